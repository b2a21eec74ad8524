"""One rank of a gloo run of a model whose Linear layers run fp8 GEMMs with comm=fp8 (weights
all-gathered in fp8), a bf16 head and an fp32-stored norm:

- fsdp2 (2 ranks): FSDP2 through `fsdp.fully_shard`, fp8 scales precomputed after each step;
- ddp (2 ranks): DDP with the plan's comm hook, on a process group that records the wire;
- deepspeed (1 rank): DeepSpeed ZeRO stages 2 and 3 with the plan's config, audited.

`python -m torch.distributed.run --nproc_per_node 2 -m tests.workers.fp8 MODE OUTDIR`; each
rank writes OUTDIR/MODE-rank{N}.json.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from precision_annot import PrecisionPlan, annotate, apply, audit, check, resolve
from precision_annot._src.dtypes import dtype_name
from precision_annot.adapters import fsdp
from tests.workers import leave
from tests.workers.collectives import recording, register_recording_gloo

STEPS = 5


class Fp8Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.norm = nn.LayerNorm(64)
        self.down = nn.Linear(64, 64)
        self.head = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(self.norm(self.up(x)).relu()))


def model_and_plan(comm: str = "fp8") -> tuple[nn.Module, PrecisionPlan]:
    torch.manual_seed(0)
    model = Fp8Net()
    annotate(model, {nn.Linear: f"compute=fp8,comm={comm}"})
    annotate(model, {"head": "compute=bf16,comm=bf16"})
    return model, resolve(model, default="bf16-mixed")


def data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(32, 32, generator=gen), torch.randn(32, 16, generator=gen)


def train(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
          precompute: bool) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(STEPS):
        loss = sum(torch.nn.functional.mse_loss(model(x).float(), y) for x, y in batches)
        assert isinstance(loss, torch.Tensor)
        loss = loss / len(batches)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if precompute:
            fsdp.precompute_float8_scales(model)
        losses.append(loss.item())
    return losses


def ddp(rank: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    from precision_annot.adapters import ddp as ddp_adapter
    from tests.workers.collectives import WIRE

    model, plan = model_and_plan()
    apply(model, plan)
    wrapped = DistributedDataParallel(model)
    wrapped.register_comm_hook(None, ddp_adapter.comm_hook(plan))
    WIRE.clear()
    losses = train(wrapped, [data(rank)], precompute=False)
    return {"losses": losses, "wire": sorted({(op, d, n) for op, d, n in WIRE}),
            "findings": [f.code for f in check(wrapped, "ddp")],
            "types": {n: type(m).__name__ for n, m in model.named_modules()}}


def deepspeed_stages(rank: int) -> dict[str, Any]:
    import deepspeed

    from precision_annot.adapters import deepspeed as ds_adapter

    out: dict[str, Any] = {}
    base = {"train_micro_batch_size_per_gpu": 32, "zero_optimization": {"stage": 2},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10_000}
    model, plan = model_and_plan("fp8")  # weights all-gathered in fp8: DeepSpeed cannot
    config = ds_adapter.to_config(plan, base)
    ds_adapter.prepare(model, plan)
    out["fp8_comm_findings"] = [(f.severity, f.code) for f in check(plan, "deepspeed", config)]
    try:
        deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                             config=config)
        out["fp8_comm_error"] = None
    except RuntimeError as e:
        out["fp8_comm_error"] = str(e)
    for stage in (2, 3):
        model, plan = model_and_plan("fp32")
        base = {**base, "zero_optimization": {"stage": stage}}
        config = ds_adapter.to_config(plan, base)
        ds_adapter.prepare(model, plan)
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), config=config)
        x, y = data(rank)
        losses = []
        for step in range(STEPS):
            if step == 0:
                with audit(model) as report:
                    loss = torch.nn.functional.mse_loss(engine(x).float(), y)
                    engine.backward(loss)
            else:
                loss = torch.nn.functional.mse_loss(engine(x).float(), y)
                engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[f"stage{stage}"] = {
            "losses": losses,
            "divergences": [str(d) for d in report.divergences],
            "fp8_gemms": {n: dict(report[n].fp8_gemms) for n in ("up", "down", "head")},
            "findings": [f.code for f in check(plan, "deepspeed", config)],
            "types": {n: type(m).__name__ for n, m in model.named_modules()},
        }
        engine.destroy()
    return out


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "deepspeed":
        import deepspeed

        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                           ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(key, value)
        deepspeed.init_distributed(dist_backend="gloo")
        (out / "deepspeed-rank0.json").write_text(json.dumps(deepspeed_stages(0)))
        leave()
    rank = int(os.environ["RANK"])
    if mode == "ddp":
        register_recording_gloo()
        dist.init_process_group("recgloo")
        (out / f"ddp-rank{rank}.json").write_text(json.dumps(ddp(rank)))
        leave()
    dist.init_process_group("gloo")
    model, plan = model_and_plan()
    reference = copy.deepcopy(model)
    fsdp.fully_shard(model, plan)
    with recording(dist) as calls:
        losses = train(model, [data(rank)], precompute=True)
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
            for n, p in model.named_parameters()}
    # one process, the same plan, both ranks' data (FSDP averages the two ranks' gradients)
    apply(reference, plan)
    ref_losses = train(reference, [data(0), data(1)], precompute=False)
    worst = max((full[n].float() - p.detach().float()).abs().max().item()
                for n, p in reference.named_parameters())
    result = {
        "losses": losses,
        "ref_losses": ref_losses,
        "worst": worst,
        "storage": {n: dtype_name(p.dtype) for n, p in model.named_parameters()},
        "gathers": sorted({d for op, d, _ in calls if op.startswith("all_gather")}),
        "reduces": sorted({d for op, d, _ in calls if op.startswith("reduce_scatter")}),
        "calls": calls,
        "types": {n: type(m).__name__ for n, m in model.named_modules()},
    }
    (out / f"fsdp2-rank{rank}.json").write_text(json.dumps(result))
    leave()


if __name__ == "__main__":
    main()
