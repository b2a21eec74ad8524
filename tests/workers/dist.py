"""One rank of a 2-rank gloo run: train the island model under DDP, FSDP1 or FSDP2.

`python -m torch.distributed.run --nproc_per_node 2 -m tests.workers.dist MODE OUTDIR`; each rank
writes OUTDIR/rank{N}.json with what it observed, and the tests assert on those.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from precision_annot import PrecisionPlan, apply, fp32, resolve
from precision_annot._src.dtypes import dtype_name
from precision_annot.adapters import ddp as ddp_adapter
from precision_annot.adapters import fsdp as fsdp_adapter
from precision_annot.adapters.fsdp import plan_name
from tests.workers import leave
from tests.workers.collectives import recording
from tests.workers.models import POLICY, Net


def ddp(model: nn.Module, plan: PrecisionPlan) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    apply(model, plan)
    wrapped = DistributedDataParallel(model)
    wrapped.register_comm_hook(None, ddp_adapter.comm_hook(plan))
    return wrapped


def fsdp1(model: nn.Module, plan: PrecisionPlan) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel

    apply(model, plan)
    return FullyShardedDataParallel(model, auto_wrap_policy=fsdp_adapter.wrap_policy(plan),
                                    mixed_precision=fsdp_adapter.mixed_precision(plan),
                                    use_orig_params=True, device_id=torch.device("cpu"))


def fsdp2(model: nn.Module, plan: PrecisionPlan) -> nn.Module:
    return fsdp_adapter.fully_shard(model, plan)


MERGE_BELOW = 0.1  # the norm island holds 64 of the 740 parameters

MODES: dict[str, Callable[[nn.Module, PrecisionPlan], nn.Module]] = {
    "ddp": ddp, "fsdp1": fsdp1, "fsdp2": fsdp2,
}


class Rank(NamedTuple):
    """One rank of a 2-rank run of a worker: its output file, its rank, the model, and the
    model as `MODES[mode]` wraps it."""

    out: Path
    rank: int
    net: nn.Module
    runner: nn.Module


def start(model: Callable[[], nn.Module]) -> Rank:
    """Join the gloo group and wrap `model()` in the mode the command line names (DDP with
    the plan's hook, FSDP1 or FSDP2): `python -m ... MODE OUTDIR`."""
    mode, outdir = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    net = model()
    return Rank(outdir / f"{mode}-rank{rank}.json", rank, net, MODES[mode](net, resolve(net)))


def data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    return torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)


def full_params(model: nn.Module, mode: str) -> dict[str, list[float]]:
    def values() -> dict[str, list[float]]:
        out = {}
        for n, p in model.named_parameters():
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[plan_name(n).removeprefix("module.")] = t.detach().double().flatten().tolist()
        return out

    if mode == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model):
            return values()
    return values()


def reference(world: int) -> dict[str, list[float]]:
    """The same 5 steps in one process, on every rank's data, averaging the ranks' losses."""
    torch.manual_seed(0)
    model = apply(Net(), default=POLICY)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [data(r) for r in range(world)]
    for _ in range(5):
        opt.zero_grad()
        loss = sum(nn.functional.mse_loss(model(x).float(), y) for x, y in batches) / world
        loss.backward()  # type: ignore[union-attr]
        opt.step()
    return {n: p.detach().double().flatten().tolist() for n, p in model.named_parameters()}


def plain_fsdp2_error() -> str:
    """FSDP2 on its own: an fp32 LayerNorm unit inside a bf16 model."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4))
    fully_shard(model[1], mp_policy=MixedPrecisionPolicy(param_dtype=fp32))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    try:
        model(torch.randn(4, 16))
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return ""


def state_dict_round_trip(model: nn.Module, mode: str, path: Path) -> bool:
    """Save a sharded state dict with torch.distributed.checkpoint, perturb, load, compare."""
    import torch.distributed.checkpoint as dcp

    def state() -> dict[str, Any]:
        if mode == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp import StateDictType

            with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                return dict(model.state_dict())
        return dict(model.state_dict())

    def local(t: Any) -> torch.Tensor:
        if hasattr(t, "to_local"):
            return t.to_local()  # type: ignore[no-any-return]
        if hasattr(t, "local_shards"):
            return t.local_shards()[0].tensor  # type: ignore[no-any-return]
        return t  # type: ignore[no-any-return]

    sd = state()
    before = {k: local(v).detach().clone() for k, v in sd.items()}
    dcp.save(sd, checkpoint_id=str(path))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    sd = state()
    dcp.load(sd, checkpoint_id=str(path))
    if mode == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import StateDictType

        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            model.load_state_dict(sd)
    else:
        model.load_state_dict(sd)
    after = state()
    return all(torch.equal(before[k], local(after[k])) for k in before)


def train(model: nn.Module, rank: int) -> tuple[list[float], list[Any]]:
    """5 SGD steps on this rank's data: the losses and the collectives they issued."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data(rank)
    losses = []
    with recording(dist) as calls:
        for _ in range(5):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses, calls


def merged(rank: int, merge_below: float) -> dict[str, Any]:
    """FSDP2 with small islands sharing their parent's unit (`merge_below`)."""
    torch.manual_seed(0)
    net = Net()
    model = fsdp_adapter.fully_shard(net, resolve(net, default=POLICY), merge_below=merge_below)
    losses, calls = train(model, rank)
    return {"losses": losses, "seen": net.seen(), "collectives": calls,
            "params": full_params(model, "fsdp2")}


def main() -> None:
    mode, outdir = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict[str, Any] = {"rank": rank}
    if mode == "fsdp2":
        result["plain_fsdp2_error"] = plain_fsdp2_error()
    torch.manual_seed(0)
    net = Net()
    model = MODES[mode](net, resolve(net, default=POLICY))
    result["storage"] = {n: dtype_name(p.dtype) for n, p in model.named_parameters()}
    losses, calls = train(model, rank)
    result.update({
        "losses": losses,
        "seen": net.seen(),
        "collectives": calls,
        "params": full_params(model, mode),
        "reference": reference(world),
        "round_trip": state_dict_round_trip(model, mode, outdir / "ckpt"),
    })
    if mode == "fsdp2":
        result["merged"] = merged(rank, MERGE_BELOW)
    (outdir / f"rank{rank}.json").write_text(json.dumps(result))
    leave()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
