"""FSDP2 and FSDP1: units, dtype checks, keep_dtype and errors in one process (world size 1,
gloo), and real training on 2 gloo ranks."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from precision_annot import Policy, bf16, fp16, fp32, precision, resolve
from precision_annot.adapters import fsdp
from tests.adapters.distributed import check_training, run_ranks
from tests.helpers import free_port


@pytest.fixture
def group() -> Iterator[None]:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_units_at_boundaries_storage_changes_and_selection() -> None:
    model = nn.Sequential(
        nn.Sequential(nn.Linear(2, 2), precision(storage=bf16)(nn.Linear(2, 2))),
        precision(fp32)(nn.LayerNorm(2)),
        nn.Linear(2, 2),
    )
    plan = resolve(model, default=Policy(compute=bf16, storage=fp32))
    assert fsdp.unit_names(plan) == ["0.1", "1", ""]
    assert fsdp.unit_names(plan, model, units=["2"]) == ["0.1", "1", "2", ""]
    assert fsdp.unit_names(plan, model, units=[nn.Sequential]) == ["0.1", "0", "1", ""]
    with pytest.raises(ValueError, match="matches no module"):
        fsdp.unit_names(plan, model, units=["nope"])


def test_mixed_dtypes_in_one_unit_name_the_modules(group: None) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).to(fp16))  # storage unset
    with pytest.raises(ValueError, match=r"\(root\).*fp32: \['0'\].*fp16: \['1'\]"):
        fsdp.fully_shard(model)


def test_fully_shard_keeps_an_fp32_rotary_table(group: None) -> None:
    seen: list[tuple[torch.dtype, torch.dtype]] = []

    class Rope(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
            seen.append((x.dtype, freqs.dtype))
            out: torch.Tensor = self.lin(x) * freqs.cos().to(x.dtype)
            return out

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = precision("bf16-mixed", keep_dtype=("freqs",))(Rope())
            self.head = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.head(self.block(x, freqs=torch.randn(4)))
            return out

    model = Model()
    fsdp.fully_shard(model, resolve(model, default="fp32"))
    model(torch.randn(2, 4)).sum().backward()
    assert seen == [(bf16, fp32)]


def test_bad_input(group: None) -> None:
    with pytest.raises(ValueError, match="mp_policy comes from the plan"):
        fsdp.fully_shard(nn.Linear(2, 2), mp_policy=object())
    with pytest.raises(TypeError, match="PrecisionPlan"):
        fsdp.mixed_precision("bf16")  # type: ignore[arg-type]


def _fsdp1_units(model: nn.Module, policy: Any) -> list[str]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    wrapped = FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"))
    return sorted(fsdp.plan_name(n) for n, m in wrapped.named_modules()
                  if isinstance(m, FSDP) and n)


def test_wrap_policy_matches_units_by_name_on_a_copy_or_a_loaded_plan(group: None) -> None:
    """0.1 matched modules by identity: on a copy it picked no unit, so FSDP1 wrapped only the
    root and the fp32 island crashed."""
    import copy

    from precision_annot import PrecisionPlan, apply

    model = nn.Sequential(nn.Linear(4, 4), precision(fp32)(nn.LayerNorm(4)), nn.Linear(4, 4))
    plan = resolve(model, default=Policy(compute=bf16, storage=fp32))
    twin = copy.deepcopy(model)
    loaded = PrecisionPlan.from_json(plan.to_json())
    for target, policy_plan in ((twin, plan), (copy.deepcopy(model), loaded)):
        apply(target, policy_plan)
        assert _fsdp1_units(target, fsdp.wrap_policy(policy_plan)) == ["1"]
    with pytest.raises(ValueError, match=r"does not match the model.*no module named '1'"):
        _fsdp1_units(nn.Sequential(nn.Linear(4, 4)), fsdp.wrap_policy(plan))


@pytest.mark.parametrize("mode", ["fsdp1", "fsdp2"])
def test_two_ranks_train_with_planned_dtypes(mode: str, tmp_path: Path) -> None:
    ranks = run_ranks(mode, tmp_path)
    check_training(ranks, "reduce_scatter_single")
    if mode == "fsdp2":  # FSDP2 alone fails where the adapter trains
        assert "same dtype" in ranks[0]["plain_fsdp2_error"]
