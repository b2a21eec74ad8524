"""`apply` and `remove`: install what `compile_plan` says runs, and take it off again.

`apply` compiles the plan into an `Execution` (each tensor's dtype, each boundary and entry
guard), compares it with what the model holds now, and only then changes the model: nothing
is changed when the plan is already real, and a failure while preparing leaves the model as it
was. What it leaves on each module is kept by one `ModuleState` per module, the only code that
writes to a module's `__dict__`, `_parameters` and `_buffers`; the model's root keeps the
`AppliedState`: the plan, the execution, and each tensor's dtype before the first `apply`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from precision_annot._src import float8, grads, recompute
from precision_annot._src.arithmetic import (
    Arithmetic,
    ArithmeticForward,
    ModuleGemms,
    runs_linear_forward,
)
from precision_annot._src.boundary import (
    Boundary,
    CastingDict,
    Region,
    forward_state_restorer,
    get_tensor,
    set_tensor,
)
from precision_annot._src.checkpoints.loading import narrowed, warn_narrowed
from precision_annot._src.dtypes import dtype_name, wider
from precision_annot._src.execution import Execution, Key, Kind, Site, compile_plan
from precision_annot._src.guards import paused_gc, require_module, require_plan, warn
from precision_annot._src.plan import PrecisionPlan
from precision_annot._src.policy import SpecLike
from precision_annot._src.resolution import capture, is_container, resolve
from precision_annot._src.update import guard
from precision_annot._src.wrappers import unwrap

__all__ = ["AppliedState", "ModuleState", "Subject", "apply", "applied_plan", "check_matches",
           "find_boundary", "installed_boundaries", "plan_of", "remove", "subject"]

M = TypeVar("M", bound=nn.Module)

_STATE_ATTR = "_precision_annot_state"
_REPLICATE = "_replicate_for_data_parallel"
_SCRIPT = "__prepare_scriptable__"


@dataclasses.dataclass(eq=False)
class AppliedState:
    """What `apply` keeps on the model's root: the plan, what it compiled to, and each
    floating tensor's dtype before the first `apply`, so that `remove` can give it back. Its
    identity marks the model's forward for the entry guards."""

    plan: PrecisionPlan
    execution: Execution
    originals: dict[Key, torch.dtype]
    drift_warned: bool = False
    resolved: bool = True  # the plan was resolved from the annotations, not given
    # set while torch.compile traces the model's forward: the entry guards inside it then
    # trace as the pass-through they are there (eager code reads a thread-local instead, which
    # Dynamo cannot trace)
    tracing: bool = False
    # the parameters whose gradients accumulate wider than they are stored (grad=fp32)
    wide: grads.WideGrads | None = None
    # the module a `load_state_dict` under way was called on (the model or a submodule), with
    # what it hands each parameter below it: the optimizers' masters restart from it
    loading: tuple[nn.Module, dict[torch.Tensor, torch.Tensor]] | None = None

    def warn_drift(self, where: str, planned: torch.dtype, now: torch.dtype, how: str) -> None:
        """Say once per apply that tensors left their planned dtypes."""
        if self.drift_warned:
            return
        self.drift_warned = True
        warn(
            f"{how} changed tensors of an applied model away from the plan (first: {where!r} "
            f"is {dtype_name(now)}, planned {dtype_name(planned)}). Its boundaries still cast "
            "their inputs as planned, so these tensors now compute and are updated in the new "
            "dtype, and an op that needs its input and weight in one dtype (LayerNorm, Linear) "
            "raises a DriftError. Call "
            "precision_annot.apply(model, plan) again to restore the plan (or "
            "precision_annot.remove(model) first to run without it).")

    def before_load(self, model: nn.Module, state_dict: Mapping[str, Any], prefix: str,
                    *args: Any) -> None:
        """`load_state_dict` pre hook: name the tensors the checkpoint holds narrower than the
        plan keeps them (their precision is gone before the load)."""
        keys = {key: f"{prefix}{key[0]}.{key[2]}" if key[0] else f"{prefix}{key[2]}"
                for key, target in self.execution.targets.items() if target.persistent}
        planned = {keys[key]: self.execution.targets[key].dtype for key in keys}
        found = narrowed(planned, (
            (k, v.dtype) for k, v in state_dict.items() if isinstance(v, torch.Tensor)))
        defer = DEFER_NARROWED.get(model)  # type: ignore[no-untyped-call]
        if found and defer is not None and defer(found):
            return  # a schedule's: the optimizer's checkpoint may hold the phase and masters
        warn_narrowed("load_state_dict", found, stacklevel=3)

    def before_load_masters(self, module: nn.Module, state_dict: Mapping[str, Any],
                            prefix: str, *args: Any) -> None:
        """`load_state_dict` pre hook of the model and each submodule: the module the load was
        called on (given an empty prefix, or, through a wrapper, the first one reached) notes
        what it hands each parameter below it; the modules the load reaches through it leave
        it alone."""
        if prefix and self.loading is not None:
            return
        given: dict[torch.Tensor, torch.Tensor] = {
            p: value for name, p in module.named_parameters()
            if isinstance(value := state_dict.get(f"{prefix}{name}"), torch.Tensor)}
        self.loading = (module, given)

    def after_load_masters(self, module: nn.Module, incompatible: Any) -> None:
        """`load_state_dict` post hook of the model and each submodule: the planned
        optimizers' masters of the parameters the load gave values start from them (the
        checkpoint's own), so that the next step does not write the old masters back over
        the loaded weights."""
        held = self.loading
        if held is None or held[0] is not module:
            return
        self.loading = None
        if held[1]:
            guard.loaded(held[1])

    def after_load(self, model: nn.Module, incompatible: Any) -> None:
        """`load_state_dict` post hook: `assign=True` puts the checkpoint's own tensors in the
        model, in the checkpoint's dtypes; each goes back to its planned dtype (the same
        parameter object, its data cast), new parameters accumulate their gradients in the
        plan's dtype, and the step guard learns the new parameters."""
        named = dict(model.named_modules())
        moved = False
        cast: dict[tuple[Any, ...], torch.Tensor] = {}  # one cast per tensor the load gave
        for (name, kind, tname), target in self.execution.targets.items():
            module = named.get(name)
            tensor = None if module is None else get_tensor(module, kind, tname)
            if module is not None and tensor is not None and tensor.dtype != target.dtype:
                key = (*_view(tensor), target.dtype)
                if key not in cast:
                    cast[key] = tensor.detach().to(target.dtype)
                state = ModuleState.of(module) or ModuleState(module, name)
                state.cast(kind, tname, cast[key])
                moved = True
        for held in filter(None, map(ModuleState.of, named.values())):
            moved = held.rewrap_loaded_weight() or moved
        if self.wide is not None:
            self.wide.bind(model)
        if moved or any(guard.planned(p) is None for p in model.parameters()):
            # (new parameters: `assign=True`, or made since apply, as `to_empty` makes them;
            # the masters made for them, and the values kept for those, follow the plan)
            guard.note([], guard.planned_updates(self.plan, named))


#: per model, a callable a `precision_annot.schedule` sets, handed the tensors a load gives
#: narrower than the plan keeps them, which returns True when it says so itself, later
DEFER_NARROWED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _view(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What makes two tensors one view of one storage (the tensors `assign=True` puts in tied
    or shared places), so that each is cast once and the cast ones still share their storage,
    as the loaded ones did; a tensor without storage (meta, a subclass) is itself."""
    try:
        if tensor.device.type != "meta" and type(tensor) in (torch.Tensor, nn.Parameter):
            return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
                    tuple(tensor.shape), tuple(tensor.stride()))
    except (RuntimeError, NotImplementedError):
        pass
    return (id(tensor),)


def _set_data(param: torch.Tensor, value: torch.Tensor) -> None:
    """`param.data = value`, and the parameter stays the same object: an optimizer's state,
    its hooks, its `grad_dtype` and weak references to it stay with it.

    A tensor subclass that wraps inner tensors (a DTensor, under tensor parallelism or FSDP2)
    holds them, and what they are (a DTensor's spec, with its dtype), in Python attributes
    that `.data` leaves as they were: the parameter would say the new dtype and compute with
    the old. Those attributes (its slots and its own `__dict__`) are taken from `value` too,
    as `torch.utils.swap_tensors` takes them; that one refuses a tensor anything holds a weak
    reference to (this package's step guard, torch.compile's guards), so it is not used.
    """
    param.data = value
    if not (float8.is_wrapper_subclass(value) and type(value) is type(param)):
        return
    names = set(value.__dict__)
    for cls in type(value).__mro__:
        if cls not in (torch.Tensor, object):
            slots = cls.__dict__.get("__slots__", ())
            names.update((slots,) if isinstance(slots, str) else slots)
    for name in sorted(names - {"__dict__", "__weakref__"}):
        if hasattr(value, name):
            setattr(param, name, getattr(value, name))


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
        replica.__dict__.pop(ModuleState.ATTR, None)
        replica.__dict__.pop(_SCRIPT, None)
        replica.__dict__.pop("_apply", None)
        return replica


class RefuseScript:
    """`module.__prepare_scriptable__` for a module whose forward is a boundary: TorchScript
    cannot compile a Python boundary, so `torch.jit.script` is refused with the way out
    instead of failing deep inside TorchScript."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self) -> nn.Module:
        raise RuntimeError(
            f"torch.jit.script cannot compile module {self.name or '(root)'!r}: "
            "precision_annot.apply replaced its forward with a Python boundary (casts and "
            "autocast), which TorchScript cannot read. torch.export.export(model, args) and "
            "torch.compile(model) trace the boundaries into the graph; or run "
            "precision_annot.remove(model) before scripting (the plan is then gone)."
        )


class ConversionWatch:
    """`module._apply` for a module holding planned tensors: `.to()`, `.half()`, `.float()`
    and the like reach every module through it, so after one, the module checks its own
    tensors against the plan and the model says once that they left it. Nothing runs per
    forward call."""

    def __init__(self, module: nn.Module, name: str, planned: tuple[tuple[Kind, str,
                                                                           torch.dtype], ...],
                 state: AppliedState, inner: Callable[..., Any] | None) -> None:
        self.module = module
        self.name = name
        self.planned = planned
        self.state = state
        self.inner = inner

    def __call__(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        module = self.module
        if self.inner is not None:
            out = self.inner(fn, recurse)
        else:
            out = type(module)._apply(module, fn, recurse)  # type: ignore[no-untyped-call]
        for kind, tname, dtype in self.planned:
            tensor = get_tensor(module, kind, tname)
            if tensor is not None and tensor.dtype != dtype:
                where = f"{self.name}.{tname}" if self.name else tname
                self.state.warn_drift(where, dtype, tensor.dtype,
                                      "A conversion (model.to, .half, .float, ...)")
                break
        return out


class ModuleState:
    """What `apply` leaves on one module, as FSDP2 keeps one state per module: its boundary
    or entry guard, the parameter and buffer dicts that hand out compute-dtype copies, its
    repr suffix and its conversion watch. The only writer of a module's `__dict__`,
    `_parameters` and `_buffers` in this package."""

    ATTR = "_precision_annot"

    def __init__(self, module: nn.Module, name: str) -> None:
        self.module = module
        self.name = name
        self.boundary: Boundary | None = None
        self.converted: float8.Converted | None = None

    @classmethod
    def of(cls, module: nn.Module) -> ModuleState | None:
        state = module.__dict__.get(cls.ATTR)
        return state if isinstance(state, ModuleState) else None

    # -- tensors ----------------------------------------------------------------------------
    def cast(self, kind: Kind, name: str, value: torch.Tensor) -> None:
        """Give a parameter (the same object, new data) or a buffer (a new tensor) a value
        cast to another dtype."""
        module = self.module
        tensor = get_tensor(module, kind, name)
        if kind == "param" and tensor is not None:
            with torch.no_grad():
                grad = tensor.grad
                if grad is not None:
                    tensor.grad = None
                _set_data(tensor, value)
                if grad is not None:  # in the dtype it accumulates in from now on
                    tensor.grad = grad.to(getattr(tensor, "grad_dtype", None) or value.dtype)
        else:
            set_tensor(module, kind, name, value)

    def rewrap_loaded_weight(self) -> bool:
        """After `load_state_dict(assign=True)`: a converted layer whose weight torchao wrapped
        for FSDP2's fp8 all-gather (comm=fp8) holds the plain parameter the load gave it. Wrap
        that one as `apply` wrapped the first (torchao's own conversion, on a meta Linear
        sharing the parameters), and keep it as the weight `remove` gives back, so that neither
        the fp8 all-gather nor the loaded values are lost. True when it wrapped one."""
        converted, module = self.converted, self.module
        weight = module._parameters.get("weight")
        if converted is None or converted.weight is None or weight is None \
                or type(weight) not in (torch.Tensor, nn.Parameter):
            return False
        assert isinstance(module, nn.Linear)
        with torch.device("meta"):
            plain = nn.Linear(module.in_features, module.out_features, bias=False)
        plain.weight = weight
        plain.bias = module.bias
        new = float8.build(plain, converted.gemm, self.name)
        converted.weight = weight
        module._parameters["weight"] = new._parameters["weight"]
        return True

    def convert(self, gemm: float8.Gemm) -> None:
        """Turn this Linear into torchao's fp8 module for `gemm`, in place."""
        self.converted = float8.commit(self.module, float8.build(self.module, gemm, self.name),
                                       gemm, self.name)

    def compute_as(self, arith: Arithmetic) -> None:
        """Make this Linear's GEMMs compute as `arith` says (a wide output, emulated fp32): its
        forward becomes an `ArithmeticForward`, under the boundary `install` puts on it."""
        module = self.module
        d = module.__dict__
        kind = ArithmeticForward if runs_linear_forward(module) else ModuleGemms
        d["forward"] = kind(module, arith, d.get("forward"))  # type: ignore[arg-type]

    # -- installing -------------------------------------------------------------------------
    def install(self, site: Site | None, casting: Mapping[Kind, tuple[Region, frozenset[str]]],
                text: str | None, planned: tuple[tuple[Kind, str, torch.dtype], ...],
                owner: AppliedState) -> None:
        module = self.module
        d = module.__dict__
        for kind, (region, upcast_only) in casting.items():
            attr = "_parameters" if kind == "param" else "_buffers"
            d[attr] = CastingDict(dict(d[attr]), region, upcast_only)
        if site is not None:
            buried, direct = find_boundary(module)
            swap = site.swap if site.guard else site.region
            if buried is not None and not direct:  # another library wrapped our forward
                buried.configure(site.spec, site.region, site.planned, swap)
                buried.attach(owner, guard=site.guard, top=site.top)
                self.boundary = buried
            else:
                self.boundary = Boundary(module, site.spec, inner=d.get("forward"),
                                         region=site.region, swap=swap, planned=site.planned,
                                         owner=owner, guard=site.guard, top=site.top)
                d["forward"] = self.boundary
            d[_REPLICATE] = Replicate(module)
            d[_SCRIPT] = RefuseScript(self.name)
        if text is not None:
            d["extra_repr"] = ReprSuffix(module, text, d.get("extra_repr"))
        if planned:
            d["_apply"] = ConversionWatch(module, self.name, planned, owner, d.get("_apply"))
        d[self.ATTR] = self

    def intact(self, site: Site | None, gemm: float8.Gemm | None,
               arith: Arithmetic | None = None) -> bool:
        """True when what `install` left is still there and does what `site` and `gemm`
        say."""
        converted = self.converted
        if (converted.gemm if converted else None) != gemm or (
                converted and type(self.module) is converted.cls):
            return False
        if arith != arithmetic_of_module(self.module):
            return False
        boundary = find_boundary(self.module)[0]
        if site is None:
            return boundary is None or not boundary.active
        return boundary is self.boundary and boundary is not None and boundary.active

    @staticmethod
    def strip(module: nn.Module) -> None:
        """Take off everything this package put on `module`, found by type, so that what an
        earlier apply (or a copy of an applied model) left goes too."""
        d = module.__dict__
        boundary, direct = find_boundary(module)
        if boundary is not None:
            if direct:
                if boundary.inner is None:
                    del d["forward"]
                else:
                    d["forward"] = boundary.inner
            else:
                boundary.configure(None, None, ())  # wrapped by another library: pass through
        forward = d.get("forward")
        if isinstance(forward, (ArithmeticForward, ModuleGemms)):
            if forward.inner is None:
                del d["forward"]
            else:
                d["forward"] = forward.inner
        for attr, kind in (("extra_repr", ReprSuffix), ("_apply", ConversionWatch)):
            value = d.get(attr)
            if isinstance(value, kind):
                if value.inner is None:
                    del d[attr]
                else:
                    d[attr] = value.inner
        for attr, ours in ((_REPLICATE, Replicate), (_SCRIPT, RefuseScript)):
            if isinstance(d.get(attr), ours):
                del d[attr]
        for attr in ("_parameters", "_buffers"):
            store = d.get(attr)
            if isinstance(store, CastingDict):
                d[attr] = dict(store.items())
        state = d.pop(ModuleState.ATTR, None)
        if isinstance(state, ModuleState) and state.converted is not None:
            float8.revert(module, state.converted)


# -- finding what is installed --------------------------------------------------------------------

def arithmetic_of_module(module: nn.Module) -> Arithmetic | None:
    """The arithmetic `apply` gave this Linear's GEMMs (under its boundary, if any), or None."""
    boundary, direct = find_boundary(module)
    forward = boundary.inner if boundary is not None and direct else module.__dict__.get(
        "forward")
    return forward.arith if isinstance(forward, (ArithmeticForward, ModuleGemms)) else None


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
    """Names of the modules whose forward runs an active `Boundary` (entry guards are not
    boundaries), even one that another library has wrapped since."""
    return [n for n, m in unwrap(model).named_modules()
            if (b := find_boundary(m)[0]) and b.active and not b.guard]


def applied_plan(model: nn.Module) -> PrecisionPlan | None:
    """The plan `apply` last made real on `model` (seen through wrappers), or None."""
    model = unwrap(model)
    state: AppliedState | None = model.__dict__.get(_STATE_ATTR)
    if state is None:
        return None
    plan = state.plan
    named = dict(model.named_modules())
    stale = any(plan.module(n) is not named.get(n) for n in plan)  # a copy, or unpickled
    if stale and all(n in named for n in plan):
        state.plan = plan = plan.bound_to(named)
    return plan


def plan_of(model: nn.Module, default: SpecLike | None = None, *, where: str = "") -> PrecisionPlan:
    """The plan an entry point starts from: the one `apply` made real on the model (seen
    through wrappers), else its annotations resolved with `default`.

    A `default` given for a model that already has a plan is not used; when it would resolve
    to another plan, a `UserWarning` says so."""
    inner = unwrap(model)
    applied = applied_plan(inner)
    if applied is None:
        return resolve(inner, default)
    if default is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            other = resolve(inner, default)
        if [e.policy for e in other.values()] != [e.policy for e in applied.values()]:
            warnings.warn(
                f"{where or 'This entry point'} was given default={default!r}, but the model "
                "already has a plan applied, which differs from the model's annotations with "
                "that default; the applied plan is used. To use the default, "
                "precision_annot.remove(model) first, or apply(model, default=...) again.",
                UserWarning, stacklevel=3)
    return applied


@dataclasses.dataclass(frozen=True)
class Subject:
    """What an entry point that takes "a model or its plan" was given, worked out once.

    Attributes:
        plan: the plan: the one applied to the model, else its annotations resolved; or the
            plan given. It holds what `resolve` saw of each module (`PrecisionPlan.captured`)
            whenever the model is here to see.
        model: the model inside any wrapper; None for a plan whose model is gone (collected, or
            a plan file).
        wrapped: the wrapper the caller passed (`DistributedDataParallel`, FSDP1, a compiled
            module), else None.
    """

    plan: PrecisionPlan
    model: nn.Module | None
    wrapped: nn.Module | None

    def require_facts(self, where: str, what: str) -> None:
        """Raise when the plan cannot say what `what` needs and there is no model to look at."""
        if not self.plan.captured:
            raise ValueError(
                f"{where} needs what resolve saw of each module (classes, shapes, tied and "
                f"frozen parameters) to check {what}, and this plan holds none: it was written "
                "by precision_annot 0.3 or older, and its model is not here. Pass the model, "
                "or write the plan again with this version (plan.to_json(), or "
                "precision-annot report --json).")


def subject(model_or_plan: object, where: str, *, default: SpecLike | None = None,
            argument: str = "model_or_plan") -> Subject:
    """The plan, model and wrapper an entry point works on, from a model (seen through its
    wrappers; the plan `apply` made real on it, else its annotations resolved with `default`)
    or a `PrecisionPlan` (with its model while that is alive)."""
    if isinstance(model_or_plan, nn.Module):
        model = unwrap(model_or_plan)
        plan = plan_of(model, default, where=where)
        named = plan.modules() if plan.has_model else dict(model.named_modules())
        return Subject(capture(plan, named), model,
                       model_or_plan if model_or_plan is not model else None)
    if isinstance(model_or_plan, PrecisionPlan):
        if not model_or_plan.has_model:
            return Subject(model_or_plan, None, None)
        return Subject(capture(model_or_plan, model_or_plan.modules()),
                       model_or_plan.module(""), None)
    raise TypeError(
        f"{where}: {argument} must be an nn.Module or a PrecisionPlan. "
        f"Received: {model_or_plan!r} (of type {type(model_or_plan).__name__})"
    )


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


def _is_real(state: AppliedState | None, plan: PrecisionPlan, execution: Execution,
             named: dict[str, nn.Module]) -> bool:
    """True when the model already holds exactly this execution."""
    if state is None or state.plan != plan or state.execution != execution:
        return False
    for (name, kind, tname), target in execution.targets.items():
        tensor = get_tensor(named[name], kind, tname)
        if tensor is None or tensor.dtype != target.dtype:
            return False
    for name, module in named.items():
        own = ModuleState.of(module)
        if own is None or not own.intact(execution.sites.get(name), execution.gemms.get(name),
                                         execution.arithmetic.get(name)):
            return False
    return True


# -- changing the model ---------------------------------------------------------------------------

def _warn_rounded_again(originals: dict[Key, torch.dtype],
                        prepared: list[tuple[Key, torch.Tensor, torch.Tensor]]) -> None:
    """A tensor stored narrower than it was before the first apply (by an earlier plan, or a
    `model.half()` since), cast to another dtype now, is cast from its narrowed values: the new
    dtype does not bring back the bits dropped before. A parameter whose optimizer keeps a
    master is left out: the master is written into it."""
    rounded = [(key, tensor.dtype, value.dtype) for key, tensor, value in prepared
               if key in originals and wider(originals[key], tensor.dtype)
               and not guard.mastered(tensor)]
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


def _absorb_nested(model: nn.Module) -> tuple[dict[Key, torch.dtype], list[nn.Parameter]]:
    """Originals recorded by earlier applies on this model or its submodules, as this model's
    names, and the parameters they gave a wider gradient dtype; their states are dropped (and
    their load and forward hooks removed), since this apply now owns the tree."""
    originals: dict[Key, torch.dtype] = {}
    widened: list[nn.Parameter] = []
    for name, module in model.named_modules():
        state: AppliedState | None = module.__dict__.pop(_STATE_ATTR, None)
        _drop_load_hooks(module)
        if state is None:
            continue
        if state.wide is not None:
            widened += state.wide.release(module)
        prefix = f"{name}." if name else ""
        for (mname, kind, tname), dtype in state.originals.items():
            full = f"{prefix}{mname}" if mname else name
            originals.setdefault((full, kind, tname), dtype)
    return originals, widened


def _drop_load_hooks(module: nn.Module) -> None:
    """Take off the load hooks an `AppliedState` registered on `module`.

    NOTE: the hooks are found in the module's own hook dicts (torch gives a handle, not a
    lookup), the pre-hooks wrapped in torch's `_WrappedHook`."""
    for hooks in (module._load_state_dict_post_hooks, module._load_state_dict_pre_hooks):
        for key in [k for k, h in hooks.items() if isinstance(
                getattr(getattr(h, "hook", h), "__self__", None), AppliedState)]:
            del hooks[key]


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
    compute dtype. A module with submodules that can be called on its own (an encoder) gets an
    entry guard, so that called directly it runs as planned. Other modules are not touched.

    Call it before building the optimizer: it changes the dtype of parameters, and an
    optimizer that already holds state for them keeps that state in the old dtype.

    `apply` is idempotent and atomic: when the plan is already real nothing changes, and on
    any error the model is left as it was. Call it again after `model.half()` or
    `model.to(dtype)` (a warning says when one of them moved tensors off the plan) to restore
    the plan; loading a checkpoint keeps it (`load_state_dict`, `assign=True` included, puts
    each tensor back in its planned dtype, and warns, naming them, about tensors the
    checkpoint holds narrower than the plan keeps). `remove` undoes it.

    Args:
        model: the module tree (a wrapper such as `torch.compile`'s is seen through).
        plan: a plan from `resolve` or `PrecisionPlan.from_json`; when None, `model`'s
            annotations resolved with `default`. On a model already applied, `apply(model)`
            re-applies as it was applied: the plan it was given, or its annotations resolved
            with the default it was given then (a new annotation is taken up); so it restores
            the plan after `model.half()`. (Default: None)
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
    resolved = plan is None
    if plan is None:
        # an applied model keeps how its plan was made: apply(model) after model.half()
        # restores it, from the annotations with the default it was applied with (so a new
        # annotation is taken up), or the plan it was given as it was
        state: AppliedState | None = unwrap(model).__dict__.get(_STATE_ATTR)
        if state is not None and default is None and not state.resolved:
            plan, resolved = applied_plan(model), False
        else:
            plan = resolve(model, default if default is not None or state is None
                           else state.plan.default)
    elif default is not None:
        raise ValueError(
            "apply got both plan= and default=; default is only used to resolve a plan. "
            "Pass default to resolve(model, default=...) instead."
        )
    else:
        require_plan(plan, "apply")
    if not isinstance(check_finite, bool):
        raise TypeError(f"check_finite must be a bool. Received: check_finite={check_finite!r}")
    assert plan is not None
    recompute.install(forward_state_restorer)  # before anything changes: it may refuse
    with paused_gc():
        _apply(unwrap(model), plan, check_finite, resolved)
    return model


def _apply(root: nn.Module, plan: PrecisionPlan, check_finite: bool, resolved: bool) -> None:
    named = dict(root.named_modules())
    check_matches(plan, named)
    plan = _for_model(plan, named)
    execution = compile_plan(plan, named, check=check_finite)
    current_state = root.__dict__.get(_STATE_ATTR)
    if _is_real(current_state, plan, execution, named):
        assert current_state is not None
        current_state.resolved = resolved
        return

    prepared, current = _prepare(execution, named)
    wide = grads.planned(plan, named, execution.targets)
    originals, widened = _absorb_nested(root)
    _warn_rounded_again(originals, prepared)
    for key, dtype in current.items():  # kept from the first apply, if there was one
        originals.setdefault(key, dtype)
    for module in named.values():
        ModuleState.strip(module)
    states = {name: ModuleState(module, name) for name, module in named.items()}
    updates = guard.planned_updates(plan, named)
    # (a master this plan keeps for a parameter it narrows mid-run starts from its values now)
    guard.narrowing([(tensor, tensor.detach(), cast.dtype) for key, tensor, cast in prepared
                     if key[1] == "param"], updates)
    for (name, kind, tname), _, cast in prepared:
        states[name].cast(kind, tname, cast)
    guard.note([(tensor, current[key], f"{key[0]}.{key[2]}" if key[0] else key[2])
                for key, tensor, _ in prepared if key[1] == "param"], updates)
    if execution.gemms:
        float8.prepare_compile()
    for name, gemm in execution.gemms.items():
        states[name].convert(gemm)
    state = AppliedState(plan, execution, originals, resolved=resolved)
    _install(states, execution, state)
    _widen(root, state, wide, widened)
    root.register_load_state_dict_pre_hook(state.before_load)  # type: ignore[no-untyped-call]
    root.register_load_state_dict_post_hook(state.after_load)  # type: ignore[no-untyped-call]
    for module in named.values():  # (the root's after the root's own load hooks)
        module.register_load_state_dict_pre_hook(state.before_load_masters)
        module.register_load_state_dict_post_hook(state.after_load_masters)
    object.__setattr__(root, _STATE_ATTR, state)


def _widen(root: nn.Module, state: AppliedState, wide: tuple[grads.Entry, ...],
           widened: list[nn.Parameter]) -> None:
    """Give each parameter the plan's gradient dtype (`grad=fp32`); one an earlier apply
    widened and this plan does not gets its own dtype back, and so does one an earlier apply
    gave its own dtype back that this one stored in another (see `grads.stale`)."""
    named = dict(root.named_modules())
    kept = {id(get_tensor(named[m], "param", t)) for m, t, _, _ in wide}
    grads.own_dtype([p for p in (*widened, *grads.stale(root.parameters()))
                     if id(p) not in kept])
    if wide:
        state.wide = grads.WideGrads(wide)
        state.wide.bind(root)


def _prepare(execution: Execution, named: dict[str, nn.Module]
             ) -> tuple[list[tuple[Key, torch.Tensor, torch.Tensor]], dict[Key, torch.dtype]]:
    """Everything that can fail, done before anything changes: each fp8 layer validated,
    each tensor cast to its planned dtype (the casts, and every tensor's dtype now)."""
    for name, gemm in execution.gemms.items():
        float8.validate(float8.plain_class(named[name]), gemm, name)
    prepared: list[tuple[Key, torch.Tensor, torch.Tensor]] = []
    current: dict[Key, torch.dtype] = {}
    for key, target in execution.targets.items():
        tensor = get_tensor(named[key[0]], key[1], key[2])
        assert tensor is not None
        current[key] = tensor.dtype
        if tensor.dtype != target.dtype:
            prepared.append((key, tensor, tensor.to(target.dtype)))
    return prepared, current


def _install(states: dict[str, ModuleState], execution: Execution,
             state: AppliedState) -> None:
    """Each module's part of the execution, installed through its `ModuleState`."""
    casting: dict[str, dict[Kind, tuple[Region, frozenset[str]]]] = {}
    for (name, kind), entry in execution.casting.items():
        casting.setdefault(name, {})[kind] = entry
    planned: dict[str, list[tuple[Kind, str, torch.dtype]]] = {}
    for (name, kind, tname), target in execution.targets.items():
        planned.setdefault(name, []).append((kind, tname, target.dtype))
    for name, module_state in states.items():
        arith = execution.arithmetic.get(name)
        if arith is not None:
            module_state.compute_as(arith)
        module_state.install(execution.sites.get(name), casting.get(name, {}),
                             execution.reprs.get(name), tuple(planned.get(name, ())), state)


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
    root = unwrap(model)
    originals, widened = _absorb_nested(root)
    named = dict(root.named_modules())
    for module in named.values():
        ModuleState.strip(module)
    for (name, kind, tname), dtype in originals.items():
        module = named.get(name)
        tensor = None if module is None else get_tensor(module, kind, tname)
        if module is not None and tensor is not None and tensor.dtype != dtype:
            ModuleState(module, name).cast(kind, tname, tensor.detach().to(dtype))
    guard.forget(root.parameters())
    grads.own_dtype([*widened, *grads.stale(root.parameters())])
    return model
