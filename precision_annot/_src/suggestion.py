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
import json
import math
import sys
import time
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from precision_annot._src.casting import floating_leaves, map_tree
from precision_annot._src.dtypes import LOW_PRECISION, dtype_name, fp16, fp32
from precision_annot._src.guards import require_module
from precision_annot._src.plan import PrecisionPlan, Source, format_table, parent_name
from precision_annot._src.policy import Policy, SpecLike, as_policy
from precision_annot._src.resolution import resolve
from precision_annot._src.runtime import apply, remove
from precision_annot._src.samples import as_call
from precision_annot._src.tracking import DATA_MOVEMENT, ModuleTracker

__all__ = ["Check", "Sensitivity", "Suggestion", "suggest"]

#: The default tolerance: bf16 keeps 8 bits of mantissa, fp16 11.
DEFAULT_TOLERANCE = {fp16: 1e-2, torch.bfloat16: 5e-2}
ISLAND = Policy(compute=fp32, storage=fp32, comm=fp32)
FP16_SMALLEST = 2.0 ** -24  # the smallest fp16 subnormal: a gradient below it flushes to zero
MAX_CHECKS = 64
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
            root), or None.
        passed: every error within the tolerance.
    """

    islands: tuple[str, ...]
    output_error: float
    loss_error: float | None
    grad_error: float | None
    first_nonfinite: str | None
    passed: bool

    def errors(self) -> dict[str, float]:
        out = {"output": self.output_error}
        if self.loss_error is not None:
            out["loss"] = self.loss_error
        if self.grad_error is not None:
            out["gradients"] = self.grad_error
        return out


class Suggestion:
    """What `suggest` found: the fp32 islands, and the evidence.

    Attributes:
        islands: names of the modules to keep in fp32, outermost only.
        rules: `[(name, "fp32"), ...]`, for `annotate(model, suggestion.rules)`.
        plan: the plan for the model given to `suggest`: everything in `low`, the islands in
            fp32; ready for `apply` and every adapter.
        table: every measured module's `Sensitivity`, most sensitive first.
        checks: the end-to-end runs, in order; the plan's own is the last that passed.
        met: whether the plan meets the tolerance.
        low: the policy of everything outside the islands.
        tolerance: the tolerance asked for.
        seconds: how long `suggest` took.
    """

    def __init__(self, *, islands: list[str], plan: PrecisionPlan, table: list[Sensitivity],
                 checks: list[Check], final: Check, met: bool, low: Policy, tolerance: float,
                 seconds: float, message: str) -> None:
        self.islands = islands
        self.rules: list[tuple[str, str]] = [(name, "fp32") for name in islands]
        self.plan = plan
        self.table = table
        self.checks = checks
        self.final = final
        self.met = met
        self.low = low
        self.tolerance = tolerance
        self.seconds = seconds
        self.message = message

    def __repr__(self) -> str:
        return (f"Suggestion({len(self.islands)} fp32 islands: {self.islands}, "
                f"met={self.met})")

    def __str__(self) -> str:
        total = sum(e.params for e in self.plan.values())
        held = sum(e.params for n, e in self.plan.items()
                   if any(n == i or n.startswith(i + ".") for i in self.islands))
        errors = ", ".join(f"{k} error {v:.2e}" for k, v in self.final.errors().items())
        lines = [
            f"suggest: everything in {self.low} ({dtype_name(self.low.compute)} compute), "
            f"tolerance {self.tolerance:g}, {len(self.checks)} end-to-end checks, "
            f"{self.seconds:.1f} s",
            self.message,
            f"fp32 islands ({len(self.islands)}, holding {held:,} of {total:,} parameters, "
            f"{held / max(total, 1):.0%}): {', '.join(self.islands) or 'none'}",
            f"end to end: {errors}",
            "",
        ]
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
        """The suggestion as JSON: the islands, the checks, the table and the plan."""
        def number(x: float | None) -> float | str | None:
            return x if x is None or math.isfinite(x) else str(x)

        return json.dumps({
            "format": "precision_annot.suggestion",
            "low": str(self.low),
            "tolerance": self.tolerance,
            "met": self.met,
            "message": self.message,
            "islands": self.islands,
            "errors": {k: number(v) for k, v in self.final.errors().items()},
            "checks": len(self.checks),
            "seconds": round(self.seconds, 3),
            "table": [{k: number(v) if isinstance(v, float) else v
                       for k, v in dataclasses.asdict(s).items()} for s in self.table],
            "plan": json.loads(self.plan.to_json()),
        }, indent=indent)

    def plot(self, path: str | Path, *, top: int = 40) -> Path:
        """A bar chart of each module's sensitivity, islands highlighted, written to `path`.

        Needs matplotlib: `pip install 'precision-annot[plot]'`.
        """
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError("Suggestion.plot needs matplotlib: "
                              "pip install 'precision-annot[plot]'") from e
        rows = [s for s in self.table if not math.isnan(s.error)][:top][::-1]
        floor = 1e-8
        values = [1e3 if s.nonfinite else max(s.error, s.underflow or 0.0, floor) for s in rows]
        colors = ["#d62728" if s.name in self.islands else "#1f77b4" for s in rows]
        fig, ax = plt.subplots(figsize=(8, max(2.5, 0.28 * len(rows) + 1)))
        ax.barh([s.name or "(root)" for s in rows], values, color=colors)
        ax.set_xscale("log")
        ax.axvline(self.tolerance, color="gray", linestyle="--", linewidth=1)
        ax.set_xlabel(f"relative error alone in {dtype_name(self.low.compute)} "
                      "(non-finite drawn at 1e3); dashed: tolerance")
        ax.set_title(f"Sensitivity per module: red = kept in fp32 ({len(self.islands)})")
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


def _require_outputs(output: Any, loss_fn: Callable[[Any], torch.Tensor] | None) -> None:
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
    if math.isfinite(drift) and drift <= tolerance * 0.1:
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
               loss_fn: Callable[[Any], torch.Tensor] | None) -> _Reference:
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
        try:
            torch.manual_seed(SEED)
            output = model(*args, **kwargs)
        except TypeError as e:
            if not (len(args) == 1 and isinstance(args[0], tuple) and not kwargs):
                raise
            raise TypeError(f"suggest: the model failed on the sample ({e}). A tuple sample is "
                            "passed as one argument; for several positional arguments pass "
                            "(args, kwargs), e.g. suggest(model, ((x1, x2), {})).") from e
        loss = loss_fn(output) if loss_fn is not None else None
        if loss is not None:
            if not (isinstance(loss, torch.Tensor) and loss.is_floating_point()
                    and loss.numel() == 1 and loss.requires_grad):
                raise TypeError(
                    "suggest(loss_fn=...) must return a one-element floating tensor computed "
                    "from the output, so that its backward reaches the parameters. Received: "
                    f"{_describe(loss)}.")
            loss.backward()  # type: ignore[no-untyped-call]
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return _Reference(_detached(output), None if loss is None else loss.detach(), grads,
                      inputs, outputs, mode.peaks, mode.backward_peak, mode.counts)


def _describe(value: Any) -> str:
    if not isinstance(value, torch.Tensor):
        return f"{value!r} (of type {type(value).__name__})"
    return (f"a tensor of shape {tuple(value.shape)}, dtype {value.dtype}, "
            f"requires_grad={value.requires_grad}")


def _uniform(structure: PrecisionPlan, policy: Policy) -> PrecisionPlan:
    return _plan(structure, policy, [], None)


def _plan(structure: PrecisionPlan, policy: Policy, islands: list[str],
          modules: dict[str, nn.Module] | None) -> PrecisionPlan:
    """`structure` (a resolved plan, for names, classes and kept arguments) with everything in
    `policy` but the islands and their subtrees in fp32."""
    policies: dict[str, Policy] = {}
    sources: dict[str, dict[str, Source | None]] = {}
    for name in structure:
        island = next((i for i in islands if name == i or name.startswith(i + ".")), None)
        chosen = ISLAND if island is not None else policy
        source: Source = "default" if not name else "rule" if island == name else "inherited"
        policies[name] = chosen
        sources[name] = {f: (source if v is not None else None) for f, v in chosen.items()}
    planned = structure.with_policies(policies, sources)
    return PrecisionPlan(dict(planned.items()), default=policy, model_type=structure.model_type,
                         modules=modules)


def _measure(reference: nn.Module, ref: _Reference, structure: PrecisionPlan, policy: Policy,
             scale: float, progress: _Progress) -> list[Sensitivity]:
    low = policy.compute
    assert low is not None
    limit = torch.finfo(low).max
    named = dict(reference.named_modules())
    todo = [n for n in ref.inputs if n and not structure[n].container and n in named]
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

def _check(reference: nn.Module, ref: _Reference, structure: PrecisionPlan, policy: Policy,
           islands: list[str], args: tuple[Any, ...], kwargs: dict[str, Any],
           loss_fn: Callable[[Any], torch.Tensor] | None, scale: float,
           tolerance: float) -> Check:
    model = copy.deepcopy(reference)
    apply(model, _plan(structure, policy, islands, None))
    names = {m: n for n, m in model.named_modules()}
    tracker = ModuleTracker(names)
    mode = _Watch(tracker, baseline=ref.nonfinite)
    loss_error = grad_error = None
    with tracker, mode:
        torch.manual_seed(SEED)
        output = model(*copy.deepcopy(args), **copy.deepcopy(kwargs))
        output_error = relative_error(output, ref.output)
        if loss_fn is not None and ref.loss is not None:
            loss = loss_fn(output)
            loss_error = relative_error(loss, ref.loss)
            (loss * scale).backward()  # type: ignore[no-untyped-call]
            grads = {n: p.grad.double() / scale for n, p in model.named_parameters()
                     if p.grad is not None}
            grad_error = relative_error([grads[n] for n in ref.grads if n in grads],
                                        [ref.grads[n] for n in ref.grads if n in grads])
            if len(grads) != len(ref.grads):
                grad_error = math.inf
    errors = [e for e in (output_error, loss_error, grad_error) if e is not None]
    passed = all(math.isfinite(e) and e <= tolerance for e in errors)
    return Check(tuple(islands), output_error, loss_error, grad_error, mode.first_nonfinite,
                 passed)


def _choose(table: list[Sensitivity], structure: PrecisionPlan, check: Callable[[list[str]], Check],
            progress: _Progress) -> tuple[list[str], list[Check], bool, str]:
    def covered(name: str, islands: list[str]) -> bool:
        return any(name == i or name.startswith(i + ".") for i in islands)

    def runs_above(name: str) -> str:
        """The nearest ancestor that runs its own forward ("" for the root)."""
        parent = parent_name(name)
        while parent and structure[parent].container:
            parent = parent_name(parent)
        return parent

    order = [s.name for s in table if s.score > 0]
    islands: list[str] = []
    checks = [check(islands)]
    message = ""
    while not checks[-1].passed and len(checks) < MAX_CHECKS:
        progress.update("end-to-end checks", len(checks), len(checks) + 1)
        last = checks[-1]
        culprit = last.first_nonfinite
        if culprit == OUTSIDE:
            target = None
            where = ("a non-finite value first appears outside the model, in loss_fn: compute "
                     "the loss in fp32 (output.float())")
        elif culprit is not None:
            # a value that overflows on leaving an island needs the island's caller too
            leaving = bool(culprit) and covered(culprit, islands)
            target = runs_above(culprit) if leaving else culprit
            where = (f"the output of the fp32 island {culprit!r} does not fit the low dtype "
                     "when it is handed back to its caller, the root, which cannot be an island"
                     if leaving else "a non-finite value arises in the model's own code (the "
                     "root), which cannot be an island")
        else:
            target = next((n for n in order if not covered(n, islands)), None)
            where = "every measured module is in fp32 already"
        if not target:
            message = (f"No plan short of the whole model in fp32 meets the tolerance: "
                       f"{where}. The errors reached: "
                       + ", ".join(f"{k} {v:.2e}" for k, v in last.errors().items()) + ".")
            break
        islands = [i for i in islands if not covered(i, [target])] + [target]
        checks.append(check(islands))
    met = checks[-1].passed
    if met:
        # drop what is not needed, the largest islands first
        size = {s.name: s.params for s in table}
        for island in sorted(islands, key=lambda n: -sum(
                v for k, v in size.items() if k == n or k.startswith(n + "."))):
            progress.update("pruning", len(checks), len(checks) + 1)
            trial = [i for i in islands if i != island]
            result = check(trial)
            checks.append(result)
            if result.passed:
                islands = trial
        message = (f"The plan meets the tolerance with {len(islands)} fp32 island"
                   f"{'' if len(islands) == 1 else 's'}.")
    elif not message:
        message = (f"No plan met the tolerance within {MAX_CHECKS} end-to-end checks; the "
                   "islands shown are the last ones tried.")
    progress.done()
    return islands, checks, met, message


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


def _fp32_copy(model: nn.Module) -> nn.Module:
    """A deep copy of `model` with no plan applied, every floating tensor in fp32, in eval
    mode (dropout off, so that runs compare)."""
    reference = copy.deepcopy(model)
    remove(reference)
    reference.float()
    reference.eval()
    reference.zero_grad(set_to_none=True)
    return reference


def suggest(
    model: nn.Module,
    sample: Any,
    *,
    low: SpecLike = "bf16",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    tolerance: float | None = None,
    progress: bool | None = None,
) -> Suggestion:
    """Find the fp32 islands a model needs to run in a low dtype, and verify them end to end.

    Everything runs in `low` except the suggested islands. The choice is verified against an
    fp32 run of the same model on `sample`: the outputs, and with `loss_fn` the loss and the
    gradients, stay within `tolerance`. The model's own annotations are not read: the plan is
    built from scratch (arguments named in `keep_dtype` are still kept). The model is not
    changed; the runs happen on copies, in eval mode.

    Args:
        model: the model, in fp32.
        sample: a batch: a tensor, a dict of keyword arguments, or `(args, kwargs)`.
        low: the policy of everything outside the islands: "bf16" or "fp16" (compute and
            storage in that dtype), or "bf16-mixed" / "16-mixed" (fp32 master weights).
            (Default: "bf16")
        loss_fn: `loss_fn(output) -> loss`; with it the backward is checked too, and for fp16
            the gradients that would underflow at a dynamic loss scale are measured.
            (Default: None)
        tolerance: the largest relative error allowed, end to end; None takes 1e-2 for fp16
            and 5e-2 for bf16. (Default: None)
        progress: show a progress bar on stderr; None shows it when stderr is a terminal.
            (Default: None)

    Returns:
        A `Suggestion`. When nothing smaller than the whole model meets the tolerance, its
        `met` is False and its message says why; a `UserWarning` says so too.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from precision_annot import suggest
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
        >>> found = suggest(model, torch.randn(4, 8), low="bf16")
        >>> found.met
        True
    """
    require_module(model, "suggest")
    policy = as_policy(low, argument="low")
    if policy.compute not in LOW_PRECISION:
        raise ValueError(
            "suggest(low=...) names the low-precision policy to run in: its compute must be "
            f"fp16 or bf16. Received: low={low!r} (compute={dtype_name(policy.compute)}). "
            "Valid: 'bf16', 'fp16', 'bf16-mixed', '16-mixed'."
        )
    if policy.storage is None:
        policy = dataclasses.replace(policy, storage=policy.compute)
    low_dtype = policy.compute
    assert low_dtype is not None
    if tolerance is None:
        tolerance = DEFAULT_TOLERANCE[low_dtype]
    if not isinstance(tolerance, (int, float)) or isinstance(tolerance, bool) or not (
            0 < tolerance < math.inf):
        raise ValueError(f"suggest(tolerance=...) must be a number above 0. Received: "
                         f"tolerance={tolerance!r}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"suggest(loss_fn=...) must be callable: output -> loss. Received: "
                        f"loss_fn={loss_fn!r}")
    show = sys.stderr.isatty() if progress is None else bool(progress)
    bar = _Progress(show)
    start = time.perf_counter()
    args, kwargs = as_call(sample)
    _require_real_data(model, (args, kwargs))
    reference = _fp32_copy(model)
    structure = resolve(reference)
    with torch.random.fork_rng():
        args, kwargs = map_tree((args, kwargs), lambda t: t.float())  # the fp32 reference's
        ref = _reference(reference, copy.deepcopy(args), copy.deepcopy(kwargs), loss_fn)
        _require_outputs(ref.output, loss_fn)
        _require_finite_reference(ref)
        _require_deterministic(reference, args, kwargs, ref, float(tolerance))
        scale = 1.0
        if low_dtype == fp16 and ref.backward_peak > 0:
            scale = 2.0 ** max(0, min(24, math.floor(math.log2(65504 / ref.backward_peak))))
        table = _measure(reference, ref, structure, policy, scale, bar)

        def check(islands: list[str]) -> Check:
            return _check(reference, ref, structure, policy, islands, args, kwargs, loss_fn,
                          scale, float(tolerance))

        islands, checks, met, message = _choose(table, structure, check, bar)
    final = next((c for c in reversed(checks) if c.islands == tuple(islands)), checks[-1])
    plan = _plan(resolve(model), policy, islands, dict(model.named_modules()))
    if not met:
        warnings.warn(f"suggest: {message}", UserWarning, stacklevel=2)
    return Suggestion(islands=islands, plan=plan, table=table, checks=checks, final=final,
                      met=met, low=policy, tolerance=float(tolerance),
                      seconds=time.perf_counter() - start, message=message)
