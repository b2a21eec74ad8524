"""One rank of a 2-rank gloo run of `watch`: `python -m torch.distributed.run --nproc_per_node 2
-m tests.workers.watching MODE OUTDIR` with MODE "ddp", "fsdp2" or "moe".

A bf16 model (its norm an fp32 island) trains 2 steps, watched on every step. The ranks see
different batches: rank 1's are 50 times larger; on step 0 only rank 1 runs the `extra`
module (as an expert only some ranks route tokens to); on step 1 rank 1's batch holds an inf.
Each rank writes OUTDIR/MODE-rank{N}.json: its own records, the records reduced across ranks,
and what `watch` said; both ranks append their records to one file, OUTDIR/MODE-shared.jsonl.

"moe": an fp16 mixture of experts under DDP. Rank 0 routes its tokens to experts 0 and 1, rank 1
to experts 0 and 3, and expert 3's last Linear (`moe.experts.3.2`) overflows: only rank 1 ran
the module where the overflow starts.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import precision_annot as pa
from tests.workers import leave
from tests.workers.dist import start


class Extra(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.norm = nn.LayerNorm(64)
        self.extra = Extra()
        self.fc2 = nn.Linear(64, 8)
        self.use_extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.relu(self.fc1(x)))
        if self.use_extra:
            h = self.extra(h)
        out: torch.Tensor = self.fc2(h)
        return out


def model() -> Net:
    torch.manual_seed(0)
    net = Net()
    pa.annotate(net, {"*": "bf16-true", nn.LayerNorm: "fp32"})
    return net


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)) for _ in range(4))
        self.route: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x
        for i in self.route:
            out = out + self.experts[i](x)
        return out


class MoENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.moe = MoE()
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.moe(torch.relu(self.fc1(x))))
        return out


def moe() -> None:
    from torch.nn.parallel import DistributedDataParallel

    outdir = Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = pa.apply(MoENet(), default="16-true")
    with torch.no_grad():
        net.moe.experts[3][2].weight.mul_(2e5)  # finite weights, an output past fp16's range
    net.moe.route = [0, 1] if rank == 0 else [0, 3]
    runner = DistributedDataParallel(net, find_unused_parameters=True)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 + rank)).half()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with pa.watch(runner, every=1) as w:
            runner(x).float().pow(2).mean().backward()
            w.step()
    out = {"mine": [r.to_dict() for r in w.records(rank)],
           "all": [r.to_dict() for r in w.records("all")],
           "said": [str(s.message) for s in said if "watch:" in str(s.message)]}
    (outdir / f"moe-rank{rank}.json").write_text(json.dumps(out))
    leave()


def main() -> None:
    if sys.argv[1] == "moe":
        moe()
    path, rank, net, runner = start(model)  # FSDP2 shards, or DDP with the plan's hook
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(10 + rank)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        shared = path.with_name(path.name.replace(f"-rank{rank}.json", "-shared.jsonl"))
        with pa.watch(runner, every=1, path=shared) as w:
            for step in range(2):
                x = torch.randn(16, 32, generator=gen) * (50.0 if rank == 1 else 1.0)
                if step == 1 and rank == 1:
                    x[0, 0] = torch.inf
                net.use_extra = step == 0 and rank == 1
                opt.zero_grad()
                runner(x.bfloat16()).float().pow(2).mean().backward()
                opt.step()
                w.step()
    out = {"mine": [r.to_dict() for r in w.records(rank)],
           "all": [r.to_dict() for r in w.records("all")],
           "said": [str(s.message) for s in said if "watch:" in str(s.message)]}
    path.write_text(json.dumps(out))
    leave()


if __name__ == "__main__":
    main()
