"""The step's one-pass kernels (`update/engines.py`), through `precision_annot.optimizer`.

Adam, AdamW and SGD step every parameter their kernel takes in one pass through torch's fused
kernels: bit for bit the class's own `fused=True` step over the same presented tensors (the
masters, a working copy, states upcast); a group that asks for `foreach`, `fused=False`,
`differentiable` or `capturable` gets the class's own step. The low-bit update runs through
`update_kernels.lowbit_adam`, compiled by default (the one test of it here is slow; every
other test runs it eagerly, see tests/conftest.py).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import nn

import precision_annot as pa
from precision_annot._src import update_kernels
from precision_annot._src.update import engines
from precision_annot._src.update import step as update_step
from tests.helpers import Allocations

bf16, fp32 = torch.bfloat16, torch.float32


class Spy:
    """A registered kernel that counts the parameters handed to it, and runs the default."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.mixed_dtypes = inner.mixed_dtypes
        self.cached = inner.cached
        self.taken = 0

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.taken += len(args[1])
        self.inner(*args, **kwargs)


def model_for(spec: str, widths: tuple[int, ...] = (64, 96, 32)) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(a, b) for a, b in itertools.pairwise(widths)]
    return pa.apply(nn.Sequential(*layers), default=spec)


def train(model: nn.Module, opt: Any, steps: int = 3) -> None:
    for i in range(steps):
        x = torch.randn(8, model[0].in_features, generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        model(x.to(model[0].weight.dtype)).float().pow(2).mean().backward()
        opt.step()


def spied(monkeypatch: pytest.MonkeyPatch, name: str) -> Spy:
    spy = Spy(update_step.KERNELS[name])
    monkeypatch.setitem(update_step.KERNELS, name, spy)
    return spy


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if sorted(a) != sorted(b):
        return False
    return all(torch.equal(v, b[k]) and v.dtype == b[k].dtype if isinstance(v, torch.Tensor)
               else v == b[k] for k, v in a.items())


CASES = {
    "AdamW masters": ("bf16-true,master=fp32", torch.optim.AdamW, {"lr": 1e-2}),
    "AdamW masters, fp32 grads": ("bf16-master", torch.optim.AdamW, {"lr": 1e-2}),
    "AdamW masters, bf16 moments": ("bf16-true,master=fp32,optim=bf16", torch.optim.AdamW,
                                    {"lr": 1e-2}),
    "AdamW bf16, fp32 grads, no master": ("bf16-true,grad=fp32", torch.optim.AdamW,
                                          {"lr": 1e-2}),
    "SGD masters, nesterov": ("bf16-true,master=fp32", torch.optim.SGD,
                              {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    "Adam fp16 masters, amsgrad, maximize, L2": (
        "16-true,master=fp32", torch.optim.Adam,
        {"lr": 1e-2, "amsgrad": True, "maximize": True, "weight_decay": 0.1}),
    "AdamW fp32, bf16 moments": ("fp32,optim=bf16", torch.optim.AdamW, {"lr": 1e-2}),
    "AdamW masters, tensor lr": ("bf16-true,master=fp32", torch.optim.AdamW,
                                 {"lr": torch.tensor(1e-2)}),
    "SGD masters, bf16 momentum, dampening": (
        "bf16-true,master=fp32,optim=bf16", torch.optim.SGD,
        {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}),
    "SGD masters, no momentum": ("bf16-true,master=fp32", torch.optim.SGD, {"lr": 0.1}),
}
FAST = ["AdamW masters", "AdamW masters, fp32 grads", "AdamW masters, bf16 moments",
        "AdamW bf16, fp32 grads, no master", "SGD masters, nesterov"]


@pytest.mark.parametrize("case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow)
                                  for c in CASES])
def test_the_kernel_equals_the_classs_own_fused_step_bit_for_bit(
        case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every parameter, master and state after 3 steps equals the class's own `fused=True`
    step over the presented tensors (no kernel registered), in value and dtype."""
    spec, cls, hyper = CASES[case]
    name = cls.__name__
    spy = spied(monkeypatch, name)
    ours = model_for(spec)
    opt = pa.optimizer(ours, cls, **hyper)
    train(ours, opt)
    monkeypatch.delitem(update_step.KERNELS, name)
    theirs = model_for(spec)
    ref = pa.optimizer(theirs, cls, fused=True, **hyper)
    train(theirs, ref)
    assert spy.taken == 3 * 4  # every parameter, every step, through the kernel
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert p.dtype == q.dtype and torch.equal(p, q)
        assert same_state(opt.state[p], ref.state[q])


@pytest.mark.parametrize(("flags", "kernel"), [
    ({}, True), ({"fused": True}, True), ({"fused": False}, False), ({"foreach": False}, False),
    ({"foreach": True}, False), ({"differentiable": True}, False)])
def test_an_explicit_foreach_fused_false_or_differentiable_runs_the_classs_own_step(
        flags: dict[str, Any], kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = spied(monkeypatch, "AdamW")
    model = model_for("bf16-true,master=fp32")
    opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-2, **flags)
    train(model, opt, 1)
    assert (spy.taken > 0) == kernel
    assert all(opt.master(p) is not None for p in model.parameters())


def test_capturable_is_left_to_the_class_which_refuses_it_on_a_cpu() -> None:
    model = model_for("bf16-true,master=fp32")
    opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-2, capturable=True)
    with pytest.raises(AssertionError, match="capturable=True"):  # torch's own refusal
        train(model, opt, 1)


def test_the_default_step_differs_from_torchs_for_loop_only_in_the_last_bits() -> None:
    """torch's CPU default (its for-loop) and its fused kernel round differently; the default
    step here is the fused one, within a few ulps of the for-loop's masters."""
    ours = model_for("bf16-true,master=fp32")
    opt = pa.optimizer(ours, torch.optim.AdamW, lr=1e-2)
    train(ours, opt, 5)
    loop = model_for("bf16-true,master=fp32")
    ref = pa.optimizer(loop, torch.optim.AdamW, lr=1e-2, foreach=False)
    train(loop, ref, 5)
    for p, q in zip(ours.parameters(), loop.parameters(), strict=True):
        a, b = opt.master(p), ref.master(q)
        assert a is not None and b is not None
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_a_step_makes_no_temporary_and_cuts_only_the_gradients() -> None:
    """Over bf16 weights with fp32 masters (a 1024x512 weight: two chunks), a step after the
    first allocates nothing: each gradient is widened a chunk at a time into a kept scratch
    buffer; what was cut into pieces once (masters, moments, weights) is kept, and only the
    gradients, new at each backward, are cut again."""
    model = model_for("bf16-true,master=fp32", (1024, 512, 16))
    opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-3)
    train(model, opt, 2)
    opt.zero_grad()
    model(torch.randn(4, 1024).to(bf16)).float().pow(2).mean().backward()
    with Allocations() as seen:
        opt.step()
    assert seen.bytes == 0
    assert seen.ops.count("_fused_adamw_") >= 3  # chunks of 262,144 elements
    big = sum(p.numel() > update_kernels.CHUNK for p in model.parameters())
    assert seen.ops.count("split_with_sizes") == big == 1


def test_a_loaded_state_and_a_swapped_parameter_are_stepped_not_the_ones_cached() -> None:
    """The kernel's cache holds tensors of an earlier step: a state loaded into the same
    optimizer, and a parameter whose `.data` was replaced, are what the next step updates."""
    def run(load: bool) -> nn.Module:
        model = model_for("bf16-true,master=fp32")
        opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-2)
        train(model, opt, 2)
        saved = ({k: v.clone() for k, v in model.state_dict().items()},
                 {"state": {k: {n: t.clone() for n, t in s.items()}
                            for k, s in opt.state_dict()["state"].items()},
                  "param_groups": opt.state_dict()["param_groups"]})
        if load:
            train(model, opt, 2)  # further, then back to the saved point
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.clone()  # new storage under the same parameter
        train(model, opt, 2)
        return model

    for p, q in zip(run(True).parameters(), run(False).parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize(("spec", "cls", "hyper"), [
    ("bf16-true,master=fp32", torch.optim.AdamW, {"lr": 1e-2}),
    ("fp32,optim=bf16", torch.optim.AdamW, {"lr": 1e-2}),
    ("bf16-true,master=fp32", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})])
def test_a_parameter_cut_into_chunks_and_given_new_storage_is_stepped_in_it(
        spec: str, cls: type[torch.optim.Optimizer], hyper: dict[str, Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A parameter larger than a chunk is stepped through views cut from it once; given new
    storage between steps (`p.data = ...`, `model.float().bfloat16()`), the next step writes
    into the new storage, not into the views of the old one (where the update was lost: 2
    steps after the swap, the 64x96 weight stayed 0.0103 from the hand loop's)."""
    monkeypatch.setattr(update_kernels, "CHUNK", 1024)  # the weights are cut into pieces

    def run(swap: bool) -> nn.Module:
        model = model_for(spec)
        opt = pa.optimizer(model, cls, **hyper)
        train(model, opt, 2)
        if swap:
            for p in model.parameters():
                p.data = p.data.clone()  # new storage under the same parameter
        train(model, opt, 2)
        return model

    for p, q in zip(run(True).parameters(), run(False).parameters(), strict=True):
        assert torch.equal(p, q)


def test_sgd_starts_the_momentum_of_a_parameter_unfrozen_later() -> None:
    """torch's fused SGD starts every buffer of one call at once: a parameter whose momentum
    starts later (unfrozen) gets its own first step, as torch's SGD gives it."""
    runs = []
    for flags in ({}, {"foreach": False}):
        model = model_for("bf16-true,master=fp32")
        model[1].weight.requires_grad_(False)
        opt = pa.optimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9, dampening=0.5,
                           **flags)
        train(model, opt, 2)
        model[1].weight.requires_grad_(True)
        train(model, opt, 2)
        runs.append((model, opt))
    (a, oa), (b, ob) = runs
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q) and torch.equal(oa.master(p), ob.master(q))  # type: ignore[arg-type]
        assert torch.equal(oa.state[p]["momentum_buffer"], ob.state[q]["momentum_buffer"])


# -- the low-bit update, compiled -----------------------------------------------------------------

@pytest.mark.slow
def test_the_8bit_default_is_compiled_once_per_layout_and_equals_torchao_by_hand(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The default: `update_kernels.lowbit_adam` compiled, bit for bit torchao's `AdamW8bit`
    (itself compiled, as torchao runs it) over fp32 masters fed the upcast gradients, the
    masters copied into the bf16 weights; a model of other shapes, same layout, compiles
    nothing more."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(engines, "COMPILE", True)
    optim = pytest.importorskip("torchao.optim")
    spec = "bf16-true,master=fp32,optim=8bit"
    widths = (64, 128, 96)  # 8,192 and 12,288 elements: quantized; biases (< 4,096) are not
    with torch._inductor.config.patch(fx_graph_cache=False):
        ours = model_for(spec, widths)
        opt = pa.optimizer(ours, torch.optim.AdamW, lr=1e-2, weight_decay=0.01)
        train(ours, opt, 3)
        hand = model_for("bf16-true", widths)
        masters = [p.detach().float().clone() for p in hand.parameters()]
        ref = optim.AdamW8bit(masters, lr=1e-2, weight_decay=0.01)
        for i in range(3):
            x = torch.randn(8, widths[0], generator=torch.Generator().manual_seed(i))
            hand.zero_grad()
            hand(x.to(bf16)).float().pow(2).mean().backward()
            for m, p in zip(masters, hand.parameters(), strict=True):
                m.grad = p.grad.float()
            ref.step()
            with torch.no_grad():
                for m, p in zip(masters, hand.parameters(), strict=True):
                    p.copy_(m)
        graphs = counters["stats"]["unique_graphs"]
        other = model_for(spec, (32, 256, 48))  # new shapes, the same layout
        train(other, pa.optimizer(other, torch.optim.AdamW, lr=1e-2, weight_decay=0.01), 2)
        assert counters["stats"]["unique_graphs"] == graphs
    for p, q, m in zip(ours.parameters(), hand.parameters(), masters, strict=True):
        assert torch.equal(p, q) and torch.equal(opt.master(p), m)  # type: ignore[arg-type]
        mine, theirs = opt.state[p], ref.state[m]
        assert type(mine["exp_avg"]) is type(theirs["exp_avg"])
        for name in ("exp_avg", "exp_avg_sq"):
            a, b = mine[name], theirs[name]
            if hasattr(a, "codes"):
                assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
            else:
                assert torch.equal(a, b)
    assert type(opt.state[ours[0].weight]["exp_avg"]).__name__ == "OptimState8bit"


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["8bit", "4bit", "fp8"])
def test_grad_fp32_with_a_low_bit_state_compiles_and_equals_torchao_by_hand(
        fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`grad=fp32` beside a low-bit state, with a master (layer 0) and without (layer 1), under
    the default compiled update: bit for bit torchao's own optimizer by hand, over fp32
    masters fed the fp32 gradients and over the bf16 weights themselves. Before: the first
    step crashed for every format, with and without masters (`InternalTorchDynamoError:
    attempting to assign a gradient with dtype 'float' to a tensor with grad_dtype
    'BFloat16'`: Dynamo faked the parameter behind the kernel's view of it, with its fp32
    gradient)."""
    monkeypatch.setattr(engines, "COMPILE", True)
    optim = pytest.importorskip("torchao.optim")
    cls = {"8bit": optim.AdamW8bit, "4bit": optim.AdamW4bit, "fp8": optim.AdamWFp8}[fmt]
    widths = (64, 128, 96)  # weights of 8,192 and 12,288 elements: quantized; biases not
    torch.manual_seed(0)
    ours = nn.Sequential(*(nn.Linear(a, b) for a, b in itertools.pairwise(widths)))
    pa.annotate(ours, {"0": f"bf16-true,master=fp32,grad=fp32,optim={fmt}",
                       "1": f"bf16-true,grad=fp32,optim={fmt}"})
    pa.apply(ours)
    assert {p.grad_dtype for p in ours.parameters()} == {fp32}
    opt = pa.optimizer(ours, torch.optim.AdamW, lr=1e-2, weight_decay=0.01)
    with torch._inductor.config.patch(fx_graph_cache=False):
        train(ours, opt, 3)
        hand = model_for("bf16-true", widths)
        for p in hand.parameters():
            p.grad_dtype = fp32
        masters = [p.detach().float().clone() for p in hand[0].parameters()]
        refs = (cls(masters, lr=1e-2, weight_decay=0.01),
                cls(list(hand[1].parameters()), lr=1e-2, weight_decay=0.01))
        for i in range(3):
            x = torch.randn(8, widths[0], generator=torch.Generator().manual_seed(i))
            hand.zero_grad()
            hand(x.to(bf16)).float().pow(2).mean().backward()
            for m, p in zip(masters, hand[0].parameters(), strict=True):
                m.grad = p.grad
            for ref in refs:
                ref.step()
            with torch.no_grad():
                for m, p in zip(masters, hand[0].parameters(), strict=True):
                    p.copy_(m)
    theirs = dict(zip(hand[0].parameters(), masters, strict=True))
    for p, q in zip(ours.parameters(), hand.parameters(), strict=True):
        assert torch.equal(p, q)
        held = theirs.get(q, q)
        mine = opt.state[p]
        if held is not q:
            assert torch.equal(opt.master(p), held)  # type: ignore[arg-type]
        state = (refs[0] if held is not q else refs[1]).state[held]
        for name in ("exp_avg", "exp_avg_sq"):
            a, b = mine[name], state[name]
            assert type(a) is type(b)
            if hasattr(a, "codes"):
                assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
            else:
                assert torch.equal(a, b)
    assert type(opt.state[ours[1].weight]["exp_avg"]).__name__.startswith("OptimState")


@pytest.mark.parametrize("kernel", ["adam", "sgd"])
def test_a_narrow_gradient_of_any_layout_cut_into_chunks_is_stepped(kernel: str) -> None:
    """`update_kernels` takes a gradient stored narrower than the masters in any layout: here
    a transposed bf16 gradient of a parameter cut into chunks, beside a narrowed one that fits
    in a chunk. The step equals torch's fused step on the gradients upcast (and made
    contiguous: torch's fused CPU step reads a non-contiguous gradient as if it were; one
    AdamW step of lr 1e-3 on a transposed one lands 2e-3 from its for-loop step, on torch 2.13
    and 2.15), bit for bit. Before:
    the cut one was viewed flat (`.view(-1)`), which raised "view size is not compatible with
    input tensor's size and stride"."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(96, 80), (40, 8)]  # 7,680 elements cut into chunks of 1,024; 320 in one
    grads = [[torch.randn(s[::-1], generator=gen).to(bf16).t() for s in shapes[:1]]
             + [torch.randn(40, 16, generator=gen).to(bf16)[:, ::2]] for _ in range(2)]
    assert not any(g.is_contiguous() for step in grads for g in step)
    masters = [torch.randn(s, generator=gen) for s in shapes]
    ours = [m.clone() for m in masters]
    stored = [m.to(bf16) for m in masters]
    hand = [nn.Parameter(m.clone()) for m in masters]
    hyper: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1}
    if kernel == "adam":
        ref: torch.optim.Optimizer = torch.optim.AdamW(hand, fused=True, **hyper)
        moments = [[torch.zeros_like(m) for m in masters] for _ in range(2)]
        steps = [torch.zeros(()) for _ in masters]
    else:
        ref = torch.optim.SGD(hand, fused=True, momentum=0.9, **hyper)
        buffers: list[torch.Tensor | None] = [None] * len(masters)
    for step in grads:
        if kernel == "adam":
            update_kernels.adam(ours, step, *moments, [], steps, beta1=0.9, beta2=0.999,
                                eps=1e-8, decoupled=True, stored=stored, chunk=1024, **hyper)
        else:
            update_kernels.sgd(ours, step, buffers, momentum=0.9, stored=stored, chunk=1024,
                               **hyper)
        for p, g in zip(hand, step, strict=True):
            p.grad = g.float().contiguous()
        ref.step()
    for mine, theirs, weight in zip(ours, hand, stored, strict=True):
        assert torch.equal(mine, theirs.detach()) and torch.equal(weight, mine.to(bf16))
