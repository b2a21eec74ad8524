"""What runs at every call of a boundary: cast in, set autocast, run, cast out.

`apply` decides everything it can once: each boundary's `BoundarySpec` (the entry dtype, the
autocast mode, the exit dtype, the arguments kept as they are) and whether the call can take
the fast path (one tensor argument, nothing kept, nothing checked, no parameter to cast).
The per-call code here only reads those decisions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
import threading
import types
import warnings
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any, Protocol, TypeVar

import torch
from torch import nn
from typing_extensions import ParamSpec

from precision_annot._src import recompute
from precision_annot._src.casting import Copies, cast_tree, check_tree, first_floating
from precision_annot._src.dtypes import dtype_name, wider
from precision_annot._src.policy import AutocastMode, Policy
from precision_annot._src.tags import tag_function

__all__ = ["REGION_OBSERVERS", "Boundary", "BoundarySpec", "CastingDict", "DriftError",
           "ForwardState", "Planned", "Region", "RegionObserver", "autocast_context",
           "cast_inputs", "device_type_of", "forward_state", "forward_state_restorer",
           "get_tensor", "in_applied_forward",
           "keep_binding", "set_tensor", "wrap_function"]

P = ParamSpec("P")
R = TypeVar("R")

_NULL = contextlib.nullcontext()


# -- autocast and device --------------------------------------------------------------------------

# read at every boundary call: bound once here (each dotted lookup costs on a hot path)
_is_compiling = torch.compiler.is_compiling
_profiler = torch.autograd.profiler

_AUTOCAST_DEVICES: dict[str, bool] = {
    d: torch.amp.is_autocast_available(d)
    for d in ("cpu", "cuda", "meta", "xpu", "mps", "hpu", "xla", "mtia", "privateuseone")
}


def _autocast_available(device_type: str) -> bool:
    available = _AUTOCAST_DEVICES.get(device_type)
    if available is None:
        available = _AUTOCAST_DEVICES[device_type] = torch.amp.is_autocast_available(device_type)
    return available


def autocast_context(
    mode: AutocastMode, device_type: str, dtype: torch.dtype | None
) -> contextlib.AbstractContextManager[Any] | None:
    """The autocast context a region with this autocast mode needs, or None when nothing has
    to change (entering autocast costs about 7 us even when it changes nothing, and inside
    `torch.compile` a context that changes nothing still splits the graph), or when the
    device has no autocast (meta tensors). Under `torch.compile` the state is read at trace
    time and guarded."""
    if mode is None or not (_AUTOCAST_DEVICES.get(device_type) or _autocast_available(
            device_type)):
        return None
    enabled = torch.is_autocast_enabled(device_type)
    if mode == "off":
        return torch.autocast(device_type, enabled=False) if enabled else None
    if enabled and torch.get_autocast_dtype(device_type) == dtype:
        return None
    if not torch.compiler.is_compiling() and _inside_autocast():
        # PyTorch caches a weight's autocast copy by the weight alone, not by the dtype: a
        # weight shared with an enclosing region of another dtype (a tied weight used by a
        # bf16 island in an fp16 model) would get the other region's copy ("expected m1 and
        # m2 to have the same dtype"). A region nested in another casts without the cache.
        return torch.autocast(device_type, dtype=dtype, enabled=True, cache_enabled=False)
    return torch.autocast(device_type, dtype=dtype, enabled=True)


def _inside_autocast() -> bool:
    """Inside an autocast context (enabled or not), whose cache outlives a nested one."""
    depth = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return depth > 1


def device_type_of(
    first: torch.Tensor | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    module: nn.Module | None = None,
) -> str:
    """The device of the first floating input, else of any tensor argument (token ids count),
    else of the module's weights, else "cpu".

    Autocast is per device type: a GPU model whose root takes integer tokens must still get
    CUDA autocast, not CPU autocast.
    """
    if first is not None:
        return first.device.type
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    if module is not None:
        for tensor in (*module.parameters(), *module.buffers()):
            return tensor.device.type
    return "cpu"


def _traced(what: str, name: str) -> contextlib.AbstractContextManager[Any]:
    """A named profiler range for a boundary cast, only while a profiler is recording."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(f"precision_annot::{what}[{name}]")
    return _NULL


# -- parameters and buffers seen in the compute dtype ---------------------------------------------

_tls = threading.local()


@dataclasses.dataclass(eq=False)
class Region:
    """The modules a boundary runs whose parameters or buffers differ from its compute dtype.

    While the boundary's forward runs in a thread, each of those tensors is seen there as a
    copy in the compute dtype, made on first access and shared for the rest of the call; its
    gradient lands in the tensor's own dtype. Nothing is swapped on the module, so another
    thread running the same model at the same time sees its own copies, or none.

    Attributes:
        compute: the dtype the tensors are seen in.
        members: (path relative to the boundary module, "param" or "buffer", name, upcast
            only): the tensors to cast. Non-persistent buffers are only cast up, never down.
    """

    compute: torch.dtype
    members: tuple[tuple[str, str, str, bool], ...]

    def needs(self, tensor: torch.Tensor, upcast_only: bool) -> bool:
        if not tensor.is_floating_point() or tensor.dtype == self.compute:
            return False
        return wider(self.compute, tensor.dtype) if upcast_only else True

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Cast this region's tensors, in this thread, until the block ends."""
        caches: dict[Region, dict[tuple[int, str], Cached]] | None
        caches = getattr(_tls, "caches", None)
        if caches is None:
            caches = _tls.caches = {}
        outer = caches.get(self)
        cache = caches[self] = {} if outer is None else outer
        try:
            yield
        finally:
            if outer is None:
                del caches[self]
                _write_back(cache.values())

    @contextlib.contextmanager
    def swapped(self, module: nn.Module) -> Iterator[None]:
        """Cast this region's tensors by replacing them on the modules for the block.

        Only for a module no other thread runs meanwhile: inside `torch.compile` (traced
        once, functionally) and in a DataParallel replica (one thread per replica)."""
        saved: list[tuple[nn.Module, str, str, Cached]] = []
        try:
            for path, kind, name, upcast_only in self.members:
                owner = module.get_submodule(path)
                tensor = get_tensor(owner, kind, name)
                if tensor is not None and self.needs(tensor, upcast_only):
                    cast = tensor.to(self.compute)
                    set_tensor(owner, kind, name, cast)
                    saved.append((owner, kind, name, (tensor, cast, kind == "buffer")))
            yield
        finally:
            for owner, kind, name, (tensor, _, _) in saved:
                set_tensor(owner, kind, name, tensor)
            _write_back(entry for *_, entry in saved)


# (the tensor, its copy in the compute dtype, whether it is a buffer)
Cached = tuple[torch.Tensor, torch.Tensor, bool]


def _write_back(entries: Iterable[Cached]) -> None:
    """Nothing written is lost: what the forward wrote into a copy is written back into the
    tensor it was made from, in that tensor's dtype.

    Buffers are compared element by element (native kernels update BatchNorm's running
    statistics without bumping the version counter), with no data-dependent branch, so the
    same code runs inside `torch.compile`; elements that did not change keep their exact
    value even when the copy was narrower. Parameters are written back only when changed in
    place, in eager mode."""
    compiling = torch.compiler.is_compiling()
    for original, cast, is_buffer in entries:
        if cast is original:
            continue
        with torch.no_grad():
            if is_buffer:
                changed = cast != original.to(cast.dtype)
                original.copy_(torch.where(changed, cast.to(original.dtype), original))
            elif not compiling and not cast.is_inference() and cast._version > 0:
                original.copy_(cast.to(original.dtype))


class CastingDict(dict[str, Any]):
    """`module._parameters` or `module._buffers` of a module in a `Region`: while that region is
    active in the current thread, reading a tensor gives its copy in the compute dtype.

    `nn.Module.__getattr__` reads parameters and buffers through `__getitem__`, so
    `self.weight` inside the forward sees the copy; `named_parameters`, `state_dict` and
    optimizers iterate the dict and see the real tensors. Installed and removed by `apply`
    and `remove` (the only place this package replaces a module's `_parameters` or
    `_buffers`).
    """

    __slots__ = ("region", "upcast_only")

    def __init__(self, items: dict[str, Any], region: Region, upcast_only: frozenset[str]):
        super().__init__(items)
        self.region = region
        self.upcast_only = upcast_only

    def __getitem__(self, name: str) -> Any:
        value = dict.__getitem__(self, name)
        if value is None or torch.compiler.is_compiling():
            return value
        caches = getattr(_tls, "caches", None)
        cache = caches.get(self.region) if caches else None
        if cache is None:
            return value
        key = (id(self), name)
        hit = cache.get(key)
        if hit is not None and hit[0] is value:
            return hit[1]
        if not self.region.needs(value, name in self.upcast_only):
            return value
        cast = value.to(self.region.compute)
        cache[key] = (value, cast, not isinstance(value, nn.Parameter))
        return cast

    def __reduce__(self) -> tuple[Any, ...]:
        return (CastingDict, (dict(self), self.region, self.upcast_only))


def get_tensor(owner: nn.Module, kind: str, name: str) -> torch.Tensor | None:
    """A parameter or buffer as the module's forward reads it; in a DataParallel replica,
    parameters are plain attributes."""
    # NOTE: read through the dicts directly (not getattr) so that a CastingDict gives the
    # real tensor: dict.get does not call __getitem__.
    if name in owner.__dict__:
        value = owner.__dict__[name]
        return value if isinstance(value, torch.Tensor) else None
    store = owner.__dict__["_parameters" if kind == "param" else "_buffers"]
    value = dict.get(store, name)
    return value if isinstance(value, torch.Tensor) else None


def set_tensor(owner: nn.Module, kind: str, name: str, value: torch.Tensor) -> None:
    """Put `value` where `get_tensor` found the tensor, bypassing `nn.Module.__setattr__`
    (which refuses a non-Parameter in place of a parameter)."""
    # NOTE: the one place this package writes module._parameters / _buffers entries.
    if name in owner.__dict__:
        owner.__dict__[name] = value
        return
    store = owner.__dict__["_parameters" if kind == "param" else "_buffers"]
    dict.__setitem__(store, name, value)


# -- the boundary ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BoundarySpec:
    """What one boundary does; fixed at apply time so that a call only reads it.

    Attributes:
        name: the module's qualified name, for messages and profiler ranges.
        compute: the dtype floating inputs are cast to at entry; None leaves them.
        mode: "autocast", "off" or None (see `autocast_mode`).
        exit: the dtype floating outputs are cast to at exit; None leaves them, unless
            `exit_to_input`.
        exit_to_input: cast outputs back to the dtype of the first floating input.
        keep_positions: positional indexes never cast (negative ones count from the end).
        keep_names: keyword names never cast.
        check: raise on non-finite values crossing, forward and backward.
    """

    name: str
    compute: torch.dtype | None
    mode: AutocastMode
    exit: torch.dtype | None
    exit_to_input: bool = False
    keep_positions: frozenset[int] = frozenset()
    keep_names: frozenset[str] = frozenset()
    check: bool = False

    def target(self, first: torch.dtype | None) -> torch.dtype | None:
        """The dtype outputs leave in, given the dtype of the first floating input (None when
        there was none): runtime rule 4, as `policy.exit_dtype` decided it."""
        if self.exit_to_input:
            return first
        return self.exit

    @property
    def simple(self) -> bool:
        """Nothing kept and nothing checked: a call with one tensor argument can take
        `Boundary`'s fast path, which runs these same rules without the general cases."""
        return not (self.check or self.keep_positions or self.keep_names)

    def describe(self) -> str:
        parts = [f"compute={dtype_name(self.compute)}", f"autocast={self.mode or 'as caller'}"]
        exit_to = "input dtype" if self.exit_to_input else dtype_name(self.exit)
        parts.append(f"exit={exit_to}")
        if self.keep_positions or self.keep_names:
            parts.append(f"keep={sorted(map(str, self.keep_positions | self.keep_names))}")
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class Planned:
    """A tensor of the boundary's region and its planned dtype, to explain dtype errors."""

    path: str
    kind: str
    name: str
    dtype: torch.dtype


class DriftError(RuntimeError):
    """A boundary failed because its parameters are no longer in their planned dtypes."""


class _Local(threading.local):
    """Per thread: the applied model whose forward is running (its `apply` state), if any."""

    model: object | None = None


_local = _Local()


def in_applied_forward() -> bool:
    """True when the current thread is inside the forward of an applied model (a boundary or
    an entry guard is running). One thread-local read; `precision_scope` calls it on entry."""
    return _local.model is not None


@dataclasses.dataclass(frozen=True, eq=False)
class ForwardState:
    """What an applied forward has set in one thread at one point: the model whose forward
    runs (the entry guards read it) and the regions active there (the parameter dicts read
    them).

    Activation checkpointing runs a part of the forward again during backward, where none of
    this is set (and maybe in another thread); torch restores autocast and the random state
    for that rerun, and `recompute` has it restore this too. Without it an entry guard that
    passed through the first time would cast (T5's fp32 residual stream rounded to bf16), and
    a parameter seen in its region's compute dtype would be seen in its own:
    `torch.utils.checkpoint` raised CheckpointError, and with `use_reentrant=True` the
    gradients were those of another computation.
    """

    model: object | None
    regions: tuple[Region, ...]

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """This state in the current thread until the block ends; the regions cast with fresh
        copies, written back at the end as a boundary's are."""
        local = _local
        outer, local.model = local.model, self.model
        try:
            with contextlib.ExitStack() as stack:
                for region in self.regions:
                    stack.enter_context(region.active())
                yield
        finally:
            local.model = outer


def forward_state() -> ForwardState | None:
    """The state an applied forward has set in this thread, or None outside one."""
    caches: dict[Region, Any] | None = getattr(_tls, "caches", None)
    model = _local.model
    if model is None and not caches:
        return None
    return ForwardState(model, tuple(caches) if caches else ())


def forward_state_restorer() -> Callable[[], contextlib.AbstractContextManager[Any]] | None:
    """What a checkpoint starting now reruns its function under (see `recompute`)."""
    state = forward_state()
    return None if state is None else state.restored


def cast_inputs(args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype,
                positions: frozenset[int], names: frozenset[str], copies: Copies | None = None
                ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Every floating tensor in the arguments cast to `dtype`, but the kept ones: the entry
    cast of a boundary, of an entry guard and of the function form alike."""
    n = len(args)
    new_args = tuple(
        a if (i in positions or i - n in positions) else cast_tree(a, dtype, copies,
                                                                   f"argument {i}")
        for i, a in enumerate(args)
    )
    new_kwargs = {k: v if k in names else cast_tree(v, dtype, copies, f"argument {k!r}")
                  for k, v in kwargs.items()}
    return new_args, new_kwargs


class Boundary:
    """The forward of one boundary module: cast in, set autocast, run, cast out.

    It replaces the module's `forward` as an instance attribute, so modules that are not
    boundaries run untouched. It carries the signature, name and docstring of the forward it
    wraps, as `functools.wraps` would (Hugging Face's Trainer reads the signature to pick the
    batch columns it passes). `remove` takes it off again, or, when another library has
    wrapped it meanwhile (Accelerate's autocast wrapper), turns it into a pass-through.

    An entry guard (`guard=True`) is the same object on a module that is not a boundary but
    can be called on its own (an encoder): called from inside its model's forward it runs the
    module as is; called from outside, it sets up what its boundary would have and hands its
    outputs back as computed.

    Args:
        module: the module whose forward it is.
        spec: what it does at each call.
        inner: an instance `forward` it wraps, else the class's. (Default: None)
        region: the tensors seen in the compute dtype while it runs, the object the modules'
            `CastingDict`s know. (Default: None)
        swap: the same tensors with paths from `module`, for the cases that swap them on the
            modules (`torch.compile`, a DataParallel replica); `region` when None.
            (Default: None)
        planned: tensors and planned dtypes, to explain a failure. (Default: ())
        owner: what identifies its model's forward (the model's apply state). (Default: None)
        guard: an entry guard. (Default: False)
        top: no boundary above it: it marks its model's forward as running, for the entry
            guards inside (a boundary below one never starts the forward, so it reads nothing
            per call). (Default: True)
        exclusive: a DataParallel replica, which one thread runs. (Default: False)
    """

    def __init__(
        self,
        module: nn.Module,
        spec: BoundarySpec,
        *,
        inner: Callable[..., Any] | None = None,
        region: Region | None = None,
        swap: Region | None = None,
        planned: tuple[Planned, ...] = (),
        owner: object | None = None,
        guard: bool = False,
        top: bool = True,
        exclusive: bool = False,
    ) -> None:
        self.module = module
        self.inner = inner
        self.exclusive = exclusive
        self.attach(owner, guard=guard, top=top)
        self.configure(spec, region, planned, swap)
        self._warned: set[str] = set()
        self.__qualname__ = getattr(self._target(), "__qualname__", "forward")

    def attach(self, owner: object | None, *, guard: bool, top: bool) -> None:
        """Set the model it belongs to and its place there: an entry guard, or a boundary
        with none above it (`top`), marks that model's forward as running."""
        self.owner = owner
        self.guard = guard
        self.marks = guard or top

    def configure(self, spec: BoundarySpec | None, region: Region | None,
                  planned: tuple[Planned, ...], swap: Region | None = None) -> None:
        """Set what this boundary does; `spec=None` makes it a pass-through."""
        recompute.install(forward_state_restorer)  # once: checkpoints rerun under it
        self.spec = spec
        self.region = region
        self.swap = swap if swap is not None else region
        self.planned = planned
        # decided here once: the spec allows the fast path, and no parameter is cast
        self.fast = spec is not None and spec.simple and region is None
        self._direct = self._run if self.inner is not None else functools.partial(
            type(self.module).forward, self.module)

    @property
    def active(self) -> bool:
        return self.spec is not None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the bound forward (a class defined in a function cannot be
        pickled by reference); `__setstate__` binds it again."""
        state = dict(self.__dict__)
        state.pop("_direct", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.configure(self.spec, self.region, self.planned, self.swap)

    def rebound(self, module: nn.Module) -> Boundary:
        """This boundary for a DataParallel replica of its module."""
        return Boundary(module, self.spec, inner=self.inner, region=self.region,  # type: ignore[arg-type]
                        swap=self.swap, planned=self.planned, owner=self.owner,
                        guard=self.guard, top=self.marks, exclusive=True)

    # functools.wraps, computed when asked, so that nothing here holds a bound method
    def _target(self) -> Callable[..., Any]:
        if self.inner is not None:
            return self.inner
        return types.MethodType(type(self.module).forward, self.module)

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        return self._target()

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self._target())

    @property
    def __name__(self) -> str:
        return getattr(self._target(), "__name__", "forward")

    @property
    def __doc__(self) -> str | None:  # type: ignore[override]
        return getattr(self._target(), "__doc__", None)

    # torch.export reads the forward's code and globals to name its inputs
    @property
    def __code__(self) -> types.CodeType:
        code: types.CodeType = getattr(self._target(), "__code__")  # noqa: B009
        return code

    @property
    def __globals__(self) -> dict[str, Any]:
        namespace: dict[str, Any] = getattr(self._target(), "__globals__")  # noqa: B009
        return namespace

    @property
    def __defaults__(self) -> tuple[Any, ...] | None:
        return getattr(self._target(), "__defaults__", None)

    @property
    def __kwdefaults__(self) -> dict[str, Any] | None:
        return getattr(self._target(), "__kwdefaults__", None)

    def __repr__(self) -> str:
        spec = self.spec
        name = self.module.__class__.__name__
        if spec is None:
            return f"Boundary({name}, removed)"
        kind = "entry guard" if self.guard else "Boundary"
        return f"{kind}({spec.name or '(root)'!r}, {spec.describe()})"

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _is_compiling():  # first: Dynamo folds it, so it costs no guard
            return self._compiled(args, kwargs)
        spec = self.spec
        if spec is None:
            return self._run(*args, **kwargs)
        if self.marks:  # an entry guard, or a boundary with none above it: maybe the start
            outer = _local.model
            if outer is not self.owner:  # the model's forward starts here: mark it
                return self._entered(outer, args, kwargs, spec)
            if self.guard:  # inside its model: the model's code has the last word
                return self._run(*args, **kwargs)
        if not (self.fast and len(args) == 1 and not kwargs) or (
                _profiler._is_profiler_enabled):
            return self._call(args, kwargs, spec)
        x = args[0]
        if not isinstance(x, torch.Tensor):
            return self._call(args, kwargs, spec)
        return self._fast(x, spec)

    def _fast(self, x: torch.Tensor, spec: BoundarySpec) -> Any:
        """The fast path: one tensor in, the same rules as `_call` with the general cases
        taken out: the autocast state from autocast_context, the exit dtype from spec.target;
        the two casts are cast_tree's tensor case written out (calling it twice per crossing
        cost 0.04 more on benchmarks/overhead.py's chain)."""
        compute = spec.compute
        cast = x.to(compute) if (compute is not None and x.dtype != compute
                                 and x.is_floating_point()) else x
        device = "cpu" if x.is_cpu else x.device.type
        context = None if spec.mode is None else autocast_context(spec.mode, device, compute)
        try:
            if context is None:
                out = self._direct(cast)  # the class's forward, bound once
            else:
                with context:
                    out = self._direct(cast)
        except RuntimeError as e:
            self._explain(e)
            raise
        if cast is not x and _modified(cast):
            self._warn_modified("argument 0")
        target = spec.target(x.dtype if x.is_floating_point() else None)
        if isinstance(out, torch.Tensor):
            if target is not None and out.dtype != target and out.is_floating_point():
                return out.to(target)
            return out
        return self._exit_tree(out, target, spec, device)

    def _entered(self, outer: object | None, args: tuple[Any, ...], kwargs: dict[str, Any],
                 spec: BoundarySpec) -> Any:
        """The call that starts its model's forward in this thread (the root's, or a module
        called on its own): mark the thread as inside the model for the call."""
        local = _local
        local.model = self.owner
        try:  # a guard sets up its boundary's state; a boundary runs as it always does
            return self._call(args, kwargs, spec) if self.guard else self(*args, **kwargs)
        finally:
            local.model = outer

    def _compiled(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The call under `torch.compile`, traced into the graph once. Every attribute read
        here becomes a guard checked at each call, so it reads few: the spec, and whether its
        model's forward is being traced. As in eager, an entry guard inside its model's
        forward passes through (the model's code has the last word: T5 hands an fp32 residual
        stream from block to block, which a cast here would round to bf16), and called on its
        own sets up what its boundary would have."""
        spec = self.spec
        if spec is None:
            return self._run(*args, **kwargs)
        owner = self.owner
        if not self.marks or owner is None:
            return self._traced_call(args, kwargs, spec)
        if getattr(owner, "tracing", False):
            return self._run(*args, **kwargs) if self.guard else self._traced_call(
                args, kwargs, spec)
        owner.tracing = True  # type: ignore[attr-defined]  # the model's forward starts here
        try:
            return self._traced_call(args, kwargs, spec)
        finally:
            owner.tracing = False  # type: ignore[attr-defined]

    def _traced_call(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                     spec: BoundarySpec) -> Any:
        first = first_floating((args, kwargs)) if (
            spec.mode is not None or spec.exit_to_input) else None
        if spec.compute is not None:
            args, kwargs = cast_inputs(args, kwargs, spec.compute, spec.keep_positions,
                                       spec.keep_names)
        device = first.device.type if first is not None else device_type_of(
            None, args, kwargs, self.module)
        context = autocast_context(spec.mode, device, spec.compute)
        region = _NULL if self.swap is None else self.swap.swapped(self.module)
        with region, (context or _NULL):
            out = self._run(*args, **kwargs)
        target = spec.target(None if first is None else first.dtype)
        return out if target is None else cast_tree(out, target)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any], spec: BoundarySpec) -> Any:
        check = spec.check
        first = None
        if spec.mode is not None or spec.exit_to_input or spec.compute is not None:
            first = first_floating((args, kwargs))
        copies: Copies = []
        if spec.compute is not None:
            with _traced("cast_inputs", spec.name):
                args, kwargs = cast_inputs(args, kwargs, spec.compute, spec.keep_positions,
                                           spec.keep_names, copies)
        if check:
            check_tree((args, kwargs), spec.name, "entry")
        device = device_type_of(first, args, kwargs, self.module)
        region, context = self._state(device)
        try:
            with region, context:
                out = self._run(*args, **kwargs)
        except RuntimeError as e:
            self._explain(e)
            raise
        for label, cast in copies or ():
            if not cast.is_inference() and cast._version > 0:
                self._warn_modified(label)
        target = spec.target(None if first is None else first.dtype)
        return self._exit_tree(out, target, spec, device, check=check)

    def _state(self, device: str) -> tuple[contextlib.AbstractContextManager[Any],
                                           contextlib.AbstractContextManager[Any]]:
        """This boundary's region and autocast state, for one call or one generator step."""
        spec = self.spec
        assert spec is not None
        context = autocast_context(spec.mode, device, spec.compute)
        region: contextlib.AbstractContextManager[Any] = _NULL
        if self.region is not None:
            region = (self.swap or self.region).swapped(self.module) if self.exclusive else (
                self.region.active())
        return region, context or _NULL

    def _exit_tree(self, out: Any, target: torch.dtype | None, spec: BoundarySpec, device: str,
                   check: bool = False) -> Any:
        if isinstance(out, types.GeneratorType):
            return self._generator(out, target, device)
        if target is not None:
            with _traced("cast_outputs", spec.name):
                out = cast_tree(out, target)
        if check:
            check_tree(out, spec.name, "exit")
        return out

    def _generator(self, gen: Generator[Any, Any, Any], target: torch.dtype | None,
                   device: str) -> Generator[Any, Any, Any]:
        """A generator returned by the forward runs later, in the caller's code: run each
        step as part of this model's forward, under this boundary's state, and cast each item
        at exit."""
        while True:
            local = _local
            outer, local.model = local.model, self.owner
            region, context = self._state(device)
            try:
                with region, context:
                    item = next(gen)
            except StopIteration as stop:
                return stop.value
            finally:
                local.model = outer
            yield item if target is None else cast_tree(item, target)

    def _warn_modified(self, label: str) -> None:
        if label in self._warned:
            return
        self._warned.add(label)
        spec = self.spec
        assert spec is not None
        warnings.warn(
            f"Module {spec.name or '(root)'!r} modified its {label} in place, but that argument "
            f"is a copy cast to {dtype_name(spec.compute)} at the module's boundary, so the "
            "caller does not see the change. To pass it through uncast (a cache, a buffer "
            f"written in place), name it in keep_dtype: precision(..., keep_dtype=(...)).",
            UserWarning,
            stacklevel=4,
        )

    def _explain(self, error: RuntimeError) -> None:
        """Re-raise a failure as a `DriftError` when this boundary's parameters are no longer in
        their planned dtypes (after `.half()`, `.to(dtype)`, `load_state_dict(assign=True)`)."""
        if isinstance(error, DriftError) or not self.planned or _sharded(self.module):
            return
        drifted, swapped = self._drifted()
        if not drifted:
            return
        spec = self.spec
        assert spec is not None
        more = f" (and {len(drifted) - 3} more)" if len(drifted) > 3 else ""
        cause = self._drift_cause(swapped)
        raise DriftError(
            f"Module {spec.name or '(root)'!r} failed with tensors that are no longer in their "
            f"planned dtypes: {'; '.join(drifted[:3])}{more}. {cause} The error was: {error}"
        ) from error

    def _drifted(self) -> tuple[list[str], bool]:
        """The planned tensors no longer in their planned dtypes, said; and whether one is a
        parameter that is not a Parameter (a tensor passed in for the call)."""
        drifted = []
        swapped = False
        for item in self.planned:
            try:
                owner = self.module.get_submodule(item.path)
            except AttributeError:
                continue
            tensor = get_tensor(owner, item.kind, item.name)
            if tensor is not None and tensor.dtype != item.dtype:
                where = f"{item.path}.{item.name}" if item.path else item.name
                drifted.append(f"{where} is {dtype_name(tensor.dtype)}, planned "
                               f"{dtype_name(item.dtype)}")
                swapped |= item.kind == "param" and not isinstance(tensor, nn.Parameter)
        return drifted, swapped

    def _drift_cause(self, swapped: bool) -> str:
        """What most likely changed the dtypes, and the way back."""
        plan = getattr(self.owner, "plan", None)  # the AppliedState of the model
        root = plan.module("") if plan is not None else None
        if root is not None and _sharded(root):
            return ("FSDP2 gathers the parameters of each unit in its MixedPrecisionPolicy's "
                    "param_dtype, and this module's unit gathers them narrower than the plan "
                    "has them. Shard with precision_annot.adapters.fsdp.fully_shard(model, "
                    "plan), which gives each island a unit of its own; check(model, 'fsdp') "
                    "names the units that differ.")
        if swapped:
            return ("These tensors were passed in for this call (torch.func.functional_call, "
                    "or a state swapped in), in other dtypes than the plan holds. Pass them "
                    "in their planned dtypes, e.g. {name: t.to(dtype)} with each module's "
                    "storage from precision_annot.applied_plan(model); the model itself is "
                    "unchanged.")
        return ("Something changed them after apply (model.half(), model.to(dtype), "
                "load_state_dict(assign=True), ...). Call precision_annot.apply(model) "
                "again to restore the plan.")


def _modified(cast: torch.Tensor) -> bool:
    """Whether the forward wrote into the copy the boundary cast its argument to."""
    try:
        return cast._version > 0
    except RuntimeError:  # an inference tensor has no version counter
        return False


def _sharded(module: nn.Module) -> bool:
    """FSDP2 shards this module or one under it: while unsharded, its parameters are in their
    unit's param_dtype by design, which is not drift."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    kind = getattr(fsdp, "FSDPModule", None)
    return kind is not None and any(isinstance(m, kind) for m in module.modules())


# -- the function form ----------------------------------------------------------------------------

def keep_binding(
    fn: Callable[..., Any], keep: tuple[str | int, ...], what: str, *, method: bool = False
) -> tuple[frozenset[int], frozenset[str]]:
    """Bind `keep_dtype` entries to `fn`'s parameters: a name keeps the argument whether it is
    passed by keyword or by position, and so does an index.

    Raises `ValueError` for a name `fn` does not take (unless it takes **kwargs), and for an
    index past its positional parameters (unless it takes *args)."""
    if not keep:
        return frozenset(), frozenset()
    signature = _Signature(fn, method)
    positions: set[int] = set()
    names: set[str] = set()
    for k in keep:
        at, named = signature.index(k, what, keep) if isinstance(k, int) else signature.name(
            k, what, keep)
        positions |= at
        names |= named
    return frozenset(positions), frozenset(names)


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


class _Signature:
    """The parameters of a forward, as `keep_binding` binds names and positions to them (none
    known when it has no signature to read: every entry is taken as given)."""

    def __init__(self, fn: Callable[..., Any], method: bool) -> None:
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            params = []
        if method and params and params[0].kind in _POSITIONAL:
            params = params[1:]  # self
        self.known = bool(params)
        self.positional = [p for p in params if p.kind in _POSITIONAL]
        self.by_name = {p.name: p for p in params if p.kind not in _VARIADIC}
        self.takes_kwargs = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
        self.takes_args = any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params)

    def index(self, k: int, what: str, keep: tuple[str | int, ...]
              ) -> tuple[set[int], set[str]]:
        """A kept position, and the name it may also be passed by."""
        positional = self.positional
        if self.known and not self.takes_args and not -len(positional) <= k < len(positional):
            raise ValueError(
                f"keep_dtype names position {k}, but {what} takes {len(positional)} "
                f"positional argument{'' if len(positional) == 1 else 's'} "
                f"({', '.join(repr(p.name) for p in positional) or 'none'}). Received: "
                f"keep_dtype={keep!r}"
            )
        index = k if k >= 0 else len(positional) + k
        by_name = 0 <= index < len(positional) and (
            positional[index].kind != inspect.Parameter.POSITIONAL_ONLY)
        return {k}, {positional[index].name} if by_name else set()

    def name(self, k: str, what: str, keep: tuple[str | int, ...]
             ) -> tuple[set[int], set[str]]:
        """A kept name, and the position it may also be passed at."""
        param = self.by_name.get(k)
        if param is None:
            if not self.takes_kwargs and self.known:
                raise ValueError(
                    f"keep_dtype names {k!r}, but {what} takes no argument of that name. "
                    f"Valid names: {', '.join(repr(n) for n in self.by_name) or 'none'}. "
                    f"Received: keep_dtype={keep!r}"
                )
            return set(), {k}
        names = {k} if param.kind != inspect.Parameter.POSITIONAL_ONLY else set()
        at = {self.positional.index(param)} if param in self.positional else set()
        return at, names


class RegionObserver(Protocol):
    """Told when a function-form region starts and ends (`audit` charges its ops to it)."""

    def enter_region(self, name: str, policy: Policy) -> None: ...

    def exit_region(self, name: str) -> None: ...


#: the observers `audit` registers while it records; empty otherwise, so a region pays one check
REGION_OBSERVERS: list[RegionObserver] = []


def wrap_function(
    fn: Callable[P, R], policy: Policy, keep: tuple[str | int, ...]
) -> Callable[P, R]:
    """The function form of `precision`: cast in, disable autocast, run, cast back out."""
    qualname = getattr(fn, "__qualname__", "function")
    positions, names = keep_binding(fn, keep, f"function {qualname!r}")
    spec = BoundarySpec(name=qualname, compute=policy.compute, mode="off", exit=policy.output,
                        exit_to_input=policy.output is None, keep_positions=positions,
                        keep_names=names)
    observers = REGION_OBSERVERS

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        watched = bool(observers) and not torch.compiler.is_compiling()
        if watched:
            for observer in observers:
                observer.enter_region(qualname, policy)
        try:
            first = first_floating((args, kwargs))
            if spec.compute is not None:
                args, kwargs = cast_inputs(args, kwargs, spec.compute, positions, names)
            device = device_type_of(first, args, kwargs)
            context = autocast_context("off", device, None)
            with context or _NULL:
                out = fn(*args, **kwargs)
        finally:
            if watched:
                for observer in observers:
                    observer.exit_region(qualname)
        target = spec.target(None if first is None else first.dtype)
        return out if target is None else cast_tree(out, target)

    tag_function(wrapper, policy)
    return wrapper
