"""The step kernels of the update half, against torch's and torchao's own steps written by hand.

Each kernel is fed what the optimizer holds (gradients as stored, fp32 masters, states in their
dtype) and compared, bit for bit, with the same step written by hand: the gradient upcast, torch's
fused step (`torch.optim.AdamW(fused=True)`, `torch.optim.SGD(fused=True)`) or torchao's
`AdamW8bit` on the fp32 masters, and the master rounded into the stored weight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.optim.adam import adam as torch_adam_functional

from precision_annot._src import update_kernels as kernels
from tests.helpers import Allocations

#: shapes with odd sizes, one larger than the small chunk the tests use (so it is split), and
#: several smaller ones (so they are grouped into one chunk)
SHAPES = [(37, 29), (1000,), (7,), (64, 33), (1,), (0,)]
#: a chunk small enough to split and group the shapes above (a multiple of 64)
CHUNK = 256
HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8),
                                              b.view(-1).view(torch.uint8))


def tensors(dtype: torch.dtype, seed: int, scale: float = 1.0,
            shapes: list[tuple[int, ...]] = SHAPES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * scale).to(dtype) for s in shapes]


class Layout:
    """What the optimizer holds for one layout: masters (or params), stored weights, states."""

    def __init__(self, param: torch.dtype, state: torch.dtype, stored: torch.dtype | None,
                 shapes: list[tuple[int, ...]] = SHAPES) -> None:
        self.params = tensors(param, 0, shapes=shapes)
        self.stored = [p.to(stored) for p in self.params] if stored is not None else None
        self.exp_avgs = [torch.zeros_like(p, dtype=state) for p in self.params]
        self.exp_avg_sqs = [torch.zeros_like(p, dtype=state) for p in self.params]
        self.max_exp_avg_sqs = [torch.zeros_like(p, dtype=state) for p in self.params]
        self.steps = [torch.tensor(0.0) for _ in self.params]


def torch_adam(params: list[torch.Tensor], grads: list[list[torch.Tensor]], *, decoupled: bool,
               state: torch.dtype | None = None, **options: Any) -> dict[str, Any]:
    """torch's fused Adam(W) on fp32 copies of `params`, fed each step's gradients upcast; with
    `state`, the moments are kept in that dtype between steps (widened before each step and
    rounded after it), as a user keeping bf16 state by hand would."""
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    ps = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = cls(ps, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
              fused=True, **options)
    for step_grads in grads:
        for p, g in zip(ps, step_grads, strict=True):
            p.grad = g.to(p.dtype)
        opt.step()
        if state is not None:
            for s in opt.state.values():
                for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                    if key in s:
                        s[key].copy_(s[key].to(state))
    return {"params": [p.detach() for p in ps], "state": [opt.state[p] for p in ps]}


def ours_adam(layout: Layout, grads: list[list[torch.Tensor]], *, decoupled: bool,
              amsgrad: bool = False, **options: Any) -> None:
    for step_grads in grads:
        kernels.adam(layout.params, step_grads, layout.exp_avgs, layout.exp_avg_sqs,
                     layout.max_exp_avg_sqs if amsgrad else [], layout.steps,
                     decoupled=decoupled, amsgrad=amsgrad, stored=layout.stored, chunk=CHUNK,
                     **HYPER, **options)


# -- Adam and AdamW through torch's fused kernel --------------------------------------------------

@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("decoupled", "options"), [
    (True, {"weight_decay": 0.01}),
    (False, {"weight_decay": 0.01, "amsgrad": True}),
    (True, {"weight_decay": 0.0, "maximize": True}),
])
def test_adam_over_fp32_masters_equals_torch_fused_on_upcast_gradients_bit_for_bit(
        grad_dtype: torch.dtype, decoupled: bool, options: dict[str, Any]) -> None:
    grads = [tensors(grad_dtype, 10 + k, 1e-2) for k in range(3)]
    ours = Layout(torch.float32, torch.float32, torch.bfloat16)
    ours_adam(ours, grads, decoupled=decoupled, **options)
    ref = torch_adam(tensors(torch.float32, 0), grads, decoupled=decoupled, **options)
    for i, p in enumerate(ours.params):
        assert bits_equal(p, ref["params"][i])
        assert ours.stored is not None and bits_equal(ours.stored[i], p.bfloat16())
        if p.numel():
            state = ref["state"][i]
            assert bits_equal(ours.exp_avgs[i], state["exp_avg"])
            assert bits_equal(ours.exp_avg_sqs[i], state["exp_avg_sq"])
            assert bits_equal(ours.steps[i], state["step"])
            if options.get("amsgrad"):
                assert bits_equal(ours.max_exp_avg_sqs[i], state["max_exp_avg_sq"])


def test_splitting_a_tensor_into_chunks_changes_no_bit() -> None:
    """Chunk boundaries fall on multiples of 64 elements: torch's vectorised loop and its tail
    fall where they fall on the whole tensor (on AVX-512 and AVX2 alike)."""
    shapes = [(4099,), (130, 7), (3,)]
    grads = [tensors(torch.bfloat16, 20 + k, 1e-2, shapes) for k in range(2)]
    results = []
    for chunk in (64, 192, 1 << 20):
        layout = Layout(torch.float32, torch.float32, torch.bfloat16, shapes)
        for step_grads in grads:
            kernels.adam(layout.params, step_grads, layout.exp_avgs, layout.exp_avg_sqs, [],
                         layout.steps, decoupled=True, weight_decay=0.1, chunk=chunk,
                         stored=layout.stored, **HYPER)
        results.append(layout)
    for other in results[1:]:
        for a, b in zip(results[0].params + results[0].exp_avg_sqs,
                        other.params + other.exp_avg_sqs, strict=True):
            assert bits_equal(a, b)


@pytest.mark.parametrize("seed", range(6))
def test_any_shapes_and_chunk_size_give_torchs_bits(seed: int) -> None:
    """Random shapes (a tensor of exactly a chunk, one element more or fewer, empty ones) and
    chunk sizes: the step equals torch's fused step on the upcast gradients."""
    g = torch.Generator().manual_seed(seed)
    chunk = 64 * int(torch.randint(1, 33, (), generator=g))
    sizes = [chunk, chunk + 1, chunk - 1, 0, *torch.randint(1, 5000, (4,), generator=g).tolist()]
    shapes = [(int(n),) for n in sizes[:: 1 if seed % 2 else -1]]
    grad_dtype = (torch.bfloat16, torch.float16)[seed % 2]
    grads = [tensors(grad_dtype, 500 + seed + k, 1e-2, shapes) for k in range(2)]
    ours = Layout(torch.float32, torch.float32, grad_dtype, shapes)
    for step_grads in grads:
        kernels.adam(ours.params, step_grads, ours.exp_avgs, ours.exp_avg_sqs, [], ours.steps,
                     decoupled=bool(seed % 3), weight_decay=0.05, stored=ours.stored,
                     chunk=chunk, **HYPER)
    ref = torch_adam(tensors(torch.float32, 0, shapes=shapes), grads,
                     decoupled=bool(seed % 3), weight_decay=0.05)
    for i, p in enumerate(ours.params):
        assert bits_equal(p, ref["params"][i])
        assert ours.stored is not None and bits_equal(ours.stored[i], p.to(grad_dtype))


def test_a_found_inf_skips_a_lowbit_step_before_anything_moves() -> None:
    p = tensors(torch.float32, 0, shapes=[(64, 128)])
    before = p[0].clone()
    m = [kernels.lowbit_state(p[0], "8bit", True)]
    v = [kernels.lowbit_state(p[0], "8bit", False)]
    steps = [torch.tensor(0.0)]
    kernels.lowbit_adam(p, tensors(torch.bfloat16, 1, shapes=[(64, 128)]), m, v, [], steps,
                        decoupled=True, weight_decay=0.0, found_inf=torch.tensor(1.0), **HYPER)
    assert bits_equal(p[0], before) and steps[0].item() == 0.0
    assert int(m[0].codes.count_nonzero()) == 0  # type: ignore[attr-defined]


def test_bf16_state_over_fp32_masters_equals_torch_with_the_state_rounded_after_each_step(
        ) -> None:
    grads = [tensors(torch.bfloat16, 30 + k, 1e-2) for k in range(3)]
    ours = Layout(torch.float32, torch.bfloat16, torch.bfloat16)
    ours_adam(ours, grads, decoupled=True, weight_decay=0.01)
    ref = torch_adam(tensors(torch.float32, 0), grads, decoupled=True, weight_decay=0.01,
                     state=torch.bfloat16)
    for i, p in enumerate(ours.params):
        assert bits_equal(p, ref["params"][i])
        if p.numel():
            assert bits_equal(ours.exp_avgs[i], ref["state"][i]["exp_avg"].bfloat16())
            assert bits_equal(ours.exp_avg_sqs[i], ref["state"][i]["exp_avg_sq"].bfloat16())


@pytest.mark.parametrize("state", [torch.float32, torch.bfloat16])
def test_fp32_params_without_a_master_are_torch_fused_itself(state: torch.dtype) -> None:
    grads = [tensors(torch.float32, 40 + k, 1e-2) for k in range(2)]
    ours = Layout(torch.float32, state, None)
    ours_adam(ours, grads, decoupled=True, weight_decay=0.01)
    ref = torch_adam(tensors(torch.float32, 0), grads, decoupled=True, weight_decay=0.01,
                     state=None if state == torch.float32 else state)
    for i, p in enumerate(ours.params):
        assert bits_equal(p, ref["params"][i])


def test_bf16_params_and_state_without_a_master_are_torch_fused_in_bf16() -> None:
    grads = [tensors(torch.bfloat16, 50 + k, 1e-2) for k in range(2)]
    ours = Layout(torch.bfloat16, torch.bfloat16, None)
    ours_adam(ours, grads, decoupled=True, weight_decay=0.01)
    ps = [torch.nn.Parameter(p) for p in tensors(torch.bfloat16, 0)]
    opt = torch.optim.AdamW(ps, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                            eps=HYPER["eps"], weight_decay=0.01, fused=True)
    for step_grads in grads:
        for p, g in zip(ps, step_grads, strict=True):
            p.grad = g
        opt.step()
    for a, b in zip(ours.params, ps, strict=True):
        assert bits_equal(a, b.detach())


def test_bf16_params_with_fp32_state_compute_in_fp32_and_round_the_weight_once() -> None:
    """The step computes in the widest dtype of a parameter's tensors: an fp32 state over a
    bf16 weight with no master is the fp32 step on the weight widened, rounded back after."""
    grads = [tensors(torch.bfloat16, 60 + k, 1e-2) for k in range(2)]
    ours = Layout(torch.bfloat16, torch.float32, None)
    ours_adam(ours, grads, decoupled=True, weight_decay=0.01)
    ps = [p.float() for p in tensors(torch.bfloat16, 0)]
    ref_states = Layout(torch.float32, torch.float32, None)
    for step_grads in grads:
        torch._foreach_add_(ref_states.steps, 1)
        torch._fused_adamw_(ps, [g.float() for g in step_grads], ref_states.exp_avgs,
                            ref_states.exp_avg_sqs, [], ref_states.steps, weight_decay=0.01,
                            amsgrad=False, maximize=False, **HYPER)
        ps = [p.bfloat16().float() for p in ps]
    for i, p in enumerate(ours.params):
        assert bits_equal(p, ps[i].bfloat16())
        assert bits_equal(ours.exp_avg_sqs[i], ref_states.exp_avg_sqs[i])


@pytest.mark.parametrize("inf", [0.0, 1.0])
def test_a_grad_scalers_scale_is_divided_out_in_fp32_and_found_inf_skips_the_step(
        inf: float) -> None:
    """fp16 gradients of a scaled loss are unscaled in fp32, as Apex O2 unscales into the
    master (no gradient flushed to zero in fp16 first), and `found_inf` leaves everything as
    it was, the step count included."""
    scale = torch.tensor(65536.0)
    found = torch.tensor(inf)
    grads = [[(g.float() * scale).half() for g in tensors(torch.float32, 70, 1e-6)]]
    ours = Layout(torch.float32, torch.float32, torch.float16)
    before = [p.clone() for p in ours.params]
    ours_adam(ours, grads, decoupled=True, weight_decay=0.01, grad_scale=scale,
              found_inf=found)
    params = [p.clone() for p in before]
    ref = Layout(torch.float32, torch.float32, None)
    torch_adam_functional(params, [g.float() for g in grads[0]], ref.exp_avgs, ref.exp_avg_sqs,
                          [], ref.steps, fused=True, grad_scale=scale, found_inf=found,
                          decoupled_weight_decay=True, amsgrad=False, weight_decay=0.01,
                          maximize=False, **HYPER)
    for i, p in enumerate(ours.params):
        assert bits_equal(p, params[i])
        assert bits_equal(ours.steps[i], ref.steps[i])
        if inf:
            assert bits_equal(p, before[i])
    assert ours.steps[0].item() == (0.0 if inf else 1.0)


def test_the_gradients_as_stored_are_left_as_they_were() -> None:
    grads = tensors(torch.bfloat16, 80, 1e-2)
    kept = [g.clone() for g in grads]
    layout = Layout(torch.float32, torch.float32, torch.bfloat16)
    kernels.adam(layout.params, grads, layout.exp_avgs, layout.exp_avg_sqs, [], layout.steps,
                 decoupled=True, weight_decay=0.0, stored=layout.stored,
                 grad_scale=torch.tensor(4.0), chunk=CHUNK, **HYPER)
    assert all(bits_equal(a, b) for a, b in zip(grads, kept, strict=True))


def test_a_masters_step_makes_no_full_size_temporary() -> None:
    """After the first step (which makes the scratch buffers), a step allocates nothing: the
    gradient is widened a chunk at a time into a buffer of `chunk` elements."""
    shapes = [(256, 256), (256,), (256, 512)]
    layout = Layout(torch.float32, torch.float32, torch.bfloat16, shapes)
    grads = tensors(torch.bfloat16, 90, 1e-2, shapes)

    def step() -> None:
        kernels.adam(layout.params, grads, layout.exp_avgs, layout.exp_avg_sqs, [],
                     layout.steps, decoupled=True, weight_decay=0.0, stored=layout.stored,
                     chunk=4096, **HYPER)

    kernels._scratch.cache = {}
    step()
    with Allocations() as seen:
        step()
    assert seen.bytes == 0
    assert seen.ops.count("_fused_adamw_") == 49  # 196,864 elements in full chunks of 4,096
    assert all(buf.numel() <= 4096 for buf in kernels._scratch.cache.values())


def test_a_tensor_lr_is_torchs_tensor_lr() -> None:
    grads = [tensors(torch.bfloat16, 85, 1e-2)]
    ours = Layout(torch.float32, torch.float32, torch.bfloat16)
    options = {**HYPER, "lr": torch.tensor(0.03)}
    kernels.adam(ours.params, grads[0], ours.exp_avgs, ours.exp_avg_sqs, [], ours.steps,
                 decoupled=True, weight_decay=0.1, stored=ours.stored, chunk=CHUNK, **options)
    ps = [torch.nn.Parameter(p) for p in tensors(torch.float32, 0)]
    opt = torch.optim.AdamW(ps, lr=torch.tensor(0.03), betas=(HYPER["beta1"], HYPER["beta2"]),
                            eps=HYPER["eps"], weight_decay=0.1, fused=True)
    for p, g in zip(ps, grads[0], strict=True):
        p.grad = g.float()
    opt.step()
    assert all(bits_equal(a, b.detach()) for a, b in zip(ours.params, ps, strict=True))


@pytest.mark.usefixtures("group")
def test_dtensor_shards_are_stepped_where_they_are() -> None:
    """Under FSDP2 every tensor of a parameter is a DTensor sharded alike: each rank steps its
    local shards, with the plain tensors' result; a gradient placed otherwise is refused."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    shapes = [(64, 128), (1000,)]
    plain = Layout(torch.float32, torch.float32, torch.bfloat16, shapes)
    grads = tensors(torch.bfloat16, 95, 1e-2, shapes)

    def shard(ts: list[torch.Tensor]) -> list[torch.Tensor]:
        return [distribute_tensor(t.clone(), mesh, [Shard(0)]) for t in ts]

    sharded = {k: shard(getattr(plain, k)) for k in ("params", "exp_avgs", "exp_avg_sqs")}
    stored = shard(plain.stored or [])
    steps = [torch.tensor(0.0) for _ in shapes]
    kernels.adam(sharded["params"], shard(grads), sharded["exp_avgs"], sharded["exp_avg_sqs"],
                 [], steps, decoupled=True, weight_decay=0.01, stored=stored, chunk=CHUNK,
                 **HYPER)
    kernels.adam(plain.params, grads, plain.exp_avgs, plain.exp_avg_sqs, [], plain.steps,
                 decoupled=True, weight_decay=0.01, stored=plain.stored, chunk=CHUNK, **HYPER)
    for a, b in zip(sharded["params"] + stored, plain.params + (plain.stored or []),
                    strict=True):
        assert bits_equal(a.to_local(), b)
    state = kernels.lowbit_state(sharded["params"][0], "8bit", True)
    assert type(state.to_local()).__name__ == "OptimState8bit"  # type: ignore[attr-defined]
    replicated = [distribute_tensor(g, mesh, [Replicate()]) for g in grads]
    with pytest.raises(ValueError, match=r"grads\[0\] is a DTensor placed \(Replicate\(\),\); "
                                         r"the step takes the tensors of a parameter placed as "
                                         r"the parameter is \(\(Shard\(dim=0\),\)\)"):
        kernels.adam(sharded["params"], replicated, sharded["exp_avgs"],
                     sharded["exp_avg_sqs"], [], steps, decoupled=True, weight_decay=0.0,
                     **HYPER)


# -- SGD -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("options", [
    {"momentum": 0.9, "weight_decay": 0.01},
    {"momentum": 0.9, "nesterov": True, "dampening": 0.0},
    {"momentum": 0.0, "maximize": True},
])
def test_sgd_over_fp32_masters_equals_torch_fused_sgd_bit_for_bit(options: dict[str, Any]
                                                                    ) -> None:
    grads = [tensors(torch.bfloat16, 100 + k, 1e-2) for k in range(3)]
    layout = Layout(torch.float32, torch.float32, torch.bfloat16)
    buffers: list[torch.Tensor | None] = [None] * len(layout.params)
    for step_grads in grads:
        kernels.sgd(layout.params, step_grads, buffers, lr=0.1, stored=layout.stored,
                    chunk=CHUNK, **options)
    ps = [torch.nn.Parameter(p) for p in tensors(torch.float32, 0)]
    opt = torch.optim.SGD(ps, lr=0.1, fused=True, **options)
    for step_grads in grads:
        for p, g in zip(ps, step_grads, strict=True):
            p.grad = g.float()
        opt.step()
    for i, p in enumerate(layout.params):
        assert bits_equal(p, ps[i].detach())
        assert layout.stored is not None and bits_equal(layout.stored[i], p.bfloat16())
        if options["momentum"] and p.numel():
            b = buffers[i]
            assert b is not None and bits_equal(b, opt.state[ps[i]]["momentum_buffer"])


# -- what a caller gets wrong ----------------------------------------------------------------------

def test_bad_calls_name_the_argument_and_what_is_valid() -> None:
    layout = Layout(torch.float32, torch.float32, None, [(4, 4)])
    grads = tensors(torch.float32, 1, shapes=[(4, 4)])
    call: Callable[..., None] = kernels.adam
    base = {"decoupled": True, "weight_decay": 0.0, **HYPER}
    with pytest.raises(ValueError, match=r"`grads` must hold one entry per parameter \(1\); "
                                         r"received 2"):
        call(layout.params, grads * 2, layout.exp_avgs, layout.exp_avg_sqs, [], layout.steps,
             **base)
    with pytest.raises(ValueError, match=r"`chunk` must be a positive multiple of 64.*"
                                         r"chunk=100"):
        call(layout.params, grads, layout.exp_avgs, layout.exp_avg_sqs, [], layout.steps,
             stored=[layout.params[0].bfloat16()], chunk=100, **base)
    wide = [torch.zeros(16, 8).t()]
    with pytest.raises(ValueError, match=r"contiguous tensors only; received params\[0\] of "
                                         r"shape \(8, 16\) and stride \(1, 8\)"):
        call(wide, [torch.zeros(8, 16)], [torch.zeros(8, 16)], [torch.zeros(8, 16)], [],
             [torch.tensor(0.0)], stored=[torch.zeros(8, 16)], chunk=64, **base)
    with pytest.raises(ValueError, match=r"`max_exp_avg_sqs` must hold one tensor per "
                                         r"parameter \(1\) when amsgrad=True; received 0"):
        call(layout.params, grads, layout.exp_avgs, layout.exp_avg_sqs, [], layout.steps,
             amsgrad=True, **base)
    meta = [torch.zeros(4, device="meta")]
    with pytest.raises(ValueError, match=r"the Adam step runs torch's fused kernels, which torch "
                                         r"has for device types .*cpu.*; received parameters "
                                         r"on meta"):
        call(meta, meta, meta, meta, [], [torch.tensor(0.0)], **base)
    assert layout.steps[0].item() == 0.0  # refused before anything moved
    with pytest.raises(ValueError, match=r"`state` must be one of '8bit', '4bit', 'fp8'; "
                                         r"received state='int8'"):
        kernels.lowbit_state(layout.params[0], "int8", True)  # type: ignore[arg-type]


def test_fused_kernels_are_known_for_the_cpu() -> None:
    assert kernels.fused_available(torch.device("cpu"))
    assert not kernels.fused_available(torch.device("meta"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_only_masters_step_runs_torchs_fused_cuda_kernel() -> None:
    """On a GPU the step is torch's fused CUDA kernel (`_fused_adamw_`), with the same result
    as `torch.optim.AdamW(fused=True)` on the masters."""
    device = torch.device("cuda")
    assert kernels.fused_available(device)
    shapes = [(1024, 1024), (1024,)]
    masters = [t.to(device) for t in tensors(torch.float32, 0, shapes=shapes)]
    grads = [t.to(device) for t in tensors(torch.bfloat16, 1, 1e-2, shapes)]
    stored = [m.bfloat16() for m in masters]
    m = [torch.zeros_like(p) for p in masters]
    v = [torch.zeros_like(p) for p in masters]
    steps = [torch.tensor(0.0, device=device) for _ in masters]
    ref = [torch.nn.Parameter(p.clone()) for p in masters]
    with Allocations() as seen:
        kernels.adam(masters, grads, m, v, [], steps, decoupled=True, weight_decay=0.01,
                     stored=stored, **HYPER)
    assert "_fused_adamw_" in seen.ops
    opt = torch.optim.AdamW(ref, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                            eps=HYPER["eps"], weight_decay=0.01, fused=True)
    for p, g in zip(ref, grads, strict=True):
        p.grad = g.float()
    opt.step()
    for a, b, s in zip(masters, ref, stored, strict=True):
        assert bits_equal(a, b.detach())
        assert bits_equal(s, a.bfloat16())


# -- low-bit states (torchao), compiled once per layout ----------------------------------------

#: two quantized shapes (>= 4,096 elements, whole blocks) and two torchao keeps plain
LOWBIT_SHAPES = [(64, 128), (4096,), (100,), (3, 5)]


def torchao_by_hand(cls_name: str, grads: list[list[torch.Tensor]], shapes: list[tuple[int, ...]],
                    **options: Any) -> tuple[list[torch.Tensor], Any]:
    """torchao's optimizer on fp32 masters, fed each step's gradients upcast."""
    import torchao.optim

    masters = [torch.nn.Parameter(p) for p in tensors(torch.float32, 0, shapes=shapes)]
    opt = getattr(torchao.optim, cls_name)(masters, lr=HYPER["lr"],
                                           betas=(HYPER["beta1"], HYPER["beta2"]),
                                           eps=HYPER["eps"], **options)
    for step_grads in grads:
        for p, g in zip(masters, step_grads, strict=True):
            p.grad = g.float()
        opt.step()
    return [p.detach() for p in masters], opt


def ours_lowbit(state: kernels.LowBit, grads: list[list[torch.Tensor]],
                shapes: list[tuple[int, ...]], *, amsgrad: bool = False, **options: Any
                ) -> dict[str, list[torch.Tensor]]:
    masters = tensors(torch.float32, 0, shapes=shapes)
    out = {"params": masters, "stored": [p.bfloat16() for p in masters],
           "exp_avgs": [kernels.lowbit_state(p, state, True) for p in masters],
           "exp_avg_sqs": [kernels.lowbit_state(p, state, False) for p in masters],
           "max_exp_avg_sqs": [kernels.lowbit_state(p, state, False) for p in masters]
           if amsgrad else [],
           "steps": [torch.tensor(0.0) for _ in masters]}
    for step_grads in grads:
        kernels.lowbit_adam(out["params"], step_grads, out["exp_avgs"], out["exp_avg_sqs"],
                            out["max_exp_avg_sqs"], out["steps"], stored=out["stored"],
                            **HYPER, **options)
    return out


def same_state(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    if type(ours) is not type(theirs):
        return False
    names = getattr(type(ours), "tensor_attrs", None)
    if names is None:
        return bits_equal(ours, theirs)
    return all(bits_equal(getattr(ours, n), getattr(theirs, n)) for n in names)


@pytest.mark.parametrize("signed", [True, False])
def test_the_8bit_quantizer_finds_torchaos_codes(signed: bool) -> None:
    """The quantizer that starts from a table of bf16 buckets gives torchao's codes: at both
    edges of every bucket in [-1, 1], at every map value and midpoint and the fp32 values next
    to them, at 0, -0, +-1 and NaN, and at values spread over every magnitude."""
    from torchao.optim.quant_utils import quantize_8bit_with_qmap

    qmap = kernels.lowbit_state(torch.zeros(4096), "8bit", signed).qmap  # type: ignore[attr-defined]
    table = kernels._floor_table(qmap)
    assert table is not None
    bits = torch.arange(1 << 16, dtype=torch.int32) << 16
    edges = torch.cat([bits.view(torch.float32), (bits | 0xFFFF).view(torch.float32)])
    points = torch.cat([qmap, (qmap[1:] + qmap[:-1]) / 2,
                        torch.tensor([0.0, -0.0, 1.0, -1.0, float("nan")])])
    g = torch.Generator().manual_seed(0)
    spread = torch.randn(1 << 18, generator=g) * torch.exp(torch.randn(1 << 18, generator=g) * 4)
    x = torch.cat([edges, points, torch.nextafter(points, torch.full_like(points, 2.0)),
                   torch.nextafter(points, torch.full_like(points, -2.0)),
                   spread / spread.abs().max()])
    x = x[(x.abs() <= 1) | x.isnan()]
    if not signed:
        x = x[(x >= 0) | x.isnan()]
    assert torch.equal(kernels._quantize_8bit(x, qmap, table), quantize_8bit_with_qmap(x, qmap))


def test_a_map_a_bucket_cannot_search_in_one_step_uses_torchaos_search() -> None:
    assert kernels._floor_table(torch.linspace(0.5, 0.51, 256)) is None  # 64 a bucket


@pytest.mark.slow
@pytest.mark.parametrize(("state", "cls_name", "decoupled"), [
    ("8bit", "AdamW8bit", True), ("8bit", "Adam8bit", False), ("4bit", "AdamW4bit", True),
    ("fp8", "AdamWFp8", True)])
def test_lowbit_adam_equals_torchaos_optimizer_by_hand_bit_for_bit(
        state: kernels.LowBit, cls_name: str, decoupled: bool) -> None:
    """Both compiled in this process: inductor's on-disk cache does not key its graphs by
    ATEN_CPU_CAPABILITY, and its AVX2 and AVX-512 code round differently, so a graph cached
    under the other capability would be compared with one compiled under this one."""
    grads = [tensors(torch.bfloat16, 200 + k, 1e-2, LOWBIT_SHAPES) for k in range(3)]
    with torch._inductor.config.patch(fx_graph_cache=False):
        ours = ours_lowbit(state, grads, LOWBIT_SHAPES, decoupled=decoupled, weight_decay=0.01)
        masters, opt = torchao_by_hand(cls_name, grads, LOWBIT_SHAPES, weight_decay=0.01)
    for i, p in enumerate(masters):
        theirs = opt.state[opt.param_groups[0]["params"][i]]
        assert bits_equal(ours["params"][i], p)
        assert bits_equal(ours["stored"][i], p.bfloat16())
        assert same_state(ours["exp_avgs"][i], theirs["exp_avg"])
        assert same_state(ours["exp_avg_sqs"][i], theirs["exp_avg_sq"])
        assert bits_equal(ours["steps"][i], theirs["step"])
    assert type(ours["exp_avgs"][0]).__name__ == {"8bit": "OptimState8bit",
                                                  "4bit": "OptimState4bit",
                                                  "fp8": "OptimStateFp8"}[state]


@pytest.mark.slow
def test_lowbit_adam_compiles_once_per_layout_not_per_shape() -> None:
    """After one step has compiled the 8-bit and the plain layouts, parameters of shapes never
    seen before compile nothing more (torchao's optimizer compiles once per shape)."""
    from torch._dynamo.utils import counters

    ours_lowbit("8bit", [tensors(torch.bfloat16, 1, 1e-2, LOWBIT_SHAPES)], LOWBIT_SHAPES,
                decoupled=True, weight_decay=0.01)
    before = counters["stats"]["unique_graphs"]
    new = [(256, 48), (8192,), (33,), (2, 4096), (7, 9)]
    ours_lowbit("8bit", [tensors(torch.bfloat16, 2, 1e-2, new)] * 2, new, decoupled=True,
                weight_decay=0.01)
    assert counters["stats"]["unique_graphs"] == before


@pytest.mark.slow
def test_lowbit_amsgrad_keeps_the_largest_second_moment_in_8bit() -> None:
    """torchao's own AdamW8bit(amsgrad=True) cannot step (torchao 0.18 has no `maximum` for
    its 8-bit state); here the maximum is taken on the dequantized values and stored in 8 bits:
    after a large first gradient and smaller ones, it keeps the first step's moments."""
    shapes = [(64, 128)]
    grads = [tensors(torch.bfloat16, 300 + k, 10.0 ** -k, shapes) for k in range(3)]
    ours = ours_lowbit("8bit", grads, shapes, amsgrad=True, decoupled=True, weight_decay=0.0)
    vmax = ours["max_exp_avg_sqs"][0].dequantize()
    v = ours["exp_avg_sqs"][0].dequantize()
    assert bool((vmax >= v - 0.02 * v.max()).all())  # up to the state's rounding
    assert float((vmax > v).float().mean()) > 0.5  # the first step's larger moments are kept
    assert bool(ours["params"][0].isfinite().all())


@pytest.mark.slow
def test_lowbit_stochastic_rounding_lands_on_a_neighbour_without_bias() -> None:
    """bf16 parameters without a master, rounded stochastically (torchao's rounding): each
    value is the fp32 result cut to bf16 toward zero or away from it, away as often as the
    cut-off bits say."""
    shapes = [(256, 256)]
    params = [p.bfloat16() for p in tensors(torch.float32, 0, shapes=shapes)]
    exact = [p.float() for p in params]
    grads = tensors(torch.bfloat16, 400, 1e-2, shapes)
    for target, rounding in ((exact, False), (params, True)):
        kernels.lowbit_adam(target, grads, [kernels.lowbit_state(exact[0], "8bit", True)],
                            [kernels.lowbit_state(exact[0], "8bit", False)], [],
                            [torch.tensor(0.0)], decoupled=True, weight_decay=0.0,
                            stochastic=rounding, **HYPER)
    bits = exact[0].view(torch.int32)
    toward = (bits & -65536).view(torch.float32)
    away = ((bits & -65536) + 65536).view(torch.float32)
    got = params[0].float()
    assert bool(((got == toward) | (got == away)).all())
    went_away = (got == away) & (away != toward)
    assert abs(float(went_away.float().mean()) - float(((bits & 0xFFFF) / 65536).mean())) < 0.01


@pytest.mark.slow
def test_lowbit_adam_divides_a_grad_scalers_scale_out_in_fp32() -> None:
    """fp16 gradients of a loss scaled by 2**16 step as the unscaled gradients do."""
    shapes = [(64, 128), (100,)]
    grads = tensors(torch.float32, 600, 1e-6, shapes)
    scale = torch.tensor(65536.0)
    scaled = [(g * scale).half() for g in grads]
    exact = [(s.float() / scale) for s in scaled]  # what the scaled fp16 gradient holds
    results = []
    for step_grads, options in ((scaled, {"grad_scale": scale}), (exact, {})):
        out = ours_lowbit("8bit", [step_grads], shapes, decoupled=True, weight_decay=0.0,
                          **options)
        results.append(out)
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert bits_equal(a, b)
