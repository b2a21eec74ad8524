"""`ModuleTracker`: which module's own code runs each op, forward and backward."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from precision_annot import Policy, fp32, precision
from precision_annot._src.tracking import ModuleTracker


class Owners(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, tracker: ModuleTracker) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.tracker = tracker
        self.seen: list[tuple[str, str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        owner = self.tracker.owner()
        if owner is not None:
            self.seen.append((*owner, func.overloadpacket.__name__))
        return out


def test_ops_are_charged_to_the_innermost_module_forward_and_backward() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Tanh()))
    tracker = ModuleTracker({m: n for n, m in model.named_modules()})
    with tracker, Owners(tracker) as mode:
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    forward = {(name, op) for name, phase, op in mode.seen if phase == "forward"}
    backward = {(name, op) for name, phase, op in mode.seen if phase == "backward"}
    assert ("0", "addmm") in forward and ("1.0", "tanh") in forward
    assert ("1.0", "tanh_backward") in backward and ("0", "mm") in backward
    assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks  # taken off


def test_a_region_gets_a_row_of_its_own_when_asked() -> None:
    @precision(compute=fp32)
    def scale(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    class Block(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return scale(x) + 1

    model = nn.Sequential(Block())
    regions: list[tuple[str, Policy]] = []
    tracker = ModuleTracker({m: n for n, m in model.named_modules()},
                            on_region=lambda n, p: regions.append((n, p)))
    with tracker, Owners(tracker) as mode:
        model(torch.randn(2, 4))
    name = "0::test_a_region_gets_a_row_of_its_own_when_asked.<locals>.scale"
    assert regions == [(name, Policy(compute=fp32))]
    assert (name, "forward", "mul") in mode.seen and ("0", "forward", "add") in mode.seen
