"""`make demo`: the main job, run as a newcomer runs it; and the islands it shows, in training."""

from __future__ import annotations

import copy
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from precision_annot import annotate, apply, resolve
from precision_annot._src.demo_model import Norm, TinyTransformer
from precision_annot._src.demo_runner import _batches, next_token_loss, train_loop
from precision_annot._src.suggest import relative_error, suggest


@pytest.mark.slow  # over make test's budget: run by make test-all
def test_module_entry_point_and_demo(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "precision_annot", "demo", "--fast", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for marker in ("1. A small transformer", "2. The plan", "3. Training under the plan",
                   "4. The same model in plain fp32", "final loss", "5. The same plan as a "
                   "DeepSpeed config", "6. Which modules does fp16 need in fp32?",
                   "fp32 islands (2, ", "7. The same model trained",
                   "8. Before launching the suggested plan", "[deepspeed-fp16-zero]",
                   "10. The optimizer step, per module too"):
        assert marker in out
    # 0.5 printed "Epoch 0/-2" (max_steps alone leaves max_epochs=-1)
    assert "Epoch 0/0" in out and "/-" not in out
    losses = next(line for line in out.splitlines() if "final loss" in line).split()
    annotated, fp32 = float(losses[2]), float(losses[3])
    assert annotated < 2.0 and fp32 < 2.0  # both learned (from ln(64) = 4.16)
    assert json.loads((tmp_path / "deepspeed_config.json").read_text())["torch_autocast"]
    final = dict(re.findall(r"^   (.+?)\s+final loss\s+(\S+)", out, re.M))
    assert math.isnan(float(final["all fp16 + loss scaling"]))
    assert abs(float(final["suggested (2 islands)"]) - float(final["fp32"])) < 0.01 * float(
        final["fp32"])
    if "torchao is not installed" not in out:  # 9: fp8 GEMMs with bf16 islands, against bf16
        fp8, bf16 = float(final["fp8 GEMMs + bf16 islands"]), float(final["bf16-mixed"])
        # 15 steps in --fast (fp8 is emulated, slowly, on a CPU): learned, as bf16 did
        assert fp8 < 0.65 * math.log(64) and abs(fp8 - bf16) < 0.05 * bf16
        gap = re.search(r"fp8 ends (\S+)% from bf16", out)
        assert gap and abs(float(gap.group(1)) / 100 - abs(fp8 - bf16) / bf16) < 1e-3
        assert "audit: 8 Linear layers ran fp8 GEMMs, the head none (0 divergences" in out
    # 10: the update half: bytes per parameter planned and measured agree, and every layout
    # trains as fp32 AdamW does
    rows = re.findall(r"^    (fp32 AdamW|bf16 \+ fp32 master.*?)\s+([\d.]+),\s+([\d.]+)"
                      r"\s+([\d.]+)$", out, re.M)
    assert len(rows) >= 2, out[-2000:]
    reference = float(rows[0][3])
    for label, planned, measured, loss in rows:
        assert planned == measured, label
        assert abs(float(loss) - reference) < 0.02 * reference, label
    assert float(rows[0][1]) == 16.0


def _norms_fp32(model: nn.Module, low: str) -> nn.Module:
    """Every module in `low`, every norm in fp32: the hand-written plan of the demo model."""
    model = copy.deepcopy(model)
    annotate(model, {nn.Module: low})
    annotate(model, {Norm: "fp32"})
    return model


@pytest.mark.parametrize("low", ["16-mixed", "bf16"])
def test_suggest_needs_fewer_fp32_parameters_than_all_norms_in_fp32(low: str) -> None:
    """Without the planted overflow, nothing needs fp32: the norms cost parameters and buy no
    accuracy. With it, all-norms-fp32 is non-finite: the feed-forwards are what fp16 needs."""
    tokens = _batches(1)[0]
    for gain, expected in ((1.0, []), (2.0 ** 16, ["blocks.0.mlp", "blocks.1.mlp"])):
        torch.manual_seed(0)
        model = TinyTransformer(gain=gain)
        found = suggest(model, tokens, low=low, loss_fn=next_token_loss)
        if low == "bf16":
            expected = []  # bf16 has fp32's range
        assert found.met and found.islands == expected
        norms = _norms_fp32(model, low)
        out = apply(norms, resolve(norms))(tokens[:, :-1])
        ref = copy.deepcopy(model).eval()(tokens[:, :-1])
        norms_error = relative_error(out, ref)
        island_params = sum(e.params for n, e in found.plan.items()
                            if any(n == i or n.startswith(i + ".") for i in found.islands))
        norm_params = sum(p.numel() for m in model.modules() if isinstance(m, Norm)
                          for p in m.parameters())
        if not expected:
            assert island_params == 0 < norm_params
            assert found.final.output_error <= norms_error * 1.01
        else:
            assert math.isinf(norms_error)  # the norms do not help


@pytest.mark.slow
def test_training_100_steps_the_suggested_plan_ends_within_1_percent_of_fp32() -> None:
    torch.manual_seed(0)
    model = TinyTransformer()
    tokens = _batches(1)[0]
    found = suggest(model, tokens, low="16-mixed", loss_fn=next_token_loss)
    everything = copy.deepcopy(model)
    annotate(everything, {nn.Module: "16-mixed"})
    fp32 = train_loop(copy.deepcopy(model), None, 100)
    low = train_loop(everything, resolve(everything), 100)
    islands = train_loop(copy.deepcopy(model), found.plan, 100)
    assert all(math.isfinite(x) for x in islands)
    assert abs(islands[-1] - fp32[-1]) <= 0.01 * fp32[-1], (islands[-1], fp32[-1])
    assert not math.isfinite(low[-1])
    print(f"fp32 {fp32[-1]:.6f}  all fp16 {low[-1]}  suggested {islands[-1]:.6f}")
