"""`torch.distributed.checkpoint` into an applied model, in one process: DCP loads each saved
tensor into the state dict's own tensor, so the plan's dtypes are kept; `adapters.dcp.LoadPlanner`
says what a checkpoint held narrower than the plan keeps (DCP alone casts silently). The
2-rank FSDP2 case is tests/adapters/test_fsdp.py's."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from precision_annot import apply
from precision_annot.adapters.dcp import LoadPlanner
from tests.test_checkpoints import ISLANDS, PLANNED, Net, by_hand, loaded, saved

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def load(path: Path, planner: LoadPlanner | None) -> tuple[dict[str, torch.Tensor], list[str]]:
    model = apply(Net(), default="bf16-true")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(model.state_dict(), checkpoint_id=str(path), planner=planner)
    return loaded(model), [str(w.message) for w in caught]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dcp_loads_into_the_planned_dtypes_and_the_planner_names_what_was_lost(
        dtype: torch.dtype, tmp_path: Path) -> None:
    state = saved(dtype)
    dcp.save(state, checkpoint_id=str(tmp_path))
    for planner in (None, LoadPlanner()):
        after, said = load(tmp_path, planner)
        assert {k: v.dtype for k, v in after.items()} == PLANNED
        assert all(torch.equal(after[k], v) for k, v in by_hand(state).items())
        if planner is None or dtype == torch.float32:
            assert said == []  # DCP alone casts silently
        else:
            (message,) = said
            assert message.startswith("torch.distributed.checkpoint.load: the checkpoint holds "
                                      "4 tensor(s) narrower than the plan keeps them")
            assert all(repr(n) in message for n in ISLANDS)


def test_the_planner_reads_a_nested_state_as_dcp_flattens_it(tmp_path: Path) -> None:
    """The usual app state, {"model": ...}: keys are flattened by DCP itself."""
    dcp.save({"model": saved(torch.bfloat16)}, checkpoint_id=str(tmp_path))
    model = apply(Net(), default="bf16-true")
    with pytest.warns(UserWarning, match=r"'model.norm.weight'"):
        dcp.load({"model": model.state_dict()}, checkpoint_id=str(tmp_path),
                 planner=LoadPlanner())
    assert model.norm.weight.dtype == torch.float32
