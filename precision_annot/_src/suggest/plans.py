"""Candidate plans: everything in the low policy, the islands (and their subtrees) in fp32."""

from __future__ import annotations

import copy
import dataclasses

from torch import nn

from precision_annot._src.dtypes import fp32
from precision_annot._src.plan import PrecisionPlan, Source
from precision_annot._src.policy import Policy
from precision_annot._src.suggest.constants import ISLAND

Islands = dict[str, bool]  # island -> it hands its output back in fp32


def islands_key(islands: Islands) -> tuple[tuple[str, bool], ...]:
    return tuple(sorted(islands.items()))


def covering(name: str, islands: Islands) -> str | None:
    return next((i for i in islands if name == i or name.startswith(i + ".")), None)


def runnable_copy(module: nn.Module, policy: Policy) -> nn.Module:
    """A copy of (part of) the fp32 reference to apply a candidate plan to and run: its
    parameters shared with the reference where `apply` leaves them as they are (the plan
    stores what it does not keep in fp32 in fp32 too, as the "-mixed" and fp8 policies do),
    everything else copied. A copy of every parameter costs as much as a step of a small
    model; the runs take no optimizer step, and their gradients are cleared after each."""
    if policy.storage not in (None, fp32):
        return copy.deepcopy(module)
    shared = {id(p): p for p in module.parameters()}
    return copy.deepcopy(module, shared)


def uniform_plan(structure: PrecisionPlan, policy: Policy) -> PrecisionPlan:
    return plan_for(structure, policy, {}, None, ISLAND)


def plan_for(structure: PrecisionPlan, policy: Policy, islands: Islands,
             modules: dict[str, nn.Module] | None, island: Policy,
             arithmetic: dict[str, Policy] | None = None) -> PrecisionPlan:
    """`structure` (a resolved plan, for names, classes and kept arguments) with everything in
    `policy` but the islands and their subtrees in `island`; an island marked True hands its
    output back in fp32; the Linear layers of `arithmetic` in their own policy (the low
    dtype's GEMMs with an fp32 output)."""
    arithmetic = arithmetic or {}
    policies: dict[str, Policy] = {}
    sources: dict[str, dict[str, Source | None]] = {}
    handing = dataclasses.replace(island, output=fp32)
    for name in structure:
        owner = covering(name, islands)
        chosen = policy if owner is None else handing if (owner == name and islands[name]) \
            else island
        if owner is None and name in arithmetic:
            chosen, owner = arithmetic[name], name
        source: Source = "default" if not name else "rule" if owner == name else "inherited"
        policies[name] = chosen
        sources[name] = {f: (source if v is not None else None) for f, v in chosen.items()}
        if chosen.fp8 is not None:
            sources[name]["gemm"] = source
        if chosen.backward is not None:
            sources[name]["backward"] = source
    planned = structure.with_policies(policies, sources)
    return PrecisionPlan(dict(planned.items()), default=policy, model_type=structure.model_type,
                         modules=modules)
