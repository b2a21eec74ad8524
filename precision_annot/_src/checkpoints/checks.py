"""`check(model_or_plan, "checkpoint", {"path": ...})`: what loading a checkpoint would do to
the plan, read from the dtypes the checkpoint recorded (no tensor data is read).

Each tensor of the plan's model (its parameters and persistent buffers, as `resolve` saw them)
is found in the checkpoint under a common prefix (none for a state dict; `model.` for DCP's
`{"model": ...}`; `state_dict.` for a Lightning checkpoint; `module.` for a DDP one) and its
saved dtype compared with the dtype the plan keeps it in:

- narrowed (an error): saved narrower than the plan keeps it (an fp32 island saved in bf16):
  the load widens it back, with the low bits already gone;
- widened (an info): saved wider (an fp32 checkpoint of a bf16 layer): the load rounds it
  into the plan's dtype, as planned;
- missing or unexpected (a warning): a tensor of the model the checkpoint lacks (a tied
  parameter saved once counts as saved), or a floating tensor under the prefix that is no
  tensor of the model;
- a shape other than the model's (an error): `load_state_dict` refuses it.

A parameter whose plan keeps a master copy (`master=fp32` over bf16 storage) is kept in the
master's dtype: the checkpoint's master for it (a tensor named `<name>.master` under any
prefix, as an optimizer's state flattens) is compared with that dtype; without one, a resumed run
starts its master from the saved weight, which a warning says when that weight is narrower.

A checkpoint that holds none of the model's tensors under any prefix (an optimizer's own state
dict, another model's weights) is one error, not a list of every key. Keys a loader renames are
read as it renames them: for a Hugging Face model (given as the model, not its plan), each key
goes through transformers' own conversions, as `from_pretrained` reads it (ViT's
`encoder.layer.0` is the model's `layers.0`; per-expert weights fuse into one tensor, whose
shape is then not compared).

A checkpoint saved under a `precision_annot.schedule` holds the schedule's step and phase (with
the optimizer's state; `phases` finds it): one info says them (`phase_findings`), and, given the
model, whether the plan checked is that phase's. A folder of a model's weights is read with the
optimizer's state beside it (the Hugging Face Trainer's `optimizer.pt`): its phase and masters.

A PEFT adapter (a folder with `adapter_config.json`) is read as what it is, adapter weights for
`PeftModel.from_pretrained`: the base model's tensors it holds (`modules_to_save`) are compared
as above, its own weights where the plan's model holds them (a `PeftModel`), else named by the
modules they adapt (one info) and checked against those modules' shapes (`adapter_findings`).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from precision_annot._src.check_backend import CheckBackend, Checked
from precision_annot._src.checkpoints.phases import SavedPhase, saved_phases
from precision_annot._src.checkpoints.reading import (
    Saved,
    adapter_config,
    optimizer_beside,
    saved_tensors,
)
from precision_annot._src.dtypes import dtype_name, wider
from precision_annot._src.findings import Finding, listing
from precision_annot._src.plan import PrecisionPlan, TensorInfo, parent_name
from precision_annot._src.resolution import resolve
from precision_annot._src.runtime import Subject

__all__ = ["CHECKS", "KEY_MAPS", "CheckpointChecks", "adapter_findings", "checkpoint_findings",
           "loaded_keys", "phase_findings"]


@dataclasses.dataclass(frozen=True)
class _Planned:
    """One tensor of the plan's model: its info, and the dtype the plan keeps its value in."""

    info: TensorInfo
    keep: torch.dtype
    master: torch.dtype | None  # a master copy's dtype, where the plan keeps one


def _planned(plan: PrecisionPlan) -> dict[str, _Planned]:
    out = {}
    for name, entry in plan.items():
        policy = entry.policy
        master = policy.master if policy.copies_master else None
        for info in entry.facts.tensors if entry.facts is not None else ():
            if info.persistent:
                full = f"{name}.{info.name}" if name else info.name
                out[full] = _Planned(info, info.dtype,
                                     master if isinstance(master, torch.dtype)
                                     and not info.buffer else None)
    return out


def _prefixes(planned: Mapping[str, object], saved: Mapping[str, object]) -> dict[str, int]:
    """Each prefix under which tensors of the model are saved, with how many."""
    counts: dict[str, int] = {}
    for key in saved:
        parts = key.split(".")
        for i in range(len(parts)):
            if ".".join(parts[i:]) in planned:
                prefix = ".".join(parts[:i])
                counts[prefix + "." if prefix else ""] = counts.get(
                    prefix + "." if prefix else "", 0) + 1
    return counts


def _prefix(planned: Mapping[str, object], saved: Mapping[str, object]) -> str:
    """The prefix under which the most of the model's tensors are saved (the shortest on a
    tie)."""
    counts = _prefixes(planned, saved)
    return max(sorted(counts), key=lambda p: (counts[p], -len(p)), default="")


def _masters(planned: Mapping[str, _Planned], saved: Mapping[str, Saved]) -> dict[str, Saved]:
    """The master copies a checkpoint holds (`<prefix><name>.master`), by the name of the
    parameter they are the master of."""
    masters = {key[:-len(".master")]: value for key, value in saved.items()
               if key.endswith(".master")}
    prefix = _prefix(planned, masters)
    return {key[len(prefix):]: value for key, value in masters.items()
            if key.startswith(prefix)}


def checkpoint_findings(plan: PrecisionPlan, saved: Mapping[str, Saved], where: str,
                        merged: frozenset[str] = frozenset()) -> list[Finding]:
    """What loading the checkpoint `saved` (its tensors' dtypes and shapes, by key) into the
    plan's model would do, as findings; `merged` are keys that stand for several saved tensors
    a loader fuses (their shape is the pieces', not compared)."""
    planned = _planned(plan)
    counts = _prefixes(planned, saved)
    if planned and not counts:
        return [_foreign(planned, saved, where)]
    prefix = _prefix(planned, saved)
    out: list[Finding] = _ambiguous(counts, prefix, where)
    missing = [name for name, want in planned.items() if prefix + name not in saved
               and (want.info.tied is None or prefix + want.info.tied not in saved)]
    out += _compared(plan, planned, saved, prefix, where, merged)
    out += _missing(missing, where) + _unexpected(planned, saved, prefix, where)
    return out


def _compared(plan: PrecisionPlan, planned: Mapping[str, _Planned], saved: Mapping[str, Saved],
              prefix: str, where: str, merged: frozenset[str]) -> list[Finding]:
    """Each tensor of the model the checkpoint holds (under `prefix`), compared with what the
    plan keeps: shapes, kinds, dtypes, and masters where the plan keeps them."""
    masters = _masters(planned, saved)
    out: list[Finding] = []
    widened: dict[tuple[torch.dtype, torch.dtype], list[str]] = {}
    no_master: list[str] = []
    for name, want in planned.items():
        got = saved.get(prefix + name)
        if got is None or got.dtype is None:  # a dtype torch has none for (F4): not compared
            continue
        if got.shape != want.info.shape and prefix + name not in merged:
            out.append(_shape(name, got, want, where))
            continue
        out += _tensor(name, got.dtype, want, masters.get(name), where, widened, no_master)
    return out + _widened(widened, where) + _no_masters(plan, no_master, planned, where,
                                                        _indexed_masters(saved))


def _tensor(name: str, dtype: torch.dtype, want: _Planned, master: Saved | None, where: str,
            widened: dict[tuple[torch.dtype, torch.dtype], list[str]], no_master: list[str]
            ) -> list[Finding]:
    """One tensor saved in `dtype` (and its master, if saved) against what the plan keeps."""
    out = []
    if want.info.dtype.is_floating_point and dtype.is_floating_point:
        out += _compare(name, dtype, want.keep, where, widened)
    elif want.info.dtype.is_floating_point:
        out.append(_kind(name, dtype, want.keep, where))
    if want.master is not None:
        if master is not None and master.dtype is not None:
            out += _compare(f"{name} (its master)", master.dtype, want.master, where, {})
        elif master is None and not wider(dtype, want.master) and dtype != want.master:
            no_master.append(name)
    return out


def _module(name: str) -> str:
    return parent_name(name.split(" ")[0])


def _compare(name: str, dtype: torch.dtype, keep: torch.dtype, where: str,
             widened: dict[tuple[torch.dtype, torch.dtype], list[str]]) -> list[Finding]:
    if dtype == keep:
        return []
    if wider(dtype, keep):
        widened.setdefault((dtype, keep), []).append(name)
        return []
    return [Finding(
        "error", "checkpoint-narrowed", _module(name),
        f"{where} holds {name!r} in {dtype_name(dtype)}, and the plan keeps it in "
        f"{dtype_name(keep)}: a load widens it back to {dtype_name(keep)} with "
        f"{dtype_name(dtype)}'s rounding, so the bits the plan keeps it wide for are already "
        "gone.",
        "Load it from a checkpoint saved as the plan keeps it (the applied model's own "
        "state_dict, adapters.transformers.save_pretrained), or accept the rounding.")]


def _kind(name: str, dtype: torch.dtype, keep: torch.dtype, where: str) -> Finding:
    """A floating tensor of the model saved as integers, bools, complex or quantized values."""
    quantized = dtype in (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2)
    does = ("load_state_dict refuses it (\"Copying from quantized Tensor to non-quantized "
            "Tensor is not allowed\")" if quantized else
            "load_state_dict copies the imaginary part away, silently" if dtype.is_complex else
            "load_state_dict copies the stored numbers into it as values, silently (no scale: "
            "a quantized checkpoint's codes, not its weights)")
    return Finding(
        "error", "checkpoint-kind", _module(name),
        f"{where} holds {name!r} in {dtype_name(dtype)}, and the model holds it as a floating "
        f"tensor ({dtype_name(keep)}): {does}.",
        "Load it with the loader that wrote it (it dequantizes), or from a floating "
        "checkpoint.")


def _shape(name: str, got: Saved, want: _Planned, where: str) -> Finding:
    return Finding(
        "error", "checkpoint-shape", _module(name),
        f"{where} holds {name!r} with shape {list(got.shape)}, and the model's is "
        f"{list(want.info.shape)}: load_state_dict refuses it (\"size mismatch\").",
        "Load a checkpoint of this model's configuration.")


def _widened(widened: dict[tuple[torch.dtype, torch.dtype], list[str]], where: str
             ) -> list[Finding]:
    return [Finding(
        "info", "checkpoint-widened", _module(names[0]) if len(names) == 1 else "",
        f"{where} holds {len(names)} tensor(s) in {dtype_name(saved)} that the plan keeps in "
        f"{dtype_name(keep)} ({listing(names)}): a load rounds them into {dtype_name(keep)}, as "
        "planned.", "Nothing to do; the plan stores them narrower by design.",
        tuple(dict.fromkeys(_module(n) for n in names)))
        for (saved, keep), names in sorted(widened.items(), key=lambda kv: str(kv[0]))]


def _missing(missing: list[str], where: str) -> list[Finding]:
    if not missing:
        return []
    return [Finding(
        "warning", "checkpoint-missing", _module(missing[0]) if len(missing) == 1 else "",
        f"{where} lacks {len(missing)} tensor(s) of the model ({listing(missing)}): "
        "load_state_dict(strict=True) refuses it, and a strict=False load leaves them as "
        "initialized.", "Check that the checkpoint is of this model, or load with strict=False "
        "on purpose.", tuple(dict.fromkeys(_module(n) for n in missing)))]


def _indexed_masters(saved: Mapping[str, Saved]) -> list[Saved]:
    """Master copies keyed by the optimizer's parameter index (`state.3.master`: a `torch.save`
    of `optimizer.state_dict()`), which name no parameter."""
    return [v for k, v in saved.items()
            if k.endswith(".master") and k.rsplit(".", 2)[-2].isdigit()]


def _no_masters(plan: PrecisionPlan, names: list[str], planned: Mapping[str, _Planned],
                where: str, indexed: list[Saved]) -> list[Finding]:
    if not names:
        return []
    want = planned[names[0]].master
    assert want is not None
    if indexed:
        return [_by_index(names, want, indexed, where)]
    return [Finding(
        "warning", "checkpoint-no-masters", _module(names[0]) if len(names) == 1 else "",
        f"{where} holds no master copy for {len(names)} parameter(s) whose plan keeps "
        f"{dtype_name(want)} masters ({listing(names)}), only their narrower weights: a run "
        "resumed from it starts the masters from the saved weights, without what the masters "
        "held below the weights' precision.",
        "To resume exactly, save the optimizer's state (its masters) with the model; to start "
        "from the weights, nothing to do.", tuple(dict.fromkeys(_module(n) for n in names)))]


def _by_index(names: list[str], want: torch.dtype, indexed: list[Saved], where: str
              ) -> Finding:
    """Masters saved by index: their dtypes are compared as a whole, not by parameter."""
    dtypes = sorted({m.dtype for m in indexed if m.dtype is not None}, key=str)
    narrow = [d for d in dtypes if d != want and not wider(d, want)]
    said = (f"{where} holds {len(indexed)} master copies keyed by the optimizer's parameter "
            f"index (a torch.save of optimizer.state_dict()), in "
            f"{', '.join(map(dtype_name, dtypes)) or 'no dtype read'}, so they are not matched "
            f"to the {len(names)} parameter(s) whose plan keeps {dtype_name(want)} masters "
            f"({listing(names)})")
    if narrow:
        return Finding("error", "checkpoint-narrowed", "",
                       f"{said}; those in {', '.join(map(dtype_name, narrow))} are narrower than "
                       "the plan keeps them: a resumed run widens them with their rounding.",
                       "Save the optimizer's masters in the dtype the plan keeps them.",
                       tuple(dict.fromkeys(_module(n) for n in names)))
    return Finding("info", "checkpoint-masters-by-index", "",
                   f"{said}; none is narrower than the plan keeps them.",
                   "To have each compared by name, save with torch.distributed.checkpoint's "
                   "get_state_dict (its optimizer state is keyed by parameter name).",
                   tuple(dict.fromkeys(_module(n) for n in names)))


def _unexpected(planned: Mapping[str, _Planned], saved: Mapping[str, Saved], prefix: str,
                where: str) -> list[Finding]:
    extra = [k[len(prefix):] for k, v in saved.items() if k.startswith(prefix)
             and v.dtype is not None and v.dtype.is_floating_point
             and k[len(prefix):] not in planned and not k.endswith(".master")]
    if not extra:
        return []
    return [Finding(
        "warning", "checkpoint-unexpected", "",
        f"{where} holds {len(extra)} floating tensor(s) that are no tensor of the model "
        f"({listing(extra)}): load_state_dict(strict=True) refuses it.",
        "Check that the checkpoint is of this model (or another layout of it: renamed keys).")]


def _foreign(planned: Mapping[str, _Planned], saved: Mapping[str, Saved], where: str
             ) -> Finding:
    """A checkpoint that holds none of the model's tensors, under any prefix."""
    keys = list(saved)
    what = (" It is an optimizer's state_dict (its 'state' and 'param_groups'), which names "
            "parameters by their index, not a model's." if {k.split(".")[0] for k in keys}
            <= {"state", "param_groups"} and keys else "")
    return Finding(
        "error", "checkpoint-foreign", "",
        f"{where} holds none of the model's {len(planned)} tensor(s) under any prefix (it "
        f"holds {len(keys)} tensor(s): {listing(keys) if keys else 'none'}).{what} "
        "load_state_dict(strict=True) refuses it, and a strict=False load loads nothing.",
        "Check the model's own checkpoint (its state_dict, or the file holding it beside the "
        "optimizer's); for a checkpoint whose keys a loader renames (Hugging Face), pass the "
        "model, not its plan.")


def _ambiguous(counts: Mapping[str, int], prefix: str, where: str) -> list[Finding]:
    """The model's tensors saved as often under another prefix (an EMA copy beside them)."""
    others = sorted(p for p, n in counts.items() if n == counts[prefix] and p != prefix)
    if not others:
        return []
    return [Finding(
        "info", "checkpoint-prefix", "",
        f"{where} holds the model's tensors under {len(others) + 1} prefixes "
        f"({listing([prefix, *others])}); this check read those under {prefix!r}.",
        "Load the copy you mean by its prefix (state[...] before load_state_dict).")]


# -- PEFT adapters ------------------------------------------------------------------------------

#: the prefix PEFT gives every key of an adapter of a model (`PeftModel.base_model.model`)
_PEFT_PREFIX = "base_model.model."
#: the parts of a PEFT model's tensor names its saved adapter leaves out: a wrapped layer's
#: `base_layer`, the adapter's name ("default", `PeftModel.from_pretrained`'s), the copy
#: `modules_to_save` trains
_PEFT_PARTS = frozenset({"base_layer", "modules_to_save", "default"})
#: each LoRA tensor's dimension that is the base weight's ([out, in] for a Linear, [num, dim] for
#: an Embedding): (suffix, its dimension, the base weight's)
_LORA_DIMS = ((".lora_A.weight", 1, 1), (".lora_B.weight", 0, 0),
              (".lora_embedding_A", 1, 0), (".lora_embedding_B", 0, 1))


def _peft_model(planned: Mapping[str, object]) -> bool:
    """Whether the plan is of a model PEFT wrapped (a `PeftModel`, or a model after
    `inject_adapter_in_model`): its names hold PEFT's layers."""
    return any(name.startswith(_PEFT_PREFIX) or ".base_layer." in name for name in planned)


def _peft_name(name: str, peft: bool) -> str | None:
    """A tensor or module name of the plan's model as a PEFT adapter saves it; None for the
    frozen copy `modules_to_save` keeps beside the trained one (never saved)."""
    if not peft:
        return name
    parts = name.removeprefix(_PEFT_PREFIX).split(".")
    if "original_module" in parts:
        return None
    return ".".join(p for p in parts if p not in _PEFT_PARTS)


def _adapter_key(key: str) -> str:
    """A saved adapter key, as `_peft_name` gives the model's names."""
    return ".".join(p for p in key.removeprefix(_PEFT_PREFIX).split(".") if p != "base_layer")


def adapter_findings(plan: PrecisionPlan, saved: Mapping[str, Saved], config: Mapping[str, Any],
                     where: str) -> list[Finding]:
    """What `PeftModel.from_pretrained(model, path)` would load of a PEFT adapter (`saved`, with
    its `adapter_config.json` as `config`) into the plan's model: the tensors of the model it
    holds (`modules_to_save`, a trained embedding) compared as any checkpoint's; its own adapter
    tensors compared where the plan's model holds them (a `PeftModel`), else read as weights
    added beside the modules they adapt, checked against those modules' shapes."""
    planned = _planned(plan)
    peft = _peft_model(planned)
    names: dict[str, str] = {}
    for name in planned:
        form = _peft_name(name, peft)
        if form is not None:
            names.setdefault(form, name)
    ours: dict[str, Saved] = {}
    added: dict[str, Saved] = {}
    for key, value in saved.items():
        form = _adapter_key(key)
        if form in names:
            ours[names[form]] = value
        else:
            added[form] = value
    out = _compared(plan, planned, ours, "", where, frozenset())
    trained = [n for n in planned if peft and "default" in n.split(".") and n not in ours]
    out += _missing(trained, where)
    return out + _added(plan, planned, added, config, where, peft)


def _adapted(modules: Mapping[str | None, str], key: str, targets: object) -> str | None:
    """The module of the plan's model an adapter tensor is added to: the longest module name
    its key starts with (of `modules`, by their names as PEFT saves them), followed by the
    adapter's own one or two parts (`lora_A.weight`, `lora_embedding_A`), and named by the
    config's `target_modules` where it lists names (PEFT's rule: the name, or its last parts)."""
    parts = key.split(".")
    for i in range(len(parts) - 1, max(len(parts) - 3, 0), -1):
        module = modules.get(".".join(parts[:i]))
        if module is not None and not parts[i].isdigit() and _targeted(parts[:i], targets):
            return module
    return None


def _targeted(parts: list[str], targets: object) -> bool:
    if not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        return True  # a pattern (not matched here: a config's regex is not run), or none
    name = ".".join(parts)
    return any(name == t or name.endswith("." + t) for t in targets)


def _added(plan: PrecisionPlan, planned: Mapping[str, _Planned], added: Mapping[str, Saved],
           config: Mapping[str, Any], where: str, peft: bool) -> list[Finding]:
    """The adapter's own tensors, which the plan's model does not hold: where they go."""
    if not added:
        return []
    kind = str(config.get("peft_type", "PEFT"))
    if "num_virtual_tokens" in config:  # prompt learning: weights of virtual tokens, no module
        return [_adapter_info(kind, list(added), [], added, where)]
    names = {_peft_name(name, peft): name for name in plan if name}
    modules: dict[str, str] = {}
    homeless = []
    for key in added:
        module = _adapted(names, key, config.get("target_modules"))
        if module is None:
            homeless.append(key)
        else:
            modules[key] = module
    if not modules:
        return [_foreign_adapter(kind, homeless, len(planned), where)]
    out = [_adapter_info(kind, list(modules), list(dict.fromkeys(modules.values())), added,
                         where)]
    out += _lora_shapes(planned, modules, added, config, where)
    if homeless:
        out.append(Finding(
            "warning", "checkpoint-unexpected", "",
            f"{where} holds {len(homeless)} {kind} adapter tensor(s) for modules the model does "
            f"not have ({listing(homeless)}): PeftModel.from_pretrained loads adapters with "
            "strict=False and drops them without a word.",
            "Check that the adapter was trained on this model's configuration (its number of "
            "layers)."))
    return out


def _adapter_info(kind: str, keys: list[str], modules: list[str], added: Mapping[str, Saved],
                  where: str) -> Finding:
    dtypes = sorted({dtype_name(added[k].dtype) for k in keys if added[k].dtype is not None})
    on = (f" on {len(modules)} of the model's modules ({listing(modules)})" if modules else
          " (weights of virtual tokens, on no module)")
    return Finding(
        "info", "checkpoint-adapter", modules[0] if len(modules) == 1 else "",
        f"{where} is a PEFT {kind} adapter (its adapter_config.json): {len(keys)} tensor(s) "
        f"in {', '.join(dtypes) or 'no dtype torch has'}{on}, which PeftModel.from_pretrained("
        "model, path) adds beside them. They are no tensors of this model, so the plan keeps no "
        "dtype for them to compare with.",
        "Load it with peft's PeftModel.from_pretrained (or model.load_adapter), not "
        "load_state_dict; to compare its tensors with a plan, check the PeftModel it makes.",
        tuple(modules))


def _foreign_adapter(kind: str, keys: list[str], count: int, where: str) -> Finding:
    return Finding(
        "error", "checkpoint-foreign", "",
        f"{where} is a PEFT {kind} adapter whose {len(keys)} tensor(s) adapt no module of the "
        f"model ({listing(keys)}; the model has {count} tensor(s)): PeftModel.from_pretrained "
        "refuses it (\"Target modules ... not found in the base model\").",
        "Check the adapter of this model (its base_model_name_or_path).")


def _lora_shapes(planned: Mapping[str, _Planned], modules: Mapping[str, str],
                 added: Mapping[str, Saved], config: Mapping[str, Any], where: str
                 ) -> list[Finding]:
    """LoRA's A and B against the weight they adapt: A's input size is the weight's, B's output
    size is (transposed where `fan_in_fan_out`, as GPT-2's Conv1D keeps its weight)."""
    flip = bool(config.get("fan_in_fan_out"))
    out = []
    for key, module in modules.items():
        base = planned.get(f"{module}.weight")
        shape = added[key].shape
        for suffix, dim, base_dim in _LORA_DIMS:
            if not (key.endswith(suffix) and base is not None and len(base.info.shape) == 2
                    and len(shape) == 2):
                continue
            want = base.info.shape[1 - base_dim if flip and "embedding" not in suffix
                                   else base_dim]
            if shape[dim] != want:
                out.append(Finding(
                    "error", "checkpoint-shape", module,
                    f"{where} holds {key!r} with shape {list(shape)}, and the weight it adapts "
                    f"is {list(base.info.shape)}: size {shape[dim]} where {want} fits. "
                    "PeftModel.from_pretrained refuses it (\"size mismatch\").",
                    "Load an adapter trained on this model's configuration."))
    return out


#: how a checkpoint's keys become the model's tensor names for a loader that renames them, by
#: the package of the model's class: "module:function", imported only for such a model (as
#: `check_backend.REGISTRY` names backends). The function takes the model and the keys, and
#: gives each key the loader reads into another name that name, and whether several keys are
#: fused into it.
KEY_MAPS: dict[str, str] = {
    "transformers": "precision_annot.adapters.transformers:checkpoint_names",
}


def loaded_keys(model: object, saved: Mapping[str, Saved]
                ) -> tuple[dict[str, Saved], frozenset[str]]:
    """`saved` with its keys as the model's loader reads them (`KEY_MAPS`), and the names that
    several saved tensors are fused into (each seen in the narrowest dtype of its pieces)."""
    where = KEY_MAPS.get(type(model).__module__.partition(".")[0])
    if where is None:
        return dict(saved), frozenset()
    module_name, _, attribute = where.partition(":")
    names = getattr(importlib.import_module(module_name), attribute)(model, list(saved))
    out: dict[str, Saved] = {}
    merged: set[str] = set()
    for key, value in saved.items():
        name, fused = names.get(key, (key, False))
        if fused:
            merged.add(name)
        held = out.get(name)
        if held is None or (held.dtype is not None and value.dtype is not None
                            and wider(held.dtype, value.dtype)):
            out[name] = value
    return out, frozenset(merged)


# -- the phase of a precision schedule -----------------------------------------------------------

def phase_findings(saved: list[SavedPhase], where: str, subject: Subject) -> list[Finding]:
    """One info per schedule state the checkpoint holds (the same state held twice, by the
    optimizer and by Lightning's callback, is one): the step and phase it was saved in, and
    its phases; where the model is given and the phase's spec resolves on it, whether the plan
    checked is that phase's."""
    held: dict[tuple[int, int, tuple[tuple[int, str], ...]], dict[str, list[str]]] = {}
    for state in saved:
        keys = held.setdefault((state.step, state.phase, state.phases), {})
        keys.setdefault(state.file, []).append(state.key)
    return [_phase(step, phase, phases, places, where, subject)
            for (step, phase, phases), places in held.items()]


def _phase(step: int, phase: int, phases: tuple[tuple[int, str], ...],
           places: Mapping[str, list[str]], where: str, subject: Subject) -> Finding:
    start, spec = phases[phase]
    listed = ", ".join(f"{i}: {text!r} from step {first}" for i, (first, text) in
                       enumerate(phases))
    mapping = "{" + ", ".join(f"{first}: {text!r}" for first, text in phases) + "}"
    other = _other_plan(subject, spec)
    said = "" if other is None else (
        f" The plan checked is not that phase's: {other}; the comparisons of this check are "
        f"with the plan checked, and a run resumed under the schedule loads into phase "
        f"{phase}'s.")
    fix = (f"To resume in it, build precision_annot.schedule(model, {mapping}, optimizer=...) "
           "(Lightning: ScheduleCallback; the Hugging Face Trainer: adapters.transformers."
           "schedule_callback) before loading: the optimizer's load_state_dict goes to that "
           "phase first.")
    if other is not None:
        fix += (f" To compare the checkpoint with that phase's plan, check "
                f"resolve(model, default={spec!r}).")
    return Finding(
        "info", "checkpoint-phase", "",
        f"{where} was saved at step {step} in phase {phase} of a precision schedule (from "
        f"step {start}: {spec!r}), as {_held(places)} says; its phases: {listed}."
        f"{said}", fix)


def _held(places: Mapping[str, list[str]]) -> str:
    """Where a schedule's state is held: "'optimizer.pt' under key 'x'", "'a.ckpt' under keys
    'x' and 'y'"."""
    return " and ".join(
        repr(file) + ("" if keys == [""] else f" under key{'s' if len(keys) > 1 else ''} "
                      + " and ".join(map(repr, keys))) for file, keys in places.items())


def _other_plan(subject: Subject, spec: str) -> str | None:
    """How the plan checked differs from the phase's (its spec resolved on the model, as the
    schedule applies it), None where they agree or this cannot say (no model, a phase given as
    a plan, a spec `resolve` refuses)."""
    if subject.model is None or spec == "<plan>":
        return None
    try:
        with warnings.catch_warnings():  # a default the annotations override: said by resolve
            warnings.simplefilter("ignore")
            phase_plan = resolve(subject.model, default=spec)
    except ValueError:
        return None
    differ = [name for name, entry in subject.plan.items()
              if name in phase_plan and entry.policy != phase_plan[name].policy]
    if not differ:
        return None
    first = subject.plan[differ[0]].policy
    return (f"{len(differ)} module(s) ({listing([n or '(root)' for n in differ])}) hold "
            f"another policy (the first {str(first)!r}, the phase's "
            f"{str(phase_plan[differ[0]].policy)!r})")


class CheckpointChecks(CheckBackend):
    """`check(model_or_plan, "checkpoint", {"path": ...})`: a DCP directory, safetensors files
    (or their index), or a `torch.save` file, read without its tensor data."""

    name = "checkpoint"
    keys = ("path",)
    trains = False

    def options(self, config: Any) -> Any:
        options = super().options(config)
        path = None if options is None else options.get("path")
        if not isinstance(path, (str, os.PathLike)):
            raise ValueError(
                "check: backend='checkpoint' needs config={'path': ...}, the checkpoint to read "
                "(a DCP directory, a .safetensors file or index, or a torch.save file). "
                f"Received: config={config!r}")
        return options

    def run(self, given: Subject, options: Any) -> Checked:
        path = options["path"]
        where = f"The checkpoint {str(path)!r}"
        adapter = adapter_config(path)
        if adapter is not None:
            return Checked(adapter_findings(given.plan, saved_tensors(path), adapter, where)
                           + phase_findings(saved_phases(path), where, given))
        saved, merged = loaded_keys(given.model, saved_tensors(path))
        beside = optimizer_beside(path)
        if beside is not None:  # the Hugging Face Trainer's optimizer.pt: its masters
            saved.update({f"optimizer.{key}": value for key, value in
                          saved_tensors(beside).items() if key.endswith(".master")})
        return Checked(checkpoint_findings(given.plan, saved, where, merged)
                       + phase_findings(saved_phases(path), where, given))


CHECKS = CheckpointChecks()
