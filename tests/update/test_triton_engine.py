"""The optimizer's step through the Triton kernel (`engines.step_functions`), run by Triton's
interpreter on CPU tensors, against the same training loop through the fused route.

A training run takes the kernel on an NVIDIA GPU only; here `update_triton`'s test-only switch
(`_TEST_ONLY_INTERPRETED_CPU`) lets the engines take it for the CPU while Triton's interpreter
runs, so that the whole path (the engine's choice, the canary on the device's first step, the
launches) runs as it runs on a GPU. The model's sizes are odd for the kernel (two programs,
whole blocks and parts of one, a dozen small tensors, a 0-size parameter) and multiples of 16
for torch's CPU kernel, whose scalar tail (the last `numel % 8` or `% 16` elements) contracts an
fma the other way (tests/update/test_triton.py bounds that directly): on these sizes the loops
agree bit for bit, step after step.
"""

from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import precision_annot as pa
from precision_annot._src import update_kernels, update_triton
from precision_annot._src.update import engines

bf16, fp32 = torch.bfloat16, torch.float32
CPU = torch.device("cpu")


def _triton_version() -> tuple[int, ...]:
    try:
        import triton
    except ImportError:
        return ()
    return tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())


#: the interpreter runs the kernels only with Triton 3.9 or newer (update_triton.MIN_TRITON)
needs_triton = pytest.mark.skipif(_triton_version() < update_triton.MIN_TRITON,
                                  reason="the kernels need triton>=3.9")


class Launches:
    """The kernel launches of a run: (kernel, number of tensors)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: list[tuple[str, int]] = []
        launch = update_triton._launch

        def recorded(kernel: Any, programs: int, args: list[Any], *rest: Any) -> None:
            name = "sgd" if "B" in rest[0] else "adam"
            self.seen.append((name, int(args[-2])))
            launch(kernel, programs, args, *rest)

        monkeypatch.setattr(update_triton, "_launch", recorded)

    def of(self, tensors: int) -> int:
        return sum(n == tensors for _, n in self.seen)


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[Launches]:
    """The interpreter on, the engines taking the kernels for the CPU, no verdict yet, and the
    launches recorded."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(update_triton.SWITCH, raising=False)
    monkeypatch.setattr(update_triton, "_TEST_ONLY_INTERPRETED_CPU", True)
    monkeypatch.setattr(update_triton, "_VERDICTS", {})
    yield Launches(monkeypatch)


# -- the model and its loop --------------------------------------------------------------------

class Net(nn.Module):
    """`a.weight`: 4,160 elements (two programs of the kernel, the second of 64), `b.weight`:
    2,112 (two whole blocks of 1,024 and a part), 12 scales of 16 to 64 elements, and a 0-size
    parameter: 16 tensors in one launch."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(65, 64)
        self.scales = nn.ParameterList(
            [nn.Parameter(torch.randn(16 * (1 + k % 4)) * 0.1) for k in range(12)])
        self.empty = nn.Parameter(torch.zeros(0))
        self.b = nn.Linear(64, 33, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        for s in self.scales:
            n = s.numel()
            h = torch.cat([h[:, :n] * (1 + s), h[:, n:]], 1)
        return self.b(torch.tanh(h) + self.empty.sum())  # type: ignore[no-any-return]


TENSORS = 16
CASES: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "AdamW, fused=True": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1,
                                              "fused": True}),
    "SGD, nesterov momentum, weight decay": (torch.optim.SGD, {
        "lr": 5e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
}
#: over make test's budget: run by make test-all
SLOW_CASES: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "Adam, weight decay, amsgrad": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.01,
                                                       "amsgrad": True}),
    "SGD, dampened momentum, maximize": (torch.optim.SGD, {
        "lr": 5e-2, "momentum": 0.9, "dampening": 0.1, "maximize": True}),
    "AdamW, beta1=0.3, a tensor lr": (torch.optim.AdamW, {
        "lr": torch.tensor(3e-3), "betas": (0.3, 0.99), "weight_decay": 0.1}),
}


def train(cls: type[torch.optim.Optimizer], hyper: dict[str, Any], steps: int = 2,
          spec: str = "bf16-true,master=fp32") -> tuple[nn.Module, Any]:
    """`steps` steps of a planned optimizer: bf16 weights and gradients, fp32 masters."""
    torch.manual_seed(0)
    model = pa.apply(Net(), default=spec)
    opt = pa.optimizer(model, cls, **hyper)
    for i in range(steps):
        g = torch.Generator().manual_seed(100 + i)
        x, y = torch.randn(8, 65, generator=g), torch.randn(8, 33, generator=g)
        opt.zero_grad()
        (model(x.to(bf16)).float() - y).pow(2).mean().backward()
        opt.step()
    return model, opt


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def assert_same_run(ours: tuple[nn.Module, Any], ref: tuple[nn.Module, Any]) -> None:
    """Weights, masters and every state tensor, bit for bit."""
    (model, opt), (ref_model, ref_opt) = ours, ref
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        assert p.dtype == bf16 and same(p, q), name
        assert same(opt.master(p), ref_opt.master(q)), name
        state, ref_state = opt.state[p], ref_opt.state[q]
        assert state.keys() == ref_state.keys(), name
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert same(value, ref_state[key]), f"{name} {key}"


# -- the loops ---------------------------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("case", [*CASES, *(pytest.param(c, marks=pytest.mark.slow)
                                           for c in SLOW_CASES)])
def test_a_training_loop_through_the_kernel_is_the_fused_routes_bit_for_bit(
        case: str, launches: Launches, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the kernel (one launch of all 16 tensors a step, after the canary's) and
    through the fused route, the same loop ends with the same weights, masters and states."""
    cls, hyper = {**CASES, **SLOW_CASES}[case]
    ours = train(cls, hyper)
    assert launches.of(TENSORS) == 2
    assert update_triton._VERDICTS == {CPU: True}  # the canary ran, and agreed
    monkeypatch.setattr(update_triton, "_TEST_ONLY_INTERPRETED_CPU", False)
    launches.seen.clear()
    ref = train(cls, hyper)
    assert launches.seen == []
    assert_same_run(ours, ref)


@needs_triton
@pytest.mark.slow  # over make test's budget: run by make test-all
def test_fp32_gradients_accumulated_are_read_as_the_fused_route_reads_them(
        launches: Launches, monkeypatch: pytest.MonkeyPatch) -> None:
    """"bf16-master" (DeepSpeed's layout: fp32 gradients) with AdamW."""
    hyper = {"lr": 1e-2, "weight_decay": 0.1}
    ours = train(torch.optim.AdamW, hyper, spec="bf16-master")
    assert launches.of(TENSORS) == 2
    monkeypatch.setattr(update_triton, "_TEST_ONLY_INTERPRETED_CPU", False)
    assert_same_run(ours, train(torch.optim.AdamW, hyper, spec="bf16-master"))


@needs_triton
@pytest.mark.slow  # over make test's budget: run by make test-all
def test_a_parameter_unfrozen_mid_run_starts_its_momentum_through_the_kernel_too(
        launches: Launches, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGD with momentum, `b.weight` frozen for the first step: at the second its buffer starts
    in a call of its own (torch's fused SGD starts every buffer of a call at once), beside the
    others' call, through the kernel as through the fused route."""
    def run() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        model = pa.apply(Net(), default="bf16-true,master=fp32")
        opt = pa.optimizer(model, torch.optim.SGD, lr=5e-2, momentum=0.9)
        for i in range(3):
            model.b.weight.requires_grad_(i > 0)
            g = torch.Generator().manual_seed(100 + i)
            x, y = torch.randn(8, 65, generator=g), torch.randn(8, 33, generator=g)
            opt.zero_grad()
            (model(x.to(bf16)).float() - y).pow(2).mean().backward()
            opt.step()
        return model, opt

    ours = run()
    assert launches.seen[-4:] == [("sgd", TENSORS - 1)] * 2 + [("sgd", 1)] + [
        ("sgd", TENSORS)]  # (step 2: the held buffers, then the new one)
    monkeypatch.setattr(update_triton, "_TEST_ONLY_INTERPRETED_CPU", False)
    assert_same_run(ours, run())


# -- the canary and the fallback ---------------------------------------------------------------

def perturbed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's Adam made wrong in one bit: the last bit of the first master's first
    element flipped after each call."""
    adam = update_triton.adam

    def wrong(params: list[torch.Tensor], *args: Any, **kwargs: Any) -> None:
        adam(params, *args, **kwargs)
        with torch.no_grad():
            bits(params[0])[:1] ^= 1

    monkeypatch.setattr(update_triton, "adam", wrong)


@needs_triton
def test_a_kernel_that_disagrees_on_the_canary_leaves_the_step_to_the_fused_route(
        launches: Launches, monkeypatch: pytest.MonkeyPatch) -> None:
    """One warning says what differed (and how to report it); the loop is then the fused
    route's, for this optimizer and the next one on the device, with no second warning."""
    perturbed(monkeypatch)
    with pytest.warns(UserWarning) as caught:
        ours = train(torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
        sgd = train(torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9})
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert messages[0].startswith(
        "precision_annot: the Triton masters step failed its check on cpu (cpu; torch ")
    assert ("AdamW's params[0] (shape (4160,), torch.float32) differs in 1 of its first "
            "4160 elements, the first at [0]: ") in messages[0]
    assert f"as with {update_triton.SWITCH}=0" in messages[0]
    assert "please report this message" in messages[0]
    assert launches.of(TENSORS) == 0  # only the canary's launches ran
    assert update_triton._VERDICTS == {CPU: False}
    assert not update_triton._runs_on(CPU)  # direct calls take the fused route too
    monkeypatch.setattr(update_triton, "_TEST_ONLY_INTERPRETED_CPU", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same_run(ours, train(torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}))
        assert_same_run(sgd, train(torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9}))


@needs_triton
def test_a_kernel_that_raises_on_the_canary_leaves_the_step_to_the_fused_route(
        launches: Launches, monkeypatch: pytest.MonkeyPatch) -> None:
    def fails(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("PTX .version 9.1 does not support .target sm_120")

    monkeypatch.setattr(update_triton, "_launch", fails)
    with pytest.warns(UserWarning, match=r"failed its check on cpu .*: the kernel raised "
                                         r"RuntimeError: PTX \.version 9\.1 does not support"):
        ours = train(torch.optim.AdamW, {"lr": 1e-2}, steps=2)
    assert update_triton._VERDICTS == {CPU: False}
    monkeypatch.setattr(update_triton, "_TEST_ONLY_INTERPRETED_CPU", False)
    assert_same_run(ours, train(torch.optim.AdamW, {"lr": 1e-2}, steps=2))


@needs_triton
def test_the_canary_agrees_and_names_what_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The canary as a GPU runs it, here interpreted: nothing differs; a tail element off by
    more than the bound, or any bit off outside the tail, is named."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert update_triton._canary(CPU) is None
    ref = torch.randn(70)
    ours = ref.clone()
    bits(ours)[65] += 3  # (on the tail: 3 ulps)
    assert update_triton._difference(ours, ref) is None
    ours[65] += 1.0
    assert "on its last 6 elements (torch's scalar tail) by " in str(
        update_triton._difference(ours, ref))
    bits(ours)[3] ^= 1
    assert str(update_triton._difference(ours, ref)).startswith(
        "differs in 1 of its first 64 elements, the first at [3]: ")


# -- what takes the fused route ----------------------------------------------------------------

def test_turned_off_by_the_environment_variable_the_fused_route_steps_with_no_check(
        launches: Launches, monkeypatch: pytest.MonkeyPatch) -> None:
    for value in ("0", "off", "False"):
        monkeypatch.setenv(update_triton.SWITCH, value)
        assert not update_triton.available(CPU)
        assert engines.step_functions([torch.zeros(3)]) is update_kernels
    monkeypatch.setenv(update_triton.SWITCH, "1")
    assert update_triton.available(CPU) == (_triton_version() >= update_triton.MIN_TRITON)
    assert update_triton._VERDICTS == {}  # no canary ran


@pytest.mark.parametrize("triton", ["3.8.1", "none"])
def test_with_triton_older_than_3_9_or_none_the_fused_route_steps(
        triton: str, launches: Launches, monkeypatch: pytest.MonkeyPatch) -> None:
    """`_triton` (what `available` asks) finds no Triton it takes, and the optimizer steps
    through the fused route, with no canary."""
    if triton == "none":
        monkeypatch.setitem(sys.modules, "triton", None)  # (import triton: ImportError)
    else:
        monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__=triton))
    found = update_triton._triton.__wrapped__()  # (uncached)
    assert found is None
    monkeypatch.setattr(update_triton, "_triton", lambda: found)
    assert not update_triton.available(CPU)
    assert not update_triton.available(torch.device("cuda", 0))
    _, opt = train(torch.optim.AdamW, {"lr": 1e-2}, steps=1)
    assert launches.seen == [] and update_triton._VERDICTS == {}
    assert engines.step_functions(list(opt.param_groups[0]["params"])) is update_kernels


@needs_triton
def test_what_the_kernel_hands_the_fused_route_keeps_the_groups_cache(
        launches: Launches) -> None:
    """An fp64 parameter beside an fp32 master in one call: the kernel steps the master, the
    fused route the fp64 one, its loops kept in the cache the engine passes and reused."""
    params = [torch.randn(40), torch.randn(24, dtype=torch.float64)]
    states = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    steps = [torch.tensor(0.0), torch.tensor(0.0)]
    cache: dict[str, Any] = {}
    held = []
    for k in range(2):
        grads = [torch.randn(40).bfloat16(), torch.randn(24, dtype=torch.float64)]
        update_triton.adam(params, grads, states[0], states[1], [], steps, lr=1e-2, beta1=0.9,
                           beta2=0.99, eps=1e-8, weight_decay=0.0, decoupled=True, cache=cache)
        held.append(cache["the Adam step"][2])
        assert [float(s) for s in steps] == [k + 1.0, k + 1.0]
    assert launches.seen == [("adam", 1), ("adam", 1)]
    assert cache["the Adam step"][1]["params"][0] is params[1]  # (the fp64 one only)
    assert held[0] is held[1]
