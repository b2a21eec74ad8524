"""`Finding`, and what a plan's numerics say before any backend is chosen.

`check` gathers findings from here and from each adapter (each adapter knows what its backend
ignores, refuses or runs badly); this module holds the record they all return and the checks
that hold for every backend: loss scaling, low-precision storage, sensitive ops run in a low
dtype, gradients summed in a narrow dtype, islands whose output is narrowed on the way out, and
annotations that do not reach the modules they seem to cover.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Literal, TypeAlias

import torch

from precision_annot.dtypes import LOW_PRECISION, bf16, dtype_name, fp16, wider
from precision_annot.plan import ModulePlan, PrecisionPlan, parent_name
from precision_annot.policy import FIELDS, autocast_mode

__all__ = ["SEVERITIES", "Finding", "Severity", "numerics", "outermost"]

Severity: TypeAlias = Literal["error", "warning", "info"]
SEVERITIES: tuple[Severity, ...] = ("error", "warning", "info")


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing a backend will ignore, refuse or run badly, found before launch.

    Attributes:
        severity: "error" (it will fail or silently drop part of the plan), "warning" (it runs,
            but worse than planned), or "info" (a trade worth knowing).
        code: a stable name for the finding, e.g. "fp16-loss-scaling".
        module: the module it concerns ("" for the whole model).
        message: what is wrong, in one sentence.
        fix: what to do about it.
    """

    severity: Severity
    code: str
    module: str
    message: str
    fix: str

    def __str__(self) -> str:
        return (f"{self.severity}: {self.module or '(model)'}: {self.message} "
                f"Fix: {self.fix} [{self.code}]")

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


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


def _subtree_params(plan: PrecisionPlan, name: str) -> int:
    prefix = f"{name}." if name else ""
    return sum(e.params for n, e in plan.items() if n == name or n.startswith(prefix))


def _bits(dtype: torch.dtype) -> int:
    """Significant bits of a floating dtype: 8 for bf16, 11 for fp16, 24 for fp32."""
    return round(-math.log2(torch.finfo(dtype).eps)) + 1


def _class_name(entry: ModulePlan) -> str:
    return entry.type.rsplit(".", 1)[-1]


def _sensitive(entry: ModulePlan) -> str | None:
    """What kind of precision-sensitive op a module's class is: a norm, a softmax or a loss."""
    name = _class_name(entry)
    if "Norm" in name:
        return "normalization"
    if name in ("Softmax", "LogSoftmax", "Softmin", "Softmax2d"):
        return "softmax"
    if name.endswith("Loss"):
        return "loss"
    return None


def numerics(plan: PrecisionPlan, backend: str | None = None) -> list[Finding]:
    """The findings that hold whatever the backend (a few depend on which one runs the plan:
    DeepSpeed keeps fp32 master weights and scales the loss itself, Lightning's plugin scales
    the loss)."""
    return [*_loss_scaling(plan, backend), *_low_storage(plan, backend),
            *_sensitive_ops(plan), *_narrow_comm(plan), *_narrowed_islands(plan),
            *_shadowed(plan)]


def _loss_scaling(plan: PrecisionPlan, backend: str | None) -> Iterator[Finding]:
    if not plan.needs_loss_scaling or backend in ("lightning", "deepspeed"):
        return
    users = [n for n, e in plan.items() if e.policy.uses(fp16)]
    scaler = ("torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler, which agrees on "
              "overflow across ranks" if backend in ("fsdp", "fsdp1") else
              "precision_annot.GradScaler (it also unscales fp16-stored gradients)")
    yield Finding(
        "warning", "fp16-loss-scaling", "",
        f"The plan uses fp16 in {len(users)} modules and this path does not scale the loss by "
        "itself, so gradients below 6e-5 lose precision and those below 3e-8 flush to zero.",
        f"Scale the loss with {scaler}: scale, unscale before clipping, step, update.",
    )


def _low_storage(plan: PrecisionPlan, backend: str | None) -> Iterator[Finding]:
    if backend == "deepspeed":
        return  # DeepSpeed's bf16 and fp16 modes keep fp32 master weights in the optimizer
    low = [n for n, e in plan.items()
           if e.policy.storage in LOW_PRECISION and _subtree_params(plan, n)]
    for name in outermost(plan, low):
        dtype = plan[name].policy.storage
        assert dtype is not None
        bits = _bits(dtype)
        extra = (" Adam's eps (1e-8) is zero in fp16, so a parameter whose gradient is zero "
                 "divides 0 by 0." if dtype == fp16 else "")
        yield Finding(
            "warning", "low-storage", name,
            f"{_subtree_params(plan, name):,} parameters are stored in {dtype_name(dtype)} "
            f"with no fp32 master copy: an update smaller than about 2^-{bits} of a weight "
            f"rounds away, so small learning rates stop training.{extra}",
            f"Store them in fp32 with {dtype_name(dtype)} compute (e.g. "
            f"'{'bf16' if dtype == bf16 else '16'}-mixed'), or use an optimizer that keeps an "
            "fp32 copy.",
        )


def _sensitive_ops(plan: PrecisionPlan) -> Iterator[Finding]:
    for name, entry in plan.items():
        kind = _sensitive(entry)
        compute = entry.policy.compute
        if kind is None or compute not in LOW_PRECISION or autocast_mode(entry.policy) != "off":
            continue
        yield Finding(
            "warning", "low-sensitive-op", name,
            f"This {kind} ({_class_name(entry)}) runs in {dtype_name(compute)} with autocast "
            "off: its reductions (a mean, a variance, a sum of exponentials) lose precision "
            "that the rest of the model then inherits.",
            f"Make it an fp32 island (precision(fp32) or annotate(model, {{'{name}': 'fp32'}})),"
            f" or keep its storage in fp32 so that autocast runs it as its op lists say.",
        )


def _narrow_comm(plan: PrecisionPlan) -> Iterator[Finding]:
    """One finding per (storage, comm) pair: the modules whose gradients are summed narrower
    than they are stored."""
    pairs: dict[tuple[torch.dtype, torch.dtype], list[str]] = {}
    for name, entry in plan.items():
        comm, storage = entry.policy.comm, entry.policy.storage
        if entry.params and comm is not None and storage is not None and wider(storage, comm):
            pairs.setdefault((storage, comm), []).append(name)
    for (storage, comm), names in pairs.items():
        params = sum(plan[n].params for n in names)
        where = names[0] if len(names) == 1 else ""
        losses = ", ".join(f"{math.log2(n) / 2:g} at {n} ranks" for n in (8, 64, 512))
        yield Finding(
            "info", "narrow-comm", where,
            f"Gradients of {params:,} parameters in {len(names)} modules, stored in "
            f"{dtype_name(storage)}, are summed across ranks in {dtype_name(comm)}, which keeps "
            f"{_bits(comm)} significant bits; with random rounding a sum over N ranks loses "
            f"about log2(N)/2 bits more: {losses}.",
            f"Keep comm at {dtype_name(storage)} where gradients are small beside their sum, "
            f"or accept the trade: {storage.itemsize // comm.itemsize}x less traffic.",
        )


def _narrowed_islands(plan: PrecisionPlan) -> Iterator[Finding]:
    """One finding for the islands wider than fp16 that hand their output back to fp16 code."""
    names = []
    for name, entry in plan.items():
        context = plan.context(name) if name else None
        if not entry.boundary or context is None or entry.policy.output is not None:
            continue
        inner, outer = entry.policy.compute, context.policy.compute
        if inner is None or outer != fp16 or not wider(inner, outer):
            continue
        if _sensitive(entry) in ("normalization", "softmax"):
            continue  # their outputs are bounded: a norm's by its weights, a softmax's by 1
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
    )


def _shadowed(plan: PrecisionPlan) -> Iterator[Finding]:
    """An annotation on a parent that its children, tagged by a construction scope, outrank."""
    shadowed: dict[str, set[str]] = {}
    for name, entry in plan.items():
        if not name:
            continue
        parent = plan[parent_name(name)]
        for field in FIELDS:
            if field == "output":
                continue
            source, parent_source = entry.sources.get(field), parent.sources.get(field)
            if (source == "scope" and parent_source in ("instance", "rule")
                    and getattr(entry.policy, field) != getattr(parent.policy, field)):
                shadowed.setdefault(parent.name, set()).add(field)
    for name, fields in shadowed.items():
        children = [n for n in plan if parent_name(n) == name and n]
        yield Finding(
            "warning", "annotation-shadowed", name,
            f"Its {', '.join(sorted(fields))} annotation does not reach its children: they "
            "were built inside a precision_scope, and a scope's tag outranks what a module "
            "inherits from its parent.",
            f"Annotate the children too (annotate(model, {{'{name}.*': ...}}) or a class "
            f"rule), or build them outside the scope ({len(children)} "
            f"{'child' if len(children) == 1 else 'children'}).",
        )
