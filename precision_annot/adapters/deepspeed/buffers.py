"""DeepSpeed's `data_types.keep_in_fp32_modules`: the buffers DeepSpeed holds in fp32.

DeepSpeed 0.19.8 reads it where `initialize` casts the model (`runtime/engine.py`,
`_configure_distributed_model` and `_cast_module_mixed_precision`; the matching is
`runtime/keep_in_fp32.py`). Only under its bf16 or fp16 section, at every ZeRO stage:

- parameters go to the section's dtype; buffers keep the dtype they arrive in, except
- the floating buffers whose full names match the setting are made fp32 (from any dtype), and
- with `data_types.buffer_dtype`, every other floating buffer is cast to that dtype.

The setting is "auto" (the default): each module's own Hugging Face lists,
`_keep_in_fp32_modules_strict` (and, under fp16, `_keep_in_fp32_modules`), each entry searched
under that module's name; or a list of patterns (`*` is any text, the rest a regular
expression searched anywhere in the name); `[]` keeps nothing. A parameter a list names still
follows the section's dtype. Any other value (null included) is refused at config parsing.

`held` works out what DeepSpeed leaves each buffer in; the export (`to_config`) and the check
both ask it, through `export.buffer_dtypes`.
"""

from __future__ import annotations

import functools
import importlib
import re

import torch

from precision_annot._src.dtypes import bf16, fp16, fp32
from precision_annot._src.plan import PrecisionPlan

__all__ = ["AUTO", "KEEP_IN_FP32", "READ_SINCE", "exact_patterns", "held", "keep_patterns",
           "kept_by", "planned_buffers", "refusal"]

KEEP_IN_FP32 = "keep_in_fp32_modules"
AUTO = "auto"
#: the first DeepSpeed release that reads `data_types.keep_in_fp32_modules`
READ_SINCE = (0, 19, 8)
#: the buffer dtypes DeepSpeed's `buffer_dtype` casts (`engine.CASTABLE_DTYPES`)
_CASTABLE = frozenset({fp16, bf16, fp32, torch.float64})


def refusal(value: object) -> str | None:
    """Why DeepSpeed refuses this `data_types.keep_in_fp32_modules` value, or None."""
    if value == AUTO:
        return None
    if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
        return (f"data_types.{KEEP_IN_FP32}={value!r} (\"data_types.{KEEP_IN_FP32} must be "
                "\"auto\" or a list of name patterns\")")
    try:
        _matcher([n.replace("*", ".*") for n in value])
    except re.error as e:
        return f"data_types.{KEEP_IN_FP32}={value!r} (the patterns do not compile: {e})"
    return None


def planned_buffers(plan: PrecisionPlan) -> dict[str, tuple[str, torch.dtype]]:
    """Each floating buffer's full name -> (its module, the dtype the plan holds it in): a
    persistent buffer in its module's storage, any other in the dtype it was built in. Empty
    for a plan written without what `resolve` saw (precision_annot 0.3 and older)."""
    out: dict[str, tuple[str, torch.dtype]] = {}
    for name, entry in plan.items():
        storage = entry.policy.storage
        for t in entry.facts.tensors if entry.facts is not None else ():
            if t.buffer:
                dtype = storage if storage is not None and t.persistent else t.dtype
                out[f"{name}.{t.name}" if name else t.name] = (name, dtype)
    return out


@functools.lru_cache(maxsize=512)
def _class(path: str) -> type | None:
    """The class a plan names ("package.module.Class"), where it can be imported."""
    module_name, _, class_name = path.rpartition(".")
    if not module_name or "<" in path:
        return None
    try:
        found = getattr(importlib.import_module(module_name), class_name, None)
    except Exception:
        return None
    return found if isinstance(found, type) else None


def _own_entries(plan: PrecisionPlan, name: str, low: torch.dtype) -> set[str]:
    """One module's Hugging Face keep-in-fp32 entries DeepSpeed's "auto" applies under `low`:
    read from the module when the model is here, else from what `resolve` saw of it (a plan
    from a file or a collected model), else from its class."""
    source: object = plan.module(name)
    facts = plan[name].facts
    if source is None and facts is not None:
        entries = set(facts.keep_in_fp32_strict)
        return entries | set(facts.keep_in_fp32) if low == fp16 else entries
    if source is None:
        source = _class(plan[name].type)
    entries = set(getattr(source, "_keep_in_fp32_modules_strict", None) or [])
    if low == fp16:
        entries |= set(getattr(source, "_keep_in_fp32_modules", None) or [])
    return entries


def keep_patterns(plan: PrecisionPlan, setting: object, low: torch.dtype) -> list[str]:
    """The regular expressions DeepSpeed searches buffer names with, for this setting ("auto"
    or a list) under the section dtype `low` (as `keep_in_fp32.keep_in_fp32_pattern`)."""
    if isinstance(setting, list):
        return sorted({str(n).replace("*", ".*") for n in setting})
    patterns = set()
    for name in plan:
        for entry in _own_entries(plan, name, low):
            pattern = entry.replace("*", ".*")
            patterns.add(rf"^{re.escape(name)}\..*{pattern}" if name else pattern)
    return sorted(patterns)


def _matcher(patterns: list[str]) -> re.Pattern[str] | None:
    """DeepSpeed's one expression for the patterns; None for none (it keeps nothing)."""
    return re.compile("|".join(patterns)) if patterns else None


def exact_patterns(names: list[str]) -> list[str]:
    """Patterns that match exactly these full buffer names, as DeepSpeed searches them."""
    return ["^" + re.escape(n) + "$" for n in sorted(names)]


def kept_by(plan: PrecisionPlan, setting: object, low: torch.dtype) -> set[str]:
    """The buffers a setting keeps in fp32 under the section dtype `low`."""
    kept = _matcher(keep_patterns(plan, setting, low))
    return {n for n in planned_buffers(plan) if kept is not None and kept.search(n)}


def held(plan: PrecisionPlan, low: torch.dtype | None, setting: object,
         cast: torch.dtype | None) -> dict[str, torch.dtype]:
    """What DeepSpeed's `initialize` leaves each floating buffer in, the buffers arriving as
    planned (`prepare` puts them there): under the section dtype `low` (None: no section, no
    cast), with this `keep_in_fp32_modules` setting and `buffer_dtype` (`cast`)."""
    planned = planned_buffers(plan)
    if low is None:
        return {n: d for n, (_, d) in planned.items()}
    kept = kept_by(plan, setting, low)
    return {n: fp32 if n in kept else (cast if cast is not None and d in _CASTABLE else d)
            for n, (_, d) in planned.items()}
