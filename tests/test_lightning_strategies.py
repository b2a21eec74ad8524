"""Lightning Trainer with 2 CPU processes: DDPStrategy and ModelParallelStrategy (FSDP2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import free_port

pytest.importorskip("lightning")
WORKER = Path(__file__).with_name("lightning_worker.py")


@pytest.mark.parametrize("strategy", ["ddp", "model_parallel"])
def test_two_process_strategies_train_with_planned_dtypes(strategy: str, tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, str(WORKER), strategy, str(tmp_path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"{strategy}-rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["batch"] == ["bf16"]  # cast before the transfer
        assert r["seen"] == {"fc1": "bf16", "norm": "fp32", "fc2": "bf16"}
        assert set(r["storage"].values()) == {"fp32"}
        assert r["losses"][-1] < r["losses"][0] * 0.7, r["losses"]
        dtypes = {d for d, _ in r["reduced"]}
        assert dtypes == {"bf16", "fp32"}, r["reduced"]  # bf16 for the Linears, fp32 island
        bf16_n = max(n for d, n in r["reduced"] if d == "bf16")
        fp32_n = max(n for d, n in r["reduced"] if d == "fp32")
        assert bf16_n > fp32_n >= 32
    assert ranks[0]["params"] == ranks[1]["params"]
