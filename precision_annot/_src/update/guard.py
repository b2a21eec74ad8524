"""What `apply` says about each parameter's update, and the step guard that holds optimizers to
it.

`apply` notes here, per parameter, its qualified name and its module's update fields (`note`),
and the dtype a parameter had before `apply` changed it. `precision_annot.optimizer` reads the
fields at every step (`planned`), so an optimizer built before `apply`, or before a plan with
another update half was applied, steps as the plan applied now says. One global optimizer step
pre-hook stops any other optimizer that would drop that update half.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from precision_annot._src.dtypes import dtype_name, wider
from precision_annot._src.update.rule import UpdateFields, fields_of, rule_for

__all__ = ["Planned", "StepGuard", "follow", "forget", "loaded", "mastered", "mastered_params",
           "narrowing", "note", "planned", "planned_updates", "shared_master", "take_wide",
           "wide_of"]


class Planned(NamedTuple):
    """One parameter as the applied plan says it: its qualified name and its update fields."""

    name: str
    fields: UpdateFields


class StepGuard:
    """What an optimizer step must not do to an applied model, checked once per `apply` by one
    global optimizer step pre-hook (registered at the first apply that needs it; per step it
    costs a dictionary lookup):

    - step on state built before `apply` changed a parameter's dtype (torch's own error there,
      "expected dtype float for `end` but got dtype c10::BFloat16", names neither the
      parameter nor the cause);
    - update, as a plain optimizer does, a parameter whose plan keeps a master copy, a wider
      gradient or state, or stochastic rounding: that update half would be silently dropped
      (with master=fp32 over bf16 storage, updates below 2^-8 of a weight round away).

    `precision_annot.optimizer` is exempt from both: it steps each parameter as its rule says
    now, and converts a state built under another layout at its next step."""

    def __init__(self) -> None:
        # keyed by identity: a tensor's == is elementwise
        self.changed: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.planned: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.checked: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.generation = 0
        self.handle: Any = None

    def note(self, changed: Iterable[tuple[torch.Tensor, torch.dtype, str]],
             planned: Iterable[tuple[torch.Tensor, Planned]]) -> None:
        changed, planned = list(changed), list(planned)
        if not changed and not planned:
            return
        for param, old, name in changed:
            self.changed[param] = (old, name)
        for param, said in planned:
            self.planned[param] = said
        self.generation += 1
        _tell([p for p, _, _ in changed] + [p for p, _ in planned])
        if self.handle is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self.handle = register_optimizer_step_pre_hook(self)

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.checked.get(optimizer) == self.generation or getattr(
                optimizer, "_precision_annot_updates", False):
            return
        for group in optimizer.param_groups:
            for param in group["params"]:
                self._dropped(optimizer, param)
                self._stale(optimizer, param)
        with contextlib.suppress(TypeError):  # not weak-referenceable: checked at every step
            self.checked[optimizer] = self.generation

    def _dropped(self, optimizer: Any, param: torch.Tensor) -> None:
        said: Planned | None = self.planned.get(param)  # type: ignore[no-untyped-call]
        if said is None:
            return
        rule = rule_for(said.fields, param.dtype)
        if rule.plain:
            return
        name = type(optimizer).__name__
        raise RuntimeError(
            f"{name}.step(): it updates parameter {said.name!r} (stored in "
            f"{dtype_name(param.dtype)}) itself, and the plan says {rule.describe()} for it, "
            "which this optimizer does not keep: the update would be made as if the plan said "
            "nothing (with master=fp32 over bf16, updates below 2^-8 of a weight round away). "
            f"Build it with precision_annot.optimizer(model, torch.optim.{name}, lr=...).")

    def _stale(self, optimizer: Any, param: torch.Tensor) -> None:
        said: tuple[torch.dtype, str] | None = self.changed.get(param)  # type: ignore[no-untyped-call]
        state = optimizer.state.get(param) if said is not None else None
        if not state or said is None:
            return
        old, name = said
        stale = [k for k, v in state.items() if isinstance(v, torch.Tensor)
                 and v.dtype == old != param.dtype and v.shape == param.shape]
        if stale:
            raise RuntimeError(
                f"{type(optimizer).__name__}.step(): it holds state for parameter {name!r} "
                f"({', '.join(stale)} in {dtype_name(old)}) built before precision_annot.apply "
                f"stored that parameter in {dtype_name(param.dtype)}, and its update mixes the "
                "two. Build the optimizer after apply; or, to keep its state, load it into the "
                "new one (new.load_state_dict(old.state_dict()) casts the state to each "
                "parameter's dtype).")


_GUARD = StepGuard()
#: the optimizers `precision_annot.optimizer` built (weakly held), told when `apply` or
#: `remove` changes what is said about one of their parameters
_FOLLOWED: weakref.WeakSet[Any] = weakref.WeakSet()


def follow(optimizer: Any) -> None:
    """`optimizer` (a planned one) settles its state into what `apply` or `remove` say about
    its parameters as soon as they say it (its `_precision_annot_settle`): a master no longer
    planned is in its weight at once, not at the next step (which may never come)."""
    _FOLLOWED.add(optimizer)


def optimizers_of(params: list[torch.Tensor]) -> list[Any]:
    """The optimizers `precision_annot.optimizer` built that step any of `params`."""
    ids = {id(p) for p in params}
    return [opt for opt in list(_FOLLOWED)
            if any(id(p) in ids for g in opt.param_groups for p in g["params"])]


def _tell(params: list[torch.Tensor]) -> None:
    ids = {id(p) for p in params}
    for optimizer in list(_FOLLOWED):
        if any(id(p) in ids for g in optimizer.param_groups for p in g["params"]):
            optimizer._precision_annot_settle()
    for p in params:
        if p in _WIDE:
            _settle_wide(p)


def _held_master(param: torch.Tensor) -> bool:
    for optimizer in list(_FOLLOWED):
        state = optimizer.state.get(param)
        if state and isinstance(state.get("master"), torch.Tensor):
            return True
    return False


def mastered(param: torch.Tensor) -> bool:
    """Whether an optimizer `precision_annot.optimizer` built keeps a master of `param`, or a
    value is kept for its master (`wide_of`): either is written into it, rounded, once the new
    plan is applied."""
    return _held_master(param) or wide_of(param) is not None


# -- the value a master starts from, before an optimizer makes it ------------------------------

class _Wide(NamedTuple):
    """A value of a parameter wider than it is stored, kept for the master an optimizer makes
    for it (in that master's dtype), and the dtype the parameter holds it rounded into."""

    value: torch.Tensor
    stored: torch.dtype


#: per parameter, the widest value known for it while no optimizer holds its master: a load of
#: wider values (an fp32 checkpoint into bf16 weights) before the first step, or the values an
#: `apply` narrowed mid-run (a detour through fp32, `remove` then `apply` again). The master an
#: optimizer makes for it starts from this value, not from the rounded weight.
_WIDE: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _holds(kept: _Wide, param: torch.Tensor) -> bool:
    """Whether `param` still holds `kept` rounded (nothing else was written into it since)."""
    if kept.value.shape != param.shape:
        return False
    with torch.no_grad():
        return torch.equal(kept.value.to(kept.stored), param.detach().to(kept.stored))


def wide_of(param: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """The value kept for `param`'s master (in `dtype` where given), or None: none is kept, or
    `param` no longer holds its rounding (then it is dropped)."""
    kept: _Wide | None = _WIDE.get(param)  # type: ignore[no-untyped-call]
    if kept is None:
        return None
    if not _holds(kept, param):
        _WIDE.pop(param, None)  # type: ignore[no-untyped-call]
        return None
    return kept.value if dtype is None or kept.value.dtype == dtype else kept.value.to(dtype)


def take_wide(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """`wide_of(param, dtype)`, given up to the master an optimizer makes of it now."""
    value = wide_of(param, dtype)
    _WIDE.pop(param, None)  # type: ignore[no-untyped-call]
    return value


def _keep_wide(param: torch.Tensor, value: torch.Tensor, dtype: torch.dtype, *,
               copy: bool) -> None:
    with torch.no_grad():
        held = value.detach().to(device=param.device, dtype=dtype, copy=copy)
    _WIDE[param] = _Wide(held, param.dtype)


def mastered_params() -> list[torch.Tensor]:
    """Every parameter the plans applied keep a master for, wider than it is stored."""
    return [p for p, said in list(_GUARD.planned.items())  # type: ignore[no-untyped-call]
            if rule_for(said.fields, p.dtype).master is not None]


def _master_dtype(param: torch.Tensor) -> torch.dtype | None:
    said = planned(param)
    return None if said is None else rule_for(said.fields, param.dtype).master


def _settle_wide(param: torch.Tensor) -> None:
    """`apply` or `remove` changed what is said about `param`: the value kept for its master
    is written into it (which then holds it as well as its dtype can), and kept further only
    where the plan now keeps a master for it wider than it is stored."""
    value = wide_of(param)
    if value is None:
        return
    with torch.no_grad():
        param.copy_(value)
    dtype = _master_dtype(param)
    if dtype is None or _held_master(param):
        _WIDE.pop(param, None)  # type: ignore[no-untyped-call]
    else:
        _WIDE[param] = _Wide(value.to(dtype), param.dtype)


def _load_wide(param: torch.Tensor, value: torch.Tensor) -> None:
    """`load_state_dict` gave `param` the checkpoint's `value`, and no optimizer holds its
    master: a value wider than the parameter (or of another format, fp16 into bf16) is kept
    for the master its plan keeps; one that is the kept value rounded (the weights loaded back
    unchanged) leaves it; any other value drops it."""
    dtype = _master_dtype(param)
    if dtype is None and param in _SCHEDULED and value.is_floating_point() and wider(
            value.dtype, param.dtype):
        dtype = value.dtype  # a later phase may store it wider: see `schedule_keeps`
    kept: _Wide | None = _WIDE.get(param)  # type: ignore[no-untyped-call]
    usable = value.is_floating_point() and value.shape == param.shape
    if kept is not None and usable and wider(kept.value.dtype, value.dtype) and torch.equal(
            kept.value.to(device=value.device, dtype=value.dtype), value.detach()):
        return
    _WIDE.pop(param, None)  # type: ignore[no-untyped-call]
    if dtype is not None and usable and value.dtype != param.dtype and not wider(
            param.dtype, value.dtype):
        _keep_wide(param, value, dtype, copy=True)


def _stepped(state: Any) -> bool:
    """Whether an optimizer's state for a parameter comes from a step: a step count above 0
    (a state its own `state_dict()` gave back before any step, as Accelerate's wrapper loads
    it, holds step 0 and zero moments), or, for a class without one, any state."""
    if not state:
        return False
    step = state.get("step")
    if step is None:
        return True
    return bool(float(step) > 0) if isinstance(step, (torch.Tensor, int, float)) else True


#: the parameters a `precision_annot.schedule` drives: a load of values wider than one is
#: stored keeps them (as for a master) until the schedule's next step, so that the optimizer's
#: checkpoint, loaded after the weights as trainers load it, can go to a phase that stores
#: them wider (bf16 weights, then fp32) without the rounding of the phase the load met
_SCHEDULED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def schedule_keeps(params: Iterable[torch.Tensor]) -> None:
    """A schedule drives these parameters (see `_SCHEDULED`)."""
    for p in params:
        _SCHEDULED[p] = True


def scheduled_storages() -> set[int]:
    """The storages (their data pointers) of the parameters a schedule drives: the tensors of
    a state dict made from them share them."""
    out = set()
    for p in list(_SCHEDULED.keys()):  # type: ignore[no-untyped-call]
        to_local = getattr(p, "to_local", None)
        local = to_local() if to_local is not None else p
        out.add(int(local.untyped_storage().data_ptr()))
    return out


def release_wide(params: Iterable[torch.Tensor]) -> None:
    """The schedule stepped: the values a load kept for a parameter whose plan keeps no
    master are stale (the step wrote it), and let go."""
    if not len(_WIDE):
        return  # (every step of a run: nothing kept, nothing to walk)
    for p in params:
        if p in _WIDE and _master_dtype(p) is None:
            _WIDE.pop(p, None)  # type: ignore[no-untyped-call]


#: whether a schedule's switch (not its first phase) is applying a plan now
_SWITCHING = [False]


@contextlib.contextmanager
def switching(on: bool) -> Iterator[None]:
    """A schedule's switch applies a plan: every parameter an optimizer holds (a frozen one,
    one not stepped yet) is part of a run going on, and a master its new phase keeps starts
    from the widest copy there is."""
    before, _SWITCHING[0] = _SWITCHING[0], on
    try:
        yield
    finally:
        _SWITCHING[0] = before


def _going_on(param: torch.Tensor) -> bool:
    return any(_stepped(opt.state.get(param)) for opt in list(_FOLLOWED))


def _optimized() -> set[int]:
    """The parameters (by id) the planned optimizers hold."""
    return {id(p) for opt in list(_FOLLOWED) for g in opt.param_groups for p in g["params"]}


def narrowing(params: Iterable[tuple[torch.Tensor, torch.Tensor, torch.dtype]],
              planned: Iterable[tuple[torch.Tensor, Planned]]) -> None:
    """`apply` is about to store these parameters in another dtype (each with an alias of its
    values now, which the cast leaves as they are, and the dtype it casts to). Where one is
    narrowed, an optimizer already holds state for it (a run goes on after a detour through
    fp32) and the new plan keeps a master for it, that master is made from these values, the
    widest copy there is, not from the rounded weight. The masters of a model not stepped yet
    are made from its rounded weights, as Apex O2 and DeepSpeed make them."""
    said = {id(p): s for p, s in planned}
    held = _optimized() if _SWITCHING[0] else set()
    for param, value, stored in params:
        if (id(param) not in said or not wider(value.dtype, stored) or param in _WIDE
                or _held_master(param) or not (_going_on(param) or (
                    id(param) in held and param in _SCHEDULED))):
            continue
        dtype = rule_for(said[id(param)].fields, stored).master
        if dtype is not None:
            with torch.no_grad():
                kept = value.detach() if value.dtype == dtype else value.detach().to(dtype)
            _WIDE[param] = _Wide(kept, stored)


def shared_master(optimizer: Any, param: torch.Tensor, dtype: torch.dtype,
                  equal_to: torch.Tensor | None = None) -> torch.Tensor | None:
    """The master of `param` another planned optimizer holds (in `dtype`; equal to `equal_to`
    where given), or None: two optimizers stepping one parameter update one master, as two
    torch optimizers update one fp32 parameter (each its own master would write back over the
    other's updates)."""
    for other in list(_FOLLOWED):
        state = other.state.get(param) if other is not optimizer else None
        master = state.get("master") if state else None
        if isinstance(master, torch.Tensor) and master.dtype == dtype and (
                master.shape == param.shape) and (
                equal_to is None or master is equal_to or torch.equal(master, equal_to)):
            return master
    return None


def loaded(given: dict[torch.Tensor, torch.Tensor]) -> None:
    """`load_state_dict` gave these parameters new values (the checkpoint's tensor for each):
    every optimizer holding a master for one starts it from them (its
    `_precision_annot_loaded`); a parameter whose master no optimizer holds yet (none built,
    or none stepped) keeps a wider value for the master its plan keeps (`_load_wide`), so
    that the master starts from the checkpoint's own values whenever it is made."""
    ids = {id(p) for p in given}
    for optimizer in list(_FOLLOWED):
        if any(id(p) in ids for g in optimizer.param_groups for p in g["params"]):
            optimizer._precision_annot_loaded(given)
    for param, value in given.items():
        if _held_master(param):
            _WIDE.pop(param, None)  # type: ignore[no-untyped-call]
        else:
            _load_wide(param, value)


def note(changed: Iterable[tuple[torch.Tensor, torch.dtype, str]],
         planned: Iterable[tuple[torch.Tensor, Planned]]) -> None:
    """`apply` made a plan real: `changed` are the parameters it stored in another dtype (with
    the dtype they had and their name), `planned` every parameter with what the plan says."""
    _GUARD.note(changed, planned)


def forget(params: Iterable[torch.Tensor]) -> None:
    """`remove` took the plan off: nothing is said about these parameters any more."""
    params = list(params)
    for p in params:
        _GUARD.planned.pop(p, None)  # type: ignore[no-untyped-call]
        _GUARD.changed.pop(p, None)  # type: ignore[no-untyped-call]
    _GUARD.generation += 1
    _tell(params)


def planned(param: torch.Tensor) -> Planned | None:
    """What the plan applied last says about `param`, or None when no applied plan holds it."""
    said: Planned | None = _GUARD.planned.get(param)  # type: ignore[no-untyped-call]
    return said


def generation() -> int:
    """Changes whenever `apply` or `remove` changes what is said about some parameter."""
    return _GUARD.generation


def planned_updates(plan: Mapping[str, Any], named: Mapping[str, nn.Module]
                    ) -> list[tuple[torch.Tensor, Planned]]:
    """Every parameter of the plan's modules (each shared one at its first holder, whose update
    fields the plan's resolution made agree with the others') with what its module says."""
    out: list[tuple[torch.Tensor, Planned]] = []
    seen: set[int] = set()
    for name, entry in plan.items():
        fields = fields_of(entry.policy)
        for pname, p in named[name].named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            out.append((p, Planned(f"{name}.{pname}" if name else pname, fields)))
    return out
