"""The LightningModule the in-process Lightning tests train: an fp32 island between two low
layers, each recording the dtype its forward saw."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from precision_annot import fp32, precision

QUIET = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_progress_bar": False,
         "enable_model_summary": False}


class RecLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = x.dtype
        return super().forward(x)


class RecNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = x.dtype
        return super().forward(x)


class Net(L.LightningModule):  # type: ignore[misc]
    def __init__(self, inf_at: int | None = None) -> None:
        super().__init__()
        self.fc1 = RecLinear(8, 16)
        self.norm = precision(fp32)(RecNorm(16))
        self.fc2 = RecLinear(16, 1)
        self.inf_at = inf_at
        self.batch_dtypes: list[tuple[torch.dtype, ...]] = []
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.snapshots: dict[int, list[torch.Tensor]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(torch.relu(self.norm(self.fc1(x))))
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        self.batch_dtypes.append((x.dtype, y.dtype, idx.dtype))
        loss = nn.functional.mse_loss(self(x).float(), y.float())
        self.losses.append(loss.item())
        self.snapshots[self.global_step] = [p.detach().clone() for p in self.parameters()]
        if self.inf_at is not None and self.global_step == self.inf_at:
            loss = loss * math.inf
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        grads = [p.grad.float().norm() for p in self.parameters() if p.grad is not None]
        self.grad_norms.append(float(torch.stack(grads).norm()))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def seen(model: Net) -> dict[str, torch.dtype]:
    return {n: getattr(model, n).seen for n in ("fc1", "norm", "fc2")}


def data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    return DataLoader(TensorDataset(x, x[:, :1] * 2 + 1, torch.arange(64)), batch_size=16)
