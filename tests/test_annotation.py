"""Annotation and resolution: precedence, scopes across threads and tasks, rules, plan I/O."""

from __future__ import annotations

import asyncio
import itertools
import threading

import pytest
import torch
from torch import nn

from precision_annot import (
    Policy,
    PrecisionPlan,
    annotate,
    apply,
    bf16,
    fp16,
    fp32,
    fp64,
    precision,
    precision_scope,
    resolve,
)
from precision_annot.runtime import installed_boundaries


def test_precision_on_class_returns_same_class_and_subclasses_inherit() -> None:
    class Base(nn.Linear):
        pass

    tagged = precision(fp32)(Base)
    assert tagged is Base

    class Child(Base):
        pass

    @precision(compute=bf16)
    class Grandchild(Child):
        pass

    assert resolve(Child(2, 2))[""].policy == Policy(fp32, fp32, fp32)
    # the nearest tag in the MRO wins, as a whole
    assert resolve(Grandchild(2, 2))[""].policy == Policy(compute=bf16)
    assert resolve(Grandchild(2, 2))[""].sources["compute"] == "class"


def test_precision_on_instance_returns_the_instance() -> None:
    norm = nn.LayerNorm(3)
    assert precision(fp32)(norm) is norm
    assert resolve(norm)[""].sources == {
        "compute": "instance", "storage": "instance", "comm": "instance", "output": None
    }


def test_keep_dtype_is_stored() -> None:
    block = precision(bf16, keep_dtype=("freqs", 2))(nn.Linear(2, 2))
    assert resolve(block)[""].keep_dtype == ("freqs", 2)
    with pytest.raises(TypeError, match="keep_dtype"):
        precision(bf16, keep_dtype=(1.5,))  # type: ignore[arg-type]


def test_precision_refuses_a_target_as_spec() -> None:
    with pytest.raises(TypeError, match=r"@precision\(fp32\)"):
        precision(nn.Linear)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not an nn.Module subclass"):
        precision(fp32)(int)
    with pytest.raises(TypeError, match="Received: 3"):
        precision(fp32)(3)  # type: ignore[call-overload]


# --- precedence: each level against each other ---------------------------------------------------

LEVELS = ["instance", "class", "scope", "inherited", "default"]


def _build(levels: set[str]) -> tuple[nn.Module, nn.Module]:
    """A parent with one child; `levels` says which levels set compute, each to its own dtype."""
    dtypes = {"instance": fp64, "class": fp16, "scope": bf16, "inherited": fp32}

    class Leaf(nn.Linear):
        pass

    if "class" in levels:
        precision(compute=dtypes["class"])(Leaf)
    if "scope" in levels:
        with precision_scope(compute=dtypes["scope"]):
            leaf = Leaf(2, 2)
    else:
        leaf = Leaf(2, 2)
    if "instance" in levels:
        precision(compute=dtypes["instance"])(leaf)
    root = nn.Sequential(leaf)
    if "inherited" in levels:
        precision(compute=dtypes["inherited"])(root)
    return root, leaf


@pytest.mark.parametrize(("higher", "lower"), list(itertools.combinations(range(len(LEVELS)), 2)))
def test_precedence_table(higher: int, lower: int) -> None:
    levels = {LEVELS[higher], LEVELS[lower]} - {"default"}
    root, _ = _build(levels)
    has_default = "default" in (LEVELS[higher], LEVELS[lower])
    default = Policy(compute=torch.float32) if has_default else None
    entry = resolve(root, default)["0"]
    winner = LEVELS[higher]
    expected = {"instance": fp64, "class": fp16, "scope": bf16, "inherited": fp32,
                "default": fp32}[winner]
    assert entry.policy.compute == expected
    # a default reaches the child through the root, so the child sees it as inherited
    assert entry.sources["compute"] == ("inherited" if winner == "default" else winner)


def test_default_fills_root_fields_only_where_nothing_is_set() -> None:
    root = precision(compute=fp32)(nn.Sequential(nn.Linear(2, 2)))
    plan = resolve(root, default="bf16-mixed")
    assert plan[""].policy == Policy(compute=fp32, storage=fp32, comm=fp32)
    assert plan[""].sources == {"compute": "instance", "storage": "default", "comm": "default",
                                "output": None}


def test_instance_and_rule_later_call_wins_field_by_field() -> None:
    lin = nn.Linear(2, 2)
    model = nn.Sequential(lin)
    precision(compute=fp16, storage=fp32)(lin)
    annotate(model, {"0": "compute=bf16"})
    entry = resolve(model)["0"]
    assert entry.policy == Policy(compute=bf16, storage=fp32)
    assert entry.sources["compute"] == "rule" and entry.sources["storage"] == "instance"
    precision(compute=fp64)(lin)
    assert resolve(model)["0"].sources["compute"] == "instance"


def test_output_is_not_inherited() -> None:
    model = precision(compute=bf16, output=fp32)(nn.Sequential(nn.Linear(2, 2)))
    plan = resolve(model)
    assert plan[""].policy.output == fp32
    assert plan["0"].policy.output is None
    assert plan.boundaries == ("",)


# --- scopes --------------------------------------------------------------------------------------

def test_scope_tags_root_submodules_and_parameterless_modules() -> None:
    with precision_scope(compute=bf16):
        model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Sequential(nn.GELU()))
    plan = resolve(model)
    assert all(e.sources["compute"] == "scope" for e in plan.values())


def test_nested_scopes_merge_and_inner_wins() -> None:
    with precision_scope(compute=bf16, storage=fp32):
        outer = nn.Linear(2, 2)
        with precision_scope(compute=fp16, comm=bf16):
            inner = nn.Linear(2, 2)
        after = nn.Linear(2, 2)
    assert resolve(outer)[""].policy == Policy(compute=bf16, storage=fp32)
    assert resolve(inner)[""].policy == Policy(compute=fp16, storage=fp32, comm=bf16)
    assert resolve(after)[""].policy == Policy(compute=bf16, storage=fp32)
    assert resolve(nn.Linear(2, 2))[""].policy == Policy()


def test_scope_restores_state_after_an_exception() -> None:
    with pytest.raises(RuntimeError, match="boom"), precision_scope(compute=bf16):
        raise RuntimeError("boom")
    assert resolve(nn.Linear(2, 2))[""].policy == Policy()
    assert nn.Module.__init__.__name__ == "__init__"


def test_scope_does_not_leak_into_another_thread() -> None:
    entered, built = threading.Event(), threading.Event()
    other: list[nn.Module] = []

    def construct() -> None:
        entered.wait(5)
        other.append(nn.Linear(2, 2))
        built.set()

    thread = threading.Thread(target=construct)
    thread.start()
    with precision_scope(compute=bf16):
        entered.set()
        built.wait(5)
        mine = nn.Linear(2, 2)
    thread.join()
    assert resolve(mine)[""].policy.compute == bf16
    assert resolve(other[0])[""].policy.compute is None


def test_scope_does_not_leak_into_another_asyncio_task() -> None:
    async def scoped(gate: asyncio.Event, done: asyncio.Event) -> nn.Module:
        with precision_scope(compute=fp16):
            gate.set()
            await done.wait()
            return nn.Linear(2, 2)

    async def plain(gate: asyncio.Event, done: asyncio.Event) -> nn.Module:
        await gate.wait()
        module = nn.Linear(2, 2)
        done.set()
        return module

    async def main() -> tuple[nn.Module, nn.Module]:
        gate, done = asyncio.Event(), asyncio.Event()
        return await asyncio.gather(scoped(gate, done), plain(gate, done))  # type: ignore[return-value]

    mine, other = asyncio.run(main())
    assert resolve(mine)[""].policy.compute == fp16
    assert resolve(other)[""].policy.compute is None


def test_scope_rejects_unknown_fields() -> None:
    with pytest.raises(TypeError, match="Unknown policy field 'speed'"):
        precision_scope(speed=bf16)


# --- annotate ------------------------------------------------------------------------------------

def _encdec() -> nn.Module:
    return nn.ModuleDict({
        "enc": nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)),
        "dec": nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)),
    })


def test_annotate_selectors_name_glob_class_predicate() -> None:
    model = _encdec()
    annotate(model, [
        ("enc.0", "bf16"),
        ("dec.*", "fp16"),
        (nn.LayerNorm, "fp32"),
        (lambda name, m: name == "dec", "compute=fp64"),
    ])
    plan = resolve(model)
    assert plan["enc.0"].policy.compute == bf16
    assert plan["dec.0"].policy.compute == fp16
    assert plan["enc.1"].policy.compute == fp32 and plan["dec.1"].policy.compute == fp32
    assert plan["dec"].policy.compute == fp64
    assert plan["enc"].policy.compute is None
    assert plan["enc.0"].sources["compute"] == "rule"


def test_glob_matches_the_whole_name() -> None:
    model = _encdec()
    annotate(model, {"enc.*": "bf16"})
    plan = resolve(model)
    assert plan["enc"].policy.compute is None  # "enc.*" does not match "enc"
    assert plan["enc.1"].policy.compute == bf16
    with pytest.raises(ValueError, match="matches no module"):
        annotate(_encdec(), {"nc.*": "bf16"})  # no substring matching


def test_later_rule_wins() -> None:
    model = _encdec()
    annotate(model, [(nn.Linear, "bf16"), ("enc.0", "compute=fp32")])
    entry = resolve(model)["enc.0"]
    assert entry.policy == Policy(compute=fp32, storage=bf16, comm=bf16)


def test_strict_names_closest_modules() -> None:
    with pytest.raises(ValueError, match=r"'enc\.1'") as info:
        annotate(_encdec(), {"enc.l": "fp32"})
    assert "strict=True" in str(info.value)
    with pytest.raises(ValueError, match="Module classes in the model"):
        annotate(_encdec(), {nn.Conv2d: "fp32"})
    annotate(_encdec(), {nn.Conv2d: "fp32"}, strict=False)


def test_annotate_bad_input() -> None:
    with pytest.raises(TypeError, match="annotate expects an nn.Module"):
        annotate("model", {})  # type: ignore[type-var]
    with pytest.raises(TypeError, match="selector"):
        annotate(_encdec(), {3: "fp32"})
    with pytest.raises(TypeError, match="nn.Module subclass"):
        annotate(_encdec(), {int: "fp32"})
    with pytest.raises(TypeError, match="rules"):
        annotate(_encdec(), 5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"rules\[0\]"):
        annotate(_encdec(), ["enc"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"Invalid glob 'enc\.\[0'"):
        annotate(_encdec(), {"enc.[0": "fp32"})
    with pytest.raises(ValueError, match="'fp9'"):
        annotate(_encdec(), {"enc": "fp9"})


def test_resolve_and_apply_reject_non_modules() -> None:
    with pytest.raises(TypeError, match="resolve expects an nn.Module"):
        resolve([nn.Linear(2, 2)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="default"):
        resolve(nn.Linear(2, 2), default=3)  # type: ignore[arg-type]


def test_tied_parameters_with_conflicting_storage_name_both_modules() -> None:
    emb, head = nn.Embedding(4, 2), nn.Linear(2, 4, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": precision(bf16)(emb), "head": precision(fp32)(head)})
    with pytest.raises(ValueError, match=r"'emb'.*'head'"):
        resolve(model)
    precision(bf16)(head)
    assert resolve(model)["head"].policy.storage == bf16


# --- the plan ------------------------------------------------------------------------------------

def _model() -> nn.Module:
    with precision_scope("bf16-mixed"):
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    annotate(model, {nn.LayerNorm: "fp32", "2": "output=fp32"})
    return model


def test_plan_table_and_queries() -> None:
    plan = resolve(_model())
    text = str(plan)
    for column in ("module", "type", "compute", "storage", "comm", "output", "source", "params",
                   "bytes"):
        assert column in text.splitlines()[0]
    assert "LayerNorm" in text and "rule" in text and "scope" in text
    assert plan.boundaries == ("", "1", "2")
    assert not plan.needs_loss_scaling
    assert plan.param_bytes_by_dtype == {fp32: (20 + 8 + 10) * 4}
    assert resolve(nn.Linear(2, 2), default="16-mixed").needs_loss_scaling
    with pytest.raises(KeyError, match="Names: '', '0'"):
        plan["3"]


def test_param_bytes_follow_planned_storage() -> None:
    plan = resolve(nn.Sequential(nn.Linear(4, 4), precision(bf16)(nn.Linear(4, 4))))
    assert plan.param_bytes_by_dtype == {fp32: 80, bf16: 40}


def test_json_round_trip_and_reapply_to_a_fresh_instance() -> None:
    plan = resolve(_model())
    loaded = PrecisionPlan.from_json(plan.to_json())
    assert loaded == plan
    assert loaded.to_json() == plan.to_json()
    fresh = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))  # no annotations
    apply(fresh, loaded)
    assert fresh[1].weight.dtype == fp32
    out = fresh(torch.randn(3, 4))
    assert out.dtype == fp32
    assert installed_boundaries(fresh) == ["", "1", "2"]


def test_from_json_rejects_other_text() -> None:
    with pytest.raises(ValueError, match="not JSON"):
        PrecisionPlan.from_json("{")
    with pytest.raises(ValueError, match="precision_annot.plan"):
        PrecisionPlan.from_json('{"modules": []}')


# --- selectors and scopes: errors that explain, or it just works ---------------------------------

def test_a_module_instance_is_a_selector() -> None:
    model = _encdec()
    annotate(model, {model["enc"][1]: "fp32"})
    plan = resolve(model)
    assert plan["enc.1"].policy.compute == fp32 and plan["dec.1"].policy.compute is None
    with pytest.raises(ValueError, match="instance LayerNorm matches no module.*not part"):
        annotate(model, {nn.LayerNorm(2): "fp32"})


def test_a_predicate_that_raises_is_named_with_its_rule() -> None:
    def broken(name: str, module: nn.Module) -> bool:
        return module.weight.shape[0] > 1  # type: ignore[union-attr]  # ModuleDict has none

    model = _encdec()
    with pytest.raises(AttributeError, match=r"annotate: rule 1 \(predicate .*broken.*\) raised "
                                             r"on module '\(root\)'"):
        annotate(model, [("enc.0", "bf16"), (broken, "fp32")])
    assert resolve(model)["enc.0"].policy.compute is None  # the first rule left no tag


def test_a_leaf_name_points_to_the_glob() -> None:
    with pytest.raises(ValueError, match=r"2 modules end in '1'.*'enc\.1', 'dec\.1'.*'\*\.1'"):
        annotate(_encdec(), {"1": "fp32"})


def test_precision_scope_as_a_decorator() -> None:
    @precision_scope(compute="bf16")
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(2, 2))

    first, second = build(), build()
    assert resolve(first)["0"].policy.compute == bf16 == resolve(second)["0"].policy.compute
    assert resolve(nn.Linear(2, 2))[""].policy.compute is None  # nothing leaks after the call
    assert build.__name__ == "build"
    with pytest.raises(TypeError, match=r"@precision\('compute=bf16'\)"):
        precision_scope(compute="bf16")(nn.Linear)
