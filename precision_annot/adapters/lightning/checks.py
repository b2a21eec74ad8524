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
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    StrategyRegistry,
)

from precision_annot._src.check_backend import CheckBackend, Checked
from precision_annot._src.findings import Finding, drift, drifts
from precision_annot._src.plan import PrecisionPlan
from precision_annot._src.policy import PRESETS
from precision_annot._src.runtime import Subject, applied_plan
from precision_annot.adapters import ddp, deepspeed, fsdp
from precision_annot.adapters.lightning.base import PlanPrecision
from precision_annot.adapters.lightning.fsdp import AnnotatedFSDPPrecision

__all__ = ["CHECKS", "LightningChecks", "findings", "reduced"]

_OURS = ("AnnotatedPrecision", "AnnotatedFSDPPrecision", "AnnotatedDeepSpeedPrecision",
         "FabricAnnotatedPrecision")
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
        # Lightning refuses CPU for the registered names, and its _setup_model passes FSDP1
        # device_id=None on CPU, which FSDP1 refuses: only a subclass that replaces it runs
        own: type = FSDPStrategy if issubclass(cls, FSDPStrategy) else FabricFSDP
        setup = getattr(cls, "_setup_model", None)
        return "fsdp", {"cuda_only": isinstance(strategy, str)
                        or setup is getattr(own, "_setup_model", None)}
    if issubclass(cls, (DDPStrategy, FabricDDP)):
        kwargs = getattr(strategy, "_ddp_kwargs", None) or {}
        return "ddp", {"hook": getattr(strategy, "_ddp_comm_hook", None),
                       "bucket_cap_mb": kwargs.get("bucket_cap_mb")}
    return "other", {}


def _is_ours(plugin: object) -> bool:
    return isinstance(plugin, PlanPrecision) or plugin in _OURS


def _config_keys() -> frozenset[str]:
    """The keyword arguments `Trainer` and `Fabric` take: what a config may hold."""
    from lightning.fabric import Fabric
    from lightning.pytorch import Trainer

    return frozenset(k for cls in (Trainer, Fabric)
                     for k in inspect.signature(cls.__init__).parameters if k != "self")


def _refuse_unknown(config: Mapping[str, Any], plugins: list[Any]) -> None:
    """A key neither Trainer nor Fabric takes, or a plugin named by a string that is not one
    of ours, is bad input, refused as Lightning refuses an unknown strategy name."""
    valid = _config_keys()
    for key in config:
        if key not in valid:
            close = difflib.get_close_matches(str(key), sorted(valid), n=3)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise ValueError(
                f"check: config for backend='lightning' has a key neither Trainer nor Fabric "
                f"takes.{hint} Received: {key!r}. Valid: {', '.join(sorted(valid))}")
    _refuse_bad_precision(config.get("precision"))
    for plugin in plugins:
        if isinstance(plugin, str) and plugin not in _OURS:
            close = difflib.get_close_matches(plugin, _OURS, n=2)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise ValueError(
                f"check: config 'plugins' names no precision plugin of this library.{hint} "
                f"Received: {plugin!r}. Valid names: {', '.join(map(repr, _OURS))}, or a "
                "plugin instance")


def _refuse_bad_precision(precision: Any) -> None:
    """A `precision=` Lightning itself refuses ("Precision 7 is invalid") is bad input here too.

    NOTE: Lightning's own check is its private `_convert_precision_to_unified_args` (the
    connector calls it first thing); asking it keeps the list of valid values Lightning's."""
    if precision is None:
        return
    from lightning.fabric.connector import _convert_precision_to_unified_args

    try:
        _convert_precision_to_unified_args(precision)
    except ValueError as e:
        raise ValueError(f"check: config 'precision' is one Lightning refuses: {e}") from e


def _strategy_precision(strategy: object) -> Any:
    """The precision plugin set on a strategy instance (the Trainer's `precision_plugin`,
    Fabric's `precision`), or None where none was set: both then hand a new default
    `Precision()`, which is Lightning's choice, not the user's."""
    from lightning.fabric.plugins.precision import Precision as FabricPrecision
    from lightning.fabric.strategies.strategy import Strategy as FabricStrategy
    from lightning.pytorch.plugins.precision import Precision as TrainerPrecision
    from lightning.pytorch.strategies import Strategy as TrainerStrategy

    if isinstance(strategy, TrainerStrategy):
        plugin: Any = strategy.precision_plugin
    elif isinstance(strategy, FabricStrategy):
        plugin = strategy.precision
    else:
        return None
    return None if type(plugin) in (TrainerPrecision, FabricPrecision) else plugin


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


def _cuda_only(strategy: str, cpu: str, why: str, fix: str) -> Finding:
    return Finding("error", "lightning-cuda-only", "",
                   f"Lightning's {strategy} cannot start here ({cpu}): {why}.",
                   f"Run it on GPUs; on CPU, {fix}")


def _no_plugin(plan: PrecisionPlan, config: Mapping[str, Any], plugins: list[Any],
               applied: bool) -> list[Finding]:
    """No plugin of ours: Lightning's own precision runs. An applied plan still runs under a
    "32-true" or "-mixed" precision (its boundaries set their own autocast); a "-true" preset
    casts the whole model in convert_module; an unapplied plan is dropped for the preset's
    dtypes. Each module's planned dtypes are compared with what the preset gives it."""
    precision = config.get("precision")
    preset = str(precision) if precision is not None else "32-true"
    runs = _what_runs(precision, plugins)
    fix = (f"Trainer(plugins=[AnnotatedPrecision(default={preset!r})]), without precision=.")
    policy = PRESETS.get(preset)
    if policy is None:  # another plugin: what it does is its own
        return [Finding("error", "lightning-no-plugin", "",
                        f"No AnnotatedPrecision plugin is given, so Lightning runs {runs} for "
                        "the whole model and the plan's per-module dtypes are not applied.",
                        fix)]
    holders = [n for n, e in plan.items() if e.params and not e.container]
    true_preset = policy.storage == policy.compute and preset != "32-true"
    if applied and not true_preset:
        return []
    cause = (f"Lightning runs {runs}: it casts every parameter in convert_module" if applied
             else f"no AnnotatedPrecision plugin is given and the model has no plan applied, so "
                  f"Lightning runs {runs} for the whole model")
    fields = ["storage"] if applied else ["storage", "compute"]
    return drifts(plan, {f: {n: getattr(policy, f) for n in holders if getattr(policy, f)}
                         for f in fields},
                  code="lightning-no-plugin", backend="Lightning", cause=cause, fix=fix)


def _what_runs(precision: Any, plugins: list[Any]) -> str:
    """The precision Lightning runs without ours: another plugin, the preset, or its
    default."""
    others = [type(p).__name__ for p in plugins if _is_precision(p)]
    if others:
        return f"the {others[0]} plugin"
    return f"precision={precision!r}" if precision is not None else "its default '32-true'"


def _both_precisions(config: Mapping[str, Any], plugins: list[Any],
                     strategy_plugin: Any) -> list[Finding]:
    precision = config.get("precision")
    if precision is None and not (strategy_plugin is not None and
                                  any(_is_precision(p) for p in plugins)):
        return []
    given = (f"precision={precision!r}" if precision is not None
             else "a precision plugin on the strategy")
    return [Finding(
        "error", "lightning-precision", "",
        f"{given} and a precision plugin are both given; Lightning refuses to start "
        "(\"Received both precision= and plugins=\").",
        "Drop it and pass its value to the plugin: "
        f"AnnotatedPrecision(default={precision or 'bf16-mixed'!r}).",
    )]


def _fsdp(plan: PrecisionPlan, ours: list[Any], settings: dict[str, Any],
          cpu: str | None) -> list[Finding]:
    out = []
    if not any(isinstance(p, AnnotatedFSDPPrecision) or p == "AnnotatedFSDPPrecision"
               for p in ours):
        out.append(Finding(
            "error", "lightning-strategy", "",
            "FSDPStrategy takes only an FSDPPrecision plugin; Lightning raises a TypeError for "
            "AnnotatedPrecision.",
            "Trainer(strategy=FSDPStrategy(...), plugins=[AnnotatedFSDPPrecision(...)]) (with "
            "Fabric, shard through precision_annot.adapters.fsdp instead).",
        ))
    if cpu and settings["cuda_only"]:
        out.append(_cuda_only(
            "FSDPStrategy", cpu, "it passes device_id=None to FSDP1 on CPU, which FSDP1 "
            "refuses, and its registered names refuse CPU outright",
            "wrap with FSDP yourself: FullyShardedDataParallel(model, auto_wrap_policy="
            "fsdp.wrap_policy(plan), mixed_precision=fsdp.mixed_precision(plan), "
            "device_id=torch.device('cpu')), or a FSDPStrategy subclass whose _setup_model "
            "passes device_id=torch.device('cpu').",
        ))
    return out + fsdp.findings(plan, "fsdp1")


def _deepspeed(plan: PrecisionPlan, ours: list[Any], settings: dict[str, Any],
               cpu: str | None) -> list[Finding]:
    out = []
    if cpu and settings["cuda_only"]:
        out.append(_cuda_only(
            "DeepSpeedStrategy", cpu, "its setup_environment requires a CUDA accelerator",
            "call deepspeed.initialize yourself, with precision_annot.adapters.deepspeed."
            "prepare(model) and to_config(model, base): DeepSpeed itself runs on CPU."))
    return out + deepspeed.findings(plan, settings["config"])


def _ddp(plan: PrecisionPlan, ours: list[Any], settings: dict[str, Any],
         cpu: str | None) -> list[Finding]:
    hook = settings["hook"]
    if hook is None or not ddp.hooked_modules(plan):
        # the plugin registers the plan's hook itself, so only its buckets are left to say
        return [f for f in ddp.findings(plan, bucket_cap_mb=settings["bucket_cap_mb"])
                if f.code == "ddp-mixed-bucket"]
    out: list[Finding] = []  # the plan's hook is not registered: its buckets do not split
    name = getattr(hook, "__name__", hook)
    if cpu:  # Lightning drops the user's hook on CPU, and the plugin then registers none
        return out + drift(plan, "comm", _stored(plan), code="lightning-ddp-hook",
                           backend="Lightning's DDP",
                           cause=f"DDPStrategy(ddp_comm_hook={name}) is registered by Lightning "
                                 f"only on CUDA ({cpu}), and the plugin registers none beside "
                                 "it, so each gradient reduces in its parameter's dtype",
                           fix="Drop ddp_comm_hook; AnnotatedPrecision registers the plan's "
                               "comm hook.")
    out.append(Finding(
        "warning", "lightning-ddp-hook", "",
        f"DDPStrategy(ddp_comm_hook={name}) is given and replaces the plan's comm hook, so the "
        "plan's per-module comm holds only if that hook reduces as the plan says.",
        "Drop ddp_comm_hook; AnnotatedPrecision registers the plan's comm hook.",
    ))
    return out


def _stored(plan: PrecisionPlan) -> dict[str, torch.dtype]:
    """Each parameter-holding module's floating storage dtype."""
    return {n: e.stored for n, e in plan.items() if e.stored is not None}


def _processes(config: Mapping[str, Any]) -> int | None:
    """How many processes the Trainer starts with strategy "auto" (None: it depends on the
    machine)."""
    devices, nodes = config.get("devices", "auto"), config.get("num_nodes", 1)
    if isinstance(devices, (list, tuple)):
        count: int | None = len(devices)
    elif isinstance(devices, int) and devices > 0:
        count = devices
    elif isinstance(devices, str) and devices.strip().isdigit():
        count = int(devices)
    else:
        count = 1 if _on_cpu(config.get("accelerator", "auto")) and devices == "auto" else None
    return None if count is None or not isinstance(nodes, int) else count * nodes


def reduced(plan: PrecisionPlan, config: Mapping[str, Any] | None
            ) -> dict[str, torch.dtype] | None:
    """What Lightning reduces each parameter-holding module's gradients in, with these Trainer
    arguments; None where that is not known here (another comm hook on CUDA, a device count
    that depends on the machine), {} where nothing is reduced (one process).

    - DDP with a plugin of ours and no hook of the user's: the plan's comm (the plugin
      registers the plan's hook); otherwise each gradient in its parameter's dtype, as DDP
      does, since Lightning registers `ddp_comm_hook` only on CUDA.
    - FSDP: its units' reduce dtypes; DeepSpeed: what its engine reduces in with the config.
    """
    if config is None:
        return None
    plugins = config.get("plugins") or []
    plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    strategy = config.get("strategy", "auto")
    kind, settings = _strategy_kind(strategy)
    ours = [p for p in [*plugins, _strategy_precision(strategy)] if _is_ours(p)]
    if kind != "ddp":
        return _reduced_elsewhere(plan, kind, settings, config)
    stored = _stored(plan)
    if ours and settings["hook"] is None:
        return {n: plan[n].policy.grad_comm or d for n, d in stored.items()}
    if settings["hook"] is not None and not _on_cpu(config.get("accelerator", "auto")):
        return None  # the user's hook runs, and its dtypes are its own
    return stored


def _reduced_elsewhere(plan: PrecisionPlan, kind: str, settings: dict[str, Any],
                       config: Mapping[str, Any]) -> dict[str, torch.dtype] | None:
    """`reduced` for a strategy other than DDP: FSDP's units, DeepSpeed's engine, or one
    process (nothing reduced; None when the device count is not known here)."""
    if kind == "fsdp":
        return fsdp.reduced(plan, fsdp.unit_names(plan), fsdp1=True)  # Lightning wraps FSDP1
    if kind == "deepspeed":
        dsp = deepspeed.translate(plan, warn=False)
        found, stage = deepspeed.given_config(dsp, settings["config"])
        return deepspeed.reduced(dsp, found, stage)
    processes = _processes(config) if config.get("strategy", "auto") == "auto" else None
    return None if processes is None or processes > 1 else {}


_STRATEGY_CHECKS: dict[str, Callable[[PrecisionPlan, list[Any], dict[str, Any], str | None],
                                     list[Finding]]] = {
    "fsdp": _fsdp, "deepspeed": _deepspeed, "ddp": _ddp,
}


def findings(plan: PrecisionPlan, config: Mapping[str, Any] | None, *,
             applied: bool = False) -> list[Finding]:
    """What Lightning will refuse, drop or skip for `plan` given the Trainer's arguments;
    `applied` says the model it is given already has the plan applied."""
    if config is None:
        return []
    if not isinstance(config, Mapping):
        raise TypeError(
            "check: config for backend='lightning' is a dict of the Trainer's keyword "
            f"arguments, e.g. {{'strategy': 'ddp', 'accelerator': 'cpu'}}. Received: {config!r}"
        )
    plugins = config.get("plugins") or []
    plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    _refuse_unknown(config, plugins)
    strategy = config.get("strategy", "auto")
    strategy_plugin = _strategy_precision(strategy)
    kind, settings = _strategy_kind(strategy)  # first: a misspelled name is bad input
    ours = [p for p in [*plugins, strategy_plugin] if _is_ours(p)]
    if not ours:
        return _no_plugin(plan, config, plugins, applied)
    out = _both_precisions(config, plugins, strategy_plugin)
    check = _STRATEGY_CHECKS.get(kind)
    if check is not None:
        out += check(plan, ours, settings, _on_cpu(config.get("accelerator", "auto")))
    return out


class LightningChecks(CheckBackend):
    """`check(..., "lightning", config)`: the config is the keyword arguments `Trainer` (or
    `Fabric`) will get; the strategy's own backend is asked for the strategy chosen."""

    name = "lightning"
    keys = None

    def options(self, config: Any) -> Any:
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(
                "check: config for backend='lightning' is a dict of the Trainer's keyword "
                f"arguments, e.g. {{'strategy': 'ddp', 'accelerator': 'cpu'}}. Received: "
                f"{config!r}")
        return config

    def run(self, given: Subject, options: Any) -> Checked:
        applied = given.model is not None and applied_plan(given.model) is not None
        return Checked(findings(given.plan, options, applied=applied),
                       reduced(given.plan, options))


CHECKS = LightningChecks()
