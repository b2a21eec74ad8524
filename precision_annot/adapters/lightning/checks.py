"""What Lightning will refuse, drop or skip for a plan, read from the Trainer's arguments.

`findings(plan, config)` takes the keyword arguments you will give `Trainer` (or `Fabric`):
`precision`, `plugins`, `strategy` and `accelerator` are read, the rest ignored. Strategies are
read as Lightning reads them, by instance or by registered name ("ddp", "deepspeed_stage_3",
"fsdp", ...), and the backend's own findings (DeepSpeed's config, FSDP's units, DDP's buckets)
are added for the strategy chosen.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    StrategyRegistry,
)

from precision_annot.adapters.lightning.base import PlanPrecision
from precision_annot.adapters.lightning.fsdp import AnnotatedFSDPPrecision
from precision_annot.findings import Finding
from precision_annot.plan import PrecisionPlan

__all__ = ["findings"]

_OURS = ("AnnotatedPrecision", "AnnotatedFSDPPrecision", "FabricAnnotatedPrecision")
# the name the Trainer takes that is not a registered strategy
_LIGHTNING_NAMES = frozenset({"auto"})


def _strategy_kind(strategy: object) -> tuple[str, dict[str, Any]]:
    """("ddp" | "deepspeed" | "fsdp" | "other", the strategy's settings we read), for a
    strategy instance (Trainer's or Fabric's) or a name in the Trainer's registry."""
    from lightning.fabric.strategies.ddp import DDPStrategy as FabricDDP
    from lightning.fabric.strategies.deepspeed import DeepSpeedStrategy as FabricDeepSpeed
    from lightning.fabric.strategies.fsdp import FSDPStrategy as FabricFSDP

    if isinstance(strategy, str):
        # the registry's own get() builds the strategy; dict.get reads its entry
        entry = dict.get(StrategyRegistry, strategy)
        if entry is None:
            if strategy in _LIGHTNING_NAMES:  # Lightning's own, not in the registry
                return "other", {}
            names = sorted(set(StrategyRegistry) | _LIGHTNING_NAMES)
            close = difflib.get_close_matches(strategy, names, n=3)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise ValueError(
                f"check: config 'strategy' names no Lightning strategy.{hint} Received: "
                f"strategy={strategy!r}. Valid: a Strategy instance or one of "
                f"{', '.join(repr(n) for n in names)}")
        cls, params = entry["strategy"], dict(entry["init_params"])
    else:
        cls, params = type(strategy), {}
    if issubclass(cls, (DeepSpeedStrategy, FabricDeepSpeed)):
        # Lightning refuses CPU in setup_environment, which a subclass may replace
        base = DeepSpeedStrategy if issubclass(cls, DeepSpeedStrategy) else FabricDeepSpeed
        cuda_only = cls.setup_environment is base.setup_environment
        if isinstance(strategy, (DeepSpeedStrategy, FabricDeepSpeed)):
            return "deepspeed", {"config": strategy.config, "cuda_only": cuda_only}
        stage = params.get("stage", inspect.signature(cls).parameters["stage"].default)
        return "deepspeed", {"config": {"zero_optimization": {"stage": stage}},
                             "cuda_only": cuda_only}
    if issubclass(cls, (FSDPStrategy, FabricFSDP)):
        # Lightning refuses CPU for the registered names and the exact class, not subclasses
        return "fsdp", {"cuda_only": isinstance(strategy, str) or cls is FSDPStrategy}
    if issubclass(cls, (DDPStrategy, FabricDDP)):
        kwargs = getattr(strategy, "_ddp_kwargs", None) or {}
        return "ddp", {"hook": getattr(strategy, "_ddp_comm_hook", None),
                       "bucket_cap_mb": kwargs.get("bucket_cap_mb")}
    return "other", {}


def _is_ours(plugin: object) -> bool:
    return isinstance(plugin, PlanPrecision) or plugin in _OURS


def _is_precision(plugin: object) -> bool:
    """A precision plugin of any kind, Lightning's or ours."""
    from lightning.fabric.plugins.precision import Precision as FabricPrecision
    from lightning.pytorch.plugins.precision import Precision as TrainerPrecision

    return _is_ours(plugin) or isinstance(plugin, (TrainerPrecision, FabricPrecision))


def _on_cpu(accelerator: object) -> str | None:
    """Why this run is on CPU ("accelerator='cpu'" or "no CUDA device here"), or None."""
    if accelerator == "cpu" or type(accelerator).__name__ == "CPUAccelerator":
        return "accelerator='cpu'"
    if accelerator in (None, "auto") and not torch.cuda.is_available():
        return "accelerator='auto' and no CUDA device here"
    return None


def _cuda_only(strategy: str, cpu: str, fix: str) -> Finding:
    return Finding("error", "lightning-cuda-only", "",
                   f"Lightning's {strategy} runs only on CUDA GPUs ({cpu}), and refuses to start.",
                   f"Run it on GPUs; on CPU, {fix}")


def findings(plan: PrecisionPlan, config: Mapping[str, Any] | None) -> list[Finding]:
    """What Lightning will refuse, drop or skip for `plan` given the Trainer's arguments."""
    if config is None:
        return []
    if not isinstance(config, Mapping):
        raise TypeError(
            "check: config for backend='lightning' is a dict of the Trainer's keyword "
            f"arguments, e.g. {{'strategy': 'ddp', 'accelerator': 'cpu'}}. Received: {config!r}"
        )
    plugins = config.get("plugins") or []
    plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    strategy = config.get("strategy", "auto")
    precision = config.get("precision")
    strategy_plugin = getattr(strategy, "_precision_plugin", None)
    kind, settings = _strategy_kind(strategy)  # first: a misspelled name is bad input
    ours = [p for p in [*plugins, strategy_plugin] if _is_ours(p)]
    out: list[Finding] = []
    if not ours:
        others = [type(p).__name__ for p in plugins if _is_precision(p)]
        runs = (f"the {others[0]} plugin" if others else
                f"precision={precision!r}" if precision is not None else "its default '32-true'")
        out.append(Finding(
            "error", "lightning-no-plugin", "",
            f"No AnnotatedPrecision plugin is given, so Lightning runs {runs} for the whole "
            "model and the plan is not applied.",
            f"Trainer(plugins=[AnnotatedPrecision(default={precision or '32-true'!r})]), "
            "without precision=.",
        ))
        return out
    if precision is not None or (strategy_plugin is not None and any(_is_precision(p)
                                                                     for p in plugins)):
        given = (f"precision={precision!r}" if precision is not None
                 else "a precision plugin on the strategy")
        out.append(Finding(
            "error", "lightning-precision", "",
            f"{given} and a precision plugin are both given; Lightning refuses to start "
            "(\"Received both precision= and plugins=\").",
            "Drop it and pass its value to the plugin: "
            f"AnnotatedPrecision(default={precision or 'bf16-mixed'!r}).",
        ))
    cpu = _on_cpu(config.get("accelerator", "auto"))
    if kind == "fsdp" and not any(isinstance(p, AnnotatedFSDPPrecision)
                                  or p == "AnnotatedFSDPPrecision" for p in ours):
        out.append(Finding(
            "error", "lightning-strategy", "",
            "FSDPStrategy takes only an FSDPPrecision plugin; Lightning raises a TypeError for "
            "AnnotatedPrecision.",
            "Use AnnotatedFSDPPrecision with the Trainer's FSDPStrategy (with Fabric, shard "
            "through precision_annot.adapters.fsdp instead).",
        ))
    if kind == "fsdp":
        from precision_annot.adapters import fsdp

        if cpu and settings["cuda_only"]:
            out.append(_cuda_only("FSDPStrategy", cpu,
                                  "wrap with FSDP yourself, with precision_annot.adapters.fsdp."
                                  "wrap_policy(plan) and mixed_precision(plan): FSDP itself "
                                  "runs on CPU with gloo."))
        out += fsdp.findings(plan, "fsdp1")
    if kind == "deepspeed":
        from precision_annot.adapters import deepspeed

        if cpu and settings["cuda_only"]:
            out.append(_cuda_only("DeepSpeedStrategy", cpu,
                                  "call deepspeed.initialize yourself, with "
                                  "precision_annot.adapters.deepspeed.prepare(model) and "
                                  "to_config(model, base): DeepSpeed itself runs on CPU."))
        out += deepspeed.findings(plan, settings["config"])
    if kind == "ddp":
        from precision_annot.adapters import ddp

        # the plugin registers the plan's hook itself, so only the buckets are left to say
        out += [f for f in ddp.findings(plan, bucket_cap_mb=settings["bucket_cap_mb"])
                if f.code == "ddp-mixed-bucket"]
        hook = settings["hook"]
        if hook is not None and ddp.hooked_modules(plan):
            where = (f"on CPU ({cpu}) Lightning does not register it, and the plugin then "
                     "registers none, so gradients reduce in the parameter dtype" if cpu else
                     "it replaces the plan's hook")
            out.append(Finding(
                "error" if cpu else "warning", "lightning-ddp-hook", "",
                f"DDPStrategy(ddp_comm_hook={getattr(hook, '__name__', hook)}) is given and "
                f"the plan reduces some gradients in another dtype than they are stored in: "
                f"{where}.",
                "Drop ddp_comm_hook; AnnotatedPrecision registers the plan's comm hook.",
            ))
    if cpu and kind not in ("deepspeed", "fsdp"):
        out.append(Finding(
            "info", "lightning-cpu", "",
            f"This run is on CPU ({cpu}), where Lightning skips its CUDA-only paths: it "
            "registers DDPStrategy(ddp_comm_hook=...) only on CUDA and refuses DeepSpeedStrategy "
            "and FSDPStrategy; AnnotatedPrecision registers the plan's DDP comm hook itself.",
            "Nothing to change for this strategy; test DeepSpeed and FSDP on CPU through their "
            "adapters directly.",
        ))
    return out
