"""Lightning Trainer and Fabric with the annotated precision plugins, on CPU, for real."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from precision_annot import bf16, fp16, fp32, precision, resolve

L = pytest.importorskip("lightning")
from precision_annot.adapters.lightning import (  # noqa: E402
    AnnotatedPrecision,
    FabricAnnotatedPrecision,
)

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


@pytest.mark.parametrize(("default", "low"), [("bf16-mixed", bf16), ("16-true", fp16)])
def test_trainer_fits_with_an_fp32_island(default: str, low: torch.dtype) -> None:
    torch.manual_seed(0)
    model = Net()
    plugin = AnnotatedPrecision(default=default)
    L.Trainer(max_steps=12, plugins=[plugin], enable_checkpointing=False, **QUIET).fit(model,
                                                                                        data())
    # batches are cast before they are moved (Lightning issue 17727); integers untouched
    assert model.batch_dtypes[0] == (low, low, torch.int64)
    assert seen(model) == {"fc1": low, "norm": fp32, "fc2": low}
    storage = fp32 if default.endswith("mixed") else low
    assert model.fc1.weight.dtype == storage and model.norm.weight.dtype == fp32
    assert model.losses[-1] < model.losses[0] * 0.7, model.losses
    assert plugin.precision == default
    assert (plugin.scaler is not None) == (low == fp16)


def test_fp16_unscales_before_clipping_and_skips_a_non_finite_step() -> None:
    torch.manual_seed(0)
    model = Net(inf_at=3)
    plugin = AnnotatedPrecision(default="16-mixed")
    L.Trainer(max_steps=8, plugins=[plugin], gradient_clip_val=1.0, enable_checkpointing=False,
              **QUIET).fit(model, data())
    assert plugin.scaler is not None
    # unscaled before the clipping hook: gradient norms are O(1), not O(2**16)
    finite = [g for g in model.grad_norms if math.isfinite(g)]
    assert finite and max(finite) < 100, model.grad_norms
    # the non-finite step changed nothing, and the scale was lowered
    before, after = model.snapshots[3], model.snapshots[4]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(model.snapshots[4], model.snapshots[5],
                                                      strict=True))
    assert plugin.scaler.get_scale() < 2.0**16


def test_scaler_state_is_saved_and_restored(tmp_path: Path) -> None:
    torch.manual_seed(0)
    plugin = AnnotatedPrecision(default="16-mixed")
    trainer = L.Trainer(max_steps=4, plugins=[plugin], default_root_dir=tmp_path, **QUIET)
    trainer.fit(Net(inf_at=1), data())
    assert plugin.scaler is not None
    saved_scale = plugin.scaler.get_scale()
    assert saved_scale < 2.0**16  # lowered by the overflow
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    state = torch.load(ckpt, weights_only=False)
    assert state["AnnotatedPrecision"]["scale"] == saved_scale

    resumed = AnnotatedPrecision(default="16-mixed")
    seen: list[float] = []

    class Probe(L.Callback):  # type: ignore[misc]
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            assert resumed.scaler is not None
            seen.append(resumed.scaler.get_scale())

    L.Trainer(max_steps=6, plugins=[resumed], callbacks=[Probe()], default_root_dir=tmp_path,
              **QUIET).fit(Net(), data(), ckpt_path=ckpt)
    assert seen == [saved_scale]


def test_trainer_precision_and_plugin_together_raise() -> None:
    with pytest.raises(ValueError, match="precision"):
        L.Trainer(precision="bf16-mixed", plugins=[AnnotatedPrecision()], **QUIET)


def test_plugin_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError, match="plan must be a PrecisionPlan"):
        AnnotatedPrecision(plan="bf16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="default is only used"):
        AnnotatedPrecision(plan=resolve(nn.Linear(2, 2)), default="bf16")
    with pytest.raises(ValueError, match="'fp9'"):
        AnnotatedPrecision(default="fp9")


def test_explicit_plan_is_used() -> None:
    torch.manual_seed(0)
    model = Net()
    plan = resolve(model, default="bf16-mixed")
    plugin = AnnotatedPrecision(plan)
    L.Trainer(max_steps=2, plugins=[plugin], enable_checkpointing=False, **QUIET).fit(model,
                                                                                       data())
    assert plugin.plan is plan and seen(model)["norm"] == fp32


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
