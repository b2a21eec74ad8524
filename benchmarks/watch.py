"""What `watch` costs a training step, against the same steps with nothing watched.

A bf16 model with fp32 LayerNorm islands (8 blocks of Linear, GELU, LayerNorm; an applied
plan), trained with SGD: forward, backward, step. A block of `every` steps with a `watch(model,
every=every)` open (one sampled step in it, the others bare) is timed against the same block
with no watch, alternating, in thread CPU time, one thread; the median ratio is reported for
every=1 (each step measured), 10 and 100, and for steps that are not sampled (a watch open
whose sampled step is over).

Run: `python benchmarks/watch.py [--quick] [--width N]`.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import precision_annot as pa


def model(width: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width)]
    net = nn.Sequential(*layers, nn.Linear(width, 1))
    pa.annotate(net, {nn.LayerNorm: "fp32"})
    return pa.apply(net, default="bf16-true")


def timed(fn: Callable[[], Any]) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    net = model(args.width)
    opt = torch.optim.SGD(net.parameters(), lr=1e-6)
    x = torch.randn(64, args.width).bfloat16()
    modules = len(list(net.modules()))
    print(f"torch {torch.__version__}, python {platform.python_version()}, "
          f"{platform.machine()}, 1 thread; {modules} modules, width {args.width}, batch 64")

    def step() -> None:
        opt.zero_grad()
        net(x).float().pow(2).mean().backward()
        opt.step()

    def bare(n: int) -> Callable[[], None]:
        def run() -> None:
            for _ in range(n):
                step()
        return run

    def watched(n: int) -> Callable[[], None]:
        def run() -> None:
            with pa.watch(net, every=n) as w:
                for _ in range(n):
                    step()
                    w.step()
        return run

    def idle(n: int) -> Callable[[], None]:
        """`n` steps with a watch open whose sampled step is over: what unsampled steps cost."""
        def run() -> None:
            with pa.watch(net, every=10**9) as w:
                step()
                w.step()  # step 0, sampled, before the clock starts: see `timed_after`
                start = time.thread_time()
                for _ in range(n):
                    step()
                    w.step()
                run.elapsed = time.thread_time() - start  # type: ignore[attr-defined]
        return run

    def compare(a: Callable[[], None], b: Callable[[], None], reps: int, per: int,
                a_time: Callable[[], float] | None = None) -> tuple[float, float]:
        for _ in range(2):
            a()
            b()
        ratios, extra = [], []
        for i in range(reps):
            if i % 2:
                ta = timed(a) if a_time is None else (a(), a_time())[1]
                tb = timed(b)
            else:
                tb = timed(b)
                ta = timed(a) if a_time is None else (a(), a_time())[1]
            ratios.append(ta / tb)
            extra.append((ta - tb) / per)
        return statistics.median(ratios), statistics.median(extra)

    many = 6 if args.quick else 20
    print(f"{'steps':28s} {'watched/bare':>13s}  {'extra per sampled step':>23s}")
    unsampled = idle(20)
    ratio, _ = compare(unsampled, bare(20), 3 * many,
                       per=1, a_time=lambda: unsampled.elapsed)  # type: ignore[attr-defined]
    print(f"{'unsampled (watch open)':28s} {ratio:13.3f}  {'-':>23s}")
    ten = lambda: [watched(1)() for _ in range(10)]  # noqa: E731
    ratio, extra = compare(ten, bare(10), 3 * many, per=10)
    print(f"{'every=1 (each step sampled)':28s} {ratio:13.3f}  {extra * 1e3:20.2f} ms")
    for every in (10, 100):
        ratio, extra = compare(watched(every), bare(every), many if every == 100 else 3 * many,
                               per=1)
        print(f"{f'every={every}':28s} {ratio:13.3f}  {extra * 1e3:20.2f} ms")


if __name__ == "__main__":
    main()
