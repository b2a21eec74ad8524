"""`Search`: each candidate plan checked end to end once per batch, the path kept."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections import Counter
from typing import Any

import torch
from torch import nn

from precision_annot._src.casting import floating_leaves
from precision_annot._src.plan import PrecisionPlan
from precision_annot._src.policy import Policy
from precision_annot._src.runtime import apply
from precision_annot._src.suggest.compare import relative_error, scan
from precision_annot._src.suggest.constants import SEED
from precision_annot._src.suggest.plans import (
    Islands,
    covering,
    islands_key,
    plan_for,
    runnable_copy,
)
from precision_annot._src.suggest.records import LossFn, Reference, Sample
from precision_annot._src.suggest.reference import run_reference
from precision_annot._src.suggest.report import Check
from precision_annot._src.suggest.watch import Watch
from precision_annot._src.tracking import ModuleTracker


class Search:
    """The end-to-end checks of one `suggest` call: each plan checked once per sample, the path
    kept, and the best plan seen."""

    def __init__(self, reference: nn.Module, structure: PrecisionPlan, policy: Policy,
                 island: Policy, loss_fn: LossFn | None, scale: float, tolerance: float,
                 margin: float, ties: list[set[str]], sizes: dict[str, int]) -> None:
        self.reference = reference
        self.structure = structure
        self.policy = policy
        self.island = island
        self.loss_fn = loss_fn
        self.scale = scale
        self.tolerance = tolerance
        self.margin = margin
        self.ties = ties
        self.sizes = sizes
        self.memo: dict[tuple[Any, ...], Check] = {}
        self.path: list[Check] = []
        self.own = {n: {id(p): p.numel() for p in m._parameters.values() if p is not None}
                    for n, m in reference.named_modules()}
        self.runs: Counter[str] = Counter()
        self.watching: str | None = None
        #: the share of the tolerance the calibration batch settled at, when no island
        #: brought it to the margin by enough to be worth its parameters (None: it reached it)
        self.settled: float | None = None
        #: it settled without seeking an island: it missed the margin by less than kernels
        #: move an error
        self.settled_near = False
        #: the limit the calibration batch is held to once it settled
        self.settled_limit: float | None = None
        #: Linear layers whose GEMMs run in the low dtype with a wide output instead of being
        #: islands (`arith.cheaper_arithmetic`), with their policy
        self.arithmetic: dict[str, Policy] = {}

    def held_together(self, islands: Islands) -> Islands:
        """The islands with every owner of a parameter they share with a module outside: a
        tie has one dtype, so a plan never stores one tensor in two."""
        if self.policy.storage == self.island.storage:
            return islands
        out = dict(islands)
        for owners in self.ties:
            inside = [o for o in owners if covering(o, out) is not None]
            if inside:
                for owner in owners:
                    if covering(owner, out) is None:
                        out[owner] = False
        return out

    def light(self, sample: Sample) -> Reference:
        """The plain fp32 run of `sample` (output, loss, gradients), run once."""
        if sample.light is None:
            sample.light = run_reference(self.reference, sample.args, sample.kwargs,
                                         self.loss_fn, sample, watch=False)
            self.runs["fp32"] += 1
        return sample.light

    def full(self, sample: Sample) -> Reference:
        """The watched reference of `sample`, run once, when a check or a choice needs it."""
        if sample.ref is None:
            low = self.policy.compute
            sample.ref = run_reference(
                self.reference, copy.deepcopy(sample.args), copy.deepcopy(sample.kwargs),
                self.loss_fn, sample, feeds_above=None if low is None else float(
                    torch.finfo(low).max))
            self.runs["fp32 watched"] += 1
        return sample.ref

    def fp32_params(self, islands: Islands) -> int:
        """The parameter elements the islands hold, a shared one counted once."""
        seen: dict[int, int] = {}
        for name, own in self.own.items():
            if covering(name, islands) is not None:
                seen.update(own)
        return sum(seen.values())

    def check(self, islands: Islands, sample: Sample, *, limit: float, find: bool = True
              ) -> Check:
        """The plan with `islands` run on `sample` and held to `limit`, once per batch (a run
        held to another limit is read again). With `find`, a run that fails with a non-finite
        value is watched op by op to name the module where it first arose (what the choice
        of the next island needs); without, pass or fail is all the caller reads (pruning,
        stepping down), and no run is watched."""
        islands = self.held_together(islands)
        key = (islands_key(islands), sample.label, limit,
               tuple(sorted((n, str(p)) for n, p in self.arithmetic.items())))
        found = self._seen(key)
        if found is not None and not (find and _unplaced(found)):
            return found if found.limit == limit else held_to(found, limit)
        assert sample.light is not None
        # a run is watched (every op, to find where a non-finite value arises) only when it
        # fails with one: a failing run stops at the loss, a forward, while watching a run
        # that passes costs a step of Python per op. Watched at once: a run seen before
        # without being watched, and the first, when the fp32 run already says it will fail
        # (`watching`)
        watching = find and (found is not None or self.watching == sample.label)
        self.watching = None
        result = run_check(self, islands, sample, limit, watch=watching)
        if find and _unplaced(result) and not watching:
            result = run_check(self, islands, sample, limit, watch=True)  # find where
        self.memo[key] = result
        self.path.append(result)
        return result

    def _seen(self, key: tuple[Any, ...]) -> Check | None:
        """The run of these islands on this batch, held to this limit or another."""
        return self.memo.get(key) or next(
            (c for (k, label, _, arith), c in self.memo.items()
             if k == key[0] and label == key[1] and arith == key[3]), None)

    def plan(self, islands: Islands, modules: dict[str, nn.Module] | None = None,
             structure: PrecisionPlan | None = None) -> PrecisionPlan:
        return plan_for(structure or self.structure, self.policy, islands, modules, self.island,
                        self.arithmetic)


def _unplaced(check: Check) -> bool:
    """A run that failed with a non-finite value, not watched to say where it arose."""
    return check.first_nonfinite is None and not check.finite and check.crashed is None


def run_check(search: Search, islands: Islands, sample: Sample, limit: float, *,
              watch: bool) -> Check:
    """Run the plan with `islands` on `sample` (watched: every op, for where a non-finite
    value first arises) and compare with the fp32 run."""
    model = runnable_copy(search.reference, search.policy)
    apply(model, search.plan(islands))
    search.runs["checks (watched)" if watch else "checks"] += 1
    tracker = ModuleTracker({m: n for n, m in model.named_modules()})
    mode = Watch(tracker, baseline=search.full(sample).nonfinite if watch else None)
    errors: list[float | None] = [math.inf, None, None]  # output, loss, gradients
    crashed = raised_in = None
    room = Room(model, sample, search.policy.compute)
    try:
        with (tracker if watch else contextlib.nullcontext()), (
                mode if watch else contextlib.nullcontext()), room:
            _compare(search, model, sample, errors)
    except Exception as e:  # the plan itself fails: an fp32 output its caller cannot take, a
        # dtype an op or the model's own code refuses (any exception: a check of its own)
        crashed = f"{type(e).__name__}: {e}"[:300]
        raised_in = _raised_in(e, {m: n for n, m in model.named_modules()})
        errors[0] = math.inf
        errors[1] = None if errors[1] is None else math.inf
    finally:
        model.zero_grad(set_to_none=True)  # parameters may be the reference's own
    output_error, loss_error, grad_error = errors
    assert output_error is not None
    return Check(tuple(islands), tuple(i for i, out in islands.items() if out), output_error,
                 loss_error, grad_error, mode.first_nonfinite if watch else None,
                 _passes(errors, limit, room.crowded), sample.label, limit,
                 search.fp32_params(islands), crashed, room.crowded, raised_in)


def _raised_in(error: BaseException, names: dict[nn.Module, str]) -> str | None:
    """The innermost module whose forward was running when `error` was raised (read from its
    traceback: no hook to pay for on runs that do not raise), or None: outside every module
    (the loss function, or the backward, which runs no module's Python)."""
    where = None
    tb = error.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and owner in names:
            where = names[owner]
        tb = tb.tb_next
    return where


def _passes(errors: Any, limit: float, crowded: tuple[str, float] | None) -> bool:
    """Every error measured finite and within `limit`, and every output kept its room."""
    return crowded is None and all(math.isfinite(e) and e <= limit for e in errors
                                   if e is not None)


class Room:
    """Whether the plan's values keep room below the low dtype's largest on `sample`: the
    first module whose output, held in the low dtype, reaches past `sample.room` of it. Only
    the modules whose fp32 output came near it are hooked (usually none: nothing to pay)."""

    def __init__(self, model: nn.Module, sample: Sample, low: torch.dtype | None) -> None:
        assert sample.light is not None
        self.crowded: tuple[str, float] | None = None
        self.handles: list[Any] = []
        self.low = low
        self.largest = math.inf if low is None else float(torch.finfo(low).max)
        self.limit = sample.room * self.largest
        hot = {n for n, peak in sample.light.output_peaks.items()
               if sample.room < 1 and peak > 0.9 * self.limit}
        self.modules = [(n, m) for n, m in model.named_modules() if n in hot]

    def __enter__(self) -> Room:
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in self.modules]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()

    def _hook(self, name: str) -> Any:
        def hook(_: nn.Module, __: Any, out: Any) -> None:
            if self.crowded is not None:
                return
            leaves: list[torch.Tensor] = []
            floating_leaves(out, leaves)
            peak = max((scan(t.detach(), peaks=True)[1] for t in leaves if t.dtype == self.low),
                       default=0.0)
            if peak > self.limit:
                self.crowded = (name, peak / self.largest)
        return hook


def _compare(search: Search, model: nn.Module, sample: Sample, errors: list[float | None]
             ) -> None:
    """One seeded step of `model` on `sample`: the errors of the output, the loss and the
    gradients against the fp32 run, written into `errors` as they are known (a step that
    raises part way keeps those already measured)."""
    ref = sample.light
    assert ref is not None
    torch.manual_seed(SEED)
    output = model(*copy.deepcopy(sample.args), **copy.deepcopy(sample.kwargs))
    errors[0] = relative_error(output, ref.output)
    if search.loss_fn is None or ref.loss is None:
        return
    loss = search.loss_fn(output, sample)
    errors[1] = loss_error = relative_error(loss, ref.loss)
    if not math.isfinite(loss_error):  # a scaler skips this step: no gradients
        errors[2] = math.inf
        return
    grads = _scaled_backward(search, model, loss)
    shared = [n for n in ref.grads if n in grads]
    errors[2] = math.inf if len(grads) != len(ref.grads) else relative_error(
        [grads[n] for n in shared], [ref.grads[n] for n in shared])


def held_to(check: Check, limit: float) -> Check:
    """`check`'s run held to another limit."""
    return dataclasses.replace(check, limit=limit,
                               passed=_passes(check.errors().values(), limit, check.crowded))


def worst_error(check: Check) -> float:
    return max(check.errors().values())


def _scaled_backward(search: Search, model: nn.Module, loss: torch.Tensor
                     ) -> dict[str, torch.Tensor]:
    """The gradients as a `GradScaler` training loop gets them: the loss scaled, and while a
    gradient is non-finite, the scale lowered (by 4x, down to 1) and the backward run again, as
    the scaler skips the step and backs off; unscaled, in float64. The scale that worked is
    kept for the next check, as the scaler keeps its scale from step to step. A backward that
    will be retried stops at the first parameter gradient that is not finite."""
    scale = search.scale
    while True:
        retry = scale > 1
        overflowed = _backward(model, loss * scale, stop=retry)
        if scale != search.scale:
            search.runs["backward retries"] += 1
        grads = {n: p.grad.double() / scale for n, p in model.named_parameters()
                 if p.grad is not None}
        if not retry or (not overflowed and all(
                bool(torch.isfinite(g).all()) for g in grads.values())):
            search.scale = scale
            return grads
        model.zero_grad(set_to_none=True)
        scale = max(1.0, scale / 4)


class _Overflow(Exception):
    """A parameter's gradient is not finite: the backward is retried at a lower scale."""


def _backward(model: nn.Module, loss: torch.Tensor, *, stop: bool) -> bool:
    """`loss.backward()`, keeping the graph; with `stop`, cut short where a parameter's
    gradient is not finite (the rest would be thrown away). Whether it was."""
    def check(grad: torch.Tensor) -> None:
        if not bool(torch.isfinite(grad).all()):
            raise _Overflow

    handles = [p.register_hook(check) for p in model.parameters()  # type: ignore[no-untyped-call]
               if p.requires_grad] if stop else []
    try:
        loss.backward(retain_graph=stop)  # type: ignore[no-untyped-call]
    except _Overflow:
        return True
    finally:
        for handle in handles:
            handle.remove()
    return False


def ties_of(model: nn.Module) -> list[set[str]]:
    """The modules sharing each shared parameter."""
    owners: dict[int, set[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for p in module._parameters.values():
            if p is not None:
                owners.setdefault(id(p), set()).add(name)
    return [o for o in owners.values() if len(o) > 1]


def sizes_of(model: nn.Module) -> dict[str, int]:
    """Each module's parameter elements, children and shared ones counted once."""
    out: dict[str, int] = {}
    for name, module in model.named_modules():
        out[name] = sum(p.numel() for p in module.parameters())
    return out
