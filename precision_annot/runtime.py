"""`apply` and `remove`: make a plan real with storage casts and boundary forwards.

Only boundary modules are touched at run time: each gets its `forward` replaced by a
`Boundary`, which casts inputs at entry (one autograd node), runs the original forward
under the right autocast state, and casts outputs at exit. Everything else runs untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn
from typing_extensions import ParamSpec

from precision_annot.casting import cast_tree, first_floating
from precision_annot.dtypes import dtype_name
from precision_annot.plan import PrecisionPlan
from precision_annot.policy import Policy, SpecLike
from precision_annot.resolution import autocast_mode, resolve

__all__ = ["Boundary", "apply", "forward_depth", "installed_boundaries", "remove", "wrap_function"]

P = ParamSpec("P")
R = TypeVar("R")
M = TypeVar("M", bound=nn.Module)

_STATE_ATTR = "_precision_annot_state"
_local = threading.local()


def forward_depth() -> int:
    """How many applied boundary forwards are running in this thread."""
    depth: int = getattr(_local, "depth", 0)
    return depth


@dataclasses.dataclass(frozen=True)
class BoundarySpec:
    """What one boundary does; fixed at apply time so the hot path only reads it."""

    name: str
    compute: torch.dtype | None
    exit_dtype: torch.dtype | None  # cast outputs to this at exit
    exit_to_input: bool  # else cast outputs back to the first floating input's dtype
    mode: str | None  # "autocast" (compute), "off" (autocast disabled) or None (unchanged)
    keep: tuple[str | int, ...]
    check: bool


@dataclasses.dataclass(frozen=True)
class _AppliedState:
    fingerprint: tuple[str, bool]
    originals: tuple[tuple[str, str, str, torch.dtype], ...]  # module, kind, name, dtype


def _split_kept(
    args: tuple[Any, ...], kwargs: dict[str, Any], keep: tuple[str | int, ...]
) -> tuple[tuple[Any, ...], dict[str, Any], dict[int, Any], dict[str, Any]]:
    kept_args = {}
    for k in keep:
        if isinstance(k, int) and -len(args) <= k < len(args):
            kept_args[k % len(args)] = args[k]
    kept_kwargs = {k: kwargs[k] for k in keep if isinstance(k, str) and k in kwargs}
    args = tuple(None if i in kept_args else a for i, a in enumerate(args))
    kwargs = {k: (None if k in kept_kwargs else v) for k, v in kwargs.items()}
    return args, kwargs, kept_args, kept_kwargs


def _cast_inputs(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dtype: torch.dtype,
    keep: tuple[str | int, ...],
    check: tuple[str, str] | None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if not keep:
        if not kwargs and len(args) == 1:
            return (cast_tree(args[0], dtype, check=check),), kwargs
        return cast_tree((args, kwargs), dtype, check=check)  # type: ignore[no-any-return]
    args, kwargs, kept_args, kept_kwargs = _split_kept(args, kwargs, keep)
    args, kwargs = cast_tree((args, kwargs), dtype, check=check)
    args = tuple(kept_args.get(i, a) for i, a in enumerate(args))
    kwargs.update(kept_kwargs)
    return args, kwargs


_NULL = contextlib.nullcontext()


def _autocast(
    mode: str | None, device_type: str, dtype: torch.dtype | None, compiling: bool
) -> contextlib.AbstractContextManager[Any]:
    """The autocast state a boundary needs; no context at all when it is already in force."""
    if mode is None:
        return _NULL
    if not compiling:  # eager fast path: entering autocast costs ~7 us even when it changes nothing
        enabled = torch.is_autocast_enabled(device_type)
        if mode == "off" and not enabled:
            return _NULL
        if mode == "autocast" and enabled and torch.get_autocast_dtype(device_type) == dtype:
            return _NULL
    if mode == "autocast":
        return torch.autocast(device_type, dtype=dtype, enabled=True)
    return torch.autocast(device_type, enabled=False)


def _device_type(
    first: torch.Tensor | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    module: nn.Module | None = None,
) -> str:
    """The device of the first floating input, else of any tensor argument (token ids count),
    else of the module's weights.

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


def _traced(what: str, name: str, compiling: bool) -> Any:
    """A named profiler range for a boundary cast, only while a profiler is recording."""
    if not compiling and torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(f"precision_annot::{what}[{name}]")
    return _NULL


class Boundary:
    """The forward of one boundary module: cast in, set autocast, run, cast out.

    It replaces the module's `forward` as an instance attribute, so it costs nothing
    elsewhere, survives `copy.deepcopy` and pickling, and `remove` restores the original.
    """

    def __init__(
        self,
        module: nn.Module,
        spec: BoundarySpec,
        upcast: tuple[tuple[nn.Module, str], ...],
        inner: Callable[..., Any] | None,
    ) -> None:
        self.module = module
        self.spec = spec
        self.upcast = upcast
        self.inner = inner

    def __repr__(self) -> str:
        s = self.spec
        return (f"Boundary({s.name or '(root)'!r}, compute={dtype_name(s.compute)}, "
                f"mode={s.mode}, exit={dtype_name(s.exit_dtype)})")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        spec = self.spec
        compiling = torch.compiler.is_compiling()
        check_in = (spec.name, "entry") if spec.check and not compiling else None
        # the first floating input gives the autocast device and the exit dtype; skip the walk
        # for boundaries that need neither
        first = None
        if spec.mode is not None or spec.exit_to_input:
            first = first_floating(args[0]) if len(args) == 1 and not kwargs else (
                first_floating((args, kwargs))
            )
        device_type = _device_type(first, args, kwargs, self.module)
        if spec.compute is not None:
            with _traced("cast_inputs", spec.name, compiling):
                args, kwargs = _cast_inputs(args, kwargs, spec.compute, spec.keep, check_in)
        if not compiling:
            _local.depth = getattr(_local, "depth", 0) + 1
        try:
            with _autocast(spec.mode, device_type, spec.compute, compiling):
                out = self._run(args, kwargs)
        finally:
            if not compiling:
                _local.depth -= 1
        target = spec.exit_dtype
        if target is None and spec.exit_to_input and first is not None:
            target = first.dtype
        if target is None:
            return out
        check_out = (spec.name, "exit") if spec.check and not compiling else None
        with _traced("cast_outputs", spec.name, compiling):
            return cast_tree(out, target, check=check_out)

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        compute = self.spec.compute
        saved = []
        for owner, pname in self.upcast:  # compute wider than storage: upcast for the forward
            p = owner._parameters[pname]
            if p is not None and p.dtype != compute:
                saved.append((owner, pname, p))
                owner._parameters[pname] = p.to(compute)  # type: ignore[assignment]
        try:
            if self.inner is None:
                return type(self.module).forward(self.module, *args, **kwargs)
            return self.inner(*args, **kwargs)
        finally:
            for owner, pname, p in saved:
                owner._parameters[pname] = p


class ReprSuffix:
    """An applied module's `extra_repr`: its own, then its policy, so `print(model)` shows it.

    Boundaries are marked with `*`. It is an instance attribute, not a hook: no run-time cost.
    """

    def __init__(self, module: nn.Module, text: str, inner: Callable[[], str] | None) -> None:
        self.module = module
        self.text = text
        self.inner = inner

    def __call__(self) -> str:
        own = self.inner() if self.inner is not None else type(self.module).extra_repr(self.module)
        return f"{own}, precision={self.text}" if own else f"precision={self.text}"


def wrap_function(
    fn: Callable[P, R], policy: Policy, keep: tuple[str | int, ...]
) -> Callable[P, R]:
    """The function form of `precision`: cast in, disable autocast, run, cast back out."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        first = first_floating((args, kwargs))
        if policy.compute is not None:
            args, kwargs = _cast_inputs(args, kwargs, policy.compute, keep, None)
        with torch.autocast(_device_type(first, args, kwargs), enabled=False):
            out = fn(*args, **kwargs)
        target = policy.output or (first.dtype if first is not None else None)
        return out if target is None else cast_tree(out, target)

    wrapper.__precision_annot_policy__ = policy  # type: ignore[attr-defined]
    return wrapper


def _check_matches(plan: PrecisionPlan, named: dict[str, nn.Module]) -> None:
    missing = [n for n in plan if n not in named]
    extra = [n for n in named if n not in plan]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"modules in the plan but not in the model: {missing[:8]}")
        if extra:
            parts.append(f"modules in the model but not in the plan: {extra[:8]}")
        raise ValueError(
            f"This plan was made for another model ({plan.model_type or 'unknown'}): "
            + "; ".join(parts)
        )
    for name, module in named.items():
        expected = plan[name].type
        # a wrapper's dynamic subclass (FSDP2's FSDPLinear) still matches its planned class
        lineage = {f"{c.__module__}.{c.__qualname__}" for c in type(module).__mro__}
        if expected not in lineage:
            actual = f"{type(module).__module__}.{type(module).__qualname__}"
            raise ValueError(
                f"This plan was made for another model: module {name or '(root)'!r} is "
                f"{actual} here but {expected} in the plan."
            )


def _cast_storage(
    plan: PrecisionPlan, named: dict[str, nn.Module]
) -> list[tuple[str, str, str, torch.dtype]]:
    originals: list[tuple[str, str, str, torch.dtype]] = []
    for name, module in named.items():
        storage = plan[name].policy.storage
        if storage is None:
            continue
        for pname, p in module._parameters.items():
            if p is not None and p.is_floating_point() and p.dtype != storage:
                originals.append((name, "param", pname, p.dtype))
                with torch.no_grad():
                    p.data = p.data.to(storage)
                    if p.grad is not None:
                        p.grad = p.grad.to(storage)
        for bname, b in module._buffers.items():
            if b is not None and b.is_floating_point() and b.dtype != storage:
                originals.append((name, "buffer", bname, b.dtype))
                module._buffers[bname] = b.to(storage)
    return originals


def _boundary_specs(
    plan: PrecisionPlan, named: dict[str, nn.Module], check: bool
) -> dict[str, tuple[BoundarySpec, tuple[tuple[nn.Module, str], ...]]]:
    region: dict[str, str | None] = {}
    members: dict[str, list[str]] = {}
    for name in named:
        parent = name.rpartition(".")[0] if name else None
        region[name] = name if plan[name].boundary else (
            region[parent] if parent is not None else None
        )
        owner = region[name]
        if owner is not None:
            members.setdefault(owner, []).append(name)
    out = {}
    for name in plan.boundaries:
        entry = plan[name]
        policy = entry.policy
        parent_policy = plan[name.rpartition(".")[0]].policy if name else None
        if policy.output is not None:
            exit_dtype, exit_to_input = policy.output, False
        elif parent_policy is not None and parent_policy.compute is not None:
            exit_dtype, exit_to_input = parent_policy.compute, False
        else:
            exit_dtype = None
            exit_to_input = parent_policy is not None and policy.compute is not None
        spec = BoundarySpec(
            name=name,
            compute=policy.compute,
            exit_dtype=exit_dtype,
            exit_to_input=exit_to_input,
            mode=autocast_mode(policy),
            keep=entry.keep_dtype,
            check=check,
        )
        upcast: list[tuple[nn.Module, str]] = []
        if spec.mode == "off" and policy.compute is not None:
            for member in members.get(name, []):
                storage = plan[member].policy.storage
                for pname, p in named[member]._parameters.items():
                    if p is None or not p.is_floating_point():
                        continue
                    if (storage or p.dtype) != policy.compute:
                        upcast.append((named[member], pname))
        out[name] = (spec, tuple(upcast))
    return out


def apply(
    model: M,
    plan: PrecisionPlan | None = None,
    *,
    default: SpecLike | None = None,
    check_finite: bool = False,
) -> M:
    """Make a precision plan real on `model`, in place.

    Parameters and floating buffers are cast to their module's storage dtype; each boundary
    module's forward casts floating inputs to its compute dtype at entry (one autograd node),
    runs under autocast (compute below storage), with autocast disabled (compute at or above
    storage, parameters upcast as needed), and casts outputs at exit to `output`, else to the
    parent's compute dtype. Non-boundary modules are not touched. `apply` is idempotent and
    `remove` undoes it.

    Args:
        model: the module tree.
        plan: a plan from `resolve` or `PrecisionPlan.from_json`; resolved from `model` when
            None. (Default: None)
        default: the root's defaults, used only when `plan` is None. (Default: None)
        check_finite: raise `FloatingPointError` naming the module and the direction when a
            non-finite value crosses a boundary; for debugging: it syncs, and it is skipped
            inside `torch.compile`. (Default: False)

    Returns:
        `model`.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from precision_annot import apply, precision, fp32
        >>> model = nn.Sequential(nn.Linear(4, 4), precision(fp32)(nn.LayerNorm(4)))
        >>> _ = apply(model, default="bf16")
        >>> model(torch.randn(2, 4)).dtype
        torch.bfloat16
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"apply expects an nn.Module. Received: model={model!r} "
            f"(of type {type(model).__name__})"
        )
    if plan is None:
        plan = resolve(model, default)
    elif default is not None:
        raise ValueError(
            "apply got both plan= and default=; default is only used to resolve a plan. "
            "Pass default to resolve(model, default=...) instead."
        )
    elif not isinstance(plan, PrecisionPlan):
        raise TypeError(
            "plan must be a PrecisionPlan from resolve() or PrecisionPlan.from_json(). "
            f"Received: plan={plan!r} (of type {type(plan).__name__})"
        )
    if not isinstance(check_finite, bool):
        raise TypeError(f"check_finite must be a bool. Received: check_finite={check_finite!r}")
    named = dict(model.named_modules())
    _check_matches(plan, named)
    fingerprint = (_semantics(plan), check_finite)
    state: _AppliedState | None = model.__dict__.get(_STATE_ATTR)
    if state is not None:
        if state.fingerprint == fingerprint:
            return model
        remove(model)
    _strip_boundaries(model)
    originals = _cast_storage(plan, named)
    for name, (spec, upcast) in _boundary_specs(plan, named, check_finite).items():
        module = named[name]
        module.__dict__["forward"] = Boundary(module, spec, upcast, module.__dict__.get("forward"))
    for name, module in named.items():
        entry = plan[name]
        if not entry.policy.is_empty():
            text = str(entry.policy) + ("*" if entry.boundary else "")
            module.__dict__["extra_repr"] = ReprSuffix(module, text,
                                                       module.__dict__.get("extra_repr"))
    object.__setattr__(model, _STATE_ATTR, _AppliedState(fingerprint, tuple(originals)))
    return model


def _semantics(plan: PrecisionPlan) -> str:
    """What makes two plans apply the same way: policies, kept arguments and boundaries."""
    return "|".join(
        f"{n}:{e.policy}:{e.keep_dtype}:{e.boundary}" for n, e in plan.items()
    )


def _strip_boundaries(model: nn.Module) -> None:
    """Put back each module's own `forward` and `extra_repr` (or the ones it had before)."""
    for module in model.modules():
        for attr, kind in (("forward", Boundary), ("extra_repr", ReprSuffix)):
            installed = module.__dict__.get(attr)
            if isinstance(installed, kind):
                if installed.inner is None:
                    del module.__dict__[attr]
                else:
                    module.__dict__[attr] = installed.inner


def installed_boundaries(model: nn.Module) -> list[str]:
    """Names of the modules whose forward is a `Boundary` now."""
    return [n for n, m in model.named_modules() if isinstance(m.__dict__.get("forward"), Boundary)]


def remove(model: M) -> M:
    """Undo `apply`: no boundary is left, and each parameter and buffer gets its old dtype back.

    Example:
        >>> from torch import nn
        >>> from precision_annot import apply, remove
        >>> model = remove(apply(nn.Linear(2, 2), default="bf16"))
        >>> model.weight.dtype
        torch.float32
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"remove expects an nn.Module. Received: model={model!r} "
            f"(of type {type(model).__name__})"
        )
    _strip_boundaries(model)
    state: _AppliedState | None = model.__dict__.pop(_STATE_ATTR, None)
    if state is None:
        return model
    named = dict(model.named_modules())
    for name, kind, tname, dtype in state.originals:
        module = named.get(name)
        if module is None:
            continue
        if kind == "param":
            p = module._parameters.get(tname)
            if p is not None:
                with torch.no_grad():
                    p.data = p.data.to(dtype)
                    if p.grad is not None:
                        p.grad = p.grad.to(dtype)
        else:
            b = module._buffers.get(tname)
            if b is not None:
                module._buffers[tname] = b.to(dtype)
    return model
