"""DDP: the comm hook reduces each gradient in its planned dtype, on 2 real gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from precision_annot import PrecisionPlan, resolve
from precision_annot.adapters import ddp
from tests.adapters.distributed import check_training, run_ranks


def test_two_ranks_reduce_in_the_planned_dtypes(tmp_path: Path) -> None:
    check_training(run_ranks("ddp", tmp_path), "all_reduce")


def test_bad_input() -> None:
    with pytest.raises(TypeError, match=r"comm_hook: plan must be a PrecisionPlan"):
        ddp.comm_hook(nn.Linear(2, 2))  # type: ignore[arg-type]
    loaded = PrecisionPlan.from_json(resolve(nn.Linear(2, 2)).to_json())
    with pytest.raises(RuntimeError, match="does not hold its model"):
        ddp.comm_hook(loaded)
