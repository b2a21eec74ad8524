"""FSDP2 and FSDP1: one sharded unit per plan boundary, each with its mixed-precision policy.

FSDP's mixed precision is per unit: `param_dtype` (the dtype parameters are unsharded in, so
the compute dtype), `reduce_dtype` and `output_dtype`. What it does not do is cast at an fp32
unit's exit back into the bf16 code around it, or leave an fp32 side input (a rotary table)
alone. The plan's boundary casts (`apply`) do both, so these adapters apply the plan and then
shard along its boundaries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from precision_annot._src.dtypes import dtype_name, widest
from precision_annot._src.findings import Finding, drift, listing
from precision_annot._src.float8 import import_torchao
from precision_annot._src.guards import require_plan
from precision_annot._src.plan import PrecisionPlan, TensorInfo, nearest, parent_name
from precision_annot._src.runtime import apply, plan_of
from precision_annot._src.selectors import Selector, matcher
from precision_annot._src.tables import human_bytes
from precision_annot._src.wrappers import unwrap

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy
    from torch.distributed.fsdp.wrap import CustomPolicy

__all__ = ["CollectiveCost", "Unit", "UnitCost", "collective_cost", "findings", "fully_shard",
           "mixed_precision", "plan_units", "precompute_float8_scales", "reduced",
           "unit_names", "wrap_policy"]


def unit_names(
    plan: PrecisionPlan,
    model: nn.Module | None = None,
    units: Iterable[Selector] | None = None,
    *,
    merge_below: float | None = None,
) -> list[str]:
    """Names of the modules to shard as units, children before parents, the root last.

    A unit is made at every boundary, wherever storage changes (FSDP flattens one dtype per
    unit), wherever comm changes on a module that holds parameters (FSDP reduces one dtype per
    unit), and at every module a selector in `units` picks (selectors as for `annotate`).
    With `merge_below`, a boundary holding less than that share of the parameters, stored in
    the dtype the unit around it is stored in, joins that unit instead: fewer collectives, but
    the unit is then gathered in the widest compute dtype among its members.
    """
    chosen = _plan_units(plan)
    selected = _selected_units(model, units)
    chosen |= selected
    if merge_below is not None:
        _merge_small(plan, chosen, selected, merge_below)
    order = [n for n in plan if n in chosen]
    return sorted(order, key=lambda n: -(n.count(".") + 1 if n else 0))


def _plan_units(plan: PrecisionPlan) -> set[str]:
    """The units the plan needs: the root, every boundary, every change of storage, and
    every change of comm on a module that holds parameters."""
    chosen = {""}
    for name, entry in plan.items():
        if not name:
            continue
        parent = plan[parent_name(name)]
        if (entry.boundary or entry.policy.storage != parent.policy.storage
                or (entry.policy.comm != parent.policy.comm and entry.params)):
            chosen.add(name)
    return chosen


def _selected_units(model: nn.Module | None, units: Iterable[Selector] | None) -> set[str]:
    """The modules the user's `units` selectors pick; each selector must pick one."""
    if units is None:
        return set()
    if model is None:
        raise ValueError("unit_names: selecting units needs the model.")
    named = list(model.named_modules())
    selected: set[str] = set()
    for selector in units:
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
    """

    name: str
    members: tuple[str, ...]
    params: int
    storage: frozenset[torch.dtype]
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    output_dtype: torch.dtype | None
    holders: tuple[str, ...] = ()


def plan_units(plan: PrecisionPlan, names: list[str]) -> list[Unit]:
    """The units `names` make of the plan, in the order given: who is in each, and the dtypes
    it is gathered and reduced in (the widest its members need)."""
    owner = nearest(plan, set(names))
    members: dict[str, list[str]] = {n: [] for n in names}
    for name in plan:
        members[owner[name] or ""].append(name)
    return [_unit(plan, name, members[name]) for name in names]


def _unit(plan: PrecisionPlan, name: str, members: list[str]) -> Unit:
    """The unit at `name` holding `members`: gathered in the widest compute its holders need
    (None where that is its storage), reduced in the widest comm."""
    holders = [m for m in members if plan[m].params]
    storage = frozenset(k for m in holders for k in plan[m].param_dtype_bytes)
    floating = [d for d in storage if d.is_floating_point]
    stored = floating[0] if len(floating) == 1 else plan[name].policy.storage
    gather = widest(plan[m].policy.compute for m in holders) or plan[name].policy.compute
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
    )


def _mixed(units: list[Unit], plan: PrecisionPlan) -> list[tuple[Unit, str]]:
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


def _mixed_message(detail: str) -> str:
    return (f"would hold parameters of several dtypes ({detail}), and FSDP flattens one dtype "
            "per unit.")


def _mp2(unit: Unit) -> MixedPrecisionPolicy:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=unit.param_dtype,
        reduce_dtype=unit.reduce_dtype,
        output_dtype=unit.output_dtype,
        cast_forward_inputs=False,  # the plan's boundaries cast, honouring keep_dtype
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
    so `keep_dtype` arguments such as rotary tables keep their dtype. A module with a master
    copy (`storage=bf16,master=fp32`) is sharded in the master's dtype and gathered in its
    storage's: the fp32 shards are the masters, and `precision_annot.optimizer` (or any
    optimizer) steps them; its `optim` states (torchao's low-bit ones included) live on the
    shards.

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
    _refuse_wide_grads(plan)
    apply(model, plan)
    shards = [dataclasses.replace(u, param_dtype=u.param_dtype or _gathered_in(u, gathered))
              for u in plan_units(plan, unit_names(plan, model, units, merge_below=merge_below))]
    for unit, detail in _mixed(shards, plan)[:1]:
        raise ValueError(f"FSDP unit {unit.name or '(root)'!r} {_mixed_message(detail)} "
                         f"{MIXED_FIX}")
    named = dict(model.named_modules())
    for unit in shards:
        _fully_shard(named[unit.name], mp_policy=_mp2(unit), **fully_shard_kwargs)
    return model


def _refuse_wide_grads(plan: PrecisionPlan) -> None:
    """FSDP2 keeps each gradient shard in its parameter shard's dtype (and accumulates the
    unsharded gradients of `set_requires_gradient_sync(False)` micro-batches in the unit's
    reduce dtype): a `grad` wider than the shards cannot be kept. With a master it is: the
    shards are then the fp32 masters and their gradients fp32."""
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


# -- what the units cost ------------------------------------------------------------------------

#: The cost model's constants: one collective's fixed latency, and the bus bandwidth per rank.
#: Typical of 8 GPUs on one NVLink node; across nodes latency is higher and bandwidth lower.
LATENCY_S = 10e-6
BANDWIDTH = 100e9
#: `findings` reports when at least SMALL_UNITS units each hold less than SMALL_UNIT of the
#: parameters.
SMALL_UNIT = 0.01
SMALL_UNITS = 4


@dataclasses.dataclass(frozen=True)
class UnitCost:
    """One unit's collectives per step: `gathers` all-gathers of `gather_bytes` each, one
    reduce-scatter of `reduce_bytes`, and their estimated `seconds`."""

    unit: Unit
    gathers: int
    gather_bytes: int
    reduce_bytes: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
    """The collectives one training step of the sharded plan issues, and an estimate of their
    time: each costs `latency_s + bytes / bandwidth`.

    Attributes:
        units: per unit that holds parameters: all-gathers per step (2: forward and backward;
            1 for the root, which FSDP keeps gathered between forward and backward), the bytes
            each gather and the reduce-scatter move, and the estimated seconds.
        gathers: all-gathers per step.
        reduce_scatters: reduce-scatters per step (one per unit).
        seconds: the estimated total.
    """

    units: tuple[UnitCost, ...]
    gathers: int
    reduce_scatters: int
    seconds: float

    @property
    def collectives(self) -> int:
        """All-gathers and reduce-scatters per step."""
        return self.gathers + self.reduce_scatters

    @property
    def bytes(self) -> int:
        """The bytes of the tensors one step's collectives gather and reduce (a ring moves
        (N - 1) / N of them per rank)."""
        return sum(c.gathers * c.gather_bytes + c.reduce_bytes for c in self.units)


def _itemsize(dtype: torch.dtype | None, unit: Unit) -> int:
    if dtype is not None:
        return dtype.itemsize
    floating = [d for d in unit.storage if d.is_floating_point]
    return floating[0].itemsize if len(floating) == 1 else 4


def collective_cost(plan: PrecisionPlan, names: list[str] | None = None, *,
                    latency_s: float = LATENCY_S, bandwidth: float = BANDWIDTH,
                    merge_below: float | None = None) -> CollectiveCost:
    """Count the collectives one training step of `fully_shard(model, plan)` issues, and
    estimate their time with a latency-plus-bandwidth model.

    Every unit that holds parameters all-gathers twice (forward, and backward after
    resharding; the root once, as FSDP keeps it unsharded) and reduce-scatters once. Each
    collective takes `latency_s + bytes / bandwidth`, with the bytes of the unsharded tensor in
    the dtype it is gathered or reduced in. Overlap with compute is not modelled.

    Args:
        plan: the plan to shard.
        names: the units, as `unit_names` gives them; by default the plan's boundaries (with
            `merge_below`). (Default: None)
        latency_s: one collective's fixed cost in seconds. (Default: `LATENCY_S`, 10 us)
        bandwidth: bytes per second. (Default: `BANDWIDTH`, 100e9, one NVLink node)
        merge_below: as for `fully_shard`. (Default: None)

    Returns:
        A `CollectiveCost`: per unit and in total.
    """
    require_plan(plan, "collective_cost")
    if not latency_s >= 0 or not bandwidth > 0:
        raise ValueError("collective_cost: latency_s must be >= 0 and bandwidth > 0. "
                         f"Received: latency_s={latency_s!r}, bandwidth={bandwidth!r}")
    shards = plan_units(plan, names or unit_names(plan, merge_below=merge_below))
    costs = []
    for unit in shards:
        if not unit.params:
            continue
        gathers = 1 if not unit.name else 2
        gather_bytes = unit.params * _itemsize(unit.param_dtype, unit)
        reduce_bytes = unit.params * _itemsize(unit.reduce_dtype, unit)
        seconds = (gathers * (latency_s + gather_bytes / bandwidth)
                   + latency_s + reduce_bytes / bandwidth)
        costs.append(UnitCost(unit, gathers, gather_bytes, reduce_bytes, seconds))
    return CollectiveCost(tuple(costs), sum(c.gathers for c in costs), len(costs),
                          sum(c.seconds for c in costs))


def reduced(plan: PrecisionPlan, names: list[str]) -> dict[str, torch.dtype]:
    """What FSDP reduces each parameter-holding module's gradients in, sharded into the units
    `names` (as `unit_names` gives them): its unit's reduce dtype, the widest comm of the
    unit's members (its storage where none sets one)."""
    return _reduced(plan_units(plan, names), plan)


def _reduced(units: list[Unit], plan: PrecisionPlan | None = None) -> dict[str, torch.dtype]:
    out: dict[str, torch.dtype] = {}
    for unit in units:
        floating = [d for d in unit.storage if d.is_floating_point]
        dtype = unit.reduce_dtype or (floating[0] if len(floating) == 1 else None)
        if dtype is None:
            continue
        for member in unit.holders:
            out[member] = dtype
    return out


def _fix(backend: str) -> str:
    if backend == "fsdp":
        return "precision_annot.adapters.fsdp.fully_shard(model, units=[...])"
    return ("FullyShardedDataParallel(model, auto_wrap_policy=fsdp.wrap_policy(plan), "
            "mixed_precision=fsdp.mixed_precision(plan), device_id=torch.device('cpu'))")


def sharded_units(plan: PrecisionPlan, model: nn.Module) -> list[Unit] | None:
    """The units a model already sharded (by FSDP2's `fully_shard` or FSDP1's wrapper, ours or
    the user's own) really has, with the dtypes its `MixedPrecisionPolicy` (or FSDP1's
    `MixedPrecision`) really gathers and reduces in; None for a model not sharded yet.

    NOTE: reads the mixed-precision settings FSDP keeps on each unit: FSDP2's state
    (`_get_fsdp_state()._mp_policy`, no public getter) and FSDP1's `mixed_precision`."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    live: dict[str, tuple[torch.dtype | None, torch.dtype | None, torch.dtype | None]] = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            mp = module._get_fsdp_state()._mp_policy
            live[plan_name(name)] = (mp.param_dtype, mp.reduce_dtype, mp.output_dtype)
        elif isinstance(module, FullyShardedDataParallel):
            mp1 = module.mixed_precision
            live[plan_name(name)] = (mp1.param_dtype, mp1.reduce_dtype, None)
    if not live:
        return None
    names = sorted((n for n in live if n in plan), key=lambda n: -(n.count(".") + 1 if n else 0))
    if "" not in names:
        names.append("")  # what no unit holds stays with the root, unsharded
    out = []
    for unit in plan_units(plan, names):
        gather, reduce, output = live.get(unit.name, (None, None, None))
        out.append(dataclasses.replace(unit, param_dtype=gather,
                                       reduce_dtype=reduce or gather, output_dtype=output))
    return out


def findings(plan: PrecisionPlan, backend: str = "fsdp", *, model: nn.Module | None = None,
             units: Iterable[Selector] | None = None, merge_below: float | None = None,
             latency_s: float = LATENCY_S, bandwidth: float = BANDWIDTH,
             use_orig_params: bool = False) -> list[Finding]:
    """What FSDP (2, or 1 with backend="fsdp1") will refuse, narrow, widen or run badly for
    this plan, sharded as `fully_shard(model, plan, units=units, merge_below=merge_below)` (or
    `wrap_policy` and `mixed_precision`) would shard it, or, for a `model` already sharded, as
    it is sharded (its units and their mixed-precision settings, whoever chose them). Tied
    and frozen parameters are read off the plan; `use_orig_params` is FSDP1's."""
    require_plan(plan, "findings")
    model = model if model is not None else plan.module("")
    units = None if units is None else list(units)
    live = sharded_units(plan, model) if model is not None else None
    names = [u.name for u in live] if live is not None else unit_names(
        plan, model, units, merge_below=merge_below)
    shards = live if live is not None else plan_units(plan, names)
    out = [Finding("error", "fsdp-mixed-unit", unit.name,
                   f"This FSDP unit {_mixed_message(detail)} FSDP refuses it at the first "
                   "forward (\"FSDP expects uniform original parameter dtype\").", MIXED_FIX)
           for unit, detail in _mixed(shards, plan)]
    if backend == "fsdp1":
        out += _integer_parameters(plan, shards)
    out += _tied_across_units(plan, shards, backend)
    if backend == "fsdp1":
        out += _frozen_beside_trainable(plan, shards, use_orig_params)
    where = "FSDP2" if backend == "fsdp" else "FSDP1"
    if live is not None:
        out += _gathered(plan, live, where)
    out += drift(plan, "comm", _reduced(shards), code="fsdp-unit-comm", backend=where,
                 cause="FSDP reduces each unit's gradients in one dtype, "
                       + ("its reduce_dtype (else its param_dtype)" if live is not None else
                          "the widest comm of the unit's members"),
                 fix=f"Make each of them a unit of its own: {_fix(backend)}"
                 " with units naming them, or give the unit one comm dtype.")
    if live is None:
        out += _small_units(plan, model, units, names, backend, latency_s, bandwidth)
    return out


def _gathered(plan: PrecisionPlan, live: list[Unit], where: str) -> list[Finding]:
    """A sharded unit that gathers its parameters in another dtype than its members compute
    in: narrower, the members planned wider see narrow weights (an fp32 island's forward
    raises a DriftError: its parameters are no longer in their planned dtype); wider, more
    bytes are gathered than planned."""
    actual = {m: unit.param_dtype for unit in live if unit.param_dtype is not None
              for m in unit.members if plan[m].params and plan[m].policy.compute is not None}
    return drift(plan, "compute", actual, code="fsdp-param-dtype", backend=where,
                 cause="each unit gathers its parameters in its mixed-precision param_dtype, "
                       "and a module computes in the dtype its weights are gathered in (an "
                       "island planned wider raises a DriftError at its first forward)",
                 fix=f"Shard with the plan's own policies: "
                     f"{_fix('fsdp' if where == 'FSDP2' else 'fsdp1')}, or give these modules "
                     "units whose param_dtype is their compute.")
def _integer_parameters(plan: PrecisionPlan, shards: list[Unit]) -> list[Finding]:
    bad = [unit for unit in shards if any(not d.is_floating_point for d in unit.storage)]

    def kinds(unit: Unit) -> str:
        return ", ".join(sorted(dtype_name(d) for d in unit.storage if not d.is_floating_point))

    return [Finding(
        "error", "fsdp-integer-param", unit.name,
        f"This FSDP1 unit holds integer parameters ({kinds(unit)}), and FSDP1 refuses to wrap "
        "it (\"Cannot flatten integer dtype tensors\").",
        "Keep integer tensors as buffers (module.register_buffer), or shard with FSDP2 "
        "(precision_annot.adapters.fsdp.fully_shard), which shards them as they are.")
        for unit in bad]


def _owners(plan: PrecisionPlan, shards: list[Unit]) -> dict[str, list[tuple[str, str]]]:
    """Each parameter's holders, as (qualified name, unit), keyed by the name it is first
    seen as: read off the plan's facts, so a model FSDP1 has already flattened reads alike."""
    unit_of = {m: u.name for u in shards for m in u.members}
    out: dict[str, list[tuple[str, str]]] = {}
    for name, entry in plan.items():
        for info in entry.own_params:
            full = f"{name}.{info.name}" if name else info.name
            out.setdefault(info.tied or full, []).append((full, unit_of.get(name, "")))
    return out


def _tied_across_units(plan: PrecisionPlan, shards: list[Unit], backend: str
                       ) -> list[Finding]:
    out = []
    for owners in _owners(plan, shards).values():
        units = list(dict.fromkeys(u for _, u in owners))
        if len(units) < 2:
            continue
        names = [n for n, _ in owners]
        happens = ("FSDP2 refuses it (\"Parameter ... is shared with a parameter already "
                   "managed by another FSDP group\")" if backend == "fsdp" else
                   "FSDP1 flattens it into each unit apart, so the tie breaks: the copies "
                   "train apart, or the forward fails on a flattened view")
        common = _common_parent([n.rpartition(".")[0] for n in names])
        out.append(Finding(
            "error", "fsdp-tied-units", names[0].rpartition(".")[0],
            f"The tied parameters {listing(names)} sit in different FSDP units "
            f"({listing(units)}): {happens}.",
            f"Put their modules in one unit: fully_shard(model, units=['{common}']) with "
            "their islands annotated alike, or untie them.",
            tuple(n.rpartition(".")[0] for n in names)))
    return out


def _common_parent(names: list[str]) -> str:
    parts = [n.split(".") for n in names]
    common = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def _frozen_beside_trainable(plan: PrecisionPlan, shards: list[Unit], use_orig_params: bool
                             ) -> list[Finding]:
    """FSDP1 flattens a unit's parameters into one: with use_orig_params=False it refuses
    frozen and trainable ones together; with True it reduce-scatters the frozen ones' zero
    gradients with the rest (measured: 1,136 elements on the wire for 624 trainable)."""
    out = []
    for unit in shards:
        frozen = _frozen_beside(plan, unit)
        if not frozen:
            continue
        if not use_orig_params:
            out.append(Finding(
                "error", "fsdp1-frozen-mixed", unit.name,
                "This FSDP1 unit holds frozen and trainable parameters, and with "
                "use_orig_params=False FSDP1 refuses to wrap it (\"Must flatten tensors with "
                "uniform `requires_grad`\").",
                "FullyShardedDataParallel(model, ..., use_orig_params=True, "
                "device_id=torch.device('cpu')), or freeze whole units."))
            continue
        storage = plan[unit.name].policy.storage
        extra = sum(t.numel * (storage or t.dtype).itemsize for _, t in frozen)
        names = [n for n, _ in frozen]
        out.append(Finding(
            "warning", "fsdp1-frozen-reduced", unit.name,
            f"This FSDP1 unit holds frozen parameters ({listing(names, 3)}) beside trainable "
            f"ones, and FSDP1 reduce-scatters the whole flat parameter: the frozen ones' zero "
            f"gradients cost {extra:,} more bytes on the wire a step.",
            "Make the frozen modules units of their own (units are made at boundaries; an "
            "annotation on them, e.g. their own comm, splits them off), or shard with FSDP2 "
            "(precision_annot.adapters.fsdp.fully_shard), which reduces only gradients.",
            tuple(n.rpartition(".")[0] for n in names)))
    return out


def _frozen_beside(plan: PrecisionPlan, unit: Unit) -> list[tuple[str, TensorInfo]]:
    """The unit's frozen floating parameters (a tie counted at its first holder), when it
    holds trainable ones too; else none."""
    params = [(f"{m}.{t.name}" if m else t.name, t) for m in unit.members
              for t in plan[m].own_params if t.dtype.is_floating_point and t.tied is None]
    frozen = [(n, t) for n, t in params if not t.trainable]
    return [] if len(frozen) == len(params) else frozen


def _small_units(plan: PrecisionPlan, model: nn.Module | None,
                 units: list[Selector] | None, names: list[str], backend: str,
                 latency_s: float, bandwidth: float) -> list[Finding]:
    cost = collective_cost(plan, names, latency_s=latency_s, bandwidth=bandwidth)
    total = sum(c.unit.params for c in cost.units) or 1
    small = [c for c in cost.units if c.unit.name and c.unit.params < SMALL_UNIT * total]
    if len(small) < SMALL_UNITS:
        return []
    where = "fully_shard" if backend == "fsdp" else "wrap_policy and mixed_precision"
    merged = collective_cost(plan, unit_names(plan, model, units, merge_below=SMALL_UNIT),
                             latency_s=latency_s, bandwidth=bandwidth)
    saved = cost.collectives - merged.collectives
    trade = (f"{where}(..., merge_below={SMALL_UNIT}) makes {saved} fewer collectives per "
             f"step and moves {human_bytes(max(merged.bytes - cost.bytes, 0))} more, "
             "gathering and reducing the merged units in the islands' wider dtypes")
    if not saved:
        fix = ("Shard larger units: the small ones are stored unlike the unit around "
               "them, so they cannot merge; make storage uniform to let merge_below merge "
               "them.")
    elif merged.seconds < cost.seconds:
        fix = (f"Let small islands share their parent's unit: {trade}, about "
               f"{merged.seconds * 1e3:.2f} ms per step.")
    else:
        fix = (f"Keep them: {trade}, about {merged.seconds * 1e3:.2f} ms per step, slower "
               "at these constants.")
    return [Finding(
        "info", "fsdp-small-units", "",
        f"{len(small)} of {len(cost.units)} FSDP units hold less than 1% of the parameters "
        f"each; every unit costs 2 all-gathers and a reduce-scatter per step "
        f"({cost.collectives} collectives in all), and these small ones are latency-bound: "
        f"about {sum(c.seconds for c in small) * 1e3:.2f} of {cost.seconds * 1e3:.2f} ms "
        f"per step at {latency_s * 1e6:g} us and {bandwidth / 1e9:g} GB/s.",
        fix, tuple(c.unit.name for c in small),
    )]
