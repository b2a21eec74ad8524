"""Loading a checkpoint into an applied model keeps the plan, and says what was lost before.

Every loader of an applied model ends with each tensor in its planned dtype: `load_state_dict`
copies into the planned tensors (and, with `assign=True`, the applied root's post-hook casts
the tensors it was handed back to the plan); DCP loads into the state dict's own tensors;
`adapters.transformers.from_pretrained` reads back what the plan keeps wider. What no loader
can give back is precision the checkpoint does not hold: a tensor saved narrower than the plan
keeps it (an fp32 island saved in bf16) is widened with its low bits gone. Each loader says so
through `narrowed` and `warn_narrowed`, naming the tensors.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping

import torch

from precision_annot._src.dtypes import dtype_name, wider
from precision_annot._src.plan import PrecisionPlan

__all__ = ["Narrowed", "narrowed", "planned_dtypes", "warn_narrowed"]

#: (tensor name, dtype saved, dtype the plan keeps)
Narrowed = tuple[str, torch.dtype, torch.dtype]


def planned_dtypes(plan: PrecisionPlan) -> dict[str, torch.dtype]:
    """Each tensor a state dict of the plan's model holds (parameters and persistent buffers),
    by its qualified name, in the dtype the plan keeps it: what `resolve` saw (the plan's
    facts), so a plan whose model is gone reads alike."""
    out = {}
    for name, entry in plan.items():
        for info in entry.facts.tensors if entry.facts is not None else ():
            if info.persistent:
                out[f"{name}.{info.name}" if name else info.name] = info.dtype
    return out


def narrowed(planned: Mapping[str, torch.dtype],
             saved: Iterable[tuple[str, torch.dtype]]) -> list[Narrowed]:
    """The saved floating tensors narrower than the plan keeps them (or as wide, another
    format: fp16 for bf16), in the order saved."""
    out = []
    for name, dtype in saved:
        keep = planned.get(name)
        if (keep is not None and dtype != keep and dtype.is_floating_point
                and keep.is_floating_point and not wider(dtype, keep)):
            out.append((name, dtype, keep))
    return out


def warn_narrowed(where: str, found: list[Narrowed], *, stacklevel: int = 2) -> None:
    """One `UserWarning` naming every tensor the checkpoint held narrower than the plan."""
    if not found:
        return
    pairs = sorted({(dtype_name(s), dtype_name(k)) for _, s, k in found})
    said = "; ".join(f"saved in {s}, kept in {k}" for s, k in pairs)
    warnings.warn(
        f"{where}: the checkpoint holds {len(found)} tensor(s) narrower than the plan keeps them "
        f"({said}), so their low bits were lost before this load: "
        f"{', '.join(repr(n) for n, _, _ in found)}. They are loaded into their planned dtype "
        "with the checkpoint's rounding. Load them from a checkpoint saved as the plan keeps "
        "them (check(model, 'checkpoint', {'path': ...}) says which before loading).",
        UserWarning, stacklevel=stacklevel + 1)
