"""DDP, FSDP1 and FSDP2 with real torch.distributed: 2 ranks on gloo, started from the test."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import free_port, run_processes

WORKER = Path(__file__).with_name("dist_worker.py")
BF16_ELEMENTS = 16 * 32 + 32 + 32 * 4 + 4  # fc1 and fc2
ISLAND_ELEMENTS = 2 * 32  # the LayerNorm


def run_ranks(mode: str, tmp_path: Path) -> list[dict[str, Any]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), str(WORKER), mode, str(tmp_path)]
    proc = run_processes(cmd, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("mode", ["ddp", "fsdp1", "fsdp2"])
def test_two_ranks_train_with_planned_dtypes(mode: str, tmp_path: Path) -> None:
    ranks = run_ranks(mode, tmp_path)
    reduce_op = "all_reduce" if mode == "ddp" else "reduce_scatter_single"
    for r in ranks:
        assert r["losses"][-1] < r["losses"][0] * 0.9, r["losses"]
        assert set(r["storage"].values()) == {"fp32"}  # fp32 master weights everywhere
        assert r["seen"] == {"fc1": ["bf16"], "norm": ["fp32"], "fc2": ["bf16"]}
        reduced = {(d, n) for op, d, n in r["collectives"] if op == reduce_op}
        # bf16 on the wire for the bf16-comm parameters, fp32 for the island, nothing else
        assert reduced == {("bf16", BF16_ELEMENTS), ("fp32", ISLAND_ELEMENTS)}, r["collectives"]
        assert r["round_trip"] is True
    assert ranks[0]["params"] == ranks[1]["params"]
    # averaged correctly: the same as one process training on both ranks' data (bf16 comm)
    ref = ranks[0]["reference"]
    assert set(ref) == set(ranks[0]["params"])
    worst = max(abs(a - b) for n in ref for a, b in zip(ref[n], ranks[0]["params"][n],
                                                         strict=True))
    assert worst < 5e-3, worst
    if mode == "fsdp2":
        assert "same dtype" in ranks[0]["plain_fsdp2_error"]
