"""What `check` says about a plan's fp8 GEMMs: layers fp8 kernels refuse, GEMMs too small to
gain, fp8 planned where no Linear converts it, and fp8 comm a backend cannot all-gather."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from precision_annot._src.dtypes import FP8, dtype_name
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

__all__ = ["fp8_findings", "too_small"]

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
    if not any(e.policy.gemm for e in plan.values()):
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
        if entry.policy.gemm is None or name in gemms or entry.has("embedding"):
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
