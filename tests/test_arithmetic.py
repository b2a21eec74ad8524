"""The arithmetic of a Linear's GEMMs (`_src/arithmetic.py`), against the same numbers computed
by hand in fp64: a router Linear 1024 -> 64 over 8,192 tokens, top-8 experts."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from torch import nn

import precision_annot as pa
from precision_annot._src.arithmetic import Arithmetic, linear, mm, pieces

bf16, fp32, fp64 = torch.bfloat16, torch.float32, torch.float64
TOKENS, HIDDEN, EXPERTS, TOP = 8192, 1024, 64, 8


@pytest.fixture(scope="module")
def router() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(bf16)
    w = (torch.randn(EXPERTS, HIDDEN, generator=gen) / HIDDEN ** 0.5).to(bf16)
    g = torch.randn(TOKENS, EXPERTS, generator=gen)  # an fp32 output gradient
    return x, w, g


def _changes(out: torch.Tensor, exact: torch.Tensor) -> float:
    """The share of tokens whose top-8 expert set differs from the exact result's."""
    top = out.double().topk(TOP, -1).indices.sort(-1).values
    ref = exact.topk(TOP, -1).indices.sort(-1).values
    return float((top != ref).any(-1).double().mean())


def _error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact).norm() / exact.norm())


def test_bf16_operands_with_an_fp32_output_change_no_top8_set(
        router: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """The GEMM's fp32 output, never rounded to bf16: no token's top-8 set moves against the
    exact (fp64) product of the same bf16 operands; rounded to bf16 (0.5's output=fp32), 2%."""
    x, w, _ = router
    exact = x.double() @ w.double().t()
    wide = linear(x, w, None, Arithmetic(bf16, fp32))
    assert wide.dtype == fp32
    assert _changes(wide, exact) == 0.0
    assert 0.01 < _changes((x @ w.t()).float(), exact) < 0.05  # the bf16 GEMM's rounding
    # on a CPU the operands are widened: their products are exact, the sums fp32's own
    assert torch.equal(wide, x.float() @ w.float().t())


@pytest.mark.parametrize(("backward", "bound"), [
    ("round", 3e-3), ("split2", 1e-5), ("split3", 2e-7), ("wide", 5e-7)])
def test_the_backward_of_a_wide_output(router: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                                       backward: str, bound: float) -> None:
    """The fp32 output gradient rounded to bf16 (0.5's backward), split into 2 or 3 bf16
    pieces, or kept fp32: input and weight gradients against fp64, and, for the split, the
    pieces' GEMMs summed by hand."""
    x, w, g = router
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    linear(xr, wr, None, Arithmetic(bf16, fp32, backward)).backward(g)  # type: ignore[arg-type]
    exact_x, exact_w = g.double() @ w.double(), g.double().t() @ x.double()
    assert xr.grad is not None and wr.grad is not None
    assert xr.grad.dtype == bf16 and wr.grad.dtype == bf16
    # rounded once to bf16, the gradients carry bf16's own error: compared before that rounding
    by_hand_x = {"round": (g.to(bf16).float() @ w.float()).to(bf16),
                 "wide": g @ w.float()}.get(backward)
    if backward.startswith("split"):
        count = int(backward[-1])
        by_hand_x = sum((p.float() @ w.float() for p in reversed(pieces(g, count))),
                        torch.zeros(TOKENS, HIDDEN))
    assert by_hand_x is not None
    assert _error(by_hand_x, exact_x) < bound
    assert torch.equal(xr.grad, by_hand_x.to(bf16))
    assert _error(wr.grad.float(), exact_w) < max(bound, 4e-3)  # rounded to its bf16 weight


def test_the_backward_keeps_fp32_gradients_for_fp32_parameters(
        router: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """bf16-mixed: fp32 parameters computed in bf16; a 2-piece backward hands back fp32
    gradients within 1e-5 of the exact ones (a bf16 GEMM's rounded gradient: 1.7e-3)."""
    x, w, g = router
    xr, wr = x.float().requires_grad_(True), w.float().requires_grad_(True)
    bias = torch.zeros(EXPERTS, requires_grad=True)
    out = linear(xr, wr, bias, Arithmetic(bf16, fp32, "split2"))
    out.backward(g)
    assert out.dtype == fp32
    assert xr.grad is not None and wr.grad is not None and bias.grad is not None
    assert (xr.grad.dtype, wr.grad.dtype, bias.grad.dtype) == (fp32, fp32, fp32)
    assert _error(xr.grad, g.double() @ w.double()) < 1e-5
    assert _error(wr.grad, g.double().t() @ x.double()) < 1e-5
    assert torch.equal(bias.grad, g.sum(0))


@pytest.mark.parametrize("emulation", ["bf16x9", "bf16x3"])
def test_emulated_fp32_gemms(emulation: str) -> None:
    """fp32 operands multiplied as their bf16 pieces: bf16x9 is as close to the exact product
    as an fp32 GEMM is (within 2x), bf16x3 within 1e-5; a bf16 GEMM misses by 2e-3."""
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(256, 512, generator=gen), torch.randn(512, 128, generator=gen)
    exact = a.double() @ b.double()
    fp32_error = _error(a @ b, exact)
    got = mm(a, b, emulation)  # type: ignore[arg-type]
    assert got.dtype == fp32
    if emulation == "bf16x9":
        assert _error(got, exact) < 2 * fp32_error
    else:
        assert _error(got, exact) < 1e-5
    assert _error((a.to(bf16) @ b.to(bf16)).float(), exact) > 1e-3
    # the pieces hold fp32 exactly (3 of 8 bits each, and bf16's exponent)
    assert torch.equal(sum(p.float() for p in pieces(a, 3)), a)


def test_emulated_fp32_in_both_passes() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 16, 32, generator=gen, requires_grad=True)
    w = torch.randn(8, 32, generator=gen, requires_grad=True)
    out = linear(x, w, None, Arithmetic(fp32, fp32, emulation="bf16x9"))
    assert out.shape == (4, 16, 8)
    g = torch.randn(4, 16, 8, generator=gen)
    out.backward(g)
    assert x.grad is not None and w.grad is not None
    gx = g.reshape(-1, 8).double() @ w.double()
    gw = g.reshape(-1, 8).double().t() @ x.reshape(-1, 32).double()
    assert _error(x.grad.reshape(-1, 32), gx) < 1e-6 and _error(w.grad, gw) < 1e-6


def test_autocast_around_does_not_round_the_operands_twice() -> None:
    """Under an outer bf16 autocast the operands are rounded as the arithmetic says, once."""
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(8, 16, generator=gen), torch.randn(4, 16, generator=gen)
    with torch.autocast("cpu", dtype=bf16):
        out = linear(x, w, None, Arithmetic(bf16, fp32))
    assert out.dtype == fp32
    assert torch.equal(out, x.to(bf16).float() @ w.to(bf16).float().t())


# -- through the plan: output wider than compute, backward, emulated fp32 ----------------------

class _Seen(nn.Module):
    """Records the dtype its forward is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.dtypes.append(x.dtype)
        return x


def _router_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 16), _Seen())


def test_output_fp32_over_bf16_compute_hands_back_the_gemms_unrounded_fp32() -> None:
    """The router's plan `bf16-mixed,output=fp32`: bf16 operands, the fp32 GEMM output never
    rounded to bf16 (0.5 rounded it, then widened it); the model around it stays bf16."""
    model, ref = _router_model(), _router_model()
    pa.annotate(model, {"2": "bf16-mixed,output=fp32"})
    pa.apply(model, default="bf16-mixed")
    x = torch.randn(32, 64)
    out = model(x)
    h = torch.nn.functional.gelu(torch.nn.functional.linear(
        x.to(bf16), ref[0].weight.to(bf16), ref[0].bias.to(bf16)))
    want = h.float() @ ref[2].weight.to(bf16).float().t() + ref[2].bias.to(bf16).float()
    assert model[3].dtypes == [fp32]
    assert torch.equal(out, want)
    rounded = torch.nn.functional.linear(h, ref[2].weight.to(bf16), ref[2].bias.to(bf16))
    assert not torch.equal(out, rounded.float())  # what output=fp32 computed before


@pytest.mark.parametrize("backward", ["round", "split2", "split3", "wide"])
def test_the_backward_field_reaches_the_gemms_of_the_backward(backward: str) -> None:
    """`backward=` in the plan's string form: the input gradient handed to the layer below is
    what the arithmetic computes by hand (`linear` with the same Arithmetic)."""
    model, ref = _router_model(), _router_model()
    spec = f"bf16-mixed,output=fp32,backward={backward}"
    pa.annotate(model, {"2": spec})
    pa.apply(model, default="bf16-mixed")
    assert str(pa.applied_plan(model)["2"].policy).endswith(f"backward={backward}")
    x = torch.randn(32, 64)
    g = torch.randn(32, 16)
    model(x).backward(g)
    h = torch.nn.functional.gelu(torch.nn.functional.linear(
        x.to(bf16), ref[0].weight.to(bf16), ref[0].bias.to(bf16))).detach().requires_grad_()
    w = ref[2].weight.detach().requires_grad_()
    b = ref[2].bias.detach().requires_grad_()
    linear(h, w, b, Arithmetic(bf16, fp32, backward)).backward(g)  # type: ignore[arg-type]
    assert model[2].weight.grad is not None and w.grad is not None
    assert torch.equal(model[2].weight.grad, w.grad)
    assert model[2].weight.grad.dtype == fp32


def test_backward_without_a_wide_output_and_bad_values_are_refused() -> None:
    with pytest.raises(ValueError, match="backward must be one of 'round', 'split2'"):
        pa.Policy.parse("bf16,backward=split4")
    with pytest.raises(ValueError, match="bf16x9 emulates fp32 GEMMs"):
        pa.Policy.parse("compute=bf16x9/bf16")
    assert pa.Policy.parse("bf16x9") == pa.Policy(compute="bf16x9", storage=fp32, comm=fp32)
    assert pa.Policy.parse(str(pa.Policy.parse("bf16x3,output=fp32"))).emulation == "bf16x3"


@pytest.mark.parametrize("emulation", ["bf16x9", "bf16x3"])
def test_emulated_fp32_islands_compute_as_their_pieces(emulation: str) -> None:
    """`compute=bf16x9` on a Linear: fp32 compute, its GEMMs the bf16 pieces' (`mm`); inside
    a bf16 model, inherited by the Linears of a block."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 8)))
    ref = [(m.weight.detach().clone(), m.bias.detach().clone()) for m in
           (model[0], model[1][0], model[1][1])]
    pa.annotate(model, {"1": emulation})
    pa.apply(model, default="bf16-mixed")
    x = torch.randn(8, 32)
    out = model(x)
    h = torch.nn.functional.linear(x.to(bf16), ref[0][0].to(bf16), ref[0][1].to(bf16)).float()
    for w, b in ref[1:]:
        h = mm(h, w.t().contiguous(), emulation) + b  # type: ignore[arg-type]
    assert out.dtype == bf16  # handed back in the caller's compute
    assert torch.equal(out, h.to(bf16))


def _eager_and_compiled(model: nn.Module, x: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, dict[str, tuple[Any, Any]]]:
    eager = model(x)
    eager.float().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model)(x)
    compiled.float().sum().backward()
    return eager, compiled, {n: (grads[n], p.grad) for n, p in model.named_parameters()}


@pytest.mark.slow  # over make test's budget (7 s of inductor): run by make test-all; the
# router's compiled test stays in make test
@pytest.mark.parametrize("spec", ["bf16-mixed,output=fp32,backward=split2", "bf16x3"])
def test_compiled_arithmetic_equals_eager_bit_for_bit(spec: str) -> None:
    """Under torch.compile the operands and pieces are still rounded (Inductor keeps a narrow
    intermediate of a fused kernel wide): outputs and gradients equal eager's. (Inductor also
    drops a boundary's cast to bf16 that the next op widens again, a bf16 ulp off eager with
    or without these arithmetics: the layer here gets a bf16 input and is the last one.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 16))
    pa.annotate(model, {"1": spec})
    pa.apply(model, default="bf16-mixed")
    eager, compiled, grads = _eager_and_compiled(model, torch.randn(16, 64).to(bf16))
    assert torch.equal(eager, compiled)
    assert all(torch.equal(a, b) for name, (a, b) in grads.items() if name.startswith("1."))


def test_remove_deepcopy_and_pickle_keep_the_arithmetic_with_the_plan() -> None:
    model = _router_model()
    forward = model[2].forward
    pa.annotate(model, {"2": "bf16-mixed,output=fp32,backward=split3"})
    pa.apply(model, default="bf16-mixed")
    x = torch.randn(4, 64)
    out = model(x)
    for copy_ in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert torch.equal(copy_(x), out)
    pa.remove(model)
    assert "forward" not in model[2].__dict__ and model[2].forward == forward
    assert model(x).dtype == fp32 and model[2].weight.dtype == fp32


def test_a_linear_subclass_with_its_own_forward_gets_the_wide_output_of_its_gemm() -> None:
    """A subclass of nn.Linear with a forward of its own: the GEMM its forward runs on its own
    weight hands back fp32; the rest of its forward computes as its code says."""

    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    model = nn.Sequential(Scaled(8, 4))
    pa.annotate(model, {"0": "bf16-mixed,output=fp32"})
    pa.apply(model)
    x = torch.randn(2, 8)
    want = (x.to(bf16).float() @ model[0].weight.to(bf16).float().t()
            + model[0].bias.to(bf16).float()) * 2
    out = model(x)
    assert out.dtype == fp32 and torch.equal(out, want)


def test_audit_records_the_arithmetic_each_linear_ran() -> None:
    """`audit` says how each Linear's GEMMs ran, without a divergence where that is the plan;
    one whose forward lost its arithmetic (replaced after apply) diverges."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    pa.annotate(model, {"2": "bf16-mixed,output=fp32,backward=split2", "0": "bf16x9"})
    pa.apply(model, default="bf16-mixed")
    with pa.audit(model) as report:
        model(torch.randn(4, 16)).sum().backward()
    assert report.divergences == []
    assert report["2"].arithmetic == {"bf16 operands, fp32 output, backward split2"}
    assert report["0"].arithmetic == {"fp32 emulated as bf16x9, both passes"}
    assert report["1"].arithmetic == set()
    assert "bf16 operands, fp32 output, backward split2" in str(report)
    boundary = model[2].forward
    boundary.inner = None  # type: ignore[attr-defined]  # as a wrapper calling the class's
    with pa.audit(model) as report:
        model(torch.randn(4, 16))
    assert [(d.module, d.field) for d in report.divergences] == [("2", "arithmetic")]


class _WeightRouter(nn.Module):
    """A router holding its weight and calling F.linear, as transformers' MoE routers do."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 32) / 32 ** 0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch.nn.functional.linear(x, self.weight)
        return logits, torch.softmax(logits.float(), -1).topk(2, -1).indices


def test_a_router_holding_its_weight_gets_the_wide_output_of_its_own_gemm() -> None:
    """transformers' routers (Mixtral's, Qwen's, DeepSeek's) are no nn.Linear: they run
    F.linear on a weight of their own. That GEMM hands back fp32 too (it silently stayed bf16);
    a GEMM of the same forward by another tensor keeps the compute dtype's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=8,
        num_experts_per_tok=2)
    model = transformers.MixtralForCausalLM(config)
    pa.annotate(model, {"*.gate": "bf16-mixed,output=fp32,backward=split2"})
    pa.apply(model, default="bf16-mixed")
    gate = model.model.layers[0].mlp.gate
    assert not isinstance(gate, nn.Linear)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    gate.register_forward_hook(lambda m, args, out: seen.append((args[0], out[0])) and None)
    with pa.audit(model) as report:
        model(input_ids=torch.randint(0, 64, (1, 16))).logits.float().sum().backward()
    x, logits = seen[0]
    want = x.reshape(-1, 32).to(bf16).float() @ gate.weight.to(bf16).float().t()
    assert logits.dtype == fp32 and torch.equal(logits, want)
    assert report["model.layers.0.mlp.gate"].arithmetic == {
        "bf16 operands, fp32 output, backward split2"}
    assert report.divergences == []
    assert gate.weight.grad is not None and gate.weight.grad.dtype == fp32
    pa.remove(model)
    assert "forward" not in gate.__dict__


def test_a_router_holding_its_weight_compiles_bit_for_bit() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), _WeightRouter())
    pa.annotate(model, {"1": "bf16-mixed,output=fp32"})
    pa.apply(model, default="bf16-mixed")
    x = torch.randn(16, 32).to(bf16)
    eager = model(x)
    compiled = torch.compile(model)(x)
    assert eager[0].dtype == fp32
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])
    h = torch.nn.functional.linear(x, model[0].weight.to(bf16), model[0].bias.to(bf16))
    want = h.float() @ model[1].weight.to(bf16).float().t()
    assert torch.equal(eager[0], want)
