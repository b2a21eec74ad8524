"""The tensor-parallel gradient reduction of replicated parameters, in the planned `comm`.

A parameter replicated over the TP mesh (a norm's weight under `SequenceParallel`, the bias of
a row-parallel Linear whose output is sequence-sharded, a router) receives a gradient that is a
partial sum on each rank. DTensor (or FSDP2 before torch 2.15, reading the gradient of its
unsharded parameter) all-reduces it in the gradient's own dtype, which under FSDP2 is its
`param_dtype` (bf16): FSDP2's `reduce_dtype` does not reach this all-reduce (PyTorch issue
190626, fixed in torch 2.15, where FSDP2 accumulates such a gradient in its reduce dtype and
all-reduces it there). Here the partial gradient is reduced in the module's planned `comm` as
it arrives, before it is accumulated, and handed on replicated, so nothing downstream reduces
it again; `adapters.fsdp.fully_shard` turns this off (`native`) where the installed FSDP2
reduces it in that dtype itself, which also spares the rounding back to the gradient's dtype.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["ReplicatedGrads", "reduce_partial"]


def reduce_partial(comm: torch.dtype, grad: torch.Tensor) -> torch.Tensor | None:
    """`grad` with its partial placements reduced in `comm` (and cast back to its dtype), or
    None (unchanged) when it is not partial or already in `comm`."""
    if not isinstance(grad, DTensor) or grad.dtype == comm:
        return None
    if not any(p.is_partial() for p in grad.placements):
        return None
    target = tuple(Replicate() if p.is_partial() else p for p in grad.placements)
    wide = DTensor.from_local(grad.to_local().to(comm), grad.device_mesh, grad.placements,
                              run_check=False, shape=grad.shape, stride=grad.stride())
    return wide.redistribute(grad.device_mesh, target).to(grad.dtype)


class ReplicatedGrads:
    """A forward pre-hook on a module holding parameters replicated over a tensor-parallel
    mesh: each such parameter's gradient is hooked to be reduced in `comm` as it arrives, when
    the hook is made and at each eager forward for parameters that appeared since (FSDP2's
    unsharded parameters, which it keeps from step to step: under `torch.compile`, where
    nothing is hooked, run one eager step first). One check of a few parameters per call.

    Args:
        comm: the dtype to reduce the partial gradients in.

    Attributes:
        native: set when FSDP2 reduces these gradients in `comm` itself (torch 2.15): the hook
            then hooks nothing more.
    """

    def __init__(self, comm: torch.dtype) -> None:
        self.comm = comm
        self.native = False
        self.hooked: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __call__(self, module: nn.Module, args: Any) -> None:
        if self.native or torch.compiler.is_compiling():  # compiled: hooked eagerly before
            return
        self.hook(module)

    def hook(self, module: nn.Module) -> None:
        """Hook the module's replicated parameters not hooked yet."""
        # the real parameters: a CastingDict's items, not the copies it hands out
        for param in dict.values(module._parameters):
            if (isinstance(param, DTensor) and param.requires_grad and param.is_leaf
                    and param not in self.hooked
                    and any(isinstance(p, Replicate) for p in param.placements)):
                param.register_hook(functools.partial(reduce_partial, self.comm))
                self.hooked[param] = True

    def __repr__(self) -> str:
        return f"ReplicatedGrads(comm={self.comm}{', native' if self.native else ''})"


def leave_to_fsdp2(module: nn.Module, reduce_dtype: torch.dtype | None) -> None:
    """Turn off the `ReplicatedGrads` hook of a module FSDP2 shards into a unit reducing in
    `reduce_dtype`, where the installed FSDP2 all-reduces the module's partial gradients in
    that dtype itself (torch 2.15) and it is the hook's `comm`.

    NOTE: nn.Module has no public way to list its hooks; `_forward_pre_hooks` is only read."""
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, ReplicatedGrads) and hook.comm == reduce_dtype:
            hook.native = True


def replicated(module: nn.Module) -> bool:
    """Whether `module` holds a trainable parameter replicated over a DTensor mesh."""
    return any(isinstance(p, DTensor) and p.requires_grad
               and any(isinstance(q, Replicate) for q in p.placements)
               for p in dict.values(module._parameters))
