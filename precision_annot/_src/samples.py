"""Calling a model with a sample batch: the convention `audit`'s CLI and `suggest` share.

A sample is `(args, kwargs)` (a tuple of a tuple or list and a dict), a mapping (passed as
keyword arguments, as Hugging Face batches are), or anything else (passed as the one
positional argument).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from precision_annot._src.casting import floating_leaves

__all__ = ["as_call", "scalar_loss", "step"]


def as_call(sample: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword arguments a sample stands for."""
    if (isinstance(sample, tuple) and len(sample) == 2 and isinstance(sample[0], (tuple, list))
            and isinstance(sample[1], Mapping)):
        return tuple(sample[0]), dict(sample[1])
    if isinstance(sample, Mapping):
        return (), dict(sample)
    return (sample,), {}


def scalar_loss(output: Any) -> torch.Tensor | None:
    """The sum of every floating tensor in `output`, in fp32; None when there is none."""
    leaves: list[torch.Tensor] = []
    floating_leaves(output, leaves)
    if not leaves:
        return None
    return torch.stack([t.float().sum() for t in leaves]).sum()


def step(model: nn.Module, sample: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None,
         *, backward: bool = True) -> tuple[Any, torch.Tensor | None]:
    """One forward on `sample` and, when it gives a loss that needs gradients, one backward.

    The loss is `loss_fn(output)`, else the sum of the output's floating tensors.
    """
    args, kwargs = as_call(sample)
    output = model(*args, **kwargs)
    loss = loss_fn(output) if loss_fn is not None else scalar_loss(output)
    if backward and loss is not None and loss.requires_grad:
        loss.backward()  # type: ignore[no-untyped-call]
    return output, loss
