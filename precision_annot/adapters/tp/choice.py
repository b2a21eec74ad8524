"""Which tensor-parallel style each module gets, decided once from the precision plan.

`parallelize_module` applies these decisions and `check(model, "tp", ...)` reports them, so the
two never disagree. A decision starts from the style the user's TP plan names for a module and
changes it only where the precision plan says otherwise:

- a module computing in fp8 with per-tensor scales gets torchao's fp8 style
  (`Float8ColwiseParallel`, `Float8RowwiseParallel`); one computing in another fp8 recipe gets
  the plain style (torchao's fp8 styles scale per tensor);
- a module not planned in fp8 (an fp32 island, a router) never gets an fp8 style;
- a Linear whose planned `comm` differs from the dtype its GEMM computes in gets the planned
  style (`PlannedRowwiseParallel`, `PlannedColwiseParallel`), which computes and reduces its
  partial sums in `comm`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from fnmatch import fnmatch
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
)

from precision_annot._src.dtypes import FP8, FP8_RECIPES, dtype_name
from precision_annot._src.findings import Severity, listing
from precision_annot._src.float8 import import_torchao
from precision_annot._src.plan import ModulePlan, PrecisionPlan
from precision_annot.adapters.tp.styles import PlannedColwiseParallel, PlannedRowwiseParallel
from precision_annot.adapters.transformers import router_names

__all__ = ["Decision", "Note", "decide", "match", "role"]


@dataclasses.dataclass(frozen=True)
class Note:
    """Why a decision differs from what was asked, or what a planned dtype cannot do here: one
    runtime warning of `parallelize_module`, one finding of `check`."""

    severity: Severity
    code: str
    message: str
    fix: str


@dataclasses.dataclass(frozen=True)
class Decision:
    """The style one module gets.

    Attributes:
        name: the module's name in the precision plan.
        asked: the style the user's TP plan names for it.
        style: the style it gets.
        role: "colwise", "rowwise", "prepare" or None (a style left as it is).
        reduce: the dtype its tensor-parallel partial sums are reduced in (a row-parallel
            Linear's output, a column-parallel Linear's input gradient); None where there is
            none or it is another style's.
        notes: what `parallelize_module` warns of and `check` reports.
    """

    name: str
    asked: ParallelStyle
    style: ParallelStyle
    role: str | None
    reduce: torch.dtype | None
    notes: tuple[Note, ...] = ()


def _float8_styles() -> dict[str, type[ParallelStyle]]:
    """torchao's fp8 styles by role; empty without torchao."""
    try:
        tp = import_torchao("torchao.float8.float8_tensor_parallel", "fp8 tensor parallel")
    except ImportError:
        return {}
    return {"colwise": tp.Float8ColwiseParallel, "rowwise": tp.Float8RowwiseParallel,
            "prepare": tp.PrepareFloat8ModuleInput}


def role(style: ParallelStyle) -> tuple[str | None, bool]:
    """What a style does ("colwise", "rowwise", "prepare", or None for a style this adapter
    leaves alone: its own subclasses, SequenceParallel, ...), and whether it is torchao's fp8
    one. Only torch's and torchao's own classes (and the planned styles) are recognised."""
    kind = type(style)
    if kind.__module__.startswith("torchao."):  # torchao is imported only for its own styles
        fp8 = {cls: r for r, cls in _float8_styles().items()}
        if kind in fp8:
            return fp8[kind], True
    plain = {ColwiseParallel: "colwise", PlannedColwiseParallel: "colwise",
             RowwiseParallel: "rowwise", PlannedRowwiseParallel: "rowwise",
             PrepareModuleInput: "prepare"}
    return plain.get(kind), False


def match(model: nn.Module, parallelize_plan: ParallelStyle | Mapping[str, ParallelStyle]
          ) -> tuple[list[tuple[str, str, ParallelStyle]], list[str]]:
    """The modules a TP plan names, as torch's `parallelize_module` finds them (each dotted
    part of a key matched with fnmatch against the children's names; "" is `model` itself), in
    the order it applies them: (key, the module's name under `model`, style); and the keys
    that name no module (torch skips them with a warning)."""
    if isinstance(parallelize_plan, ParallelStyle):
        return [("", "", parallelize_plan)], []
    if not isinstance(parallelize_plan, Mapping):
        raise TypeError("parallelize_module: parallelize_plan is a ParallelStyle or a dict "
                        "of module names to ParallelStyles. Received: "
                        f"{parallelize_plan!r} (of type {type(parallelize_plan).__name__})")
    found: list[tuple[str, str, ParallelStyle]] = []
    unmatched: list[str] = []
    for key, style in parallelize_plan.items():
        names = list(_names(model, "", key.split("."))) if key else [""]
        unmatched.extend([] if names else [key])
        found.extend((key, n, style) for n in names)
    return found, unmatched


def _names(module: nn.Module, prefix: str, tokens: list[str]) -> Iterator[str]:
    if not tokens:
        yield prefix
        return
    for child, sub in module.named_children():
        if fnmatch(child, tokens[0]):
            yield from _names(sub, f"{prefix}.{child}" if prefix else child, tokens[1:])


def _compute(entry: ModulePlan, module: nn.Module) -> torch.dtype | None:
    """The dtype the module's GEMM computes in (and hands back): its planned compute, else
    its weight's dtype."""
    if entry.policy.compute is not None:
        return entry.policy.compute
    weight = getattr(module, "weight", None)
    return weight.dtype if isinstance(weight, torch.Tensor) else None


def _comm(entry: ModulePlan) -> torch.dtype | None:
    """The planned dtype of the module's tensor-parallel reductions: its `comm` (comm=fp8
    all-gathers fp8 weights, which is no reduction dtype)."""
    comm = entry.policy.comm
    return None if comm is None or comm == FP8 else comm


def _rebuild(style: ParallelStyle, cls: type[Any], **extra: Any) -> ParallelStyle:
    """`style`'s layouts in another class of the same role."""
    new: ParallelStyle
    if isinstance(style, (ColwiseParallel, RowwiseParallel)):
        new = cls(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                  use_local_output=style.use_local_output, **extra)
    else:
        assert isinstance(style, PrepareModuleInput)
        new = cls(input_layouts=style.input_layouts,
                  desired_input_layouts=style.desired_input_layouts,
                  input_kwarg_layouts=style.input_kwarg_layouts or None,
                  desired_input_kwarg_layouts=style.desired_input_kwarg_layouts or None,
                  use_local_output=style.use_local_output)
    new.src_data_rank = style.src_data_rank
    return new


def _plain(role_: str) -> type[Any]:
    return {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
            "prepare": PrepareModuleInput}[role_]


def decide(name: str, module: nn.Module, style: ParallelStyle, plan: PrecisionPlan,
           named: Mapping[str, nn.Module] | None = None) -> Decision:
    """The style `module` (named `name` in `plan`) gets when the TP plan asks `style`."""
    kind, fp8_asked = role(style)
    if kind is None:
        return Decision(name, style, style, None, None)
    if kind == "prepare":
        return _prepare(name, module, style, plan, fp8_asked)
    if isinstance(style, (PlannedColwiseParallel, PlannedRowwiseParallel)):
        return Decision(name, style, style, kind, style.comm)  # the user's own choice
    if name not in plan:
        raise ValueError(
            f"The TP plan names {name!r}, which the precision plan does not hold (a module "
            "added after the plan was applied or resolved): apply the plan again "
            "(apply(model)) or resolve it again, then parallelize. Modules in the plan: "
            f"{listing(list(plan)[:8])}{', ...' if len(plan) > 8 else ''}.")
    entry = plan[name]
    gemm = entry.policy.gemm if isinstance(module, nn.Linear) else None
    if gemm is not None:
        return _fp8(name, module, style, entry, kind, gemm)
    notes = []
    if fp8_asked:
        notes.append(_not_fp8_note(name, entry, style, named))
    return _high(name, module, style, entry, kind, notes)


def _high(name: str, module: nn.Module, style: ParallelStyle, entry: ModulePlan, kind: str,
          notes: list[Note]) -> Decision:
    """A module computing in high precision: the planned style where its partial sums would
    otherwise be reduced in another dtype than its comm (its compute, where comm is unset),
    else the plain one.

    Under the plain styles a row-parallel Linear's partial output is reduced in the output
    hook torch adds, after the module's forward: after a boundary's exit cast (an fp32
    island's partial sums rounded to the bf16 of the code around it). A column-parallel
    Linear's input gradient is reduced where its input became a DTensor, before the
    boundary's entry cast: in the caller's dtype. A boundary therefore always gets the planned
    style, which reduces inside the module's own forward."""
    compute, comm = _compute(entry, module), _comm(entry)
    want = comm or compute
    plain = style if type(style) in (ColwiseParallel, RowwiseParallel) else _rebuild(
        style, _plain(kind))
    if want is None or (want == compute and not entry.boundary):
        return Decision(name, style, plain, kind, _reduced(module, compute), tuple(notes))
    why = _cannot_plan(module, kind)
    if why is not None:
        if comm is not None and comm != compute:
            notes.append(_wire_only(name, entry, kind, compute, why, "the sum runs"))
        return Decision(name, style, plain, kind, _reduced(module, compute), tuple(notes))
    if kind == "rowwise":
        planned = _rebuild(style, PlannedRowwiseParallel, comm=want, output=entry.policy.output)
    else:
        planned = _rebuild(style, PlannedColwiseParallel, comm=want)
    return Decision(name, style, planned, kind, want, tuple(notes))


def _reduced(module: nn.Module, compute: torch.dtype | None) -> torch.dtype | None:
    """The dtype a plain style sums partial results across ranks in: a row-parallel Linear's
    output and a column-parallel Linear's input gradient come out of its GEMM in the compute
    dtype; an Embedding's rows come whole from one rank (no sum to speak of)."""
    return compute if isinstance(module, nn.Linear) else None


def _cannot_plan(module: nn.Module, kind: str) -> str | None:
    """Why the planned style cannot compute this module's partial sums in its comm, or None."""
    if isinstance(module, nn.Embedding):
        return ("an Embedding's sharded lookup sums rows that each come whole from one rank "
                "(the others add zeros), so the sum is exact in any dtype")
    if not isinstance(module, nn.Linear):
        return f"{type(module).__qualname__} is not an nn.Linear"
    if type(module).forward is not nn.Linear.forward:
        return (f"{type(module).__qualname__} overrides nn.Linear's forward, which the planned "
                "style would replace")
    return None


def _wire_only(name: str, entry: ModulePlan, kind: str, compute: torch.dtype | None,
               why: str, what: str) -> Note:
    comm = entry.policy.comm
    where = "output" if kind == "rowwise" else "input's gradient"
    severity: Severity = "info" if "exact" in why else "warning"
    return Note(
        severity, "tp-comm-wire-only",
        f"{name!r} plans comm={dtype_name(comm)} for its partial sums ({where}), and "
        f"{why}: casting them to {dtype_name(comm)} after they are computed in "
        f"{dtype_name(compute)} would act on the wire only (more bytes, no gain), so {what} "
        f"in {dtype_name(compute)}.",
        f"Plan comm={dtype_name(compute)} for {name!r} to say what runs"
        + ("." if severity == "info" else
           ", or keep it out of fp8 (compute=bf16) to have its partial sums in "
           f"{dtype_name(comm)}."))


def _not_fp8_note(name: str, entry: ModulePlan, style: ParallelStyle,
                  named: Mapping[str, nn.Module] | None) -> Note:
    what = "a router" if named is not None and name in router_names(dict(named)) else (
        f"planned compute={dtype_name(entry.policy.compute)}")
    return Note(
        "warning", "tp-fp8-style-not-fp8",
        f"The TP plan gives {name!r} {type(style).__name__}, but the precision plan does not "
        f"run it in fp8 ({what}): torchao's fp8 style would quantize its input to fp8 (and "
        "refuses a layer that is not a Float8Linear), so parallelize_module gives it "
        "a style without fp8 and keeps its planned dtype.",
        f"Give {name!r} {type(style).__name__.replace('Float8', '')} in the TP plan.")


def _fp8(name: str, module: nn.Module, style: ParallelStyle, entry: ModulePlan, kind: str,
         gemm: str) -> Decision:
    """An fp8 Linear: torchao's fp8 style for per-tensor scales, the plain style otherwise;
    its partial sums come out of torchao's fp8 GEMM in the high-precision dtype."""
    compute = _compute(entry, module)
    notes = []
    comm = _comm(entry)
    if comm is not None and comm != compute:
        notes.append(_wire_only(
            name, entry, kind, compute,
            f"it computes in {gemm}: torchao's fp8 GEMM hands its partial sums back in "
            f"{dtype_name(compute)}", "parallelize_module reduces them"))
    fp8 = _float8_styles()
    if FP8_RECIPES[gemm] == "tensorwise" and kind in fp8:
        chosen = style if type(style) is fp8[kind] else _rebuild(style, fp8[kind])
    else:
        chosen = style if type(style) is _plain(kind) else _rebuild(style, _plain(kind))
    return Decision(name, style, chosen, kind, compute, tuple(notes))


def _prepare(name: str, module: nn.Module, style: ParallelStyle, plan: PrecisionPlan,
             fp8_asked: bool) -> Decision:
    """`PrepareFloat8ModuleInput` casts the module's input to fp8 before gathering it: kept
    only where every Linear under the module runs fp8 with per-tensor scales."""
    if not fp8_asked:
        return Decision(name, style, style, "prepare", None)
    prefix = f"{name}." if name else ""
    high = [f"{prefix}{n}" if n else name for n, m in module.named_modules()
            if isinstance(m, nn.Linear) and FP8_RECIPES.get(
                plan[f"{prefix}{n}" if n else name].policy.gemm or "") != "tensorwise"]
    if not high:
        return Decision(name, style, style, "prepare", None)
    note = Note(
        "warning", "tp-fp8-style-not-fp8",
        f"The TP plan gives {name!r} PrepareFloat8ModuleInput, which hands its input in fp8 "
        f"to every layer under it, and {listing(high)} are not planned in fp8 with per-tensor "
        "scales: parallelize_module gives it the plain PrepareModuleInput (its input is "
        "gathered in its own dtype).",
        "Use PrepareModuleInput there, or put PrepareFloat8ModuleInput on a module whose "
        "Linear layers all compute in fp8.")
    return Decision(name, style, _rebuild(style, PrepareModuleInput), "prepare", None, (note,))
