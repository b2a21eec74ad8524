"""The numerics findings: each is produced by a plan that has the problem, absent from one that
does not, and what it claims about the numbers is checked against torch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from precision_annot import (
    Finding,
    Policy,
    annotate,
    apply,
    bf16,
    check,
    fp16,
    fp32,
    precision,
    precision_scope,
    resolve,
)
from precision_annot._src.findings import numerics, outermost
from tests.helpers import Recorder


def codes(findings: list[Finding]) -> list[str]:
    return [f.code for f in findings]


def by_code(findings: list[Finding], code: str) -> list[Finding]:
    return [f for f in findings if f.code == code]


def island_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 8), precision(fp32)(nn.LayerNorm(8)), nn.Linear(8, 8))


def test_finding_prints_as_one_line_with_its_fix_and_code() -> None:
    f = Finding("warning", "low-storage", "", "Something rounds away.", "Store it in fp32.")
    assert str(f) == ("warning: (model): Something rounds away. Fix: Store it in fp32. "
                      "[low-storage]")
    assert f.to_dict() == {"severity": "warning", "code": "low-storage", "module": "",
                           "message": "Something rounds away.", "fix": "Store it in fp32.",
                           "modules": []}
    assert Finding("error", "x", "a.b", "m", "f").modules == ("a.b",)


def test_a_clean_plan_has_no_numerics_finding() -> None:
    for backend in (None, "local", "deepspeed", "fsdp", "fsdp1", "ddp", "lightning"):
        assert numerics(resolve(island_model(), "bf16-mixed"), backend) == []


def test_fp16_without_loss_scaling_where_the_path_does_not_scale() -> None:
    plan = resolve(island_model(), "16-mixed")
    (found,) = by_code(numerics(plan, None), "fp16-loss-scaling")
    assert found.severity == "warning" and "fp16 in 3 modules" in found.message
    assert "precision_annot.GradScaler" in found.fix
    (fsdp,) = by_code(numerics(plan, "fsdp"), "fp16-loss-scaling")
    assert "ShardedGradScaler" in fsdp.fix
    for scales_itself in ("lightning", "deepspeed"):  # the plugin / the engine scale the loss
        assert by_code(numerics(plan, scales_itself), "fp16-loss-scaling") == []
    assert by_code(numerics(resolve(island_model(), "bf16-mixed")), "fp16-loss-scaling") == []
    # the claim: below 6e-5 (subnormal) precision is lost, below 3e-8 the gradient is zero
    assert torch.tensor(2.9e-8).half().item() == 0.0 and torch.tensor(1e-7).half().item() > 0
    assert torch.finfo(fp16).tiny == 2.0 ** -14  # 6.1e-5


@pytest.mark.parametrize(("preset", "bits"), [("bf16-true", 8), ("16-true", 11)])
def test_low_storage_without_master_weights(preset: str, bits: int) -> None:
    plan = resolve(island_model(), preset)
    (found,) = by_code(numerics(plan), "low-storage")
    assert found.module == ""  # one finding for the whole model, not one per module
    assert f"about 2^-{bits} of a weight" in found.message
    assert "160 parameters" in found.message
    assert ("Adam's eps" in found.message) == (preset == "16-true")
    assert by_code(numerics(plan, "deepspeed"), "low-storage") == []  # fp32 master weights
    assert by_code(numerics(resolve(island_model(), "bf16-mixed")), "low-storage") == []
    # the claim, on a real SGD step: an update of 2^-(bits+1) of a weight rounds away
    dtype = {8: bf16, 11: fp16}[bits]
    w = nn.Parameter(torch.ones(4, dtype=dtype))
    w.grad = torch.full_like(w, 2.0 ** -(bits + 1))
    torch.optim.SGD([w], lr=1.0).step()
    assert torch.equal(w.detach(), torch.ones(4, dtype=dtype))
    w.grad = torch.full_like(w, 2.0 ** -(bits - 1))
    torch.optim.SGD([w], lr=1.0).step()
    assert (w.detach() < 1).all()
    assert torch.tensor(1e-8, dtype=fp16).item() == 0.0  # Adam's eps


@pytest.mark.parametrize("norm", [nn.LayerNorm, nn.RMSNorm])
@pytest.mark.parametrize("low", ["bf16-true", "16-true"])
def test_a_layer_norm_in_a_low_dtype_is_not_reported(norm: type[nn.Module], low: str) -> None:
    """Issue 18: flagged by class name, it cried wolf (a model class named NormNet was told
    to become fp32). Measured: run in bf16 or fp16, a LayerNorm or RMSNorm gives what an fp32
    island handing back the same dtype gives, to one unit in the last place of that dtype."""
    class NormNet(nn.Sequential):
        pass

    torch.manual_seed(0)
    low_net = NormNet(nn.Linear(64, 64), norm(64))
    with torch.no_grad():
        low_net[1].weight.copy_(1 + torch.randn(64) * 0.1)  # type: ignore[operator]
    island = NormNet(nn.Linear(64, 64), precision(fp32)(norm(64)))
    island.load_state_dict(low_net.state_dict())
    plan = resolve(low_net, low)
    assert "low-sensitive-op" not in codes(numerics(plan))
    assert "low-storage" in codes(numerics(plan))  # what it does say: the weights' storage
    apply(low_net, plan)
    apply(island, default=low)
    x = torch.randn(32, 64) * 3
    got, want = low_net(x).detach().float(), island(x).detach().float()
    ulp = torch.finfo(plan.root.policy.compute).eps * want.abs().clamp_min(1.0)  # type: ignore[arg-type]
    assert ((got - want).abs() <= ulp).all()


def test_batch_norm_statistics_kept_low_are_measured() -> None:
    """Only BatchNorm's running statistics degrade, measured: bf16 drifts past 1%, fp16 not."""
    from precision_annot._src.findings import RUNNING_STATS_TOLERANCE, running_stats_error

    assert running_stats_error(32, bf16) > RUNNING_STATS_TOLERANCE > running_stats_error(32, fp16)
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32))
    (found,) = by_code(numerics(resolve(model, "bf16-true")), "low-running-stats")
    assert found.severity == "warning" and found.module == "1" and "drifts 1." in found.message
    assert by_code(numerics(resolve(model, "16-true")), "low-running-stats") == []
    assert by_code(numerics(resolve(model, "bf16-mixed")), "low-running-stats") == []
    # a BatchNorm that keeps no running statistics has none to drift (0.3 said it did)
    untracked = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32, track_running_stats=False))
    assert by_code(numerics(resolve(untracked, "bf16-true")), "low-running-stats") == []


def test_comm_narrower_than_storage_is_one_finding_per_dtype_pair() -> None:
    plan = resolve(island_model(), Policy(compute=bf16, storage=fp32, comm=bf16))
    (found,) = by_code(numerics(plan), "narrow-comm")
    assert found.severity == "info" and found.module == "" and found.modules == ("0", "2")
    assert "The plan asks for summing the gradients of 144 parameters in 2 modules ('0' and " \
        "'2')" in found.message
    assert "8 significant bits" in found.message
    assert "1.5 at 8 ranks, 3 at 64 ranks, 4.5 at 512 ranks" in found.message
    assert "2x less traffic" in found.fix
    assert by_code(numerics(resolve(island_model(), "bf16-mixed")), "narrow-comm") == []


def test_an_island_whose_output_is_narrowed_back_to_fp16() -> None:
    class Big(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 1e5

    def model(output: torch.dtype | None = None) -> nn.Sequential:
        island = precision(compute=fp32, storage=fp32, output=output)(Big())
        return nn.Sequential(nn.Linear(4, 4), island, nn.Linear(4, 4))

    plan = resolve(model(), "16-true")
    (found,) = by_code(numerics(plan), "island-output-narrowed")
    assert found.module == "1" and found.severity == "info" and "suggest(" in found.fix
    # the claim: the island's own result is finite, the fp16 value handed on is not
    ran = apply(model(), plan)
    assert torch.isinf(ran[1](torch.ones(2, 4))).all()
    widened = model(output=fp32)
    assert by_code(numerics(resolve(widened, "16-true")), "island-output-narrowed") == []
    apply(widened, resolve(widened, "16-true"))
    assert torch.isfinite(widened[1](torch.ones(2, 4))).all()
    # several islands: one finding naming them
    two = nn.Sequential(precision(fp32)(Big()), nn.Linear(4, 4), precision(fp32)(Big()))
    (both,) = by_code(numerics(resolve(two, "16-true")), "island-output-narrowed")
    assert both.module == "" and both.message.startswith("2 islands wider than fp16 hand their "
                                                         "outputs back in fp16 (0, 2)")
    # bf16 has the range; a norm's output is bounded
    assert by_code(numerics(resolve(model(), "bf16-true")), "island-output-narrowed") == []
    assert by_code(numerics(resolve(island_model(), "16-true")), "island-output-narrowed") == []


def test_an_annotation_a_construction_scope_shadows() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            with precision_scope(compute=bf16):
                self.fc = Recorder(nn.Linear(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.fc(x)
            return out

    model = nn.Sequential(Block(), nn.Linear(4, 4))
    annotate(model, {"0": "fp32"})
    (found,) = by_code(numerics(resolve(model)), "annotation-shadowed")
    assert found.module == "0" and "compute annotation does not reach" in found.message
    apply(model, resolve(model))
    model(torch.randn(2, 4))
    assert model[0].fc.seen == [bf16]  # what the finding says: the child kept its scope tag
    annotate(model, {"0.*": "fp32"})  # its fix
    assert by_code(numerics(resolve(model)), "annotation-shadowed") == []
    plain = nn.Sequential(precision(fp32)(nn.Sequential(nn.Linear(4, 4))))
    assert by_code(numerics(resolve(plain)), "annotation-shadowed") == []


def test_outermost_keeps_one_name_per_subtree() -> None:
    plan = resolve(nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2)))
    assert outermost(plan, ["0", "0.0", "1"]) == ["0", "1"]
    assert outermost(plan, ["", "0.0"]) == [""]


def test_check_on_a_model_resolves_its_annotations() -> None:
    model = island_model()
    with precision_scope("bf16-true"):
        model.append(nn.Linear(8, 8))
    assert codes(check(model)) == ["low-storage"]
    assert by_code(check(model), "low-storage")[0].module == "3"
