"""`check`: before launch, what a backend will refuse, narrow, widen or run badly for a plan.

Each backend is asked through one protocol (`check_backend.CheckBackend`: its option keys, and
`run`), worked out by the same code that exports the plan for it, and says, where it knows,
the dtype it will reduce each module's gradients in; the numerics that hold for every
training backend come from `findings.numerics`, the loop's optimizer from `_optimizer` here.
A backend's module is imported only when it is the one asked about.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from precision_annot._src.check_backend import BACKENDS, Checked, backend_for
from precision_annot._src.findings import SEVERITIES, Finding, listing, numerics
from precision_annot._src.float8_checks import accelerate_findings, fp8_findings
from precision_annot._src.plan import PrecisionPlan
from precision_annot._src.runtime import subject
from precision_annot._src.update.rule import module_rules

__all__ = ["BACKENDS", "check"]


def _optimizer(plan: PrecisionPlan, optimizer: Any) -> list[Finding]:
    """An optimizer that steps the parameters themselves, for a plan that keeps masters,
    gradient buffers or other state dtypes for them: that update half is dropped (its first
    step is refused by the step guard `apply` installs)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("check: config 'optimizer' is the optimizer you will step. Received: "
                        f"{optimizer!r} (of type {type(optimizer).__name__})")
    if getattr(optimizer, "_precision_annot_updates", False):
        return []
    rules = {n: [r for _, r in module_rules(e) if not r.plain] for n, e in plan.items()}
    planned = [n for n, found in rules.items() if found]
    if not planned:
        return []
    return [Finding(
        "error", "optimizer-ignores-update", planned[0],
        f"{type(optimizer).__name__} steps the parameters themselves, and the plan keeps "
        f"{rules[planned[0]][0].describe()} "
        f"for {listing(planned)}: that update half is dropped (with master=fp32 over bf16, "
        "updates below 2^-8 of a weight round away). Its first step() is refused.",
        f"precision_annot.optimizer(model, torch.optim.{type(optimizer).__name__}, lr=...)",
        tuple(planned))]


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
            "tp" (tensor parallel), or "checkpoint" (what loading a checkpoint would do to the
            plan); None checks only what holds for every backend. (Default: None)
        config: what the backend will be given. DeepSpeed: the config it will get, as it is (a
            dict, or a JSON or hjson file; None: what `to_config(plan)` exports), with
            `prepare(model)` called before `initialize`.
            Lightning: the Trainer's keyword arguments (`precision`, `plugins`, `strategy`,
            `accelerator`). Local, DDP and FSDP: `optimizer`, the optimizer you will step
            (one that ignores the plan's masters or states is an error), and `fp8`, who converts
            the fp8 layers: "apply" (the default) or "accelerate" (Accelerate's
            `AORecipeKwargs` from `adapters.fp8.ao_recipe_kwargs`). FSDP: `units`
            (FSDP2, with a model) and `merge_below` as
            `fully_shard` takes them, the cost model's `latency_s` and `bandwidth`, and for
            FSDP1 `use_orig_params`. DDP: `bucket_cap_mb`. TP: `parallelize_plan` (as
            `adapters.tp.parallelize_module` takes it) and `tp_degree`. Local, DDP and FSDP:
            `grad_scaler=True` when the training loop scales the loss. Checkpoint: `path`, a
            DCP directory, safetensors files (or their index) or a `torch.save` file, read
            without its tensor data. (Default: None)

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
    impl = backend_for(backend) if backend is not None else None
    if impl is None and config is not None:
        raise ValueError(f"check: backend=None takes no config. Received: config={config!r}; "
                         f"name the backend it is for, one of {list(BACKENDS)}.")
    options = impl.options(config) if impl is not None else None
    given = subject(model_or_plan, "check")
    given.require_facts("check", "a plan")
    plan = given.plan
    checked = impl.run(given, options) if impl is not None else Checked([])
    found = list(checked.findings)
    if impl is None or impl.trains:
        loop = impl.loop(options) if impl is not None else {}
        found = numerics(plan, backend, comm=checked.comm, stored=checked.stored,
                         scaled=bool(loop.get("grad_scaler"))) + found
        if loop.get("optimizer") is not None:
            found += _optimizer(plan, loop["optimizer"])
        found += fp8_findings(plan, backend)
        if loop.get("fp8") == "accelerate":
            found += accelerate_findings(given)
    return sorted(found, key=lambda f: SEVERITIES.index(f.severity))
