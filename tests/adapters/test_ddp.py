"""DDP: the comm hook reduces each gradient in its planned dtype, on 2 real gloo ranks; its
findings: a missing or foreign hook, and buckets the hook splits (predicted as DDP builds them)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from precision_annot import Policy, PrecisionPlan, apply, bf16, check, fp32, precision, resolve
from precision_annot._src.runtime import applied_plan
from precision_annot.adapters import ddp
from tests.adapters.distributed import check_training, run_ranks
from tests.workers.models import POLICY, Net


@pytest.mark.slow  # over make test's budget: run by make test-all
def test_two_ranks_reduce_in_the_planned_dtypes(tmp_path: Path) -> None:
    ranks = run_ranks("ddp", tmp_path)
    check_training(ranks, "all_reduce")
    # one bucket holding bf16 and fp32 comm: the predicted 2 all-reduces a step, as recorded
    (bucket,) = ddp.buckets(resolve(Net(), default=POLICY))
    assert bucket.comms == {bf16, fp32}
    for r in ranks:
        assert Counter(op for op, _, _ in r["collectives"]) == {"all_reduce": 2 * 5}


def blocks() -> nn.Sequential:
    """8 Linear(300, 300) (361 kB each), two of them reduced in fp32."""
    model = nn.Sequential(*[nn.Linear(300, 300) for _ in range(8)])
    for i in (2, 5):
        precision(compute=fp32, comm=fp32)(model[i])
    return model


def test_buckets_are_predicted_as_ddp_rebuilds_them(group: None) -> None:
    model = blocks()
    plan = resolve(model, default=Policy(compute=bf16, storage=fp32, comm=bf16))
    apply(model, plan)
    wrapped = DistributedDataParallel(model)
    wrapped.register_comm_hook(None, ddp.comm_hook(plan))
    for _ in range(3):  # DDP rebuilds its buckets in the second step, and logs them
        wrapped(torch.randn(4, 300)).sum().backward()
    rebuilt = wrapped._get_ddp_logging_data()["rebuilt_bucket_sizes"]
    predicted = ddp.buckets(plan)
    assert [int(x) for x in str(rebuilt).split(", ")] == [b.bytes for b in predicted]
    assert [b.modules for b in predicted] == [("7", "6", "5"), ("4", "3", "2", "1", "0")]
    assert [b.comms for b in predicted] == [{bf16, fp32}, {bf16, fp32}]
    (split,) = [f for f in ddp.findings(plan, wrapped) if f.code == "ddp-mixed-bucket"]
    assert split.message.startswith("2 of DDP's 2 gradient buckets mix comm dtypes (bf16, fp32)")
    assert "4 all-reduces per step instead of 2" in split.message
    # one cap for every bucket when you set it, as DDP does
    assert [b.bytes for b in ddp.buckets(plan, bucket_cap_mb=0.5)] == [722400] * 4
    uniform = resolve(blocks(), default="bf16-mixed")  # comm fp32 everywhere
    assert ddp.findings(uniform) == []


def test_check_a_ddp_model_without_the_plans_hook(group: None) -> None:
    model = Net()
    plan = resolve(model, default=POLICY)
    apply(model, plan)
    bare = DistributedDataParallel(model)
    found = {f.code: f for f in check(bare, "ddp")}
    # bf16 planned, fp32 reduced: more bytes than planned, a warning (a narrowed one errs)
    assert found["ddp-no-hook"].severity == "warning"
    assert found["ddp-no-hook"].modules == ("fc1.inner", "fc2.inner")
    assert "'fc1.inner' and 'fc2.inner' (676 parameters) in another dtype than the plan " \
        "(planned bf16, fp32 instead)" in found["ddp-no-hook"].message
    assert "1,352 more bytes a step on the wire" in found["ddp-no-hook"].message  # 676 x 2
    foreign = DistributedDataParallel(model)
    foreign.register_comm_hook(None, allreduce_hook)
    found = {f.code: f for f in check(foreign, "ddp")}
    assert "ddp-no-hook" not in found and found["ddp-other-hook"].severity == "warning"
    assert "'allreduce_hook'" in found["ddp-other-hook"].message
    builtin = DistributedDataParallel(model)  # 0.2 took a C++ hook for no hook at all
    builtin._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    found = {f.code: f for f in check(builtin, "ddp")}
    assert found["ddp-other-hook"].severity == "error"  # the fp32 island, summed in fp16
    assert "norm.inner" in found["ddp-other-hook"].modules
    assert "BuiltinCommHookType.FP16_COMPRESS" in found["ddp-other-hook"].message
    ours = DistributedDataParallel(model)
    ours.register_comm_hook(None, ddp.comm_hook(plan))
    codes = {f.code for f in check(ours, "ddp")}
    assert not codes & {"ddp-no-hook", "ddp-other-hook", "ddp-needs-hook"}
    assert "ddp-needs-hook" in {f.code for f in check(plan, "ddp")}  # no model: a reminder
    assert check(resolve(Net(), default="bf16-mixed"), "ddp") == []


def test_bad_input() -> None:
    with pytest.raises(TypeError, match=r"comm_hook: plan must be a PrecisionPlan"):
        ddp.comm_hook(nn.Linear(2, 2))  # type: ignore[arg-type]
    loaded = PrecisionPlan.from_json(resolve(nn.Linear(2, 2)).to_json())
    with pytest.raises(RuntimeError, match="does not hold its model"):
        ddp.comm_hook(loaded)
    with pytest.raises(ValueError, match=r"bucket_cap_mb is DDP's bucket size in MiB.*"
                                         r"Received: bucket_cap_mb=0"):
        ddp.buckets(loaded, bucket_cap_mb=0)


def test_audit_and_check_see_through_ddp_to_the_applied_plan(group: None) -> None:
    """0.2 compared a DDP-wrapped model against its bare annotations."""
    from precision_annot import audit

    model = nn.Sequential(nn.Linear(4, 4), precision(fp32)(nn.LayerNorm(4)), nn.Linear(4, 2))
    apply(model, default=Policy(compute=bf16, storage=fp32, comm=bf16))
    wrapped = DistributedDataParallel(model)
    wrapped.register_comm_hook(None, ddp.comm_hook(applied_plan(wrapped)))  # type: ignore[arg-type]
    with audit(wrapped) as report:
        wrapped(torch.randn(2, 4)).float().sum().backward()
    assert report.divergences == [] and set(report["0"].forward_ops) == {bf16}
    assert [f.code for f in check(wrapped, "ddp")] == ["narrow-comm", "ddp-mixed-bucket"]
    del wrapped
