"""Candidate plans: everything in the low policy, the islands (and their subtrees) in fp32."""

from __future__ import annotations

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


def uniform_plan(structure: PrecisionPlan, policy: Policy) -> PrecisionPlan:
    return plan_for(structure, policy, {}, None, ISLAND)


def plan_for(structure: PrecisionPlan, policy: Policy, islands: Islands,
          modules: dict[str, nn.Module] | None, island: Policy) -> PrecisionPlan:
    """`structure` (a resolved plan, for names, classes and kept arguments) with everything in
    `policy` but the islands and their subtrees in `island`; an island marked True hands its
    output back in fp32."""
    policies: dict[str, Policy] = {}
    sources: dict[str, dict[str, Source | None]] = {}
    handing = dataclasses.replace(island, output=fp32)
    for name in structure:
        owner = covering(name, islands)
        chosen = policy if owner is None else handing if (owner == name and islands[name]) \
            else island
        source: Source = "default" if not name else "rule" if owner == name else "inherited"
        policies[name] = chosen
        sources[name] = {f: (source if v is not None else None) for f, v in chosen.items()}
        if chosen.gemm is not None:
            sources[name]["gemm"] = source
    planned = structure.with_policies(policies, sources)
    return PrecisionPlan(dict(planned.items()), default=policy, model_type=structure.model_type,
                         modules=modules)
