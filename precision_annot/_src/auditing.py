"""`audit`: record what actually runs, forward and backward, and compare it with the plan.

No backend tells its user what dtype each module really ran in. Inside an `audit` block every
floating op is seen where it runs, after autocast has picked its dtype (at dispatch), and is
charged to the innermost module running it: in forward through the module stack, in backward
through the autograd node being executed, which the forward pass mapped to the module that
created it. Parameters, buffers, gradients, outputs and the autocast state are recorded too,
and `AuditReport.divergences` lists every difference from the plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Any, Literal, TypeAlias

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.hooks import RemovableHandle

from precision_annot._src.arithmetic import Arithmetic
from precision_annot._src.boundary import device_type_of
from precision_annot._src.casting import floating_leaves
from precision_annot._src.dtypes import FP8, dtype_name, wider
from precision_annot._src.execution import Execution, Kind, Site, compile_plan
from precision_annot._src.float8 import is_fp8_tensor
from precision_annot._src.guards import require_module, require_plan
from precision_annot._src.plan import ModulePlan, PrecisionPlan
from precision_annot._src.policy import Policy, autocast_mode
from precision_annot._src.runtime import (
    arithmetic_of_module,
    check_matches,
    find_boundary,
    plan_of,
)
from precision_annot._src.schedule import Switch, switches_of
from precision_annot._src.tables import format_table
from precision_annot._src.tracking import DATA_MOVEMENT, ModuleTracker
from precision_annot._src.update.rule import fields_of, rule_for
from precision_annot._src.wrappers import unwrap

__all__ = ["AuditReport", "Divergence", "ModuleRecord", "UpdateRecord", "audit"]

Phase: TypeAlias = Literal["forward", "backward", "state"]

_CASTS = frozenset({"to", "float", "half", "bfloat16", "double", "type", "type_as"})
#: views compute nothing (DTensor's `to_local`, in a tensor-parallel output hook, is one)
_VIEWS = frozenset({"view", "view_as"})

#: the collectives (`torch.ops._c10d_functional`, what DTensor issues) that sum across ranks
_REDUCING = frozenset({"all_reduce", "all_reduce_coalesced", "reduce_scatter_tensor",
                       "reduce_scatter_tensor_coalesced"})

#: the ops a Linear's GEMM reaches dispatch as (torchao's fp8 tensors arrive as mm/addmm)
_GEMMS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_grouped_mm",
                    "matmul", "linear", "_grouped_mm"})


@dataclasses.dataclass(frozen=True)
class UpdateRecord:
    """What one optimizer step did with one parameter (`audit(model, optimizer=...)`).

    Attributes:
        grad: the dtype of the gradient the step read.
        master: the dtype of the master copy it updated, or None (the parameter itself).
        state: the optimizer's state tensors for it, by name: a dtype name, or the class of a
            low-bit state ("OptimState8bit").
        changed: whether what the step updates (the master, where there is one) changed.
    """

    grad: torch.dtype | None
    master: torch.dtype | None
    state: dict[str, str]
    changed: bool


@dataclasses.dataclass
class ModuleRecord:
    """What one module did inside an `audit` block.

    Attributes:
        name: the module's qualified name ("" for the root).
        type: its class name.
        calls: how many times its forward ran.
        forward_ops: floating ops of its own code in forward, by the dtype they computed in.
        backward_ops: the same in backward.
        autocast: the autocast states its own code ran under, as (enabled, dtype) pairs.
        inputs: dtypes of the floating tensors it was called with (before any boundary cast).
        outputs: dtypes of the floating tensors it handed back.
        tensors: its own parameters and floating buffers, by name: ("param" or "buffer", dtype).
        grads: dtypes of the gradients its parameters received, by name.
        region: for a function-form region's row (`module::function`), its policy.
        gemms: its weight GEMMs per phase: matrix multiplies by its own weight (a Linear's, a
            Conv1D's), or with fp8 operands; not those of activations alone (attention scores).
        fp8_gemms: those of them that took fp8 operands (`_scaled_mm`, torchao's fp8
            tensors), per phase.
        high_weight_gemms: for a module planned with fp8 GEMMs, the GEMMs that multiplied by
            its weight (or a copy autocast made of it) in high precision, wherever they ran
            (a parent calling `F.linear(x, fc.weight)`, `MultiheadAttention` using its
            `out_proj`'s weight), per phase.
        updates: with `audit(model, optimizer=...)`, what the optimizer's last step in the
            block did with each of its parameters (an `UpdateRecord`), by name.
        placements: for its DTensor parameters (tensor parallel), their placements, by name,
            e.g. "Shard(dim=0)".
        reductions: the reducing collectives it ran on DTensors (a row-parallel Linear's
            all-reduce of its partial sums), per phase and dtype: the dtype the sum ran in.
        arithmetic: for a Linear whose GEMMs ran a wide output or emulated fp32, how (its
            operands, output and backward, as "bf16 operands, fp32 output, backward split2",
            or "bf16x9 (fp32 emulated)"), once per arithmetic it ran with.
    """

    name: str
    type: str
    calls: int = 0
    forward_ops: Counter[torch.dtype] = dataclasses.field(default_factory=Counter)
    backward_ops: Counter[torch.dtype] = dataclasses.field(default_factory=Counter)
    autocast: set[tuple[bool, torch.dtype | None]] = dataclasses.field(default_factory=set)
    inputs: set[torch.dtype] = dataclasses.field(default_factory=set)
    first_inputs: set[torch.dtype] = dataclasses.field(default_factory=set)
    outputs: set[torch.dtype] = dataclasses.field(default_factory=set)
    tensors: dict[str, tuple[Kind, torch.dtype]] = dataclasses.field(default_factory=dict)
    grads: dict[str, torch.dtype] = dataclasses.field(default_factory=dict)
    region: Policy | None = None
    gemms: Counter[str] = dataclasses.field(default_factory=Counter)
    fp8_gemms: Counter[str] = dataclasses.field(default_factory=Counter)
    high_weight_gemms: Counter[str] = dataclasses.field(default_factory=Counter)
    updates: dict[str, UpdateRecord] = dataclasses.field(default_factory=dict)
    placements: dict[str, str] = dataclasses.field(default_factory=dict)
    casts_itself: bool = False
    reductions: Counter[tuple[str, torch.dtype]] = dataclasses.field(default_factory=Counter)
    arithmetic: set[str] = dataclasses.field(default_factory=set)

    def reduced_in(self, phase: str = "forward") -> set[torch.dtype]:
        """The dtypes its reducing collectives ran in, in `phase`."""
        return {d for p, d in self.reductions if p == phase}


@dataclasses.dataclass(frozen=True)
class Divergence:
    """One difference between what ran and what the plan says.

    Attributes:
        module: the module's qualified name.
        field: "compute", "gemm", "arithmetic", "autocast", "storage", "grad", "output", "comm" (a
            tensor-parallel reduction) or "boundary".
        planned: what the plan says.
        actual: what ran.
        phase: "forward", "backward", or "state" (dtypes held, not computed).
    """

    module: str
    field: str
    planned: str
    actual: str
    phase: Phase

    def __str__(self) -> str:
        return (f"{self.module or '(root)'}: {self.field} planned {self.planned}, "
                f"{'held' if self.phase == 'state' else 'ran'} {self.actual}"
                f"{'' if self.phase == 'state' else f' ({self.phase})'}")


def _dtypes(counter: Counter[torch.dtype] | set[torch.dtype]) -> str:
    if isinstance(counter, Counter):
        return " ".join(f"{dtype_name(d)}:{n}" for d, n in sorted(
            counter.items(), key=lambda kv: -kv[1])) or "-"
    return ",".join(sorted(dtype_name(d) for d in counter)) or "-"


def _ops(record: ModuleRecord, phase: str) -> str:
    text = _dtypes(record.forward_ops if phase == "forward" else record.backward_ops)
    fp8 = record.fp8_gemms[phase]
    text = f"{text} fp8-gemm:{fp8}" if fp8 else text
    reduced = record.reduced_in(phase)
    return f"{text} reduce:{_dtypes(reduced)}" if reduced else text


def _autocast_text(states: set[tuple[bool, torch.dtype | None]]) -> str:
    if not states:
        return "-"
    return ",".join(sorted(dtype_name(d) if on else "off" for on, d in states))


def _compute(name: str, policy: Policy, record: ModuleRecord) -> Iterator[Divergence]:
    """Ops of the module's own code narrower than its compute dtype."""
    compute = policy.compute
    if compute is None:
        return
    for phase, ops in (("forward", record.forward_ops), ("backward", record.backward_ops)):
        low = {d for d in ops if d != compute and not wider(d, compute)}
        if low:
            yield Divergence(name, "compute", dtype_name(compute),
                             _dtypes(Counter({d: ops[d] for d in low})), phase)  # type: ignore[arg-type]


def _gemm(name: str, policy: Policy, planned: bool, record: ModuleRecord
          ) -> Iterator[Divergence]:
    """fp8 GEMMs where the plan converts the module, and none where it does not."""
    for phase in ("forward", "backward"):
        ran, fp8 = record.gemms[phase], record.fp8_gemms[phase]
        if planned and record.high_weight_gemms[phase]:
            yield Divergence(name, "gemm", str(policy.fp8),
                             f"{record.high_weight_gemms[phase]} GEMMs by its weight in high "
                             "precision, outside its own fp8 forward", phase)
        elif planned and ran and not fp8:
            yield Divergence(name, "gemm", str(policy.fp8), f"{ran} GEMMs, none in fp8",
                             phase)
        elif not planned and fp8:
            high = dtype_name(policy.compute) if policy.compute else "high precision"
            yield Divergence(name, "gemm", high, f"fp8 ({fp8} of {ran} GEMMs)", phase)


def _arithmetic(name: str, planned: Arithmetic | None, record: ModuleRecord
                ) -> Iterator[Divergence]:
    """A Linear's GEMMs against the plan's arithmetic (a wide output, a split backward,
    emulated fp32): what its forward ran with, where it ran."""
    if not record.calls:
        return
    want = {str(planned)} if planned is not None else set()
    if record.arithmetic != want:
        ran = ", ".join(sorted(record.arithmetic)) or "the compute dtype's own GEMMs"
        yield Divergence(name, "arithmetic", str(planned) if planned else "the compute "
                         "dtype's own GEMMs", ran, "forward")


def _update(entry: ModulePlan, record: ModuleRecord) -> Iterator[Divergence]:
    """The optimizer's step against the plan's update half: the master dtype it updated, and a
    parameter whose gradient was not zero left unchanged (its update rounded away, or the
    optimizer never saw it)."""
    policy = entry.policy
    for pname, done in record.updates.items():
        stored = record.tensors.get(pname, ("param", torch.float32))[1]
        planned = rule_for(fields_of(policy), stored).master
        if planned != done.master:
            yield Divergence(entry.name, "master", dtype_name(planned) if planned else "none",
                             f"{dtype_name(done.master) if done.master else 'none'} for "
                             f"{pname}", "state")
        if not done.changed:
            yield Divergence(entry.name, "update", "changed", f"{pname} unchanged by the step "
                             "(its update rounded away, or the optimizer never saw it)",
                             "state")


def _autocast(name: str, policy: Policy, record: ModuleRecord) -> Iterator[Divergence]:
    """Rule 3: the autocast state the module's own code ran under. A module that casts its
    operands itself (a tensor-parallel Linear computing its partial sums in its comm dtype:
    its class says `_precision_annot_casts_itself`) may turn autocast off, as a Linear whose
    GEMMs run a wide output does (its operands rounded as its arithmetic says, not by
    autocast)."""
    if record.arithmetic:
        return
    mode = autocast_mode(policy)
    if mode == "autocast":
        wrong = {s for s in record.autocast if s != (True, policy.compute)
                 and not (record.casts_itself and not s[0])}
    elif mode == "off":
        wrong = {s for s in record.autocast if s[0]}
    else:
        return
    if wrong:
        planned = dtype_name(policy.compute) if mode == "autocast" else "off"
        yield Divergence(name, "autocast", planned, _autocast_text(wrong), "forward")


def _comm(name: str, policy: Policy, record: ModuleRecord) -> Iterator[Divergence]:
    """A tensor-parallel module's (one holding DTensor parameters) reductions in its planned
    comm dtype (comm=fp8 all-gathers fp8 weights: no reduction dtype), those its style's
    input hook owes included (torch's ColwiseParallel reduces its input's gradient where its
    input became a DTensor: `audit._claim_input_hooks`)."""
    comm = policy.comm
    if comm is None or comm == FP8 or not record.placements:
        return
    phases: tuple[Phase, ...] = ("forward", "backward")
    for phase in phases:
        other = {d for d in record.reduced_in(phase) if d != comm}
        if other:
            yield Divergence(name, "comm", dtype_name(comm), _dtypes(other), phase)


def _output(entry: ModulePlan, record: ModuleRecord, site: Site | None
            ) -> Iterator[Divergence]:
    """Rule 4: a boundary's outputs leave in the dtype its spec says."""
    if not entry.boundary or site is None or site.guard or not record.calls or (
            not record.outputs):
        return
    first = next(iter(record.first_inputs)) if len(record.first_inputs) == 1 else None
    if site.spec.exit_to_input and first is None:
        return
    target = site.spec.target(first)
    if target is not None and record.outputs != {target}:
        yield Divergence(entry.name, "output", dtype_name(target), _dtypes(record.outputs),
                         "forward")


def _region_diverges(record: ModuleRecord) -> Iterator[Divergence]:
    """A function-form region: its ops in its compute dtype, with autocast off."""
    policy = record.region
    assert policy is not None
    yield from _compute(record.name, policy, record)
    yield from _autocast(record.name, Policy(compute=policy.compute, storage=policy.compute),
                         record)


class AuditReport:
    """What ran inside an `audit` block, module by module, against the plan.

    `report.divergences` lists every difference from the plan and is empty when the plan is
    real; `str(report)` is a table with one row per module that ran or holds tensors.
    `report.switches` holds each switch a `precision_annot.schedule` made inside the block
    (its step, phases and what it narrowed): the rows then hold what ran in both phases and are
    compared with the plan the block began in, so audit one phase per block to compare each.
    """

    def __init__(self, plan: PrecisionPlan, execution: Execution,
                 records: dict[str, ModuleRecord], installed: dict[str, bool]) -> None:
        self.plan = plan
        self.execution = execution
        self.records = records
        self._installed = installed
        self.switches: list[Switch] = []

    def __getitem__(self, name: str) -> ModuleRecord:
        return self.records[name]

    @property
    def divergences(self) -> list[Divergence]:
        """Every difference between what ran and the plan, in module order."""
        out: list[Divergence] = []
        for name, record in self.records.items():
            if record.region is not None:
                out.extend(_region_diverges(record))
            elif name in self.plan:
                entry = self.plan[name]
                site = self.execution.sites.get(name)
                out.extend(self._boundary(entry, record, site))
                out.extend(_compute(entry.name, entry.policy, record))
                out.extend(_gemm(entry.name, entry.policy, entry.policy.fp8 is not None,
                                 record))
                out.extend(_arithmetic(entry.name, self.execution.arithmetic.get(name),
                                       record))
                out.extend(_autocast(entry.name, entry.policy, record))
                out.extend(_comm(entry.name, entry.policy, record))
                out.extend(self._storage(entry, record))
                out.extend(_output(entry, record, site))
                out.extend(_update(entry, record))
        return out

    def _boundary(self, entry: ModulePlan, record: ModuleRecord, site: Site | None
                  ) -> Iterator[Divergence]:
        if entry.boundary and record.calls and not self._installed.get(entry.name, False):
            yield Divergence(entry.name, "boundary", "installed", "missing (not applied?)",
                             "state")

    def _storage(self, entry: ModulePlan, record: ModuleRecord) -> Iterator[Divergence]:
        """Rule 1: tensors held, and gradients received, in their planned dtypes (a gradient
        in the plan's `grad` where that is wider than storage)."""
        name = entry.name
        targets = self.execution.targets
        for tname, (kind, dtype) in record.tensors.items():
            target = targets.get((name, kind, tname))
            if target is not None and target.persistent and dtype != target.dtype:
                yield Divergence(name, "storage", f"{tname} {dtype_name(target.dtype)}",
                                 dtype_name(dtype), "state")
        policy = entry.policy
        for tname, dtype in record.grads.items():
            target = targets.get((name, "param", tname))
            expected = target.dtype if target is not None else record.tensors[tname][1]
            # grad=fp32: .grad accumulates in the rule's gradient dtype
            expected = rule_for(fields_of(policy), expected).grad or expected
            if dtype != expected:
                yield Divergence(name, "grad", f"{tname} {dtype_name(expected)}",
                                 dtype_name(dtype), "backward")

    def __str__(self) -> str:
        bad: dict[str, set[str]] = {}
        for d in self.divergences:
            bad.setdefault(d.module, set()).add(d.field)
        header = ("module", "type", "calls", "compute", "forward ops", "backward ops",
                  "autocast", "tensors", "grads", "output", "status")
        rows: list[tuple[str, ...]] = [header]
        for name, r in self.records.items():
            if r.region is not None:  # a function-form region: module::function
                label, calls, compute = (f"{name} (region)", str(r.calls),
                                         r.region.show("compute"))
            elif name in self.plan:
                entry = self.plan[name]
                depth = name.count(".") + (1 if name else 0)
                label = ("  " * depth) + (name.rsplit(".", 1)[-1] if name else "(root)")
                label += " *" if entry.boundary else ""
                calls = "-" if entry.container else str(r.calls)
                compute = entry.policy.show("compute")
                if r.arithmetic:
                    compute += f" ({', '.join(sorted(r.arithmetic))})"
            else:
                continue  # a wrapper around the planned model
            rows.append((
                label, r.type, calls, compute,
                _ops(r, "forward"), _ops(r, "backward"), _autocast_text(r.autocast),
                _dtypes({d for _, d in r.tensors.values()}), _dtypes(set(r.grads.values())),
                _dtypes(r.outputs),
                ("! " + ",".join(sorted(bad[name]))) if name in bad else "ok",
            ))
        lines = format_table(rows, right={2})
        divergences = self.divergences
        lines.append("")
        lines.append("ops: the dtypes floating ops computed in, after autocast, with counts "
                     "(fp8-gemm: GEMMs with fp8 operands); * boundary.")
        for switch in self.switches:
            lines.append(f"The plan switched inside the block, at {switch}: the rows hold both "
                         "phases, compared with the plan the block began in.")
        if divergences:
            lines.append(f"{len(divergences)} divergences from the plan:")
            lines.extend(f"  {d}" for d in divergences)
        else:
            lines.append("No divergence: every module ran as the plan says.")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"AuditReport({len(self.records)} modules, "
                f"{len(self.divergences)} divergences)")


class _Recorder:
    """Records each tracked module's calls, inputs, tensors and outputs, and the function-form
    regions that run inside them (as records of their own, named `module::function`)."""

    def __init__(self, records: dict[str, ModuleRecord]) -> None:
        self.records = records

    def enter(self, name: str, module: nn.Module, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> None:
        record = self.records[name]
        record.calls += 1
        leaves: list[torch.Tensor] = []
        floating_leaves((args, kwargs), leaves)
        record.inputs.update(t.dtype for t in leaves)
        if leaves:
            record.first_inputs.add(leaves[0].dtype)
        record.tensors.update(_own_tensors(module))
        _distributed_facts(module, record)
        arith = arithmetic_of_module(module)
        if arith is not None:
            record.arithmetic.add(str(arith))

    def exit(self, name: str, module: nn.Module, output: Any) -> None:
        leaves: list[torch.Tensor] = []
        floating_leaves(output, leaves)
        self.records[name].outputs.update(t.dtype for t in leaves)

    def region(self, name: str, policy: Policy) -> None:
        record = self.records.get(name)
        if record is None:
            record = self.records[name] = ModuleRecord(name, "function", region=policy)
        record.calls += 1


def _distributed_facts(module: nn.Module, record: ModuleRecord) -> None:
    """Its DTensor parameters' placements, and whether its class casts its own operands."""
    for pname, p in module._parameters.items():
        placements = getattr(p, "placements", None)
        if placements is not None:
            record.placements[pname] = ",".join(str(q) for q in placements)
    record.casts_itself = bool(getattr(type(module), "_precision_annot_casts_itself", False))


def _own_tensors(module: nn.Module) -> Iterator[tuple[str, tuple[Kind, torch.dtype]]]:
    for pname, p in module._parameters.items():
        if p is not None and p.is_floating_point():
            yield pname, ("param", p.dtype)
    for bname, b in dict.items(module._buffers):
        if b is not None and b.is_floating_point():
            yield bname, ("buffer", b.dtype)


def _computes(func: Any, args: Any, kwargs: Any) -> bool:
    """Whether an op computes (its dtype says something about precision) or only moves data.
    `index_put(accumulate=True)` and a `scatter` with a `reduce` sum what they move."""
    packet = func.overloadpacket.__name__
    if packet not in DATA_MOVEMENT:
        return True
    if packet in ("index_put", "index_put_"):
        accumulate = kwargs.get("accumulate") if kwargs else None
        if accumulate is None and len(args) > 3:
            accumulate = args[3]
        return bool(accumulate)
    if packet == "scatter":
        return bool(kwargs and kwargs.get("reduce")) or len(args) > 4
    return False


class _OpDtypes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the dtype each floating op computes in, after autocast, at dispatch."""

    def __init__(self, tracker: ModuleTracker, records: dict[str, ModuleRecord],
                 modules: dict[str, nn.Module], fp8_planned: Iterable[str] = ()) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.tracker = tracker
        self.records = records
        self.modules = modules
        # the weights planned with fp8 GEMMs, and the copies made of them (autocast's, a .to()),
        # by the address of their first element (not their storage's: ZeRO and FSDP1 keep
        # every parameter in one flat buffer): (their module, their storage, held so that no
        # other tensor gets the address while the audit runs)
        self.fp8_weights: dict[int, tuple[str, Any]] = {}
        for name in fp8_planned:
            weight = getattr(modules.get(name), "weight", None)
            if isinstance(weight, torch.Tensor):
                self._track(weight, name)

    def _track(self, tensor: torch.Tensor, owner: str) -> None:
        with contextlib.suppress(RuntimeError, NotImplementedError):
            storage = tensor.untyped_storage()
            if storage.nbytes():
                self.fp8_weights[tensor.data_ptr()] = (owner, storage)

    def _fp8_owner(self, tensors: Iterable[torch.Tensor]) -> str | None:
        """The fp8-planned module whose weight (or a copy of it) is among `tensors`."""
        for t in tensors:
            with contextlib.suppress(RuntimeError, NotImplementedError):
                found = self.fp8_weights.get(t.data_ptr())
                if found is not None:
                    return found[0]
        return None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.namespace == "_c10d_functional":  # a collective (DTensor's): moves, or sums
            self._reduction(func, args)
            return out
        if self.fp8_weights and func.overloadpacket.__name__ in ("_to_copy", "clone"):
            self._follow_copy(args, out)
        if func.is_view or not _computes(func, args, kwargs):
            return out
        gemm = func.overloadpacket.__name__ in _GEMMS
        operands = _operands(args, kwargs) if gemm else []
        fp8 = any(is_fp8_tensor(t) for t in operands)
        inputs: list[torch.Tensor] = []
        floating_leaves((args, kwargs), inputs)
        if not inputs:
            return out
        results: list[torch.Tensor] = []
        floating_leaves(out, results)
        owner: tuple[str, str] | None = self.tracker.owner() if results else None
        if not fp8 and self.fp8_weights:
            self._high_weight_gemm(operands, owner)
        if owner is not None:
            self._book(owner, results, gemm, fp8, operands)
        return out

    def _reduction(self, func: Any, args: Any) -> None:
        """A reducing collective: the dtype its sum ran in, charged to the module running it."""
        if func.overloadpacket.__name__ not in _REDUCING or not args:
            return
        first = args[0][0] if isinstance(args[0], (list, tuple)) and args[0] else args[0]
        owner = self.tracker.owner()
        if owner is not None and isinstance(first, torch.Tensor):
            self.records[owner[0]].reductions[(owner[1], first.dtype)] += 1

    def _follow_copy(self, args: Any, out: Any) -> None:
        """A copy of an fp8-planned weight (autocast's, a .to()) is that weight too."""
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        copied = self._fp8_owner([source]) if source is not None else None
        if copied is not None and isinstance(out, torch.Tensor) and not is_fp8_tensor(out):
            self._track(out, copied)

    def _high_weight_gemm(self, operands: list[torch.Tensor], owner: tuple[str, str] | None
                          ) -> None:
        """An fp8-planned weight multiplied in high precision outside its own layer (its own
        forward running high is counted with its GEMMs)."""
        high = self._fp8_owner(operands)
        if high is None or (owner is not None and owner[0] == high):
            return
        phase = owner[1] if owner is not None else (
            "backward" if torch._C._current_graph_task_id() != -1 else "forward")
        self.records[high].high_weight_gemms[phase] += 1

    def _book(self, owner: tuple[str, str], results: list[torch.Tensor], gemm: bool,
              fp8: bool, operands: list[torch.Tensor]) -> None:
        """One op of `owner`'s own code: the dtypes it computed in, and its GEMM."""
        name, phase = owner
        record = self.records[name]
        counter = record.forward_ops if phase == "forward" else record.backward_ops
        for t in results:
            counter[t.dtype] += 1
        if gemm and (fp8 or self._weighs(name, operands)):
            record.gemms[phase] += 1
            if fp8:
                record.fp8_gemms[phase] += 1

    def _weighs(self, name: str, operands: list[torch.Tensor]) -> bool:
        """Whether a GEMM multiplies by the module's own weight (a Linear's, a Conv1D's), not
        by activations only (attention scores)."""
        module = self.modules.get(name)
        if module is None:
            return False
        own = set()
        for p in module._parameters.values():
            if p is not None and p.is_floating_point() and p.dim() >= 2:
                with contextlib.suppress(RuntimeError, NotImplementedError):
                    own.add(p.untyped_storage().data_ptr())
        for t in operands:
            with contextlib.suppress(RuntimeError, NotImplementedError):
                if t.untyped_storage().data_ptr() in own:
                    return True
        return False


def _operands(args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors an op is given directly (a GEMM's operands)."""
    return [t for t in (*args, *(kwargs or {}).values()) if isinstance(t, torch.Tensor)]


def _collective(func: Any) -> bool:
    """Whether `func` is a collective (DTensor's, in a tensor-parallel hook: an all-gather moves
    data, a reduction's dtype is recorded as a reduction), which autocast never changes."""
    packet = getattr(func, "overloadpacket", func)  # an op's str is "namespace.name[.overload]"
    return str(packet).startswith(("_c10d_functional", "c10d"))


class _AutocastState(TorchFunctionMode):
    """Records the autocast state each module's own code runs under (seen above dispatch,
    where autocast has not yet changed it)."""

    def __init__(self, tracker: ModuleTracker, records: dict[str, ModuleRecord]) -> None:
        super().__init__()
        self.tracker = tracker
        self.records = records

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tracker = self.tracker
        name = getattr(func, "__name__", "")
        if (not tracker.stack or name in _CASTS or name in DATA_MOVEMENT or name in _VIEWS
                or _collective(func)):
            return out
        if not (isinstance(out, torch.Tensor) and out.is_floating_point()):
            return out
        device = device_type_of(None, tuple(args), kwargs)
        enabled = torch.is_autocast_enabled(device)
        state = (enabled, torch.get_autocast_dtype(device) if enabled else None)
        self.records[tracker.stack[-1]].autocast.add(state)
        return out


class audit:
    """Record what runs inside the block, in forward and backward, and compare it with the plan.

    For each module that runs, the report keeps the dtypes its floating ops compute in (seen
    after autocast, at dispatch), the autocast state its code runs under, the dtypes of its
    parameters, buffers, gradients and outputs; `report.divergences` lists every difference
    from the plan and is empty when the plan is real. Function-form regions
    (`precision(...)(fn)`) that run inside a module get a row of their own,
    `module::function`, checked against their own policy. Hooks registered inside the block
    are charged to their module.

    Run the model eagerly and in one thread inside the block (not under `torch.compile`).

    Args:
        model: the model, applied or not; wrappers (`DistributedDataParallel`,
            `torch.compile`'s) are seen through.
        plan: the plan to compare with; the plan `apply` last made real on `model` when None,
            else `resolve(model)`. (Default: None)

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from precision_annot import apply, audit, fp32, precision
        >>> model = apply(nn.Sequential(nn.Linear(4, 4), precision(fp32)(nn.LayerNorm(4))),
        ...               default="bf16")
        >>> with audit(model) as report:
        ...     model(torch.randn(2, 4)).float().sum().backward()
        >>> report.divergences
        []
    """

    def __init__(self, model: nn.Module, plan: PrecisionPlan | None = None, *,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        require_module(model, "audit")
        if plan is not None:
            require_plan(plan, "audit")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("audit: optimizer is the torch.optim.Optimizer you step inside the "
                            f"block. Received: optimizer={optimizer!r}")
        self.optimizer = optimizer
        self.model = unwrap(model)
        self.plan = plan or plan_of(self.model)
        self._handles: list[RemovableHandle] = []
        self._modes: list[Any] = []
        self._tracker: ModuleTracker | None = None
        self.report: AuditReport | None = None

    def __enter__(self) -> AuditReport:
        if self.report is not None:
            raise RuntimeError("This audit has already run; create a new audit(model) to "
                               "record again.")
        names = _plan_names(self.model, self.plan)
        planned = {n: m for m, n in names.items() if n in self.plan or
                   not n.startswith("(wrapper)")}
        check_matches(self.plan, planned)
        execution = compile_plan(self.plan, planned)
        records = {n: ModuleRecord(n, type(m).__name__) for m, n in names.items()}
        installed = {n: bool((b := find_boundary(m)[0]) and b.active) for m, n in names.items()}
        for module, name in names.items():
            records[name].tensors = dict(_own_tensors(module))
            _distributed_facts(module, records[name])
        recorder = _Recorder(records)
        tracker = self._tracker = ModuleTracker(names, recorder.enter, recorder.exit,
                                                recorder.region)
        tracker.__enter__()
        self._claim_input_hooks(tracker, names, records)
        self._record_grads(names, records)
        self._modes = [_AutocastState(tracker, records),
                       _OpDtypes(tracker, records, {n: m for m, n in names.items()},
                                 [n for n, e in self.plan.items() if e.policy.fp8])]
        for mode in self._modes:
            mode.__enter__()
        if self.optimizer is not None:
            self._watch_step(self.optimizer, names, records)
        self.report = AuditReport(self.plan, execution, records, installed)
        self._names = names
        self._switches_before = len(switches_of(self.model))
        return self.report

    def _claim_input_hooks(self, tracker: ModuleTracker, names: dict[nn.Module, str],
                           records: dict[str, ModuleRecord]) -> None:
        """Charge to each tensor-parallel module what its style's input hook makes.

        A tensor-parallel style makes the module's input a DTensor in a forward pre-hook that
        runs before the tracker's: torch's column-parallel style all-reduces the input's
        gradient in the backward of that step, which was charged to the caller. A pre-hook
        run first marks the autograd nodes made from there on as the module's, so the
        reduction is recorded where it is owed, in the dtype it ran in. An FSDP2 unit's own
        pre-forward (its all-gather) stays outside the module's code, as before."""
        held = [(m, n) for m, n in names.items() if records[n].placements]
        if not held:
            return
        from torch.distributed.fsdp import FSDPModule  # DTensors: torch.distributed is here

        for module, name in held:
            if not isinstance(module, FSDPModule):
                self._handles.append(module.register_forward_pre_hook(
                    functools.partial(_claim, tracker, name), prepend=True))

    def _record_grads(self, names: dict[nn.Module, str], records: dict[str, ModuleRecord]
                      ) -> None:
        """A hook on each trainable parameter: the dtype its gradient accumulates in."""
        for module in names:
            for pname, p in module.named_parameters(recurse=False):
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                        _grad_recorder(records[names[module]], pname)))

    def _watch_step(self, optimizer: torch.optim.Optimizer, names: dict[nn.Module, str],
                    records: dict[str, ModuleRecord]) -> None:
        """Record what each step of `optimizer` inside the block does with every parameter."""
        owners = {id(p): (names[m], pname) for m in names
                  for pname, p in m.named_parameters(recurse=False)}
        before: dict[int, torch.Tensor] = {}
        grads: dict[int, torch.dtype] = {}

        def pre(opt: Any, args: Any, kwargs: Any) -> None:
            before.clear()
            for group in opt.param_groups:
                for p in group["params"]:
                    grad = p.grad
                    if grad is not None and bool(grad.ne(0).any()):
                        before[id(p)] = _updated(opt, p).detach().clone()
                        grads[id(p)] = grad.dtype

        def post(opt: Any, args: Any, kwargs: Any) -> None:
            for group in opt.param_groups:
                for p in group["params"]:
                    owner = owners.get(id(p))
                    if owner is None or id(p) not in before:
                        continue
                    master = opt.master(p) if hasattr(opt, "master") else None
                    state = _state_of(opt, p)
                    records[owner[0]].updates[owner[1]] = UpdateRecord(
                        grads[id(p)], None if master is None else master.dtype,
                        {k: (type(v).__name__ if type(v) is not torch.Tensor
                             and type(v) is not nn.Parameter else dtype_name(v.dtype))
                         for k, v in state.items()
                         if isinstance(v, torch.Tensor) and v.numel() > 1},
                        _changed(before[id(p)], _updated(opt, p).detach()))

        self._handles.append(optimizer.register_step_pre_hook(pre))
        self._handles.append(optimizer.register_step_post_hook(post))

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(exc_type, exc, tb)
        if self._tracker is not None:
            self._tracker.__exit__(exc_type, exc, tb)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        assert self.report is not None
        self.report.switches = switches_of(self.model)[self._switches_before:]
        for module, name in self._names.items():  # storage as it is at the end of the block
            self.report.records[name].tensors.update(_own_tensors(module))


def _claim(tracker: ModuleTracker, name: str, module: nn.Module, args: Any) -> None:
    """The autograd nodes made from here until the module's own pre-hook (its input hooks')
    are the module's: a mark in the tracker's record, the module innermost."""
    if threading.get_ident() != tracker.thread:
        return
    tracker.stack.append(name)
    tracker._mark()
    tracker.stack.pop()


def _updated(optimizer: Any, param: torch.Tensor) -> torch.Tensor:
    """What the step updates for `param`: its master copy where there is one (the stored copy
    is rounded from it, and may round to where it was)."""
    master = optimizer.master(param) if hasattr(optimizer, "master") else None
    return master if master is not None else param


def _changed(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Whether the step changed what it updates (a master made by this very step is compared
    with the stored values it was made from)."""
    return not torch.equal(before.to(after.dtype), after)


def _state_of(optimizer: Any, param: torch.Tensor) -> dict[str, Any]:
    """The optimizer's state for `param`, but a master copy."""
    return {k: v for k, v in optimizer.state.get(param, {}).items() if k != "master"}


def _grad_recorder(record: ModuleRecord, name: str) -> Callable[[torch.Tensor], None]:
    def hook(p: torch.Tensor) -> None:
        if p.grad is not None:
            record.grads[name] = p.grad.dtype

    return hook


_WRAPPER_PARTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def _plan_names(model: nn.Module, plan: PrecisionPlan) -> dict[nn.Module, str]:
    """Each module's name as the plan knows it: wrapper levels (FSDP1, activation
    checkpointing, torch.compile) left out. A wrapper whose name its inner module takes is
    "(wrapper) name"."""
    out: dict[nn.Module, str] = {}
    taken: dict[str, nn.Module] = {}
    for raw, module in model.named_modules():
        clean = ".".join(p for p in raw.split(".") if p not in _WRAPPER_PARTS)
        if clean in taken:
            out[taken[clean]] = f"(wrapper) {clean}"
        taken[clean] = module
        out[module] = clean
    return out
