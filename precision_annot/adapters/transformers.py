"""Hugging Face transformers: fp32 islands from a model's own lists, FSDP units, and a
checkpoint round trip that keeps the islands exact.

- `rules(model)` turns `_keep_in_fp32_modules` and `_keep_in_fp32_modules_strict` into
  `annotate` rules, matched the way transformers matches them when it loads a checkpoint: each
  entry is a pattern (`*` is any text) searched in each parameter's and buffer's full name.
  A module is kept in fp32 when the tensors it holds match (see `HFKeepInFP32`).
- `units(model)` turns `_no_split_modules` into the `units=` of `fsdp.fully_shard`.
- `save_pretrained` writes the plan beside the checkpoint; `from_pretrained` loads the model,
  applies that plan, and reads every tensor the plan stores wider than it was loaded back from
  the checkpoint files, so fp32 islands in a bf16 checkpoint come back bit for bit.
- `fp8_rules(model)` runs the Linear GEMMs in fp8 and keeps out of it what DeepSeek-V3's fp8
  recipe keeps out: the embeddings, the LM head, the MoE routers and gates, the norms.
- `keep_in_fp32_patterns(plan)` gives the plan's fp32 modules as `_keep_in_fp32_modules_strict`
  entries, for a model class of your own that should load them in fp32 through transformers
  alone.

transformers is imported only when a function here needs it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from precision_annot._src.annotation import annotate
from precision_annot._src.checkpoints.loading import narrowed, warn_narrowed
from precision_annot._src.dtypes import FP8_RECIPES, bf16, dtype_name, fp16, fp32, to_dtype, wider
from precision_annot._src.float8 import plain_class
from precision_annot._src.plan import PrecisionPlan, parent_name
from precision_annot._src.resolution import resolve
from precision_annot._src.runtime import apply, plan_of
from precision_annot._src.schedule import (
    Phase,
    Schedule,
    phases_of,
    schedule,
    unwrapped_optimizer,
)
from precision_annot._src.update.optimizer import PlanOptimizer
from precision_annot._src.watching import watch as make_watch

__all__ = ["FP8Linear", "HFKeepInFP32", "fp8_rules", "from_pretrained", "keep_in_fp32_patterns",
           "router_names", "rules", "save_pretrained", "schedule_callback", "units",
           "watch_callback"]

M = TypeVar("M", bound=nn.Module)
PLAN_FILE = "precision_plan.json"


@dataclasses.dataclass(frozen=True)
class HFKeepInFP32:
    """A selector for `annotate`: the modules that hold the tensors one entry of
    `_keep_in_fp32_modules` names, as transformers matches it (`*` is any text, searched
    anywhere in each parameter's or buffer's full name).

    transformers keeps single tensors in fp32; a plan keeps whole modules. A module is selected
    when every floating-point tensor in its subtree matches (T5's `wo` layers, BLIP-2's
    `qformer`), or when it holds a matching tensor itself and its submodules hold none: then
    its other tensors are kept in fp32 with it (DeepSeek-V3's router keeps its weight in fp32
    beside its `e_score_correction_bias`). Wider than transformers, never narrower.

    A matching tensor on a module whose submodules hold tensors of their own (RWKV's
    `time_decay`, an attention's `sinks` beside its projections, a mixture's
    `e_score_correction_bias` beside its experts) is not selected so; `beside=True` selects
    exactly those modules, which `rules` stores in fp32 with their submodules.
    """

    pattern: str
    beside: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "_regex", re.compile(self.pattern.replace("*", ".*")))

    def matches(self, tensor_name: str) -> bool:
        """Whether transformers keeps the tensor of this full name in fp32."""
        regex: re.Pattern[str] = self._regex  # type: ignore[attr-defined]
        return regex.search(tensor_name) is not None

    def __call__(self, name: str, module: nn.Module) -> bool:
        holds = any(map(self.matches, _tensor_names(name, module, recurse=False)))
        children_hold = any(_tensor_names("", child, recurse=True) for child in module.children())
        subtree = _tensor_names(name, module, recurse=True)
        whole = bool(subtree) and all(map(self.matches, subtree))
        if self.beside:
            return holds and children_hold and not whole
        return (holds and not children_hold) or whole

    def __repr__(self) -> str:
        return f"keep_in_fp32({self.pattern!r}{', beside=True' if self.beside else ''})"


def _tensor_names(name: str, module: nn.Module, *, recurse: bool) -> list[str]:
    """Full names of the floating-point parameters and buffers of `module` (and, with
    `recurse`, of its subtree)."""
    prefix = f"{name}." if name else ""
    tensors = [*module.named_parameters(recurse=recurse), *module.named_buffers(recurse=recurse)]
    return [prefix + n for n, t in tensors if t.is_floating_point()]


def rules(model: nn.Module, dtype: torch.dtype | str | None = None
          ) -> list[tuple[HFKeepInFP32 | str, str]]:
    """`annotate` rules that keep the model's own fp32 modules in fp32.

    Args:
        model: a transformers `PreTrainedModel`.
        dtype: the low dtype the model will run in. transformers keeps
            `_keep_in_fp32_modules` in fp32 only for fp16 and `_keep_in_fp32_modules_strict`
            for fp16 and bf16; the same choice is made here. None takes both lists.
            (Default: None)

    Returns:
        `[(selector, "fp32,output=fp32"), ...]`, for `annotate(model, rules(model))`: kept
        modules compute and store in fp32 and hand their output back in fp32, as they do in
        transformers, where the fp32 output flows on (handed back in fp16 instead, T5's
        overflowing `wo` output becomes inf). One rule per entry that
        selects a module of this model (entries for parts this configuration does not build,
        such as the experts of a dense variant, are left out). A kept tensor on a module whose
        submodules hold tensors of their own (an attention's `sinks`, a mixture's
        `e_score_correction_bias` beside its experts) gets a
        `(HFKeepInFP32(entry, beside=True), "storage=fp32")` rule: that module is stored in
        fp32 and computes as the rest of the model; with `dtype` given, each of its other
        submodules gets `(name, "storage=<dtype>")`, so they stay as transformers stores them.
        Every tensor transformers keeps in fp32 is fp32 in the plan. Empty when the model lists
        nothing.

    Warns:
        UserWarning: when, with `dtype` None, such modules are stored in fp32 with their
            submodules (wider than transformers, which keeps the single tensors), naming the
            tensors and the parameters widened.

    Example:
        >>> from precision_annot import annotate  # doctest: +SKIP
        >>> annotate(t5, rules(t5))  # T5 keeps its `wo` layers in fp32  # doctest: +SKIP
    """
    modules = list(model.named_modules())
    selectors = [HFKeepInFP32(p) for p in _kept_patterns(model, dtype)]
    chosen, kept = _selected(modules, selectors, KEPT, [])
    beside, holders = _selected(modules, [HFKeepInFP32(s.pattern, beside=True)
                                          for s in selectors], "storage=fp32", kept)
    chosen += beside  # kept tensors beside submodules: their modules stored in fp32
    if dtype is not None:  # their other submodules stay in the dtype transformers loads
        chosen += [(n, f"storage={dtype_name(to_dtype(dtype, field='dtype'))}")
                   for n in _besides(dict(modules), holders, kept)]
    else:
        _warn_widened(model, [t for n, m in modules for t in _tensor_names(n, m, recurse=False)
                              if any(s.matches(t) for s in selectors) and not _under(t, kept)],
                      sorted(set(holders)))
    return chosen


def _selected(modules: list[tuple[str, nn.Module]], selectors: list[HFKeepInFP32], spec: str,
              kept: list[str]) -> tuple[list[tuple[HFKeepInFP32 | str, str]], list[str]]:
    """One `(selector, spec)` rule per selector that picks a module outside `kept`, and the
    modules picked."""
    rules: list[tuple[HFKeepInFP32 | str, str]] = []
    picked: list[str] = []
    for selector in selectors:
        selected = [n for n, m in modules if selector(n, m) and not _under(n, kept)]
        if selected:
            rules.append((selector, spec))
            picked += selected
    return rules, picked


def _besides(named: dict[str, nn.Module], holders: list[str], kept: list[str]) -> list[str]:
    """The children of the holders that hold tensors and are neither kept nor holders."""
    out = []
    for holder in dict.fromkeys(holders):
        for cname, child in named[holder].named_children():
            full = f"{holder}.{cname}" if holder else cname
            if (_tensor_names(full, child, recurse=True) and not _under(full, kept)
                    and full not in holders):
                out.append(full)
    return out


def _under(name: str, modules: list[str]) -> bool:
    """Whether `name` is one of `modules` or inside one."""
    return any(m == "" or name == m or name.startswith(m + ".") for m in modules)


def _kept_patterns(model: nn.Module, dtype: torch.dtype | str | None) -> list[str]:
    """The model's keep-in-fp32 entries transformers applies for `dtype` (both lists for
    None), each once."""
    low = None if dtype is None else to_dtype(dtype, field="dtype")
    patterns: list[str] = []
    if low is None or low == fp16:
        patterns += sorted(getattr(model, "_keep_in_fp32_modules", None) or [])
    patterns += sorted(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    return list(dict.fromkeys(patterns))


def _warn_widened(model: nn.Module, tensors: list[str], holders: list[str]) -> None:
    """Kept tensors beside submodules: their modules are stored in fp32, submodules included."""
    if not tensors:
        return
    named = dict(model.named_modules())
    outer = [h for h in holders if not _under(parent_name(h), holders) or h == ""]
    widened = sum(p.numel() for h in outer for p in named[h].parameters()
                  if p.is_floating_point())
    shapes = sorted({re.sub(r"\.\d+(?=\.|$)", ".*", h) for h in outer})
    warnings.warn(
        f"rules: transformers keeps {len(tensors)} tensor(s) of this model in fp32 on modules "
        f"whose submodules hold tensors of their own: {', '.join(repr(t) for t in tensors)}. "
        f"A plan keeps whole modules, so {len(outer)} module(s) ({', '.join(shapes[:4])}"
        f"{', ...' if len(shapes) > 4 else ''}) are stored in fp32 with their submodules "
        f"({widened:,} parameters, wider than transformers stores them) and compute as the "
        "rest of the model. Pass the dtype the model will run in, rules(model, dtype='bf16'), "
        "to keep their submodules in it.", UserWarning, stacklevel=3)


#: what `rules` gives a kept module: fp32, handing its output back in fp32, as transformers
#: does: it runs a kept module on fp32 weights and never casts its output back, so the fp32
#: output flows on (T5's `wo` feeds a residual sum that type promotion keeps in fp32)
KEPT = "fp32,output=fp32"

#: a router's name beside its block's experts, and the gates that need no experts beside them
_ROUTER_NAMES = frozenset({"gate", "router"})
_GATE_NAMES = frozenset({"shared_expert_gate"})


def _declared_routers(named: dict[str, nn.Module]) -> list[tuple[type | None, str | None,
                                                                   str | None]]:
    """What the model's classes declare produces router logits: transformers' own
    `_can_record_outputs["router_logits"]` (an `OutputRecorder`, or a class), as (class, class
    name, layer name)."""
    found: list[tuple[type | None, str | None, str | None]] = []
    for module in named.values():
        declared = getattr(type(module), "_can_record_outputs", None)
        if not isinstance(declared, dict):
            continue
        for key, value in declared.items():
            if "router" not in str(key):
                continue
            for item in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(item, type):
                    found.append((item, None, None))
                else:
                    found.append((getattr(item, "target_class", None),
                                  getattr(item, "class_name", None),
                                  getattr(item, "layer_name", None)))
    return found


def router_names(model: nn.Module | dict[str, nn.Module]) -> list[str]:
    """The MoE routers and gates of a model, whatever their class (in transformers 5 a router
    holds its own weight, as `MixtralTopKRouter` does, rather than an `nn.Linear`):

    - what transformers declares: the modules whose outputs its `_can_record_outputs`
      records as `router_logits` (by class, class name or layer name);
    - by role: a module named `gate` or `router` beside its block's `experts`, and
      Qwen2-MoE's `shared_expert_gate`.

    A dense MLP's `gate_proj` is not a router, and neither is a layer whose width happens to
    equal the number of experts."""
    named = model if isinstance(model, dict) else dict(model.named_modules())
    declared = _declared_routers(named)
    out = []
    for name, module in named.items():
        if not name:
            continue
        parent, _, leaf = name.rpartition(".")
        beside_experts = leaf in _ROUTER_NAMES and f"{parent + '.' if parent else ''}experts" \
            in named
        if beside_experts or leaf in _GATE_NAMES or any(
                _declares(d, name, module) for d in declared):
            out.append(name)
    return out


def _declares(declared: tuple[type | None, str | None, str | None], name: str,
              module: nn.Module) -> bool:
    """Whether one `_can_record_outputs` entry (class, class name, layer name; any may be
    None, not all) names this module."""
    cls, class_name, layer = declared
    return bool((cls is None or isinstance(module, cls))
                and (class_name is None or type(module).__name__.endswith(class_name))
                and (layer is None or layer in name) and (cls or class_name or layer))


@dataclasses.dataclass(frozen=True)
class FP8Linear:
    """A selector for `annotate`: the Linear layers whose GEMMs can run in fp8 (a plain
    nn.Linear forward, both dimensions divisible by 16, which fp8 GPU kernels require), except
    the named modules and the Linear layers inside them."""

    exclude: frozenset[str] = frozenset()

    def __call__(self, name: str, module: nn.Module) -> bool:
        cls = plain_class(module)  # a layer apply converted is still the user's Linear
        return (isinstance(module, nn.Linear) and cls.forward is nn.Linear.forward
                and module.in_features % 16 == 0 and module.out_features % 16 == 0
                and not any(name == e or name.startswith(e + ".") for e in self.exclude))

    def __repr__(self) -> str:
        return f"FP8Linear(exclude={sorted(self.exclude)})"


def fp8_rules(model: nn.Module, recipe: str = "fp8-rowwise", high: torch.dtype | str = "bf16"
              ) -> list[tuple[Any, str]]:
    """`annotate` rules for DeepSeek-V3's fp8 recipe: the GEMMs of the Linear layers in fp8;
    the embeddings and norms (not Linear layers), the LM head (the output embeddings) and the
    MoE routers and gates in high precision.

    Args:
        model: a transformers `PreTrainedModel` (any model: the LM head is then found only
            through `get_output_embeddings`, the routers by name).
        recipe: the fp8 compute: "fp8", "fp8-rowwise", "fp8-rowwise-gw-hp" or "mxfp8".
            (Default: "fp8-rowwise")
        high: the compute of the LM head; routers and gates compute in fp32, as DeepSeek-V3's
            do. (Default: bf16)

    Returns:
        `[(selector, policy), ...]` for `annotate(model, fp8_rules(model))`: fp8 on every
        eligible Linear layer (`FP8Linear`), then the LM head and the routers by name.

    Example:
        >>> from precision_annot import annotate  # doctest: +SKIP
        >>> annotate(llama, fp8_rules(llama))  # doctest: +SKIP
    """
    key = recipe.strip().lower() if isinstance(recipe, str) else recipe
    if key not in FP8_RECIPES:
        raise ValueError(f"fp8_rules: recipe must be one of {', '.join(map(repr, FP8_RECIPES))}."
                         f" Received: recipe={recipe!r}")
    high_dtype = to_dtype(high, field="high")
    named = dict(model.named_modules())
    by_id = {id(m): n for n, m in named.items()}
    head = None
    get_head = getattr(model, "get_output_embeddings", None)
    if callable(get_head):
        found = get_head()
        head = by_id.get(id(found)) if isinstance(found, nn.Module) else None
    routers = router_names(named)
    keep = frozenset([*routers, *([head] if head else [])])
    fused = [n for n, m in named.items() if any(
        p is not None and p.is_floating_point() and p.dim() >= 3 for p in m._parameters.values())]
    if fused:
        warnings.warn(
            f"fp8_rules: {len(fused)} module(s) hold their weights as 3-D tensors (fused MoE "
            f"experts, e.g. {fused[0]!r}, {type(named[fused[0]]).__name__}): their grouped GEMMs "
            "are not nn.Linear layers, so fp8 does not reach them and they run in their "
            "high-precision compute.", UserWarning, stacklevel=2)
    out: list[tuple[Any, str]] = [(FP8Linear(keep), f"compute={key}")]
    if head:
        out.append((head, f"compute={dtype_name(high_dtype)}"))
    out.extend((name, "compute=fp32") for name in routers)
    return out


def watch_callback(trainer: Any, every: int = 100, *, path: str | os.PathLike[str] | None = None,
                   prefix: str = "precision") -> Any:
    """Add `precision_annot.watch` to a Hugging Face `Trainer`: every `every`-th step, each
    module's output's and gradient's largest magnitude and margin (the share of its dtype's
    largest value) go into the step's logs, which the Trainer hands to every integration
    `report_to` names (TensorBoard, W&B, ...). The callback is put first among the Trainer's,
    so that those integrations see the numbers in the logs they write. A run resumed from a
    checkpoint goes on counting from its step. A Trainer with `torch_compile=True` is refused
    (its compiled steps run no module hook).

    Args:
        trainer: a `transformers.Trainer`, before `train()`.
        every: measure one step in this many. (Default: 100)
        path: also append each sampled step to this JSON-lines file. (Default: None)
        prefix: the metrics' prefix. (Default: "precision")

    Returns:
        The callback; its `watch` attribute holds the `precision_annot.watch` of the run.

    Example:
        >>> cb = watch_callback(trainer, every=50)  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
    """
    from transformers import TrainerCallback

    if getattr(getattr(trainer, "args", None), "torch_compile", False):
        raise ValueError(
            "watch_callback: the Trainer compiles the model (TrainingArguments(torch_compile="
            "True)), and compiled code runs no module hook, so watch would see nothing of its "
            "steps. Watch a run with torch_compile=False, or watch your own loop, calling the "
            "uncompiled model while watch.sampling is True (see the watch guide). Received: "
            "trainer.args.torch_compile=True")

    class WatchCallback(TrainerCallback):
        def __init__(self) -> None:
            self.watch: Any = None
            self.pending: dict[str, float] = {}

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            model: nn.Module = kwargs["model"]
            # a resumed run goes on from the checkpoint's step: the same numbers, the same
            # steps sampled
            self.watch = make_watch(model, every=every, path=None if path is None else Path(path),
                                    start=int(state.global_step))

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            record = self.watch.step() if self.watch is not None else None
            if record is not None:
                self.pending = record.metrics(prefix)
                control.should_log = True  # so this step's logs carry them
            return control

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
                   **kwargs: Any) -> None:
            if logs is not None and self.pending:
                logs.update(self.pending)  # before the integrations: this callback is first
                self.pending = {}

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.watch is not None:
                self.watch.close()

    callback = WatchCallback()
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback


def schedule_callback(trainer: Any, phases: dict[int | float, Phase], *,
                      total_steps: int | None = None) -> Any:
    """Run `precision_annot.schedule` in a Hugging Face `Trainer`: the phase of step 0 is
    applied to `trainer.model` now (before `train()` builds or loads anything), and after each
    optimizer step (`on_step_end`) the next phase is applied where it starts. A run resumed
    from a checkpoint goes to the phase of the checkpoint's step before its first step. Pass a
    `precision_annot.optimizer` as `Trainer(optimizers=(optimizer, None))`: an optimizer the
    Trainer builds itself is refused when training begins.

    Args:
        trainer: a `transformers.Trainer`, before `train()`.
        phases: as `precision_annot.schedule` takes them; fractions are of `total_steps`.
        total_steps: the optimizer steps of the run, for fractions. (Default: the Trainer's
            `args.max_steps` where it is set, else the steps it computes from
            `num_train_epochs` when training begins)

    Returns:
        The callback; its `schedule` attribute holds the `Schedule`.

    Example:
        >>> cb = schedule_callback(trainer, {0: "bf16-master", 0.9: "32-true"})  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
    """
    from transformers import TrainerCallback

    if total_steps is None and getattr(getattr(trainer, "args", None), "max_steps", -1) > 0:
        total_steps = int(trainer.args.max_steps)
    later = total_steps is None and any(isinstance(k, float) and k for k in phases)
    first = ({k: v for k, v in phases.items() if not isinstance(k, float) or not k} if later
             else phases)
    if later:  # every phase checked now; fractions placed when training begins
        phases_of(phases, 10**9)
    given = getattr(trainer, "optimizer", None)
    sched = schedule(trainer.model, first, total_steps=total_steps, optimizer=given)

    class ScheduleCallback(TrainerCallback):
        def __init__(self) -> None:
            self.schedule: Schedule = sched

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if later:  # the steps the Trainer computed from num_train_epochs
                self.schedule.phases = phases_of(phases, int(state.max_steps))
            _require_planned(kwargs.get("optimizer"), self.schedule)
            self.schedule.seek(int(state.global_step))  # a resumed run: the saved step's phase

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            self.schedule.step()
            return control

    callback = ScheduleCallback()
    trainer.add_callback(callback)
    return callback


def _require_planned(optimizer: Any, sched: Schedule) -> None:
    """The Trainer's optimizer must be one `precision_annot.optimizer` built: it follows
    each switch (masters, moments and their formats)."""
    if optimizer is None:
        return
    inner = unwrapped_optimizer(optimizer)
    if not isinstance(inner, PlanOptimizer):
        raise ValueError(
            "schedule_callback: the Trainer's optimizer must be one precision_annot.optimizer "
            "built (it follows each switch: masters, moments and their formats); pass it as "
            "Trainer(optimizers=(precision_annot.optimizer(model, torch.optim.AdamW, lr=...), "
            f"None)). Received: the Trainer's own {type(inner).__name__}")
    if sched.optimizer is None:
        sched.optimizer = inner
        sched.attach()


def units(model: nn.Module) -> list[type[nn.Module]]:
    """The classes of `_no_split_modules` found in `model`, for
    `fsdp.fully_shard(model, units=units(model))`: one FSDP unit per transformer block."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    found = {type(m) for m in model.modules() if type(m).__name__ in names}
    return sorted(found, key=lambda c: c.__name__)


def keep_in_fp32_patterns(plan: PrecisionPlan) -> list[str]:
    """The plan's fp32-storage modules that hold parameters, outermost only, as patterns that
    transformers' loader matches exactly: set them as a model class's
    `_keep_in_fp32_modules_strict` to load those weights in fp32 with `from_pretrained`."""
    chosen: list[str] = []
    for name, entry in plan.items():
        if entry.policy.storage != fp32 or not name:
            continue
        if any(name == c or name.startswith(c + ".") for c in chosen):
            continue
        if entry.params or any(n.startswith(name + ".") and plan[n].params for n in plan):
            chosen.append(name)
    return ["^" + re.escape(name) + r"\." for name in chosen]


def save_pretrained(model: nn.Module, directory: str | os.PathLike[str],
                    plan: PrecisionPlan | None = None, **kwargs: Any) -> None:
    """`model.save_pretrained(directory, **kwargs)`, with the plan written beside it as
    `precision_plan.json`. The plan defaults to the one `apply` made real on the model."""
    if not callable(getattr(model, "save_pretrained", None)):
        raise TypeError(
            "save_pretrained needs a transformers model (a PreTrainedModel, which has "
            f"save_pretrained). Received: model of type {type(model).__name__}. For any other "
            "model, save its state_dict and the plan yourself: torch.save(model.state_dict(), "
            "...) and Path(...).write_text(precision_annot.applied_plan(model).to_json()).")
    plan = plan or plan_of(model)
    model.save_pretrained(directory, **kwargs)  # type: ignore[operator]
    Path(directory, PLAN_FILE).write_text(plan.to_json())


def from_pretrained(model_class: type[M], directory: str | os.PathLike[str],
                    plan: PrecisionPlan | None = None, **kwargs: Any) -> M:
    """Load a checkpoint with transformers, apply its plan, and restore exactly what the plan
    stores wider than transformers loaded it.

    A default `from_pretrained` loads every weight in the checkpoint's one dtype, so fp32
    islands of a bf16 model come back rounded to bf16. Here each tensor whose planned storage
    holds values the dtype it was loaded in does not (fp32 loaded in bf16; bf16 loaded in
    fp16, which lacks bf16's range) is read again from the checkpoint files.

    Args:
        model_class: the transformers model class, e.g. `T5ForConditionalGeneration`.
        directory: a directory written by `save_pretrained` (or by `model.save_pretrained`:
            then pass `plan`).
        plan: the plan to apply; `precision_plan.json` in the directory when None, else the
            model's own annotations with `rules(model)`. (Default: None)
        **kwargs: passed to `model_class.from_pretrained` (`dtype`, `device_map`, ...).

    Returns:
        The model, with the plan applied.
    """
    if not isinstance(model_class, type) or not callable(
            getattr(model_class, "from_pretrained", None)):
        raise TypeError(
            "from_pretrained needs a transformers model class (a PreTrainedModel subclass, "
            "such as T5ForConditionalGeneration), which loads its checkpoint. Received: "
            f"model_class={model_class!r}. For any other model, build it, load its state_dict, "
            "then precision_annot.apply(model, PrecisionPlan.from_json(text)).")
    model: M = model_class.from_pretrained(directory, **kwargs)  # type: ignore[attr-defined]
    saved = Path(directory, PLAN_FILE)
    if plan is None and saved.is_file():
        plan = PrecisionPlan.from_json(saved.read_text())
    if plan is None:
        annotate(model, rules(model, _low_dtype(kwargs.get("dtype", kwargs.get("torch_dtype")))),
                 strict=False)
        plan = resolve(model)
    loaded = {n: t.dtype for n, t in _named_tensors(model)}
    apply(model, plan)
    # read back what the load's dtype cannot hold every value of: an fp32 island loaded in
    # bf16, and a bf16 weight loaded in fp16 (dtype=torch.float16: fp16 has bf16's bits but
    # not its range, so large and tiny values were rounded)
    restore = [n for n, t in _named_tensors(model)
               if t.dtype != loaded[n] and not wider(loaded[n], t.dtype)]
    if restore:
        _read_back(model, Path(directory), restore)
    return model


def _low_dtype(dtype: object) -> torch.dtype | None:
    """The 16-bit dtype `from_pretrained` was asked to load in, else None."""
    return dtype if isinstance(dtype, torch.dtype) and dtype in (fp16, bf16) else None


def _named_tensors(model: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    for name, module in model.named_modules():
        for tname, t in [*module._parameters.items(), *dict.items(module._buffers)]:
            if t is not None and t.is_floating_point():
                yield (f"{name}.{tname}" if name else tname), t


def _checkpoint_keys(model: nn.Module, names: list[str]) -> dict[str, str | None]:
    """Each tensor's key in the checkpoint files: its name, renamed as transformers renames it
    on save (ViT's `vit.layers.0` is saved as `vit.encoder.layer.0`); None where transformers
    converts it together with other tensors (fused experts), which one key cannot say."""
    try:  # NOTE: transformers' own renaming, as its save_pretrained reverts it
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            PrefixChange,
            WeightConverter,
            WeightRenaming,
            apply_converters,
            apply_renamings,
        )
    except ImportError:  # a transformers without conversions: keys are names
        return {n: n for n in names}
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = [c for c in get_model_conversion_mapping(model,  # type: ignore[arg-type]
                                                               add_legacy=False)
                       if not isinstance(c, PrefixChange)]
    reverse = [c.reverse_transform() for c in (conversions or [])[::-1]]
    renamings = [c for c in reverse if isinstance(c, WeightRenaming)]
    converters = [c for c in reverse if isinstance(c, WeightConverter)]
    out: dict[str, str | None] = {}
    for name in names:
        _, pattern = apply_converters(name, converters)
        out[name] = None if pattern is not None else apply_renamings(name, renamings)
    return out


def checkpoint_names(model: nn.Module, keys: Iterable[str]) -> dict[str, tuple[str, bool]]:
    """The checkpoint keys that transformers' `from_pretrained` loads into a tensor of another
    name (ViT's saved `encoder.layer.0.attention.attention.query.weight` is the model's
    `layers.0.attention.q_proj.weight`), each with that name and whether it is fused with other
    keys into it (per-expert weights into one tensor); keys loaded under their own name are
    left out. What `check(model, "checkpoint", ...)` reads a Hugging Face checkpoint by.

    NOTE: transformers' own renaming (`get_model_conversion_mapping`, `rename_source_key`), as
    `from_pretrained` calls it on a checkpoint's keys."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:  # a transformers without conversions: keys are names
        return {}
    conversions = get_model_conversion_mapping(model)  # type: ignore[arg-type]
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    names = dict.fromkeys(model.state_dict(keep_vars=True), True)
    prefix = getattr(model, "base_model_prefix", None) or None
    out: dict[str, tuple[str, bool]] = {}
    for key in keys:
        if key in names:
            continue
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, names)
        if renamed in names:
            out[key] = (renamed, pattern is not None)
    return out


def _files_of(directory: Path, keys: dict[str, str | None]
              ) -> tuple[dict[Path, list[str]], list[str]]:
    """The tensors by the safetensors file of the checkpoint that holds their key (by its
    index, else the single file), and those with no key or no file."""
    index = directory / "model.safetensors.index.json"
    weight_map: dict[str, str] = (json.loads(index.read_text())["weight_map"]
                                  if index.is_file() else {})
    single = directory / "model.safetensors"
    by_file: dict[Path, list[str]] = {}
    missed: list[str] = []
    for name, key in keys.items():
        file = directory / weight_map[key] if key in weight_map else single
        if key is None or not file.is_file():
            missed.append(name)
        else:
            by_file.setdefault(file, []).append(name)
    return by_file, missed


def _read_back(model: nn.Module, directory: Path, names: list[str]) -> None:
    """Copy these tensors from the checkpoint's safetensors files, in the model's dtype; warn,
    naming them, about those that cannot be found there."""
    from safetensors import safe_open

    keys = _checkpoint_keys(model, names)
    tensors = {n: _tensor(model, n) for n in names}
    by_file, missed = _files_of(directory, keys)
    restored: set[int] = set()
    saved: list[tuple[str, torch.dtype]] = []
    for file, found in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            present = set(f.keys())
            for name in found:
                tensor, key = tensors[name], keys[name]
                if tensor is None or key not in present:
                    missed.append(name)
                    continue
                value = f.get_tensor(key)
                saved.append((name, value.dtype))
                with torch.no_grad():
                    tensor.copy_(value.to(tensor.dtype))
                restored.add(id(tensor))
    warn_narrowed("from_pretrained", narrowed(
        {n: t.dtype for n, t in tensors.items() if t is not None}, saved), stacklevel=3)
    lost = [n for n in missed if tensors[n] is not None and id(tensors[n]) not in restored]
    if lost:  # a tied tensor restored through its twin is not lost
        warnings.warn(
            f"from_pretrained: {len(lost)} tensor(s) the plan stores wider than the checkpoint "
            f"loaded them could not be read back from {str(directory)!r}, so they keep the "
            f"loaded rounding: {', '.join(repr(n) for n in lost[:6])}"
            f"{', ...' if len(lost) > 6 else ''}. Their checkpoint keys are not in its files "
            "(renamed or fused by a conversion this library cannot map).",
            UserWarning, stacklevel=3)


def _tensor(model: nn.Module, name: str) -> torch.Tensor | None:
    owner = model.get_submodule(parent_name(name))
    tname = name.rpartition(".")[2]
    tensor: torch.Tensor | None = owner._parameters.get(tname)
    if tensor is None:
        tensor = dict.get(owner._buffers, tname)
    return tensor
