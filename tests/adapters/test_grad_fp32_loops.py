"""`grad=fp32` in the loops users run: DDP (2 gloo ranks, with and without `no_sync`), the
Hugging Face Trainer, the Lightning Trainer and FSDP2, each against the loop written by hand
(`tests.workers.grads.HandLoop`: fp32 masters, fp32 gradient sums by hand)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import launch


def ddp_cases(cases: list[str], tmp_path: Path) -> dict[str, list[dict[str, Any]]]:
    launch("tests.workers.grads", ",".join(cases), str(tmp_path), ranks=2, timeout=300)
    return {c: [json.loads((tmp_path / f"{c}-rank{r}.json").read_text()) for r in (0, 1)]
            for c in cases}


def assert_equals_the_hand_loop(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["weights"] == 0.0 and r["masters"] == 0.0, r
        assert r["grads"] == ["torch.float32"], r  # .grad is fp32 after DDP's reduction


def test_ddp_no_sync_accumulates_in_fp32_and_reduces_as_by_hand(tmp_path: Path) -> None:
    """3 micro-batches per step, the first two under `no_sync`, `model.zero_grad()` and
    `clip_grad_norm_` on the model: equal to the hand loop (sums reduced in bf16, the plan's
    comm) bit for bit on both ranks. A plan reducing in fp32 without the comm hook that can is
    refused at the first forward, naming the fix."""
    found = ddp_cases(["no_sync", "misconfigured"], tmp_path)
    assert_equals_the_hand_loop(found["no_sync"])
    for r in found["misconfigured"]:
        assert r["error"] is not None and "reduces it in fp32 (comm=fp32" in r["error"]
        assert "register_comm_hook(None, precision_annot.adapters.ddp.comm_hook(" in r["error"]


@pytest.mark.slow  # 10 s: 4 more DDP loops on 2 ranks
def test_ddp_every_step_synchronised_hooked_fp32_comm_and_unused_parameters(
        tmp_path: Path) -> None:
    """Without `no_sync`; with the plan's comm hook (bf16 comm, and fp32 comm, where the hook
    reduces the fp32 sums themselves); with `find_unused_parameters=True` and a Linear that
    rank 0 uses only before the synchronising micro-batch and rank 1 only in it, and one that
    no rank uses (its `.grad` stays None)."""
    found = ddp_cases(["sync", "no_sync_hook", "fp32_comm_hook", "find_unused"], tmp_path)
    for case, ranks in found.items():
        assert_equals_the_hand_loop(ranks)
        assert all(r["dead"] is (True if case == "find_unused" else None) for r in ranks)
