"""`suggest`: find the fp32 islands a model needs to run in fp16 or bf16, for training.

1. **Measure.** One fp32 reference run (forward, and backward with `loss_fn`) records each
   module's first inputs and output, the largest value its own ops produce, and its parameters'
   gradients. Then each module that runs is run once by itself in `low` on its recorded inputs:
   the relative error of its output, and whether a non-finite value appears inside it.
2. **Choose.** Candidate plans (everything in `low`, some modules in fp32) are run end to end and
   compared with the reference: outputs, and with `loss_fn` the loss and the gradients. Islands
   are added greedily: where a non-finite value first appears, else the next most sensitive
   module; when a value overflows on leaving an island, its parent takes its place. Then each
   island is dropped again if the plan still passes without it.
3. **Return** a `Suggestion`: the islands, the rules, the plan, the table, and what the checks
   measured.

Cost: the reference run, one run of each module by itself (so each level of the module tree
costs about one forward in `low`), and a few end-to-end runs (each a copy of the model, a
forward and, with `loss_fn`, a backward).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import itertools
import json
import math
import sys
import time
import types
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TextIO

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from precision_annot._src.casting import floating_leaves, map_tree
from precision_annot._src.dtypes import FP8_RECIPES, LOW_PRECISION, bf16, dtype_name, fp16, fp32
from precision_annot._src.guards import require_module
from precision_annot._src.plan import PrecisionPlan, Source, parent_name
from precision_annot._src.policy import Policy, SpecLike, as_policy
from precision_annot._src.resolution import resolve
from precision_annot._src.runtime import apply, remove
from precision_annot._src.samples import as_call
from precision_annot._src.tables import format_table
from precision_annot._src.tracking import DATA_MOVEMENT, ModuleTracker

__all__ = ["Check", "Sensitivity", "Suggestion", "suggest"]

#: The default tolerance: bf16 keeps 8 bits of mantissa, fp16 11, fp8 (e4m3) 3. With the
#: margin (0.5), the calibration batch is held to 1e-2 (fp16), 5e-2 (bf16), 1e-1 (fp8); the
#: gradients of a model with no hot spot, all in the low dtype, measure 6e-3 (fp16) and 2e-2
#: (bf16) on benchmarks/suggest.py's 6-layer LM.
DEFAULT_TOLERANCE = {fp16: 2e-2, torch.bfloat16: 1e-1}
FP8_TOLERANCE = 2e-1
ISLAND = Policy(compute=fp32, storage=fp32, comm=fp32)
FP16_SMALLEST = 2.0 ** -24  # the smallest fp16 subnormal: a gradient below it flushes to zero
MAX_CHECKS = 64
MARGIN = 0.5  # the calibration batch is held to this share of the tolerance
MIN_ROWS = 16  # fewer rows (tokens, samples) than this cannot show a model's peaks
SEED = 0  # every run starts from it, so that sampling or noise in a forward repeats
OUTSIDE = "<outside the model>"  # code no module runs: the loss function


@dataclasses.dataclass(frozen=True)
class Sensitivity:
    """How one module fares when it alone computes in the low dtype.

    Attributes:
        name: the module's qualified name.
        type: its class name.
        params: its parameter elements, children included: what keeping it in fp32 costs.
        error: relative error of its output, alone in `low`, against fp32 (inf: non-finite;
            nan: it could not be run by itself).
        nonfinite: a non-finite value appeared inside it, alone in `low`.
        peak: the largest absolute value its own ops produced in the fp32 reference.
        headroom: `peak` over the largest finite value of `low` (1 or more overflows).
        grad_peak: the largest absolute gradient of its own parameters (with `loss_fn`).
        underflow: the fraction of its nonzero parameter gradients that would flush to zero in
            fp16 at the loss scale the reference allows (fp16 with `loss_fn` only).
    """

    name: str
    type: str
    params: int
    error: float
    nonfinite: bool
    peak: float
    headroom: float
    grad_peak: float | None = None
    underflow: float | None = None

    @property
    def score(self) -> float:
        """What the choice ranks by: inf for a non-finite value, else the larger of the error
        and the gradient underflow; unmeasured modules rank last."""
        if self.nonfinite:
            return math.inf
        if math.isnan(self.error):
            return -1.0
        return max(self.error, self.underflow or 0.0)


@dataclasses.dataclass(frozen=True)
class Check:
    """One end-to-end run of a candidate plan against the fp32 reference.

    Attributes:
        islands: the modules kept in fp32.
        output_error: relative error of the outputs (inf: non-finite).
        loss_error: relative error of the loss, with `loss_fn`.
        grad_error: relative error of all gradients together, with `loss_fn`.
        first_nonfinite: the module whose own code first produced a non-finite value ("" for the
            root), or None (none, or not looked for: only a failing run is watched).
        passed: every error within `limit`.
        sample: the batch it ran on: "calibration", or "held-out 1", ...
        limit: the error it was held to: a margin below the tolerance on the calibration batch,
            the tolerance on held-out batches.
        fp32_params: the parameter elements its islands hold.
        outputs: the islands that hand their output back in fp32.
        crashed: the error the plan's run raised (a caller that cannot take an island's fp32
            output, in a model without autocast), or None.
    """

    islands: tuple[str, ...]
    outputs: tuple[str, ...]
    output_error: float
    loss_error: float | None
    grad_error: float | None
    first_nonfinite: str | None
    passed: bool
    sample: str = "calibration"
    limit: float = math.inf
    fp32_params: int = 0
    crashed: str | None = None

    def errors(self) -> dict[str, float]:
        out = {"output": self.output_error}
        if self.loss_error is not None:
            out["loss"] = self.loss_error
        if self.grad_error is not None:
            out["gradients"] = self.grad_error
        return out

    @property
    def finite(self) -> bool:
        return all(math.isfinite(e) for e in self.errors().values())

    @property
    def failed(self) -> list[str]:
        """The errors above the limit: "output", "loss", "gradients"."""
        return [k for k, v in self.errors().items() if not (math.isfinite(v) and v <= self.limit)]

    def to_dict(self) -> dict[str, Any]:
        def number(x: float) -> float | str:
            return x if math.isfinite(x) else str(x)

        return {"islands": list(self.islands), "output_fp32": list(self.outputs),
                "sample": self.sample, "limit": self.limit,
                "errors": {k: number(v) for k, v in self.errors().items()},
                "failed": self.failed, "passed": self.passed,
                "first_nonfinite": self.first_nonfinite, "fp32_params": self.fp32_params,
                "crashed": self.crashed}


class Suggestion:
    """What `suggest` found: the fp32 islands, and the evidence.

    Attributes:
        islands: names of the modules to keep in fp32 (in high precision for an fp8 `low`),
            outermost only.
        outputs: the islands that hand their output back in fp32 (`output=fp32`).
        rules: `[(name, policy), ...]`, for `annotate(model, suggestion.rules)`.
        plan: the plan for the model given to `suggest`: everything in `low`, the islands in
            fp32; ready for `apply` and every adapter.
        table: every measured module's `Sensitivity`, most sensitive first (empty when no check
            needed it: modules are measured one by one only when a plan fails with finite
            errors).
        checks: every end-to-end run, in order, on every batch (`Check.sample`).
        final: the plan's check on the calibration batch.
        held_out: the plan's checks on the held-out batches; `worst` is the worst of them all.
        met: the plan meets the tolerance on every batch.
        verified: the plan was also checked on at least one held-out batch, and the
            calibration batch holds enough rows (16 tokens or samples) to show a model's
            peaks. `met` without `verified` is a plan shown to hold only on the data it was
            chosen on.
        low: the policy of everything outside the islands.
        tolerance: the tolerance asked for; the calibration batch is held to `margin` times it.
        kept_for_speed: Linear layers kept out of fp8 because their GEMMs are too small to
            gain (fp8 `low` only).
        reasons: why each island was added: "a non-finite value arose in it", "gradients", ...
        runs: what `suggest` ran, by kind: fp32 reference steps, checks (a step in the low
            dtype each), backward passes (a retry when fp16 gradients overflow the loss
            scale), watched runs, modules run alone.
        seconds: how long `suggest` took.
    """

    def __init__(self, *, islands: Islands, plan: PrecisionPlan, table: list[Sensitivity],
                 checks: list[Check], final: Check, held_out: list[Check], met: bool,
                 low: Policy, tolerance: float, margin: float, seconds: float, message: str,
                 reasons: dict[str, str], kept_for_speed: list[str], island: Policy,
                 runs: dict[str, int] | None = None, verified: bool = True) -> None:
        self.islands = [i for i in islands if i not in kept_for_speed]
        self.outputs = [i for i, out in islands.items() if out]
        text = "bf16" if island.compute == bf16 and island.storage != bf16 else "fp32"
        text = f"compute={dtype_name(island.compute)}" if low.gemm else text
        self.rules: list[tuple[str, str]] = [
            (name, f"{text},output=fp32" if islands[name] else text) for name in islands]
        self.plan = plan
        self.table = table
        self.checks = checks
        self.final = final
        self.held_out = held_out
        self.met = met
        self.low = low
        self.tolerance = tolerance
        self.margin = margin
        self.seconds = seconds
        self.message = message
        self.reasons = reasons
        self.kept_for_speed = kept_for_speed
        self.runs = runs or {}
        self.verified = verified

    @property
    def worst(self) -> Check:
        """The plan's worst check over every batch, by its largest error."""
        return max([self.final, *self.held_out],
                   key=lambda c: max(c.errors().values()) / min(c.limit, self.tolerance))

    def __repr__(self) -> str:
        return (f"Suggestion({len(self.islands)} fp32 islands: {self.islands}, "
                f"met={self.met}" + ("" if self.verified else ", verified=False") + ")")

    def __str__(self) -> str:
        total = sum(e.params for e in self.plan.values())
        held = sum(e.params for n, e in self.plan.items()
                   if any(n == i or n.startswith(i + ".") for i in self.islands))
        errors = ", ".join(f"{k} error {v:.2e}" for k, v in self.final.errors().items())
        held_worst = max(self.held_out, key=lambda c: max(c.errors().values()) / c.limit,
                         default=None)
        worst = "" if held_worst is None else ", ".join(
            f"{k} {v:.2e}" for k, v in held_worst.errors().items())
        kind = "high-precision" if self.low.gemm else "fp32"
        what = self.low.show("compute")
        lines = [
            f"suggest: everything in {self.low} ({what} compute), tolerance "
            f"{self.tolerance:g} (the calibration batch held to {self.margin:g} of it), "
            f"{len(self.checks)} end-to-end checks, {self.seconds:.1f} s ("
            + ", ".join(f"{k} {v}" for k, v in self.runs.items()) + ")",
            self.message,
            f"{kind} islands ({len(self.islands)}, holding {held:,} of {total:,} parameters, "
            f"{held / max(total, 1):.0%}): "
            + (", ".join(i + (" (output fp32)" if i in self.outputs else "")
                         for i in self.islands) or "none"),
            f"calibration batch: {errors}",
            (f"held-out batches ({len(self.held_out)}), the worst: {worst}" if self.held_out
             else "held-out batches: none"),
        ]
        if self.kept_for_speed:
            lines.append(f"kept out of fp8 as too small to gain: {len(self.kept_for_speed)} "
                         "Linear layers")
        lines.append("")
        if not self.table:
            lines.append("No module was measured alone: the checks found every island.")
            return "\n".join(lines)
        header = ("module", "type", "params", "error alone", "peak |x|", "peak/max",
                  "non-finite", "grad peak", "underflow", "island")
        rows: list[tuple[str, ...]] = [header]
        for s in self.table:
            rows.append((
                s.name, s.type, f"{s.params:,}",
                "-" if math.isnan(s.error) else f"{s.error:.2e}",
                f"{s.peak:.3g}", f"{s.headroom:.2g}", "yes" if s.nonfinite else "-",
                "-" if s.grad_peak is None else f"{s.grad_peak:.3g}",
                "-" if s.underflow is None else f"{s.underflow:.1%}",
                "*" if s.name in self.islands else "",
            ))
        lines += format_table(rows, right={2, 3, 4, 5, 7, 8})
        lines.append("")
        lines.append("error alone: relative error of the module's output when it alone computes "
                     "in the low dtype; peak |x|: the largest value its own ops produce in fp32.")
        return "\n".join(lines)

    def to_json(self, *, indent: int | None = 2) -> str:
        """The suggestion as JSON: the islands, every check tried (the path), the table and
        the plan."""
        def number(x: float | None) -> float | str | None:
            return x if x is None or math.isfinite(x) else str(x)

        return json.dumps({
            "format": "precision_annot.suggestion",
            "low": str(self.low),
            "tolerance": self.tolerance,
            "margin": self.margin,
            "met": self.met,
            "verified": self.verified,
            "message": self.message,
            "islands": self.islands,
            "output_fp32": self.outputs,
            "reasons": self.reasons,
            "kept_for_speed": self.kept_for_speed,
            "errors": {k: number(v) for k, v in self.final.errors().items()},
            "held_out": [c.to_dict() for c in self.held_out],
            "checks": len(self.checks),
            "runs": self.runs,
            "path": [c.to_dict() for c in self.checks],
            "seconds": round(self.seconds, 3),
            "table": [{k: number(v) if isinstance(v, float) else v
                       for k, v in dataclasses.asdict(s).items()} for s in self.table],
            "plan": json.loads(self.plan.to_json()),
        }, indent=indent)

    def chart(self, *, top: int = 40) -> list[tuple[str, float]]:
        """The bars `plot` draws, bottom to top: each measured module's `error` alone in the
        low dtype (a non-finite error drawn at 1e3, a zero at 1e-8 on the log scale)."""
        rows = sorted((s for s in self.table if not math.isnan(s.error)),
                      key=lambda s: -s.error)[:top][::-1]
        return [(s.name, 1e3 if not math.isfinite(s.error) else max(s.error, 1e-8))
                for s in rows]

    def plot(self, path: str | Path, *, top: int = 40) -> Path:
        """A bar chart of each measured module's error alone in the low dtype, islands
        highlighted, written to `path`.

        Needs matplotlib: `pip install 'precision-annot[plot]'`.
        """
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError("Suggestion.plot needs matplotlib: "
                              "pip install 'precision-annot[plot]'") from e
        bars = self.chart(top=top)
        colors = ["#d62728" if name in self.islands else "#1f77b4" for name, _ in bars]
        fig, ax = plt.subplots(figsize=(8, max(2.5, 0.28 * len(bars) + 1)))
        ax.barh([name or "(root)" for name, _ in bars], [v for _, v in bars], color=colors)
        ax.set_xscale("log")
        ax.axvline(self.tolerance, color="gray", linestyle="--", linewidth=1)
        ax.set_xlabel(f"relative error of the output, alone in {dtype_name(self.low.compute)} "
                      "(non-finite drawn at 1e3); dashed: tolerance")
        ax.set_title(f"Error per module: red = kept in fp32 ({len(self.islands)})")
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, dpi=120)
        plt.close(fig)
        return out


# -- measuring ----------------------------------------------------------------------------------

def _detached(obj: Any) -> Any:
    """A copy of a call's arguments or outputs that later runs cannot change."""
    detached = map_tree(obj, lambda t: t.detach().clone())
    return detached if detached is not obj or not _mutable(obj) else copy.deepcopy(obj)


def _mutable(obj: Any) -> bool:
    return isinstance(obj, (list, dict)) or (
        dataclasses.is_dataclass(obj) and not isinstance(obj, type))


def relative_error(actual: Any, expected: Any) -> float:
    """||actual - expected|| / ||expected|| over every floating tensor, in float64, where
    `expected` is finite; inf when `actual` holds a non-finite value `expected` does not hold
    at the same place (a masked -inf in both is the same result)."""
    got: list[torch.Tensor] = []
    want: list[torch.Tensor] = []
    floating_leaves(actual, got)
    floating_leaves(expected, want)
    if len(got) != len(want) or not want:
        return math.nan
    diff = norm = 0.0
    for a, b in zip(got, want, strict=True):
        a64, b64 = a.detach().double(), b.detach().double()
        if a64.shape != b64.shape:
            return math.nan
        finite = torch.isfinite(b64)
        if not bool(finite.all()):
            same = (a64 == b64) | (a64.isnan() & b64.isnan())
            if not bool(same[~finite].all()):
                return math.inf
            a64, b64 = a64[finite], b64[finite]
        if not bool(torch.isfinite(a64).all()):
            return math.inf
        diff += float((a64 - b64).pow(2).sum())
        norm += float(b64.pow(2).sum())
    return math.sqrt(diff) / max(math.sqrt(norm), 1e-30)


@dataclasses.dataclass
class _Reference:
    output: Any
    loss: torch.Tensor | None
    grads: dict[str, torch.Tensor]
    inputs: dict[str, tuple[tuple[Any, ...], dict[str, Any]]]
    outputs: dict[str, Any]
    peaks: dict[str, float]
    backward_peak: float
    nonfinite: Counts


Counts = dict[tuple[str, str], int]  # (module, "forward" | "backward") -> non-finite elements


_FP8_DATA = frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
                       torch.float8_e5m2fnuz, torch.float8_e8m0fnu})


class _Watch(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Watches the ops of a run: the largest |value| each module's own ops produce in forward,
    the largest in backward, how many non-finite elements each module's own ops produce, and
    the first module whose count goes past the reference's.

    Some code makes non-finite values on purpose (an attention mask of -inf, or
    `finfo.min + bias`, which overflows even in fp32), so a module counts as the culprit only
    when it makes more of them than it did in the fp32 reference. Ops that only move data
    (a `masked_fill`, a copy) pass values on and are not counted; a cast is.
    """

    def __init__(self, tracker: ModuleTracker, *, peaks: bool = False,
                 baseline: Counts | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.tracker = tracker
        self.track_peaks = peaks
        self.baseline = baseline
        self.peaks: dict[str, float] = {}
        self.backward_peak = 0.0
        self.counts: Counts = {}
        self.first_nonfinite: str | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        results: list[torch.Tensor] = []
        floating_leaves(out, results)
        results = [t for t in results if t.dtype not in _FP8_DATA  # fp8 GEMMs' scaled data
                   and not is_traceable_wrapper_subclass(t)]
        if not results:
            return out
        owner = self.tracker.owner()
        backward = torch._C._current_graph_task_id() != -1
        name, phase = owner if owner is not None else (
            OUTSIDE, "backward" if backward else "forward")
        packet = func.overloadpacket.__name__
        if packet == "_to_copy" or packet not in DATA_MOVEMENT:
            bad = sum(int((~torch.isfinite(t)).sum()) for t in results)
            if bad:
                key = (name, phase)
                self.counts[key] = self.counts.get(key, 0) + bad
                if (self.baseline is not None and self.first_nonfinite is None
                        and self.counts[key] > self.baseline.get(key, 0)):
                    self.first_nonfinite = name
        if self.track_peaks:
            finite = [t.detach()[torch.isfinite(t.detach())] for t in results]
            peak = max((float(t.abs().max()) for t in finite if t.numel()), default=0.0)
            if phase == "forward" and owner is not None:
                self.peaks[name] = max(self.peaks.get(name, 0.0), peak)
            elif phase == "backward":
                self.backward_peak = max(self.backward_peak, peak)
        return out


def _require_real_data(model: nn.Module, sample: Any) -> None:
    leaves: list[torch.Tensor] = []
    floating_leaves(sample, leaves)
    tensors = [*model.parameters(), *model.buffers(), *leaves]
    if any(t.is_meta for t in tensors):
        raise ValueError("suggest runs the model and compares numbers: its parameters and the "
                         "sample must hold data, and some are on the meta device. Materialize "
                         "the model (model.to_empty(device=...) and load its weights) first.")


def _require_outputs(output: Any, loss_fn: LossFn | None) -> None:
    """suggest compares floating outputs (or, with `loss_fn`, the loss and the gradients)."""
    if isinstance(output, types.GeneratorType):
        raise TypeError(
            "suggest: the model returned a generator, so there is no output to compare until "
            "the caller runs it. Pass a model that returns its outputs, e.g. a wrapper whose "
            "forward returns list(model(...)).")
    leaves: list[torch.Tensor] = []
    floating_leaves(output, leaves)
    if not leaves and loss_fn is None:
        raise TypeError(
            "suggest: the model returned no floating tensor (it returned "
            f"{_describe(output)}), so no plan can be compared with the fp32 run. Return the "
            "outputs, or pass loss_fn=... to compare the loss and the gradients.")


def _require_deterministic(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                           ref: _Reference, tolerance: float) -> None:
    """A second fp32 run from the same seed must give the same output: a plan's error is
    measured against the first, so noise would read as precision loss."""
    torch.manual_seed(SEED)
    with torch.no_grad():
        again = model(*copy.deepcopy(args), **copy.deepcopy(kwargs))
    drift = relative_error(again, ref.output)
    if math.isfinite(drift) and drift <= min(tolerance * 0.1, 1e-4):
        return
    raise ValueError(
        "suggest: two fp32 runs of the model on the same sample, each from the same torch "
        f"seed, differ (relative error {drift:.2e}), so a plan's error could not be told from "
        "that noise. Its forward draws randomness that torch's seed does not fix (Python's "
        "random, NumPy, a generator of its own) or reads state that changes between calls. "
        "Make the forward deterministic for suggest: eval() mode, sampling off (e.g. "
        "do_sample=False), or seed that randomness inside the forward.")


def _require_finite_reference(ref: _Reference) -> None:
    """Every plan is compared with the fp32 run, so that run must not give nan (an output of
    inf may be meant: masked logits) nor a non-finite loss."""
    leaves: list[torch.Tensor] = []
    floating_leaves(ref.output, leaves)
    if ref.loss is not None and not bool(torch.isfinite(ref.loss).all()):
        what = "the loss is"
    elif any(bool(torch.isnan(t).any()) for t in leaves):
        what = "its output holds nan"
    else:
        return
    raise ValueError(
        f"suggest: the model's fp32 run on this sample is not finite ({what}). Every candidate "
        "plan is measured against that run, so suggest needs a sample the model handles in "
        "fp32: check the sample for nan or inf values.")


def _reference(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
               loss_fn: LossFn | None, sample: _Sample, *, watch: bool = True) -> _Reference:
    """The fp32 run plans are compared with. Watched (`watch`), it records every module's
    first inputs and output, the peak its own ops produce and the non-finite values each makes;
    unwatched (the first run, and each held-out batch's), only the output, loss, gradients and
    the largest gradient of a module output (for fp16's loss scale): one plain step."""
    if not watch:
        return _plain_reference(model, args, kwargs, loss_fn, sample)
    inputs: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
    outputs: dict[str, Any] = {}

    def enter(name: str, module: nn.Module, a: tuple[Any, ...], k: dict[str, Any]) -> None:
        if name not in inputs:  # an argument that cannot be copied: the module is not measured
            with contextlib.suppress(Exception):
                inputs[name] = (_detached(a), _detached(k))

    def leave(name: str, module: nn.Module, output: Any) -> None:
        if name not in outputs:
            with contextlib.suppress(Exception):
                outputs[name] = _detached(output)

    names = {m: n for n, m in model.named_modules()}
    tracker = ModuleTracker(names, enter, leave)
    mode = _Watch(tracker, peaks=True)
    with tracker, mode:
        output, loss = _reference_step(model, args, kwargs, loss_fn, sample)
    return _Reference(_detached(output), loss, _take_gradients(model), inputs, outputs,
                      mode.peaks, mode.backward_peak, mode.counts)


def _plain_reference(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                     loss_fn: LossFn | None, sample: _Sample) -> _Reference:
    peak = [0.0]

    def on_grad(grad: torch.Tensor) -> None:
        finite = grad[torch.isfinite(grad)]
        if finite.numel():
            peak[0] = max(peak[0], float(finite.abs().max()))

    def hook(_: nn.Module, __: Any, out: Any) -> None:
        leaves: list[torch.Tensor] = []
        floating_leaves(out, leaves)
        for t in leaves:
            if t.requires_grad:
                t.register_hook(on_grad)  # type: ignore[no-untyped-call]

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        output, loss = _reference_step(model, args, kwargs, loss_fn, sample)
    finally:
        for handle in handles:
            handle.remove()
    return _Reference(_detached(output), loss, _take_gradients(model), {}, {}, {}, peak[0], {})


def _reference_step(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                    loss_fn: LossFn | None, sample: _Sample
                    ) -> tuple[Any, torch.Tensor | None]:
    """One seeded fp32 forward on copies of the sample, and the backward of `loss_fn`'s loss:
    the output and the (detached) loss."""
    try:
        torch.manual_seed(SEED)
        output = model(*copy.deepcopy(args), **copy.deepcopy(kwargs))
    except TypeError as e:
        if not (len(args) == 1 and isinstance(args[0], tuple) and not kwargs):
            raise
        raise TypeError(f"suggest: the model failed on the sample ({e}). A tuple sample is "
                        "passed as one argument; for several positional arguments pass "
                        "(args, kwargs), e.g. suggest(model, ((x1, x2), {})).") from e
    loss = loss_fn(output, sample) if loss_fn is not None else None
    if loss is None:
        return output, None
    _require_loss(loss)
    loss.backward()  # type: ignore[no-untyped-call]
    return output, loss.detach()


def _take_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """The gradients a step left, by parameter name; the model's own are cleared."""
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _require_loss(loss: Any) -> None:
    if not (isinstance(loss, torch.Tensor) and loss.is_floating_point()
            and loss.numel() == 1 and loss.requires_grad):
        raise TypeError(
            "suggest(loss_fn=...) must return a one-element floating tensor computed "
            "from the output, so that its backward reaches the parameters. Received: "
            f"{_describe(loss)}.")


def _describe(value: Any) -> str:
    if not isinstance(value, torch.Tensor):
        return f"{value!r} (of type {type(value).__name__})"
    return (f"a tensor of shape {tuple(value.shape)}, dtype {value.dtype}, "
            f"requires_grad={value.requires_grad}")


def _uniform(structure: PrecisionPlan, policy: Policy) -> PrecisionPlan:
    return _plan(structure, policy, {}, None, ISLAND)


def _plan(structure: PrecisionPlan, policy: Policy, islands: Islands,
          modules: dict[str, nn.Module] | None, island: Policy) -> PrecisionPlan:
    """`structure` (a resolved plan, for names, classes and kept arguments) with everything in
    `policy` but the islands and their subtrees in `island`; an island marked True hands its
    output back in fp32."""
    policies: dict[str, Policy] = {}
    sources: dict[str, dict[str, Source | None]] = {}
    handing = dataclasses.replace(island, output=fp32)
    for name in structure:
        owner = _covering(name, islands)
        chosen = policy if owner is None else handing if (owner == name and islands[name]) \
            else island
        source: Source = "default" if not name else "rule" if owner == name else "inherited"
        policies[name] = chosen
        sources[name] = {f: (source if v is not None else None) for f, v in chosen.items()}
        if chosen.gemm is not None:
            sources[name]["gemm"] = source
    planned = structure.with_policies(policies, sources)
    return PrecisionPlan(dict(planned.items()), default=policy, model_type=structure.model_type,
                         modules=modules)


def _measure(reference: nn.Module, ref: _Reference, structure: PrecisionPlan, policy: Policy,
             scale: float, progress: _Progress, eligible: set[str] | None = None
             ) -> list[Sensitivity]:
    low = policy.compute
    assert low is not None
    limit = torch.finfo(low).max
    named = dict(reference.named_modules())
    todo = [n for n in ref.inputs if n and not structure[n].container and n in named
            and (eligible is None or n in eligible)]
    table = []
    for i, name in enumerate(todo):
        progress.update("measuring modules", i, len(todo))
        module = named[name]
        error, nonfinite = _alone(module, name, ref, structure, policy)
        grads = [ref.grads[f"{name}.{p}"] for p, _ in module.named_parameters(recurse=False)
                 if f"{name}.{p}" in ref.grads]
        grad_peak = max((float(g.abs().max()) for g in grads if g.numel()), default=None)
        underflow = None
        if grads and low == fp16:
            nonzero = sum(int((g != 0).sum()) for g in grads)
            under = sum(int(((g != 0) & (g.abs() * scale < FP16_SMALLEST)).sum()) for g in grads)
            underflow = under / nonzero if nonzero else 0.0
        peak = ref.peaks.get(name, 0.0)
        table.append(Sensitivity(
            name=name, type=type(module).__name__,
            params=sum(p.numel() for p in module.parameters()),
            error=error, nonfinite=nonfinite, peak=peak, headroom=peak / limit,
            grad_peak=grad_peak, underflow=underflow,
        ))
    progress.done()
    return sorted(table, key=lambda s: -s.score)


def _alone(module: nn.Module, name: str, ref: _Reference, structure: PrecisionPlan,
           policy: Policy) -> tuple[float, bool]:
    """Run a copy of `module` by itself in `policy` on its recorded inputs."""
    prefix = f"{name}."
    sub_structure = PrecisionPlan(
        {n.removeprefix(prefix) if n != name else "": dataclasses.replace(
            e, name=n.removeprefix(prefix) if n != name else "")
         for n, e in structure.items() if n == name or n.startswith(prefix)},
        model_type=type(module).__qualname__)
    args, kwargs = ref.inputs[name]
    try:
        sub = copy.deepcopy(module)
        apply(sub, _uniform(sub_structure, policy))
        names = {m: n for n, m in sub.named_modules()}
        tracker = ModuleTracker(names)
        baseline = {(n.removeprefix(prefix) if n != name else "", phase): count
                    for (n, phase), count in ref.nonfinite.items()
                    if n == name or n.startswith(prefix)}
        mode = _Watch(tracker, baseline=baseline)
        with torch.no_grad(), tracker, mode:
            torch.manual_seed(SEED)
            out = sub(*copy.deepcopy(args), **copy.deepcopy(kwargs))
    except Exception:
        return math.nan, False
    if name not in ref.outputs:
        return math.nan, mode.first_nonfinite is not None
    return relative_error(out, ref.outputs[name]), mode.first_nonfinite is not None


# -- choosing ------------------------------------------------------------------------------------

Islands = dict[str, bool]  # island -> it hands its output back in fp32


def _key(islands: Islands) -> tuple[tuple[str, bool], ...]:
    return tuple(sorted(islands.items()))


def _covering(name: str, islands: Islands) -> str | None:
    return next((i for i in islands if name == i or name.startswith(i + ".")), None)


def _peak(value: Any) -> float:
    leaves: list[torch.Tensor] = []
    floating_leaves(value, leaves)
    finite = [t[torch.isfinite(t)] for t in leaves]
    return max((float(t.abs().max()) for t in finite if t.numel()), default=0.0)


@dataclasses.dataclass
class _Sample:
    """One batch the plans are checked on: its call, its fp32 reference and its label."""

    label: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    ref: _Reference | None = None  # the full one (inputs, outputs, peaks), when it was needed
    light: _Reference | None = None  # outputs, loss, gradients and non-finite counts
    original: Any = None  # the batch as the user gave it (what a two-argument loss_fn gets)


class _Search:
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

    def held_together(self, islands: Islands) -> Islands:
        """The islands with every owner of a parameter they share with a module outside: a
        tie has one dtype, so a plan never stores one tensor in two."""
        if self.policy.storage == self.island.storage:
            return islands
        out = dict(islands)
        for owners in self.ties:
            inside = [o for o in owners if _covering(o, out) is not None]
            if inside:
                for owner in owners:
                    if _covering(owner, out) is None:
                        out[owner] = False
        return out

    def full(self, sample: _Sample) -> _Reference:
        """The watched reference of `sample`, run once, when a check or a choice needs it."""
        if sample.ref is None:
            sample.ref = _reference(self.reference, copy.deepcopy(sample.args),
                                    copy.deepcopy(sample.kwargs), self.loss_fn, sample)
            self.runs["fp32 watched"] += 1
        return sample.ref

    def fp32_params(self, islands: Islands) -> int:
        """The parameter elements the islands hold, a shared one counted once."""
        seen: dict[int, int] = {}
        for name, own in self.own.items():
            if _covering(name, islands) is not None:
                seen.update(own)
        return sum(seen.values())

    def check(self, islands: Islands, sample: _Sample, *, limit: float) -> Check:
        islands = self.held_together(islands)
        key = (_key(islands), sample.label, limit)
        found = self.memo.get(key) or next(
            (c for (k, label, _), c in self.memo.items() if k == key[0] and label == key[1]),
            None)
        if found is not None:  # the same run held to another limit: its errors stand
            return found if found.limit == limit else _held_to(found, limit)
        assert sample.light is not None
        # a run is watched (every op, to find where a non-finite value arises) only when it
        # fails with one; after one did, the next on the same batch is watched at once
        result = _check(self, islands, sample, limit, watch=self.watching == sample.label)
        if result.first_nonfinite is None and not result.finite and result.crashed is None \
                and self.watching != sample.label:
            result = _check(self, islands, sample, limit, watch=True)  # find where
        self.watching = sample.label if not result.finite else None
        self.memo[key] = result
        self.path.append(result)
        return result

    def plan(self, islands: Islands, modules: dict[str, nn.Module] | None = None,
             structure: PrecisionPlan | None = None) -> PrecisionPlan:
        return _plan(structure or self.structure, self.policy, islands, modules, self.island)


def _check(search: _Search, islands: Islands, sample: _Sample, limit: float, *,
           watch: bool) -> Check:
    ref = sample.light
    assert ref is not None
    model = copy.deepcopy(search.reference)
    apply(model, search.plan(islands))
    search.runs["checks (watched)" if watch else "checks"] += 1
    names = {m: n for n, m in model.named_modules()}
    tracker = ModuleTracker(names)
    mode = _Watch(tracker, baseline=search.full(sample).nonfinite if watch else None)
    loss_error = grad_error = None
    crashed = None
    try:
        with (tracker if watch else contextlib.nullcontext()), (
                mode if watch else contextlib.nullcontext()):
            torch.manual_seed(SEED)
            output = model(*copy.deepcopy(sample.args), **copy.deepcopy(sample.kwargs))
            output_error = relative_error(output, ref.output)
            if search.loss_fn is not None and ref.loss is not None:
                loss = search.loss_fn(output, sample)
                loss_error = relative_error(loss, ref.loss)
                if not math.isfinite(loss_error):  # a scaler skips this step: no gradients
                    grad_error = math.inf
                else:
                    grads = _scaled_backward(search, model, loss)
                    grad_error = relative_error(
                        [grads[n] for n in ref.grads if n in grads],
                        [ref.grads[n] for n in ref.grads if n in grads])
                    if len(grads) != len(ref.grads):
                        grad_error = math.inf
    except RuntimeError as e:  # the plan itself fails (an fp32 output its caller cannot take)
        crashed = f"{type(e).__name__}: {e}"[:300]
        output_error = math.inf
        loss_error = None if loss_error is None else math.inf
    errors = [e for e in (output_error, loss_error, grad_error) if e is not None]
    passed = all(math.isfinite(e) and e <= limit for e in errors)
    return Check(tuple(islands), tuple(i for i, out in islands.items() if out), output_error,
                 loss_error, grad_error, mode.first_nonfinite if watch else None, passed,
                 sample.label, limit, search.fp32_params(islands), crashed)


_HANDED = "its output overflowed on the way out: it hands back fp32"
#: on the calibration batch, between the margin and the tolerance, an island is added only
#: when it brings the worst error (against the limit) down by at least this share
WORTH = 0.2


def _held_to(check: Check, limit: float) -> Check:
    """`check`'s run held to another limit."""
    errors = check.errors().values()
    return dataclasses.replace(check, limit=limit, passed=all(
        math.isfinite(e) and e <= limit for e in errors))


def _worst(check: Check) -> float:
    return max(check.errors().values())


def _scaled_backward(search: _Search, model: nn.Module, loss: torch.Tensor
                     ) -> dict[str, torch.Tensor]:
    """The gradients as a `GradScaler` training loop gets them: the loss scaled, and while a
    gradient is non-finite, the scale lowered (by 4x, down to 1) and the backward run again, as
    the scaler skips the step and backs off; unscaled, in float64. The scale that worked is
    kept for the next check, as the scaler keeps its scale from step to step."""
    scale = search.scale
    while True:
        retry = scale > 1
        (loss * scale).backward(retain_graph=retry)  # type: ignore[no-untyped-call]
        if scale != search.scale:
            search.runs["backward retries"] += 1
        grads = {n: p.grad.double() / scale for n, p in model.named_parameters()
                 if p.grad is not None}
        if not retry or all(bool(torch.isfinite(g).all()) for g in grads.values()):
            search.scale = scale
            return grads
        model.zero_grad(set_to_none=True)
        scale = max(1.0, scale / 4)


def _runs_above(structure: PrecisionPlan, name: str) -> str:
    """The nearest ancestor that runs its own forward ("" for the root)."""
    parent = parent_name(name)
    while parent and structure[parent].container:
        parent = parent_name(parent)
    return parent


def _climb(structure: PrecisionPlan, ref: _Reference, start: str, limit: float
           ) -> tuple[str, bool]:
    """The island that takes over from `start`, whose output overflowed its caller: the
    nearest module at or above `start` (never the root) whose output, as the fp32 run
    recorded it, fits the low dtype with room to spare; else the outermost, handing back fp32.
    One level at a time, chosen from the recorded peaks, not by a check per level."""
    name, last = start, start
    while name:
        if name in ref.outputs and _peak(ref.outputs[name]) < limit / 2:
            return name, False
        last = name
        name = _runs_above(structure, name)
    return last, True


class _Move(NamedTuple):
    """The island `_choose` adds next, why, and how."""

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
_NO_CALLER = ("No plan short of the whole model in fp32 meets the tolerance: the output of the "
              "fp32 island does not fit the low dtype when it is handed back to its caller, "
              "the root, which cannot be an island.")


def _choose(search: _Search, sample: _Sample, start: Islands, measure: Callable[[], list[
            Sensitivity]], progress: _Progress, low_max: float, fixed: frozenset[str],
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
    while not last.passed and len(search.memo) < MAX_CHECKS:
        progress.update(f"checks on the {sample.label} batch", len(search.memo),
                        min(MAX_CHECKS, candidates + 1))
        move = _next_island(search, sample, islands, last, why, measure, low_max, limit)
        if isinstance(move, str):
            return islands, move, why
        trial = {i: o for i, o in islands.items() if _covering(i, {move.target: False}) is None}
        trial[move.target] = move.out32 or (not move.exact and islands.get(move.target, False))
        before, last = last, search.check(trial, sample, limit=limit)
        if move.by_error and not _worth(search, before, last, limit):
            # the margin is a target, not a cliff: between it and the tolerance, an island
            # that does not bring the error down by a fifth is not worth its parameters
            search.settled = _worst(before) / search.tolerance
            limit = search.tolerance
            last = _held_to(before, limit)
            break
        islands = trial
        why[move.target] = move.reason
    if not last.passed:
        return islands, (f"No plan met the tolerance within {MAX_CHECKS} end-to-end checks; the "
                         "islands shown are the best plan tried."), why
    if not prune:  # islands the batches seen before need stay
        return islands, "", why
    return _prune(search, sample, islands, limit, progress, fixed), "", why


def _next_island(search: _Search, sample: _Sample, islands: Islands, last: Check,
                 why: dict[str, str], measure: Callable[[], list[Sensitivity]],
                 low_max: float, limit: float) -> _Move | str:
    """The island to add after `last` failed, or why no plan short of fp32 can pass."""
    structure = search.structure
    handed = [i for i in last.outputs if why.get(i) == _HANDED]
    if last.crashed is not None and handed:  # its caller cannot take fp32: move up
        target, out32 = _climb(structure, search.full(sample),
                               _runs_above(structure, handed[-1]) or handed[-1], low_max)
        return _Move(target, out32, "an island's fp32 output could not be taken by its caller",
                     exact=True)
    culprit = last.first_nonfinite
    if culprit == OUTSIDE:
        return _NO_LOSS
    if culprit is None:
        return _by_error(islands, last, measure(), limit)
    return _by_culprit(search, sample, islands, culprit, low_max)


def _by_culprit(search: _Search, sample: _Sample, islands: Islands, culprit: str,
                low_max: float) -> _Move | str:
    """Where a non-finite value first arose in `culprit`: it becomes an island; an island it
    is already hands back fp32; an island whose fp32 output overflowed its caller moves up."""
    structure = search.structure
    owner = _covering(culprit, islands) if culprit else None
    callers = [i for i, out in islands.items() if out and _runs_above(structure, i) == culprit]
    if owner is not None and not islands[owner]:
        return _Move(owner, True, _HANDED)
    if owner is not None or (culprit and callers):
        target, out32 = _climb(structure, search.full(sample), owner or culprit, low_max)
        return _Move(target, out32, "an island's fp32 output overflowed its caller") \
            if target else _NO_CALLER
    return _Move(culprit, False, "a non-finite value arose in it") if culprit else _NO_ROOT


def _by_error(islands: Islands, last: Check, table: list[Sensitivity], limit: float
              ) -> _Move | str:
    """With finite errors too large: the most sensitive module measured alone that no island
    holds yet."""
    target = next((s.name for s in table if s.score > 0 and _covering(s.name, islands) is None),
                  None)
    if target is None:
        return ("No plan short of the whole model in fp32 meets the tolerance: every module "
                "measured alone is an island already (or could not be run alone). The errors "
                "reached: " + ", ".join(f"{k} {v:.2e}" for k, v in last.errors().items()) + ".")
    if target == "":
        return _NO_CALLER
    grads_only = (last.grad_error is not None and last.grad_error > limit
                  and last.output_error <= limit
                  and (last.loss_error is None or last.loss_error <= limit))
    return _Move(target, False, "gradients" if grads_only else "sensitive", by_error=True)


def _worth(search: _Search, before: Check, after: Check, limit: float) -> bool:
    """Whether the island that turned `before` into `after` is worth keeping: it passes, or
    `before` was more than the margin away, or it brings the worst error down by WORTH."""
    return after.passed or not _within(search, before, limit) or (
        _worst(after) <= (1 - WORTH) * _worst(before))


def _within(search: _Search, check: Check, limit: float) -> bool:
    """`check` misses only the margin on the calibration batch: every error finite and within
    the tolerance."""
    return limit < search.tolerance and check.finite and check.crashed is None and all(
        e <= search.tolerance for e in check.errors().values())


def _prune(search: _Search, sample: _Sample, islands: Islands, limit: float,
           progress: _Progress, fixed: frozenset[str]) -> Islands:
    """Drop each island again, the largest first, while the plan still passes; then hand back
    in the low dtype where fp32 output is not needed."""
    order = sorted((i for i in islands if i not in fixed), key=lambda n: -search.sizes.get(n, 0))
    for i, island in enumerate(order):
        progress.update("pruning", i, len(order))
        trial = {k: v for k, v in islands.items() if k != island}
        if search.check(trial, sample, limit=limit).passed:
            islands = trial
    islands = _step_down(search, sample, islands, limit, fixed)
    for island in [k for k, v in islands.items() if v]:
        trial = {**islands, island: False}
        if search.check(trial, sample, limit=limit).passed:
            islands = trial
    progress.done()
    return islands


def _children(structure: PrecisionPlan, name: str) -> list[str]:
    """The modules right under `name` that run their own forward (a container's children
    stand in for it)."""
    out: list[str] = []
    for child in structure:
        if child and parent_name(child) == name:
            out += _children(structure, child) if structure[child].container else [child]
    return out


def _step_down(search: _Search, sample: _Sample, islands: Islands, limit: float,
               fixed: frozenset[str]) -> Islands:
    """Replace each island by the smallest of its children that passes in its place, handing
    back fp32 (so that the island's own code still sees the child's result at full
    precision), and go on down from it: an MoE layer kept whole because its router's logits
    need fp32 becomes the router. One check per child tried, the smallest first; an island
    none of whose children passes alone stays."""
    for island in [i for i in islands if i not in fixed]:
        current = island
        while True:
            kids = sorted(_children(search.structure, current),
                          key=lambda n: search.sizes.get(n, 0))
            rest = {k: v for k, v in islands.items() if k != current}
            found = next((kid for kid in kids if search.sizes.get(kid, 0) < search.sizes.get(
                current, 0) and search.check({**rest, kid: True}, sample, limit=limit).passed),
                None)
            if found is None:
                break
            islands = {**rest, found: True}
            current = found
    return islands


def _best(search: _Search, label: str) -> Check | None:
    """The passing check with the fewest fp32 parameters (then islands) on `label`'s batch."""
    passed = [c for c in search.path if c.sample == label and c.passed]
    return min(passed, key=lambda c: (c.fp32_params, len(c.islands)), default=None)


class _Progress:
    """A one-line progress display on stderr, for long runs."""

    def __init__(self, enabled: bool, stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.shown = False

    def update(self, what: str, i: int, n: int) -> None:
        if self.enabled:
            width = 24
            filled = int(width * i / max(n, 1))
            self.stream.write(f"\rsuggest: {what} [{'#' * filled}{'.' * (width - filled)}] "
                              f"{i}/{n}   ")
            self.stream.flush()
            self.shown = True

    def done(self) -> None:
        if self.shown:
            self.stream.write("\r" + " " * 79 + "\r")
            self.stream.flush()
            self.shown = False


def _fp32_copy(model: nn.Module, training: bool) -> nn.Module:
    """A deep copy of `model` with no plan applied, every floating tensor in fp32, in eval
    mode (dropout off, so that runs compare). With `training` (a loss to train on), the
    normalisations that keep running statistics (BatchNorm) run as in training, on the
    batch's own statistics: eval mode would normalise with the running ones, which training
    never computes in, and a plan would be chosen for values training does not see."""
    reference = copy.deepcopy(model)
    remove(reference)
    reference.float()
    reference.eval()
    if training:
        for module in reference.modules():
            if isinstance(getattr(module, "running_mean", None), torch.Tensor):
                module.train()
    reference.zero_grad(set_to_none=True)
    return reference


LossFn = Callable[[Any, "_Sample"], torch.Tensor]


def _loss_fn(loss_fn: Callable[..., torch.Tensor] | None) -> LossFn | None:
    """`loss_fn(output)` or `loss_fn(output, sample)`, as one signature."""
    if loss_fn is None:
        return None
    if not callable(loss_fn):
        raise TypeError(f"suggest(loss_fn=...) must be callable: output -> loss, or "
                        f"(output, sample) -> loss. Received: loss_fn={loss_fn!r}")
    try:
        params = [p for p in inspect.signature(loss_fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.default is p.empty]
        two = len(params) >= 2
    except (TypeError, ValueError):
        two = False
    if two:
        return lambda output, sample: loss_fn(output, sample.original)
    return lambda output, sample: loss_fn(output)


def _batch_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    leaves: list[torch.Tensor] = []
    _tensor_leaves((args, kwargs), leaves)
    return int(leaves[0].shape[0]) if leaves and leaves[0].dim() else 0


def _tensor_leaves(obj: Any, out: list[torch.Tensor]) -> None:
    def keep(t: torch.Tensor) -> torch.Tensor:
        out.append(t)
        return t

    map_tree(obj, keep, floating_only=False)


def _rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """How many rows (tokens, samples) the sample holds: all but the last dimension of a
    floating input, every element of an integer one."""
    leaves: list[torch.Tensor] = []
    _tensor_leaves((args, kwargs), leaves)
    if not leaves:
        return 0
    t = leaves[0]
    return int(t.numel() // (t.shape[-1] if t.is_floating_point() and t.dim() > 1 else 1))


def _split(args: tuple[Any, ...], kwargs: dict[str, Any], parts: int
           ) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The sample cut along its batch dimension (the first dimension of its first tensor):
    every tensor with that first dimension is cut, others are shared."""
    size = _batch_size(args, kwargs)
    bounds = [size * i // parts for i in range(parts + 1)]

    def cut(lo: int, hi: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda t: t[lo:hi] if t.dim() and t.shape[0] == size else t

    return [map_tree((args, kwargs), cut(lo, hi), floating_only=False)
            for lo, hi in itertools.pairwise(bounds)]


def _as_given(sample: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A part of `sample` in the form `sample` was given in: a tensor, a mapping, or
    `(args, kwargs)`."""
    if isinstance(sample, Mapping):
        return kwargs
    if (isinstance(sample, tuple) and len(sample) == 2 and isinstance(sample[0], (tuple, list))
            and isinstance(sample[1], Mapping)):
        return (args, kwargs)
    return args[0]


def _samples(sample: Any, args: tuple[Any, ...], kwargs: dict[str, Any], held_out: Any,
             loss_fn: LossFn | None) -> tuple[_Sample, list[_Sample], str]:
    """The calibration batch and the held-out ones, and a warning to give (or "")."""
    if held_out is not None:
        if not isinstance(held_out, (list, tuple)) or (isinstance(held_out, tuple) and len(
                held_out) == 2 and isinstance(held_out[1], Mapping)):
            raise TypeError("suggest(held_out=...) is a list of samples (each as `sample` is "
                            f"given), or [] to hold nothing out. Received: {held_out!r}"[:300])
        calib = _Sample("calibration", args, kwargs, original=_as_given(sample, args, kwargs))
        others = []
        for i, extra in enumerate(held_out, 1):
            a, k = as_call(extra)
            a, k = map_tree((a, k), lambda t: t.float())
            others.append(_Sample(f"held-out {i}", a, k, original=_as_given(extra, a, k)))
        return calib, others, ""
    size = _batch_size(args, kwargs)
    whole = _Sample("calibration", args, kwargs, original=_as_given(sample, args, kwargs))
    if size < 4:
        return whole, [], (f"the sample's batch has {size} rows, too few to hold any out: the "
                           "plan is checked on that batch alone. Pass a larger batch, or "
                           "held_out=[batch, ...].")
    halves = _split(args, kwargs, 2)
    calib = _Sample("calibration", *halves[0], original=_as_given(sample, *halves[0]))
    rest = _split(*halves[1], 2)
    others = [_Sample(f"held-out {i}", *part, original=_as_given(sample, *part))
              for i, part in enumerate(rest, 1)]
    return calib, others, ""


def _ties(model: nn.Module) -> list[set[str]]:
    """The modules sharing each shared parameter."""
    owners: dict[int, set[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for p in module._parameters.values():
            if p is not None:
                owners.setdefault(id(p), set()).add(name)
    return [o for o in owners.values() if len(o) > 1]


def _sizes(model: nn.Module) -> dict[str, int]:
    """Each module's parameter elements, children and shared ones counted once."""
    out: dict[str, int] = {}
    for name, module in model.named_modules():
        out[name] = sum(p.numel() for p in module.parameters())
    return out


def _low_policy(low: SpecLike) -> tuple[Policy, Policy]:
    """The policy outside the islands and the islands' own."""
    if isinstance(low, str) and low.strip().lower().split("/")[0] in FP8_RECIPES:
        recipe = low.strip().lower()
        policy = Policy(compute=recipe if "/" in recipe else f"{recipe}/bf16",  # type: ignore[arg-type]
                        storage=fp32, comm=fp32)
        assert policy.compute is not None
        return policy, Policy(compute=policy.compute, storage=fp32, comm=fp32)
    policy = as_policy(low, argument="low")
    if policy.compute not in LOW_PRECISION:
        raise ValueError(
            "suggest(low=...) names the low-precision policy to run in: its compute must be "
            f"fp16 or bf16, or an fp8 recipe. Received: low={low!r} "
            f"(compute={dtype_name(policy.compute)}). Valid: 'bf16', 'fp16', 'bf16-mixed', "
            f"'16-mixed', {', '.join(repr(r) for r in FP8_RECIPES)}.")
    if policy.storage is None:
        policy = dataclasses.replace(policy, storage=policy.compute)
    return policy, ISLAND


def _speed_islands(model: nn.Module, policy: Policy) -> list[str]:
    """With fp8 `low`: the Linear layers whose GEMMs are too small for fp8 to gain, and every
    module that is not a Linear under fp8 (its ops run in the high compute anyway)."""
    from precision_annot._src.float8 import Gemm
    from precision_annot._src.float8_checks import too_small

    assert policy.gemm is not None
    gemm = Gemm(policy.gemm)
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)
            and too_small(gemm, m.out_features, m.in_features)]


def _verify(search: _Search, calib: _Sample, others: list[_Sample], islands: Islands,
            message: str, why: dict[str, str],
            measure_on: Callable[[_Sample], Callable[[], list[Sensitivity]]],
            bar: _Progress, fixed: frozenset[str], losses: LossFn | None,
            reference: nn.Module) -> tuple[Islands, str]:
    """Check the islands on each held-out batch at the tolerance; on a batch where they fail,
    search again from them on that batch."""
    low = search.policy.compute
    assert low is not None
    for i, batch in enumerate(others):
        if message:
            break
        bar.update("held-out batches", i, len(others))
        batch.light = _reference(reference, batch.args, batch.kwargs, losses, batch,
                                 watch=False)
        search.runs["fp32"] += 1
        if search.check(islands, batch, limit=search.tolerance).passed:
            continue
        islands, message, more = _choose(search, batch, islands, measure_on(batch), bar,
                                         torch.finfo(low).max, fixed, limit=search.tolerance,
                                         prune=False)
        why.update(more)
    bar.done()
    return islands, message


def _outcome(search: _Search, islands: Islands, message: str, final: Check, held: list[Check],
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
    best = _best(search, final.sample)
    if best is not None and not message.startswith("No plan"):
        islands = {i: i in best.outputs for i in best.islands}
    return False, message, islands


def _whole_model(search: _Search, islands: Islands, speed: list[str]) -> str:
    """Why a passing plan is no answer, when its islands (not those kept for speed, which
    stay in the low compute's wider dtype) hold every parameter; else ""."""
    total = search.sizes.get("", 0)
    kept = [i for i in islands if i not in speed]
    if not (total and kept and search.fp32_params(dict.fromkeys(kept, False)) >= total):
        return ""
    return ("No plan short of the whole model in fp32 meets the tolerance: the plan that "
            "passes keeps every parameter in fp32 (" + ", ".join(repr(i) for i in kept)
            + "), since each island's output overflows the low dtype in its caller.")


def _met_message(search: _Search, islands: Islands, held: list[Check], speed: list[str],
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


def _require_numbers(tolerance: object, margin: object) -> None:
    for value, what in ((tolerance, "tolerance"), (margin, "margin")):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not (
                0 < value < math.inf) or (what == "margin" and value > 1):
            raise ValueError(f"suggest({what}=...) must be a number above 0"
                             f"{' and at most 1' if what == 'margin' else ''}. Received: "
                             f"{what}={value!r}")


def _warn_small(small: str, rows: int) -> None:
    if rows < MIN_ROWS:
        small = " ".join(filter(None, [small, (
            f"The calibration batch holds {rows} rows (tokens, samples): too few to show "
            "the peaks a plan must survive. Pass a larger sample.")]))
    if small:
        warnings.warn(f"suggest: {small}", UserWarning, stacklevel=3)


def _first_scale(low: torch.dtype, ref: _Reference) -> float:
    """The loss scale fp16 checks start from: the largest power of two (up to 2**24) that
    keeps the fp32 run's largest gradient in fp16; 1 for other dtypes."""
    if low != fp16 or ref.backward_peak <= 0:
        return 1.0
    return float(2.0 ** max(0, min(24, math.floor(math.log2(65504 / ref.backward_peak)))))


def _warn_no_fp8_gain(low: SpecLike, speed: list[str], low_dtype: torch.dtype) -> None:
    warnings.warn(
        f"suggest: low={low!r} but no Linear layer here gains from fp8: "
        + (f"all {len(speed)} are too small (torchao's thresholds, see check's "
           f"fp8-small-gemm), so the plan keeps them in {dtype_name(low_dtype)} and runs no "
           "GEMM in fp8." if speed else "the model has none, so nothing would run in fp8.")
        + " low='bf16-mixed' gives the same plan without fp8 in its name.",
        UserWarning, stacklevel=3)


def _unverified(rows: int) -> str:
    return (" Unverified: " + (f"the calibration batch holds {rows} rows (tokens, samples), "
                               f"fewer than {MIN_ROWS}" if rows < MIN_ROWS
                               else "no held-out batch checked it")
            + ", so the plan has not been shown to hold on data it was not chosen on.")


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
        tolerance: the largest relative error allowed, end to end, on held-out batches; the
            calibration batch is held to `margin` times it. None takes 2e-2 for fp16, 1e-1 for
            bf16 and 2e-1 for fp8 (the calibration batch then at 1e-2, 5e-2 and 1e-1).
            (Default: None)
        held_out: batches to verify the plan on. None cuts `sample` along its first dimension:
            the first half calibrates, the second half (in two) is held out; [] holds nothing
            out. (Default: None)
        margin: the share of the tolerance the calibration batch is held to, so that the plan
            keeps room on batches it was not chosen on. (Default: 0.5)
        measure: run every module alone in `low` for the table and the chart, even when the
            checks did not need it (about one forward in `low` per level of the module tree).
            (Default: False)
        progress: show a progress bar on stderr; None shows it when stderr is a terminal.
            (Default: None)

    Returns:
        A `Suggestion`. When nothing smaller than the whole model meets the tolerance, its
        `met` is False and its message says why; a `UserWarning` says so too.

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
    require_module(model, "suggest")
    policy, island = _low_policy(low)
    low_dtype = policy.compute
    assert low_dtype is not None
    if tolerance is None:
        tolerance = FP8_TOLERANCE if policy.gemm else DEFAULT_TOLERANCE[low_dtype]
    _require_numbers(tolerance, margin)
    losses = _loss_fn(loss_fn)
    show = sys.stderr.isatty() if progress is None else bool(progress)
    bar = _Progress(show)
    start = time.perf_counter()
    args, kwargs = as_call(sample)
    _require_real_data(model, (args, kwargs))
    reference = _fp32_copy(model, training=losses is not None)
    structure = resolve(reference)
    if policy.gemm:
        from precision_annot._src.float8 import import_torchao

        import_torchao("torchao.float8", f"suggest(low={low!r})")
    with torch.random.fork_rng():
        args, kwargs = map_tree((args, kwargs), lambda t: t.float())  # the fp32 reference's
        calib, others, small = _samples(sample, args, kwargs, held_out, losses)
        try:
            ref = _reference(reference, calib.args, calib.kwargs, losses, calib, watch=False)
        except Exception:
            if losses is None or held_out is not None or not others:
                raise
            # the loss closes over the whole batch: check on it alone
            calib = _Sample("calibration", args, kwargs,
                            original=_as_given(sample, args, kwargs))
            others = []
            small = ("loss_fn(output) does not take a part of the sample (it closes over the "
                     "whole batch), so nothing is held out: pass loss_fn(output, sample), or "
                     "held_out=[batch, ...].")
            ref = _reference(reference, args, kwargs, losses, calib, watch=False)
        _require_outputs(ref.output, losses)
        _require_finite_reference(ref)
        _require_deterministic(reference, calib.args, calib.kwargs, ref, float(tolerance))
        rows = _rows(calib.args, calib.kwargs)
        _warn_small(small, rows)
        calib.light = ref
        scale = _first_scale(low_dtype, ref)
        search = _Search(reference, structure, policy, island, losses, scale, float(tolerance),
                         float(margin), _ties(reference), _sizes(reference))
        search.runs.update({"fp32": 1, "fp32 forward (determinism)": 1})
        speed = _speed_islands(reference, policy) if policy.gemm else []
        eligible = None if not policy.gemm else {
            n for n, m in reference.named_modules() if isinstance(m, nn.Linear)}
        if eligible is not None and len(speed) == len(eligible):
            _warn_no_fp8_gain(low, speed, low_dtype)
        tables: dict[str, list[Sensitivity]] = {}

        def measure_on(batch: _Sample) -> Callable[[], list[Sensitivity]]:
            def measure() -> list[Sensitivity]:
                if batch.label not in tables:
                    tables[batch.label] = _measure(reference, search.full(batch), structure,
                                                   policy, scale, bar, eligible)
                    search.runs["modules alone (forward)"] += len(tables[batch.label])
                return tables[batch.label]
            return measure

        islands, message, why = _choose(search, calib, dict.fromkeys(speed, False),
                                        measure_on(calib), bar, torch.finfo(low_dtype).max,
                                        frozenset(speed))
        islands, message = _verify(search, calib, others, islands, message, why, measure_on,
                                   bar, frozenset(speed), losses, reference)
        islands = search.held_together(islands)
        held = [search.check(islands, b, limit=float(tolerance)) for b in others if b.light]
        if measure:
            measure_on(calib)()
        final = search.check(islands, calib, limit=float(tolerance) * (
            float(margin) if search.settled is None else 1.0))
    met, message, islands = _outcome(search, islands, message, final, held, speed, why)
    verified = bool(held) and rows >= MIN_ROWS
    if met and not verified:
        message += _unverified(rows)
    plan = search.plan(islands, dict(model.named_modules()), resolve(model))
    if not met:
        warnings.warn(f"suggest: {message}", UserWarning, stacklevel=2)
    return Suggestion(islands=islands, plan=plan, table=tables.get(calib.label, []),
                      checks=list(search.path), final=final, held_out=held, met=met, low=policy,
                      tolerance=float(tolerance), margin=float(margin),
                      seconds=time.perf_counter() - start, message=message, reasons=why,
                      kept_for_speed=speed, island=island, runs=dict(search.runs),
                      verified=verified)
