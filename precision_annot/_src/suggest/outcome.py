"""What the search comes to: met or not, and the message that says so."""

from __future__ import annotations

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
            return True, _met_message(search, islands, held, speed, why), islands
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


def _met_message(search: Search, islands: Islands, held: list[Check], speed: list[str],
                 why: dict[str, str]) -> str:
    count = len([i for i in islands if i not in speed])
    margin = search.margin
    at = (f"at {margin:g} of the tolerance" if search.settled is None else
          f"at {search.settled:.2f} of the tolerance: no further island brought its worst "
          f"error down by {WORTH:.0%}, so the {margin:g} margin stayed a target")
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
