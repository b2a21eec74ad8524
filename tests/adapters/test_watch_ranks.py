"""`watch` on 2 gloo ranks under DDP and FSDP2: each step's statistics reduced across ranks
(the largest magnitude, summed counts), a module only one rank ran included, and an overflow on
one rank said on rank 0 (tests/workers/watching.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from precision_annot._src.watching import report
from tests.helpers import launch


def ranks(mode: str, tmp_path: Path) -> list[dict[str, Any]]:
    launch("tests.workers.watching", mode, str(tmp_path), ranks=2, timeout=300)
    return [json.loads((tmp_path / f"{mode}-rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("mode", [
    pytest.param("ddp", marks=pytest.mark.slow),  # 6 s; FSDP2 stays in make test
    "fsdp2"])
def test_watch_reduces_each_step_across_ranks(mode: str, tmp_path: Path) -> None:
    r0, r1 = ranks(mode, tmp_path)
    assert [r["step"] for r in r0["all"]] == [0, 1] and r0["all"] == r1["all"]
    step0 = r0["all"][0]
    for name in ("fc1", "norm", "fc2"):
        mine = [r["mine"][0]["outputs"][name] for r in (r0, r1)]
        merged = step0["outputs"][name]
        assert merged["amax"] == max(m["amax"] for m in mine) and merged["dtype"] == "bf16"
        assert merged["nonfinite"] == 0
    # rank 1's batch is 50 times larger: the merged fc1 is rank 1's, not rank 0's
    assert step0["outputs"]["fc1"]["amax"] > 10 * r0["mine"][0]["outputs"]["fc1"]["amax"]
    # only rank 1 ran `extra` on step 0: the reduction has it, rank 0's own record does not
    assert "extra" not in r0["mine"][0]["outputs"] and "extra" in r1["mine"][0]["outputs"]
    assert step0["outputs"]["extra"] == r1["mine"][0]["outputs"]["extra"]
    # step 1: rank 1's inf; rank 0 saw none itself, and says it from the reduced record
    assert r0["mine"][1]["first_nonfinite"] is None
    assert r1["mine"][1]["first_nonfinite"] == "fc1" == r0["all"][1]["first_nonfinite"]
    assert r0["all"][1]["outputs"]["fc1"]["nonfinite"] == (
        r1["mine"][1]["outputs"]["fc1"]["nonfinite"])
    assert r0["all"][1]["outputs"]["fc1"]["in_nonfinite"] == 1  # the inf came in the batch
    assert len(r0["said"]) == 1 and "step 1: module 'fc1', the first to hold non-finite" in (
        r0["said"][0])
    assert r1["said"] == []  # said once, on rank 0
    # one file both ranks append to: each rank's own records, the reduced one once (rank 0's);
    # watch-report counts 2 sampled steps (0.4: 6, its reduced records written by each rank)
    shared = tmp_path / f"{mode}-shared.jsonl"
    lines = [json.loads(line) for line in shared.read_text().splitlines()]
    assert sorted(str(r["rank"]) for r in lines) == ["0", "0", "1", "1", "all", "all"]
    assert report(shared).startswith(f"2 sampled steps in {shared}")
