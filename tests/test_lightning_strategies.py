"""Lightning Trainer with 2 CPU processes: DDPStrategy and ModelParallelStrategy (FSDP2)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import free_port, run_processes

pytest.importorskip("lightning")
WORKER = Path(__file__).with_name("lightning_worker.py")


def run(strategy: str, tmp_path: Path) -> list[dict[str, Any]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}
    proc = run_processes([sys.executable, str(WORKER), strategy, str(tmp_path)], cwd=tmp_path,
                         timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((tmp_path / f"{strategy}-rank{r}.json").read_text()) for r in (0, 1)]


def check(ranks: list[dict[str, Any]]) -> None:
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


@pytest.mark.parametrize("strategy", ["ddp", "model_parallel"])
def test_two_process_strategies_train_with_planned_dtypes(strategy: str, tmp_path: Path) -> None:
    check(run(strategy, tmp_path))


def test_deepspeed_strategy_with_lightnings_cuda_only_check_bypassed(tmp_path: Path) -> None:
    """Lightning's DeepSpeedStrategy refuses non-CUDA accelerators; the worker skips only that
    check (and gives CPU devices an index). DeepSpeed itself runs for real on its CPU
    accelerator with gloo, ZeRO-2, with the config the plugin fills from the DeepSpeed adapter."""
    ranks = run("deepspeed", tmp_path)
    check(ranks)
    assert ranks[0]["config"] == {"torch_autocast": {
        "enabled": True, "dtype": "bfloat16",
        "lower_precision_safe_modules": ["__main__.RecLinear"]}}


def test_fsdp_strategy_with_lightnings_cpu_device_id_bypassed(tmp_path: Path) -> None:
    """Lightning's FSDPStrategy passes device_id=None on CPU, which FSDP1 refuses; the worker's
    subclass passes device_id=cpu instead. FSDP1 itself runs for real with gloo, wrapped by the
    plugin's auto_wrap_policy and MixedPrecision from the plan."""
    check(run("fsdp", tmp_path))
