"""Where declarations are recorded: tags on classes and instances, which `resolve` reads.

Class tags live in the class's own `__dict__`, so the nearest decorated class in the MRO wins;
instance and scope tags live in the instance `__dict__`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal, TypeAlias

from torch import nn

from precision_annot._src.policy import Policy

__all__ = ["ClassTag", "InstanceTag", "KeepDtype", "class_tag", "instance_tag", "keep_dtype_of",
           "region_of", "scope_tag", "tag_class", "tag_function", "tag_instance", "tag_scope"]

KeepDtype: TypeAlias = tuple[str | int, ...]
TagSource: TypeAlias = Literal["instance", "rule"]

CLASS_TAG = "__precision_annot_class__"
INSTANCE_TAG = "_precision_annot_instance"
SCOPE_TAG = "_precision_annot_scope"
REGION_TAG = "__precision_annot_region__"


@dataclasses.dataclass(frozen=True)
class ClassTag:
    """What `@precision(...)` recorded on a class."""

    policy: Policy
    keep_dtype: KeepDtype = ()


@dataclasses.dataclass(frozen=True)
class InstanceTag:
    """What `precision(...)(module)` and `annotate` recorded on an instance, field by field:
    each field's dtype and whether an instance call or a rule set it (the later one wins)."""

    fields: Mapping[str, tuple[Any, TagSource]]  # a dtype, or the fp8 recipe under "gemm"
    keep_dtype: KeepDtype = ()


def keep_dtype_of(value: object) -> KeepDtype:
    """The `keep_dtype` argument as a tuple of names and indexes; anything else raises."""
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        value = (value,)
    if not isinstance(value, (tuple, list)) or not all(
        isinstance(v, (str, int)) and not isinstance(v, bool) for v in value
    ):
        raise TypeError(
            "keep_dtype must be a sequence of keyword names (str) or positional indexes (int). "
            f"Received: keep_dtype={value!r}"
        )
    return tuple(value)


def tag_class(cls: type[nn.Module], policy: Policy, keep_dtype: KeepDtype = ()) -> None:
    setattr(cls, CLASS_TAG, ClassTag(policy, keep_dtype))


def tag_instance(module: nn.Module, policy: Policy, source: TagSource,
                 keep_dtype: KeepDtype = ()) -> None:
    """Merge `policy` into the instance tag of `module`; the fields it sets win. Compute and
    the fp8 GEMM recipe are one slot: a compute dtype set alone clears an earlier recipe."""
    old = instance_tag(module)
    fields: dict[str, tuple[Any, TagSource]] = dict(old.fields) if old else {}
    for field, dtype in policy.items():
        if dtype is not None:
            fields[field] = (dtype, source)
    if policy.gemm is not None:
        fields["gemm"] = (policy.gemm, source)
    elif policy.compute is not None:
        fields.pop("gemm", None)
    if policy.backward is not None:
        fields["backward"] = (policy.backward, source)
    keep = keep_dtype or (old.keep_dtype if old else ())
    object.__setattr__(module, INSTANCE_TAG, InstanceTag(fields, keep))


def tag_scope(module: nn.Module, policy: Policy) -> None:
    object.__setattr__(module, SCOPE_TAG, policy)


def instance_tag(module: nn.Module) -> InstanceTag | None:
    tag: InstanceTag | None = module.__dict__.get(INSTANCE_TAG)
    return tag


def class_tag(cls: type) -> ClassTag | None:
    """The tag of the nearest decorated class in `cls`'s MRO."""
    for klass in cls.__mro__:
        tag: ClassTag | None = klass.__dict__.get(CLASS_TAG)
        if tag is not None:
            return tag
    return None


def scope_tag(module: nn.Module) -> Policy | None:
    tag: Policy | None = module.__dict__.get(SCOPE_TAG)
    return tag


def tag_function(wrapper: object, policy: Policy) -> None:
    """Mark the wrapper `precision(...)(fn)` returns as a region with this policy, so that
    `resolve` finds it in the forwards that call it."""
    setattr(wrapper, REGION_TAG, policy)


def region_of(obj: object) -> Policy | None:
    """The policy of a function-form region, or None for anything else."""
    try:
        found = getattr(obj, REGION_TAG, None)
    except Exception:  # an object whose attribute access raises
        return None
    return found if isinstance(found, Policy) else None
