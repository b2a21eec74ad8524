"""Overhead of `apply` against the same model written by hand with `.to()` casts.

One process, alternating runs, median ratios. Two measurements:

1. a GPT-like model (d=256, 4 layers, batch 8x128, CPU), bf16 storage and compute with fp32
   LayerNorms: forward + backward, applied vs hand-cast;
2. a tiny model made of boundary crossings only: the cost per crossing, forward + backward,
   in microseconds.

Run: `make bench` (or `python benchmarks/overhead.py --quick`).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from precision_annot import annotate, apply, bf16, fp32


class Block(nn.Module):
    def __init__(self, d: int, heads: int, hand_cast: bool) -> None:
        super().__init__()
        self.heads, self.hand_cast = heads, hand_cast
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def norm(self, ln: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
        if self.hand_cast:
            return ln(x.to(fp32)).to(bf16)
        out: torch.Tensor = ln(x)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.norm(self.ln1, x)).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.out(nn.functional.gelu(self.fc(self.norm(self.ln2, x))))
        return out


class GPT(nn.Module):
    def __init__(self, vocab: int = 512, d: int = 256, layers: int = 4, heads: int = 4,
                 hand_cast: bool = False) -> None:
        super().__init__()
        self.hand_cast = hand_cast
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, hand_cast) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x.to(fp32)).to(bf16) if self.hand_cast else self.ln_f(x)
        logits: torch.Tensor = self.head(x)
        return logits


def gpt_pair() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    hand = GPT(hand_cast=True)
    applied = GPT(hand_cast=False)
    applied.load_state_dict(hand.state_dict())
    hand.to(bf16)
    for m in hand.modules():
        if isinstance(m, nn.LayerNorm):
            m.to(fp32)
    annotate(applied, {nn.LayerNorm: "fp32"})
    apply(applied, default="bf16")
    return applied, hand


class Island(nn.Module):
    """The cheapest possible fp32 island: a parameterless module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Chain(nn.Module):
    def __init__(self, n: int, hand_cast: bool) -> None:
        super().__init__()
        self.hand_cast = hand_cast
        self.islands = nn.ModuleList(Island() for _ in range(n))
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.scale
        for island in self.islands:
            x = island(x.to(fp32)).to(bf16) if self.hand_cast else island(x)
        return x


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def alternate(a: Callable[[], None], b: Callable[[], None], reps: int, warmup: int = 3
              ) -> tuple[list[float], list[float]]:
    for _ in range(warmup):
        a()
        b()
    ta, tb = [], []
    for i in range(reps):
        if i % 2:
            ta.append(timed(a))
            tb.append(timed(b))
        else:
            tb.append(timed(b))
            ta.append(timed(a))
    return ta, tb


def step(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        model(x).float().mean().backward()
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    reps = 6 if args.quick else 16

    applied, hand = gpt_pair()
    tokens = torch.randint(0, 512, (8, 128))
    out_a, out_h = applied(tokens), hand(tokens)
    max_diff = (out_a.float() - out_h.float()).abs().max().item()
    ta, th = alternate(step(applied, tokens), step(hand, tokens), reps)
    ratios = [a / h for a, h in zip(ta, th, strict=True)]
    print(f"GPT-like d=256, 4 layers, batch 8x128, bf16 + fp32 LayerNorms, fwd+bwd, {reps} runs")
    print(f"  applied   median {statistics.median(ta) * 1e3:8.2f} ms")
    print(f"  hand .to  median {statistics.median(th) * 1e3:8.2f} ms")
    print(f"  ratio     median {statistics.median(ratios):.3f}  (max |diff| of logits "
          f"{max_diff:.1e})")

    n = 64
    chain_a, chain_h = Chain(n, hand_cast=False), Chain(n, hand_cast=True)
    for island in chain_a.islands:
        island.__dict__.pop("_precision_annot_instance", None)
    annotate(chain_a, {"islands.*": "fp32"})
    apply(chain_a, default="bf16")
    chain_h.to(bf16)
    x = torch.randn(4, 8, dtype=bf16, requires_grad=True)
    reps_c = reps * 5
    ta, th = alternate(step(chain_a, x), step(chain_h, x), reps_c)
    per = [(a - h) / n * 1e6 for a, h in zip(ta, th, strict=True)]
    full = statistics.median(ta) / n * 1e6
    print(f"boundary crossing, tiny model ({n} fp32 islands in bf16), fwd+bwd, {reps_c} runs")
    print(f"  applied per crossing        {full:6.1f} us (whole step / crossings)")
    print(f"  overhead over hand .to()    {statistics.median(per):6.1f} us per crossing")
    if not math.isfinite(max_diff):
        raise SystemExit("non-finite logits")


if __name__ == "__main__":
    main()
