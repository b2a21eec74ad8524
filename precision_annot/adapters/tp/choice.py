"""Which tensor-parallel style each module gets, decided once from the precision plan.

`parallelize_module` applies these decisions and `check(model, "tp", ...)` reports them, so the
two never disagree. A decision starts from the style the user's TP plan names for a module and
changes it only where the precision plan says otherwise:

- a module computing in fp8 with per-tensor scales gets torchao's fp8 style
  (`Float8ColwiseParallel`, `Float8RowwiseParallel`); one computing in another fp8 recipe gets
  the plain style (torchao's fp8 styles scale per tensor);
- a module not planned in fp8 (an fp32 island, a router) never gets an fp8 style;
- a Linear whose partial sums the plain style would reduce in another dtype than its planned
  one gets the planned style (`PlannedRowwiseParallel`, `PlannedColwiseParallel`), which
  computes and reduces them in that dtype: its `comm` (else its compute dtype) differs from
  its compute dtype; it is a boundary; it is column-parallel and computes in another dtype
  than its weight's (its input arrives wider, and torch's style reduces the input's gradient
  in the dtype the input arrived in, before autocast casts it); or it is row-parallel on a
  dimension the TP degree does not divide (torch's style fails there);
- a column-parallel module that keeps the plain style (an fp8 layer, a Linear subclass with
  its own forward) has its input cast to its compute dtype before the style turns it into a
  DTensor, so its input's gradient is reduced in that dtype, whatever dtype it arrived in.

`Decision.reduce` is the dtype each module's partial sums are reduced in, as they run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from fnmatch import fnmatch
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
)

from precision_annot._src.dtypes import FP8, FP8_RECIPES, dtype_name, wider
from precision_annot._src.findings import Severity, listing
from precision_annot._src.float8 import import_torchao
from precision_annot._src.plan import ModulePlan, PrecisionPlan, parent_name
from precision_annot.adapters.tp.styles import PlannedColwiseParallel, PlannedRowwiseParallel
from precision_annot.adapters.transformers import router_names

__all__ = ["Decision", "Note", "decide", "fp8_recipe", "match", "named_by", "role"]


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
            module's output, a column-parallel module's input gradient); None where there is
            none or it is another style's.
        notes: what `parallelize_module` warns of (or refuses) and `check` reports.
        precast: for a column-parallel module keeping a plain style, the dtype its input is
            cast to before the style makes it a DTensor (so its gradient is reduced in it);
            None: no cast.
    """

    name: str
    asked: ParallelStyle
    style: ParallelStyle
    role: str | None
    reduce: torch.dtype | None
    notes: tuple[Note, ...] = ()
    precast: torch.dtype | None = None


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
        names = named_by(model, key)
        unmatched.extend([] if names else [key])
        found.extend((key, n, style) for n in names)
    return found, unmatched


def named_by(model: nn.Module, key: str) -> list[str]:
    """The names of the modules a TP plan key names under `model`, as torch matches them."""
    return list(_names(model, "", key.split("."))) if key else [""]


def _names(module: nn.Module, prefix: str, tokens: list[str]) -> Iterator[str]:
    if not tokens:
        yield prefix
        return
    for child, sub in module.named_children():
        if fnmatch(child, tokens[0]):
            yield from _names(sub, f"{prefix}.{child}" if prefix else child, tokens[1:])


def fp8_recipe(entry: ModulePlan, module: nn.Module) -> str | None:
    """The fp8 recipe a Linear's GEMMs run in, or None (not fp8: high precision, or an
    emulation of fp32, whose GEMMs hand back fp32 as a plain fp32 Linear's do)."""
    gemm = entry.policy.gemm
    return gemm if isinstance(module, nn.Linear) and gemm in FP8_RECIPES else None


def _compute(entry: ModulePlan, module: nn.Module) -> torch.dtype | None:
    """The dtype the module's GEMM computes in (and hands back): its planned compute, else
    its weight's dtype."""
    if entry.policy.compute is not None:
        return entry.policy.compute
    return _stored(entry, module)


def _stored(entry: ModulePlan, module: nn.Module) -> torch.dtype | None:
    """The dtype the module's weight is kept in: its planned storage, else its weight's."""
    if entry.policy.storage is not None:
        return entry.policy.storage
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
           named: Mapping[str, nn.Module] | None = None, degree: int | None = None
           ) -> Decision:
    """The style `module` (named `name` in `plan`) gets when the TP plan asks `style`, on a
    TP mesh of `degree` ranks (None: not known, shard shapes are not looked at)."""
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
    if not isinstance(module, (nn.Linear, nn.Embedding)):
        return Decision(name, style, style, kind, None, (_refused(name, module, style),))
    entry = plan[name]
    gemm = fp8_recipe(entry, module)
    notes = []
    if fp8_asked and gemm is None:
        notes.append(_not_fp8_note(name, entry, style, named))
    if gemm is not None:
        chosen = _fp8_style(style, kind, gemm)
    else:
        planned = _planned(module, style, entry, kind, degree)
        if planned is not None:
            return Decision(name, style, planned, kind, planned.comm, tuple(notes))
        chosen = style if type(style) is _plain(kind) else _rebuild(style, _plain(kind))
    return _kept(name, module, style, chosen, plan, kind, notes, degree)


def _planned(module: nn.Module, style: ParallelStyle, entry: ModulePlan, kind: str,
             degree: int | None) -> PlannedColwiseParallel | PlannedRowwiseParallel | None:
    """The planned style for a Linear whose partial sums the plain style would reduce in
    another dtype than planned (or not at all), else None.

    Under the plain styles a row-parallel Linear's partial output is reduced in the output
    hook torch adds, after the module's forward: after a boundary's exit cast (an fp32
    island's partial sums rounded to the bf16 of the code around it). A column-parallel
    Linear's input gradient is reduced where its input became a DTensor, before the
    boundary's entry cast and before autocast's cast: in the dtype the input arrived in (fp32
    under bf16 autocast, where the code around it computes in fp32). A boundary, and a
    column-parallel Linear computing in another dtype than its weight's, therefore get the
    planned style, which reduces inside the module's own forward. So does a row-parallel
    Linear whose input dimension the TP degree does not divide, where torch's style fails."""
    if _cannot_plan(module) is not None:
        return None
    compute, comm = _compute(entry, module), _comm(entry)
    want = comm or compute
    if want is None:
        return None
    needed = (want != compute or entry.boundary
              or (kind == "colwise" and compute != _stored(entry, module))
              or (kind == "rowwise" and _uneven_input(module, style, degree)))
    if not needed:
        return None
    if kind == "rowwise":
        return cast(PlannedRowwiseParallel, _rebuild(style, PlannedRowwiseParallel, comm=want,
                                                     output=entry.policy.output))
    return cast(PlannedColwiseParallel, _rebuild(style, PlannedColwiseParallel, comm=want))


def _uneven_input(module: nn.Module, style: ParallelStyle, degree: int | None) -> bool:
    """Whether a row-parallel module takes its input as shards of a dimension `degree` does
    not divide: torch's style makes them a DTensor as if they were even, and its GEMM fails
    ("a and b must have same reduction dim")."""
    if degree is None or not isinstance(style, RowwiseParallel):
        return False
    if not isinstance(style.input_layouts[0], Shard) or not isinstance(module, nn.Linear):
        return False
    return bool(module.in_features % degree)


def _cannot_plan(module: nn.Module) -> str | None:
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


def _exit_dtype(plan: PrecisionPlan, name: str, compute: torch.dtype | None
                ) -> torch.dtype | None:
    """The dtype a module hands its output back in: a boundary's exit cast (its `output`,
    else the compute dtype of the code around it), else what it computes in."""
    entry = plan[name]
    if not entry.boundary or not name:
        return compute
    if entry.policy.output is not None:
        return entry.policy.output
    return plan[parent_name(name)].policy.compute or compute


def _kept(name: str, module: nn.Module, asked: ParallelStyle, style: ParallelStyle,
          plan: PrecisionPlan, kind: str, notes: list[Note], degree: int | None) -> Decision:
    """A module keeping a plain style (or torchao's fp8 one): the dtype its partial sums are
    reduced in, as they run, and what that means for its planned comm.

    A column-parallel module's input is cast to its compute dtype before the style makes it a
    DTensor (as autocast would cast it for its GEMM), so its input's gradient, which its GEMM
    hands back in that dtype, is reduced in it. A row-parallel module's output is reduced in
    the dtype it leaves in (its GEMM's, or a boundary's exit cast's); an Embedding's in its
    weight's (a lookup is exact), and a column-parallel Embedding's input (ids) has no
    gradient."""
    entry = plan[name]
    compute = _compute(entry, module)
    precast: torch.dtype | None = None
    if isinstance(module, nn.Embedding):
        reduce = _stored(entry, module) if kind == "rowwise" else None
    elif kind == "colwise":
        reduce = precast = compute
    else:
        reduce = _exit_dtype(plan, name, compute)
    comm = _comm(entry)
    if comm is not None and reduce is not None and comm != reduce:
        notes.append(_comm_note(name, module, entry, kind, reduce))
    if _uneven_input(module, style, degree):
        notes.append(_uneven_note(name, module, style, degree))
    return Decision(name, asked, style, kind, reduce, tuple(notes), precast)


def _refused(name: str, module: nn.Module, style: ParallelStyle) -> Note:
    return Note(
        "error", "tp-style-refused",
        f"The TP plan gives {name!r} ({type(module).__qualname__}) "
        f"{type(style).__name__}, which shards nn.Linear and nn.Embedding layers only: torch "
        f"refuses it (\"{type(style).__name__} currently only support nn.Linear and "
        "nn.Embedding!\"), and so does parallelize_module, before any module is sharded.",
        f"Shard the Linear layers inside {name!r}, or give it SequenceParallel (a norm) or "
        "PrepareModuleInput.")


def _uneven_note(name: str, module: nn.Module, style: ParallelStyle, degree: int | None
                 ) -> Note:
    size = getattr(module, "in_features", 0)
    return Note(
        "error", "tp-uneven-shard",
        f"{name!r} ({type(module).__qualname__}) is row-parallel on a dimension of {size}, "
        f"which {degree} ranks do not divide, and keeps {type(style).__name__}: torch's "
        "style makes its sharded input a DTensor as if the shards were even, and its GEMM "
        "fails at the first forward (\"a and b must have same reduction dim\").",
        f"Use a TP degree that divides {size}, or make {name!r} a plain nn.Linear (the "
        "planned style runs uneven shards).")


def _comm_note(name: str, module: nn.Module, entry: ModulePlan, kind: str,
               reduce: torch.dtype) -> Note:
    """A planned comm the kept style cannot reduce in: narrower than what runs (an error),
    wider (a warning), or exact either way (an Embedding's lookup: info)."""
    comm = entry.policy.comm
    where = "output" if kind == "rowwise" else "input's gradient"
    if isinstance(module, nn.Embedding):
        return Note(
            "info", "tp-comm-wire-only",
            f"{name!r} plans comm={dtype_name(comm)} for its partial sums ({where}), and "
            f"{_cannot_plan(module)}: they are reduced in {dtype_name(reduce)}, the dtype of "
            "its weight.",
            f"Plan comm={dtype_name(reduce)} for {name!r} to say what runs.")
    gemm = fp8_recipe(entry, module)
    why = (f"it computes in {gemm}: torchao's fp8 GEMM hands its partial sums back in "
           f"{dtype_name(reduce)}" if gemm else _cannot_plan(module)
           or f"it is a boundary whose exit casts its output to {dtype_name(reduce)}")
    if comm is not None and wider(comm, reduce):
        return Note(
            "error", "tp-comm-wire-only",
            f"{name!r} plans comm={dtype_name(comm)} for its partial sums ({where}), and "
            f"{why}: casting them to {dtype_name(comm)} after they are rounded would act on "
            f"the wire only (more bytes, no gain), so they are reduced in "
            f"{dtype_name(reduce)}, narrower than planned.",
            f"Plan comm={dtype_name(reduce)} for {name!r} to say what runs"
            + (f", or keep it out of fp8 (compute={dtype_name(reduce)}) to have its partial "
               f"sums in {dtype_name(comm)}." if gemm else
               ", or make it a plain nn.Linear (the planned style computes its partial sums "
               f"in {dtype_name(comm)})."))
    return Note(
        "warning", "tp-comm-widened",
        f"{name!r} plans comm={dtype_name(comm)} for its partial sums ({where}), and {why}: "
        f"they are reduced in {dtype_name(reduce)}, wider than planned (more bytes).",
        f"Plan comm={dtype_name(reduce)} for {name!r} to say what runs.")


def _not_fp8_note(name: str, entry: ModulePlan, style: ParallelStyle,
                  named: Mapping[str, nn.Module] | None) -> Note:
    what = "a router" if named is not None and name in router_names(dict(named)) else (
        f"planned compute={dtype_name(entry.policy.compute)}")
    return Note(
        "info", "tp-fp8-style-not-fp8",
        f"The TP plan gives {name!r} {type(style).__name__}, but the precision plan does not "
        f"run it in fp8 ({what}): torchao's fp8 style would quantize its input to fp8 (and "
        "refuses a layer that is not a Float8Linear), so parallelize_module gives it "
        "a style without fp8 and keeps its planned dtype.",
        f"Give {name!r} {type(style).__name__.replace('Float8', '')} in the TP plan.")


def _fp8_style(style: ParallelStyle, kind: str, gemm: str) -> ParallelStyle:
    """An fp8 Linear's style: torchao's fp8 style for per-tensor scales, the plain style
    otherwise."""
    fp8 = _float8_styles()
    if FP8_RECIPES[gemm] == "tensorwise" and kind in fp8:
        return style if type(style) is fp8[kind] else _rebuild(style, fp8[kind])
    return style if type(style) is _plain(kind) else _rebuild(style, _plain(kind))


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
        "info", "tp-fp8-style-not-fp8",
        f"The TP plan gives {name!r} PrepareFloat8ModuleInput, which hands its input in fp8 "
        f"to every layer under it, and {listing(high)} are not planned in fp8 with per-tensor "
        "scales: parallelize_module gives it the plain PrepareModuleInput (its input is "
        "gathered in its own dtype).",
        "Use PrepareModuleInput there, or put PrepareFloat8ModuleInput on a module whose "
        "Linear layers all compute in fp8.")
    return Decision(name, style, _rebuild(style, PrepareModuleInput), "prepare", None, (note,))
