"""`make demo`: the main job, run as a newcomer runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_module_entry_point_and_demo(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "precision_annot", "demo", "--fast", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for marker in ("1. A small transformer", "2. The plan", "3. Training under the plan",
                   "4. The same model in plain fp32", "final loss", "5. The same plan as a "
                   "DeepSpeed config"):
        assert marker in out
    losses = next(line for line in out.splitlines() if "final loss" in line).split()
    annotated, fp32 = float(losses[2]), float(losses[3])
    assert annotated < 2.0 and fp32 < 2.0  # both learned (from ln(64) = 4.16)
    assert json.loads((tmp_path / "deepspeed_config.json").read_text())["torch_autocast"]
