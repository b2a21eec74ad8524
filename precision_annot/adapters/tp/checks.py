"""What `check(model, "tp", {"parallelize_plan": ..., "tp_degree": N})` says: the decisions
`parallelize_module` would make (a style torch refuses for the module, a comm its kept style
cannot reduce in, an fp8 style asked for a module not planned in fp8, an uneven shard torch's
style fails on), TP plan keys naming no module (an error where the module meant was one half
of a column/row-parallel pair: the other half then meets a full-size tensor), and fp8 layers
whose local shard breaks their kernels' blocks.

Each finding was judged against real runs on gloo ranks (`tests/adapters/test_tp.py`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ParallelStyle

from precision_annot._src.check_backend import LOOP_KEYS, CheckBackend, Checked
from precision_annot._src.findings import Finding, listing
from precision_annot._src.float8 import MX_BLOCK
from precision_annot._src.plan import PrecisionPlan
from precision_annot._src.runtime import Subject
from precision_annot.adapters.tp.choice import (
    Decision,
    decide,
    fp8_recipe,
    match,
    named_by,
    role,
)

__all__ = ["CHECKS", "CONFIG_KEYS", "TPChecks", "findings"]

#: the keys `check(model, "tp", config)` reads
CONFIG_KEYS = ("parallelize_plan", "tp_degree")

#: fp8 GEMM kernels (torch._scaled_mm) take dimensions that are multiples of this
FP8_MULTIPLE = 16


def _options(config: Mapping[str, Any]) -> tuple[ParallelStyle | Mapping[str, ParallelStyle],
                                                 int | None]:
    tp_plan = config.get("parallelize_plan")
    if tp_plan is None:
        raise ValueError("check: backend='tp' needs config={'parallelize_plan': {...}} (the "
                         "dict of module names to styles you give parallelize_module), and "
                         "'tp_degree' (the TP mesh size) to check the local shards.")
    degree = config.get("tp_degree")
    if degree is not None and (not isinstance(degree, int) or isinstance(degree, bool)
                               or degree < 1):
        raise ValueError(f"check: config 'tp_degree' is the TP mesh size, an int >= 1. "
                         f"Received: tp_degree={degree!r}")
    return tp_plan, degree


def findings(plan: PrecisionPlan, model: nn.Module | None, config: Any) -> list[Finding]:
    """The findings for running `plan`'s model under `parallelize_module` with
    `config["parallelize_plan"]` on a TP mesh of `config["tp_degree"]` ranks."""
    if model is None:
        raise ValueError("check: backend='tp' reads the TP plan's module names off the model, "
                         "and this plan holds none (it was loaded from JSON, or its model is "
                         "gone); pass the model instead of its plan.")
    tp_plan, degree = _options(config or {})
    found, unmatched = match(model, tp_plan)
    named = dict(model.named_modules())
    chosen = [decide(name, named[name], style, plan, named, degree)
              for _, name, style in found]
    styles = tp_plan if isinstance(tp_plan, Mapping) else {}
    out = list(_unmatched(model, unmatched, styles, found))
    out += _notes(chosen)
    if degree is not None:
        out += _shards(plan, named, chosen, degree)
    return out


def _facing(style: ParallelStyle) -> str | None:
    """The side a style hands or takes shards on, toward its partner in a Megatron pair:
    "out" (a column-parallel style whose output stays sharded), "in" (a row-parallel one
    whose input arrives sharded), or None."""
    kind = role(style)[0]
    if kind == "colwise" and isinstance(getattr(style, "output_layouts", (None,))[0], Shard):
        return "out"
    if kind == "rowwise" and isinstance(getattr(style, "input_layouts", (None,))[0], Shard):
        return "in"
    return None


def _meant(model: nn.Module, key: str, taken: set[str]) -> str | None:
    """The module an unmatched key most likely meant, by its name in the key's parent: the
    closest name among the children of the modules its parent part names, that no other key
    shards; None where none is close."""
    import difflib

    parent, _, last = key.rpartition(".")
    named = dict(model.named_modules())
    children = {child for p in named_by(model, parent) for child, _ in named[p].named_children()
                if (f"{p}.{child}" if p else child) not in taken}
    close = difflib.get_close_matches(last, sorted(children), n=1, cutoff=0.6)
    return f"{parent}.{close[0]}" if close and parent else (close[0] if close else None)


def _broken_pair(key: str, styles: Mapping[str, ParallelStyle],
                 found: list[tuple[str, str, ParallelStyle]]) -> bool:
    """Whether an unmatched key's style is one half of a column/row-parallel pair whose other
    half a key beside it (the same parent part) shards."""
    side = _facing(styles[key])
    if side is None:
        return False
    parent = key.rpartition(".")[0]
    other = "in" if side == "out" else "out"
    return any(k != key and k.rpartition(".")[0] == parent and _facing(s) == other
               for k, _, s in found)


def _unmatched(model: nn.Module, keys: list[str], styles: Mapping[str, ParallelStyle],
               found: list[tuple[str, str, ParallelStyle]]) -> Iterator[Finding]:
    """A key naming no module is skipped (torch warns). The module it most likely meant (a
    close name no other key shards) then runs unsharded on every rank: a warning; an error
    where that module is one half of a column/row-parallel pair whose other half is sharded
    (the first forward fails). A key like no module's name means nothing this model holds:
    nothing runs otherwise than planned (info)."""
    import difflib

    names = [n for n, _ in model.named_modules() if n]
    taken = {n for _, n, _ in found}
    for key in keys:
        close = difflib.get_close_matches(key, names, n=3, cutoff=0.5)
        fix = "Use a module name from the model: " + (
            ", ".join(map(repr, close)) if close else ", ".join(map(repr, names[:5]))) + "."
        meant = _meant(model, key, taken)
        if meant is None:
            yield Finding(
                "info", "tp-plan-unmatched", "",
                f"The TP plan key {key!r} names no module, and none of the model's is named "
                "like it: parallelize_module (torch's and this one) skips it with a warning.",
                fix)
        elif _broken_pair(key, styles, found):
            partner = "RowwiseParallel" if _facing(styles[key]) == "out" else "ColwiseParallel"
            yield Finding(
                "error", "tp-plan-unmatched", "",
                f"The TP plan key {key!r} names no module; it seems to mean {meant!r}, one "
                f"half of a {type(styles[key]).__name__} / {partner} pair whose other half "
                "is sharded: parallelize_module (torch's and this one) skips the key with a "
                "warning, and the first forward fails, the sharded half meeting a full-size "
                "tensor (\"mat1 and mat2 shapes cannot be multiplied\").", fix)
        else:
            yield Finding(
                "warning", "tp-plan-unmatched", "",
                f"The TP plan key {key!r} names no module: parallelize_module (torch's and "
                f"this one) skips it with a warning, so the module it seems to mean, {meant!r}, "
                "runs unsharded on every rank.", fix)


def _notes(chosen: list[Decision]) -> list[Finding]:
    """The decisions' notes, one finding per code, naming every module it concerns."""
    by_code: dict[str, list[Decision]] = {}
    for decision in chosen:
        for note in decision.notes:
            by_code.setdefault(note.code, []).append(decision)
    out = []
    for code, decisions in by_code.items():
        first = next(n for n in decisions[0].notes if n.code == code)
        names = list(dict.fromkeys(d.name for d in decisions))
        more = f" The same holds for {listing(names[1:])}." if len(names) > 1 else ""
        out.append(Finding(first.severity, code, names[0], first.message + more, first.fix,
                           tuple(names)))
    return out


def _sizes(n: int, degree: int) -> list[int]:
    """The sizes of a dimension of `n` sharded over `degree` ranks, as DTensor's Shard cuts it
    (torch.chunk: ceil-sized pieces, the last ones smaller or empty)."""
    step = -(-n // degree)
    return [max(0, min(step, n - i * step)) for i in range(degree)]


def _broken(plan: PrecisionPlan, module: nn.Module, decision: Decision, degree: int
            ) -> str | None:
    """Why the local shard of an fp8 Linear breaks its kernels where its global shape did not,
    or None.

    MX (measured on gloo, 2 and 4 ranks, hidden sizes 32 to 256): torchao cuts the sharded
    dimension into blocks of 32 as a view of the DTensor, which DTensor refuses where the TP
    degree does not divide the number of blocks ("Cannot unflatten unevenly sharded
    tensor"); a single block is no split, and runs (its shards are not multiples of 32).
    Per-tensor and row-wise fp8: GPU kernels (torch._scaled_mm) take multiples of 16."""
    gemm = fp8_recipe(plan[decision.name], module)
    if gemm is None or decision.role not in ("colwise", "rowwise") or not isinstance(
            module, nn.Linear):
        return None
    in_, out = module.in_features, module.out_features
    cut = out if decision.role == "colwise" else in_
    if gemm == "mxfp8":
        if in_ % MX_BLOCK or out % MX_BLOCK:
            return None  # the global shape already breaks them: fp8-dims says so
        blocks = cut // MX_BLOCK
        if blocks > 1 and blocks % degree:
            return (f"cuts its {cut} features into {blocks} MX blocks of {MX_BLOCK}, which "
                    f"{degree} ranks do not divide: torchao's MX cast views the sharded "
                    "weight as blocks, and DTensor refuses the view (\"Cannot unflatten "
                    "unevenly sharded tensor\"), on a CPU too")
        return None
    if in_ % FP8_MULTIPLE or out % FP8_MULTIPLE:
        return None
    local = next((s for s in _sizes(cut, degree) if s % FP8_MULTIPLE), None)
    if local is None:
        return None
    return (f"holds {local} of its {cut} sharded features on a rank of {degree}, and fp8 GPU "
            f"kernels (torch._scaled_mm) take multiples of {FP8_MULTIPLE}, so its first fp8 "
            "GEMM on a GPU fails (a CPU emulates fp8 and runs it)")


def _shards(plan: PrecisionPlan, named: Mapping[str, nn.Module], chosen: list[Decision],
            degree: int) -> Iterator[Finding]:
    """fp8 Linears whose local shard breaks what the global shape satisfied."""
    bad = [(d.name, why) for d in chosen
           if (why := _broken(plan, named[d.name], d, degree)) is not None]
    if not bad:
        return
    name, why = bad[0]
    gemm = plan[name].policy.gemm
    module = named[name]
    assert isinstance(module, nn.Linear)
    mx = gemm == "mxfp8"
    yield Finding(
        "error", "tp-fp8-shard", name,
        f"{listing([b[0] for b in bad])} run fp8 GEMMs (compute={gemm}) on shards of their "
        f"weight: {name!r} ({module.in_features} -> {module.out_features}) {why}.",
        (f"Use a TP degree that divides the number of {MX_BLOCK}-wide blocks of the sharded "
         "dimension" if mx else
         f"Use a TP degree that leaves each shard a multiple of {FP8_MULTIPLE}")
        + f", or keep {name!r} out of fp8 (annotate(model, {{{name!r}: 'compute=bf16'}})).",
        tuple(b[0] for b in bad))


class TPChecks(CheckBackend):
    """`check(model, "tp", {"parallelize_plan": ..., "tp_degree": N})`."""

    name = "tp"
    keys = (*CONFIG_KEYS, *LOOP_KEYS)

    def run(self, given: Subject, options: Any) -> Checked:
        return Checked(findings(given.plan, given.model, self.without_loop(options)))


CHECKS = TPChecks()
