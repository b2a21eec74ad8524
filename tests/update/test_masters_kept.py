"""The masters keep the widest values there are: a wider checkpoint loaded before the first step
(meta-device init, `apply`, `to_empty`, `load_state_dict`) starts them from its own values
whenever they are made, and a detour through fp32 mid-run (`remove` or `apply(model, "fp32")`,
then the plan again) keeps them. Each run is checked against the Apex O2 loop written by hand
(fp32 masters from the same values, torch's fused AdamW over them, copied back rounded), bit
for bit.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import precision_annot as pa
from tests.test_update import batch, loss_of, mlp

bf16, fp32 = torch.bfloat16, torch.float32
SPEC = "bf16-true,master=fp32"
HYPER: dict[str, Any] = {"lr": 3e-3, "weight_decay": 0.1}


def checkpoint() -> dict[str, torch.Tensor]:
    """An fp32 checkpoint (another initialisation: a trained model's, say), most of whose
    values bf16 cannot hold."""
    return {k: v.clone() for k, v in mlp(seed=1).state_dict().items()}


def train(model: nn.Module, opt: Any, start: int, count: int) -> None:
    for step in range(start, start + count):
        opt.zero_grad()
        loss_of(model, batch(step)).backward()
        opt.step()


class Hand:
    """The Apex O2 loop by hand: a bf16 copy of the model, fp32 masters made from `values`
    (by name), torch's AdamW(fused=True) stepping them, each copied back rounded."""

    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        self.model = pa.apply(mlp(), default="bf16")
        self.model.load_state_dict(values)
        self.masters = [values[n].detach().float().clone()
                        for n, _ in self.model.named_parameters()]
        self.opt = torch.optim.AdamW(self.masters, fused=True, **HYPER)

    def train(self, start: int, count: int) -> None:
        for step in range(start, start + count):
            self.model.zero_grad()
            loss_of(self.model, batch(step)).backward()
            for m, p in zip(self.masters, self.model.parameters(), strict=True):
                m.grad = p.grad.float()
            self.opt.step()
            with torch.no_grad():
                for m, p in zip(self.masters, self.model.parameters(), strict=True):
                    p.copy_(m)


def assert_as_by_hand(model: nn.Module, opt: Any, hand: Hand) -> None:
    for (name, p), q, m in zip(model.named_parameters(), hand.model.parameters(), hand.masters,
                               strict=True):
        master = opt.master(p)
        assert p.dtype == bf16 and torch.equal(p, q), name
        assert master is not None and master.dtype == fp32 and torch.equal(master, m), name


def on_meta() -> nn.Module:
    with torch.device("meta"):
        model = mlp()
    pa.apply(model, default=SPEC)
    return model.to_empty(device="cpu")


# -- a wider checkpoint loaded before the first step -----------------------------------------------

@pytest.mark.parametrize("built", ["before the load", "after the load"])
def test_an_fp32_checkpoint_loaded_before_the_first_step_starts_the_masters(built: str) -> None:
    """Before: the masters were made at the first step from the bf16-rounded weights (up to
    7.8e-3 off the checkpoint on this model), with no warning. Now from the checkpoint's own values,
    whether the optimizer was built before the load or after it; `state_dict()` before the
    first step (what DCP saves) holds them too."""
    values = checkpoint()
    model = on_meta()
    opt = pa.optimizer(model, torch.optim.AdamW, **HYPER) if built.startswith("before") \
        else None
    model.load_state_dict(values)
    opt = opt or pa.optimizer(model, torch.optim.AdamW, **HYPER)
    saved = opt.state_dict()["state"]
    for index, (name, _) in enumerate(model.named_parameters()):
        assert torch.equal(saved[index]["master"], values[name]), name
    train(model, opt, 0, 3)
    hand = Hand(values)
    hand.train(0, 3)
    assert_as_by_hand(model, opt, hand)


def test_the_kept_values_follow_later_loads_and_are_dropped_when_the_weight_moves() -> None:
    """The weights loaded back unchanged (their bf16 rounding) keep the wider values; another
    load replaces them; a weight written by hand since (no load) drops them: its master is
    made from it, as from any weight."""
    values, other = checkpoint(), {k: v * 1.5 for k, v in checkpoint().items()}
    model = on_meta()
    model.load_state_dict(values)
    model.load_state_dict({k: v.to(bf16) for k, v in values.items()})  # its own rounding
    opt = pa.optimizer(model, torch.optim.AdamW, **HYPER)
    assert torch.equal(opt.state_dict()["state"][1]["master"], values["1.weight"])
    model.load_state_dict(other)
    assert torch.equal(opt.state_dict()["state"][1]["master"], other["1.weight"])
    with torch.no_grad():
        model[1].weight.mul_(2)
    assert torch.equal(opt.state_dict()["state"][1]["master"], model[1].weight.float())


def test_an_fp32_checkpoint_into_a_plan_without_masters_keeps_nothing_beside_it() -> None:
    """No master planned: nothing wider is kept beside the weights (the plan's memory
    holds)."""
    from precision_annot._src.update import guard

    model = pa.apply(mlp(), default="bf16-true")
    model.load_state_dict(checkpoint())
    assert all(guard.wide_of(p) is None for p in model.parameters())


# -- a detour through fp32 -------------------------------------------------------------------------

def detours() -> dict[str, Callable[[nn.Module], None]]:
    return {"remove": lambda m: pa.remove(m),
            "apply fp32": lambda m: pa.apply(m, default="fp32")}


@pytest.mark.parametrize("detour", list(detours()))
@pytest.mark.parametrize("stepped_in_fp32", [False, True], ids=["evaluated", "trained"])
def test_a_detour_through_fp32_keeps_the_masters(detour: str, stepped_in_fp32: bool) -> None:
    """3 steps, the plan taken off (evaluate and save in fp32: the weights are the masters),
    the plan applied again, 3 steps: the same as the run that did not stop, bit for bit, and
    the same as the hand loop. Before: the masters restarted from the bf16-rounded weights
    (up to 7.5e-3 off their values at the switch; 3 steps later the masters 7.5e-3 and the
    weights 1.6e-2 off the run that did not stop), with no warning. A step taken in fp32 in
    between updates the fp32 weights, and the masters start from them."""
    whole = pa.apply(mlp(), default=SPEC)
    whole_opt = pa.optimizer(whole, torch.optim.AdamW, **HYPER)
    train(whole, whole_opt, 0, 6)

    model = pa.apply(mlp(), default=SPEC)
    opt = pa.optimizer(model, torch.optim.AdamW, **HYPER)
    train(model, opt, 0, 3)
    masters = [opt.master(p).clone() for p in model.parameters()]  # type: ignore[union-attr]
    detours()[detour](model)
    assert all(p.dtype == fp32 and torch.equal(p, m)
               for p, m in zip(model.parameters(), masters, strict=True))
    with torch.no_grad():
        model(batch(9))  # evaluate in fp32
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    if stepped_in_fp32:
        train(model, opt, 3, 1)
        after = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing narrowed from rounded values: no warning
        pa.apply(model, default=SPEC)
    if stepped_in_fp32:  # the masters its next step makes
        made = opt.state_dict()["state"]
        assert all(torch.equal(made[i]["master"], after[n])
                   for i, (n, _) in enumerate(model.named_parameters()))
        return
    train(model, opt, 3, 3)
    for (name, p), q in zip(model.named_parameters(), whole.parameters(), strict=True):
        assert torch.equal(p, q) and torch.equal(opt.master(p), whole_opt.master(q)), name
    hand = Hand({k: v.to(bf16).float() for k, v in mlp().state_dict().items()})
    hand.train(0, 6)
    assert_as_by_hand(model, opt, hand)
    assert all(v.dtype == fp32 for v in saved.values())


def test_a_checkpoint_loaded_before_the_first_step_reaches_the_weights_of_an_fp32_detour() -> None:
    """`remove` before any step gives back the checkpoint's own fp32 values, not the bf16
    rounding of them: the kept value is the widest copy there is."""
    values = checkpoint()
    model = on_meta()
    model.load_state_dict(values)
    pa.remove(model)
    for name, p in model.named_parameters():
        assert p.dtype == fp32 and torch.equal(p, values[name]), name
