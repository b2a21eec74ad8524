"""Record the dtype reaching each torch.distributed collective, and put the originals back."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch

from precision_annot.dtypes import dtype_name

NAMES = ("all_reduce", "reduce", "all_gather", "reduce_scatter", "reduce_scatter_tensor",
         "reduce_scatter_single", "all_gather_into_tensor", "all_gather_single",
         "all_to_all_single")

Call = tuple[str, str, int]  # collective, dtype of its largest tensor argument, numel


@contextlib.contextmanager
def recording(*namespaces: ModuleType) -> Iterator[list[Call]]:
    """Wrap the collectives in `namespaces` for the block; each call appends (name, dtype,
    numel) of its largest tensor argument (a reduce-scatter's input) to the yielded list."""
    calls: list[Call] = []
    saved: list[tuple[ModuleType, str, Callable[..., Any]]] = []
    for namespace in namespaces:
        for name in NAMES:
            original = getattr(namespace, name, None)
            if original is not None:
                saved.append((namespace, name, original))
                setattr(namespace, name, _wrap(original, name, calls))
    try:
        yield calls
    finally:
        for namespace, name, original in reversed(saved):
            setattr(namespace, name, original)


_inside = threading.local()  # one record per collective, even if one wrapped call makes another


def _wrap(original: Callable[..., Any], name: str, into: list[Call]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if getattr(_inside, "active", False):
            return original(*args, **kwargs)
        tensors = []
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor):
                tensors.append(a)
            elif isinstance(a, list):
                tensors += [t for t in a if isinstance(t, torch.Tensor)]
        if tensors:
            t = max(tensors, key=lambda x: x.numel())
            into.append((name, dtype_name(t.dtype), t.numel()))
        _inside.active = True
        try:
            return original(*args, **kwargs)
        finally:
            _inside.active = False

    return wrapped
