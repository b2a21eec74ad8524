"""`check` against what the backends really did: precision and recall at each severity.

Every scenario of tests/workers/scenarios.py is run for real (DDP, FSDP2, FSDP1 and DeepSpeed
on 2 gloo ranks; local numerics and Lightning in one process) by tests/workers/matrix.py, which
records what the backend did. From that record this file works out, without asking `check`,
what happened at each severity:

- error: the run was refused, a dtype was narrowed (on the wire, in storage or in compute),
  a parameter planned in fp32 stopped moving (its updates vanished), or a tie broke;
- warning: it ran, but a dtype was widened, or a numeric loss was measured (gradients flushed
  to zero, updates or running statistics that drifted from an fp32 run);
- info (the claims `narrow-comm` makes): gradients were summed narrower than they are stored.

Then `check` is asked about the same scenario, and each severity is scored: a true positive
where both say it, a false positive where only `check` does, a false negative where only the
run does. Precision and recall must each be at least 95%.

DeepSpeed is also scored on its own (a slow test): its 17 scenarios here and the 20 of
tests/workers/ds_matrix.py (ZeRO-0 masters, configs `to_config` exports, "auto" precision keys,
class lists written by hand, engines started after a torch_autocast engine), whose records add
the dtype of the master weights DeepSpeed's optimizer kept: an update narrower than planned is
an error, a wider one a warning.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

from precision_annot import PrecisionPlan, apply, check
from precision_annot._src.dtypes import dtype_from_name, wider
from precision_annot._src.findings import SEVERITIES
from precision_annot._src.update.rule import update_rule
from precision_annot.adapters import deepspeed as ds_adapter
from tests.helpers import deepspeed_op_built, launch
from tests.workers import ds_matrix
from tests.workers.matrix import register_hook
from tests.workers.scenarios import SCENARIOS, Scenario, build_applied, shard

RANKED = ("error", "warning", "info")


def _by_dtype(pairs: list[tuple[str, int]]) -> Counter[torch.dtype]:
    out: Counter[torch.dtype] = Counter()
    for name, n in pairs:
        out[dtype_from_name(name)] += n
    return out


def _changed(planned: Counter[torch.dtype], seen: Counter[torch.dtype]) -> set[str]:
    """"narrowed" when elements planned at some width reached a narrower (or another equally
    wide) dtype, "widened" when they reached a wider one."""
    out = set()
    ranks = sorted({*planned, *seen}, key=lambda d: torch.finfo(d).bits)
    for threshold in ranks:
        def at_least(counts: Counter[torch.dtype], t: torch.dtype = threshold) -> int:
            return sum(n for d, n in counts.items() if not wider(t, d))

        if at_least(seen) < at_least(planned):
            out.add("narrowed")
        if at_least(seen) > at_least(planned):
            out.add("widened")
    for d in planned:  # the same width, another dtype (fp16 for bf16)
        if seen.get(d, 0) < planned[d] and any(not wider(d, o) and not wider(o, d) and o != d
                                               for o in seen):
            out.add("narrowed")
    return out


def observed(scenario: Scenario, plan: PrecisionPlan, record: dict[str, Any]) -> set[str]:
    """The severities of what the run did, from its record alone."""
    if record["refused"]:
        return {"error"}
    model = plan.module("")
    assert model is not None
    facts: set[str] = set()
    comm: Counter[torch.dtype] = Counter()
    storage: Counter[torch.dtype] = Counter()
    stored: dict[str, torch.dtype] = {}
    updated: Counter[torch.dtype] = Counter()
    counted: set[int] = set()  # a tied tensor once (the recorded storage lists it once)
    for name, entry in plan.items():
        module = plan.module(name)
        assert module is not None
        for pname, p in module.named_parameters(recurse=False):
            if not p.is_floating_point() or id(p) in counted:
                continue
            counted.add(id(p))
            dtype = entry.policy.storage or p.dtype
            storage[dtype] += p.numel()
            stored[f"{name}.{pname}" if name else pname] = dtype
            if p.requires_grad:
                comm[entry.policy.comm or dtype] += p.numel()
                policy = entry.policy
                if any(f is not None for f in (policy.master, policy.grad, policy.optim)):
                    updated[update_rule(policy.master, policy.grad, policy.optim,
                                        dtype).updated] += p.numel()  # a planned update
    if record["wire"]:
        facts |= _changed(comm, _by_dtype([(d, n) for _, d, n in record["wire"]]))
        held = {dtype_from_name(d) for d, _ in record["storage"]} or set(storage)
        if any(wider(s, dtype_from_name(w)) for s in held for _, w, _ in record["wire"]):
            facts.add("summed narrower")  # held wider than it reached the wire
    if record["storage"]:
        facts |= _changed(storage, _by_dtype(record["storage"]))
    masters = (record.get("update") or {}).get("masters")
    if masters is not None and updated:  # the optimizer stepped copies, where one was planned
        facts |= _changed(updated, Counter({dtype_from_name(masters): updated.total()}))
    for name, seen in record["compute"].items():
        planned = plan[name].policy.compute
        if planned is not None:
            facts |= _changed(Counter({planned: 1}), Counter({dtype_from_name(seen): 1}))
    severities = set()
    if "narrowed" in facts or (record["tie"] or 0) > 1e-6:
        severities.add("error")
    for name in record["stalled"]:
        severities.add("error" if not wider(torch.float32, stored[name]) else "warning")
    numeric = record["numeric"]
    if ("widened" in facts or numeric.get("flushed", 0) > 0.01
            or numeric.get("running_stats", 0) > 0.01 or numeric.get("update_error", 0) > 0.1):
        severities.add("warning")
    if "summed narrower" in facts:
        severities.add("info")
    return severities


def predicted(scenario: Scenario, group: Any) -> set[str]:
    """The severities `check` gives the scenario, asked as its user would ask."""
    model, plan = build_applied(scenario)
    target: nn.Module | PrecisionPlan = plan
    config = scenario.check_config() if callable(scenario.check_config) else (
        scenario.check_config)
    if scenario.backend == "ddp":
        apply(model, plan)
        target = nn.parallel.DistributedDataParallel(model)
        register_hook(target, scenario.run.get("hook"), model)
    elif scenario.backend == "deepspeed":
        run = scenario.run
        config = ds_adapter.to_config(plan, run["to_config"]) if "to_config" in run else (
            run["config"])
    elif scenario.wrapped:
        target = shard(scenario, model, plan)  # as the worker shards it, on this 1-rank group
    elif scenario.applied:
        target = model
    found = check(target, scenario.backend, config)
    severities = {f.severity for f in found if f.severity != "info"}
    if any(f.code == "narrow-comm" for f in found):
        severities.add("info")
    return severities


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("matrix")
    deepspeed_op_built()
    for group in ("ddp", "fsdp", "fsdp1", "deepspeed"):
        launch("tests.workers.matrix", group, str(out), ranks=2, timeout=300)
    launch("tests.workers.matrix", "single", str(out), ranks=1, timeout=300)
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}


@contextmanager
def process_state(scenario: Scenario) -> Iterator[None]:
    """This process as the worker's was when it started the scenario's engine: DeepSpeed's
    torch_autocast flag on after a torch_autocast engine (`run["after_autocast"]`), else off,
    as in a fresh process. `check` reads that flag."""
    if scenario.backend != "deepspeed":
        yield
        return
    from deepspeed.runtime import torch_autocast

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch_autocast, "TORCH_AUTOCAST_INITIALIZED",
                      bool(scenario.run.get("after_autocast", False)))
        yield


def score(scenarios: Iterable[Scenario], records: dict[str, dict[str, Any]], group: None
          ) -> tuple[dict[str, Counter[str]], str]:
    """tp, fp and fn of `check` at each severity over the scenarios' real runs, and a report:
    the table, then each disagreement."""
    scores = {s: Counter[str]() for s in RANKED}
    wrong = []
    for scenario in scenarios:
        record = records[scenario.name]
        _, plan = build_applied(scenario)
        truth = observed(scenario, plan, record)
        with process_state(scenario):
            said = predicted(scenario, group)
        for severity in RANKED:
            if record["refused"] and severity != "error":
                continue  # a refused run shows nothing else
            key = {(True, True): "tp", (False, True): "fp", (True, False): "fn"}.get(
                (severity in truth, severity in said))
            if key:
                scores[severity][key] += 1
            if key in ("fp", "fn"):
                wrong.append(f"{scenario.name}: {severity} {key} (ran {sorted(truth)}, check "
                             f"said {sorted(said)}; refused={record['refused']!r})")
    table = []
    for severity, c in scores.items():
        precision = c["tp"] / max(c["tp"] + c["fp"], 1)
        recall = c["tp"] / max(c["tp"] + c["fn"], 1)
        table.append(f"{severity}: tp={c['tp']} fp={c['fp']} fn={c['fn']} "
                     f"precision={precision:.0%} recall={recall:.0%}")
    return scores, "\n".join(table + wrong)


def assert_agrees(scores: dict[str, Counter[str]], report: str) -> None:
    """Each severity exercised, and precision and recall at least 95% at each."""
    assert all(c["tp"] for c in scores.values()), report
    for c in scores.values():
        assert c["tp"] >= 0.95 * (c["tp"] + c["fp"]), report  # precision
        assert c["tp"] >= 0.95 * (c["tp"] + c["fn"]), report  # recall


@pytest.mark.slow  # about 40 s of real runs a torch: over make test's budget
def test_check_agrees_with_what_the_backends_did(records: dict[str, dict[str, Any]],
                                                 group: None) -> None:
    scores, report = score(SCENARIOS, records, group)
    print(f"check against {len(SCENARIOS)} real runs:\n{report}")  # shown by pytest -s
    assert_agrees(scores, report)
    assert SEVERITIES == RANKED


DEEPSPEED = [s for s in SCENARIOS if s.backend == "deepspeed"] + ds_matrix.SCENARIOS


@pytest.fixture(scope="module")
def deepspeed_records(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The DeepSpeed scenarios run for real on 2 gloo ranks: tests/workers/matrix.py's, then
    tests/workers/ds_matrix.py's, whose records add what DeepSpeed's optimizer kept."""
    out = tmp_path_factory.mktemp("ds_matrix")
    deepspeed_op_built()
    launch("tests.workers.matrix", "deepspeed", str(out), ranks=2, timeout=300)
    launch("tests.workers.ds_matrix", str(out), ranks=2, timeout=300)
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}


@pytest.mark.slow
def test_check_agrees_with_what_deepspeed_did(deepspeed_records: dict[str, dict[str, Any]],
                                              group: None) -> None:
    assert sorted(deepspeed_records) == sorted(s.name for s in DEEPSPEED)
    scores, report = score(DEEPSPEED, deepspeed_records, group)
    print(f"check against {len(DEEPSPEED)} real DeepSpeed runs:\n{report}")  # pytest -s
    assert_agrees(scores, report)


@pytest.mark.slow  # it needs every scenario's real run (the matrix's fixture)
def test_every_scenario_ran(records: dict[str, dict[str, Any]]) -> None:
    assert sorted(records) == sorted(s.name for s in SCENARIOS)
