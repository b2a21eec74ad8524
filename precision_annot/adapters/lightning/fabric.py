"""`FabricAnnotatedPrecision`: the Fabric precision plugin."""

from __future__ import annotations

from typing import Any

from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
from lightning.fabric.utilities.types import Optimizable
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from precision_annot.adapters.lightning.base import PlanPrecision

__all__ = ["FabricAnnotatedPrecision"]


class FabricAnnotatedPrecision(PlanPrecision, FabricPrecision):
    """The Fabric precision plugin: `Fabric(plugins=[FabricAnnotatedPrecision()])`.

    Fabric casts a module's inputs in its forward; this plugin casts them to the root's compute
    dtype, applies the plan in `fabric.setup`, and scales the loss when fp16 is used.

    Args: as for `AnnotatedPrecision`.
    """

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        return self.apply_plan(module)

    @override
    def backward(self, tensor: Tensor, model: nn.Module | None, *args: Any,
                 **kwargs: Any) -> None:
        # Fabric ignores what pre_backward returns; like its MixedPrecision, scale here.
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        super().backward(tensor, model, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        if self.scaler is None:
            return optimizer.step(**kwargs)
        if isinstance(optimizer, LBFGS):
            raise ValueError("FabricAnnotatedPrecision with fp16 does not support LBFGS.")
        step_output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return step_output

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if self.scaler is not None:
            if _optimizer_handles_unscaling(optimizer):
                raise NotImplementedError(
                    "Gradient clipping is not implemented for fused optimizers."
                )
            self.scaler.unscale_(optimizer)
