"""What the contract suite builds: layouts, optimizer classes, a small model, and the grid of
(layout, class) cases each check runs on (one fast representative per check; the rest slow)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import precision_annot as pa
from tests.helpers import accumulate_as_planned

#: the update layouts the suite runs on, as plan strings
LAYOUTS = {
    "plain": "fp32",
    "masters": "bf16-true,master=fp32",
    "8bit": "bf16-true,master=fp32,optim=8bit",
    "stochastic": "bf16-true,master=stochastic",
    "grad32": "bf16-true,master=fp32,grad=fp32",
}


def _lion() -> type[torch.optim.Optimizer] | None:
    try:
        import bitsandbytes as bnb
    except ImportError:  # an optional extra
        return None
    return bnb.optim.Lion  # type: ignore[no-any-return]


#: each class with the hyperparameters its cases use (one variant each, beyond the defaults
#: torch's own suite also tries: momentum, amsgrad, weight decay, maximize)
CLASSES: dict[str, tuple[Callable[[], type[torch.optim.Optimizer] | None], dict[str, Any]]] = {
    "AdamW": (lambda: torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "Adam": (lambda: torch.optim.Adam, {"lr": 1e-2, "amsgrad": True, "weight_decay": 0.01}),
    "SGD": (lambda: torch.optim.SGD, {"lr": 2e-2, "momentum": 0.9, "nesterov": True}),
    "Adagrad": (lambda: torch.optim.Adagrad, {"lr": 5e-2}),
    "RMSprop": (lambda: torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.5, "centered": True}),
    "Adamax": (lambda: torch.optim.Adamax, {"lr": 1e-2}),
    "NAdam": (lambda: torch.optim.NAdam, {"lr": 1e-2}),
    "RAdam": (lambda: torch.optim.RAdam, {"lr": 1e-2}),
    "Adadelta": (lambda: torch.optim.Adadelta, {"lr": 1.0}),
    "ASGD": (lambda: torch.optim.ASGD, {"lr": 2e-2}),
    "Rprop": (lambda: torch.optim.Rprop, {"lr": 1e-3}),
    "Adafactor": (lambda: torch.optim.Adafactor, {"lr": 1e-2}),
    "LBFGS": (lambda: torch.optim.LBFGS, {"lr": 0.5, "max_iter": 4}),
    "Lion": (_lion, {"lr": 1e-3}),
}
#: the classes a low-bit state runs with (torchao's Adam update)
LOW_BIT_CLASSES = ("AdamW", "Adam")
#: the one fast case of a check, when it does not say otherwise
FAST = ("masters", "AdamW")


@dataclasses.dataclass(frozen=True)
class Case:
    layout: str
    name: str

    @property
    def spec(self) -> str:
        return LAYOUTS[self.layout]

    @property
    def cls(self) -> type[torch.optim.Optimizer]:
        cls = CLASSES[self.name][0]()
        if cls is None:
            pytest.skip(f"{self.name} needs an optional package")
        return cls

    @property
    def kwargs(self) -> dict[str, Any]:
        kwargs = dict(CLASSES[self.name][1])
        if self.layout == "8bit":  # torchao's update has no amsgrad form (refused)
            kwargs.pop("amsgrad", None)
        return kwargs

    @property
    def closure_needed(self) -> bool:
        return self.name == "LBFGS"

    @property
    def stochastic(self) -> bool:
        return self.layout == "stochastic"

    def __str__(self) -> str:
        return f"{self.layout}-{self.name}"


def cases(fast: tuple[str, str] = FAST, *, layouts: tuple[str, ...] = tuple(LAYOUTS),
          classes: tuple[str, ...] = tuple(CLASSES),
          skip: Callable[[Case], bool] = lambda c: False) -> list[Any]:
    """Every (layout, class) case of a check, the `fast` one unmarked, the others slow."""
    out = []
    for layout in layouts:
        for name in classes:
            if layout == "8bit" and name not in LOW_BIT_CLASSES:
                continue
            case = Case(layout, name)
            if skip(case):
                continue
            marks = () if (layout, name) == fast else (pytest.mark.slow,)
            out.append(pytest.param(case, id=str(case), marks=marks))
    assert any(not p.marks for p in out), f"no fast case {fast}"
    return out


class Toy(nn.Module):
    """A weight large enough for torchao to quantize its state (4,096 elements in whole
    blocks) and a bias that is not."""

    def __init__(self, seed: int = 0, contiguous: bool = True) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        if contiguous:
            weight = torch.randn(64, 64, generator=gen) * 0.1
            bias = torch.randn(64, generator=gen) * 0.1
        else:
            weight = (torch.randn(64, 64, 2, generator=gen) * 0.1)[..., 0]
            bias = (torch.randn(64, 2, generator=gen) * 0.1)[..., 0]
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t() + self.bias


def inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(16, 64, generator=gen), torch.randn(16, 64, generator=gen) * 0.1


def model_for(case: Case, *, seed: int = 0, contiguous: bool = True) -> Toy:
    model = Toy(seed, contiguous)
    pa.apply(model, default=case.spec)
    return accumulate_as_planned(model)


def loss_of(model: Toy) -> torch.Tensor:
    x, y = inputs()
    return (model(x.to(model.weight.dtype)).float() - y).pow(2).mean()


def build(case: Case, params: Any = None, *, seed: int = 0, model: Toy | None = None,
          **overrides: Any) -> tuple[Toy, Any]:
    model = model if model is not None else model_for(case, seed=seed)
    kwargs = {**case.kwargs, **overrides}
    return model, pa.optimizer(model, case.cls, params, **kwargs)


def closure_for(model: Toy, opt: Any) -> Callable[[], torch.Tensor]:
    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = loss_of(model)
        loss.backward()
        return loss

    return closure


def step(case: Case, model: Toy, opt: Any, *, seed: int | None = None) -> torch.Tensor:
    """One training step as the class wants it (a closure for LBFGS); with `seed`, stochastic
    rounding draws from a stream of its own, so two optimizers stepped in parallel round alike."""
    closure = closure_for(model, opt)
    with _rng(seed):
        if case.closure_needed:
            return opt.step(closure)  # type: ignore[no-any-return]
        loss = closure()
        opt.step()
        return loss


@contextlib.contextmanager
def _rng(seed: int | None) -> Iterator[None]:
    if seed is None:
        yield
        return
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        yield


def grad_like(p: torch.Tensor, value: float = 0.0) -> torch.Tensor:
    """A gradient for `p` in the dtype it accumulates in (`grad_dtype`: fp32 with grad=fp32)."""
    dtype = p.grad_dtype if p.grad_dtype is not None else p.dtype
    return torch.full_like(p, value, dtype=dtype)


#: where a class itself does not keep a check of torch's contract, as torch's own suite skips
#: it (LBFGS) or the class fails it on its own (bitsandbytes' Lion), the reason
LIMITS: dict[tuple[str, str], str] = {
    **{(check, "LBFGS"): "LBFGS takes one parameter group" for check in (
        "param_groups_weight_decay", "param_group_with_lrscheduler", "add_param_group")},
    **{(check, "Lion"): "bitsandbytes' load_state_dict runs no load hooks and drops "
       "param_names" for check in ("load_state_dict_pre_hook_and_prepend",
                                   "load_state_dict_post_hook", "load_state_dict_pre_post_hook",
                                   "can_load_from_to_named_state_dict",
                                   "state_dict_deterministic")},
    ("distributed_checkpoint", "LBFGS"): "DCP initialises an empty optimizer's state with "
    "step(closure=None), which LBFGS refuses",
}
#: the flags each class did not have at first (torch's `not_og_supported_flags`)
OLD_FLAGS: dict[str, tuple[str, ...]] = {"Adafactor": ("foreach",), "LBFGS": ()}


def limited(check: str) -> Callable[[Case], bool]:
    return lambda case: (check, case.name) in LIMITS


def stored(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def truth(opt: Any, model: nn.Module) -> list[torch.Tensor]:
    """What each parameter's update keeps: its master where it has one."""
    out = []
    for p in model.parameters():
        master = opt.master(p)
        out.append((master if master is not None else p).detach().clone())
    return out
