"""Precision over time, measured: a small byte-level LM on real text, in four precision runs.

The corpus is the English text Python ships in `pydoc_data/topics.py` (the help topics: 79
pages, 466,117 bytes in Python 3.11, joined in the order of their names); the first 90% of its
bytes train, the last 10% are held out. The model is a GPT-style transformer over bytes (pre-LN
blocks, causal attention, a 4x MLP, learned positions, the head tied to the byte embedding so
that every `nn.Linear` is inside a block). Each run builds it from the same initial weights,
trains it with `precision_annot.optimizer(model, torch.optim.AdamW)` under a warm-up and cosine
LR schedule on the same batches in the same order, and changes its plan with
`precision_annot.schedule`:

1. `fp32`: "32-true" throughout;
2. `bf16`: "bf16-true,optim=bf16" throughout: bf16 weights and compute, bf16 Adam moments, no
   master weights;
3. `bf16, fp32 masters last 10%`: run 2, then "bf16-master" (fp32 masters, fp32 gradients and
   moments) from 90% of the steps;
4. `fp8, bf16 last 10%`: "bf16-master,compute=fp8" (every Linear's GEMMs in fp8 through
   torchao's `Float8Linear`, scaled per tensor, the other ops in bf16, fp32 masters), then
   "bf16-master" from 90% of the steps.

For each run it reports the training loss (the mean of the last 100 steps' losses), the loss on
the held-out bytes under the plan the run ended in and again in fp32 (the weights, or their
masters, evaluated by "32-true"), the gap of each to run 1, the share of run 2's gap that run 3's
last 10% recovered, the share of stored parameter values each of the last 100 steps left
unchanged (without masters: updates lost to rounding), and the median time per step in thread
CPU time, per phase (the forward, backward, clipping, optimizer and schedule steps; not the
batch's slicing). It also records, at every step, what one Linear's forward saw (its class, the
dtypes of its input and weight) and what its update kept (the dtypes of its gradient, master
and first moment), so that the step where each run's plan changed can be checked.

The defaults (d_model 64, 2 layers, 4 heads, 64 bytes of context, 16 windows a step: 120,576
parameters) keep the four runs of 2,000 steps within 17-31 minutes on one core of a CPU
without bf16 instructions, where a bf16 step takes about 8x as long as an fp32 one. Run with
one thread:
`OMP_NUM_THREADS=1 python benchmarks/schedule_recipe.py --steps 2000 --out recipe.json`.
`--runs 1,3` runs a subset; `--seed` changes the initial weights and the batches (the same in
every run); `--d-model`, `--layers`, `--heads`, `--seq`, `--batch` size the model and batches.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import precision_annot as pa

RUN2 = "bf16-true,optim=bf16"
RUNS: dict[int, tuple[str, dict[float, str]]] = {
    1: ("fp32", {0: "32-true"}),
    2: ("bf16, bf16 moments, no masters", {0: RUN2}),
    3: ("bf16, fp32 masters last 10%", {0: RUN2, 0.9: "bf16-master"}),
    4: ("fp8, bf16 last 10%", {0: "bf16-master,compute=fp8", 0.9: "bf16-master"}),
}
#: the training losses averaged for the final training loss
LAST = 100


def corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """The bytes of pydoc_data's help topics: (training bytes, held-out bytes)."""
    from pydoc_data.topics import topics

    data = "".join(topics[name] for name in sorted(topics)).encode("utf-8")
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    cut = int(len(tokens) * 0.9)
    return tokens[:cut], tokens[cut:]


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(
            1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ByteLM(nn.Module):
    """A GPT over bytes; the head is the byte embedding's transpose (no `nn.Linear`)."""

    def __init__(self, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / (math.sqrt(2 * layers) if "fc2" in name
                                               or "proj" in name else 1.0))
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.emb.weight)


def batches(train: torch.Tensor, steps: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """The start of each window of each step's batch: the same in every run."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, len(train) - seq - 1, (steps, batch), generator=g)


def windows(data: torch.Tensor, starts: torch.Tensor, seq: int) -> tuple[torch.Tensor, ...]:
    rows = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def lr_at(step: int, steps: int, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model: nn.Module, held: torch.Tensor, seq: int, batch: int) -> float:
    """The mean loss over every whole window of `held` (windows laid end to end)."""
    starts = torch.arange(0, len(held) - seq - 1, seq)
    total, count = 0.0, 0
    for i in range(0, len(starts), batch):
        x, y = windows(held, starts[i:i + batch], seq)
        logits = model(x).float()
        total += F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1), reduction="sum").item()
        count += y.numel()
    return total / count


def _name(dtype: object) -> str:
    return str(dtype).replace("torch.", "") if dtype is not None else "-"


class Seen:
    """What one Linear's forward saw, and what its update kept, at each training step."""

    def __init__(self, linear: nn.Linear) -> None:
        self.linear = linear
        self.forward = ""
        self.steps: list[str] = []
        linear.register_forward_pre_hook(self._hook)

    def _hook(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if torch.is_grad_enabled() and not self.forward:
            self.forward = (f"{type(module).__name__}(input={_name(args[0].dtype)}, "
                            f"weight={_name(module.weight.dtype)})")

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        weight = self.linear.weight
        state = optimizer.state.get(weight, {})
        grad = weight.grad.dtype if weight.grad is not None else None
        master = state.get("master")
        moment = state.get("exp_avg")
        self.steps.append(
            f"{self.forward} grad={_name(grad)} "
            f"master={_name(master.dtype if isinstance(master, torch.Tensor) else None)} "
            f"exp_avg={_name(getattr(moment, 'dtype', None))}")
        self.forward = ""

    def segments(self) -> list[tuple[int, str]]:
        """(first step, what was seen) for each run of steps that saw the same."""
        out: list[tuple[int, str]] = []
        for i, seen in enumerate(self.steps):
            if not out or out[-1][1] != seen:
                out.append((i, seen))
        return out


def _unchanged(before: list[torch.Tensor], after: list[torch.Tensor]) -> float:
    """The share of stored parameter values a step left as they were."""
    same = sum(int((a.detach() == b).sum()) for a, b in zip(after, before, strict=True))
    return same / sum(b.numel() for b in before)


def _step(model: nn.Module, stepped: tuple[Any, Any, pa.Schedule], seen: Seen,
          xy: tuple[torch.Tensor, torch.Tensor], track: bool) -> tuple[float, float, list[float]]:
    """One training step: its loss, its thread CPU time and, when tracked, the share of stored
    values it left as they were. What `seen` records and the share are found outside the time
    taken, after the optimizer's step and before the schedule's (which may switch)."""
    optimizer, lrs, sched = stepped
    x, y = xy
    t0 = time.thread_time()
    loss = F.cross_entropy(model(x).float().reshape(-1, 256), y.reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    took = time.thread_time() - t0
    before = [p.detach().clone() for p in model.parameters()] if track else []
    t0 = time.thread_time()
    optimizer.step()
    took += time.thread_time() - t0
    seen.after_step(optimizer)
    same = [_unchanged(before, list(model.parameters()))] if track else []
    t0 = time.thread_time()
    lrs.step()
    sched.step()
    return loss.item(), took + time.thread_time() - t0, same


def train(phases: Mapping[float, str], args: argparse.Namespace, data: tuple[torch.Tensor, ...],
          order: torch.Tensor) -> dict[str, Any]:
    train_bytes, held = data
    torch.manual_seed(args.seed)
    model = ByteLM(args.d_model, args.layers, args.heads, args.seq)
    seen = Seen(model.blocks[0].fc1)
    optimizer = pa.optimizer(model, torch.optim.AdamW, lr=args.lr, weight_decay=0.1,
                             betas=(0.9, 0.95))
    lrs = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_at(s, args.steps, args.warmup))
    sched = pa.schedule(model, phases, optimizer=optimizer, total_steps=args.steps)
    losses: list[float] = []
    cpu: list[float] = []
    unchanged: list[float] = []
    phase_of: list[int] = []
    wall0 = time.perf_counter()
    for step in range(args.steps):
        x, y = windows(train_bytes, order[step], args.seq)
        phase_of.append(sched.phase)
        loss, took, same = _step(model, (optimizer, lrs, sched), seen, (x, y),
                                 track=step >= args.steps - LAST)
        cpu.append(took)
        unchanged.extend(same)
        losses.append(loss)
        if not math.isfinite(losses[-1]):
            break
        if args.log and (step + 1) % args.log == 0:
            print(f"  step {step + 1}: loss {statistics.fmean(losses[-args.log:]):.4f}, "
                  f"{1e3 * statistics.median(cpu[-args.log:]):.0f} ms/step", flush=True)
    wall = time.perf_counter() - wall0
    eval_loss = evaluate(model, held, args.seq, args.batch)
    with warnings.catch_warnings():
        # without masters the fp32 weights are the bf16 ones widened, as this eval means
        warnings.filterwarnings("ignore", message=r".*stored narrower than before the first")
        pa.apply(model, default="32-true")  # masters written into the weights, fp32 compute
    eval_fp32 = evaluate(model, held, args.seq, args.batch)
    starts = [start for start, _ in sched.phases]
    return {
        "phases": {str(k): v for k, v in phases.items()},
        "switch_steps": starts[1:],
        "train_loss": statistics.fmean(losses[-LAST:]),
        "eval_loss": eval_loss,
        "eval_loss_fp32": eval_fp32,
        "unchanged": statistics.fmean(unchanged) if unchanged else math.nan,
        "ms_per_step": 1e3 * statistics.median(cpu),
        "ms_per_step_by_phase": [1e3 * statistics.median(
            [c for c, p in zip(cpu, phase_of, strict=True) if p == i] or [math.nan])
            for i in range(len(starts))],
        "wall_s": wall,
        "losses": losses,
        "seen": [list(s) for s in seen.segments()],
    }


def table(results: dict[str, dict[str, Any]]) -> str:
    base = results.get("1")
    rows = ["| run | plan | train loss | vs fp32 | held-out loss | vs fp32 | held-out, fp32 "
            "eval | vs fp32 | values a step left unchanged | ms/step (thread CPU) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in results.items():
        plan = " → ".join(f"{v} (from step {s})" if s else v for s, v in zip(
            [0, *r["switch_steps"]], r["phases"].values(), strict=True))
        gaps = [f"{r[k] - base[k]:+.4f}" if base and r is not base else "" for k in
                ("train_loss", "eval_loss", "eval_loss_fp32")]
        ms = " → ".join(f"{m:.0f}" for m in r["ms_per_step_by_phase"])
        rows.append(f"| {key} | {plan} | {r['train_loss']:.4f} | {gaps[0]} | "
                    f"{r['eval_loss']:.4f} | {gaps[1]} | {r['eval_loss_fp32']:.4f} | "
                    f"{gaps[2]} | {100 * r['unchanged']:.1f}% | {ms} |")
    if base and "2" in results and "3" in results:
        rows.append("")
        for k, what in (("train_loss", "training"), ("eval_loss", "held-out")):
            gap = results["2"][k] - base[k]
            got = (results["2"][k] - results["3"][k]) / gap if gap else math.nan
            rows.append(f"Run 2's {what} gap: {gap:+.4f}; run 3's last 10% recovered "
                        f"{100 * got:.0f}% of it ({results['3'][k] - base[k]:+.4f} left).")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the results here as JSON")
    parser.add_argument("--runs", default="1,2,3,4", help="which runs, such as 1,3")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--log", type=int, default=0, help="print every N steps (0: never)")
    args = parser.parse_args(argv)
    runs = [int(r) for r in args.runs.split(",")]
    for r in runs:
        if r not in RUNS:
            parser.error(f"--runs: run {r} is not one of {sorted(RUNS)}; received {args.runs!r}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    data = corpus()
    order = batches(data[0], args.steps, args.batch, args.seq, args.seed)
    results: dict[str, dict[str, Any]] = {}
    for r in runs:
        name, phases = RUNS[r]
        print(f"run {r}: {name}", flush=True)
        results[str(r)] = {"name": name, **train(phases, args, data, order)}
    out = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "corpus": {"source": "pydoc_data.topics", "train_bytes": len(data[0]),
                   "held_out_bytes": len(data[1])},
        "parameters": sum(p.numel() for p in ByteLM(args.d_model, args.layers, args.heads,
                                                    args.seq).parameters()),
        "runs": results,
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.steps} steps, "
          f"{out['parameters']:,} parameters")
    print(table(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
