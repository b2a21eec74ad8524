"""The one-pass kernels `precision_annot.optimizer`'s step hands its parameters to.

- `FusedAdam` (`step.KERNELS["Adam"]`, `["AdamW"]`) and `FusedSGD` (`["SGD"]`): on an NVIDIA
  GPU where Triton (3.9 or newer) imports, the Triton kernels of `update_triton.adam` /
  `update_triton.sgd`, which read each gradient as stored (bf16, or the fp32 accumulation),
  update the fp32 master and the moments, and write the master rounded into the bf16 weight
  in one pass over many tensors; checked on each device's first step against the fused route
  (`update_triton.checked`: where they differ, one warning and the fused route from then on)
  and turned off by `PRECISION_ANNOT_TRITON=0`. Elsewhere (the CPU, other devices, older or no
  Triton), torch's fused kernels through `update_kernels.adam` / `update_kernels.sgd`: the
  gradient widened and the master rounded a cache-sized chunk at a time, no full-size
  temporary. Over fp32 masters the fused route is bit for bit torch's `AdamW(fused=True)` (and
  `SGD(fused=True)`) stepping the masters; torch's CPU default (its for-loop) differs from
  that in the last bit, as torch's own fused and for-loop steps do. The Triton kernels compute
  torch's fused CPU kernel's formula (see `update_triton` for where the bits can differ).
- `lowbit_step`: torchao's Adam update over its low-bit states (`optim="8bit"`, `"4bit"`,
  `"fp8"`) through `update_kernels.lowbit_adam`, compiled once per layout (state format,
  flags, dtypes) for every shape, not once per parameter as torchao's own optimizers compile
  theirs; `COMPILE` (or `optimizer(..., compile_step=False)`) runs it eagerly instead.

Each kernel keeps, per group, a cache of what it works out from the tensors (the optimizer's
`_precision_annot_cache`, dropped whenever the groups, the parameters' dtypes or what `apply`
says change): a step then only gathers its tensors and cuts the gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from precision_annot._src import update_kernels, update_triton
from precision_annot._src.update import formats, guard

if TYPE_CHECKING:
    from precision_annot._src.update.rule import Item, UpdateRule

__all__ = ["COMPILE", "FRESH", "FusedAdam", "FusedSGD", "fresh_master", "fresh_state", "fused_step",
           "held_master",
           "lowbit_step", "master_of", "new_step", "step_functions"]

#: whether the low-bit update runs compiled when the optimizer was built without saying
#: (`compile_step=None`); the tests turn it off, but for the one test of the compiled step
COMPILE = True


def master_of(param: torch.Tensor, rule: UpdateRule, state: dict[str, Any],
              optimizer: Any = None) -> tuple[torch.Tensor, bool]:
    """The master copy of `param` from its state (taken out of it), where there is none the
    one another planned optimizer steps (`guard.shared_master`), the wider value kept for it
    (`guard.wide_of`: a checkpoint loaded before the first step, a detour through fp32) or
    one made from the parameter, cast where it is in another dtype; and whether it was made
    now."""
    dtype = rule.master
    assert dtype is not None
    master = state.pop("master", None)
    if isinstance(master, torch.Tensor) and master.dtype == dtype:
        return master, False
    if master is None and (shared := guard.shared_master(optimizer, param, dtype)) is not None:
        return shared, False
    if master is None and (wide := guard.take_wide(param, dtype)) is not None:
        return wide, True  # a wider value loaded (or narrowed by apply) before it was made
    source = master if isinstance(master, torch.Tensor) else param
    return source.detach().to(dtype, copy=True), master is None


def held_master(optimizer: Any, param: torch.Tensor, rule: UpdateRule) -> torch.Tensor:
    """The master of `param` kept in its state (made, or cast, and kept there first where
    it is missing or in another dtype)."""
    state = optimizer.state[param]
    master = state.get("master")
    if isinstance(master, torch.Tensor) and master.dtype == rule.master:
        return master
    master, _ = master_of(param, rule, state, optimizer)
    optimizer.state[param] = {"master": master, **state}
    return master


def new_step(target: torch.Tensor) -> torch.Tensor:
    """A step counter as torch's fused step keeps it: float32, on the parameter's device."""
    if target.device.type == "cpu":
        return torch.tensor(0.0, dtype=torch.float32)
    return torch.zeros((), dtype=torch.float32, device=target.device)


def fused_step(state: dict[str, Any], target: torch.Tensor) -> torch.Tensor:
    """The state's step counter as a fused kernel takes it (a float32 tensor on the
    parameter's device), made or converted in the state where it is not."""
    step = state.get("step")
    if not isinstance(step, torch.Tensor):
        step = state["step"] = new_step(target) + float(step or 0.0)
    elif step.dtype != torch.float32 or (
            target.device.type != "cpu" and step.device != target.device):
        step = state["step"] = step.to(dtype=torch.float32, device=target.device)
    return step


def step_functions(params: Sequence[torch.Tensor]) -> ModuleType:
    """The module whose `adam` / `sgd` step `params`: `update_triton` where its kernels run on
    their (first one's) device (`update_triton.available`) and passed the check there
    (`update_triton.checked`, run on the device's first step), else `update_kernels`.
    `update_triton` hands what its kernels do not step to `update_kernels` itself (a
    parameter on another device included, checked there first)."""
    device = params[0].device if params else None
    if device is not None and update_triton.available(device) and update_triton.checked(device):
        return update_triton
    return update_kernels


class FusedAdam:
    """The Adam/AdamW kernel of `step.KERNELS`: `adam` of `step_functions(params)` (the Triton
    kernel on an NVIDIA GPU, else the fused route) over the lists the step gathers (for one
    group, its parameters with masters or those without), each computed in the widest dtype
    of its tensors (the master's fp32; fp32 for a bf16 parameter with an fp32 gradient or
    state) and written back rounded where stored narrower."""

    #: takes parameters stored narrower than they compute in, and states narrower than what is
    #: updated (bf16 moments over fp32 masters, read and written rounded to nearest)
    mixed_dtypes = True
    #: keeps `update_kernels`' cache per group across steps
    cached = True

    def __call__(self, group: dict[str, Any], params: list[torch.Tensor],
                 grads: list[torch.Tensor], masters: list[torch.Tensor | None],
                 exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                 max_exp_avg_sqs: list[torch.Tensor] | None, steps: list[torch.Tensor],
                 adamw: bool, grad_scale: torch.Tensor | None,
                 found_inf: torch.Tensor | None, *, cache: dict[str, Any] | None = None
                 ) -> None:
        beta1, beta2 = group["betas"]
        mastered = bool(masters) and masters[0] is not None
        step_functions(params).adam(
            masters if mastered else params, grads, exp_avgs,
            exp_avg_sqs, max_exp_avg_sqs or [], steps, lr=group["lr"], beta1=beta1,
            beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
            decoupled=adamw, amsgrad=bool(group["amsgrad"]),
            maximize=bool(group["maximize"]), stored=params if mastered else None,
            grad_scale=grad_scale, found_inf=found_inf, cache=cache)


class FusedSGD:
    """The SGD kernel of `step.KERNELS`: `sgd` of `step_functions(params)` (the Triton kernel
    on an NVIDIA GPU, else the fused route) over the lists the step gathers (for one group,
    its parameters with masters or those without), its momentum buffers filled in place on
    their first step, as torch's fused SGD does."""

    mixed_dtypes = True
    cached = True

    def __call__(self, group: dict[str, Any], params: list[torch.Tensor],
                 grads: list[torch.Tensor], masters: list[torch.Tensor | None],
                 momentum_buffers: list[torch.Tensor | None],
                 grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None, *,
                 cache: dict[str, Any] | None = None) -> None:
        mastered = bool(masters) and masters[0] is not None
        targets: list[torch.Tensor] = masters if mastered else params  # type: ignore[assignment]
        hyper = {"lr": group["lr"], "momentum": group["momentum"],
                 "dampening": group["dampening"], "weight_decay": group["weight_decay"],
                 "nesterov": bool(group["nesterov"]), "maximize": bool(group["maximize"]),
                 "grad_scale": grad_scale, "found_inf": found_inf}
        new = [k for k, b in enumerate(momentum_buffers) if b is None]
        functions = step_functions(params)
        if not group["momentum"] or not new or len(new) == len(targets):
            functions.sgd(targets, grads, momentum_buffers,
                          stored=params if mastered else None, cache=cache, **hyper)
            return
        # some parameters start their momentum now (unfrozen, added): torch's fused SGD
        # starts every buffer of one call at once, so those take a call of their own
        held = [k for k, b in enumerate(momentum_buffers) if b is not None]
        for index in (held, new):
            _sgd_part(functions, index, params, grads, targets if mastered else None,
                      momentum_buffers, hyper)


def _sgd_part(functions: ModuleType, index: list[int], params: list[torch.Tensor],
              grads: list[torch.Tensor], masters: list[torch.Tensor] | None,
              momentum_buffers: list[torch.Tensor | None], hyper: dict[str, Any]) -> None:
    """`functions.sgd` over the parameters at `index` (their buffers filled in place)."""
    buffers = [momentum_buffers[k] for k in index]
    targets = masters if masters is not None else params
    functions.sgd([targets[k] for k in index], [grads[k] for k in index], buffers,
                  stored=[params[k] for k in index] if masters is not None else None, **hyper)
    for k, b in zip(index, buffers, strict=True):
        momentum_buffers[k] = b


# -- torchao's Adam update over low-bit states ---------------------------------------------------

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


def _contiguous(*tensors: torch.Tensor | None) -> bool:
    for t in tensors:
        if t is not None:
            local = getattr(t, "to_local", None)
            if not (local() if local is not None else t).is_contiguous():
                return False
    return True


def _eager_torchao(optimizer: Any, items: Sequence[Item]) -> None:
    """torchao's own per-parameter update, eagerly: for tensors not laid out contiguously
    (the one-pass kernel views each parameter as blocks)."""
    adam = formats.torchao_module("torchao.optim.adam", str(items[0].rule.state))
    adamw = isinstance(optimizer, torch.optim.AdamW)
    for item in items:
        p, rule = item.param, item.rule
        assert p.grad is not None
        group = optimizer.param_groups[item.group]
        state = optimizer.state[p]
        target = state["master"] if rule.master is not None else p
        grad = -p.grad if group.get("maximize") else p.grad
        beta1, beta2 = (float(b) for b in group["betas"])
        state["step"] += 1
        adam.single_param_adam(
            target.detach(), grad, state["step"], state["exp_avg"], state["exp_avg_sq"],
            state.get("max_exp_avg_sq"), torch.as_tensor(group["lr"], dtype=torch.float32),
            beta1, beta2, float(group["weight_decay"]), float(group["eps"]),
            adamw or bool(group.get("decoupled_weight_decay")),
            rule.stochastic and target.dtype is torch.bfloat16)
        if target is not p:
            p.copy_(target)


def lowbit_step(optimizer: Any, items: Sequence[Item], compiled: bool) -> None:
    """torchao's Adam update for the low-bit items that have a gradient: their states made
    (or converted) as torchao makes them, then one `update_kernels.lowbit_adam` call per group
    and kind (with masters, stochastic, neither), compiled once per layout."""
    calls, eager = _lowbit_calls(optimizer, items)
    for (index, mastered, stochastic), mine in calls.items():
        _lowbit_group(optimizer, optimizer.param_groups[index], mine, mastered, stochastic,
                      compiled)
    if eager:
        _eager_torchao(optimizer, eager)


def _lowbit_group(optimizer: Any, group: dict[str, Any], mine: list[Item], mastered: bool,
                  stochastic: bool, compiled: bool) -> None:
    """One `update_kernels.lowbit_adam` call over a group's items of one kind."""
    adamw = isinstance(optimizer, torch.optim.AdamW)
    states = [optimizer.state[i.param] for i in mine]
    params = [i.param for i in mine]
    beta1, beta2 = (float(b) for b in group["betas"])
    update_kernels.lowbit_adam(
        [s["master"] for s in states] if mastered else params,
        [p.grad for p in params],  # type: ignore[misc]
        [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
        [s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else [],
        [s["step"] for s in states], lr=group["lr"], beta1=beta1, beta2=beta2,
        eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
        decoupled=adamw or bool(group.get("decoupled_weight_decay")),
        maximize=bool(group.get("maximize")), stored=params if mastered else None,
        stochastic=stochastic, compiled=compiled)


def _lowbit_calls(optimizer: Any, items: Sequence[Item]
                  ) -> tuple[dict[tuple[int, bool, bool], list[Item]], list[Item]]:
    """The low-bit items with a gradient, their states made: by (group, with a master,
    stochastic) for the one-pass kernel, and those it cannot view as blocks (eager)."""
    calls: dict[tuple[int, bool, bool], list[Item]] = {}
    eager: list[Item] = []
    for item in items:
        p, rule = item.param, item.rule
        if p.grad is None:
            continue
        group = optimizer.param_groups[item.group]
        target = held_master(optimizer, p, rule) if rule.master is not None else p
        state = optimizer.state[p]
        _low_bit_state(state, target, rule, bool(group["amsgrad"]))
        if _contiguous(target, p.grad, state["exp_avg"], state["exp_avg_sq"]):
            calls.setdefault((item.group, rule.master is not None, rule.stochastic),
                             []).append(item)
        else:
            eager.append(item)
    return calls, eager


# -- the state a parameter's first step starts from ---------------------------------------------

#: the families whose state before a first step is known here (what `fresh_state` makes)
FRESH = frozenset({"Adam", "AdamW", "SGD"})


def fresh_master(param: torch.Tensor, rule: UpdateRule) -> torch.Tensor:
    """A copy of the master `param`'s next step makes (none is held): from the value kept
    for it (`guard.wide_of`), else from the parameter."""
    assert rule.master is not None
    with torch.no_grad():
        wide = guard.wide_of(param, rule.master)
        return (wide if wide is not None else param.detach()).to(rule.master, copy=True)


def fresh_state(family: str, param: torch.Tensor, rule: UpdateRule, group: dict[str, Any]
                ) -> dict[str, Any]:
    """The state `param`'s first step starts from, as the step would make it: its master from
    the value kept for it (`guard.wide_of`) or the parameter as it is now, zero moments
    (momentum) in the rule's format, step 0."""
    with torch.no_grad():
        target = fresh_master(param, rule) if rule.master else param.detach()
        out: dict[str, Any] = {"master": target} if rule.master else {}
        if family == "SGD":
            if group["momentum"]:
                fmt = rule.state if isinstance(rule.state, torch.dtype) else target.dtype
                out["momentum_buffer"] = torch.zeros_like(target, dtype=fmt)
            return out
        amsgrad = bool(group["amsgrad"])
        if rule.low_bit:
            _low_bit_state(out, target, rule, amsgrad)
            return out
        out["step"] = (torch.zeros((), dtype=torch.float32, device=target.device)
                       if group.get("fused") or group.get("capturable") else torch.tensor(0.0))
        names = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
        for name in names:
            out[name] = torch.zeros_like(target, dtype=rule.state,  # type: ignore[arg-type]
                                         memory_format=torch.preserve_format)
        return out
