"""FSDP2 and FSDP1: one sharded unit per plan boundary, each with its mixed-precision policy,
and what FSDP will do with a plan, said before launch.

- `export.py`: `fully_shard` (FSDP2), `wrap_policy` and `mixed_precision` (FSDP1), the units.
- `cost.py`: `collective_cost`, what the units cost per step.
- `checks.py`: `findings`, `reduced` and the `check` backends, worked out by the same code.
"""

from precision_annot.adapters.fsdp.checks import findings, reduced, sharded_units
from precision_annot.adapters.fsdp.cost import (
    BANDWIDTH,
    LATENCY_S,
    CollectiveCost,
    UnitCost,
    collective_cost,
)
from precision_annot.adapters.fsdp.export import (
    Unit,
    fully_shard,
    masters_as_shards,
    mixed_precision,
    plan_name,
    plan_units,
    precompute_float8_scales,
    unit_names,
    wrap_policy,
)

__all__ = ["BANDWIDTH", "LATENCY_S", "CollectiveCost", "Unit", "UnitCost", "collective_cost",
           "findings", "fully_shard", "masters_as_shards", "mixed_precision", "plan_name",
           "plan_units", "precompute_float8_scales", "reduced", "sharded_units", "unit_names",
           "wrap_policy"]
