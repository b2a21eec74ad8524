"""DeepSpeed export: the precision sections of a config, and the model prepared for `initialize`.

DeepSpeed has two precision mechanisms. The `bf16` / `fp16` sections cast the whole module to
one dtype, so an fp32 layer inside is lost (DeepSpeed issue 2100; under ZeRO-2/3 a layer forced
back to fp32 crashes). The `torch_autocast` section keeps fp32 parameters, runs forward under
`torch.autocast`, reduces gradients per parameter in its `comm_dtype` attribute (ZeRO 1-3), and
uses a dynamic `GradScaler` for fp16. The mapping:

| plan | config |
|---|---|
| uniform bf16 storage, no wider compute | `bf16.enabled` |
| uniform fp16 storage, no wider compute | `fp16.enabled`, `loss_scale: 0` (dynamic) |
| fp32 storage, fp16/bf16 compute somewhere | `torch_autocast`: `dtype`, safe module classes |
| mixed storage (fp32 islands in a bf16 model) | fp32 storage + `torch_autocast`, with a warning |
| per-module comm | `comm_dtype` on each parameter, set by `prepare` |
| uniform comm under `bf16`/`fp16` | `communication_data_type` |
| buffers kept in fp32, under `bf16`/`fp16` | `data_types.keep_in_fp32_modules` (`buffers.py`) |

`translate(plan)` works out once what DeepSpeed can run; `to_config` and `prepare` share it.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import warnings
from collections.abc import Callable, Mapping
from os import PathLike
from pathlib import Path
from typing import Any, Literal, TypeAlias, Union

import torch
from torch import nn

from precision_annot._src.dtypes import (
    DTYPE_NAMES,
    LOW_PRECISION,
    SHORT,
    bf16,
    dtype_name,
    fp16,
    fp32,
    to_dtype,
    widest,
)
from precision_annot._src.findings import listing
from precision_annot._src.guards import require_module
from precision_annot._src.plan import PrecisionPlan
from precision_annot._src.policy import Policy
from precision_annot._src.runtime import apply, subject
from precision_annot._src.update.rule import fields_of, rule_for
from precision_annot._src.wrappers import unwrap
from precision_annot.adapters.deepspeed import buffers

__all__ = ["FP16_ZERO_FIX", "GRAD_ACCUM_WORDS", "PRECISION_SECTIONS", "ZERO0_MASTERS",
           "BaseConfig", "DeepSpeedPlan", "UpdateHalf", "buffer_dtypes", "config_dtype",
           "config_flag", "config_section", "deepspeed_release", "deepspeed_version",
           "fp16_zero_refusal", "keep_refusal", "keep_setting", "listed_modules", "load_base",
           "mixed_storage_message", "param_entries", "prepare", "reads_keep_in_fp32",
           "safe_classes", "section_dtype", "static_loss_scale", "to_config", "translate",
           "unimportable", "update_half", "zero_stage"]

BaseConfig: TypeAlias = Union[Mapping[str, Any], str, "PathLike[str]", None]
Case: TypeAlias = Literal["low_storage", "fp32", "autocast"]

_DS_DTYPES = frozenset({fp32, fp16, bf16})  # what DeepSpeed's precision keys take
# Strings DeepSpeed's pydantic config models read as booleans.
_TRUE = frozenset({"true", "t", "yes", "y", "on", "1"})
_FALSE = frozenset({"false", "f", "no", "n", "off", "0"})
PRECISION_SECTIONS = ("bf16", "fp16", "torch_autocast")


# -- the plan as DeepSpeed can run it -------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DeepSpeedPlan:
    """The plan DeepSpeed runs, from `translate`: pass it to `to_config` and `prepare`.

    Attributes:
        plan: the plan to apply; equal to the source plan unless storage was mixed.
        moved: modules whose low-precision storage became fp32 (mixed storage).
        extra_bytes: what that costs in parameter bytes.
        storages: the storage dtypes of the modules that hold parameters.
        low_compute: the fp16/bf16 compute dtypes used anywhere.
        comms: the comm dtypes of the modules that hold parameters (None: unset).
    """

    plan: PrecisionPlan
    moved: tuple[str, ...]
    extra_bytes: int
    storages: frozenset[torch.dtype]
    low_compute: frozenset[torch.dtype]
    comms: frozenset[torch.dtype | None]

    @property
    def case(self) -> Case:
        if self.storages and self.storages <= LOW_PRECISION:
            return "low_storage"
        return "autocast" if self.low_compute else "fp32"


def param_entries(plan: PrecisionPlan) -> list[str]:
    return [name for name, e in plan.items() if e.params > 0]


def translate(model_or_plan: nn.Module | PrecisionPlan | DeepSpeedPlan, *,
              warn: bool = True) -> DeepSpeedPlan:
    """The plan as DeepSpeed can run it. Mixed storage (fp32 islands in a bf16 model) becomes
    fp32 storage everywhere, with each module's compute kept through `torch_autocast`; that
    is said once, by a `UserWarning` naming the byte cost (`warn=False`: not said)."""
    if isinstance(model_or_plan, DeepSpeedPlan):
        return model_or_plan
    plan = subject(model_or_plan, "deepspeed").plan
    storages = {plan[n].policy.storage for n in param_entries(plan)}
    moved: dict[str, Policy] = {}
    extra = 0
    if len(storages - {None}) > 1 and storages & LOW_PRECISION:
        for name, entry in plan.items():
            p = entry.policy
            if p.storage in LOW_PRECISION:
                moved[name] = dataclasses.replace(p, compute=p.compute or p.storage,
                                                  storage=fp32)
        widened = plan.with_policies(moved)
        extra = sum(widened[n].param_bytes - plan[n].param_bytes for n in moved)
        if warn:
            warnings.warn(mixed_storage_message(storages, len(moved), extra), UserWarning,
                          stacklevel=3)
        plan = widened
    names = param_entries(plan)
    return DeepSpeedPlan(
        plan=plan,
        moved=tuple(moved),
        extra_bytes=extra,
        storages=frozenset(s for n in names if (s := plan[n].policy.storage) is not None),
        low_compute=frozenset(e.policy.compute for e in plan.values()
                              if e.policy.compute in LOW_PRECISION),
        comms=frozenset(plan[n].policy.grad_comm for n in names),
    )


def mixed_storage_message(storages: set[torch.dtype | None], moved: int, extra: int) -> str:
    kept = sorted({dtype_name(s) for s in storages if s is not None})
    return (f"The plan mixes storage dtypes ({', '.join(kept)}); DeepSpeed's bf16/fp16 modes "
            "cast every parameter to one dtype. Exporting fp32 storage for the "
            f"{moved} low-precision modules instead, with their compute kept low through "
            f"torch_autocast and the fp32 islands kept in fp32: {extra:,} more bytes of "
            "parameters.")


def _import_class(path: str) -> type | None:
    """The class DeepSpeed finds for `path` ("package.module.Class"): it splits the name at its
    last dot, imports the module and takes the attribute; None where that fails."""
    module_name, _, class_name = path.rpartition(".")
    if not module_name or "<" in path:
        return None
    try:
        found = getattr(importlib.import_module(module_name), class_name, None)
    except Exception:
        return None
    return found if isinstance(found, type) else None


def importable_class(path: str) -> str | None:
    """`path` ("package.module.Class") when DeepSpeed can import it back by `rsplit('.', 1)`,
    else None."""
    return path if _import_class(path) is not None else None


def unimportable(listed: list[str]) -> list[str]:
    """The names of `torch_autocast.lower_precision_safe_modules` DeepSpeed cannot import: it
    refuses to start with them ("Failed to import lower precision safe module")."""
    return [path for path in listed if _import_class(path) is None]


def listed_modules(plan: PrecisionPlan, listed: list[str]) -> set[str]:
    """The parameter-holding modules whose class `listed` names as DeepSpeed reads it: each
    name imported (`torch.nn.Linear` is `torch.nn.modules.linear.Linear`), then matched by
    exact class, never a subclass. A plan class that cannot be imported (defined in a
    function) matches no importable name."""
    classes = {c for c in map(_import_class, listed) if c is not None}
    names = param_entries(plan)
    found = {path: _import_class(path) for path in {plan[n].type for n in names}}
    return {name for name in names if found[plan[name].type] in classes}


def safe_classes(dsp: DeepSpeedPlan, dtype: torch.dtype) -> list[str] | None:
    """Classes whose every parameter-holding instance reduces in `dtype`, or None when the
    plan cannot be said by exact class (DeepSpeed matches `module.__class__`, not subclasses).
    Read from the plan's class paths, so a plan loaded from JSON gives the same answer."""
    plan = dsp.plan
    by_class: dict[str, set[torch.dtype | None]] = {}
    for name in param_entries(plan):
        by_class.setdefault(plan[name].type, set()).add(plan[name].policy.grad_comm)
    names = []
    for path, comms in by_class.items():
        if dtype in comms:
            if len(comms) > 1 or importable_class(path) is None:
                return None
            names.append(path)
    return sorted(names)


# -- reading the user's base as DeepSpeed reads it ------------------------------------------------

def load_base(base: BaseConfig) -> dict[str, Any]:
    if base is None:
        return {}
    if isinstance(base, Mapping):
        return copy.deepcopy(dict(base))
    if isinstance(base, (str, PathLike)):
        path = Path(base)
        if not path.is_file():
            raise ValueError(f"base must be a dict or a path to a JSON file; no file at {base!r}.")
        import hjson  # DeepSpeed reads its config files with hjson: comments are allowed

        try:
            data = hjson.loads(path.read_text())
        except Exception as e:
            raise ValueError(f"base config {str(path)!r} is not valid JSON or hjson: {e}") from e
        if not isinstance(data, Mapping):
            raise ValueError(f"base config {str(path)!r} must hold a JSON object.")
        return _plain(data)  # type: ignore[no-any-return]
    raise TypeError(
        "base must be a dict, a path to a JSON file, or None. "
        f"Received: base={base!r} (of type {type(base).__name__})"
    )


def _plain(value: Any) -> Any:
    """hjson's ordered dicts as plain dicts, recursively."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def config_section(config: dict[str, Any], key: str) -> dict[str, Any]:
    """A section of the base, `{}` when absent or null; anything else raises, naming it."""
    value = config.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"base config: {key!r} must be an object or null. Received: "
                         f"{key}={value!r}")
    return value


def config_flag(config: dict[str, Any], section: str, key: str = "enabled") -> bool | None:
    """A boolean of the base as DeepSpeed reads it; None when absent or "auto"."""
    value = config_section(config, section).get(key)
    if value is None or value == "auto":
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"base config: {section}.{key} must be a boolean or \"auto\". Received: "
                     f"{section}.{key}={value!r}")


def config_dtype(value: object, key: str) -> torch.dtype | None:
    """A dtype of the base; None when absent or "auto"."""
    if value is None or value == "auto":
        return None
    try:
        dtype = to_dtype(str(value), field=key)
    except ValueError:
        dtype = None
    if dtype not in _DS_DTYPES:
        valid = [n for n, d in DTYPE_NAMES.items() if d in _DS_DTYPES]
        raise ValueError(
            f"Unknown dtype in base config: {key}={value!r}. Valid: "
            f"{', '.join(repr(k) for k in valid)} or \"auto\""
        )
    return dtype


def zero_stage(config: dict[str, Any]) -> int:
    value = config_section(config, "zero_optimization").get("stage", 0)
    if value is None or value == "auto":
        return 0
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value not in (0, 1, 2, 3):
        raise ValueError("base config: zero_optimization.stage must be 0, 1, 2 or 3. Received: "
                         f"zero_optimization.stage={value!r}")
    return value


def _torch_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16: the spelling torch_autocast.dtype is written in."""
    return str(dtype).removeprefix("torch.")


def _contradiction(key: str, base_value: object, plan_value: object) -> ValueError:
    return ValueError(
        f"base config contradicts the plan at {key}: the base has {base_value!r}, the plan needs "
        f"{plan_value!r}. Remove the key from the base, or change the plan's annotations."
    )


def _fill(config: dict[str, Any], section: str, key: str, value: Any) -> None:
    """Set `section.key`, creating the section where the base left it absent or null."""
    if not isinstance(config.get(section), dict):
        config[section] = {}
    config[section][key] = value


def _disable(config: dict[str, Any], section: str, plan_needs: str) -> None:
    """The plan does not use `section`: refuse `enabled: true`, and fill "auto" with false."""
    if config_flag(config, section) is True:
        raise _contradiction(f"{section}.enabled", config_section(config, section)["enabled"],
                             plan_needs)
    if config_section(config, section).get("enabled") == "auto":
        _fill(config, section, "enabled", False)


# -- one fill per case ----------------------------------------------------------------------------

def _fill_low_storage(config: dict[str, Any], dsp: DeepSpeedPlan, stage: int) -> None:
    """Uniform bf16 or fp16 storage: DeepSpeed's own bf16 or fp16 section."""
    (low,) = dsp.storages
    section, other = ("bf16", "fp16") if low == bf16 else ("fp16", "bf16")
    needs = f"{section}.enabled (storage {dtype_name(low)})"
    _disable(config, other, needs)
    _disable(config, "torch_autocast", needs)
    if config_flag(config, section) is False:
        raise _contradiction(f"{section}.enabled", config_section(config, section)["enabled"], True)
    _fill(config, section, "enabled", True)
    if low == fp16:
        static = static_loss_scale(config, dsp)
        if static is not None:
            warnings.warn(
                f"base sets fp16.loss_scale={static} (static); the plan uses fp16, for which "
                "adapters turn on dynamic loss scaling. Keeping the base's value.",
                UserWarning, stacklevel=3,
            )
        elif config_section(config, section).get("loss_scale", "auto") in (None, "auto"):
            _fill(config, section, "loss_scale", 0)
    known = {c for c in dsp.comms if c is not None}
    if len(known) > 1:
        wide = widest(known)
        assert wide is not None
        warnings.warn(
            f"The plan reduces gradients in several dtypes ({sorted(map(dtype_name, known))}); "
            f"DeepSpeed's {section} mode reduces all in one. Using {dtype_name(wide)}.",
            UserWarning, stacklevel=3,
        )
        known = {wide}
    if known and known != {low}:
        (comm,) = known
        given = config_dtype(config.get("communication_data_type"), "communication_data_type")
        if given is not None and given != comm:
            raise _contradiction("communication_data_type", config["communication_data_type"],
                                 SHORT[comm])
        config["communication_data_type"] = SHORT[comm]


@dataclasses.dataclass(frozen=True)
class UpdateHalf:
    """What DeepSpeed makes of the plan's update half (`master`, `grad`, `optim`) at one ZeRO
    stage, from `update_half`.

    Attributes:
        keys: the config keys that say it (`{section}_master_weights_and_grads`,
            `{section}_optimizer_states`, `grad_accum_dtype`); empty where DeepSpeed's own
            layout is the plan's, or where the plan sets none of the three fields.
        refusal: why DeepSpeed cannot hold it (a narrowing, or a layout it has no setting
            for), a sentence without its full stop; else None.
        widened: what DeepSpeed keeps wider than planned, where it has no setting for the
            plan's layout at this stage but runs its own wider one; else None.
        modules: the modules concerned (with a refusal or a widening).
    """

    keys: dict[str, Any]
    refusal: str | None = None
    widened: str | None = None
    modules: tuple[str, ...] = ()


def update_half(dsp: DeepSpeedPlan, stage: int) -> UpdateHalf:
    """What DeepSpeed makes of the plan's update half at ZeRO `stage` (see `UpdateHalf`).

    DeepSpeed keeps one layout for the whole model. Under its bf16 (fp16) section, ZeRO 1-3
    keep fp32 master weights and fp32 optimizer state unless `bf16_master_weights_and_grads`
    (and `bf16_optimizer_states`) say bf16, and gradients accumulate in
    `data_types.grad_accum_dtype`. ZeRO 0 always keeps fp32 master weights and fp32 optimizer
    state (its unfused fp16/bf16 optimizer wraps the optimizer around fp32 copies of the
    weights, updates them and writes them back rounded), refuses both keys, and accumulates
    gradients in the section's dtype (it refuses another `grad_accum_dtype`). A plan that sets
    none of the three fields leaves DeepSpeed's defaults as they are."""
    plan = dsp.plan
    names = [n for n in param_entries(plan) if any(
        getattr(plan[n].policy, f) is not None for f in ("master", "grad", "optim"))]
    if not names:
        return UpdateHalf({})
    layouts = _update_layouts(plan)
    if len(layouts) > 1:
        groups = sorted(layouts.values(), key=len)
        return UpdateHalf({}, refusal=(
            f"the plan updates its modules in {len(layouts)} ways (for example "
            f"{groups[0][0]!r} apart from {groups[-1][0]!r}), and DeepSpeed keeps one layout "
            "of masters, gradients and state for the whole model"),
            modules=tuple(n for g in groups[:-1] for n in g))
    policy = plan[names[0]].policy
    section = {bf16: "bf16", fp16: "fp16"}.get(policy.storage or fp32)
    refusal = _update_refusal(policy, section, stage)
    if refusal is not None:
        return UpdateHalf({}, refusal=refusal, modules=tuple(names))
    widened = _zero0_widened(plan, names, policy, section) if stage == 0 else None
    return UpdateHalf(_update_keys(policy, section, stage), widened=widened,
                      modules=tuple(names) if widened else ())


#: DeepSpeed's words when ZeRO 0 is given another grad_accum_dtype than its weights' dtype
GRAD_ACCUM_WORDS = "\"unsupported mix of model_dtype and grad_accum_dtype\""
#: the dtype DeepSpeed stores weights in under each section
_SECTION_DTYPES = {"bf16": bf16, "fp16": fp16, None: fp32}
#: how ZeRO 0 updates weights under DeepSpeed's bf16 or fp16 section (deepspeed 0.19.8,
#: `runtime/fp16/unfused_optimizer.py`; tests/adapters/test_deepspeed.py measures it)
ZERO0_MASTERS = ("at ZeRO stage 0 DeepSpeed's {section} mode always keeps fp32 master weights "
                 "and fp32 optimizer state: it wraps the optimizer around fp32 copies of the "
                 "weights, kept from step to step, and writes them back rounded")


def _copies(policy: Policy, section: str | None) -> bool:
    """Whether the plan keeps a master copy beside the section's weights."""
    return rule_for(fields_of(policy), _SECTION_DTYPES[section]).master is not None


def _update_keys(policy: Policy, section: str | None, stage: int) -> dict[str, Any]:
    """The keys that say one update layout DeepSpeed can hold."""
    if section is None:  # fp32 storage: masters and state are fp32 already
        return {}
    out: dict[str, Any] = {}
    state = policy.optim if isinstance(policy.optim, torch.dtype) else None
    copies = _copies(policy, section)
    if stage >= 1:  # ZeRO 0 refuses both keys, and keeps fp32 masters whatever they say
        out[f"{section}_master_weights_and_grads"] = not copies
        if not copies:
            out[f"{section}_optimizer_states"] = state is None or state == policy.storage
    if policy.grad is not None:
        out["grad_accum_dtype"] = SHORT[policy.grad]
    return out


def _zero0_widened(plan: PrecisionPlan, names: list[str], policy: Policy,
                   section: str | None) -> str | None:
    """What ZeRO 0 keeps wider than a plan that updates the low weights themselves (no master
    copy), or None."""
    if section is None or _copies(policy, section):
        return None
    elements = sum(plan[n].params for n in names)
    state = rule_for(fields_of(policy), _SECTION_DTYPES[section]).state
    twice = isinstance(state, torch.dtype) and state.itemsize < 4
    return (f"{ZERO0_MASTERS.format(section=section)}, where the plan updates the {section} "
            f"weights themselves (master={section}) for {listing(names)}: {elements * 4:,} "
            "more bytes of masters" + (" and twice the bytes of optimizer state" if twice else "")
            + " than planned")


def _update_layouts(plan: PrecisionPlan) -> dict[str, list[str]]:
    """The modules holding parameters, by how they are updated (master, grad, optim), a
    master that is the stored weight itself written alike however it was said."""
    layouts: dict[str, list[str]] = {}
    for name in param_entries(plan):
        p = plan[name].policy
        low = p.storage if p.storage in LOW_PRECISION else None
        master = p.master if p.master is not None else (None if low is None else "as stored")
        if master == p.storage:
            master = "as stored"
        layouts.setdefault(f"master={master},grad={p.grad},optim={p.optim}", []).append(name)
    return layouts


def _update_refusal(policy: Policy, section: str | None, stage: int) -> str | None:
    """Why DeepSpeed's one `section` ("bf16", "fp16"; None for fp32 weights) at `stage`
    cannot hold this update layout, or None."""
    if isinstance(policy.optim, str) or policy.master == "stochastic":
        what = f"optim={policy.optim}" if isinstance(policy.optim, str) else (
            "master='stochastic'")
        return (f"{what} has no DeepSpeed setting (its optimizers keep full-precision state "
                "and round to nearest)")
    state = policy.optim if isinstance(policy.optim, torch.dtype) else None
    if section is None:
        return None if state is None or state == fp32 else (
            f"optim={dtype_name(state)} over fp32 weights has no DeepSpeed setting (its state "
            "is kept in the dtype it updates)")
    rule = rule_for(fields_of(policy), _SECTION_DTYPES[section])
    copies = rule.master is not None
    grad = rule.grad or _SECTION_DTYPES[section]
    if stage == 0 and grad != _SECTION_DTYPES[section]:
        return (f"grad={dtype_name(grad)} over {section} weights needs ZeRO stage 1-3: at "
                f"stage 0 DeepSpeed accumulates gradients in the {section} weights' own .grad, "
                f"refuses data_types.grad_accum_dtype={SHORT[grad]!r} ({GRAD_ACCUM_WORDS}), "
                f"and without that key fails at initialize on the parameters' "
                f"{dtype_name(grad)} gradients; at ZeRO stage 0 leave grad unset (or "
                f"{section}): {ZERO0_MASTERS.format(section=section)}")
    if copies and state is not None and state != fp32:
        return (f"optim={dtype_name(state)} beside fp32 masters has no DeepSpeed setting "
                f"({section}_optimizer_states needs {section} masters)")
    return None


def _fill_update(config: dict[str, Any], dsp: DeepSpeedPlan, stage: int) -> None:
    """The plan's update half, where it sets one, into the bf16/fp16 section and data_types."""
    half = update_half(dsp, stage)
    if half.refusal is not None:
        raise ValueError(f"DeepSpeed cannot run the plan's update half: {half.refusal}. "
                         f"Modules: {list(half.modules[:8])}")
    if half.widened is not None:
        warnings.warn(f"DeepSpeed keeps more than the plan: {half.widened}.", UserWarning,
                      stacklevel=3)
    section = next((s for s in ("bf16", "fp16") if config_flag(config, s)), None)
    for key, value in half.keys.items():
        if key == "grad_accum_dtype":
            data = config_section(config, "data_types")
            given = data.get(key)
            if given not in (None, "auto") and config_dtype(given, f"data_types.{key}") != to_dtype(
                    value):
                raise _contradiction(f"data_types.{key}", given, value)
            _fill(config, "data_types", key, value)
        elif section is not None:
            given = config_section(config, section).get(key)
            if given not in (None, "auto") and bool(given) != value:
                raise _contradiction(f"{section}.{key}", given, value)
            _fill(config, section, key, value)


def static_loss_scale(config: dict[str, Any], dsp: DeepSpeedPlan) -> object | None:
    """The base's static fp16 loss scale where the plan runs DeepSpeed's fp16 mode, else None
    (0, "auto" or unset: dynamic)."""
    scale: object = config_section(config, "fp16").get("loss_scale")
    if dsp.case == "low_storage" and fp16 in dsp.storages and scale not in (None, 0, "auto"):
        return scale
    return None


def _fill_fp32(config: dict[str, Any], dsp: DeepSpeedPlan, stage: int) -> None:
    """fp32 everywhere: no precision section."""
    for section in PRECISION_SECTIONS:
        _disable(config, section, "fp32 training (no section)")


def _fill_autocast(config: dict[str, Any], dsp: DeepSpeedPlan, stage: int) -> None:
    """fp32 storage with fp16/bf16 compute: the torch_autocast section."""
    if len(dsp.low_compute) > 1:
        raise ValueError(
            "The plan computes in both fp16 and bf16 over fp32 storage; DeepSpeed's "
            "torch_autocast takes one dtype. Annotate one low-precision compute dtype."
        )
    (dtype,) = dsp.low_compute
    refusal = fp16_zero_refusal(dsp, stage)
    if refusal:
        raise ValueError(f"{refusal} (see the DeepSpeed guide). {FP16_ZERO_FIX}")
    needs = f"torch_autocast (fp32 storage, {dtype_name(dtype)} compute)"
    for section in ("bf16", "fp16"):
        _disable(config, section, needs)
    if config_flag(config, "torch_autocast") is False:
        raise _contradiction("torch_autocast.enabled",
                             config_section(config, "torch_autocast")["enabled"], True)
    _fill(config, "torch_autocast", "enabled", True)
    given = config_section(config, "torch_autocast").get("dtype")
    if config_dtype(given, "torch_autocast.dtype") not in (None, dtype):
        raise _contradiction("torch_autocast.dtype", given, _torch_name(dtype))
    _fill(config, "torch_autocast", "dtype", _torch_name(dtype))
    listed = config_section(config, "torch_autocast").get("lower_precision_safe_modules")
    if listed not in (None, "auto"):
        _check_user_classes(dsp, listed, dtype)
    else:
        classes = safe_classes(dsp, dtype)
        # [] when per-parameter comm_dtype (set by prepare) is needed: DeepSpeed's default list
        # would otherwise tag every Linear and Conv with the autocast dtype.
        _fill(config, "torch_autocast", "lower_precision_safe_modules",
              classes if classes is not None else [])
    if len(dsp.comms) == 1 and None not in dsp.comms:  # one comm dtype: every stage honours it
        (comm,) = dsp.comms
        given = config_dtype(config.get("communication_data_type"), "communication_data_type")
        if given is not None and given != comm:
            raise _contradiction("communication_data_type", config["communication_data_type"],
                                 SHORT[comm])  # type: ignore[index]
        config["communication_data_type"] = SHORT[comm]  # type: ignore[index]
    if _zero0_ignores_comm(dsp, stage):
        warnings.warn(ZERO0_COMM, UserWarning, stacklevel=3)


ZERO0_COMM = ("ZeRO stage 0 reduces every gradient in one dtype (communication_data_type, "
              "else the parameter dtype); the plan's per-module comm dtypes take effect with "
              "ZeRO stages 1-3.")


FP16_ZERO_FIX = ("Use ZeRO stage 0, bf16 compute, or uniform fp16 storage (the fp16 section) "
                 "without fp32 islands.")


def fp16_zero_refusal(dsp: DeepSpeedPlan, stage: int) -> str | None:
    """Why fp16 compute over fp32 storage cannot train under this ZeRO stage (a sentence
    without its full stop), or None."""
    if dsp.case != "autocast" or fp16 not in dsp.low_compute or stage < 1:
        return None
    if not fp16_autocast_zero_broken():
        return None
    return (f"fp16 compute over fp32 storage maps to torch_autocast dtype float16, and with "
            f"zero_optimization.stage={stage} deepspeed {deepspeed_version()} does not update "
            "the parameters")


def _zero0_ignores_comm(dsp: DeepSpeedPlan, stage: int) -> bool:
    return dsp.case == "autocast" and stage == 0 and len(dsp.comms - {None}) > 1


_FILLS: dict[Case, Callable[[dict[str, Any], DeepSpeedPlan, int], None]] = {
    "low_storage": _fill_low_storage,
    "fp32": _fill_fp32,
    "autocast": _fill_autocast,
}


def to_config(
    model_or_plan: nn.Module | PrecisionPlan | DeepSpeedPlan, base: BaseConfig = None
) -> dict[str, Any]:
    """A DeepSpeed config for the plan: `base`, with the precision sections it leaves empty filled.

    `base` is read as DeepSpeed reads it: a file may carry comments (hjson), a `null` section
    is an empty one, `"auto"` values of the precision keys are filled from the plan
    (`communication_data_type` included, which DeepSpeed and Accelerate refuse as "auto"),
    booleans may be strings such as "false", and `torch_autocast.lower_precision_safe_modules`
    names classes DeepSpeed imports. Under the bf16 or fp16 section,
    `data_types.keep_in_fp32_modules` (read by DeepSpeed 0.19.8 and later) is set to the
    buffers the plan keeps in fp32 where DeepSpeed's "auto" would keep others; the plan's
    update half goes into that section's master keys and `data_types.grad_accum_dtype` (see
    `update_half`; at ZeRO 0 DeepSpeed keeps fp32 masters of its own, and a plan without
    masters is warned of).

    Args:
        model_or_plan: a model (resolved here), a `PrecisionPlan`, or `translate`'s result.
        base: the user's config, as a dict or a path to a JSON or hjson file; its settings win
            where they do not contradict the plan. (Default: None)

    Returns:
        A new dict; `base` is not modified. Call `prepare(model)` before `deepspeed.initialize`.

    Raises:
        ValueError: where `base` contradicts the plan or holds a value DeepSpeed would not read
            (the message names the key); or when the plan computes in both fp16 and bf16 over
            fp32 storage.
    """
    config = load_base(base)
    dsp = translate(model_or_plan)
    stage = zero_stage(config)
    config_dtype(config.get("communication_data_type"), "communication_data_type")
    config_dtype(config_section(config, "torch_autocast").get("dtype"), "torch_autocast.dtype")
    _FILLS[dsp.case](config, dsp, stage)
    _fill_auto_comm(config)
    _fill_update(config, dsp, stage)
    _fill_buffers(config, dsp)
    for section in PRECISION_SECTIONS:  # DeepSpeed cannot read a null torch_autocast
        if section in config and config[section] is None:
            del config[section]
    return config


def _fill_auto_comm(config: dict[str, Any]) -> None:
    """`communication_data_type: "auto"` where the plan has no one comm dtype to write there:
    the dtype DeepSpeed reduces in when the key is absent (its bf16 or fp16 section's, else
    fp32). DeepSpeed refuses "auto" at this key, and neither the Hugging Face Trainer nor
    Accelerate fills it."""
    if config.get("communication_data_type") == "auto":
        config["communication_data_type"] = SHORT[section_dtype(config) or fp32]


# -- buffers: data_types.keep_in_fp32_modules (buffers.py) --------------------------------------

def reads_keep_in_fp32() -> bool:
    """Whether the installed DeepSpeed reads `data_types.keep_in_fp32_modules` (True where none
    is installed here: the config is then written for the machine that launches, and older
    releases ignore the key)."""
    release = deepspeed_release()
    return release is None or release >= buffers.READ_SINCE


def section_dtype(config: dict[str, Any]) -> torch.dtype | None:
    """The dtype DeepSpeed's enabled section casts the model to (fp16 first, as DeepSpeed
    asks), or None: then it casts nothing, and keeps no buffer in fp32."""
    if config_flag(config, "fp16"):
        return fp16
    return bf16 if config_flag(config, "bf16") else None


def keep_setting(config: dict[str, Any]) -> object:
    """The config's `data_types.keep_in_fp32_modules` ("auto" where it is left out)."""
    return config_section(config, "data_types").get(buffers.KEEP_IN_FP32, buffers.AUTO)


def keep_refusal(config: dict[str, Any]) -> str | None:
    """Why the installed DeepSpeed refuses the config's `keep_in_fp32_modules`, or None."""
    if buffers.KEEP_IN_FP32 not in config_section(config, "data_types"):
        return None
    return buffers.refusal(keep_setting(config)) if reads_keep_in_fp32() else None


def buffer_dtypes(plan: PrecisionPlan, config: dict[str, Any]) -> dict[str, torch.dtype]:
    """What DeepSpeed's `initialize` leaves each floating buffer in with this config, the
    buffers arriving as planned (`prepare` puts them there)."""
    low = section_dtype(config) if reads_keep_in_fp32() and not keep_refusal(config) else None
    cast = config_dtype(config_section(config, "data_types").get("buffer_dtype"),
                        "data_types.buffer_dtype")
    return buffers.held(plan, low, keep_setting(config), cast)


def _fill_buffers(config: dict[str, Any], dsp: DeepSpeedPlan) -> None:
    """Under a bf16 or fp16 section, where the base leaves `keep_in_fp32_modules` out or "auto"
    and DeepSpeed would keep other buffers in fp32 than the plan does, the plan's fp32 buffers,
    by exact name; raise where the base's value (or its `buffer_dtype`) holds a buffer in
    another dtype than the plan."""
    if not reads_keep_in_fp32():
        return  # an older DeepSpeed ignores the key
    refusal = keep_refusal(config)
    if refusal is not None:
        raise ValueError(f"base config: DeepSpeed refuses {refusal}; give \"auto\" or a list of "
                         "name patterns, or leave the key out.")
    low = section_dtype(config)
    if low is None:
        return  # DeepSpeed casts nothing without its bf16/fp16 section
    planned = {n: d for n, (_, d) in buffers.planned_buffers(dsp.plan).items()}
    fp32_buffers = {n for n, d in planned.items() if d == fp32}
    wanted = buffers.exact_patterns(sorted(fp32_buffers))
    given = keep_setting(config)
    if given == buffers.AUTO and buffers.kept_by(dsp.plan, given, low) != fp32_buffers:
        _fill(config, "data_types", buffers.KEEP_IN_FP32, wanted)
    actual = buffer_dtypes(dsp.plan, config)
    wrong = {n: (d, actual[n]) for n, d in planned.items() if actual[n] != d}
    if wrong:
        raise _buffers_contradicted(config, given, wanted, wrong)


def _buffers_contradicted(config: dict[str, Any], given: object, wanted: list[str],
                          wrong: dict[str, tuple[torch.dtype, torch.dtype]]) -> ValueError:
    """The base's key that holds these buffers other than planned ((planned, held) each): its
    own keep_in_fp32_modules where that keeps one in fp32 or leaves out one the plan keeps
    there, else its buffer_dtype."""
    said = ", ".join(f"{n!r} in {dtype_name(a)}" for n, (a, _) in sorted(wrong.items())[:4])
    if given != buffers.AUTO and any(fp32 in pair for pair in wrong.values()):
        return _contradiction(f"data_types.{buffers.KEEP_IN_FP32}", given,
                              f"{wanted} (the plan holds {said})")
    return _contradiction("data_types.buffer_dtype",
                          config_section(config, "data_types").get("buffer_dtype"),
                          f"the buffers as planned ({said})")


def deepspeed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deepspeed")
    except PackageNotFoundError:
        return "unknown"


def deepspeed_release() -> tuple[int, ...] | None:
    """The installed DeepSpeed's release as numbers ((0, 19, 8)), None where none is installed."""
    found = deepspeed_version()
    if found == "unknown":
        return None
    return tuple(int(x) for x in found.split("+")[0].split(".")[:3] if x.isdigit())


def fp16_autocast_zero_broken() -> bool:
    """True for the DeepSpeed versions seen to drop fp16 torch_autocast updates under ZeRO 1-3."""
    release = deepspeed_release()
    return release is None or release <= (0, 19, 8)


def _check_user_classes(dsp: DeepSpeedPlan, listed: object, dtype: torch.dtype) -> None:
    if not isinstance(listed, list) or not all(isinstance(x, str) for x in listed):
        raise TypeError(
            "torch_autocast.lower_precision_safe_modules must be a list of 'package.Class' names. "
            f"Received: {listed!r}"
        )
    missing = unimportable(listed)
    if missing:
        raise ValueError(f"base config: DeepSpeed cannot import {missing} of "
                         "torch_autocast.lower_precision_safe_modules, and refuses to start "
                         "(\"Failed to import lower precision safe module\"); give importable "
                         "'package.module.Class' names, or leave the key to the plan.")
    plan = dsp.plan
    tagged = listed_modules(plan, listed)
    for name in param_entries(plan):
        comm = plan[name].policy.grad_comm
        if name in tagged and comm != dtype:
            raise _contradiction(
                "torch_autocast.lower_precision_safe_modules",
                f"{listed} (DeepSpeed reduces {plan[name].type} in {dtype_name(dtype)})",
                f"{name!r} reduced in {dtype_name(comm)}",
            )


def prepare(model: nn.Module, plan: PrecisionPlan | DeepSpeedPlan | None = None) -> nn.Module:
    """Make the plan real on `model` for DeepSpeed; call it before `deepspeed.initialize`.

    It applies the plan DeepSpeed can run (see `translate`: mixed storage becomes fp32 storage
    with per-module compute, with a warning), and sets each parameter's `comm_dtype` attribute,
    which DeepSpeed's ZeRO 1-3 reduce in under `torch_autocast`.

    Args:
        model: the model, not yet handed to DeepSpeed.
        plan: its plan, or `translate`'s result (then the warning is not repeated); resolved
            from `model` when None. (Default: None)

    Returns:
        `model`.
    """
    require_module(model, "prepare")
    model = unwrap(model)
    dsp = translate(model if plan is None else plan)
    apply(model, dsp.plan)  # checks the plan belongs to this model, naming missing modules
    for name, module in model.named_modules():
        comm = dsp.plan[name].policy.grad_comm
        for p in module.parameters(recurse=False):
            if comm is not None:
                p.comm_dtype = comm
            elif hasattr(p, "comm_dtype"):
                del p.comm_dtype
    return model
