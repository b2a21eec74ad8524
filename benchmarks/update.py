"""The update half's step kernels against torch's fused fp32 AdamW, the same step composed by hand,
DeepSpeed's CPU Adam and torchao's AdamW8bit by hand.

One process, one thread, alternating runs timed in thread CPU time; each row is the median of
the per-pair ratios (row / its baseline) and the median time per parameter. The parameters are
4,202,496 in 16 tensors (8 of 1024x512 and 8 of 1024), as a model's would be, gradients present:

- torch's fused fp32 AdamW (`torch.optim.AdamW(fused=True).step()` on fp32 weights and fp32
  gradients): the baseline of the first table, 28 bytes moved per parameter;
- the masters step through the real optimizer (`precision_annot.optimizer(model, AdamW,
  ...).step()` over a model of those shapes with "bf16-true,master=fp32" applied), which runs
  `update_kernels.adam`: bf16 weights with fp32 masters, reading the bf16 gradient and
  writing master, moments and the bf16 weight; also the kernel called by hand, with fp32
  gradients (`bf16-master`: accumulated in fp32 by autograd) and with bf16 moments
  (`optim=bf16`);
- the same layout composed by hand: every gradient upcast, torch's fused step on the masters,
  the masters copied into the bf16 weights;
- DeepSpeed's CPU Adam (`DeepSpeedCPUAdam`, its AVX C++ step, JIT-built on first use) on fp32
  weights;
- SGD with momentum over masters (the optimizer, and `update_kernels.sgd` by hand) against
  torch's fused fp32 SGD;
- the 8-bit step (the optimizer with "optim=8bit", compiled once per layout, and
  `update_kernels.lowbit_adam` by hand) against torchao's `AdamW8bit` by hand on the same
  layout (fp32 masters fed the upcast gradients, masters copied into the bf16 weights).

`--gpt2` also times the first 8-bit step (compilation included) on GPT-2's 148 parameter shapes
(124M parameters), ours and torchao's by hand, each in a fresh process with an empty inductor
cache.

Run: `python benchmarks/update.py [--quick] [--no-deepspeed] [--gpt2]`.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import precision_annot as pa
from precision_annot._src import update_kernels as kernels

SHAPES = [(1024, 512), (1024,)] * 8
HYPER = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
#: GPT-2 (124M): token and position embeddings, 12 blocks, the final LayerNorm
GPT2 = [(50257, 768), (1024, 768)] + [
    (768,), (768,), (768, 2304), (2304,), (768, 768), (768,), (768,), (768,), (768, 3072),
    (3072,), (3072, 768), (768,)] * 12 + [(768,), (768,)]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def make(shapes: list[tuple[int, ...]], dtype: torch.dtype, seed: int, scale: float = 1.0
         ) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * scale).to(dtype) for s in shapes]


class Masters:
    """One layout as the optimizer holds it: fp32 masters, bf16 weights, gradients, moments."""

    def __init__(self, shapes: list[tuple[int, ...]], grad: torch.dtype = torch.bfloat16,
                 state: torch.dtype = torch.float32) -> None:
        self.masters = make(shapes, torch.float32, 0)
        self.weights = [m.bfloat16() for m in self.masters]
        self.grads = make(shapes, grad, 1, 1e-3)
        self.exp_avgs = [torch.zeros_like(m, dtype=state) for m in self.masters]
        self.exp_avg_sqs = [torch.zeros_like(m, dtype=state) for m in self.masters]
        self.steps = [torch.tensor(0.0) for _ in self.masters]

    def adam(self) -> None:
        kernels.adam(self.masters, self.grads, self.exp_avgs, self.exp_avg_sqs, [], self.steps,
                     decoupled=True, stored=self.weights, **HYPER)


def model_of(spec: str, grad: torch.dtype) -> nn.Module:
    """`SHAPES` as a model (8 Linear(512, 1024)) with the plan `spec` applied and a gradient
    of dtype `grad` on each parameter."""
    torch.manual_seed(0)
    model = pa.apply(nn.Sequential(*[nn.Linear(512, 1024) for _ in range(8)]), default=spec)
    for p, g in zip(model.parameters(), make(SHAPES, grad, 1, 1e-3), strict=True):
        p.grad = g
    return model


def planned(spec: str, cls: Any = torch.optim.AdamW, grad: torch.dtype = torch.bfloat16,
            **options: Any) -> Callable[[], Any]:
    """The real optimizer's step: `precision_annot.optimizer(model, cls, ...).step()`."""
    opt = pa.optimizer(model_of(spec, grad), cls, **options)
    return opt.step  # type: ignore[no-any-return]


def torch_fused(shapes: list[tuple[int, ...]], cls: Any = torch.optim.AdamW, **options: Any
                ) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(t) for t in make(shapes, torch.float32, 0)]
    for p, g in zip(params, make(shapes, torch.float32, 1, 1e-3), strict=True):
        p.grad = g
    return cls(params, fused=True, **options)  # type: ignore[no-any-return]


def adamw_options() -> dict[str, Any]:
    return {"lr": HYPER["lr"], "betas": (HYPER["beta1"], HYPER["beta2"]), "eps": HYPER["eps"],
            "weight_decay": HYPER["weight_decay"]}


def kernel_alone(opt: torch.optim.Optimizer) -> Callable[[], None]:
    """torch's fused AdamW kernel on the optimizer's own tensors, without its Python."""
    opt.step()
    params = opt.param_groups[0]["params"]
    lists = [[p.grad for p in params]] + [[opt.state[p][k] for p in params]
                                          for k in ("exp_avg", "exp_avg_sq", "step")]

    def step() -> None:
        torch._foreach_add_(lists[3], 1)
        torch._fused_adamw_(params, lists[0], lists[1], lists[2], [], lists[3], amsgrad=False,
                            maximize=False, **HYPER)
    return step


def chunks_by_hand(shapes: list[tuple[int, ...]]) -> Callable[[], None]:
    """The masters step's own passes with no Python between them: each tensor cut once, before
    timing, into `CHUNK`-element pieces; a piece's gradient widened into a scratch buffer,
    torch's fused step, the master rounded into the bf16 weight."""
    layout = Masters(shapes)
    scratch = torch.empty(kernels.CHUNK)
    step = torch.tensor(1.0)
    pieces = []
    for row in zip(layout.masters, layout.grads, layout.exp_avgs, layout.exp_avg_sqs,
                   layout.weights, strict=True):
        for m, g, a, b, w in zip(*(t.view(-1).split(kernels.CHUNK) for t in row),
                                 strict=True):
            pieces.append(([m], g, [scratch[:g.numel()]], [a], [b], w))

    def run() -> None:
        for m, g, wide, a, b, w in pieces:
            wide[0].copy_(g)
            torch._fused_adamw_(m, wide, a, b, [], [step], amsgrad=False, maximize=False,
                                **HYPER)
            w.copy_(m[0])
    return run


def composed(shapes: list[tuple[int, ...]]) -> Callable[[], None]:
    """The masters layout by hand: every gradient upcast, torch's fused step, copy back."""
    layout = Masters(shapes)
    masters = [torch.nn.Parameter(m) for m in layout.masters]
    opt = torch.optim.AdamW(masters, fused=True, **adamw_options())

    def step() -> None:
        for m, g in zip(masters, layout.grads, strict=True):
            m.grad = g.float()
        opt.step()
        torch._foreach_copy_(layout.weights, [m.detach() for m in masters])
        for m in masters:
            m.grad = None
    return step


def deepspeed_adam(shapes: list[tuple[int, ...]]) -> Callable[[], None] | str:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:  # any failure to import or build it is reported
        return f"unavailable ({type(e).__name__})"
    params = [torch.nn.Parameter(t) for t in make(shapes, torch.float32, 0)]
    for p, g in zip(params, make(shapes, torch.float32, 1, 1e-3), strict=True):
        p.grad = g
    start = time.perf_counter()
    opt = DeepSpeedCPUAdam(params, adamw_mode=True, **adamw_options())
    opt.step()
    print(f"  (DeepSpeed CPU Adam built/loaded and stepped once: "
          f"{time.perf_counter() - start:.0f} s)")
    return opt.step  # type: ignore[no-any-return]


def sgd_masters(shapes: list[tuple[int, ...]]) -> Callable[[], None]:
    layout = Masters(shapes)
    buffers: list[torch.Tensor | None] = [None] * len(shapes)

    def step() -> None:
        kernels.sgd(layout.masters, layout.grads, buffers, lr=0.01, momentum=0.9,
                    stored=layout.weights)
    return step


def lowbit_ours(shapes: list[tuple[int, ...]]) -> Callable[[], None]:
    layout = Masters(shapes)
    m = [kernels.lowbit_state(p, "8bit", True) for p in layout.masters]
    v = [kernels.lowbit_state(p, "8bit", False) for p in layout.masters]
    lr = torch.tensor(HYPER["lr"])
    options = {k: v for k, v in HYPER.items() if k != "lr"}

    def step() -> None:
        kernels.lowbit_adam(layout.masters, layout.grads, m, v, [], layout.steps, lr=lr,
                            decoupled=True, stored=layout.weights, **options)
    return step


def lowbit_by_hand(shapes: list[tuple[int, ...]]) -> Callable[[], None]:
    """torchao's AdamW8bit on fp32 masters, fed the upcast gradients, masters copied back."""
    from torchao.optim import AdamW8bit

    layout = Masters(shapes)
    masters = [torch.nn.Parameter(p) for p in layout.masters]
    opt = AdamW8bit(masters, **adamw_options())

    def step() -> None:
        for p, g in zip(masters, layout.grads, strict=True):
            p.grad = g.float()
        opt.step()
        torch._foreach_copy_(layout.weights, [p.detach() for p in masters])
        for p in masters:
            p.grad = None
    return step


def timed(fn: Callable[[], Any]) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def compare(a: Callable[[], Any], b: Callable[[], Any], pairs: int
            ) -> tuple[float, float, float]:
    """(median of a/b, median a, median b) over `pairs` alternating pairs, after a warm-up."""
    a()
    b()
    ta: list[float] = []
    tb: list[float] = []
    for i in range(pairs):
        if i % 2:
            ta.append(timed(a))
            tb.append(timed(b))
        else:
            tb.append(timed(b))
            ta.append(timed(a))
    ratios = [x / y for x, y in zip(ta, tb, strict=True)]
    return statistics.median(ratios), statistics.median(ta), statistics.median(tb)


def row(label: str, result: tuple[float, float, float], n: int) -> None:
    ratio, mine, _ = result
    print(f"| {label} | {mine / n * 1e9:.3f} | **{ratio:.3f}** |")


def masters_table(pairs: int, deepspeed: bool) -> None:
    n = sum(torch.Size(s).numel() for s in SHAPES)
    base = torch_fused(SHAPES, **adamw_options()).step
    print(f"\n{n:,} parameters in {len(SHAPES)} tensors; baseline: torch fused fp32 AdamW\n")
    print("| step | ns/param | / torch fused fp32 |")
    print("|---|---|---|")
    row("torch fused fp32 AdamW (against itself)",
        compare(torch_fused(SHAPES, **adamw_options()).step, base, pairs), n)
    row("torch's fused kernel alone (no optimizer Python)",
        compare(kernel_alone(torch_fused(SHAPES, **adamw_options())), base, pairs), n)
    row("**masters step, `precision_annot.optimizer(model, AdamW).step()`**: bf16 grads -> "
        "fp32 masters, moments, bf16 weights",
        compare(planned("bf16-true,master=fp32", **adamw_options()), base, pairs), n)
    row("the same, `update_kernels.adam` called by hand (no optimizer Python)",
        compare(Masters(SHAPES).adam, base, pairs), n)
    row("the same passes by hand, no Python between them",
        compare(chunks_by_hand(SHAPES), base, pairs), n)
    row("masters step, fp32 grads (`bf16-master`: accumulated in fp32), optimizer",
        compare(planned("bf16-master", grad=torch.float32, **adamw_options()), base, pairs), n)
    row("masters step, bf16 moments (`optim=bf16`), optimizer",
        compare(planned("bf16-true,master=fp32,optim=bf16", **adamw_options()), base, pairs),
        n)
    row("composed by hand: upcast all, torch fused on masters, copy back",
        compare(composed(SHAPES), base, pairs), n)
    if deepspeed:
        ds = deepspeed_adam(SHAPES)
        if isinstance(ds, str):
            print(f"| DeepSpeed CPU Adam (fp32) | {ds} | - |")
        else:
            row("DeepSpeed CPU Adam (fp32, its C++ step)", compare(ds, base, pairs), n)
    sgd_base = torch_fused(SHAPES, torch.optim.SGD, lr=0.01, momentum=0.9).step
    row("SGD momentum over masters, optimizer / torch fused fp32 SGD momentum",
        compare(planned("bf16-true,master=fp32", torch.optim.SGD, lr=0.01, momentum=0.9),
                sgd_base, pairs), n)
    row("the same, `update_kernels.sgd` by hand", compare(sgd_masters(SHAPES), sgd_base, pairs),
        n)


def lowbit_table(pairs: int) -> None:
    n = sum(torch.Size(s).numel() for s in SHAPES)
    ours = planned("bf16-true,master=fp32,optim=8bit", **adamw_options())
    alone, theirs = lowbit_ours(SHAPES), lowbit_by_hand(SHAPES)
    for label, fn in (("ours, the optimizer", ours), ("ours, lowbit_adam by hand", alone),
                      ("torchao AdamW8bit by hand", theirs)):
        start = time.perf_counter()
        fn()
        print(f"  (first 8-bit step, {label}: {time.perf_counter() - start:.1f} s)")
    ratio, mine, hand = compare(ours, theirs, pairs)
    ratio_alone, mine_alone, _ = compare(alone, theirs, pairs)
    base = torch_fused(SHAPES, **adamw_options()).step
    fp32 = compare(base, base, 1)[1]
    print("\n| 8-bit step (fp32 masters, bf16 grads and weights) | ns/param | "
          "/ torchao by hand | / torch fused fp32 |")
    print("|---|---|---|---|")
    print(f"| torchao AdamW8bit by hand | {hand / n * 1e9:.2f} | 1 | {hand / fp32:.1f} |")
    print(f"| **ours, `precision_annot.optimizer(..., AdamW).step()`** | {mine / n * 1e9:.2f} | "
          f"**{ratio:.3f}** | {mine / fp32:.1f} |")
    print(f"| ours, `update_kernels.lowbit_adam` by hand | {mine_alone / n * 1e9:.2f} | "
          f"{ratio_alone:.3f} | {mine_alone / fp32:.1f} |")


_FIRST_STEP = """
import sys, time, torch
torch.set_num_threads(1)
sys.path.insert(0, {root!r})
from torch._dynamo.utils import counters
from benchmarks.update import GPT2, lowbit_by_hand, lowbit_ours
fn = {engine}(GPT2)
wall, cpu = time.perf_counter(), time.thread_time()
fn()
first = time.perf_counter() - wall
cpu = time.thread_time() - cpu
seconds = []
for _ in range(3):
    start = time.thread_time()
    fn()
    seconds.append(time.thread_time() - start)
print(f"{{first:.0f}} {{cpu:.0f}} {{counters['stats']['unique_graphs']}} {{min(seconds):.2f}}")
"""


def gpt2_first_step() -> None:
    n = sum(torch.Size(s).numel() for s in GPT2)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print(f"\nGPT-2 shapes ({n:,} parameters in {len(GPT2)} tensors, "
          f"{len(set(GPT2))} shapes), a fresh process and inductor cache each:\n")
    print("| 8-bit step | first step, wall (s) | of which this thread's CPU (s) | graphs "
          "compiled | a later step, CPU (s) |")
    print("|---|---|---|---|---|")
    for label, engine in (("ours", "lowbit_ours"), ("torchao AdamW8bit by hand",
                                                    "lowbit_by_hand")):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS="1")
            out = subprocess.run([sys.executable, "-c", _FIRST_STEP.format(
                root=root, engine=engine)], env=env, capture_output=True, text=True,
                check=True).stdout.split()
        print(f"| {label} | {' | '.join(out[-4:])} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer pairs")
    parser.add_argument("--pairs", type=int, default=None, help="pairs per row")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed's CPU Adam")
    parser.add_argument("--no-lowbit", action="store_true", help="skip the 8-bit step")
    parser.add_argument("--gpt2", action="store_true",
                        help="time the first 8-bit step on GPT-2's shapes (minutes)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pairs = args.pairs or (7 if args.quick else 31)
    print(f"{cpu_model()}, capability {torch.backends.cpu.get_cpu_capability()}; torch "
          f"{torch.__version__}, python {platform.python_version()}; 1 thread, {pairs} pairs")
    masters_table(pairs, not args.no_deepspeed)
    if not args.no_lowbit:
        lowbit_table(max(3, pairs // 3))
    if args.gpt2:
        gpt2_first_step()


if __name__ == "__main__":
    main()
