"""Record the dtype reaching each torch.distributed collective, and put the originals back."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from precision_annot._src.dtypes import dtype_name

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


def _largest(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The largest tensor a collective was given (directly or in a list): what it moves."""
    tensors: list[torch.Tensor] = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            tensors.append(a)
        elif isinstance(a, list):
            tensors += [t for t in a if isinstance(t, torch.Tensor)]
    return max(tensors, key=lambda x: x.numel()) if tensors else None


def _wrap(original: Callable[..., Any], name: str, into: list[Call]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if getattr(_inside, "active", False):
            return original(*args, **kwargs)
        t = _largest(args, kwargs)
        if t is not None:
            into.append((name, dtype_name(t.dtype), t.numel()))
        _inside.active = True
        try:
            return original(*args, **kwargs)
        finally:
            _inside.active = False

    return wrapped


# -- the wire itself: a process group that records what reaches gloo ------------------------------

_REDUCING = frozenset({"allreduce", "allreduce_coalesced", "reduce", "reduce_scatter",
                       "_reduce_scatter_base", "reduce_scatter_tensor_coalesced",
                       "reduce_scatter_single", "reduce_scatter_single_coalesced"})
_METHODS = ("allreduce", "allreduce_coalesced", "broadcast", "allgather", "_allgather_base",
            "allgather_coalesced", "allgather_into_tensor_coalesced", "reduce_scatter",
            "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "alltoall",
            "alltoall_base", "reduce", "gather", "scatter", "send", "recv", "recv_anysource",
            "barrier")

#: every reduction a RecordingGloo group issued in this process: (method, dtype, elements)
WIRE: list[Call] = []


class RecordingGloo(dist.ProcessGroup):  # type: ignore[misc]
    """A gloo process group that records the dtype and size of every reduction, as it reaches
    gloo: C++ callers (DDP's reducer and its built-in hooks) included, which a Python patch of
    torch.distributed cannot see. `dist.init_process_group("recgloo")` makes one. It serves
    DDP; FSDP and DeepSpeed need more of a process group than a Python one gives (a group name,
    per-device backends), and call collectives from Python, where `recording` sees them."""

    def __init__(self, store: Any, rank: int, size: int, timeout: Any) -> None:
        super().__init__(rank, size)
        self.inner = dist.ProcessGroupGloo(store, rank, size, timeout)

    def getBackendName(self) -> str:
        return "recgloo"


def _delegate(name: str) -> Callable[..., Any]:
    def method(self: RecordingGloo, *args: Any, **kwargs: Any) -> Any:
        if name in _REDUCING:
            t = _largest(args, kwargs)
            if t is not None:
                WIRE.append((name, dtype_name(t.dtype), t.numel()))
        return getattr(self.inner, name)(*args, **kwargs)

    method.__name__ = name
    return method


for _name in _METHODS:
    setattr(RecordingGloo, _name, _delegate(_name))


def register_recording_gloo() -> None:
    """Make "recgloo" a backend name for `init_process_group` (CPU tensors)."""
    if "recgloo" not in dist.Backend.backend_list:
        dist.Backend.register_backend("recgloo", RecordingGloo, devices=["cpu"])
