"""`resolve`: the effective policy of every module, per field, by the precedence of the contract.

Per field, the highest level that sets it wins:

1. the instance (`precision(...)(module)` or `annotate`; the later call wins),
2. the class, through the nearest decorated class in the MRO,
3. the construction scope,
4. the parent's effective value (not for `output`, which applies to one module's exit),
5. `default`, at the root.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from precision_annot.annotation import class_tag, instance_tag, scope_tag
from precision_annot.dtypes import LOW_PRECISION, dtype_name, itemsize
from precision_annot.plan import ModulePlan, PrecisionPlan, Source
from precision_annot.policy import FIELDS, Policy, SpecLike, as_policy

__all__ = ["autocast_mode", "replan", "resolve"]


def autocast_mode(policy: Policy) -> str | None:
    """How a module's forward treats autocast: "autocast", "off", or None (left as it is)."""
    if policy.compute is None:
        return None
    if policy.compute in LOW_PRECISION and policy.storage != policy.compute:
        return "autocast"
    return "off"


def is_boundary(policy: Policy, parent: Policy | None) -> bool:
    """True when a module's compute, output or autocast mode differs from its parent's."""
    if parent is None:
        return policy.compute is not None or policy.output is not None
    return (
        policy.compute != parent.compute
        or (policy.output is not None and policy.output != parent.output)
        or autocast_mode(policy) != autocast_mode(parent)
    )


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
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"resolve expects an nn.Module. Received: model={model!r} "
            f"(of type {type(model).__name__})"
        )
    fallback = None if default is None else as_policy(default, argument="default")
    entries: dict[str, ModulePlan] = {}
    modules: dict[str, nn.Module] = {}
    storage_owner: dict[int, tuple[str, torch.dtype]] = {}
    counted: set[int] = set()
    for name, module in model.named_modules():
        parent = entries[name.rpartition(".")[0]].policy if name else None
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
            elif parent is not None and field != "output" and getattr(parent, field) is not None:
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
            nbytes = p.numel() * itemsize(dtype)
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
            boundary=is_boundary(policy, parent),
            params=params,
            param_bytes=total,
            param_dtype_bytes=by_dtype,
        )
        modules[name] = module
    return PrecisionPlan(
        entries, default=fallback, model_type=type(model).__qualname__, modules=modules
    )


def _check_tied(
    owners: dict[int, tuple[str, torch.dtype]],
    param: nn.Parameter,
    module_name: str,
    param_name: str,
    storage: torch.dtype | None,
) -> None:
    if storage is None or not param.is_floating_point():
        return
    first = owners.setdefault(id(param), (module_name, storage))
    if first[1] != storage:
        raise ValueError(
            f"Parameter {param_name!r} is shared by modules {first[0] or '(root)'!r} "
            f"(storage={dtype_name(first[1])}) and {module_name or '(root)'!r} "
            f"(storage={dtype_name(storage)}). A shared parameter has one storage dtype: "
            "annotate both modules with the same storage."
        )


def replan(plan: PrecisionPlan, policies: dict[str, Policy]) -> PrecisionPlan:
    """A copy of `plan` with some modules' policies replaced and boundaries recomputed.

    Adapters use it where a backend cannot express a plan exactly and they run a close one.
    """
    entries: dict[str, ModulePlan] = {}
    for name, entry in plan.items():
        policy = policies.get(name, entry.policy)
        parent = entries[name.rpartition(".")[0]].policy if name else None
        by_dtype = dict(entry.param_dtype_bytes)
        if policy.storage is not None and policy.storage != entry.policy.storage and by_dtype:
            by_dtype = {dtype_name(policy.storage): entry.params * itemsize(policy.storage)}
        entries[name] = dataclasses.replace(
            entry,
            policy=policy,
            boundary=is_boundary(policy, parent),
            param_bytes=sum(by_dtype.values()),
            param_dtype_bytes=by_dtype,
        )
    return PrecisionPlan(
        entries, default=plan.default, model_type=plan.model_type, modules=plan.modules()
    )
