"""Where declarations are recorded: class tags through the MRO, instance tags field by field,
scope tags, and the mark on function-form regions."""

from __future__ import annotations

import pytest
from torch import nn

from precision_annot import Policy, bf16, fp16, fp32, precision
from precision_annot._src.tags import (
    class_tag,
    instance_tag,
    keep_dtype_of,
    region_of,
    tag_instance,
)


def test_the_nearest_decorated_class_in_the_mro_wins() -> None:
    @precision(fp32)
    class Base(nn.Module):
        pass

    @precision(compute=bf16)
    class Child(Base):
        pass

    class Grandchild(Child):
        pass

    assert class_tag(Grandchild).policy == Policy(compute=bf16)  # type: ignore[union-attr]
    assert class_tag(Base).policy == Policy(compute=fp32, storage=fp32, comm=fp32)  # type: ignore[union-attr]
    assert class_tag(nn.Linear) is None


def test_instance_tags_merge_field_by_field_and_remember_their_source() -> None:
    module = nn.Linear(2, 2)
    tag_instance(module, Policy(compute=bf16, storage=fp32), "instance")
    tag_instance(module, Policy(compute=fp16), "rule")
    tag = instance_tag(module)
    assert tag is not None
    assert tag.fields == {"compute": (fp16, "rule"), "storage": (fp32, "instance")}


def test_keep_dtype_and_the_region_mark() -> None:
    assert keep_dtype_of("freqs") == ("freqs",) and keep_dtype_of([0, "x"]) == (0, "x")
    with pytest.raises(TypeError, match="keep_dtype must be a sequence"):
        keep_dtype_of([True])

    @precision(compute=fp32)
    def softmax(x: object) -> object:
        return x

    assert region_of(softmax) == Policy(compute=fp32)
    assert region_of(len) is None and region_of(nn.Linear(2, 2)) is None
