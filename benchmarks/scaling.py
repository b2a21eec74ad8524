"""How the cost of each entry point grows with the number of modules.

Models of N modules: blocks of a Linear and a LayerNorm (plus the block and a list holding
them), annotated with 10 rules, as a mixture-of-experts model has tens of thousands of
modules. For each N the time of each step is printed, and its time per module: a step that is
linear in the modules keeps that number flat as N grows.

Run: `python benchmarks/scaling.py [--sizes 1000,10000,100000] [--only apply,check-fsdp]`.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

from precision_annot import PrecisionPlan, annotate, apply, audit, check, remove, resolve


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.norm(self.fc(x))
        return out


class Stack(nn.Module):
    def __init__(self, blocks: int, d: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


RULES: list[tuple[object, str]] = [
    (nn.LayerNorm, "fp32"),
    ("blocks.0", "compute=fp32"),
    ("blocks.1.*", "compute=fp32,output=fp32"),
    ("blocks.2.fc", "comm=bf16"),
    (lambda name, m: name.endswith("7.fc"), "comm=bf16"),
    ("blocks.3", "bf16"),
    ("blocks.4.norm", "compute=fp32,storage=fp32"),
    ("blocks.5.fc", "compute=bf16"),
    ("blocks.6.*", "output=fp32"),
    ("blocks.8", "compute=fp32,storage=fp32,comm=fp32"),
]

STEPS = ("annotate", "resolve", "apply", "reapply", "json", "forward", "audit", "remove",
         "check", "check-ddp", "check-fsdp", "check-fsdp1", "check-deepspeed")


def timed(fn: Callable[[], object]) -> float:
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(n_modules: int, only: set[str]) -> dict[str, float]:
    blocks = max(10, n_modules // 3)  # a block is 3 modules: itself, its Linear, its LayerNorm
    model = Stack(blocks)
    n = len(list(model.modules()))
    x = torch.randn(2, 4)
    out: dict[str, float] = {"modules": float(n)}
    plan_box: list[PrecisionPlan] = []

    def step(name: str, fn: Callable[[], object]) -> None:
        if name in only:
            out[name] = timed(fn)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out["annotate"] = timed(lambda: annotate(model, RULES))
        out["resolve"] = timed(lambda: plan_box.append(resolve(model, "bf16-mixed")))
        plan = plan_box[0]
        out["apply"] = timed(lambda: apply(model, plan))
        out["reapply"] = timed(lambda: apply(model, plan))
        step("json", lambda: PrecisionPlan.from_json(plan.to_json()))
        step("forward", lambda: model(x))

        def audited() -> None:
            with audit(model):
                model(x)

        step("audit", audited)
        step("check", lambda: check(model))
        step("check-ddp", lambda: check(model, "ddp"))
        step("check-fsdp", lambda: check(model, "fsdp"))
        step("check-fsdp1", lambda: check(model, "fsdp1"))
        step("check-deepspeed", lambda: check(model, "deepspeed",
                                              {"zero_optimization": {"stage": 2}}))
        step("remove", lambda: remove(model))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000",
                        help="module counts, comma-separated (default: 1000,10000,100000)")
    parser.add_argument("--only", default=",".join(STEPS),
                        help=f"steps beyond annotate/resolve/apply/reapply: {','.join(STEPS)}")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = parser.parse_args()
    only = set(args.only.split(","))
    torch.set_num_threads(1)
    rows = [measure(int(s), only) for s in args.sizes.split(",")]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread")
    steps = [s for s in ("annotate", "resolve", "apply", "reapply", *STEPS) if s in rows[0]]
    steps = list(dict.fromkeys(steps))
    header = f"{'step':<16}" + "".join(f"{int(r['modules']):>12,} modules" for r in rows)
    print(header)
    print(f"{'':<16}" + "".join(f"{'s':>10} {'us/mod':>9}" for _ in rows))
    for name in steps:
        cells = "".join(f"{r[name]:>10.3f} {r[name] / r['modules'] * 1e6:>9.1f}" for r in rows)
        print(f"{name:<16}{cells}")


if __name__ == "__main__":
    main()
