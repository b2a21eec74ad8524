"""What `suggest` returns: each module's `Sensitivity`, each end-to-end `Check`, and the
`Suggestion` with its text, JSON and chart."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from precision_annot._src.dtypes import bf16, dtype_name
from precision_annot._src.plan import PrecisionPlan
from precision_annot._src.policy import Policy
from precision_annot._src.suggest.plans import Islands
from precision_annot._src.tables import format_table


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
            output, in a model without autocast; code that refuses the low dtype), or None.
        raised_in: the module in whose own code the run raised ("" for the root), or None (it
            did not raise, or raised outside every module: in `loss_fn` or the backward).
        crowded: on the calibration batch, the first module whose output, held in the low
            dtype, reached past `margin` of that dtype's largest value, and the share it
            reached; the plan then fails, as data it was not chosen on may overflow. None:
            every such output kept that room (or the batch is held out).
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
    crowded: tuple[str, float] | None = None
    raised_in: str | None = None

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
        """The errors above the limit: "output", "loss", "gradients"; and "range" when an
        output came too near the low dtype's largest value (`crowded`)."""
        return [k for k, v in self.errors().items() if not (math.isfinite(v) and v <= self.limit)
                ] + (["range"] if self.crowded is not None else [])

    def to_dict(self) -> dict[str, Any]:
        def number(x: float) -> float | str:
            return x if math.isfinite(x) else str(x)

        return {"islands": list(self.islands), "output_fp32": list(self.outputs),
                "sample": self.sample, "limit": self.limit,
                "errors": {k: number(v) for k, v in self.errors().items()},
                "failed": self.failed, "passed": self.passed,
                "first_nonfinite": self.first_nonfinite, "fp32_params": self.fp32_params,
                "crashed": self.crashed, "raised_in": self.raised_in,
                "crowded": None if self.crowded is None else {
                    "module": self.crowded[0], "share": self.crowded[1]}}


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
        arithmetic: Linear layers that the search made islands but that meet the tolerance
            with the low dtype's GEMMs and an fp32 output (then a 2-piece backward), cheaper
            than fp32 GEMMs, by name: their policy ("bf16-mixed,output=fp32" and so on). They
            are in `plan` and `rules`, not in `islands`.
        reasons: why each island was added: "a non-finite value arose in it", "gradients", ...
        runs: what `suggest` ran, by kind: fp32 reference steps, checks (a step in the low
            dtype each), backward passes (a retry when fp16 gradients overflow the loss
            scale), watched runs, modules run alone.
        loss_scale: the loss scale the fp16 checks' backward ran at, as a `GradScaler` that
            has settled scales (the largest power of two that keeps the gradients finite);
            None for other dtypes. Start a GradScaler there (`init_scale=`) when it is far
            above the default 2**16.
        seconds: how long `suggest` took.
    """

    def __init__(self, *, islands: Islands, plan: PrecisionPlan, table: list[Sensitivity],
                 checks: list[Check], final: Check, held_out: list[Check], met: bool,
                 low: Policy, tolerance: float, margin: float, seconds: float, message: str,
                 reasons: dict[str, str], kept_for_speed: list[str], island: Policy,
                 runs: dict[str, int] | None = None, verified: bool = True,
                 loss_scale: float | None = None,
                 arithmetic: dict[str, Policy] | None = None) -> None:
        self.islands = [i for i in islands if i not in kept_for_speed]
        self.outputs = [i for i, out in islands.items() if out]
        text = "bf16" if island.compute == bf16 and island.storage != bf16 else "fp32"
        text = f"compute={dtype_name(island.compute)}" if low.fp8 else text
        self.rules: list[tuple[str, str]] = [
            (name, f"{text},output=fp32" if islands[name] else text) for name in islands]
        self.arithmetic = {n: str(p) for n, p in (arithmetic or {}).items()}
        self.rules += list(self.arithmetic.items())
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
        self.loss_scale = loss_scale

    @property
    def worst(self) -> Check:
        """The plan's worst check over every batch, by its largest error."""
        return max([self.final, *self.held_out],
                   key=lambda c: max(c.errors().values()) / min(c.limit, self.tolerance))

    def __repr__(self) -> str:
        return (f"Suggestion({len(self.islands)} fp32 islands: {self.islands}, "
                f"met={self.met}" + ("" if self.verified else ", verified=False") + ")")

    def __str__(self) -> str:
        lines = self._summary()
        if self.kept_for_speed:
            lines.append(f"kept out of fp8 as too small to gain: {len(self.kept_for_speed)} "
                         "Linear layers")
        lines.append("")
        if not self.table:
            lines.append("No module was measured alone: the checks found every island.")
        else:
            lines += self._table()
        return "\n".join(lines)

    def _summary(self) -> list[str]:
        total = sum(e.params for e in self.plan.values())
        held = sum(e.params for n, e in self.plan.items()
                   if any(n == i or n.startswith(i + ".") for i in self.islands))
        errors = ", ".join(f"{k} error {v:.2e}" for k, v in self.final.errors().items())
        held_worst = max(self.held_out, key=lambda c: max(c.errors().values()) / c.limit,
                         default=None)
        kind = "high-precision" if self.low.fp8 else "fp32"
        return [
            f"suggest: everything in {self.low} ({self.low.show('compute')} compute), "
            f"tolerance {self.tolerance:g} (the calibration batch held to {self.margin:g} of "
            f"it), {len(self.checks)} end-to-end checks, {self.seconds:.1f} s ("
            + ", ".join(f"{k} {v}" for k, v in self.runs.items()) + ")",
            self.message,
            f"{kind} islands ({len(self.islands)}, holding {held:,} of {total:,} parameters, "
            f"{held / max(total, 1):.0%}): "
            + (", ".join(i + (" (output fp32)" if i in self.outputs else "")
                         for i in self.islands) or "none"),
            *self._arithmetic_lines(kind),
            f"calibration batch: {errors}",
            ("held-out batches: none" if held_worst is None else
             f"held-out batches ({len(self.held_out)}), the worst: "
             + ", ".join(f"{k} {v:.2e}" for k, v in held_worst.errors().items())),
        ]

    def _arithmetic_lines(self, kind: str) -> list[str]:
        """The line naming the Linear layers that run the low dtype's GEMMs with an fp32
        output instead of being islands, if any."""
        if not self.arithmetic:
            return []
        return [f"instead of {kind} islands, the low dtype's GEMMs with an fp32 output: "
                + ", ".join(f"{n} (backward={Policy.parse(p).backward or 'round'})"
                            for n, p in self.arithmetic.items())]

    def _table(self) -> list[str]:
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
        return [*format_table(rows, right={2, 3, 4, 5, 7, 8}), "",
                "error alone: relative error of the module's output when it alone computes "
                "in the low dtype; peak |x|: the largest value its own ops produce in fp32."]

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
            "loss_scale": self.loss_scale,
            "message": self.message,
            "islands": self.islands,
            "output_fp32": self.outputs,
            "arithmetic": self.arithmetic,
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
