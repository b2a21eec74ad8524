"""`resolve`: the effective policy of every module, per field, by the precedence of the contract.

Per field, the highest level that sets it wins:

1. the instance (`precision(...)(module)` or `annotate`; the later call wins),
2. the class, through the nearest decorated class in the MRO,
3. the construction scope,
4. the parent's effective value (not for `output`, which applies to one module's exit, unless
   the parent is a container: it never runs, so its children carry its `output` too),
5. `default`, at the root.

A module reached by several paths (shared by two parents) is resolved under each of them; it
has one policy, so paths that disagree are an error naming both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import types
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from precision_annot._src.dtypes import STOCHASTIC, bf16, dtype_name, wider
from precision_annot._src.float8 import Gemm, Refusal, plain_class, refusals
from precision_annot._src.guards import paused_gc, require_module, warn
from precision_annot._src.plan import (
    ModuleFacts,
    ModulePlan,
    PrecisionPlan,
    Source,
    TensorInfo,
    parent_name,
)
from precision_annot._src.policy import (
    FIELDS,
    Policy,
    SpecLike,
    as_policy,
    exit_dtype,
    is_boundary,
)
from precision_annot._src.tags import class_tag, instance_tag, region_of, scope_tag
from precision_annot._src.update.rule import fields_of, rule_for
from precision_annot._src.wrappers import unwrap

__all__ = ["function_regions", "is_container", "resolve"]


def is_container(module: nn.Module) -> bool:
    """True for a module with no `forward` of its own (`nn.ModuleList`, `nn.ModuleDict`, ...):
    it is never called, so it cannot cast anything."""
    return type(module).forward is nn.Module.forward and "forward" not in module.__dict__


@dataclasses.dataclass(frozen=True)
class _Path:
    """One path to a module, as resolved there."""

    name: str
    policy: Policy
    container: bool
    context: Policy | None  # the policy of the nearest running ancestor on this path


def resolve(model: nn.Module, default: SpecLike | None = None) -> PrecisionPlan:
    """Compute the effective policy of every module of `model`.

    Args:
        model: the module tree, annotated with `precision`, `precision_scope` or `annotate`
            (a wrapper such as `DistributedDataParallel` or `torch.compile`'s is seen through).
        default: the root's defaults, used for each field nothing else sets. (Default: None)

    Returns:
        A `PrecisionPlan` with one row per module, in `named_modules()` order.

    Raises:
        ValueError: when two modules share a parameter but resolve to different storage or
            comm dtypes, or one module reached by two paths resolves differently on each.

    Warns:
        UserWarning: when `default` sets nothing, because every field it sets is already set
            on the root by an annotation or a construction scope.

    Example:
        >>> from torch import nn
        >>> from precision_annot import precision, resolve, fp32
        >>> model = nn.Sequential(nn.Linear(2, 2), precision(fp32)(nn.LayerNorm(2)))
        >>> plan = resolve(model, default="bf16")
        >>> plan["1"].policy.compute, plan["0"].sources["compute"]
        (torch.float32, 'inherited')
    """
    require_module(model, "resolve")
    with paused_gc():
        return _resolve(unwrap(model), None if default is None else as_policy(
            default, argument="default"))


def _resolve(model: nn.Module, fallback: Policy | None) -> PrecisionPlan:
    entries: dict[str, ModulePlan] = {}
    modules: dict[str, nn.Module] = {}
    first: dict[int, _Path] = {}  # id(module) -> its first path
    paths: dict[str, _Path] = {}
    tied: dict[int, tuple[str, torch.dtype, bool, torch.dtype | None, Policy]] = {}
    first_names: dict[int, str] = {}  # id(parameter) -> the qualified name first seen as
    for name, module in model.named_modules(remove_duplicate=False):
        parent = paths[parent_name(name)] if name else None
        policy, sources = _fields(module, parent, fallback)
        container = is_container(module)
        context = None if parent is None else (
            parent.context if parent.container else parent.policy)
        path = paths[name] = _Path(name, policy, container,
                                   context if parent is not None else None)
        seen = first.get(id(module))
        if seen is not None:
            _require_same(seen, path, runs=not container)
            continue
        first[id(module)] = path
        numel: dict[torch.dtype, int] = {}
        for pname, p in module.named_parameters(recurse=False):
            if _check_tied(tied, p, name, pname, policy):
                stored = policy.storage if policy.storage and p.is_floating_point() else p.dtype
                numel[stored] = numel.get(stored, 0) + p.numel()
        keep = _keep_dtype(module)
        cls = plain_class(module)
        entries[name] = ModulePlan(
            name=name,
            type=f"{cls.__module__}.{cls.__qualname__}",
            policy=policy,
            sources=sources,
            keep_dtype=keep,
            container=container,
            numel=numel,
            regions=function_regions(module),
            facts=module_facts(module, name, policy.storage, first_names),
        )
        modules[name] = module
    if fallback is not None:
        _warn_if_default_unused(fallback, entries[""])
    _warn_if_keep_unused(entries)
    _require_linear_under_fp8(entries, modules)
    _require_update_fields(entries)
    return PrecisionPlan(
        entries, default=fallback, model_type=type(model).__qualname__, modules=modules
    )


def module_facts(module: nn.Module, name: str, storage: torch.dtype | None,
                 seen: dict[int, str]) -> ModuleFacts:
    """What a plan keeps of one module (named `name`, stored in `storage`) for checks made
    without the model: its traits and its own tensors, each in the dtype the plan holds it in
    (runtime rule 1). `seen` maps each parameter already met (modules walked in order) to its
    first qualified name, so a tied parameter names its first holder."""
    infos = []
    for pname, p in module.named_parameters(recurse=False):
        qualified = f"{name}.{pname}" if name else pname
        first = seen.setdefault(id(p), qualified)
        dtype = storage if storage is not None and p.is_floating_point() else p.dtype
        infos.append(TensorInfo(pname, tuple(p.shape), dtype, trainable=p.requires_grad,
                                tied=None if first == qualified else first))
    non_persistent = module._non_persistent_buffers_set
    for bname, b in dict.items(module._buffers):
        if b is not None and b.is_floating_point():
            persistent = bname not in non_persistent
            dtype = storage if storage is not None and persistent else b.dtype
            infos.append(TensorInfo(bname, tuple(b.shape), dtype, buffer=True,
                                    trainable=False, persistent=persistent))
    return ModuleFacts(_traits(module, plain_class(module)), tuple(infos),
                       _hf_names(module, "_keep_in_fp32_modules"),
                       _hf_names(module, "_keep_in_fp32_modules_strict"))


def _hf_names(module: nn.Module, attribute: str) -> tuple[str, ...]:
    """A Hugging Face model's list of module names (`_keep_in_fp32_modules`), sorted; () for
    other modules."""
    found = getattr(module, attribute, None)
    return tuple(sorted(str(n) for n in found)) if isinstance(found, (list, tuple, set)) else ()


def capture(plan: PrecisionPlan, named: Mapping[str, nn.Module]) -> PrecisionPlan:
    """`plan` with what `resolve` sees of each module filled in from the live model `named`
    where the plan lacks it (a plan file written by precision_annot 0.3 or older)."""
    if plan.captured:
        return plan
    seen: dict[int, str] = {}
    facts = {n: module_facts(named[n], n, e.policy.storage, seen)
             for n, e in plan.items() if n in named}
    return plan.with_facts(facts)


def _traits(module: nn.Module, cls: type[nn.Module]) -> frozenset[str]:
    """The `TRAITS` of a module whose class, as the user built it, is `cls`."""
    traits = []
    if issubclass(cls, nn.Linear):
        traits.append("linear")
        if cls.forward is not nn.Linear.forward:
            traits.append("linear-forward")
    if isinstance(module, nn.Embedding):
        traits.append("embedding")
    if isinstance(module, nn.MultiheadAttention):
        traits.append("multihead-attention")
    if getattr(module, "track_running_stats", False) and isinstance(
            getattr(module, "running_mean", None), torch.Tensor):  # BatchNorm*, InstanceNorm*
        traits.append("running-stats")
    return frozenset(traits)


def _levels(module: nn.Module, parent: _Path | None, fallback: Policy | None
            ) -> list[tuple[Source, Policy, frozenset[str]]]:
    """The levels that may set a module's fields, highest first: (source, what it says, the
    fields it may pass on)."""
    itag, ctag, stag = instance_tag(module), class_tag(type(module)), scope_tag(module)
    levels: list[tuple[Source, Policy, frozenset[str]]] = []
    if itag is not None:
        for source in ("rule", "instance"):  # one tag: each field has one source
            said = {f: v for f, (v, s) in itag.fields.items()
                    if ("rule" if s == "rule" else "instance") == source}
            if said:
                levels.append((source, Policy(**said), _ALL))
    if ctag is not None:
        levels.append(("class", ctag.policy, _ALL))
    if stag is not None:
        levels.append(("scope", stag, _ALL))
    if parent is not None:
        inherits = _ALL if parent.container else _ALL - {"output", "backward"}
        levels.append(("inherited", parent.policy, inherits))
    elif fallback is not None:
        levels.append(("default", fallback, _ALL))
    return levels


_ALL = frozenset([*FIELDS, "gemm", "backward"])


def _fields(module: nn.Module, parent: _Path | None, fallback: Policy | None
            ) -> tuple[Policy, dict[str, Source | None]]:
    """One module's policy on one path, and per field where it came from. Compute and the fp8
    GEMM recipe are one slot: the highest level that sets either decides the recipe."""
    values: dict[str, Any] = {}
    sources: dict[str, Source | None] = {}
    levels = _levels(module, parent, fallback)
    for field in FIELDS:
        found = next(((src, getattr(p, field)) for src, p, passes in levels
                      if field in passes and getattr(p, field) is not None), (None, None))
        sources[field], values[field] = found
    slot = next(((src, p.gemm) for src, p, passes in levels if "gemm" in passes
                 and (p.gemm is not None or p.compute is not None)), (None, None))
    if slot[1] is not None:
        sources["gemm"], values["gemm"] = slot
    backward = next(((src, p.backward) for src, p, passes in levels
                     if "backward" in passes and p.backward is not None), (None, None))
    if backward[1] is not None:
        sources["backward"], values["backward"] = backward
    return Policy(**values), sources


def _require_linear_under_fp8(entries: dict[str, ModulePlan], modules: dict[str, nn.Module]
                              ) -> None:
    """An fp8 recipe set on a module itself (by an instance, class or rule annotation) must
    reach a Linear layer: fp8 runs the GEMMs of nn.Linear layers, and nothing else. mxfp8
    must run over a dtype torchao's MX formats take."""
    _require_fp8_runs(entries, modules)
    explicit = [n for n, e in entries.items() if e.policy.fp8 and e.sources.get("gemm") in
                ("instance", "class", "rule")]
    if not explicit:
        return
    reached: set[str] = set()
    for name, module in modules.items():
        if isinstance(module, nn.Linear):
            parts = name.split(".") if name else []
            reached.update(".".join(parts[:i]) for i in range(len(parts) + 1))
    bad = [n for n in explicit if n not in reached]
    if bad:
        first = entries[bad[0]]
        raise ValueError(
            f"compute={first.policy.fp8} ({first.sources['gemm']} annotation) is set on "
            f"{len(bad)} module(s) with no nn.Linear under them, e.g. {bad[0] or '(root)'!r} "
            f"({first.type.rsplit('.', 1)[-1]}): fp8 runs the GEMMs of nn.Linear layers, and "
            "this module has none. Annotate the Linear layers or a module that holds them "
            f"(annotate(model, {{nn.Linear: 'compute={first.policy.fp8}'}})). Modules: "
            f"{bad[:8]}")


def _require_fp8_runs(entries: dict[str, ModulePlan], modules: dict[str, nn.Module]) -> None:
    """No Linear planned with fp8 GEMMs that no Linear can run (`float8.REFUSALS` for any
    class; a class's own forward is refused when apply converts it)."""
    refused: dict[Refusal, list[tuple[str, Gemm]]] = {}
    for name, entry in entries.items():
        if entry.policy.fp8 is not None and isinstance(modules[name], nn.Linear):
            gemm = Gemm(entry.policy.fp8, compute=entry.policy.compute)
            for refusal in refusals(gemm, own_forward=False):
                refused.setdefault(refusal, []).append((name, gemm))
    for refusal, layers in refused.items():
        name, gemm = layers[0]
        raise ValueError(refusal.message(
            f"{len(layers)} Linear layer(s), e.g. {name or '(root)'!r}", name, gemm))


def _require_update_fields(entries: dict[str, ModulePlan]) -> None:
    """The update fields of a module that holds parameters must say something the optimizer
    can do: a master at least as wide as storage, stochastic rounding into bf16 storage, a
    gradient buffer at least as wide as storage."""
    for name, entry in entries.items():
        p = entry.policy
        if not entry.params:
            continue
        where = f"Module {name or '(root)'!r} ({entry.type.rsplit('.', 1)[-1]})"
        storage = p.storage
        if isinstance(p.master, torch.dtype) and storage is not None and not _holds(p.master,
                                                                                 storage):
            raise ValueError(
                f"{where}: master={dtype_name(p.master)} does not hold every value of its "
                f"storage={dtype_name(storage)}. The master is what the optimizer updates; "
                "narrower than (or beside) the stored weights, every update would be rounded "
                f"twice. Use master={dtype_name(storage)} or wider, or leave master unset.")
        if p.master == STOCHASTIC and storage not in (None, bf16) and not wider(storage, bf16):
            raise ValueError(
                f"{where}: master='stochastic' writes each fp32 update into bf16 storage with "
                f"stochastic rounding (torchao's), and its storage is {dtype_name(storage)}. "
                "Store it in bf16 (an island stored in fp32 is updated as stored), or use "
                "master=fp32 for a master copy.")
        if p.grad is not None and storage is not None and not _holds(p.grad, storage):
            raise ValueError(
                f"{where}: grad={dtype_name(p.grad)} does not hold every value of its "
                f"storage={dtype_name(storage)}: gradients arrive in the storage dtype, and "
                "accumulating them in it only loses bits. Use a grad at least as wide as "
                "storage, or leave it unset.")


def _holds(dtype: torch.dtype, storage: torch.dtype) -> bool:
    """`dtype` holds every value of `storage` (the same dtype, or a wider one)."""
    return dtype == storage or wider(dtype, storage)


def _keep_dtype(module: nn.Module) -> tuple[str | int, ...]:
    itag, ctag = instance_tag(module), class_tag(type(module))
    return (itag.keep_dtype if itag and itag.keep_dtype else None) or (
        ctag.keep_dtype if ctag else ())


def _require_same(first: _Path, again: _Path, *, runs: bool) -> None:
    """A module reached by a second path runs once per call with one boundary: its policy, its
    boundary and its exit dtype must be what its first path gives."""
    def what(path: _Path) -> tuple[Policy, bool, tuple[torch.dtype | None, bool]]:
        boundary = is_boundary(path.policy, path.context, runs=runs)
        exit_to = exit_dtype(path.policy, path.context) if boundary else (None, False)
        return path.policy, boundary, exit_to

    one, two = what(first), what(again)
    if one == two:
        return

    def say(path: _Path, info: tuple[Policy, bool, tuple[torch.dtype | None, bool]]) -> str:
        policy, boundary, (exit_to, to_input) = info
        text = str(policy)
        if boundary and one[0] == two[0]:
            text += (", hands its output back in the input's dtype" if to_input else
                     f", hands its output back in {dtype_name(exit_to)}" if exit_to else
                     ", a boundary")
        elif one[0] == two[0]:
            text += ", not a boundary"
        return f"{text} under {parent_name(path.name) or '(root)'!r}"

    fix = ("set output= on it so that both callers get the same dtype back"
           if one[0] == two[0] else
           "annotate the module itself (precision(...)(module)) so that both paths agree")
    raise ValueError(
        f"Module {first.name!r} is also reached as {again.name!r} (one module shared by two "
        f"parents), and the two paths resolve it differently: {say(first, one)}; "
        f"{say(again, two)}. One module runs with one policy: {fix}, or use two modules."
    )


def _warn_if_keep_unused(entries: dict[str, ModulePlan]) -> None:
    """keep_dtype on a container (ModuleList, ModuleDict) keeps nothing: no call passes
    through a module with no forward of its own."""
    for name, entry in entries.items():
        if entry.container and entry.keep_dtype:
            warn(f"keep_dtype={entry.keep_dtype} on {name or '(root)'!r} is ignored: "
                 f"{entry.type.rsplit('.', 1)[-1]} has no forward of its own, so nothing "
                 "passes through it.")


def _warn_if_default_unused(fallback: Policy, root: ModulePlan) -> None:
    given = [f for f, v in fallback.items() if v is not None]
    if not given or any(root.sources[f] == "default" for f in given):
        return
    setters = ", ".join(f"{f}={dtype_name(getattr(root.policy, f))} ({root.sources[f]})"
                        for f in given)
    warn(
        f"resolve: default={str(fallback)!r} sets nothing: the root already sets every field it "
        f"gives ({setters}), and the root's own annotations and construction scope outrank the "
        "default. To change them, annotate the root (annotate(model, {'': ...})) or build the "
        "model outside its precision_scope.")


def _check_tied(
    owners: dict[int, tuple[str, torch.dtype, bool, torch.dtype | None, Policy]],
    param: nn.Parameter,
    module_name: str,
    param_name: str,
    policy: Policy,
) -> bool:
    """A shared parameter has one dtype, one comm dtype and one update: every owner must plan
    the same. An owner that leaves storage unset plans the dtype the parameter has now. True
    the first time a parameter is seen (count it), False after."""
    storage, comm = policy.storage, policy.comm
    target = storage if storage is not None and param.is_floating_point() else param.dtype
    first = owners.get(id(param))
    if first is None:
        owners[id(param)] = (module_name, target, storage is None, comm, policy)
        return True
    if not param.is_floating_point():
        return False

    def says(dtype: torch.dtype, unset: bool) -> str:
        return f"storage={dtype_name(dtype)}" + (", unset: it keeps its dtype" if unset else "")

    owner = first[0] or "(root)"
    if first[1] != target:
        raise ValueError(
            f"Parameter {param_name!r} is shared by modules {owner!r} "
            f"({says(first[1], first[2])}) and {module_name or '(root)'!r} "
            f"({says(target, storage is None)}). A shared parameter has one storage dtype: "
            "annotate both modules with the same storage."
        )
    if first[3] != comm:
        raise ValueError(
            f"Parameter {param_name!r} is shared by modules {owner!r} "
            f"(comm={dtype_name(first[3])}) and {module_name or '(root)'!r} "
            f"(comm={dtype_name(comm)}). A shared parameter's gradient is reduced once, in one "
            "dtype, and backends would each pick another: annotate both modules with the same "
            "comm."
        )
    _check_tied_update(first[0] or "(root)", first[4], module_name or "(root)", policy,
                       param_name, target)
    return False


def _check_tied_update(owner: str, first: Policy, other: str, policy: Policy, param_name: str,
                       stored: torch.dtype) -> None:
    """A shared parameter is updated one way: the update rules its owners' fields give for its
    dtype must agree (a master planned by one and not the other would be dropped silently)."""
    a, b = rule_for(fields_of(first), stored), rule_for(fields_of(policy), stored)
    if a == b:
        return
    raise ValueError(
        f"Parameter {param_name!r} is shared by modules {owner!r} ({a.describe()}) and "
        f"{other!r} ({b.describe()}). A shared parameter is updated one way (one master, one "
        "gradient and state dtype): annotate both modules with the same master, grad and "
        "optim.")


# -- function-form regions --------------------------------------------------------------------

_REGIONS: weakref.WeakKeyDictionary[Any, dict[str, Policy]] = weakref.WeakKeyDictionary()


def function_regions(module: nn.Module) -> dict[str, Policy]:
    """The function-form regions (`precision(...)(fn)`) the module's forward refers to, by
    qualified name: functions named in its code that are globals of its file, variables it
    closes over, or attributes of its class. Read from the code, so a region reached only
    through another object is not found (`audit` still sees it run)."""
    forward = _own_forward(module)
    code = getattr(forward, "__code__", None)
    if code is None:
        return {}
    key = getattr(forward, "__func__", forward)
    cached = _REGIONS.get(key)
    if cached is None:
        cached = {}
        namespace = dict(getattr(forward, "__globals__", {}))
        cells = getattr(forward, "__closure__", None) or ()
        for free, cell in zip(code.co_freevars, cells, strict=False):  # a function defined
            with contextlib.suppress(ValueError):                      # around the class
                namespace[free] = cell.cell_contents
        for word in sorted(set(_names(code)) | set(code.co_freevars)):
            found = namespace.get(word)
            if found is None:
                found = _class_attribute(type(module), word)
            region = region_of(found)
            if region is not None:
                cached[getattr(found, "__qualname__", word)] = region
        with contextlib.suppress(TypeError):  # not weak-referenceable: not cached
            _REGIONS[key] = cached
    return dict(cached)


def _own_forward(module: nn.Module) -> Callable[..., Any]:
    """The forward the module's own code is in, under any wrapper (a boundary, Accelerate's)."""
    forward: Callable[..., Any] = module.__dict__.get("forward") or type(module).forward
    try:
        found: Callable[..., Any] = inspect.unwrap(forward)
    except ValueError:  # a cycle of __wrapped__
        return forward
    return found


def _names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _class_attribute(cls: type, name: str) -> Any:
    try:
        return inspect.getattr_static(cls, name)
    except AttributeError:
        return None
