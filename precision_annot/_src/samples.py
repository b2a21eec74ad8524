"""Calling a model with a sample batch: the convention `audit`'s CLI and `suggest` share.

A sample is `(args, kwargs)` (a tuple of a tuple or list and a dict), a mapping (passed as
keyword arguments, as Hugging Face batches are), or anything else (passed as the one
positional argument).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from precision_annot._src.casting import floating_leaves

__all__ = ["as_call", "loss_of", "scalar_loss", "step"]


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


def loss_of(loss_fn: Callable[..., Any] | None, where: str
            ) -> Callable[[Any, Any], torch.Tensor | None] | None:
    """`loss_fn(output)` or `loss_fn(output, sample)` (told apart by how many positional
    parameters without a default it has, as `suggest` tells them), as `(output, sample) ->
    loss`; the loss is checked to be a tensor. `where` names the caller in errors."""
    if loss_fn is None:
        return None
    if not callable(loss_fn):
        raise TypeError(f"{where}(loss_fn=...) is a function: output -> loss, or "
                        f"(output, sample) -> loss. Received: loss_fn={loss_fn!r}")
    try:
        params = [p for p in inspect.signature(loss_fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.default is p.empty]
        two = len(params) >= 2
    except (TypeError, ValueError):  # a builtin without a signature: one argument
        two = False

    def loss(output: Any, sample: Any) -> torch.Tensor | None:
        value = loss_fn(output, sample) if two else loss_fn(output)
        if value is not None and not (isinstance(value, torch.Tensor)
                                      and value.is_floating_point()):
            raise TypeError(f"{where}(loss_fn=...) must return a floating tensor computed "
                            f"from the output (or None). Received: {value!r} (of type "
                            f"{type(value).__name__})")
        return value

    return loss
