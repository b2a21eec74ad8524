"""What `precision-annot <command> --help` says a default is, is what the command does."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from precision_annot import apply, diff, suggest
from precision_annot._src.cli import main


def _help(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return " ".join(capsys.readouterr().out.split())


def _defaults(text: str, option: str, kinds: str) -> dict[str, float]:
    """The "(default: X kind, ...)" values the help gives for `option`."""
    after = text.split("options:", 1)[1].split(option, 1)[1]
    return {k: float(v) for v, k in re.findall(rf"([\d.e-]+) ({kinds})", after)[:3]}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4), nn.LayerNorm(4))


def test_suggests_help_gives_the_tolerances_suggest_uses(
        capsys: pytest.CaptureFixture[str]) -> None:
    """0.5's help said 1e-2 (fp16) and 5e-2 (bf16); suggest used 0.02 and 0.1."""
    said = _defaults(_help("suggest", capsys), "--tolerance X", "fp16|bf16|fp8")
    assert set(said) == {"fp16", "bf16", "fp8"}
    x = torch.randn(64, 8)
    for low in ("fp16", "bf16"):
        assert suggest(_model(), x, low=low).tolerance == said[low], low


def test_diffs_help_gives_its_default_loss_and_tolerances(
        capsys: pytest.CaptureFixture[str]) -> None:
    """0.5's help said the default loss was the outputs summed: the sum of a LayerNorm's
    output is a constant, and diff's default is a fixed projection."""
    text = _help("diff", capsys)
    loss = text.split("options:", 1)[1].split("--loss TARGET", 1)[1].split("--tolerance", 1)[0]
    assert "projection" in loss and "summed" not in loss
    said = _defaults(text, "--tolerance X", "fp16|bf16|wider")
    x = torch.randn(16, 8)
    for spec, key in (("16-true", "fp16"), ("bf16-true", "bf16"), ("fp32", "wider")):
        assert diff(apply(_model(), default=spec), x).tolerance == said[key], key
