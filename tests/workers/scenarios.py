"""The scenarios `check` is judged on: each a model, a plan, a backend and what it is given.

The matrix worker (`tests.workers.matrix`) runs each for real on 2 gloo ranks (the local and
Lightning ones in one process) and records what the backend did: whether it refused, the dtype
of every gradient reduction on the wire, the dtype of every parameter it holds, the dtypes
modules computed in, whether every trainable parameter moved, whether ties held, and measured
numeric losses. tests/adapters/test_check_matrix.py asks `check` about the same scenarios and
compares. One source for both sides: the scenario builds the model, and `check` is asked with
its `check_config`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from precision_annot import Policy, PrecisionPlan, annotate, apply, bf16, fp16, fp32, resolve

MIXED = "bf16-mixed"
BF16_COMM = Policy(compute=bf16, storage=fp32, comm=bf16)  # bf16 on the wire, fp32 masters


class Net(nn.Module):
    """fc1 -> norm -> fc2: the layers every scenario annotates."""

    def __init__(self, norm: str = "layer", frozen: bool = False,
                 integer: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.norm: nn.Module = nn.LayerNorm(32) if norm == "layer" else nn.BatchNorm1d(
            32, track_running_stats=norm != "batch-untracked")
        self.fc2 = nn.Linear(32, 16)
        if frozen:
            self.fc1.weight.requires_grad_(False)
        if integer:
            self.register_parameter("steps", nn.Parameter(torch.zeros(8, dtype=torch.int64),
                                                          requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(torch.relu(self.norm(self.fc1(x))))
        return out


class Tied(nn.Module):
    """An embedding tied to an output head: the head is an fp32 island."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.relu(self.body(self.emb(x))))
        return out


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One backend run and the `check` call that should predict it.

    Attributes:
        name: a unique name.
        backend: "ddp", "fsdp", "fsdp1", "deepspeed", "lightning" or "local".
        build: () -> (model, plan): the model, annotated, and the plan it runs.
        check_config: what `check` is given for it (or a function that makes it, for what
            is built late: a Lightning strategy).
        run: how the worker runs it (hook name, FSDP options, DeepSpeed config, Trainer
            arguments), read by the worker.
        applied: the model is handed over with its plan applied (Lightning without a plugin).
        tokens: the model takes token ids.
        wrapped: `check` is asked about the model as the worker wrapped or sharded it (FSDP1's
            wrapper, the user's own `fully_shard`), not about its plan.
    """

    name: str
    backend: str
    build: Callable[[], tuple[nn.Module, PrecisionPlan]]
    check_config: Any = None
    run: dict[str, Any] = dataclasses.field(default_factory=dict)
    applied: bool = False
    tokens: bool = False
    wrapped: bool = False


def plain(default: Any, rules: dict[Any, Any] | None = None, **net: Any
          ) -> Callable[[], tuple[nn.Module, PrecisionPlan]]:
    def build() -> tuple[nn.Module, PrecisionPlan]:
        torch.manual_seed(0)
        model = Net(**net)
        annotate(model, rules if rules is not None else {"norm": "fp32"})
        return model, resolve(model, default=default)

    return build


def tied() -> tuple[nn.Module, PrecisionPlan]:
    torch.manual_seed(0)
    model = Tied()
    annotate(model, {"head": "compute=fp32"})
    return model, resolve(model, default=MIXED)


def _ds(stage: int, **more: Any) -> dict[str, Any]:
    return {"zero_optimization": {"stage": stage}, **more}


AUTOCAST = {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}


def shard(scenario: Scenario, model: nn.Module, plan: PrecisionPlan) -> nn.Module:
    """FSDP as the scenario's user shards it: the adapter, or (run["user_mp"]) FSDP2's own
    fully_shard with one MixedPrecisionPolicy over the applied plan, or FSDP1's wrapper with
    the plan's policies. Returns what is trained."""
    from precision_annot.adapters import fsdp as fsdp_adapter

    run = scenario.run
    if scenario.backend == "fsdp" and run.get("user_mp"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        apply(model, plan)
        policy = MixedPrecisionPolicy(param_dtype=bf16)
        for module in model.modules():
            if isinstance(module, nn.Linear):
                fully_shard(module, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model
    if scenario.backend == "fsdp":
        fsdp_adapter.fully_shard(model, plan, merge_below=run.get("merge_below"))
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel

    apply(model, plan)
    return FullyShardedDataParallel(
        model, auto_wrap_policy=fsdp_adapter.wrap_policy(plan,
                                                         merge_below=run.get("merge_below")),
        mixed_precision=fsdp_adapter.mixed_precision(plan, merge_below=run.get("merge_below")),
        use_orig_params=run.get("use_orig_params", False), device_id=torch.device("cpu"))


HF_AUTO = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}


def cpu_fsdp_strategy() -> Any:
    """A FSDPStrategy subclass that keeps Lightning's own _setup_model (device_id=None)."""
    from lightning.pytorch.strategies import FSDPStrategy

    class MyFSDP(FSDPStrategy):  # type: ignore[misc]
        pass

    return MyFSDP(process_group_backend="gloo")


def lightning_fsdp_config() -> dict[str, Any]:
    from precision_annot.adapters.lightning import AnnotatedFSDPPrecision

    return {"strategy": cpu_fsdp_strategy(), "accelerator": "cpu",
            "plugins": [AnnotatedFSDPPrecision(default=MIXED)]}
FP32_FC2 = {"norm": "fp32", "fc2": "comm=fp32"}

SCENARIOS: list[Scenario] = [
    # -- DDP: the hook decides the wire dtype
    Scenario("ddp-plan-hook", "ddp", plain(BF16_COMM), run={"hook": "plan"}),
    Scenario("ddp-plan-hook-mixed", "ddp", plain(MIXED), run={"hook": "plan"}),
    Scenario("ddp-no-hook-bf16-comm", "ddp", plain(BF16_COMM), run={"hook": None}),
    Scenario("ddp-no-hook-fp32-comm-over-bf16", "ddp",
             plain(Policy(compute=bf16, storage=bf16, comm=fp32), {}), run={"hook": None}),
    Scenario("ddp-no-hook-islands-mixed", "ddp", plain(MIXED), run={"hook": None}),
    Scenario("ddp-builtin-fp16-compress", "ddp", plain(MIXED), run={"hook": "builtin_fp16"}),
    Scenario("ddp-fp16-compress", "ddp", plain(MIXED), run={"hook": "fp16_compress"}),
    Scenario("ddp-allreduce-hook", "ddp", plain(BF16_COMM), run={"hook": "allreduce"}),
    Scenario("ddp-own-hook", "ddp", plain(BF16_COMM), run={"hook": "own"}),
    Scenario("ddp-integer-parameter", "ddp", plain(MIXED, integer=True), run={"hook": "plan"}),
    Scenario("ddp-integer-parameter-no-hook", "ddp", plain(BF16_COMM, integer=True),
             run={"hook": None}),
    # -- FSDP2: one reduce dtype and one storage dtype per unit, ties within a unit
    Scenario("fsdp2-islands", "fsdp", plain(BF16_COMM)),
    Scenario("fsdp2-comm-only-annotation", "fsdp", plain(BF16_COMM, FP32_FC2)),
    Scenario("fsdp2-merged-island-widens", "fsdp", plain(BF16_COMM),
             check_config={"merge_below": 0.1}, run={"merge_below": 0.1}),
    Scenario("fsdp2-tied-across-units", "fsdp", tied, run={}, tokens=True),
    Scenario("fsdp2-integer-parameter", "fsdp", plain(MIXED, integer=True)),
    Scenario("fsdp2-frozen-beside-trainable", "fsdp", plain(MIXED, frozen=True)),
    Scenario("fsdp2-user-mp-policy-over-islands", "fsdp", plain(MIXED),
             run={"user_mp": True}, wrapped=True),
    # -- FSDP1
    Scenario("fsdp1-islands", "fsdp1", plain(BF16_COMM), check_config={"use_orig_params": True},
             run={"use_orig_params": True}),
    Scenario("fsdp1-integer-parameter", "fsdp1", plain(MIXED, integer=True),
             check_config={"use_orig_params": True}, run={"use_orig_params": True}),
    Scenario("fsdp1-frozen-flat", "fsdp1", plain(MIXED, {}, frozen=True),
             run={"use_orig_params": False}),
    Scenario("fsdp1-frozen-orig-params", "fsdp1", plain(MIXED, {}, frozen=True),
             check_config={"use_orig_params": True}, run={"use_orig_params": True}),
    Scenario("fsdp1-tied-across-units", "fsdp1", tied, check_config={"use_orig_params": True},
             run={"use_orig_params": True}, tokens=True),
    Scenario("fsdp1-tied-wrapped", "fsdp1", tied, check_config={"use_orig_params": True},
             run={"use_orig_params": True}, tokens=True, wrapped=True),
    Scenario("fsdp1-merged-island-widens", "fsdp1", plain(BF16_COMM),
             check_config={"merge_below": 0.1, "use_orig_params": True},
             run={"merge_below": 0.1, "use_orig_params": True}),
    # -- DeepSpeed: the config as given, prepare(model) before initialize
    Scenario("ds-to-config-zero2", "deepspeed", plain(MIXED), run={"to_config": _ds(2)}),
    Scenario("ds-to-config-zero0-uniform-comm", "deepspeed", plain(BF16_COMM, {}),
             run={"to_config": _ds(0)}),
    Scenario("ds-hand-zero0-uniform-comm", "deepspeed", plain(BF16_COMM, {}),
             run={"config": _ds(0, **AUTOCAST)}),
    Scenario("ds-to-config-zero0-mixed-comm", "deepspeed", plain(BF16_COMM),
             run={"to_config": _ds(0)}),
    Scenario("ds-to-config-zero3-mixed-comm", "deepspeed", plain(BF16_COMM),
             run={"to_config": _ds(3)}),
    Scenario("ds-to-config-zero1-mixed-comm", "deepspeed", plain(BF16_COMM),
             run={"to_config": _ds(1)}),
    Scenario("ds-hand-autocast-zero3-default-list", "deepspeed", plain(BF16_COMM, FP32_FC2),
             run={"config": _ds(3, **AUTOCAST)}),
    Scenario("ds-hand-autocast-default-list", "deepspeed", plain(BF16_COMM, FP32_FC2),
             run={"config": _ds(2, **AUTOCAST)}),
    Scenario("ds-bf16-section-one-fp32-comm", "deepspeed", plain("bf16", {"norm": "comm=fp32"}),
             run={"to_config": _ds(2)}),
    Scenario("ds-bf16-section-zero1-mixed-comm", "deepspeed",
             plain("bf16", {"norm": "comm=fp32"}), run={"to_config": _ds(1)}),
    Scenario("ds-communication-data-type-auto", "deepspeed", plain("bf16", {}),
             run={"config": _ds(2, bf16={"enabled": True}, communication_data_type="auto")}),
    Scenario("ds-hand-bf16-section-with-island", "deepspeed", plain(MIXED),
             run={"config": _ds(2, bf16={"enabled": True})}),
    Scenario("ds-hand-bf16-section-with-island-zero0", "deepspeed", plain(MIXED),
             run={"config": _ds(0, bf16={"enabled": True})}),
    Scenario("ds-mixed-storage", "deepspeed", plain("bf16"), run={"to_config": _ds(2)}),
    Scenario("ds-hf-auto-values", "deepspeed", plain(MIXED), run={"config": HF_AUTO}),
    Scenario("ds-fp16-autocast-zero2", "deepspeed", plain("16-mixed"),
             run={"config": _ds(2, torch_autocast={"enabled": True, "dtype": "float16"})}),
    Scenario("ds-fp16-section", "deepspeed", plain("16-true", {}),
             run={"config": _ds(0, fp16={"enabled": True, "loss_scale": 128})}),
    # -- one process: the numbers a plan loses, and Lightning's own precision
    Scenario("local-fp16-without-scaler", "local", plain("16-mixed", {}), run={"scale": False}),
    Scenario("local-fp16-with-scaler", "local", plain("16-mixed", {}),
             check_config={"grad_scaler": True}, run={"scale": True}),
    Scenario("local-bf16-batchnorm", "local", plain("bf16-true", {}, norm="batch")),
    Scenario("local-bf16-mixed-batchnorm", "local", plain(MIXED, {}, norm="batch")),
    Scenario("local-bf16-batchnorm-untracked", "local",
             plain("bf16-true", {}, norm="batch-untracked")),
    Scenario("local-bf16-mixed-norms", "local", plain(MIXED)),
    Scenario("lightning-applied-mixed", "lightning", plain(MIXED),
             check_config={"precision": "bf16-mixed", "accelerator": "cpu"},
             run={"precision": "bf16-mixed"}, applied=True),
    Scenario("lightning-applied-true", "lightning", plain(MIXED),
             check_config={"precision": "bf16-true", "accelerator": "cpu"},
             run={"precision": "bf16-true"}, applied=True),
    Scenario("lightning-plugin", "lightning", plain(MIXED),
             check_config={"plugins": ["AnnotatedPrecision"], "accelerator": "cpu"},
             run={"plugin": True}),
    Scenario("lightning-not-applied", "lightning", plain(MIXED),
             check_config={"precision": "32-true", "accelerator": "cpu"},
             run={"precision": "32-true"}),
    Scenario("lightning-fsdp-subclass-on-cpu", "lightning", plain(MIXED),
             check_config=lightning_fsdp_config, run={"fsdp": True}),
]

BY_NAME = {s.name: s for s in SCENARIOS}
assert len(BY_NAME) == len(SCENARIOS)


def data(scenario: Scenario, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    if scenario.tokens:
        return torch.randint(0, 16, (8, 4), generator=gen), torch.randn(8, 4, 16, generator=gen)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)


def build_applied(scenario: Scenario) -> tuple[nn.Module, PrecisionPlan]:
    model, plan = scenario.build()
    if scenario.applied:
        apply(model, plan)
    return model, plan


__all__ = ["BY_NAME", "HF_AUTO", "SCENARIOS", "Scenario", "build_applied", "data", "fp16",
           "shard"]
