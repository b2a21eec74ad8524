"""What a boundary does at each call: casts, autocast, outputs, the function form, checks."""

from __future__ import annotations

import copy
import dataclasses
import threading
import types
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from precision_annot import (
    Policy,
    annotate,
    apply,
    bf16,
    fp16,
    fp32,
    precision,
    precision_scope,
    resolve,
)
from precision_annot._src.runtime import installed_boundaries
from tests.helpers import Recorder, island_model, tol

LOW = [bf16, fp16]


@pytest.mark.parametrize("low", LOW)
def test_fp32_island_in_a_low_precision_model(low: torch.dtype) -> None:
    model, f1, g, f2 = island_model()
    reference = copy.deepcopy(model)
    apply(model, default=low)

    # storage: every parameter in its module's storage dtype
    assert {p.dtype for p in f1.parameters()} | {p.dtype for p in f2.parameters()} == {low}
    assert {p.dtype for p in g.parameters()} == {fp32}

    x = torch.randn(5, 8, requires_grad=True)
    y = model(x)
    assert (f1.seen, g.seen, f2.seen) == ([low], [fp32], [low])
    assert y.dtype == low
    y.float().pow(2).sum().backward()
    assert x.grad is not None and x.grad.dtype == fp32  # the input's own dtype
    assert {p.grad.dtype for p in f1.parameters()} == {low}  # type: ignore[union-attr]
    assert {p.grad.dtype for p in g.parameters()} == {fp32}  # type: ignore[union-attr]

    # the same computation written by hand with .to() casts
    r1, rg, r2 = reference[0].inner.to(low), reference[1].inner, reference[2].inner.to(low)
    xr = x.detach().clone().requires_grad_(True)
    yr = r2(rg(r1(xr.to(low)).to(fp32)).to(low))
    yr.float().pow(2).sum().backward()
    assert_close(y, yr, rtol=0, atol=0)
    assert_close(x.grad, xr.grad, rtol=0, atol=0)
    for p, q in zip(model.parameters(), [*r1.parameters(), *rg.parameters(), *r2.parameters()],
                    strict=True):
        assert_close(p.grad, q.grad, rtol=0, atol=0)


@pytest.mark.parametrize("low", LOW)
def test_mixed_precision_runs_under_autocast_and_the_island_is_not_downcast(
    low: torch.dtype,
) -> None:
    model, f1, g, f2 = island_model()
    apply(model, default=Policy(compute=low, storage=fp32))
    assert {p.dtype for p in model.parameters()} == {fp32}
    x = torch.randn(5, 8)
    y = model(x)
    # the root casts inputs to low and runs under autocast; the island disables it
    assert (f1.autocast, g.autocast, f2.autocast) == ([True], [False], [True])
    assert g.seen == [fp32]
    assert y.dtype == low

    # an outer autocast region cannot downcast the island either
    with torch.autocast("cpu", dtype=low):
        model(x)
        ln_out = model[1](torch.randn(5, 8, dtype=low))
    assert g.autocast[-2:] == [False, False] and g.seen[-1] == fp32
    assert ln_out.dtype == low  # handed back in the parent's compute dtype
    with torch.autocast("cpu", dtype=low):
        hand = model[2].inner(model[1].inner(model[0].inner(x.to(low)).float()).to(low))
    assert_close(y, hand, **tol(low))


@pytest.mark.parametrize("island_first", [True, False])
def test_a_weight_tied_across_two_autocast_dtypes_gets_each_regions_own_cast(
        island_first: bool) -> None:
    """Found by the property test's 3000 examples: PyTorch's autocast caches a weight's cast
    by the weight alone, so a bf16 island and the fp16 model around it shared one copy of a
    tied weight: "self and mat2 must have the same dtype, Half and BFloat16"."""
    torch.manual_seed(0)
    first, second = nn.Linear(8, 8), nn.Linear(8, 8)
    second.weight = first.weight
    precision(Policy(compute=bf16))(first if island_first else second)
    model = nn.Sequential(first, second)
    apply(model, default=Policy(compute=fp16))
    x = torch.randn(3, 8)
    out = model(x)

    def linear(h: torch.Tensor, layer: nn.Linear, dtype: torch.dtype) -> torch.Tensor:
        return nn.functional.linear(h.to(dtype), layer.weight.to(dtype), layer.bias.to(dtype))

    island, other = (bf16, fp16) if island_first else (fp16, bf16)
    h = linear(x, first, island).to(fp16)  # an island hands its output back in fp16
    expected = linear(h, second, other).to(fp16)
    assert out.dtype == fp16 and torch.equal(out, expected)
    out.float().sum().backward()
    assert first.weight.grad is not None and first.weight.grad.dtype == torch.float32


def test_compute_wider_than_storage_upcasts_parameters() -> None:
    seen: list[torch.dtype] = []

    class Probe(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(self.weight.dtype)
            return super().forward(x)

    layer = Probe(4, 4)
    model = nn.Sequential(nn.Linear(4, 4), precision(compute=fp32, storage=bf16)(layer))
    apply(model, default="bf16")
    assert layer.weight.dtype == bf16
    x = torch.randn(3, 4)
    y = model(x)
    assert seen == [fp32]
    assert isinstance(layer.weight, nn.Parameter) and layer.weight.dtype == bf16  # restored
    y.float().sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.dtype == bf16
    # hand-written: bf16 layer, then the fp32 computation with upcast weights
    h = model[0](x.to(bf16)).float()
    ref = torch.nn.functional.linear(h, layer.weight.float(), layer.bias.float()).to(bf16)
    assert_close(y, ref, rtol=0, atol=0)


def test_compile_fullgraph_aot_eager() -> None:
    model, *_ = island_model()
    apply(model, default=Policy(compute=bf16, storage=fp32))
    x = torch.randn(4, 8)
    eager = model(x)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    assert out.dtype == eager.dtype == bf16
    assert_close(out, eager, **tol(bf16))
    out.float().sum().backward()
    assert model[1].inner.weight.grad is not None


def test_compile_fullgraph_with_upcast_parameters() -> None:
    model = nn.Sequential(nn.Linear(4, 4), precision(compute=fp32, storage=bf16)(nn.Linear(4, 4)))
    apply(model, default="bf16")
    x = torch.randn(3, 4)
    out = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    assert_close(out, model(x), rtol=0, atol=0)


@pytest.mark.slow
def test_compile_fullgraph_inductor() -> None:
    model, *_ = island_model()
    apply(model, default=Policy(compute=bf16, storage=fp32))
    x = torch.randn(4, 8)
    out = torch.compile(model, fullgraph=True)(x)
    assert_close(out, model(x), **tol(bf16))


def test_function_form_runs_in_fp32_inside_autocast() -> None:
    seen: list[tuple[torch.dtype, bool]] = []

    @precision(fp32)
    def stable_softmax(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        seen.append((x.dtype, torch.is_autocast_enabled("cpu")))
        out = torch.zeros(3, x.shape[1], dtype=x.dtype).index_add_(0, index, x)
        return out.softmax(-1)

    x = torch.randn(6, 4, dtype=bf16)
    index = torch.tensor([0, 1, 2, 0, 1, 2])
    with torch.autocast("cpu", dtype=bf16):
        y = stable_softmax(x, index)
    assert seen == [(fp32, False)]
    assert y.dtype == bf16  # the caller's dtype
    ref = torch.zeros(3, 4).index_add_(0, index, x.float()).softmax(-1).to(bf16)
    assert_close(y, ref, rtol=0, atol=0)
    assert stable_softmax.__name__ == "stable_softmax"


def test_function_form_output_and_keep_dtype() -> None:
    @precision(compute=bf16, output=fp16, keep_dtype=("table",))
    def mix(x: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        return x * 2, table.dtype

    out, table_dtype = mix(torch.ones(2), table=torch.ones(2, dtype=torch.float64))
    assert out.dtype == fp16 and table_dtype == torch.float64


class Overflow(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_check_finite_names_module_and_forward() -> None:
    model = nn.Sequential(nn.Linear(4, 4), precision(fp16)(Overflow(1e6)))
    apply(model, default="fp32", check_finite=True)
    with pytest.raises(FloatingPointError, match=r"forward: outputs leaving module '1'"):
        model(torch.randn(2, 4))


def test_check_finite_names_module_and_backward() -> None:
    model = nn.Sequential(nn.Linear(4, 4), precision(fp16)(Overflow(300.0)))
    apply(model, default="fp32", check_finite=True)
    out = model(torch.randn(2, 4))
    assert torch.isfinite(out).all()
    with pytest.raises(FloatingPointError, match=r"backward: input gradients leaving module '1'"):
        (out * 1000).sum().backward()


def test_check_finite_does_not_change_the_graph() -> None:
    model = nn.Sequential(nn.Linear(4, 4), precision(fp16)(Overflow(1.0)))
    apply(model, default="fp32", check_finite=True)
    out = model[1](torch.randn(2, 4))
    # the casts are the same native casts as without the check: the check is a gradient hook
    assert type(out.grad_fn).__name__ == "ToCopyBackward0"


def test_check_finite_off_lets_values_through() -> None:
    model = nn.Sequential(nn.Linear(4, 4), precision(fp16)(Overflow(1e6)))
    apply(model, default="fp32")
    assert not torch.isfinite(model(torch.randn(2, 4))).all()


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    ids: torch.Tensor
    note: str


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []

    def forward(self, batch: Batch, items: list[Any], pair: Pair, *, extra: dict[str, Any],
                scale: float = 1.0) -> dict[str, Any]:
        self.seen.append((batch.x.dtype, batch.ids.dtype, [items[0].dtype, items[1][0].dtype],
                          pair.a.dtype, pair.b.dtype, extra["t"].dtype, extra["mask"].dtype))
        return {"y": batch.x * scale, "none": None, "ids": batch.ids, "pair": pair}


def test_nested_inputs_kwargs_and_none_outputs() -> None:
    inner = precision(compute=bf16)(Nested())
    model = nn.Sequential()
    model.add_module("inner", inner)
    apply(model, default=fp32)
    batch = Batch(torch.randn(2), torch.arange(2), "n")
    items = [torch.randn(2), (torch.randn(2, dtype=fp16),), 7]
    pair = Pair(torch.randn(2), torch.randn(2))
    out = inner(batch, items, pair, extra={"t": torch.randn(1), "mask": torch.ones(1).bool()},
                scale=2.0)
    (x_dt, ids_dt, item_dts, a_dt, b_dt, t_dt, mask_dt) = inner.seen[0]
    assert (x_dt, ids_dt, a_dt, b_dt, t_dt, mask_dt) == (bf16, torch.int64, bf16, bf16, bf16,
                                                         torch.bool)
    assert item_dts == [bf16, bf16]
    # outputs come back in the parent's compute dtype (fp32); None and ints pass through
    assert out["y"].dtype == fp32 and out["none"] is None and out["ids"].dtype == torch.int64
    assert isinstance(out["pair"], Pair) and out["pair"].a.dtype == fp32
    assert batch.x.dtype == fp32  # the caller's objects are not mutated


def test_module_called_twice_and_parameterless_modules() -> None:
    act = precision(fp32)(Recorder(nn.GELU()))
    lin = nn.Linear(4, 4)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.act = lin, act

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.act(self.lin(self.act(x)))
            return out

    model = Twice()
    apply(model, default="bf16")
    x = torch.randn(2, 4, requires_grad=True)
    y = model(x)
    assert act.seen == [fp32, fp32] and y.dtype == bf16
    y.float().sum().backward()
    ref_lin = copy.deepcopy(lin)
    xr = x.detach().clone().requires_grad_(True)
    gelu = nn.GELU()
    yr = gelu(ref_lin(gelu(xr.to(bf16).float()).to(bf16)).float()).to(bf16)
    assert_close(y, yr, rtol=0, atol=0)


def test_keep_dtype_protects_an_fp32_rotary_table() -> None:
    class RopeBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.seen: list[tuple[torch.dtype, torch.dtype, torch.dtype]] = []

        def forward(self, x: torch.Tensor, freqs: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            self.seen.append((x.dtype, freqs.dtype, pos.dtype))
            out: torch.Tensor = self.lin(x) * torch.cos(freqs).to(x.dtype)
            return out

    block = precision(bf16, keep_dtype=("freqs", 2))(RopeBlock())
    model = nn.ModuleDict({"block": block})
    apply(model, default=fp32)
    freqs, pos = torch.randn(4), torch.randn(4)
    block(torch.randn(2, 4), freqs=freqs, pos=pos)
    block(torch.randn(2, 4), freqs, pos)  # a name binds to the parameter, by position too
    assert block.seen == [(bf16, fp32, fp32), (bf16, fp32, fp32)]


def test_boundary_casts_appear_by_name_in_the_profiler() -> None:
    model, *_ = island_model()
    apply(model, default="bf16")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(torch.randn(2, 8)).float().sum().backward()
    names = {e.name for e in prof.events()}
    assert "precision_annot::cast_inputs[]" in names
    assert "precision_annot::cast_inputs[1]" in names
    assert "precision_annot::cast_outputs[1]" in names
    assert "aten::_to_copy" in names


def test_autocast_device_comes_from_integer_inputs_and_weights() -> None:
    from precision_annot._src.boundary import device_type_of as _device_type

    tokens = torch.zeros(2, 3, dtype=torch.long, device="meta")
    assert _device_type(None, (tokens,), {}, nn.Linear(2, 2)) == "meta"
    assert _device_type(None, (), {"ids": tokens}, nn.Linear(2, 2)) == "meta"
    assert _device_type(None, (3,), {}, nn.Linear(2, 2, device="meta")) == "meta"
    assert _device_type(None, (3,), {}, nn.ReLU()) == "cpu"
    assert _device_type(None, (tokens,), {}) == "meta"  # the function form: no module
    assert _device_type(torch.zeros(1), (tokens,), {}) == "cpu"  # a floating input wins


def test_fp16_islands_agree_with_hand_written_casts() -> None:
    torch.manual_seed(0)
    lin, norm = nn.Linear(4, 4), nn.LayerNorm(4)
    model = nn.Sequential(lin, precision(fp32)(norm))
    hand_lin = nn.Linear(4, 4)
    hand_lin.load_state_dict(lin.state_dict())
    apply(model, default="fp16")
    x = torch.randn(3, 4)
    with torch.no_grad():
        out = model(x)
        assert_close(out, norm(hand_lin.half()(x.half()).float()).half(), rtol=0, atol=0)
    assert torch.isfinite(out).all()


class Stack(nn.Module):
    """embed -> layers (a container) -> head, each layer a Recorder."""

    def __init__(self, container: str = "list") -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        layers = [Recorder(nn.Linear(4, 4)) for _ in range(2)]
        self.layers: nn.Module = (nn.ModuleList(layers) if container == "list" else
                                  nn.ModuleDict({f"l{i}": m for i, m in enumerate(layers)}))
        self.head = Recorder(nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        layers = self.layers if isinstance(self.layers, nn.ModuleList) else self.layers.values()
        for layer in layers:
            x = layer(x)
        out: torch.Tensor = self.head(x)
        return out


@pytest.mark.parametrize("container", ["list", "dict"])
def test_an_annotated_container_moves_its_boundary_to_the_children_that_run(
    container: str,
) -> None:
    model = Stack(container)
    annotate(model, {"layers": "fp32"})
    plan = resolve(model, default="bf16-mixed")
    children = [n for n in plan if n.startswith("layers.") and n.count(".") == 1]
    assert "layers" not in plan.boundaries and set(children) <= set(plan.boundaries)
    assert all(plan[c].policy.compute == fp32 for c in children)
    apply(model, plan)
    y = model(torch.randn(2, 4))
    layers = list(model.layers.children())
    assert [r.seen for r in layers] == [[fp32], [fp32]]
    assert [r.autocast for r in layers] == [[False], [False]]
    assert model.head.seen == [bf16] and model.head.autocast == [True] and y.dtype == bf16


class Caller(nn.Module):
    """Records the dtype its child hands back."""

    def __init__(self, child: nn.Module) -> None:
        super().__init__()
        self.child = child
        self.got: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.child(x)
        self.got.append(y.dtype)
        return y


def test_output_is_honoured_whatever_the_parents_output_is() -> None:
    child = precision(output=fp32)(nn.Linear(4, 4))
    model = precision(compute=bf16, output=fp32)(Caller(child))
    apply(model, default="bf16")
    assert model(torch.randn(2, 4)).dtype == fp32
    assert model.got == [fp32]  # 0.1 handed back bf16: the root's output hid the child's


class Cached(nn.Module):
    """Appends to a list cache and writes into a dict cache, as a KV cache does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor],
                state: dict[str, Any]) -> torch.Tensor:
        y: torch.Tensor = self.lin(x)
        cache.append(y.detach())
        state["steps"] = state.get("steps", 0) + 1
        return y


def test_containers_that_need_no_cast_are_passed_as_the_same_object() -> None:
    island = precision(fp32)(Cached())
    model = nn.Sequential()
    model.add_module("island", island)
    apply(model, default="bf16")
    cache: list[torch.Tensor] = []
    state: dict[str, Any] = {"ids": torch.arange(3)}
    island(torch.randn(2, 4, dtype=bf16), cache, state)
    island(torch.randn(2, 4, dtype=bf16), cache, state=state)
    assert len(cache) == 2 and state["steps"] == 2  # 0.1 rebuilt both: nothing came back


class WritesCache(nn.Module):
    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache[0] = x.sum()
        return x * 2


def test_an_in_place_write_into_a_cast_copy_warns_and_keep_dtype_fixes_it() -> None:
    island = precision(fp32)(WritesCache())
    model = nn.Sequential()
    model.add_module("island", island)
    apply(model, default="bf16")
    cache = torch.zeros(2, dtype=bf16)
    with pytest.warns(UserWarning, match=r"'island' modified its argument 1 in place.*keep_dtype"):
        island(torch.ones(3, dtype=bf16), cache)
    assert cache[0] == 0  # the write went to the fp32 copy
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        island(torch.ones(3, dtype=bf16), cache)  # warned once per argument

    kept = precision(fp32, keep_dtype=("cache",))(WritesCache())
    model = nn.Sequential()
    model.add_module("island", kept)
    apply(model, default="bf16")
    kept(torch.ones(3, dtype=bf16), cache)
    assert cache[0] == 3


class Rope(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.dtype, ...]] = []

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, /, pos: torch.Tensor) -> torch.Tensor:
        self.seen.append((x.dtype, freqs.dtype, pos.dtype))
        return x * freqs.cos().to(x.dtype)


def test_keep_dtype_binds_to_the_parameter_by_name_or_position() -> None:
    block = precision(bf16, keep_dtype=("pos", 1))(Rope())
    model = nn.ModuleDict({"block": block})
    apply(model, default=fp32)
    x, freqs, pos = torch.randn(4), torch.randn(4), torch.randn(4)
    block(x, freqs, pos)
    block(x, freqs, pos=pos)
    assert block.seen == [(bf16, fp32, fp32), (bf16, fp32, fp32)]


def test_keep_dtype_that_names_no_argument_is_an_error_at_apply() -> None:
    model = nn.Sequential(precision(bf16, keep_dtype=("freqs",))(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match=r"keep_dtype names 'freqs'.*Valid names: 'input'"):
        apply(model)
    assert installed_boundaries(model) == [] and model[0].weight.dtype == fp32  # untouched


class Probe(nn.Linear):
    """Records the dtype of its weight as its forward sees it, and a buffer's."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.register_buffer("table", torch.linspace(0, 1, 4))
        self.seen: list[tuple[torch.dtype, torch.dtype]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((self.weight.dtype, self.table.dtype))
        return super().forward(x) * self.table


def test_threads_see_their_own_upcast_parameters() -> None:
    """0.1 swapped module._parameters in place: in 300 steps, 214 gave the island no gradient,
    55 training steps and 12 evaluation steps raised. A plain model gives 0, 0, 0."""
    torch.manual_seed(0)
    island = precision(compute=fp32, storage=bf16)(Probe())
    model = nn.Sequential(nn.Linear(4, 4), island, nn.Linear(4, 4))
    apply(model, default="bf16")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    errors: list[str] = []
    no_grad_steps = 0
    stop = threading.Event()

    def evaluate() -> None:
        while not stop.is_set():
            try:
                with torch.no_grad():
                    model(torch.randn(8, 4))
            except Exception as e:  # pragma: no cover - the failure being tested
                errors.append(f"eval: {e}")

    thread = threading.Thread(target=evaluate)
    thread.start()
    try:
        for _ in range(150):
            opt.zero_grad()
            try:
                model(torch.randn(8, 4)).float().pow(2).sum().backward()
            except Exception as e:  # pragma: no cover - the failure being tested
                errors.append(f"train: {e}")
                continue
            if island.weight.grad is None or not island.weight.grad.abs().sum() > 0:
                no_grad_steps += 1
            opt.step()
    finally:
        stop.set()
        thread.join()
    assert errors == [] and no_grad_steps == 0
    assert island.weight.dtype == bf16 and island.weight.grad is not None
    assert island.weight.grad.dtype == bf16


def test_buffers_are_seen_in_a_wider_compute_dtype() -> None:
    """0.1 upcast parameters but not buffers: a bf16 rotary table in an fp32 island computed
    angles in bf16 (1.79 rad off at position 4095)."""
    class Angles(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 16, 2) / 16))
            self.seen: list[torch.dtype] = []

        def forward(self, pos: torch.Tensor) -> torch.Tensor:
            self.seen.append(self.inv_freq.dtype)
            return torch.outer(pos, self.inv_freq)

    angles = precision(compute=fp32, storage=bf16)(Angles())
    model = nn.Sequential(angles)
    apply(model, default="bf16")
    assert angles.inv_freq.dtype == bf16  # stored as planned
    pos = torch.arange(4096.0)
    out = angles(pos)  # positions in fp32: the root would round them to bf16 first
    assert angles.seen == [fp32]
    # the same computation by hand: the stored bf16 table, computed in fp32
    hand = torch.outer(pos, angles.inv_freq.float()).to(bf16)
    assert_close(out, hand, rtol=0, atol=0)
    bf16_compute = torch.outer(pos.to(bf16), angles.inv_freq)
    assert (bf16_compute.float() - hand.float()).abs().max() > 1  # what 0.1 computed


def test_a_batchnorm_island_over_bf16_storage_trains_and_keeps_its_statistics() -> None:
    """0.1: "expected scalar type Float but found BFloat16"."""
    torch.manual_seed(0)
    norm = precision(compute=fp32, storage=bf16)(nn.BatchNorm1d(4))
    model = nn.Sequential(nn.Linear(4, 4), norm)
    reference = nn.BatchNorm1d(4)
    apply(model, default="bf16")
    x = torch.randn(16, 4)
    out = model(x)
    out.float().sum().backward()
    h = model[0](x.to(bf16)).float()
    reference(h)
    assert norm.running_mean.dtype == bf16
    assert_close(norm.running_mean, reference.running_mean.to(bf16), rtol=0, atol=0)
    assert int(norm.num_batches_tracked) == 1
    assert norm.weight.grad is not None and norm.weight.grad.dtype == bf16


def test_check_finite_checks_the_roots_exit() -> None:
    class Blowup(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x / 0

    model = apply(nn.Sequential(Blowup()), check_finite=True)  # no policy at all
    with pytest.raises(FloatingPointError, match=r"outputs leaving module '\(root\)'"):
        model(torch.ones(2))


def test_check_finite_allows_in_place_ops_on_tensors_that_need_no_cast() -> None:
    """0.1: "Output 0 of BoundaryCastBackward is a view and is being modified inplace"."""
    class Inplace(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.mul_(2)  # in place on its input, which needs no cast

    def run(check: bool) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), precision(output=fp32)(Inplace()))  # a boundary
        apply(model, default="fp32", check_finite=check)
        x = torch.randn(2, 4, requires_grad=True)
        out = model(x)
        out.add_(1)  # in place on a tensor that left the boundary without a cast
        out.sum().backward()
        assert x.grad is not None
        return out, x.grad

    plain, checked = run(False), run(True)
    assert_close(plain[0], checked[0], rtol=0, atol=0)
    assert_close(plain[1], checked[1], rtol=0, atol=0)


def test_an_applied_model_runs_on_meta_tensors() -> None:
    """0.1: "unknown device type for autocast"."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), precision(fp32)(nn.LayerNorm(4)))
    apply(model, default="bf16-mixed")
    out = model(torch.empty(2, 4, device="meta"))
    assert out.device.type == "meta" and out.shape == (2, 4)


class Steps(nn.Module):
    """Returns a generator, as a layer-by-layer streaming module might."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[tuple[torch.dtype, bool]] = []

    def forward(self, x: torch.Tensor) -> Iterator[torch.Tensor]:
        for _ in range(3):
            x = self.lin(x)
            self.seen.append((x.dtype, torch.is_autocast_enabled("cpu")))
            yield x


def test_a_generator_from_an_island_runs_in_the_island_and_hands_back_the_callers_dtype() -> (
        None):
    island = precision(fp32)(Steps())
    with precision_scope("bf16-mixed"):
        model = nn.Sequential(nn.Linear(4, 4))
    model.add_module("steps", island)

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = model

        def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
            return list(self.body.steps(self.body[0](x)))

    root = Root()
    apply(root, default="bf16-mixed")
    items = root(torch.randn(2, 4))
    assert [t.dtype for t in items] == [bf16, bf16, bf16]  # 0.1 leaked fp32 into the parent
    assert island.seen == [(fp32, False)] * 3  # each step ran as the island, not the caller
    gen = island(torch.randn(2, 4))
    assert isinstance(gen, types.GeneratorType)


def test_a_dataparallel_replica_runs_its_own_parameters() -> None:
    """torch's `replicate` (CUDA only) calls `_replicate_for_data_parallel` on each module and
    sets the copied parameters on the replicas as plain attributes; done here on CPU."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), precision(compute=fp32, storage=bf16)(Probe()))
    apply(model, default="bf16")
    modules = list(model.modules())
    replicas = [m._replicate_for_data_parallel() for m in modules]  # type: ignore[no-untyped-call]
    index = {m: i for i, m in enumerate(modules)}
    for module, replica in zip(modules, replicas, strict=True):
        for key, child in module._modules.items():
            setattr(replica, key, replicas[index[child]])  # type: ignore[index]
        for key, param in module._parameters.items():
            assert param is not None
            setattr(replica, key, param.detach().clone() * 0 + 1)  # a different copy
    x = torch.randn(2, 4)
    out = replicas[0](x)
    # the replica's own weights (all ones), computed as the plan says: fp32 island over bf16
    ones = torch.ones(4, 4, dtype=bf16)
    h = nn.functional.linear(x.to(bf16), ones, torch.ones(4, dtype=bf16))
    hand = (nn.functional.linear(h.float(), ones.float(), torch.ones(4)) *
            modules[2].table.float()).to(bf16)
    assert_close(out, hand, rtol=0, atol=0)
    assert modules[2].seen[-1] == (fp32, fp32)  # weight and persistent buffer, upcast
    assert model[1].weight.dtype == bf16 and not torch.equal(model[1].weight, ones)


def test_a_dtype_error_after_drift_names_the_module_the_dtypes_and_the_fix() -> None:
    model = nn.Sequential(nn.Linear(4, 4), precision(fp32)(nn.Linear(4, 4)))
    apply(model, default="bf16")
    model[1].half()
    with pytest.raises(RuntimeError, match=r"Module '1'.*weight is fp16, planned fp32.*apply\("):
        model(torch.randn(2, 4))


def test_the_function_form_keeps_dtype_by_position_too() -> None:
    @precision(compute=bf16, keep_dtype=("table",))
    def mix(x: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        return x * 2, table.dtype

    _, by_position = mix(torch.ones(2), torch.ones(2))
    assert by_position == fp32


def test_batchnorm_statistics_in_an_island_are_kept_under_compile() -> None:
    def make() -> nn.Sequential:
        torch.manual_seed(0)
        norm = precision(compute=fp32, storage=bf16)(nn.BatchNorm1d(4))
        return apply(nn.Sequential(nn.Linear(4, 4), norm), default="bf16")

    compiled, eager = make(), make()
    run = torch.compile(compiled, fullgraph=True, backend="aot_eager")
    x = torch.randn(8, 4)
    for _ in range(3):
        assert_close(run(x), eager(x), rtol=0, atol=0)
    assert_close(compiled[1].running_mean, eager[1].running_mean, rtol=0, atol=0)
    assert compiled[1].running_mean.abs().sum() > 0 and int(compiled[1].num_batches_tracked) == 3


def test_compiled_islands_follow_the_autocast_state_of_each_call() -> None:
    """Under torch.compile a boundary reads the autocast state at trace time (a guard
    recompiles when it changes), so an island switches off an outer autocast it meets later."""
    island = precision(fp32)(Recorder(nn.LayerNorm(4)))
    model = nn.Sequential(nn.Linear(4, 4), island, nn.Linear(4, 4))
    apply(model, default="bf16")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 4)
    plain = compiled(x)
    with torch.autocast("cpu", dtype=bf16):
        inside = compiled(x)
    assert plain.dtype == inside.dtype == bf16
    assert_close(inside, model(x), rtol=0, atol=0)  # the island ran in fp32 both times
