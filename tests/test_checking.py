"""`check`: its arguments, its order, and that it asks each adapter (the adapters' findings
are tested beside each adapter)."""

from __future__ import annotations

import pytest
from torch import nn

from precision_annot import PrecisionPlan, check, fp32, precision, resolve


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 8), precision(fp32)(nn.LayerNorm(8)), nn.Linear(8, 8))


def test_bad_arguments_name_the_argument_and_the_valid_values() -> None:
    with pytest.raises(ValueError, match=r"backend must be None or one of \['local', "
                                         r"'deepspeed', 'fsdp', 'fsdp1', 'ddp', 'lightning', "
                                         r"'tp', 'checkpoint'\]. Received: backend='horovod'"):
        check(model(), "horovod")
    with pytest.raises(ValueError, match=r"backend='local' has unknown key 'stage'; valid: "
                                         r"\['grad_scaler', 'optimizer', 'fp8'\]"):
        check(model(), "local", {"stage": 2})
    with pytest.raises(ValueError, match=r"unknown key 'bucket_cap'; valid: \['bucket_cap_mb', "
                                         r"'grad_scaler', 'optimizer', 'fp8'\]"):
        check(model(), "ddp", {"bucket_cap": 25})
    with pytest.raises(ValueError, match=r"config 'fp8' says who converts the fp8 layers, one of "
                                         r"\['apply', 'accelerate'\]. Received: fp8='torchao'"):
        check(model(), "ddp", {"fp8": "torchao"})
    with pytest.raises(TypeError, match=r"config for backend='fsdp' is a dict"):
        check(model(), "fsdp", 0.01)
    with pytest.raises(TypeError, match=r"model_or_plan must be an nn.Module or a PrecisionPlan"):
        check("model.pt")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="merge_below is a share of the parameters"):
        check(model(), "fsdp", {"merge_below": 5})


def test_findings_come_errors_first() -> None:
    """An fp32 Linear island in an fp16 model, for DeepSpeed (ZeRO-0) with torch_autocast
    turned off: the config is an error, mixed storage and comm at ZeRO-0 warnings, and the
    island's output and the per-parameter comm infos."""
    islands = nn.Sequential(nn.Linear(8, 8), precision(fp32)(nn.Linear(8, 8)), nn.Linear(8, 8))
    found = check(resolve(islands, "16-true"), "deepspeed", {"torch_autocast": {"enabled": False}})
    assert [(f.severity, f.code) for f in found] == [
        ("error", "deepspeed-config"), ("warning", "deepspeed-mixed-storage"),
        ("warning", "deepspeed-zero0-comm"), ("info", "island-output-narrowed"),
        ("info", "deepspeed-needs-prepare")]


def test_a_loaded_plan_checks_like_the_model() -> None:
    plan = resolve(model(), "bf16-true")
    loaded = PrecisionPlan.from_json(plan.to_json())
    for backend in (None, "deepspeed", "fsdp", "ddp"):
        assert check(loaded, backend) == check(plan, backend)


def test_backend_none_holds_for_every_backend() -> None:
    """What `backend=None` reports, every backend reports, unless that backend handles it
    itself (Lightning's plugin and DeepSpeed scale the loss; DeepSpeed keeps master weights)."""
    for preset in ("16-mixed", "bf16-true", "16-true"):
        plan = resolve(model(), preset)
        common = {f.code for f in check(plan)}
        for backend in ("local", "fsdp", "fsdp1", "ddp"):
            assert common <= {f.code for f in check(plan, backend)}


def test_a_model_is_checked_against_the_plan_applied_to_it() -> None:
    from precision_annot import apply

    m = model()
    assert check(m) == []  # its annotations alone: an fp32 island in an fp32 model
    plan = resolve(m, "bf16-true")
    apply(m, plan)
    assert [f.code for f in check(m)] == ["low-storage"] == [f.code for f in check(plan)]
