"""`GradScaler`: dynamic loss scaling for the local path, fp16-stored parameters included."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from precision_annot import GradScaler, apply, fp16


def test_it_unscales_fp16_stored_gradients_that_torchs_scaler_refuses() -> None:
    model = apply(nn.Linear(4, 1), default="fp16")  # fp16 storage: fp16 gradients
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        plain = torch.amp.GradScaler("cpu")
        plain.scale(model(torch.randn(8, 4)).float().pow(2).mean()).backward()
        plain.unscale_(opt)
    opt.zero_grad()
    scaler = GradScaler(init_scale=2.0 ** 10)
    before = model.weight.detach().clone()
    loss = model(torch.randn(8, 4)).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaled = model.weight.grad.detach().clone()  # type: ignore[union-attr]
    scaler.unscale_(opt)
    torch.testing.assert_close(model.weight.grad, scaled / 2.0 ** 10, rtol=0, atol=0)
    scaler.step(opt)
    scaler.update()
    assert model.weight.dtype == fp16 and not torch.equal(model.weight, before)


def test_a_step_that_overflows_is_skipped_and_the_scale_halves() -> None:
    model = apply(nn.Linear(4, 1), default="16-mixed")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler(init_scale=2.0 ** 16)
    before = model.weight.detach().clone()
    scaler.scale(model(torch.randn(8, 4)).float().sum() * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(model.weight, before) and scaler.get_scale() == 2.0 ** 15


def test_device_and_enabled() -> None:
    assert GradScaler()._device == ("cuda" if torch.cuda.is_available() else "cpu")
    off = GradScaler(enabled=False)  # a bf16 plan: the same loop, no scaling
    loss = torch.tensor(3.0, requires_grad=True)
    assert off.scale(loss) is loss
    with pytest.raises(TypeError, match=r"device=\.\.\.\) takes a device type.*Received: "
                                        r"device=0"):
        GradScaler(device=0)  # type: ignore[arg-type]
