"""One rank of a 2-rank gloo run: fp32 LayerNorm islands in a bf16-mixed model under FSDP2,
sharded as `adapters.fsdp.fully_shard` does on the installed torch (from torch 2.15 each
island stays in its block's unit, gathered in fp32 through `param_dtype_override_fn`) and with
each island its own unit (what torch 2.13 and 2.14 need), trained alike.

`python -m torch.distributed.run --nproc_per_node 2 -m tests.workers.islands OUTDIR`: each rank
writes OUTDIR/rank{N}.json with each layout's collectives, the dtypes the islands saw and the
trained parameters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from precision_annot import fp32, precision, resolve
from precision_annot._src.dtypes import dtype_name
from precision_annot.adapters import fsdp
from tests.workers import leave
from tests.workers.collectives import recording

BLOCKS = 3
STEPS = 3


class Norm(nn.LayerNorm):
    """A LayerNorm recording the dtypes of its input and of its weight as its forward sees
    it (under FSDP2: as gathered)."""

    def __init__(self, d: int) -> None:
        super().__init__(d)
        self.seen: list[tuple[str, str]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((dtype_name(x.dtype), dtype_name(self.weight.dtype)))
        return super().forward(x)


class Block(nn.Module):
    """A Llama-like block in miniature: a projection, then its fp32 norm island."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.norm = precision(fp32)(Norm(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.norm(torch.relu(self.proj(x)))
        return out


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(BLOCKS)], nn.Linear(32, 4))


def train(units: list[Any], rank: int) -> dict[str, Any]:
    net = model()
    plan = resolve(net, default="bf16-mixed")  # comm=fp32: every unit reduces in fp32
    sharded = fsdp.fully_shard(net, plan, units=units)
    from torch.distributed.fsdp import FSDPModule

    opt = torch.optim.SGD(sharded.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(8, 32, generator=gen), torch.randn(8, 4, generator=gen)
    with recording(dist) as calls:
        for _ in range(STEPS):
            opt.zero_grad()
            nn.functional.mse_loss(sharded(x).float(), y).backward()
            opt.step()
    params = {n: p.full_tensor().detach().double().flatten().tolist()
              for n, p in sharded.named_parameters()}
    return {
        "units": [n for n, m in sharded.named_modules() if isinstance(m, FSDPModule)],
        "kept": sorted(set(u.name for u in fsdp.sharded_units(plan, sharded) or []
                           for _ in u.kept)),
        "collectives": calls,
        "seen": sorted({s for block in net[:BLOCKS] for s in block.norm.seen}),
        "params": params,
    }


def main() -> None:
    outdir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {"native": train([Block], rank), "separate": train([Block, Norm], rank)}
    (outdir / f"rank{rank}.json").write_text(json.dumps(result))
    leave()


if __name__ == "__main__":
    main()
