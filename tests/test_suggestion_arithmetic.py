"""`suggest` tries a cheaper arithmetic before it keeps a Linear as an fp32 island: the low
dtype's GEMMs with an fp32 output, then with a 2-piece backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import precision_annot as pa
from precision_annot._src.suggest.arith import candidates

fp16, fp32 = torch.float16, torch.float32


class Router(nn.Module):
    """A router whose logits ride on a large offset (60,000, near fp16's largest value) that
    its caller takes off: fp16 output would crowd fp16's range; fp16 operands are enough."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 32)
        self.gate = nn.Linear(32, 16)
        with torch.no_grad():
            self.gate.bias.fill_(60000.0)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gate(torch.relu(self.inp(x)))
        return self.out(y.float() - 60000.0)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def test_a_router_gets_an_fp32_output_of_fp16_gemms_instead_of_an_fp32_island() -> None:
    torch.manual_seed(0)
    model = Router()
    x = torch.randn(64, 32)
    held = [torch.randn(64, 32) for _ in range(2)]
    found = pa.suggest(model, x, low="16-mixed", held_out=held, loss_fn=_loss)
    assert found.met
    assert found.islands == []
    assert found.arithmetic == {"gate": "compute=fp16,storage=fp32,comm=fp32,output=fp32,"
                                        "backward=round"}
    assert ("gate", found.arithmetic["gate"]) in found.rules
    assert "gate (backward=round)" in str(found)
    policy = found.plan["gate"].policy
    assert policy.wide_output and policy.compute == fp16
    # the plan runs as said: fp16 operands, the fp32 product handed back unrounded
    seen: list[torch.Tensor] = []
    pa.apply(model, found.plan)
    model.gate.register_forward_hook(lambda m, a, out: seen.append(out))
    model(x)
    h = torch.relu(torch.nn.functional.linear(
        x.to(fp16), model.inp.weight.to(fp16), model.inp.bias.to(fp16)))
    want = (h.float() @ model.gate.weight.to(fp16).float().t()
            + model.gate.bias.to(fp16).float())
    assert seen[0].dtype == fp32 and torch.equal(seen[0], want)


@pytest.mark.parametrize("low", ["bf16-mixed", "16-mixed"])
def test_the_candidates_keep_the_low_policy_and_add_an_fp32_output(low: str) -> None:
    first, second = candidates(pa.Policy.parse(low))
    assert first == pa.Policy.parse(f"{low},output=fp32,backward=round")
    assert second.backward == "split2" and second.output == fp32


def test_check_points_an_fp32_router_island_at_the_cheaper_arithmetic() -> None:
    """An fp32 Linear island handing back fp32 in bf16 code: an info finding naming it; the
    same router with output=fp32 over bf16 compute gets none, and hands back fp32 too."""
    model = Router()
    pa.annotate(model, {"gate": "fp32,output=fp32"})
    found = [f for f in pa.check(pa.resolve(model, default="bf16-mixed"))
             if f.code == "island-wide-output"]
    assert [f.modules for f in found] == [("gate",)] and found[0].severity == "info"
    assert "'bf16-mixed,output=fp32'" in found[0].fix
    cheaper = Router()
    pa.annotate(cheaper, {"gate": "bf16-mixed,output=fp32"})
    assert not [f for f in pa.check(pa.resolve(cheaper, default="bf16-mixed"))
                if f.code == "island-wide-output"]
    outs: list[torch.Tensor] = []
    pa.apply(cheaper, default="bf16-mixed")
    cheaper.gate.register_forward_hook(lambda m, a, out: outs.append(out))
    cheaper(torch.randn(4, 32))
    assert outs[0].dtype == fp32
