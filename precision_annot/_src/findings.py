"""`Finding`, what a plan's numerics say before any backend is chosen, and how a backend's dtypes
are compared with the plan's.

`check` gathers findings from here and from each adapter. Severity means one thing everywhere:

- **error**: the run is refused, or a dtype is silently narrowed, an update vanishes, or a tie
  breaks;
- **warning**: it runs, but worse than planned: silently widened (more bytes), or a measured
  numeric loss;
- **info**: a cost, or what the backend will do that the plan leaves to it.

Each adapter says what its backend will do with each module (the dtype it reduces its
gradients in, the dtype it stores its parameters in); `drift` compares that with the plan, so
that a narrowed dtype is always an error and a widened one always a warning.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Literal, TypeAlias

import torch
from torch import nn

from precision_annot._src.dtypes import (
    LOW_PRECISION,
    bf16,
    dtype_name,
    fp16,
    fp32,
    wider,
)
from precision_annot._src.plan import ModulePlan, PrecisionPlan, parent_name
from precision_annot._src.policy import FIELDS
from precision_annot._src.update.rule import fields_of, module_rules, rule_for

__all__ = ["SEVERITIES", "Finding", "Severity", "drift", "drifts", "listing", "numerics",
           "outermost"]

Severity: TypeAlias = Literal["error", "warning", "info"]
SEVERITIES: tuple[Severity, ...] = ("error", "warning", "info")


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing a backend will ignore, refuse or run badly, found before launch.

    Attributes:
        severity: "error" (refused, a dtype silently narrowed, an update lost or a tie broken),
            "warning" (it runs, but worse than planned: widened, or a measured numeric loss),
            or "info" (a cost, or what the backend does with what the plan leaves open).
        code: a stable name for the finding, e.g. "fp16-loss-scaling"; docs/check.md lists
            every code.
        module: the module it concerns ("" for the whole model); the first of `modules`.
        message: what is wrong and what happens if it is left so.
        fix: what to do about it, as code to paste where there is some.
        modules: every module it concerns. (Default: `(module,)`, or () for the whole model)
    """

    severity: Severity
    code: str
    module: str
    message: str
    fix: str
    modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.modules and self.module:
            object.__setattr__(self, "modules", (self.module,))

    def __str__(self) -> str:
        return (f"{self.severity}: {self.module or '(model)'}: {self.message} "
                f"Fix: {self.fix} [{self.code}]")

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = dataclasses.asdict(self)
        out["modules"] = list(self.modules)
        return out


def listing(names: list[str], limit: int = 6) -> str:
    """Module names as a message shows them: 'a', 'b' and 3 more."""
    shown = [repr(n or "(root)") for n in names[:limit]]
    more = len(names) - limit
    if more > 0:
        return ", ".join(shown) + f" and {more} more"
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " and " + shown[-1]


def outermost(plan: PrecisionPlan, names: list[str]) -> list[str]:
    """The names in `names` with no ancestor in `names`: one finding for a whole subtree."""
    chosen = set(names)
    out = []
    for name in names:
        parent, covered = name, False
        while parent:
            parent = parent_name(parent)
            if parent in chosen:
                covered = True
                break
        if not covered:
            out.append(name)
    return out


def _subtree_params(plan: PrecisionPlan) -> dict[str, int]:
    """Each module's parameter elements with its descendants', in one pass (children first)."""
    total = {name: entry.params for name, entry in plan.items()}
    for name in reversed(list(plan)):
        if name:
            total[parent_name(name)] += total[name]
    return total


def _bits(dtype: torch.dtype) -> int:
    """Significant bits of a floating dtype: 8 for bf16, 11 for fp16, 24 for fp32."""
    return round(-math.log2(torch.finfo(dtype).eps)) + 1


# -- a backend's dtypes against the plan's ------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Drift:
    """Where a backend's dtype for one field differs from the plan's: narrowed (a narrower or
    sideways dtype: an error) or widened (a warning), by module, as (planned, actual)."""

    narrowed: dict[str, tuple[torch.dtype, torch.dtype]]
    widened: dict[str, tuple[torch.dtype, torch.dtype]]


def compare(plan: PrecisionPlan, field: str, actual: Mapping[str, torch.dtype]) -> Drift:
    """Compare what a backend does with `field` (module -> dtype) with the plan, where the
    plan sets the field (None leaves it to the backend). For comm, the dtype gradients are
    reduced in (`Policy.grad_comm`)."""
    narrowed: dict[str, tuple[torch.dtype, torch.dtype]] = {}
    widened: dict[str, tuple[torch.dtype, torch.dtype]] = {}
    for name, dtype in actual.items():
        policy = plan[name].policy
        planned = policy.grad_comm if field == "comm" else getattr(policy, field)
        if planned is None or dtype == planned:
            continue
        (widened if wider(dtype, planned) else narrowed)[name] = (planned, dtype)
    return Drift(narrowed, widened)


_WHAT = {"comm": ("reduces the gradients of", "summed"),
         "storage": ("stores the parameters of", "held"),
         "compute": ("computes", "computed")}


def drift(plan: PrecisionPlan, field: str, actual: Mapping[str, torch.dtype], *, code: str,
          backend: str, cause: str, fix: str) -> list[Finding]:
    """One error for the modules the backend narrows, one warning for those it widens: each
    names the modules, the dtypes, what happens, and `fix`."""
    return drifts(plan, {field: actual}, code=code, backend=backend, cause=cause, fix=fix)


def drifts(plan: PrecisionPlan, actual: Mapping[str, Mapping[str, torch.dtype]], *, code: str,
           backend: str, cause: str, fix: str) -> list[Finding]:
    """`drift` for several fields with one cause (a backend that stores and computes every
    module in one dtype): still one error and one warning, each saying every field."""
    compared = {field: compare(plan, field, dtypes) for field, dtypes in actual.items()}
    out = []
    for severity in ("error", "warning"):
        parts, names, nouns, extra = [], [], [], 0
        for field, found in compared.items():
            changes = found.narrowed if severity == "error" else found.widened
            if changes:
                parts.append(_drift_part(plan, field, changes))
                names += [n for n in changes if n not in names]
                nouns.append(_WHAT[field][1])
                extra += 0 if field == "compute" else sum(
                    plan[n].params * (b.itemsize - a.itemsize) for n, (a, b) in changes.items())
        if parts:
            out.append(Finding(
                severity, code, names[0], f"{backend} {', and '.join(parts)}, because {cause}, "
                f"{_drift_then(severity, nouns, extra)}.", fix, tuple(names)))
    return out


def _drift_part(plan: PrecisionPlan, field: str,
                changes: Mapping[str, tuple[torch.dtype, torch.dtype]]) -> str:
    """What a backend does to one field of these modules: "stores 'a' (n parameters) in
    another dtype than the plan (planned x, y instead)"."""
    verb = _WHAT[field][0]
    pairs = sorted({(dtype_name(a), dtype_name(b)) for a, b in changes.values()})
    said = "; ".join(f"planned {a}, {b} instead" for a, b in pairs)
    elements = sum(plan[n].params for n in changes)
    return (f"{verb} {listing(list(changes))} ({elements:,} parameters) in another dtype than "
            f"the plan ({said})")


def _drift_then(severity: str, nouns: list[str], extra: int) -> str:
    """What the drift costs: bits (narrowed) or time and bytes (widened)."""
    if severity == "error":
        return (f"so they are {' and '.join(nouns)} with fewer bits than the plan gives them, "
                "silently (an island meant to stay wide is not)")
    if nouns == ["computed"]:
        return "so they run slower than planned"
    return (f"so they cost more than planned: {extra:,} more bytes"
            f"{' a step on the wire' if 'summed' in nouns else ' of parameters'}")


# -- what holds whatever the backend -------------------------------------------------------------

def numerics(plan: PrecisionPlan, backend: str | None = None, *,
             comm: Mapping[str, torch.dtype] | None = None,
             stored: Mapping[str, torch.dtype] | None = None, scaled: bool = False
             ) -> list[Finding]:
    """The findings that hold whatever the backend (a few depend on which one runs the plan:
    DeepSpeed keeps fp32 master weights and scales the loss itself, Lightning's plugin scales
    the loss). `comm` and `stored` are what the backend really reduces each module's gradients
    in and stores its parameters in, where known; `scaled` says the loop scales the loss."""
    return [*_loss_scaling(plan, backend, scaled), *_low_storage(plan, backend),
            *_running_statistics(plan, backend), *_narrow_comm(plan, backend, comm, stored),
            *_narrowed_islands(plan), *_shadowed(plan), *_wide_output_islands(plan)]


def _loss_scaling(plan: PrecisionPlan, backend: str | None, scaled: bool) -> Iterator[Finding]:
    if not plan.needs_loss_scaling or scaled or backend in ("lightning", "deepspeed"):
        return
    users = [n for n, e in plan.items()
             if e.policy.uses(fp16) or any(r.uses(fp16) for r in e.regions.values())]
    scaler = ("torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler(), which agrees on "
              "overflow across ranks" if backend in ("fsdp", "fsdp1") else
              "precision_annot.GradScaler() (it also unscales fp16-stored gradients)")
    yield Finding(
        "warning", "fp16-loss-scaling", users[0] if len(users) == 1 else "",
        f"The plan uses fp16 in {len(users)} modules ({listing(users, 3)}) and this path does "
        "not scale the loss by itself: gradients below 6e-5 lose precision and those below "
        "3e-8 flush to zero, so small updates vanish.",
        f"Scale the loss with {scaler}: scale, unscale before clipping, step, update. If your "
        "loop already does, say so: check(..., config={'grad_scaler': True}).",
        tuple(users),
    )


def _low_storage(plan: PrecisionPlan, backend: str | None) -> Iterator[Finding]:
    """Low storage updated as stored: no master copy (none planned; under DeepSpeed, one
    said away with master equal to storage) and no stochastic rounding."""
    subtree = _subtree_params(plan)

    def bare(entry: ModulePlan) -> bool:
        if backend == "deepspeed":  # its bf16 and fp16 modes keep fp32 master weights
            return entry.policy.master == entry.policy.storage
        policy = entry.policy
        rules = [r for _, r in module_rules(entry)] or (  # none of its own: as it plans
            [rule_for(fields_of(policy), policy.storage)] if policy.storage else [])
        return not any(r.master is not None or r.stochastic for r in rules)

    low = [n for n, e in plan.items()
           if e.policy.storage in LOW_PRECISION and subtree[n] and bare(e)]
    for name in outermost(plan, low):
        dtype = plan[name].policy.storage
        assert dtype is not None
        bits = _bits(dtype)
        extra = (" Adam's eps (1e-8) is zero in fp16, so a parameter whose gradient is zero "
                 "divides 0 by 0." if dtype == fp16 else "")
        yield Finding(
            "warning", "low-storage", name,
            f"{subtree[name]:,} parameters are stored in {dtype_name(dtype)} "
            f"with no fp32 master copy: an update smaller than about 2^-{bits} of a weight "
            f"rounds away, so small learning rates stop training.{extra}",
            f"Keep an fp32 master copy: annotate(model, {{{name!r}: 'master=fp32'}}) and "
            "precision_annot.optimizer(model, torch.optim.AdamW, ...), which writes each "
            f"update back rounded; or master='stochastic' (bf16); or store them in fp32 with "
            f"{dtype_name(dtype)} compute ('{'bf16' if dtype == bf16 else '16'}-mixed').",
        )


#: the relative error of running statistics, kept in a low dtype, above which it is reported
RUNNING_STATS_TOLERANCE = 1e-2


def running_stats_error(features: int, dtype: torch.dtype, steps: int = 200) -> float:
    """Measured: the relative error of a BatchNorm's running variance kept in `dtype`, against
    fp32, after `steps` training batches of N(3, 2) data (momentum 0.1). bf16 gives about
    1.4e-2, fp16 about 4e-4."""
    def run(storage: torch.dtype) -> torch.Tensor:
        gen = torch.Generator().manual_seed(0)
        norm = nn.BatchNorm1d(features).to(storage)
        with torch.no_grad():
            for _ in range(steps):
                norm((torch.randn(32, features, generator=gen) * 2 + 3).to(storage))
        return norm.running_var.float()  # type: ignore[union-attr]

    reference = run(fp32)
    return float((run(dtype) - reference).norm() / reference.norm())


def _running_statistics(plan: PrecisionPlan, backend: str | None) -> Iterator[Finding]:
    """A norm whose running statistics are stored in a low dtype, measured: momentum updates
    smaller than the dtype's resolution round away. (A LayerNorm or RMSNorm run in bf16 gives
    the same output as an fp32 island handing back bf16, so it is not reported; nor is a
    BatchNorm with track_running_stats=False, which keeps none.)"""
    if backend == "deepspeed":
        return
    measured: dict[tuple[int, torch.dtype], float] = {}
    for name, entry in plan.items():
        storage = entry.policy.storage
        if not entry.has("running-stats") or storage not in LOW_PRECISION:
            continue
        assert storage is not None and entry.facts is not None
        mean = entry.facts.tensor("running_mean")
        key = (mean.shape[0] if mean is not None and mean.shape else 64, storage)
        if key not in measured:
            measured[key] = running_stats_error(*key)
        error = measured[key]
        if error <= RUNNING_STATS_TOLERANCE:
            continue
        yield Finding(
            "warning", "low-running-stats", name,
            f"Its running mean and variance are kept in {dtype_name(storage)}: measured over "
            f"200 batches, the running variance drifts {error:.1%} from fp32's, because "
            "momentum updates below the dtype's resolution round away; evaluation then "
            "normalizes with the drifted statistics.",
            f"Keep it in fp32: annotate(model, {{'{name}': 'fp32'}}) (or "
            "{nn.BatchNorm2d: 'fp32'}).",
        )


#: where the plan's own comm dtypes are what is reported (no backend: what the plan asks)
_AS_PLANNED = (None, "local")


def _narrow_comm(plan: PrecisionPlan, backend: str | None,
                 comm: Mapping[str, torch.dtype] | None,
                 stored: Mapping[str, torch.dtype] | None) -> Iterator[Finding]:
    """One finding per (storage, comm) pair: the modules whose gradients are summed narrower
    than they are stored, as the backend will store and sum them (`stored`, `comm`), else as
    the plan asks; nothing when a backend's wire dtypes are unknown (another comm hook)."""
    if comm is None and backend not in _AS_PLANNED:
        return
    pairs = _narrowed_pairs(plan, comm, stored or {})
    who = f"{backend} sums" if backend and comm is not None else (
        "the plan asks for summing")
    for (storage, reduced), names in pairs.items():
        params = sum(plan[n].params for n in names)
        losses = ", ".join(f"{math.log2(n) / 2:g} at {n} ranks" for n in (8, 64, 512))
        yield Finding(
            "info", "narrow-comm", names[0] if len(names) == 1 else "",
            f"{who[0].upper()}{who[1:]} the gradients of {params:,} parameters in "
            f"{len(names)} modules ({listing(names, 3)}), stored in {dtype_name(storage)}, "
            f"in {dtype_name(reduced)}, "
            f"which keeps {_bits(reduced)} significant bits; with random rounding a sum over N "
            f"ranks loses about log2(N)/2 bits more: {losses}.",
            f"Keep comm at {dtype_name(storage)} where gradients are small beside their sum, "
            f"or accept the trade: {storage.itemsize // reduced.itemsize}x less traffic.",
            tuple(names),
        )


def _narrowed_pairs(plan: PrecisionPlan, comm: Mapping[str, torch.dtype] | None,
                    stored: Mapping[str, torch.dtype]
                    ) -> dict[tuple[torch.dtype, torch.dtype], list[str]]:
    """The modules holding parameters whose gradients are summed narrower than stored, by
    (storage, comm): as the backend does (`stored`, `comm`), else as the plan asks."""
    pairs: dict[tuple[torch.dtype, torch.dtype], list[str]] = {}
    for name, entry in plan.items():
        storage = stored.get(name) or entry.policy.storage or fp32
        reduced = comm.get(name) if comm is not None else entry.policy.grad_comm
        if entry.params and reduced is not None and wider(storage, reduced):
            pairs.setdefault((storage, reduced), []).append(name)
    return pairs


def _bounded(type_path: str) -> bool:
    """A module whose output is bounded: a norm's by its weights, a softmax's by 1."""
    name = type_path.rsplit(".", 1)[-1]
    return name in _BOUNDED or name.endswith(("LayerNorm", "RMSNorm", "GroupNorm"))


_BATCH_NORMS = frozenset({"BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm",
                          "LazyBatchNorm1d", "LazyBatchNorm2d", "LazyBatchNorm3d"})
_BOUNDED = frozenset({"LayerNorm", "RMSNorm", "GroupNorm", "Softmax", "LogSoftmax", "Softmin",
                      "Softmax2d", *_BATCH_NORMS})


def _narrowed_islands(plan: PrecisionPlan) -> Iterator[Finding]:
    """One finding for the islands wider than fp16 that hand their output back to fp16 code."""
    names = []
    for name, entry in plan.items():
        context = plan.context(name) if name else None
        if not entry.boundary or context is None or entry.policy.output is not None:
            continue
        inner, outer = entry.policy.compute, context.policy.compute
        if inner is None or outer != fp16 or not wider(inner, outer) or _bounded(entry.type):
            continue
        names.append(name)
    if not names:
        return
    listed = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    yield Finding(
        "info", "island-output-narrowed", names[0] if len(names) == 1 else "",
        (f"{len(names)} islands wider than fp16 hand their outputs" if len(names) > 1 else
         "An island wider than fp16 hands its output")
        + f" back in fp16 ({listed}): a value above 65504 becomes inf on the way out, as in "
        "T5's feed-forward.",
        "If their outputs can grow that large, set output=fp32 on them or keep their callers "
        "in fp32; suggest(model, batch, low='fp16') checks this end to end (its own islands "
        "have been).",
        tuple(names),
    )


def _wide_output_islands(plan: PrecisionPlan) -> Iterator[Finding]:
    """One finding for the fp32 islands that are Linear layers handing back fp32 inside
    bf16/fp16 code (a router kept fp32 for its logits): their GEMMs could run in the low dtype
    with an fp32 output, the product of bf16 operands exact in fp32 and never rounded."""
    names = []
    for name, entry in plan.items():
        context = plan.context(name) if name else None
        policy = entry.policy
        if context is None or not entry.has("linear") or policy.compute != fp32 or (
                policy.output != fp32) or policy.emulation is not None:
            continue
        outer = context.policy.compute
        if outer in (fp16, bf16):
            names.append((name, outer))
    if not names:
        return
    low = dtype_name(names[0][1])
    preset = "bf16-mixed" if names[0][1] == bf16 else "16-mixed"
    yield Finding(
        "info", "island-wide-output", names[0][0] if len(names) == 1 else "",
        f"{listing([n for n, _ in names])}: fp32 Linear island(s) handing back fp32 inside "
        f"{low} code. Their GEMMs could run in {low} with an fp32 output (the products of "
        f"{low} operands are exact in fp32; the output is never rounded), at a fraction of "
        "fp32's GEMM time: the rounding of a router's logits is what changes its top-k.",
        f"Try output=fp32 over {low} compute on them (annotate(model, {{name: "
        f"'{preset},output=fp32'}}), 'backward=split2' for fp32-grade gradients); "
        f"suggest(model, batch, low='{low}') measures whether the error holds.",
        tuple(n for n, _ in names),
    )


def _shadowed(plan: PrecisionPlan) -> Iterator[Finding]:
    """An annotation on a parent that its children, tagged by a construction scope, outrank."""
    shadowed: dict[str, set[str]] = {}
    children: dict[str, int] = {}
    for name, entry in plan.items():
        if not name:
            continue
        parent = plan[parent_name(name)]
        children[parent.name] = children.get(parent.name, 0) + 1
        for field in FIELDS:
            if field == "output":
                continue
            source, parent_source = entry.sources.get(field), parent.sources.get(field)
            if (source == "scope" and parent_source in ("instance", "rule")
                    and getattr(entry.policy, field) != getattr(parent.policy, field)):
                shadowed.setdefault(parent.name, set()).add(field)
    for name, fields in shadowed.items():
        count = children[name]
        yield Finding(
            "warning", "annotation-shadowed", name,
            f"Its {', '.join(sorted(fields))} annotation does not reach its children: they "
            "were built inside a precision_scope, and a scope's tag outranks what a module "
            "inherits from its parent, so they run as the scope said.",
            f"Annotate the children too (annotate(model, {{'{name}.*': ...}}) or a class "
            f"rule), or build them outside the scope ({count} "
            f"{'child' if count == 1 else 'children'}).",
        )
