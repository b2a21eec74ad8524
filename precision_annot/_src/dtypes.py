"""Floating dtypes by name: the four a policy can hold, and every alias users type."""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["DTYPE_NAMES", "LOW_PRECISION", "bf16", "dtype_from_name", "dtype_name", "fp16",
           "fp32", "fp64", "to_dtype", "wider", "widest"]

fp64 = torch.float64
fp32 = torch.float32
fp16 = torch.float16
bf16 = torch.bfloat16

#: Canonical short name of each supported dtype, as `str(Policy)` prints it.
SHORT: dict[torch.dtype, str] = {fp64: "fp64", fp32: "fp32", fp16: "fp16", bf16: "bf16"}

_ALIASES: dict[torch.dtype, tuple[str, ...]] = {
    fp64: ("fp64", "float64", "f64", "double", "torch.float64", "torch.double"),
    fp32: ("fp32", "float32", "f32", "float", "single", "torch.float32", "torch.float"),
    fp16: ("fp16", "float16", "f16", "half", "torch.float16", "torch.half"),
    bf16: ("bf16", "bfloat16", "torch.bfloat16"),
}

#: Every accepted name, lower case, mapped to its dtype.
DTYPE_NAMES: dict[str, torch.dtype] = {
    alias: dtype for dtype, aliases in _ALIASES.items() for alias in aliases
}

LOW_PRECISION: frozenset[torch.dtype] = frozenset({fp16, bf16})

# fp16 and bf16 share a rank: neither holds the other (fp16 has the bits, bf16 the range).
_RANK: dict[torch.dtype, int] = {fp64: 3, fp32: 2, fp16: 1, bf16: 1}


def wider(a: torch.dtype, b: torch.dtype) -> bool:
    """True when `a` holds every value of `b` and more: fp64 > fp32 > {fp16, bf16}."""
    return _RANK.get(a, 0) > _RANK.get(b, 0)


def widest(dtypes: Iterable[torch.dtype | None]) -> torch.dtype | None:
    """The widest of `dtypes` (None entries ignored; None if there is none), the first of a
    tie: fp64 > fp32 > {fp16, bf16}."""
    known = [d for d in dtypes if d is not None]
    return max(known, key=lambda d: _RANK.get(d, 0)) if known else None


def _valid() -> str:
    return ", ".join(repr(n) for n in DTYPE_NAMES)


def to_dtype(value: object, *, field: str = "dtype") -> torch.dtype:
    """Return the floating dtype `value` names: a `torch.dtype` or any alias in `DTYPE_NAMES`.

    Raises `ValueError` for an unknown name or a non-floating dtype, and `TypeError` for
    anything else; the message names `field`, quotes the value and lists the valid names.
    """
    if isinstance(value, torch.dtype):
        if value in SHORT:
            return value
        raise ValueError(
            f"{field} must be a floating dtype among fp64, fp32, fp16, bf16. "
            f"Received: {field}={value!r}"
        )
    if isinstance(value, str):
        key = value.strip().lower()
        if key in DTYPE_NAMES:
            return DTYPE_NAMES[key]
        raise ValueError(
            f"Unknown dtype name {value!r} for {field}. Valid names: {_valid()}"
        )
    raise TypeError(
        f"{field} must be a torch.dtype or a dtype name such as 'bf16'. "
        f"Received: {field}={value!r} (of type {type(value).__name__})"
    )


def dtype_name(dtype: torch.dtype | None) -> str:
    """The canonical short name (`fp32`, `bf16`, ...) of a policy dtype, torch's own name
    (`int8`, `float8_e4m3fn`) of any other dtype, or `-` for None. `dtype_from_name` reads
    every one of them back."""
    if dtype is None:
        return "-"
    return SHORT.get(dtype, str(dtype).removeprefix("torch."))


def dtype_from_name(name: str, *, field: str = "dtype") -> torch.dtype:
    """The torch dtype `dtype_name` wrote: a policy dtype's alias or any torch dtype's name
    (`int8`, `torch.uint8`, `float8_e5m2`, `complex64`). Raises `ValueError` naming `field`."""
    key = name.strip().lower() if isinstance(name, str) else name
    if isinstance(key, str):
        if key in DTYPE_NAMES:
            return DTYPE_NAMES[key]
        found = getattr(torch, key.removeprefix("torch."), None)
        if isinstance(found, torch.dtype):
            return found
    raise ValueError(f"Unknown dtype name {name!r} for {field}: neither a policy dtype "
                     f"({', '.join(SHORT.values())}) nor a torch dtype such as 'int8'.")
