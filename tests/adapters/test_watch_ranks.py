"""`watch` on 2 gloo ranks under DDP and FSDP2: each step's statistics reduced across ranks
(the largest magnitude, summed counts), a module only one rank ran included, and an overflow on
one rank said on rank 0 (tests/workers/watching.py); an overflow in an expert only one rank ran
named after it; and `watch` and `diff` under tensor parallelism, sequence parallelism and loss
parallelism (torch's styles), against hooks written by hand that gather each tensor whole
(tests/workers/watch_tp.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from precision_annot._src.watching import report
from tests.helpers import launch


def ranks(mode: str, tmp_path: Path, worker: str = "tests.workers.watching"
          ) -> list[dict[str, Any]]:
    launch(worker, mode, str(tmp_path), ranks=2, timeout=300)
    return [json.loads((tmp_path / f"{mode}-rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow  # over make test's budget: run by make test-all
@pytest.mark.parametrize("mode", [
    "ddp",
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


@pytest.mark.slow  # 20 s; the reduced order is tested in tests/test_watching.py in make test
def test_an_overflow_in_an_expert_only_one_rank_ran_is_named_after_it(tmp_path: Path) -> None:
    """Only rank 1 routes tokens to expert 3, whose last Linear overflows. 0.5 named `moe` in
    the reduced record and in what rank 0 said (rank 0 had no row of its own for the expert, so
    it came after every module rank 0 ran); rank 1's own record was right."""
    r0, r1 = ranks("moe", tmp_path)
    assert r1["mine"][0]["first_nonfinite"] == "moe.experts.3.2"
    assert r0["mine"][0]["first_nonfinite"] is None
    assert "moe.experts.3.2" not in r0["mine"][0]["outputs"]
    for r in (r0, r1):
        assert r["all"][0]["first_nonfinite"] == "moe.experts.3.2"
        order = list(r["all"][0]["outputs"])  # the order the modules ran in, on some rank
        assert order.index("moe.experts.3.2") < order.index("moe.experts.3") < order.index("moe")
        assert order.index("moe.experts.1") < order.index("moe.experts.3.0")
    assert list(r0["all"][0]["outputs"]) == list(r1["all"][0]["outputs"])
    assert list(r0["all"][0]["grads"]) == list(r1["all"][0]["grads"])
    expert = r0["all"][0]["outputs"]["moe.experts.3.2"]
    assert expert == r1["mine"][0]["outputs"]["moe.experts.3.2"]  # rank 1's alone
    assert expert["nonfinite"] > 0 and expert["in_nonfinite"] == 0
    assert len(r0["said"]) == 1 and r1["said"] == []
    assert "step 0: the output of module 'moe.experts.3.2' reached" in r0["said"][0]


def by_hand(r: dict[str, Any], step: int, kind: str, name: str) -> tuple[dict[str, Any], ...]:
    """What the hooks written by hand measured of one module's tensor: whole, this rank's."""
    (hand,) = r["hand"][step][kind][name]  # one call, one tensor
    return hand["whole"], hand["local"]


def agrees(measured: dict[str, Any], hand: dict[str, Any]) -> None:
    """A record's statistics are the tensor's measured by hand: the largest finite magnitude,
    the counts (shares of its elements) and the values not finite."""
    assert measured["amax"] == hand["amax"]
    assert measured["nonfinite"] == hand["nonfinite"]
    assert measured["over"] * hand["numel"] == pytest.approx(hand["over"], abs=1e-9)
    assert measured["under"] * hand["numel"] == pytest.approx(hand["under"], abs=1e-9)


@pytest.mark.slow  # over make test's budget: run by make test-all
def test_watch_and_diff_measure_a_tensor_parallel_mlp_as_hooks_gathering_it_whole(
        tmp_path: Path) -> None:
    """A Megatron MLP in fp16 (each Linear handed a DTensor; the row-parallel one hands back a
    replicated DTensor, whose gradient comes back as a pending sum) and a column-parallel head.
    0.5 crashed (`aten.cat.default got mixed torch.Tensor and DTensor`). Each rank's record holds
    its local shard, the reduced one the whole tensor, as hooks written by hand measure it with
    `full_tensor()`; on step 1 only rank 1's shard of `mlp.up` overflows."""
    r0, r1 = ranks("mlp", tmp_path, "tests.workers.watch_tp")
    assert r0["all"] == r1["all"]
    for r in (r0, r1):
        for step in (0, 1):
            for kind in ("outputs", "grads"):
                assert set(r["hand"][step][kind]) == set(r["all"][step][kind])
                for name in r["all"][step][kind]:
                    whole, local = by_hand(r, step, kind, name)
                    agrees(r["all"][step][kind][name], whole)
                    agrees(r["mine"][step][kind][name], local)
        placed = {n: h[0]["placements"] for n, h in r["hand"][0]["grads"].items()}
        assert placed["mlp.down"] == ["P(sum)"]  # reduced first, as the next op would
    step1 = r0["all"][1]
    assert step1["first_nonfinite"] == "mlp.up" and step1["outputs"]["mlp.up"]["nonfinite"] == 2
    assert step1["outputs"]["mlp.up"]["in_nonfinite"] == 0
    # a replicated DTensor counts once: 32 values not finite, not one count per rank
    assert step1["outputs"]["mlp.down"]["nonfinite"] == 32 == by_hand(r0, 1, "outputs",
                                                                       "mlp.down")[0]["nonfinite"]
    assert r0["mine"][1]["outputs"]["mlp.up"]["nonfinite"] == 0  # not in rank 0's shard
    said = "step 1: the output of module 'mlp.up' reached 2 non-finite values"
    assert len(r0["said"]) == 1 and said in r0["said"][0]
    assert r1["said"] == []
    for r in (r0, r1):
        root = next(m for m in r["diff"]["modules"] if m["name"] == "")
        assert root["output_error"] == pytest.approx(r["hand_diff"]["output_error"], rel=1e-9)
        assert root["grad_error"] == pytest.approx(r["hand_diff"]["grad_error"], rel=1e-9)
        assert 0 < root["output_error"] < 1e-3  # fp16 against fp32, not a wrong comparison
        assert [m["name"] for m in r["diff_default"]["modules"]] == [
            "mlp.up", "mlp.down", "mlp", "head", ""]
    whole = [m for m in r0["diff"]["modules"] if m["name"] != "mlp.up"]  # DTensors: gathered
    assert whole == [m for m in r1["diff"]["modules"] if m["name"] != "mlp.up"]


@pytest.mark.slow  # 20 s; the tensor-parallel MLP above stays in make test
def test_watch_and_diff_under_sequence_and_loss_parallelism(tmp_path: Path) -> None:
    """A vocabulary-parallel embedding, sequence-parallel LayerNorms and a head whose logits
    stay sharded by vocabulary for torch's `loss_parallel` cross-entropy, in bf16. 0.5 crashed
    in watch, and in diff (`aten.mv.default got mixed torch.Tensor and DTensor`, its default
    loss). The sharded DTensors are marked `sharded` in each rank's record."""
    r0, r1 = ranks("sp", tmp_path, "tests.workers.watch_tp")
    assert r0["all"] == r1["all"]
    for r in (r0, r1):
        for kind in ("outputs", "grads"):
            assert set(r["hand"][0][kind]) == set(r["all"][0][kind])
            for name in r["all"][0][kind]:
                whole, local = by_hand(r, 0, kind, name)
                agrees(r["all"][0][kind][name], whole)
                agrees(r["mine"][0][kind][name], local)
                assert r["mine"][0][kind][name]["sharded"] == (name in (
                    "norm", "final_norm", "head", ""))
                assert r["all"][0][kind][name]["sharded"] is False
        assert r["said"] == []
        root = next(m for m in r["diff"]["modules"] if m["name"] == "")
        assert root["output_error"] == pytest.approx(r["hand_diff"]["output_error"], rel=1e-9)
        assert root["grad_error"] == pytest.approx(r["hand_diff"]["grad_error"], rel=1e-9)
        assert 0 < root["output_error"] < 2e-2  # bf16 against fp32
        default = {m["name"]: m for m in r["diff_default"]["modules"]}
        assert default[""]["output_error"] == root["output_error"]  # the same forward
        assert 0 < default[""]["grad_error"] < 2e-2
    for row0, row1 in zip(r0["diff"]["modules"], r1["diff"]["modules"], strict=True):
        if row0["name"] in ("norm", "final_norm", "head", ""):  # DTensors: compared whole
            assert row0 == row1
