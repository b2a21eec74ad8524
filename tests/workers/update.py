"""One rank of a 2-rank gloo run of the update half: `python -m torch.distributed.run
--nproc_per_node 2 -m tests.workers.update MODE OUTDIR` with MODE "fsdp2" or "ddp".

The model is bf16 with fp32 masters and 8-bit AdamW state ("bf16-true,master=fp32,optim=8bit",
its norm an fp32 island), trained 4 steps with `precision_annot.optimizer`. Each rank writes
OUTDIR/MODE-rank{N}.json: what it held (parameter and state dtypes, bytes on this rank), what
its Linear layers computed in, the losses, and its parameters whole.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

import precision_annot as pa
from precision_annot._src.dtypes import dtype_name
from precision_annot._src.update import engines
from precision_annot._src.update.optimizer import state_bytes
from tests.workers import leave
from tests.workers.dist import start

SPEC = "bf16-true,master=fp32,optim=8bit"
engines.COMPILE = False  # the low-bit update eagerly: its compiled default has its own test


def model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 64))
    pa.annotate(net, {"*": SPEC, nn.LayerNorm: "fp32"})
    return net


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def main() -> None:
    path, rank, net, runner = start(model)  # FSDP2 shards, or DDP with the plan's hook
    seen: dict[str, str] = {}

    def record(name: str) -> Any:
        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            seen.setdefault(name, dtype_name(out.dtype))

        return hook

    for name, module in net.named_modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(record(name))
    optimizer = pa.optimizer(net, torch.optim.AdamW, lr=3e-3)
    gen = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(32, 64, generator=gen), torch.randn(32, 64, generator=gen)
    losses = []
    for _ in range(4):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(runner(x).float(), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    params = list(net.parameters())
    held = sum(local(p).numel() * local(p).element_size() for p in params)
    grads = sum(local(p.grad).numel() * local(p.grad).element_size() for p in params
                if p.grad is not None)
    kinds = sorted({type(local(v)).__name__ for s in optimizer.state.values()
                    for k, v in s.items() if k == "exp_avg"})
    whole = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().double()
             .flatten().tolist() for n, p in net.named_parameters()}
    out: dict[str, Any] = {
        "losses": losses,
        "storage": {n: dtype_name(local(p).dtype) for n, p in net.named_parameters()},
        "seen": seen,
        "state_kinds": kinds,
        "bytes": held + grads + state_bytes(optimizer),
        "params": whole,
        "masters": sorted({dtype_name(local(s["master"]).dtype)
                           for s in optimizer.state.values() if "master" in s}),
    }
    if path.name.startswith("fsdp2"):
        out["dcp"] = dcp_round_trip(net, runner, optimizer, path.parent, x, y)
    path.write_text(json.dumps(out))
    leave()


def dcp_round_trip(net: nn.Module, runner: nn.Module, optimizer: Any, outdir: Path,
                   x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """torch.distributed.checkpoint: the optimizer's state (fp32 shards, 8-bit states on them)
    saved with get_optimizer_state_dict, loaded into a fresh sharded model and optimizer with
    set_optimizer_state_dict; then one more step of each, compared."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from tests.workers.dist import MODES

    where = str(outdir / "dcp")
    saved = get_optimizer_state_dict(net, optimizer)
    dcp.save({"optim": saved}, checkpoint_id=where)
    fresh = model()
    fresh_runner = MODES["fsdp2"](fresh, pa.resolve(fresh))
    fresh.load_state_dict(net.state_dict())
    again = pa.optimizer(fresh, torch.optim.AdamW, lr=3e-3)
    target = {"optim": get_optimizer_state_dict(fresh, again)}
    dcp.load(target, checkpoint_id=where)
    set_optimizer_state_dict(fresh, again, target["optim"])
    kinds = sorted({type(local(v)).__name__ for s in again.state.values()
                    for k, v in s.items() if k == "exp_avg"})
    for r, o in ((runner, optimizer), (fresh_runner, again)):
        o.zero_grad()
        nn.functional.mse_loss(r(x).float(), y).backward()
        o.step()
    worst = max(float((local(p) - local(q)).abs().max()) for p, q in zip(
        net.parameters(), fresh.parameters(), strict=True))
    return {"keys": sorted(saved["state"]), "kinds": kinds, "worst": worst}


if __name__ == "__main__":
    main()
