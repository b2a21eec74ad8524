"""One rank of a 2-rank gloo run: train an annotated model with DDP, FSDP1 or FSDP2.

Started by tests/test_distributed.py as
`python -m torch.distributed.run --nproc_per_node 2 tests/dist_worker.py MODE OUTDIR`.
Each rank writes OUTDIR/rank{N}.json with what it observed; the test asserts on those.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from precision_annot import Policy, apply, fp32, precision, resolve
from precision_annot.adapters import ddp, fsdp
from precision_annot.dtypes import dtype_name
from tests.collectives import record
from tests.helpers import Recorder

RECORDED: list[tuple[str, str, int]] = []


def record_collectives() -> None:
    record((dist,), RECORDED)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = Recorder(nn.Linear(16, 32))
        self.norm = precision(fp32)(Recorder(nn.LayerNorm(32)))
        self.fc2 = Recorder(nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(torch.relu(self.norm(self.fc1(x))))
        return out


POLICY = Policy(compute=torch.bfloat16, storage=fp32, comm=torch.bfloat16)


def clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").removeprefix("module.")


def full_params(model: nn.Module, mode: str) -> dict[str, list[float]]:
    out = {}
    if mode == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model):
            for n, p in model.named_parameters():
                out[clean(n)] = p.detach().double().flatten().tolist()
        return out
    for n, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[clean(n)] = t.detach().double().flatten().tolist()
    return out


def data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    return torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)


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


def main() -> None:
    mode, outdir = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict[str, Any] = {"rank": rank}
    if mode == "fsdp2":
        result["plain_fsdp2_error"] = plain_fsdp2_error()
    torch.manual_seed(0)
    model: nn.Module = Net()
    net = model
    plan = resolve(model, default=POLICY)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        apply(model, plan)
        model = DDP(model)
        model.register_comm_hook(None, ddp.comm_hook(plan))
    elif mode == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        apply(model, plan)
        model = FSDP(model, auto_wrap_policy=fsdp.wrap_policy(plan),
                     mixed_precision=fsdp.mixed_precision(plan), use_orig_params=True,
                     device_id=torch.device("cpu"))
    elif mode == "fsdp2":
        fsdp.fully_shard(model, plan)
    result["storage"] = {n: dtype_name(p.dtype) for n, p in model.named_parameters()}
    record_collectives()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data(rank)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        out = model(x)
        loss = nn.functional.mse_loss(out.float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    result["losses"] = losses
    result["out_dtype"] = dtype_name(out.dtype)
    result["seen"] = {n: [dtype_name(d) for d in getattr(net, n).seen[:1]]
                      for n in ("fc1", "norm", "fc2")}
    result["collectives"] = RECORDED
    result["params"] = full_params(model, mode)
    result["reference"] = reference(world)
    result["round_trip"] = checkpoint_round_trip(model, mode, outdir / "ckpt")
    (outdir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def checkpoint_round_trip(model: nn.Module, mode: str, path: Path) -> bool:
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


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
