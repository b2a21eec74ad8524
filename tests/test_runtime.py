"""Runtime rules: storage, boundary casts, autocast, output casts, cost, apply/remove, compile."""

from __future__ import annotations

import copy
import dataclasses
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
    remove,
    resolve,
)
from precision_annot.casting import cast_tree
from precision_annot.runtime import installed_boundaries
from tests.helpers import Recorder, tol

LOW = [bf16, fp16]


def island_model() -> tuple[nn.Sequential, Recorder, Recorder, Recorder]:
    """seeds/001: f (low) -> g (fp32 island) -> f (low)."""
    torch.manual_seed(0)
    f1 = Recorder(nn.Linear(8, 8))
    g = precision(fp32)(Recorder(nn.LayerNorm(8)))
    f2 = Recorder(nn.Linear(8, 4))
    return nn.Sequential(f1, g, f2), f1, g, f2


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


@pytest.mark.parametrize("src", [fp32, bf16, fp16])
@pytest.mark.parametrize("dst", [fp32, bf16, fp16, torch.float64])
def test_boundary_cast_is_exact(src: torch.dtype, dst: torch.dtype) -> None:
    x = torch.randn(17, 3, dtype=src, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y = cast_tree(x, dst)
    y2 = x2.to(dst)
    assert_close(y, y2, rtol=0, atol=0)
    grad = torch.randn_like(y2)
    y.backward(grad)
    y2.backward(grad)
    assert x.grad is not None and x.grad.dtype == src
    assert_close(x.grad, x2.grad, rtol=0, atol=0)


def test_cast_to_same_dtype_returns_the_same_object() -> None:
    x = torch.randn(3)
    assert cast_tree(x, fp32) is x
    tree = {"a": x, "b": [x, torch.arange(3)]}
    assert cast_tree(tree, fp32) is tree
    ints = torch.arange(4)
    out = cast_tree({"x": x, "ids": ints, "n": 3, "s": "text"}, bf16)
    assert out["ids"] is ints and out["n"] == 3 and out["s"] == "text" and out["x"].dtype == bf16


def test_hooks_only_at_boundaries() -> None:
    with precision_scope("bf16-mixed"):
        model = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)) for _ in range(3)))
    annotate(model, {nn.LayerNorm: "fp32"})
    plan = resolve(model)
    apply(model, plan)
    assert len(installed_boundaries(model)) == len(plan.boundaries) == 4
    assert sorted(installed_boundaries(model)) == sorted(plan.boundaries)
    no_boundary = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    plan2 = resolve(no_boundary, default=Policy(storage=fp32))
    apply(no_boundary, plan2)
    assert plan2.boundaries == ()
    assert all("forward" not in m.__dict__ for m in no_boundary.modules())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in no_boundary.modules())


def test_apply_twice_equals_once_and_remove_restores() -> None:
    model, *_ = island_model()
    original = {n: p.dtype for n, p in model.named_parameters()}
    apply(model, default="bf16")
    first = {n: m.__dict__["forward"] for n, m in model.named_modules() if "forward" in m.__dict__}
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    apply(model, default="bf16")
    again = {n: m.__dict__["forward"] for n, m in model.named_modules() if "forward" in m.__dict__}
    assert first == again and all(first[n] is again[n] for n in first)
    for n, p in model.named_parameters():
        assert_close(p, weights[n], rtol=0, atol=0)

    remove(model)
    assert installed_boundaries(model) == []
    assert {n: p.dtype for n, p in model.named_parameters()} == original
    with pytest.raises(RuntimeError, match=r"dtype|type"):
        model(torch.randn(2, 8, dtype=bf16))  # plain PyTorch: bf16 input into fp32 Linear
    assert remove(model) is model  # a second remove is harmless


def test_apply_with_a_changed_plan_reapplies() -> None:
    model, _, g, _ = island_model()
    apply(model, default="bf16")
    precision(fp16)(model[0])
    apply(model, default="bf16")
    assert model[0].inner.weight.dtype == fp16
    model(torch.randn(2, 8))
    assert model[0].seen[-1] == fp16 and g.seen[-1] == fp32


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


# --- odd inputs and modules ----------------------------------------------------------------------

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


def test_bad_input_to_apply() -> None:
    with pytest.raises(TypeError, match="apply expects an nn.Module"):
        apply("model")  # type: ignore[type-var]
    with pytest.raises(TypeError, match="plan must be a PrecisionPlan"):
        apply(nn.Linear(2, 2), {"": "fp32"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="both plan= and default="):
        apply(nn.Linear(2, 2), resolve(nn.Linear(2, 2)), default="bf16")
    plan = resolve(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)))
    with pytest.raises(ValueError, match=r"another model.*'2'"):
        apply(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), plan)
    with pytest.raises(ValueError, match=r"module '1' is .*GELU"):
        apply(nn.Sequential(nn.Linear(2, 2), nn.GELU(), nn.Linear(2, 2)), plan)


def test_scope_inside_an_applied_forward_points_to_the_function_form() -> None:
    class Bad(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with precision_scope(fp32):
                return x

    model = apply(Bad(), default="bf16")
    with pytest.raises(RuntimeError, match=r"function form.*precision\(fp32\)\(fn\)"):
        model(torch.randn(2))
    with precision_scope(fp32):  # the depth counter was restored
        pass


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


def test_applied_model_survives_deepcopy() -> None:
    model, *_ = island_model()
    apply(model, default="bf16")
    clone = copy.deepcopy(model)
    clone(torch.randn(2, 8))
    assert clone[1].seen == [fp32] and model[1].seen == []


def test_autocast_device_comes_from_integer_inputs_and_weights() -> None:
    from precision_annot.boundary import device_type_of as _device_type

    tokens = torch.zeros(2, 3, dtype=torch.long, device="meta")
    assert _device_type(None, (tokens,), {}, nn.Linear(2, 2)) == "meta"
    assert _device_type(None, (), {"ids": tokens}, nn.Linear(2, 2)) == "meta"
    assert _device_type(None, (3,), {}, nn.Linear(2, 2, device="meta")) == "meta"
    assert _device_type(None, (3,), {}, nn.ReLU()) == "cpu"
    assert _device_type(None, (tokens,), {}) == "meta"  # the function form: no module
    assert _device_type(torch.zeros(1), (tokens,), {}) == "cpu"  # a floating input wins


def test_print_shows_each_module_precision_until_removed() -> None:
    model, *_ = island_model()
    plain = repr(model)
    apply(model, default="bf16")
    text = repr(model)
    lines = [line.strip() for line in text.splitlines()]
    assert lines[1] == "precision=compute=bf16,storage=bf16,comm=bf16*"  # the root, a boundary
    assert "(1): Recorder(" in lines and "precision=compute=fp32,storage=fp32,comm=fp32*" in lines
    assert ("(inner): Linear(in_features=8, out_features=8, bias=True, "
            "precision=compute=bf16,storage=bf16,comm=bf16)") in lines
    remove(model)
    assert repr(model) == plain


# --- apply and remove: the regressions of 0.1 ----------------------------------------------------

def _island() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), precision(fp32)(Recorder(nn.LayerNorm(4))),
                         nn.Linear(4, 4))


def test_boundaries_come_from_the_policies_not_a_stale_flag_in_a_plan_file() -> None:
    import json

    from precision_annot import PrecisionPlan

    model = nn.Sequential(nn.Linear(4, 4), Recorder(nn.LayerNorm(4)), nn.Linear(4, 4))
    data = json.loads(resolve(model, default="bf16").to_json())
    entry = next(e for e in data["modules"] if e["name"] == "1")
    entry["policy"] = "compute=fp32,storage=fp32"  # hand-edited; "boundary" left false
    assert entry["boundary"] is False
    plan = PrecisionPlan.from_json(json.dumps(data))
    assert "1" in plan.boundaries
    apply(model, plan)
    model(torch.randn(2, 4))
    assert model[1].seen == [fp32] and model[1].autocast == [False]


class Rotary(nn.Module):
    """Llama's rotary embedding, reduced: a non-persistent fp32 table, angles in fp32."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("scale", torch.ones(1))  # persistent: follows storage

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        angles = positions[:, None].float() * self.inv_freq[None, :].float()
        return angles.cos().to(x.dtype)


def test_non_persistent_buffers_keep_the_dtype_they_were_built_in() -> None:
    rotary = Rotary()
    model = nn.ModuleDict({"rotary": rotary})
    apply(model, default="bf16")
    assert rotary.inv_freq.dtype == fp32 and rotary.scale.dtype == bf16
    positions = torch.arange(4032, 4096)
    x = torch.randn(1, dtype=bf16)
    cos = rotary(x, positions)
    exact = (positions[:, None].double() * Rotary().inv_freq[None, :].double()).cos()
    error = (cos.double() - exact).abs().max().item()
    assert error < 0.005, error  # bf16 rounding of the result only
    rounded = (positions[:, None].float() * rotary.inv_freq.to(bf16).float()).cos()
    assert (rounded.double() - exact).abs().max().item() > 0.3  # 0.1 rounded the table to bf16
    remove(model)
    assert rotary.inv_freq.dtype == fp32 and rotary.scale.dtype == fp32


@pytest.mark.parametrize("drift", ["half", "to", "assign"])
def test_apply_again_restores_the_plan_after_dtypes_drift(drift: str) -> None:
    model = _island()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    plan = resolve(model, default="bf16")
    apply(model, plan)
    if drift == "half":
        model.half()
    elif drift == "to":
        model.to(torch.float64)
    else:
        model.load_state_dict(state, assign=True)  # fp32 tensors replace the parameters
    assert model[0].weight.dtype != bf16
    apply(model, plan)
    assert model[0].weight.dtype == bf16 and model[2].bias.dtype == bf16
    assert model[1].inner.weight.dtype == fp32
    assert model(torch.randn(2, 4)).dtype == bf16
    remove(model)
    assert {p.dtype for p in model.parameters()} == {fp32}


def test_apply_a_submodule_again_after_removing_its_parent() -> None:
    model = _island()
    sub = model[1]
    apply(sub, default="bf16")
    remove(model)
    assert installed_boundaries(sub) == []
    apply(sub, default="bf16")
    assert installed_boundaries(sub) == [""]
    apply(model, default="bf16")  # the parent takes over the submodule's record
    remove(model)
    assert {p.dtype for p in model.parameters()} == {fp32} and installed_boundaries(model) == []


class RefusesCast(nn.Parameter):
    """A parameter whose cast raises, as a broken tensor subclass's would."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.to:
            raise RuntimeError("this parameter cannot be cast")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_apply_is_atomic_when_a_cast_fails() -> None:
    model = _island()
    model[2].weight = RefusesCast(model[2].weight.detach())
    before = {n: (p.dtype, p.detach().clone()) for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match="cannot be cast"):
        apply(model, default="bf16")
    after = {n: (p.dtype, p.detach()) for n, p in model.named_parameters()}
    assert {n: d for n, (d, _) in after.items()} == {n: d for n, (d, _) in before.items()}
    assert all(torch.equal(before[n][1], after[n][1]) for n in before)
    assert installed_boundaries(model) == [] and "_precision_annot_state" not in model.__dict__


def test_annotate_is_atomic_when_a_later_rule_fails() -> None:
    model = _island()
    with pytest.raises(ValueError, match="matches no module"):
        annotate(model, [("0", "bf16"), ("nope", "fp32")])
    assert resolve(model)["0"].policy == Policy()


def test_tied_weights_with_one_owner_unset_and_the_other_bf16_are_an_error() -> None:
    emb, head = nn.Embedding(4, 2), nn.Linear(2, 4, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": precision(storage=bf16)(head)})
    with pytest.raises(ValueError, match=r"shared by modules 'emb' \(storage=fp32, unset.*'head'"):
        resolve(model)


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
