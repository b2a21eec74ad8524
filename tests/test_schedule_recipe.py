"""benchmarks/schedule_recipe.py, the measured recipe of docs/schedule-recipe.md, at a tiny size:
its four runs train to finite losses, and each run's plan changes at the planned step, as one
Linear's forward and its update saw it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from precision_annot._src import float8

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # over make test's budget: run by make test-all
@pytest.mark.skipif(not float8.available(), reason="run 4 needs torchao")
def test_recipe_runs_and_switches_at_the_planned_step(tmp_path: Path) -> None:
    out = tmp_path / "recipe.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.schedule_recipe", "--steps", "20", "--d-model", "32",
         "--layers", "1", "--heads", "2", "--seq", "32", "--batch", "4", "--warmup", "2",
         "--out", str(out)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert sorted(runs) == ["1", "2", "3", "4"]
    for key, run in runs.items():
        assert len(run["losses"]) == 20, key
        values = [*run["losses"], run["train_loss"], run["eval_loss"], run["eval_loss_fp32"]]
        assert all(math.isfinite(v) for v in values), (key, values)
        assert f"| {key} | " in proc.stdout

    # 0.9 of 20 steps: the phase after the switch runs from step 18 on
    assert [runs[k]["switch_steps"] for k in "1234"] == [[], [], [18], [18]]
    no_masters = ("Linear(input=bfloat16, weight=bfloat16) grad=bfloat16 master=- "
                  "exp_avg=bfloat16")
    masters = "Linear(input=bfloat16, weight=bfloat16) grad=float32 master=float32 exp_avg=float32"
    assert runs["1"]["seen"] == [
        [0, "Linear(input=float32, weight=float32) grad=float32 master=- exp_avg=float32"]]
    assert runs["2"]["seen"] == [[0, no_masters]]
    assert runs["3"]["seen"] == [[0, no_masters], [18, masters]]
    assert runs["4"]["seen"] == [[0, f"Float8{masters}"], [18, masters]]
    # same weights, same batches: runs 2 and 3 are one run until the switch
    assert runs["3"]["losses"][:18] == runs["2"]["losses"][:18]
