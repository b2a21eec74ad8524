"""Floating dtypes by name: the four a policy can hold, and every alias users type."""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["BACKWARDS", "DTYPE_NAMES", "EMULATIONS", "FP8", "FP8_RECIPES", "LOW_BIT_STATES",
           "LOW_PRECISION", "STOCHASTIC", "bf16", "dtype_from_name", "dtype_name", "fp16", "fp32",
           "fp64", "parse_compute", "to_dtype", "to_master", "to_optim", "wider", "widest"]

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

#: fp8 compute for GEMMs, by name: each name is one torchao recipe (`Float8LinearConfig.
#: from_recipe_name`, or torchao's MX formats for mxfp8). A module whose compute is one of
#: these runs its Linear GEMMs in fp8 and its other ops in the dtype it would otherwise have.
FP8_RECIPES: dict[str, str] = {
    "fp8": "tensorwise",
    "fp8-rowwise": "rowwise",
    "fp8-rowwise-gw-hp": "rowwise_with_gw_hp",
    "mxfp8": "mxfp8",
}

#: emulated fp32 compute, by name: a module whose compute is one of these computes in fp32 and
#: runs its Linear GEMMs as GEMMs of bf16 pieces of their fp32 operands, summed in fp32 (all 9
#: products of 3 pieces each, as cuBLAS's `fp32_precision = "bfx9"`; or the 3 largest)
EMULATIONS: tuple[str, ...] = ("bf16x9", "bf16x3")

#: what the backward GEMMs of a Linear with a wide output make of its wide output gradient
BACKWARDS: tuple[str, ...] = ("round", "split2", "split3", "wide")

#: the dtype fp8 weights are all-gathered in: the only fp8 a `comm` field takes
FP8 = torch.float8_e4m3fn

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


def _valid(field: str = "dtype") -> str:
    extra = ([*FP8_RECIPES, *EMULATIONS] if field == "compute" else
             ["fp8"] if field == "comm" else [])
    return ", ".join(repr(n) for n in [*DTYPE_NAMES, *extra])


def to_dtype(value: object, *, field: str = "dtype") -> torch.dtype:
    """Return the floating dtype `value` names: a `torch.dtype` or any alias in `DTYPE_NAMES`
    (and, for a `comm` field, fp8: weights all-gathered in float8_e4m3fn).

    Raises `ValueError` for an unknown name or a non-floating dtype, and `TypeError` for
    anything else; the message names `field`, quotes the value and lists the valid names.
    """
    if field == "comm" and (value == FP8 or (isinstance(value, str) and value.strip().lower()
                                             in ("fp8", "float8_e4m3fn", "torch.float8_e4m3fn"))):
        return FP8
    if isinstance(value, str) and value.strip().lower() in FP8_RECIPES:
        where = ("a compute dtype for GEMMs: write compute=" + value.strip().lower()
                 if field != "compute" else "read by parse_compute, not here")
        raise ValueError(f"{field}={value!r}: fp8 is {where}; storage and outputs stay in a "
                         "floating dtype, and comm takes 'fp8' for weights all-gathered in "
                         f"fp8. Valid names for {field}: {_valid(field)}")
    if isinstance(value, torch.dtype):
        if value in SHORT:
            return value
        if value.is_floating_point and value.itemsize == 1:  # float8_e4m3fn, float8_e5m2, ...
            raise ValueError(
                f"{field}={value!r}: fp8 is written as a compute recipe for GEMMs, "
                f"compute='fp8' (tensorwise scaling), 'fp8-rowwise', 'fp8-rowwise-gw-hp' or "
                f"'mxfp8', with storage and outputs in a floating dtype among fp64, fp32, "
                f"fp16, bf16; comm takes torch.float8_e4m3fn for weights all-gathered in fp8."
            )
        raise ValueError(
            f"{field} must be a floating dtype among fp64, fp32, fp16, bf16. "
            f"Received: {field}={value!r}"
        )
    if isinstance(value, str):
        key = value.strip().lower()
        if key in DTYPE_NAMES:
            return DTYPE_NAMES[key]
        raise ValueError(
            f"Unknown dtype name {value!r} for {field}. Valid names: {_valid(field)}"
        )
    raise TypeError(
        f"{field} must be a torch.dtype or a dtype name such as 'bf16'. "
        f"Received: {field}={value!r} (of type {type(value).__name__})"
    )


#: what a module's `master` field takes besides a float dtype: no copy, stochastic rounding
STOCHASTIC = "stochastic"
#: the low-bit optimizer states an `optim` field takes besides a float dtype
LOW_BIT_STATES: tuple[str, ...] = ("8bit", "4bit", "fp8")


def to_master(value: object) -> torch.dtype | str:
    """A `master` value: a float dtype (the copy the optimizer updates) or "stochastic" (no
    copy: updates are written into storage with stochastic rounding)."""
    if isinstance(value, str) and value.strip().lower() == STOCHASTIC:
        return STOCHASTIC
    try:
        return to_dtype(value, field="master")
    except (TypeError, ValueError) as e:
        raise type(e)(f"{e}; or 'stochastic': no master copy, updates written into bf16 "
                      "storage with stochastic rounding.") from None


def to_optim(value: object) -> torch.dtype | str:
    """An `optim` value: the dtype of the optimizer's state tensors, or a low-bit state
    ("8bit", "4bit", "fp8": torchao's quantized optimizer states)."""
    if isinstance(value, str) and value.strip().lower() in LOW_BIT_STATES:
        return value.strip().lower()
    try:
        return to_dtype(value, field="optim")
    except (TypeError, ValueError) as e:
        raise type(e)(f"{e}; or a low-bit state: {', '.join(map(repr, LOW_BIT_STATES))}."
                      ) from None


def parse_compute(value: object) -> tuple[torch.dtype | None, str | None]:
    """A compute value: (the dtype ops run in, the fp8 recipe or fp32 emulation GEMMs run in).
    "bf16" is (bf16, None), "fp8-rowwise" is (None, "fp8-rowwise"): other ops keep the dtype
    they would otherwise have; "fp8-rowwise/bf16", as a resolved policy prints it, is both;
    "bf16x9" is (fp32, "bf16x9"): fp32 ops, GEMMs emulated."""
    if isinstance(value, str):
        gemm, slash, rest = value.strip().lower().partition("/")
        if gemm in FP8_RECIPES:
            return (to_dtype(rest, field="compute") if slash else None), gemm
        if gemm in EMULATIONS:
            if slash and to_dtype(rest, field="compute") != torch.float32:
                raise ValueError(f"compute={value!r}: {gemm} emulates fp32 GEMMs, and the "
                                 f"module's other ops compute in fp32; write compute={gemm!r}")
            return torch.float32, gemm
    return to_dtype(value, field="compute"), None


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
