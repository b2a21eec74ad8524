"""`watch`: per-module numerics while a plan trains, against each module's own dtype limits.

On every `every`-th step, each module's output and the gradient of that output are measured:
their largest magnitude, how many values are past the point where one more doubling overflows
(half the dtype's largest value) or below its smallest normal, and whether any is not finite,
always against the dtype the tensor is held in (an fp16 module's output against fp16's 65504,
an fp32 island's against fp32's). Steps in between install nothing, so they cost nothing. A
module at its limit is said once, with the fix its measurements support. Under DDP or FSDP
the statistics are reduced across ranks (the largest magnitude, summed counts).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch import nn

from precision_annot._src.casting import first_floating
from precision_annot._src.dtypes import dtype_name, wider
from precision_annot._src.float8 import import_torchao
from precision_annot._src.guards import require_module
from precision_annot._src.plan import PrecisionPlan
from precision_annot._src.runtime import plan_of
from precision_annot._src.tables import format_table
from precision_annot._src.wrappers import unwrap

__all__ = ["Fp8Stats", "ModuleStats", "WatchRecord", "watch"]

#: a value this share of the dtype's largest value overflows with one more doubling
NEAR = 0.5
#: the statistics kept per tensor, in this order: largest magnitude, past NEAR, below the
#: smallest normal (not zero), not finite, elements, and for an output whether the module's
#: (first floating) input held values that were not finite
_FIELDS = ("amax", "over", "under", "nonfinite", "numel", "in_nonfinite")
#: the floating dtypes a reduced record can carry, by code
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn,
           torch.float8_e5m2)


@dataclasses.dataclass(frozen=True)
class ModuleStats:
    """One module's output (or the gradient of its output) on one sampled step.

    Attributes:
        dtype: the dtype the tensor is held in: the limits it is measured against.
        amax: its largest magnitude among the finite values.
        over: the share of its values past half the dtype's largest value (inf included).
        under: the share below the dtype's smallest normal (zeros excluded).
        nonfinite: how many of its values are inf or nan.
        in_nonfinite: for an output, 1 when the module's input already held inf or nan (the
            module did not make those), else 0 (reduced across ranks: how many ranks' did).
    """

    dtype: torch.dtype
    amax: float
    over: float
    under: float
    nonfinite: int
    in_nonfinite: int = 0

    @property
    def margin(self) -> float:
        """`amax` as a share of the dtype's largest value (1.0: at the limit)."""
        return self.amax / torch.finfo(self.dtype).max if self.dtype.is_floating_point else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": dtype_name(self.dtype), "amax": self.amax, "over": self.over,
                "under": self.under, "nonfinite": self.nonfinite,
                "in_nonfinite": self.in_nonfinite, "margin": self.margin}


@dataclasses.dataclass(frozen=True)
class Fp8Stats:
    """One GEMM operand of an fp8 Linear (torchao's Float8Linear) on one sampled step: how
    torchao scales it into fp8, recomputed with torchao's own scale function and the layer's
    config (torchao keeps no scale between calls).

    Attributes:
        operand: "input" or "weight".
        dtype: the fp8 dtype it is cast to.
        amax: its largest magnitude before the cast.
        scale: torchao's scale (fp8's largest value over amax); the smallest one with
            rowwise scales.
        underflow: the share of its nonzero values that fall below the fp8 dtype's smallest
            normal once scaled (lost to subnormals or zero).
    """

    operand: str
    dtype: torch.dtype
    amax: float
    scale: float
    underflow: float

    def to_dict(self) -> dict[str, Any]:
        return {"operand": self.operand, "dtype": str(self.dtype).removeprefix("torch."),
                "amax": self.amax, "scale": self.scale, "underflow": self.underflow}


@dataclasses.dataclass(frozen=True)
class WatchRecord:
    """One sampled step.

    Attributes:
        step: the step's index (the `watch.step()` calls before it).
        outputs: each module's output, by name.
        grads: the gradient of each module's output, by name.
        first_nonfinite: the first module, in execution order, whose output held a value
            that is not finite (None: none did).
        first_nonfinite_grad: the first, in the backward's order, whose output's gradient did.
        scale: the GradScaler's scale, when one is watched.
        skipped: the steps the GradScaler skipped so far, when one is watched.
        rank: this process's rank, or "all" for the statistics reduced across ranks.
        fp8: for each fp8 Linear, its input's and weight's `Fp8Stats` (this rank's; not
            reduced).
    """

    step: int
    outputs: dict[str, ModuleStats]
    grads: dict[str, ModuleStats]
    first_nonfinite: str | None
    first_nonfinite_grad: str | None
    scale: float | None = None
    skipped: int | None = None
    rank: int | str = 0
    fp8: dict[str, tuple[Fp8Stats, ...]] = dataclasses.field(default_factory=dict)

    def closest(self, n: int = 5) -> list[tuple[str, str, ModuleStats]]:
        """The `n` (module, "output" or "grad", stats) closest to their dtype's largest value."""
        rows = [(m, "output", s) for m, s in self.outputs.items()]
        rows += [(m, "grad", s) for m, s in self.grads.items()]
        return sorted(rows, key=lambda r: (-r[2].nonfinite, -r[2].margin))[:n]

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "rank": self.rank, "scale": self.scale,
                "skipped": self.skipped, "first_nonfinite": self.first_nonfinite,
                "first_nonfinite_grad": self.first_nonfinite_grad,
                "outputs": {m: s.to_dict() for m, s in self.outputs.items()},
                "grads": {m: s.to_dict() for m, s in self.grads.items()},
                "fp8": {m: [s.to_dict() for s in ops] for m, ops in self.fp8.items()}}

    def metrics(self, prefix: str = "precision") -> dict[str, float]:
        """Flat numbers for a logger: per module its output's and gradient's largest magnitude
        and margin, and the closest module's margin."""
        out: dict[str, float] = {}
        for kind, table in (("out", self.outputs), ("grad", self.grads)):
            for module, s in table.items():
                key = f"{prefix}/{module or 'root'}/{kind}"
                out[f"{key}_amax"] = s.amax
                out[f"{key}_margin"] = s.margin
                out[f"{key}_nonfinite"] = float(s.nonfinite)
        for module, ops in self.fp8.items():
            for op in ops:
                key = f"{prefix}/{module or 'root'}/fp8_{op.operand}"
                out[f"{key}_amax"] = op.amax
                out[f"{key}_scale"] = op.scale
                out[f"{key}_underflow"] = op.underflow
        closest = self.closest(1)
        if closest:
            out[f"{prefix}/closest_margin"] = closest[0][2].margin
        if self.scale is not None:
            out[f"{prefix}/scale"] = self.scale
        if self.skipped is not None:
            out[f"{prefix}/skipped"] = float(self.skipped)
        return out

    def __str__(self) -> str:
        rows: list[tuple[str, ...]] = [("module", "of", "dtype", "amax", "margin", "over",
                                        "under", "non-finite")]
        for module, kind, s in self.closest(10):
            rows.append((module or "(root)", kind, dtype_name(s.dtype), f"{s.amax:.3g}",
                         f"{s.margin:.2%}", f"{s.over:.2%}", f"{s.under:.2%}",
                         str(s.nonfinite)))
        head = f"step {self.step} (rank {self.rank})"
        if self.scale is not None:
            head += f", loss scale {self.scale:g}, {self.skipped} steps skipped"
        return "\n".join([head, *format_table(rows, right={3, 4, 5, 6, 7})])


class _Step:
    """The hooks of one sampled step, and what they measure (tensors: no sync until read)."""

    def __init__(self, named: dict[str, nn.Module]) -> None:
        self.order: list[str] = []
        self.outputs: dict[str, tuple[torch.dtype, torch.Tensor]] = {}
        self.grads: dict[str, tuple[torch.dtype, torch.Tensor]] = {}
        self.grad_order: list[str] = []
        # a container that hands on its last child's output (Sequential, a wrapper) is not
        # measured again: the same tensor object, unchanged, has the child's statistics and
        # gradient (a weak reference: a freed tensor's address can be reused)
        self.seen: dict[int, tuple[weakref.ref[torch.Tensor], str, int]] = {}
        self.aliases: dict[str, str] = {}
        self.fp8: dict[str, list[tuple[str, torch.dtype, torch.Tensor]]] = {}
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in named.items()]

    def _hook(self, name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: Any, output: Any) -> None:
            if name in self.outputs or torch.compiler.is_compiling():
                return
            first = first_floating(output)
            if first is None:
                return
            self.order.append(name)
            seen = self.seen.get(id(first))
            if seen is not None and seen[0]() is first and seen[2] == first._version:
                self.outputs[name] = self.outputs[seen[1]]
                self.aliases[name] = seen[1]
                return
            self.seen[id(first)] = (weakref.ref(first), name, first._version)
            given = first_floating(args)
            given = None if given is None else given.detach()
            if given is not None and _is_fp8_linear(module):
                self.fp8[name] = _fp8_operands(module, given)
            self.outputs[name] = (first.dtype, _measure(first.detach(), given))
            if first.requires_grad:
                def grad(g: torch.Tensor) -> None:
                    if name not in self.grads:
                        self.grad_order.append(name)
                        self.grads[name] = (g.dtype, _measure(g.detach()))

                first.register_hook(grad)  # type: ignore[no-untyped-call]

        return record

    def finish(self) -> None:
        """Give each container that handed on a child's tensor the child's gradient too, just
        after the child in the backward's order (the child is the one that made it)."""
        for name, child in self.aliases.items():
            if child in self.grads and name not in self.grads:
                self.grads[name] = self.grads[child]
                self.grad_order.insert(self.grad_order.index(child) + 1, name)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _is_fp8_linear(module: nn.Module) -> bool:
    """A torchao Float8Linear (looked up only once torchao is loaded: no import here)."""
    linear = sys.modules.get("torchao.float8.float8_linear")
    return linear is not None and isinstance(module, linear.Float8Linear)


def _fp8_operands(module: nn.Module, given: torch.Tensor
                  ) -> list[tuple[str, torch.dtype, torch.Tensor]]:
    """The input's and weight's amax, torchao's scale and the share that underflows once
    scaled, each as a float64 tensor (no sync), computed as torchao's cast computes them."""
    disabled = import_torchao("torchao.float8.config", "watch").ScalingType.DISABLED
    axis = import_torchao("torchao.float8.float8_scaling_utils", "watch").get_maybe_axiswise_dim
    to_scale = import_torchao("torchao.float8.float8_utils", "watch").tensor_to_scale
    config: Any = getattr(module, "config")  # noqa: B009  # torchao's Float8LinearConfig
    weight: Any = module.weight
    out = []
    for operand, t, cast in (("input", given, config.cast_config_input),
                             ("weight", weight.detach(), config.cast_config_weight)):
        if cast.scaling_type is disabled or type(t) is not torch.Tensor:
            continue  # not cast, or a DTensor shard or fp8 tensor already: no whole operand
        granularity = cast.scaling_granularity
        scale = to_scale(t, cast.target_dtype, scaling_granularity=granularity,
                         axiswise_dim=axis(-1, granularity),
                         round_scales_to_power_of_2=config.round_scales_to_power_of_2)
        scaled = t.float().abs() * scale
        lost = ((scaled < torch.finfo(cast.target_dtype).tiny) & (t != 0)).sum()
        nonzero = torch.count_nonzero(t).clamp_min(1)
        out.append((operand, cast.target_dtype, torch.stack([
            t.abs().amax().double(), scale.amin().double(), (lost / nonzero).double()])))
    return out


def _measure(t: torch.Tensor, given: torch.Tensor | None = None) -> torch.Tensor:
    """The statistics of `_FIELDS` for one tensor (and whether the input `given` to the module
    that made it held values that are not finite), as one float64 tensor: a handful of kernels,
    no sync."""
    finfo = torch.finfo(t.dtype)
    a = t.abs()
    numel = t.numel()
    # |a / tiny - 1/2| < 1/2 exactly when 0 < a < tiny (scaling by a power of two is exact,
    # and the operands stay normal, which CPUs are fast on): one comparison, not three
    counts = torch.stack([
        a > finfo.max * NEAR,  # inf included
        (a * (1 / finfo.tiny) - 0.5).abs_() < 0.5,
        ~(a <= finfo.max),  # inf and nan: not <= the largest value
    ]).reshape(3, -1).sum(1).double()
    amax = (torch.nan_to_num(a, nan=0.0, posinf=0.0).amax() if numel
            else a.new_zeros(())).double().reshape(1)
    size = torch.full((1,), float(numel), dtype=torch.float64, device=t.device)
    came = (torch.zeros(1, dtype=torch.float64, device=t.device) if given is None
            else torch.isnan((given * 0).sum()).double().reshape(1))  # inf * 0 is nan too
    return torch.cat([amax, counts, size, came])


def _all_stats(table: dict[str, tuple[torch.dtype, torch.Tensor]], order: list[str]
               ) -> dict[str, ModuleStats]:
    """The statistics of a step's tensors in `order`, read in one transfer (one sync)."""
    if not order:
        return {}
    values = torch.stack([table[n][1] for n in order]).cpu()
    return {n: _stats(table[n][0], values[i]) for i, n in enumerate(order)}


def _stats(dtype: torch.dtype, values: torch.Tensor) -> ModuleStats:
    amax, over, under, nonfinite, numel, given = values.tolist()
    n = max(numel, 1.0)
    return ModuleStats(dtype, amax, over / n, under / n, int(nonfinite), int(given))


class watch:
    """Record per-module numerics on every `every`-th training step, against each tensor's
    own dtype limits.

    Call `step()` once per training step, after the backward (and the optimizer step). The
    forward and backward of step 0, `every`, `2 * every`, ... are measured; the steps in
    between run with nothing installed. Use it as a context manager, or `close()` it.

    Args:
        model: the model being trained (seen through wrappers); its plan names the modules.
        every: measure one step in this many. (Default: 100)
        scaler: a GradScaler whose scale and skipped steps to record. (Default: None)
        path: a JSON-lines file each sampled step is appended to (`precision-annot
            watch-report` reads it). (Default: None)
        reduce: under torch.distributed, also reduce each sampled step across ranks (the
            largest magnitude, summed counts) into a record of rank "all". (Default: True)
        warn: say once per module, with the fix, when its output or gradient reaches half
            its dtype's largest value or is not finite. (Default: True)

    Attributes:
        history: every `WatchRecord` so far (this rank's, and the reduced ones).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from precision_annot import apply, watch
        >>> model = apply(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), default="bf16")
        >>> with watch(model, every=2) as w:
        ...     for _ in range(4):
        ...         model(torch.randn(8, 4, dtype=torch.bfloat16)).float().sum().backward()
        ...         record = w.step()  # the step's WatchRecord when it was sampled
        >>> len(w.history), w.history[1].step  # steps 0 and 2 were measured
        (2, 2)
    """

    def __init__(self, model: nn.Module, every: int = 100, *, scaler: Any = None,
                 path: str | Path | None = None, reduce: bool = True, warn: bool = True
                 ) -> None:
        require_module(model, "watch")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"watch: every is a number of steps, 1 or more. Received: "
                             f"every={every!r}")
        self.model = unwrap(model)
        self.plan: PrecisionPlan = plan_of(self.model, where="watch")
        self.named = dict(self.model.named_modules())
        self.every = every
        self.scaler = scaler
        self.reduce = reduce
        self.warn = warn
        self.history: list[WatchRecord] = []
        self.index = 0
        self.skipped = 0
        self._scale: float | None = None if scaler is None else float(scaler.get_scale())
        self._said: set[tuple[str, str]] = set()
        self._file: TextIO | None = None
        if path is not None:
            self._file = Path(path).open("a")  # noqa: SIM115  # closed by close()
        self._current: _Step | None = _Step(self.named)

    def __enter__(self) -> watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove the hooks and close the file."""
        if self._current is not None:
            self._current.close()
            self._current = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def step(self) -> WatchRecord | None:
        """End one training step: the record of this step when it was sampled, else None.
        Installs the hooks before the next sampled step."""
        current = self._current
        self._count_skips()
        record = None
        if current is not None:
            current.close()
            self._current = None
            record = self._record(current)
        self.index += 1
        if self.index % self.every == 0:
            self._current = _Step(self.named)
        return record

    def _count_skips(self) -> None:
        """A GradScaler lowers its scale exactly when it skips a step."""
        if self.scaler is None:
            return
        scale = float(self.scaler.get_scale())
        if self._scale is not None and scale < self._scale:
            self.skipped += 1
        self._scale = scale

    def _record(self, current: _Step) -> WatchRecord:
        current.finish()
        outputs = _all_stats(current.outputs, current.order)
        grads = _all_stats(current.grads, current.grad_order)
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        first = next((n for n in current.order if outputs[n].nonfinite), None)
        first_grad = next((n for n in current.grad_order if grads[n].nonfinite), None)
        fp8 = {name: tuple(Fp8Stats(op, dtype, *values.tolist())
                           for op, dtype, values in ops)
               for name, ops in current.fp8.items()}
        record = WatchRecord(self.index, outputs, grads, first, first_grad, self._scale,
                             None if self.scaler is None else self.skipped, rank, fp8)
        self._keep(record)
        if self.reduce and dist.is_available() and dist.is_initialized():
            self._keep(self._reduced(current, record))
        return record

    def _keep(self, record: WatchRecord) -> None:
        self.history.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record.to_dict()) + "\n")
            self._file.flush()
        if self.warn and self._speaks(record):
            self._say(record)

    def _speaks(self, record: WatchRecord) -> bool:
        """Under torch.distributed with `reduce`, rank 0 speaks for every rank, from the
        reduced record; without `reduce`, each rank for itself."""
        if not (dist.is_available() and dist.is_initialized()):
            return True
        if self.reduce:
            return record.rank == "all" and dist.get_rank() == 0
        return record.rank != "all"

    def _reduced(self, current: _Step, mine: WatchRecord) -> WatchRecord:
        """This step over every rank: the largest magnitude, summed counts. Every module of the
        model has a row on every rank, so that the collectives line up even where a rank ran a
        module the others skipped (an expert no token was routed to); the dtype travels as a
        code, and a module no rank ran is left out."""
        codes = list(_DTYPES)

        def reduce(table: dict[str, tuple[torch.dtype, torch.Tensor]], order: list[str]
                   ) -> dict[str, ModuleStats]:
            rows = torch.zeros(len(self.named), len(_FIELDS) + 2, dtype=torch.float64)
            index = {n: i for i, n in enumerate(self.named)}
            for name, (dtype, values) in table.items():
                rows[index[name], : len(_FIELDS)] = values.cpu()
                rows[index[name], -2] = 1.0  # ran here
                rows[index[name], -1] = float(codes.index(dtype) if dtype in codes else 0)
            amax = rows[:, :1].clone()
            if dist.get_backend() == "nccl":  # its collectives take CUDA tensors only
                device = torch.device("cuda", torch.cuda.current_device())
                amax, rows = amax.to(device), rows.to(device)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX)
            counts = rows[:, 1:-1].clone()
            dist.all_reduce(counts, op=dist.ReduceOp.SUM)
            code = rows[:, -1:].clone()
            dist.all_reduce(code, op=dist.ReduceOp.MAX)
            merged = torch.cat([amax, counts[:, :-1]], dim=1).cpu()
            ran, code = counts[:, -1].cpu(), code[:, 0].cpu()
            ordered = [*order, *(n for n in self.named if n not in table)]
            return {n: _stats(codes[int(code[index[n]])], merged[index[n]])
                    for n in ordered if ran[index[n]] > 0}

        outputs = reduce(current.outputs, current.order)
        grads = reduce(current.grads, current.grad_order)
        first = next((n for n in outputs if outputs[n].nonfinite), None)
        first_grad = next((n for n in grads if grads[n].nonfinite), None)
        return WatchRecord(mine.step, outputs, grads, first, first_grad, mine.scale,
                           mine.skipped, "all")

    def _say(self, record: WatchRecord) -> None:
        """The first module at its limit in the forward's order, and the first in the
        backward's: the ones after it inherit its values, so they are not named too. A
        backward that follows a forward with values not finite inherits them, so it is not
        named then; nor are gradients under a watched GradScaler, which keeps them as close to
        the limit as it can and skips the steps that pass it (`skipped` counts them)."""
        for kind, table in (("output", record.outputs), ("grad", record.grads)):
            if kind == "grad" and record.first_nonfinite is not None:
                continue
            module, s = next(((m, s) for m, s in table.items()
                              if s.margin >= NEAR or s.nonfinite), (None, None))
            if module is None or s is None or (module, kind) in self._said:
                continue
            if kind == "grad" and self.scaler is not None:
                continue
            self._said.add((module, kind))
            first_back = kind == "grad" and module == next(iter(table))
            warnings.warn(self.message(module, kind, s, record.step, from_loss=first_back),
                          UserWarning, stacklevel=3)

    def message(self, module: str, kind: str, s: ModuleStats, step: int, *,
                from_loss: bool = False) -> str:
        """What `watch` says of the first module at its dtype's limit, and the fix its measurements
        support: an island that computes wider and hands back narrower needs `output=fp32`;
        a module that computes in the narrow dtype itself needs to compute wider."""
        where = module or "(root)"
        key = repr(module)  # the root is '' in a rule
        what = (f"{s.nonfinite} non-finite values" if s.nonfinite else
                f"{s.amax:.3g}, {s.margin:.0%} of {dtype_name(s.dtype)}'s largest value")
        if kind == "output" and s.in_nonfinite:
            return (f"watch: step {step}: module {where!r}, the first to hold non-finite "
                    f"values ({s.nonfinite}), was handed them: they come from its "
                    "input (the batch, or code that runs between modules), not from a "
                    "module's precision.")
        if from_loss:
            return (f"watch: step {step}: the gradient the loss hands module {where!r}, the "
                    f"first of the backward, reached {what}: no module made it; scale the loss "
                    "down, or train with precision_annot.GradScaler, which skips such steps "
                    "and lowers its scale.")
        entry = self.plan.get(module)
        compute = entry.policy.compute if entry is not None else None
        if kind == "output" and compute is not None and wider(compute, s.dtype):
            fix = (f"it computes in {dtype_name(compute)} and hands its output back in "
                   f"{dtype_name(s.dtype)}: annotate(model, {{{key}: 'output=fp32'}}) "
                   "hands it back in fp32")
        else:
            fix = (f"keep it in fp32: annotate(model, {{{key}: 'fp32,output=fp32'}}), or "
                   f"suggest(model, batch, low='{dtype_name(s.dtype)}') to find the smallest "
                   "islands")
        return (f"watch: step {step}: the {kind} of module {where!r} reached {what}; "
                f"{fix}.")

    def records(self, rank: int | str | None = None) -> Iterator[WatchRecord]:
        """The records kept, of one rank (or "all") when given."""
        return (r for r in self.history if rank is None or r.rank == rank)


def _read(path: str | Path) -> Iterator[dict[str, Any]]:
    """The records of a JSON-lines file `watch` wrote, rank 0's and the reduced ones."""
    for line in Path(path).read_text().splitlines():
        record = json.loads(line) if line.strip() else None
        if record is not None and record.get("rank") in (0, "all"):
            yield record


def _tensors(record: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(module, "output" or "grad", its statistics) for each tensor of one record."""
    for kind, label in (("outputs", "output"), ("grads", "grad")):
        for module, stats in record[kind].items():
            yield module, label, stats


def _worst_fp8(fp8: dict[tuple[str, str], tuple[float, int, float]], record: dict[str, Any]
               ) -> None:
    """Keep each fp8 operand's worst underflow (and its step) and its smallest scale."""
    for module, ops in record.get("fp8", {}).items():
        for op in ops:
            key = (module, op["operand"])
            under, step, scale = fp8.get(key, (-1.0, record["step"], op["scale"]))
            if op["underflow"] > under:
                under, step = op["underflow"], record["step"]
            fp8[key] = (under, step, min(scale, op["scale"]))


def _fp8_table(fp8: dict[tuple[str, str], tuple[float, int, float]], top: int) -> list[str]:
    if not fp8:
        return []
    table: list[tuple[str, ...]] = [("fp8 module", "operand", "worst underflow", "at step",
                                     "smallest scale")]
    for (module, operand), (under, step, scale) in sorted(
            fp8.items(), key=lambda kv: -kv[1][0])[:top]:
        table.append((module or "(root)", operand, f"{under:.2%}", str(step), f"{scale:.3g}"))
    return ["", "fp8 GEMM operands, the share of nonzero values below fp8's smallest normal "
                "once scaled:", *format_table(table, right={2, 3, 4})]


def report(path: str | Path, top: int = 10) -> str:
    """The modules closest to their dtype's limits over a JSON-lines file `watch` wrote: each
    tensor's worst step (values not finite first, then the largest margin)."""
    worst: dict[tuple[str, str], tuple[tuple[bool, float], int, dict[str, Any]]] = {}
    fp8: dict[tuple[str, str], tuple[float, int, float]] = {}
    steps = 0
    for record in _read(path):
        steps += 1
        _worst_fp8(fp8, record)
        for module, kind, stats in _tensors(record):
            score = (stats["nonfinite"] > 0, stats["margin"])
            if (module, kind) not in worst or score > worst[(module, kind)][0]:
                worst[(module, kind)] = (score, record["step"], stats)
    rows: list[tuple[str, ...]] = [("module", "of", "dtype", "worst margin", "at step",
                                    "non-finite")]
    for (module, kind), (_, step, stats) in sorted(worst.items(),
                                                   key=lambda kv: kv[1][0], reverse=True)[:top]:
        rows.append((module or "(root)", kind, stats["dtype"], f"{stats['margin']:.2%}",
                     str(step), str(stats["nonfinite"])))
    return "\n".join([f"{steps} sampled steps in {path}; the closest to their limits:",
                      *format_table(rows, right={3, 4, 5}), *_fp8_table(fp8, top)])


def _series(path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Each tensor's margin over the steps (inf where values were not finite), by label."""
    series: dict[str, list[tuple[int, float]]] = {}
    for record in _read(path):
        for module, kind, stats in _tensors(record):
            label = f"{module or '(root)'} {'out' if kind == 'output' else 'grad'} " \
                    f"({stats['dtype']})"
            margin = math.inf if stats["nonfinite"] else stats["margin"]
            series.setdefault(label, []).append((record["step"], margin))
    return series


def plot(path: str | Path, out: str | Path, top: int = 8) -> None:
    """Each watched tensor's largest magnitude over the steps, as a share of its dtype's
    largest value (log scale), for the `top` modules closest to it; overflow (1.0) and one
    doubling from it (0.5) are marked. Needs matplotlib (the `plot` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("watch-report --plot draws with matplotlib: pip install "
                          "'precision-annot[plot]'.") from e
    series = _series(path)
    ranked = sorted(series, key=lambda k: -max(m for _, m in series[k]))[:top]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label in ranked:
        steps = [s for s, _ in series[label]]
        values = [min(m, 2.0) if m > 0 else 1e-12 for _, m in series[label]]
        ax.plot(steps, values, label=label)
        over = [(s, 2.0) for s, m in series[label] if m >= 1.0]
        if over:
            ax.scatter(*zip(*over, strict=True), marker="x", color="red", zorder=3)
    ax.axhline(1.0, color="red", linestyle="--", linewidth=1, label="overflow")
    ax.axhline(NEAR, color="orange", linestyle=":", linewidth=1, label="one doubling away")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("largest magnitude / dtype's largest value")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
