"""FSDP2 and FSDP1: units, dtype checks, keep_dtype and errors in one process (world size 1,
gloo), and real training on 2 gloo ranks."""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from precision_annot import (
    Policy,
    PrecisionPlan,
    annotate,
    applied_plan,
    apply,
    bf16,
    check,
    fp16,
    fp32,
    precision,
    resolve,
)
from precision_annot._src import seams
from precision_annot._src.dtypes import dtype_name
from precision_annot._src.tables import human_bytes
from precision_annot.adapters import fsdp
from tests.adapters.distributed import check_training, run_ranks
from tests.helpers import Recorder, launch
from tests.workers.dist import MERGE_BELOW
from tests.workers.models import POLICY, Net


def test_units_at_boundaries_storage_changes_and_selection() -> None:
    model = nn.Sequential(
        nn.Sequential(nn.Linear(2, 2), precision(storage=bf16)(nn.Linear(2, 2))),
        precision(fp32)(nn.LayerNorm(2)),
        nn.Linear(2, 2),
    )
    plan = resolve(model, default=Policy(compute=bf16, storage=fp32))
    assert fsdp.unit_names(plan) == ["0.1", "1", ""]
    assert fsdp.unit_names(plan, model, units=["2"]) == ["0.1", "1", "2", ""]
    assert fsdp.unit_names(plan, model, units=[nn.Sequential]) == ["0.1", "0", "1", ""]
    with pytest.raises(ValueError, match="matches no module"):
        fsdp.unit_names(plan, model, units=["nope"])


def test_mixed_dtypes_in_one_unit_name_the_modules(group: None) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).to(fp16))  # storage unset
    with pytest.raises(ValueError, match=r"\(root\).*fp32: \['0'\].*fp16: \['1'\]"):
        fsdp.fully_shard(model)


def test_fully_shard_keeps_an_fp32_rotary_table(group: None) -> None:
    seen: list[tuple[torch.dtype, torch.dtype]] = []

    class Rope(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
            seen.append((x.dtype, freqs.dtype))
            out: torch.Tensor = self.lin(x) * freqs.cos().to(x.dtype)
            return out

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = precision("bf16-mixed", keep_dtype=("freqs",))(Rope())
            self.head = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.head(self.block(x, freqs=torch.randn(4)))
            return out

    model = Model()
    fsdp.fully_shard(model, resolve(model, default="fp32"))
    model(torch.randn(2, 4)).sum().backward()
    assert seen == [(bf16, fp32)]


def test_bad_input(group: None) -> None:
    with pytest.raises(ValueError, match="mp_policy comes from the plan"):
        fsdp.fully_shard(nn.Linear(2, 2), mp_policy=object())
    with pytest.raises(TypeError, match="PrecisionPlan"):
        fsdp.mixed_precision("bf16")  # type: ignore[arg-type]


def _fsdp1_units(model: nn.Module, policy: Any) -> list[str]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    wrapped = FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"))
    return sorted(fsdp.plan_name(n) for n, m in wrapped.named_modules()
                  if isinstance(m, FSDP) and n)


def test_wrap_policy_matches_units_by_name_on_a_copy_or_a_loaded_plan(group: None) -> None:
    """0.1 matched modules by identity: on a copy it picked no unit, so FSDP1 wrapped only the
    root and the fp32 island crashed."""
    import copy

    from precision_annot import PrecisionPlan, apply

    model = nn.Sequential(nn.Linear(4, 4), precision(fp32)(nn.LayerNorm(4)), nn.Linear(4, 4))
    plan = resolve(model, default=Policy(compute=bf16, storage=fp32))
    twin = copy.deepcopy(model)
    loaded = PrecisionPlan.from_json(plan.to_json())
    for target, policy_plan in ((twin, plan), (copy.deepcopy(model), loaded)):
        apply(target, policy_plan)
        assert _fsdp1_units(target, fsdp.wrap_policy(policy_plan)) == ["1"]
    with pytest.raises(ValueError, match=r"does not match the model.*no module named '1'"):
        _fsdp1_units(nn.Sequential(nn.Linear(4, 4)), fsdp.wrap_policy(plan))


def recorded(calls: list[list[Any]], ops: tuple[str, ...]) -> Counter[tuple[str, str]]:
    return Counter((op, dtype) for op, dtype, _ in calls if op in ops)


def predicted(cost: fsdp.CollectiveCost, gather: str, steps: int) -> Counter[tuple[str, str]]:
    """The collectives `collective_cost` says `steps` steps issue, by kind and dtype (a unit
    keeping some parameters in their own dtype gathers its bytes, as uint8)."""
    out: Counter[tuple[str, str]] = Counter()
    for c in cost.units:
        (stored,) = c.unit.storage
        moved = "uint8" if c.unit.kept else dtype_name(c.unit.param_dtype or stored)
        out[gather, moved] += c.gathers * steps
        out["reduce_scatter_single", dtype_name(c.unit.reduce_dtype or stored)] += steps
    return out


@pytest.mark.slow  # over make test's budget (6 s a torch): FSDP2's islands-in-units run stays
@pytest.mark.parametrize("mode", ["fsdp1", "fsdp2"])  # FSDP1 also runs in the check matrix
def test_two_ranks_train_with_planned_dtypes(mode: str, tmp_path: Path) -> None:
    ranks = run_ranks(mode, tmp_path)
    check_training(ranks, "reduce_scatter_single")
    if mode == "fsdp2":  # FSDP2 alone fails where the adapter trains
        assert "same dtype" in ranks[0]["plain_fsdp2_error"]
    # the cost model's count is the count recorded: per step, the root (bf16) gathers once,
    # the fp32 norm unit twice, and each reduce-scatters once
    gather = "all_gather" if mode == "fsdp1" else "all_gather_single"  # FSDP1 on CPU: a list
    cost = fsdp.collective_cost(resolve(Net(), default=POLICY))
    assert (cost.gathers, cost.reduce_scatters) == (3, 2)
    for r in ranks:
        assert recorded(r["collectives"], (gather, "reduce_scatter_single")) == predicted(
            cost, gather, 5) == Counter({(gather, "fp32"): 10, (gather, "bf16"): 5,
                                         ("reduce_scatter_single", "fp32"): 5,
                                         ("reduce_scatter_single", "bf16"): 5})
    if mode == "fsdp1":
        return
    # merge_below: the island shares the root's unit, 2 collectives a step instead of 5, the
    # unit reduced in fp32 and gathered in fp32 (before torch 2.15), or from 2.15 with the
    # island's parameters in fp32 and the rest in bf16 (param_dtype_override_fn: FSDP2 then
    # gathers the unit's bytes); the island still computes in fp32, the rest in bf16
    merged_cost = fsdp.collective_cost(resolve(Net(), default=POLICY), merge_below=MERGE_BELOW)
    assert merged_cost.collectives == 2
    moved = "uint8" if seams.FSDP2_KEEPS_PARAM_DTYPE else "fp32"
    for r in ranks:
        m = r["merged"]
        assert recorded(m["collectives"], (gather, "reduce_scatter_single")) == predicted(
            merged_cost, gather, 5) == Counter({(gather, moved): 5,
                                                ("reduce_scatter_single", "fp32"): 5})
        assert m["seen"] == {"fc1": ["bf16"], "norm": ["fp32"], "fc2": ["bf16"]}
        assert m["losses"][-1] < m["losses"][0] * 0.9
    assert ranks[0]["merged"]["params"] == ranks[1]["merged"]["params"]
    ref = ranks[0]["reference"]
    worst = max(abs(a - b) for n in ref for a, b in zip(ref[n], ranks[0]["merged"]["params"][n],
                                                         strict=True))
    assert worst < 5e-3, worst


def small_islands(blocks: int = 5) -> nn.Sequential:
    """Linear(128, 128) blocks, each followed by an fp32 LayerNorm island of 256 parameters
    (0.3% of the model)."""
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(128, 128), precision(fp32)(Recorder(nn.LayerNorm(128)))]
    return nn.Sequential(*layers)


@pytest.mark.skipif(seams.FSDP2_KEEPS_PARAM_DTYPE,
                    reason="from torch 2.15 the islands stay in the unit around them")
def test_check_many_small_units_and_the_merge_that_answers_it() -> None:
    plan = resolve(small_islands(), default="bf16-mixed")
    found = [f for f in fsdp.findings(plan) if f.code == "fsdp-small-units"]
    (small,) = found
    assert small.severity == "info"
    assert small.message.startswith("5 of 6 FSDP units hold less than 1% of the parameters")
    assert "(17 collectives in all)" in small.message  # 5 islands x 3, the root 1 + 1
    # the trade, by hand: the root (82,560 parameters) was gathered in bf16 and reduced in
    # fp32, each island gathered twice and reduced in fp32; merged, one unit does both in fp32
    before = 82560 * 2 + 82560 * 4 + 5 * (2 * 256 * 4 + 256 * 4)
    after = 83840 * 4 * 2
    merged = fsdp.collective_cost(plan, merge_below=0.01)
    assert (fsdp.collective_cost(plan).bytes, merged.bytes) == (before, after)
    assert "merge_below=0.01) makes 15 fewer collectives per step" in small.fix
    assert f"moves {human_bytes(after - before)} more" in small.fix
    assert fsdp.unit_names(plan, merge_below=0.01) == [""]
    assert fsdp.findings(plan, merge_below=0.01) == []  # merged, nothing left to say
    assert fsdp.findings(resolve(small_islands(3), default="bf16-mixed")) == []  # 3 units only
    # the estimate is the stated model: latency + bytes / bandwidth per collective
    cost = fsdp.collective_cost(plan, latency_s=1.0, bandwidth=float("inf"))
    assert cost.seconds == 17.0


def test_merged_units_keep_each_module_computing_as_planned(group: None) -> None:
    model = small_islands(2)
    plan = resolve(model, default="bf16-mixed")
    fsdp.fully_shard(model, plan, merge_below=0.01)
    from torch.distributed.fsdp import FSDPModule

    assert [n for n, m in model.named_modules() if isinstance(m, FSDPModule)] == [""]
    model(torch.randn(2, 128)).sum().backward()
    assert model[1].seen == [fp32] and model[3].seen == [fp32]
    assert all(p.grad is not None for p in model.parameters())
    twin = small_islands(2)
    apply(twin, plan)
    assert _fsdp1_units(twin, fsdp.wrap_policy(plan, merge_below=0.01)) == []
    assert _fsdp1_units(small_islands(2), fsdp.wrap_policy(plan)) == ["1", "3"]


def test_check_a_unit_holding_several_dtypes() -> None:
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).to(fp16))  # storage not planned
    (found,) = fsdp.findings(resolve(mixed))
    assert (found.severity, found.code, found.module) == ("error", "fsdp-mixed-unit", "")
    assert "fp32: ['0']; fp16: ['1']" in found.message
    planned = nn.Sequential(nn.Linear(2, 2), precision(storage=fp16)(nn.Linear(2, 2)))
    assert fsdp.findings(resolve(planned)) == []  # a storage change makes its own unit


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(128, 128)
        self.norm = precision(fp32)(nn.LayerNorm(128))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.norm(self.fc(x))
        return out


@pytest.mark.skipif(seams.FSDP2_KEEPS_PARAM_DTYPE,
                    reason="from torch 2.15 the islands stay in their blocks' units")
def test_check_counts_the_units_selected_as_fully_shard_would() -> None:
    from precision_annot import check

    model = nn.Sequential(*[Block() for _ in range(5)])
    apply(model, resolve(model, default="bf16-mixed"))
    (small,) = check(model, "fsdp", {"units": [Block]})
    # 5 blocks and 5 islands hold parameters; the islands merge into their blocks
    assert small.message.startswith("5 of 10 FSDP units") and "(30 collectives" in small.message
    assert "15 fewer collectives" in small.fix and small.fix.startswith("Let small islands")
    assert check(model, "fsdp", {"units": [Block], "merge_below": 0.01}) == []
    # a plan resolved from the model finds the units in it; one loaded from JSON cannot
    resolved = resolve(model, default="bf16-mixed")
    assert check(resolved, "fsdp", {"units": [Block]}) == [small]
    with pytest.raises(ValueError, match="'units' selects modules, so it needs the model, and "
                       "this plan holds none"):
        check(PrecisionPlan.from_json(resolved.to_json()), "fsdp", {"units": [Block]})
    # when bytes cost more than the latency saved, the fix says to keep the units
    (slow,) = check(model, "fsdp", {"units": [Block], "bandwidth": 1e6})
    assert slow.fix.startswith("Keep them:") and "slower at these constants" in slow.fix


def test_merge_below_never_makes_a_unit_of_two_dtypes() -> None:
    model = nn.Sequential(nn.Linear(64, 64), precision(storage=bf16)(nn.Linear(2, 2)),
                          precision(fp32)(nn.LayerNorm(2)))
    plan = resolve(model, default="bf16-mixed")
    assert fsdp.unit_names(plan) == ["1", "2", ""]
    # the LayerNorm (fp32, 4 parameters) joins the root; the bf16 Linear cannot
    assert fsdp.unit_names(plan, merge_below=0.5) == ["1", ""]
    assert fsdp.findings(plan, merge_below=0.5) == []
    with pytest.raises(ValueError, match=r"merge_below is a share of the parameters, between 0 "
                                         r"and 1. Received: merge_below=1.5"):
        fsdp.unit_names(plan, merge_below=1.5)


def test_fully_shard_keeps_the_plan_applied_to_the_model(group: None) -> None:
    """0.2 resolved the bare annotations again and turned the applied model back to fp32."""
    from precision_annot import audit

    model = nn.Sequential(nn.Linear(4, 4), precision(fp32)(nn.LayerNorm(4)), nn.Linear(4, 2))
    apply(model, default="bf16-mixed")
    fsdp.fully_shard(model)
    with audit(model) as report:
        model(torch.randn(2, 4)).float().sum().backward()
    assert set(report["0"].forward_ops) == {bf16} and set(report["1"].forward_ops) == {fp32}
    assert report.divergences == []


def test_a_model_sharded_with_its_own_policy_is_checked_as_sharded(group: None) -> None:
    """0.3 checked the units fully_shard would make, not the ones the user made: an fp32 island
    under the user's MixedPrecisionPolicy(param_dtype=bf16) raised a DriftError at its first
    forward while check gave an info. The real 2-rank run is the check matrix's
    fsdp2-user-mp-policy-over-islands."""
    from tests.workers.scenarios import BY_NAME, shard

    scenario = BY_NAME["fsdp2-user-mp-policy-over-islands"]
    model, plan = scenario.build()
    sharded = shard(scenario, model, plan)
    found = {f.code: f for f in check(sharded, "fsdp")}
    assert found["fsdp-param-dtype"].severity == "error"
    assert found["fsdp-param-dtype"].modules == ("norm",)
    with pytest.raises(RuntimeError, match=r"Module 'norm'.*FSDP2 gathers the parameters of "
                                           r"each unit in its MixedPrecisionPolicy's param_dtype"):
        sharded(torch.randn(2, 16))


@pytest.mark.slow  # over make test's budget: run by make test-all
def test_two_ranks_load_a_bf16_checkpoint_into_the_sharded_fp32_router_and_resume_exactly(
        tmp_path: Path) -> None:
    """FSDP2 on 2 gloo ranks, a bf16 model whose router is an fp32 island, sharded along its
    plan. A bf16 checkpoint (the router saved in bf16) loaded through DCP, into the sharded
    state dict or whole with set_model_state_dict(full_state_dict=True): the router's shards
    stay fp32, holding the saved values, and the load names the router's tensors (0.4: silent);
    check names the same two before the load. Model and optimizer saved after 2 steps and
    loaded into a fresh sharded model: the next 2 steps equal the uninterrupted run's."""
    launch("tests.workers.checkpoints", str(tmp_path), ranks=2, timeout=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    reference = ranks[0]["reference"]
    planned = {"up.weight": "bf16", "up.bias": "bf16", "router.weight": "fp32",
               "router.bias": "fp32", "down.weight": "bf16", "down.bias": "bf16"}
    for mode in ("sharded", "full", "broadcast"):
        for name, dtype in planned.items():
            assert {r[mode]["params"][name]["dtype"] for r in ranks} == {dtype}, (mode, name)
            whole = [row for r in ranks for row in r[mode]["params"][name]["values"]]
            assert whole == reference[name], (mode, name)  # shards along dim 0, in rank order
    said = [w for r in ranks for mode in ("sharded", "full") for w in r[mode]["warnings"]]
    assert said and all("'model.router.weight', 'model.router.bias'" in w
                        or "'router.weight', 'router.bias'" in w for w in said)
    assert ranks[0]["sharded"]["warnings"] and not ranks[1]["sharded"]["warnings"]  # once
    # broadcast_from_rank0: torch casts into the planned shards before load_state_dict runs,
    # so the load cannot see what was narrowed (docs/checkpoints.md says so; check does)
    assert [r["broadcast"]["warnings"] for r in ranks] == [[], []]
    assert ranks[0]["check"] == [["error", "checkpoint-narrowed", "router"]] * 2
    for r in ranks:
        resumed, uninterrupted = r["resume"]["resumed"], r["resume"]["uninterrupted"]
        assert resumed == uninterrupted
        assert {n: p["dtype"] for n, p in resumed.items()} == planned
        assert r["resume"]["moments"] == planned  # torch's AdamW: moments in each shard's dtype


def test_fully_shard_refuses_units_given_as_one_string_or_a_number() -> None:
    from precision_annot.adapters.fsdp import unit_names

    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    plan = resolve(model)
    for bad in ("0", 3):
        with pytest.raises(TypeError, match=r"fully_shard: units is a list of selectors.*"
                                            rf"Received: units={bad!r}"):
            unit_names(plan, model, bad)  # type: ignore[arg-type]
    assert "0" in unit_names(plan, model, ["0"])


def test_fp32_islands_join_the_unit_around_them_where_fsdp2_keeps_their_dtype() -> None:
    """From torch 2.15 an island computing in its storage dtype (an fp32 LayerNorm in a
    bf16-mixed model) is no unit of its own: FSDP2 gathers its parameters in fp32 inside the
    unit around it (`param_dtype_override_fn`), 3 collectives a step fewer per island; FSDP1,
    which has no such switch, keeps a unit per island. What `check` says follows."""
    plan = resolve(small_islands(), default="bf16-mixed")
    separate = fsdp.collective_cost(plan, keep_dtype_in_unit=False)
    kept = fsdp.collective_cost(plan, keep_dtype_in_unit=True)
    assert (separate.collectives, kept.collectives) == (17, 2)
    (unit,) = [c.unit for c in kept.units]
    assert unit.param_dtype == bf16 and unit.kept == tuple(f"{i}.inner" for i in (1, 3, 5, 7, 9))
    # bytes: the Linears gathered in bf16 and the norms in fp32, once (the root), everything
    # reduced in fp32 (the preset's comm)
    assert kept.bytes == 5 * 16512 * 2 + 5 * 256 * 4 + 83840 * 4
    assert fsdp.unit_names(plan, keep_dtype_in_unit=True) == [""]
    assert fsdp.unit_names(plan) == ["1", "3", "5", "7", "9", ""]  # FSDP1's, and before 2.15
    small = [f for f in fsdp.findings(plan) if f.code == "fsdp-small-units"]
    assert bool(small) is not seams.FSDP2_KEEPS_PARAM_DTYPE
    assert [f.code for f in fsdp.findings(plan, "fsdp1")] == ["fsdp-small-units"]
    # an island reduced in another dtype than its unit cannot join it (one reduce dtype a unit)
    wide = resolve(small_islands(), default="bf16-mixed,comm=bf16")
    assert fsdp.unit_names(wide, keep_dtype_in_unit=True) == ["1", "3", "5", "7", "9", ""]


def test_llama_norm_islands_cost_fewer_collectives_where_fsdp2_keeps_their_dtype() -> None:
    """A Llama from a small config, bf16-mixed with its RMS norms fp32, sharded a
    unit per decoder layer: before torch 2.15 each norm (2 a layer, 1 final) is a unit of its own (3
    collectives a step each); from 2.15 they stay in their layers' units."""
    pytest.importorskip("transformers")
    from tests.adapters.hf_models import build

    torch.manual_seed(0)
    model, _ = build("llama")
    layers = len(model.model.layers)
    from precision_annot import annotate

    annotate(model, {"*norm": "fp32"})
    plan = resolve(model, default="bf16-mixed")
    layer_type = type(model.model.layers[0])
    names = {keep: fsdp.unit_names(plan, model, [layer_type], keep_dtype_in_unit=keep)
             for keep in (False, True)}
    separate = fsdp.collective_cost(plan, names[False], keep_dtype_in_unit=False)
    kept = fsdp.collective_cost(plan, names[True], keep_dtype_in_unit=True)
    norms = 2 * layers + 1
    assert len(names[False]) - len(names[True]) == norms
    assert separate.collectives - kept.collectives == 3 * norms
    assert all(c.unit.kept for c in kept.units if c.unit.name.startswith("model.layers."))


def test_two_ranks_keep_fp32_islands_in_their_blocks_units_as_separate_units_compute(
        tmp_path: Path) -> None:
    """2 gloo ranks, a bf16-mixed model of 3 blocks each ending in an fp32 LayerNorm island,
    3 SGD steps, a unit per block. From torch 2.15 `fully_shard` keeps each island in its
    block's unit (gathered in fp32 through `param_dtype_override_fn`): 9 collectives a step
    fewer than with each island a unit of its own, and the trained parameters equal bit for
    bit. Before 2.15 both layouts are the separate one."""
    launch("tests.workers.islands", str(tmp_path), ranks=2, timeout=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    from tests.workers.islands import BLOCKS, STEPS

    ops = ("all_gather_single", "reduce_scatter_single")
    for r in ranks:
        native, separate = r["native"], r["separate"]
        assert native["params"] == separate["params"]  # bit for bit
        for run in (native, separate):
            assert run["seen"] == [["fp32", "fp32"]]  # the islands: fp32 inputs and weights
        # a block unit: 2 gathers and a reduce-scatter a step; the root (the last Linear): 1+1
        blocks = Counter({("all_gather_single", "bf16"): 2 * BLOCKS * STEPS,
                          ("reduce_scatter_single", "fp32"): BLOCKS * STEPS})
        root = Counter({("all_gather_single", "bf16"): STEPS,
                        ("reduce_scatter_single", "fp32"): STEPS})
        islands = Counter({("all_gather_single", "fp32"): 2 * BLOCKS * STEPS,
                           ("reduce_scatter_single", "fp32"): BLOCKS * STEPS})
        assert recorded(separate["collectives"], ops) == blocks + root + islands
        if seams.FSDP2_KEEPS_PARAM_DTYPE:
            mixed = Counter({("all_gather_single", "uint8"): 2 * BLOCKS * STEPS,
                             ("reduce_scatter_single", "fp32"): BLOCKS * STEPS})
            assert recorded(native["collectives"], ops) == mixed + root
            assert native["kept"] == [str(i) for i in range(BLOCKS)]
            assert len(native["units"]) == BLOCKS + 1
        else:
            assert native["collectives"] == separate["collectives"] and native["kept"] == []


@pytest.mark.skipif(not seams.FSDP2_GRAD_DTYPE, reason="FSDP2 keeps grad_dtype from torch 2.15")
def test_unsynced_micro_batches_are_summed_in_the_reduce_dtype_and_check_says_so(
        group: None) -> None:
    """`bf16-true,grad=fp32` under `fully_shard`, FSDP2's accumulation idiom:
    `set_requires_gradient_sync(False)` on the first 2 of 3 micro-batches. FSDP2 sums the
    unreduced micro-batches in its reduce dtype (the plan's comm, bf16), so the weights equal a
    hand loop summing in bf16, not the fp32 sums `grad=fp32` asks for (on 2 gloo ranks 7.8e-3
    apart after 2 steps). `check(..., "fsdp", {"gradient_sync": False})` warns of it."""
    from tests.workers.grads import mlp

    spec = "bf16-true,grad=fp32"
    plan = resolve(mlp(), default=spec)
    assert "fsdp-unsynced-sums" not in [f.code for f in check(plan, "fsdp")]
    (warned,) = [f for f in check(plan, "fsdp", {"gradient_sync": False})
                 if f.code == "fsdp-unsynced-sums"]
    assert warned.severity == "warning" and "sums the micro-batches it does not reduce in " \
        "bf16, not fp32" in warned.message
    assert not [f for f in check(resolve(mlp(), default=spec + ",comm=fp32"), "fsdp",
                                 {"gradient_sync": False}) if f.code == "fsdp-unsynced-sums"]
    with pytest.raises(TypeError, match="'gradient_sync' says whether every micro-batch"):
        check(plan, "fsdp", {"gradient_sync": "no"})
    model = fsdp.fully_shard(apply(mlp(), default=spec))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    hand = mlp().to(bf16)
    for step in range(2):
        model.zero_grad()
        sums: dict[str, torch.Tensor] = {}
        for micro in range(3):
            model.set_requires_gradient_sync(micro == 2)
            tokens = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(
                100 + 10 * step + micro))
            nn.functional.cross_entropy(model(tokens).float(), tokens).backward()
            hand.zero_grad()
            nn.functional.cross_entropy(hand(tokens).float(), tokens).backward()
            for n, p in hand.named_parameters():
                assert p.grad is not None
                # the unsynced ones summed in bf16, then the synced one added into fp32
                sums[n] = p.grad if n not in sums else sums[n] + p.grad
            if micro == 2:
                sums = {n: v.float() for n, v in sums.items()}
        opt.step()
        with torch.no_grad():
            for n, p in hand.named_parameters():
                p.add_(sums[n], alpha=-0.5)
    for n, p in model.named_parameters():
        assert torch.equal(p.full_tensor().detach(), hand.get_parameter(n).detach()), n


# -- torch 2.15's islands inside a unit, and check on models sharded otherwise ------------------

needs_215 = pytest.mark.skipif(not seams.FSDP2_KEEPS_PARAM_DTYPE,
                               reason="param_dtype_override_fn and grad_dtype: torch 2.15")


class _Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.norm(torch.relu(self.proj(x)))
        return out


def _tied_islands() -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(_Block(), _Block(), nn.Linear(16, 4))
    net[1].norm.weight = net[0].norm.weight  # two fp32 islands sharing one weight
    annotate(net, {"0.norm": "fp32", "1.norm": "fp32"})
    return net


@needs_215
def test_tied_fp32_islands_stay_in_the_unit_around_them(group: None) -> None:
    """Two fp32 LayerNorm islands of a bf16-mixed model sharing a weight: torch 2.15's own
    fully_shard(root, MixedPrecisionPolicy(param_dtype=bf16, param_dtype_override_fn keeping
    both norms' parameters)) shards them in one unit and trains bit for bit as the hand loop
    (/tmp/breaker40/fsdp_islands.py tied_hand, 2 gloo ranks); adapters.fsdp.fully_shard makes
    each island a unit of its own and FSDP2 refuses ("Parameter '1.norm.weight' is shared with
    a parameter already managed by another FSDP group"); check's fix, units=[''], refuses the
    same."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from precision_annot.adapters import fsdp

    by_hand = apply(_tied_islands(), default="bf16-mixed")
    kept = {id(p) for block in by_hand[:2] for p in block.norm.parameters()}
    fully_shard(by_hand, mp_policy=MixedPrecisionPolicy(
        param_dtype=bf16, reduce_dtype=torch.float32, cast_forward_inputs=False,
        param_dtype_override_fn=lambda p: p.dtype if id(p) in kept else None))
    by_hand(torch.randn(4, 16)).float().sum().backward()  # torch can

    net = _tied_islands()
    fsdp.fully_shard(net, resolve(net, default="bf16-mixed"))
    net(torch.randn(4, 16)).float().sum().backward()  # FSDP2's lazy init raises ValueError
    plan = resolve(_tied_islands(), default="bf16-mixed")
    fix = [f.fix for f in check(plan, "fsdp") if f.code == "fsdp-tied-units"]
    assert fix == [], fix  # "Put their modules in one unit: fully_shard(model, units=[''])..."


@needs_215
def test_check_of_a_user_sharded_model_says_what_its_override_gathered(group: None) -> None:
    """torch 2.15's override_fn sees only the parameter, so "keep norms in fp32" is written
    `p.ndim == 1` and catches the Linear biases too. Each Linear then runs with a bf16 weight
    and an fp32 bias under bf16 autocast (it computes in bf16, recorded); check says "FSDP2
    computes '0', '2' and '4' (612 parameters) in another dtype than the plan (planned bf16,
    fp32 instead)": 576 of those are bf16 weights, and nothing computes in fp32 there."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    class Lin(nn.Linear):
        seen: set[tuple[torch.dtype, torch.dtype]]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = super().forward(x)
            self.seen.add((self.weight.dtype, out.dtype))
            return out

    torch.manual_seed(0)
    net = nn.Sequential(Lin(16, 16), nn.LayerNorm(16), Lin(16, 16), nn.LayerNorm(16), Lin(16, 4))
    for m in (net[0], net[2], net[4]):
        m.seen = set()
    annotate(net, {"1": "fp32", "3": "fp32"})
    apply(net, default="bf16-mixed")
    fully_shard(net, mp_policy=MixedPrecisionPolicy(
        param_dtype=bf16, reduce_dtype=torch.float32, cast_forward_inputs=False,
        param_dtype_override_fn=lambda p: p.dtype if p.ndim == 1 else None))
    net(torch.randn(4, 16)).float().sum().backward()
    assert {d for m in (net[0], net[2], net[4]) for d in m.seen} == {(bf16, bf16)}  # ran in bf16
    said = [f.message for f in check(net, "fsdp") if f.code == "fsdp-param-dtype"]
    assert said == [], said


def test_check_of_a_sharded_model_under_fsdps_checkpoint_wrapper_reads_its_islands(
        group: None) -> None:
    """Blocks wrapped by FSDP's apply_activation_checkpointing (non-reentrant), then
    adapters.fsdp.fully_shard: the islands are gathered in fp32 (recorded) and 2-rank training
    equals the hand loop bit for bit (/tmp/breaker40/fsdp_islands.py ckpt), but check says
    "error fsdp-param-dtype: FSDP2 computes '0._checkpoint_wrapped_module.norm', ... (96
    parameters) in another dtype than the plan (planned fp32, bf16 instead)", on torch 2.13
    (separate units; also at 4f4ba85) and 2.15 (kept in the block's unit) alike."""
    import functools

    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as wrapper

    from precision_annot.adapters import fsdp

    torch.manual_seed(0)
    net = nn.Sequential(_Block(), _Block(), _Block(), nn.Linear(16, 4))
    annotate(net, {f"{i}.norm": "fp32" for i in range(3)})
    wrapper.apply_activation_checkpointing(net, checkpoint_wrapper_fn=functools.partial(
        wrapper.checkpoint_wrapper, checkpoint_impl=wrapper.CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, _Block))
    seen: set[torch.dtype] = set()
    for m in net.modules():
        if isinstance(m, nn.LayerNorm):
            m.register_forward_hook(lambda mod, args, out: seen.add(mod.weight.dtype))
    sharded = fsdp.fully_shard(net, resolve(net, default="bf16-mixed"))
    sharded(torch.randn(4, 16)).float().sum().backward()
    assert seen == {torch.float32}  # the islands ran on fp32 weights, as planned
    said = [f.message for f in check(sharded, "fsdp") if f.code == "fsdp-param-dtype"]
    assert said == [], said


class _LookUp(nn.Module):
    """An Embedding feeding a residual stream, as a language model's does."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.norm = nn.LayerNorm(32)
        self.fc = nn.Linear(32, 32)
        self.head = nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.fc(self.norm(h))
        out: torch.Tensor = self.head(h)
        return out


def _one_step(model: nn.Module, ids: torch.Tensor
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor], set[torch.dtype]]:
    """One forward and backward: the output, every full gradient, and the dtypes the
    Embedding handed back."""
    seen: set[torch.dtype] = set()
    hook = model.get_submodule("embed").register_forward_hook(
        lambda m, args, out: seen.add(out.dtype))
    out = model(ids)
    out.float().square().mean().backward()
    hook.remove()
    grads = {n: getattr(p.grad, "full_tensor", lambda g=p.grad: g)()
             for n, p in model.named_parameters()}
    return out.detach(), grads, seen


def test_an_embedding_looks_up_in_its_storage_dtype_under_fsdp2_as_in_one_process(
        group: None) -> None:
    """The plan for an Embedding under "bf16-mixed" is what autocast does with it (and what
    `apply` runs): a lookup computes nothing and autocast does not cast it, so it hands back
    its fp32 rows and the ops after it round them where they compute. FSDP2 gathered it in
    the unit's param_dtype, a bf16 lookup and a bf16 residual stream (on this 1-rank mesh the
    output 1.6e-2 and the gradients 6.4e-3, relative, from one process). Its unit is now
    gathered in fp32: the same numbers as `apply`, bit for bit (2 x 2 FSDP2 + TP:
    test_fsdp2_and_tp_on_a_2x2_mesh). As a unit of its own, only the Embedding is gathered in
    fp32, and its fp32 rows reach the unit gathered in bf16 as in one process (on a CPU a
    LayerNorm gathered in bf16 refuses them: fp32 norm islands, as docs/backends/fsdp.md
    says)."""
    torch.manual_seed(0)
    base = _LookUp()
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    islands = copy.deepcopy(base)
    annotate(islands, {nn.LayerNorm: "fp32"})
    keep = seams.FSDP2_KEEPS_PARAM_DTYPE
    for net, units, gathered in (
            (base, None, [("", None)]),  # gathered as stored
            (islands, [nn.Embedding], [("embed", None), ("", bf16)])):
        want, want_grads, want_dtypes = _one_step(apply(copy.deepcopy(net),
                                                        default="bf16-mixed"), ids)
        sharded = apply(copy.deepcopy(net), default="bf16-mixed")
        plan = applied_plan(sharded)
        assert plan is not None
        cut = fsdp.plan_units(plan, fsdp.unit_names(plan, sharded, units,
                                                    keep_dtype_in_unit=keep),
                              keep_dtype_in_unit=keep)
        assert [(u.name, u.param_dtype) for u in cut if u.name != "norm"] == gathered
        got, got_grads, got_dtypes = _one_step(fsdp.fully_shard(sharded, units=units), ids)
        assert want_dtypes == got_dtypes == {fp32}
        assert torch.equal(got, want)
        for name, grad in want_grads.items():
            assert torch.equal(got_grads[name], grad), name
    # FSDP1 gathers it as stored too (0.5: param_dtype=bf16)
    assert fsdp.mixed_precision(resolve(_LookUp(), default="bf16-mixed")).param_dtype is None
    # bf16-true stores it in bf16: looked up in bf16 both ways, gathered as stored
    plan = resolve(_LookUp(), default="bf16-true")
    assert fsdp.plan_units(plan, [""])[0].param_dtype is None
