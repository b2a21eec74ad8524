"""What `check` says about a plan's fp8 GEMMs: layers fp8 kernels refuse, GEMMs too small to
gain, fp8 planned where no Linear converts it, fp8 comm a backend cannot all-gather, and a plan
Accelerate's fp8 (`adapters.fp8.ao_recipe_kwargs`) refuses, by the rules it refuses by."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from precision_annot._src.dtypes import FP8, FP8_RECIPES, bf16, dtype_name
from precision_annot._src.execution import fp8_gemms
from precision_annot._src.findings import Finding, listing
from precision_annot._src.float8 import (
    MX_BLOCK,
    REFUSALS,
    Gemm,
    available,
    install_hint,
    refusals,
)
from precision_annot._src.plan import ModulePlan, PrecisionPlan
from precision_annot._src.runtime import Subject, applied_plan

__all__ = ["accelerate_findings", "accelerate_refusal", "fp8_findings", "one_gemm",
           "too_small", "unapplied_islands"]

#: backends that all-gather parameters and can do it in fp8 (FSDP2 with torchao's weights)
_FP8_GATHER = frozenset({"fsdp"})


def too_small(gemm: Gemm, n: int, k: int) -> bool:
    """torchao's own filter (`_auto_filter_for_recipe`, from H100 measurements): a Linear of
    `n` outputs and `k` inputs whose GEMM is too small for fp8 to gain over bf16, because the
    casts and scales cost more than the faster GEMM saves."""
    if gemm.torchao_recipe == "tensorwise":
        return k <= 4096 and n <= 1024
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


def fp8_findings(plan: PrecisionPlan, backend: str | None) -> list[Finding]:
    """The fp8 findings for `plan` under `backend`, from what `resolve` saw of each module (the
    plan's facts), so a plan whose model is gone is checked alike."""
    if not any(e.policy.fp8 for e in plan.values()):
        return []
    gemms = fp8_gemms(plan)
    return [*_unavailable(gemms), *_refused(plan, gemms), *_dims(plan, gemms),
            *_not_converted(plan, gemms), *_comm(plan, gemms, backend), *_small(plan, gemms)]


def _shape(entry: ModulePlan) -> tuple[int, int]:
    """A Linear's (in_features, out_features), from its weight's shape."""
    weight = entry.facts.tensor("weight") if entry.facts is not None else None
    out, in_ = weight.shape if weight is not None and len(weight.shape) == 2 else (0, 0)
    return in_, out


def _unavailable(gemms: dict[str, Gemm]) -> Iterator[Finding]:
    if gemms and not available():
        names = list(gemms)
        yield Finding("error", "fp8-unavailable", names[0],
                      f"{len(names)} Linear layer(s) are planned with fp8 GEMMs, which run "
                      "through torchao, and torchao is not installed: apply refuses the plan.",
                      f"{install_hint}.", tuple(names))


def _refused(plan: PrecisionPlan, gemms: dict[str, Gemm]) -> Iterator[Finding]:
    """The layers apply refuses, by the rules apply raises from (`float8.REFUSALS`)."""
    hit: dict[str, list[str]] = {}
    for name, gemm in gemms.items():
        for refusal in refusals(gemm, plan[name].has("linear-forward")):
            hit.setdefault(refusal.code, []).append(name)
    for refusal in REFUSALS:
        names = hit.get(refusal.code, [])
        if names:
            gemm = gemms[names[0]]
            yield Finding("error", refusal.code, names[0],
                          f"{listing(names)}: {refusal.why(gemm)}",
                          refusal.fix(names[0], gemm), tuple(names))


def _linears(plan: PrecisionPlan, gemms: dict[str, Gemm],
             test: Callable[[Gemm, int, int], bool]) -> tuple[list[str], tuple[int, int]]:
    """The fp8 Linear layers for which `test(gemm, in_features, out_features)` holds, by name,
    and the first one's (in_features, out_features)."""
    found = [(name, _shape(plan[name])) for name, gemm in gemms.items()
             if test(gemm, *_shape(plan[name]))]
    return [n for n, _ in found], (found[0][1] if found else (0, 0))


def _dims(plan: PrecisionPlan, gemms: dict[str, Gemm]) -> Iterator[Finding]:
    def odd(gemm: Gemm, in_: int, out: int) -> bool:
        block = MX_BLOCK if gemm.recipe == "mxfp8" else 16
        return bool(in_ % block or out % block)

    bad, (in_, out) = _linears(plan, gemms, odd)
    if bad:
        yield Finding(
            "error", "fp8-dims", bad[0],
            f"{listing(bad)} run fp8 GEMMs with a dimension not divisible by 16 (32 for mxfp8), "
            f"e.g. {in_} -> {out}: fp8 GPU kernels "
            "(torch._scaled_mm) refuse such shapes, so the first forward on a GPU fails. A CPU "
            "emulates fp8 and runs them, so CPU tests do not show it.",
            f"Keep them out of fp8: annotate(model, {{{bad[0]!r}: 'compute=bf16'}}) (or pad "
            "their dimensions to a multiple of 16).", tuple(bad))


def _not_converted(plan: PrecisionPlan, gemms: dict[str, Gemm]) -> Iterator[Finding]:
    """fp8 planned on modules whose matrix multiplies no Linear conversion reaches: their own
    weights (GPT-2's Conv1D, fused MoE experts, a router holding its weight) stay in high
    precision, and so does a Linear its parent never calls (MultiheadAttention's out_proj)."""
    missed = []
    for name, entry in plan.items():
        if entry.policy.fp8 is None or name in gemms or entry.has("embedding"):
            continue
        if entry.facts is not None and any(t.dtype.is_floating_point and len(t.shape) >= 2
                                           for t in entry.facts.params):
            missed.append(name)
    for name, entry in plan.items():
        out_proj = f"{name + '.' if name else ''}out_proj"
        if entry.has("multihead-attention") and out_proj in gemms:
            missed.append(out_proj)
    if missed:
        kinds = sorted({plan[n].type.rsplit(".", 1)[-1] for n in missed})
        yield Finding(
            "warning", "fp8-not-converted", missed[0],
            f"{listing(missed)} ({', '.join(kinds)}) are planned with fp8 GEMMs, but fp8 "
            "converts nn.Linear layers that are called as modules, and these multiply by their "
            "weights another way: they run in their high-precision compute.",
            "Plan them without fp8 to say what runs, or make their GEMMs nn.Linear layers.",
            tuple(missed))


def _comm(plan: PrecisionPlan, gemms: dict[str, Gemm], backend: str | None
          ) -> Iterator[Finding]:
    fp8 = [n for n, e in plan.items() if e.policy.comm == FP8 and e.params]
    if not fp8 or backend in (None, "local", "lightning") or backend in _FP8_GATHER:
        return
    if backend == "deepspeed" and any(gemms[n].all_gather for n in fp8 if n in gemms):
        yield Finding(
            "error", "fp8-comm-refused", fp8[0],
            f"{listing(fp8)} have comm=fp8, so apply gives their weights torchao's fp8 "
            "all-gather tensor type; DeepSpeed's engine moves the model with module.to(device), "
            "which cannot swap such tensors: deepspeed.initialize fails (\"_apply(): Couldn't "
            "swap Float8Linear.weight\"). torchao's own conversion fails the same way.",
            "Keep their fp8 compute with comm=bf16 (or fp32): DeepSpeed runs fp8 GEMMs, it "
            "does not all-gather fp8.", tuple(fp8))
        return
    first = plan[fp8[0]].policy
    carried = dtype_name(first.compute or first.storage)
    yield Finding(
        "warning", "fp8-comm", fp8[0],
        f"{listing(fp8)} have comm=fp8 (weights all-gathered in fp8), which only FSDP2 does "
        f"(with torchao's fp8 weights); {backend} moves their weights and gradients in their "
        f"own dtypes ({carried} or wider): more bytes than planned.",
        "Shard with FSDP2 (adapters.fsdp.fully_shard), or set comm to the dtype this backend "
        "should reduce in.", tuple(fp8))


def _small(plan: PrecisionPlan, gemms: dict[str, Gemm]) -> Iterator[Finding]:
    small, (in_, out) = _linears(plan, gemms, lambda gemm, k, n: too_small(gemm, n, k))
    if small:
        yield Finding(
            "info", "fp8-small-gemm", small[0],
            f"{listing(small)} run GEMMs too small for fp8 to gain (e.g. {in_} "
            f"-> {out}): by torchao's measurements, casting and scaling cost "
            "more than the faster GEMM saves, so they run slower than in bf16.",
            f"Keep them in bf16 (annotate(model, {{{small[0]!r}: 'compute=bf16'}}) for each), "
            "as torchao's auto_filter_for_recipe would.", tuple(small))


# -- Accelerate's fp8 --------------------------------------------------------------------------

def one_gemm(gemms: dict[str, Gemm], what: str) -> Gemm:
    """The plan's one fp8 GEMM kind, for a backend (`what`) that takes one fp8 config for the
    whole model; a plan with none, several, or mxfp8 is refused with why."""
    kinds = sorted({(g.recipe, g.all_gather) for g in gemms.values()})
    if not kinds:
        raise ValueError(f"{what}: the plan runs no GEMM in fp8 (no Linear layer has an fp8 "
                         f"compute); valid fp8 computes: {', '.join(FP8_RECIPES)}.")
    if len(kinds) > 1:
        said = ", ".join(f"compute={r}" + (",comm=fp8" if a else "") for r, a in kinds)
        raise ValueError(f"{what} takes one fp8 config for the whole model, and the plan has "
                         f"{len(kinds)}: {said}. Use one recipe (and one comm) for every fp8 "
                         "Linear, or precision_annot.apply, which converts each with its own.")
    recipe, all_gather = kinds[0]
    if recipe == "mxfp8":
        raise ValueError(f"{what}: torchao's Float8LinearConfig has no mxfp8 recipe; "
                         "precision_annot.apply converts mxfp8 Linear layers itself.")
    return Gemm(recipe, all_gather)


def unapplied_islands(given: Subject) -> list[str]:
    """The modules Accelerate's fp8 would run in its bf16 autocast against the plan: those
    planned to compute in another dtype (an fp32 island), unless the plan is applied to the
    model (then their boundaries keep it inside Accelerate's autocast)."""
    if given.model is not None and applied_plan(given.model) is not None:
        return []
    return [n for n, e in given.plan.items()
            if e.policy.compute is not None and e.policy.compute != bf16 and not e.container]


def accelerate_refusal(given: Subject) -> str | None:
    """Why `adapters.fp8.ao_recipe_kwargs` refuses this plan, or None: the same rules it
    raises by."""
    islands = unapplied_islands(given)
    if islands:
        return (f"ao_recipe_kwargs: the plan computes {listing(islands)} in another dtype than "
                "Accelerate's bf16 autocast, and Accelerate runs the whole forward under that "
                "autocast, so they would run in bf16 unless the plan is applied. Call "
                "precision_annot.apply(model, default='bf16-mixed') before accelerator.prepare("
                "model): apply converts the fp8 layers itself (the filter then leaves them "
                "alone) and its boundaries keep the islands in their dtype inside Accelerate's "
                "autocast.")
    given.require_facts("ao_recipe_kwargs", "which layers are Linear")
    try:
        one_gemm(fp8_gemms(given.plan), "ao_recipe_kwargs")
    except ValueError as e:
        return str(e)
    return None


def accelerate_findings(given: Subject) -> list[Finding]:
    """`check(..., config={"fp8": "accelerate"})`: a plan Accelerate's fp8 refuses at setup
    (`ao_recipe_kwargs` raises before `Accelerator` exists) is an error before launch."""
    refusal = accelerate_refusal(given)
    if refusal is None:
        return []
    islands = unapplied_islands(given)
    names = islands or list(fp8_gemms(given.plan))
    fix = ("precision_annot.apply(model, default='bf16-mixed') before "
           "fp8.ao_recipe_kwargs(model) and accelerator.prepare(model)" if islands else
           "Plan one fp8 recipe (not mxfp8) for every fp8 Linear, or let precision_annot.apply "
           "convert them (config={'fp8': 'apply'}).")
    return [Finding("error", "fp8-accelerate-refused", names[0] if names else "",
                    f"Accelerate's fp8 refuses this plan at setup: {refusal}", fix,
                    tuple(names))]
