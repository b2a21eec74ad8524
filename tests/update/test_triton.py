"""The Triton masters step (`update_triton`), run by Triton's interpreter on CPU tensors.

Each step is compared with the fused route (`update_kernels`, torch's fused CPU kernel over
chunks) fed the same tensors: bit for bit on every element outside torch's scalar tail, and
within a stated bound on the tail, where torch's compiler contracts one multiply-add into an fma
the other way round (the vectorised loop computes `fma(c * g, g, v * beta2)`, the scalar tail
`fma(v, beta2, (c * g) * g)`; SGD likewise `b * momentum + (1 - dampening) * g`). The kernel
computes the vectorised loop's formula on every element, which a hand-written reference (NumPy,
with an exact fma) checks on the tail too. Stochastic rounding is checked against torchao's own
`_fp32_to_bf16_sr` fed the Philox draws the kernel documents.

`TRITON_INTERPRET=1` is set for each test (Triton reads it when a kernel is made, and the
module makes one set of kernels per mode), so other tests of the process are not affected.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from precision_annot._src import update_kernels, update_triton

pytest.importorskip("triton", minversion="3.9")  # (update_triton.MIN_TRITON)

bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
#: odd sizes, one larger than a program's 1,024 elements (3 programs, the last partial), one
#: of 1,073 (a whole block and 49 elements), a 0-size tensor; mixed in one launch
SHAPES = [(37, 29), (1000,), (7,), (64, 33), (1,), (0,), (300,)]
CHUNK = 1024
HYPER: dict[str, Any] = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8}
#: the elements of torch's scalar tail (the vector width of its CPU kernels): 0 where unknown
#: (then every element is held to the bound)
WIDTH = {"AVX2": 8, "AVX512": 16}.get(torch.backends.cpu.get_cpu_capability(), 0)
#: how far a tail element may be from the fused route after 3 steps, in ulps (of its dtype) of
#: the largest tail value of the tensor: one contraction rounds one way, the other the other
#: (an ulp of the products), and a momentum that nearly cancels carries that as several ulps
#: of itself; measured at most 11 for SGD's buffers, 1 for Adam's second moment, 0 for masters
BOUND = 16


@pytest.fixture(autouse=True)
def _interpreted(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


# -- comparing ---------------------------------------------------------------------------------

def bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1).clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8).reshape(t.numel(), t.element_size())


def ulp(x: torch.Tensor) -> float:
    """The gap from |x| to the next float of its dtype."""
    a = x.abs().reshape(1)
    wide = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return float((a.view(wide) + 1).view(a.dtype).float() - a.float())


def agree(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Equal bits but on torch's scalar tail, there within BOUND ulps of the tail's largest
    magnitude (NaNs need only both be NaN)."""
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, what
    n = ours.numel()
    body = n - n % WIDTH if WIDTH else 0
    a, b = ours.reshape(-1), ref.reshape(-1)
    same = (bits(a[:body]) == bits(b[:body])).all(1) | (a[:body].isnan() & b[:body].isnan())
    assert bool(same.all()), f"{what}: elements {(~same).nonzero().reshape(-1)[:8].tolist()}"
    if body < n:
        gap = float((a[body:].float() - b[body:].float()).abs().max())
        step = ulp(b[body:].abs().max())
        assert gap <= BOUND * step, f"{what}: tail off by {gap / step} ulps"


def same_bits(ours: torch.Tensor, ref: torch.Tensor) -> bool:
    return ours.dtype == ref.dtype and bool(
        ((bits(ours) == bits(ref)).all(1) | (ours.reshape(-1).isnan()
                                             & ref.reshape(-1).isnan())).all())


# -- what the optimizer holds ------------------------------------------------------------------

def tensors(dtype: torch.dtype, seed: int, scale: float = 1.0,
            shapes: list[tuple[int, ...]] = SHAPES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * scale).to(dtype) for s in shapes]


class Held:
    """One layout: what is updated, its stored copy, the states (made alike from the seeds)."""

    def __init__(self, param: torch.dtype, state: torch.dtype, stored: torch.dtype | None,
                 shapes: list[tuple[int, ...]] = SHAPES, states: int = 3) -> None:
        self.params = tensors(param, 0, shapes=shapes)
        self.stored = [p.to(stored) for p in self.params] if stored is not None else None
        g = torch.Generator().manual_seed(1)
        self.states = [[(torch.rand(p.shape, generator=g) * 1e-4).to(state)
                        for p in self.params] for _ in range(states)]
        self.steps = [torch.tensor(float(k % 3)) for k in range(len(shapes))]

    def all(self) -> list[tuple[str, torch.Tensor]]:
        out = [(f"params[{i}]", p) for i, p in enumerate(self.params)]
        out += [(f"stored[{i}]", p) for i, p in enumerate(self.stored or [])]
        for k, state in enumerate(self.states):
            out += [(f"state{k}[{i}]", s) for i, s in enumerate(state)]
        return out + [(f"steps[{i}]", s) for i, s in enumerate(self.steps)]


def adam(module: Any, held: Held, grads: list[list[torch.Tensor]], **options: Any) -> None:
    amsgrad = bool(options.get("amsgrad"))
    for step_grads in grads:
        module.adam(held.params, step_grads, held.states[0], held.states[1],
                    held.states[2] if amsgrad else [], held.steps, stored=held.stored,
                    **{**HYPER, **options})


def both(run: Callable[[Any, Held], None], *layout: Any, **kw: Any) -> tuple[Held, Held]:
    """The fused route's and the Triton kernel's result of `run` from the same tensors."""
    ref, ours = Held(*layout, **kw), Held(*layout, **kw)
    run(update_kernels, ref)
    run(update_triton, ours)
    return ours, ref


def compare(ours: Held, ref: Held) -> None:
    for (name, a), (_, b) in zip(ours.all(), ref.all(), strict=True):
        agree(a, b, name)


# -- a hand-written reference: torch's vectorised formula, in NumPy -----------------------------

def fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fp32 fma, rounded once: the double sum (its error found exactly) rounded to odd, then
    to fp32 (53 bits round to odd, then to 24, round as once)."""
    x, y, z = (np.asarray(v, np.float32).astype(np.float64) for v in (a, b, c))
    prod = x * y  # exact: 48 bits
    s = prod + z
    back = s - prod
    err = (prod - (s - back)) + (z - back)
    odd = (s.view(np.int64) & 1) == 1
    nudge = (err != 0) & ~odd
    s = np.where(nudge, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def f32(x: float) -> np.float32:
    return np.float32(x)


def reference_adamw(p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, step: float,
                    lr: float, beta1: float, beta2: float, eps: float, wd: float
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One AdamW step of torch's fused CPU kernel's vectorised loop, in fp32."""
    p = p * f32(1 - lr * wd)
    m = fma(f32(1 - beta1), g - m, m)
    v = fma(f32(1 - beta2) * g, g, v * f32(beta2))
    denom = np.sqrt(v) / f32(np.sqrt(1 - beta2 ** step)) + f32(eps)
    return p + (f32(-(lr / (1 - beta1 ** step))) * m) / denom, m, v


# -- Adam and AdamW ------------------------------------------------------------------------------

ADAM = {
    "AdamW: bf16 gradients, fp32 masters, bf16 weights": (
        (fp32, fp32, bf16, bf16), {"decoupled": True, "weight_decay": 0.01}),
    "Adam (L2), amsgrad, maximize: fp16 gradients and weights": (
        (fp32, fp32, fp16, fp16), {"decoupled": False, "weight_decay": 0.1, "amsgrad": True,
                                   "maximize": True}),
    "AdamW, amsgrad: bf16 moments over fp32 masters": (
        (fp32, bf16, bf16, bf16), {"decoupled": True, "weight_decay": 0.01, "amsgrad": True}),
    "AdamW: bf16 parameters stepped in fp32 (fp32 gradients and moments), no master": (
        (bf16, fp32, None, fp32), {"decoupled": True, "weight_decay": 0.01}),
    "AdamW, beta1=0.3 (torch's lerp from the gradient), a tensor lr": (
        (fp32, fp32, bf16, bf16), {"decoupled": True, "weight_decay": 0.0, "beta1": 0.3,
                                   "lr": torch.tensor(3e-3)}),
}
SLOW_ADAM = {
    "AdamW: fp32 everything, no stored copy (torch's fused kernel unchunked)": (
        (fp32, fp32, None, fp32), {"decoupled": True, "weight_decay": 0.01}),
    "Adam: fp16 parameters and bf16 gradients (computed in fp32)": (
        (fp16, fp32, None, bf16), {"decoupled": False, "weight_decay": 0.01}),
}


@pytest.mark.parametrize("case", [*ADAM, *(pytest.param(c, marks=pytest.mark.slow)
                                           for c in SLOW_ADAM)])
def test_adam_equals_the_fused_route_over_three_steps(case: str) -> None:
    (param, state, stored, grad), options = {**ADAM, **SLOW_ADAM}[case]
    grads = [tensors(grad, 10 + k, 1e-2) for k in range(3)]
    ours, ref = both(lambda module, held: adam(module, held, grads, chunk=CHUNK, **options),
                     param, state, stored)
    compare(ours, ref)
    assert [float(s) for s in ours.steps] == [float(k % 3) + 3 for k in range(len(SHAPES))]


def test_adamw_is_torchs_vectorised_formula_on_every_element() -> None:
    """The tail included: the kernel computes one formula everywhere."""
    grads = [tensors(bf16, 20 + k, 1e-2) for k in range(2)]
    held = Held(fp32, fp32, bf16)
    start = [(p.numpy().copy(), m.numpy().copy(), v.numpy().copy(), float(s))
             for p, m, v, s in zip(held.params, held.states[0], held.states[1], held.steps,
                                   strict=True)]
    adam(update_triton, held, grads, decoupled=True, weight_decay=0.01, chunk=CHUNK)
    for i, (p, m, v, s) in enumerate(start):
        for k, step_grads in enumerate(grads):
            g = step_grads[i].float().numpy()
            p, m, v = reference_adamw(p, g, m, v, s + k + 1, HYPER["lr"], HYPER["beta1"],
                                      HYPER["beta2"], HYPER["eps"], 0.01)
        assert same_bits(held.params[i], torch.from_numpy(p)), i
        assert same_bits(held.states[1][i], torch.from_numpy(v)), i
        assert same_bits(held.stored[i], torch.from_numpy(p).bfloat16()), i  # type: ignore[index]


def test_programs_of_several_blocks_many_small_tensors_and_mixed_sizes() -> None:
    """A program of 3 blocks of 64 (`chunk=192`): whole blocks, a partial one, tensors spanning
    programs, and 12 tensors of 1 to 12 elements, in one launch."""
    shapes = [(193,), (64,), (130, 3), *((k,) for k in range(1, 13))]
    grads = [tensors(bf16, 30 + k, 1e-2, shapes) for k in range(2)]
    ours, ref = both(lambda module, held: adam(module, held, grads, chunk=192,
                                               decoupled=True, weight_decay=0.01),
                     fp32, fp32, bf16, shapes=shapes)
    compare(ours, ref)


# -- SGD ---------------------------------------------------------------------------------------

SGD = {
    "momentum, weight decay (first step makes the buffers)": ({"momentum": 0.9,
                                                               "weight_decay": 0.01}, None),
    "nesterov": ({"momentum": 0.9, "nesterov": True}, None),
    "dampening, maximize, bf16 buffers": ({"momentum": 0.9, "dampening": 0.1,
                                           "maximize": True}, bf16),
    "no momentum": ({}, None),
}


@pytest.mark.parametrize("case", SGD)
def test_sgd_equals_the_fused_route_over_three_steps(case: str) -> None:
    options, buffer = SGD[case]
    grads = [tensors(bf16, 40 + k, 1e-2) for k in range(3)]
    buffers: dict[int, list[torch.Tensor | None]] = {}

    def run(module: Any, held: Held) -> None:
        mine: list[torch.Tensor | None] = (
            [None] * len(SHAPES) if buffer is None or not options
            else [torch.zeros_like(p, dtype=buffer) for p in held.params])
        for step_grads in grads:
            module.sgd(held.params, step_grads, mine, lr=0.1, stored=held.stored, chunk=CHUNK,
                       **options)
        buffers[id(module)] = mine

    ours, ref = both(run, fp32, fp32, bf16, states=0)
    compare(ours, ref)
    for i, (a, b) in enumerate(zip(buffers[id(update_triton)], buffers[id(update_kernels)],
                                   strict=True)):
        assert (a is None) == (b is None) == (not options)
        if a is not None and b is not None:
            agree(a, b, f"momentum_buffers[{i}]")


def test_sgd_nesterov_is_torchs_vectorised_formula_on_every_element() -> None:
    grads = [tensors(bf16, 50 + k, 1e-2) for k in range(2)]
    params = tensors(fp32, 0)
    start = [p.numpy().copy() for p in params]
    buffers: list[torch.Tensor | None] = [None] * len(SHAPES)
    for step_grads in grads:
        update_triton.sgd(params, step_grads, buffers, lr=0.1, momentum=0.9, nesterov=True,
                          weight_decay=0.01, chunk=CHUNK)
    for i, p in enumerate(start):
        b = np.zeros_like(p)
        for k, step_grads in enumerate(grads):
            g = fma(p, f32(0.01), step_grads[i].float().numpy())
            b = g if k == 0 else fma(f32(1.0), g, b * f32(0.9))
            p = fma(fma(b, f32(0.9), g), f32(-0.1), p)
        assert same_bits(params[i], torch.from_numpy(p)), i
        assert same_bits(buffers[i], torch.from_numpy(b)), i  # type: ignore[arg-type]


# -- a GradScaler's scale and found_inf ---------------------------------------------------------

@pytest.mark.parametrize("grad", [fp16, fp32])
def test_a_scale_is_divided_out_in_fp32_as_the_fused_route_does(grad: torch.dtype) -> None:
    """An fp32 gradient is written back unscaled, as torch's fused kernel writes it; a narrower
    one is read only."""
    scale = torch.tensor(65536.0)
    found = torch.tensor(0.0)
    raw = [(g.float() * scale).to(grad) for g in tensors(fp32, 60, 1e-6)]
    seen = {}

    def run(module: Any, held: Held) -> None:
        grads = [g.clone() for g in raw]
        adam(module, held, [grads], decoupled=True, weight_decay=0.01, grad_scale=scale,
             found_inf=found, chunk=CHUNK)
        seen[id(module)] = grads

    ours, ref = both(run, fp32, fp32, fp16)
    compare(ours, ref)
    for a, b, r in zip(seen[id(update_triton)], seen[id(update_kernels)], raw, strict=True):
        agree(a, b, "grads")
        assert grad == fp32 or same_bits(a, r)


@pytest.mark.parametrize("family", ["adam", "sgd"])
def test_found_inf_skips_the_step_on_the_device_steps_included(family: str) -> None:
    held = Held(fp32, fp32, bf16)
    before = [t.clone() for _, t in held.all()]
    grads = tensors(bf16, 70, 1e-2)
    inf = torch.tensor(1.0)
    if family == "adam":
        adam(update_triton, held, [grads], decoupled=True, weight_decay=0.01, found_inf=inf,
             grad_scale=torch.tensor(2.0), amsgrad=True, chunk=CHUNK)
    else:
        update_triton.sgd(held.params, grads, held.states[0], lr=0.1, momentum=0.9,
                          stored=held.stored, found_inf=inf, chunk=CHUNK)  # type: ignore[arg-type]
    for (name, after), was in zip(held.all(), before, strict=True):
        assert same_bits(after, was), name


# -- rounding ------------------------------------------------------------------------------------

EDGES = [0.0, -0.0, 1.0, 1.00390625, 1.005859375, 1.0078125 + 2**-9, 3.0000002, -2.5e-41,
         1e-40, 3.4e38, 3.3961e38, -3.4028235e38, float("inf"), float("-inf"), float("nan"),
         65504.0, 65520.0, 6e-8, 2.98e-8, -1e-6, 5.9604645e-08]


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("stored", [bf16, fp16])
def test_a_weight_is_rounded_to_nearest_even_as_torch_rounds(stored: torch.dtype) -> None:
    """Ties both ways, overflow to infinity, subnormals, signed zeros, infinities, NaN: an SGD
    step of lr=0 leaves the master as it was, and writes it rounded."""
    base = torch.tensor(EDGES, dtype=fp32).view(torch.int32)
    values = torch.cat([base, base - 1, base + 1]).view(fp32)
    params = [values.clone()]
    weights = [torch.empty(values.shape, dtype=stored)]
    update_triton.sgd(params, [torch.zeros_like(values, dtype=bf16)], [], lr=0.0,
                      stored=weights, chunk=CHUNK)
    assert same_bits(params[0], values)
    assert same_bits(weights[0], values.to(stored))


def test_a_bf16_gradient_is_read_exactly() -> None:
    g = torch.tensor([1e-40, -3e-39, 1.5, 0.0, 3.3e38, -2.0**-133], dtype=bf16)
    params = [torch.zeros(6)]
    update_triton.sgd(params, [g], [], lr=-1.0, chunk=CHUNK)
    assert same_bits(params[0], g.float())


def philox(seed: int, counters: np.ndarray) -> np.ndarray:
    """Philox4x32-10 as Triton's `tl.randint(seed, counter)` runs it (counter = the 64-bit
    offset, split low and high; key = the seed, split likewise): its first word."""
    mask = np.uint64(0xFFFFFFFF)
    c = [counters & mask, counters >> np.uint64(32), counters * 0, counters * 0]
    k = [np.uint64(seed) & mask, np.uint64(seed) >> np.uint64(32) & mask]
    for _ in range(10):
        a0, a2 = c[0], c[2]
        c[0] = ((a2 * np.uint64(0xCD9E8D57)) >> np.uint64(32)) ^ c[1] ^ k[0]
        c[2] = ((a0 * np.uint64(0xD2511F53)) >> np.uint64(32)) ^ c[3] ^ k[1]
        c[1] = (a2 * np.uint64(0xCD9E8D57)) & mask
        c[3] = (a0 * np.uint64(0xD2511F53)) & mask
        k = [(k[0] + np.uint64(0x9E3779B9)) & mask, (k[1] + np.uint64(0xBB67AE85)) & mask]
    return c[0]


def draws(seed: int, t: int, n: int) -> torch.Tensor:
    """The 16-bit integers the kernel documents for element j of the launch's tensor t."""
    counters = (np.uint64(t) << np.uint64(40)) + np.arange(n, dtype=np.uint64)
    return torch.from_numpy((philox(seed, counters) & np.uint64(0xFFFF)).astype(np.int32))


def torchao_rounding(x: torch.Tensor, rand: torch.Tensor,
                     monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """torchao's `_fp32_to_bf16_sr` of `x`, its `torch.randint` answering `rand`."""
    utils = pytest.importorskip("torchao.optim.quant_utils")
    with monkeypatch.context() as m:
        m.setattr(torch, "randint", lambda *a, **k: rand.reshape(x.shape))
        return utils._fp32_to_bf16_sr(x)  # type: ignore[no-any-return]


@pytest.mark.slow
def test_the_stream_is_tritons_randint() -> None:
    """Triton's own `tl.randint`, interpreted in a process that imported Triton interpreting,
    gives the draws above."""
    script = (
        "import torch, triton, triton.language as tl\n"
        "@triton.jit\n"
        "def k(out, seed, BLOCK: tl.constexpr):\n"
        "    offs = tl.arange(0, BLOCK).to(tl.int64) + (5 << 40) + 1000\n"
        "    tl.store(out + tl.arange(0, BLOCK), (tl.randint(seed, offs) & 0xFFFF).to(tl.int32))\n"
        "out = torch.empty(64, dtype=torch.int32)\n"
        "k[(1,)](out, 2**40 + 77, BLOCK=64)\n"
        "print(out.tolist())\n")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300, check=True)
    counters = (np.uint64(5) << np.uint64(40)) + np.uint64(1000) + np.arange(64, dtype=np.uint64)
    want = (philox(2**40 + 77, counters) & np.uint64(0xFFFF)).tolist()
    assert eval(run.stdout.strip().splitlines()[-1]) == want


@pytest.mark.parametrize("where", ["bf16 parameters", "the stored weight of an fp32 master"])
def test_stochastic_rounding_is_torchaos_rule_on_the_documented_stream(
        where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The weight written equals torchao's rounding of the fp32 update, fed the kernel's
    Philox draws; the seed makes it reproducible, and another seed rounds otherwise."""
    shapes = [(300,), (7,), (0,), (1100,)]
    grads = [tensors(fp32, 80, 1e-2, shapes)]
    master = where != "bf16 parameters"
    layout = (fp32, fp32, bf16) if master else (bf16, fp32, None)
    exact = Held(fp32, fp32, None, shapes=shapes)  # the same step, kept in fp32
    exact.params = [p.float() for p in Held(*layout, shapes=shapes).params]
    adam(update_triton, exact, grads, decoupled=True, weight_decay=0.01, chunk=CHUNK)
    runs = []
    for seed in (1234, 1234, 99):
        held = Held(*layout, shapes=shapes)
        adam(update_triton, held, grads, decoupled=True, weight_decay=0.01, chunk=CHUNK,
             stochastic=True, seed=seed)
        runs.append(held.stored if master else held.params)
        for a, b in zip(held.states[1], exact.states[1], strict=True):
            assert same_bits(a, b)
    for t, x in enumerate(exact.params):
        want = torchao_rounding(x, draws(1234, t, x.numel()), monkeypatch)
        assert runs[0] is not None and same_bits(runs[0][t], want), t
        assert same_bits(runs[1][t], runs[0][t])  # type: ignore[index]
    assert any(not same_bits(a, b) for a, b in zip(runs[0], runs[2], strict=True))  # type: ignore[arg-type]


def test_stochastic_rounding_at_the_draw_itself_rounds_toward_zero(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the 16 bits dropped equal the draw, torchao keeps the value truncated; one more
    and it rounds away (SGD with lr=0 leaves the master as it is, its stored weight rounded)."""
    n = 256
    rand = draws(7, 0, n)
    high = torch.randint(0x3F00, 0x4100, (n,), generator=torch.Generator().manual_seed(0))
    high = torch.where(torch.arange(n) % 4 < 2, high, high | 0x8000)  # both signs
    low = (rand + torch.arange(n) % 2).clamp(max=0xFFFF)  # the draw, or one above it
    master = ((high << 16) | low).to(torch.int32).view(fp32)
    weights = [torch.empty(n, dtype=bf16)]
    update_triton.sgd([master.clone()], [torch.zeros(n, dtype=bf16)], [], lr=0.0,
                      stored=weights, chunk=CHUNK, stochastic=True, seed=7)
    assert same_bits(weights[0], torchao_rounding(master, rand, monkeypatch))
    away = weights[0].float().abs() > master.abs()
    assert bool((away == (low > rand)).all())


def test_a_seed_left_out_is_drawn_from_torchs_generator() -> None:
    held = [Held(bf16, fp32, None) for _ in range(2)]
    for h in held:
        torch.manual_seed(5)
        adam(update_triton, h, [tensors(fp32, 90, 1e-2)], decoupled=True, weight_decay=0.0,
             chunk=CHUNK, stochastic=True)
    for a, b in zip(held[0].params, held[1].params, strict=True):
        assert same_bits(a, b)


# -- what goes where, what is refused ------------------------------------------------------------

def test_what_the_kernel_does_not_take_goes_to_the_fused_route() -> None:
    """bf16 computations (every tensor bf16) and fp64 ones are the fused route's, beside an
    fp32 one stepped here, in one call; stochastic rounding refuses them."""
    shapes = [(33,), (40,), (9,)]
    dtypes = [bf16, torch.float64, fp32]

    def make() -> Held:
        held = Held(fp32, fp32, None, shapes=shapes)
        for i, d in enumerate(dtypes):
            held.params[i] = held.params[i].to(d)
            for state in held.states:
                state[i] = state[i].to(d)
        return held

    grads = [[g.to(d) for g, d in zip(tensors(fp32, 95, 1e-2, shapes), dtypes, strict=True)]]
    ours, ref = make(), make()
    adam(update_kernels, ref, grads, decoupled=True, weight_decay=0.01)
    adam(update_triton, ours, grads, decoupled=True, weight_decay=0.01, chunk=CHUNK)
    compare(ours, ref)
    with pytest.raises(ValueError, match=r"stochastic=True rounds in the Triton kernel.*"
                                         r"params\[0\] of dtype torch.bfloat16 on cpu"):
        adam(update_triton, ours, grads, decoupled=True, weight_decay=0.01, stochastic=True)


def test_only_0_size_tensors_still_count_their_steps() -> None:
    held = Held(fp32, fp32, bf16, shapes=[(0,), (0, 3)])
    adam(update_triton, held, [tensors(bf16, 1, shapes=[(0,), (0, 3)])], decoupled=True,
         weight_decay=0.0)
    assert [float(s) for s in held.steps] == [1.0, 2.0]


def test_bad_calls_name_the_argument_and_what_is_valid() -> None:
    held = Held(fp32, fp32, bf16, shapes=[(4, 4)])
    base = {"decoupled": True, "weight_decay": 0.0}
    grads = [tensors(bf16, 1, shapes=[(4, 4)])]
    with pytest.raises(ValueError, match=r"`chunk` must be a positive multiple of 64.*"
                                         r"chunk=100"):
        adam(update_triton, held, grads, chunk=100, **base)
    with pytest.raises(ValueError, match=r"`seed` must be an integer in \[0, 2\*\*63\); "
                                         r"received seed=-1"):
        adam(update_triton, held, grads, stochastic=True, seed=-1, **base)
    with pytest.raises(ValueError, match=r"grads\[0\] must be on the device of params\[0\] "
                                         r"\(cpu\) with its 16 elements; received 15"):
        adam(update_triton, held, [[torch.zeros(15, dtype=bf16)]], **base)
    held.states[0][0] = torch.zeros(4, 4).t()
    with pytest.raises(ValueError, match=r"contiguous tensors only; received exp_avgs\[0\]"):
        adam(update_triton, held, grads, **base)
    assert float(held.steps[0]) == 0.0  # refused before anything moved
    with pytest.raises(ValueError, match=r"`max_exp_avg_sqs` must hold one tensor per "
                                         r"parameter \(1\) when amsgrad=True; received 0"):
        update_triton.adam(held.params, grads[0], held.states[0], held.states[1], [],
                           held.steps, amsgrad=True, **HYPER, **base)


def test_a_narrow_gradient_laid_out_otherwise_is_read_as_the_fused_route_reads_it() -> None:
    """(The fused route in its default chunk: cut smaller, it views such a gradient flat.)"""
    grads = [[g.t().contiguous().t() if g.dim() == 2 else g
              for g in tensors(bf16, 3, 1e-2, [(29, 37), (5,)])]]
    ours, ref = both(lambda module, held: adam(
        module, held, grads, decoupled=True, weight_decay=0.0,
        **({"chunk": CHUNK} if module is update_triton else {})),
        fp32, fp32, bf16, shapes=[(29, 37), (5,)])
    compare(ours, ref)


@pytest.mark.usefixtures("group")
def test_dtensor_shards_are_stepped_where_they_are() -> None:
    """Under FSDP2 each rank steps its local shards (the plain tensors' result); a first step's
    momentum buffers are DTensors placed as their parameters; a gradient placed otherwise is
    refused, as the fused route refuses it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    shapes = [(64, 33), (7,)]
    grads = tensors(bf16, 96, 1e-2, shapes)

    def shard(ts: list[torch.Tensor]) -> list[torch.Tensor]:
        return [distribute_tensor(t.clone(), mesh, [Shard(0)]) for t in ts]

    plain = Held(fp32, fp32, bf16, shapes=shapes)
    sharded = {"params": shard(plain.params), "stored": shard(plain.stored or [])}
    buffers: list[torch.Tensor | None] = [None, None]
    update_triton.sgd(sharded["params"], shard(grads), buffers, lr=0.1, momentum=0.9,
                      stored=sharded["stored"], chunk=CHUNK)
    plain_buffers: list[torch.Tensor | None] = [None, None]
    update_triton.sgd(plain.params, grads, plain_buffers, lr=0.1, momentum=0.9,
                      stored=plain.stored, chunk=CHUNK)
    for a, b in zip(sharded["params"] + sharded["stored"] + buffers,
                    plain.params + (plain.stored or []) + plain_buffers, strict=True):
        assert isinstance(a, DTensor) and a.placements == (Shard(0),)
        assert b is not None and same_bits(a.to_local(), b)
    replicated = [distribute_tensor(g, mesh, [Replicate()]) for g in grads]
    with pytest.raises(ValueError, match=r"grads\[0\] is a DTensor placed \(Replicate\(\),\)"):
        update_triton.sgd(sharded["params"], replicated, buffers, lr=0.1, momentum=0.9)


def test_the_kernel_runs_only_on_an_nvidia_gpu_in_training() -> None:
    """Interpreting, the CPU runs it for the tests; a training run uses it on CUDA only."""
    assert not update_triton.available(torch.device("cpu"))
    assert not update_triton.available(torch.device("cuda"))  # (interpreting)


def test_the_step_size_table_is_the_same_on_the_host_and_on_a_device() -> None:
    """Where the step counts live on the GPU the table is computed there (no sync), with
    torch's double ops; on the CPU both give glibc's bits for 20,000 steps."""
    for lr in (1e-3, torch.tensor(3e-4)):
        hyper = update_triton._AdamHyper(lr, 0.9, 0.999, 1e-8, 0.1, True, False)
        steps = [torch.tensor(float(k)) for k in range(20000)]
        host = update_triton._host_table(steps, hyper)
        device = update_triton._device_table(steps, hyper, torch.device("cpu"))
        assert same_bits(host, device)


# -- the kernels for a GPU, compiled here without one ------------------------------------------

ADAM_FLAGS = {"P": 1, "G": 2, "M": 1, "V": 1, "X": 0, "S": 2, "DECOUPLED": True,
              "MAXIMIZE": False, "HAS_WD": True, "FROM_GRAD": False, "HAS_SCALE": False,
              "HAS_INF": False, "WRITE_GRAD": False, "STOCHASTIC": False, "ALIGNED": True,
              "COUNT": True}
SGD_FLAGS = {"P": 1, "G": 2, "B": 1, "S": 2, "MAXIMIZE": False, "HAS_WD": True, "FIRST": False,
             "NESTEROV": True, "HAS_SCALE": False, "HAS_INF": False, "WRITE_GRAD": False,
             "STOCHASTIC": False, "ALIGNED": True}
#: what a GPU compiles: the masters step, then the other branches the interpreter runs
VARIANTS = {
    "AdamW masters": ("_adam_kernel", {}),  # (the one not marked slow)
    "Adam L2, amsgrad, maximize, fp16, fp32 gradient unscaled, found_inf": (
        "_adam_kernel", {"G": 1, "X": 1, "S": 3, "DECOUPLED": False, "MAXIMIZE": True,
                         "FROM_GRAD": True, "HAS_SCALE": True, "HAS_INF": True,
                         "WRITE_GRAD": True}),
    "AdamW bf16 parameters and moments, stochastic, unaligned": (
        "_adam_kernel", {"P": 2, "G": 1, "M": 2, "V": 2, "S": 0, "STOCHASTIC": True,
                         "ALIGNED": False, "COUNT": False}),
    "SGD nesterov, stochastic stored weight": ("_sgd_kernel", {"STOCHASTIC": True}),
    "SGD first step, bf16 buffer, scale and found_inf": (
        "_sgd_kernel", {"B": 2, "FIRST": True, "NESTEROV": False, "MAXIMIZE": True,
                        "HAS_SCALE": True, "HAS_INF": True}),
}


@pytest.mark.parametrize("variant", [v if v == "AdamW masters" else pytest.param(
    v, marks=pytest.mark.slow) for v in VARIANTS])
def test_the_kernels_compile_for_sm90_with_16_byte_loads_and_ieee_arithmetic(
        variant: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """PTX for an H100/H200, made here without a GPU: whole blocks load and store 16 bytes at a
    time (where the addresses are aligned), division and square root are IEEE (`div.rn`,
    `sqrt.rn`), and the masters step's only fmas are the two written (AdamW's decay `p * d`
    then `+ update` is not contracted into a third)."""
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    name, changes = VARIANTS[variant]
    flags = {**(ADAM_FLAGS if name == "_adam_kernel" else SGD_FLAGS), **changes,
             "BLOCK": 1024, "ITERS": 4}
    pointers = {"chunks": "*i32", "addrs": "*i64", "numels": "*i64"}
    pointers |= ({"table": "*fp32"} if name == "_adam_kernel" else {})
    pointers |= {"consts": "*fp32", "scale_ptr": "*fp32", "inf_ptr": "*fp32", "n": "i32",
                 "seed": "i64"}
    source = ASTSource(update_triton._kernels(False)[name],
                       {**pointers, **dict.fromkeys(flags, "constexpr")}, constexprs=flags)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4, "enable_fp_fusion": False}).asm["ptx"]
    assert ("ld.global.v4.b32" in ptx) == flags["ALIGNED"]
    assert not re.search(r"div\.(full|approx)|sqrt\.approx|rsqrt", ptx)
    if name == "_adam_kernel":
        assert "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx
    if variant == "AdamW masters":
        per_thread = 1024 // (4 * 32)
        assert len(re.findall(r"\bfma\.rn\.f32\b", ptx)) == 2 * per_thread * 2  # 2 paths
