"""One rank of a DeepSpeed run on the CPU accelerator with gloo, for ZeRO stages 0-3.

Run directly for one rank, or under `torch.distributed.run` for two:
`python tests/ds_worker.py MODE STAGES OUTDIR`, MODE in {train, fp16}, STAGES like "0,1,2,3".
Each rank writes OUTDIR/<mode>-stage<S>-rank<R>.json with what it observed.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from precision_annot import fp32, precision, resolve
from precision_annot.adapters import deepspeed as ds_adapter
from precision_annot.dtypes import dtype_name
from tests.collectives import record
from tests.helpers import Recorder

RECORDED: list[tuple[str, str, int]] = []


def record_collectives() -> None:
    import torch.distributed.distributed_c10d as c10d

    record((dist, c10d), RECORDED)  # DeepSpeed's ZeRO-3 calls through c10d directly


class Rotary(nn.Module):
    """A RoPE-style module whose fp32 `inv_freq` buffer must stay fp32 (DeepSpeed issue 5812)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(d).float() / d)))
        self.seen: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(dtype_name(self.inv_freq.dtype))
        pos = torch.arange(x.shape[0], dtype=self.inv_freq.dtype, device=x.device)
        return x * torch.cos(pos[:, None] * self.inv_freq[None, :] * 1e-3)


class Net(nn.Module):
    """seeds/001: bf16 layers f, an fp32 layer g (the norm), a rotary table kept in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = Recorder(nn.Linear(16, 32))
        self.rope = precision(fp32)(Rotary(32))
        self.norm = precision(fp32)(Recorder(nn.LayerNorm(32)))
        self.fc2 = Recorder(nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(torch.relu(self.norm(self.rope(self.fc1(x)))))
        return out


def gathered(engine: Any, params: list[nn.Parameter], stage: int) -> list[list[float]]:
    import deepspeed

    if stage == 3:
        with deepspeed.zero.GatheredParameters(params):
            return [p.detach().double().flatten().tolist() for p in params]
    return [p.detach().double().flatten().tolist() for p in params]


def run_stage(mode: str, stage: int, rank: int) -> dict[str, Any]:
    import deepspeed

    torch.manual_seed(0)
    net = Net()
    default = "fp16" if mode == "fp16" else "bf16"
    plan = resolve(net, default=default)
    base = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10_000}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = ds_adapter.to_config(plan, base)
        ds_adapter.prepare(net, plan)
    island = list(net.norm.parameters())
    before = [p.detach().clone().double().flatten().tolist() for p in island]
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(),
                                                                           lr=0.05),
                                      config=config)
    result: dict[str, Any] = {
        "config": {k: v for k, v in config.items() if k not in base},
        "warnings": [str(w.message) for w in caught],
        "island_storage": [dtype_name(getattr(p, "ds_tensor", p).dtype) for p in island],
        "inv_freq": dtype_name(net.rope.inv_freq.dtype),
    }
    record_collectives()
    gen = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
    losses, skipped = [], []
    for step in range(5):
        out = engine(x)
        loss = nn.functional.mse_loss(out.float(), y)
        if mode == "fp16" and step == 2:
            loss = loss * float("inf")  # an overflow step: it must be skipped, not applied
            params_before = gathered(engine, list(net.parameters()), stage)
        engine.backward(loss)
        engine.step()
        if mode == "fp16" and step == 2:
            skipped.append(gathered(engine, list(net.parameters()), stage) == params_before)
        losses.append(loss.item())
    scaler = (getattr(engine, "torch_autocast_z0_gradscaler", None)
              or getattr(engine.optimizer, "torch_autocast_gradscaler", None))
    result.update({
        "losses": losses,
        "skipped": skipped,
        "scale": None if scaler is None else float(scaler.get_scale()),
        "seen": {**{n: [dtype_name(d) for d in getattr(net, n).seen[:1]]
                    for n in ("fc1", "norm", "fc2")}, "rope": net.rope.seen[:1]},
        "island_before": before,
        "island_after": gathered(engine, island, stage),
        "params": gathered(engine, list(net.parameters()), stage),
        "collectives": sorted({c for c in RECORDED if c[2] > 1}),
        "all_collectives": sorted(set(RECORDED)),
        "comm_dtype": {n: dtype_name(p.comm_dtype) for n, p in net.named_parameters()
                       if hasattr(p, "comm_dtype")},
    })
    RECORDED.clear()
    engine.destroy()
    return result


def main() -> None:
    mode, stages, outdir = sys.argv[1], [int(s) for s in sys.argv[2].split(",")], Path(sys.argv[3])
    import deepspeed

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    for stage in stages:
        result = run_stage(mode, stage, rank)
        (outdir / f"{mode}-stage{stage}-rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
