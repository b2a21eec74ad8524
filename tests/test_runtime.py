"""`apply` and `remove`: storage, idempotence, atomicity, drift, and what `remove` restores."""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from precision_annot import (
    Policy,
    annotate,
    apply,
    audit,
    bf16,
    check,
    fp16,
    fp32,
    precision,
    precision_scope,
    remove,
    resolve,
)
from precision_annot._src.boundary import Boundary
from precision_annot._src.runtime import applied_plan, installed_boundaries
from tests.helpers import Recorder, island_model


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
    with pytest.warns(UserWarning, match=r"2 tensor\(s\) stored narrower than before the first "
                      r"apply \(fp32\).*'0\.inner\.weight': bf16 -> fp16.*rounding of bf16"):
        apply(model, default="bf16")
    assert model[0].inner.weight.dtype == fp16
    model(torch.randn(2, 8))
    assert model[0].seen[-1] == fp16 and g.seen[-1] == fp32


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


def test_applied_model_survives_deepcopy() -> None:
    model, *_ = island_model()
    apply(model, default="bf16")
    clone = copy.deepcopy(model)
    clone(torch.randn(2, 8))
    assert clone[1].seen == [fp32] and model[1].seen == []


def test_a_copied_models_plan_holds_the_copys_modules() -> None:
    """deepcopy copied the plan's weak references as they were: the copy's plan named the
    original's modules, so an adapter given it (a DDP hook, FSDP units) saw the wrong
    parameters."""
    model, *_ = island_model()
    apply(model, default="bf16")
    clone = copy.deepcopy(model)
    plan = applied_plan(clone)
    assert plan is not None and plan.module("0") is clone[0] and plan.module("") is clone
    assert {id(p) for _, p, _ in plan.param_policies()} == {id(p) for p in clone.parameters()}
    assert applied_plan(model).module("0") is model[0]  # type: ignore[union-attr]


def test_an_applied_model_pickles_and_its_plan_binds_to_the_loaded_model() -> None:
    """torch.save(model) raised "cannot pickle 'weakref.ReferenceType' object"."""
    model, *_ = island_model()
    apply(model, default="bf16")
    buffer = io.BytesIO()
    torch.save(model, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    x = torch.randn(2, 8)
    assert torch.equal(loaded(x), model(x))
    assert loaded[1].seen[-1] == fp32 and loaded[0].seen[-1] == bf16
    plan = applied_plan(loaded)
    assert plan is not None and plan.module("1") is loaded[1] and plan == applied_plan(model)
    alone = pickle.loads(pickle.dumps(applied_plan(model)))  # a plan pickles without its model
    assert alone == plan and not alone.has_model


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


@pytest.mark.parametrize("drift", ["half", "to"])
def test_apply_again_restores_the_plan_after_dtypes_drift(drift: str) -> None:
    model = _island()
    plan = resolve(model, default="bf16")
    apply(model, plan)
    if drift == "half":
        model.half()
    else:
        model.to(torch.float64)
    assert model[0].weight.dtype != bf16
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        apply(model, plan)
    # after half(), the fp16 values are what is left of the fp32 ones: said, once
    assert ["stored narrower than before the first apply" in str(w.message) for w in seen] == (
        [True] if drift == "half" else [])
    assert model[0].weight.dtype == bf16 and model[2].bias.dtype == bf16
    assert model[1].inner.weight.dtype == fp32
    assert model(torch.randn(2, 4)).dtype == bf16
    remove(model)
    assert {p.dtype for p in model.parameters()} == {fp32}


def test_apply_without_a_plan_reapplies_as_the_model_was_applied() -> None:
    """0.3's apply(model) after .half() re-resolved the bare annotations without the default
    that was applied, and the next forward failed with a raw dtype error. It now re-resolves
    with that default (a new annotation is taken up), or reuses a plan given explicitly."""
    model = _island()
    apply(model, default="bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.half()
        apply(model)
    assert model[0].weight.dtype == bf16 and model[1].inner.weight.dtype == fp32
    assert model(torch.randn(2, 4)).dtype == bf16
    annotate(model, {"2": "fp32"})
    apply(model)  # the annotation is taken up, with the same default
    assert model[2].weight.dtype == fp32 and model[0].weight.dtype == bf16
    given = _island()
    explicit = resolve(given, default="bf16").with_policies({"2": Policy.parse("fp32")})
    apply(given, explicit)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        given.half()
        apply(given)
    assert applied_plan(given) == explicit and given[2].weight.dtype == fp32


def test_an_optimizer_built_before_apply_is_refused_with_the_cause() -> None:
    """0.3 ended in torch's raw "expected dtype float for `end` but got dtype c10::BFloat16"."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    apply(model, default="bf16")
    model(torch.randn(2, 4)).float().sum().backward()
    with pytest.raises(RuntimeError, match=r"AdamW.step\(\): it holds state for parameter "
                                           r"'0.weight' \(exp_avg, exp_avg_sq in fp32\) built "
                                           r"before precision_annot.apply stored that parameter "
                                           r"in bf16.*Build the optimizer after apply"):
        optimizer.step()
    rebuilt = torch.optim.AdamW(model.parameters())
    rebuilt.load_state_dict(optimizer.state_dict())  # the fix the message gives
    rebuilt.step()
    assert rebuilt.state[model[0].weight]["exp_avg"].dtype == bf16
    fresh = nn.Linear(4, 4)  # an optimizer built after apply is not touched
    apply(fresh, default="bf16")
    after = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        fresh(torch.randn(2, 4, dtype=bf16)).float().sum().backward()
        after.step()


def test_a_drift_error_says_which_cause_it_is() -> None:
    """Tensors passed to torch.func.functional_call are not the model's: 0.3 told the user to
    apply again, which changes nothing."""
    model = nn.Sequential(nn.Linear(4, 4), precision(fp32)(nn.Linear(4, 4)))
    apply(model, default="bf16")
    passed = {n: p.detach().half() for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match=r"Module '\(root\)'.*0\.weight is fp16, planned "
                                           r"bf16.*These tensors were passed in for this call "
                                           r"\(torch\.func\.functional_call"):
        torch.func.functional_call(model, passed, (torch.randn(2, 4),))
    planned = {n: p.detach() for n, p in model.named_parameters()}
    assert torch.func.functional_call(model, planned, (torch.randn(2, 4),)).dtype == bf16


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


# -- entry points: a module called on its own, wrappers, export, conversions -------------------

class Seen(nn.Module):
    """A Linear that records the dtype it computed in and whether autocast was on."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.log: list[tuple[torch.dtype, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x)
        self.log.append((out.dtype, torch.is_autocast_enabled("cpu")))
        return out


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Seen()
        self.norm = precision(fp32)(nn.LayerNorm(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.norm(self.body(x))
        return out


class EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.decoder = Seen()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.decoder(self.encoder(x))
        return out


@pytest.mark.parametrize("default", ["bf16", "bf16-mixed"])
def test_a_submodule_called_on_its_own_runs_as_planned(default: str) -> None:
    """0.2: with bf16 storage `model.encoder(x)` on an fp32 x raised "mat1 and mat2 must have
    the same dtype"; with bf16-mixed it ran in fp32, silently. generate() calls encoders so."""
    model = EncoderDecoder()
    apply(model, default=default)
    out = model.encoder(torch.randn(2, 4))
    assert model.encoder.body.log[-1] == (bf16, default == "bf16-mixed")
    assert out.dtype == bf16  # its fp32 norm hands back to the encoder's own compute
    with audit(model) as report:
        model.encoder(torch.randn(2, 4)).float().sum().backward()
    assert report.divergences == []
    model(torch.randn(2, 4))  # and through the model, as before
    assert model.encoder.body.log[-1] == (bf16, default == "bf16-mixed")


def test_inside_the_model_a_submodule_runs_as_the_models_code_says() -> None:
    """An entry guard acts only when called from outside: a parent that calls a child with
    autocast off on purpose (a router kept in fp32) is not overruled."""
    class Router(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Sequential(Seen())
            self.rest = Seen()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", enabled=False):
                logits = self.gate(x.float())
            out: torch.Tensor = self.rest(x) + logits
            return out

    model = apply(Router(), default="bf16-mixed")
    model(torch.randn(2, 4))
    assert model.gate[0].log[-1] == (fp32, False)
    assert model.rest.log[-1] == (bf16, True)
    model.gate(torch.randn(2, 4))  # called alone, it runs as planned
    assert model.gate[0].log[-1] == (bf16, True)


def test_leaves_and_unchanged_subtrees_get_no_entry_guard() -> None:
    model = EncoderDecoder()
    apply(model, default="bf16-mixed")
    guarded = sorted(n for n, m in model.named_modules()
                     if isinstance(m.__dict__.get("forward"), Boundary)
                     and m.__dict__["forward"].guard)
    assert guarded == ["decoder", "encoder", "encoder.body"]  # modules with submodules
    assert "forward" not in model.encoder.body.lin.__dict__  # a leaf: nothing per call
    plain = apply(nn.Sequential(nn.Sequential(nn.Linear(2, 2))), default="output=fp32")
    assert installed_boundaries(plain) == [""]  # the root casts its output ...
    assert "forward" not in plain[0].__dict__  # ... and sets up nothing a guard would repeat


def test_a_conversion_after_apply_is_said_once_and_names_a_tensor() -> None:
    """0.2: Trainer(bf16_full_eval=True) runs model.to(bf16); the islands and fp32 master
    weights then trained in bf16 with no message."""
    model = EncoderDecoder()
    apply(model, default="bf16-mixed")
    with pytest.warns(UserWarning, match=r"changed tensors of an applied model away from the "
                      r"plan \(first: '.*weight' is bf16, planned fp32\)") as caught:
        model.to(bf16)
    (said,) = [w for w in caught if "away from the plan" in str(w.message)]
    assert said.filename == __file__  # points at the user's .to(), not into torch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.to(bf16)  # said once per apply
    with pytest.warns(UserWarning, match="keep the rounding of bf16"):
        apply(model, default="bf16-mixed")  # restores the plan (from the rounded values)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.to("cpu")  # a move that keeps the dtypes says nothing
    assert model.encoder.norm.weight.dtype == fp32
    state = {k: v.to(bf16) for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning, match="narrower than the plan keeps them"):
        model.load_state_dict(state, assign=True)  # the fp32 norm saved in bf16: said
    assert model.encoder.norm.weight.dtype == fp32  # and kept as planned
    remove(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.to(fp16)  # no plan, nothing to say


def test_export_traces_the_plan_and_script_is_refused_with_the_way_out() -> None:
    """0.2: both failed on Boundary.__code__ / __globals__."""
    torch.manual_seed(0)
    model = EncoderDecoder()
    apply(model, default="bf16-mixed")
    x = torch.randn(3, 4)
    exported = torch.export.export(model, (x,))
    assert torch.equal(exported.module()(x), model(x))
    assert exported.module()(x).dtype == bf16
    scriptable = apply(nn.Sequential(nn.Linear(4, 4), precision(fp32)(nn.LayerNorm(4))),
                       default="bf16")
    with pytest.raises(RuntimeError, match=r"torch.jit.script cannot compile module "
                                           r"'\(root\)'.*torch.export.export.*remove"):
        torch.jit.script(scriptable)
    remove(scriptable)
    assert torch.jit.script(scriptable)(x).dtype == fp32  # plain again


def test_every_entry_point_sees_through_compile_and_data_parallel() -> None:
    """0.2: audit(torch.compile(model)) raised "plan made for another model"; check on it
    compared against the bare annotations."""
    model = EncoderDecoder()
    apply(model, default="bf16-mixed")
    compiled = torch.compile(model)
    assert applied_plan(compiled) is applied_plan(model)
    assert resolve(compiled).model_type == "EncoderDecoder"
    with audit(compiled) as report:
        model(torch.randn(2, 4)).float().sum().backward()
    assert report.divergences == [] and report.plan is applied_plan(model)
    assert check(compiled) == check(applied_plan(model))  # type: ignore[arg-type]
    wrapped = nn.DataParallel(model)
    assert installed_boundaries(wrapped) == installed_boundaries(model)
    remove(compiled)
    assert installed_boundaries(model) == [] and model.encoder.norm.weight.dtype == fp32
