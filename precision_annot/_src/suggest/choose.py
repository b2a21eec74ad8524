"""The choice: add islands until a check passes, drop them again, step down into children, and
search again on a held-out batch that fails."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import NamedTuple

import torch
from torch import nn

from precision_annot._src.dtypes import dtype_name
from precision_annot._src.plan import PrecisionPlan, parent_name
from precision_annot._src.suggest.compare import finite_peak
from precision_annot._src.suggest.constants import KERNELS, MAX_CHECKS, OUTSIDE
from precision_annot._src.suggest.plans import Islands, covering
from precision_annot._src.suggest.progress import Progress
from precision_annot._src.suggest.records import LossFn, Reference, Sample
from precision_annot._src.suggest.report import Check, Sensitivity
from precision_annot._src.suggest.search import Search, held_to, worst_error

_HANDED = "its output overflowed on the way out: it hands back fp32"
_ROOM = ("its output, in the low dtype, came within the margin of that dtype's largest value: "
         "it hands back fp32")
#: islands chosen by error must together halve the worst error within FUTILE tries: a plan's
#: error is not a property of the plan alone (the same plan measured with another CPU's
#: kernels moves by up to 40%, KERNELS), and islands that do less may only be trading one
#: kernel set's rounding for another's
WORTH = 0.5


def _runs_above(structure: PrecisionPlan, name: str) -> str:
    """The nearest ancestor that runs its own forward ("" for the root)."""
    parent = parent_name(name)
    while parent and structure[parent].container:
        parent = parent_name(parent)
    return parent


def _climb(structure: PrecisionPlan, ref: Reference, start: str, limit: float
           ) -> tuple[str, bool]:
    """The island that takes over from `start`, whose output overflowed its caller: the
    nearest module at or above `start` (never the root) whose output, as the fp32 run
    recorded it, fits the low dtype with room to spare; else the outermost, handing back fp32.
    One level at a time, chosen from the recorded peaks, not by a check per level."""
    name, last = start, start
    while name:
        if name in ref.outputs and finite_peak(ref.outputs[name]) < limit / 2:
            return name, False
        last = name
        name = _runs_above(structure, name)
    return last, True


class Move(NamedTuple):
    """The island `choose` adds next, why, and how."""

    target: str
    out32: bool
    reason: str
    exact: bool = False  # out32 as given, not kept True where the island already hands fp32
    by_error: bool = False  # chosen by measured error (finite): may settle at the tolerance


_NO_ROOT = ("No plan short of the whole model in fp32 meets the tolerance: a non-finite value "
            "arises in the model's own code (the root), which cannot be an island.")
_NO_LOSS = ("No plan short of the whole model in fp32 meets the tolerance: a non-finite value "
            "first appears outside the model, in loss_fn: compute the loss in fp32 "
            "(output.float()).")
_NO_ROOM = ("No plan short of the whole model in fp32 meets the tolerance: the model's own "
            "output, in the low dtype, comes within the margin of that dtype's largest value on "
            "the calibration batch, and the root cannot be an island. Return the output in "
            "fp32 (compute it in an fp32 module), or scale it down.")
_NO_CALLER = ("No plan short of the whole model in fp32 meets the tolerance: the output of the "
              "fp32 island does not fit the low dtype when it is handed back to its caller, "
              "the root, which cannot be an island.")


#: islands chosen by error in a row must together bring the worst error down by WORTH: where
#: this many do not, more of the same will not either, and the search stops there
FUTILE = 3


def choose(search: Search, sample: Sample, start: Islands, measure: Callable[[], list[
            Sensitivity]], progress: Progress, low_max: float, fixed: frozenset[str],
            limit: float | None = None, prune: bool = True
            ) -> tuple[Islands, str, dict[str, str]]:
    """Add islands until a check on `sample` passes at `limit` (the margin times the
    tolerance by default). Returns the islands, a message when it gave up, and why each island
    was added. `fixed` islands (kept for speed) are never pruned."""
    limit = search.tolerance * search.margin if limit is None else limit
    islands = dict(start)
    why: dict[str, str] = {}
    candidates = sum(1 for e in search.structure.values() if not e.container)
    last = search.check(islands, sample, limit=limit)
    weigh = _Weigh()
    while not last.passed and len(search.memo) < MAX_CHECKS:
        progress.update(f"checks on the {sample.label} batch", len(search.memo),
                        min(MAX_CHECKS, candidates + 1))
        if _near(search, last, limit):
            # it misses the margin by less than another CPU's kernels move an error: whether
            # it passes is up to the CPU, so it settles here, as it would where it passes
            search.settled_near = True
            last, limit = _settle(search, last)
            break
        move = _next_island(search, sample, islands, last, why, measure, low_max, limit,
                            weigh.broke)
        if isinstance(move, str):
            return islands, move, why
        trial = _with(islands, move)
        # a candidate chosen by its error may not be kept: where it fails, it is watched (to
        # say where) only once it is
        before, last = last, search.check(trial, sample, limit=limit, find=not move.by_error)
        if weigh(move, before, last, within=_within(search, before, limit)):
            last = search.check(trial, sample, limit=limit)  # seen before, or watched
            islands = trial
            why[move.target] = move.reason
        else:  # the next candidate instead
            last = before
        if weigh.exhausted and not last.passed:
            if not _within(search, last, limit):
                return islands, weigh.futile(sample, last), why
            # the margin is a target, not a cliff: within the tolerance, the plan settles
            last, limit = _settle(search, last)
            break
    if not last.passed:
        return islands, (f"No plan met the tolerance within {MAX_CHECKS} end-to-end checks."
                         ), why
    if not prune:  # islands the batches seen before need stay
        return islands, "", why
    return _prune(search, sample, islands, limit, progress, fixed), "", why


def _settle(search: Search, last: Check) -> tuple[Check, float]:
    """The plan settles short of the margin: from here it is held to what it reached, with
    the room kernels need (KERNELS), up to the tolerance, so that pruning and stepping down
    keep what its islands gained."""
    search.settled = worst_error(last) / search.tolerance
    limit = min(search.tolerance, KERNELS * worst_error(last))
    search.settled_limit = limit
    return held_to(last, limit), limit


def _with(islands: Islands, move: Move) -> Islands:
    """The islands with `move`'s target, which takes the place of the islands inside it."""
    trial = {i: o for i, o in islands.items() if covering(i, {move.target: False}) is None}
    trial[move.target] = move.out32 or (not move.exact and islands.get(move.target, False))
    return trial


class _Weigh:
    """Whether an island chosen by its error is kept: only where the run stays finite and its
    worst error comes down by more than another CPU's kernels move an error (KERNELS);
    else the next candidate is tried instead. The search is `exhausted` once FUTILE islands
    by error in a row, kept or not, have not halved the worst error (WORTH): more of them
    will not either; and for a plan already within the tolerance (missing only the margin),
    at the first island not kept: each try costs a step, for room the plan does not need."""

    def __init__(self) -> None:
        self.broke: set[str] = set()
        self.start: float | None = None  # the worst error the current run of tries started at
        self.tries = 0
        self.exhausted = False

    def __call__(self, move: Move, before: Check, after: Check, within: bool = False) -> bool:
        if not move.by_error:
            self.start, self.tries = None, 0
            return True
        if self.start is None:
            self.start = worst_error(before)
        self.tries += 1
        kept = after.finite and after.crashed is None and (
            KERNELS * worst_error(after) <= worst_error(before))
        if kept and worst_error(after) <= (1 - WORTH) * self.start:
            self.start, self.tries = worst_error(after), 0
        self.exhausted = self.tries >= FUTILE or (within and not kept)
        if not kept:
            self.broke.add(move.target)
        return kept

    def futile(self, sample: Sample, last: Check) -> str:
        return (f"No plan short of the whole model in fp32 meets the tolerance: {FUTILE} "
                f"islands chosen by their error in a row did not halve the worst error on the "
                f"{sample.label} batch (from {self.start:.2e}: {worst_error(last):.2e}).")


def _next_island(search: Search, sample: Sample, islands: Islands, last: Check,
                 why: dict[str, str], measure: Callable[[], list[Sensitivity]],
                 low_max: float, limit: float, broke: Collection[str] = ()) -> Move | str:
    """The island to add after `last` failed, or why no plan short of fp32 can pass."""
    structure = search.structure
    handed = [i for i in last.outputs if why.get(i) in (_HANDED, _ROOM)]
    if last.crashed is not None and handed:  # its caller cannot take fp32: move up
        target, out32 = _climb(structure, search.full(sample),
                               _runs_above(structure, handed[-1]) or handed[-1], low_max)
        return Move(target, out32, "an island's fp32 output could not be taken by its caller",
                     exact=True)
    if last.crashed is not None:  # the plan's run raised: errors say nothing, where it did
        return _by_raise(search, islands, last)
    # a run that ended finite failed by its errors: a non-finite value its watch saw on the
    # way (a scaled backward that overflowed and was retried at a lower scale, as a
    # GradScaler skips a step) is not why
    if last.finite and last.crowded is not None:
        return _by_room(islands, last.crowded[0])
    culprit = last.first_nonfinite if not last.finite else None
    if culprit == OUTSIDE:
        return _NO_LOSS
    if culprit is None:
        return _by_error(islands, last, measure(), limit, broke, _fits(sample, low_max))
    return _by_culprit(search, sample, islands, culprit, low_max)


def _by_culprit(search: Search, sample: Sample, islands: Islands, culprit: str,
                low_max: float) -> Move | str:
    """Where a non-finite value first arose in `culprit`: it becomes an island; an island it
    is already hands back fp32; an island whose fp32 output overflowed its caller moves up."""
    structure = search.structure
    owner = covering(culprit, islands) if culprit else None
    callers = [i for i, out in islands.items() if out and _runs_above(structure, i) == culprit]
    if owner is not None and not islands[owner]:
        return Move(owner, True, _HANDED)
    if owner is not None or (culprit and callers):
        target, out32 = _climb(structure, search.full(sample), owner or culprit, low_max)
        return Move(target, out32, "an island's fp32 output overflowed its caller") \
            if target else _NO_CALLER
    if not culprit:
        return _NO_ROOT
    if not _fits(sample, low_max)(culprit):
        # its fp32 output does not fit the low dtype with room to spare: handed back in it,
        # it would overflow on the way out, so it hands back fp32 from the start (a check
        # saved per such culprit)
        return Move(culprit, True, _HANDED)
    return Move(culprit, False, "a non-finite value arose in it")


RAISED = "the plan's run raised in its own code"


def _by_raise(search: Search, islands: Islands, last: Check) -> Move | str:
    """Where the plan's run raised (its code meets a dtype it cannot take: a tensor it makes
    in fp32 multiplied with a low one, where no autocast casts them): the module it raised in
    becomes an island, computing in fp32 on fp32 inputs. Where that is the root, an island
    already, or no module, no island can help, and the error is named."""
    where = last.raised_in
    if where and covering(where, islands) is None:
        return Move(where, False, RAISED)
    low = dtype_name(search.policy.compute)
    at = ("outside the model (in loss_fn or the backward)" if where is None else
          "in the model's own code (the root, which cannot be an island)" if not where else
          f"inside the fp32 island {covering(where, islands)!r}, in {where!r}")
    return (f"No plan short of the whole model in fp32 meets the tolerance: the plan's run "
            f"raised {at}: {last.crashed}. Code that makes its own fp32 tensors and mixes them "
            f"with {low} ones needs autocast to cast them (a '-mixed' low: '16-mixed', "
            f"'bf16-mixed'), or a cast in the code.")


def _by_room(islands: Islands, name: str) -> Move | str:
    """Where a module's output, held in the low dtype, came within the margin of its largest
    value (on data it was not chosen on, it may overflow): the module hands back fp32, as an
    island of its own or the island that holds it."""
    if not name:
        return _NO_ROOM
    owner = covering(name, islands)
    return Move(owner or name, True, _ROOM, exact=True)


def _fits(sample: Sample, low_max: float) -> Callable[[str], bool]:
    """Whether a module's output, as the plain fp32 run recorded it, fits the low dtype with
    room to spare, as `_climb` reads it (unrecorded: taken to fit)."""
    peaks = sample.light.output_peaks if sample.light is not None else {}
    return lambda name: peaks.get(name, 0.0) < low_max / 2


def _by_error(islands: Islands, last: Check, table: list[Sensitivity], limit: float,
              broke: Collection[str] = (), fits: Callable[[str], bool] = lambda _: True
              ) -> Move | str:
    """With finite errors too large: the most sensitive module measured alone that neither
    is in an island nor holds one. A module holding an island was measured alone with the
    island's own trouble inside it (an overflowing `wo` makes its whole encoder rank first),
    which the island already answers: taking it would trade the island for its ancestor."""
    target = next((s.name for s in table if s.score > 0 and covering(s.name, islands) is None
                   and not any(covering(i, {s.name: False}) for i in islands)
                   and s.name not in broke), None)
    if target is None:
        return _no_candidate(last, table, broke)
    if target == "":
        return _NO_CALLER
    grads_only = (last.grad_error is not None and last.grad_error > limit
                  and last.output_error <= limit
                  and (last.loss_error is None or last.loss_error <= limit))
    # an island whose fp32 output does not fit the low dtype hands it back in fp32
    return Move(target, not fits(target), "gradients" if grads_only else "sensitive",
                exact=True, by_error=True)


def _no_candidate(last: Check, table: list[Sensitivity], broke: Collection[str]) -> str:
    """Why no module is left to try by error: each is an island, holds one, was tried and
    not kept (`broke`), or could not be run alone."""
    tried = [s.name for s in table if s.name in broke]
    return ("No plan short of the whole model in fp32 meets the tolerance: every module "
            "measured alone is an island already, holds one, "
            + (f"was tried as one and did not bring the worst error down by more than "
               f"{KERNELS:g}x ({', '.join(repr(t) for t in tried)}), " if tried else "")
            + "or could not be run alone. The errors reached: "
            + ", ".join(f"{k} {v:.2e}" for k, v in last.errors().items()) + ".")


def _near(search: Search, check: Check, limit: float) -> bool:
    """`check` misses only the margin, and by less than kernels move an error."""
    return _within(search, check, limit) and check.crowded is None and (
        worst_error(check) <= KERNELS * limit)


def _within(search: Search, check: Check, limit: float) -> bool:
    """`check` misses only the margin on the calibration batch: every error finite and within
    the tolerance."""
    return limit < search.tolerance and check.finite and check.crashed is None and all(
        e <= search.tolerance for e in check.errors().values())


def _prune(search: Search, sample: Sample, islands: Islands, limit: float,
           progress: Progress, fixed: frozenset[str]) -> Islands:
    """Drop each island again, the largest first, while the plan still passes; then hand back
    in the low dtype where fp32 output is not needed."""
    order = sorted((i for i in islands if i not in fixed), key=lambda n: -search.sizes.get(n, 0))
    for i, island in enumerate(order):
        progress.update("pruning", i, len(order))
        trial = {k: v for k, v in islands.items() if k != island}
        if search.check(trial, sample, limit=limit, find=False).passed:
            islands = trial
    islands = _step_down(search, sample, islands, limit, fixed)
    for island in [k for k, v in islands.items() if v and not _overflows(search, sample, k)]:
        trial = {**islands, island: False}
        if search.check(trial, sample, limit=limit, find=False).passed:
            islands = trial
    progress.done()
    return islands


def _overflows(search: Search, sample: Sample, island: str) -> bool:
    """The island's output, as the fp32 run recorded it, is twice what the low dtype holds:
    handed back in it, it is inf, so no check is needed to know that it must hand back fp32.
    (Read only where that run was watched already.)"""
    ref = sample.ref
    low = search.policy.compute
    if ref is None or low is None or island not in ref.outputs:
        return False
    return finite_peak(ref.outputs[island]) >= 2 * torch.finfo(low).max


def _rescuers(search: Search, sample: Sample, name: str) -> list[str]:
    """The children of island `name` that may stand in for it. Where its own code made a
    value past the low dtype's largest (as the fp32 run recorded), a child handing back fp32
    can keep that value in fp32 only if the value was computed from the child's output: the
    others fail for sure and are not tried."""
    kids = _children(search.structure, name)
    ref = sample.ref
    if ref is None or name not in ref.feeds:
        return kids
    return [k for k in kids if k in ref.feeds[name]]


def _children(structure: PrecisionPlan, name: str) -> list[str]:
    """The modules right under `name` that run their own forward (a container's children
    stand in for it)."""
    out: list[str] = []
    for child in structure:
        if child and parent_name(child) == name:
            out += _children(structure, child) if structure[child].container else [child]
    return out


def _step_down(search: Search, sample: Sample, islands: Islands, limit: float,
               fixed: frozenset[str]) -> Islands:
    """Replace each island by the smallest of its children that passes in its place, handing
    back fp32 (so that the island's own code still sees the child's result at full
    precision), and go on down from it: an MoE layer kept whole because its router's logits
    need fp32 becomes the router. One check per child tried, the smallest first; an island
    none of whose children passes alone stays."""
    for island in [i for i in islands if i not in fixed]:
        current = island
        while True:
            kids = sorted(_rescuers(search, sample, current),
                          key=lambda n: search.sizes.get(n, 0))
            rest = {k: v for k, v in islands.items() if k != current}
            found = next((kid for kid in kids if search.sizes.get(kid, 0) < search.sizes.get(
                current, 0) and search.check({**rest, kid: True}, sample, limit=limit,
                                            find=False).passed),
                None)
            if found is None:
                break
            islands = {**rest, found: True}
            current = found
    return islands


def verify(search: Search, others: list[Sample], islands: Islands,
            message: str, why: dict[str, str],
            measure_on: Callable[[Sample], Callable[[], list[Sensitivity]]],
            bar: Progress, fixed: frozenset[str], losses: LossFn | None,
            reference: nn.Module) -> tuple[Islands, str]:
    """Check the islands on each held-out batch at the tolerance; on a batch where they fail,
    search again from them on that batch."""
    low = search.policy.compute
    assert low is not None
    for i, batch in enumerate(others):
        if message:
            break
        bar.update("held-out batches", i, len(others))
        search.light(batch)
        if search.check(islands, batch, limit=search.tolerance).passed:
            continue
        islands, message, more = choose(search, batch, islands, measure_on(batch), bar,
                                         torch.finfo(low).max, fixed, limit=search.tolerance,
                                         prune=False)
        why.update(more)
    bar.done()
    return islands, message
