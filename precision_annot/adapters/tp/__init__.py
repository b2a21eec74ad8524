"""Tensor parallelism from the precision plan: `parallelize_module`.

torch's `parallelize_module` shards layers by the styles a TP plan names, and knows nothing of
precision: a row-parallel Linear all-reduces its partial sums in the dtype its GEMM rounded
them to (bf16), so the result moves with the TP degree; torchao's fp8 styles must be chosen by
hand, and nothing keeps them off a router; FSDP2's `reduce_dtype` does not reach the TP-mesh
all-reduce of replicated parameters' gradients. `parallelize_module` here takes torch's
arguments and applies each style as the model's precision plan says:

- fp8 styles (torchao's) for Linear layers that compute in fp8 with per-tensor scales, plain
  styles elsewhere: an fp32 island or a router is never given an fp8 style (a warning names
  it);
- a row-parallel Linear's `comm` is the dtype of its partial sums and their all-reduce
  (`PlannedRowwiseParallel`); a column-parallel Linear's `comm` that of its input gradient's
  (`PlannedColwiseParallel`): `comm=fp32` over bf16 compute gives a result independent of the
  TP degree up to one final rounding; unset, its compute dtype (torch's column-parallel style
  reduces the input's gradient in the dtype the input arrived in, fp32 under bf16 autocast);
- a column-parallel module keeping a plain style (an fp8 layer, a Linear subclass with its own
  forward) has its input cast to its compute dtype before the style makes it a DTensor, so its
  input's gradient is reduced in that dtype;
- parameters replicated over the TP mesh have their partial gradients reduced in their `comm`.

`tp.reduced_in(model)` says the dtype each sum runs in, and `audit` records it.

`check(model, "tp", {"parallelize_plan": ..., "tp_degree": ...})` says the same before launch.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from precision_annot._src.findings import listing
from precision_annot._src.guards import require_module, require_plan, warn
from precision_annot._src.plan import PrecisionPlan
from precision_annot._src.runtime import (
    AppliedState,
    ModuleState,
    applied_plan,
    apply,
    find_boundary,
    plan_of,
)
from precision_annot._src.wrappers import unwrap
from precision_annot.adapters.tp.choice import Decision, Note, decide, match
from precision_annot.adapters.tp.grads import ReplicatedGrads, replicated
from precision_annot.adapters.tp.styles import (
    InputCast,
    PlannedColwiseParallel,
    PlannedRowwiseParallel,
)

__all__ = ["PlannedColwiseParallel", "PlannedRowwiseParallel", "decisions",
           "parallelize_module", "reduced_in", "styles"]


def _owner_plan(module: nn.Module) -> tuple[PrecisionPlan, str] | None:
    """The plan of the applied model `module` is part of, and its name there (torchtitan
    parallelizes block by block): found through what `apply` left on its modules."""
    own = ModuleState.of(module)
    if own is None:
        return None
    for sub in module.modules():
        boundary = find_boundary(sub)[0]
        owner = getattr(boundary, "owner", None) or getattr(sub.__dict__.get("_apply"), "state",
                                                             None)
        if isinstance(owner, AppliedState):
            root = owner.plan.module("")
            plan = applied_plan(root) if root is not None else owner.plan
            return (plan or owner.plan), own.name
    return None


def model_plan(module: nn.Module, plan: PrecisionPlan | None, where: str
               ) -> tuple[PrecisionPlan, str]:
    """The precision plan `module` runs under and its name in it, applying the plan first when
    none is applied: the plan given (whose model holds `module`), else the plan applied to
    `module` or to the model it is part of, else its annotations resolved."""
    if plan is not None:
        require_plan(plan, where)
        prefix = next((n for n, m in plan.modules().items() if m is module), None)
        if prefix is None:
            raise ValueError(f"{where}: plan is not the plan of a model holding this module "
                             "(resolve(model) of the model it belongs to).")
        root = plan.module("")
        if root is not None and applied_plan(root) is None:
            apply(root, plan)
        return plan, prefix
    found = applied_plan(module)
    if found is not None:
        return found, ""
    owned = _owner_plan(module)
    if owned is not None:
        return owned
    resolved = plan_of(module)
    apply(module, resolved)
    return resolved, ""


def _full(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _warn_unmatched(module: nn.Module, keys: list[str]) -> None:
    names = [n for n, _ in module.named_modules() if n]
    for key in keys:
        close = difflib.get_close_matches(key, names, n=3, cutoff=0.5)
        warn(f"parallelize_module: the TP plan key {key!r} names no module, so it is skipped "
             "(as torch's parallelize_module skips it) and that module runs unsharded on every "
             "rank. " + (f"Closest module names: {', '.join(map(repr, close))}." if close
                         else f"Module names start with: {', '.join(map(repr, names[:5]))}."))


#: notes that refuse the TP plan before any module is sharded
REFUSED = frozenset({"tp-style-refused"})


def _refuse(chosen: list[Decision]) -> None:
    """Raise for a decision torch's parallelize_module would refuse midway, leaving the
    modules before it sharded: before anything is."""
    for decision in chosen:
        for note in decision.notes:
            if note.code in REFUSED:
                raise ValueError(f"parallelize_module: {note.message} {note.fix}")


def _warn_notes(chosen: list[Decision]) -> None:
    """One warning per kind of note, naming every module it concerns."""
    by_code: dict[str, list[tuple[str, Note]]] = {}
    for decision in chosen:
        for note in decision.notes:
            # the style asked for is replaced: surprising at run time, a note to `check`
            if note.severity != "info" or note.code == "tp-fp8-style-not-fp8":
                by_code.setdefault(note.code, []).append((decision.name, note))
    for found in by_code.values():
        first = found[0][1]
        others = [n for n, _ in found[1:]]
        more = f" The same holds for {listing(others)}." if others else ""
        warn(f"parallelize_module: {first.message}{more} {first.fix}")


def _warn_unplanned(module: nn.Module, chosen: list[Decision], plan: PrecisionPlan) -> None:
    """No plan was applied to `module` or a model holding it, so its own was applied here:
    the Linear layers it shards without a planned compute dtype are a sign that the plan is set
    above it (on the model of which it is a block), where it cannot be seen from here."""
    bare = [d.name for d in chosen if d.role in ("colwise", "rowwise")
            and d.name in plan and plan[d.name].policy.compute is None]
    if bare:
        warn(f"parallelize_module: no precision plan is applied to this "
             f"{type(module).__qualname__} or to a model holding it, so its own annotations "
             f"were applied as its plan, and they plan no compute dtype for {listing(bare)}: "
             "they get torch's styles in their parameters' dtype. Annotations and defaults on "
             "the modules above it (precision(...)(model), apply(model, default=...)) are not "
             "seen from here. To parallelize a part of a model (a transformer block), apply "
             "the model's plan first (apply(model, ...)), or pass plan=resolve(model, ...).")


_DECISIONS = "_precision_annot_tp_decisions"


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    parallelize_plan: ParallelStyle | dict[str, ParallelStyle] | None = None,
    *,
    src_data_rank: int | None = 0,
    plan: PrecisionPlan | None = None,
) -> nn.Module:
    """torch's `parallelize_module`, with each style chosen from the precision plan.

    The plan is applied first (if it is not yet), so fp8 layers are torchao's; then each module
    the TP plan names gets the style `check(model, "tp", ...)` reports: torchao's fp8 style for
    fp8 layers with per-tensor scales, never an fp8 style for a module planned otherwise (a
    warning names it), and for a Linear whose `comm` differs from its compute dtype, the
    planned style that computes and reduces its partial sums in `comm`. Parameters replicated
    over the mesh have their partial gradients reduced in their `comm`. Keys naming no module
    are skipped with a warning that names the closest modules.

    Args:
        module: the model, or a part of an applied model (a transformer block).
        device_mesh: the 1-D tensor-parallel mesh (`mesh["tp"]` of a 2-D mesh); None: the
            current mesh, as torch takes it. (Default: None)
        parallelize_plan: a `ParallelStyle`, or a dict of module names (fnmatch per dotted
            part, as torch matches them) to styles. (Default: None, nothing is done)
        src_data_rank: as torch's. (Default: 0)
        plan: the precision plan of the model `module` belongs to; None: the plan applied to
            it (or to the model it is part of), else its annotations. (Default: None)

    Returns:
        `module`, parallelized.

    Example:
        >>> # from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
        >>> # precision_annot.annotate(model, {nn.Linear: "comm=fp32"})
        >>> # precision_annot.apply(model, default="bf16-mixed")
        >>> # tp.parallelize_module(model, mesh["tp"], {"*.up": ColwiseParallel(),
        >>> #                                           "*.down": RowwiseParallel()})
    """
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    require_module(module, "parallelize_module", "module")
    if parallelize_plan is None:
        return torch_parallelize(module, device_mesh, None, src_data_rank=src_data_rank)
    root = unwrap(module)
    unplanned = plan is None and applied_plan(root) is None and _owner_plan(root) is None
    precision, prefix = model_plan(root, plan, "parallelize_module")
    degree = device_mesh.size() if device_mesh is not None else None
    chosen = decisions(root, parallelize_plan, precision, prefix, degree)
    _refuse(chosen)
    _warn_unmatched(root, match(root, parallelize_plan)[1])
    if unplanned:
        _warn_unplanned(root, chosen, precision)
    _warn_notes(chosen)
    named = dict(root.named_modules())
    for decision in chosen:
        local = decision.name[len(prefix) + 1:] if prefix else decision.name
        torch_parallelize(named[local], device_mesh, decision.style, src_data_rank=src_data_rank)
        if decision.precast is not None:
            _precast(named[local], decision.precast)
    _hook_replicated(root, chosen, precision, prefix)
    root.__dict__.setdefault(_DECISIONS, []).extend(chosen)
    return module


def decisions(module: nn.Module, parallelize_plan: ParallelStyle | Mapping[str, ParallelStyle],
              plan: PrecisionPlan, prefix: str = "", degree: int | None = None
              ) -> list[Decision]:
    """The style each module the TP plan names gets under `plan` on a TP mesh of `degree`
    ranks (None: not known), in the order they are applied (`prefix`: `module`'s name in
    `plan`)."""
    found, _ = match(module, parallelize_plan)
    everything = plan.modules() or None
    named = dict(module.named_modules())
    return [decide(_full(prefix, name), named[name], style, plan, everything, degree)
            for _, name, style in found]


def _precast(module: nn.Module, dtype: torch.dtype) -> None:
    """An `InputCast` pre-hook on a column-parallel module keeping a plain style, run before
    the style's own (which makes the input a DTensor), once per module."""
    # NOTE: nn.Module has no public way to list its hooks; `_forward_pre_hooks` is read only,
    # so that parallelizing a module twice hooks it once
    if not any(isinstance(h, InputCast) for h in module._forward_pre_hooks.values()):
        module.register_forward_pre_hook(InputCast(dtype), prepend=True)


def _hook_replicated(root: nn.Module, chosen: list[Decision], plan: PrecisionPlan,
                     prefix: str) -> None:
    """A `ReplicatedGrads` pre-hook on each module under the parallelized ones that holds
    replicated parameters and plans a comm."""
    seen: set[str] = set()
    for decision in chosen:
        local = decision.name[len(prefix) + 1:] if prefix else decision.name
        top = root.get_submodule(local) if local else root
        for name, sub in top.named_modules(prefix=decision.name):
            comm = plan[name].policy.grad_comm if name in plan else None
            if name in seen or comm is None or not replicated(sub):
                continue
            # NOTE: nn.Module has no public way to list its hooks; `_forward_pre_hooks` is read
            # only, so that parallelizing a module twice hooks it once
            if any(isinstance(h, ReplicatedGrads) for h in sub._forward_pre_hooks.values()):
                continue
            seen.add(name)
            hook = ReplicatedGrads(comm)
            hook.hook(sub)
            sub.register_forward_pre_hook(hook)


def _applied(module: nn.Module) -> list[Decision]:
    """The decisions `parallelize_module` applied under `module` (whichever module it was
    called on: the model, or each block)."""
    return [d for sub in unwrap(module).modules() for d in sub.__dict__.get(_DECISIONS, [])]


def styles(module: nn.Module) -> dict[str, ParallelStyle]:
    """The style `parallelize_module` applied to each module under `module`, by name in the
    precision plan (the last one, where a module was given several)."""
    return {d.name: d.style for d in _applied(module)}


def reduced_in(module: nn.Module) -> dict[str, torch.dtype]:
    """The dtype each module under `module` that `parallelize_module` gave a reducing style
    sums its partial results across ranks in, as it runs (a row-parallel module's output, a
    column-parallel module's input gradient), by name in the precision plan. A
    column-parallel module whose input arrives already a DTensor (gathered by a
    `PrepareModuleInput` above it, with `use_local_output=False`) under a plain style leaves
    that sum to the module that made the DTensor."""
    return {d.name: d.reduce for d in _applied(module) if d.reduce is not None}
