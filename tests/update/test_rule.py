"""One home for "how is this parameter updated": `UpdateRule`, decided per (policy, stored
dtype), and everything that asks it agreeing, layout by layout: the optimizer's step, the step
guard, `plan.memory`, `audit`, `check` (the plain-optimizer finding and `low-storage`) and the
DeepSpeed export."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

import precision_annot as pa
from precision_annot import bf16, fp16, fp32
from precision_annot._src.update.optimizer import state_bytes
from precision_annot._src.update.rule import UpdateRule, update_rule
from precision_annot.adapters.deepspeed import export as ds
from tests.helpers import accumulate_as_planned

pytest.importorskip("torchao")


@dataclasses.dataclass(frozen=True)
class Row:
    spec: str
    master: torch.dtype | None = None
    stochastic: bool = False
    grad: torch.dtype | None = None  # None: the stored dtype
    state: torch.dtype | str | None = None  # None: what is updated
    stored: torch.dtype = bf16


TABLE = {
    # check said optimizer-ignores-update here while the others said no master is needed
    "fp32 Linear, master=fp32": Row("master=fp32", stored=fp32),
    "fp32 storage, master=fp32": Row("fp32,master=fp32", stored=fp32),
    "bf16-mixed, master=fp32": Row("bf16-mixed,master=fp32", stored=fp32),
    "bf16, no master": Row("bf16-true"),
    "bf16, fp32 master": Row("bf16-true,master=fp32", master=fp32),
    "fp16, fp32 master": Row("16-true,master=fp32", master=fp32, stored=fp16),
    "bf16, fp32 master and gradients": Row("bf16-master", master=fp32, grad=fp32),
    "bf16, fp32 master, 8-bit state": Row("bf16-true,master=fp32,optim=8bit", master=fp32,
                                          state="8bit"),
    "bf16, fp32 master, bf16 state": Row("bf16-true,master=fp32,optim=bf16", master=fp32,
                                         state=bf16),
    "bf16, stochastic": Row("bf16-true,master=stochastic", stochastic=True),
    "bf16, stochastic, 8-bit state": Row("bf16-true,master=stochastic,optim=8bit",
                                         stochastic=True, state="8bit"),
    "bf16, fp32 state, no master": Row("bf16-true,optim=fp32", state=fp32),
}


def expected(row: Row) -> UpdateRule:
    return UpdateRule(row.stored, row.master, row.stochastic, row.grad, row.state)


def model_for(row: Row) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64))  # a 4,096-element weight: a low-bit state holds
    return accumulate_as_planned(pa.apply(model, default=row.spec))


def loss_of(model: nn.Module) -> torch.Tensor:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    return model(x.to(model[0].weight.dtype)).float().pow(2).mean()


#: the rows of the fast suite (the case check and the others disagreed on, and the common one)
FAST_ROWS = ("fp32 Linear, master=fp32", "bf16, fp32 master")


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST_ROWS else (
    pytest.mark.slow,)) for n in TABLE])
def test_everything_that_asks_how_a_parameter_is_updated_agrees(name: str) -> None:
    row = TABLE[name]
    rule = expected(row)
    model = model_for(row)
    weight = model[0].weight
    plan = pa.applied_plan(model)
    assert plan is not None and weight.dtype == row.stored
    policy = plan["0"].policy
    assert update_rule(policy.master, policy.grad, policy.optim, weight.dtype) == rule

    # the optimizer: what its step keeps
    opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-3)
    assert opt.rule(weight) == rule
    loss_of(model).backward()
    opt.step()
    master = opt.master(weight)
    assert (master.dtype if master is not None else None) == row.master
    exp_avg = opt.state[weight]["exp_avg"]
    kind = type(exp_avg).__name__
    assert kind == "OptimState8bit" if rule.state == "8bit" else exp_avg.dtype == rule.state

    # plan.memory: the bytes that step left
    figure = plan.memory("adamw")
    assert state_bytes(opt) == figure.total("master_bytes") + figure.total("state_bytes")
    assert figure.total("master_bytes") == sum(
        p.numel() * row.master.itemsize for p in model.parameters()) if row.master else (
        figure.total("master_bytes") == 0)
    assert figure.total("grad_bytes") == sum(p.grad.numel() * p.grad.element_size()
                                             for p in model.parameters())

    # the step guard, and check's finding, on a plain optimizer over the same parameters
    plain = torch.optim.AdamW(model.parameters(), lr=1e-3)
    findings = {f.code for f in pa.check(model, "local", {"optimizer": plain})}
    assert ("optimizer-ignores-update" in findings) == (not rule.plain)
    low = rule.stored in (bf16, fp16) and rule.master is None and not rule.stochastic
    assert ("low-storage" in findings) == low
    if rule.plain:
        plain.step()
    else:
        with pytest.raises(RuntimeError, match=f"the plan says {rule.describe()} for it"):
            plain.step()

    # audit: the master the step updated, against the plan
    opt.zero_grad()
    with pa.audit(model, optimizer=opt) as report:
        loss_of(model).backward()
        opt.step()
    done = report["0"].updates["weight"]
    assert done.master == row.master
    assert not [d for d in report.divergences if d.field == "master"]


@pytest.mark.parametrize("name", [n for n, r in TABLE.items() if "state" not in n and (
    r.stored != fp16)])
def test_the_deepspeed_export_says_the_same_master(name: str) -> None:
    """DeepSpeed's `bf16_master_weights_and_grads` is the absence of a master (ZeRO 1-3)."""
    row = TABLE[name]
    rule = expected(row)
    plan = pa.resolve(nn.Sequential(nn.Linear(64, 64)), row.spec)
    keys: dict[str, Any] = ds._update_keys(plan["0"].policy, {bf16: "bf16"}.get(row.stored), 2)
    if row.stored == fp32:
        assert keys == {} and rule.plain
    elif not row.stochastic:
        assert keys["bf16_master_weights_and_grads"] == (rule.master is None)


def test_a_complex_parameter_gets_no_real_master() -> None:
    """A complex64 parameter under master=fp32: the complex dtype of fp32 is its own, so no
    master (a float32 one would drop its imaginary part); fp64 gives a complex128 master."""
    assert update_rule(fp32, None, None, torch.complex64).plain
    assert update_rule(torch.float64, None, None, torch.complex64).master == torch.complex128
    assert update_rule(fp32, None, "8bit", torch.complex64).plain  # no complex low-bit form
