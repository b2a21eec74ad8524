"""The masters step on a CUDA GPU: the Triton kernel against torch's fused fp32 AdamW, 0.5's
route and TransformerEngine's FusedAdam with master weights.

100M parameters (by default) in GPT-like tensors (an embedding, then blocks of attention and
MLP weights with their biases and norms), bf16 weights and gradients with fp32 masters and
moments, AdamW with weight decay. Rows, timed with CUDA events, alternating in rounds (each
round runs every row once, in a rotated order, `--iters` steps each), reported as the median
ns/param over the rounds and the median of the per-round ratios to the first row:

- torch's fused fp32 AdamW (`torch.optim.AdamW(fused=True)`) on fp32 parameters and fp32
  gradients: the floor (28 bytes moved per parameter);
- TransformerEngine's `FusedAdam(master_weights=True)` on the bf16 parameters, if it imports;
- 0.5's route (`update_kernels.adam`: torch's fused CUDA kernel over chunks, the bf16
  gradient widened before it and the master rounded into the bf16 weight after it);
- the Triton kernel (`update_triton.adam`: one pass, 28 bytes per parameter), at several
  `chunk` sizes (elements per Triton program), and with bf16 moments (24 bytes).

Before timing it checks the Triton kernel on the GPU against torch's fused CPU kernel (through
`update_kernels`) on 1M parameters for 3 steps: the bits of the masters, moments and weights
outside torch's CPU scalar tail should be equal (the kernel computes that loop's formula with
IEEE division and square root and no contracted fma; the per-tensor bias corrections come from
CUDA's double `pow`), and prints how many differ.

Then it runs the check `precision_annot.optimizer` runs on a device's first step before it takes
the kernel there (`update_triton.checked`: a few small tensors, the same comparison) and prints
its verdict; where it fails, the optimizer would step through 0.5's route on this device, and
so the Triton rows are not timed.

Run: `python benchmarks/update_triton.py [--params N] [--rounds R] [--iters I]`; about a
minute on an H100 or H200. Without a CUDA device it says so and exits (`--cpu-check` runs the
same code on a few thousand parameters through Triton's interpreter, to check the script).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

HYPER = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
CHUNKS = (2048, 4096, 16384)


def shapes_for(total: int) -> list[tuple[int, ...]]:
    """An embedding of about a third of `total`, then transformer blocks until `total` (width
    1024; 16 for a few thousand parameters)."""
    width = 1024 if total >= 10_000_000 else 16
    out: list[tuple[int, ...]] = [(max(total // (3 * width), 1), width)]
    block = [(width,), (width,), (3 * width, width), (3 * width,), (width, width), (width,),
             (width,), (width,), (4 * width, width), (4 * width,), (width, 4 * width), (width,)]
    while sum(torch.Size(s).numel() for s in out) < total:
        out += block
    return out


class Masters:
    """bf16 weights and gradients, fp32 masters and moments (or `state` moments)."""

    def __init__(self, shapes: list[tuple[int, ...]], device: torch.device,
                 state: torch.dtype = torch.float32) -> None:
        g = torch.Generator(device=device).manual_seed(0)
        self.masters = [torch.randn(s, generator=g, device=device) for s in shapes]
        self.weights = [m.bfloat16() for m in self.masters]
        self.grads = [(torch.randn(s, generator=g, device=device) * 1e-3).bfloat16()
                      for s in shapes]
        self.exp_avgs = [torch.zeros(s, device=device, dtype=state) for s in shapes]
        self.exp_avg_sqs = [torch.zeros(s, device=device, dtype=state) for s in shapes]
        self.steps = [torch.zeros((), device=device) for _ in shapes]
        self.cache: dict[str, Any] = {}

    def step(self, module: Any, **options: Any) -> None:
        module.adam(self.masters, self.grads, self.exp_avgs, self.exp_avg_sqs, [], self.steps,
                    decoupled=True, stored=self.weights, cache=self.cache, **HYPER,
                    **options)


def floor_row(shapes: list[tuple[int, ...]], device: torch.device) -> Callable[[], None]:
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                            eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], fused=True)
    return opt.step  # type: ignore[return-value]


def te_row(shapes: list[tuple[int, ...]], device: torch.device) -> Callable[[], None] | str:
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam
    except Exception as e:  # (not installed, or built for another torch)
        return f"not measured: transformer_engine does not import ({type(e).__name__}: {e})"
    params = [torch.nn.Parameter(torch.randn(s, device=device).bfloat16()) for s in shapes]
    for p in params:
        p.grad = (torch.randn_like(p, dtype=torch.float32) * 1e-3).bfloat16()
    opt = FusedAdam(params, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                    eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], adam_w_mode=True,
                    master_weights=True)
    return opt.step  # type: ignore[no-any-return]


def rows(shapes: list[tuple[int, ...]], device: torch.device
         ) -> dict[str, Callable[[], None] | str]:
    from precision_annot._src import update_kernels, update_triton

    out: dict[str, Callable[[], None] | str] = {
        "torch fused fp32 AdamW (fp32 weights and gradients): the floor":
            floor_row(shapes, device),
        "TransformerEngine FusedAdam(master_weights=True)": te_row(shapes, device)}
    route = Masters(shapes, device)
    out["0.5's route: update_kernels.adam (torch fused + 2 conversion passes)"] = (
        lambda: route.step(update_kernels))
    if not update_triton._runs_on(device):
        out["Triton: update_triton.adam"] = "not measured: Triton does not run here"
        return out
    for chunk in CHUNKS:
        held = Masters(shapes, device)
        out[f"Triton: update_triton.adam, chunk={chunk}"] = (
            lambda held=held, chunk=chunk: held.step(update_triton, chunk=chunk))
    bf16 = Masters(shapes, device, torch.bfloat16)
    out["Triton, bf16 moments (24 bytes a parameter)"] = lambda: bf16.step(update_triton)
    return out


class Clock:
    """Milliseconds of `iters` calls: CUDA events on a GPU, the wall clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def time(self, fn: Callable[[], None], iters: int) -> float:
        if not self.cuda:
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            return (time.perf_counter() - start) * 1e3 / iters
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / iters


def measure(table: dict[str, Callable[[], None] | str], rounds: int, iters: int,
            clock: Clock) -> dict[str, list[float]]:
    runnable = [name for name, fn in table.items() if callable(fn)]
    for name in runnable:  # warm up: compile, allocate, fill caches
        clock.time(table[name], 3)  # type: ignore[arg-type]
    times: dict[str, list[float]] = {name: [] for name in runnable}
    for r in range(rounds):
        order = runnable[r % len(runnable):] + runnable[:r % len(runnable)]
        for name in order:
            times[name].append(clock.time(table[name], iters))  # type: ignore[arg-type]
    return times


def report(table: dict[str, Callable[[], None] | str], times: dict[str, list[float]],
           params: int) -> None:
    floor = next(iter(times))
    print("\n| step | ns/param | / torch fused fp32 AdamW |\n|---|---|---|")
    for name, fn in table.items():
        if not callable(fn):
            print(f"| {name} | {fn} | |")
            continue
        ms = statistics.median(times[name])
        ratio = statistics.median(a / b for a, b in zip(times[name], times[floor], strict=True))
        print(f"| {name} | {ms * 1e6 / params:.3f} | {ratio:.3f} |")


def check_bits(device: torch.device, params: int) -> None:
    """The Triton kernel on `device` against torch's fused CPU kernel, 3 steps."""
    from precision_annot._src import update_kernels, update_triton

    width = 8 if torch.backends.cpu.get_cpu_capability() == "AVX2" else 16
    shapes = [(params // 2,), (params // 4 + 7,), (1000, 37), (5,), (0,)]
    ours, ref = Masters(shapes, device), Masters(shapes, device)
    cpu = {k: [t.cpu() for t in getattr(ref, k)] for k in
           ("masters", "weights", "grads", "exp_avgs", "exp_avg_sqs", "steps")}
    for _ in range(3):
        ours.step(update_triton)
        update_kernels.adam(cpu["masters"], cpu["grads"], cpu["exp_avgs"], cpu["exp_avg_sqs"],
                            [], cpu["steps"], decoupled=True, stored=cpu["weights"], **HYPER)
    differ = tail = 0
    for key in ("masters", "weights", "exp_avgs", "exp_avg_sqs"):
        for a, b in zip(getattr(ours, key), cpu[key], strict=True):
            n = a.numel() - a.numel() % width
            wide = torch.int16 if a.element_size() == 2 else torch.int32
            same = a.cpu().reshape(-1).view(wide) == b.reshape(-1).view(wide)
            differ += int((~same[:n]).sum())
            tail += int((~same[n:]).sum())
    total = sum(torch.Size(s).numel() for s in shapes)
    print(f"bits against torch's fused CPU kernel, 3 steps over {total:,} parameters: "
          f"{differ} values differ outside its scalar tail of {width}, {tail} on it")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=100_000_000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--cpu-check", action="store_true",
                        help="run the script's code on the CPU through Triton's interpreter")
    args = parser.parse_args(argv)
    if args.cpu_check:
        os.environ["TRITON_INTERPRET"] = "1"
        device, args.params, args.rounds, args.iters = torch.device("cpu"), 4000, 2, 1
    elif not torch.cuda.is_available():
        print("no CUDA device here: the masters step on a GPU was not measured "
              "(`--cpu-check` runs this script's code on the CPU).")
        return 0
    else:
        device = torch.device("cuda")
        print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}")
    try:
        import triton

        print(f"triton {triton.__version__}")
    except ImportError:
        print("triton does not import: its rows are not measured")
    shapes = shapes_for(args.params)
    params = sum(torch.Size(s).numel() for s in shapes)
    print(f"{params:,} parameters in {len(shapes)} tensors; {args.rounds} rounds of "
          f"{args.iters} steps a row")
    start = time.perf_counter()
    check_bits(device, 1_000_000 if device.type == "cuda" else 3000)
    from precision_annot._src import update_triton

    print(f"the optimizer's check on {device}: "
          + ("the kernel agrees" if update_triton.checked(device) else
             "failed (the warning above says what differed): the optimizer would not take it"))
    table = rows(shapes, device)
    times = measure(table, args.rounds, args.iters, Clock(device))
    report(table, times, params)
    print(f"\n({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
