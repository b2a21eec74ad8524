"""`watch`: per-module numerics while a plan trains, against each module's own dtype limits.

On every `every`-th training step, each module's outputs and the gradients of those outputs are
measured (every call of the module, every floating tensor it returns; a forward run without
gradients between steps, an evaluation, is not a training step and is not recorded):
their largest magnitude, how many values are past the point where one more doubling overflows
(half the dtype's largest value) or below its smallest normal, and whether any is not finite,
always against the dtype the tensor is held in (an fp16 module's output against fp16's 65504,
an fp32 island's against fp32's). Steps in between install nothing, so they cost nothing. A
module at its limit is said once, with the fix its measurements support. Under DDP or FSDP
the statistics are reduced across ranks (the largest magnitude, summed counts). A DTensor
(tensor parallel) is measured on this rank's local shard, and the record reduced across ranks
holds the whole tensor's statistics.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple, TextIO

import torch
import torch.distributed as dist
from torch import nn

from precision_annot._src.casting import first_floating
from precision_annot._src.dtypes import dtype_name, wider
from precision_annot._src.float8 import import_torchao
from precision_annot._src.guards import require_module
from precision_annot._src.plan import PrecisionPlan
from precision_annot._src.recording import Inputs, Recorder, Returned, dtensors
from precision_annot._src.runtime import plan_of
from precision_annot._src.schedule import Switch, switches_of
from precision_annot._src.tables import format_table
from precision_annot._src.wrappers import compiled, unwrap

__all__ = ["Fp8Stats", "ModuleStats", "WatchRecord", "watch"]

#: a value this share of the dtype's largest value overflows with one more doubling
NEAR = 0.5
#: the statistics kept per tensor, in this order: largest magnitude, past NEAR, below the
#: smallest normal (not zero), not finite, elements, and for an output whether the module's
#: (first floating, positional or keyword) input held values that were not finite and whether
#: its parameters did; a module's row merges its tensors (every call, every floating tensor
#: returned) and counts them last
_FIELDS = ("amax", "over", "under", "nonfinite", "numel", "in_nonfinite", "weights_nonfinite",
           "tensors")
#: the floating dtypes a reduced record can carry, by code
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn,
           torch.float8_e5m2)


@dataclasses.dataclass(frozen=True)
class ModuleStats:
    """One module's outputs (or the gradients of its outputs) on one sampled step: every
    floating tensor every call of it returned, merged.

    Attributes:
        dtype: the dtype the tensor closest to its limit is held in: the limits `amax` is
            measured against.
        amax: that tensor's largest magnitude among the finite values.
        over: the share of the values past half their dtype's largest value (inf included).
        under: the share below their dtype's smallest normal (zeros excluded).
        nonfinite: how many of the values are inf or nan.
        in_nonfinite: for outputs, 1 when the input of the first call that returned values
            not finite already held inf or nan (the module did not make those), else 0
            (reduced across ranks: how many ranks' did). The input is the call's first
            floating tensor, positional arguments first, then keyword ones.
        tensors: how many tensors the row merges (1: one call returning one floating tensor).
        weights_nonfinite: for outputs, 1 when the module's parameters (its submodules'
            included) already held inf or nan when that call ran, as an optimizer step on
            gradients that were not finite leaves them, else 0 (reduced across ranks: how many
            ranks' did).
        sharded: whether a tensor of the row was a DTensor sharded across ranks (tensor
            parallel), measured on this rank's local shard only; the record reduced across
            ranks (rank "all") holds the whole tensor's statistics, and says False.
    """

    dtype: torch.dtype
    amax: float
    over: float
    under: float
    nonfinite: int
    in_nonfinite: int = 0
    tensors: int = 1
    weights_nonfinite: int = 0
    sharded: bool = False

    @property
    def margin(self) -> float:
        """`amax` as a share of the dtype's largest value (1.0: at the limit)."""
        return self.amax / torch.finfo(self.dtype).max if self.dtype.is_floating_point else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": dtype_name(self.dtype), "amax": self.amax, "over": self.over,
                "under": self.under, "nonfinite": self.nonfinite,
                "in_nonfinite": self.in_nonfinite, "tensors": self.tensors,
                "weights_nonfinite": self.weights_nonfinite, "sharded": self.sharded,
                "margin": self.margin}


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
        step: the step's index (`start` plus the `watch.step()` calls before it).
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


class _Measured(NamedTuple):
    """One tensor's statistics (`_FIELDS` but the last, a float64 tensor: no sync until read),
    the dtype it is held in, and for a DTensor how many ranks hold the same local values
    (`copies`: its replicas) and whether other ranks hold other parts of it (`sharded`)."""

    dtype: torch.dtype
    values: torch.Tensor
    copies: int = 1
    sharded: bool = False


class _Step:
    """The recorder of one sampled step, and what it measures (tensors: no sync until read).

    Every call of a module and every floating tensor it returns is measured on its own; a
    module's row merges them (`_Row`). A tensor a container hands on unchanged from its child
    is the child's: measured once, and its gradient too."""

    def __init__(self, named: dict[str, nn.Module]) -> None:
        #: (module, statistics) per tensor, in the forward's order, and per gradient in the
        #: backward's
        self.outputs: list[tuple[str, _Measured]] = []
        self.grads: list[tuple[str, _Measured]] = []
        self._measured: dict[Returned, _Measured] = {}
        self._grads: dict[Returned, _Measured] = {}
        #: whether a module's parameters held values not finite, by module, and by parameter
        #: (each read once a step)
        self._weights: dict[int, torch.Tensor | None] = {}
        self._params: dict[int, torch.Tensor | None] = {}
        self.fp8: dict[str, list[tuple[str, torch.dtype, torch.Tensor]]] = {}
        self.recorder = Recorder(named, self._output, self._grad, training_only=True)

    def _output(self, r: Returned, t: torch.Tensor, module: nn.Module, inputs: Inputs) -> None:
        if r.same is not None:
            entry = self._measured[r.same]
        else:
            given = first_floating(inputs)
            given = None if given is None else given.detach()
            if given is not None and r.call == 0 and r.name not in self.fp8 and (
                    _is_fp8_linear(module)):
                self.fp8[r.name] = _fp8_operands(module, given)
            entry = self._measured[r] = _measured(t.detach(), given, self._weights_of(module))
        self.outputs.append((r.name, entry))

    def _grad(self, r: Returned, g: torch.Tensor) -> None:
        entry = self._grads.get(r.same) if r.same is not None else None
        if entry is None:
            entry = self._grads[r] = _measured(g.detach())
        self.grads.append((r.name, entry))

    def _weights_of(self, module: nn.Module) -> torch.Tensor | None:
        """Whether `module`'s parameters (its submodules' included) hold a value that is not
        finite, as a bool tensor (None: it has no floating parameter)."""
        key = id(module)
        if key not in self._weights:
            flags = [f for f in map(self._param, module.parameters()) if f is not None]
            self._weights[key] = (torch.stack([f.to(flags[0].device) for f in flags]).any()
                                  if flags else None)
        return self._weights[key]

    def _param(self, p: torch.Tensor) -> torch.Tensor | None:
        key = id(p)
        if key not in self._params:
            local = _shard(p.detach())
            plain = type(local) is torch.Tensor and local.is_floating_point()
            if plain and local.element_size() == 1:
                local = local.float()  # fp8: few kernels take it; exact in fp32
            self._params[key] = ~torch.isfinite(local).all() if plain else None
        return self._params[key]

    def close(self) -> None:
        self.recorder.close()


def _shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (this rank's shard), else `t`."""
    tensor = dtensors()
    return t.to_local() if tensor is not None and isinstance(t, tensor.DTensor) else t


def _measured(t: torch.Tensor, given: torch.Tensor | None = None,
              weights: torch.Tensor | None = None) -> _Measured:
    """`_measure` of `t`, a DTensor on its local shard. A DTensor whose placement is a pending
    reduction (Partial: a gradient not summed yet) holds no values of its own on a rank, so it is
    reduced first, as the op that reads it next would. Whether `given` held values that are not
    finite is read on its local shard (a pending sum holds them whenever a part does)."""
    given = None if given is None else _shard(given)
    tensor = dtensors()
    if tensor is None or not isinstance(t, tensor.DTensor):
        return _Measured(t.dtype, _measure(t, given, weights))
    d: Any = t
    if any(p.is_partial() for p in d.placements):
        d = d.redistribute(d.device_mesh, [tensor.Replicate() if p.is_partial() else p
                                           for p in d.placements])
    copies = math.prod(d.device_mesh.size(i) for i, p in enumerate(d.placements)
                       if p.is_replicate())
    return _Measured(t.dtype, _measure(d.to_local(), given, weights), copies,
                     any(p.is_shard() for p in d.placements))


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


def _measure(t: torch.Tensor, given: torch.Tensor | None = None,
             weights: torch.Tensor | None = None) -> torch.Tensor:
    """The statistics of `_FIELDS` for one tensor (and whether the input `given` to the module
    that made it held values that are not finite, and `weights`: whether its parameters did),
    as one float64 tensor: a handful of kernels, no sync."""
    finfo = torch.finfo(t.dtype)
    if t.element_size() == 1:  # fp8 (a quantizer's output): few kernels take it; exact in fp32
        t = t.float()
    if given is not None and given.element_size() == 1:
        given = given.float()
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
    spoilt = (torch.zeros(1, dtype=torch.float64, device=t.device) if weights is None
              else weights.to(t.device, torch.float64).reshape(1))
    return torch.cat([amax, counts, size, came, spoilt])


class _Row:
    """One module's tensors on one step, merged: the dtype and largest magnitude of the one
    closest to its dtype's limit, the counts summed (each tensor's against its own dtype), and
    whether the input and the parameters of the first call that held values not finite
    already held them. `shared` holds the counts as they add up across ranks: a DTensor's
    replicas (ranks holding the same values) count once between them."""

    def __init__(self, m: _Measured, values: list[float]) -> None:
        self.dtype = m.dtype
        self.values = [*values, 1.0]  # _FIELDS: the tensors' statistics, then the tensors
        self.shared = [v / m.copies for v in values[1:5]]  # over, under, nonfinite, numel
        self.sharded = m.sharded

    def add(self, m: _Measured, values: list[float]) -> None:
        mine = self.values
        if _margin(values[0], m.dtype) > _margin(mine[0], self.dtype):
            self.dtype, mine[0] = m.dtype, values[0]
        if values[3] and not mine[3]:
            mine[5], mine[6] = values[5], values[6]
        for i in (1, 2, 3, 4):
            mine[i] += values[i]
            self.shared[i - 1] += values[i] / m.copies
        mine[7] += 1.0
        self.sharded = self.sharded or m.sharded


def _margin(amax: float, dtype: torch.dtype) -> float:
    return amax / torch.finfo(dtype).max


def _merged(events: list[tuple[str, _Measured]]) -> tuple[dict[str, _Row], str | None]:
    """Each module's row over a step's tensors (read in one transfer: one sync), in the order
    the modules first appear, and the module of the first tensor that held a value not
    finite."""
    if not events:
        return {}, None
    values = torch.stack([m.values for _, m in events]).cpu().tolist()
    rows: dict[str, _Row] = {}
    first = None
    for (name, m), v in zip(events, values, strict=True):
        if first is None and v[3]:
            first = name
        row = rows.get(name)
        if row is None:
            rows[name] = _Row(m, v)
        else:
            row.add(m, v)
    return rows, first


def _stats(dtype: torch.dtype, values: list[float], sharded: bool = False) -> ModuleStats:
    amax, over, under, nonfinite, numel, given, weights, tensors = values
    n = max(numel, 1.0)
    return ModuleStats(dtype, amax, over / n, under / n, round(nonfinite), round(given),
                       round(tensors), round(weights), sharded)


def _interleave(orders: list[list[int]]) -> list[int]:
    """One order of the modules over every rank's own order (each a list of module indices):
    the first rank's order is kept, and a module a rank ran that no rank before it did goes
    right before the module that follows it in that rank's order (an expert only rank 1 ran
    comes between the modules it ran between there, not after every module rank 0 ran)."""
    end = -1  # a ring: succ[end] is the first module, pred[end] the last
    succ, pred = {end: end}, {end: end}
    for order in orders:
        after = end
        for module in reversed(order):
            if module not in succ:  # not placed yet: right before the one after it here
                before = pred[after]
                succ[before], pred[module], succ[module], pred[after] = (
                    module, before, after, module)
            after = module
    out = []
    module = succ[end]
    while module != end:
        out.append(module)
        module = succ[module]
    return out


_COMPILED = (
    "watch: the model ran compiled (torch.compile) on a sampled step. Compiled code runs no "
    "module hook, so watch cannot see what its modules returned (it would record nothing). "
    "Call the uncompiled model on the steps watch samples, e.g. "
    "`out = (model if w.sampling else compiled)(batch)` with `compiled = torch.compile(model)`: "
    "both share the parameters.")


def _refuse_compiled(model: nn.Module) -> None:
    if compiled(model):
        raise ValueError(
            "watch: the model is compiled (torch.compile). Compiled code runs no module hook, "
            "so watch would record nothing. Give watch the uncompiled model, keep the "
            "compiled one apart (`compiled = torch.compile(model)`, not `model.compile()`), "
            "and call the uncompiled one while watch.sampling is True: "
            "`out = (model if w.sampling else compiled)(batch)`. Received: "
            f"model of type {type(model).__name__}")


def _require_scaler(scaler: Any) -> None:
    if scaler is not None and not callable(getattr(scaler, "get_scale", None)):
        raise TypeError("watch: scaler is the GradScaler the run steps with "
                        "(precision_annot.GradScaler or torch.amp.GradScaler), whose "
                        "get_scale() watch reads to count skipped steps; or None. Received: "
                        f"scaler={scaler!r} (of type {type(scaler).__name__})")


class _Skips:
    """The steps a GradScaler skipped: it lowers its scale exactly when it skips one.

    Torch's GradScaler reads its scale with `.item()` (on a GPU, a wait for the device);
    a step that is not sampled compares the scale where it lives instead, and a sampled step
    reads the count and the scale (it waits for the device to measure anyway)."""

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler
        self.count = 0
        self.scale = float(scaler.get_scale())
        self._last: torch.Tensor | None = None  # the scale after the step before, as a tensor
        self._pending: torch.Tensor | None = None  # skips counted on the device, not read yet

    def step(self) -> None:
        now = _scale_tensor(self.scaler)
        if now is None:  # not torch's scaler (or not scaling yet): read it
            scale = float(self.scaler.get_scale())
            self.count += int(scale < self.scale)
            self.scale = scale
            return
        lower = (now < (self.scale if self._last is None else self._last)).int()
        self._pending = lower if self._pending is None else self._pending + lower
        self._last = now.clone()  # the scaler updates its scale in place

    def read(self) -> tuple[float, int]:
        if self._pending is not None:
            self.count += int(self._pending.item())
            self._pending = None
        if self._last is not None:
            self.scale = float(self._last.item())
        return self.scale, self.count


def _scale_tensor(scaler: Any) -> torch.Tensor | None:
    """The GradScaler's scale as the tensor it keeps, or None (another scaler, or one that has
    not scaled a loss yet).

    NOTE: torch's GradScaler hands its scale tensor only through `_get_scale_async`;
    `get_scale()` reads it to the host."""
    get = getattr(scaler, "_get_scale_async", None)
    scale = get() if callable(get) else None
    return scale if isinstance(scale, torch.Tensor) else None


def _open(path: str | Path) -> TextIO:
    """The JSON-lines file a run appends to, its folder checked first."""
    file = Path(path)
    if not file.parent.is_dir():
        raise FileNotFoundError(f"watch: path={str(path)!r} is in a folder that does not "
                                f"exist ({str(file.parent)!r}): create it first, e.g. "
                                "Path(path).parent.mkdir(parents=True, exist_ok=True).")
    if file.is_dir():
        raise IsADirectoryError(f"watch: path={str(path)!r} is a folder; path names the "
                                "JSON-lines file each sampled step is appended to.")
    return file.open("a")


class watch:
    """Record per-module numerics on every `every`-th training step, against each tensor's
    own dtype limits.

    Call `step()` once per training step, after the backward (and the optimizer step). The
    forward and backward of step 0, `every`, `2 * every`, ... are measured; the steps in
    between run with nothing installed. Every call of a module counts, and every floating
    tensor it returns; forwards run without gradients (an evaluation between steps) do not.
    A compiled model runs no module hook: watch refuses one, and says so at the end of a
    sampled step that ran compiled code; call the uncompiled model while `sampling` is True.
    Use it as a context manager, or `close()` it.

    Args:
        model: the model being trained (seen through wrappers); its plan names the modules.
        every: measure one step in this many. (Default: 100)
        scaler: a GradScaler whose scale and skipped steps to record. (Default: None)
        path: a JSON-lines file each sampled step is appended to (`precision-annot
            watch-report` reads it). (Default: None)
        reduce: under torch.distributed, also reduce each sampled step across ranks (the
            largest magnitude, summed counts) into a record of rank "all": a DTensor's
            statistics, measured on each rank's shard, become the whole tensor's there.
            (Default: True)
        warn: say once per module, with the fix, when its output or gradient reaches half
            its dtype's largest value or is not finite. (Default: True)
        start: the index of the first step: a run resumed from a checkpoint taken after N
            steps passes N, so that its steps keep their numbers and the same steps are
            sampled as in a run that was not stopped. (Default: 0)

    Attributes:
        history: every `WatchRecord` so far (this rank's, and the reduced ones).
        switches: each switch of a `precision_annot.schedule` seen so far (a `Switch`: its
            step, phases and what it narrowed); each is also a line of `path`, and the plan
            of the new phase names the modules from the next step on. Call `step()` after
            the schedule's, so that a step runs with the hooks of its own phase.
        sampling: whether the step now running is measured.

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
                 path: str | Path | None = None, reduce: bool = True, warn: bool = True,
                 start: int = 0) -> None:
        require_module(model, "watch")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"watch: every is a number of steps, 1 or more. Received: "
                             f"every={every!r}")
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"watch: start is the index of the first step (the steps a resumed "
                             f"run took before), 0 or more. Received: start={start!r}")
        _require_scaler(scaler)
        _refuse_compiled(model)
        self.model = unwrap(model)
        self.plan: PrecisionPlan = plan_of(self.model, where="watch")
        self.named = dict(self.model.named_modules())
        self.every = every
        self.scaler = scaler
        self.reduce = reduce
        self.warn = warn
        self.history: list[WatchRecord] = []
        self.switches: list[Switch] = []
        self._switches_seen = len(switches_of(self.model))
        self.index = start
        self._skips = None if scaler is None else _Skips(scaler)
        self._said: set[tuple[str, str, bool]] = set()
        self._said_empty = False
        self._file: TextIO | None = None
        if path is not None:
            self._file = _open(path)
        self._current: _Step | None = _Step(self.named) if start % every == 0 else None

    @property
    def sampling(self) -> bool:
        """Whether the step now running is measured (its forward and backward are recorded)."""
        return self._current is not None

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
        if self._skips is not None:
            self._skips.step()
        record = None
        if current is not None:
            current.close()
            self._current = None
            if current.recorder.compiled:
                self.close()
                raise RuntimeError(_COMPILED)
            record = self._record(current)
        self.index += 1
        self._follow_switches()
        if self.index % self.every == 0:
            self._current = _Step(self.named)
        return record

    def _follow_switches(self) -> None:
        """A schedule switched the plan since the last step: kept, written, and the new
        phase's plan (and modules: an fp8 phase converts its Linear layers) followed."""
        made = switches_of(self.model)
        if len(made) <= self._switches_seen:
            return
        for switch in made[self._switches_seen:]:
            self.switches.append(switch)
            if self._file is not None and (not (dist.is_available() and dist.is_initialized())
                                           or dist.get_rank() == 0):
                self._file.write(json.dumps({"step": switch.step, "switch": switch.to_dict()})
                                 + "\n")
                self._file.flush()
        self._switches_seen = len(made)
        self.plan = plan_of(self.model, where="watch")
        self.named = dict(self.model.named_modules())

    def _record(self, current: _Step) -> WatchRecord:
        outputs, first = _merged(current.outputs)
        grads, first_grad = _merged(current.grads)
        if not outputs:
            self._say_empty()
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        fp8 = {name: tuple(Fp8Stats(op, dtype, *values.tolist())
                           for op, dtype, values in ops)
               for name, ops in current.fp8.items()}
        scale, skipped = (None, None) if self._skips is None else self._skips.read()
        record = WatchRecord(self.index,
                             {n: _stats(r.dtype, r.values, r.sharded) for n, r in outputs.items()},
                             {n: _stats(r.dtype, r.values, r.sharded) for n, r in grads.items()},
                             first, first_grad, scale, skipped, rank, fp8)
        self._keep(record)
        if self.reduce and dist.is_available() and dist.is_initialized():
            self._keep(self._reduced(outputs, grads, record))
        return record

    def _say_empty(self) -> None:
        if self._said_empty or not self.warn:
            return
        self._said_empty = True
        warnings.warn(f"watch: step {self.index} was sampled, but no module of the model ran a "
                      "forward with gradients since the step before it, so there is nothing "
                      "to record: call step() once per training step, after its backward. (A "
                      "model compiled after watch started runs code that module hooks do not "
                      "see: call the uncompiled model while watch.sampling is True.)",
                      UserWarning, stacklevel=4)

    def _keep(self, record: WatchRecord) -> None:
        self.history.append(record)
        if self._file is not None and (record.rank != "all" or dist.get_rank() == 0):
            # one reduced record per step in a file the ranks share: rank 0's
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

    def _reduced(self, outputs: dict[str, _Row], grads: dict[str, _Row], mine: WatchRecord
                 ) -> WatchRecord:
        """This step over every rank: the largest magnitude, summed counts (a DTensor's
        replicas counted once). Every module of the model has a row on every rank, so that
        the collectives line up even where a rank ran a module the others skipped (an expert
        no token was routed to); the dtype travels as a code, and a module no rank ran is left
        out. The modules keep the order they ran in (`_interleave`), so that the first module
        that held values not finite is the first on the rank that ran it, wherever it ran."""
        out = self._reduce(outputs)
        back = self._reduce(grads)
        first = next((n for n in out if out[n].nonfinite), None)
        first_grad = next((n for n in back if back[n].nonfinite), None)
        return WatchRecord(mine.step, out, back, first, first_grad, mine.scale, mine.skipped,
                           "all")

    def _reduce(self, table: dict[str, _Row]) -> dict[str, ModuleStats]:
        codes = list(_DTYPES)
        index = {n: i for i, n in enumerate(self.named)}
        names = list(self.named)
        # per module: amax | over, under, nonfinite, numel (as shared) | in_nonfinite,
        # weights_nonfinite, tensors, ran | dtype code
        rows = torch.zeros(len(names), 10, dtype=torch.float64)
        position = torch.full((len(names),), -1, dtype=torch.int64)
        for k, (name, row) in enumerate(table.items()):
            v = row.values
            code = codes.index(row.dtype) if row.dtype in codes else 0
            rows[index[name]] = torch.tensor([v[0], *row.shared, v[5], v[6], v[7], 1.0, code])
            position[index[name]] = k
        if dist.get_backend() == "nccl":  # its collectives take CUDA tensors only
            device = torch.device("cuda", torch.cuda.current_device())
            rows, position = rows.to(device), position.to(device)
        amax = rows[:, :1].clone()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        counts = rows[:, 1:9].clone()
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        dtypes = rows[:, 9].clone()
        dist.all_reduce(dtypes, op=dist.ReduceOp.MAX)
        positions = [torch.empty_like(position) for _ in range(dist.get_world_size())]
        dist.all_gather(positions, position)
        merged = torch.cat([amax, counts[:, :7]], dim=1).cpu().tolist()
        ran, dtype = counts[:, 7].cpu().tolist(), dtypes.cpu().tolist()
        orders = [sorted((i for i, k in enumerate(ranks) if k >= 0), key=ranks.__getitem__)
                  for ranks in torch.stack(positions).cpu().tolist()]
        return {names[i]: _stats(codes[int(dtype[i])], merged[i])
                for i in _interleave(orders) if ran[i] > 0}

    def _say(self, record: WatchRecord) -> None:
        """Per direction, the first module at its limit in that direction's order, and the
        first whose values are not finite, each once: the ones after them inherit their
        values, so they are not named too, but a module that overflows after another was
        said to be near its limit is. A backward that follows a forward with values not finite
        inherits them, so it is not named then; nor are gradients under a watched GradScaler,
        which keeps them as close to the limit as it can and skips the steps that pass it
        (`skipped` counts them)."""
        for kind, table, first in (("output", record.outputs, record.first_nonfinite),
                                   ("grad", record.grads, record.first_nonfinite_grad)):
            if kind == "grad" and (record.first_nonfinite is not None
                                   or self.scaler is not None):
                continue
            near = next((m for m, s in table.items() if s.margin >= NEAR or s.nonfinite), None)
            for module in dict.fromkeys(m for m in (near, first) if m is not None):
                s = table[module]
                key = (module, kind, bool(s.nonfinite))
                if key in self._said:
                    continue
                self._said.add(key)
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
        if kind == "output" and s.nonfinite and s.in_nonfinite:
            return (f"watch: step {step}: module {where!r}, the first to hold non-finite "
                    f"values ({s.nonfinite}), was handed them: they come from its "
                    "input (the batch, or code that runs between modules), not from a "
                    "module's precision.")
        if kind == "output" and s.nonfinite and s.weights_nonfinite:
            return (f"watch: step {step}: module {where!r}, the first to hold non-finite "
                    f"values ({s.nonfinite}), computed them from weights that were already "
                    "not finite: an optimizer step was taken on gradients that were not finite "
                    "(a loss or backward that overflowed, on an earlier step), and no "
                    "precision of this module undoes that. Skip such steps: train with "
                    "precision_annot.GradScaler, which skips them and lowers its scale, or "
                    "step only when the loss and the gradients are finite; clip gradients "
                    "that grow large (torch.nn.utils.clip_grad_norm_). Then resume from a "
                    "checkpoint taken before the weights went non-finite.")
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


def _read(path: str | Path, switches: list[dict[str, Any]] | None = None
          ) -> list[dict[str, Any]]:
    """The records of a JSON-lines file `watch` wrote, checked. A last line cut short (a run
    stopped while writing it: watch ends each line it writes) is left out, and said. The
    lines of a schedule's switches go into `switches` where given."""
    text = Path(path).read_text()
    lines = text.splitlines()
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines) and not text.endswith("\n"):
                warnings.warn(f"watch-report: the last line of {path} (line {n}) was cut short, "
                              "as by a run stopped while writing it; it is left out.",
                              UserWarning, stacklevel=3)
                break
            raise ValueError(f"line {n} is not JSON ({e})") from e
        if isinstance(record, dict) and isinstance(record.get("switch"), dict):
            if switches is not None:
                switches.append(record["switch"])
            continue  # a schedule's switch (see `watch.switches`)
        if not isinstance(record, dict) or not {"step", "rank", "outputs", "grads"} <= set(
                record):
            raise ValueError(f"line {n} is not a record watch wrote (a JSON object with step, "
                             f"rank, outputs and grads): {line[:60]!r}")
        records.append(record)
    return records


def _steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per step, the record reduced across ranks where there is one, else each rank's own."""
    reduced = {r["step"] for r in records if r["rank"] == "all"}
    return [r for r in records if r["rank"] == "all" or r["step"] not in reduced]


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
    switches: list[dict[str, Any]] = []
    records = _read(path, switches)
    for record in records:
        _worst_fp8(fp8, record)  # each rank's own (fp8 statistics are not reduced)
    steps: set[int] = set()
    for record in _steps(records):
        steps.add(record["step"])
        for module, kind, stats in _tensors(record):
            score = (stats["nonfinite"] > 0, stats["margin"])
            if (module, kind) not in worst or score > worst[(module, kind)][0]:
                worst[(module, kind)] = (score, record["step"], stats)
    if not steps:
        return (f"0 sampled steps in {path}: watch(path=...) appends one line per sampled "
                "step, and none was written (no sampled step ended, or this is not its file).")
    rows: list[tuple[str, ...]] = [("module", "of", "dtype", "worst margin", "at step",
                                    "non-finite")]
    for (module, kind), (_, step, stats) in sorted(worst.items(),
                                                   key=lambda kv: kv[1][0], reverse=True)[:top]:
        rows.append((module or "(root)", kind, stats["dtype"], f"{stats['margin']:.2%}",
                     str(step), str(stats["nonfinite"])))
    return "\n".join([f"{len(steps)} sampled steps in {path}; the closest to their limits:",
                      *format_table(rows, right={3, 4, 5}), *_fp8_table(fp8, top),
                      *_switch_lines(switches)])


def _switch_lines(switches: list[dict[str, Any]]) -> list[str]:
    """The schedule's switches a file holds, one line each, with what each narrowed."""
    if not switches:
        return []
    lines = ["", "precision schedule switches:"]
    for s in switches:
        line = f"  step {s['step']}: phase {s['phase']} ({s['previous']} -> {s['spec']})"
        narrowed = s.get("narrowed") or []
        if narrowed:
            line += "; narrowed " + "; ".join(
                f"{n['what']} {n['source']} -> {n['target']} (largest relative change "
                f"{n['change']:.3g})" for n in narrowed)
        lines.append(line)
    return lines


def _series(path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Each tensor's margin over the steps (inf where values were not finite), by label."""
    series: dict[str, list[tuple[int, float]]] = {}
    for record in _steps(_read(path)):
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
