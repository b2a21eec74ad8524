"""`compile_plan`: what runs at every module, worked out once, without touching the model."""

from __future__ import annotations

import copy

import torch
from torch import nn

from precision_annot import bf16, fp32, precision, resolve
from precision_annot._src.execution import Target, compile_plan


class Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.ones(2), persistent=False)
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(x) * self.inv_freq.sum()
        return out


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), precision(fp32)(Rotary()), nn.Linear(4, 4))


def test_it_is_pure_and_equal_for_equal_inputs() -> None:
    net = model()
    before = copy.deepcopy(net.state_dict())
    plan = resolve(net, default="bf16")
    named = dict(net.named_modules())
    one, two = compile_plan(plan, named), compile_plan(plan, named)
    assert one == two and one is not two
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert "forward" not in net[1].__dict__
    assert compile_plan(resolve(net, default="bf16-mixed"), named) != one


def test_targets_boundaries_guards_and_the_exit_rule() -> None:
    net = model()
    execution = compile_plan(resolve(net, default="bf16"), dict(net.named_modules()))
    targets = execution.targets
    assert targets[("0", "param", "weight")] == Target(bf16)
    assert targets[("1", "buffer", "inv_freq")] == Target(fp32, persistent=False)  # as built
    assert targets[("1", "buffer", "count")] == Target(fp32)  # its module's storage
    island = execution.sites["1"]
    assert not island.guard and island.spec.compute == fp32 and island.spec.exit == bf16
    root = execution.sites[""]
    assert root.spec.compute == bf16 and root.spec.exit is None  # the root: as computed
    assert "0" not in execution.sites  # a leaf that changes nothing: untouched
    assert execution.reprs["1"].endswith("*")


def test_a_guard_shares_its_boundarys_region_with_its_own_paths() -> None:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.block(x)
            return out

    net = Outer()
    precision(compute=fp32, storage=bf16)(net)  # fp32 compute over bf16 weights: a region
    execution = compile_plan(resolve(net), dict(net.named_modules()))
    root, guard = execution.sites[""], execution.sites["block"]
    assert guard.guard and guard.region is root.region  # the object the dicts know
    assert root.region is not None and ("block.0", "param", "weight", False) in \
        root.region.members
    assert guard.swap is not None and ("0", "param", "weight", False) in guard.swap.members
