"""`precision-annot demo`: the main job. On CPU, in under a minute, it:

1. builds a small transformer annotated three ways (a decorator, a scope, a rule);
2. prints its precision plan;
3. trains it under the plan with the Lightning Trainer and `AnnotatedPrecision`;
4. trains the same model in fp32 and prints both final losses side by side;
5. writes the DeepSpeed config for the plan to a file;
6. asks `suggest` which modules fp16 needs in fp32 (the model's feed-forward runs a hidden
   state past fp16's range, as T5's does), and prints its table;
7. trains the model three ways over the same steps: fp32, all fp16 with loss scaling, and the
   suggested plan, and prints the final losses side by side;
8. checks the suggested plan before a launch on DeepSpeed ZeRO-2 and on FSDP2, and prints what
   each would refuse or run badly;
9. trains the model with fp8 GEMMs (torchao, where installed) and bf16 islands against bf16,
   prints the loss gap, and what `audit` saw run in fp8.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from precision_annot._src import float8
from precision_annot._src.annotation import annotate
from precision_annot._src.auditing import audit
from precision_annot._src.checking import check
from precision_annot._src.demo_model import Norm, TinyTransformer, build_model
from precision_annot._src.plan import PrecisionPlan
from precision_annot._src.resolution import resolve
from precision_annot._src.runtime import applied_plan, apply
from precision_annot._src.scaler import GradScaler
from precision_annot._src.suggest import suggest
from precision_annot._src.update.optimizer import optimizer, state_bytes

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
    # one epoch of `steps` batches: max_steps alone leaves max_epochs=-1, which the progress
    # bar prints as "Epoch 0/-2"
    trainer = L.Trainer(max_steps=steps, max_epochs=1, accelerator="cpu", devices=1,
                        plugins=plugins, logger=False, enable_checkpointing=False,
                        enable_model_summary=False, enable_progress_bar=True)
    print(f"\n{label}")
    start = time.perf_counter()
    trainer.fit(module, _data(steps, 16))
    return module.final_loss, time.perf_counter() - start


def run_demo(*, fast: bool = False, out: str | Path = "demo-output") -> int:
    # deferred: optional backends (the lightning extra), loaded when the demo runs
    from precision_annot.adapters import deepspeed as ds_adapter
    from precision_annot.adapters.lightning import AnnotatedPrecision

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    steps = 30 if fast else 120

    print("precision_annot demo: one precision declaration, every backend.\n")
    print("1. A small transformer, annotated three ways (precision_annot/_src/demo_model.py):")
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
    suggested = islands_demo(steps)
    check_demo(suggested)
    fp8_demo(steps // 2)  # a CPU emulates fp8 GEMMs slowly: about 1.2 s a step here
    update_demo(steps)
    print("\nNext: docs/index.md for the tour, docs/cookbook/ for recipes, "
          "`precision-annot report pkg.module:make_model` for your own model.")
    return 0


def _batches(steps: int, batch: int = 16) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, VOCAB, (steps * batch, 1), generator=g)
    tokens = (starts + torch.arange(SEQ + 1)) % VOCAB
    return tuple(tokens[i:i + batch] for i in range(0, steps * batch, batch))


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The language-model loss of logits computed on `tokens` itself: each position predicts
    the next token, the last position predicts nothing. As `loss_fn(output, sample)` it works
    on any part of a batch, which `suggest` needs to check held-out batches."""
    return nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, VOCAB),
                                       tokens[:, 1:].reshape(-1))


def _next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB),
                                       tokens[:, 1:].reshape(-1))


def train_loop(model: nn.Module, plan: PrecisionPlan | None, steps: int) -> list[float]:
    """A plain PyTorch loop: apply, AdamW, a GradScaler when the plan uses fp16."""
    if plan is not None:
        apply(model, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = GradScaler() if plan is not None and plan.needs_loss_scaling else None
    losses = []
    for tokens in _batches(steps):
        loss = _next_token_loss(model(tokens[:, :-1]), tokens)
        optimizer.zero_grad()
        if scaler is None:
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
        else:
            scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
            scaler.step(optimizer)
            scaler.update()
        losses.append(loss.item())
    return losses


def islands_demo(steps: int) -> PrecisionPlan:
    """Sections 6 and 7: suggest's islands for fp16, and why they matter, in training; returns
    the suggested plan."""
    print("\n6. Which modules does fp16 need in fp32? suggest(model, batch, low='16-mixed')")
    print("   The feed-forward's hidden state runs 2**16 times larger than its output (T5's")
    print("   pattern): fine in fp32 and bf16, past fp16's 65504. suggest runs each module")
    print("   alone in fp16, then checks candidate plans end to end (outputs, loss, gradients).\n")
    torch.manual_seed(0)
    model = TinyTransformer(vocab=VOCAB)
    sample = _batches(1)[0]
    found = suggest(model, sample, low="16-mixed", loss_fn=next_token_loss)
    print(found)

    everything_low = copy.deepcopy(model)
    annotate(everything_low, {nn.Module: "16-mixed"})  # a rule on every module: no island
    runs = [("fp32", copy.deepcopy(model), None),
            ("all fp16 + loss scaling", everything_low, resolve(everything_low)),
            (f"suggested ({len(found.islands)} islands)", copy.deepcopy(model), found.plan)]
    print(f"\n7. The same model trained {steps} steps three ways (plain PyTorch loop, AdamW,")
    print("   fp16 compute over fp32 master weights, precision_annot.GradScaler for fp16):\n")
    finals = {}
    for label, run_model, plan in runs:
        losses = train_loop(run_model, plan, steps)
        finals[label] = losses[-1]
    width = max(len(label) for label in finals)
    for label, value in finals.items():
        note = "  (non-finite: every step skipped)" if not math.isfinite(value) else ""
        print(f"   {label:<{width}}  final loss {value:10.6f}{note}")
    fp32_loss, suggested = finals["fp32"], list(finals.values())[-1]
    gap = abs(suggested - fp32_loss) / fp32_loss
    print(f"\n   The suggested plan ends {gap:.2%} from fp32; without islands fp16 never trains.")
    print("   `precision-annot suggest mymod:make_model --sample mymod:make_batch --low fp16`")
    print("   does the same for your model and writes the plan for every backend.")
    return found.plan


def check_demo(plan: PrecisionPlan) -> None:
    """Section 8: what two backends would do with the suggested fp16 plan."""
    print("\n8. Before launching the suggested plan: check(plan, backend, config)")
    for backend, config in (("deepspeed", {"zero_optimization": {"stage": 2}}), ("fsdp", None)):
        found = check(plan, backend, config)
        shown = f"{backend}, {json.dumps(config)}" if config else backend
        print(f"\n   {shown}: {len(found)} findings")
        for finding in found:
            print(textwrap.fill(str(finding), width=92, initial_indent="   - ",
                                subsequent_indent="     "))
    print("\n   `precision-annot check mymod:make_model --backend deepspeed --config ds.json`")
    print("   exits 1 on an error, so a CI job can stop a launch that would not train.")


def fp8_demo(steps: int) -> None:
    """Section 9: fp8 GEMMs with bf16 islands against bf16, in training, `steps` steps."""
    print("\n9. fp8 GEMMs per module: annotate(model, {nn.Linear: 'compute=fp8-rowwise',")
    print("   'head': 'compute=bf16'}) over bf16-mixed: every Linear but the head runs its")
    print("   GEMMs in fp8 (torchao); norms, attention and the head in bf16; fp32 masters.")
    if not float8.available():
        print(f"   skipped: torchao is not installed ({float8.install_hint}).")
        return
    torch.manual_seed(0)
    base = TinyTransformer(vocab=VOCAB, gain=1.0)
    fp8_model, bf16_model = copy.deepcopy(base), copy.deepcopy(base)
    annotate(fp8_model, [(nn.Linear, "compute=fp8-rowwise"), ("head", "compute=bf16")])
    fp8_plan = resolve(fp8_model, default="bf16-mixed")
    runs = {"bf16-mixed": train_loop(bf16_model, resolve(bf16_model, "bf16-mixed"), steps),
            "fp8 GEMMs + bf16 islands": train_loop(fp8_model, fp8_plan, steps),
            "fp32 reference": train_loop(copy.deepcopy(base), None, steps)}
    width = max(map(len, runs))
    for label, losses in runs.items():
        print(f"   {label:<{width}}  final loss {losses[-1]:10.6f}")
    fp8_loss, bf16_loss = runs["fp8 GEMMs + bf16 islands"][-1], runs["bf16-mixed"][-1]
    print(f"\n   fp8 ends {abs(fp8_loss - bf16_loss) / bf16_loss:.2%} from bf16 "
          f"({abs(fp8_loss - runs['fp32 reference'][-1]) / runs['fp32 reference'][-1]:.2%} "
          "from fp32).")
    tokens = _batches(1)[0]
    with audit(fp8_model) as report:
        _next_token_loss(fp8_model(tokens[:, :-1]), tokens).backward()  # type: ignore[no-untyped-call]
    ran = [n for n, r in report.records.items() if r.fp8_gemms["forward"]]
    print(f"   audit: {len(ran)} Linear layers ran fp8 GEMMs, the head none "
          f"({len(report.divergences)} divergences from the plan).")
    codes = sorted({f.code for f in check(fp8_model)})
    print(f"   check: {', '.join(codes) or 'nothing'} (on a GPU these GEMMs are too small to "
          "gain; docs/fp8.md)")


def update_demo(steps: int) -> None:
    """Section 10: the update half: masters, gradient accumulation and optimizer state per
    layout, bytes per parameter measured against planned, and the losses side by side."""
    print("\n10. The optimizer step, per module too: precision_annot.optimizer(model,")
    print("    torch.optim.AdamW) keeps what each module's master, grad and optim fields say.")
    layouts: dict[str, tuple[str, dict[Any, str]]] = {
        "fp32 AdamW": ("fp32", {}), "bf16 + fp32 master (DeepSpeed)": ("bf16-master", {})}
    if float8.available():  # the low-bit states are torchao's
        layouts["bf16 + fp32 master + 8-bit state"] = ("bf16-true,master=fp32,optim=8bit",
                                                       {nn.Embedding: "optim=fp32"})
    width = max(map(len, layouts))
    print(f"    {'layout':<{width}}  bytes/param (planned, measured)  final loss")
    for label, (spec, rules) in layouts.items():
        torch.manual_seed(0)
        model = TinyTransformer(vocab=VOCAB, gain=1.0)
        rules_here: dict[Any, str] = {"*": spec, Norm: "fp32", **rules}
        annotate(model, rules_here)
        apply(model)
        opt = optimizer(model, torch.optim.AdamW, lr=3e-3)
        loss = torch.tensor(0.0)
        for tokens in _batches(steps):
            loss = _next_token_loss(model(tokens[:, :-1]), tokens)
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
        params = list(model.parameters())
        held = sum(p.numel() * p.element_size() for p in params) + sum(
            p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
        plan = applied_plan(model)
        assert plan is not None
        figure = plan.memory("adamw")
        measured = (held + state_bytes(opt)) / figure.params
        print(f"    {label:<{width}}  {figure.per_param():6.2f}, {measured:6.2f}"
              f"{'':18}{loss.item():.6f}")
    print("    docs/update.md: stochastic rounding, 4-bit and fp8 states, and the backends.")
