"""Boundary casts over trees of values, touching only floating tensor leaves.

Leaves are found in tensors, lists, tuples (named ones too), dicts and dataclass instances.
Nothing that needs no cast is copied: a tensor already in the target dtype, a non-floating
tensor, and a list, tuple, dict or dataclass holding no tensor that needs a cast come back as
the same object, so in-place updates (a KV cache appended to, a tensor written into) reach
the caller. A cast is `Tensor.to`, whose autograd node returns each gradient in the dtype its
input had, so a pure cast is exact in backward.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["cast_tree", "check_tree", "first_floating", "floating_leaves"]

Copies = list[tuple[str, torch.Tensor]]


def floating_leaves(obj: Any, out: list[torch.Tensor]) -> None:
    """Append every floating tensor in `obj`, in a fixed traversal order."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            floating_leaves(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            floating_leaves(item, out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            floating_leaves(getattr(obj, field.name), out)


def first_floating(obj: Any) -> torch.Tensor | None:
    """The first floating tensor in `obj`, or None."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.is_floating_point() else None
    leaves: list[torch.Tensor] = []
    floating_leaves(obj, leaves)
    return leaves[0] if leaves else None


def map_tree(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor], *,
             floating_only: bool = True) -> Any:
    """`obj` with `fn` applied to every floating tensor (every tensor, with
    `floating_only=False`); containers are rebuilt only where a leaf changed (by identity), so
    unchanged lists, dicts and objects stay the same objects."""
    if isinstance(obj, torch.Tensor):
        return fn(obj) if obj.is_floating_point() or not floating_only else obj
    if isinstance(obj, (list, tuple)):
        return _map_sequence(obj, fn, floating_only)
    if isinstance(obj, dict):
        return _map_dict(obj, fn, floating_only)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _map_dataclass(obj, fn, floating_only)
    return obj


def _map_sequence(obj: list[Any] | tuple[Any, ...], fn: Callable[[torch.Tensor], torch.Tensor],
                  floating_only: bool) -> Any:
    """A list or tuple (a named tuple, a subclass) rebuilt as its own type where a leaf
    changed."""
    items = [map_tree(item, fn, floating_only=floating_only) for item in obj]
    if all(a is b for a, b in zip(items, obj, strict=True)):
        return obj
    if isinstance(obj, list):
        return type(obj)(items) if type(obj) is not list else items
    return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)


def _map_dict(obj: dict[Any, Any], fn: Callable[[torch.Tensor], torch.Tensor],
              floating_only: bool) -> Any:
    """A dict (an OrderedDict, a ModelOutput) copied and refilled where a value changed."""
    changed = {k: map_tree(v, fn, floating_only=floating_only) for k, v in obj.items()}
    if all(changed[k] is v for k, v in obj.items()):
        return obj
    new = copy.copy(obj)
    for key, value in changed.items():
        new[key] = value
    return new


def _map_dataclass(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor],
                   floating_only: bool) -> Any:
    """A dataclass instance (frozen too) copied with its changed fields set."""
    fields = {f.name: map_tree(getattr(obj, f.name), fn, floating_only=floating_only)
              for f in dataclasses.fields(obj)}
    if all(fields[k] is getattr(obj, k) for k in fields):
        return obj
    new = copy.copy(obj)
    for key, value in fields.items():
        object.__setattr__(new, key, value)
    return new


def cast_tree(obj: Any, dtype: torch.dtype, copies: Copies | None = None, label: str = "") -> Any:
    """`obj` with every floating tensor cast to `dtype`; see the module docstring for what
    stays the same object. Each copy made is appended to `copies` as `(label, copy)`."""
    if isinstance(obj, torch.Tensor):  # the common case, kept short
        if not obj.is_floating_point() or obj.dtype == dtype:
            return obj
        out = obj.to(dtype)
        if copies is not None:
            copies.append((label, out))
        return out

    def cast(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == dtype:
            return t
        out = t.to(dtype)
        if copies is not None:
            copies.append((label, out))
        return out

    return map_tree(obj, cast)


# -- check_finite ---------------------------------------------------------------------------------

_MOVING = {
    ("forward", "entry"): "inputs entering",
    ("forward", "exit"): "outputs leaving",
    ("backward", "entry"): "input gradients leaving",
    ("backward", "exit"): "output gradients entering",
}


def _raise_nonfinite(t: torch.Tensor, module: str, side: str, direction: str, index: int) -> None:
    raise FloatingPointError(
        f"Non-finite value (inf or nan) in {direction}: {_MOVING[(direction, side)]} module "
        f"{module or '(root)'!r}, tensor {index} of shape {tuple(t.shape)} in {t.dtype}."
    )


def check_tree(obj: Any, module: str, side: str) -> None:
    """Raise `FloatingPointError` if a floating tensor in `obj` is not finite, and arrange for
    its gradient to be checked the same way in backward.

    The backward check is a one-shot tensor hook, not an autograd node, so the tensors are
    not replaced: in-place ops on them and object identity behave exactly as without the check.
    """
    leaves: list[torch.Tensor] = []
    floating_leaves(obj, leaves)
    for i, t in enumerate(leaves):
        if not bool(torch.isfinite(t).all()):
            _raise_nonfinite(t, module, side, "forward", i)
        if t.requires_grad and torch.is_grad_enabled():
            _hook_once(t, module, side, i)


def _hook_once(t: torch.Tensor, module: str, side: str, index: int) -> None:
    handle: Any = None

    def check(grad: torch.Tensor) -> None:
        handle.remove()
        if not bool(torch.isfinite(grad).all()):
            _raise_nonfinite(grad, module, side, "backward", index)

    handle = t.register_hook(check)  # type: ignore[no-untyped-call]
