"""Selectors: names, globs, classes, instances and predicates, and what a miss says."""

from __future__ import annotations

import pytest
from torch import nn

from precision_annot import (
    annotate,
    bf16,
    fp16,
    fp32,
    fp64,
    resolve,
)
from tests.helpers import encdec


def test_annotate_selectors_name_glob_class_predicate() -> None:
    model = encdec()
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
    model = encdec()
    annotate(model, {"enc.*": "bf16"})
    plan = resolve(model)
    assert plan["enc"].policy.compute is None  # "enc.*" does not match "enc"
    assert plan["enc.1"].policy.compute == bf16
    with pytest.raises(ValueError, match="matches no module"):
        annotate(encdec(), {"nc.*": "bf16"})  # no substring matching


def test_strict_names_closest_modules() -> None:
    with pytest.raises(ValueError, match=r"'enc\.1'") as info:
        annotate(encdec(), {"enc.l": "fp32"})
    assert "strict=True" in str(info.value)
    with pytest.raises(ValueError, match="Module classes in the model"):
        annotate(encdec(), {nn.Conv2d: "fp32"})
    annotate(encdec(), {nn.Conv2d: "fp32"}, strict=False)


def test_a_module_instance_is_a_selector() -> None:
    model = encdec()
    annotate(model, {model["enc"][1]: "fp32"})
    plan = resolve(model)
    assert plan["enc.1"].policy.compute == fp32 and plan["dec.1"].policy.compute is None
    with pytest.raises(ValueError, match="instance LayerNorm matches no module.*not part"):
        annotate(model, {nn.LayerNorm(2): "fp32"})


def test_a_predicate_that_raises_is_named_with_its_rule() -> None:
    def broken(name: str, module: nn.Module) -> bool:
        return module.weight.shape[0] > 1  # type: ignore[union-attr]  # ModuleDict has none

    model = encdec()
    with pytest.raises(AttributeError, match=r"annotate: rule 1 \(predicate .*broken.*\) raised "
                                             r"on module '\(root\)'"):
        annotate(model, [("enc.0", "bf16"), (broken, "fp32")])
    assert resolve(model)["enc.0"].policy.compute is None  # the first rule left no tag


def test_a_leaf_name_points_to_the_glob() -> None:
    with pytest.raises(ValueError, match=r"2 modules end in '1'.*'enc\.1', 'dec\.1'.*'\*\.1'"):
        annotate(encdec(), {"1": "fp32"})
