"""`resolve`: the effective policy of every module, per field, by the precedence of the contract.

Per field, the highest level that sets it wins:

1. the instance (`precision(...)(module)` or `annotate`; the later call wins),
2. the class, through the nearest decorated class in the MRO,
3. the construction scope,
4. the parent's effective value (not for `output`, which applies to one module's exit, unless
   the parent is a container: it never runs, so its children carry its `output` too),
5. `default`, at the root.
"""

from __future__ import annotations

import torch
from torch import nn

from precision_annot.dtypes import dtype_name
from precision_annot.guards import require_module
from precision_annot.plan import ModulePlan, PrecisionPlan, Source, parent_name
from precision_annot.policy import FIELDS, Policy, SpecLike, as_policy
from precision_annot.tags import class_tag, instance_tag, scope_tag

__all__ = ["is_container", "resolve"]


def is_container(module: nn.Module) -> bool:
    """True for a module with no `forward` of its own (`nn.ModuleList`, `nn.ModuleDict`, ...):
    it is never called, so it cannot cast anything."""
    return type(module).forward is nn.Module.forward and "forward" not in module.__dict__


def resolve(model: nn.Module, default: SpecLike | None = None) -> PrecisionPlan:
    """Compute the effective policy of every module of `model`.

    Args:
        model: the module tree, annotated with `precision`, `precision_scope` or `annotate`.
        default: the root's defaults, used for each field nothing else sets. (Default: None)

    Returns:
        A `PrecisionPlan` with one row per module, in `named_modules()` order.

    Raises:
        ValueError: when two modules share a parameter but resolve to different storage.

    Example:
        >>> from torch import nn
        >>> from precision_annot import precision, resolve, fp32
        >>> model = nn.Sequential(nn.Linear(2, 2), precision(fp32)(nn.LayerNorm(2)))
        >>> plan = resolve(model, default="bf16")
        >>> plan["1"].policy.compute, plan["0"].sources["compute"]
        (torch.float32, 'inherited')
    """
    require_module(model, "resolve")
    fallback = None if default is None else as_policy(default, argument="default")
    entries: dict[str, ModulePlan] = {}
    modules: dict[str, nn.Module] = {}
    storage_owner: dict[int, tuple[str, torch.dtype, bool]] = {}
    counted: set[int] = set()
    for name, module in model.named_modules():
        parent_entry = entries[parent_name(name)] if name else None
        parent = parent_entry.policy if parent_entry else None
        inherits = set(FIELDS) if parent_entry and parent_entry.container else (
            set(FIELDS) - {"output"}
        )
        itag, ctag, stag = instance_tag(module), class_tag(type(module)), scope_tag(module)
        values: dict[str, torch.dtype | None] = {}
        sources: dict[str, Source | None] = {}
        for field in FIELDS:
            value: torch.dtype | None = None
            source: Source | None = None
            if itag is not None and field in itag.fields:
                value, tag_source = itag.fields[field]
                source = "rule" if tag_source == "rule" else "instance"
            elif ctag is not None and getattr(ctag.policy, field) is not None:
                value, source = getattr(ctag.policy, field), "class"
            elif stag is not None and getattr(stag, field) is not None:
                value, source = getattr(stag, field), "scope"
            elif parent is not None and field in inherits and getattr(parent, field) is not None:
                value, source = getattr(parent, field), "inherited"
            elif parent is None and fallback is not None and getattr(fallback, field) is not None:
                value, source = getattr(fallback, field), "default"
            values[field] = value
            sources[field] = source
        policy = Policy(**values)
        params, total = 0, 0
        by_dtype: dict[str, int] = {}
        for pname, p in module.named_parameters(recurse=False):
            _check_tied(storage_owner, p, name, pname, policy.storage)
            if id(p) in counted:
                continue
            counted.add(id(p))
            dtype = policy.storage if policy.storage is not None and p.is_floating_point() else (
                p.dtype
            )
            nbytes = p.numel() * dtype.itemsize
            params += p.numel()
            total += nbytes
            by_dtype[dtype_name(dtype)] = by_dtype.get(dtype_name(dtype), 0) + nbytes
        keep = (itag.keep_dtype if itag and itag.keep_dtype else None) or (
            ctag.keep_dtype if ctag else ()
        )
        entries[name] = ModulePlan(
            name=name,
            type=f"{type(module).__module__}.{type(module).__qualname__}",
            policy=policy,
            sources=sources,
            keep_dtype=keep,
            container=is_container(module),
            params=params,
            param_bytes=total,
            param_dtype_bytes=by_dtype,
        )
        modules[name] = module
    return PrecisionPlan(
        entries, default=fallback, model_type=type(model).__qualname__, modules=modules
    )


def _check_tied(
    owners: dict[int, tuple[str, torch.dtype, bool]],
    param: nn.Parameter,
    module_name: str,
    param_name: str,
    storage: torch.dtype | None,
) -> None:
    """A shared parameter has one dtype: every owner must plan the same one. An owner that
    leaves storage unset plans the dtype the parameter has now."""
    if not param.is_floating_point():
        return
    target = storage if storage is not None else param.dtype
    first = owners.setdefault(id(param), (module_name, target, storage is None))
    if first[1] != target:
        def says(dtype: torch.dtype, unset: bool) -> str:
            return f"storage={dtype_name(dtype)}" + (", unset: it keeps its dtype" if unset else "")

        raise ValueError(
            f"Parameter {param_name!r} is shared by modules {first[0] or '(root)'!r} "
            f"({says(first[1], first[2])}) and {module_name or '(root)'!r} "
            f"({says(target, storage is None)}). A shared parameter has one storage dtype: "
            "annotate both modules with the same storage."
        )
