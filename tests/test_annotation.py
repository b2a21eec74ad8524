"""`precision` on classes, instances and functions, and `annotate` by rule."""

from __future__ import annotations

import pytest
from torch import nn

from precision_annot import (
    Policy,
    annotate,
    bf16,
    fp16,
    fp32,
    fp64,
    precision,
    resolve,
)
from tests.helpers import encdec, island_model


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
        "compute": "instance", "storage": "instance", "comm": "instance", "output": None,
        "master": None, "grad": None, "optim": None}


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


def test_later_rule_wins() -> None:
    model = encdec()
    annotate(model, [(nn.Linear, "bf16"), ("enc.0", "compute=fp32")])
    entry = resolve(model)["enc.0"]
    assert entry.policy == Policy(compute=fp32, storage=bf16, comm=bf16)


def test_annotate_bad_input() -> None:
    with pytest.raises(TypeError, match="annotate expects an nn.Module"):
        annotate("model", {})  # type: ignore[type-var]
    with pytest.raises(TypeError, match="selector"):
        annotate(encdec(), {3: "fp32"})
    with pytest.raises(TypeError, match="nn.Module subclass"):
        annotate(encdec(), {int: "fp32"})
    with pytest.raises(TypeError, match="rules"):
        annotate(encdec(), 5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"rules\[0\]"):
        annotate(encdec(), ["enc"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"Invalid glob 'enc\.\[0'"):
        annotate(encdec(), {"enc.[0": "fp32"})
    with pytest.raises(ValueError, match="'fp9'"):
        annotate(encdec(), {"enc": "fp9"})


def test_annotate_is_atomic_when_a_later_rule_fails() -> None:
    model, *_ = island_model()
    with pytest.raises(ValueError, match="matches no module"):
        annotate(model, [("0", "bf16"), ("nope", "fp32")])
    assert resolve(model)["0"].policy == Policy()
