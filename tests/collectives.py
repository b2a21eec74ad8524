"""Record the dtype reaching each torch.distributed collective, for the multi-rank workers."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from precision_annot.dtypes import dtype_name

NAMES = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor",
         "reduce_scatter_single", "all_gather_into_tensor", "all_gather_single",
         "all_to_all_single")


def record(namespaces: tuple[ModuleType, ...], into: list[tuple[str, str, int]]) -> None:
    """Wrap the collectives in `namespaces`; append (name, dtype, numel) of the largest tensor
    argument of each call (a reduce-scatter's input) to `into`."""
    for namespace in namespaces:
        for name in NAMES:
            original = getattr(namespace, name, None)
            if original is None or getattr(original, "_recording", False):
                continue
            setattr(namespace, name, _wrap(original, name, into))


def _wrap(original: Callable[..., Any], name: str,
          into: list[tuple[str, str, int]]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        tensors = []
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor):
                tensors.append(a)
            elif isinstance(a, list):
                tensors += [t for t in a if isinstance(t, torch.Tensor)]
        if tensors:
            t = max(tensors, key=lambda x: x.numel())
            into.append((name, dtype_name(t.dtype), t.numel()))
        return original(*args, **kwargs)

    wrapped._recording = True  # type: ignore[attr-defined]
    return wrapped
