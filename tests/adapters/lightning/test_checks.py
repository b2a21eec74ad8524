"""check(..., "lightning", trainer_kwargs): each finding from the Trainer's arguments, absent
when they are right, and each refusal it predicts confirmed on the real Trainer."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from precision_annot import Finding, check, resolve
from precision_annot.adapters.lightning import AnnotatedFSDPPrecision, AnnotatedPrecision
from tests.adapters.lightning.models import QUIET, Net, data
from tests.workers.models import POLICY


def found(config: dict[str, Any], default: Any = POLICY) -> dict[str, Finding]:
    out = check(resolve(Net(), default=default), "lightning", config)
    return {f.code: f for f in out if f.code.startswith(("lightning-", "ddp-", "deepspeed-"))}


class CPUFSDPStrategy(FSDPStrategy):  # type: ignore[misc]
    """A subclass: Lightning's CPU refusal by name is for the registered names, its plugin
    check for all; its _setup_model still passes FSDP1 device_id=None, which FSDP refuses on
    CPU (tests/adapters/test_check_matrix.py runs it)."""


class DeviceFSDPStrategy(CPUFSDPStrategy):
    """A subclass that gives FSDP1 a CPU device, as tests/workers/lightning.py's does."""

    def _setup_model(self, model: Any) -> Any:
        raise NotImplementedError  # only its presence is read here


def trainer(**kwargs: Any) -> L.Trainer:
    return L.Trainer(**{**QUIET, "enable_checkpointing": False, **kwargs})


def test_no_plugin_means_the_plan_is_not_applied() -> None:
    (f,) = found({"precision": "bf16-mixed"}).values()
    assert (f.severity, f.code) == ("error", "lightning-no-plugin")  # the fp32 island in bf16
    assert "Lightning runs precision='bf16-mixed' for the whole model" in f.message
    assert f.modules == ("norm",) and "planned fp32, bf16 instead" in f.message
    assert "AnnotatedPrecision(default='bf16-mixed')" in f.fix
    (widened,) = found({"precision": "32-true"}).values()  # the bf16 layers run fp32
    assert (widened.severity, widened.code) == ("warning", "lightning-no-plugin")
    assert found({"plugins": [AnnotatedPrecision()], "accelerator": "gpu"}) == {}


def test_precision_and_the_plugin_together() -> None:
    config = {"precision": "16-mixed", "plugins": [AnnotatedPrecision()], "accelerator": "gpu"}
    assert list(found(config)) == ["lightning-precision"]
    with pytest.raises(ValueError, match="Received both `precision=16-mixed`"):
        trainer(precision="16-mixed", plugins=[AnnotatedPrecision()])


def test_a_plugin_set_on_the_strategy_counts_for_trainer_and_fabric_strategies() -> None:
    """The plugin a strategy instance carries (the Trainer's `precision_plugin=`, Fabric's
    `precision=`) is read through those public properties: a Fabric strategy's plugin was never
    seen before (it was read from the Trainer strategy's private attribute only)."""
    from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy

    from precision_annot.adapters.lightning import FabricAnnotatedPrecision

    for bare in (DDPStrategy(), FabricDDPStrategy()):  # Lightning's default plugin is not ours
        assert "lightning-no-plugin" in found({"strategy": bare, "accelerator": "cpu"})
    for strategy in (DDPStrategy(precision_plugin=AnnotatedPrecision()),
                     FabricDDPStrategy(precision=FabricAnnotatedPrecision())):
        assert "lightning-no-plugin" not in found({"strategy": strategy, "accelerator": "cpu"})
    config = {"strategy": FabricDDPStrategy(precision=FabricAnnotatedPrecision()),
              "plugins": [FabricAnnotatedPrecision()], "accelerator": "cpu"}
    assert "lightning-precision" in found(config)
    with pytest.raises(ValueError, match="precision set through both strategy class and plugins"):
        L.Fabric(**config)


def test_fsdp_strategy_needs_the_fsdp_plugin() -> None:
    config = {"strategy": CPUFSDPStrategy(), "plugins": [AnnotatedPrecision()],
              "accelerator": "cpu"}
    assert "lightning-strategy" in found(config)
    with pytest.raises(TypeError, match="can only work with the `FSDPPrecision` plugin"):
        trainer(strategy=CPUFSDPStrategy(), plugins=[AnnotatedPrecision()])
    config["plugins"] = [AnnotatedFSDPPrecision()]
    assert "lightning-strategy" not in found(config)
    trainer(strategy=CPUFSDPStrategy(), plugins=[AnnotatedFSDPPrecision()])  # accepted


def test_cuda_only_strategies_on_cpu() -> None:
    for strategy in ("fsdp", FSDPStrategy(), "deepspeed", DeepSpeedStrategy()):
        plugin = AnnotatedFSDPPrecision() if "FSDP" in str(strategy) or strategy == "fsdp" \
            else AnnotatedPrecision()
        got = found({"strategy": strategy, "plugins": [plugin], "accelerator": "cpu"})
        assert got["lightning-cuda-only"].severity == "error", strategy
        got = found({"strategy": strategy, "plugins": [plugin], "accelerator": "gpu"})
        assert "lightning-cuda-only" not in got
    fsdp1 = found({"strategy": CPUFSDPStrategy(), "accelerator": "cpu",
                   "plugins": [AnnotatedFSDPPrecision()]})["lightning-cuda-only"]
    assert "device_id=None" in fsdp1.message and "device_id=torch.device('cpu')" in fsdp1.fix
    assert "lightning-cuda-only" not in found({"strategy": DeviceFSDPStrategy(),
                                               "accelerator": "cpu",
                                               "plugins": [AnnotatedFSDPPrecision()]})
    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        trainer(strategy="fsdp", plugins=[AnnotatedFSDPPrecision()])
    with pytest.raises(RuntimeError, match="only supported on CUDA GPUs"):
        trainer(strategy="deepspeed", plugins=[AnnotatedPrecision()], max_steps=1).fit(
            Net(), data())


def test_deepspeed_strategy_brings_the_deepspeed_findings() -> None:
    for strategy, stage in (("deepspeed_stage_3", 3), ("deepspeed", 2),
                            (DeepSpeedStrategy(stage=1), 1)):
        got = found({"strategy": strategy, "plugins": [AnnotatedPrecision()],
                     "accelerator": "gpu"}, default="16-mixed")
        assert f"zero_optimization.stage={stage}" in got["deepspeed-fp16-zero"].message
    got = found({"strategy": "deepspeed", "plugins": [AnnotatedPrecision()],
                 "accelerator": "gpu"}, default="bf16-mixed")
    assert got == {}


def test_ddp_comm_hook_given_with_a_plan_that_sets_comm() -> None:
    def config(accelerator: str, hook: Any = allreduce_hook) -> dict[str, Any]:
        return {"strategy": DDPStrategy(ddp_comm_hook=hook), "plugins": [AnnotatedPrecision()],
                "accelerator": accelerator}

    cpu = found(config("cpu"))
    # Lightning drops it on CPU, and the plan's too: the bf16 layers reduce in fp32, widened
    assert cpu["lightning-ddp-hook"].severity == "warning"
    assert cpu["lightning-ddp-hook"].modules == ("fc1", "fc2")
    # nor is the plan's hook registered, so no bucket splits by comm (the 2-process run in
    # test_trainer.py reduced everything in fp32); 0.3 said it did
    assert "ddp-mixed-bucket" not in cpu
    assert "ddp-mixed-bucket" in found(config("cpu", hook=None))  # the plugin's hook splits
    assert "ddp-needs-hook" not in cpu
    assert found(config("gpu"))["lightning-ddp-hook"].severity == "warning"  # it replaces ours
    assert "lightning-ddp-hook" not in found(config("cpu", hook=None))
    assert "lightning-ddp-hook" not in found(config("cpu"), default="32-true")


def test_a_cpu_run_gets_no_finding_for_being_on_cpu() -> None:
    """0.2 added an info with "Nothing to change" to every CPU run; an info is a cost."""
    config = {"strategy": "ddp", "plugins": [AnnotatedPrecision()], "accelerator": "cpu"}
    assert not [f for f in check(resolve(Net(), default="bf16-mixed"), "lightning", config)]


def test_a_misspelt_key_or_plugin_name_is_refused_with_the_spelling() -> None:
    """0.3 accepted {"precison": ...} silently and read "AnnotatedPrecison" as no plugin."""
    plan = resolve(Net(), default="bf16-mixed")
    with pytest.raises(ValueError, match=r"neither Trainer nor Fabric takes\. Did you mean "
                                         r"'precision'\? Received: 'precison'"):
        check(plan, "lightning", {"precison": "bf16-mixed"})
    with pytest.raises(ValueError, match=r"Did you mean 'AnnotatedPrecision'.*Received: "
                                         r"'AnnotatedPrecison'"):
        check(plan, "lightning", {"plugins": ["AnnotatedPrecison"]})
    assert check(plan, "lightning", {"loggers": [], "devices": 1, "plugins": [
        "AnnotatedPrecision"]}) == []  # Fabric's keys are Lightning's too


def test_lightning_without_the_plugin_is_one_finding_per_severity() -> None:
    """Its storage and its compute both differ from the plan for one cause: one error, naming
    both (0.3 gave two lightning-no-plugin errors)."""
    plan = resolve(Net(), default="bf16-mixed")
    got = check(plan, "lightning", {"precision": "16-true", "accelerator": "cpu"})
    assert [(f.severity, f.code) for f in got] == [("error", "lightning-no-plugin")]
    message = got[0].message
    assert "stores the parameters of" in message and "and computes" in message
    assert "held and computed with fewer bits" in message


def test_config_must_be_the_trainers_keyword_arguments() -> None:
    with pytest.raises(TypeError, match="dict of the Trainer's keyword arguments"):
        check(resolve(Net()), "lightning", ["ddp"])
    assert check(resolve(Net(), default="bf16-mixed"), "lightning") == []  # nothing to read


def test_a_precision_lightning_refuses_is_refused_by_check_too() -> None:
    with pytest.raises(ValueError, match="Precision 7 is invalid"):
        L.Trainer(precision=7, logger=False)  # type: ignore[arg-type]  # what Lightning says
    with pytest.raises(ValueError, match=r"config 'precision' is one Lightning refuses: "
                                         r"Precision 7 is invalid"):
        check(Net(), "lightning", {"precision": 7})
    assert all(f.code != "lightning-precision" for f in check(Net(), "lightning",
                                                                {"precision": "bf16-mixed"}))
