"""torch's optimizer contract (the checks of PyTorch's test/test_optim.py, written afresh) for
`precision_annot.optimizer`, on every update layout: plain fp32, bf16 with fp32 masters, 8-bit
state, stochastic rounding, fp32 gradient accumulation; over torch's classes and a third-party
one (bitsandbytes' Lion).

Each check runs on one fast case; the whole grid of (layout, class) cases is marked slow. A
check named after torch's carries its name; the checks torch has not (isinstance, `defaults`
with OneCycleLR, pickling, every LR scheduler, DCP, a frozen module unfrozen later) follow.
"""

from __future__ import annotations

import copy
import inspect
import io
import pickle
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

import precision_annot as pa
from precision_annot._src.update.optimizer import state_bytes
from tests.helpers import accumulate_as_planned
from tests.update.cases import (
    CLASSES,
    OLD_FLAGS,
    Case,
    Toy,
    build,
    cases,
    grad_like,
    limited,
    loss_of,
    model_for,
    step,
    stored,
    truth,
)

pytest.importorskip("torchao")

FOREACH = tuple(n for n in CLASSES if n not in ("LBFGS", "Lion"))
FUSED = ("AdamW", "Adam", "SGD", "Adagrad")


def same(a: Any, b: Any, **tol: float) -> None:
    """Nested equality of state dicts and tensor lists (low-bit states compared by their
    dequantized values): exact, or within `tol` (`rtol`, `atol`; empty: assert_close's
    defaults for the dtype, as torch's own checks compare)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (sorted(map(str, a)),
                                                          sorted(map(str, b)))
        for key in a:
            same(a[key], b[key], **tol)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same(x, y, **tol)
    elif isinstance(a, torch.Tensor):
        if hasattr(a, "dequantize") and type(a) is not torch.Tensor:
            a, b = a.dequantize(), b.dequantize()
        torch.testing.assert_close(a, b, **({} if tol.pop("close", 0) else (
            {"rtol": 0, "atol": 0} | tol)))
    else:
        assert a == b, (a, b)


def parallel(case: Case, pairs: list[tuple[Toy, Any]], steps: int, start: int = 0) -> None:
    for i in range(start, start + steps):
        for model, opt in pairs:
            step(case, model, opt, seed=i)


# -- torch's checks -------------------------------------------------------------------------------

@pytest.mark.parametrize("case", cases(("masters", "AdamW")))
def test_errors(case: Case) -> None:
    """A bad hyperparameter is refused as the class refuses it, and a sparse gradient where
    the class takes none fails as it does."""
    bad = {"lr": -1.0}
    try:
        case.cls([nn.Parameter(torch.zeros(2))], **bad)
    except Exception as e:  # the class's own refusal, whatever it is
        expected: Exception | None = e
    else:
        expected = None
    model = model_for(case)
    if expected is None:
        pa.optimizer(model, case.cls, **bad)
    else:
        with pytest.raises(type(expected), match=_escaped(str(expected))):
            pa.optimizer(model, case.cls, **bad)


def _escaped(text: str) -> str:
    import re

    return re.escape(text)


@pytest.mark.parametrize("case", cases(("masters", "Adam"), classes=("Adam", "AdamW", "NAdam"),
                                       layouts=("plain", "masters", "stochastic", "grad32")))
def test_errors_at_step(case: Case) -> None:
    model, opt = build(case)
    model.weight.grad = grad_like(model.weight).to_sparse()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()


@pytest.mark.parametrize("contiguous", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["contiguous", "noncontiguous"])
@pytest.mark.parametrize("with_lrsched", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["", "lrsched"])
@pytest.mark.parametrize("case", cases(("stochastic", "SGD")))
def test_forloop_goes_right_direction(case: Case, contiguous: bool, with_lrsched: bool) -> None:
    model = Toy(contiguous=contiguous)
    pa.apply(model, default=case.spec)
    foreach = {"foreach": False} if case.name in FOREACH else {}
    _, opt = build(case, model=model, **foreach)
    schedulers = [lr_scheduler.StepLR(opt, 5, 0.9), lr_scheduler.ReduceLROnPlateau(opt)] if (
        with_lrsched) else []
    first = loss_of(model).item()
    for i in range(20):
        loss = step(case, model, opt, seed=i)
        for s in schedulers:
            s.step(loss) if isinstance(s, lr_scheduler.ReduceLROnPlateau) else s.step()
    assert loss_of(model).item() < first


@pytest.mark.parametrize("case", cases(("8bit", "AdamW"),
                                       skip=limited("param_group_with_lrscheduler")))
def test_param_group_with_lrscheduler_goes_right_direction(case: Case) -> None:
    model = model_for(case)
    _, opt = build(case, [{"params": [model.weight]}, {"params": [model.bias], "lr": 0.01}],
                   model=model)
    schedulers = [lr_scheduler.StepLR(opt, 5, 0.9), lr_scheduler.ExponentialLR(opt, 0.95)]
    first = loss_of(model).item()
    for i in range(20):
        step(case, model, opt, seed=i)
        for s in schedulers:
            s.step()
    assert loss_of(model).item() < first
    assert opt.param_groups[1]["lr"] == pytest.approx(0.01 * 0.9 ** 4 * 0.95 ** 20)


@pytest.mark.parametrize("case", cases(("grad32", "AdamW"),
                                       skip=lambda c: c.name in ("Lion", "Adafactor")))
def test_tensor_lr(case: Case) -> None:
    """A tensor lr steps as the same float lr does."""
    lr = 1.0 if case.closure_needed else 1e-3
    a = build(case, lr=lr)
    try:
        b = build(case, lr=torch.tensor(lr))
    except ValueError as e:
        assert "lr as a Tensor is not supported" in str(e)
        return
    parallel(case, [a, b], 5)
    same(stored(a[0]), stored(b[0]), close=1)
    same(truth(a[1], a[0]), truth(b[1], b[0]), close=1)


class ComplexToy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.z = nn.Parameter(torch.randn(8, 5, dtype=torch.complex64, generator=gen))
        self.w = nn.Parameter(torch.randn(8, 5, generator=gen))


@pytest.mark.parametrize("case", cases(("masters", "Adam"), layouts=(
    "plain", "masters", "grad32", "stochastic"), skip=lambda c: c.name in ("Lion", "Adafactor")))
def test_complex(case: Case) -> None:
    """A complex64 parameter gets no real master (which would drop its imaginary part): it is
    stepped exactly as the class steps it (and, for a pointwise class, as the class steps its
    real view, as torch's check asks), beside a real parameter that has one."""
    model = pa.apply(ComplexToy(), default=case.spec)
    assert model.z.dtype == torch.complex64
    # LBFGS steps all its parameters as one vector: there, the complex one alone
    opt = pa.optimizer(model, case.cls, [model.z] if case.closure_needed else None,
                       **case.kwargs)
    twin = nn.Parameter(model.z.detach().clone())
    real = nn.Parameter(torch.view_as_real(model.z.detach()).clone())
    plain, as_real = case.cls([twin], **case.kwargs), case.cls([real], **case.kwargs)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        grad = torch.randn(8, 5, 2, generator=gen)
        model.z.grad = torch.view_as_complex(grad.clone())
        twin.grad, real.grad = torch.view_as_complex(grad.clone()), grad.clone()
        model.w.grad = grad_like(model.w, 0.5)
        loss = torch.randn(1, generator=gen)
        for o in (opt, plain, as_real):
            o.step(lambda loss=loss: loss) if case.closure_needed else o.step()
    assert opt.master(model.z) is None and model.z.imag.abs().sum() > 0
    same(model.z.detach(), twin.detach())
    same(torch.view_as_real(model.z.detach()), real.detach(), close=1)
    assert case.layout in ("plain", "stochastic") or case.closure_needed or (
        opt.master(model.w) is not None)


def _compare_flag(case: Case, flag: str, steps: int = 7) -> None:
    pairs = []
    for value in (False, True):
        model = model_for(case)
        pairs.append(build(case, model=model, **{flag: value}))
    for i in range(steps):
        for model, opt in pairs:
            if i == 3:
                model.weight.requires_grad_(False)  # frozen two steps, as torch's check does
            if i == 5:
                model.weight.requires_grad_(True)
            opt.zero_grad()
            with torch.random.fork_rng():
                torch.manual_seed(i)
                if i != 2:
                    loss_of(model).backward()
                opt.step()
    (m0, o0), (m1, o1) = pairs
    tol = {"rtol": 1e-5, "atol": 1e-6}
    same(truth(o0, m0), truth(o1, m1), **tol)
    for p0, p1 in zip(m0.parameters(), m1.parameters(), strict=True):
        same({k: v for k, v in o0.state[p0].items()}, {k: v for k, v in o1.state[p1].items()},
             **tol)


@pytest.mark.parametrize("case", cases(("grad32", "RMSprop"), classes=FOREACH))
def test_foreach_matches_forloop(case: Case) -> None:
    _compare_flag(case, "foreach")


@pytest.mark.parametrize("case", cases(("masters", "Adam"), classes=FUSED,
                                       layouts=("plain", "masters", "stochastic", "grad32")))
def test_fused_matches_forloop(case: Case) -> None:
    _compare_flag(case, "fused")


@pytest.mark.parametrize("case", cases(("8bit", "AdamW"), layouts=("8bit",)))
def test_fused_is_refused_on_a_low_bit_state_naming_it(case: Case) -> None:
    model = model_for(case)
    with pytest.raises(ValueError, match=r"optim=8bit for 2 parameter\(s\), e.g. 'weight', runs "
                                         r"through torchao's Adam update, which has no fused "
                                         r"form: fused=True cannot be honoured there"):
        pa.optimizer(model, case.cls, lr=1e-3, fused=True)


@pytest.mark.parametrize("case", cases(("8bit", "Adam"), layouts=("8bit",)))
def test_amsgrad_is_refused_on_a_low_bit_state_naming_it(case: Case) -> None:
    """torchao's update cannot read a low-bit max_exp_avg_sq (its own AdamW8bit fails too)."""
    with pytest.raises(ValueError, match=r"has no amsgrad form: amsgrad=True cannot be "
                                         r"honoured there"):
        pa.optimizer(model_for(case), case.cls, lr=1e-3, amsgrad=True)


@pytest.mark.parametrize("case", cases(("stochastic", "Adagrad"),
                                       skip=limited("param_groups_weight_decay")))
def test_param_groups_weight_decay(case: Case) -> None:
    model = model_for(case)
    kwargs = {k: v for k, v in case.kwargs.items()}
    _, opt = build(case, [dict(params=[model.weight], **kwargs),
                          dict(params=[model.bias], **{**kwargs, "weight_decay": 0.0})],
                   model=model)
    first = loss_of(model).item()
    for i in range(20):
        step(case, model, opt, seed=i)
    assert loss_of(model).item() < first
    assert opt.param_groups[1]["weight_decay"] == 0.0


class Irrelevant(Toy):
    def __init__(self) -> None:
        super().__init__()
        self.irrelevant = nn.Parameter(torch.randn(64))


@pytest.mark.parametrize("case", cases(("masters", "NAdam"), skip=lambda c: c.name == "LBFGS"))
def test_param_groups_lr(case: Case) -> None:
    """A group at lr 1e-28 leaves its parameter as it was, whatever its gradient."""
    model = pa.apply(Irrelevant(), default=case.spec)
    kwargs = {k: v for k, v in case.kwargs.items() if k != "lr"}
    outer = {"lr": 1e-28, **({"step_sizes": (0, 50)} if case.name == "Rprop" else {})}
    opt = pa.optimizer(model, case.cls, [dict(params=[model.weight, model.bias],
                                              lr=case.kwargs["lr"], **kwargs),
                                         dict(params=[model.irrelevant])], **outer)
    before = model.irrelevant.detach().clone()
    first = loss_of(model).item()
    for i in range(20):
        opt.zero_grad()
        loss_of(model).backward()
        model.irrelevant.grad = torch.rand_like(model.irrelevant,
                                                dtype=model.irrelevant.grad_dtype)
        with torch.random.fork_rng():
            torch.manual_seed(i)
            opt.step()
    assert loss_of(model).item() < first
    same(model.irrelevant.detach(), before)


@pytest.mark.parametrize("case", cases(("8bit", "Adam")))
def test_step_is_noop_when_params_have_no_grad(case: Case) -> None:
    model, opt = build(case)
    model.requires_grad_(False)
    before = stored(model)
    opt.step(lambda: torch.tensor([1.0]))
    same(stored(model), before)
    assert all(opt.master(p) is None for p in model.parameters())


@pytest.mark.parametrize("case", cases(("stochastic", "Adadelta"),
                                       skip=lambda c: c.name in ("ASGD", "Lion")))
def test_step_is_noop_for_zero_grads(case: Case) -> None:
    takes = inspect.signature(case.cls.__init__).parameters
    kwargs: dict[str, Any] = {"weight_decay": 0.0} if "weight_decay" in takes else {}
    if case.name == "AdamW":
        kwargs["lr"] = 1e-5
    model, opt = build(case, **kwargs)
    before = stored(model)
    for p in model.parameters():
        p.grad = grad_like(p)
    opt.step(lambda: torch.tensor([1.0]))
    same(stored(model), before)


@pytest.mark.parametrize("case", cases(("8bit", "AdamW")))
def test_optimizer_can_be_printed(case: Case) -> None:
    model, opt = build(case)
    step(case, model, opt)
    text = repr(opt)
    assert text.startswith(f"{case.cls.__name__} (") and "updated by precision_annot" in text


def _named(model: nn.Module, named: bool) -> Any:
    return list(model.named_parameters()) if named else list(model.parameters())


@pytest.mark.parametrize("named", [(False, False), *(pytest.param(n, marks=pytest.mark.slow)
                                                      for n in ((True, False), (False, True)))],
                         ids=["unnamed", "named-from", "named-to"])
@pytest.mark.parametrize("case", cases(("8bit", "AdamW"), skip=limited("state_dict_deterministic")))
def test_state_dict_deterministic(case: Case, named: tuple[bool, bool]) -> None:
    """A second optimizer loaded from the first's state dict steps as it does, and their
    state dicts are equal; repeated groups are saved alike."""
    model = model_for(case)
    _, opt = build(case, _named(model, named[0]), model=model)
    for i in range(10):
        step(case, model, opt, seed=i)
    twin = model_for(case, seed=1)  # other values: the masters and the checkpoint set them
    twin.load_state_dict(model.state_dict())
    _, twin_opt = build(case, _named(twin, named[1]), model=twin)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    parallel(case, [(model, opt), (twin, twin_opt)], 10, start=10)
    same(stored(model), stored(twin))
    same(truth(opt, model), truth(twin_opt, twin))

    def without_names(sd: dict[str, Any]) -> dict[str, Any]:
        sd = copy.deepcopy(sd)
        for g in sd["param_groups"]:
            g.pop("param_names", None)
        return sd

    same(without_names(opt.state_dict()), without_names(twin_opt.state_dict()))
    twin_opt.param_groups.extend(twin_opt.param_groups)
    same(without_names(opt.state_dict())["param_groups"][-1],
         without_names(twin_opt.state_dict())["param_groups"][-1])


NEW_FLAGS = ("maximize", "foreach", "fused", "differentiable", "capturable",
             "decoupled_weight_decay")


@pytest.mark.parametrize("case", cases(("grad32", "NAdam")))
def test_can_load_older_state_dict(case: Case) -> None:
    model, opt = build(case)
    for i in range(3):
        step(case, model, opt, seed=i)
    old = copy.deepcopy(opt.state_dict())
    for group in old["param_groups"]:
        for flag in OLD_FLAGS.get(case.name, NEW_FLAGS):
            group.pop(flag, None)
    opt.load_state_dict(old)
    step(case, model, opt)


@pytest.mark.parametrize("named", [(True, False), *(pytest.param(n, marks=pytest.mark.slow)
                                                     for n in ((False, True), (True, True)))],
                         ids=["named-unnamed", "unnamed-named", "named-named"])
@pytest.mark.parametrize("case", cases(("masters", "RAdam"),
                                       skip=limited("can_load_from_to_named_state_dict")))
def test_can_load_from_to_named_state_dict(case: Case, named: tuple[bool, bool]) -> None:
    model = model_for(case)
    _, opt = build(case, _named(model, named[0]), model=model)
    for i in range(3):
        step(case, model, opt, seed=i)
    _, again = build(case, _named(model, named[1]), model=model)
    again.load_state_dict(copy.deepcopy(opt.state_dict()))
    step(case, model, again)
    assert again.state_dict()["param_groups"][0]["param_names"] == ["weight", "bias"]


@pytest.mark.parametrize("named", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["unnamed", "named"])
@pytest.mark.parametrize("case", cases(("8bit", "AdamW")))
def test_save_load_equality_with_weights_only(case: Case, named: bool) -> None:
    """The state dict (masters, 8-bit states) saves and loads back equal, also with
    `weights_only=True`, which refuses tensor subclasses."""
    model = model_for(case)
    _, opt = build(case, _named(model, named), model=model)
    for i in range(3):
        step(case, model, opt, seed=i)
    saved = opt.state_dict()
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    for weights_only in (False, True):
        buffer.seek(0)
        same(torch.load(buffer, weights_only=weights_only), saved)


@pytest.mark.parametrize("case", cases(("8bit", "Adam")))
def test_load_nontensor_step(case: Case) -> None:
    model, opt = build(case)
    for i in range(3):
        step(case, model, opt, seed=i)
    sd = copy.deepcopy(opt.state_dict())
    for state in sd["state"].values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].item()
    opt.load_state_dict(sd)
    step(case, model, opt)
    steps = [float(s["step"]) for s in opt.state.values() if "step" in s]
    assert all(s == 4 for s in steps), steps  # SGD keeps none


def _sd_pre(opt: Any) -> None:
    opt.state["test"] = 1


def _sd_post(opt: Any, sd: dict[str, Any]) -> dict[str, Any]:
    sd["ran_state_dict_pre_hook"] = sd["state"].pop("test", None) is not None
    return sd


@pytest.mark.parametrize("case", cases(("stochastic", "RMSprop")))
def test_state_dict_pre_post_hooks(case: Case) -> None:
    """test_state_dict_pre_hook, _post_hook and _pre_post_hook: each fires once per call."""
    model, opt = build(case)
    step(case, model, opt)
    calls: list[str] = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))
    opt.register_state_dict_pre_hook(_sd_pre)
    assert opt.state_dict()["state"]["test"] == 1
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("post"))
    opt.register_state_dict_post_hook(_sd_post)
    sd = opt.state_dict()
    assert "test" not in sd["state"] and sd["ran_state_dict_pre_hook"] is True
    assert calls == ["pre", "pre", "post"]


def _load_pre_1(opt: Any, sd: dict[str, Any]) -> None:
    sd["param_groups"][0]["lr"] = 0.002


def _load_pre_2(opt: Any, sd: dict[str, Any]) -> dict[str, Any]:
    mine = copy.deepcopy(sd)
    mine["param_groups"][0]["lr"] = 0.003
    return mine


def _load_post(opt: Any) -> None:
    opt.state["ran_load_state_dict_pre_hook2"] = opt.param_groups[0]["lr"] == 0.003
    opt.state["ran_load_state_dict_post_hook"] = True


@pytest.mark.parametrize("case", cases(("masters", "SGD"),
                                       skip=limited("load_state_dict_pre_hook_and_prepend")))
def test_load_state_dict_pre_hook_and_prepend(case: Case) -> None:
    model, opt = build(case)
    step(case, model, opt)
    sd = opt.state_dict()
    opt.register_load_state_dict_pre_hook(_load_pre_1)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.002
    opt.register_load_state_dict_pre_hook(_load_pre_2, prepend=True)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.002  # prepended: the other hook overrides it
    step(case, model, opt)


@pytest.mark.parametrize("case", cases(("masters", "SGD"),
                                       skip=limited("load_state_dict_post_hook")))
def test_load_state_dict_post_hook(case: Case) -> None:
    model, opt = build(case)
    step(case, model, opt)
    opt.register_load_state_dict_post_hook(_load_post)
    opt.load_state_dict(opt.state_dict())
    assert opt.state["ran_load_state_dict_pre_hook2"] is False
    assert opt.state["ran_load_state_dict_post_hook"] is True
    step(case, model, opt)


@pytest.mark.parametrize("case", cases(("8bit", "AdamW"),
                                       skip=limited("load_state_dict_pre_post_hook")))
def test_load_state_dict_pre_post_hook(case: Case) -> None:
    model, opt = build(case)
    step(case, model, opt)
    opt.register_load_state_dict_pre_hook(_load_pre_2)
    opt.register_load_state_dict_post_hook(_load_post)
    opt.load_state_dict(opt.state_dict())
    assert opt.state["ran_load_state_dict_pre_hook2"] is True
    assert opt.state["ran_load_state_dict_post_hook"] is True
    if case.layout == "8bit":
        assert type(opt.state[model.weight]["exp_avg"]).__name__ == "OptimState8bit"


@pytest.mark.parametrize("case", cases(("8bit", "Adam")))
def test_step_pre_and_post_hook(case: Case) -> None:
    """test_step_pre_hook and test_step_post_hook: each fires once per step, and not after
    its handle is removed."""
    model, opt = build(case)
    data = {"pre": 0, "post": 0}
    pre = opt.register_step_pre_hook(lambda o, a, k: data.__setitem__("pre", data["pre"] + 1))
    post = opt.register_step_post_hook(lambda o, a, k: data.__setitem__("post", data["post"] + 1))
    step(case, model, opt)
    step(case, model, opt)
    assert data == {"pre": 2, "post": 2}
    pre.remove()
    post.remove()
    step(case, model, opt)
    assert data == {"pre": 2, "post": 2}


@pytest.mark.parametrize("case", cases(("stochastic", "LBFGS")))
def test_step_all_hooks(case: Case) -> None:
    """Global and per-optimizer hooks in torch's order, once per step, beside a plain SGD."""
    model, opt = build(case)
    other = torch.optim.SGD([nn.Parameter(torch.zeros(2))])
    data: list[int] = []
    handles = [register_optimizer_step_pre_hook(lambda o, a, k: data.append(0)),
               register_optimizer_step_post_hook(lambda o, a, k: data.append(5))]
    try:
        handles += [opt.register_step_pre_hook(lambda o, a, k: data.append(1)),
                    opt.register_step_post_hook(lambda o, a, k: data.append(2)),
                    other.register_step_pre_hook(lambda o, a, k: data.append(1)),
                    other.register_step_post_hook(lambda o, a, k: data.append(2))]
        step(case, model, opt)
        assert data == [0, 1, 2, 5]
        other.step()
        step(case, model, opt)
        assert data == [0, 1, 2, 5] * 3
    finally:
        for handle in handles:
            handle.remove()
    step(case, model, opt)
    assert data == [0, 1, 2, 5] * 3


@pytest.mark.parametrize("case", cases(("8bit", "AdamW")))
def test_deepcopy_copies_all_public_attrs(case: Case) -> None:
    """And the copy, masters and low-bit states included, steps as the original does."""
    model, opt = build(case)
    for i in range(3):
        step(case, model, opt, seed=i)

    def public(obj: Any) -> set[str]:
        return {k for k in obj.__dict__ if not k.startswith("_")}

    pair = copy.deepcopy((model, opt))
    assert public(pair[1]) == public(opt) and type(pair[1]) is type(opt)
    parallel(case, [(model, opt), pair], 3, start=3)
    same(truth(opt, model), truth(pair[1], pair[0]))


@pytest.mark.parametrize("case", cases(("masters", "Adam"), skip=lambda c: c.closure_needed))
def test_step_with_a_closure_equals_closure_then_step(case: Case) -> None:
    """`step(closure)` with a closure that zeroes the gradients and re-evaluates the model
    (the form torch's older checks use) steps as calling the closure, then `step()`."""
    a, b = build(case), build(case)
    for i in range(4):
        with torch.random.fork_rng():
            torch.manual_seed(i)
            a[1].step(lambda: _closure(*a))
        with torch.random.fork_rng():
            torch.manual_seed(i)
            _closure(*b)
            b[1].step()
    same(truth(a[1], a[0]), truth(b[1], b[0]))


def _closure(model: Toy, opt: Any) -> torch.Tensor:
    opt.zero_grad()
    loss = loss_of(model)
    loss.backward()
    return loss


@pytest.mark.parametrize("case", cases(("masters", "LBFGS"), classes=("LBFGS",)))
def test_second_order_optims_return_consistent_types(case: Case) -> None:
    model = model_for(case)
    results = []
    for tolerance in (float("inf"), -float("inf")):
        _, opt = build(case, model=model, tolerance_grad=tolerance)
        for p in model.parameters():
            p.grad = grad_like(p, 1.0)
        results.append(opt.step(lambda: torch.tensor([10.0])))
    assert type(results[0]) is type(results[1])


@pytest.mark.parametrize("case", cases(("stochastic", "SGD")))
def test_non_empty_state(case: Case) -> None:
    model, opt = build(case)
    step(case, model, opt)
    assert opt.state and all(len(s) > 0 for s in opt.state.values())
    assert set(opt.state) <= set(model.parameters())  # keyed by the model's own parameters


# -- what the issue adds to torch's checks ------------------------------------------------

@pytest.mark.parametrize("case", cases(("masters", "AdamW")))
def test_it_is_the_class_with_its_defaults_and_one_cycle_works(case: Case) -> None:
    model, opt = build(case)
    plain = case.cls([nn.Parameter(torch.zeros(2))], **case.kwargs)
    assert isinstance(opt, case.cls) and isinstance(opt, pa.PlanOptimizer)
    assert opt.defaults == plain.defaults
    if "betas" in opt.defaults or "momentum" in opt.defaults:
        scheduler = lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=10)
        for i in range(10):
            step(case, model, opt, seed=i)
            scheduler.step()


@pytest.mark.parametrize("case", cases(("grad32", "Adagrad"), skip=limited("add_param_group")))
def test_add_param_group_is_stepped(case: Case) -> None:
    model = model_for(case)
    _, opt = build(case, [model.weight], model=model)
    step(case, model, opt)
    bias = model.bias.detach().clone()
    opt.add_param_group({"params": [model.bias]})
    step(case, model, opt, seed=1)
    assert not torch.equal(model.bias.detach(), bias) and model.bias in opt.state
    assert opt.rule(model.bias).describe() == opt.rule(model.weight).describe()


@pytest.mark.parametrize("case", cases(("8bit", "AdamW")))
def test_pickling_round_trips_and_continues(case: Case) -> None:
    model, opt = build(case)
    for i in range(3):
        step(case, model, opt, seed=i)
    again_model, again = pickle.loads(pickle.dumps((model, opt)))
    assert type(again) is type(opt)
    parallel(case, [(model, opt), (again_model, again)], 3, start=3)
    same(stored(model), stored(again_model))
    same(truth(opt, model), truth(again, again_model))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("case", cases(("grad32", "AdamW"), layouts=("masters", "8bit",
                                                                     "stochastic", "grad32")))
def test_a_copy_of_an_optimizer_built_before_apply_steps_as_the_original(
        case: Case, how: str) -> None:
    """Built first, then `apply` (the order a schedule takes): a deepcopy or an unpickled copy
    of (model, optimizer) mid-run steps as the original does, weights, masters and moments bit
    for bit (measured before: the copy's rule was "as stored", the build's, and its first step
    raised torch's "expected dtype c10::BFloat16 for `end` but got dtype float")."""
    model = Toy()
    opt = pa.optimizer(model, case.cls, **case.kwargs)
    accumulate_as_planned(pa.apply(model, default=case.spec))
    parallel(case, [(model, opt)], 3)
    pair = (copy.deepcopy((model, opt)) if how == "deepcopy"
            else pickle.loads(pickle.dumps((model, opt))))
    assert [pair[1].rule(p) for p in pair[0].parameters()] == [
        opt.rule(p) for p in model.parameters()]
    parallel(case, [(model, opt), pair], 3, start=3)
    same(stored(model), stored(pair[0]))
    same(truth(opt, model), truth(pair[1], pair[0]))
    same(opt.state_dict(), pair[1].state_dict())


def _schedulers(opt: Any) -> list[Any]:
    one = lambda: lr_scheduler.StepLR(opt, 2)  # noqa: E731
    cycle = "betas" in opt.defaults or "momentum" in opt.defaults
    return [
        lr_scheduler.LambdaLR(opt, lambda e: 0.9 ** e),
        lr_scheduler.MultiplicativeLR(opt, lambda e: 0.95),
        lr_scheduler.StepLR(opt, 2),
        lr_scheduler.MultiStepLR(opt, [2, 4]),
        lr_scheduler.ConstantLR(opt, 0.5, 3),
        lr_scheduler.LinearLR(opt, 0.5, 1.0, 3),
        lr_scheduler.ExponentialLR(opt, 0.9),
        lr_scheduler.SequentialLR(opt, [one(), lr_scheduler.ExponentialLR(opt, 0.9)], [3]),
        lr_scheduler.CosineAnnealingLR(opt, 5),
        lr_scheduler.ChainedScheduler([one(), lr_scheduler.ExponentialLR(opt, 0.9)]),
        lr_scheduler.CyclicLR(opt, 1e-4, 1e-2, cycle_momentum=cycle),
        lr_scheduler.OneCycleLR(opt, 1e-2, total_steps=20, cycle_momentum=cycle),
        lr_scheduler.CosineAnnealingWarmRestarts(opt, 3),
        lr_scheduler.PolynomialLR(opt, 6),
        lr_scheduler.ReduceLROnPlateau(opt),
    ]


@pytest.mark.parametrize("case", cases(("stochastic", "AdamW")))
def test_every_lr_scheduler(case: Case) -> None:
    for index in range(len(_schedulers(build(case)[1]))):
        model, opt = build(case)
        scheduler = _schedulers(opt)[index]
        lrs = []
        for i in range(6):
            loss = step(case, model, opt, seed=i)
            scheduler.step(loss) if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau) else (
                scheduler.step())
            lrs.append(opt.param_groups[0]["lr"])
        assert all(lr >= 0 for lr in lrs), (type(scheduler).__name__, lrs)
        if not isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
            assert len(set(lrs)) > 1, type(scheduler).__name__


@pytest.mark.parametrize("case", cases(("grad32", "SGD")))
def test_zero_grad(case: Case) -> None:
    model, opt = build(case)
    for set_to_none in (False, True):
        loss_of(model).backward()
        opt.zero_grad(set_to_none=set_to_none)
        assert all((p.grad is None) if set_to_none else (p.grad.abs().sum() == 0)
                   for p in model.parameters())
    step(case, model, opt)


@pytest.mark.parametrize("case", cases(("masters", "AdamW")))
def test_a_module_frozen_at_build_and_unfrozen_later_moves(case: Case) -> None:
    """As with torch: the frozen parameter is in the groups, skipped while it has no gradient,
    stepped (through its master) once it has one."""
    model = model_for(case)
    model.bias.requires_grad_(False)
    _, opt = build(case, model=model)
    assert any(p is model.bias for g in opt.param_groups for p in g["params"])
    frozen = model.bias.detach().clone()
    step(case, model, opt)
    same(model.bias.detach(), frozen)
    assert opt.master(model.bias) is None
    model.bias.requires_grad_(True)
    before = model.bias.detach().clone()
    step(case, model, opt, seed=1)
    assert not torch.equal(model.bias.detach(), before)
    assert case.layout != "masters" or opt.master(model.bias) is not None


@pytest.mark.parametrize("case", cases(("masters", "AdamW"), classes=(
    "AdamW", "Adam", "SGD", "RMSprop", "Adagrad")))  # the classes plan.memory knows
def test_state_holds_masters_and_moments_keyed_by_the_model_parameters(case: Case) -> None:
    model, opt = build(case)
    step(case, model, opt)
    assert set(opt.state) == set(model.parameters())
    plan = pa.applied_plan(model)
    assert plan is not None
    figure = plan.memory(case.cls, **case.kwargs)
    assert state_bytes(opt) == figure.total("master_bytes") + figure.total("state_bytes")


@pytest.mark.parametrize("case", cases(("grad32", "AdamW"), skip=lambda c: (
    c.layout == "grad32" and c.name not in ("Adam", "AdamW", "SGD")) or limited(
        "distributed_checkpoint")(c)))
def test_distributed_checkpoint_state_dict_round_trips(case: Case) -> None:
    """`torch.distributed.checkpoint`'s get_optimizer_state_dict / set_optimizer_state_dict,
    on one process: a new optimizer set from it steps as the original does. (With grad=fp32
    for Adam, AdamW and SGD only: DCP initialises the empty state of another class by
    assigning each parameter a zero gradient of the parameter's own dtype, which
    `grad_dtype=float32` refuses; the state of those three is known before their first
    step, and DCP is told so.)"""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model, opt = build(case)
    for i in range(3):
        step(case, model, opt, seed=i)
    saved = copy.deepcopy(get_optimizer_state_dict(model, opt))
    assert set(saved["state"]) == ({"weight"} if case.name == "LBFGS" else {"weight", "bias"})
    twin = model_for(case, seed=1)
    twin.load_state_dict(model.state_dict())
    _, twin_opt = build(case, model=twin)
    set_optimizer_state_dict(twin, twin_opt, saved)
    same(truth(opt, model), truth(twin_opt, twin))
    parallel(case, [(model, opt), (twin, twin_opt)], 3, start=3)
    same(truth(opt, model), truth(twin_opt, twin))



@pytest.mark.slow  # torch.compile's start-up
@pytest.mark.parametrize("case", cases(("masters", "AdamW"), layouts=("masters",),
                                       classes=("AdamW",)))
def test_a_compiled_step_steps_as_the_eager_one(case: Case) -> None:
    """`torch.compile(optimizer.step)`, as torch's docs show: the planned step runs as it is
    (its stand-ins change every step), bit for bit the eager one."""
    a, b = build(case), build(case)
    compiled = torch.compile(a[1].step)
    for _ in range(3):
        for model, opt, run in ((*a, compiled), (*b, b[1].step)):
            opt.zero_grad()
            loss_of(model).backward()
            run()
    same(truth(a[1], a[0]), truth(b[1], b[0]))
