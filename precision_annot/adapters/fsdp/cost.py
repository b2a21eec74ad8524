"""What FSDP's units cost: the collectives one training step issues, and an estimate of their
time with a latency-plus-bandwidth model (`collective_cost`)."""

from __future__ import annotations

import dataclasses

import torch

from precision_annot._src import seams
from precision_annot._src.guards import require_plan
from precision_annot._src.plan import PrecisionPlan
from precision_annot.adapters.fsdp.export import Unit, plan_units, unit_names

__all__ = ["BANDWIDTH", "LATENCY_S", "SMALL_UNIT", "SMALL_UNITS", "CollectiveCost", "UnitCost",
           "collective_cost"]


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


def _gathered_bytes(plan: PrecisionPlan, unit: Unit) -> int:
    """The bytes one all-gather of the unit moves: its parameters in `param_dtype`, those it
    keeps in their own dtype (FSDP2 then gathers the unit's bytes as uint8) in that dtype."""
    kept = sum(plan[m].params * _itemsize(plan[m].policy.storage, unit) for m in unit.kept)
    rest = unit.params - sum(plan[m].params for m in unit.kept)
    return kept + rest * _itemsize(unit.param_dtype, unit)


def collective_cost(plan: PrecisionPlan, names: list[str] | None = None, *,
                    latency_s: float = LATENCY_S, bandwidth: float = BANDWIDTH,
                    merge_below: float | None = None,
                    keep_dtype_in_unit: bool | None = None) -> CollectiveCost:
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
        keep_dtype_in_unit: islands that compute in their storage dtype stay in the unit
            around them, gathered in their own dtype (FSDP2 on torch 2.15 and later).
            (Default: None, what `fully_shard` does on the installed torch)

    Returns:
        A `CollectiveCost`: per unit and in total.
    """
    require_plan(plan, "collective_cost")
    if not latency_s >= 0 or not bandwidth > 0:
        raise ValueError("collective_cost: latency_s must be >= 0 and bandwidth > 0. "
                         f"Received: latency_s={latency_s!r}, bandwidth={bandwidth!r}")
    keep = seams.FSDP2_KEEPS_PARAM_DTYPE if keep_dtype_in_unit is None else keep_dtype_in_unit
    shards = plan_units(plan, names or unit_names(plan, merge_below=merge_below,
                                                  keep_dtype_in_unit=keep),
                        keep_dtype_in_unit=keep)
    costs = []
    for unit in shards:
        if not unit.params:
            continue
        gathers = 1 if not unit.name else 2
        gather_bytes = _gathered_bytes(plan, unit)
        reduce_bytes = unit.params * _itemsize(unit.reduce_dtype, unit)
        seconds = (gathers * (latency_s + gather_bytes / bandwidth)
                   + latency_s + reduce_bytes / bandwidth)
        costs.append(UnitCost(unit, gathers, gather_bytes, reduce_bytes, seconds))
    return CollectiveCost(tuple(costs), sum(c.gathers for c in costs), len(costs),
                          sum(c.seconds for c in costs))
