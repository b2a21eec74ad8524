"""State formats: a state tensor kept in a float dtype or in one of torchao's low-bit tensor
types, converted from one to the other, counted in bytes, and saved so that any `torch.load`
reads it back.

The low-bit formats live in torchao's tensor subclasses (`OptimState8bit`, `OptimState4bit`,
`OptimStateFp8`): created as torchao's own optimizers create them, read through their
`dequantize`, written through their `copy_` (which quantizes). Nothing here re-implements them.
"""

from __future__ import annotations

import importlib
import types
from typing import Any, cast

import torch

from precision_annot._src.dtypes import STOCHASTIC
from precision_annot._src.float8 import import_torchao, install_hint

__all__ = ["UNSIGNED", "is_moment", "low_bit_bytes", "low_bit_of", "nbytes", "new_low_bit",
           "portable", "quantized", "rebuilt", "require_torchao", "settle_low_bit", "to_format",
           "torchao_module", "torchao_use"]

#: torchao's optimizer class (whose buffer factory makes the state) and block size per format
_TORCHAO: dict[str, tuple[str, int]] = {"8bit": ("AdamW8bit", 256), "4bit": ("AdamW4bit", 128),
                                         "fp8": ("AdamWFp8", 256)}
#: the tensor type of each format, by name
_TYPES = {"OptimState8bit": "8bit", "OptimState4bit": "4bit", "OptimStateFp8": "fp8"}
#: (bytes per element of its codes, bytes of its value map) per format; scales are 4 bytes a block
_SIZES: dict[str, tuple[float, int]] = {"8bit": (1.0, 256 * 4), "4bit": (0.5, 16 * 4),
                                        "fp8": (1.0, 0)}
#: torchao quantizes a tensor of at least this many elements, in whole blocks (as bitsandbytes)
MIN_QUANTIZED = 4096
#: state names that are never negative: kept with torchao's unsigned value map
UNSIGNED = frozenset({"exp_avg_sq", "max_exp_avg_sq"})


def torchao_use(what: str) -> str:
    """What an update takes from torchao: `what` is a low-bit format ("8bit", "4bit", "fp8")
    or "stochastic" (see `UpdateRule.torchao`)."""
    if what == STOCHASTIC:
        return ("master='stochastic' writes each update into bf16 storage with torchao's "
                "stochastic rounding")
    name = next((t for t, fmt in _TYPES.items() if fmt == what), None)
    if name is None:
        return ("a low-bit optimizer state (optim='8bit', '4bit' or 'fp8') is kept in "
                "torchao's formats and stepped with torchao's Adam update")
    return (f"optim={what!r} keeps the optimizer state in torchao's {what} format ({name}) "
            "and steps it with torchao's Adam update")


def _missing(uses: str) -> str:
    return (f"{uses}; torchao is not installed. Install it with the fp8 extra: "
            f"{install_hint}; or plan a float optim (optim=bf16) or master=fp32 instead, "
            "which need no torchao.")


def torchao_module(name: str, what: str) -> Any:
    """torchao's module `name`, for an update that needs it for `what` (see `torchao_use`);
    where torchao is missing, an ImportError that says what it is needed for and how to
    install it."""
    try:
        return import_torchao(name, torchao_use(what))
    except ImportError as e:
        raise ImportError(_missing(torchao_use(what))) from (e.__cause__ or e)


def require_torchao(uses: dict[str, list[str]]) -> None:
    """Refuse, where torchao is missing, the updates that need it: `uses` maps what each
    needs it for (see `torchao_use`) to the names of the parameters updated so."""
    if not uses:
        return
    try:
        import_torchao("torchao.optim", "")
    except ImportError as e:
        said = "; ".join(f"{torchao_use(what)} ({_names(names)})" for what, names in uses.items())
        raise ImportError(_missing(said)) from (e.__cause__ or e)


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:3])
    return f"{shown} and {len(names) - 3} more" if len(names) > 3 else shown


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def low_bit_of(value: object) -> str | None:
    """The low-bit format of a state tensor (a DTensor's local one), or None."""
    if not isinstance(value, torch.Tensor):
        return None
    return _TYPES.get(type(_local(value)).__name__)


def is_moment(name: object, value: object, param: torch.Tensor) -> bool:
    """A state entry kept in the rule's state format: a floating (or low-bit) tensor shaped
    like its parameter, not the master copy. A step counter, a scalar and a flattened history
    (LBFGS) stay as the optimizer class keeps them."""
    if name == "master" or not isinstance(value, torch.Tensor):
        return False
    if low_bit_of(value) is not None:
        return True
    return (value.is_floating_point() or value.is_complex()) and value.shape == param.shape


def low_bit_bytes(fmt: str, numel: int) -> int | None:
    """Bytes of one `fmt` state of `numel` elements, or None when torchao keeps that tensor
    in full precision (fewer than 4,096 elements, or not in whole blocks)."""
    block = _TORCHAO[fmt][1]
    if numel < MIN_QUANTIZED or numel % block:
        return None
    code, mapped = _SIZES[fmt]
    return int(numel * code) + numel // block * 4 + mapped


def quantized(fmt: str, like: torch.Tensor) -> bool:
    """Whether torchao keeps a state of `like` (its local shard, for a DTensor) in `fmt`, or
    in full precision (too small, or not in whole blocks)."""
    return low_bit_bytes(fmt, _local(like).numel()) is not None


def new_low_bit(fmt: str, like: torch.Tensor, signed: bool) -> torch.Tensor:
    """A zero state in `fmt` for a tensor like `like` (a DTensor gets a DTensor), made as
    torchao's own optimizer makes it: quantized from 4,096 elements in whole blocks, a plain
    zero tensor in `like`'s dtype below."""
    optim = torchao_module("torchao.optim", fmt)
    name, block = _TORCHAO[fmt]
    cls: Any = getattr(optim, name)
    # NOTE: torchao's buffer factory is a method of its optimizers (`_AdamBase._new_buffer`),
    # reading only `block_size` and `_subclass_zeros`; it is the one place that knows the
    # quantization threshold and the DTensor wrapping, so it is called with just those two.
    owner = types.SimpleNamespace(block_size=block, _subclass_zeros=cls._subclass_zeros)
    out: torch.Tensor = cls._new_buffer(owner, like, signed)
    return out


def _plain(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A state tensor as a plain tensor of `dtype` (a low-bit one dequantized)."""
    if low_bit_of(value) is None:
        return value if value.dtype == dtype else value.to(dtype)
    local = _local(value)
    plain: torch.Tensor = cast(Any, local).dequantize(dtype)
    if local is value:
        return plain
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(plain, value.device_mesh, value.placements,  # type: ignore[attr-defined]
                              run_check=False, shape=value.shape, stride=value.stride())


def to_format(value: torch.Tensor, fmt: torch.dtype | str, like: torch.Tensor, *,
              signed: bool = True) -> torch.Tensor:
    """`value` (a state tensor of `like`, in any format) in format `fmt`: a float dtype, or a
    low-bit format (quantized from its values; left as it is when already in it)."""
    if isinstance(fmt, torch.dtype):
        return _plain(value, fmt)
    if low_bit_of(value) == fmt:
        return value
    out = new_low_bit(fmt, like, signed)
    source = _plain(value, torch.float32)
    with torch.no_grad():
        out.copy_(source if low_bit_of(out) is not None else source.to(out.dtype))
    return out


def settle_low_bit(state: dict[str, Any], target: torch.Tensor, fmt: str) -> None:
    """The moments `state` holds for `target` (what the step updates: the master, else the
    parameter) in the low-bit format `fmt`, as torchao's update keeps them: quantized where
    torchao quantizes a tensor of that size, else in `target`'s dtype. A moment not made yet
    stays so (the update makes it)."""
    kept = quantized(fmt, target)
    for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        value = state.get(name)
        if not isinstance(value, torch.Tensor):
            continue
        if kept and low_bit_of(value) != fmt:
            state[name] = to_format(value, fmt, target, signed=name not in UNSIGNED)
        elif not kept and (low_bit_of(value) or value.dtype != target.dtype):
            state[name] = to_format(value, target.dtype, target)


def nbytes(t: torch.Tensor) -> int:
    """The bytes a tensor holds on this rank: a low-bit state's codes, scales and value map; a
    DTensor's local shard."""
    t = _local(t)
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None and type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        names, _ = flatten()
        return sum(nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


# -- saving ---------------------------------------------------------------------------------------

_SUBCLASS = "__tensor_subclass__"


def _portable_value(value: Any) -> Any:
    flatten = getattr(value, "__tensor_flatten__", None)
    if flatten is None or not type(value).__module__.startswith("torchao"):
        return value
    names, ctx = flatten()
    cls = type(value)
    return {_SUBCLASS: f"{cls.__module__}:{cls.__qualname__}", "ctx": list(ctx),
            "inner": {n: getattr(value, n) for n in names}, "size": list(value.shape),
            "stride": list(value.stride())}


def portable(state: dict[Any, Any]) -> dict[Any, Any]:
    """An optimizer's `state` (per parameter, a dict of values) with torchao's low-bit tensors
    written as their plain inner tensors: any `torch.load` reads it back (`weights_only=True`
    refuses a tensor subclass, and Lightning's callable `map_location` cannot rebuild one)."""
    if not any(isinstance(s, dict) and any(low_bit_of(v) for v in s.values())
               for s in state.values()):
        return state
    return {k: ({n: _portable_value(v) for n, v in s.items()} if isinstance(s, dict) else s)
            for k, s in state.items()}


def rebuilt(value: Any) -> Any:
    """A value `portable` wrote, as the tensor it was; anything else as it is."""
    if not (isinstance(value, dict) and _SUBCLASS in value):
        return value
    module, _, name = value[_SUBCLASS].partition(":")
    if not module.startswith("torchao."):
        raise ValueError(f"load_state_dict: a saved state names the tensor type {module}:{name}"
                         ", and only torchao's low-bit states are rebuilt.")
    cls: Any = importlib.import_module(module)
    for part in name.split("."):
        cls = getattr(cls, part)
    ctx = value["ctx"]
    return cls.__tensor_unflatten__(value["inner"], ctx if isinstance(ctx, list) else list(ctx),
                                    tuple(value["size"]), tuple(value["stride"]))
