"""The update half on 2 gloo ranks: FSDP2 shards the masters, DDP keeps them per rank.

A bf16 model with fp32 masters and 8-bit AdamW state ("bf16-true,master=fp32,optim=8bit", an
fp32 norm island), trained with `precision_annot.optimizer` (tests/workers/update.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import precision_annot as pa
from tests.helpers import launch
from tests.workers.update import model

pytest.importorskip("torchao")


def ranks(mode: str, tmp_path: Path) -> list[dict[str, Any]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    launch("tests.workers.update", mode, str(tmp_path), ranks=2, timeout=300)
    return [json.loads((tmp_path / f"{mode}-rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow  # over make test's budget: run by make test-all
def test_fsdp2_shards_the_fp32_masters_and_gathers_them_in_bf16(tmp_path: Path) -> None:
    """storage=bf16,master=fp32 under FSDP2: fp32 shards (the masters, no third copy),
    gathered in bf16 for the forward, 8-bit states on the shards; each rank holds half; and
    torch.distributed.checkpoint's get/set_optimizer_state_dict round-trip the optimizer."""
    fsdp2 = ranks("fsdp2", tmp_path)
    figure = pa.resolve(model()).memory("adamw")
    for r in fsdp2:
        assert set(r["storage"].values()) == {"fp32"} and r["masters"] == []
        assert r["seen"] == {"0": "bf16", "3": "bf16"}  # gathered in bf16, computed in bf16
        assert r["state_kinds"] == ["OptimState8bit", "Tensor"]  # the norm's stay fp32
        assert r["losses"][-1] < 0.75 * r["losses"][0]
        # fp32 shards and gradient shards and the 8-bit states: about half of one replica of
        # the local layout (bf16 weights, fp32 masters), which keeps a bf16 copy besides
        assert r["bytes"] < 0.55 * figure.total()
    assert fsdp2[0]["params"] == fsdp2[1]["params"]
    for r in fsdp2:  # torch.distributed.checkpoint: saved, loaded into a fresh run, equal
        assert r["dcp"]["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight", "3.bias",
                                    "3.weight"]
        assert r["dcp"]["kinds"] == ["OptimState8bit", "Tensor"] and r["dcp"]["worst"] == 0


@pytest.mark.slow  # 6 s: the same run under DDP, each rank a replica
def test_ddp_keeps_masters_per_rank_and_matches_fsdp2(tmp_path: Path) -> None:
    ddp = ranks("ddp", tmp_path / "ddp")
    fsdp2 = ranks("fsdp2", tmp_path / "fsdp2")
    figure = pa.resolve(model()).memory("adamw")
    for r in ddp:
        assert r["storage"]["0.weight"] == "bf16" and r["masters"] == ["fp32"]
        assert r["bytes"] == figure.total()  # a replica holds what the plan says
    assert ddp[0]["params"] == ddp[1]["params"]
    worst = max(abs(a - b) for n in ddp[0]["params"] for a, b in zip(
        ddp[0]["params"][n], fsdp2[0]["params"][n], strict=True))
    assert worst < 2e-2  # the same update; FSDP2's weights are its fp32 shards, DDP's bf16
