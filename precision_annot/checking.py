"""`check`: before launch, what a backend will ignore, refuse or run badly for a plan.

The numerics that hold for every backend come from `findings.numerics`; each adapter adds what
its own backend does with the plan (`adapters.deepspeed.findings`, `adapters.fsdp.findings`,
`adapters.ddp.findings`, `adapters.lightning.checks.findings`), worked out by the same code
that exports the plan, so a finding and the export cannot disagree. Adapters are imported
only for the backend asked about.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from precision_annot.findings import SEVERITIES, Finding, numerics
from precision_annot.plan import PrecisionPlan
from precision_annot.runtime import plan_of
from precision_annot.wrappers import unwrap

__all__ = ["BACKENDS", "check"]

BACKENDS = ("local", "deepspeed", "fsdp", "fsdp1", "ddp", "lightning")

#: the keys `config` may hold, per backend (DeepSpeed takes its whole config, Lightning the
#: Trainer's keyword arguments)
_CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "fsdp": ("units", "merge_below", "latency_s", "bandwidth"),
    "fsdp1": ("merge_below", "latency_s", "bandwidth"),
    "ddp": ("bucket_cap_mb",),
}


def _config_for(backend: str | None, config: Any) -> Any:
    if config is None or backend in ("deepspeed", "lightning"):
        return config
    if backend not in _CONFIG_KEYS:
        raise ValueError(
            f"check: backend={backend!r} takes no config. Received: config={config!r}; "
            "config applies to backend='deepspeed' (its config, a dict or a file), 'fsdp', "
            "'fsdp1', 'ddp' and 'lightning' (the Trainer's keyword arguments)."
        )
    valid = _CONFIG_KEYS[backend]
    if not isinstance(config, Mapping):
        raise TypeError(f"check: config for backend={backend!r} is a dict with keys "
                        f"{list(valid)}. Received: {config!r}")
    unknown = sorted(set(config) - set(valid))
    if unknown:
        raise ValueError(f"check: config for backend={backend!r} has unknown key "
                         f"{unknown[0]!r}; valid: {list(valid)}.")
    return dict(config)


def check(model_or_plan: nn.Module | PrecisionPlan, backend: str | None = None,
          config: Any = None) -> list[Finding]:
    """What `backend` will ignore, refuse or run badly for this plan, found before launch.

    Args:
        model_or_plan: a model (the plan `apply` made real on it, else its annotations
            resolved here; a `DistributedDataParallel` model is unwrapped, and under
            backend="ddp" its comm hook is checked) or a `PrecisionPlan` (resolve it with the
            defaults you will train with, e.g. `resolve(model, "bf16-mixed")`).
        backend: one of "local", "deepspeed", "fsdp" (FSDP2), "fsdp1", "ddp", "lightning";
            None checks only what holds for every backend. (Default: None)
        config: what the backend will be given. DeepSpeed: your config (a dict, or a JSON or
            hjson file). Lightning: the Trainer's keyword arguments (`precision`, `plugins`,
            `strategy`, `accelerator`). FSDP: `units` (FSDP2, with a model) and `merge_below` as
            `fully_shard` takes them, and the cost model's `latency_s` and `bandwidth`. DDP:
            `bucket_cap_mb`. (Default: None)

    Returns:
        The findings, errors first, then warnings, then infos. Each has a severity, a stable
        code, the module it concerns ("" for the whole model), a one-sentence message and a fix.

    Raises:
        ValueError: for an unknown backend, or a config key the backend does not read.
        TypeError: when `model_or_plan` is neither a module nor a plan.

    Example:
        >>> from torch import nn
        >>> from precision_annot import check, resolve
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        >>> for finding in check(resolve(model, "bf16-true")):
        ...     print(finding.severity, finding.code)
        warning low-storage
        warning low-sensitive-op
        >>> check(resolve(model, "bf16-mixed"), "deepspeed", {"zero_optimization": {"stage": 2}})
        []
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"check: backend must be None or one of {list(BACKENDS)}. "
                         f"Received: backend={backend!r}")
    options = _config_for(backend, config)
    ddp_model = model = None
    if isinstance(model_or_plan, nn.parallel.DistributedDataParallel):
        ddp_model = model_or_plan
    if isinstance(model_or_plan, nn.Module):
        model = unwrap(model_or_plan)
        plan = plan_of(model)
    elif isinstance(model_or_plan, PrecisionPlan):
        plan = model_or_plan
        model = plan.module("") if plan.has_model else None  # resolved from a live model
    else:
        raise TypeError(
            "check: model_or_plan must be an nn.Module or a PrecisionPlan. "
            f"Received: {model_or_plan!r} (of type {type(model_or_plan).__name__})"
        )
    found = numerics(plan, backend)
    if backend == "deepspeed":
        from precision_annot.adapters import deepspeed

        found += deepspeed.findings(plan, options)
    elif backend in ("fsdp", "fsdp1"):
        from precision_annot.adapters import fsdp

        if options and "units" in options and model is None:
            raise ValueError("check: config 'units' selects modules, so it needs the model, and "
                             "this plan holds none (it was loaded from JSON, or its model is "
                             "gone); pass the model instead of its plan.")
        found += fsdp.findings(plan, backend, model=model, **(options or {}))
    elif backend == "ddp":
        from precision_annot.adapters import ddp

        found += ddp.findings(plan, ddp_model, **(options or {}))
    elif backend == "lightning":
        from precision_annot.adapters.lightning.checks import findings as lightning_findings

        found += lightning_findings(plan, options)
    return sorted(found, key=lambda f: SEVERITIES.index(f.severity))
