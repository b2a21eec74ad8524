"""`diff`: one step of the plan beside the same step in fp32, module by module.

Where a low-precision run first departs from fp32 is the question `watch` leads to. `diff`
runs one forward and backward of the plan on a copy of the model, and the same step in fp32 on
another copy, records each module's output and the gradient of that output in both, and
returns each module's relative error in execution order: every call, every floating tensor
returned, with the same random numbers in both runs. `.first` names the first module whose
output error passes the tolerance: modules before it track fp32, so the precision is lost in
it (the error then flows downstream). A DTensor (tensor parallel) is compared whole: it is
gathered (`full_tensor()`) on every rank.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from precision_annot._src.casting import cast_tree, map_tree
from precision_annot._src.dtypes import bf16, dtype_name, fp16, fp32
from precision_annot._src.guards import require_module
from precision_annot._src.plan import PrecisionPlan
from precision_annot._src.recording import (
    Inputs,
    Recorder,
    Returned,
    drop_recorders,
    dtensors,
    relative_error,
)
from precision_annot._src.runtime import ModuleState, apply, plan_of, remove
from precision_annot._src.samples import as_call, loss_of, projected_loss
from precision_annot._src.tables import format_table
from precision_annot._src.wrappers import unwrap

__all__ = ["DiffReport", "ModuleDiff", "diff"]

#: the default tolerance on a module's relative error, by the narrowest dtype the plan
#: computes in (the ones `suggest` holds a plan to, end to end)
TOLERANCE = {fp16: 2e-2, bf16: 1e-1}
#: for a plan that computes in fp32 or wider only
WIDE_TOLERANCE = 1e-3


@dataclasses.dataclass(frozen=True)
class ModuleDiff:
    """One module of a `diff`.

    Attributes:
        name: the module's qualified name.
        dtype: the dtype the plan computes it in (None: it sets none).
        output_error: the largest relative error against fp32 of what it returned: every
            floating tensor, every call.
        grad_error: the largest relative error of the gradients of those tensors, or None
            when the step had no backward through them.
        tensors: how many tensors were compared (1: one call returning one tensor).
    """

    name: str
    dtype: torch.dtype | None
    output_error: float
    grad_error: float | None
    tensors: int = 1


@dataclasses.dataclass(frozen=True)
class DiffReport:
    """What `diff` measured: every module that ran, in execution order.

    Attributes:
        modules: a `ModuleDiff` per module, in the order their forwards ran.
        tolerance: the relative error a module passes to be named.
        first: the module whose tensor is the first, in execution order (every call), to pass
            `tolerance` (where the precision is lost), or None.
        first_grad: the module whose gradient is the first, in the order the backward
            computes them, to pass `tolerance`, or None.
    """

    modules: tuple[ModuleDiff, ...]
    tolerance: float
    first: str | None
    first_grad: str | None

    def __getitem__(self, name: str) -> ModuleDiff:
        for row in self.modules:
            if row.name == name:
                return row
        raise KeyError(f"No module named {name!r} ran in this diff.")

    def __iter__(self) -> Iterator[ModuleDiff]:
        return iter(self.modules)

    def __str__(self) -> str:
        def show(x: float | None) -> str:
            return "-" if x is None else ("inf" if math.isinf(x) else
                                          "nan" if math.isnan(x) else f"{x:.2e}")

        rows: list[tuple[str, ...]] = [("module", "compute", "output error", "grad error", "")]
        for m in self.modules:
            mark = "<- first" if m.name == self.first else (
                "<- first (backward)" if m.name == self.first_grad else "")
            rows.append((m.name or "(root)", dtype_name(m.dtype), show(m.output_error),
                         show(m.grad_error), mark))
        lines = format_table(rows, right={2, 3})
        lines.append("")
        lines.append(f"errors relative to the same step in fp32; tolerance {self.tolerance:g}. "
                     + (f"First past it: {self.first!r}." if self.first is not None else
                        "No module passes it."))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"tolerance": self.tolerance, "first": self.first, "first_grad": self.first_grad,
                "modules": [{"name": m.name, "dtype": dtype_name(m.dtype),
                             "output_error": m.output_error, "grad_error": m.grad_error,
                             "tensors": m.tensors}
                            for m in self.modules]}


class _Run:
    """What one run of the step returned, recorded by the one `Recorder`, by (module, call,
    index): the tensors in the forward's order, the gradients in the backward's.

    The plan's run keeps a copy of each tensor and gradient (in its own dtype); the fp32 run,
    given that run as `against`, measures each of its own against it as it comes and keeps
    only the error, so that a step's outputs are held once, not twice, nor in float64."""

    def __init__(self, model: nn.Module, against: _Run | None = None) -> None:
        self.against = against
        self.order: list[Returned] = []
        self.outputs: dict[tuple[str, int, int], torch.Tensor] = {}
        self.grads: dict[tuple[str, int, int], torch.Tensor] = {}
        self.grad_order: list[Returned] = []
        #: the fp32 run's errors against `against`, by key (None: not measured)
        self.errors: dict[tuple[str, int, int], float | None] = {}
        self.grad_errors: dict[tuple[str, int, int], float | None] = {}
        #: the fp32 run's tensors of another shape than the plan's run's: the runs took other
        #: paths there (a router sent other tokens to an expert)
        self.unlike: dict[tuple[str, int, int], None] = {}  # (in the forward's order)
        self.recorder = Recorder(dict(model.named_modules()), self._output, self._grad)

    def _output(self, r: Returned, t: torch.Tensor, module: nn.Module, inputs: Inputs) -> None:
        self.order.append(r)
        if self.against is None:
            self.outputs[r.key] = (self.outputs[r.same.key] if r.same is not None
                                   else _whole(t.detach()).clone())
        elif r.same is not None:
            self.errors[r.key] = self.errors[r.same.key]
        else:
            got = self.against.outputs.get(r.key)
            if got is not None and got.shape != t.shape:
                self.unlike[r.key] = None
            self.errors[r.key] = _error(got, _whole(t.detach()))

    def _grad(self, r: Returned, g: torch.Tensor) -> None:
        done = self.grads if self.against is None else self.grad_errors
        if r.key in done:
            return  # a second backward through the same tensor
        self.grad_order.append(r)
        if self.against is None:
            same = self.grads.get(r.same.key) if r.same is not None else None
            self.grads[r.key] = same if same is not None else _whole(g.detach()).clone()
        elif r.same is not None and r.same.key in self.grad_errors:
            self.grad_errors[r.key] = self.grad_errors[r.same.key]
        else:
            self.grad_errors[r.key] = _error(self.against.grads.get(r.key), _whole(g.detach()))


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole on this rank (`full_tensor()`: a collective, which every rank
    of its mesh runs at the same hook, tensor parallelism running the same modules in the same
    order on each), else `t`. Differentiable: the default loss projects whole outputs."""
    tensor = dtensors()
    return t.full_tensor() if tensor is not None and isinstance(t, tensor.DTensor) else t


def _error(got: torch.Tensor | None, want: torch.Tensor | None) -> float | None:
    """The relative error of one tensor against fp32 (the one measure `suggest` uses too);
    nan where fp32 itself holds nan: no reference to measure against."""
    if got is None or want is None:
        return None
    if bool(torch.isnan(want).any()):
        return math.nan
    return relative_error(got, want)


def _worst(errors: list[float]) -> float:
    """The largest error; nan only when every one is nan."""
    known = [e for e in errors if not math.isnan(e)]
    return max(known) if known else math.nan


def _tolerance(plan: PrecisionPlan) -> float:
    dtypes = {e.policy.compute for e in plan.values()}
    for dtype in (fp16, bf16):
        if dtype in dtypes:
            return TOLERANCE[dtype]
    return WIDE_TOLERANCE


def _run(model: nn.Module, sample: Any, loss_fn: Callable[[Any, Any], torch.Tensor | None] | None,
         against: _Run | None = None) -> _Run:
    run = _Run(model, against)
    try:
        args, kwargs = as_call(sample)
        output = model(*args, **kwargs)
        loss = (loss_fn(output, sample) if loss_fn is not None
                else projected_loss(map_tree(output, _whole)))
        if loss is not None and loss.requires_grad:
            loss.backward()  # type: ignore[no-untyped-call]
    finally:
        run.recorder.close()
    return run


def _own(sample: Any) -> Any:
    """A copy of the sample for one run: a forward that changes what it is handed (a KV cache
    it appends to, a buffer it writes into) changes this copy, and the backward's gradients
    go to its leaves, not the caller's. A tensor with a history (the caller's graph) comes
    detached: the step starts at the sample."""
    plain = map_tree(sample, _detached)
    try:
        return copy.deepcopy(plain)
    except (TypeError, RuntimeError, copy.Error) as e:
        warnings.warn(f"diff: the sample cannot be copied ({type(e).__name__}: {e}), so both "
                      "runs are handed the same objects: a forward that changes them (a cache "
                      "it appends to) hands the fp32 run what the plan's run left.",
                      UserWarning, stacklevel=3)
        return plain


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t if t.grad_fn is None else t.detach().requires_grad_(t.requires_grad)


class _SameDraws(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The random ops of the second run hand back what the first run's drew, in order (cast to
    the second run's dtypes). Both runs start from the same generator state, but a kernel may
    draw differently by dtype: CUDA's fused dropout gives a bf16 tensor another mask than an
    fp32 one from the same state (seen on an H100, torch 2.11: an error of 0.99 at the
    dropout). A run whose random ops stop matching the first's draws afresh from there."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.draws: list[tuple[Any, list[torch.Tensor]]] = []
        self.replay: Iterator[tuple[Any, list[torch.Tensor]]] | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return out
        drawn = _drawn(func, out)
        if self.replay is None:
            self.draws.append((func, [t.detach().clone() for t in drawn]))
            return out
        recorded = next(self.replay, None)
        if recorded is None or recorded[0] is not func or [t.shape for t in drawn] != [
                t.shape for t in recorded[1]]:
            self.replay = iter(())  # the runs no longer match: draw afresh from here
            return out
        for mine, theirs in zip(drawn, recorded[1], strict=True):
            mine.copy_(theirs)
        if func is torch.ops.aten.native_dropout.default:  # the output from the mask
            p = args[1] if len(args) > 1 else kwargs["p"]
            out[0].copy_(torch.ops.aten.native_dropout_backward(
                args[0], out[1], 1.0 / (1.0 - p) if p < 1 else 0.0))
        return out


def _drawn(func: Any, out: Any) -> list[torch.Tensor]:
    """The tensors a random op drew: dropout's mask, else every tensor it returned."""
    if func is torch.ops.aten.native_dropout.default:
        return [out[1]]
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,))
            if isinstance(t, torch.Tensor)]


@contextlib.contextmanager
def _same_randomness() -> Iterator[tuple[_SameDraws, Callable[[], None]]]:
    """Runs that draw the same random numbers (dropout's masks): each run is made under the
    mode given (`with draws:`), and `rewind()` puts the global generators (CPU, and CUDA
    where it is in use) back where the first run started and has the second run's random ops
    handed the first run's draws; on exit the generators are where the caller left them."""
    initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    devices = list(range(torch.cuda.device_count())) if initialized else []
    draws = _SameDraws()
    with torch.random.fork_rng(devices=devices):
        cpu = torch.get_rng_state()
        cuda = [torch.cuda.get_rng_state(d) for d in devices]

        def rewind() -> None:
            torch.set_rng_state(cpu)
            for device, state in zip(devices, cuda, strict=True):
                torch.cuda.set_rng_state(state, device)
            draws.replay = iter(draws.draws)

        yield draws, rewind


def _copy(model: nn.Module) -> nn.Module:
    """A deep copy without the hooks a recorder (a running `watch`) put on the model, nor the
    gradients the caller's last backward left (the runs make their own; a DTensor parameter's
    would be cast with it to fp32, which torch refuses for a gradient of another dtype)."""
    copied = copy.deepcopy(model)
    drop_recorders(copied)
    copied.zero_grad(set_to_none=True)
    return copied


def _in_fp32(model: nn.Module) -> nn.Module:
    """`model.to(fp32)`, its DTensor parameters made whole first.

    NOTE: `remove` gives a parameter its old dtype by setting its `.data`; a DTensor takes the
    new dtype so, but keeps its local tensor (torch 2.13 to 2.15), and `.to` then reads it as
    cast already. Each such one is swapped for the DTensor of its local values in fp32 (the same
    object: `torch.utils.swap_tensors`)."""
    tensor = dtensors()
    if tensor is not None:
        for p in model.parameters():
            if isinstance(p, tensor.DTensor) and p.to_local().dtype != p.dtype:
                local = p.detach().to_local().to(fp32)
                whole = tensor.DTensor.from_local(local, p.device_mesh, p.placements,
                                                  run_check=False, shape=p.shape,
                                                  stride=p.stride())
                torch.utils.swap_tensors(  # type: ignore[no-untyped-call]
                    p, nn.Parameter(whole, requires_grad=p.requires_grad))
    return model.to(fp32)


def _drop(model: nn.Module) -> None:
    """Take the plan off a copy, so that it is freed as soon as it is let go: an applied
    plan's boundary holds its module (a reference cycle, left to the garbage collector,
    which may run long after the fp32 copy is made)."""
    for module in model.modules():
        ModuleState.strip(module)


def _compare(planned: _Run, exact: _Run, plan: PrecisionPlan, tolerance: float
             ) -> tuple[list[ModuleDiff], str | None, str | None, str | None]:
    """Each module both runs recorded, in the planned run's order: its worst errors over
    every tensor every call returned; the first module whose tensor passes `tolerance`, in
    the forward's order and in the backward's; and the first whose fp32 tensor holds nan."""
    outputs: dict[str, list[float]] = {}
    grads: dict[str, list[float]] = {}
    first = broken = None
    for r in planned.order:
        if r.key not in exact.errors:
            continue
        error = exact.errors[r.key]
        out = math.nan if error is None else error
        outputs.setdefault(r.name, []).append(out)
        if first is None and out > tolerance:
            first = r.name
        if broken is None and math.isnan(out) and r.key not in exact.unlike:
            broken = r.name
        grad = exact.grad_errors.get(r.key)
        if grad is not None:
            grads.setdefault(r.name, []).append(grad)
    rows = []
    for name, errors in outputs.items():
        entry = plan.get(name)
        rows.append(ModuleDiff(name, entry.policy.compute if entry is not None else None,
                               _worst(errors), _worst(grads[name]) if name in grads else None,
                               len(errors)))
    return rows, first, _first_grad(planned, exact, set(outputs), tolerance), broken


def _first_grad(planned: _Run, exact: _Run, compared: set[str], tolerance: float
                ) -> str | None:
    """The module whose gradient is the first, in the order the backward computed them, to
    pass `tolerance`."""
    for r in planned.grad_order:
        grad = exact.grad_errors.get(r.key)
        if r.name in compared and grad is not None and grad > tolerance:
            return r.name
    return None


def _say_where_the_runs_took_other_paths(exact: _Run) -> None:
    names = list(dict.fromkeys(key[0] for key in exact.unlike))
    if names:
        warnings.warn(f"diff: {len(names)} module(s) returned tensors of other shapes in the "
                      f"plan's run than in fp32's ({', '.join(map(repr, names[:4]))}"
                      f"{', ...' if len(names) > 4 else ''}): the two runs took other paths "
                      "there (a router sent other tokens to an expert, or code branched on "
                      "values the precision changed), so those are not compared (error nan).",
                      UserWarning, stacklevel=3)


def _say_if_fp32_is_not_finite(broken: str | None) -> None:
    if broken is not None:
        warnings.warn(f"diff: the fp32 run itself holds values that are not finite from module "
                      f"{broken!r} on: no precision makes them finite, so they are not "
                      "compared (error nan). Look at the weights and the batch (a step that "
                      "was taken on a non-finite loss leaves non-finite weights).",
                      UserWarning, stacklevel=3)


def diff(model: nn.Module, sample: Any, *,
         loss_fn: Callable[..., torch.Tensor] | None = None,
         tolerance: float | None = None) -> DiffReport:
    """One step of the plan against the same step in fp32, module by module.

    `model` is copied twice, one copy at a time (it is not changed): one copy runs the plan
    (the one applied to it, else its annotations resolved), the other runs every parameter
    and buffer in fp32 with no plan, both from the same values and the same random numbers
    (the fp32 run is handed what each random op of the first drew, so dropout's masks are the
    same in both whatever dtype they are drawn in; the caller's generators are left where they
    were), each on its own copy of `sample` (a KV cache the forward appends to is the
    caller's still). Every floating tensor every call of a module returns, and its gradient,
    is compared between the two; a DTensor (tensor parallel) whole, gathered on every rank.

    Args:
        model: the model (seen through wrappers).
        sample: a batch: a tensor, a dict of keyword arguments, or (args, kwargs).
        loss_fn: `loss_fn(output) -> loss` or `loss_fn(output, sample) -> loss`, the loss a
            tensor of one element. (Default: None: a fixed projection of the output's
            floating tensors, `samples.projected_loss`, whose gradient no normalization or
            softmax at the end cancels, as it cancels the sum's)
        tolerance: the relative error a module passes to be named `first`. (Default: None:
            2e-2 when the plan computes in fp16, 1e-1 in bf16, else 1e-3)

    Returns:
        A `DiffReport`; `report.first` names the first module, in execution order, whose
        output error passes the tolerance, and `str(report)` is a table.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from precision_annot import diff, resolve
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> report = diff(model, torch.randn(4, 8))   # no plan: it equals fp32
        >>> report.first is None
        True
    """
    require_module(model, "diff")
    if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(
            tolerance, (int, float)) or not 0 < tolerance < math.inf):
        raise ValueError(f"diff: tolerance is a relative error above 0, e.g. 1e-2. Received: "
                         f"tolerance={tolerance!r}")
    loss = loss_of(loss_fn, "diff")
    inner = unwrap(model)
    plan = plan_of(inner, where="diff")
    tol = tolerance if tolerance is not None else _tolerance(plan)
    with _same_randomness() as (draws, rewind):
        # one copy of the model at a time: the plan's is gone before fp32's is made
        low = apply(_copy(inner), plan)
        with draws:
            planned = _run(low, _own(sample), loss)
        _drop(low)
        del low
        rewind()
        reference = _in_fp32(remove(_copy(inner)))
        with draws:
            exact = _run(reference, cast_tree(_own(sample), fp32), loss, planned)
        del reference
    rows, first, first_grad, broken = _compare(planned, exact, plan, tol)
    _say_if_fp32_is_not_finite(broken)
    _say_where_the_runs_took_other_paths(exact)
    return DiffReport(tuple(rows), tol, first, first_grad)
