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

__all__ = ["as_call", "loss_of", "projected_loss", "scalar_loss", "step", "takes_sample"]


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


def projected_loss(output: Any) -> torch.Tensor | None:
    """A fixed projection of every floating tensor in `output`, summed, in fp32 (None when
    there is none): the default loss of a step that compares gradients.

    The plain sum of an output is a constant after a normalization or a softmax (a
    LayerNorm's output at its initial weights sums to 0 over its features, a softmax's to 1),
    so its gradient is 0 but for rounding, and comparing gradients compares rounding noise.
    Here each tensor, seen as rows by its last dimension, is weighted by the outer product of
    two fixed patterns in [-1, 1) (`_pattern`): the gradient it hands back is that product,
    which no normalization of a row or a column removes. A 0-dim tensor (a loss the model
    returns) is taken as it is. The same output gives the same loss on any run and device."""
    leaves: list[torch.Tensor] = []
    floating_leaves(output, leaves)
    if not leaves:
        return None
    parts = []
    for t in leaves:
        if t.dim() == 0:
            parts.append(t.float())
            continue
        cols = t.shape[-1]
        rows = t.numel() // max(cols, 1)
        flat = t.float().reshape(rows, cols)
        parts.append(flat @ _pattern(cols, t.device, 0) @ _pattern(rows, t.device, cols))
    return torch.stack(parts).sum()


def _pattern(n: int, device: torch.device, salt: int) -> torch.Tensor:
    """n fixed values in [-1, 1) (a multiplicative hash of the index: no generator drawn
    from, the same on every device)."""
    index = torch.arange(salt, salt + n, dtype=torch.int64, device=device)
    return (index * 2654435761 % 4294967296).to(torch.float32) / 2147483648.0 - 1.0


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
    two = takes_sample(loss_fn)

    def loss(output: Any, sample: Any) -> torch.Tensor | None:
        value = loss_fn(output, sample) if two else loss_fn(output)
        if value is None or (isinstance(value, torch.Tensor) and value.is_floating_point()
                             and value.numel() == 1):
            return value
        raise TypeError(f"{where}(loss_fn=...) must return the loss: a floating tensor of one "
                        "element computed from the output (or None); take it out of a tuple "
                        "or a dict (`out[0]`, `out['loss']`, a Hugging Face output's "
                        f"`out.loss`), and reduce a tensor (`.mean()`). Received: "
                        f"{_described(value)}")

    return loss


def takes_sample(loss_fn: Callable[..., Any]) -> bool:
    """Whether `loss_fn` is `(output, sample) -> loss` rather than `output -> loss`: it has
    two or more positional parameters without a default (a builtin without a signature takes
    one)."""
    try:
        params = [p for p in inspect.signature(loss_fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.default is p.empty]
    except (TypeError, ValueError):
        return False
    return len(params) >= 2


def _described(value: Any) -> str:
    """A short description of a value that is not a loss (never a tensor's numbers)."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {list(value)[:8]}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"{value!r} (of type {type(value).__name__})"
