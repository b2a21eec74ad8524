"""Overhead of `apply` against the same model written by hand with `.to()` casts.

One process, alternating runs, median ratios (applied / hand-written). Three measurements:

1. gpt: a GPT-like model in bf16 with fp32 LayerNorms, forward + backward, eager;
2. chain: 64 parameterless fp32 islands in a bf16 chain, forward + backward, one thread: a model
   made of boundary crossings only, so the per-call cost of a boundary is all there is;
3. compiled: the GPT of (1) under `torch.compile(fullgraph=True)`, applied against hand-written.

Run: `make bench`, or `python benchmarks/overhead.py [--quick] [--only gpt,chain,compiled]`.
"""

from __future__ import annotations

import argparse
import platform
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
    def __init__(self, vocab: int = 512, d: int = 128, layers: int = 2, heads: int = 4,
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
    """The applied GPT (fp32 LayerNorm islands in bf16) and the same written by hand."""
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


def chain_pair(n: int = 64) -> tuple[nn.Module, nn.Module]:
    applied, hand = Chain(n, hand_cast=False), Chain(n, hand_cast=True)
    annotate(applied, {"islands.*": "fp32"})
    apply(applied, default="bf16")
    hand.to(bf16)
    return applied, hand


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


def report(label: str, ta: list[float], tb: list[float], unit: float = 1e3,
           name: str = "ms") -> float:
    ratio = statistics.median([a / b for a, b in zip(ta, tb, strict=True)])
    print(f"{label}, {len(ta)} alternating pairs")
    print(f"  applied   median {statistics.median(ta) * unit:9.3f} {name}")
    print(f"  hand .to  median {statistics.median(tb) * unit:9.3f} {name}")
    print(f"  ratio     median {ratio:.3f}")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--only", default="gpt,chain,compiled",
                        help="comma-separated: gpt, chain, compiled")
    args = parser.parse_args()
    which = set(args.only.split(","))
    reps = 6 if args.quick else 20
    print(f"torch {torch.__version__}, python {platform.python_version()}, "
          f"{platform.machine()}, {torch.get_num_threads()} threads")
    tokens = torch.randint(0, 512, (4, 64))

    if "gpt" in which:
        applied, hand = gpt_pair()
        diff = (applied(tokens).float() - hand(tokens).float()).abs().max().item()
        ta, tb = alternate(step(applied, tokens), step(hand, tokens), reps * 5)
        report("GPT d=128, 2 layers, batch 4x64, bf16 + fp32 LayerNorms, fwd+bwd, eager", ta, tb)
        print(f"  max |diff| of logits {diff:.1e}")

    if "chain" in which:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        applied, hand = chain_pair()
        x = torch.randn(4, 8, dtype=bf16, requires_grad=True)
        ta, tb = alternate(step(applied, x), step(hand, x), reps * 20)
        report("chain of 64 fp32 islands in bf16, fwd+bwd, 1 thread", ta, tb)
        per = statistics.median([(a - b) / 64 for a, b in zip(ta, tb, strict=True)])
        print(f"  overhead  median {per * 1e6:9.2f} us per crossing (entry + exit, fwd + bwd)")
        torch.set_num_threads(threads)

    if "compiled" in which:
        applied, hand = gpt_pair()
        start = time.perf_counter()
        compiled_a = torch.compile(applied, fullgraph=True)
        compiled_h = torch.compile(hand, fullgraph=True)
        step(compiled_a, tokens)()
        step(compiled_h, tokens)()
        print(f"compiling both: {time.perf_counter() - start:.0f} s")
        diff = (compiled_a(tokens).float() - compiled_h(tokens).float()).abs().max().item()
        ta, tb = alternate(step(compiled_a, tokens), step(compiled_h, tokens), reps * 25)
        report("GPT as above, torch.compile(fullgraph=True), fwd+bwd", ta, tb)
        print(f"  max |diff| of logits {diff:.1e}")


if __name__ == "__main__":
    main()
