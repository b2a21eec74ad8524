"""`optimizer`: the optimizer class you give, made to keep the plan's update half.

`precision_annot.optimizer(model, torch.optim.AdamW, lr=...)` returns an instance of a class
derived from `torch.optim.AdamW` (and from `PlanOptimizer`): torch's whole optimizer contract
is AdamW's own (`defaults`, param groups, hooks, `state_dict`, `add_param_group`, closures,
schedulers, `zero_grad`), and its `state` is keyed by the model's own parameters, holding for
each what its step keeps: AdamW's moments and, where the plan says so, the fp32 master. Its
step (step.py) presents each parameter to AdamW's own step as its rule says, and writes back.
"""

from __future__ import annotations

import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from itertools import chain
from typing import Any, cast

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.weak import WeakIdKeyDictionary

from precision_annot._src.dtypes import dtype_name, wider
from precision_annot._src.guards import require_module
from precision_annot._src.recording import version
from precision_annot._src.update import engines, formats, guard
from precision_annot._src.update.rule import UpdateFields, UpdateRule, fields_of
from precision_annot._src.update.step import (
    eager_run_step,
    family,
    items_of,
    refusal,
    rule_of,
    settle,
    write_back,
)

__all__ = ["PlanOptimizer", "optimizer", "planned_class", "state_bytes"]

#: attributes a copy or a pickle leaves out: hooks (as torch does), and what a step rebuilds
_TRANSIENT = ("_optimizer_", "_precision_annot_layout", "_precision_annot_presented",
              "_precision_annot_loading", "_precision_annot_items", "_precision_annot_cache",
              "_precision_annot_schedule")
#: the key of `state_dict()` holding the phase of the `precision_annot.schedule` that
#: changes the plan of the optimizer's parameters (its `Schedule.state_dict()`)
SCHEDULE_KEY = "precision_annot_schedule"


class PlanOptimizer(Optimizer):
    """The optimizers `precision_annot.optimizer` builds: each an instance of a class derived
    from the optimizer class you gave (so `isinstance(opt, torch.optim.AdamW)` holds, and
    everything torch's optimizers do, it does), whose step updates each parameter as the plan
    applied to the model says: through an fp32 master copy, a working copy written back with
    stochastic rounding, a state kept in another dtype or in torchao's low-bit formats.

    `state[p]` holds what the class keeps for parameter `p` (its moments, in the planned
    format) and, under a plan with `master=fp32`, its master under the key "master";
    `state_dict()` is torch's format (`state` and `param_groups`), low-bit states written as
    plain tensors.
    """

    # marks the optimizers that make a plan's update half real, for the step guard of apply
    _precision_annot_updates = True
    _precision_annot_base: type[Optimizer] = Optimizer
    _precision_annot_fields: dict[torch.Tensor, UpdateFields]
    _precision_annot_names: dict[torch.Tensor, str]
    #: what `apply` said last about each parameter, kept with the optimizer (see `step.rule_of`)
    _precision_annot_said: dict[torch.Tensor, guard.Planned]
    _precision_annot_compile: bool | None
    #: `step.run_step`, run as it is under `torch.compile` (set by `planned_class`)
    _precision_annot_step: Callable[[Any, Callable[[], Any] | None], Any]

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """The class's own step, each parameter presented as its rule says."""
        return cast("float | None", self._precision_annot_step(self, closure))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's `zero_grad`; inside a step (a closure that re-evaluates the model), the
        model's own parameters too, while the class sees their masters."""
        super().zero_grad(set_to_none)
        for p in self.__dict__.get("_precision_annot_presented", ()):
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_() if p.grad.grad_fn is not None else p.grad.requires_grad_(False)
                p.grad.zero_()

    def _precision_annot_settle(self) -> None:
        """`apply` or `remove` changed what is said about some of the parameters: what is said
        now noted (see `step.rule_of`), and each state settled into it now (see
        `step.settle`), not at the next step."""
        self._precision_annot_said = {
            p: said for g in self.param_groups for p in g["params"]
            if (said := guard.planned(p)) is not None}
        try:
            items = items_of(self)
        except ValueError:
            return  # an update no rule makes: the step says so
        settle(self, items)
        self._precision_annot_layout = True

    def _precision_annot_loaded(self, given: dict[torch.Tensor, torch.Tensor]) -> None:
        """`load_state_dict` put new values into some of the parameters (`given`: the
        checkpoint's tensor for each): a master whose weight no longer holds its rounding
        starts from the loaded value, the checkpoint's own where it is as wide as the master,
        else the weight; a weight loaded back unchanged keeps its master's extra bits."""
        with torch.no_grad():
            for param, value in given.items():
                state = self.state.get(param)
                master = state.get("master") if state else None
                if isinstance(master, torch.Tensor):
                    _reload_master(master, param, value)

    def master(self, param: torch.Tensor) -> torch.Tensor | None:
        """The master copy the step updates for `param`, or None when it updates `param`
        itself (or has not stepped it yet)."""
        state = self.state.get(param)
        master = state.get("master") if state else None
        return master if isinstance(master, torch.Tensor) else None

    def rule(self, param: torch.Tensor) -> UpdateRule:
        """How the next step updates `param` (see `UpdateRule`)."""
        return rule_of(self, param)[0]

    @property
    def state(self) -> defaultdict[Any, Any]:
        """torch's per-parameter state (see `_State`)."""
        held = self.__dict__["state"]
        if type(held) is not _State:
            held = self.__dict__["state"] = _State(self, held)
        return held

    @state.setter
    def state(self, value: defaultdict[Any, Any]) -> None:
        self.__dict__["state"] = value

    def state_dict(self) -> dict[str, Any]:
        """torch's `state_dict` (`state` by parameter index, `param_groups`), with torchao's
        low-bit states written as their plain inner tensors, so any `torch.load` reads it.

        For Adam, AdamW and SGD it holds every trainable parameter's state, one not stepped
        yet as its first step will start from (its master from the parameter, zero moments,
        step 0), so that `torch.distributed.checkpoint` finds the state initialised: it then
        needs no dummy step (which assigns each parameter a zero gradient of its own dtype,
        refused where `grad=fp32` set an fp32 `grad_dtype`), and a checkpoint's tensors have
        a place to load into. A state whose master is not made yet (loaded from a checkpoint
        without one) holds the master its next step makes; a master not made yet starts
        from the wider value a load kept for it (see `guard.wide_of`), else the weight."""
        saved: dict[str, Any] = super().state_dict()
        name = family(type(self)._precision_annot_base)
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                held = saved["state"].get(index)
                if name in engines.FRESH and p.requires_grad and not held:
                    saved["state"][index] = engines.fresh_state(name, p, self.rule(p), group)
                elif isinstance(held, dict) and "master" not in held and (
                        rule := self.rule(p)).master is not None:
                    # a state loaded without one (another layout): the master its next
                    # step makes, from the value kept for it or from the weight
                    saved["state"][index] = {"master": engines.fresh_master(p, rule), **held}
                index += 1
        out = {**saved, "state": formats.portable(saved["state"])}
        _hand_out(self, out["state"])
        sched = self._precision_annot_scheduled()
        if sched is not None:
            out[SCHEDULE_KEY] = sched.state_dict()
        return out

    def _precision_annot_scheduled(self) -> Any:
        """The `precision_annot.schedule` changing the plan of this optimizer's parameters."""
        ref = self.__dict__.get("_precision_annot_schedule")
        return ref() if ref is not None else None

    def _precision_annot_phase(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint saved under a schedule: its phase applied first (the model's plan, so
        that the state loads into the layout it was saved in); the state dict without it."""
        saved = state_dict.get(SCHEDULE_KEY) if isinstance(state_dict, dict) else None
        if saved is None:
            return state_dict
        sched = self._precision_annot_scheduled()
        if sched is None:
            warnings.warn(
                f"{type(self).__name__}.load_state_dict: the checkpoint was saved at step "
                f"{saved.get('step')!r} in phase {saved.get('phase')!r} of a "
                f"precision_annot.schedule (phases {saved.get('phases')!r}), and no schedule "
                "follows this optimizer: its state loads into the plan applied now. Build the "
                "schedule (with this optimizer) before loading to resume in that phase.",
                UserWarning, stacklevel=3)
        else:
            sched.load_state_dict(saved)
        return {k: v for k, v in state_dict.items() if k != SCHEDULE_KEY}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's `load_state_dict`, keeping each state in the format its rule plans (torch's
        own casts every state tensor to its parameter's dtype): masters in their dtype, moments
        in the planned dtype or low-bit format, whatever the checkpoint holds. A checkpoint
        that holds a state narrower than planned is loaded widened, with a warning naming it.
        Each parameter with a master is set from it (the master is the truth).

        A state this optimizer's `state_dict()` handed out comes back as it was handed out
        when nothing was loaded into it: `torch.distributed.checkpoint` loads into the state
        dict's own tensors, and a partial load (`allow_partial_load=True`) leaves those the
        checkpoint lacks as they were. Such a master was not loaded: a master made for the
        first step is made from the weights (as from a checkpoint without masters), and the
        master the optimizer holds stays, restarting from its weight where the weight was
        loaded since; other such states beside loaded ones are named in a warning."""
        captured: list[dict[str, Any]] = []

        def capture(opt: Optimizer, given: dict[str, Any]) -> None:
            if "state" not in given or "param_groups" not in given:
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict expects torch's optimizer state "
                    f"dict (keys 'state' and 'param_groups'). Received keys: {sorted(given)}"
                    + (" (a checkpoint of precision_annot 0.4's PlanOptimizer, which kept "
                       "masters apart: load it with precision_annot 0.4 and save again)"
                       if "engines" in given else ""))
            captured.append(given)

        def rebuild(opt: Optimizer) -> None:
            del self._precision_annot_loading
            _rebuild_state(self, captured[-1])

        capture(self, state_dict)  # refused before anything changes
        captured.clear()
        state_dict = self._precision_annot_phase(state_dict)
        state_dict, kept = _unwritten(self, state_dict)
        pre = self.register_load_state_dict_pre_hook(capture)  # after the user's pre-hooks
        post = self.register_load_state_dict_post_hook(rebuild, prepend=True)
        self._precision_annot_loading = True
        try:
            super().load_state_dict(state_dict)
            if self.__dict__.get("_precision_annot_loading"):  # a class whose own load runs
                del self._precision_annot_loading  # no hooks (bitsandbytes')
                _rebuild_state(self, captured[-1] if captured else state_dict)
        finally:
            self.__dict__.pop("_precision_annot_loading", None)
            pre.remove()
            post.remove()
        with torch.no_grad():
            for param, master in kept:  # its own master, given back as it was
                self.state[param] = {"master": master, **self.state.get(param, {})}
                _reload_master(master, param, param.detach())

    def __getstate__(self) -> dict[str, Any]:
        """torch's (`defaults`, `state`, `param_groups`), and what the class and this one keep
        besides (LBFGS's `_params`, a third-party class's attributes, the plan's fields), but
        hooks, which torch leaves out too; low-bit states as their plain inner tensors, since
        torchao's cannot be cloned (deepcopy)."""
        state: dict[str, Any] = {k: v for k, v in self.__dict__.items()
                                 if not k.startswith(_TRANSIENT)}
        state.update(super().__getstate__())
        state["state"] = _plain_state(formats.portable(state["state"]))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # inside load_state_dict, torch's cast copies are replaced by `_rebuild_state` after
        if "state" in state and not self.__dict__.get("_precision_annot_loading"):
            state = {**state, "state": defaultdict(dict, {
                k: ({n: formats.rebuilt(v) for n, v in s.items()} if isinstance(s, dict) else s)
                for k, s in state["state"].items()})}
        super().__setstate__(state)
        guard.follow(self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # a class made at run time: pickled as its base class and its state
        return (_bare, (type(self)._precision_annot_base,), self.__getstate__())

    def __repr__(self) -> str:
        layouts: dict[str, int] = {}
        for item in items_of(self):
            layouts[item.rule.describe()] = layouts.get(item.rule.describe(), 0) + 1
        plan = "; ".join(f"{n} parameter(s) {k}" for k, n in layouts.items())
        return f"{super().__repr__()}\nupdated by precision_annot: {plan or 'nothing'}"


#: the tensors `state_dict()` handed out, by identity: the optimizer that handed each out and
#: its version counter then; one given back to that optimizer's `load_state_dict` with the
#: same version was not loaded into (see `_unwritten`)
_HANDED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _leaves(value: Any) -> Iterator[torch.Tensor]:
    """The tensors of a saved state entry: a tensor, or those a portable low-bit one holds."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for inner in value.values():
            yield from _leaves(inner)


def _stamp(t: torch.Tensor) -> int:
    """`t`'s version counter: a DTensor's local tensor's (DCP loads into that one, which
    leaves the DTensor's own counter as it was)."""
    to_local = getattr(t, "to_local", None)
    return version(to_local() if to_local is not None else t)


def _hand_out(opt: PlanOptimizer, state: dict[Any, Any]) -> None:
    owner = weakref.ref(opt)
    for saved in state.values():
        if isinstance(saved, dict):
            for value in saved.values():
                for t in _leaves(value):
                    _HANDED[t] = (owner, _stamp(t))


def _untouched(opt: PlanOptimizer, value: Any) -> bool | None:
    """Whether every tensor of a state entry is one `opt.state_dict()` handed out, unwritten
    since (True), some were written into (False), or it holds others (None)."""
    seen = [_HANDED.get(t) for t in _leaves(value)]  # type: ignore[no-untyped-call]
    if not seen or any(h is None or h[0]() is not opt for h in seen):
        return None
    return all(h[1] == _stamp(t) for h, t in zip(seen, _leaves(value), strict=True))


def _unwritten(opt: PlanOptimizer, given: dict[str, Any]
               ) -> tuple[dict[str, Any], list[tuple[torch.Tensor, torch.Tensor]]]:
    """`given` without the masters `opt.state_dict()` handed out that nothing was loaded
    into since (see `load_state_dict`), and each of those that `opt` holds as a parameter's
    master now (kept as its master); a warning names other such states beside loaded ones."""
    ids = chain.from_iterable(g["params"] for g in given["param_groups"])
    params = dict(zip(ids, chain.from_iterable(g["params"] for g in opt.param_groups),
                      strict=False))
    state: dict[Any, Any] = {}
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    stale: list[str] = []
    for key, saved in given["state"].items():
        param = params.get(key)
        state[key], held, left = _unwritten_in(opt, param, saved)
        if held is not None and param is not None:
            kept.append((param, held))
        name = opt._precision_annot_names.get(param, "") if param is not None else ""
        stale += [f"{name or f'#{key}'} {k}" for k in left]
    if stale:
        warnings.warn(
            f"load_state_dict: {len(stale)} state tensor(s) were not loaded "
            f"({', '.join(stale[:6])}{', ...' if len(stale) > 6 else ''}): they hold what "
            "state_dict() gave, beside states of the same parameters that were loaded (a "
            "partial torch.distributed.checkpoint load of a checkpoint saved in another "
            "layout). Load it with planner=precision_annot.adapters.dcp.LoadPlanner(), which "
            "reads each state in the checkpoint's layout and converts it as load_state_dict "
            "does.", UserWarning, stacklevel=3)
    return {**given, "state": state}, kept


def _unwritten_in(opt: PlanOptimizer, param: torch.Tensor | None, saved: Any
                  ) -> tuple[Any, torch.Tensor | None, list[str]]:
    """One parameter's saved state: without its master where that is one handed out and not
    loaded into; that master where `opt` holds it as the parameter's own; and the names of
    its other states not loaded into beside loaded ones (a partial load)."""
    if not isinstance(saved, dict):
        return saved, None, []
    marks = {k: _untouched(opt, v) for k, v in saved.items()}
    left = [k for k, m in marks.items() if m is True and k != "master"] \
        if False in marks.values() else []
    if param is None or marks.get("master") is not True:
        return saved, None, left
    held = opt.state.get(param, {}).get("master")
    return ({k: v for k, v in saved.items() if k != "master"},
            held if held is saved["master"] else None, left)


def _reload_master(master: torch.Tensor, param: torch.Tensor, value: torch.Tensor) -> None:
    """The master starts from the checkpoint's own value (a narrower float one, an fp16
    checkpoint into bf16 weights, widens exactly: it keeps the bits bf16 drops), unless that
    value is the master rounded (the weights loaded back unchanged keep the master's bits);
    else (another shape, not a float) from the loaded weight."""
    if value.shape == master.shape and value.is_floating_point():
        if wider(master.dtype, value.dtype) and torch.equal(
                master.to(device=value.device, dtype=value.dtype), value.detach()):
            return
        source = value.detach().to(device=master.device, dtype=master.dtype)
        if not torch.equal(source, master):
            master.copy_(source)
    elif not torch.equal(master.to(param.dtype), param.detach()):
        master.copy_(param.detach())


class _State(defaultdict):  # type: ignore[type-arg]
    """A planned optimizer's `state`: torch's defaultdict of per-parameter states, true (as
    `torch.distributed.checkpoint` asks, "is the state initialised?") also while empty when
    its `state_dict()` holds every parameter's first state (Adam, AdamW, SGD). Copied or
    pickled, a plain defaultdict."""

    def __init__(self, owner: PlanOptimizer, data: Any = ()) -> None:
        super().__init__(dict, data)
        self._owner = weakref.ref(owner)

    def __bool__(self) -> bool:
        if dict.__len__(self):
            return True
        owner = self._owner()
        return owner is not None and family(
            type(owner)._precision_annot_base) in engines.FRESH

    def __reduce__(self) -> Any:
        return (_plain_state, (dict(self),))

    def __copy__(self) -> Any:
        return _plain_state(dict(self))

    def copy(self) -> Any:
        return _plain_state(dict(self))


def _plain_state(data: dict[Any, Any]) -> defaultdict[Any, Any]:
    return defaultdict(dict, data)


_CLASSES: dict[type[Optimizer], type[PlanOptimizer]] = {}


def planned_class(optimizer_class: type[Optimizer]) -> type[PlanOptimizer]:
    """The class `precision_annot.optimizer` instantiates for `optimizer_class`: derived from
    `PlanOptimizer` and from it (made once per class)."""
    made = _CLASSES.get(optimizer_class)
    if made is None:
        made = cast(type[PlanOptimizer], type(optimizer_class.__name__, (
            PlanOptimizer, optimizer_class), {
                "_precision_annot_base": optimizer_class,
                "_precision_annot_step": staticmethod(eager_run_step()),
                "__module__": __name__,
                "__qualname__": f"PlanOptimizer[{optimizer_class.__qualname__}]",
                "__doc__": optimizer_class.__doc__}))
        _CLASSES[optimizer_class] = made
    return made


def _bare(optimizer_class: type[Optimizer]) -> PlanOptimizer:
    """A bare planned instance, for unpickling and deepcopy (its `__setstate__` follows)."""
    made = planned_class(optimizer_class)
    return made.__new__(made)


def _rebuild_state(opt: PlanOptimizer, given: dict[str, Any]) -> None:
    """After the class's `load_state_dict` (torch's casts every state tensor to its
    parameter's dtype): each parameter's master and moments rebuilt from the values as saved,
    in its rule's formats, other tensors in the dtype the class computes in; what the class's
    load made of the rest (a step counter, a third-party class's own packing) stays."""
    saved_ids = chain.from_iterable(g["params"] for g in given["param_groups"])
    params = chain.from_iterable(g["params"] for g in opt.param_groups)
    id_map = dict(zip(saved_ids, params, strict=True))
    state: defaultdict[Any, dict[str, Any]] = defaultdict(dict, opt.state)
    narrowed: list[str] = []
    for key, value in given["state"].items():
        param = id_map.get(key)
        if param is None or not isinstance(value, dict):  # not a parameter's: as loaded
            continue
        rule, name = rule_of(opt, param)
        state[param] = _loaded(param, rule, value, dict(opt.state.get(param, {})),
                               name or f"#{key}", narrowed)
        master = state[param].get("master")
        if isinstance(master, torch.Tensor) and (shared := guard.shared_master(
                opt, param, master.dtype, equal_to=master)) is not None:
            state[param]["master"] = shared  # (both loaded from one checkpoint: one again)
    opt.__setstate__({"state": state, "param_groups": opt.param_groups})
    opt.__dict__.pop("_precision_annot_layout", None)
    opt.__dict__.pop("_precision_annot_cache", None)  # (it holds the states loaded over)
    if narrowed:
        warnings.warn(
            f"load_state_dict: the checkpoint holds {len(narrowed)} state tensor(s) narrower "
            f"than planned ({', '.join(narrowed[:6])}{', ...' if len(narrowed) > 6 else ''}): "
            "they are loaded widened, and the bits the checkpoint dropped do not come back.",
            UserWarning, stacklevel=4)


def _loaded(param: torch.Tensor, rule: UpdateRule, saved: dict[str, Any],
            loaded: dict[str, Any], name: str, narrowed: list[str]) -> dict[str, Any]:
    """One parameter's state: `loaded` (what the class's load made of it) with its master,
    its moments and its other tensors taken again from `saved`."""
    out = dict(loaded)
    for key, raw in saved.items():
        value = formats.rebuilt(raw)
        if key == "step" or not _holds_tensors(value):
            continue  # as the class loaded it (a step counter where it was saved)
        if key == "master":
            out.pop("master", None)
            _load_master(param, rule, value, name, narrowed, out)
        elif formats.is_moment(key, value, param):
            out[key] = _load_moment(param, rule, key, value, f"{name} {key}", narrowed)
        else:
            out[key] = _in_working(value, param, rule)
    return out


def _holds_tensors(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value)


def _in_working(value: Any, param: torch.Tensor, rule: UpdateRule) -> Any:
    """A tensor (or a list of them: LBFGS's history) on the parameter's device, floating ones
    in the dtype the class computes in."""
    if isinstance(value, (list, tuple)):
        return type(value)(_in_working(v, param, rule) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    if value.is_floating_point():
        return value.to(device=param.device, dtype=rule.working)
    return value.to(device=param.device)


def _load_master(param: torch.Tensor, rule: UpdateRule, value: torch.Tensor, name: str,
                 narrowed: list[str], out: dict[str, Any]) -> None:
    value = value.to(device=param.device)
    dtype = rule.master
    if dtype is not None:
        if wider(dtype, value.dtype):
            narrowed.append(f"{name} master ({dtype_name(value.dtype)}, planned "
                            f"{dtype_name(dtype)})")
        out["master"] = value.to(dtype)
        write_back(param, out["master"], rule)
    else:
        write_back(param, value, rule)  # no master planned: the stored weight takes it


def _load_moment(param: torch.Tensor, rule: UpdateRule, key: str, value: torch.Tensor,
                 name: str, narrowed: list[str]) -> torch.Tensor:
    value = value.to(device=param.device)
    planned = rule.state
    low = formats.low_bit_of(value)
    assert planned is not None
    if isinstance(planned, torch.dtype):
        if low is not None or wider(planned, value.dtype):
            narrowed.append(f"{name} ({low or dtype_name(value.dtype)}, planned "
                            f"{dtype_name(planned)})")
        return formats.to_format(value, planned, param)
    like = param if rule.master is None else param.detach().to(rule.master)
    if not formats.quantized(planned, like):
        if low is not None:
            narrowed.append(f"{name} ({low}, planned {dtype_name(like.dtype)})")
        return formats.to_format(value, like.dtype, like)
    return formats.to_format(value, planned, like, signed=key not in formats.UNSIGNED)


# -- building one -----------------------------------------------------------------------------

def _model_params(model: nn.Module, plan: Any) -> tuple[dict[torch.Tensor, UpdateFields],
                                                         dict[torch.Tensor, str]]:
    """Each parameter of the model once (a shared one at its first holder), with its module's
    update fields and its qualified name."""
    fields: dict[torch.Tensor, UpdateFields] = {}
    names: dict[torch.Tensor, str] = {}
    for name, module in model.named_modules():
        said = fields_of(plan[name].policy) if name in plan else UpdateFields()
        for pname, p in module.named_parameters(recurse=False):
            if p in names:
                continue
            fields[p] = said
            names[p] = f"{name}.{pname}" if name else pname
    return fields, names


def _note_new(fields: dict[torch.Tensor, UpdateFields], names: dict[torch.Tensor, str]) -> None:
    """Parameters made since `apply` (`to_empty` makes new ones) are the applied plan's: the
    step guard and the loads that keep values for their masters learn them."""
    guard.note([], [(p, guard.Planned(names[p], f)) for p, f in fields.items()
                    if guard.planned(p) is None])


def optimizer(model: nn.Module, optimizer_class: type[Optimizer], /,
              params: Iterable[Any] | None = None, *, compile_step: bool | None = None,
              **hyperparameters: Any) -> Any:
    """An instance of `optimizer_class` that keeps the plan's update half: master copies,
    gradient and state dtypes, low-bit states, stochastic rounding, per module.

    It is the class you give, derived (`isinstance(opt, optimizer_class)` holds): param
    groups, per-group hyperparameters, LR schedulers, hooks, `zero_grad`, `add_param_group`,
    closures, `state_dict` / `load_state_dict`, deepcopy, pickling and
    `torch.distributed.checkpoint` work as they do for it. Its step asks, per parameter, how
    the plan applied to the model now updates it (so it may be built before `apply`):

    - `master=fp32` over bf16 or fp16 storage: an fp32 master copy of the parameter (kept in
      its state as "master") is updated from its gradient and written back rounded into
      storage. Adam, AdamW and SGD with `fused` and `foreach` left unset (or `fused=True`) do
      it in one pass through torch's fused kernel, bit for bit `fused=True` over the masters
      (on an NVIDIA GPU where Triton 3.9 or newer imports, through a Triton kernel of the same
      formula as torch's fused CPU kernel, checked on the first step; `PRECISION_ANNOT_TRITON=0`
      gives torch's fused CUDA kernel back); with `foreach=...`, `fused=False`, `differentiable`
      or `capturable` given, and for any other class, the class's own step updates the
      masters, the gradients upcast a chunk of parameters at a time.
    - `master="stochastic"` over bf16 storage: the class steps an fp32 copy made for the step,
      written back with stochastic rounding (torchao's); any class.
    - `grad=fp32`: the gradient is accumulated in fp32 (`Tensor.grad_dtype`), and the step
      reads it as it is.
    - `optim=bf16` (a float dtype): the state is kept in it between steps, and the class runs
      on it upcast; any class. `optim="8bit"`, `"4bit"`, `"fp8"`: torchao's low-bit states,
      through torchao's Adam update, compiled once per layout (Adam and AdamW; `fused=True`
      is refused there).

    Args:
        model: the model, its plan applied or its annotations resolved (wrappers are seen
            through).
        optimizer_class: a `torch.optim.Optimizer` class, e.g. `torch.optim.AdamW`, or a
            third-party one.
        params: what torch's optimizers take: parameters, (name, parameter) pairs, or group
            dicts with per-group hyperparameters. None takes every parameter of the model (a
            frozen one is skipped while it has no gradient, as torch does). (Default: None)
        compile_step: run the low-bit update (torchao's Adam) through `torch.compile`: one
            compiled kernel per layout (state format, flags, dtypes), whatever the shapes;
            the first step compiles. False runs the same operations eagerly (many passes
            over each state). None: compiled. (Default: None)
        **hyperparameters: for `optimizer_class` (`lr`, `weight_decay`, ...).

    Returns:
        An instance of `optimizer_class` (and of `PlanOptimizer`).

    Raises:
        TypeError: `optimizer_class` is not an optimizer class.
        ValueError: an update the class cannot make (a low-bit state with another class than
            Adam or AdamW, or with `fused=True`), naming the parameters.
        ImportError: the plan keeps a low-bit state (`optim="8bit"`, `"4bit"`, `"fp8"`) or
            rounds stochastically (`master="stochastic"`), which are torchao's, and torchao
            is not installed (the `fp8` extra installs it).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import precision_annot as pa
        >>> model = pa.apply(nn.Linear(8, 8), default="bf16-true,master=fp32")
        >>> opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-3)
        >>> isinstance(opt, torch.optim.AdamW)
        True
        >>> model(torch.randn(4, 8, dtype=torch.bfloat16)).float().sum().backward()
        >>> opt.step()
        >>> opt.master(model.weight).dtype
        torch.float32
    """
    # deferred: an import cycle (runtime imports guard)
    from precision_annot._src.runtime import applied_plan, subject

    require_module(model, "optimizer")
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
        raise TypeError("optimizer: optimizer_class must be a torch.optim.Optimizer class, "
                        f"e.g. torch.optim.AdamW. Received: {optimizer_class!r}")
    given = subject(model, "optimizer")
    target = given.model if given.model is not None else model
    fields, names = _model_params(target, given.plan)
    if applied_plan(target) is not None:
        _note_new(fields, names)
    if params is None:
        params = [p for p in names if p.is_floating_point() or p.is_complex()]
        if not params:
            raise ValueError("optimizer: the model has no floating parameters.")
    made = planned_class(optimizer_class)
    opt = made(params, **hyperparameters)
    opt._precision_annot_fields = fields
    opt._precision_annot_names = names
    opt._precision_annot_compile = None if compile_step is None else bool(compile_step)
    guard.follow(opt)
    items = items_of(opt)
    why = refusal(opt, [i for i in items if i.rule.engine == "torchao"])
    if why is not None:
        raise ValueError(f"optimizer: {why}")
    _require_torchao(items)
    return opt


def _require_torchao(items: Iterable[Any]) -> None:
    """Refuse now, not at the first step, an update half that needs torchao where it is not
    installed, saying what for and how to install it."""
    uses: dict[str, list[str]] = {}
    for item in items:
        what = item.rule.torchao
        if what is not None:
            uses.setdefault(what, []).append(item.name)
    try:
        formats.require_torchao(uses)
    except ImportError as e:
        raise ImportError(f"optimizer: {e}") from e.__cause__


def state_bytes(optimizer: Optimizer) -> int:
    """The bytes of every tensor an optimizer's state holds on this rank (masters included; a
    low-bit state's codes, scales and maps; a DTensor's local shard)."""
    return sum(formats.nbytes(v) for s in optimizer.state.values() if isinstance(s, dict)
               for v in s.values() if isinstance(v, torch.Tensor))
