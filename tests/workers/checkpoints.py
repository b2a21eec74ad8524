"""One rank of a 2-rank gloo run: a bf16 model with an fp32 router, sharded by FSDP2 along its
plan, loaded from checkpoints through `torch.distributed.checkpoint`.

`python -m torch.distributed.run --nproc_per_node 2 -m tests.workers.checkpoints OUTDIR`; each
rank writes OUTDIR/rank{N}.json with what it observed:

- "sharded": a bf16 checkpoint (every tensor bf16, the router too) loaded by `dcp.load` into
  the sharded model's own state dict, with `adapters.dcp.LoadPlanner`;
- "full": the same checkpoint loaded whole (`dcp.load` into a plain state dict) and set with
  `set_model_state_dict(full_state_dict=True)`, which hands the sharded model new tensors
  (`load_state_dict(assign=True)`);
- "broadcast": the checkpoint on rank 0 only, set with `broadcast_from_rank0=True` and
  `cpu_offload=True`;
- "resume": 2 steps, a DCP checkpoint of model and optimizer (`get_state_dict`), 2 steps more;
  then a fresh sharded model and optimizer loaded from it (`set_state_dict`) and run the same 2
  steps: the parameters of both, to compare bit for bit.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from precision_annot import check, fp32, precision, resolve
from precision_annot._src.dtypes import dtype_name
from precision_annot.adapters import fsdp as fsdp_adapter
from precision_annot.adapters.dcp import LoadPlanner
from tests.workers import leave


class Moe(nn.Module):
    """A bf16 block whose router is an fp32 island, as MoE models keep it."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.router = precision(fp32)(nn.Linear(32, 4))
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        gate = self.router(h).softmax(-1).max(-1, keepdim=True).values
        return self.down(h) * gate.to(h.dtype)


def sharded(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = Moe()
    return fsdp_adapter.fully_shard(model, resolve(model, default="bf16-true"))


def local(model: nn.Module) -> dict[str, Any]:
    """Each parameter's local shard: its dtype and values."""
    out = {}
    for name, p in model.named_parameters():
        shard = p.to_local() if hasattr(p, "to_local") else p
        out[name] = {"dtype": dtype_name(shard.dtype), "values": shard.detach().double().tolist()}
    return out


def reference_bf16() -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: another model's, every one in bf16 (router values off the bf16
    grid before rounding, so the rounding shows)."""
    torch.manual_seed(1)
    source = Moe()
    return {k: v.detach().to(torch.bfloat16) for k, v in source.state_dict().items()}


def load_sharded(path: Path) -> dict[str, Any]:
    model = sharded()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.load({"model": get_model_state_dict(model)}, checkpoint_id=str(path),
                 planner=LoadPlanner())
    return {"params": local(model), "warnings": [str(w.message) for w in caught
                                                 if "narrower" in str(w.message)]}


def load_full(path: Path) -> dict[str, Any]:
    model = sharded()
    full = {"model": {k: torch.empty_like(v) for k, v in reference_bf16().items()}}
    dcp.load(full, checkpoint_id=str(path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        set_model_state_dict(model, full["model"],
                             options=StateDictOptions(full_state_dict=True))
    model(torch.randn(4, 16, dtype=torch.bfloat16)).float().sum().backward()  # it still runs
    return {"params": local(model), "warnings": [str(w.message) for w in caught
                                                 if "narrower" in str(w.message)]}


def load_broadcast(rank: int) -> dict[str, Any]:
    """The checkpoint on rank 0 only, broadcast by `set_model_state_dict(full_state_dict=True,
    broadcast_from_rank0=True, cpu_offload=True)`: torch casts each tensor into the model's
    dtype while broadcasting, before `load_state_dict` runs."""
    model = sharded(seed=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        set_model_state_dict(model, reference_bf16() if rank == 0 else {},
                             options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                      broadcast_from_rank0=True))
    model(torch.randn(4, 16, dtype=torch.bfloat16)).float().sum().backward()  # it still runs
    return {"params": local(model), "warnings": [str(w.message) for w in caught
                                                 if "narrower" in str(w.message)]}


def steps(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, start: int) -> None:
    for step in range(start, start + 2):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randn(8, 16, generator=gen).to(torch.bfloat16)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def resume(path: Path, rank: int) -> dict[str, Any]:
    model = sharded()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps(model, optimizer, rank, 0)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    steps(model, optimizer, rank, 2)
    again = sharded(seed=7)  # other weights: all must come from the checkpoint
    optimizer2 = torch.optim.AdamW(again.parameters(), lr=1e-2)
    model_sd, optim_sd = get_state_dict(again, optimizer2)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path), planner=LoadPlanner())
    set_state_dict(again, optimizer2, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    steps(again, optimizer2, rank, 2)
    moments = {n: dtype_name(s["exp_avg"].dtype) for n, s in
               ((n, optimizer2.state[p]) for n, p in again.named_parameters())}
    return {"uninterrupted": local(model), "resumed": local(again), "moments": moments}


def main() -> None:
    outdir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    warnings.filterwarnings("ignore", "torch.distributed is disabled")
    dcp.save({"model": reference_bf16()}, checkpoint_id=str(outdir / "bf16"))
    result: dict[str, Any] = {
        "sharded": load_sharded(outdir / "bf16"),
        "full": load_full(outdir / "bf16"),
        "broadcast": load_broadcast(rank),
        "resume": resume(outdir / "resume", rank),
        "reference": {k: v.double().tolist() for k, v in reference_bf16().items()},
    }
    if rank == 0:  # what check says of the checkpoint, before any load
        plan = resolve(Moe(), default="bf16-true")
        result["check"] = [(f.severity, f.code, f.module) for f in
                           check(plan, "checkpoint", {"path": outdir / "bf16"})]
    (outdir / f"rank{rank}.json").write_text(json.dumps(result))
    leave()


if __name__ == "__main__":
    main()
