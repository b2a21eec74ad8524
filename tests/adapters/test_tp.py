"""Tensor parallel from the plan: the style each module gets, `check(model, "tp")`, the planned
styles' arithmetic on one rank, and real gloo runs on 2 and 4 ranks (tests/workers/tp.py)."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from precision_annot import (
    PrecisionPlan,
    annotate,
    applied_plan,
    apply,
    audit,
    bf16,
    check,
    fp32,
    precision,
    resolve,
)
from precision_annot.adapters import tp
from precision_annot.adapters.tp.styles import wide_mm
from tests.helpers import launch
from tests.workers.tp import Blocks, Embedded, Routed, full, mlp_plan


def run_ranks(mode: str, tmp_path: Path, ranks: int, *args: str) -> list[dict[str, Any]]:
    launch("tests.workers.tp", mode, str(tmp_path), *args, ranks=ranks, timeout=600)
    return [json.loads((tmp_path / f"{mode}-rank{r}.json").read_text()) for r in range(ranks)]


def applied(model: nn.Module) -> PrecisionPlan:
    plan = applied_plan(model)
    assert plan is not None
    return plan


def styles(model: nn.Module, tp_plan: dict[str, Any]) -> dict[str, tuple[str, str | None]]:
    """The style each module gets, and the dtype it reduces in, as parallelize_module would."""
    return {d.name: (type(d.style).__name__, d.reduce and str(d.reduce).removeprefix("torch."))
            for d in tp.decisions(model, tp_plan, applied(model))}


# -- the style each module gets ------------------------------------------------------------------

def test_comm_decides_between_the_plain_and_the_planned_styles() -> None:
    model = Blocks(2, 16, 32)
    annotate(model, {nn.Linear: "comm=fp32", "blocks.1.*": "comm=bf16"})
    apply(model, default="bf16-mixed,comm=bf16")
    assert styles(model, mlp_plan(2)) == {
        "blocks.0.up": ("PlannedColwiseParallel", "float32"),   # bf16 GEMMs, fp32 sums
        "blocks.0.down": ("PlannedRowwiseParallel", "float32"),
        "blocks.1.up": ("ColwiseParallel", "bfloat16"),        # what torch does
        "blocks.1.down": ("RowwiseParallel", "bfloat16"),
    }
    # an fp32 island is a boundary: under the plain styles its sums would be reduced in the
    # bf16 of the code around it (rounded at its exit, or before its entry's cast)
    annotate(model, {"blocks.1.down": "fp32"})
    apply(model)
    assert styles(model, mlp_plan(2))["blocks.1.down"] == ("PlannedRowwiseParallel", "float32")
    # layouts are kept
    chosen = tp.decisions(model, {"blocks.0.down": RowwiseParallel(output_layouts=Shard(1))},
                          applied(model))[0].style
    assert isinstance(chosen, tp.PlannedRowwiseParallel) and chosen.output_layouts == (Shard(1),)


def test_fp8_styles_only_where_the_plan_computes_fp8() -> None:
    pytest.importorskip("torchao")
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        PrepareFloat8ModuleInput,
    )

    model = Routed()
    annotate(model, {nn.Linear: "compute=fp8,comm=bf16", "router": "fp32"})
    apply(model, default="bf16-mixed")
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel(),
            "router": Float8ColwiseParallel()}
    assert styles(model, plan) == {
        "up": ("Float8ColwiseParallel", "bfloat16"), "down": ("Float8RowwiseParallel", "bfloat16"),
        "router": ("PlannedColwiseParallel", "float32")}  # an island, never fp8
    notes = [n for d in tp.decisions(model, plan, applied(model)) for n in d.notes]
    assert [n.code for n in notes] == ["tp-fp8-style-not-fp8"]
    assert "'router' Float8ColwiseParallel" in notes[0].message
    # torchao's fp8 styles scale per tensor: a row-wise recipe gets the plain style
    rowwise = Routed()
    annotate(rowwise, {nn.Linear: "compute=fp8-rowwise,comm=bf16"})
    apply(rowwise, default="bf16-mixed")
    assert styles(rowwise, {"up": Float8ColwiseParallel()})["up"][0] == "ColwiseParallel"
    # PrepareFloat8ModuleInput hands fp8 to every layer under it: kept only where all are fp8
    prepare = PrepareFloat8ModuleInput(input_layouts=Shard(0), desired_input_layouts=Replicate())
    assert styles(model, {"": prepare})[""][0] == "PrepareModuleInput"
    annotate(model, {"router": "compute=fp8"})
    apply(model)
    assert styles(model, {"": prepare})[""][0] == "PrepareFloat8ModuleInput"


def test_other_styles_pass_through() -> None:
    model = Blocks(1, 16, 32, norm=True)
    apply(model, default="bf16-mixed")
    got = styles(model, {"blocks.0.norm": SequenceParallel(),
                         "blocks.0": PrepareModuleInput(input_layouts=Shard(1),
                                                        desired_input_layouts=Replicate())})
    assert got == {"blocks.0.norm": ("SequenceParallel", None),
                   "blocks.0": ("PrepareModuleInput", None)}


# -- check(model, "tp") ----------------------------------------------------------------------------

def _codes(model: nn.Module, config: dict[str, Any]) -> list[tuple[str, str, tuple[str, ...]]]:
    return [(f.severity, f.code, f.modules) for f in check(model, "tp", config)
            if f.code.startswith("tp-")]


def test_check_tp_findings() -> None:
    pytest.importorskip("torchao")
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel

    model = Blocks(2, 64, 64)
    annotate(model, {nn.Linear: "compute=mxfp8,comm=bf16"})
    apply(model, default="bf16-mixed")
    # mxfp8 scales blocks of 32 along each GEMM's inner dimension: 64 / 4 ranks leaves 16
    assert _codes(model, {"parallelize_plan": mlp_plan(2), "tp_degree": 4}) == [
        ("error", "tp-fp8-shard", ("blocks.0.up", "blocks.0.down", "blocks.1.up",
                                   "blocks.1.down"))]
    assert _codes(model, {"parallelize_plan": mlp_plan(2), "tp_degree": 2}) == []
    routed = Routed()
    annotate(routed, {nn.Linear: "compute=fp8", "router": "fp32"})
    apply(routed, default="bf16-mixed,comm=fp32")
    found = _codes(routed, {"parallelize_plan": {"up": ColwiseParallel(),
                                                 "down": RowwiseParallel(),
                                                 "router": Float8ColwiseParallel(),
                                                 "rooter": ColwiseParallel()}})
    assert found == [("warning", "tp-plan-unmatched", ()),
                     ("warning", "tp-comm-wire-only", ("up", "down")),
                     ("warning", "tp-fp8-style-not-fp8", ("router",))]
    message = {f.code: f for f in check(routed, "tp", {"parallelize_plan": {
        "rooter": ColwiseParallel()}})}["tp-plan-unmatched"]
    assert "'rooter' names no module" in message.message and "'router'" in message.fix
    embedded = Embedded()
    apply(embedded, default="bf16-mixed")
    assert _codes(embedded, {"parallelize_plan": {"embed": RowwiseParallel()}}) == [
        ("info", "tp-comm-wire-only", ("embed",))]  # its sum is exact in bf16


def test_check_tp_config_errors() -> None:
    model = apply(Blocks(1, 16, 32), default="bf16-mixed")
    with pytest.raises(ValueError, match="needs config=.*'parallelize_plan'"):
        check(model, "tp", {})
    with pytest.raises(ValueError, match=r"'tp_degree' is the TP mesh size.*tp_degree=0"):
        check(model, "tp", {"parallelize_plan": mlp_plan(1), "tp_degree": 0})
    with pytest.raises(ValueError, match="unknown key 'degree'"):
        check(model, "tp", {"parallelize_plan": mlp_plan(1), "degree": 2})
    with pytest.raises(TypeError, match="parallelize_plan is a ParallelStyle or a dict"):
        check(model, "tp", {"parallelize_plan": ["blocks.0.up"]})
    loaded = PrecisionPlan.from_json(resolve(model).to_json())
    with pytest.raises(ValueError, match="pass the model instead of its plan"):
        check(loaded, "tp", {"parallelize_plan": mlp_plan(1)})


# -- on one rank: the planned styles' arithmetic -------------------------------------------------

def test_planned_styles_compute_and_round_as_written_by_hand(group: None) -> None:
    """On one rank the planned styles are their arithmetic alone: the bf16-rounded operands
    multiplied in fp32 (their products are exact there), the bias added, one rounding."""
    torch.manual_seed(0)
    model = Blocks(1, 8, 16)
    annotate(model, {nn.Linear: "comm=fp32"})
    apply(model, default="bf16-mixed")
    up, down = (model.blocks[0].up, model.blocks[0].down)
    w = {n: p.detach().clone() for n, p in model.named_parameters()}
    tp.parallelize_module(model, init_device_mesh("cpu", (1,)), mlp_plan(1))
    assert isinstance(down.weight, DTensor) and type(down).__name__ == "TPLinear"
    x = torch.randn(4, 8)
    out = model(x)
    out.float().square().mean().backward()

    def r(t: torch.Tensor) -> torch.Tensor:  # bf16-rounded, seen in fp32
        return t.to(bf16).to(fp32)

    xr = r(x).requires_grad_()
    h = (xr @ r(w["blocks.0.up.weight"]).t() + r(w["blocks.0.up.bias"])).to(bf16)
    g = nn.functional.gelu(h)
    y = (r(g) @ r(w["blocks.0.down.weight"]).t() + r(w["blocks.0.down.bias"])).to(bf16)
    ref = x.to(bf16) + y
    assert out.dtype == bf16 and torch.equal(out, ref)
    assert down.weight.grad is not None and up.weight.grad is not None
    assert down.weight.grad.dtype == fp32  # gradients land in storage


def test_row_parallel_output_fp32_is_one_ranks_rounded_output(group: None) -> None:
    """`output=fp32` on a bf16 row-parallel Linear: one rank's GEMM rounds to bf16 and the
    boundary casts that; the planned style rounds its fp32 sum the same way (it handed the
    unrounded fp32 sum back, 3e-4 from one rank on 2 ranks, its gradients 2e-3)."""
    torch.manual_seed(0)
    model = Blocks(1, 8, 16)
    annotate(model, {nn.Linear: "comm=fp32", "blocks.0.down": "output=fp32"})
    apply(model, default="bf16-mixed")
    one = copy.deepcopy(model)
    tp.parallelize_module(model, init_device_mesh("cpu", (1,)), mlp_plan(1))
    x = torch.randn(4, 8)
    got, want = model(x), one(x)
    assert got.dtype == want.dtype == fp32 and torch.equal(got, want)
    got.square().mean().backward()
    want.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), one.parameters(), strict=True):
        assert torch.equal(full(p.grad), q.grad), name


def test_partial_sums_between_fp16_and_bf16_are_rounded_once_to_comm(group: None) -> None:
    """bf16 compute with comm=fp16: each partial sum is computed in fp32 and rounded once to
    fp16 (it was computed in bf16, so its fp16 sum held bf16's precision only)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16))
    annotate(model, {nn.Linear: "comm=fp16"})
    apply(model, default="bf16-mixed")
    w, b = (t.detach().clone() for t in (model[0].weight, model[0].bias))
    tp.parallelize_module(model, init_device_mesh("cpu", (1,)), {"0": RowwiseParallel()})
    x = torch.randn(32, 8)

    def r(t: torch.Tensor) -> torch.Tensor:
        return t.to(bf16).to(fp32)

    want = ((r(x) @ r(w).t()).to(torch.float16).to(fp32) + r(b)).to(bf16)
    assert torch.equal(model(x), want)


def test_parallelize_block_by_block_uses_the_models_plan(group: None) -> None:
    """torchtitan parallelizes each block on its own: the block's decisions come from the
    plan applied to the whole model, under the block's own names."""
    model = Blocks(2, 16, 32)
    annotate(model, {"blocks.0": "comm=fp32"})
    apply(model, default="bf16-mixed,comm=bf16")
    mesh = init_device_mesh("cpu", (1,))
    for block in model.blocks:
        tp.parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    assert {n: type(s).__name__ for n, s in tp.styles(model).items()} == {
        "blocks.0.up": "PlannedColwiseParallel", "blocks.0.down": "PlannedRowwiseParallel",
        "blocks.1.up": "ColwiseParallel", "blocks.1.down": "RowwiseParallel"}
    assert tp.reduced_in(model.blocks[1]) == {"blocks.1.up": bf16, "blocks.1.down": bf16}
    model(torch.randn(4, 16)).float().sum().backward()


def test_parallelize_a_block_of_an_unapplied_model_warns(group: None) -> None:
    """A block parallelized before the model's plan is applied cannot see the plan set above
    it: it got its own (empty) plan and torch's bf16-free styles, silently."""
    mesh = init_device_mesh("cpu", (1,))
    block_plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    model = precision("bf16-mixed")(Blocks(2, 16, 32))  # set on the model, not applied
    with pytest.warns(UserWarning, match=r"no precision plan is applied to this Block .*"
                      r"no compute dtype for 'up' and 'down'.*apply\(model, \.\.\.\)"):
        tp.parallelize_module(model.blocks[0], mesh, block_plan)
    applied = apply(precision("bf16-mixed")(Blocks(2, 16, 32)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tp.parallelize_module(applied.blocks[0], mesh, block_plan)
    assert type(tp.styles(applied)["blocks.0.up"]).__name__ == "PlannedColwiseParallel"


def test_parallelize_module_errors_and_warnings(group: None) -> None:
    mesh = init_device_mesh("cpu", (1,))
    model = apply(Blocks(1, 16, 32), default="bf16-mixed")
    with pytest.raises(TypeError, match="parallelize_plan is a ParallelStyle or a dict"):
        tp.parallelize_module(model, mesh, ["blocks.0.up"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expects an nn.Module"):
        tp.parallelize_module("model", mesh, {})  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match=r"'blocks\.0\.upp' names no module.*'blocks\.0\.up'"):
        tp.parallelize_module(model, mesh, {"blocks.0.upp": ColwiseParallel()})
    assert not isinstance(model.blocks[0].up.weight, DTensor)
    with pytest.raises(ValueError, match="plan is not the plan of a model holding"):
        tp.parallelize_module(model, mesh, mlp_plan(1), plan=resolve(Blocks(1, 16, 32)))
    model.extra = nn.Linear(16, 16)  # added after apply
    with pytest.raises(ValueError, match=r"names 'extra', which the precision plan does not "
                       r"hold .*apply\(model\)"):
        tp.parallelize_module(model, mesh, {"extra": ColwiseParallel()})
    assert not isinstance(model.extra.weight, DTensor)
    apply(model)
    tp.parallelize_module(model, mesh, {"extra": ColwiseParallel()})
    assert isinstance(model.extra.weight, DTensor)


def test_audit_reads_placements(group: None) -> None:
    model = Blocks(1, 16, 32)
    annotate(model, {nn.Linear: "comm=fp32"})
    apply(model, default="bf16-mixed")
    tp.parallelize_module(model, init_device_mesh("cpu", (1,)), mlp_plan(1))
    x = torch.randn(4, 16, requires_grad=True)
    with audit(model) as report:
        model(x).float().sum().backward()
    assert report.divergences == []
    down, up = report["blocks.0.down"], report["blocks.0.up"]
    assert down.placements == {"weight": "S(1)", "bias": "R"}
    assert up.placements == {"weight": "S(0)", "bias": "S(0)"}
    # one rank reduces nothing: the 2-rank test sees the reductions (reduce:fp32)
    assert tp.reduced_in(model) == {"blocks.0.up": fp32, "blocks.0.down": fp32}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: the GEMM's fp32 output")
def test_wide_mm_on_cuda_is_the_fp32_output_of_the_bf16_gemm() -> None:
    a = torch.randn(64, 128, device="cuda", dtype=bf16)
    b = torch.randn(128, 32, device="cuda", dtype=bf16)
    out = wide_mm(a, b, fp32)
    assert out.dtype == fp32
    torch.testing.assert_close(out, a.double().mm(b.double()).float(), rtol=1e-5, atol=1e-4)


# -- on gloo ranks -------------------------------------------------------------------------------

def test_tp2_with_comm_fp32_equals_one_rank(tmp_path: Path) -> None:
    """The one multi-rank test of the fast suite: 4 residual bf16 MLP blocks on 2 ranks.
    With bf16 reductions (torch's styles) TP=2 differs from one rank; with comm=fp32 its
    output and gradients equal one rank's, and audit sees every reduction in fp32."""
    rank = run_ranks("gaps", tmp_path, 2, "4", "32", "64", "0")[0]
    bf16_gap, fp32_gap = rank["bf16"], rank["fp32"]
    assert bf16_gap[0] > 1e-3 and bf16_gap[1] > 1e-3
    assert fp32_gap[0] <= bf16_gap[0] / 20 and fp32_gap[1] <= bf16_gap[1] / 5
    audited = rank["fp32_audit"]
    assert audited["divergences"] == []
    assert audited["down_reduced"] == ["fp32"] and audited["up_reduced"] == ["fp32"]
    assert audited["placements"] == {"weight": "S(1)", "bias": "R"}
    assert rank["bf16_audit"]["down_reduced"] == ["bf16"]
    assert rank["fp32_bytes"] == 2 * rank["bf16_bytes"]
    # sequence parallel: the row-parallel bias's gradient is a partial sum on each rank,
    # reduced in fp32 before its one rounding to bf16 (rounded per rank first: 2.5e-3 off)
    ours, torchs = rank["sequence"]["ours"], rank["sequence"]["torch"]
    assert ours["out"] == 0.0 and max(ours.values()) < 1e-6, ours
    assert torchs["out"] > 1e-3 and torchs["blocks.0.down.bias"] > 1e-3, torchs
    # the gather of a gathered fp32 island's output is not an op autocast could change
    assert rank["sequence"]["gathered_divergences"] == []


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_tp_gaps_on_12_blocks(tmp_path: Path, ranks: int) -> None:
    """The measurement in docs/backends/tp.md: 12 residual bf16 MLP blocks, 10 seeds, TP=N
    against one rank. With comm=fp32 most seeds give one rank's output and gradients exactly;
    the others differ by a rounding flip, no more than one rank differs from itself when its
    GEMMs sum in another order; on average 20x below bf16's gap (the output's), 10x (the
    gradients')."""
    rank = run_ranks("gaps", tmp_path, ranks, "12", "64", "256", "0", "10")[0]
    seeds = rank["seeds"]  # bf16 out, bf16 grads, fp32 out, fp32 grads, self out, self grads

    def mean(i: int) -> float:
        return sum(s[i] for s in seeds) / len(seeds)

    assert mean(2) <= mean(0) / 20 and mean(3) <= mean(1) / 10
    assert sum(s[2] == 0 for s in seeds) >= 7 and sum(s[3] == 0 for s in seeds) >= 6
    assert max(s[3] for s in seeds) <= 2 * max(s[5] for s in seeds)
    assert min(s[1] for s in seeds) > 5e-3  # bf16 reductions: every seed
    assert rank["fp32_audit"]["divergences"] == []


@pytest.mark.slow
def test_fp8_tp_equals_torchaos_styles_by_hand_bit_for_bit(tmp_path: Path) -> None:
    pytest.importorskip("torchao")
    for rank in run_ranks("fp8", tmp_path, 2):
        assert rank["styles"] == {"up": "Float8ColwiseParallel", "down": "Float8RowwiseParallel",
                                  "router": "PlannedColwiseParallel"}
        assert len(rank["warnings"]) == 1 and "'router'" in rank["warnings"][0]
        assert rank["equal_out"] and all(rank["equal_grads"].values()), rank["equal_grads"]
        assert rank["fp8_gemms"]["up"] == {"forward": 1, "backward": 2}
        assert rank["fp8_gemms"]["router"] == {}
        assert rank["divergences"] == []


@pytest.mark.slow
def test_fsdp2_and_tp_on_a_2x2_mesh(tmp_path: Path) -> None:
    """4 ranks, dp x tp = 2 x 2, sequence-parallel LayerNorms: before torch 2.15 torch's
    styles all-reduce the replicated norms' gradients in bf16 (FSDP2's reduce_dtype misses
    them, PyTorch issue 190626); here each in its planned comm (block 0's fp32, block 1's
    bf16). From 2.15 FSDP2 does that itself, and `fully_shard` leaves it to FSDP2. The ranks
    agree, and they equal the same steps in one process."""
    from precision_annot._src import seams

    ranks = run_ranks("fsdp", tmp_path, 4)
    first = ranks[0]
    planned = [["all_reduce", "bf16"], ["all_reduce", "fp32"]]
    assert first["torch"] == (planned if seams.FSDP2_TP_REDUCE_DTYPE else [["all_reduce", "bf16"]])
    assert first["ours"] == planned
    # the hooks reducing the norms' and the row-parallel biases' partial gradients in comm:
    # from torch 2.15 left to FSDP2, which reduces them in its units' reduce dtypes
    native = ", native" if seams.FSDP2_TP_REDUCE_DTYPE else ""
    assert set(first["hooks"]) == {f"ReplicatedGrads(comm=torch.bfloat16{native})",
                                   f"ReplicatedGrads(comm=torch.float32{native})"}
    assert all(r["params"] == first["params"] for r in ranks)
    assert first["losses"][-1] < first["losses"][0]
    ref = first["reference"]
    worst = max(abs(a - b) for n in ref for a, b in zip(ref[n], first["params"][n], strict=True))
    assert worst < 5e-4, worst


@pytest.mark.slow
def test_check_tp_findings_against_real_runs(tmp_path: Path) -> None:
    """Each tp finding, and what a real run on 4 ranks does."""
    pytest.importorskip("torchao")
    rank = run_ranks("checks", tmp_path, 4)[0]
    # tp-fp8-shard: mxfp8 with 16 features a rank fails; with 32 it runs
    assert rank["mx64"]["findings"] == [["error", "tp-fp8-shard", "blocks.0.up"]]
    assert rank["mx64"]["ran"].startswith("RuntimeError")
    assert rank["mx128"] == {"findings": [], "ran": "ok"}
    # tp-fp8-style-not-fp8: torchao's style refuses the router; ours runs it in fp32
    assert rank["router_findings"] == [["warning", "tp-fp8-style-not-fp8", "router"]]
    assert "Expecting module to be Float8Linear" in rank["router_torch"]
    assert rank["router_ours"][0] == "TPLinear" and len(rank["router_ours"][1]) == 1
    # tp-comm-wire-only: the fp8 row-parallel layer's sums ran in bf16, as said
    assert rank["wire_findings"] == [["warning", "tp-comm-wire-only", "blocks.0.up"]]
    assert rank["wire_ran"] == ["bf16"]
    assert rank["wire_divergences"] == ["blocks.0.down: comm planned fp32, ran bf16 (forward)"]
    assert rank["embed_findings"] == [["info", "tp-comm-wire-only", "embed"]]
    assert rank["embed_equal"] is True
    # tp-plan-unmatched: torch skips the key with a warning, the module stays whole
    assert rank["unmatched_findings"] == [["warning", "tp-plan-unmatched", ""]]
    assert rank["unmatched_torch"][0] is False and "could not be resolved" in \
        rank["unmatched_torch"][1][0]


def test_warnings_are_one_per_kind(group: None) -> None:
    pytest.importorskip("torchao")
    model = Blocks(2, 16, 32)
    annotate(model, {nn.Linear: "compute=fp8"})
    apply(model, default="bf16-mixed")  # comm=fp32: the fp8 layers' sums come out in bf16
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tp.parallelize_module(model, init_device_mesh("cpu", (1,)), mlp_plan(2))
    texts = [str(w.message) for w in caught if "parallelize_module" in str(w.message)]
    assert len(texts) == 1 and "'blocks.0.up'" in texts[0]
    assert "The same holds for 'blocks.0.down', 'blocks.1.up' and 'blocks.1.down'" in texts[0]


@pytest.mark.slow
def test_users_loops_on_2_ranks(tmp_path: Path) -> None:
    """A Hugging Face Llama (transformers' islands kept): with comm=fp32 TP=2 gives one rank's
    logits and gradients; a sequence-parallel LayerNorm's gradient is reduced in fp32;
    torch.compile(fullgraph=True), activation checkpointing, a forward without gradients and
    a DCP round trip give what eager gives."""
    pytest.importorskip("transformers")
    rank = run_ranks("loops", tmp_path, 2)[0]
    llama = rank["llama"]
    assert llama["bf16"]["logits"] > 1e-3 and llama["bf16"]["grads"] > 1e-3
    assert llama["fp32"]["logits"] == 0.0 and llama["fp32"]["grads"] < 1e-6
    assert llama["fp32"]["divergences"] == [] and llama["bf16"]["divergences"] == []
    assert rank["compiled"] and rank["checkpointed"] and rank["no_grad"] and rank["dcp"]
    assert rank["dcp_dtypes"] == ["fp32"]
    # inductor skips a bf16 rounding a fused kernel reads, unless told to emulate it: then the
    # compiled sequence-parallel run is eager's (docs/backends/tp.md)
    skipped, emulated = rank["inductor"]["False"], rank["inductor"]["True"]
    assert skipped[0] > 1e-4, skipped
    assert emulated[0] == 0.0 and emulated[1] < 1e-6, emulated
    # TP alone: a bf16 LayerNorm's partial gradient reduced in its comm (fp32) as it arrives
    assert rank["replicated"] == {"reduced": [["all_reduce", "fp32"]], "grad": ["bf16", "R"],
                                  "agree": True}
