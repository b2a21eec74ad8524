"""FSDP2 and FSDP1: one sharded unit per plan boundary, each with its mixed-precision policy.

FSDP's mixed precision is per unit: `param_dtype` (the dtype parameters are unsharded in, so
the compute dtype), `reduce_dtype` and `output_dtype`. What it does not do is cast at an fp32
unit's exit back into the bf16 code around it, or leave an fp32 side input (a rotary table)
alone. The plan's boundary casts (`apply`) do both, so these adapters apply the plan and then
shard along its boundaries.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from precision_annot.dtypes import dtype_name
from precision_annot.guards import require_plan
from precision_annot.plan import ModulePlan, PrecisionPlan, nearest, parent_name
from precision_annot.resolution import resolve
from precision_annot.runtime import apply
from precision_annot.selectors import Selector, matcher

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy
    from torch.distributed.fsdp.wrap import CustomPolicy

__all__ = ["fully_shard", "mixed_precision", "unit_names", "wrap_policy"]


def _same_or_none(value: torch.dtype | None, base: torch.dtype | None) -> torch.dtype | None:
    return None if value is None or value == base else value


def unit_names(
    plan: PrecisionPlan, model: nn.Module | None = None, units: Iterable[Selector] | None = None
) -> list[str]:
    """Names of the modules to shard as units, children before parents, the root last.

    A unit is made at every boundary, wherever storage changes (FSDP flattens one dtype per
    unit), and at every module a selector in `units` picks (selectors as for `annotate`).
    """
    chosen = {""}
    for name, entry in plan.items():
        if not name:
            continue
        parent = plan[parent_name(name)]
        if entry.boundary or entry.policy.storage != parent.policy.storage:
            chosen.add(name)
    if units is not None:
        if model is None:
            raise ValueError("unit_names: selecting units needs the model.")
        named = list(model.named_modules())
        for selector in units:
            match = matcher(selector)
            hits = match.select(named, rule=f"fully_shard: units selector {match.label}")
            if not hits:
                raise ValueError(match.no_match(named, "fully_shard: units"))
            chosen.update(n for n, _ in hits)
    order = [n for n in plan if n in chosen]
    return sorted(order, key=lambda n: -(n.count(".") + 1 if n else 0))


def _check_uniform(plan: PrecisionPlan, model: nn.Module, units: list[str]) -> None:
    """Each unit flattens its parameters in one dtype (pytorch issue 156784): check that."""
    owner = nearest(plan, set(units))
    per_unit: dict[str, dict[torch.dtype, list[str]]] = {}
    named = dict(model.named_modules())
    for name in plan:
        for p in named[name].parameters(recurse=False):
            per_unit.setdefault(owner[name] or "", {}).setdefault(p.dtype, []).append(name)
    for unit, by_dtype in per_unit.items():
        if len(by_dtype) > 1:
            detail = "; ".join(f"{dtype_name(d)}: {sorted(set(ns))}" for d, ns in by_dtype.items())
            raise ValueError(
                f"FSDP unit {unit or '(root)'!r} would hold parameters of several dtypes "
                f"({detail}); FSDP flattens one dtype per unit. Make each group its own unit "
                "with units=[...], or give them one storage dtype."
            )


def _mp2(entry: ModulePlan) -> MixedPrecisionPolicy:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    p = entry.policy
    return MixedPrecisionPolicy(
        param_dtype=_same_or_none(p.compute, p.storage),
        reduce_dtype=p.comm,
        output_dtype=p.output,
        cast_forward_inputs=False,  # the plan's boundaries cast, honouring keep_dtype
    )


def fully_shard(
    model: nn.Module,
    plan: PrecisionPlan | None = None,
    *,
    units: Iterable[Selector] | None = None,
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """Apply the plan, then FSDP2-shard one unit per boundary (and per selected unit), root last.

    Each unit gets `MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=comm,
    output_dtype=output, cast_forward_inputs=False)`: inputs are cast by the plan's boundaries,
    so `keep_dtype` arguments such as rotary tables keep their dtype.

    Args:
        model: the model, on its device, not yet sharded.
        plan: the plan; resolved from `model` when None. (Default: None)
        units: extra units, by the selectors `annotate` takes, e.g. `[Block]`. (Default: None)
        **fully_shard_kwargs: passed to every `fully_shard` call (`mesh`,
            `reshard_after_forward`, ...); `mp_policy` comes from the plan.

    Returns:
        `model`, sharded.
    """
    from torch.distributed.fsdp import fully_shard as _fully_shard

    if "mp_policy" in fully_shard_kwargs:
        raise ValueError(
            "fully_shard: mp_policy comes from the plan; set compute/comm/output with "
            "precision(...) instead. Received: mp_policy="
            f"{fully_shard_kwargs['mp_policy']!r}"
        )
    plan = resolve(model) if plan is None else plan
    apply(model, plan)
    names = unit_names(plan, model, units)
    _check_uniform(plan, model, names)
    named = dict(model.named_modules())
    for name in names:
        _fully_shard(named[name], mp_policy=_mp2(plan[name]), **fully_shard_kwargs)
    return model


def _mp1(entry: ModulePlan) -> MixedPrecision:
    from torch.distributed.fsdp import MixedPrecision

    p = entry.policy
    return MixedPrecision(
        param_dtype=_same_or_none(p.compute, p.storage),
        reduce_dtype=p.comm,
        buffer_dtype=None,
        cast_forward_inputs=False,
        cast_root_forward_inputs=False,
    )


def mixed_precision(plan: PrecisionPlan) -> MixedPrecision:
    """FSDP1's root `MixedPrecision` for the plan: param_dtype=compute, reduce_dtype=comm."""
    require_plan(plan, "mixed_precision")
    return _mp1(plan.root)


_WRAPPER_PARTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def plan_name(name: str) -> str:
    """A module's name with the wrapper levels FSDP1 and activation checkpointing add left out."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def wrap_policy(plan: PrecisionPlan) -> CustomPolicy:
    """FSDP1's auto-wrap policy: one unit per boundary or storage change, each with its
    `MixedPrecision`. Call `apply(model, plan)` before wrapping, so boundaries cast.

    Units are matched by qualified name in the model FSDP wraps, so the policy works on a copy
    of the planned model, a second instance, or with a plan loaded from JSON.

    Example:
        >>> from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # doctest: +SKIP
        >>> apply(model, plan)  # doctest: +SKIP
        >>> FSDP(model, auto_wrap_policy=fsdp.wrap_policy(plan),  # doctest: +SKIP
        ...      mixed_precision=fsdp.mixed_precision(plan))
    """
    from torch.distributed.fsdp.wrap import CustomPolicy

    require_plan(plan, "wrap_policy")
    units = set(unit_names(plan))

    class PlanPolicy(CustomPolicy):
        """Looks modules up by name in the root FSDP is given."""

        def __init__(self) -> None:
            self.names: dict[nn.Module, str] = {}
            super().__init__(self.lookup)

        def lookup(self, module: nn.Module) -> bool | dict[str, Any]:
            name = self.names.get(module)
            if name is None or name not in units:
                return False
            return {"mixed_precision": _mp1(plan[name])}

        def _run_policy(self, root_module: nn.Module, ignored_modules: set[nn.Module],
                        root_kwargs: dict[str, Any]) -> dict[nn.Module, dict[str, Any]]:
            self.names = {m: plan_name(n) for n, m in root_module.named_modules()}
            missing = sorted(units - set(self.names.values()))
            if missing:
                raise ValueError(
                    f"wrap_policy: the plan ({plan.model_type or 'model'}) does not match the "
                    f"model FSDP wraps ({type(root_module).__name__}): no module named "
                    f"{', '.join(repr(n) for n in missing[:5])}."
                )
            return super()._run_policy(root_module, ignored_modules, root_kwargs)

    return PlanPolicy()
