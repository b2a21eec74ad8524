"""Comparing a run with the fp32 reference: relative error over trees of tensors, peaks, and
copies that later runs cannot change."""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import torch

from precision_annot._src.casting import floating_leaves, map_tree
from precision_annot._src.recording import relative_error

__all__ = ["detached", "finite_peak", "relative_error", "scan"]


def detached(obj: Any) -> Any:
    """A copy of a call's arguments or outputs that later runs cannot change."""
    detached = map_tree(obj, lambda t: t.detach().clone())
    return detached if detached is not obj or not _mutable(obj) else copy.deepcopy(obj)


def _mutable(obj: Any) -> bool:
    return isinstance(obj, (list, dict)) or (
        dataclasses.is_dataclass(obj) and not isinstance(obj, type))


def finite_peak(value: Any) -> float:
    """The largest finite |value| over every floating tensor of `value`."""
    leaves: list[torch.Tensor] = []
    floating_leaves(value, leaves)
    return max((scan(t.detach(), peaks=True)[1] for t in leaves), default=0.0)


def scan(t: torch.Tensor, peaks: bool) -> tuple[int, float]:
    """The non-finite elements of `t` and (with `peaks`) its largest finite |value|. One
    reduction and one read when every element is finite (the common case: a sum, or the
    largest |value| itself, is then finite); the exact count only where it is not."""
    if not t.numel():
        return 0, 0.0
    probe = float(t.abs().amax()) if peaks else float(t.sum(dtype=torch.float32))
    if math.isfinite(probe):
        return 0, probe if peaks else 0.0
    finite = torch.isfinite(t)
    bad = t.numel() - int(finite.sum())
    if not peaks:
        return bad, 0.0
    kept = t[finite]
    return bad, float(kept.abs().amax()) if kept.numel() else 0.0
