"""FSDP2 and FSDP1 export: one sharded unit per plan boundary, each with its mixed-precision
policy.

FSDP's mixed precision is per unit: `param_dtype` (the dtype parameters are unsharded in, so
the compute dtype), `reduce_dtype` and `output_dtype`. What it does not do is cast at an fp32
unit's exit back into the bf16 code around it, or leave an fp32 side input (a rotary table)
alone. The plan's boundary casts (`apply`) do both, so these adapters apply the plan and then
shard along its boundaries.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from precision_annot._src import seams
from precision_annot._src.dtypes import dtype_name, widest
from precision_annot._src.findings import listing
from precision_annot._src.float8 import import_torchao
from precision_annot._src.guards import require_plan
from precision_annot._src.plan import PrecisionPlan, nearest, parent_name
from precision_annot._src.policy import autocast_mode
from precision_annot._src.runtime import apply, plan_of
from precision_annot._src.selectors import Selector, matcher
from precision_annot._src.wrappers import unwrap

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy
    from torch.distributed.fsdp.wrap import CustomPolicy

__all__ = ["MIXED_FIX", "Unit", "fully_shard", "masters_as_shards", "mixed_message",
           "mixed_precision", "mixed_units", "plan_name", "plan_units", "precompute_float8_scales",
           "selectors", "unit_names", "wrap_policy"]


def unit_names(
    plan: PrecisionPlan,
    model: nn.Module | None = None,
    units: Iterable[Selector] | None = None,
    *,
    merge_below: float | None = None,
    keep_dtype_in_unit: bool = False,
) -> list[str]:
    """Names of the modules to shard as units, children before parents, the root last.

    A unit is made at every boundary, wherever storage changes (FSDP flattens one dtype per
    unit), wherever comm changes on a module that holds parameters (FSDP reduces one dtype per
    unit), and at every module a selector in `units` picks (selectors as for `annotate`).
    With `merge_below`, a boundary holding less than that share of the parameters, stored in
    the dtype the unit around it is stored in, joins that unit instead: fewer collectives, but
    the unit is then gathered in the widest compute dtype among its members.

    With `keep_dtype_in_unit` (FSDP2 on torch 2.15 and later, whose
    `MixedPrecisionPolicy.param_dtype_override_fn` gathers chosen parameters in their own
    dtype), a boundary that computes in its storage dtype (an fp32 island in a bf16-mixed
    model) and is stored and reduced as the module around it makes no unit of its own.
    """
    chosen = _plan_units(plan, keep_dtype_in_unit)
    selected = _selected_units(model, units)
    chosen |= selected
    if merge_below is not None:
        _merge_small(plan, chosen, selected, merge_below)
    order = [n for n in plan if n in chosen]
    return sorted(order, key=lambda n: -(n.count(".") + 1 if n else 0))


def _plan_units(plan: PrecisionPlan, keep_dtype_in_unit: bool = False) -> set[str]:
    """The units the plan needs: the root, every boundary (but, with `keep_dtype_in_unit`,
    those gathered in their own storage dtype), every change of storage, and every change of
    comm on a module that holds parameters."""
    chosen = {""}
    ties = _tie_groups(plan) if keep_dtype_in_unit else []
    for name, entry in plan.items():
        if not name:
            continue
        policy, parent = entry.policy, plan[parent_name(name)].policy
        changes = (policy.storage != parent.storage
                   or (policy.comm != parent.comm and entry.params))
        if changes or (entry.boundary and not (keep_dtype_in_unit and _keeps(plan, name, ties))):
            chosen.add(name)
    return chosen


def _tie_groups(plan: PrecisionPlan) -> list[set[str]]:
    """The modules holding each parameter that several modules hold."""
    groups: dict[str, set[str]] = {}
    for name, entry in plan.items():
        for info in entry.own_params:
            if info.tied is not None:
                groups.setdefault(info.tied, {info.tied.rpartition(".")[0]}).add(name)
    return list(groups.values())


def _keeps(plan: PrecisionPlan, name: str, ties: list[set[str]]) -> bool:
    """A boundary the unit around it can hold: gathered in its storage dtype or its parent's
    compute, reduced as its parent (its members too: they inherit its comm), and sharing a
    parameter only with modules that need it in the same dtype (FSDP2 gathers a shared
    parameter once, in one dtype: an fp32 island tied to a bf16 embedding stays a unit of its
    own, which FSDP2 refuses, and `check` says so; two fp32 islands sharing a weight both stay
    in the unit around them)."""
    policy, parent = plan[name].policy, parent_name(name)
    needed = _needed(plan, name)
    inside = [g for g in ties if any(m == name or m.startswith(f"{name}.") for m in g)]
    return (all(_needed(plan, m) == needed for g in inside for m in g)
            and policy.grad_comm == plan[parent].policy.grad_comm
            and _gathered_as(plan, name) in (None, policy.storage, _gathered_as(plan, parent)))


def _needed(plan: PrecisionPlan, name: str) -> torch.dtype | None:
    """The dtype a module's parameters are gathered in for its forward: its compute, else its
    storage."""
    return _gathered_as(plan, name) or plan[name].policy.storage


def _gathered_as(plan: PrecisionPlan, name: str) -> torch.dtype | None:
    """The dtype a module's parameters must be gathered in for its forward: its compute dtype
    (None where it keeps its storage's); an Embedding's storage dtype under autocast.

    An Embedding computes nothing: it hands back rows of its weight, and autocast does not
    cast a lookup, so under `"bf16-mixed"` (bf16 compute over fp32 storage) its output is its
    fp32 rows, which the ops after it round where they compute (as `torch.autocast`, Lightning
    and the Hugging Face Trainer run it, and as `apply` does). Gathered in bf16, its lookup
    would hand back bf16 rows: a bf16 residual stream where one process keeps an fp32 one
    (gradients 1.1e-2 apart on 2 x 2 FSDP2 + TP)."""
    entry = plan[name]
    compute = entry.policy.compute
    if not isinstance(compute, torch.dtype):
        return None
    if _looked_up(plan, name):
        return entry.policy.storage
    return compute


def _looked_up(plan: PrecisionPlan, name: str) -> bool:
    """Whether a module is an Embedding under autocast: its lookup hands back its weight's
    rows in their storage dtype (`_gathered_as`)."""
    entry = plan[name]
    return (entry.has("embedding") and entry.policy.storage is not None
            and autocast_mode(entry.policy) == "autocast")


def selectors(units: Any, what: str) -> list[Selector]:
    """`units` as a list of selectors; a bare string (which would be read letter by letter) or
    a non-iterable is a `TypeError` naming `what`."""
    if isinstance(units, (str, bytes)) or not isinstance(units, Iterable):
        raise TypeError(
            f"{what} is a list of selectors as annotate takes them (module names or globs, "
            "module classes, predicates), e.g. ['blocks.*']. Received: "
            f"units={units!r} (of type {type(units).__name__})")
    return list(units)


def _selected_units(model: nn.Module | None, units: Iterable[Selector] | None) -> set[str]:
    """The modules the user's `units` selectors pick; each selector must pick one."""
    if units is None:
        return set()
    if model is None:
        raise ValueError("unit_names: selecting units needs the model.")
    named = list(model.named_modules())
    selected: set[str] = set()
    for selector in selectors(units, "fully_shard: units"):
        match = matcher(selector)
        hits = match.select(named, rule=f"fully_shard: units selector {match.label}")
        if not hits:
            raise ValueError(match.no_match(named, "fully_shard: units"))
        selected.update(n for n, _ in hits)
    return selected


def _merge_small(plan: PrecisionPlan, chosen: set[str], selected: set[str],
                 merge_below: float) -> None:
    """Fold each unit the plan chose that holds under `merge_below` of the parameters into
    the unit around it, innermost first, while the two hold one storage dtype together
    (FSDP flattens one dtype per unit). Units the user selected stay."""
    if (not isinstance(merge_below, (int, float)) or isinstance(merge_below, bool)
            or not 0 < merge_below < 1):
        raise ValueError(f"merge_below is a share of the parameters, between 0 and 1. "
                         f"Received: merge_below={merge_below!r} (of type "
                         f"{type(merge_below).__name__}); e.g. merge_below=0.01")
    total = sum(e.params for e in plan.values()) or 1
    owner_of = nearest(plan, chosen)
    held: dict[str, int] = {}
    stored: dict[str, set[str]] = {}
    for n, e in plan.items():  # what each unit holds, and in which dtypes
        unit = owner_of[n] or ""
        held[unit] = held.get(unit, 0) + e.params
        stored.setdefault(unit, set()).update(
            dtype_name(k) for k, b in e.param_dtype_bytes.items() if b)
    for name in sorted(chosen - selected - {""}, key=lambda n: -n.count(".")):
        owner = parent_name(name)
        while owner not in chosen:
            owner = parent_name(owner)
        together = stored.get(name, set()) | stored.get(owner, set())
        if held.get(name, 0) < merge_below * total and len(together) <= 1:
            chosen.discard(name)  # one dtype still: FSDP can flatten the merged unit
            held[owner] = held.get(owner, 0) + held.pop(name, 0)
            stored[owner] = together


@dataclasses.dataclass(frozen=True)
class Unit:
    """One FSDP unit of a plan.

    Attributes:
        name: the module sharded as the unit ("" for the root).
        members: the modules whose parameters it holds.
        params: those parameters' elements.
        storage: the dtypes they are stored in (FSDP needs exactly one).
        param_dtype: the dtype it is gathered in (None: its storage).
        reduce_dtype: the dtype its gradients are reduced in (None: its storage).
        output_dtype: the dtype its outputs leave in, from the plan's `output`.
        holders: the members that hold parameters.
        kept: the holders whose parameters it gathers in their own dtype, not `param_dtype`
            (FSDP2's `param_dtype_override_fn`, torch 2.15 and later).
    """

    name: str
    members: tuple[str, ...]
    params: int
    storage: frozenset[torch.dtype]
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    output_dtype: torch.dtype | None
    holders: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()


def plan_units(plan: PrecisionPlan, names: list[str], *, keep_dtype_in_unit: bool = False
               ) -> list[Unit]:
    """The units `names` make of the plan, in the order given: who is in each, and the dtypes
    it is gathered and reduced in (the widest its members need; with `keep_dtype_in_unit`,
    the unit's own compute, members that compute in their storage dtype kept in it)."""
    owner = nearest(plan, set(names))
    members: dict[str, list[str]] = {n: [] for n in names}
    for name in plan:
        members[owner[name] or ""].append(name)
    return [_unit(plan, name, members[name], keep_dtype_in_unit) for name in names]


def _kept(plan: PrecisionPlan, name: str, holders: list[str]) -> tuple[str, ...] | None:
    """The holders a unit gathering in its own compute keeps in their storage dtype, or None
    where one needs a third dtype (the unit is then gathered in the widest).

    An Embedding under autocast is not kept alone: its fp32 rows reach the modules beside it
    (a norm gathered in bf16 then refuses them on a CPU, "mixed dtype (CPU)"), so its unit is
    gathered in the widest, as one process holds them all."""
    own = _gathered_as(plan, name)
    kept = []
    for m in holders:
        if _looked_up(plan, m):
            return None
        needed = _gathered_as(plan, m)
        if needed is None or needed == own:
            continue
        if needed != plan[m].policy.storage:
            return None
        kept.append(m)
    return tuple(kept)


def _gather(plan: PrecisionPlan, name: str, holders: list[str], keep_dtype_in_unit: bool
            ) -> tuple[torch.dtype | None, tuple[str, ...]]:
    """The dtype a unit gathers in and the holders it keeps in their own: its own compute with
    the islands kept, where it may keep them; else the widest compute its holders need."""
    kept = _kept(plan, name, holders) if keep_dtype_in_unit else None
    if kept:
        return plan[name].policy.compute, kept
    return widest(_gathered_as(plan, m) for m in holders) or plan[name].policy.compute, ()


def _unit(plan: PrecisionPlan, name: str, members: list[str], keep_dtype_in_unit: bool = False
          ) -> Unit:
    """The unit at `name` holding `members`: gathered in the widest compute its holders need
    (None where that is its storage), or in its own compute with the others kept in their
    storage dtype; reduced in the widest comm."""
    holders = [m for m in members if plan[m].params]
    storage = frozenset(k for m in holders for k in plan[m].param_dtype_bytes)
    floating = [d for d in storage if d.is_floating_point]
    stored = floating[0] if len(floating) == 1 else plan[name].policy.storage
    gather, kept = _gather(plan, name, holders, keep_dtype_in_unit)
    return Unit(
        name=name,
        members=tuple(members),
        params=sum(plan[m].params for m in holders),
        storage=storage,
        param_dtype=None if gather is None or gather == stored else gather,
        reduce_dtype=(widest(plan[m].policy.grad_comm for m in holders)
                      or plan[name].policy.grad_comm),
        output_dtype=plan[name].policy.output,
        holders=tuple(holders),
        kept=kept,
    )


def mixed_units(units: list[Unit], plan: PrecisionPlan) -> list[tuple[Unit, str]]:
    """Units that would hold floating parameters of several dtypes (pytorch issue 156784),
    described ("FSDP expects uniform original parameter dtype"; integer ones it shards alone)."""
    out = []
    for unit in units:
        if len({d for d in unit.storage if d.is_floating_point}) > 1:
            by_dtype: dict[str, list[str]] = {}
            for m in unit.members:
                for key in plan[m].param_dtype_bytes:
                    if key.is_floating_point:
                        by_dtype.setdefault(dtype_name(key), []).append(m)
            detail = "; ".join(f"{d}: {ns}" for d, ns in by_dtype.items())
            out.append((unit, detail))
    return out


MIXED_FIX = "Make each group its own unit with units=[...], or give them one storage dtype."


def mixed_message(detail: str) -> str:
    return (f"would hold parameters of several dtypes ({detail}), and FSDP flattens one dtype "
            "per unit.")


def _own_dtype(kept: frozenset[int], param: nn.Parameter) -> torch.dtype | None:
    """FSDP2's `param_dtype_override_fn`: a kept parameter is gathered in its own dtype."""
    return param.dtype if id(param) in kept else None


def _mp2(unit: Unit, named: dict[str, nn.Module]) -> MixedPrecisionPolicy:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    override: dict[str, Any] = {}
    if unit.kept:
        kept = frozenset(id(p) for m in unit.kept for p in named[m].parameters(recurse=False))
        override["param_dtype_override_fn"] = functools.partial(_own_dtype, kept)
    return MixedPrecisionPolicy(
        param_dtype=unit.param_dtype,
        reduce_dtype=unit.reduce_dtype,
        output_dtype=unit.output_dtype,
        cast_forward_inputs=False,  # the plan's boundaries cast, honouring keep_dtype
        **override,
    )


def fully_shard(
    model: nn.Module,
    plan: PrecisionPlan | None = None,
    *,
    units: Iterable[Selector] | None = None,
    merge_below: float | None = None,
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """Apply the plan, then FSDP2-shard one unit per boundary (and per selected unit), root last.

    Each unit gets `MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=comm,
    output_dtype=output, cast_forward_inputs=False)`: inputs are cast by the plan's boundaries,
    so `keep_dtype` arguments such as rotary tables keep their dtype. On torch 2.15 and later
    an island computing in its storage dtype (an fp32 norm in a bf16-mixed model) stays in the
    unit around it, its parameters gathered in fp32 through the policy's
    `param_dtype_override_fn`: 3 collectives a step fewer per island. The unit holding an
    Embedding under autocast is gathered in its storage dtype: a lookup hands back its rows
    uncast, as in one process. A module with a master copy (`storage=bf16,master=fp32`) is
    sharded in the master's dtype and gathered in its storage's: the fp32 shards are the
    masters, and `precision_annot.optimizer` (or any optimizer) steps them; its `optim` states
    (torchao's low-bit ones included) live on the shards.

    Args:
        model: the model, on its device, not yet sharded.
        plan: the plan; resolved from `model` when None. (Default: None)
        units: extra units, by the selectors `annotate` takes, e.g. `[Block]`. (Default: None)
        merge_below: let boundaries holding less than this share of the parameters (stored
            like the unit around them) share that unit: 3 collectives fewer per step each, for
            gathering that unit in the widest compute dtype of its members. `check(model,
            "fsdp")` says when it pays. (Default: None, every boundary its own unit)
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
    model = unwrap(model)
    plan = plan_of(model) if plan is None else plan
    plan, gathered = masters_as_shards(plan)
    if not seams.FSDP2_GRAD_DTYPE:
        _refuse_wide_grads(plan)
    apply(model, plan)
    keep = seams.FSDP2_KEEPS_PARAM_DTYPE
    names = unit_names(plan, model, units, merge_below=merge_below, keep_dtype_in_unit=keep)
    shards = [dataclasses.replace(u, param_dtype=u.param_dtype or _gathered_in(u, gathered))
              for u in plan_units(plan, names, keep_dtype_in_unit=keep)]
    for unit, detail in mixed_units(shards, plan)[:1]:
        raise ValueError(f"FSDP unit {unit.name or '(root)'!r} {mixed_message(detail)} "
                         f"{MIXED_FIX}")
    named = dict(model.named_modules())
    for unit in shards:
        _fully_shard(named[unit.name], mp_policy=_mp2(unit, named), **fully_shard_kwargs)
    if seams.FSDP2_TP_REDUCE_DTYPE:
        _native_tp_reduction(shards, named)
    return model


def _native_tp_reduction(shards: list[Unit], named: dict[str, nn.Module]) -> None:
    """From torch 2.15 FSDP2 all-reduces a tensor-parallel replicated parameter's partial
    gradient in its unit's reduce dtype: where that is the module's planned comm, the hook
    `adapters.tp.parallelize_module` put there to do it is turned off."""
    import sys

    grads = sys.modules.get("precision_annot.adapters.tp.grads")
    if grads is None:  # nothing was parallelized
        return
    for unit in shards:
        for member in unit.members:
            grads.leave_to_fsdp2(named[member], unit.reduce_dtype)


def _refuse_wide_grads(plan: PrecisionPlan) -> None:
    """FSDP2 before torch 2.15 keeps each gradient shard in its parameter shard's dtype (and
    accumulates the unsharded gradients of `set_requires_gradient_sync(False)` micro-batches
    in the unit's reduce dtype): a `grad` wider than the shards cannot be kept. With a master
    it is: the shards are then the fp32 masters and their gradients fp32. From 2.15 FSDP2
    keeps each parameter's `grad_dtype`, which `apply` sets."""
    wide = [n for n, e in plan.items() if e.params and e.policy.accumulates]
    if wide:
        policy = plan[wide[0]].policy
        grad, storage = dtype_name(cast(torch.dtype, policy.grad)), dtype_name(
            cast(torch.dtype, policy.storage))
        raise ValueError(
            f"fully_shard: the plan accumulates gradients in {grad} over {storage} storage "
            f"without a master for {len(wide)} module(s) ({listing(wide, 3)}), and FSDP2 keeps "
            f"each gradient shard in its parameter shard's dtype ({storage}): the accumulation "
            f"would be {storage}, silently. Plan master={grad} for them too (the shards are "
            f"then the masters, and their gradients {grad}), or leave grad unset.")


def masters_as_shards(plan: PrecisionPlan) -> tuple[PrecisionPlan, dict[str, torch.dtype]]:
    """FSDP2 keeps each parameter's shard apart from the copy it gathers, so a master copy
    needs no third tensor: a module with `master` wider than `storage` is sharded in the master
    dtype and gathered in its storage dtype (`storage=bf16,master=fp32`: fp32 shards gathered
    in bf16, the optimizer stepping the shards). Returns the plan FSDP runs and, per such
    module, the dtype its parameters are gathered in."""
    changed = {n: dataclasses.replace(e.policy, storage=cast(torch.dtype, e.policy.master))
               for n, e in plan.items() if e.policy.copies_master}
    if not changed:
        return plan, {}
    gathered = {n: plan[n].policy.storage for n in changed}
    return plan.with_policies(changed), {n: d for n, d in gathered.items() if d is not None}


def _gathered_in(unit: Unit, gathered: dict[str, torch.dtype]) -> torch.dtype | None:
    """The dtype a unit gathers in when its members' masters are its shards (the narrowest
    storage among them: what their forwards were planned to see)."""
    dtypes = {gathered[m] for m in unit.holders if m in gathered}
    return next(iter(dtypes)) if len(dtypes) == 1 else None


def precompute_float8_scales(model: nn.Module) -> None:
    """After each optimizer step, when modules with comm=fp8 are sharded by `fully_shard`:
    compute the fp8 scales of all their weights in one all-reduce (torchao's
    `precompute_float8_dynamic_scale_for_fsdp`), instead of one all-reduce per weight at its
    next all-gather. The values are the same either way; it saves collectives.

    Example:
        >>> # loss.backward(); optimizer.step()
        >>> # fsdp.precompute_float8_scales(model)
    """
    fsdp_utils = import_torchao("torchao.float8.fsdp_utils", "precompute_float8_scales")
    fsdp_utils.precompute_float8_dynamic_scale_for_fsdp(unwrap(model))


def _mp1(unit: Unit) -> MixedPrecision:
    from torch.distributed.fsdp import MixedPrecision

    return MixedPrecision(
        param_dtype=unit.param_dtype,
        reduce_dtype=unit.reduce_dtype,
        buffer_dtype=None,
        cast_forward_inputs=False,
        cast_root_forward_inputs=False,
    )


def mixed_precision(plan: PrecisionPlan, *, merge_below: float | None = None) -> MixedPrecision:
    """FSDP1's root `MixedPrecision` for the plan: param_dtype=compute, reduce_dtype=comm."""
    require_plan(plan, "mixed_precision")
    return _mp1(plan_units(plan, unit_names(plan, merge_below=merge_below))[-1])


_WRAPPER_PARTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def plan_name(name: str) -> str:
    """A module's name with the wrapper levels FSDP1 and activation checkpointing add left out."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def wrap_policy(plan: PrecisionPlan, *, merge_below: float | None = None) -> CustomPolicy:
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
    shards = {u.name: u for u in plan_units(plan, unit_names(plan, merge_below=merge_below))}
    units = set(shards)

    class PlanPolicy(CustomPolicy):
        """Looks modules up by name in the root FSDP is given."""

        def __init__(self) -> None:
            self.names: dict[nn.Module, str] = {}
            super().__init__(self.lookup)

        def lookup(self, module: nn.Module) -> bool | dict[str, Any]:
            name = self.names.get(module)
            if name is None or name not in units:
                return False
            return {"mixed_precision": _mp1(shards[name])}

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
