"""2 ranks: `precision_annot.schedule` under DistributedDataParallel. A switch changes the
parameters' dtypes, and DDP's buckets were made for the old ones: without wrapping the model
again the replicas drift apart (measured, for the test's records); wrapped again at each switch
(`sched.step()` returns True there), every rank equals one process stepping the whole batch."""

from __future__ import annotations

import json
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import precision_annot as pa

PHASES: dict[int | float, str] = {0: "bf16-master", 2: "32-true"}
STEPS = 4


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(10 + step))


def _run(rewrap: bool, rank: int) -> tuple[list[str], nn.Module]:
    model = _model()
    opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-2)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        sched = pa.schedule(model, PHASES, optimizer=opt)
    ddp = DistributedDataParallel(model)
    for step in range(STEPS):
        x = _batch(step)[4 * rank:4 * rank + 4].to(model[0].weight.dtype)
        ddp(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if sched.step() and rewrap:
            ddp = DistributedDataParallel(model)  # buckets for the new dtypes
    return [str(w.message) for w in said if "schedule" in str(w.message)], model


def _whole() -> nn.Module:
    """One process, by hand: each half's gradient (as each rank computes it), averaged as DDP
    averages them (each divided by the ranks, then summed), then the step."""
    model = _model()
    opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-2)
    sched = pa.schedule(model, PHASES, optimizer=opt)
    for step in range(STEPS):
        halves = []
        for rank in (0, 1):
            x = _batch(step)[4 * rank:4 * rank + 4].to(model[0].weight.dtype)
            model(x).float().pow(2).mean().backward()
            halves.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
            opt.zero_grad()
        for p, a, b in zip(model.parameters(), *halves, strict=True):
            p.grad = a / 2 + b / 2
        opt.step()
        opt.zero_grad()
        sched.step()
    return model


def _spread(model: nn.Module) -> float:
    """The largest difference of a weight between the ranks."""
    worst = 0.0
    for p in model.parameters():
        mine = p.detach().float().clone()
        top = mine.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        worst = max(worst, float((top - mine).abs().max()))
    low = torch.tensor([worst])
    dist.all_reduce(low, op=dist.ReduceOp.MAX)
    return float(low)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    said, rewrapped = _run(True, rank)
    _, kept = _run(False, rank)
    whole = _whole()
    off = max(float((a.detach().float() - b.detach().float()).abs().max())
              for a, b in zip(rewrapped.parameters(), whole.parameters(), strict=True))
    out = {"said": said, "rewrapped_spread": _spread(rewrapped), "kept_spread": _spread(kept),
           "rewrapped_vs_whole": off, "dtype": str(rewrapped[0].weight.dtype)}
    if rank == 0:
        print("RESULT " + json.dumps(out))
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
