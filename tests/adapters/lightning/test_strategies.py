"""The Trainer plugin's strategy hooks: which set runs for which strategy, and the DeepSpeed
plugin that names that path (run for real by tests/workers/lightning.py's DeepSpeed worker)."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")
import lightning as L
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

from precision_annot.adapters.lightning import (
    AnnotatedDeepSpeedPrecision,
    AnnotatedPrecision,
)
from precision_annot.adapters.lightning.deepspeed import DeepSpeedHooks
from precision_annot.adapters.lightning.strategies import LocalHooks, hooks_for
from tests.adapters.lightning.models import QUIET, Net


def attached(strategy: object) -> Net:
    """A LightningModule attached to a Trainer of this strategy, as convert_module sees it."""
    module = Net()
    module._trainer = L.Trainer(**{**QUIET, "strategy": strategy, "accelerator": "cpu"}) \
        if not isinstance(strategy, DeepSpeedStrategy) else type("T", (), {"strategy": strategy})()
    return module


def test_each_strategy_gets_its_hooks() -> None:
    plugin = AnnotatedPrecision(default="bf16-mixed")
    assert type(hooks_for(plugin, attached(DeepSpeedStrategy()))) is DeepSpeedHooks
    assert type(hooks_for(plugin, attached(DDPStrategy()))) is LocalHooks
    assert type(hooks_for(plugin, Net())) is LocalHooks  # not attached yet: this process


def test_the_deepspeed_plugin_refuses_another_strategy() -> None:
    plugin = AnnotatedDeepSpeedPrecision(default="bf16-mixed")
    with pytest.raises(TypeError, match=r"needs Trainer\(strategy=DeepSpeedStrategy\(\.\.\.\)\)\. "
                                        r"Received: strategy=DDPStrategy"):
        plugin.convert_module(attached(DDPStrategy()))
