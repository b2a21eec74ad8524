"""Run `check`'s scenarios for real and record what each backend did.

`python -m torch.distributed.run --nproc_per_node 2 -m tests.workers.matrix GROUP OUTDIR` for
"ddp", "fsdp", "fsdp1" and "deepspeed"; `python -m tests.workers.matrix single OUTDIR` runs the
local and Lightning scenarios in one process. Rank 0 writes OUTDIR/<scenario>.json:

- refused: the exception that stopped setup or a step, else None;
- wire: (collective, dtype, elements) of each reduction of the second step, as it reached gloo
  (a recording process group: DDP's C++ reducer and built-in hooks included);
- storage: the dtype and elements of every floating parameter the backend holds;
- compute: the dtype each Linear's output had (what it computed in);
- stalled: trainable parameters whose 3 steps moved them by next to nothing;
- tie: for the tied model, the largest difference between the tied parameters after 3 steps;
- numeric: measured losses (gradients flushed to zero, running statistics and updates that
  drifted from an fp32 run).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn
from torch.overrides import TorchFunctionMode

from precision_annot import GradScaler, apply
from precision_annot._src.dtypes import dtype_name
from precision_annot._src.runtime import applied_plan
from precision_annot.adapters import ddp as ddp_adapter
from precision_annot.adapters import deepspeed as ds_adapter
from tests.workers import leave
from tests.workers.collectives import WIRE, recording, register_recording_gloo
from tests.workers.scenarios import SCENARIOS, Scenario, build_applied, data, shard

REDUCTIONS = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single")
STEPS = 3
LR = 0.05


def register_hook(wrapped: nn.Module, kind: str | None, model: nn.Module) -> None:
    """Register the scenario's comm hook on a DDP model (the plan's, DDP's own, or one that
    reduces everything in fp32)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def own(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:  # fp32 always
        buffer = bucket.buffer()
        flat = buffer.float().div_(dist.get_world_size())
        work = dist.all_reduce(flat, async_op=True)
        assert work is not None
        return work.get_future().then(lambda f: buffer.copy_(f.value()[0]))

    own.__annotations__ = {"state": object, "bucket": dist.GradBucket,  # type: ignore[attr-defined]
                           "return": torch.futures.Future[torch.Tensor]}
    if kind == "plan":
        plan = applied_plan(model)
        assert plan is not None
        wrapped.register_comm_hook(None, ddp_adapter.comm_hook(plan))
    elif kind == "builtin_fp16":
        wrapped._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)  # type: ignore[operator]
    elif kind is not None:
        hook = {"fp16_compress": default_hooks.fp16_compress_hook,
                "bf16_compress": default_hooks.bf16_compress_hook,
                "allreduce": default_hooks.allreduce_hook, "own": own}[kind]
        wrapped.register_comm_hook(None, hook)


def setup(scenario: Scenario, model: nn.Module, plan: Any) -> tuple[Any, Any]:
    """The wrapped model (or engine) and its optimizer."""
    run = scenario.run
    if scenario.backend == "ddp":
        apply(model, plan)
        wrapped = nn.parallel.DistributedDataParallel(model)
        register_hook(wrapped, run.get("hook"), model)
        return wrapped, torch.optim.SGD(model.parameters(), lr=LR)
    if scenario.backend in ("fsdp", "fsdp1"):
        wrapped = shard(scenario, model, plan)
        return wrapped, torch.optim.SGD(wrapped.parameters(), lr=LR)
    return _deepspeed(scenario, model, plan)


def _deepspeed(scenario: Scenario, model: nn.Module, plan: Any) -> tuple[Any, Any]:
    import deepspeed
    from deepspeed.runtime import torch_autocast

    torch_autocast.TORCH_AUTOCAST_INITIALIZED = False  # as in a fresh process: see reduced()
    base = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
            "zero_allow_untested_optimizer": True, "steps_per_print": 10_000}
    run = scenario.run
    config = ds_adapter.to_config(plan, run["to_config"]) if "to_config" in run else dict(
        run["config"])
    ds_adapter.prepare(model, plan)
    engine, *_ = deepspeed.initialize(model=model, config={**base, **config},
                                      optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    return engine, None


def _step(scenario: Scenario, runner: Any, optimizer: Any, rank: int) -> torch.Tensor:
    x, y = data(scenario, rank)
    loss = nn.functional.mse_loss(runner(x).float(), y)
    if optimizer is None:  # DeepSpeed's engine
        runner.backward(loss)
        runner.step()
    else:
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss


@contextlib.contextmanager
def full(model: nn.Module, runner: Any) -> Iterator[dict[str, torch.Tensor]]:
    """Every floating parameter, whole, as (name -> a copy in fp64)."""
    named = dict(model.named_parameters(remove_duplicate=False))
    context: Any = contextlib.nullcontext()
    if type(runner).__name__ == "FullyShardedDataParallel":
        context = type(runner).summon_full_params(runner)
    elif type(runner).__name__ == "DeepSpeedEngine" and runner.zero_optimization_stage() == 3:
        import deepspeed

        context = deepspeed.zero.GatheredParameters(list(model.parameters()))
    with context:
        out = {}
        for n, p in named.items():
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            if t.is_floating_point():
                out[n] = t.detach().double().clone()
        yield out


def storage(model: nn.Module) -> list[tuple[str, int]]:
    out = []
    for p in model.parameters():
        held = getattr(p, "ds_tensor", None)
        dtype = held.dtype if held is not None else p.dtype
        numel = getattr(p, "ds_numel", None) or p.numel()
        if dtype.is_floating_point:
            out.append((dtype_name(dtype), int(numel)))
    return out


def stalled(before: torch.Tensor, after: torch.Tensor) -> bool:
    """A parameter that 3 SGD steps at lr 0.05 moved by less than 1e-5 of its size (about 1e-3
    is usual): its updates vanished (an unscaled update is 65536 times too small)."""
    return float((after - before).abs().max()) <= 1e-5 * max(float(before.abs().max()), 1.0)


def watch(model: nn.Module, seen: dict[str, str]) -> None:
    """Record the dtype each Linear's first output had: the dtype it computed in."""
    def hook(name: str) -> Any:
        def record(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            seen.setdefault(name, dtype_name(output.dtype))

        return record

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(hook(name))


class LinearDtypes(TorchFunctionMode):
    """Record the dtype each Linear's own `F.linear` computed in (before a boundary casts its
    output: an fp32 island hands bf16 back to bf16 code), found by the weight it multiplies
    (the module's `weight` at that moment: FSDP's gathered one, a boundary's cast copy)."""

    def __init__(self, model: nn.Module, seen: dict[str, str]) -> None:
        super().__init__()
        self.linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        self.seen = seen

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is nn.functional.linear and isinstance(out, torch.Tensor):
            weight = args[1] if len(args) > 1 else (kwargs or {}).get("weight")
            owner = next((n for n, m in self.linears if m.weight is weight), None)
            if owner is not None:
                self.seen.setdefault(owner, dtype_name(out.dtype))
        return out


def observe(scenario: Scenario, rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model, plan = build_applied(scenario)
    out: dict[str, Any] = {"name": scenario.name, "refused": None, "wire": [], "storage": [],
                           "compute": {}, "stalled": [], "tie": None, "numeric": {}}
    watch(model, out["compute"])
    try:
        runner, optimizer = setup(scenario, model, plan)
        with full(model, runner) as before:
            out["storage"] = storage(model)  # whole: FSDP1 holds flat shards otherwise
        for step in range(STEPS):
            del WIRE[:]
            with recording(dist, c10d) as calls, LinearDtypes(model, out["compute"]):
                _step(scenario, runner, optimizer, rank)
            if step == 1:  # a settled step (DDP rebuilds its buckets after the first)
                wire = WIRE if scenario.backend == "ddp" else [
                    c for c in calls if c[0] in REDUCTIONS]
                out["wire"] = [c for c in wire if c[2] > 1]  # not the loss scaler's flags
        with full(model, runner) as after:
            trainable = {n for n, p in model.named_parameters() if p.requires_grad}
            out["stalled"] = [n for n in before if n in trainable and n in after
                              and stalled(before[n], after[n])]
            if "head.weight" in after and "emb.weight" in after:
                out["tie"] = float((after["head.weight"] - after["emb.weight"]).abs().max())
    except Exception as e:
        out["refused"] = f"{type(e).__name__}: {str(e)[:400]}"
    return out


# -- one process: local numerics and Lightning --------------------------------------------------

def local(scenario: Scenario) -> dict[str, Any]:
    """3 steps of the plan, against the same 3 steps in fp32: what was lost."""
    def train(model: nn.Module, scaler: GradScaler | None) -> dict[str, torch.Tensor]:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        grads: dict[str, torch.Tensor] = {}
        for step in range(STEPS):
            x, y = data(scenario, step)
            loss = nn.functional.mse_loss(model(x).float(), y) * 1e-5  # small gradients
            opt.zero_grad()
            (scaler.scale(loss) if scaler else loss).backward()
            if scaler:
                scaler.unscale_(opt)
            if step == 0:
                grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters()
                         if p.grad is not None}
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        return grads

    torch.manual_seed(0)
    reference, _ = scenario.build()
    model, plan = scenario.build()
    start = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    apply(model, plan)
    scaled = scenario.run.get("scale", False)
    got = train(model, GradScaler() if scaled else None)
    want = train(reference, None)
    flushed = sum(int(((want[n] != 0) & (got[n] == 0)).sum()) for n in want)
    nonzero = sum(int((want[n] != 0).sum()) for n in want)
    moved = {n: p.detach().double() - start[n] for n, p in model.named_parameters()}
    ref_moved = {n: p.detach().double() - start[n] for n, p in reference.named_parameters()}
    update = max(float((moved[n] - ref_moved[n]).norm() / ref_moved[n].norm().clamp_min(1e-30))
                 for n in moved)
    numeric = {"flushed": flushed / max(nonzero, 1), "update_error": update}
    if isinstance(model.norm, nn.BatchNorm1d) and model.norm.running_var is not None:
        var, ref_var = model.norm.running_var.double(), reference.norm.running_var.double()  # type: ignore[union-attr]
        numeric["running_stats"] = float((var - ref_var).norm() / ref_var.norm())
    return {"name": scenario.name, "refused": None, "wire": [],
            "storage": storage(model), "compute": {}, "stalled": [], "tie": None,
            "numeric": numeric}


def lightning(scenario: Scenario) -> dict[str, Any]:
    import lightning.pytorch as pl

    from precision_annot.adapters.lightning import AnnotatedPrecision

    torch.manual_seed(0)
    net, _ = build_applied(scenario)
    seen: dict[str, str] = {}
    watch(net, seen)

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

    run = scenario.run
    kwargs: dict[str, Any] = {"precision": run["precision"]} if "precision" in run else {
        "plugins": [AnnotatedPrecision(default="bf16-mixed")]}
    if run.get("fsdp"):
        from precision_annot.adapters.lightning import AnnotatedFSDPPrecision
        from tests.workers.scenarios import cpu_fsdp_strategy

        kwargs = {"strategy": cpu_fsdp_strategy(),
                  "plugins": [AnnotatedFSDPPrecision(default="bf16-mixed")]}
    out: dict[str, Any] = {"name": scenario.name, "refused": None, "wire": [], "storage": [],
                           "compute": seen, "stalled": [], "tie": None, "numeric": {}}
    x, y = zip(*(data(scenario, r) for r in range(STEPS)), strict=True)
    batches = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.cat(x), torch.cat(y)), batch_size=8)
    try:
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, **kwargs)
        trainer.fit(Lit(), train_dataloaders=batches)
        out["storage"] = storage(net)
    except Exception as e:
        out["refused"] = f"{type(e).__name__}: {str(e)[:400]}"
    return out


def main() -> None:
    group, outdir = sys.argv[1], Path(sys.argv[2])
    warnings.simplefilter("ignore")
    if group == "single":
        for scenario in SCENARIOS:
            if scenario.backend in ("local", "lightning"):
                run = local if scenario.backend == "local" else lightning
                (outdir / f"{scenario.name}.json").write_text(json.dumps(run(scenario)))
        return
    register_recording_gloo()
    if group == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("recgloo" if group == "ddp" else "gloo")
    rank = dist.get_rank()
    for scenario in SCENARIOS:
        if scenario.backend == group:
            result = observe(scenario, rank)
            if rank == 0:
                (outdir / f"{scenario.name}.json").write_text(json.dumps(result))
            dist.barrier()
    leave()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
