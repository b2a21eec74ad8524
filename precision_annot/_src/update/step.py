"""The step of `precision_annot.optimizer`: each parameter as its `UpdateRule` says.

The optimizer class's own step does the update. A parameter whose rule keeps a master is
presented to it as that master (fp32, its gradient upcast where narrower); one whose rule
computes wider than it is stored (stochastic rounding, a wider gradient or state) as a copy in
that dtype made for the step; a state kept narrower than what the class computes in is upcast
around the step. Afterwards each is written back rounded (stochastically where the rule says),
and its state, keyed again by the model's own parameter, goes back to the rule's format. Torch's
own per-parameter classes are stepped a chunk of parameters at a time, so no full-size copy of
every gradient is made. Low-bit states (torchao's) go through torchao's Adam update instead,
which reads the gradient and the state as stored and computes in fp32.

A rule is asked at every step, from the dtype each parameter has then and what the plan
applied now says: a state built under another layout (an optimizer built before `apply`, or a
plan applied since with another update half) is converted at the step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch.optim import Optimizer

from precision_annot._src import update_kernels
from precision_annot._src.dtypes import STOCHASTIC, wider
from precision_annot._src.update import engines, formats
from precision_annot._src.update.guard import generation, planned
from precision_annot._src.update.rule import Item, UpdateFields, UpdateRule, rule_for

__all__ = ["CHUNK_BYTES", "KERNELS", "AdamKernel", "Item", "adam_family", "eager_run_step",
           "family", "items_of", "own_step", "refusal", "rule_of", "run_step", "settle",
           "widen_gradients", "write_back"]

#: the most bytes of copies made for one chunk of a step (upcast gradients, working copies,
#: upcast states), and never more than an eighth of the parameters, unless one is larger
CHUNK_BYTES = 64 * 1024 * 1024
#: torch's classes whose step updates each parameter from its own state alone, so that it may be
#: run over a chunk of the parameters at a time (not LBFGS: one state for all)
_PER_PARAMETER = frozenset({"Adadelta", "Adafactor", "Adagrad", "Adam", "Adamax", "AdamW",
                            "ASGD", "Muon", "NAdam", "RAdam", "RMSprop", "Rprop", "SGD",
                            "SparseAdam"})

StepFn = Callable[[Optimizer, Any], Any]


def rule_of(optimizer: Any, param: torch.Tensor) -> tuple[UpdateRule, str]:
    """The rule of `param` now and its name: what the plan applied last says about it, else
    what the model's plan said when the optimizer was built, else nothing (a plain update).

    What the plan applied last says is the step guard's, keyed by the model's parameters, and
    also the optimizer's own, noted when `apply` tells it (`_precision_annot_settle`): a copy
    or an unpickled optimizer, whose parameters the step guard never saw, steps as the
    original did (one built before `apply` has no fields from the model's plan to go on)."""
    said = planned(param)
    if said is None:
        said = optimizer.__dict__.get("_precision_annot_said", {}).get(param)
    fields: UpdateFields | None
    if said is not None:
        fields, name = said.fields, said.name
    else:
        fields = optimizer._precision_annot_fields.get(param)
        name = optimizer._precision_annot_names.get(param, "")
    if fields is None:
        return rule_for(UpdateFields(), param.dtype), name
    try:
        return rule_for(fields, param.dtype), name
    except ValueError as e:
        raise ValueError(f"{type(optimizer).__name__}.step(), parameter {name!r}: {e}") from None


def items_of(optimizer: Any) -> list[Item]:
    """Each parameter of the groups with its rule now (kept while the groups, the parameters'
    dtypes and what `apply` says stay as they are)."""
    groups = optimizer.param_groups
    key = (generation(), *(len(g["params"]) for g in groups),
           *((id(p), p.dtype) for g in groups for p in g["params"]))
    cached = optimizer.__dict__.get("_precision_annot_items")
    if cached is not None and cached[0] == key:
        return cached[1]  # type: ignore[no-any-return]
    out = []
    for index, group in enumerate(groups):
        for p in group["params"]:
            rule, name = rule_of(optimizer, p)
            out.append(Item(index, p, rule, name))
    optimizer._precision_annot_items = (key, out)
    optimizer.__dict__.pop("_precision_annot_layout", None)  # settle what may have changed
    optimizer.__dict__.pop("_precision_annot_cache", None)  # and work out the rest again
    return out


# -- writing back ---------------------------------------------------------------------------------

def _stochastic(x: torch.Tensor) -> torch.Tensor:
    # NOTE: torchao's stochastic rounding (fp32 -> bf16) is a module-private function of its
    # optimizers; it is the rounding `master="stochastic"` promises, so it is used as it is.
    utils = formats.torchao_module("torchao.optim.quant_utils", STOCHASTIC)
    out: torch.Tensor = utils._fp32_to_bf16_sr(x)
    return out


@torch.no_grad()
def write_back(param: torch.Tensor, updated: torch.Tensor, rule: UpdateRule) -> None:
    """What the step updated, into the stored parameter: rounded to nearest, or stochastically."""
    if rule.stochastic:
        param.copy_(_stochastic(updated.float()))
    else:
        param.copy_(updated)


def _grad_as(grad: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return grad if grad is None or grad.dtype == dtype else grad.to(dtype)


# -- the class's own step over presented tensors -------------------------------------------------

@dataclasses.dataclass
class _Presented:
    item: Item
    stand: torch.Tensor  # what the class steps: the parameter, its master, or a working copy
    state: dict[str, Any]
    created: bool  # a master made for this step (dropped again if nothing updated it)


def _present(optimizer: Any, item: Item) -> _Presented:
    p, rule = item.param, item.rule
    state = dict(optimizer.state.pop(p, None) or {})
    created = False
    if rule.engine == "master":
        stand, created = engines.master_of(p, rule, state, optimizer)
    elif rule.engine == "copy":
        stand = p.detach().to(rule.working, copy=True)
    else:
        stand = p
    if stand is not p:
        stand.grad = _grad_as(p.grad, stand.dtype)
    for key, value in state.items():
        if formats.is_moment(key, value, p):
            state[key] = formats.to_format(value, rule.working, stand)
    if state:
        optimizer.state[stand] = state
    return _Presented(item, stand, state, created)


def _restore(optimizer: Any, presented: _Presented) -> None:
    item, stand = presented.item, presented.stand
    p, rule = item.param, item.rule
    state = optimizer.state.pop(stand, None)
    state = dict(state) if state else {}
    for key, value in state.items():
        if formats.is_moment(key, value, p):
            assert isinstance(rule.state, torch.dtype)
            state[key] = formats.to_format(value, rule.state, p)
    if stand is not p:
        stepped = stand.grad is not None
        stand.grad = None
        if stepped:
            write_back(p, stand, rule)
        if rule.engine == "master" and (stepped or not presented.created):
            state = {"master": stand, **state}
    if state:
        optimizer.state[p] = state


def _chunks(items: list[Item], limit: int | None) -> Iterator[list[Item]]:
    if limit is None:
        yield items
        return
    chunk: list[Item] = []
    size = 0
    for item in items:
        n = item.param.numel()
        if chunk and size + n > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append(item)
        size += n
    if chunk:
        yield chunk


def _chunk_numel(optimizer: Any, items: list[Item], closure: Any) -> int | None:
    """Elements per chunk, or None to step every parameter at once (a closure, a class whose
    step is not known to be per parameter, or nothing copied): at most CHUNK_BYTES of copies
    and an eighth of the parameters, but at least the largest one (stepped whole)."""
    if closure is not None or type(optimizer)._precision_annot_base.__name__ not in _PER_PARAMETER:
        return None
    if not _torch_step(type(optimizer)._precision_annot_base):
        return None
    copied = [i.param.numel() for i in items if i.rule.working != i.rule.stored or (
        i.rule.state != i.rule.working)]
    if not copied:
        return None
    sizes = [i.param.numel() for i in items]
    return max(max(sizes), min(CHUNK_BYTES // 4, sum(sizes) // 8))


def _torch_step(cls: type) -> bool:
    step = _unhooked(cls.step)  # type: ignore[attr-defined]
    return getattr(step, "__module__", "").startswith("torch.optim")


def _unhooked(step: Any) -> Any:
    while getattr(step, "hooked", False):
        step = step.__wrapped__
    return step


def own_step(cls: type) -> StepFn:
    """The class's own `step`, without the hooks torch wraps it in.

    NOTE: torch wraps each optimizer class's `step` once (`Optimizer._patch_step_function`) to
    fire step hooks; the planned optimizer's own `step` fires them, so the class's is called
    unwrapped, or hooks would fire twice per step."""
    return _unhooked(cls.step)  # type: ignore[attr-defined,no-any-return]


def _wrapped(closure: Callable[[], Any], presented: list[_Presented]) -> Callable[[], Any]:
    """The closure as a class that re-evaluates the model (LBFGS's line search) needs it: the
    model sees what is being updated (written back rounded to nearest: the step's own write
    back, after it, rounds as the rule says), and the class sees the new gradients."""
    moved = [pr for pr in presented if pr.stand is not pr.item.param]

    def again() -> Any:
        with torch.no_grad():
            for pr in moved:
                pr.item.param.copy_(pr.stand)
        with torch.enable_grad():
            loss = closure()
        for pr in moved:
            pr.stand.grad = _grad_as(pr.item.param.grad, pr.stand.dtype)
        return loss

    return again


def _class_step(optimizer: Any, items: list[Item], closure: Any) -> Any:
    """The class's own step over `items`, presented as their rules say, a chunk at a time
    where it may be; the other parameters of the groups (stepped by torchao's update) left out
    for it."""
    groups = optimizer.param_groups
    saved = [list(g["params"]) for g in groups]
    loss = None
    try:
        for chunk in _chunks(items, _chunk_numel(optimizer, items, closure)):
            out = _chunk_step(optimizer, chunk, closure)
            loss = out if loss is None else loss
    finally:
        for group, params in zip(groups, saved, strict=True):
            group["params"][:] = params
    return loss


def _chunk_step(optimizer: Any, chunk: list[Item], closure: Any) -> Any:
    takes = [i for i in chunk if not i.rule.plain and (
        i.param.grad is not None or (closure is not None and i.param.requires_grad))]
    presented: list[_Presented] = []
    step = own_step(type(optimizer)._precision_annot_base)
    try:
        for item in takes:  # each one restored below, whatever fails
            presented.append(_present(optimizer, item))
        stands = {id(pr.item.param): pr.stand for pr in presented}
        for index, group in enumerate(optimizer.param_groups):
            group["params"][:] = [stands.get(id(i.param), i.param) for i in chunk
                                  if i.group == index]
        # a closure's `optimizer.zero_grad()` zeroes the groups, which hold the stand-ins
        # now: it zeroes the model's own parameters too (PlanOptimizer.zero_grad)
        optimizer._precision_annot_presented = [pr.item.param for pr in presented
                                                if pr.stand is not pr.item.param]
        return step(optimizer, None if closure is None else _wrapped(closure, presented))
    finally:
        optimizer._precision_annot_presented = []
        for pr in presented:
            _restore(optimizer, pr)


# -- torchao's Adam update over low-bit states ---------------------------------------------------

def refusal(optimizer: Any, items: Sequence[Item]) -> str | None:
    """Why the optimizer cannot make these low-bit updates, or None."""
    if not items:
        return None
    base = type(optimizer)._precision_annot_base
    first = items[0]
    what = f"optim={first.rule.state} for {len(items)} parameter(s), e.g. {first.name!r},"
    if adam_family(base) is None:
        return (f"{what} runs through torchao's Adam update, and optimizer_class is "
                f"{base.__name__}. Use torch.optim.AdamW or torch.optim.Adam, or plan those "
                "modules with a float optim (optim=bf16 works with any class).")
    groups = {i.group for i in items}
    for flag in ("fused", "capturable", "differentiable", "amsgrad"):
        if any(optimizer.param_groups[g].get(flag) for g in groups):
            return (f"{what} runs through torchao's Adam update, which has no {flag} form: "
                    f"{flag}=True cannot be honoured there. Leave {flag} unset, or plan those "
                    "modules with a float optim.")
    return None


def adam_family(cls: type) -> str | None:
    """"Adam" or "AdamW" for torch's classes (and subclasses that keep their step), else None."""
    name = family(cls)
    return name if name in ("Adam", "AdamW") else None


#: One-pass kernels by the family of torch's class they step for ("Adam", "AdamW", "SGD"),
#: called per group, once for its parameters with masters and once for those without:
#:
#: - Adam, AdamW: `kernel(group, params, grads, masters, exp_avgs, exp_avg_sqs,
#:   max_exp_avg_sqs, steps, adamw, grad_scale, found_inf)` updates each master (or each
#:   parameter, where `masters` holds None) from its gradient as stored, its moments and its
#:   step counter in place, with the group's hyperparameters (`adamw`: decoupled weight decay;
#:   `grad_scale`, `found_inf`: what a GradScaler hands a fused optimizer, else None), and
#:   writes each master back into its parameter rounded to nearest;
#: - SGD: `kernel(group, params, grads, masters, momentum_buffers, grad_scale, found_inf)`,
#:   `momentum_buffers` a list of tensors or None (a first step), filled in place.
#:
#: A kernel with `mixed_dtypes = True` also takes parameters that compute wider than they are
#: stored without a master (a wider gradient or state) and float states narrower than what
#: is updated, and one with `cached = True` gets `cache=`, a dict kept per group and kind
#: across steps while the optimizer's parameters and their rules stay as they are. A group
#: steps through its family's kernel where it leaves `fused` and `foreach` unset or says
#: `fused=True`, and is not `differentiable` or `capturable`; else, or with no kernel
#: registered, the class's own step does it. The defaults are `engines.FusedAdam` and
#: `engines.FusedSGD`: torch's fused kernels over the masters, in one pass.
AdamKernel = Callable[..., None]
KERNELS: dict[str, AdamKernel] = {"Adam": engines.FusedAdam(), "AdamW": engines.FusedAdam(),
                                  "SGD": engines.FusedSGD()}


def family(cls: type) -> str | None:
    """"Adam", "AdamW" or "SGD" for torch's classes (and subclasses that keep their step),
    else None."""
    for base in cls.__mro__:
        if base.__module__.startswith("torch.optim") and base.__name__ in (
                "Adam", "AdamW", "SGD"):
            return base.__name__ if own_step(cls) is own_step(base) else None
    return None


def _kernel_group_ok(group: dict[str, Any]) -> bool:
    """A group a one-pass kernel may step: `fused=True`, or neither `fused` nor `foreach`
    given, and no `differentiable` or `capturable` step asked for (the class's own step
    honours those), its hyperparameters plain numbers but `lr`."""
    if group.get("differentiable") or group.get("capturable") or group.get("foreach"):
        return False
    fused = group.get("fused")
    if fused is not True and (fused is not None or group.get("foreach") is not None):
        return False
    betas = group.get("betas", (0.0, 0.0))
    return all(isinstance(b, (float, int)) for b in betas)


def _kernel_takes(item: Item, mixed: bool) -> bool:
    """Whether a kernel takes this parameter at all (its gradient is looked at per step)."""
    rule, p = item.rule, item.param
    if rule.plain or rule.stochastic or not isinstance(rule.state, torch.dtype):
        return False  # as the class steps it; stochastic rounding; a low-bit state
    if not (rule.stored.is_floating_point and p.is_contiguous()):
        return False
    if not update_kernels.fused_available(p.device):
        return False
    if mixed:
        return rule.engine in ("master", "direct", "copy") and rule.state.is_floating_point
    return rule.engine in ("master", "direct") and rule.state == rule.updated


def _kernel_parts(optimizer: Any, items: list[Item], name: str, kernel: AdamKernel
                  ) -> dict[tuple[int, bool], list[Item]]:
    """The items a kernel may step, by group and whether they have a master (kept across
    steps while the items and the groups' flags stay as they are)."""
    groups = optimizer.param_groups
    flags = tuple(_kernel_group_ok(g) for g in groups)
    derived = optimizer.__dict__.setdefault("_precision_annot_cache", {})
    key = (name, id(kernel), flags)
    held = derived.get("parts")
    if held is not None and held[0] == key and held[1] is items:
        return held[2]  # type: ignore[no-any-return]
    mixed = bool(getattr(kernel, "mixed_dtypes", False))
    parts: dict[tuple[int, bool], list[Item]] = {}
    for item in items:
        if flags[item.group] and _kernel_takes(item, mixed):
            parts.setdefault((item.group, item.rule.master is not None), []).append(item)
    derived["parts"] = (key, items, parts)
    derived["kernels"] = {}  # a new partition: the kernels' caches go with the old one
    return parts


def _kernel_step(optimizer: Any, items: list[Item], name: str, kernel: AdamKernel
                 ) -> list[Item]:
    """The items a registered kernel takes, handed to it as lists per group and kind; the
    others (and those whose gradient it cannot read this step) are returned."""
    parts = _kernel_parts(optimizer, items, name, kernel)
    if not parts:
        return items
    taken: set[int] = set()
    adamw = isinstance(optimizer, torch.optim.AdamW)
    cached = bool(getattr(kernel, "cached", False))
    derived = optimizer._precision_annot_cache["kernels"]
    for (index, mastered), mine in parts.items():
        group = optimizer.param_groups[index]
        stepped = [i for i in mine if _readable(i.param.grad)]
        if not stepped:
            continue
        taken.update(id(i) for i in stepped)
        options = {"cache": derived.setdefault((index, mastered), {})} if cached else {}
        if name == "SGD":
            _sgd_group(optimizer, group, stepped, kernel, options)
        else:
            _adam_group(optimizer, group, stepped, kernel, adamw, options)
    return [i for i in items if id(i) not in taken] if taken else items


def _readable(grad: torch.Tensor | None) -> bool:
    """A gradient a kernel reads: present, dense, contiguous (else the class's step)."""
    return grad is not None and not grad.is_sparse and grad.is_contiguous()


def _adam_group(optimizer: Any, group: dict[str, Any], items: list[Item], kernel: AdamKernel,
                adamw: bool, options: dict[str, Any]) -> None:
    amsgrad = bool(group["amsgrad"])
    params, grads, masters, exp_avgs, exp_avg_sqs, maxes, steps = [], [], [], [], [], [], []
    state_of = optimizer.state
    for item in items:
        p = item.param
        master = engines.held_master(optimizer, p, item.rule) if item.rule.master else None
        state = state_of[p]
        target = p if master is None else master
        if "exp_avg" not in state:
            _new_adam_state(state, target, item.rule.state, amsgrad)  # type: ignore[arg-type]
        params.append(p)
        grads.append(p.grad)
        masters.append(master)
        exp_avgs.append(state["exp_avg"])
        exp_avg_sqs.append(state["exp_avg_sq"])
        if amsgrad:
            maxes.append(state["max_exp_avg_sq"])
        steps.append(engines.fused_step(state, target))
    kernel(group, params, grads, masters, exp_avgs, exp_avg_sqs, maxes or None, steps,
           adamw or bool(group.get("decoupled_weight_decay")),
           getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None),
           **options)


def _new_adam_state(state: dict[str, Any], target: torch.Tensor, dtype: torch.dtype,
                    amsgrad: bool) -> None:
    """Adam's state as torch's fused Adam makes it, its moments in the rule's state dtype (a
    zero is a zero in any)."""
    state["step"] = engines.new_step(target)
    names = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    for name in names:
        state[name] = torch.zeros_like(target, dtype=dtype, memory_format=torch.preserve_format)


def _sgd_group(optimizer: Any, group: dict[str, Any], items: list[Item], kernel: AdamKernel,
               options: dict[str, Any]) -> None:
    params, grads, masters, buffers = [], [], [], []
    state_of = optimizer.state
    for item in items:
        p = item.param
        master = engines.held_master(optimizer, p, item.rule) if item.rule.master else None
        params.append(p)
        grads.append(p.grad)
        masters.append(master)
        buffers.append(state_of[p].get("momentum_buffer") if group["momentum"] else None)
    kernel(group, params, grads, masters, buffers, getattr(optimizer, "grad_scale", None),
           getattr(optimizer, "found_inf", None), **options)
    if group["momentum"]:
        for item, buffer in zip(items, buffers, strict=True):
            state = state_of[item.param]
            if state.get("momentum_buffer") is not buffer:  # made by this step
                fmt = item.rule.state
                state["momentum_buffer"] = buffer if buffer is None or buffer.dtype == fmt \
                    else formats.to_format(buffer, fmt, item.param)  # type: ignore[arg-type]


def settle(optimizer: Any, items: Sequence[Item]) -> None:
    """Each state into the layout its rule says now, where it was built under another (an
    optimizer built before `apply`, a plan applied since with another update half): a master
    no longer planned written back into its parameter (the master is the truth) and dropped, a
    master of another dtype cast, a moment kept in another format converted (into a low-bit
    format as torchao's update keeps it)."""
    for item in items:
        state = optimizer.state.get(item.param)
        if not state:
            continue
        p, rule = item.param, item.rule
        master = state.get("master")
        if isinstance(master, torch.Tensor) and rule.master is None:
            write_back(p, state.pop("master"), rule)
        elif isinstance(master, torch.Tensor):
            if master.dtype != rule.master:
                state["master"] = master = master.to(rule.master)
            write_back(p, master, rule)  # (`apply` cast the weight from its old dtype)
        if rule.low_bit:  # as torchao's update keeps them, now (a switch names what it lost)
            held = state.get("master")
            formats.settle_low_bit(state, held if isinstance(held, torch.Tensor) else p,
                                   rule.state)  # type: ignore[arg-type]
            continue
        for key, value in state.items():
            if formats.is_moment(key, value, p) and (formats.low_bit_of(value) or (
                    value.dtype != rule.state)):
                state[key] = formats.to_format(value, rule.state, p)  # type: ignore[arg-type]


class _Split(NamedTuple):
    """A step's items by who steps them (kept while the items are)."""

    plain: bool  # every one as the class steps it: the class's own step, untouched
    low: list[Item]  # torchao's update over low-bit states
    rest: list[Item]  # a kernel, or the class's own step over presented tensors


def _split(optimizer: Any, items: list[Item]) -> _Split:
    cache = optimizer.__dict__.setdefault("_precision_annot_cache", {})
    held = cache.get("split")
    if held is not None and held[0] is items:
        return held[1]  # type: ignore[no-any-return]
    split = _Split(all(i.rule.plain for i in items),
                   [i for i in items if i.rule.engine == "torchao"],
                   [i for i in items if i.rule.engine != "torchao"])
    cache["split"] = (items, split)
    return split


def run_step(optimizer: Any, closure: Callable[[], Any] | None) -> Any:
    """One step of a planned optimizer (see the module docstring). Planned classes call it
    through `eager_run_step`."""
    items = items_of(optimizer)
    if not optimizer.__dict__.get("_precision_annot_layout"):
        settle(optimizer, items)
        optimizer._precision_annot_layout = True
    base = type(optimizer)._precision_annot_base
    split = _split(optimizer, items)
    if split.plain:
        return own_step(base)(optimizer, closure)  # nothing planned: the class's own step
    name = family(base)
    kernel = KERNELS.get(name or "")
    loss = None
    if closure is not None and (split.low or kernel is not None):
        # Adam's, AdamW's and SGD's steps evaluate the closure once, before they update
        with torch.enable_grad():
            loss = closure()
        closure = None
    if split.low:
        _low_bit_step(optimizer, split.low)
    rest = split.rest
    if kernel is not None and rest:
        with torch.no_grad():
            rest = _kernel_step(optimizer, rest, name, kernel)  # type: ignore[arg-type]
    if rest:
        out = _class_step(optimizer, rest, closure)
        loss = out if loss is None else loss
    return loss


_EAGER_STEP: list[Callable[[Any, Callable[[], Any] | None], Any]] = []


def eager_run_step() -> Callable[[Any, Callable[[], Any] | None], Any]:
    """`run_step` as `torch.compile` runs it (`torch.compile(optimizer.step)`): as it is, since
    its stand-ins are made each step and tracing them would recompile at every one. Made once,
    by the first planned optimizer class, not at import: `torch.compiler.disable` imports
    Dynamo, which `import precision_annot` does not (building a torch optimizer does)."""
    if not _EAGER_STEP:
        _EAGER_STEP.append(torch.compiler.disable(run_step))  # type: ignore[no-untyped-call,unused-ignore]
    return _EAGER_STEP[0]


def _low_bit_step(optimizer: Any, low: list[Item]) -> None:
    why = refusal(optimizer, low)
    if why is not None:
        raise RuntimeError(f"{type(optimizer).__name__}.step(): {why}")
    compiled = optimizer._precision_annot_compile
    with torch.no_grad():
        engines.lowbit_step(optimizer, low, engines.COMPILE if compiled is None else compiled)


def widen_gradients(optimizer: Any) -> None:
    """Each gradient narrower than the master it updates, upcast into the master's dtype as
    `.grad` (Apex O2: unscaling an fp16 gradient in fp16 flushes the small ones to zero; in
    fp32 they survive). A parameter whose `grad_dtype` is its own dtype is let take a wider
    gradient (`grad_dtype=None`); the gradients of the next backward arrive as before."""
    for item in items_of(optimizer):
        p, master = item.param, item.rule.master
        if master is None or p.grad is None or not wider(master, p.grad.dtype):
            continue
        if getattr(p, "grad_dtype", None) == p.dtype:
            p.grad_dtype = None
        p.grad = p.grad.to(master)
