"""Precision over time: a plan that changes at chosen steps of a run.

`schedule(model, {0: "bf16-master", 9_000: "32-true"})` applies the first phase at once, and
its `step()`, called after each optimizer step, applies the next phase at the step where it
starts. Each switch is a plain `apply`: the optimizer `precision_annot.optimizer` built follows
it (a master the new phase drops is written into its weight, one it adds is made from the
widest copy there is), and gradients are dropped at the switch, as `zero_grad` drops them.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from precision_annot._src.checkpoints.loading import Narrowed, warn_narrowed
from precision_annot._src.dtypes import dtype_name
from precision_annot._src.guards import require_module
from precision_annot._src.memory import MemoryReport
from precision_annot._src.plan import PrecisionPlan
from precision_annot._src.policy import Policy, SpecLike
from precision_annot._src.resolution import resolve
from precision_annot._src.runtime import DEFER_NARROWED, apply
from precision_annot._src.update import formats, guard
from precision_annot._src.update.optimizer import PlanOptimizer
from precision_annot._src.update.rule import Item, module_rules
from precision_annot._src.update.step import refusal

__all__ = ["Narrowing", "Schedule", "Switch", "phases_of", "schedule", "switches_of",
           "unwrapped_optimizer"]

Phase = PrecisionPlan | SpecLike


@dataclasses.dataclass(frozen=True)
class Narrowing:
    """What a switch lost: the values of one kind (`what`: "weight", the truth of a parameter,
    its master where it has one; or an optimizer state, "exp_avg", "momentum_buffer") moved
    from format `source` to `target` (a dtype name, or a low-bit format: "8bit", "4bit",
    "fp8"), and changed by it.

    Attributes:
        what: the kind of values.
        source: their format before the switch.
        target: their format after it.
        tensors: how many tensors changed.
        numel: their elements.
        change: the largest change of one tensor, relative to its largest magnitude
            (`max|new - old| / max|old|`).
    """

    what: str
    source: str
    target: str
    tensors: int
    numel: int
    change: float

    def __str__(self) -> str:
        return (f"{self.what} {self.source} -> {self.target} ({self.tensors} tensors, "
                f"{self.numel:,} values; largest relative change {self.change:.3g})")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Switch:
    """One switch of a `Schedule`, at the start of step `step`.

    Attributes:
        step: the first step of the new phase.
        phase: the new phase's index in `phases`.
        spec: the new phase's plan or spec, as text ("<plan>" for a `PrecisionPlan`).
        previous: the phase before, as text.
        narrowed: what the switch lost, kind by kind (empty when every value held its
            bits: a master kept or written into a wider weight, a state widened).
    """

    step: int
    phase: int
    spec: str
    previous: str
    narrowed: tuple[Narrowing, ...] = ()

    def __str__(self) -> str:
        text = f"step {self.step}: phase {self.phase} ({self.previous} -> {self.spec})"
        if self.narrowed:
            text += "; narrowed " + "; ".join(map(str, self.narrowed))
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "phase": self.phase, "spec": self.spec,
                "previous": self.previous, "narrowed": [n.to_dict() for n in self.narrowed]}


_LOG = "_precision_annot_switches"


def switches_of(model: nn.Module) -> list[Switch]:
    """Every switch a schedule made on `model` so far, in order (`watch` and `audit` read it).
    """
    log: list[Switch] = model.__dict__.get(_LOG, [])
    return log


def _text(spec: Phase) -> str:
    return "<plan>" if isinstance(spec, PrecisionPlan) else str(spec)


#: per (parameter, kind): the tensor holding its values and their format, before or after a
#: switch (aliases: a cast leaves the tensor it replaced as it was)
_Truths = dict[tuple[int, str], tuple[torch.Tensor, str, torch.Tensor]]


def _fmt(t: torch.Tensor) -> str:
    return formats.low_bit_of(t) or dtype_name(t.dtype)


def _truths(params: Sequence[torch.Tensor], optimizers: list[Any]) -> _Truths:
    """Each parameter's truth (its master where an optimizer holds one, else itself) and each
    of its optimizer states shaped like it."""
    out: _Truths = {}
    for p in params:
        master: torch.Tensor | None = None
        for opt in optimizers:
            state = opt.state.get(p)
            if not state:
                continue
            held = state.get("master")
            if isinstance(held, torch.Tensor):
                master = held
            for key, value in state.items():
                if formats.is_moment(key, value, p):
                    out[(id(p), str(key))] = (value, _fmt(value), p)
        # a master not made yet starts from the value kept for it (the widest copy)
        truth = master if master is not None else guard.wide_of(p)
        truth = truth if truth is not None else p.detach()
        out[(id(p), "weight")] = (truth, _fmt(truth), p)
    return out


def _change(old: torch.Tensor, new: torch.Tensor, like: torch.Tensor) -> float:
    with torch.no_grad():
        a = formats.to_format(old, torch.float64, like)
        b = formats.to_format(new, torch.float64, like)
        scale = float(a.abs().max()) if a.numel() else 0.0
        diff = float((a - b).abs().max()) if a.numel() else 0.0
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def _narrowed(before: _Truths, after: _Truths) -> tuple[Narrowing, ...]:
    """What changed in value between the two (a format that cannot hold the old values)."""
    kinds: dict[tuple[str, str, str], list[float]] = {}
    numel: dict[tuple[str, str, str], int] = {}
    for key, (old, source, like) in before.items():
        held = after.get(key)
        if held is None or (held[1] == source and held[0] is old):
            continue
        change = _change(old, held[0], like)
        if change == 0.0:
            continue
        kind = (key[1], source, held[1])
        kinds.setdefault(kind, []).append(change)
        numel[kind] = numel.get(kind, 0) + old.numel()
    return tuple(Narrowing(what, source, target, len(changes), numel[(what, source, target)],
                           max(changes))
                 for (what, source, target), changes in sorted(kinds.items()))


def _check_spec(key: object, value: object) -> None:
    """A phase's plan or spec, as `apply` takes it (a plan, or a default spec)."""
    if isinstance(value, (PrecisionPlan, Policy, torch.dtype)):
        return
    if isinstance(value, str):
        try:
            Policy.parse(value)
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"schedule: phases[{key!r}] is not a plan or spec: {e} "
                f"Received: phases[{key!r}]={value!r}") from e
        return
    raise ValueError(
        f"schedule: phases[{key!r}] must be a PrecisionPlan, a Policy, a torch.dtype or a spec "
        f"string (such as 'bf16-master' or '32-true'). Received: phases[{key!r}]={value!r} "
        f"(of type {type(value).__name__})")


def _step_of(key: object, total_steps: int | None) -> int:
    """The step a key of `phases` names: an int >= 0, or a float in [0, 1) of `total_steps`."""
    if isinstance(key, bool) or not isinstance(key, (int, float)):
        raise ValueError(
            "schedule: each key of phases must be a step (an int >= 0) or a fraction of "
            f"total_steps (a float in [0, 1)). Received: key {key!r} (of type "
            f"{type(key).__name__})")
    if isinstance(key, int):
        if key < 0:
            raise ValueError(
                "schedule: a step in phases must be >= 0 (the first optimizer step is 0). "
                f"Received: key {key!r}")
        return key
    if not (math.isfinite(key) and 0.0 <= key < 1.0):
        raise ValueError(
            "schedule: a fraction in phases must be a float in [0, 1) of total_steps (1.0 "
            f"would start after the last step). Received: key {key!r}")
    if total_steps is None:
        raise ValueError(
            f"schedule: phases has the fraction {key!r}, which needs total_steps= (the number "
            "of optimizer steps in the run); or give the phase's step as an int. Received: "
            "total_steps=None")
    return round(key * total_steps)


def _check_total(total_steps: object) -> None:
    if total_steps is not None and (isinstance(total_steps, bool) or not isinstance(
            total_steps, int) or total_steps <= 0):
        raise ValueError(
            "schedule: total_steps must be a positive int (the number of optimizer steps in "
            f"the run), or None. Received: total_steps={total_steps!r}")


def _by_step(phases: Mapping[Any, Any], total_steps: int | None
             ) -> dict[int, tuple[object, Phase]]:
    by_step: dict[int, tuple[object, Phase]] = {}
    for key, value in phases.items():
        step = _step_of(key, total_steps)
        _check_spec(key, value)
        if step in by_step:
            raise ValueError(
                f"schedule: phases {by_step[step][0]!r} and {key!r} both start at step {step} "
                f"(total_steps={total_steps!r}); give each phase its own step. Received: "
                f"phases={dict(phases)!r}")
        by_step[step] = (key, value)
    return by_step


def _refuse_late(by_step: dict[int, tuple[object, Phase]], total_steps: int,
                 phases: Mapping[Any, Any]) -> None:
    late = [by_step[step][0] for step in by_step if step >= total_steps]
    if late:
        raise ValueError(
            f"schedule: phases {late} start at or after total_steps={total_steps} (the last "
            f"step is {total_steps - 1}), so they would never run; give them a step below "
            f"total_steps. Received: phases={dict(phases)!r}")


def phases_of(phases: object, total_steps: int | None, *, last: bool = False
              ) -> list[tuple[int, Phase]]:
    """`phases` checked, as (first step, plan or spec) pairs in order; fractions are of
    `total_steps`; with `last`, `total_steps` is the run's own (not a trainer's `max_steps`
    for one fit of a run resumed later), and a phase that starts after it is refused."""
    if not isinstance(phases, Mapping) or not phases:
        raise ValueError(
            "schedule: phases must be a non-empty dict from a step (int) or a fraction of "
            "total_steps (float in [0, 1)) to a plan or spec, such as {0: 'bf16-master', "
            f"0.9: '32-true'}}. Received: phases={phases!r}")
    _check_total(total_steps)
    by_step = _by_step(phases, total_steps)
    if last and total_steps is not None:
        _refuse_late(by_step, total_steps, phases)
    if 0 not in by_step:
        raise ValueError(
            "schedule: phases must have a phase at step 0 (0 or 0.0), the plan the run starts "
            f"in. Received: phases starting at steps {sorted(by_step)}")
    return [(step, by_step[step][1]) for step in sorted(by_step)]


def unwrapped_optimizer(optimizer: Any) -> Any:
    """The optimizer a trainer's wrapper holds (Accelerate's `AcceleratedOptimizer`,
    Lightning's `LightningOptimizer`, Fabric's, which passes for the class it wraps: each
    keeps it as `.optimizer`), or `optimizer`."""
    for _ in range(8):
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, Optimizer) or inner is optimizer:
            break
        optimizer = inner
    return optimizer


class Schedule:
    """A plan that changes at chosen steps; see `schedule`.

    Attributes:
        phases: the phases in order, as (first step, plan or spec) pairs.
        step_count: the optimizer steps taken so far (the next step's index).
        history: each switch made so far (a `Switch`: its step, phases and what it narrowed).
    """

    def __init__(self, model: nn.Module, phases: list[tuple[int, Phase]],
                 optimizer: Optimizer | None, *, step: int = 0) -> None:
        self.model = model
        self.phases = phases
        self.optimizer = optimizer
        self.step_count = step  # a resumed run's: its phase is the first applied, alone
        self.history: list[Switch] = []
        self._applied: int | None = None
        self._attached = False  # some optimizer saves this schedule's phase
        self._narrowed_load: list[Narrowed] = []
        self._stepped = False  # no step counted yet by this object: a resume may be loading
        self._follow_model()
        self._switch()
        self.attach()
        if len(phases) > 1 and dist.is_available() and dist.is_initialized() and (
                dist.get_world_size() > 1):
            warnings.warn(
                "schedule: under torch.distributed, a switch changes the parameters' dtypes, "
                "and a DistributedDataParallel or FSDP wrapper made before it keeps buffers "
                "for the old ones (DDP's replicas then drift apart, silently; FSDP2's next "
                "forward fails on the mixed dtypes): wrap the model again at each switch "
                "(sched.step() returns True there), e.g. "
                "`if sched.step(): ddp_model = DistributedDataParallel(model)`.",
                UserWarning, stacklevel=3)

    def _defer(self, found: list[Narrowed]) -> bool:
        """The model's weights were loaded narrower than the phase now keeps them: before
        the run's first step here (a resume), a checkpoint of another phase, whose optimizer
        state (loaded next, in a trainer's order) holds the phase and its masters; said at
        the next step if no such state came. Later (the best checkpoint loaded at the end, a
        validation from a checkpoint), said now."""
        if self._stepped:
            return False
        self._narrowed_load = list(found)
        return True

    @property
    def phase(self) -> int:
        """The index in `phases` of the phase the next step runs in."""
        return self._phase_at(self.step_count)

    def _phase_at(self, step: int) -> int:
        return max(i for i, (start, _) in enumerate(self.phases) if start <= step)

    @property
    def current(self) -> Phase:
        """The plan or spec of the phase the next step runs in."""
        return self.phases[self.phase][1]

    @property
    def switches(self) -> list[int]:
        """The steps at which a new phase starts (after the first)."""
        return [start for start, _ in self.phases[1:]]

    def step(self) -> bool:
        """Count one optimizer step (call it after `optimizer.step()`); where the next step
        starts a new phase, apply it. Returns whether it switched."""
        self.step_count += 1
        if not self._attached and not self._stepped:
            self.attach()  # an optimizer a trainer built after the schedule, at its first step
        self._stepped = True
        guard.release_wide(self.model.parameters())
        if self._narrowed_load:
            found, self._narrowed_load = self._narrowed_load, []
            warn_narrowed("load_state_dict (said at the step after it: no optimizer state of "
                          "a scheduled phase was loaded since)", found, stacklevel=2)
        return self._switch()

    def seek(self, step: int) -> bool:
        """Go to `step` (the optimizer steps taken, as a resumed trainer counts them), applying
        its phase. Returns whether it switched."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"Schedule.seek: step must be an int >= 0. Received: step={step!r}")
        self.step_count = step
        return self._switch()

    def _optimizers(self) -> list[Any]:
        """The `precision_annot.optimizer`s stepping the model's parameters."""
        found = guard.optimizers_of(list(self.model.parameters()))
        if self.optimizer is not None and self.optimizer not in found:
            found.insert(0, self.optimizer)
        return found

    def attach(self) -> None:
        """Each optimizer of the model saves the phase in its `state_dict()` and, loaded,
        goes to it first (see `PlanOptimizer.load_state_dict`)."""
        for opt in self._optimizers():
            opt.__dict__["_precision_annot_schedule"] = weakref.ref(self)
            self._attached = True

    def _switch(self, *, measure: bool = True) -> bool:
        phase = self.phase
        if phase == self._applied:
            return False
        params = list(self.model.parameters())
        for param in params:  # stale in the old dtype, as zero_grad drops them
            param.grad = None
        previous = self._applied
        before = None if previous is None or not measure else _truths(params,
                                                                     self._optimizers())
        spec = self.phases[phase][1]
        with warnings.catch_warnings():  # planned: a weight held narrower, then wider (and
            # what the switch loses is said below, measured)
            warnings.filterwarnings("ignore", message=r".*stored narrower than before the first")
            with guard.switching(previous is not None):
                if isinstance(spec, PrecisionPlan):
                    apply(self.model, spec)
                else:
                    apply(self.model, default=spec)
        self._applied = phase
        if before is None or previous is None or not measure:
            return True
        params = list(self.model.parameters())
        record = Switch(self.step_count, phase, _text(spec), _text(self.phases[previous][1]),
                        _narrowed(before, _truths(params, self._optimizers())))
        self.history.append(record)
        self.model.__dict__.setdefault(_LOG, []).append(record)
        if record.narrowed:
            warnings.warn(
                f"schedule: the switch at step {record.step} to phase {phase} ({record.spec}) "
                f"narrowed values the phase before held: {'; '.join(map(str, record.narrowed))}."
                " Planned so: nothing to do; a phase that keeps them (a master, a wider "
                "optimizer state) would not.", UserWarning, stacklevel=3)
        return True

    def memory(self, optimizer: Any = "adamw", **hyperparameters: Any
               ) -> list[tuple[int, MemoryReport]]:
        """The bytes training holds in each phase (`PrecisionPlan.memory` of its plan), as
        (first step, report) pairs."""
        out = []
        for start, spec in self.phases:
            plan = spec if isinstance(spec, PrecisionPlan) else resolve(self.model, default=spec)
            out.append((start, plan.memory(optimizer, **hyperparameters)))
        return out

    def state_dict(self) -> dict[str, Any]:
        """The step count and the phase it is in, for a checkpoint."""
        return {"step": self.step_count, "phase": self.phase,
                "phase_start": self.phases[self.phase][0],
                "phases": [[start, _text(spec)] for start, spec in self.phases]}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Go on from a checkpoint's step, in its phase (applied now). Load it before the
        model's and the optimizer's state, so that they load into the plan they were saved
        under."""
        step = state_dict.get("step") if isinstance(state_dict, Mapping) else None
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(
                "Schedule.load_state_dict: state_dict must be what Schedule.state_dict() "
                f"returned, with an int 'step' >= 0. Received: state_dict={state_dict!r}")
        texts = state_dict.get("phases")
        mine = [[start, _text(spec)] for start, spec in self.phases]
        if texts is not None and [list(t) for t in texts] != mine:
            raise ValueError(
                f"Schedule.load_state_dict: the checkpoint was saved at step {step} under the "
                f"phases {texts!r}, and this schedule's are {mine!r}: build the schedule with "
                f"the phases the run was saved under. Received: state_dict={dict(state_dict)!r}")
        saved = (state_dict.get("phase"), state_dict.get("phase_start"))
        phase = self._phase_at(step)
        if saved != (phase, self.phases[phase][0]):
            raise ValueError(
                f"Schedule.load_state_dict: the checkpoint was saved at step {step} in phase "
                f"{saved[0]!r} (from step {saved[1]!r}), and this schedule's phases put step "
                f"{step} in phase {phase} (from step {self.phases[phase][0]}): "
                "build the schedule with the phases the run was saved under. Received: "
                f"state_dict={dict(state_dict)!r}")
        if step != self.step_count:  # another point of the run: its masters load with it
            self._narrowed_load = []  # (a state given back where it is, as Accelerate's
        self.step_count = step  # wrapper gives it, says nothing about the weights loaded)
        self._switch(measure=False)  # not a switch of the run: its state is loaded next

    def __setstate__(self, state: dict[str, Any]) -> None:
        # (a copy follows the copied model and attaches to the copied optimizers)
        self.__dict__.update(state)
        self._attached = False
        self._follow_model()
        self.attach()

    def _follow_model(self) -> None:
        """The model's parameters kept wide on a load, and its loads' narrowing deferred to
        this schedule (see `_defer`)."""
        guard.schedule_keeps(self.model.parameters())
        ref = weakref.ref(self)
        DEFER_NARROWED[self.model] = lambda found: (s := ref()) is not None and s._defer(found)

    def __repr__(self) -> str:
        phases = ", ".join(f"{start}: {spec!s}" if not isinstance(spec, PrecisionPlan)
                           else f"{start}: <plan>" for start, spec in self.phases)
        return f"Schedule({{{phases}}}, step={self.step_count}, phase={self.phase})"


def schedule(model: nn.Module, phases: Mapping[int | float, Phase], *,
             optimizer: Optimizer | None = None, total_steps: int | None = None) -> Schedule:
    """Change a model's plan at chosen steps of a run: bf16 with fp32 masters, then the last
    10% in fp32; or fp32 warm-up steps, then bf16.

    The phase of step 0 is applied at once. Call `step()` after each `optimizer.step()`; at a
    step where a new phase starts it applies that phase's plan (with `apply`), before the
    step's forward. Each switch is exact: with `precision_annot.optimizer`, a master the new
    phase drops is written into its weight, which then holds its full value, and a master it
    adds is made from the widest copy there is (the fp32 weights of the phase before), not
    from the rounded weight; the moments carry over, in the new phase's format. Gradients are
    dropped at a switch (set to None, as `zero_grad` does).

    Args:
        model: the module tree.
        phases: from the step where each phase starts (an int; or a float in [0, 1), a
            fraction of `total_steps`, rounded to the nearest step) to its plan (a
            `PrecisionPlan`) or its spec (a default for `apply`: "bf16-master", "32-true",
            a `Policy`, a dtype). There must be a phase at step 0.
        optimizer: the run's optimizer, which must be a `precision_annot.optimizer` (a plain
            one would hold state in the old dtypes after a switch). (Default: None)
        total_steps: the number of optimizer steps in the run, for fractions. (Default: None)

    Returns:
        A `Schedule`; `state_dict()` / `load_state_dict()` carry its step and phase.

    Example:
        >>> import torch, precision_annot as pa
        >>> model = torch.nn.Linear(4, 4)
        >>> sched = pa.schedule(model, {0: "bf16-master", 0.5: "32-true"}, total_steps=4)
        >>> [sched.step() for _ in range(4)], model.weight.dtype
        ([False, True, False, False], torch.float32)
    """
    require_module(model, "schedule")
    if "_original_forward" in model.__dict__:
        raise ValueError(
            "schedule: the model's forward was wrapped by accelerate's prepare (its "
            "mixed_precision autocast), which a plan applied after it does not take back: build "
            "the schedule before accelerator.prepare(model, ...). Received: a model with "
            "_original_forward set")
    optimizer = unwrapped_optimizer(optimizer)
    if optimizer is not None and not isinstance(optimizer, PlanOptimizer):
        raise ValueError(
            "schedule: optimizer must be one precision_annot.optimizer built (it follows each "
            "switch: masters, moments and their formats); a plain torch optimizer would hold "
            "state in the dtypes of the phase before. Build it with "
            "precision_annot.optimizer(model, torch.optim.AdamW, lr=...). Received: "
            f"optimizer of type {type(optimizer).__name__}")
    steps = phases_of(phases, total_steps, last=True)
    if optimizer is not None:
        _check_optimizer(model, steps, optimizer)
    return Schedule(model, steps, optimizer)


def _check_optimizer(model: nn.Module, phases: list[tuple[int, Phase]],
                     optimizer: PlanOptimizer) -> None:
    """Refused now, not at the switch: an optimizer of another model, and a phase whose
    update the optimizer cannot make (a low-bit state with another class than Adam, or
    torchao missing)."""
    params = {id(p) for p in model.parameters()}
    held = [p for g in optimizer.param_groups for p in g["params"]]
    if params and not any(id(p) in params for p in held):
        raise ValueError(
            "schedule: optimizer steps none of the model's parameters (it was built for "
            "another model?): give the optimizer precision_annot.optimizer built for this "
            f"model. Received: an optimizer of {len(held)} parameter(s), a model of "
            f"{len(params)}")
    for start, spec in phases:
        plan = spec if isinstance(spec, PrecisionPlan) else resolve(model, default=spec)
        items, uses = _phase_items(model, plan, optimizer)
        why = refusal(optimizer, items)
        if why is not None:
            raise ValueError(f"schedule: the phase from step {start} ({_text(spec)}): {why}")
        formats.require_torchao(uses)


def _phase_items(model: nn.Module, plan: PrecisionPlan, optimizer: PlanOptimizer
                 ) -> tuple[list[Item], dict[str, list[str]]]:
    """The optimizer's parameters whose update under `plan` is torchao's low-bit one, and what
    each parameter takes from torchao, by use (as `optimizer` checks them when built)."""
    group = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    named = dict(model.named_parameters())
    items: list[Item] = []
    uses: dict[str, list[str]] = {}
    for name, row in plan.items():
        for info, rule in module_rules(row):
            full = f"{name}.{info.name}" if name else info.name
            p = named.get(full)
            if p is None or id(p) not in group:
                continue
            if rule.torchao is not None:
                uses.setdefault(rule.torchao, []).append(full)
            if rule.low_bit:
                items.append(Item(group[id(p)], p, rule, full))
    return items, uses
