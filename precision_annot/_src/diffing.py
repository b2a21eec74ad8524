"""`diff`: one step of the plan beside the same step in fp32, module by module.

Where a low-precision run first departs from fp32 is the question `watch` leads to. `diff`
runs one forward and backward of the plan on a copy of the model, and the same step in fp32 on
another copy, records each module's output and the gradient of that output in both, and
returns each module's relative error in execution order. `.first` names the first module whose
output error passes the tolerance: modules before it track fp32, so the precision is lost in
it (the error then flows downstream).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from precision_annot._src.casting import cast_tree, first_floating
from precision_annot._src.dtypes import bf16, dtype_name, fp16, fp32
from precision_annot._src.guards import require_module
from precision_annot._src.plan import PrecisionPlan
from precision_annot._src.runtime import apply, plan_of, remove
from precision_annot._src.samples import as_call, scalar_loss
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
        output_error: the relative error of its output (its first call) against fp32.
        grad_error: the relative error of the gradient of that output, or None when the step
            had no backward through it.
    """

    name: str
    dtype: torch.dtype | None
    output_error: float
    grad_error: float | None


@dataclasses.dataclass(frozen=True)
class DiffReport:
    """What `diff` measured: every module that ran, in execution order.

    Attributes:
        modules: a `ModuleDiff` per module, in the order their forwards ran.
        tolerance: the relative error a module passes to be named.
        first: the first module, in execution order, whose output error passes `tolerance`
            (where the precision is lost), or None.
        first_grad: the first module, in execution order of the backward (the last forward
            first), whose gradient error passes `tolerance`, or None.
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
                             "output_error": m.output_error, "grad_error": m.grad_error}
                            for m in self.modules]}


class _Recorder:
    """Each module's first output and the gradient of it, in float64."""

    def __init__(self, model: nn.Module) -> None:
        self.order: list[str] = []
        self.outputs: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self.handles = [m.register_forward_hook(self._hook(n))
                        for n, m in model.named_modules()]

    def _hook(self, name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: Any, output: Any) -> None:
            if name in self.outputs:
                return
            first = first_floating(output)
            if first is None:
                return
            self.order.append(name)
            self.outputs[name] = first.detach().double().clone()
            if first.requires_grad:
                def grad(g: torch.Tensor) -> None:
                    self.grads.setdefault(name, g.detach().double().clone())

                first.register_hook(grad)  # type: ignore[no-untyped-call]

        return record

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _error(got: torch.Tensor | None, want: torch.Tensor | None) -> float | None:
    """||got - want|| / ||want||; inf where `got` is not finite and `want` is."""
    if got is None or want is None or got.shape != want.shape:
        return None
    finite = torch.isfinite(want)
    if not bool(finite.all()):
        return math.nan  # fp32 itself is not finite here: no reference to measure against
    if not bool(torch.isfinite(got).all()):
        return math.inf
    norm = float(want[finite].norm())
    gap = float((got - want)[finite].norm())
    return gap / norm if norm > 0 else (0.0 if gap == 0 else math.inf)


def _tolerance(plan: PrecisionPlan) -> float:
    dtypes = {e.policy.compute for e in plan.values()}
    for dtype in (fp16, bf16):
        if dtype in dtypes:
            return TOLERANCE[dtype]
    return WIDE_TOLERANCE


def _run(model: nn.Module, sample: Any, loss_fn: Callable[[Any, Any], torch.Tensor] | None
         ) -> _Recorder:
    recorder = _Recorder(model)
    try:
        args, kwargs = as_call(sample)
        output = model(*args, **kwargs)
        loss = loss_fn(output, sample) if loss_fn is not None else scalar_loss(output)
        if loss is not None and loss.requires_grad:
            loss.backward()  # type: ignore[no-untyped-call]
    finally:
        recorder.close()
    return recorder


def _compare(planned: _Recorder, exact: _Recorder, plan: PrecisionPlan) -> list[ModuleDiff]:
    """Each module both runs recorded, in the planned run's order."""
    rows = []
    for name in planned.order:
        if name not in exact.outputs:
            continue
        out = _error(planned.outputs[name], exact.outputs[name])
        grad = _error(planned.grads.get(name), exact.grads.get(name))
        entry = plan.get(name)
        rows.append(ModuleDiff(name, entry.policy.compute if entry is not None else None,
                               math.nan if out is None else out, grad))
    return rows


def _say_if_fp32_is_not_finite(rows: list[ModuleDiff], planned: _Recorder) -> None:
    broken = next((r.name for r in rows if math.isnan(r.output_error)
                   and planned.outputs.get(r.name) is not None), None)
    if broken is not None:
        warnings.warn(f"diff: the fp32 run itself holds values that are not finite from module "
                      f"{broken!r} on: no precision makes them finite, so they are not "
                      "compared (error nan). Look at the weights and the batch (a step that "
                      "was taken on a non-finite loss leaves non-finite weights).",
                      UserWarning, stacklevel=3)


def diff(model: nn.Module, sample: Any, *,
         loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
         tolerance: float | None = None) -> DiffReport:
    """One step of the plan against the same step in fp32, module by module.

    `model` is copied twice (it is not changed): one copy runs the plan (the one applied to
    it, else its annotations resolved), the other runs every parameter and buffer in fp32 with
    no plan, both from the same values. Each module's first output, and the gradient of it,
    is compared between the two.

    Args:
        model: the model (seen through wrappers).
        sample: a batch: a tensor, a dict of keyword arguments, or (args, kwargs).
        loss_fn: `loss_fn(output, sample) -> loss`; by default the sum of the output's
            floating tensors. (Default: None)
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
    inner = unwrap(model)
    plan = plan_of(inner, where="diff")
    low = copy.deepcopy(inner)
    apply(low, plan)
    reference = remove(copy.deepcopy(inner)).to(fp32)
    tol = tolerance if tolerance is not None else _tolerance(plan)
    planned = _run(low, sample, loss_fn)
    exact = _run(reference, cast_tree(sample, fp32), loss_fn)
    rows = _compare(planned, exact, plan)
    _say_if_fp32_is_not_finite(rows, planned)
    first = next((r.name for r in rows if r.output_error > tol), None)
    first_grad = next((r.name for r in reversed(rows)
                       if r.grad_error is not None and r.grad_error > tol), None)
    return DiffReport(tuple(rows), tol, first, first_grad)
