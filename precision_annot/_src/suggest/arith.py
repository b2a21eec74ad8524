"""Cheaper arithmetic for an island: before a Linear stays an fp32 island, its GEMMs run in the
low dtype with an fp32 output (bf16 operands, the product never rounded to bf16), then with
that output's gradient split into 2 pieces for the backward GEMMs. The cheapest that meets the
tolerance on every batch replaces the island."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from precision_annot._src.arithmetic import owns_gemm_weights, runs_linear_forward
from precision_annot._src.dtypes import LOW_PRECISION, fp32
from precision_annot._src.policy import Policy
from precision_annot._src.suggest.outcome import Batches
from precision_annot._src.suggest.plans import Islands
from precision_annot._src.suggest.report import Check
from precision_annot._src.suggest.search import Search

__all__ = ["CANDIDATES", "cheaper_arithmetic"]

#: what an island tries before fp32, cheapest first (what `backward` adds to the wide output)
CANDIDATES: tuple[str, ...] = ("round", "split2")


def candidates(low: Policy) -> list[Policy]:
    """The low policy with an fp32 output, then with a 2-piece backward too."""
    return [low.merge(Policy(output=fp32, backward=b)) for b in CANDIDATES]


def _gemm_islands(low: Policy, islands: Islands, modules: dict[str, nn.Module]) -> list[str]:
    """The islands whose GEMMs a cheaper arithmetic could run: Linear layers and modules
    running F.linear on a weight of their own, under a bf16 or fp16 low policy (not fp8)."""
    if low.fp8 is not None or low.compute not in LOW_PRECISION:
        return []
    return [n for n in islands
            if runs_linear_forward(modules[n]) or owns_gemm_weights(modules[n])]


def cheaper_arithmetic(search: Search, islands: Islands, batches: Batches,
                       modules: dict[str, nn.Module],
                       progress: Callable[[int, int], None] | None = None
                       ) -> tuple[Islands, dict[str, Policy], Check, list[Check]] | None:
    """The islands that are Linear layers, each tried with the low dtype's GEMMs and an fp32
    output (then a 2-piece backward) instead of fp32: the islands left, the arithmetic that
    replaced the others, and the checks of that plan; None where no island could go (or the
    low policy is not a bf16/fp16 one). Each trial keeps the replacements found before it."""
    low = search.policy
    linear = _gemm_islands(low, islands, modules)
    if not linear:
        return None
    kept, chosen = dict(islands), dict[str, Policy]()
    for i, name in enumerate(linear):
        if progress is not None:
            progress(i, len(linear))
        trial = {k: v for k, v in kept.items() if k != name}
        if name in search.held_together(trial):
            continue  # tied to a parameter an island keeps wide: a tie has one dtype
        for policy in candidates(low):
            search.arithmetic = {**chosen, name: policy}
            final, held = batches.checks(search, trial)
            if final.passed and all(c.passed for c in held):
                kept, chosen[name] = trial, policy
                break
    search.arithmetic = chosen
    if not chosen:
        return None
    final, held = batches.checks(search, kept)
    return kept, chosen, final, held
