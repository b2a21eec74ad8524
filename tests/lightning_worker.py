"""Lightning Trainer with 2 CPU processes: `python tests/lightning_worker.py STRATEGY OUTDIR`.

Lightning's launcher starts the second process by re-running this script. Each rank writes
OUTDIR/<strategy>-rank<R>.json with what it observed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from precision_annot import Policy, fp32, precision, resolve
from precision_annot.adapters import fsdp
from precision_annot.adapters.lightning import AnnotatedFSDPPrecision, AnnotatedPrecision
from precision_annot.dtypes import dtype_name

POLICY = Policy(compute=torch.bfloat16, storage=fp32, comm=torch.bfloat16)
REDUCED: list[tuple[str, int]] = []


class RecLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = dtype_name(x.dtype)
        return super().forward(x)


class RecNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = dtype_name(x.dtype)
        return super().forward(x)


class Net(L.LightningModule):  # type: ignore[misc]
    def __init__(self, strategy: str) -> None:
        super().__init__()
        self.strategy_name = strategy
        self.fc1 = RecLinear(8, 16)
        self.norm = precision(fp32)(RecNorm(16))
        self.fc2 = RecLinear(16, 1)
        self.losses: list[float] = []
        self.batch_dtypes: list[str] = []

    def configure_model(self) -> None:
        if self.strategy_name == "model_parallel":
            fsdp.fully_shard(self, resolve(self, default=POLICY),
                             mesh=self.device_mesh["data_parallel"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(torch.relu(self.norm(self.fc1(x))))
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.batch_dtypes.append(dtype_name(x.dtype))
        loss = nn.functional.mse_loss(self(x).float(), y.float())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def record_reductions() -> None:
    for name in ("all_reduce", "reduce_scatter_single", "reduce_scatter_tensor"):
        original = getattr(dist, name)

        def wrapped(*args: Any, _orig: Any = original, **kwargs: Any) -> Any:
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            t = max(tensors, key=lambda x: x.numel())
            if t.numel() > 1:
                REDUCED.append((dtype_name(t.dtype), t.numel()))
            return _orig(*args, **kwargs)

        setattr(dist, name, wrapped)


def main() -> None:
    strategy_name, outdir = sys.argv[1], Path(sys.argv[2])
    torch.manual_seed(0)
    model = Net(strategy_name)
    if strategy_name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        strategy: Any = DDPStrategy()  # the plugin registers ddp.comm_hook(plan) itself
        plugin = AnnotatedPrecision(default=POLICY)
    elif strategy_name == "deepspeed":
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
        plugin = AnnotatedPrecision(default="bf16")  # bf16 layers, fp32 island (seeds/001)
    elif strategy_name == "fsdp":
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

        strategy = CPUFSDPStrategy(process_group_backend="gloo")
        plugin = AnnotatedFSDPPrecision(default=POLICY)
    else:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        plugin = AnnotatedPrecision(default=POLICY)
    record_reductions()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    loader = DataLoader(TensorDataset(x, x[:, :1] * 2 + 1), batch_size=32)  # 1 batch per rank
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin],
                        max_steps=6, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader)
    params = {}
    if strategy_name == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(trainer.strategy.model):
            for n, p in model.named_parameters():
                clean = n.replace("_fsdp_wrapped_module.", "")
                params[clean] = p.detach().double().flatten().tolist()
    else:
        for n, p in model.named_parameters():
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            params[n] = t.detach().double().flatten().tolist()
    rank = trainer.global_rank
    (outdir / f"{strategy_name}-rank{rank}.json").write_text(json.dumps({
        "losses": model.losses,
        "batch": model.batch_dtypes[:1],
        "seen": {n: getattr(model, n).seen for n in ("fc1", "norm", "fc2")},
        "storage": {n.replace("_fsdp_wrapped_module.", ""): dtype_name(p.dtype)
                    for n, p in model.named_parameters()},
        "reduced": sorted(set(REDUCED)),
        "params": params,
        "config": {k: v for k, v in trainer.strategy.config.items() if k in
                   ("bf16", "fp16", "torch_autocast")} if strategy_name == "deepspeed" else {},
    }))


if __name__ == "__main__":
    main()
