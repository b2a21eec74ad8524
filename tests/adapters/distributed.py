"""Two gloo ranks train the island model under DDP, FSDP1 or FSDP2 (tests.workers.dist)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.helpers import launch
from tests.workers.models import linear_elements, norm_elements

LINEAR, NORM = linear_elements(16, 32, 4), norm_elements(32)


def run_ranks(mode: str, tmp_path: Path) -> list[dict[str, Any]]:
    launch("tests.workers.dist", mode, str(tmp_path), ranks=2, timeout=300)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def check_training(ranks: list[dict[str, Any]], reduce_op: str) -> None:
    """Both ranks learned, with fp32 master weights, planned forward dtypes, bf16 on the wire
    for the Linears and fp32 for the island, identical parameters, and a single-process
    reference reached."""
    for r in ranks:
        assert r["losses"][-1] < r["losses"][0] * 0.9, r["losses"]
        assert set(r["storage"].values()) == {"fp32"}  # fp32 master weights everywhere
        assert r["seen"] == {"fc1": ["bf16"], "norm": ["fp32"], "fc2": ["bf16"]}
        reduced = {(d, n) for op, d, n in r["collectives"] if op == reduce_op}
        assert reduced == {("bf16", LINEAR), ("fp32", NORM)}, r["collectives"]
        assert r["round_trip"] is True
    assert ranks[0]["params"] == ranks[1]["params"]
    # averaged correctly: the same as one process training on both ranks' data (bf16 comm)
    ref = ranks[0]["reference"]
    assert set(ref) == set(ranks[0]["params"])
    worst = max(abs(a - b) for n in ref for a, b in zip(ref[n], ranks[0]["params"][n],
                                                         strict=True))
    assert worst < 5e-3, worst
