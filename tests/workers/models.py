"""The models the multi-process workers train: DeepSpeed issue 2100's bf16 layers around an
fp32 island, with an optional rotary table that must stay fp32 (DeepSpeed issue 5812)."""

from __future__ import annotations

import torch
from torch import nn

from precision_annot import Policy, fp32, precision
from precision_annot._src.dtypes import dtype_name
from tests.helpers import Recorder

#: bf16 compute over fp32 master weights, bf16 gradients on the wire
POLICY = Policy(compute=torch.bfloat16, storage=fp32, comm=torch.bfloat16)


class Rotary(nn.Module):
    """A RoPE-style module whose fp32 `inv_freq` buffer must stay fp32."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(d).float() / d)))
        self.seen: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(dtype_name(self.inv_freq.dtype))
        pos = torch.arange(x.shape[0], dtype=self.inv_freq.dtype, device=x.device)
        return x * torch.cos(pos[:, None] * self.inv_freq[None, :] * 1e-3)


class Net(nn.Module):
    """fc1 (low) -> [rotary (fp32)] -> norm (an fp32 island) -> fc2 (low); each records the
    dtype its forward saw."""

    def __init__(self, d_in: int = 16, d_hidden: int = 32, d_out: int = 4,
                 rotary: bool = False) -> None:
        super().__init__()
        self.fc1 = Recorder(nn.Linear(d_in, d_hidden))
        self.rope = precision(fp32)(Rotary(d_hidden)) if rotary else None
        self.norm = precision(fp32)(Recorder(nn.LayerNorm(d_hidden)))
        self.fc2 = Recorder(nn.Linear(d_hidden, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc1(x)
        if self.rope is not None:
            x = self.rope(x)
        out: torch.Tensor = self.fc2(torch.relu(self.norm(x)))
        return out

    def seen(self) -> dict[str, list[str]]:
        """The dtype each layer's forward saw first."""
        out = {n: [dtype_name(d) for d in getattr(self, n).seen[:1]]
               for n in ("fc1", "norm", "fc2")}
        if self.rope is not None:
            out["rope"] = self.rope.seen[:1]
        return out


class ScaledLinear(nn.Linear):
    """A Linear subclass: DeepSpeed matches exact classes, so it needs its own entry."""


def linear_elements(d_in: int, d_hidden: int, d_out: int) -> int:
    return d_in * d_hidden + d_hidden + d_hidden * d_out + d_out


def norm_elements(d_hidden: int) -> int:
    return 2 * d_hidden
