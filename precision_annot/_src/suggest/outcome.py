"""What the search comes to: met or not, and the message that says so."""

from __future__ import annotations

import math
import warnings

from precision_annot._src.dtypes import dtype_name
from precision_annot._src.suggest.choose import WORTH
from precision_annot._src.suggest.constants import KERNELS, MIN_ROWS
from precision_annot._src.suggest.plans import Islands, islands_key
from precision_annot._src.suggest.records import Sample
from precision_annot._src.suggest.report import Check
from precision_annot._src.suggest.search import Search


class Batches:
    """The batches a plan is reported on: the calibration batch, held to the margin (or to the
    tolerance where the choice settled short of it), and the held-out batches, held to the
    tolerance (each run in fp32 first where the search stopped before it)."""

    def __init__(self, calib: Sample, others: list[Sample]) -> None:
        self.calib = calib
        self.others = others

    def checks(self, search: Search, islands: Islands) -> tuple[Check, list[Check]]:
        tolerance = search.tolerance
        for batch in self.others:
            search.light(batch)
        held = [search.check(islands, b, limit=tolerance, find=False) for b in self.others]
        final = search.check(islands, self.calib, limit=tolerance * search.margin
                             if search.settled_limit is None else search.settled_limit,
                             find=False)
        return final, held


def outcome(search: Search, islands: Islands, message: str, batches: Batches,
            speed: list[str], why: dict[str, str]
            ) -> tuple[bool, str, Islands, Check, list[Check]]:
    """Whether the plan is met, what to say, and the plan to return with its checks: the
    search's plan when it meets the tolerance; else the smallest plan seen that runs finite
    on every batch and comes nearest (see `nearest`)."""
    final, held = batches.checks(search, islands)
    met = not message and final.passed and all(c.passed for c in held)
    if met:
        fallback = _whole_model(search, islands, speed)
        if not fallback:
            return True, _met_message(search, islands, final, held, speed, why), islands, \
                final, held
        message = fallback
    if not message:
        failing = next(c for c in [final, *held] if not c.passed)
        message = (f"The plan does not meet the tolerance on the {failing.sample} batch ("
                   + ", ".join(f"{k} {v:.2e}" for k, v in failing.errors().items()) + ")"
                   + _crowding(search, failing) + ".")
    found = nearest(search, batches, islands)
    if found is not None:
        islands, final, held = found
        message += _nearest_message(search, final, held)
    return False, message, islands, final, held


def _crowding(search: Search, check: Check) -> str:
    if check.crowded is None:
        return ""
    name, share = check.crowded
    return (f"; {repr(name) if name else 'the model'}'s output, in "
            f"{dtype_name(search.policy.compute)}, "
            f"reaches {share:.0%} of its largest value, past the {search.margin:g} margin")


#: at most this many plans, the smallest first, are weighed for the nearest one
NEAREST_PLANS = 8


def nearest(search: Search, batches: Batches, islands: Islands
            ) -> tuple[Islands, Check, list[Check]] | None:
    """When no plan meets the tolerance: the smallest plan checked that runs finite on every
    batch, or a larger one only where it brings the worst error down by WORTH (the share that
    kernels' rounding cannot account for). A larger plan that still misses by about as much
    helps nobody: the user chooses between this plan, a looser tolerance and fp32. None when
    no plan seen ran finite."""
    best: tuple[Islands, Check, list[Check]] | None = None
    for plan in _finite_plans(search, islands)[:NEAREST_PLANS]:
        if best is not None and _known_worst(search, plan) > (1 - WORTH) * _worst(
                [best[1], *best[2]]):
            continue  # what it measured already rules it out: no need to run it again
        final, held = batches.checks(search, plan)
        if not all(c.finite for c in [final, *held]):
            continue
        if best is None or _worst([final, *held]) <= (1 - WORTH) * _worst([best[1], *best[2]]):
            best = plan, final, held
    return best


def _finite_plans(search: Search, islands: Islands) -> list[Islands]:
    """The plans the search ran finite, and the one it ended at, smallest first; a plan seen
    non-finite on any batch is left out."""
    plans: dict[tuple[tuple[str, bool], ...], Islands] = {}
    broken: set[tuple[tuple[str, bool], ...]] = set()
    for c in search.path:
        plan = {i: i in c.outputs for i in c.islands}
        (plans if c.finite else {}).setdefault(islands_key(plan), plan)
        if not c.finite:
            broken.add(islands_key(plan))
    plans.setdefault(islands_key(islands), islands)
    kept = [p for k, p in plans.items() if k not in broken]
    return sorted(kept, key=lambda p: (search.fp32_params(p), len(p)))


def _known_worst(search: Search, plan: Islands) -> float:
    """The worst error `plan` measured on any batch so far."""
    key = islands_key(search.held_together(plan))
    return max((max(c.errors().values()) for c in search.path
                if islands_key({i: i in c.outputs for i in c.islands}) == key), default=0.0)


def _worst(checks: list[Check]) -> float:
    return max(max(c.errors().values()) for c in checks)


def _nearest_message(search: Search, final: Check, held: list[Check]) -> str:
    if all(c.passed for c in [final, *held]):  # it meets: its size is what says no
        return ""
    worst = max([final, *held], key=lambda c: max(c.errors().values()))
    error = max(worst.errors().values())
    total = search.sizes.get("", 0)
    share = f", {final.fp32_params / total:.1%} of the parameters" if total else ""
    count = len(final.islands)
    said = (f" Returned: the smallest plan that runs finite on every batch and comes nearest "
            f"({count} island{'' if count == 1 else 's'}{share}): its worst error is "
            f"{error:.2e} ({error / search.tolerance:.2f} of the tolerance, on the "
            f"{worst.sample} batch).")
    if error >= 1:  # a relative error of 1 is what zeros measure: no tolerance makes it useful
        return said + (" An error of 1 or more is no closer to fp32 than zeros are: keep the "
                       "model in fp32.")
    if error > search.tolerance:
        return said + f" Use it at a tolerance of {error:.2g} or more, or keep the model in fp32."
    crowded = next((c for c in [final, *held] if c.crowded is not None), None)
    return said + ("" if crowded is None else _crowding(search, crowded).replace(
        "; ", " What it misses is room: ", 1) + ".")


def _whole_model(search: Search, islands: Islands, speed: list[str]) -> str:
    """Why a passing plan is no answer, when its islands (not those kept for speed, which
    stay in the low compute's wider dtype) hold every parameter; else ""."""
    total = search.sizes.get("", 0)
    kept = [i for i in islands if i not in speed]
    if not (total and kept and search.fp32_params(dict.fromkeys(kept, False)) >= total):
        return ""
    return ("No plan short of the whole model in fp32 meets the tolerance: the plan that "
            "passes keeps every parameter in fp32 (" + ", ".join(repr(i) for i in kept)
            + "), since each island's output overflows the low dtype in its caller.")


def _met_message(search: Search, islands: Islands, final: Check, held: list[Check],
                 speed: list[str], why: dict[str, str]) -> str:
    count = len([i for i in islands if i not in speed])
    margin = search.margin
    share = max(final.errors().values()) / search.tolerance  # the plan's own, after pruning
    at = (f"within {margin:g} of the tolerance" if search.settled is None else
          f"at {share:.2f} of the tolerance: it missed the {margin:g} margin by less than "
          f"another CPU's kernels move an error ({KERNELS - 1:.0%}), so it settled there"
          if search.settled_near else
          f"at {share:.2f} of the tolerance: the next island chosen by error did not bring "
          f"its worst error down by more than another CPU's kernels move it ({KERNELS - 1:.0%})"
          f", so the {margin:g} margin stayed a target")
    message = (f"The plan meets the tolerance with {count} island{'' if count == 1 else 's'}, "
               f"on the calibration batch ({at}) and on {len(held)} held-out batch"
               f"{'' if len(held) == 1 else 'es'}.")
    forced = [i for i, reason in why.items() if reason == "gradients" and i in islands]
    if forced:
        message += (f" Gradients alone forced {', '.join(repr(f) for f in forced)}: the "
                    "outputs and the loss were within the tolerance without "
                    f"{'it' if len(forced) == 1 else 'them'}.")
    return message


def warn_small(small: str, rows: int) -> None:
    if rows < MIN_ROWS:
        small = " ".join(filter(None, [small, (
            f"The calibration batch holds {rows} rows (tokens, samples): too few to show "
            "the peaks a plan must survive. Pass a larger sample.")]))
    if small:
        warnings.warn(f"suggest: {small}", UserWarning, stacklevel=3)


def unverified(rows: int) -> str:
    return (" Unverified: " + (f"the calibration batch holds {rows} rows (tokens, samples), "
                               f"fewer than {MIN_ROWS}" if rows < MIN_ROWS
                               else "no held-out batch checked it")
            + ", so the plan has not been shown to hold on data it was not chosen on.")


#: torch.amp.GradScaler's initial loss scale
DEFAULT_INIT_SCALE = 2.0 ** 16


def scale_advice(scale: float) -> str:
    """The loss scale the fp16 checks needed, when a GradScaler takes long to grow there."""
    bits = round(math.log2(scale))
    steps = (bits - 16) * 2000
    return (f" The fp16 checks ran at a loss scale of 2**{bits}: this model's gradients are "
            f"small, and at GradScaler's initial 2**16 they flush to zero in fp16 until the "
            f"scaler has doubled its way there (every 2,000 steps without overflow: about "
            f"{steps:,} steps). Start it there: GradScaler(init_scale=2.0**{bits}).")


def notes(met: bool, verified: bool, rows: int, loss_scale: float | None) -> str:
    """What a met plan's message adds: that it is unverified, and the loss scale to start a
    GradScaler at when the default is far below it."""
    if not met:
        return ""
    out = "" if verified else unverified(rows)
    if loss_scale is not None and loss_scale > DEFAULT_INIT_SCALE * 2 ** 8:
        out += scale_advice(loss_scale)
    return out
