"""`suggest`: measure, choose, verify, report."""

from __future__ import annotations

import math
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from precision_annot._src.casting import map_tree
from precision_annot._src.dtypes import dtype_name, fp16
from precision_annot._src.float8 import Gemm, import_torchao, kernel_refusal
from precision_annot._src.guards import require_module
from precision_annot._src.policy import Policy, SpecLike
from precision_annot._src.resolution import resolve
from precision_annot._src.samples import as_call
from precision_annot._src.suggest.arith import cheaper_arithmetic
from precision_annot._src.suggest.batches import (
    as_given,
    as_loss_fn,
    rows_of,
    split_samples,
)
from precision_annot._src.suggest.choose import choose, verify
from precision_annot._src.suggest.constants import (
    DEFAULT_TOLERANCE,
    FP8_TOLERANCE,
    MARGIN,
    MIN_ROWS,
)
from precision_annot._src.suggest.low import low_policies, speed_islands, warn_no_fp8_gain
from precision_annot._src.suggest.measure import measure_modules
from precision_annot._src.suggest.outcome import Batches, notes, outcome, warn_small
from precision_annot._src.suggest.progress import Progress
from precision_annot._src.suggest.records import LossFn, Sample
from precision_annot._src.suggest.reference import (
    first_scale,
    fp32_copy,
    require_deterministic,
    require_finite_reference,
    require_outputs,
    require_real_data,
    run_reference,
)
from precision_annot._src.suggest.report import Sensitivity, Suggestion
from precision_annot._src.suggest.search import Search, sizes_of, ties_of
from precision_annot._src.wrappers import unwrap


def require_numbers(tolerance: object, margin: object) -> None:
    """The tolerance is a relative error: 1 is what an output of zeros measures, so a
    tolerance of 1 or more would call a plan whose values all flush to zero met."""
    for value, what in ((tolerance, "tolerance"), (margin, "margin")):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not (
                0 < value < math.inf) or value > 1 or (what == "tolerance" and value == 1):
            valid = ("above 0 and below 1 (a relative error of 1 is what an output of zeros "
                     "measures)" if what == "tolerance" else "above 0 and at most 1")
            raise ValueError(f"suggest({what}=...) must be a number {valid}. Received: "
                             f"{what}={value!r}")


def suggest(
    model: nn.Module,
    sample: Any,
    *,
    low: SpecLike = "bf16",
    loss_fn: Callable[..., torch.Tensor] | None = None,
    tolerance: float | None = None,
    held_out: Sequence[Any] | None = None,
    margin: float = MARGIN,
    measure: bool = False,
    progress: bool | None = None,
) -> Suggestion:
    """Find the smallest fp32 islands a model needs to run in a low dtype, verified end to end.

    Everything runs in `low` except the suggested islands. The choice is verified against fp32
    runs of the same model: the outputs, and with `loss_fn` the loss and the gradients, stay
    within `tolerance`. Plans are chosen on a calibration batch held to `margin` times the
    tolerance, then verified on held-out batches at the tolerance; a plan that fails one is
    searched again on it. The model's own annotations are not read: the plan is built from
    scratch (arguments named in `keep_dtype` are still kept). The model is not changed; the
    runs happen on copies, in eval mode (with `loss_fn`, BatchNorm layers run on the batch's
    statistics, as in training).

    An island whose output overflows the low dtype on the way out first hands its output
    back in fp32 (`output=fp32`); only when that overflows its caller does the island move up,
    to the nearest ancestor whose recorded output fits. Shared (tied) parameters are never
    split between an island and the rest.

    Args:
        model: the model, in fp32.
        sample: a batch: a tensor, a dict of keyword arguments, or `(args, kwargs)`.
        low: the policy of everything outside the islands: "bf16" or "fp16" (compute and
            storage in that dtype), "bf16-mixed" / "16-mixed" (fp32 master weights), or an fp8
            recipe ("fp8", "fp8-rowwise", ...): the Linear GEMMs in fp8 over bf16, the islands
            Linear layers kept in bf16, and Linear layers too small for fp8 to gain kept out
            from the start. (Default: "bf16")
        loss_fn: `loss_fn(output) -> loss`, or `loss_fn(output, sample) -> loss` where
            `sample` is the batch that output came from (a part of `sample`, or a held-out
            batch); with it the backward is checked too, and for fp16 the gradients that would
            underflow at a dynamic loss scale are measured. (Default: None)
        tolerance: the largest relative error allowed, end to end, on held-out batches, above
            0 and below 1 (1 is what an output of zeros measures); the calibration batch is
            held to `margin` times it. None takes 2e-2 for fp16, 1e-1 for bf16 and 2e-1 for
            fp8 (the calibration batch then at 1e-2, 5e-2 and 1e-1). (Default: None)
        held_out: batches to verify the plan on. None cuts `sample` along its batch dimension
            (the first dimension most of its tensors share): the first half calibrates, the
            second half (in two) is held out; [] holds nothing out. (Default: None)
        margin: the share of the tolerance the calibration batch is held to, and the share
            of the low dtype's largest value its module outputs held in that dtype may reach,
            so that the plan keeps room on batches it was not chosen on. (Default: 0.5)
        measure: run every module alone in `low` for the table and the chart, even when the
            checks did not need it (about one forward in `low` per level of the module tree).
            (Default: False)
        progress: show a progress bar on stderr; None shows it when stderr is a terminal.
            (Default: None)

    Returns:
        A `Suggestion`. When nothing smaller than the whole model meets the tolerance, its
        `met` is False and its message says why; a `UserWarning` says so too. Its plan is
        then the smallest tried that runs finite on every batch (a larger one only where it
        halves the worst error), with the errors it reaches.

    Warns:
        UserWarning: when the sample has fewer than 16 rows (tokens, samples) or too few to
            hold any out: peaks a plan must survive may not show in it.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from precision_annot import suggest
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
        >>> found = suggest(model, torch.randn(16, 8), low="bf16")
        >>> found.met
        True
    """
    start = time.perf_counter()
    require_module(model, "suggest")
    # the model inside DDP, torch.compile, ...: every check runs a copy of it, and a copy of a
    # compiled wrapper compiles again on every check (the plan fits the wrapper all the same)
    model = unwrap(model)
    policy, island = low_policies(low)
    low_dtype = policy.compute
    assert low_dtype is not None
    tolerance = _tolerance(policy, tolerance, margin)
    losses = as_loss_fn(loss_fn)
    bar = Progress(sys.stderr.isatty() if progress is None else bool(progress))
    args, kwargs = as_call(sample)
    require_real_data(model, (args, kwargs))
    reference = fp32_copy(model, training=losses is not None)
    if policy.fp8:
        _require_fp8_kernels(model, policy.fp8, low)
    with torch.random.fork_rng():
        # 1. the fp32 reference on the calibration batch
        calib, others, rows = _calibrate(reference, sample, (args, kwargs), held_out, losses,
                                         tolerance)
        assert calib.light is not None
        calib.room = float(margin)  # its values held to the margin of the low dtype's range
        search = Search(reference, resolve(reference), policy, island, losses,
                        first_scale(low_dtype, calib.light), tolerance, float(margin),
                        ties_of(reference), sizes_of(reference))
        search.runs.update({"fp32": 1, "fp32 forward (determinism)": 1})
        if calib.light.output_peak >= torch.finfo(low_dtype).max:
            # a module's fp32 output is past what the low dtype holds: the first check will
            # most likely fail with inf, and the choice then needs to know where, so it is
            # watched at once rather than run twice
            search.watching = calib.label
        speed = _kept_for_speed(reference, policy, low)
        tables = _Tables(search, bar)
        # 2. choose on the calibration batch, 3. verify on the held-out ones
        islands, message, why = choose(search, calib, dict.fromkeys(speed, False),
                                       tables.on(calib), bar, torch.finfo(low_dtype).max,
                                       frozenset(speed))
        islands, message = verify(search, others, islands, message, why, tables.on, bar,
                                  frozenset(speed), losses, reference)
        if measure:
            tables.on(calib)()
        # 4. report: met or not; when not, the smallest plan that runs finite and comes nearest
        batches = Batches(calib, others)
        met, message, islands, final, held = outcome(
            search, search.held_together(islands), message, batches, speed, why)
        cheaper = cheaper_arithmetic(search, islands, batches, dict(reference.named_modules()),
                                     lambda i, n: bar.update("cheaper arithmetic", i, n)
                                     ) if met else None
        if cheaper is not None:
            islands, arithmetic, final, held = cheaper
            share = max(final.errors().values()) / tolerance
            message += (f" Of its islands, {len(arithmetic)} Linear layer(s) meet it with "
                        f"{dtype_name(policy.compute)} GEMMs handing back fp32 instead, "
                        f"cheaper than fp32 GEMMs (at {share:.2f} of the tolerance on the "
                        f"calibration batch): {', '.join(arithmetic)}.")
    verified = bool(held) and rows >= MIN_ROWS
    loss_scale = search.scale if low_dtype == fp16 else None
    message += notes(met, verified, rows, loss_scale)
    if not met:
        warnings.warn(f"suggest: {message}", UserWarning, stacklevel=2)
    return Suggestion(islands=islands, plan=search.plan(islands, dict(model.named_modules()),
                                                        resolve(model)),
                      table=tables.done.get(calib.label, []), checks=list(search.path),
                      final=final, held_out=held, met=met, low=policy, tolerance=tolerance,
                      margin=float(margin), seconds=time.perf_counter() - start,
                      message=message, reasons=why, kept_for_speed=speed, island=island,
                      runs=dict(search.runs), verified=verified, loss_scale=loss_scale,
                      arithmetic=search.arithmetic)


def _require_fp8_kernels(model: nn.Module, recipe: str, low: SpecLike) -> None:
    """torchao, and kernels on the model's device that run the recipe's GEMMs: where they
    raise at every call, every module would become an island for "raising in its own code",
    and the plan found would run no fp8 at all."""
    import_torchao("torchao.float8", f"suggest(low={low!r})")
    device = next((t.device for t in (*model.parameters(), *model.buffers())),
                  torch.device("cpu"))
    refusal = kernel_refusal(Gemm(recipe), device)
    if refusal is not None:
        raise RuntimeError(
            f"suggest(low={low!r}): this machine's kernels cannot run {recipe} GEMMs on "
            f"{device.type} ({refusal}), so no fp8 plan can be measured here. Run suggest where "
            "they run (a GPU with fp8, or a CPU whose kernels have fp8 matrix multiplies), or "
            "ask for low='bf16'.")


def _tolerance(policy: Policy, tolerance: float | None, margin: float) -> float:
    """The tolerance asked for, or the low dtype's default; both numbers checked."""
    assert policy.compute is not None
    if tolerance is None:
        tolerance = FP8_TOLERANCE if policy.fp8 else DEFAULT_TOLERANCE[policy.compute]
    require_numbers(tolerance, margin)
    return float(tolerance)


def _calibrate(reference: nn.Module, sample: Any, call: tuple[tuple[Any, ...], dict[str, Any]],
               held_out: Any, losses: LossFn | None, tolerance: float
               ) -> tuple[Sample, list[Sample], int]:
    """The calibration batch with its fp32 run (`light`), the held-out batches, and the
    calibration batch's rows; warns when they are too few."""
    args, kwargs = map_tree(call, lambda t: t.float())  # the fp32 reference's
    calib, others, small = split_samples(sample, args, kwargs, held_out, losses)
    try:
        ref = run_reference(reference, calib.args, calib.kwargs, losses, calib, watch=False)
    except Exception:
        if losses is None or held_out is not None or not others:
            raise
        # the loss closes over the whole batch: check on it alone
        calib = Sample("calibration", args, kwargs, original=as_given(sample, args, kwargs))
        others = []
        small = ("loss_fn(output) does not take a part of the sample (it closes over the "
                 "whole batch), so nothing is held out: pass loss_fn(output, sample), or "
                 "held_out=[batch, ...].")
        ref = run_reference(reference, args, kwargs, losses, calib, watch=False)
    require_outputs(ref.output, losses)
    require_finite_reference(ref)
    require_deterministic(reference, calib.args, calib.kwargs, ref, tolerance)
    rows = rows_of(calib.args, calib.kwargs)
    warn_small(small, rows)
    calib.light = ref
    return calib, others, rows


def _kept_for_speed(reference: nn.Module, policy: Policy, low: SpecLike) -> list[str]:
    """With an fp8 `low`: the Linear layers too small to gain, kept out of fp8 from the start
    (and a warning when that is all of them)."""
    if not policy.fp8:
        return []
    speed = speed_islands(reference, policy)
    linears = sum(1 for m in reference.modules() if isinstance(m, nn.Linear))
    if len(speed) == linears:
        assert policy.compute is not None
        warn_no_fp8_gain(low, speed, policy.compute)
    return speed


class _Tables:
    """Each batch's sensitivity table, measured once, when the choice on that batch first
    needs it."""

    def __init__(self, search: Search, bar: Progress) -> None:
        self.search = search
        self.bar = bar
        self.scale = search.scale  # the loss scale fp16 starts from: underflow is measured at it
        # under fp8 only Linear layers change: the rest run in the high compute anyway
        self.eligible = None if not search.policy.fp8 else {
            n for n, m in search.reference.named_modules() if isinstance(m, nn.Linear)}
        self.done: dict[str, list[Sensitivity]] = {}

    def on(self, batch: Sample) -> Callable[[], list[Sensitivity]]:
        def measure() -> list[Sensitivity]:
            if batch.label not in self.done:
                search = self.search
                self.done[batch.label] = measure_modules(
                    search.reference, search.full(batch), search.structure, search.policy,
                    self.scale, self.bar, self.eligible)
                search.runs["modules alone (forward)"] += len(self.done[batch.label])
            return self.done[batch.label]
        return measure
