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
from precision_annot.findings import numerics, outermost
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
                           "message": "Something rounds away.", "fix": "Store it in fp32."}


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


def test_a_norm_run_in_bf16_with_autocast_off() -> None:
    model = nn.Sequential(nn.Linear(8, 8), Recorder(nn.LayerNorm(8)))
    plan = resolve(model, "bf16-true")
    (found,) = by_code(numerics(plan), "low-sensitive-op")
    assert found.module == "1.inner" and "normalization (LayerNorm) runs in bf16" in found.message
    apply(model, plan)
    model(torch.randn(2, 8))
    assert model[1].seen == [bf16]  # what the finding says runs
    # under bf16-mixed autocast keeps layer_norm in fp32; as an island it runs in fp32
    assert by_code(numerics(resolve(model, "bf16-mixed")), "low-sensitive-op") == []
    annotate(model, {nn.LayerNorm: "fp32"})
    assert by_code(numerics(resolve(model, "bf16-true")), "low-sensitive-op") == []


def test_softmax_and_loss_modules_are_sensitive_too() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Softmax(-1), nn.CrossEntropyLoss())
    found = by_code(numerics(resolve(model, "16-true")), "low-sensitive-op")
    assert [(f.module, f.message.split(" (")[0]) for f in found] == [
        ("1", "This softmax"), ("2", "This loss")]


def test_comm_narrower_than_storage_is_one_finding_per_dtype_pair() -> None:
    plan = resolve(island_model(), Policy(compute=bf16, storage=fp32, comm=bf16))
    (found,) = by_code(numerics(plan), "narrow-comm")
    assert found.severity == "info" and found.module == ""
    assert "Gradients of 144 parameters in 2 modules" in found.message
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
