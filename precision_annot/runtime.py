"""`apply` and `remove`: make a plan real with storage casts and boundary forwards.

`apply` works out the whole target state first (each tensor's dtype, each boundary's
`BoundarySpec`, the tensors each boundary sees in its compute dtype), compares it with what
the model holds now, and only then changes the model. Nothing is changed when the plan is
already real, and a failure while preparing leaves the model as it was.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from precision_annot.boundary import (
    Boundary,
    BoundarySpec,
    CastingDict,
    Planned,
    Region,
    keep_binding,
)
from precision_annot.dtypes import dtype_name, wider
from precision_annot.guards import require_module, require_plan
from precision_annot.plan import ModulePlan, PrecisionPlan, nearest
from precision_annot.policy import SpecLike, autocast_mode
from precision_annot.resolution import is_container, resolve

__all__ = ["apply", "applied_plan", "check_matches", "find_boundary", "installed_boundaries",
           "remove"]

M = TypeVar("M", bound=nn.Module)

_STATE_ATTR = "_precision_annot_state"
_REPLICATE = "_replicate_for_data_parallel"

Key = tuple[str, str, str]  # module name, "param" | "buffer", tensor name


@dataclasses.dataclass
class AppliedState:
    """What `apply` left on the model's root: the plan, and each floating tensor's dtype before
    the first `apply`, so that `remove` can give it back."""

    plan: PrecisionPlan
    check: bool
    originals: dict[Key, torch.dtype]


@dataclasses.dataclass
class _Install:
    spec: BoundarySpec
    region: Region | None
    planned: tuple[Planned, ...]


@dataclasses.dataclass
class _Layout:
    """The target state of one apply."""

    casts: list[tuple[Key, nn.Module, torch.Tensor, torch.dtype]]
    current: dict[Key, torch.dtype]  # every floating tensor's dtype now
    boundaries: dict[str, _Install]
    casting_dicts: dict[tuple[str, str], tuple[Region, frozenset[str]]]
    reprs: dict[str, str]


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


class Replicate:
    """`module._replicate_for_data_parallel` for an applied module: the replica that
    `nn.DataParallel` makes runs its own boundary, not the original module's."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self) -> nn.Module:
        # NOTE: torch's replicate() calls this private method on each module; the replica
        # shares the original's __dict__ entries, so the boundary must be rebound to it.
        module = self.module
        replica: nn.Module = type(module)._replicate_for_data_parallel(module)  # type: ignore[no-untyped-call]
        forward = replica.__dict__.get("forward")
        if isinstance(forward, Boundary):
            replica.__dict__["forward"] = forward.rebound(replica)
        text = replica.__dict__.get("extra_repr")
        if isinstance(text, ReprSuffix):
            replica.__dict__["extra_repr"] = ReprSuffix(replica, text.text, text.inner)
        replica.__dict__[_REPLICATE] = Replicate(replica)
        return replica


# -- finding what is installed --------------------------------------------------------------------

def find_boundary(module: nn.Module) -> tuple[Boundary | None, bool]:
    """The `Boundary` this module's forward runs, and whether it is the forward itself (True) or
    buried under another library's wrapper (Accelerate's autocast, `functools.wraps`)."""
    forward = module.__dict__.get("forward")
    if isinstance(forward, Boundary):
        return forward, True
    seen = 0
    while forward is not None and seen < 32:
        seen += 1
        if isinstance(forward, Boundary):
            return (forward, False) if forward.module is module else (None, False)
        nxt = getattr(forward, "__wrapped__", None) or getattr(forward, "__func__", None)
        if nxt is None:
            closure = getattr(forward, "__closure__", None) or ()
            nxt = next((c.cell_contents for c in closure
                        if isinstance(getattr(c, "cell_contents", None), Boundary)), None)
        forward = nxt
    return None, False


def installed_boundaries(model: nn.Module) -> list[str]:
    """Names of the modules whose forward runs an active `Boundary`, even one that another
    library has wrapped since."""
    return [n for n, m in model.named_modules() if (b := find_boundary(m)[0]) and b.active]


def applied_plan(model: nn.Module) -> PrecisionPlan | None:
    """The plan `apply` last made real on `model`, or None."""
    state: AppliedState | None = model.__dict__.get(_STATE_ATTR)
    if state is None:
        return None
    if state.plan.module("") is not model:  # a copy or an unpickled model: bind to this one
        named = dict(model.named_modules())
        if all(n in named for n in state.plan):
            state.plan = state.plan.bound_to(named)
    return state.plan


# -- the target state -----------------------------------------------------------------------------

def check_matches(plan: PrecisionPlan, named: dict[str, nn.Module]) -> None:
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


def _for_model(plan: PrecisionPlan, named: dict[str, nn.Module]) -> PrecisionPlan:
    """The plan with each module's container flag read from the model itself, so boundaries
    follow what really runs (a hand-edited plan file cannot turn a boundary off)."""
    fixed = {n: e if e.container == is_container(named[n]) else
             dataclasses.replace(e, container=is_container(named[n])) for n, e in plan.items()}
    if all(fixed[n] is plan[n] for n in plan):
        return plan
    return PrecisionPlan(fixed, default=plan.default, model_type=plan.model_type,
                         modules=plan.modules())


def _forward_of(module: nn.Module) -> tuple[Callable[..., Any], bool]:
    """The forward a boundary on `module` wraps, and whether it still takes `self`."""
    own = module.__dict__.get("forward")
    if own is not None and not isinstance(own, Boundary):
        return own, False
    return type(module).forward, True


def _exit(entry: ModulePlan, context: ModulePlan | None) -> tuple[torch.dtype | None, bool]:
    """Runtime rule 4: `output` if set, else the caller's compute, else the input's dtype;
    a top-level module's outputs are left as computed."""
    if entry.policy.output is not None:
        return entry.policy.output, False
    if context is None:
        return None, False
    if context.policy.compute is not None:
        return context.policy.compute, False
    return None, entry.policy.compute is not None


def _layout(plan: PrecisionPlan, named: dict[str, nn.Module], check: bool) -> _Layout:
    casts: list[tuple[Key, nn.Module, torch.Tensor, torch.dtype]] = []
    current: dict[Key, torch.dtype] = {}
    planned_dtype: dict[Key, torch.dtype] = {}
    for name, module in named.items():
        storage = plan[name].policy.storage
        for pname, p in module._parameters.items():
            if p is None or not p.is_floating_point():
                continue
            target = storage or p.dtype
            key = (name, "param", pname)
            current[key], planned_dtype[key] = p.dtype, target
            if p.dtype != target:
                casts.append((key, module, p, target))
        for bname, b in module._buffers.items():
            if b is None or not b.is_floating_point():
                continue
            persistent = bname not in module._non_persistent_buffers_set
            target = storage if storage is not None and persistent else b.dtype
            key = (name, "buffer", bname)
            current[key], planned_dtype[key] = b.dtype, target
            if b.dtype != target:
                casts.append((key, module, b, target))

    checked_root = {""} if check and not plan.root.container else set()
    owner = nearest(named, set(plan.boundaries) | checked_root)
    boundaries: dict[str, _Install] = {}
    for name, module in named.items():
        entry = plan[name]
        if entry.container and entry.keep_dtype:
            warnings.warn(f"keep_dtype={entry.keep_dtype} on {name or '(root)'!r} is ignored: "
                          f"{type(module).__name__} has no forward of its own, so nothing "
                          "passes through it.", UserWarning, stacklevel=3)
    members: dict[str, list[str]] = {}
    for name in named:
        if owner[name] is not None:
            members.setdefault(owner[name], []).append(name)  # type: ignore[arg-type]

    casting_dicts: dict[tuple[str, str], tuple[Region, frozenset[str]]] = {}
    for name, names in members.items():
        entry = plan[name]
        policy = entry.policy
        exit_dtype, exit_to_input = _exit(entry, plan.context(name))
        forward, method = _forward_of(named[name])
        positions, kept = keep_binding(forward, entry.keep_dtype,
                                       f"the forward of {name or '(root)'!r}", method=method)
        mode = autocast_mode(policy) if entry.boundary else None
        spec = BoundarySpec(
            name=name,
            compute=policy.compute if entry.boundary else None,
            mode=mode,
            exit=exit_dtype if entry.boundary else None,
            exit_to_input=exit_to_input and entry.boundary,
            keep_positions=positions,
            keep_names=kept,
            check=check,
        )
        prefix = f"{name}." if name else ""
        planned = tuple(
            Planned(member.removeprefix(prefix) if member != name else "", kind, tname, dtype)
            for (member, kind, tname), dtype in planned_dtype.items() if member in names
        )
        region = None
        if mode == "off" and policy.compute is not None:
            region_members = []
            compute = policy.compute
            probe = Region(compute, ())
            for member in names:
                module = named[member]
                path = member.removeprefix(prefix) if member != name else ""
                non_persistent = frozenset(module._non_persistent_buffers_set)
                for kind, store in (("param", module._parameters), ("buffer", module._buffers)):
                    for tname, t in store.items():
                        if t is None or not t.is_floating_point():
                            continue
                        upcast_only = kind == "buffer" and tname in non_persistent
                        dtype = planned_dtype[(member, kind, tname)]
                        if probe.needs(torch.empty(0, dtype=dtype), upcast_only):
                            region_members.append((path, kind, tname, upcast_only))
            if region_members:
                region = Region(compute, tuple(region_members))
                for path, kind, _, _ in region_members:
                    member = f"{prefix}{path}" if path else name
                    casting_dicts[(member, kind)] = (
                        region, frozenset(named[member]._non_persistent_buffers_set)
                        if kind == "buffer" else frozenset())
        boundaries[name] = _Install(spec, region, planned)

    reprs = {}
    for name, entry in plan.items():
        if not entry.policy.is_empty():
            reprs[name] = str(entry.policy) + ("*" if entry.boundary else "")
    return _Layout(casts, current, boundaries, casting_dicts, reprs)


def _is_real(model: nn.Module, named: dict[str, nn.Module], layout: _Layout) -> bool:
    """True when the model already holds exactly this target state."""
    if layout.casts:
        return False
    for name, module in named.items():
        boundary = find_boundary(module)[0]
        want = layout.boundaries.get(name)
        if want is None:
            if boundary is not None and boundary.active:
                return False
            continue
        if boundary is None or boundary.spec != want.spec or boundary.planned != want.planned:
            return False
        if (boundary.region is None) != (want.region is None) or (
            boundary.region is not None and want.region is not None
            and (boundary.region.compute, boundary.region.members)
            != (want.region.compute, want.region.members)
        ):
            return False
        for kind in ("param", "buffer"):
            store = module.__dict__["_parameters" if kind == "param" else "_buffers"]
            wanted = layout.casting_dicts.get((name, kind))
            if isinstance(store, CastingDict) != (wanted is not None):
                return False
    return all(isinstance(m.__dict__.get("extra_repr"), ReprSuffix) == (n in layout.reprs)
               for n, m in named.items())


# -- changing the model ---------------------------------------------------------------------------

def _strip(model: nn.Module) -> None:
    """Take every boundary, casting dict, repr suffix and replica hook off the tree."""
    for module in model.modules():
        boundary, direct = find_boundary(module)
        if boundary is not None:
            if direct:
                if boundary.inner is None:
                    del module.__dict__["forward"]
                else:
                    module.__dict__["forward"] = boundary.inner
            else:
                boundary.configure(None, None, ())  # wrapped by another library: pass through
        text = module.__dict__.get("extra_repr")
        if isinstance(text, ReprSuffix):
            if text.inner is None:
                del module.__dict__["extra_repr"]
            else:
                module.__dict__["extra_repr"] = text.inner
        if isinstance(module.__dict__.get(_REPLICATE), Replicate):
            del module.__dict__[_REPLICATE]
        for attr in ("_parameters", "_buffers"):
            store = module.__dict__.get(attr)
            if isinstance(store, CastingDict):
                module.__dict__[attr] = dict(store.items())


def _set_dtype(module: nn.Module, kind: str, name: str, tensor: torch.Tensor,
               value: torch.Tensor) -> None:
    """Give a parameter (same object, new data) or buffer (new tensor) a cast value."""
    if kind == "param":
        with torch.no_grad():
            tensor.data = value
            if tensor.grad is not None:
                tensor.grad = tensor.grad.to(value.dtype)
    else:
        module._buffers[name] = value


def _warn_rounded_again(originals: dict[Key, torch.dtype],
                        prepared: list[tuple[Key, nn.Module, torch.Tensor, torch.Tensor]]) -> None:
    """A tensor stored narrower than it was before the first apply (by an earlier plan, or a
    `model.half()` since), cast to another dtype now, is cast from its narrowed values: the new
    dtype does not bring back the bits dropped before."""
    rounded = [(key, tensor.dtype, value.dtype) for key, _, tensor, value in prepared
               if key in originals and wider(originals[key], tensor.dtype)]
    if not rounded:
        return
    (name, _, tname), now, target = rounded[0]
    first = f"{name}.{tname}" if name else tname
    warnings.warn(
        f"apply: {len(rounded)} tensor(s) stored narrower than before the first apply "
        f"({dtype_name(originals[rounded[0][0]])}) are cast from their current values (e.g. "
        f"{first!r}: {dtype_name(now)} -> {dtype_name(target)}), so they keep the rounding of "
        f"{dtype_name(now)}. To start from the full values, remove(model), load the original "
        "weights again (model.load_state_dict), then apply.", UserWarning, stacklevel=3)


def _absorb_nested(model: nn.Module) -> dict[Key, torch.dtype]:
    """Originals recorded by earlier applies on this model or its submodules, as this model's
    names; their states are dropped, since this apply now owns the tree."""
    originals: dict[Key, torch.dtype] = {}
    for name, module in model.named_modules():
        state: AppliedState | None = module.__dict__.pop(_STATE_ATTR, None)
        if state is None:
            continue
        prefix = f"{name}." if name else ""
        for (mname, kind, tname), dtype in state.originals.items():
            full = f"{prefix}{mname}" if mname else name
            originals.setdefault((full, kind, tname), dtype)
    return originals


def apply(
    model: M,
    plan: PrecisionPlan | None = None,
    *,
    default: SpecLike | None = None,
    check_finite: bool = False,
) -> M:
    """Make a precision plan real on `model`, in place.

    Parameters and persistent floating buffers are cast to their module's storage dtype
    (non-persistent buffers, such as rotary tables, keep the dtype they were built in). Each
    boundary module's forward casts floating inputs to its compute dtype at entry, runs under
    autocast (compute below storage) or with autocast disabled (its tensors seen in the compute
    dtype where they differ), and casts outputs at exit to `output`, else to the caller's
    compute dtype. Modules that are not boundaries are not touched.

    Call it before building the optimizer: it changes the dtype of parameters, and an
    optimizer that already holds state for them keeps that state in the old dtype.

    `apply` is idempotent and atomic: when the plan is already real nothing changes, and on
    any error the model is left as it was. Call it again after `model.half()`,
    `model.to(dtype)` or `load_state_dict(assign=True)` to restore the plan. `remove` undoes it.

    Args:
        model: the module tree.
        plan: a plan from `resolve` or `PrecisionPlan.from_json`; resolved from `model` when
            None. (Default: None)
        default: the root's defaults, used only when `plan` is None. (Default: None)
        check_finite: raise `FloatingPointError` naming the module and the direction when a
            non-finite value crosses a boundary or leaves the root; for debugging: it syncs,
            and it is skipped inside `torch.compile`. (Default: False)

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
    require_module(model, "apply")
    if plan is None:
        plan = resolve(model, default)
    elif default is not None:
        raise ValueError(
            "apply got both plan= and default=; default is only used to resolve a plan. "
            "Pass default to resolve(model, default=...) instead."
        )
    else:
        require_plan(plan, "apply")
    if not isinstance(check_finite, bool):
        raise TypeError(f"check_finite must be a bool. Received: check_finite={check_finite!r}")
    named = dict(model.named_modules())
    check_matches(plan, named)
    plan = _for_model(plan, named)
    layout = _layout(plan, named, check_finite)
    state: AppliedState | None = model.__dict__.get(_STATE_ATTR)
    if (state is not None and state.plan == plan and state.check == check_finite
            and _is_real(model, named, layout)):
        return model

    # Prepare everything that can fail (the casts) before changing anything.
    prepared = [(key, module, tensor, tensor.to(dtype)) for key, module, tensor, dtype in
                layout.casts]

    originals = _absorb_nested(model)
    _warn_rounded_again(originals, prepared)
    for key, dtype in layout.current.items():  # kept from the first apply, if there was one
        originals.setdefault(key, dtype)
    _strip(model)
    for key, module, tensor, value in prepared:
        _set_dtype(module, key[1], key[2], tensor, value)
    for (name, kind), (region, upcast_only) in layout.casting_dicts.items():
        attr = "_parameters" if kind == "param" else "_buffers"
        module = named[name]
        module.__dict__[attr] = CastingDict(dict(module.__dict__[attr]), region,
                                            upcast_only if kind == "buffer" else frozenset())
    for name, install in layout.boundaries.items():
        module = named[name]
        boundary, direct = find_boundary(module)
        if boundary is not None and not direct:
            boundary.configure(install.spec, install.region, install.planned)
        else:
            module.__dict__["forward"] = Boundary(
                module, install.spec, inner=module.__dict__.get("forward"),
                region=install.region, planned=install.planned,
            )
        module.__dict__[_REPLICATE] = Replicate(module)
    for name, text in layout.reprs.items():
        module = named[name]
        module.__dict__["extra_repr"] = ReprSuffix(module, text, module.__dict__.get("extra_repr"))
    object.__setattr__(model, _STATE_ATTR, AppliedState(plan, check_finite, originals))
    return model


def remove(model: M) -> M:
    """Undo `apply`: no boundary is left, and each parameter and buffer gets its old dtype back.

    It sees through other libraries' forward wrappers (Accelerate's), and undoes applies made
    on submodules too.

    Example:
        >>> from torch import nn
        >>> from precision_annot import apply, remove
        >>> model = remove(apply(nn.Linear(2, 2), default="bf16"))
        >>> model.weight.dtype
        torch.float32
    """
    require_module(model, "remove")
    originals = _absorb_nested(model)
    _strip(model)
    named = dict(model.named_modules())
    for (name, kind, tname), dtype in originals.items():
        module = named.get(name)
        if module is None:
            continue
        store = module._parameters if kind == "param" else module._buffers
        tensor = store.get(tname)
        if tensor is not None and tensor.dtype != dtype:
            _set_dtype(module, kind, tname, tensor, tensor.detach().to(dtype))
    return model
