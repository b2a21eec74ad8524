"""Each module run alone in the low dtype on its recorded inputs: the sensitivity table."""

from __future__ import annotations

import copy
import dataclasses
import math

import torch
from torch import nn

from precision_annot._src.dtypes import fp16
from precision_annot._src.plan import PrecisionPlan
from precision_annot._src.policy import Policy
from precision_annot._src.runtime import apply
from precision_annot._src.suggest.compare import relative_error
from precision_annot._src.suggest.constants import FP16_SMALLEST, SEED
from precision_annot._src.suggest.plans import runnable_copy, uniform_plan
from precision_annot._src.suggest.progress import Progress
from precision_annot._src.suggest.records import Reference
from precision_annot._src.suggest.report import Sensitivity
from precision_annot._src.suggest.watch import Watch
from precision_annot._src.tracking import ModuleTracker


def measure_modules(reference: nn.Module, ref: Reference, structure: PrecisionPlan,
                    policy: Policy, scale: float, progress: Progress,
                    eligible: set[str] | None = None) -> list[Sensitivity]:
    """Each module that ran in the fp32 reference (and is `eligible`), run alone in `policy`
    on its recorded inputs: the table, most sensitive first."""
    named = dict(reference.named_modules())
    todo = [n for n in ref.inputs if n and not structure[n].container and n in named
            and (eligible is None or n in eligible)]
    table = []
    for i, name in enumerate(todo):
        progress.update("measuring modules", i, len(todo))
        table.append(_sensitivity(named[name], name, ref, structure, policy, scale))
    progress.done()
    return sorted(table, key=lambda s: -s.score)


def _sensitivity(module: nn.Module, name: str, ref: Reference, structure: PrecisionPlan,
                 policy: Policy, scale: float) -> Sensitivity:
    low = policy.compute
    assert low is not None
    error, nonfinite = _alone(module, name, ref, structure, policy)
    grads = [ref.grads[f"{name}.{p}"] for p, _ in module.named_parameters(recurse=False)
             if f"{name}.{p}" in ref.grads]
    peak = ref.peaks.get(name, 0.0)
    return Sensitivity(
        name=name, type=type(module).__name__,
        params=sum(p.numel() for p in module.parameters()),
        error=error, nonfinite=nonfinite, peak=peak, headroom=peak / torch.finfo(low).max,
        grad_peak=max((float(g.abs().max()) for g in grads if g.numel()), default=None),
        underflow=_underflow(grads, scale) if grads and low == fp16 else None,
    )


def _underflow(grads: list[torch.Tensor], scale: float) -> float:
    """The share of nonzero gradient elements that flush to zero in fp16 at `scale`."""
    nonzero = sum(int((g != 0).sum()) for g in grads)
    under = sum(int(((g != 0) & (g.abs() * scale < FP16_SMALLEST)).sum()) for g in grads)
    return under / nonzero if nonzero else 0.0


def _alone(module: nn.Module, name: str, ref: Reference, structure: PrecisionPlan,
           policy: Policy) -> tuple[float, bool]:
    """Run a copy of `module` by itself in `policy` on its recorded inputs."""
    prefix = f"{name}."
    sub_structure = PrecisionPlan(
        {n.removeprefix(prefix) if n != name else "": dataclasses.replace(
            e, name=n.removeprefix(prefix) if n != name else "")
         for n, e in structure.items() if n == name or n.startswith(prefix)},
        model_type=type(module).__qualname__)
    args, kwargs = ref.inputs[name]
    try:
        sub = runnable_copy(module, policy)
        apply(sub, uniform_plan(sub_structure, policy))
        names = {m: n for n, m in sub.named_modules()}
        tracker = ModuleTracker(names)
        baseline = {(n.removeprefix(prefix) if n != name else "", phase): count
                    for (n, phase), count in ref.nonfinite.items()
                    if n == name or n.startswith(prefix)}
        mode = Watch(tracker, baseline=baseline)
        with torch.no_grad(), tracker, mode:
            torch.manual_seed(SEED)
            out = sub(*copy.deepcopy(args), **copy.deepcopy(kwargs))
    except Exception:
        return math.nan, False
    if name not in ref.outputs:
        return math.nan, mode.first_nonfinite is not None
    return relative_error(out, ref.outputs[name]), mode.first_nonfinite is not None
