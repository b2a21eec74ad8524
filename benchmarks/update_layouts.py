"""Which update layout to pick: memory, step time and loss, per layout, measured.

- memory: `plan.memory("adamw")` bytes per parameter on the demo's GPT at two sizes (the tests
  check the figure equals the bytes a step leaves);
- step time: `optimizer.step()` alone, over 4.2 million parameters in 8 tensors with
  gradients already there, against torch's fused fp32 AdamW over the same parameters (one
  process, one thread, alternating runs timed in thread CPU time, median ratio);
- loss: the demo's GPT (vocabulary 256, width 64, 2 blocks, fp32 norms), 300 AdamW steps at lr
  1e-4 on sequences with an irreducible loss of ln 4: the mean loss of the last 20 steps.

Run: `python benchmarks/update_layouts.py [--quick] [--reps N] [--only "text|text"]` (prints a
markdown table).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any

import torch
from torch import nn

import precision_annot as pa
from precision_annot._src.demo_model import Norm, TinyTransformer
from precision_annot._src.update.guard import planned
from precision_annot._src.update.rule import rule_for

#: label -> (plan string for every module but the norms; the plain torch AdamW instead of
#: precision_annot.optimizer; AdamW's fused kernel)
LAYOUTS: dict[str, tuple[str, bool] | tuple[str, bool, bool]] = {
    "fp32 weights, torch's AdamW": ("fp32", True),
    "bf16-mixed (fp32 weights, bf16 compute), torch's AdamW": ("bf16-mixed", True),
    "bf16 weights, no master, torch's AdamW": ("bf16-true", True),
    "bf16 weights, fp32 masters": ("bf16-true,master=fp32", False),
    "the same, fp32 gradients (`bf16-master`)": ("bf16-master", False),
    "bf16 weights, fp32 masters, bf16 state": ("bf16-true,master=fp32,optim=bf16", False),
    "bf16 weights, fp32 masters, 8-bit state": ("bf16-true,master=fp32,optim=8bit", False),
    "bf16 weights, stochastic rounding (bf16 state)": ("bf16-true,master=stochastic", False),
    "stochastic rounding, 8-bit state": ("bf16-true,master=stochastic,optim=8bit", False),
}


def accumulate_as_planned(model: nn.Module) -> nn.Module:
    """grad=fp32 as `apply` makes it with `Tensor.grad_dtype` (idempotent)."""
    for p in model.parameters():
        said = planned(p)
        if said is not None:
            rule = rule_for(said.fields, p.dtype)
            if rule.grad != p.dtype:
                p.grad_dtype = rule.grad
    return model


def build(spec: str, plain: bool, net: nn.Module, lr: float, fused: bool = False
          ) -> torch.optim.Optimizer:
    pa.annotate(net, {"*": spec, Norm: "fp32"}, strict=False)
    accumulate_as_planned(pa.apply(net))
    if plain:
        return torch.optim.AdamW(net.parameters(), lr=lr, fused=fused or None)
    opt: torch.optim.Optimizer = pa.optimizer(net, torch.optim.AdamW, lr=lr, fused=fused or None)
    return opt


def gpt(width: int) -> nn.Module:
    """The demo's GPT: small (width 64, 0.2M parameters), or width 512 (vocabulary 8192, 6
    blocks: 23M parameters)."""
    torch.manual_seed(0)
    small = width == 64
    return TinyTransformer(vocab=256 if small else 8192, d=width, layers=2 if small else 6,
                           heads=4, gain=1.0)


def bytes_per_parameter(spec: str, width: int) -> float:
    net = gpt(width)
    pa.annotate(net, {"*": spec, Norm: "fp32"})
    return pa.resolve(net).memory("adamw").per_param()


def noisy_tokens(steps: int, batch: int = 16, vocab: int = 256, length: int = 32
                 ) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.empty(steps * batch, length + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (steps * batch,), generator=gen)
    noise = torch.randint(0, 4, (steps * batch, length), generator=gen)
    for t in range(length):
        tokens[:, t + 1] = (tokens[:, t] * 3 + noise[:, t]) % vocab
    return list(tokens.split(batch))


def final_loss(spec: str, plain: bool, steps: int, fused: bool = False) -> float:
    torch.manual_seed(0)
    net = TinyTransformer(vocab=256, d=64, layers=2, heads=4, gain=1.0)
    opt = build(spec, plain, net, 1e-4, fused)
    losses = []
    for tokens in noisy_tokens(steps):
        loss = nn.functional.cross_entropy(net(tokens[:, :-1]).float().reshape(-1, 256),
                                           tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return sum(losses[-20:]) / 20


def stepper(spec: str | None, plain: bool, fused: bool = False) -> Any:
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(1024, 512, bias=False) for _ in range(8)])  # 4.2M
    if spec is None:
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    else:
        opt = build(spec, plain, net, 1e-4, fused)
    for p in net.parameters():
        dtype = p.grad_dtype if p.grad_dtype is not None else p.dtype
        p.grad = (torch.randn(p.shape) * 1e-3).to(dtype)
    for _ in range(3):  # states made, first-step costs (allocations, page faults) paid
        opt.step()
    return opt.step


def timed(fn: Any) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def step_ratios(reps: int) -> dict[str, float]:
    base = stepper(None, True)
    warm = stepper("fp32", True)  # the first layout measured after the base read 2x slow
    for _ in range(5):            # here, whichever it was: a throwaway one goes first
        timed(base)
        timed(warm)
    out = {}
    for label, (spec, plain, *fused) in LAYOUTS.items():
        step = stepper(spec, plain, *fused)
        timed(base)
        timed(step)
        ratios = []
        for _ in range(reps):
            a = timed(base)
            b = timed(step)
            ratios.append(b / a)
        out[label] = statistics.median(ratios)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer runs, 60 training steps")
    parser.add_argument("--only", help="only the layouts whose label holds one of these texts "
                        "(separated by |)")
    parser.add_argument("--reps", type=int, help="timed pairs per layout")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.only:
        for label in [k for k in LAYOUTS if not any(o in k for o in args.only.split("|"))]:
            del LAYOUTS[label]
    reps, steps = (3, 60) if args.quick else (7, 300)
    reps = args.reps or reps
    ratios = step_ratios(reps)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, 1 thread")
    sizes = [sum(p.numel() for p in gpt(w).parameters()) / 1e6 for w in (64, 512)]
    print(f"| layout | bytes / parameter (GPT, {sizes[0]:.1f}M) | (GPT, {sizes[1]:.0f}M) | "
          "step time vs torch's fused fp32 AdamW | final loss |")
    print("|---|---|---|---|---|")
    for label, (spec, plain, *fused) in LAYOUTS.items():
        small = bytes_per_parameter(spec, 64)
        large = bytes_per_parameter(spec, 512)
        loss = final_loss(spec, plain, steps, *fused)
        print(f"| {label} | `{spec}` {small:.2f} | {large:.2f} | {ratios[label]:.2f}x | "
              f"{loss:.4f} |", flush=True)


if __name__ == "__main__":
    main()
