"""What the Trainer and Fabric plugins share: the plan, the batch cast, autocast, the scaler."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision as TrainerPrecision
from torch import nn
from typing_extensions import override

from precision_annot._src.boundary import autocast_context
from precision_annot._src.casting import cast_tree
from precision_annot._src.checkpoints.loading import narrowed, planned_dtypes, warn_narrowed
from precision_annot._src.dtypes import LOW_PRECISION, fp32
from precision_annot._src.guards import require_plan
from precision_annot._src.plan import PrecisionPlan
from precision_annot._src.policy import SpecLike, as_policy, autocast_mode, preset_name
from precision_annot._src.runtime import apply, plan_of
from precision_annot._src.scaler import GradScaler

__all__ = ["PlanPrecision", "TrainerPlanPrecision", "default_dtype"]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """`torch.set_default_dtype(dtype)` inside the block, the previous one restored after."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class PlanPrecision:
    """The plan-driven half of every plugin here; the Lightning base class is the other half.

    Args:
        plan: the plan to run; None resolves the module's annotations in `convert_module`.
            (Default: None)
        default: the root's defaults when resolving, e.g. "bf16-mixed". (Default: None)
        device: the autocast and GradScaler device type; None takes the model's. (Default: None)
    """

    precision: Any  # Lightning's precision string, derived from the plan's root
    scaler: Any  # a GradScaler when fp16 is used (FSDP: ShardedGradScaler), else None

    def __init__(
        self,
        plan: PrecisionPlan | None = None,
        *,
        default: SpecLike | None = None,
        device: str | None = None,
    ) -> None:
        if plan is not None:
            require_plan(plan, f"{type(self).__name__}(plan=...)")
            if default is not None:
                raise ValueError(
                    f"{type(self).__name__}(plan=..., default={default!r}): default is only "
                    "used to resolve a plan; pass it to resolve() instead."
                )
        self.given_plan = plan
        self.default = None if default is None else as_policy(default, argument="default")
        self.device = device
        self.plan: PrecisionPlan | None = plan
        self.scaler = None
        self.precision = "32-true"  # Lightning reads this string; set from the plan's root
        self.scheduled = False  # set by a ScheduleCallback: it applies each phase, this follows

    def plan_for(self, module: nn.Module) -> PrecisionPlan:
        return self.given_plan or plan_of(module, self.default, where=type(self).__name__)

    def apply_plan(self, module: nn.Module) -> nn.Module:
        """Apply the plan, pick the device, make a scaler for fp16, name the precision. Under a
        `ScheduleCallback` nothing is applied here: the callback applies the phase the run
        starts in once the optimizer exists (and a resumed run's weights have loaded), and the
        plugin follows each phase it applies."""
        if self.scheduled:
            return module
        plan = self.plan_for(module)
        apply(module, plan)
        self.follow(plan, module)
        return module

    def follow(self, plan: PrecisionPlan, module: nn.Module) -> None:
        """Run `plan`, applied to `module`: the batch cast, autocast, a GradScaler for fp16 and
        the precision string follow its root."""
        self.adopt(plan, module)
        if plan.needs_loss_scaling and self.scaler is None:
            self.scaler = GradScaler(device=self.device)
        root = plan.root.policy
        self.precision = (preset_name(root.compute, root.storage)  # e.g. "bf16-mixed"
                          or preset_name(root.compute, fp32 if root.storage else None)
                          or "32-true")

    def adopt(self, plan: PrecisionPlan, module: nn.Module) -> None:
        """Remember the plan, and take the device type from the module's parameters."""
        self.plan = plan
        if self.device is None:
            param = next(module.parameters(), None)
            self.device = param.device.type if param is not None else "cpu"

    def convert_input(self, data: Any) -> Any:
        """Cast floating tensors in the batch to the root's compute dtype (before the transfer)."""
        dtype = None if self.plan is None else self.plan.root.policy.compute
        return data if dtype is None else cast_tree(data, dtype)

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        """The root's autocast state, so code that calls submodules directly runs as the root;
        and for a "-true" root (bf16 or fp16 compute and storage), the default dtype set to it,
        as Lightning's own "bf16-true" and "16-true" set it: a tensor the forward builds
        itself (`torch.zeros(...)`, a positional table) is made in that dtype."""
        if self.plan is None:
            return contextlib.nullcontext()
        root = self.plan.root.policy
        stack = contextlib.ExitStack()
        context = autocast_context(autocast_mode(root), self.device or "cpu", root.compute)
        if context is not None:
            stack.enter_context(context)
        if root.compute in LOW_PRECISION and root.storage == root.compute:
            stack.enter_context(default_dtype(root.compute))
        return stack

    def tensor_init_context(self) -> contextlib.AbstractContextManager[None]:
        # Storage differs per module, so no default dtype is set: modules are built in fp32 and
        # each is cast to its own storage dtype in convert_module.
        return contextlib.nullcontext()

    def module_init_context(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def state_dict(self) -> dict[str, Any]:
        """The GradScaler's state, saved in checkpoints; empty without fp16."""
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


class TrainerPlanPrecision(PlanPrecision, TrainerPrecision):
    """The base of the Trainer plugins: the plan half and Lightning's Trainer `Precision`."""

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """When the Trainer restores a checkpoint: warn, naming them, about the tensors it
        holds narrower than the plan keeps them. (A one-device Trainer loads the weights before
        `convert_module` applies the plan, where the model's own load hooks cannot see them;
        `apply` then puts each in its planned dtype.)"""
        state = checkpoint.get("state_dict")
        if self.plan is None or not isinstance(state, dict):
            return
        warn_narrowed("Lightning's checkpoint restore", narrowed(planned_dtypes(self.plan), (
            (k, v.dtype) for k, v in state.items() if isinstance(v, torch.Tensor))))
