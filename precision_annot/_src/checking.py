"""`check`: before launch, what a backend will refuse, narrow, widen or run badly for a plan.

Each adapter says what its backend will do with the plan (`adapters.deepspeed.findings`,
`adapters.fsdp.findings`, `adapters.ddp.findings`, `adapters.lightning.checks.findings`), worked
out by the same code that exports the plan, and, where it knows, the dtype it will reduce each
module's gradients in; the numerics that hold for every backend come from `findings.numerics`.
Adapters are imported only for the backend asked about: one function per backend, in a table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from precision_annot._src.dtypes import STOCHASTIC
from precision_annot._src.findings import SEVERITIES, Finding, listing, numerics
from precision_annot._src.float8_checks import fp8_findings
from precision_annot._src.plan import PrecisionPlan
from precision_annot._src.policy import UPDATE_FIELDS
from precision_annot._src.runtime import applied_plan, subject

__all__ = ["BACKENDS", "check"]

BACKENDS = ("local", "deepspeed", "fsdp", "fsdp1", "ddp", "lightning", "tp")

#: the keys `config` may hold, per backend (DeepSpeed takes its whole config, Lightning the
#: Trainer's keyword arguments); `grad_scaler: True` says the training loop scales the loss
_CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "local": ("grad_scaler", "optimizer"),
    "fsdp": ("units", "merge_below", "latency_s", "bandwidth", "grad_scaler", "optimizer"),
    "fsdp1": ("merge_below", "latency_s", "bandwidth", "use_orig_params", "grad_scaler",
              "optimizer"),
    "ddp": ("bucket_cap_mb", "grad_scaler", "optimizer"),
    "tp": ("parallelize_plan", "tp_degree", "grad_scaler", "optimizer"),
}

Comm = dict[str, torch.dtype] | None
Checked = tuple[list[Finding], Comm, Comm]  # findings; what is reduced in and stored in
Checker = Callable[[PrecisionPlan, nn.Module | None, nn.Module | None, Any], Checked]


def _config_for(backend: str | None, config: Any) -> Any:
    if config is None or backend in ("deepspeed", "lightning"):
        return config
    if backend not in _CONFIG_KEYS:
        raise ValueError(
            f"check: backend={backend!r} takes no config. Received: config={config!r}; "
            "config applies to backend='deepspeed' (its config, a dict or a file), 'fsdp', "
            "'fsdp1', 'ddp', 'local' and 'lightning' (the Trainer's keyword arguments)."
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


def _local(plan: PrecisionPlan, model: nn.Module | None, wrapped: nn.Module | None,
           options: Any) -> Checked:
    return [], None, None


def _deepspeed(plan: PrecisionPlan, model: nn.Module | None, wrapped: nn.Module | None,
               options: Any) -> Checked:
    from precision_annot.adapters import deepspeed  # deferred: only the backend asked about

    found = deepspeed.findings(plan, options)
    if deepspeed.refused(found):
        return found, None, None  # it does not start: nothing is reduced
    dsp = deepspeed.translate(plan, warn=False)
    config, stage = deepspeed.given_config(dsp, options)
    stored = {n: e.policy.storage for n, e in dsp.plan.items() if e.policy.storage is not None}
    return found, deepspeed.reduced(dsp, config, stage), stored


def _fsdp(backend: str) -> Checker:
    def run(plan: PrecisionPlan, model: nn.Module | None, wrapped: nn.Module | None,
            options: Any) -> Checked:
        from precision_annot.adapters import fsdp  # deferred: only the backend asked about

        options = {k: v for k, v in (options or {}).items()
                   if k not in ("grad_scaler", "optimizer")}
        if "units" in options and model is None:
            raise ValueError("check: config 'units' selects modules, so it needs the model, and "
                             "this plan holds none (it was loaded from JSON, or its model is "
                             "gone); pass the model instead of its plan.")
        found = fsdp.findings(plan, backend, model=model, **options)
        live = fsdp.sharded_units(plan, model) if model is not None else None
        if live is not None:
            return found, fsdp.reduced(plan, [u.name for u in live]), None
        names = fsdp.unit_names(plan, model, options.get("units"),
                                merge_below=options.get("merge_below"))
        return found, fsdp.reduced(plan, names), None

    return run


def _ddp(plan: PrecisionPlan, model: nn.Module | None, wrapped: nn.Module | None,
         options: Any) -> Checked:
    from precision_annot.adapters import ddp  # deferred: only the backend asked about

    options = {k: v for k, v in (options or {}).items() if k not in ("grad_scaler", "optimizer")}
    ddp_model = wrapped if isinstance(wrapped, nn.parallel.DistributedDataParallel) else None
    return ddp.findings(plan, ddp_model, **options), ddp.reduced(plan, ddp_model)[0], None


def _lightning(plan: PrecisionPlan, model: nn.Module | None, wrapped: nn.Module | None,
               options: Any) -> Checked:
    # deferred: Lightning is an optional extra, imported only when it is the backend asked about
    from precision_annot.adapters.lightning.checks import findings, reduced

    return (findings(plan, options, applied=model is not None and _applied(model)),
            reduced(plan, options), None)


def _tp(plan: PrecisionPlan, model: nn.Module | None, wrapped: nn.Module | None,
        options: Any) -> Checked:
    from precision_annot.adapters.tp.checks import findings  # deferred: backend asked about

    options = {k: v for k, v in (options or {}).items() if k not in ("grad_scaler", "optimizer")}
    return findings(plan, model, options), None, None


def _applied(model: nn.Module) -> bool:
    return applied_plan(model) is not None


def _optimizer(plan: PrecisionPlan, optimizer: Any) -> list[Finding]:
    """An optimizer that steps the parameters themselves, for a plan that keeps masters,
    gradient buffers or other state dtypes for them: that update half is dropped (its first
    step is refused by the step guard `apply` installs)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("check: config 'optimizer' is the optimizer you will step. Received: "
                        f"{optimizer!r} (of type {type(optimizer).__name__})")
    if getattr(optimizer, "_precision_annot_updates", False):
        return []
    planned = [n for n, e in plan.items() if e.params and any(
        getattr(e.policy, f) is not None for f in UPDATE_FIELDS) and (
            e.policy.copies_master or e.policy.accumulates or e.policy.optim is not None
            or e.policy.master == STOCHASTIC)]
    if not planned:
        return []
    first = plan[planned[0]].policy
    return [Finding(
        "error", "optimizer-ignores-update", planned[0],
        f"{type(optimizer).__name__} steps the parameters themselves, and the plan keeps "
        f"{', '.join(f'{f}={first.show(f)}' for f in UPDATE_FIELDS if getattr(first, f))} "
        f"for {listing(planned)}: that update half is dropped (with master=fp32 over bf16, "
        "updates below 2^-8 of a weight round away). Its first step() is refused.",
        f"precision_annot.optimizer(model, torch.optim.{type(optimizer).__name__}, lr=...)",
        tuple(planned))]


_CHECKS: dict[str, Checker] = {
    "local": _local,
    "deepspeed": _deepspeed,
    "fsdp": _fsdp("fsdp"),
    "fsdp1": _fsdp("fsdp1"),
    "ddp": _ddp,
    "lightning": _lightning,
    "tp": _tp,
}


def check(model_or_plan: nn.Module | PrecisionPlan, backend: str | None = None,
          config: Any = None) -> list[Finding]:
    """What `backend` will refuse, narrow, widen or run badly for this plan, found before launch.

    Severity means one thing for every backend: an error is a run refused, a dtype silently
    narrowed, an update lost or a tie broken; a warning is a run that goes but worse than
    planned (silently widened, more bytes, or a measured numeric loss); an info is a cost.

    Args:
        model_or_plan: a model (the plan `apply` made real on it, else its annotations
            resolved here; wrappers are seen through, and a `DistributedDataParallel` model's
            comm hook is checked under backend="ddp") or a `PrecisionPlan` (resolve it with
            the defaults you will train with, e.g. `resolve(model, "bf16-mixed")`).
        backend: one of "local", "deepspeed", "fsdp" (FSDP2), "fsdp1", "ddp", "lightning",
            "tp" (tensor parallel); None checks only what holds for every backend.
            (Default: None)
        config: what the backend will be given. DeepSpeed: the config it will get, as it is (a
            dict, or a JSON or hjson file; None: what `to_config(plan)` exports), with
            `prepare(model)` called before `initialize`.
            Lightning: the Trainer's keyword arguments (`precision`, `plugins`, `strategy`,
            `accelerator`). Local, DDP and FSDP: `optimizer`, the optimizer you will step
            (one that ignores the plan's masters or states is an error). FSDP: `units`
            (FSDP2, with a model) and `merge_below` as
            `fully_shard` takes them, the cost model's `latency_s` and `bandwidth`, and for
            FSDP1 `use_orig_params`. DDP: `bucket_cap_mb`. TP: `parallelize_plan` (as
            `adapters.tp.parallelize_module` takes it) and `tp_degree`. Local, DDP and FSDP:
            `grad_scaler=True` when the training loop scales the loss. (Default: None)

    Returns:
        The findings, errors first, then warnings, then infos. Each has a severity, a stable
        code (docs/check.md lists them), the modules it concerns, a message saying what happens
        if it is left so, and a fix.

    Raises:
        ValueError: for an unknown backend, a config key the backend does not read, or a
            DeepSpeed config DeepSpeed could not read at all.
        TypeError: when `model_or_plan` is neither a module nor a plan.

    Example:
        >>> from torch import nn
        >>> from precision_annot import check, resolve
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        >>> for finding in check(resolve(model, "bf16-true")):
        ...     print(finding.severity, finding.code)
        warning low-storage
        >>> check(resolve(model, "bf16-mixed"), "deepspeed", {"zero_optimization": {"stage": 2}})
        []
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"check: backend must be None or one of {list(BACKENDS)}. "
                         f"Received: backend={backend!r}")
    options = _config_for(backend, config)
    given = subject(model_or_plan, "check")
    given.require_facts("check", "a plan")
    plan, model, wrapped = given.plan, given.model, given.wrapped
    found, comm, stored = _CHECKS[backend](plan, model, wrapped, options) if (
        backend) else ([], None, None)
    scaled = bool(isinstance(options, Mapping) and options.get("grad_scaler"))
    found = numerics(plan, backend, comm=comm, stored=stored, scaled=scaled) + found
    if isinstance(options, Mapping) and options.get("optimizer") is not None:
        found += _optimizer(plan, options["optimizer"])
    found += fp8_findings(plan, backend)
    return sorted(found, key=lambda f: SEVERITIES.index(f.severity))


