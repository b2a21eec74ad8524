"""The optimizer step of the update half against a plain fp32 AdamW step over as many parameters.

One process, one thread, alternating runs timed in thread CPU time, median ratios (layout /
plain fp32 AdamW). For each layout it also reports the peak of the extra bytes the step
allocates while it runs (tensors made during `step()` and still alive, tracked at dispatch),
which shows that no full-size fp32 copy of the gradients is made:

- bf16 weights, fp32 masters (`master=fp32`): the optimizer class on the masters, gradients
  upcast a chunk (64 MiB) at a time;
- the same with 8-bit state (`optim=8bit`): torchao's per-parameter update reading the bf16
  gradient, eager and `torch.compile`d (`compile_step=True`);
- stochastic rounding with bf16 state (`master="stochastic"`), eager and compiled.

The compiled rows are against torch's AdamW step compiled as torch's docs show
(`torch.compile(optimizer.step)`).

Run: `python benchmarks/update.py [--quick] [--size N]`.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import precision_annot as pa


class Peak(TorchDispatchMode):  # type: ignore[misc]
    """The bytes of tensors made inside the block and alive at once, at most."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0

    def _freed(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else [out]
        for t in outs:
            if isinstance(t, torch.Tensor) and not func.is_view and func.overloadpacket not in (
                    torch.ops.aten.copy_, torch.ops.aten.add_, torch.ops.aten.mul_,
                    torch.ops.aten.lerp_, torch.ops.aten.addcdiv_, torch.ops.aten.addcmul_):
                n = t.untyped_storage().nbytes()
                self.live += n
                weakref.finalize(t, self._freed, n)
        self.peak = max(self.peak, self.live)
        return out


def model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])


def with_grads(net: nn.Module) -> nn.Module:
    for p in net.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return net


def layouts(width: int) -> dict[str, tuple[nn.Module, torch.optim.Optimizer]]:
    out: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
    plain = with_grads(model(width))
    out["fp32 AdamW (torch)"] = (plain, torch.optim.AdamW(plain.parameters(), lr=1e-4))
    for label, spec, extra in (
            ("bf16 + fp32 master", "bf16-true,master=fp32", {}),
            ("bf16 + fp32 master + 8-bit state", "bf16-true,master=fp32,optim=8bit", {}),
            ("stochastic + bf16 state", "bf16-true,master=stochastic", {}),
    ):
        net = pa.apply(model(width), default=spec)
        with_grads(net)
        out[label] = (net, pa.optimizer(net, torch.optim.AdamW, lr=1e-4, **extra))
    return out


def timed(fn: Callable[[], Any]) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def compare(a: Callable[[], Any], b: Callable[[], Any], reps: int) -> float:
    for _ in range(2):
        a()
        b()
    ratios = []
    for i in range(reps):
        first, second = (a, b) if i % 2 else (b, a)
        t1, t2 = timed(first), timed(second)
        ta, tb = (t1, t2) if i % 2 else (t2, t1)
        ratios.append(ta / tb)
    return statistics.median(ratios)


def peak_bytes(step: Callable[[], Any]) -> int:
    with Peak() as peak:
        step()
    return peak.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--size", type=int, default=1024, help="width of the 4 Linear layers")
    args = parser.parse_args()
    torch.set_num_threads(1)
    reps = 6 if args.quick else 20
    width = args.size
    print(f"torch {torch.__version__}, python {platform.python_version()}, "
          f"{platform.machine()}, 1 thread; 4 Linear layers of {width}x{width} "
          f"({4 * (width * width + width):,} parameters)")
    runs = layouts(width)
    plain_step = runs["fp32 AdamW (torch)"][1].step
    grads = 4 * (width * width + width) * 4
    print(f"{'layout':40s} {'eager/fp32':>10s} {'peak extra':>12s}  (fp32 gradients: "
          f"{grads / 2**20:.1f} MiB)")
    for label, (_, opt) in runs.items():
        ratio = compare(opt.step, plain_step, reps) if opt.step is not plain_step else 1.0
        print(f"{label:40s} {ratio:10.3f} {peak_bytes(opt.step) / 2**20:9.2f} MiB")
    compiled_plain = torch.compile(plain_step)
    for label, spec in (("8-bit state, compiled", "bf16-true,master=fp32,optim=8bit"),
                        ("stochastic, compiled", "bf16-true,master=stochastic")):
        net = with_grads(pa.apply(model(width), default=spec))
        opt = pa.optimizer(net, torch.optim.AdamW, lr=1e-4, compile_step=True)
        start = time.perf_counter()
        opt.step()
        compiled_plain()
        print(f"  (compiling: {time.perf_counter() - start:.0f} s)")
        ratio = compare(opt.step, compiled_plain, reps)  # (no dispatch mode under compile)
        print(f"{label:40s} {ratio:10.3f} {'-':>12s}   (against torch.compile(fp32 "
              "AdamW.step))")


if __name__ == "__main__":
    main()
