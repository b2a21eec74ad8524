"""DeepSpeed checks: what DeepSpeed will refuse, narrow, widen or run badly with a config.

Worked out by the same code that exports the config (`export.translate`, `to_config`,
`prepare`), and from what DeepSpeed 0.19 does with a config: ZeRO 0 reduces every gradient in
one dtype; without torch_autocast ZeRO 1-3 do too; with it, each parameter reduces in its
`comm_dtype`; under its bf16 or fp16 section, `data_types.keep_in_fp32_modules` (0.19.8 and
later) decides which buffers it holds in fp32 (`buffers.py`). `CHECKS` is the backend
`check(..., "deepspeed", config)` asks.
"""

from __future__ import annotations

import copy
import difflib
import importlib
import re
import sys
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch
from torch import nn

from precision_annot._src.check_backend import CheckBackend, Checked
from precision_annot._src.dtypes import LOW_PRECISION, bf16, dtype_name, fp16, fp32, wider
from precision_annot._src.findings import Finding, drift, listing
from precision_annot._src.plan import PrecisionPlan
from precision_annot._src.runtime import Subject, subject
from precision_annot.adapters.deepspeed.buffers import (
    AUTO,
    KEEP_IN_FP32,
    exact_patterns,
    planned_buffers,
)
from precision_annot.adapters.deepspeed.export import (
    FP16_ZERO_FIX,
    PRECISION_SECTIONS,
    BaseConfig,
    DeepSpeedPlan,
    UpdateHalf,
    buffer_dtypes,
    config_dtype,
    config_flag,
    config_section,
    fp16_zero_refusal,
    keep_refusal,
    keep_setting,
    listed_modules,
    load_base,
    mixed_storage_message,
    param_entries,
    reads_keep_in_fp32,
    safe_classes,
    section_dtype,
    static_loss_scale,
    to_config,
    translate,
    unimportable,
    update_half,
    zero_stage,
)

__all__ = ["CHECKS", "DEFAULT_SAFE_MODULES", "DeepSpeedChecks", "autocast_started",
           "buffer_findings", "findings", "given_config", "known_keys", "read_config", "reduced",
           "refused", "unresolved_auto"]


#: the classes DeepSpeed's torch_autocast tags with the autocast dtype when its config lists none
DEFAULT_SAFE_MODULES = ("torch.nn.modules.linear.Linear", "torch.nn.modules.conv.Conv1d",
                        "torch.nn.modules.conv.Conv2d", "torch.nn.modules.conv.Conv3d")


def read_config(base: BaseConfig) -> tuple[dict[str, Any], int]:
    """The config as DeepSpeed reads it and its ZeRO stage; a config DeepSpeed could not read
    at all (not JSON or hjson, a section that is not an object, a stage that is not 0-3)
    raises `ValueError`: that is bad input, not a finding."""
    config = load_base(base)
    stage = zero_stage(config)
    for section in PRECISION_SECTIONS:
        config_section(config, section)
    return config, stage


def given_config(dsp: DeepSpeedPlan, base: BaseConfig) -> tuple[dict[str, Any], int]:
    """The config DeepSpeed will get, and its stage: `base` as it is, or, when there is none,
    what `to_config(plan)` exports (the way this library launches a plan)."""
    if base is not None:
        return read_config(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return read_config(to_config(dsp))
        except ValueError:  # the plan itself cannot be exported: said by _refusals
            return {}, 0


def reduced(dsp: DeepSpeedPlan, config: dict[str, Any], stage: int) -> dict[str, torch.dtype]:
    """What DeepSpeed (0.19) reduces each parameter-holding module's gradients in, with this
    config, after `prepare(model)` set each parameter's `comm_dtype`, in an engine started in
    this process.

    - ZeRO 0 and, without torch_autocast, ZeRO 1-3: every gradient in the engine's
      `communication_data_type`: the config's, else fp16 or bf16 with that section, else fp32.
    - ZeRO 1-3 in a process that has started an engine with torch_autocast before
      (`autocast_started`), whatever this config says: each parameter in its `comm_dtype`
      (what `prepare` set), else the dtype DeepSpeed holds it in.
    - torch_autocast with ZeRO 1-3: each parameter in its `comm_dtype`, which DeepSpeed sets to
      the autocast dtype for the exact classes `lower_precision_safe_modules` lists (each name
      imported, as DeepSpeed does; Linear and Conv when it lists none), over what `prepare`
      set; else the parameter's own dtype.
    """
    low = next((s for s in ("bf16", "fp16") if config_flag(config, s)), None)
    names = param_entries(dsp.plan)
    autocast = config_flag(config, "torch_autocast")
    if stage > 0 and not autocast and autocast_started():
        return _per_parameter(dsp.plan, names, {"bf16": bf16, "fp16": fp16}.get(low or ""))
    if stage == 0 or not autocast or low is not None:
        return dict.fromkeys(names, _engine_comm(config, low))
    section = config_section(config, "torch_autocast")
    dtype = config_dtype(section.get("dtype"), "torch_autocast.dtype") or fp16
    listed = section.get("lower_precision_safe_modules")
    tagged = listed_modules(dsp.plan, listed if isinstance(listed, list) else
                            list(DEFAULT_SAFE_MODULES))
    return {**_per_parameter(dsp.plan, names, None), **dict.fromkeys(tagged, dtype)}


def _per_parameter(plan: PrecisionPlan, names: list[str], held: torch.dtype | None
                   ) -> dict[str, torch.dtype]:
    """Each module's gradients in its parameters' `comm_dtype` (what `prepare` set), else in
    the dtype DeepSpeed holds them in (`held`, its bf16 or fp16 section's; else planned)."""
    return {name: plan[name].policy.grad_comm or held or plan[name].policy.storage or fp32
            for name in names}


def autocast_started() -> bool:
    """Whether this process has started a DeepSpeed engine with torch_autocast. DeepSpeed
    (0.19.8) keeps that in a module-level flag no engine resets, and every ZeRO 1-3 engine
    started after it reduces each parameter in its `comm_dtype` attribute, with or without
    torch_autocast in its own config (2 ranks measure it: tests/workers/ds_matrix.py). A
    process that has not imported DeepSpeed has started none."""
    module = sys.modules.get("deepspeed.runtime.torch_autocast")
    return module is not None and bool(module.is_autocast_initialized())


def _engine_comm(config: dict[str, Any], low: str | None) -> torch.dtype:
    """The engine's `communication_data_type`: the config's, else its bf16 or fp16 section's
    dtype (`low`), else fp32."""
    try:
        given = config_dtype(config.get("communication_data_type"), "communication_data_type")
    except ValueError:
        given = None  # refused by DeepSpeed: its own finding
    return given or {"bf16": bf16, "fp16": fp16}.get(low or "") or fp32


def findings(model_or_plan: nn.Module | PrecisionPlan, base: BaseConfig = None) -> list[Finding]:
    """What DeepSpeed will refuse, narrow, widen or run badly for this plan with this config
    (the config it will be given as it is, else the one `to_config(plan)` exports; and
    `prepare(model)` called before `initialize`), worked out by the same code as `to_config`
    and `prepare`.

    Raises:
        ValueError: for a config DeepSpeed could not read at all (bad input, not a finding).
    """
    plan = subject(model_or_plan, "deepspeed.findings").plan
    dsp = translate(plan, warn=False)
    config, stage = given_config(dsp, base)
    out = [*_refusals(dsp, config, stage)]
    if refused(out):
        return out  # DeepSpeed does not start: what it would run is moot
    if dsp.moved:
        storages = {plan[n].policy.storage for n in param_entries(plan)}
        out.append(Finding(
            "warning", "deepspeed-mixed-storage", dsp.moved[0] if len(dsp.moved) == 1 else "",
            mixed_storage_message(storages, len(dsp.moved), dsp.extra_bytes),
            "Accept the bytes, or make storage uniform (every module bf16 or fp16, islands "
            "computing in fp32 over low storage).", dsp.moved,
        ))
    actual = reduced(dsp, config, stage)
    cause = ("ZeRO stage 0 reduces every gradient in one dtype (communication_data_type, else "
             "the parameter dtype)" if stage == 0 else
             "without torch_autocast ZeRO reduces every gradient in communication_data_type "
             "(in a process that has started no torch_autocast engine before), and with it "
             "DeepSpeed tags the classes lower_precision_safe_modules lists (Linear and Conv "
             "when it lists none) with the autocast dtype, over prepare's comm_dtype")
    fix = ("Pass the config through precision_annot.adapters.deepspeed.to_config(plan, "
           "config) and call prepare(model) before deepspeed.initialize" + (
               "; per-module comm needs ZeRO stage 1-3" if stage == 0 else ""))
    out += drift(plan, "comm", actual, code="deepspeed-zero0-comm" if stage == 0 else
                 "deepspeed-comm", backend="DeepSpeed", cause=cause, fix=fix)
    out += _advice(dsp, config, stage)
    out += buffer_findings(dsp.plan, _auto_sections_filled(config, dsp))
    out += _misspelt(config)
    return out


def refused(found: list[Finding]) -> bool:
    """Whether these findings say DeepSpeed will not start at all."""
    return any(f.message.startswith(_REFUSES) for f in found)


def _refusals(dsp: DeepSpeedPlan, config: dict[str, Any], stage: int) -> Iterator[Finding]:
    """What DeepSpeed refuses to start with, or starts and never updates."""
    unread = [*_unread_values(config)]
    yield from unread
    half = update_half(dsp, stage)
    cannot, modules = half.refusal, half.modules
    if cannot is not None:
        yield Finding(
            "error", "deepspeed-update", modules[0] if modules else "",
            f"DeepSpeed cannot run the plan's update half: {cannot}. to_config refuses it, and "
            "a config written by hand runs DeepSpeed's own layout instead: the plan's masters, "
            "gradients or state would be other than planned.",
            "Give every module one update layout DeepSpeed has (fp32 masters and state, or "
            "bf16 masters with bf16_optimizer_states; grad=fp32 for fp32 accumulation, at ZeRO "
            "stage 1-3), or train locally, with DDP or FSDP2 and precision_annot.optimizer.",
            modules)
    refusal = fp16_zero_refusal(dsp, stage)
    if refusal:
        yield Finding("error", "deepspeed-fp16-zero", "",
                      f"{refusal}: every step is lost.", FP16_ZERO_FIX)
    if config_flag(config, "fp16") and not _fp16_supported():
        yield Finding(
            "error", "deepspeed-fp16-device", "",
            f"{_REFUSES} the fp16 section on this machine: its accelerator has no fp16 "
            "(\"Type fp16 is not supported on your device\").",
            "Run on a device with fp16 (a GPU), or use bf16 (fp16 compute over fp32 storage "
            "goes through torch_autocast at ZeRO stage 0).")
    if refusal is None and cannot is None and not unread:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                to_config(dsp, _without_compared_keys(config))  # those: their own findings
        except (TypeError, ValueError) as e:
            yield Finding("error", "deepspeed-config", "",
                          f"{str(e).rstrip('.')}. {_CONSEQUENCE}.",
                          "Change the config or the plan's annotations, as the message says.")
        yield from _update_layout(dsp, config, stage, half)


def _unread_values(config: dict[str, Any]) -> Iterator[Finding]:
    """The values DeepSpeed refuses to start with, each in its words."""
    cdt = config.get("communication_data_type")
    if cdt is not None and str(cdt).lower() not in ("fp16", "bf16", "fp32"):
        yield Finding(
            "error", "deepspeed-config", "",
            f"{_REFUSES} communication_data_type={cdt!r} (\"Invalid "
            "communication_data_type. Supported data types: ['fp16', 'bf16', 'fp32']\")" + (
                ": DeepSpeed resolves no \"auto\" at this key, the Hugging Face Trainer leaves "
                "it, and Accelerate refuses it (\"not found in kwargs\")" if cdt == "auto"
                else "") + ".",
            "Leave it out, or give one of 'fp16', 'bf16', 'fp32'; to_config(plan, config) "
            "fills it from the plan (\"auto\" included).")
    refused_auto = unresolved_auto(config)
    if refused_auto:
        keys = [k for k, _ in refused_auto]
        yield Finding(
            "error", "deepspeed-auto", "",
            f"{_REFUSES} \"auto\" at {', '.join(keys)} ({refused_auto[0][1]}): \"auto\" is "
            "filled by Hugging Face's Trainer and Accelerate before they start DeepSpeed, and "
            "DeepSpeed itself resolves it only inside its own sections (zero_optimization, "
            "bf16, fp16), not in these keys.",
            f"Give {', '.join(keys)} values, or launch through transformers' Trainer or "
            "Accelerate, which fill them; to_config(plan, config) fills the precision keys "
            "only.")
    keep = keep_refusal(config)
    if keep is not None:
        yield Finding(
            "error", "deepspeed-config", "", f"{_REFUSES} {keep}.",
            f"Leave data_types.{KEEP_IN_FP32} out, or give \"auto\" or a list of name "
            "patterns; to_config(plan, config) fills it from the plan.")
    listed = config_section(config, "torch_autocast").get("lower_precision_safe_modules")
    missing = unimportable(listed) if isinstance(listed, list) and all(
        isinstance(x, str) for x in listed) else []
    if missing and config_flag(config, "torch_autocast"):
        yield Finding(
            "error", "deepspeed-config", "",
            f"{_REFUSES} torch_autocast.lower_precision_safe_modules={listed!r}: it imports "
            f"each name and cannot import {missing} (\"Failed to import lower precision safe "
            "module\").",
            "Give importable 'package.module.Class' names (a class defined inside a function "
            "has none), or leave the key to to_config(plan, config).")


# -- the update half: the config's layout against the plan's ----------------------------------

_MASTERS = "{}_master_weights_and_grads"
_STATES = "{}_optimizer_states"
_LOW = {"bf16": bf16, "fp16": fp16}


def _without_compared_keys(config: dict[str, Any]) -> dict[str, Any]:
    """`config` less the keys that have findings of their own: where DeepSpeed keeps masters
    and optimizer states (`_update_layout`), and which buffers it keeps in fp32 or casts
    (`buffer_findings`)."""
    out = copy.deepcopy(config)
    for section in _LOW:
        if isinstance(out.get(section), dict):
            for key in (_MASTERS.format(section), _STATES.format(section)):
                out[section].pop(key, None)
    if isinstance(out.get("data_types"), dict):
        for key in (KEEP_IN_FP32, "buffer_dtype"):
            out["data_types"].pop(key, None)
    return out


def _update_layout(dsp: DeepSpeedPlan, config: dict[str, Any], stage: int,
                   half: UpdateHalf) -> Iterator[Finding]:
    """Where the config keeps masters and optimizer states (DeepSpeed's defaults where it says
    nothing) other than the plan does: narrowed (an error), widened (a warning), or a layout
    DeepSpeed itself refuses."""
    planned = half.keys
    section = next((s for s in _LOW if config_flag(config, s)), None)
    names = _update_modules(dsp.plan)
    if section is None or not names or (not planned and stage > 0):
        return  # the plan leaves the update half to DeepSpeed, or runs no bf16/fp16 section
    masters, states = _MASTERS.format(section), _STATES.format(section)
    given = {key: bool(config_flag(config, section, key)) for key in (masters, states)}
    refusal = _layout_refusal(config, section, given[masters], given[states], stage)
    if refusal is not None:
        yield _refused_layout(names, section, refusal,
                              fp32_planned=planned.get(masters) is False and given[masters])
    elif half.widened is not None:  # ZeRO 0: DeepSpeed's own fp32 masters, whatever it is told
        yield _zero0_masters(names, section, half.widened)
    else:
        yield from _layout_drift(dsp.plan, names, config, section, planned, given)


def _layout_drift(plan: PrecisionPlan, names: tuple[str, ...], config: dict[str, Any],
                  section: str, planned: dict[str, Any], given: dict[str, bool]
                  ) -> Iterator[Finding]:
    """The masters, else the optimizer states, that a layout DeepSpeed runs keeps other than
    the plan's keys (`planned`) say."""
    masters, states = _MASTERS.format(section), _STATES.format(section)
    if masters in planned and planned[masters] != given[masters]:
        said = "true" if given[masters] else _false(config, section, masters)
        yield _masters_finding(plan, names, section, given[masters], said)
    elif states in planned and planned[states] != given[states]:
        yield _states_finding(plan, names, section, planned[states])


def _zero0_masters(names: tuple[str, ...], section: str, widened: str) -> Finding:
    """ZeRO 0 keeps fp32 masters and state where the plan keeps none (`UpdateHalf.widened`)."""
    masters, states = _MASTERS.format(section), _STATES.format(section)
    return Finding(
        "warning", "deepspeed-masters", names[0],
        f"DeepSpeed keeps more than the plan: {widened}.",
        f"Accept the bytes; or use ZeRO stage 1-3, where {section}.{masters} and "
        f"{section}.{states} (to_config(plan, config) writes them) keep {section} masters and "
        "state; or plan master=fp32, what ZeRO stage 0 runs.", names)


def _update_modules(plan: PrecisionPlan) -> tuple[str, ...]:
    """The parameter-holding modules whose plan sets the update half."""
    return tuple(n for n in param_entries(plan) if any(
        getattr(plan[n].policy, f) is not None for f in ("master", "grad", "optim")))


def _false(config: dict[str, Any], section: str, key: str) -> str:
    """How a config says a flag is off: "false", or not at all."""
    return ("false" if key in config_section(config, section) else
            "not set, and DeepSpeed's default is false")


def _refused_layout(names: tuple[str, ...], section: str, refusal: str, *,
                    fp32_planned: bool) -> Finding:
    """A layout DeepSpeed refuses; where the plan keeps fp32 masters and the config asked for
    low ones, what the names mean besides."""
    masters, states = _MASTERS.format(section), _STATES.format(section)
    return Finding("error", "deepspeed-masters", names[0], f"{_REFUSES} {refusal}." + (
        f" Nor is it the plan's layout: the plan keeps fp32 masters (master=fp32), and "
        f"{masters}: true keeps them in {section}. {_NAMES_MISLEAD}" if fp32_planned else ""),
        f"Leave {section}.{masters} and {section}.{states} out, or set them as "
        "to_config(plan, config) writes them.", names)


def _layout_refusal(config: dict[str, Any], section: str, low_masters: bool, low_states: bool,
                    stage: int) -> str | None:
    """Why DeepSpeed (0.19) refuses this layout at `initialize`, or None."""
    masters, states = _MASTERS.format(section), _STATES.format(section)
    if (low_masters or low_states) and stage == 0:
        return f"{section}.{masters} or {states} at ZeRO stage 0 (\"only supported with ZeRO " \
               "Stage 1, 2, or 3\")"
    if low_states and not low_masters:
        return (f"{section}.{states} without {masters} (\"{states} requires {masters} to be "
                "enabled\")")
    offload = config_section(config_section(config, "zero_optimization"),
                             "offload_optimizer").get("device") in ("cpu", "nvme")
    if low_masters and not low_states and not offload:
        return (f"{section}.{masters} without {states}: its optimizer states would stay fp32, "
                f"which needs ZeRO-Offload with DeepSpeedCPUAdam (\"Master weights feature "
                f"requires ZeRO-{stage} Offload with DeepSpeedCPUAdam\")")
    return None


_NAMES_MISLEAD = ("The names read alike and mean opposite things: the preset \"bf16-master\" "
                  "(master=fp32) keeps fp32 master weights beside bf16 weights, while "
                  "DeepSpeed's bf16_master_weights_and_grads: true keeps the master weights "
                  "themselves in bf16.")


def _masters_finding(plan: PrecisionPlan, names: tuple[str, ...], section: str,
                     given_low: bool, said: str) -> Finding:
    """The config keeps the masters in another dtype than the plan: narrower (an error) or
    wider (a warning), said with what each name means."""
    key = f"{section}.{_MASTERS.format(section)}"
    elements = sum(plan[n].params for n in names)
    if given_low:  # the plan keeps fp32 masters, DeepSpeed low ones: narrowed
        return Finding(
            "error", "deepspeed-masters", names[0],
            f"DeepSpeed keeps {section} master weights and gradients ({key}: {said}), where "
            f"the plan keeps fp32 masters (master=fp32) for {listing(list(names))} "
            f"({elements:,} parameters): each update is added to a {section} weight, so one "
            f"below about 2^-{8 if section == 'bf16' else 11} of the weight rounds away. "
            f"{_NAMES_MISLEAD}",
            f"Set {key} to false and drop {section}.{_STATES.format(section)} (or leave both "
            "out): to_config(plan, config) writes them as the plan says.", names)
    return Finding(
        "warning", "deepspeed-masters", names[0],
        f"DeepSpeed keeps fp32 master weights and gradients and fp32 optimizer state ({key}: "
        f"{said}), where the plan updates the {section} weights themselves "
        f"(master={section}) for {listing(list(names))}: {elements * 2:,} more bytes of "
        f"masters and twice the bytes of optimizer state than planned. {_NAMES_MISLEAD}",
        f"Set {key} and {section}.{_STATES.format(section)} to true (to_config(plan, config) "
        "writes them), or plan master=fp32.", names)


def _states_finding(plan: PrecisionPlan, names: tuple[str, ...], section: str,
                    planned_low: bool) -> Finding:
    """Masters as planned, optimizer states in another dtype."""
    key = f"{section}.{_STATES.format(section)}"
    if planned_low:
        return Finding("warning", "deepspeed-masters", names[0],
                       f"DeepSpeed keeps fp32 optimizer state ({key} is false), where the plan "
                       f"keeps it in {section} for {listing(list(names))}: twice the bytes.",
                       f"Set {key} to true.", names)
    return Finding("error", "deepspeed-masters", names[0],
                   f"DeepSpeed keeps {section} optimizer state ({key}: true), where the plan "
                   f"keeps it wider for {listing(list(names))}: the moments lose bits.",
                   f"Set {key} to false.", names)


# -- buffers: data_types.keep_in_fp32_modules --------------------------------------------------

def _buffers_cause(config: dict[str, Any], low: torch.dtype) -> str:
    """What in the config decides the buffers' dtypes, in DeepSpeed's words."""
    data = config_section(config, "data_types")
    setting = keep_setting(config)
    if setting == AUTO:
        lists = "_keep_in_fp32_modules_strict" + (
            " and _keep_in_fp32_modules" if low == fp16 else "")
        how = "as given" if KEEP_IN_FP32 in data else "DeepSpeed's default"
        said = (f"data_types.{KEEP_IN_FP32} is \"auto\" ({how}), which keeps in fp32 the "
                f"buffers the model's own {lists} name")
    else:
        said = (f"data_types.{KEEP_IN_FP32} is {setting!r}, which keeps in fp32 the buffers "
                "whose names it matches")
    if data.get("buffer_dtype") is not None:
        said += f", and data_types.buffer_dtype={data['buffer_dtype']!r} casts every other one"
    return (f"{said} (DeepSpeed does this at initialize under its {dtype_name(low)} section, "
            "at every ZeRO stage; parameters follow the section)")


_DRIFT = "precision_annot's drift warning at initialize is the only sign, and the run goes on"
_NARROWED = f"so DeepSpeed rounds them to fewer bits than the plan gives them ({_DRIFT})"
_SIDEWAYS = f"so DeepSpeed holds them in another dtype than the plan gives them ({_DRIFT})"
_WIDENED = ("so the modules that read them compute with fp32 values where the plan gives them "
            f"{{planned}} ones ({_DRIFT})")


def _auto_sections_filled(config: dict[str, Any], dsp: DeepSpeedPlan) -> dict[str, Any]:
    """The config with `"enabled": "auto"` in its bf16 and fp16 sections read as `to_config`
    fills them from the plan (and the Hugging Face Trainer from the same run's settings): on
    for the low dtype the plan stores everything in, off otherwise."""
    auto = [s for s in ("bf16", "fp16")
            if config_section(config, s).get("enabled") == "auto"]
    if not auto:
        return config
    stored = next(iter(dsp.storages)) if dsp.case == "low_storage" else None
    filled = dict(config)
    for section in auto:
        on = stored == (bf16 if section == "bf16" else fp16)
        filled[section] = {**config_section(config, section), "enabled": on}
    return filled


def buffer_findings(plan: PrecisionPlan, config: dict[str, Any]) -> list[Finding]:
    """One error for the buffers DeepSpeed holds narrower than the plan (or sideways), one
    warning for those it holds wider, each naming the buffers, the dtypes and the keys."""
    low = section_dtype(config)
    if low is None or not reads_keep_in_fp32() or keep_refusal(config):
        return []
    planned = planned_buffers(plan)
    actual = buffer_dtypes(plan, config)
    changed = {n: (d, actual[n]) for n, (_, d) in planned.items() if actual[n] != d}
    wanted = exact_patterns(sorted(n for n, (_, d) in planned.items() if d == fp32))
    out = []
    for severity in ("error", "warning"):
        names = sorted(n for n, (a, b) in changed.items()
                       if wider(b, a) == (severity == "warning"))
        if names:
            modules = tuple(dict.fromkeys(planned[n][0] for n in names))
            out.append(_buffer_finding(severity, {n: changed[n] for n in names}, modules,
                                       _buffers_cause(config, low), wanted))
    return out


def _buffer_finding(severity: Literal["error", "warning"],
                    changed: dict[str, tuple[torch.dtype, torch.dtype]],
                    modules: tuple[str, ...], cause: str, wanted: list[str]) -> Finding:
    """One finding for buffers held other than planned ((planned, held) each)."""
    names = list(changed)
    pairs = sorted({(dtype_name(a), dtype_name(b)) for a, b in changed.values()})
    what = "; ".join(f"planned {a}, {b} instead" for a, b in pairs)
    if severity == "warning":
        then = _WIDENED.format(planned=", ".join(sorted({a for a, _ in pairs})))
    else:
        sideways = all(a in LOW_PRECISION for a, _ in changed.values())
        then = _SIDEWAYS if sideways else _NARROWED
    fix = ("Pass the config through precision_annot.adapters.deepspeed.to_config(plan, config), "
           f"which sets data_types.{KEEP_IN_FP32} to the buffers the plan keeps in fp32 "
           f"({wanted!r})")
    if severity == "warning":
        fix += ("; or keep those buffers in fp32 in the plan (for a Hugging Face model's own "
                "lists, annotate(model, precision_annot.adapters.transformers.rules(model, "
                "'bf16')))")
    return Finding(
        severity, "deepspeed-buffers", modules[0],
        f"DeepSpeed holds {len(names)} buffer{'s' if len(names) > 1 else ''} "
        f"({listing(names, 4)}) in another dtype than the plan ({what}), because {cause}, "
        f"{then}.", fix + ".", modules)


#: "auto" values DeepSpeed's engine reads as they are after its config parser let them through
#: (seen with deepspeed 0.19.8: `'>' not supported between instances of 'str' and 'float'` for
#: gradient_clipping; "warmup_num_steps must be a positive integer, got auto")
_ENGINE_AUTO = ("gradient_clipping", "scheduler.params.")


def _auto_paths(value: Any, path: str = "") -> Iterator[str]:
    """The dotted paths of the "auto" values in a config."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _auto_paths(item, f"{path}.{key}" if path else str(key))
    elif value == "auto":
        yield path


def unresolved_auto(config: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The "auto" values of `config` that DeepSpeed refuses, with why: each is asked of
    DeepSpeed's own config parser alone (inside its sections it resolves "auto" to the default;
    the batch sizes it reads as they are), and the engine's own reads (`_ENGINE_AUTO`) are
    refused as seen. The precision keys `to_config` fills are left to it."""
    paths = [p for p in _auto_paths(config) if p.split(".")[0] not in PRECISION_SECTIONS
             and p != "communication_data_type"]
    if not paths:
        return []
    try:
        from deepspeed.runtime.config import DeepSpeedConfig
    except ImportError:  # not installed here: only the engine's reads are known
        DeepSpeedConfig = None
    out = []
    for path in paths:
        if path.startswith(_ENGINE_AUTO) or path == _ENGINE_AUTO[0]:
            out.append((path, "its engine reads it as a number"))
            continue
        if DeepSpeedConfig is None:
            continue
        probe: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        *parents, leaf = path.split(".")
        at = probe
        for part in parents:
            at = at.setdefault(part, {})
        at[leaf] = "auto"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                DeepSpeedConfig(probe)
        except Exception as e:
            out.append((path, f"{type(e).__name__}: {e}"[:160]))
    return out


_REFUSES = "DeepSpeed refuses to start with"
_CONSEQUENCE = ("Launched as it is, DeepSpeed runs every module in the config's one dtype: "
                "under ZeRO-2 and ZeRO-3 an fp32 island then stops the first forward with "
                "\"mat1 and mat2 must have the same dtype\", and under ZeRO-0 it trains in the "
                "low dtype")


def _fp16_supported() -> bool:
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        return True  # not installed here: the machine that launches will say
    try:
        return bool(get_accelerator().is_fp16_supported())
    except Exception:
        return True


def _advice(dsp: DeepSpeedPlan, config: dict[str, Any], stage: int) -> Iterator[Finding]:
    """What runs as planned but costs or risks something."""
    if dsp.case == "autocast" and len(dsp.low_compute) == 1:
        (dtype,) = dsp.low_compute
        listed = config_section(config, "torch_autocast").get("lower_precision_safe_modules")
        if listed in (None, "auto", []) and safe_classes(dsp, dtype) is None:
            yield Finding(
                "info", "deepspeed-needs-prepare", "",
                "The plan's comm dtypes cannot be said by exact class (DeepSpeed matches "
                "module.__class__, not subclasses or instances), so the config lists no "
                "class and each parameter carries its own comm_dtype.",
                "precision_annot.adapters.deepspeed.prepare(model) before "
                "deepspeed.initialize(model=model, config=config).",
            )
    scale = static_loss_scale(config, dsp)
    if scale is not None:
        yield Finding(
            "warning", "deepspeed-static-loss-scale", "",
            f"The config sets fp16.loss_scale={scale!r}, a static scale: DeepSpeed still skips "
            "a step whose gradients overflow, but a gradient that underflows at this scale is "
            "not rescued by raising it, so small updates vanish.",
            "Set fp16.loss_scale to 0 (dynamic), or leave it out.",
        )


#: top-level keys `DeepSpeedConfig` reads that none of DeepSpeed's constants modules name
#: (DeepSpeed 0.19; tests/adapters/test_deepspeed.py records what the installed one reads)
_READ_KEYS = frozenset({
    "amp", "comet", "compile", "compression_training", "csv_monitor", "datastates_ckpt",
    "eigenvalue", "elasticity", "graph_harvesting", "hybrid_engine", "nebula", "pipeline",
    "progressive_layer_drop", "quantize_training", "sparse_attention", "sparse_gradients",
    "tensor_parallel", "tensorboard", "timers", "wandb", "weight_quantization",
    "zero_optimization"})
#: DeepSpeed's modules whose UPPER_CASE string constants name its config keys
_CONSTANTS = ("deepspeed.runtime.constants", "deepspeed.runtime.config",
              "deepspeed.runtime.activation_checkpointing.config",
              "deepspeed.profiling.constants", "deepspeed.autotuning.constants",
              "deepspeed.runtime.data_pipeline.constants",
              "deepspeed.runtime.swap_tensor.constants", "deepspeed.comm.constants",
              "deepspeed.checkpoint.constants")


def known_keys() -> frozenset[str]:
    """The config keys DeepSpeed knows: `_READ_KEYS` and every key its constants modules
    name (a module this DeepSpeed lacks is skipped)."""
    known = set(_READ_KEYS)
    for name in _CONSTANTS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        known.update(v for k, v in vars(module).items() if k.isupper() and isinstance(v, str)
                     and re.fullmatch(r"[a-z][a-z0-9_]*", v))
    return frozenset(known)


def _misspelt(config: Mapping[str, Any]) -> list[Finding]:
    """Top-level keys DeepSpeed does not know that are close to one it does: DeepSpeed reads
    no such key and says nothing, so a misspelt section (`zero_optimisation`) has no effect."""
    unknown = [k for k in config if isinstance(k, str) and k not in _ALWAYS]
    if not unknown:
        return []
    known = known_keys()
    out = []
    for key in unknown:
        if key in known:
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8)
        if close:
            out.append(Finding(
                "warning", "deepspeed-unknown-key", "",
                f"The config's top-level key {key!r} is not one DeepSpeed reads (it reads "
                f"{close[0]!r}): DeepSpeed ignores it without a word, so that setting has no "
                "effect.", f"Spell it {close[0]!r}."))
    return out


#: keys every config has, looked up without importing DeepSpeed's constants
_ALWAYS = frozenset({"train_batch_size", "train_micro_batch_size_per_gpu",
                     "gradient_accumulation_steps", "optimizer", "scheduler", "fp16", "bf16",
                     "zero_optimization", "torch_autocast", "gradient_clipping",
                     "communication_data_type", "data_types", "steps_per_print",
                     "wall_clock_breakdown", "zero_allow_untested_optimizer"})


class DeepSpeedChecks(CheckBackend):
    """`check(..., "deepspeed", config)`: the config is DeepSpeed's own (a dict, or a JSON or
    hjson file; None: what `to_config(plan)` exports), its keys meaning what DeepSpeed says."""

    name = "deepspeed"
    keys = None

    def options(self, config: Any) -> Any:
        if config is not None:
            read_config(config)  # a config DeepSpeed could not read at all is bad input
        return config

    def run(self, given: Subject, options: Any) -> Checked:
        found = findings(given.plan, options)
        if refused(found):
            return Checked(found)  # it does not start: nothing is reduced
        dsp = translate(given.plan, warn=False)
        config, stage = given_config(dsp, options)
        stored = {n: e.policy.storage for n, e in dsp.plan.items()
                  if e.policy.storage is not None}
        return Checked(found, reduced(dsp, config, stage), stored)


CHECKS = DeepSpeedChecks()
