"""`AnnotatedPrecision`: the Trainer precision plugin."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.types import Steppable
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from precision_annot._src.plan import PrecisionPlan
from precision_annot._src.policy import SpecLike
from precision_annot.adapters.lightning.base import TrainerPlanPrecision
from precision_annot.adapters.lightning.strategies import LocalHooks, hooks_for

__all__ = ["AnnotatedPrecision"]


class AnnotatedPrecision(TrainerPlanPrecision):
    """The Trainer precision plugin: `Trainer(plugins=[AnnotatedPrecision()])`.

    With `DeepSpeedStrategy(config=base)` the plugin fills the strategy's config from
    `precision_annot.adapters.deepspeed.to_config(plan, base)` (a contradiction raises), runs
    `deepspeed.prepare`, and leaves backward, loss scaling and the step to the DeepSpeed engine.
    With `DDPStrategy` it registers `ddp.comm_hook(plan)`.

    Args:
        plan: the plan to run; None resolves the LightningModule's annotations in
            `convert_module`. (Default: None)
        default: the root's defaults when resolving, e.g. "bf16-mixed". (Default: None)
        device: the autocast and GradScaler device type; None takes the model's. (Default: None)

    Example:
        >>> trainer = Trainer(plugins=[AnnotatedPrecision(default="bf16-mixed")])  # doctest: +SKIP
    """

    def __init__(self, plan: PrecisionPlan | None = None, *, default: SpecLike | None = None,
                 device: str | None = None) -> None:
        super().__init__(plan, default=default, device=device)
        self.hooks = LocalHooks(self)

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        self.hooks = hooks_for(self, module)
        return self.hooks.convert(module)

    @override
    def pre_backward(  # type: ignore[override]  # as Lightning's own: the Trainer's signature
        self, tensor: Tensor, module: pl.LightningModule
    ) -> Tensor:
        self.hooks.before_backward(module)
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        out: Tensor = super().pre_backward(tensor, module)
        return out

    @override
    def backward(  # type: ignore[override]
        self, tensor: Tensor, model: pl.LightningModule, optimizer: Steppable | None,
        *args: Any, **kwargs: Any,
    ) -> None:
        self.hooks.backward(tensor, model, optimizer, *args, **kwargs)

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        self.hooks.clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Steppable, model: pl.LightningModule, closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        return self.hooks.optimizer_step(optimizer, model, closure, **kwargs)
