"""`precision-annot demo`: the main job. On CPU, in under a minute, it:

1. builds a small transformer annotated three ways (a decorator, a scope, a rule);
2. prints its precision plan;
3. trains it under the plan with the Lightning Trainer and `AnnotatedPrecision`;
4. trains the same model in fp32 and prints both final losses side by side;
5. writes the DeepSpeed config for the plan to a file.
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from precision_annot._demo import TinyTransformer, build_model
from precision_annot.resolution import resolve

VOCAB, SEQ = 64, 32


def _data(steps: int, batch: int) -> Any:
    """Sequences that count up modulo VOCAB from a random start: next-token prediction."""
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, VOCAB, (steps * batch, 1), generator=g)
    tokens = (starts + torch.arange(SEQ + 1)) % VOCAB
    return DataLoader(TensorDataset(tokens), batch_size=batch, shuffle=False)


def _module(model: nn.Module) -> Any:
    import lightning as L

    class LanguageModel(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.final_loss = float("nan")

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (tokens,) = batch
            logits = self.model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB),
                                               tokens[:, 1:].reshape(-1))
            self.log("loss", loss, prog_bar=True)
            self.final_loss = loss.item()
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    return LanguageModel()


def _fit(model: nn.Module, plugins: list[Any], steps: int, label: str) -> tuple[float, float]:
    import lightning as L

    module = _module(model)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, plugins=plugins,
                        logger=False, enable_checkpointing=False, enable_model_summary=False,
                        enable_progress_bar=True)
    print(f"\n{label}")
    start = time.perf_counter()
    trainer.fit(module, _data(steps, 16))
    return module.final_loss, time.perf_counter() - start


def run_demo(*, fast: bool = False, out: str | Path = "demo-output") -> int:
    from precision_annot.adapters import deepspeed as ds_adapter
    from precision_annot.adapters.lightning import AnnotatedPrecision

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    steps = 30 if fast else 120

    print("precision_annot demo: one precision declaration, every backend.\n")
    print("1. A small transformer, annotated three ways (precision_annot/_demo.py):")
    print("   @precision(fp32) on the Norm class             -> every norm computes and")
    print("                                                     stores in fp32")
    print("   with precision_scope(compute=bf16, storage=fp32,")
    print("                        comm=bf16): model = ...    -> everything built inside computes")
    print("                                                     in bf16 over fp32 master weights")
    print("   annotate(model, {'head': 'compute=fp32,output=fp32'})")
    print("                                                  -> the head computes in fp32 and")
    print("                                                     hands back fp32 logits\n")
    torch.manual_seed(0)
    model = build_model(vocab=VOCAB)
    plan = resolve(model)
    print("2. The plan: each module's dtypes, where each came from (source), and the")
    print("   boundaries (*) where casts happen. Everything else runs untouched.\n")
    print(plan)

    torch.manual_seed(0)
    reference = TinyTransformer(vocab=VOCAB)  # no annotations: plain fp32
    reference.load_state_dict(model.state_dict())

    annotated_loss, annotated_s = _fit(
        model, [AnnotatedPrecision()], steps,
        f"3. Training under the plan: Lightning Trainer + AnnotatedPrecision, {steps} steps")
    fp32_loss, fp32_s = _fit(reference, [], steps,
                             f"4. The same model in plain fp32, {steps} steps")

    gap = abs(annotated_loss - fp32_loss) / fp32_loss
    print("\n                 annotated plan   plain fp32")
    print(f"   final loss    {annotated_loss:14.6f}   {fp32_loss:10.6f}   (relative gap {gap:.2%})")
    print(f"   wall time     {annotated_s:13.1f}s   {fp32_s:9.1f}s")
    print("   The bf16 run tracks fp32 closely because norms, head and logits stay in fp32.")
    print("   bf16 matmuls are slow on most CPUs; the speed and memory pay off on GPUs.")
    weights = dict(model.named_parameters())
    print(f"   storage after training: blocks.0.qkv.weight "
          f"{weights['blocks.0.qkv.weight'].dtype}, blocks.0.norm1.weight "
          f"{weights['blocks.0.norm1.weight'].dtype} (fp32 master weights)")

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "deepspeed_config.json"
    base = {"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": 2}}
    config = ds_adapter.to_config(resolve(model), base)
    path.write_text(json.dumps(config, indent=2) + "\n")
    print(f"\n5. The same plan as a DeepSpeed config, written to {path}:")
    print(f"   {json.dumps(config['torch_autocast'])}")
    print("   Call precision_annot.adapters.deepspeed.prepare(model) before deepspeed.initialize.")
    print("\nNext: docs/index.md for the tour, docs/cookbook/ for recipes, "
          "`precision-annot report pkg.module:make_model` for your own model.")
    return 0
