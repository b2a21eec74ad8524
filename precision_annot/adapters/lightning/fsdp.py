"""`AnnotatedFSDPPrecision`: the Trainer plugin for Lightning's `FSDPStrategy` (FSDP1)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.precision import FSDPPrecision
from torch import nn
from typing_extensions import override

from precision_annot.adapters.fsdp import mixed_precision, wrap_policy
from precision_annot.adapters.lightning.strategies import strategy_of
from precision_annot.adapters.lightning.trainer import AnnotatedPrecision

__all__ = ["AnnotatedFSDPPrecision"]


class AnnotatedFSDPPrecision(AnnotatedPrecision, FSDPPrecision):
    """`AnnotatedPrecision` for Lightning's `FSDPStrategy` (FSDP1), which accepts only
    `FSDPPrecision` subclasses.

    It applies the plan, gives FSDP the root's `MixedPrecision` from `fsdp.mixed_precision(plan)`,
    sets the strategy's `auto_wrap_policy` to `fsdp.wrap_policy(plan)` unless you set one, and
    uses FSDP's `ShardedGradScaler` (which agrees on overflow across ranks) when fp16 is used.

    Example:
        >>> trainer = Trainer(strategy=FSDPStrategy(),  # doctest: +SKIP
        ...                   plugins=[AnnotatedFSDPPrecision(default="bf16-mixed")])
    """

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        module = super().convert_module(module)
        assert self.plan is not None
        if self.plan.needs_loss_scaling:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device=self.device or "cpu")
        strategy = strategy_of(module)
        kwargs = getattr(strategy, "kwargs", None)
        if isinstance(kwargs, dict) and "auto_wrap_policy" not in kwargs:
            kwargs["auto_wrap_policy"] = wrap_policy(self.plan)
        return module

    @property
    @override
    def mixed_precision_config(self) -> Any:
        # Lightning reads this for configure_model's wrapping context, before convert_module
        # resolves the plan; modules wrapped there get no mixed precision from the plan.
        return None if self.plan is None else mixed_precision(self.plan)

    @override
    def convert_output(self, data: Any) -> Any:
        return data  # outputs leave in the dtype the plan gives them
