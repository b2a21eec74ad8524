"""Lightning's Trainer with 2 CPU processes: `python -m tests.workers.lightning STRATEGY OUTDIR`.

Lightning's launcher starts the second process by running this module again. Each rank writes
OUTDIR/<strategy>-rank<R>.json with what it observed.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from precision_annot import resolve
from precision_annot._src.dtypes import dtype_name
from precision_annot.adapters import fsdp
from precision_annot.adapters.fsdp import plan_name
from precision_annot.adapters.lightning import AnnotatedFSDPPrecision, AnnotatedPrecision
from tests.workers import leave
from tests.workers.collectives import WIRE, recording, register_recording_gloo
from tests.workers.models import POLICY, Net


class Module(L.LightningModule):  # type: ignore[misc]
    def __init__(self, strategy: str) -> None:
        super().__init__()
        self.strategy_name = strategy
        self.net = Net(8, 16, 1)
        self.losses: list[float] = []
        self.batch_dtypes: list[str] = []

    def configure_model(self) -> None:
        if self.strategy_name == "model_parallel":
            fsdp.fully_shard(self, resolve(self, default=POLICY),
                             mesh=self.device_mesh["data_parallel"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.batch_dtypes.append(dtype_name(x.dtype))
        loss = nn.functional.mse_loss(self(x).float(), y.float())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def ddp() -> tuple[Any, Any]:
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(), AnnotatedPrecision(default=POLICY)  # the plugin registers the hook


def ddp_own_hook() -> tuple[Any, Any]:
    """The user's own comm hook beside the plugin: Lightning registers it only on CUDA, and the
    plugin then registers none, so on CPU every gradient reduces in its parameter's dtype."""
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    register_recording_gloo()  # DDP's C++ reducer reduces without a Python hook: see the wire
    return (DDPStrategy(ddp_comm_hook=default_hooks.bf16_compress_hook,
                        process_group_backend="recgloo"), AnnotatedPrecision(default=POLICY))


def model_parallel() -> tuple[Any, Any]:
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    return strategy, AnnotatedPrecision(default=POLICY)


def deepspeed() -> tuple[Any, Any]:
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):  # type: ignore[misc]
        """Only Lightning's CUDA-only check is bypassed; DeepSpeed itself runs on its CPU
        accelerator with gloo, for real."""

        def setup_environment(self) -> None:
            DDPStrategy.setup_environment(self)

        def setup_distributed(self) -> None:  # the same, less the CUDA device-index check
            self.set_world_ranks()
            self._init_deepspeed_distributed()

        @property
        def root_device(self) -> torch.device:  # DeepSpeed wants an index: cpu:<rank>
            return torch.device("cpu", self.local_rank)

    strategy = CPUDeepSpeedStrategy(config={"zero_optimization": {"stage": 2},
                                            "train_micro_batch_size_per_gpu": 32,
                                            "zero_allow_untested_optimizer": True},
                                    process_group_backend="gloo")
    from precision_annot.adapters.lightning import AnnotatedDeepSpeedPrecision

    # bf16 layers, an fp32 island; AnnotatedPrecision takes the same path by itself
    return strategy, AnnotatedDeepSpeedPrecision(default="bf16")


def fsdp1() -> tuple[Any, Any]:
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel

    class CPUFSDPStrategy(FSDPStrategy):  # type: ignore[misc]
        """Only Lightning's device choice is bypassed: it passes device_id=None on CPU, which
        FSDP1 refuses; here device_id=cpu. FSDP1 itself runs for real with gloo."""

        def _setup_model(self, model: nn.Module) -> nn.Module:
            return FullyShardedDataParallel(
                module=model, cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"),
                **self.kwargs)

    return CPUFSDPStrategy(process_group_backend="gloo"), AnnotatedFSDPPrecision(default=POLICY)


STRATEGIES: dict[str, Callable[[], tuple[Any, Any]]] = {
    "ddp": ddp, "ddp-own-hook": ddp_own_hook, "model_parallel": model_parallel,
    "deepspeed": deepspeed, "fsdp": fsdp1,
}


def full_params(trainer: Any, model: Module, name: str) -> dict[str, list[float]]:
    def values() -> dict[str, list[float]]:
        out = {}
        for n, p in model.named_parameters():
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[plan_name(n)] = t.detach().double().flatten().tolist()
        return out

    if name == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(trainer.strategy.model):
            return values()
    return values()


def main() -> None:
    name, outdir = sys.argv[1], Path(sys.argv[2])
    torch.manual_seed(0)
    model = Module(name)
    strategy, plugin = STRATEGIES[name]()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    loader = DataLoader(TensorDataset(x, x[:, :1] * 2 + 1), batch_size=32)  # 1 batch per rank
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin],
                        max_steps=6, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with recording(dist) as calls:
        trainer.fit(model, loader)
    reduced = {(d, n) for op, d, n in [*calls, *WIRE] if n > 1 and op in (
        "all_reduce", "reduce_scatter_single", "reduce_scatter_tensor", "allreduce")}
    (outdir / f"{name}-rank{trainer.global_rank}.json").write_text(json.dumps({
        "losses": model.losses,
        "batch": model.batch_dtypes[:1],
        "seen": model.net.seen(),
        "storage": {plan_name(n): dtype_name(p.dtype) for n, p in model.named_parameters()},
        "reduced": sorted(reduced),
        "params": full_params(trainer, model, name),
        "config": {k: v for k, v in trainer.strategy.config.items() if k in
                   ("bf16", "fp16", "torch_autocast")} if name == "deepspeed" else {},
    }))
    leave()


if __name__ == "__main__":
    main()
