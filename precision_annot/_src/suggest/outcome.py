"""What the search comes to: met or not, and the message that says so."""

from __future__ import annotations

import math
import warnings

from precision_annot._src.suggest.choose import WORTH
from precision_annot._src.suggest.constants import MIN_ROWS
from precision_annot._src.suggest.plans import Islands
from precision_annot._src.suggest.report import Check
from precision_annot._src.suggest.search import Search, best_check


def outcome(search: Search, islands: Islands, message: str, final: Check, held: list[Check],
             speed: list[str], why: dict[str, str]) -> tuple[bool, str, Islands]:
    """Whether the plan is met, what to say, and the islands to return (the best plan seen on
    the calibration batch, when none met the tolerance)."""
    met = not message and final.passed and all(c.passed for c in held)
    if met:
        fallback = _whole_model(search, islands, speed)
        if not fallback:
            return True, _met_message(search, islands, final, held, speed, why), islands
        met, message = False, fallback
    if not message:
        failing = next(c for c in [final, *held] if not c.passed)
        message = (f"The plan does not meet the tolerance on the {failing.sample} batch ("
                   + ", ".join(f"{k} {v:.2e}" for k, v in failing.errors().items()) + ").")
    best = best_check(search, final.sample)
    if best is not None and not message.startswith("No plan"):
        islands = {i: i in best.outputs for i in best.islands}
    return False, message, islands


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
          f"at {share:.2f} of the tolerance: no further island brought its worst error "
          f"down by {WORTH:.0%}, so the {margin:g} margin stayed a target")
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
