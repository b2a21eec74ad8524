"""Tensor parallel: how far TP=N lands from one rank, and what comm=fp32 costs.

12 residual bf16 MLP blocks (`x + down(gelu(up(x)))`, d=64, hidden 256, a batch of 16 rows;
`apply(model, default="bf16-mixed")`), `up` column-parallel and `down` row-parallel through
`precision_annot.adapters.tp.parallelize_module`, on N gloo ranks of this machine, against the
same applied plan on one rank:

- comm=bf16 on the Linear layers: torch's own `ColwiseParallel` / `RowwiseParallel` (the
  partial sums rounded to bf16 by the GEMM and all-reduced in bf16);
- comm=fp32: `PlannedColwiseParallel` / `PlannedRowwiseParallel` (partial sums computed and
  all-reduced in fp32, rounded once).

It prints the relative gap of the output and of all gradients (L2 over every parameter) to one
rank, what one rank differs from itself when its GEMMs sum in another order (fp32 GEMMs of
the same bf16 operands), the bytes reduced per step, and the thread CPU time and wall time of
a forward and backward (alternating the two models, medians, rank 0). On a CPU the fp32
partial GEMM is an fp32 GEMM of upcast operands; on CUDA it is the bf16 GEMM's fp32 output.

Run: `python benchmarks/tp_reduction.py [--ranks 2 4] [--repeats 30] [--seeds 5]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from tests.helpers import launch


def measure(ranks: int, repeats: int, seeds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        launch("tests.workers.tp", "gaps", out, "12", "64", "256", str(repeats), str(seeds),
               ranks=ranks, timeout=1800)
        result: dict[str, Any] = json.loads((Path(out) / "gaps-rank0.json").read_text())
        return result


def _spread(values: list[float]) -> str:
    """The mean and the largest over the seeds, and how many gave exactly one rank's."""
    exact = sum(v == 0 for v in values)
    return f"{statistics.mean(values):.1e} ({max(values):.1e}; {exact}/{len(values)} exact)"


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| TP | comm | output gap | gradient gap | bytes all-reduced per rank and step "
            "| thread CPU ms | wall ms |", "|---|---|---|---|---|---|---|"]
    for r in results:
        cost = r.get("cost", {})
        for i, comm in enumerate(("bf16", "fp32")):
            outs = [s[2 * i] for s in r["seeds"]]
            grads = [s[2 * i + 1] for s in r["seeds"]]
            rows.append(f"| {r['world']} | {comm} | {_spread(outs)} | {_spread(grads)} | "
                        f"{r[f'{comm}_bytes']:,} | {cost.get(f'{comm}_cpu', float('nan')):.2f} "
                        f"| {cost.get(f'{comm}_wall', float('nan')):.2f} |")
    first = results[0]
    rows.append("")
    rows.append(f"Gaps: mean (largest; seeds equal to one rank) over {len(first['seeds'])} "
                "seeds. bf16 against fp32, "
                f"one rank: output {first['bf16_vs_fp32'][0]:.1e}, gradients "
                f"{first['bf16_vs_fp32'][1]:.1e}. One rank against itself, its GEMMs summed in "
                f"another order: output {_spread([s[4] for s in first['seeds']])}, gradients "
                f"{_spread([s[5] for s in first['seeds']])}.")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    print(table([measure(n, args.repeats, args.seeds) for n in args.ranks]))


if __name__ == "__main__":
    main()
