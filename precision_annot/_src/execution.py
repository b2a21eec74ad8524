"""`compile_plan`: what runs at every module of a model under a plan, worked out once.

A plan says what each module is declared and resolved to; an `Execution` says what runs: each
floating tensor's planned dtype, each boundary's `BoundarySpec` (entry dtype, autocast mode,
exit dtype, arguments kept), the parameters each boundary sees in its compute dtype (its
`Region`), and the entry guard of each module that can be called on its own. It is pure (it
reads the model, changes nothing) and linear in the number of modules. `apply` installs it,
and `audit` compares what ran against it, so a runtime rule changed here changes both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeAlias

import torch
from torch import nn

from precision_annot._src.arithmetic import (
    Arithmetic,
    of_policy,
    owns_gemm_weights,
    runs_linear_forward,
)
from precision_annot._src.boundary import Boundary, BoundarySpec, Planned, Region, keep_binding
from precision_annot._src.dtypes import FP8, dtype_name
from precision_annot._src.float8 import Gemm
from precision_annot._src.plan import ModulePlan, PrecisionPlan, nearest, parent_name
from precision_annot._src.policy import Policy, autocast_mode, exit_dtype

__all__ = ["Execution", "Key", "Site", "Target", "arithmetic_of", "compile_plan", "forward_of",
           "fp8_gemms"]

Kind: TypeAlias = Literal["param", "buffer"]
Key = tuple[str, Kind, str]  # module name, "param" | "buffer", tensor name


@dataclasses.dataclass(frozen=True)
class Target:
    """One floating parameter or buffer: the dtype the plan holds it in.

    Attributes:
        dtype: its planned dtype (a non-persistent buffer's own dtype: it keeps the dtype it
            was built in).
        persistent: False for a non-persistent buffer.
    """

    dtype: torch.dtype
    persistent: bool = True


@dataclasses.dataclass(frozen=True, eq=False)
class Site:
    """What runs at one module.

    Attributes:
        spec: what its forward does at each call.
        guard: True for an entry guard: a module that is not a boundary, but can be called on
            its own (an encoder, a block). It acts only when called from outside its model's
            forward: then it sets up what its boundary would have (entry cast, autocast,
            parameters in the compute dtype); inside, it runs as the model's code says.
        region: the tensors seen in the compute dtype while it runs, or None; an entry guard
            shares its boundary's (the object the modules' parameter dicts know).
        swap: for an entry guard, the part of that region under its own module, with paths
            from it (what `torch.compile` and DataParallel replicas swap on the modules);
            None for a boundary (its region's paths are from its own module).
        top: a boundary with no boundary above it, which may start its model's forward.
        planned: the tensors its forward reads and their planned dtypes, to explain a failure.
    """

    spec: BoundarySpec
    guard: bool
    region: Region | None
    planned: tuple[Planned, ...]
    swap: Region | None = None
    top: bool = True

    def signature(self) -> tuple[Any, ...]:
        def key(region: Region | None) -> Any:
            return None if region is None else (region.compute, region.members)

        return (self.spec, self.guard, key(self.region), key(self.swap), self.planned,
                self.top)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Site) and self.signature() == other.signature()

    def __hash__(self) -> int:
        return hash(self.signature())


@dataclasses.dataclass(frozen=True)
class Execution:
    """What runs at every module of one model under one plan (`compile_plan` makes it).

    Attributes:
        targets: every floating parameter and buffer, by (module, kind, name).
        sites: the modules whose forward is replaced (boundaries and entry guards), by name.
        casting: the (module, kind) dicts whose tensors are seen in a compute dtype, with their
            region and the buffers that are only ever cast up (non-persistent ones).
        reprs: the text `print(model)` shows after each annotated module's own.
        check: `check_finite` was asked for.
        gemms: the Linear layers whose GEMMs run in fp8, by name: their recipe, and whether
            their weight is all-gathered in fp8.
        arithmetic: the Linear layers whose GEMMs hand back a wider output than they compute
            in, or emulate fp32, by name (`arithmetic.of_policy`).
    """

    targets: Mapping[Key, Target]
    sites: Mapping[str, Site]
    casting: Mapping[tuple[str, Kind], tuple[Region, frozenset[str]]]
    reprs: Mapping[str, str]
    check: bool
    gemms: Mapping[str, Gemm] = dataclasses.field(default_factory=dict)
    arithmetic: Mapping[str, Arithmetic] = dataclasses.field(default_factory=dict)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Execution):
            return NotImplemented
        mine = {k: (r.compute, r.members, u) for k, (r, u) in self.casting.items()}
        theirs = {k: (r.compute, r.members, u) for k, (r, u) in other.casting.items()}
        return (self.targets == other.targets and self.sites == other.sites and mine == theirs
                and self.reprs == other.reprs and self.check == other.check
                and self.gemms == other.gemms and self.arithmetic == other.arithmetic)

    __hash__ = None  # type: ignore[assignment]


def forward_of(module: nn.Module) -> tuple[Callable[..., Any], bool]:
    """The forward a boundary on `module` wraps, and whether it still takes `self`."""
    own = module.__dict__.get("forward")
    if own is not None and not isinstance(own, Boundary):
        return own, False
    return type(module).forward, True


def compile_plan(plan: PrecisionPlan, named: Mapping[str, nn.Module], *,
                 check: bool = False) -> Execution:
    """What runs at every module of the model `named` (`dict(model.named_modules())`) under
    `plan`, whose entries it must match (see `runtime.check_matches`). Linear in the modules:
    four passes, each over the modules once (targets, boundaries, entry guards, reprs)."""
    targets = _targets(plan, named)
    boundaries = set(plan.boundaries)
    owner = nearest(named, boundaries | ({""} if check and not plan.root.container else set()))
    sites, casting = _boundary_sites(plan, named, owner, targets, check)
    _add_guards(plan, named, owner, sites)
    return Execution(targets, sites, casting, _reprs(plan), check, fp8_gemms(plan, named),
                     arithmetic_of(plan, named))


def arithmetic_of(plan: PrecisionPlan, named: Mapping[str, nn.Module]
                  ) -> dict[str, Arithmetic]:
    """The modules whose plan gives their GEMMs a wide output or emulated fp32, with that
    arithmetic: Linear layers, and modules whose forward runs `F.linear` on a 2-D weight of
    their own (transformers' MoE routers)."""
    out = {}
    for name, entry in plan.items():
        arith = of_policy(entry.policy)
        module = named[name]
        if arith is not None and (runs_linear_forward(module) or owns_gemm_weights(module)):
            out[name] = arith
    return out


def _boundary_sites(plan: PrecisionPlan, named: Mapping[str, nn.Module],
                    owner: Mapping[str, str | None], targets: Mapping[Key, Target], check: bool
                    ) -> tuple[dict[str, Site], dict[tuple[str, Kind], tuple[Region,
                                                                           frozenset[str]]]]:
    """Each boundary's site (the modules it runs: those whose nearest boundary it is), and
    the parameter dicts its region casts."""
    members: dict[str, list[str]] = {}
    for name in named:
        boundary = owner[name]
        if boundary is not None:
            members.setdefault(boundary, []).append(name)
    sites: dict[str, Site] = {}
    casting: dict[tuple[str, Kind], tuple[Region, frozenset[str]]] = {}
    above = nearest(named, {n for n in members if n})  # the nearest boundary at or above
    for name, names in members.items():
        site = _boundary_site(plan, named, name, names, targets, check)
        if name and (above[parent_name(name)] is not None or "" in members):
            site = dataclasses.replace(site, top=False)
        sites[name] = site
        if site.region is not None:
            _casting_dicts(site.region, name, named, casting)
    return sites, casting


def _add_guards(plan: PrecisionPlan, named: Mapping[str, nn.Module],
                owner: Mapping[str, str | None], sites: dict[str, Site]) -> None:
    """An entry guard on each module inside a boundary that can be called on its own."""
    for name, entry in plan.items():
        boundary = owner[name]
        if boundary is not None and name not in sites and _callable_alone(entry, named[name]):
            guard = _guard_site(entry, named[name], boundary, sites[boundary])
            if guard is not None:
                sites[name] = guard


def _reprs(plan: PrecisionPlan) -> dict[str, str]:
    """What `print(model)` shows after each annotated module's own text ("*": a boundary)."""
    texts: dict[Policy, str] = {}  # a few distinct policies among many modules
    return {name: (texts.get(entry.policy) or texts.setdefault(entry.policy,
                                                               str(entry.policy)))
            + ("*" if entry.boundary else "")
            for name, entry in plan.items() if not entry.policy.is_empty()}


def fp8_gemms(plan: PrecisionPlan, named: Mapping[str, nn.Module] | None = None
              ) -> dict[str, Gemm]:
    """The Linear layers whose plan runs their GEMMs in fp8: read off the model `named` when
    given (what `apply` converts), else off what `resolve` saw of each module."""
    def linear(name: str, entry: ModulePlan) -> bool:
        return isinstance(named[name], nn.Linear) if named is not None else entry.has("linear")

    return {name: Gemm(entry.policy.fp8, entry.policy.comm == FP8, entry.policy.compute)
            for name, entry in plan.items()
            if entry.policy.fp8 is not None and linear(name, entry)}


def _targets(plan: PrecisionPlan, named: Mapping[str, nn.Module]) -> dict[Key, Target]:
    """Rule 1: parameters and persistent floating buffers in their module's storage dtype;
    non-persistent buffers keep the dtype they were built in."""
    out: dict[Key, Target] = {}
    owners: dict[int, tuple[str, str, torch.dtype]] = {}
    for name, module in named.items():
        storage = plan[name].policy.storage
        for pname, p in module._parameters.items():
            if p is not None and p.is_floating_point():
                dtype = storage or p.dtype
                out[(name, "param", pname)] = Target(dtype)
                first = owners.setdefault(id(p), (name, pname, dtype))
                if first[2] != dtype:
                    raise ValueError(
                        f"The plan stores one shared parameter in two dtypes: "
                        f"{first[0] or '(root)'}.{first[1]} in {dtype_name(first[2])} and "
                        f"{name or '(root)'}.{pname} in {dtype_name(dtype)}, the same tensor "
                        "(tied weights). A tensor has one dtype: give every module that holds "
                        "it the same storage.")
        non_persistent = module._non_persistent_buffers_set
        for bname, b in dict.items(module._buffers):
            if b is not None and b.is_floating_point():
                persistent = bname not in non_persistent
                dtype = storage if storage is not None and persistent else b.dtype
                out[(name, "buffer", bname)] = Target(dtype, persistent)
    return out


def _tensors(named: Mapping[str, nn.Module], names: list[str], targets: Mapping[Key, Target]
             ) -> list[tuple[str, Kind, str, Target]]:
    """The floating tensors of these modules, as (module, kind, name, target)."""
    out: list[tuple[str, Kind, str, Target]] = []
    for member in names:
        module = named[member]
        for pname, p in module._parameters.items():
            if p is not None and p.is_floating_point():
                out.append((member, "param", pname, targets[(member, "param", pname)]))
        for bname, b in dict.items(module._buffers):
            if b is not None and b.is_floating_point():
                out.append((member, "buffer", bname, targets[(member, "buffer", bname)]))
    return out


def _boundary_site(plan: PrecisionPlan, named: Mapping[str, nn.Module], name: str,
                   names: list[str], targets: Mapping[Key, Target], check: bool) -> Site:
    """A boundary (or, with `check_finite`, the root checked at its exit): its spec, and the
    tensors of the modules it runs (`names`, the modules with no boundary between)."""
    entry = plan[name]
    policy = entry.policy
    boundary = entry.boundary
    context = plan.context(name)
    exit_to, to_input = exit_dtype(policy, None if context is None else context.policy)
    forward, method = forward_of(named[name])
    positions, kept = keep_binding(forward, entry.keep_dtype,
                                   f"the forward of {name or '(root)'!r}", method=method)
    mode = autocast_mode(policy) if boundary else None
    spec = BoundarySpec(
        name=name,
        compute=policy.compute if boundary else None,
        mode=mode,
        exit=exit_to if boundary else None,
        exit_to_input=to_input and boundary,
        keep_positions=positions,
        keep_names=kept,
        check=check,
    )
    prefix = f"{name}." if name else ""

    def relative(member: str) -> str:
        return member.removeprefix(prefix) if member != name else ""

    tensors = _tensors(named, names, targets)
    planned = tuple(Planned(relative(m), kind, t, target.dtype)
                    for m, kind, t, target in tensors)
    region = None
    if mode == "off" and policy.compute is not None:
        probe = Region(policy.compute, ())
        cast = tuple((relative(m), kind, t, not target.persistent)
                     for m, kind, t, target in tensors
                     if probe.needs(torch.empty(0, dtype=target.dtype), not target.persistent))
        region = Region(policy.compute, cast) if cast else None
    return Site(spec, False, region, planned)


def _casting_dicts(region: Region, name: str, named: Mapping[str, nn.Module],
                   out: dict[tuple[str, Kind], tuple[Region, frozenset[str]]]) -> None:
    prefix = f"{name}." if name else ""
    for path, kind, _, _ in region.members:
        member = f"{prefix}{path}" if path else name
        upcast_only = (frozenset(named[member]._non_persistent_buffers_set) if kind == "buffer"
                       else frozenset())
        out[(member, kind)] = (region, upcast_only)  # type: ignore[index]


def _callable_alone(entry: ModulePlan, module: nn.Module) -> bool:
    """A module worth an entry guard: it runs its own forward and has submodules (an encoder,
    a decoder, a block; leaves such as a Linear are left alone, so they cost nothing)."""
    return not entry.container and next(iter(module._modules.values()), None) is not None


def _guard_site(entry: ModulePlan, module: nn.Module, owner: str, boundary: Site
                ) -> Site | None:
    """The entry guard of a module inside `boundary`: called on its own, it sets up what the
    boundary would have (same compute and autocast mode, same region), and hands its outputs
    back as computed, as a top-level module does."""
    outer = boundary.spec
    if outer.compute is None and outer.mode is None and boundary.region is None:
        return None  # its boundary only casts at exit: nothing to set up
    forward, method = forward_of(module)
    positions, kept = keep_binding(forward, entry.keep_dtype,
                                   f"the forward of {entry.name or '(root)'!r}", method=method)
    spec = BoundarySpec(name=entry.name, compute=outer.compute, mode=outer.mode, exit=None,
                        keep_positions=positions, keep_names=kept)
    swap = None
    if boundary.region is not None:
        # the members under this module, with paths from it instead of from its boundary
        inner = entry.name.removeprefix(f"{owner}.") if owner else entry.name
        mine = f"{inner}."
        members = tuple((p.removeprefix(mine) if p != inner else "", kind, t, up)
                        for p, kind, t, up in boundary.region.members
                        if p == inner or p.startswith(mine))
        swap = Region(boundary.region.compute, members)
    return Site(spec, True, boundary.region, (), swap)
