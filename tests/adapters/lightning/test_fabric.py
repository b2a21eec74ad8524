"""The Fabric plugin, `FabricAnnotatedPrecision`, on CPU for real."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from precision_annot import fp16, fp32

L = pytest.importorskip("lightning")
from precision_annot.adapters.lightning import FabricAnnotatedPrecision  # noqa: E402
from tests.adapters.lightning.models import Net, data, seen  # noqa: E402


def test_fabric_trains_with_fp16_and_an_fp32_island() -> None:
    torch.manual_seed(0)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[FabricAnnotatedPrecision(
        default="16-mixed")])
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    plugin = fabric.strategy.precision
    losses = []
    for x, y, _ in fabric.setup_dataloaders(data()):
        for _ in range(3):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x).float(), y)
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=10.0, error_if_nonfinite=False)
            optimizer.step()
            losses.append(loss.item())
    assert isinstance(plugin, FabricAnnotatedPrecision) and plugin.scaler is not None
    assert seen(model.module) == {"fc1": fp16, "norm": fp32, "fc2": fp16}
    assert model.module.norm.weight.dtype == fp32 and model.module.fc1.weight.dtype == fp32
    assert losses[-1] < losses[0] * 0.7, losses
