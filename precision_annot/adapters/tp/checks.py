"""What `check(model, "tp", {"parallelize_plan": ..., "tp_degree": N})` says: the decisions
`parallelize_module` would make (an fp8 style asked for a module not planned in fp8, a comm
that could act only on the wire), TP plan keys naming no module, and fp8 layers whose local
shard breaks their kernels' blocks."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from precision_annot._src.check_backend import LOOP_KEYS, CheckBackend, Checked
from precision_annot._src.findings import Finding, listing
from precision_annot._src.float8 import MX_BLOCK
from precision_annot._src.plan import PrecisionPlan
from precision_annot._src.runtime import Subject
from precision_annot.adapters.tp.choice import Decision, decide, match

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
    chosen = [decide(name, named[name], style, plan, named) for _, name, style in found]
    out = list(_unmatched(model, unmatched))
    out += _notes(chosen)
    if degree is not None:
        out += _shards(plan, named, chosen, degree)
    return out


def _unmatched(model: nn.Module, keys: list[str]) -> Iterator[Finding]:
    import difflib

    names = [n for n, _ in model.named_modules() if n]
    for key in keys:
        close = difflib.get_close_matches(key, names, n=3, cutoff=0.5)
        yield Finding(
            "warning", "tp-plan-unmatched", "",
            f"The TP plan key {key!r} names no module: parallelize_module (torch's and this "
            "one) skips it with a warning, so the module you meant runs unsharded on every "
            "rank, and a style paired with it (a ColwiseParallel before a RowwiseParallel) "
            "meets a full-size tensor where it expects a shard.",
            "Use a module name from the model: " + (
                ", ".join(map(repr, close)) if close else ", ".join(map(repr, names[:5]))) + ".")


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
            ) -> int | None:
    """The size of a local shard of an fp8 Linear that breaks its kernels' blocks where its
    global shape did not, or None."""
    gemm = plan[decision.name].policy.gemm
    if gemm is None or decision.role not in ("colwise", "rowwise") or not isinstance(
            module, nn.Linear):
        return None
    multiple = MX_BLOCK if gemm == "mxfp8" else FP8_MULTIPLE
    in_, out = module.in_features, module.out_features
    if in_ % multiple or out % multiple:
        return None  # the global shape already breaks them: fp8-dims says so
    cut = out if decision.role == "colwise" else in_
    return next((s for s in _sizes(cut, degree) if s % multiple), None)


def _shards(plan: PrecisionPlan, named: Mapping[str, nn.Module], chosen: list[Decision],
            degree: int) -> Iterator[Finding]:
    """fp8 Linears whose local shard breaks what the global shape satisfied: MX's blocks of
    32 along each GEMM's inner dimension (the forward's, the backward's), and the multiples
    of 16 fp8 GPU kernels take."""
    bad = [(d.name, local) for d in chosen
           if (local := _broken(plan, named[d.name], d, degree)) is not None]
    if not bad:
        return
    name, local = bad[0]
    gemm = plan[name].policy.gemm
    module = named[name]
    assert isinstance(module, nn.Linear)
    mx = gemm == "mxfp8"
    yield Finding(
        "error", "tp-fp8-shard", name,
        f"{listing([b[0] for b in bad])} run fp8 GEMMs (compute={gemm}) on shards of their "
        f"weight: {name!r} ({module.in_features} -> {module.out_features}) holds {local} "
        f"features of its sharded dimension on a rank of {degree}, and "
        + ("MX scales blocks of 32 along every GEMM's inner dimension, so its GEMMs refuse "
           "the shard (on a CPU too)." if mx else
           "fp8 GPU kernels (torch._scaled_mm) take multiples of 16, so its first fp8 GEMM "
           "on a GPU fails (a CPU emulates fp8 and runs it)."),
        f"Use a TP degree that leaves each shard a multiple of {MX_BLOCK if mx else FP8_MULTIPLE}, "
        f"or keep {name!r} out of fp8 (annotate(model, {{{name!r}: 'compute=bf16'}})).",
        tuple(b[0] for b in bad))


class TPChecks(CheckBackend):
    """`check(model, "tp", {"parallelize_plan": ..., "tp_degree": N})`."""

    name = "tp"
    keys = (*CONFIG_KEYS, *LOOP_KEYS)

    def run(self, given: Subject, options: Any) -> Checked:
        return Checked(findings(given.plan, given.model, self.without_loop(options)))


CHECKS = TPChecks()
