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
from typing import Any

import torch
from torch.optim import Optimizer

from precision_annot._src.dtypes import wider
from precision_annot._src.float8 import import_torchao
from precision_annot._src.update import formats
from precision_annot._src.update.guard import generation, planned
from precision_annot._src.update.rule import UpdateFields, UpdateRule, rule_for

__all__ = ["CHUNK_BYTES", "KERNELS", "AdamKernel", "Item", "adam_family", "items_of", "own_step",
           "refusal", "rule_of", "run_step", "settle", "widen_gradients", "write_back"]

#: the most bytes of copies made for one chunk of a step (upcast gradients, working copies,
#: upcast states), and never more than an eighth of the parameters, unless one is larger
CHUNK_BYTES = 64 * 1024 * 1024
#: torch's classes whose step updates each parameter from its own state alone, so that it may be
#: run over a chunk of the parameters at a time (not LBFGS: one state for all)
_PER_PARAMETER = frozenset({"Adadelta", "Adafactor", "Adagrad", "Adam", "Adamax", "AdamW",
                            "ASGD", "Muon", "NAdam", "RAdam", "RMSprop", "Rprop", "SGD",
                            "SparseAdam"})

StepFn = Callable[[Optimizer, Any], Any]


@dataclasses.dataclass
class Item:
    """One parameter of a step: where it sits in the groups, its name and rule."""

    group: int
    param: torch.Tensor
    rule: UpdateRule
    name: str


def rule_of(optimizer: Any, param: torch.Tensor) -> tuple[UpdateRule, str]:
    """The rule of `param` now and its name: what the plan applied last says about it, else
    what the model's plan said when the optimizer was built, else nothing (a plain update)."""
    said = planned(param)
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
    return out


# -- writing back ---------------------------------------------------------------------------------

def _stochastic(x: torch.Tensor) -> torch.Tensor:
    # NOTE: torchao's stochastic rounding (fp32 -> bf16) is a module-private function of its
    # optimizers; it is the rounding `master="stochastic"` promises, so it is used as it is.
    utils = import_torchao("torchao.optim.quant_utils", "master='stochastic'")
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


def _master(item: Item, state: dict[str, Any]) -> tuple[torch.Tensor, bool]:
    dtype = item.rule.master
    assert dtype is not None
    master = state.pop("master", None)
    if isinstance(master, torch.Tensor) and master.dtype == dtype:
        return master, False
    source = master if isinstance(master, torch.Tensor) else item.param
    return source.detach().to(dtype, copy=True), master is None


def _present(optimizer: Any, item: Item) -> _Presented:
    p, rule = item.param, item.rule
    state = dict(optimizer.state.pop(p, None) or {})
    created = False
    if rule.engine == "master":
        stand, created = _master(item, state)
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
    for base in cls.__mro__:
        if base.__module__.startswith("torch.optim") and base.__name__ in ("Adam", "AdamW"):
            return base.__name__ if own_step(cls) is own_step(base) else None
    return None


def _low_bit_state(state: dict[str, Any], target: torch.Tensor, rule: UpdateRule,
                   amsgrad: bool) -> None:
    """The moments torchao's update reads, in the rule's low-bit format (created as torchao
    creates them; converted where a state came from another layout), and a tensor step."""
    fmt = rule.state
    assert isinstance(fmt, str)
    names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
    quantized = formats.quantized(fmt, target)
    for name in names:
        value = state.get(name)
        signed = name not in formats.UNSIGNED
        if value is None:
            state[name] = formats.new_low_bit(fmt, target, signed)
        elif quantized and formats.low_bit_of(value) != fmt:
            state[name] = formats.to_format(value, fmt, target, signed=signed)
        elif not quantized and (formats.low_bit_of(value) or value.dtype != target.dtype):
            state[name] = formats.to_format(value, target.dtype, target)
    step = state.get("step")
    if not isinstance(step, torch.Tensor):
        state["step"] = torch.tensor(float(step or 0.0))


def _torchao_step(optimizer: Any, items: list[Item]) -> None:
    adam = import_torchao("torchao.optim.adam", "a low-bit optim")
    kernel: Any = adam.single_param_adam
    if optimizer._precision_annot_compile:
        kernel = torch.compile(kernel, fullgraph=True, dynamic=False)
    adamw = isinstance(optimizer, torch.optim.AdamW)
    lrs: dict[int, torch.Tensor] = {}
    for item in items:
        p, rule = item.param, item.rule
        if p.grad is None:
            continue
        group = optimizer.param_groups[item.group]
        state = optimizer.state[p]
        target = _master(item, state)[0] if rule.master is not None else p
        _low_bit_state(state, target, rule, bool(group["amsgrad"]))
        state["step"] += 1
        lr = lrs.get(item.group)
        if lr is None:
            lr = lrs[item.group] = torch.as_tensor(group["lr"], dtype=torch.float32).detach()
        grad = -p.grad if group.get("maximize") else p.grad
        beta1, beta2 = (float(b) for b in group["betas"])
        kernel(target.detach(), grad, state["step"], state["exp_avg"], state["exp_avg_sq"],
               state.get("max_exp_avg_sq"), lr, beta1, beta2, float(group["weight_decay"]),
               float(group["eps"]), adamw or bool(group.get("decoupled_weight_decay")),
               rule.stochastic and target.dtype is torch.bfloat16)
        if target is not p:
            write_back(p, target, rule)
            optimizer.state[p] = {"master": target, **state}


#: a one-pass Adam/AdamW update over lists, one group at a time: `kernel(group, params, grads,
#: masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, adamw, grad_scale, found_inf)`
#: updates each master (or the parameter itself, where its master is None) from its gradient as
#: stored, its moments and its step counter in place, with the group's hyperparameters
#: (`adamw`: decoupled weight decay; `grad_scale`, `found_inf`: what a GradScaler hands a fused
#: optimizer, else None), and writes each master back into its parameter rounded to nearest.
#: Registered by family ("Adam", "AdamW"); with none registered, the class's own step does it.
AdamKernel = Callable[..., None]
KERNELS: dict[str, AdamKernel] = {}


def _kernel_step(optimizer: Any, items: list[Item], kernel: AdamKernel) -> list[Item]:
    """The items a registered kernel takes (a gradient, no stochastic rounding, the state in
    the dtype it updates) handed to it as lists, per group; the others are returned."""
    taken = [i for i in items if i.param.grad is not None and i.rule.engine in (
        "master", "direct") and i.rule.state == i.rule.updated]
    adamw = isinstance(optimizer, torch.optim.AdamW)
    for index, group in enumerate(optimizer.param_groups):
        mine = [i for i in taken if i.group == index]
        if mine:
            _kernel_group(optimizer, group, mine, kernel, adamw)
    chosen = {id(i) for i in taken}
    return [i for i in items if id(i) not in chosen]


def _kernel_group(optimizer: Any, group: dict[str, Any], items: list[Item],
                  kernel: AdamKernel, adamw: bool) -> None:
    lists: dict[str, list[Any]] = {k: [] for k in (
        "params", "grads", "masters", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "steps")}
    for item in items:
        _gather(optimizer, item, group, lists)
    kernel(group, lists["params"], lists["grads"], lists["masters"], lists["exp_avgs"],
           lists["exp_avg_sqs"], lists["max_exp_avg_sqs"] or None, lists["steps"],
           adamw or bool(group.get("decoupled_weight_decay")),
           getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None))


def _gather(optimizer: Any, item: Item, group: dict[str, Any], lists: dict[str, list[Any]]
            ) -> None:
    """One item's tensors for a kernel, its state made as torch's Adam makes it."""
    p = item.param
    state = optimizer.state[p]
    master = _master(item, state)[0] if item.rule.master is not None else None
    target = master if master is not None else p
    if "step" not in state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(target, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(target, memory_format=torch.preserve_format)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(target,
                                                       memory_format=torch.preserve_format)
    if master is not None:
        optimizer.state[p] = {"master": master, **state}
    lists["params"].append(p)
    lists["grads"].append(p.grad)
    lists["masters"].append(master)
    lists["exp_avgs"].append(state["exp_avg"])
    lists["exp_avg_sqs"].append(state["exp_avg_sq"])
    if group["amsgrad"]:
        lists["max_exp_avg_sqs"].append(state["max_exp_avg_sq"])
    lists["steps"].append(state["step"])


def settle(optimizer: Any, items: Sequence[Item]) -> None:
    """Each state into the layout its rule says now, where it was built under another (an
    optimizer built before `apply`, a plan applied since with another update half): a master
    no longer planned written back into its parameter (the master is the truth) and dropped, a
    master of another dtype cast, a moment kept in another format converted. Low-bit moments
    are settled by torchao's update itself."""
    for item in items:
        state = optimizer.state.get(item.param)
        if not state:
            continue
        p, rule = item.param, item.rule
        master = state.get("master")
        if isinstance(master, torch.Tensor) and rule.master is None:
            write_back(p, state.pop("master"), rule)
        elif isinstance(master, torch.Tensor) and master.dtype != rule.master:
            state["master"] = master.to(rule.master)
        if rule.low_bit:
            continue
        for key, value in state.items():
            if formats.is_moment(key, value, p) and (formats.low_bit_of(value) or (
                    value.dtype != rule.state)):
                state[key] = formats.to_format(value, rule.state, p)  # type: ignore[arg-type]


def _eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` run as it is under `torch.compile`.

    NOTE: `torch.compiler.disable` applied at import imports Dynamo (and FSDP with it) into
    every `import precision_annot`; torch's `_disable_dynamo` defers that to the first call."""
    disable: Any = torch._disable_dynamo  # type: ignore[attr-defined]
    return disable(fn)  # type: ignore[no-any-return]


@_eager
def run_step(optimizer: Any, closure: Callable[[], Any] | None) -> Any:
    """One step of a planned optimizer (see the module docstring). Under `torch.compile`
    (`torch.compile(optimizer.step)`) it runs as it is: its stand-ins are made each step, and
    tracing them would recompile at every one."""
    items = items_of(optimizer)
    if not optimizer.__dict__.get("_precision_annot_layout"):
        settle(optimizer, items)
        optimizer._precision_annot_layout = True
    base = type(optimizer)._precision_annot_base
    if all(i.rule.plain for i in items):
        return own_step(base)(optimizer, closure)  # nothing planned: the class's own step
    low = [i for i in items if i.rule.engine == "torchao"]
    loss = None
    if low:
        loss = _low_bit_step(optimizer, low, closure)
        closure = None  # evaluated once, before either update
    rest = [i for i in items if i.rule.engine != "torchao"]
    kernel = KERNELS.get(adam_family(base) or "")
    if kernel is not None and closure is None and rest:
        with torch.no_grad():
            rest = _kernel_step(optimizer, rest, kernel)
    if rest:
        out = _class_step(optimizer, rest, closure)
        loss = out if loss is None else loss
    return loss


def _low_bit_step(optimizer: Any, low: list[Item], closure: Callable[[], Any] | None) -> Any:
    why = refusal(optimizer, low)
    if why is not None:
        raise RuntimeError(f"{type(optimizer).__name__}.step(): {why}")
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    with torch.no_grad():
        _torchao_step(optimizer, low)
    return loss


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
