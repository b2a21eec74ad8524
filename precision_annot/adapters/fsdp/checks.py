"""FSDP2 and FSDP1 checks: what FSDP will refuse, narrow, widen or run badly for a plan,
sharded as the export (`fully_shard`, `wrap_policy`) would shard it, or as a model is already
sharded. `FSDP2_CHECKS` and `FSDP1_CHECKS` are the backends `check(..., "fsdp")` and
`check(..., "fsdp1")` ask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from precision_annot._src import seams
from precision_annot._src.check_backend import LOOP_KEYS, CheckBackend, Checked
from precision_annot._src.dtypes import dtype_name, wider, widest
from precision_annot._src.findings import Finding, drift, listing
from precision_annot._src.guards import require_plan
from precision_annot._src.plan import PrecisionPlan, TensorInfo
from precision_annot._src.runtime import Subject
from precision_annot._src.selectors import Selector
from precision_annot._src.tables import human_bytes
from precision_annot.adapters.fsdp.cost import (
    BANDWIDTH,
    LATENCY_S,
    SMALL_UNIT,
    SMALL_UNITS,
    collective_cost,
)
from precision_annot.adapters.fsdp.export import (
    MIXED_FIX,
    Unit,
    mixed_message,
    mixed_units,
    plan_name,
    plan_units,
    selectors,
    unit_names,
)

__all__ = ["FSDP1_CHECKS", "FSDP2_CHECKS", "FSDPChecks", "findings", "reduced", "sharded_units"]


def reduced(plan: PrecisionPlan, names: list[str], *, fsdp1: bool = False,
            keep_dtype_in_unit: bool = False) -> dict[str, torch.dtype]:
    """What FSDP reduces each parameter-holding module's gradients in, sharded into the units
    `names` (as `unit_names` gives them): its unit's reduce dtype, the widest comm of the
    unit's members; where none sets one, what the installed FSDP does with
    `reduce_dtype=None` (`_default_reduce`)."""
    units = plan_units(plan, names, keep_dtype_in_unit=keep_dtype_in_unit)
    return _reduced(units, plan, fsdp1)


def _default_reduce(unit: Unit, plan: PrecisionPlan, fsdp1: bool) -> torch.dtype | None:
    """What a unit with `reduce_dtype=None` reduces in: FSDP1 and FSDP2 before torch 2.15 its
    `param_dtype` (else its storage); FSDP2 from 2.15 its parameters' `grad_dtype` (set where
    the plan accumulates gradients wider than storage), else their storage dtype."""
    floating = [d for d in unit.storage if d.is_floating_point]
    stored = floating[0] if len(floating) == 1 else None
    if fsdp1:
        return unit.param_dtype or stored
    grads = widest(plan[m].policy.grad for m in unit.holders if plan[m].policy.accumulates)
    return seams.fsdp2_default_reduce(unit.param_dtype, stored, grads)


def _reduced(units: list[Unit], plan: PrecisionPlan, fsdp1: bool) -> dict[str, torch.dtype]:
    out: dict[str, torch.dtype] = {}
    for unit in units:
        dtype = unit.reduce_dtype or _default_reduce(unit, plan, fsdp1)
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

    # the plan's name of each module: a plan resolved on the model names the levels that FSDP1
    # and activation checkpointing wrap modules in; one resolved before wrapping does not
    named = {id(m): n if n in plan else plan_name(n) for n, m in model.named_modules()}
    live: dict[str, tuple[Any, bool, Any]] = {}  # each unit's policy, FSDP1's or not, module
    for module in model.modules():
        if isinstance(module, FSDPModule):
            live[named[id(module)]] = (module._get_fsdp_state()._mp_policy, False, module)
        elif isinstance(module, FullyShardedDataParallel):
            live[named[id(module)]] = (module.mixed_precision, True, module)
    if not live:
        return None
    names = sorted((n for n in live if n in plan), key=lambda n: -(n.count(".") + 1 if n else 0))
    if "" not in names:
        names.append("")  # what no unit holds stays with the root, unsharded
    out = []
    for unit in plan_units(plan, names):
        if unit.name not in live:
            out.append(dataclasses.replace(unit, param_dtype=None, reduce_dtype=None,
                                           output_dtype=None))
            continue
        mp, fsdp1, module = live[unit.name]
        kept = () if fsdp1 else _kept_live(module, mp, named)
        found = dataclasses.replace(unit, param_dtype=mp.param_dtype, reduce_dtype=None,
                                    output_dtype=getattr(mp, "output_dtype", None), kept=kept)
        out.append(dataclasses.replace(found, reduce_dtype=mp.reduce_dtype or _default_reduce(
            found, plan, fsdp1)))
    return out


def _kept_live(module: Any, mp: Any, names: dict[int, str]) -> tuple[str, ...]:
    """The modules of a sharded FSDP2 unit whose parameters it gathers, every one, in another
    dtype than its `param_dtype` (FSDP2's `param_dtype_override_fn`, torch 2.15).

    NOTE: FSDP2 resolves the override per parameter and keeps only the result, on its private
    parameter objects (`_fsdp_param_group.fsdp_params[i].mp_policy`); the unit's own policy
    drops the function."""
    group = module._get_fsdp_state()._fsdp_param_group
    own: dict[str, bool] = {}  # per module: every parameter of it kept in its own dtype
    for param in getattr(group, "fsdp_params", ()):
        name = names.get(id(param._module_info.module), "")
        own[name] = own.get(name, True) and param.mp_policy.param_dtype != mp.param_dtype
    # a module whose weight is gathered in param_dtype computes in it, whatever its bias is
    # gathered in (an override keeping every 1-D parameter catches the Linears' biases too)
    return tuple(name for name, kept in own.items() if kept)


def findings(plan: PrecisionPlan, backend: str = "fsdp", *, model: nn.Module | None = None,
             units: Iterable[Selector] | None = None, merge_below: float | None = None,
             latency_s: float = LATENCY_S, bandwidth: float = BANDWIDTH,
             use_orig_params: bool = False, gradient_sync: bool = True) -> list[Finding]:
    """What FSDP (2, or 1 with backend="fsdp1") will refuse, narrow, widen or run badly for
    this plan, sharded as `fully_shard(model, plan, units=units, merge_below=merge_below)` (or
    `wrap_policy` and `mixed_precision`) would shard it, or, for a `model` already sharded, as
    it is sharded (its units and their mixed-precision settings, whoever chose them). Tied
    and frozen parameters are read off the plan; `use_orig_params` is FSDP1's;
    `gradient_sync=False` says the loop skips the reduction of some micro-batches
    (`set_requires_gradient_sync(False)`, FSDP2's accumulation idiom)."""
    require_plan(plan, "findings")
    model = model if model is not None else plan.module("")
    units = None if units is None else list(units)
    live = sharded_units(plan, model) if model is not None else None
    keep = backend == "fsdp" and seams.FSDP2_KEEPS_PARAM_DTYPE
    names = [u.name for u in live] if live is not None else unit_names(
        plan, model, units, merge_below=merge_below, keep_dtype_in_unit=keep)
    shards = live if live is not None else plan_units(plan, names, keep_dtype_in_unit=keep)
    out = _structure(plan, shards, backend, use_orig_params)
    where = "FSDP2" if backend == "fsdp" else "FSDP1"
    if live is not None:
        out += _gathered(plan, live, where)
    out += drift(plan, "comm", _reduced(shards, plan, backend == "fsdp1"),
                 code="fsdp-unit-comm", backend=where,
                 cause="FSDP reduces each unit's gradients in one dtype, "
                       + (f"its reduce_dtype (else {_default_words(backend)})"
                          if live is not None else "the widest comm of the unit's members"),
                 fix=f"Make each of them a unit of its own: {_fix(backend)}"
                 " with units naming them, or give the unit one comm dtype.")
    if live is None:
        out += _small_units(plan, model, units, names, backend, latency_s, bandwidth)
    if backend == "fsdp" and not gradient_sync:
        out += _unsynced_sums(plan, shards)
    return out


def _structure(plan: PrecisionPlan, shards: list[Unit], backend: str,
               use_orig_params: bool) -> list[Finding]:
    """What FSDP refuses in how the units are cut: mixed dtypes in a unit, integer parameters
    (FSDP1), ties across units, frozen beside trainable parameters (FSDP1)."""
    out = [Finding("error", "fsdp-mixed-unit", unit.name,
                   f"This FSDP unit {mixed_message(detail)} FSDP refuses it at the first "
                   "forward (\"FSDP expects uniform original parameter dtype\").", MIXED_FIX)
           for unit, detail in mixed_units(shards, plan)]
    if backend == "fsdp1":
        out += _integer_parameters(plan, shards)
    out += _tied_across_units(plan, shards, backend)
    if backend == "fsdp1":
        out += _frozen_beside_trainable(plan, shards, use_orig_params)
    return out


def _unsynced_sums(plan: PrecisionPlan, shards: list[Unit]) -> list[Finding]:
    """Units whose plan accumulates gradients wider (`grad`) than FSDP2 reduces them: FSDP2
    sums the micro-batches a loop keeps from reducing (`set_requires_gradient_sync(False)`)
    in the unit's reduce dtype (measured: bf16 sums, 7.8e-3 off the fp32 sums by hand after 2
    SGD steps on 2 gloo ranks, bit for bit a hand loop summing in bf16)."""
    reduced = _reduced(shards, plan, False)
    out = []
    for unit in shards:
        wide = widest(plan[m].policy.grad for m in unit.holders
                      if isinstance(plan[m].policy.grad, torch.dtype))
        narrow = next((reduced[m] for m in unit.holders if m in reduced), None)
        if wide is None or narrow is None or not wider(wide, narrow):
            continue
        out.append(Finding(
            "warning", "fsdp-unsynced-sums", unit.name,
            f"This FSDP2 unit reduces its gradients in {dtype_name(narrow)} and the plan sums "
            f"them in {dtype_name(wide)} (grad={dtype_name(wide)}); with "
            "set_requires_gradient_sync(False) FSDP2 sums the micro-batches it does not "
            f"reduce in {dtype_name(narrow)}, not {dtype_name(wide)}, and the sum that reaches "
            f"the {dtype_name(wide)} gradient shard is rounded.",
            f"Keep the sync on (the default: each micro-batch is reduced and added into the "
            f"{dtype_name(wide)} shard), or plan comm={dtype_name(wide)} for these modules "
            "(twice the bytes on the wire).", unit.holders))
    return out


def _default_words(backend: str) -> str:
    if backend == "fsdp1" or not seams.FSDP2_REDUCES_IN_GRAD_DTYPE:
        return "its param_dtype"
    return "its parameters' grad_dtype or their own dtype, since torch 2.15"


def _gathered(plan: PrecisionPlan, live: list[Unit], where: str) -> list[Finding]:
    """A sharded unit that gathers its parameters in another dtype than its members compute
    in: narrower, the members planned wider see narrow weights (an fp32 island's forward
    raises a DriftError: its parameters are no longer in their planned dtype); wider, more
    bytes are gathered than planned."""
    actual = {m: (plan[m].policy.storage or unit.param_dtype) if m in unit.kept
              else unit.param_dtype for unit in live if unit.param_dtype is not None
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
    keep = backend == "fsdp" and seams.FSDP2_KEEPS_PARAM_DTYPE
    cost = collective_cost(plan, names, latency_s=latency_s, bandwidth=bandwidth,
                           keep_dtype_in_unit=keep)
    total = sum(c.unit.params for c in cost.units) or 1
    small = [c for c in cost.units if c.unit.name and c.unit.params < SMALL_UNIT * total]
    if len(small) < SMALL_UNITS:
        return []
    where = "fully_shard" if backend == "fsdp" else "wrap_policy and mixed_precision"
    merged = collective_cost(plan, unit_names(plan, model, units, merge_below=SMALL_UNIT,
                                              keep_dtype_in_unit=keep),
                             latency_s=latency_s, bandwidth=bandwidth, keep_dtype_in_unit=keep)
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


class FSDPChecks(CheckBackend):
    """`check(..., "fsdp")` (FSDP2) and `check(..., "fsdp1")`: the units `fully_shard` (or
    `wrap_policy`) would make, or those of a model already sharded."""

    def options(self, config: Any) -> Any:
        options = super().options(config)
        units = (options or {}).get("units")
        if units is not None:
            selectors(units, "check: config 'units'")
        sync = (options or {}).get("gradient_sync", True)
        if not isinstance(sync, bool):
            raise TypeError("check: config 'gradient_sync' says whether every micro-batch is "
                            "reduced (False: the loop calls set_requires_gradient_sync(False) "
                            f"on some). Received: gradient_sync={sync!r} (of type "
                            f"{type(sync).__name__})")
        orig = (options or {}).get("use_orig_params", False)
        if not isinstance(orig, bool):
            raise TypeError("check: config 'use_orig_params' is FSDP1's flag, True or False. "
                            f"Received: use_orig_params={orig!r} (of type "
                            f"{type(orig).__name__})")
        return options

    def run(self, given: Subject, options: Any) -> Checked:
        plan, model = given.plan, given.model
        settings = self.without_loop(options)
        if "units" in settings and model is None:
            raise ValueError("check: config 'units' selects modules, so it needs the model, and "
                             "this plan holds none (it was loaded from JSON, or its model is "
                             "gone); pass the model instead of its plan.")
        found = findings(plan, self.name, model=model, **settings)
        fsdp1 = self.name == "fsdp1"
        live = sharded_units(plan, model) if model is not None else None
        if live is not None:
            return Checked(found, _reduced(live, plan, fsdp1))
        keep = not fsdp1 and seams.FSDP2_KEEPS_PARAM_DTYPE
        names = unit_names(plan, model, settings.get("units"),
                           merge_below=settings.get("merge_below"), keep_dtype_in_unit=keep)
        return Checked(found, reduced(plan, names, fsdp1=fsdp1, keep_dtype_in_unit=keep))


class FSDP2Checks(FSDPChecks):
    name = "fsdp"
    keys = ("units", "merge_below", "latency_s", "bandwidth", "gradient_sync", *LOOP_KEYS)


class FSDP1Checks(FSDPChecks):
    name = "fsdp1"
    keys = ("merge_below", "latency_s", "bandwidth", "use_orig_params", *LOOP_KEYS)


FSDP2_CHECKS = FSDP2Checks()
FSDP1_CHECKS = FSDP1Checks()
