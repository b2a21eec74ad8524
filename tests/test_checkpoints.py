"""Loading a checkpoint into an applied model keeps the plan: every tensor in its planned dtype
after `load_state_dict` (plain and `assign=True`) and `set_model_state_dict`, with a warning
naming the tensors a checkpoint holds narrower than the plan keeps them. Judged against the
same load written by hand (each tensor cast to its planned dtype)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from precision_annot import apply, bf16, fp32, precision

PLANNED = {"up.weight": bf16, "up.bias": bf16, "norm.weight": fp32, "norm.bias": fp32,
           "router.weight": fp32, "router.bias": fp32, "down.weight": bf16, "down.bias": bf16}
ISLANDS = ["norm.weight", "norm.bias", "router.weight", "router.bias"]


class Net(nn.Module):
    """A bf16 model with an fp32 norm and an fp32 router, as an MoE block keeps them."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.norm = precision(fp32)(nn.LayerNorm(16))
        self.router = precision(fp32)(nn.Linear(16, 4))
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.up(x))
        return self.down(h) * self.router(h).softmax(-1).sum(-1, keepdim=True)


def saved(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A checkpoint of another instance, every tensor in `dtype` (norm weights off 1.0, so
    that bf16 rounds them)."""
    torch.manual_seed(1)
    source = Net()
    with torch.no_grad():
        source.norm.weight.add_(torch.randn(16) * 0.1)
    return {k: v.detach().to(dtype) for k, v in source.state_dict().items()}


def by_hand(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the load should give: each saved tensor cast to its planned dtype."""
    return {k: v.to(PLANNED[k]) for k, v in state.items()}


def loaded(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict_keeps_every_planned_dtype(assign: bool) -> None:
    """0.4: assign=True put the checkpoint's bf16 tensors in the fp32 islands and its fp32
    tensors in the bf16 layers (a warning said so; the plan was gone until apply again)."""
    for dtype in (torch.float32, bf16):
        model = apply(Net(), default="bf16-true")
        state = saved(dtype)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.load_state_dict(state, assign=assign)
        after = loaded(model)
        assert {k: v.dtype for k, v in after.items()} == PLANNED
        for key, value in by_hand(state).items():
            assert torch.equal(after[key], value), key
        said = [str(w.message) for w in caught]
        if dtype == fp32:  # wider than the plan keeps anything: nothing is lost
            assert said == []
        else:  # the islands were saved in bf16: their precision was gone before this load
            (message,) = said
            assert message.startswith("load_state_dict: the checkpoint holds 4 tensor(s) "
                                       "narrower than the plan keeps them (saved in bf16, "
                                       "kept in fp32)")
            assert all(repr(n) in message for n in ISLANDS)
            assert not any(repr(n) in message for n in PLANNED if n not in ISLANDS)
        out = model(torch.randn(4, 8, dtype=bf16))  # it runs as planned
        assert out.dtype == bf16


def test_assign_keeps_the_parameters_the_plan_guards() -> None:
    """After assign=True the model holds new parameter objects; the step guard that refuses a
    plain optimizer for a plan with masters knows them too."""
    model = apply(Net(), default="bf16-true,master=fp32")
    model.load_state_dict(saved(fp32), assign=True)
    assert model.up.weight.dtype == bf16
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 8, dtype=bf16)).float().sum().backward()
    with pytest.raises(RuntimeError, match=r"SGD.step\(\): it updates parameter 'up.weight'"):
        sgd.step()


def test_set_model_state_dict_keeps_the_plan_and_names_what_was_lost() -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    model = apply(Net(), default="bf16-true")
    state = saved(bf16)
    with pytest.warns(UserWarning, match=r"4 tensor\(s\) narrower.*'norm.weight'"):
        set_model_state_dict(model, state)
    after = loaded(model)
    assert {k: v.dtype for k, v in after.items()} == PLANNED
    assert all(torch.equal(after[k], v) for k, v in by_hand(state).items())


def test_a_load_into_a_submodule_prefix_and_a_wrapper_is_read_with_its_prefix() -> None:
    """DDP-style and nested loads reach the applied root with a prefix: the names are the
    root's own."""
    outer = nn.Sequential(apply(Net(), default="bf16-true"))
    with pytest.warns(UserWarning, match=r"'0.norm.weight'"):
        outer.load_state_dict({f"0.{k}": v for k, v in saved(bf16).items()})
    assert outer[0].norm.weight.dtype == fp32
