"""`GradScaler`: dynamic loss scaling for the local path, fp16-stored parameters included."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from precision_annot._src.update.optimizer import PlanOptimizer
from precision_annot._src.update.step import widen_gradients

__all__ = ["GradScaler"]


class GradScaler(torch.amp.GradScaler):
    """A dynamic loss scaler that also unscales gradients of parameters stored in fp16.

    `torch.amp.GradScaler` refuses fp16 gradients ("Attempting to unscale FP16 gradients"),
    because unscaling in fp16 can underflow; but with fp16 storage there is no wider copy to
    unscale into, and skipping non-finite steps is still what keeps fp16 training alive (FSDP's
    `ShardedGradScaler` takes the same path). Everything else is `torch.amp.GradScaler`: scale
    the loss, `unscale_` before clipping, `step` skips a step whose gradients are not finite
    and `update` lowers the scale after one; its state goes in checkpoints with `state_dict`.

    `plan.needs_loss_scaling` says when a plan needs one. With `precision_annot.optimizer`, a
    gradient narrower than the master it updates (fp16 storage, fp32 masters) is unscaled in
    the master's dtype, as Apex O2 does: `.grad` becomes the fp32 unscaled gradient, which
    clipping then sees and the step reads; in fp16 the smallest gradients would flush to zero.
    With `grad=fp32` the gradients of fp16 (or bf16) parameters are already fp32 (`.grad`
    accumulates in fp32) and are unscaled in fp32; `torch.amp.GradScaler` then works as well.

    Args:
        device: "cuda", "cpu", ...; None takes CUDA when it is available and the CPU
            otherwise, so the scaler never silently disables itself. (Default: None)
        **kwargs: as for `torch.amp.GradScaler` (`init_scale`, `growth_interval`, ...).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from precision_annot import GradScaler, apply
        >>> model = apply(nn.Linear(4, 1), default="fp16")
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = GradScaler()
        >>> scaler.scale(model(torch.randn(8, 4)).float().pow(2).mean()).backward()
        >>> scaler.step(opt)
        >>> scaler.update()
    """

    def __init__(self, device: str | None = None, **kwargs: Any) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if not isinstance(device, str):
            raise TypeError(f"GradScaler(device=...) takes a device type such as 'cuda' or "
                            f"'cpu'. Received: device={device!r}")
        super().__init__(device, **kwargs)

    def _unscale_grads_(
        self, optimizer: Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        if isinstance(optimizer, PlanOptimizer):  # unscaled in the master's dtype, as Apex O2
            widen_gradients(optimizer)
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)
