"""`optimizer`: one optimizer that makes a plan's update half real.

A plan's `master`, `grad` and `optim` fields say, per module, what the optimizer step does with
its parameters: update them as stored, or an fp32 master copy written back rounded after each
step, or the stored bf16 values with stochastic rounding; accumulate gradients as they arrive,
or in an fp32 buffer; keep the optimizer's state in the dtype of what it updates, in another
float dtype, or in torchao's 8-bit, 4-bit or fp8 states.

`PlanOptimizer` groups the model's parameters by those three fields and runs one engine per
group:

- `_TorchEngine`: the optimizer class you give, as it is, over the parameters or their master
  copies; a master's gradient is upcast a chunk of parameters at a time (never a full-size
  fp32 copy of every gradient), and a state kept narrower than what it updates is upcast a
  chunk at a time around the step and rounded back after it. With nothing to change it is the
  optimizer class itself, stepping as it always does.
- `_TorchaoEngine`: torchao's Adam and AdamW (`AdamW8bit`, `AdamW4bit`, `AdamWFp8`, and its
  full-precision `_AdamW` for stochastic rounding): its per-parameter update reads the
  stored bf16 (or accumulated fp32) gradient and the state in their own dtypes and computes in
  fp32, which is the fused update the plan asks for. Only the loop that hands it each
  parameter's gradient is this file's.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
from torch import nn
from torch.optim import Optimizer

from precision_annot._src.dtypes import STOCHASTIC, dtype_name
from precision_annot._src.float8 import import_torchao
from precision_annot._src.grads import set_grad_dtype
from precision_annot._src.guards import require_module
from precision_annot._src.plan import PrecisionPlan
from precision_annot._src.policy import UpdateKey, update_key
from precision_annot._src.runtime import subject

__all__ = ["PlanOptimizer", "optimizer", "state_bytes"]

#: what `torch.optim` classes keep per parameter, by name (for the plan's memory figures)
_ADAM_FAMILY = ("Adam", "AdamW")
#: the keys of a group that say how it is updated, not hyperparameters
_OURS = ("master", "grad", "optim", "names")
#: the most bytes of fp32 gradients (or upcast state) made at once for one chunk of a step
#: (and never more than an eighth of a group's elements, unless one parameter is larger)
CHUNK_BYTES = 64 * 1024 * 1024


def _is_tensor_lr(group: dict[str, Any]) -> bool:
    return isinstance(group.get("lr"), torch.Tensor)


class _Engine:
    """One group's update: what the optimizer steps (the parameters or their masters), and how
    each parameter's gradient reaches it."""

    def __init__(self, owner: PlanOptimizer, index: int) -> None:
        self.owner = owner
        self.index = index
        group = owner.param_groups[index]
        self.key = UpdateKey(group["master"], group["grad"], group["optim"])
        self.params: list[torch.Tensor] = list(group["params"])
        self.masters: dict[int, torch.Tensor] = {}
        if isinstance(self.key.master, torch.dtype):
            for p in self.params:
                self.masters[id(p)] = p.detach().to(self.key.master).clone()
        self.inner: Optimizer

    def updated(self, p: torch.Tensor) -> torch.Tensor:
        return self.masters.get(id(p), p)

    def sync(self) -> None:
        """The outer group's hyperparameters (an LR scheduler changes them there) into the
        inner optimizer's group."""
        outer = self.owner.param_groups[self.index]
        for inner in self.inner.param_groups:
            for key, value in outer.items():
                if key == "params" or key in _OURS:
                    continue
                if key == "lr" and _is_tensor_lr(inner):
                    inner["lr"].fill_(float(value))
                else:
                    inner[key] = value

    def write_back(self, params: Iterable[torch.Tensor]) -> None:
        """Each master, rounded into its stored parameter: the master is the truth."""
        with torch.no_grad():
            for p in params:
                master = self.masters.get(id(p))
                if master is not None:
                    p.copy_(master)

    def step(self) -> None:
        raise NotImplementedError


class _TorchEngine(_Engine):
    """The optimizer class given, over the parameters or their masters."""

    def __init__(self, owner: PlanOptimizer, index: int, optimizer_class: type[Optimizer],
                 hyperparameters: dict[str, Any]) -> None:
        super().__init__(owner, index)
        self.inner = optimizer_class([self.updated(p) for p in self.params], **hyperparameters)
        low = self.key.optim
        if isinstance(low, str):
            raise AssertionError("low-bit states run in _TorchaoEngine")
        self.state_dtype: torch.dtype | None = low

    def step(self) -> None:
        self.sync()
        key = self.key
        if not self.masters and key.grad is None and self.state_dtype is None:
            self.inner.step()  # nothing to change: the optimizer class, as it is
            return
        group = self.inner.param_groups[0]
        everything = group["params"]
        try:
            for chunk in _chunks(self.params, self._chunk_numel()):
                updated = [self.updated(p) for p in chunk]
                for p, u in zip(chunk, updated, strict=True):
                    grad = self.owner.gradient(p)
                    u.grad = None if grad is None else (
                        grad if grad.dtype == u.dtype and u is not p else grad.to(u.dtype))
                self._state(updated, up=True)
                group["params"] = updated
                self.inner.step()
                self._state(updated, up=False)
                for u in updated:
                    if u.grad is not None and self.masters:
                        u.grad = None
                self.write_back(chunk)
        finally:
            group["params"] = everything

    def _chunk_numel(self) -> int:
        """Elements per chunk: at most CHUNK_BYTES of fp32 and an eighth of the group, but
        at least its largest parameter (a parameter is stepped whole), so that no fp32 copy
        of every gradient is made even on a small model."""
        sizes = [p.numel() for p in self.params]
        return max(max(sizes, default=1), min(CHUNK_BYTES // 4, sum(sizes) // 8))

    def _state(self, updated: list[torch.Tensor], *, up: bool) -> None:
        """A state kept in `optim` between steps is upcast to the dtype of what it updates for
        the step, and rounded back after it (only tensors shaped like the parameter: a step
        counter stays as it is)."""
        low = self.state_dtype
        if low is None:
            return
        for u in updated:
            state = self.inner.state.get(u)
            if not state:
                continue
            for name, value in state.items():
                if isinstance(value, torch.Tensor) and value.shape == u.shape and (
                        value.is_floating_point()):
                    state[name] = value.to(u.dtype if up else low)


def _chunks(params: list[torch.Tensor], numel: int) -> Iterator[list[torch.Tensor]]:
    chunk: list[torch.Tensor] = []
    size = 0
    for p in params:
        if chunk and size + p.numel() > numel:
            yield chunk
            chunk, size = [], 0
        chunk.append(p)
        size += p.numel()
    if chunk:
        yield chunk


#: torchao's classes by (optimizer class name, state): Adam and AdamW only
_TORCHAO = {("AdamW", "8bit"): "AdamW8bit", ("AdamW", "4bit"): "AdamW4bit",
            ("AdamW", "fp8"): "AdamWFp8", ("Adam", "8bit"): "Adam8bit",
            ("Adam", "4bit"): "Adam4bit", ("Adam", "fp8"): "AdamFp8",
            ("AdamW", None): "_AdamW", ("Adam", None): "_AdamW"}
_TORCHAO_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad")


class _TorchaoEngine(_Engine):
    """torchao's Adam or AdamW: low-bit states, and bf16 stochastic rounding. Its update
    computes one parameter at a time in fp32 from the gradient and state as they are stored."""

    def __init__(self, owner: PlanOptimizer, index: int, optimizer_class: type[Optimizer],
                 hyperparameters: dict[str, Any], compile_step: bool) -> None:
        super().__init__(owner, index)
        key = self.key
        family = _family(optimizer_class) or "AdamW"  # optimizer() refused the others
        state = key.optim if isinstance(key.optim, str) else None
        name = _TORCHAO[(family, state)]
        optim = import_torchao("torchao.optim", f"optim={key.optim or 'as stored'}")
        adam = import_torchao("torchao.optim.adam", "the fused update")
        base: Any = getattr(optim, name)
        kwargs = {k: v for k, v in hyperparameters.items() if k in _TORCHAO_KEYS}
        unknown = sorted(set(hyperparameters) - set(_TORCHAO_KEYS))
        if unknown:
            raise ValueError(
                f"optimizer: torchao's {name} (for optim={key.optim}, master={key.master}) "
                f"takes {list(_TORCHAO_KEYS)}; received also {unknown}.")
        if family == "Adam":
            kwargs.setdefault("weight_decay", 0.0)  # torch.optim.Adam's default
        else:
            kwargs.setdefault("weight_decay", 1e-2)  # torch.optim.AdamW's default
        stochastic = key.master == STOCHASTIC
        state_dtype = key.optim if isinstance(key.optim, torch.dtype) else None
        self.inner = base([self.updated(p) for p in self.params], **kwargs,
                          bf16_stochastic_round=stochastic)
        inner = cast(Any, self.inner)
        inner.is_adamw = family == "AdamW"
        if state_dtype is not None:  # full-precision state in another float dtype
            make = inner._new_buffer

            def new_buffer(p: torch.Tensor, signed: bool) -> torch.Tensor:
                out: torch.Tensor = make(p, signed)
                return out.to(state_dtype)

            inner._new_buffer = new_buffer
        kernel = adam.single_param_adam
        self.kernel = torch.compile(kernel, fullgraph=True, dynamic=False) if (
            compile_step) else kernel
        self.stochastic = stochastic

    @torch.no_grad()
    def step(self) -> None:
        self.sync()
        inner = cast(Any, self.inner)
        group = inner.param_groups[0]
        for p in self.params:
            grad = self.owner.gradient(p)
            if grad is None:
                continue
            u = self.updated(p)
            state = inner.state[u]
            if len(state) == 0:  # as torchao's own step initialises it
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = inner._new_buffer(u, True)
                state["exp_avg_sq"] = inner._new_buffer(u, False)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = inner._new_buffer(u, False)
            state["step"] += 1
            self.kernel(u.detach(), grad, state["step"], state["exp_avg"], state["exp_avg_sq"],
                        state.get("max_exp_avg_sq"), group["lr"], group["betas"][0],
                        group["betas"][1], group["weight_decay"], group["eps"],
                        inner.is_adamw, self.stochastic and u.dtype is torch.bfloat16)
            if u is not p:
                p.copy_(u)


def _family(optimizer_class: type[Optimizer]) -> str | None:
    """"Adam" or "AdamW" for torch's classes (and subclasses), else None."""
    for cls in optimizer_class.__mro__:
        if cls.__module__.startswith("torch.optim") and cls.__name__ in _ADAM_FAMILY:
            return cls.__name__
    return None


class PlanOptimizer(Optimizer):
    # marks the optimizers that make a plan's update half real, for the step guard of apply
    _precision_annot_updates = True

    """The optimizer `precision_annot.optimizer` builds: a `torch.optim.Optimizer` whose
    `param_groups` hold the model's parameters, one group per way of updating them (its
    `master`, `grad` and `optim` keys), with the hyperparameters you gave. LR schedulers,
    `zero_grad`, `clip_grad_norm_` on the model's parameters and GradScaler work on it as on
    any optimizer; `state_dict` holds the master copies, so a resumed run continues bit for
    bit.

    Parameters whose gradients accumulate in fp32 (`grad=fp32` over bf16 storage) hold that
    accumulation in `.grad` itself (torch's `Tensor.grad_dtype`, set by `apply`), which the
    step reads.
    """

    def __init__(self, named: list[tuple[str, nn.Parameter, UpdateKey]],
                 optimizer_class: type[Optimizer], hyperparameters: dict[str, Any], *,
                 compile_step: bool = False) -> None:
        groups: dict[UpdateKey, dict[str, Any]] = {}
        for name, param, key in named:
            group = groups.setdefault(key, {"params": [], "names": [], "master": key.master,
                                            "grad": key.grad, "optim": key.optim})
            group["params"].append(param)
            group["names"].append(name)
        super().__init__(list(groups.values()), dict(hyperparameters))
        self.optimizer_class = optimizer_class
        self.buffers: dict[int, torch.Tensor] = {}
        self._views: dict[int, tuple[torch.Tensor, int]] = {}
        self._hooks: list[Any] = []
        self.engines: list[_Engine] = []
        for index, group in enumerate(self.param_groups):
            key = UpdateKey(group["master"], group["grad"], group["optim"])
            torchao = isinstance(key.optim, str) or key.master == STOCHASTIC or (
                key.grad is not None and not isinstance(key.master, torch.dtype))
            if torchao:
                engine: _Engine = _TorchaoEngine(self, index, optimizer_class, hyperparameters,
                                                 compile_step)
            else:
                engine = _TorchEngine(self, index, optimizer_class, hyperparameters)
            cast(Any, engine.inner)._precision_annot_updates = True
            self.engines.append(engine)
            if key.grad is not None:  # .grad is the accumulation (apply set grad_dtype)
                for p in group["params"]:
                    set_grad_dtype(p, key.grad)

    # -- gradients ----------------------------------------------------------------------------
    def _accumulate(self, param: torch.Tensor, dtype: torch.dtype) -> None:
        """Gradients of `param` accumulate in a buffer of `dtype`; `.grad` holds it rounded."""
        buffer = torch.zeros_like(param, dtype=dtype)
        self.buffers[id(param)] = buffer
        ref = weakref.ref(self)

        def arrive(grad: torch.Tensor) -> torch.Tensor:
            """Each micro-batch's gradient, before autograd accumulates it: into the buffer."""
            if ref() is not None:
                buffer.add_(grad)
                param.grad = None  # autograd then sets .grad to this gradient alone
            return grad

        def accumulated(p: torch.Tensor) -> None:
            """After it: .grad holds the buffer rounded, and its version is noted."""
            owner = ref()
            if owner is not None and p.grad is not None:
                with torch.no_grad():
                    p.grad.copy_(buffer)
                owner._views[id(p)] = (p.grad, p.grad._version)

        self._hooks.append(param.register_hook(arrive))  # type: ignore[no-untyped-call]
        self._hooks.append(param.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
            accumulated))

    def gradient(self, param: torch.Tensor) -> torch.Tensor | None:
        """The gradient the step uses for `param`: its buffer, else its `.grad`."""
        buffer = self.buffers.get(id(param))
        if buffer is None:
            return param.grad
        seen = self._views.get(id(param))
        if seen is None:
            return None  # no backward since the last zero_grad
        view, version = seen
        if param.grad is not view or view._version != version:
            raise RuntimeError(
                "optimizer.step(): the .grad of a parameter whose gradients accumulate in an "
                f"{dtype_name(buffer.dtype)} buffer (grad={dtype_name(buffer.dtype)}) was "
                "changed in place, by torch.nn.utils.clip_grad_norm_ or a GradScaler's unscale "
                "say: .grad is the buffer rounded, for reading, and the step uses the buffer. "
                "Clip with optimizer.clip_grad_norm_(max_norm) and scale with "
                "precision_annot.GradScaler, which act on the buffer.")
        return buffer

    def gradients(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, the gradient its step uses) for every parameter that has one."""
        for group in self.param_groups:
            for p in group["params"]:
                grad = self.gradient(p)
                if grad is not None:
                    yield p, grad

    def _refresh(self, param: torch.Tensor) -> None:
        """After the buffer was scaled: `.grad` holds it rounded again."""
        buffer = self.buffers[id(param)]
        if id(param) in self._views:
            view = buffer.to(param.dtype)
            param.grad = view
            self._views[id(param)] = (view, view._version)

    def unscale_(self, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        """What a GradScaler's `unscale_` does, on the gradients the step uses (buffers
        included); `precision_annot.GradScaler` calls it."""
        by_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        touched = []
        for p, grad in self.gradients():
            by_dtype.setdefault((grad.device, grad.dtype), []).append(grad)
            if id(p) in self.buffers:
                touched.append(p)
        for (device, _), grads in by_dtype.items():
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, found_inf.to(device), inv_scale.to(device))
        for p in touched:
            self._refresh(p)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` over the gradients the step uses (an fp32 buffer
        where there is one), computed in fp32; returns the total norm."""
        pairs = list(self.gradients())
        if not pairs:
            return torch.tensor(0.0)
        norms = [torch.linalg.vector_norm(g.float(), norm_type) for _, g in pairs]
        total: torch.Tensor = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p, g in pairs:
            g.mul_(coef.to(g.dtype))
            if id(p) in self.buffers:
                self._refresh(p)
        return total

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for engine in self.engines:
            engine.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for buffer in self.buffers.values():
            buffer.zero_()
        self._views.clear()

    # -- masters and checkpoints ------------------------------------------------------------
    def master(self, param: torch.Tensor) -> torch.Tensor | None:
        """The master copy the step updates for `param`, or None when it updates `param`."""
        for engine in self.engines:
            if id(param) in engine.masters:
                return engine.masters[id(param)]
        return None

    def state_dict(self) -> dict[str, Any]:
        """The hyperparameters, each engine's optimizer state, the master copies and the
        gradient buffers: what a resumed run needs to continue bit for bit."""
        outer = super().state_dict()
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups
                                                   for p in g["params"])}
        return {
            "param_groups": outer["param_groups"],
            "engines": [_portable(engine.inner.state_dict()) for engine in self.engines],
            "masters": {index[k]: m for e in self.engines for k, m in e.masters.items()},
            "buffers": {index[k]: b for k, b in self.buffers.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` saved; the stored parameters are set from their masters
        (the master is the truth)."""
        if set(state_dict) != {"param_groups", "engines", "masters", "buffers"}:
            raise ValueError(
                "PlanOptimizer.load_state_dict expects what PlanOptimizer.state_dict gives "
                "(keys param_groups, engines, masters, buffers). Received keys: "
                f"{sorted(state_dict)}")
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(saved, self.param_groups,
                                                                       strict=False)):
            raise ValueError("PlanOptimizer.load_state_dict: the saved groups do not match "
                             "this optimizer's (another model or plan?).")
        for group, values in zip(self.param_groups, saved, strict=True):
            for key, value in values.items():
                if key != "params":
                    group[key] = value
        flat = [p for g in self.param_groups for p in g["params"]]
        with torch.no_grad():
            for engine, inner_state in zip(self.engines, state_dict["engines"], strict=True):
                for k, master in engine.masters.items():
                    master.copy_(state_dict["masters"][_index(flat, k)])
                _load_inner(engine, inner_state)
                engine.write_back(engine.params)
            for k, buffer in self.buffers.items():
                buffer.copy_(state_dict["buffers"][_index(flat, k)])

    def __repr__(self) -> str:
        lines = [f"PlanOptimizer({self.optimizer_class.__name__},"]
        for group, engine in zip(self.param_groups, self.engines, strict=True):
            lines.append(f"  {UpdateKey(group['master'], group['grad'], group['optim'])}: "
                         f"{len(group['params'])} parameters, {type(engine.inner).__name__}")
        return "\n".join(lines) + ")"


def _index(flat: list[torch.Tensor], key: int) -> int:
    return next(i for i, p in enumerate(flat) if id(p) == key)


def _load_inner(engine: _Engine, state: dict[str, Any]) -> None:
    """Load an engine's optimizer state as saved: torch's `load_state_dict` casts each state
    tensor to its parameter's dtype, which would widen a state kept narrower (or dequantize a
    low-bit one), so the saved tensors are put back as they are (torchao's low-bit tensors
    cannot be cloned: the state holds the loaded ones)."""
    inner = engine.inner
    state = _rebuilt(state)
    inner.load_state_dict(state)
    params = [p for g in inner.param_groups for p in g["params"]]
    for index, saved in state["state"].items():
        inner.state[params[index]] = dict(saved)


_SUBCLASS = "__tensor_subclass__"


def _portable(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state_dict with torchao's low-bit state tensors (tensor subclasses) saved
    as their plain inner tensors, so that any `torch.load` reads it back: Lightning's, with a
    callable map_location, cannot rebuild a tensor subclass, and `weights_only=True` refuses
    one."""
    def plain(value: Any) -> Any:
        flatten = getattr(value, "__tensor_flatten__", None)
        if flatten is None or not type(value).__module__.startswith("torchao"):
            return value
        names, ctx = flatten()
        cls = type(value)
        return {_SUBCLASS: f"{cls.__module__}:{cls.__qualname__}", "ctx": ctx,
                "inner": {n: getattr(value, n) for n in names}, "size": tuple(value.shape),
                "stride": tuple(value.stride())}

    return {**state, "state": {k: {n: plain(v) for n, v in s.items()}
                               for k, s in state["state"].items()}}


def _rebuilt(state: dict[str, Any]) -> dict[str, Any]:
    """`_portable`, undone."""
    import importlib

    def tensor(value: Any) -> Any:
        if not (isinstance(value, dict) and _SUBCLASS in value):
            return value
        module, _, name = value[_SUBCLASS].partition(":")
        cls: Any = importlib.import_module(module)
        for part in name.split("."):
            cls = getattr(cls, part)
        return cls.__tensor_unflatten__(value["inner"], value["ctx"], value["size"],
                                        value["stride"])

    return {**state, "state": {k: {n: tensor(v) for n, v in s.items()}
                               for k, s in state["state"].items()}}


def optimizer(model: nn.Module, optimizer_class: type[Optimizer], /, *,
              plan: PrecisionPlan | None = None, compile_step: bool = False,
              **hyperparameters: Any) -> PlanOptimizer:
    """One optimizer that makes the plan's update half real: master copies, gradient
    accumulation buffers and optimizer-state dtypes, per module.

    Build it after `apply` (which gives the parameters their storage dtypes), over the whole
    model: its parameters are grouped by how their module's `master`, `grad` and `optim` say
    they are updated, each group with `hyperparameters`.

    - `master=fp32` over bf16 storage: the optimizer class steps an fp32 copy of each
      parameter, from its gradient upcast a chunk at a time, and writes it back rounded.
    - `master="stochastic"`: no copy; torchao's update writes into bf16 with stochastic
      rounding (Adam and AdamW).
    - `grad=fp32` over bf16 storage: gradients accumulate across micro-batches in `.grad`,
      in fp32 (`apply` sets torch's `grad_dtype`), which the step reads.
    - `optim=bf16` (a float dtype): the state is kept in it between steps (the optimizer class
      runs on it upcast, a chunk at a time); `optim="8bit"`, `"4bit"`, `"fp8"`: torchao's
      low-bit states (Adam and AdamW).

    Args:
        model: the model, with its plan applied (wrappers are seen through).
        optimizer_class: a `torch.optim.Optimizer` class, e.g. `torch.optim.AdamW`.
        plan: the plan whose update fields to use; the one applied to `model` when None.
            (Default: None)
        compile_step: run torchao's per-parameter update through `torch.compile` (one fused
            kernel per parameter shape; the first step compiles). (Default: False)
        **hyperparameters: for `optimizer_class` (`lr`, `weight_decay`, ...).

    Returns:
        A `PlanOptimizer`.

    Raises:
        ValueError: for an update the optimizer class cannot make (a low-bit state or
            stochastic rounding with another class than Adam or AdamW), naming the modules.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import precision_annot as pa
        >>> model = pa.apply(nn.Linear(8, 8), default="bf16-true,master=fp32")
        >>> opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-3)
        >>> opt.master(model.weight).dtype
        torch.float32
    """
    require_module(model, "optimizer")
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
        raise TypeError("optimizer: optimizer_class must be a torch.optim.Optimizer class, "
                        f"e.g. torch.optim.AdamW. Received: {optimizer_class!r}")
    given = subject(model if plan is None else plan, "optimizer")
    plan = given.plan
    target = given.model if given.model is not None else model
    named = _trainable(target, plan)
    needs: dict[str, list[str]] = {}
    for full, _, key in named:
        if isinstance(key.optim, str) or key.master == STOCHASTIC or (
                key.grad is not None and not isinstance(key.master, torch.dtype)):
            needs.setdefault(str(key), []).append(full)  # only torchao's Adam(W) steps these
    if needs and _family(optimizer_class) is None:
        what, names = next(iter(needs.items()))
        raise ValueError(
            f"optimizer: {what} for {len(names)} parameter(s), e.g. {names[0]!r}, runs "
            f"through torchao's Adam and AdamW, and optimizer_class is "
            f"{optimizer_class.__name__}. Use torch.optim.AdamW or torch.optim.Adam, or plan "
            "those modules with master=fp32 and a float optim.")
    if not named:
        raise ValueError("optimizer: the model has no trainable parameters.")
    return PlanOptimizer(named, optimizer_class, hyperparameters, compile_step=compile_step)


def state_bytes(optimizer: Optimizer) -> int:
    """The bytes of every tensor an optimizer's state holds on this rank (a low-bit state's
    codes, scales and maps included; a DTensor's local shard), masters and gradient buffers of
    a `PlanOptimizer` included."""
    def nbytes(t: torch.Tensor) -> int:
        if hasattr(t, "to_local"):  # a DTensor: this rank's shard
            t = t.to_local()
        inner = getattr(t, "__tensor_flatten__", None)
        if inner is not None and type(t) is not torch.Tensor and type(t) is not nn.Parameter:
            names, _ = inner()
            return sum(nbytes(getattr(t, n)) for n in names)
        return t.numel() * t.element_size()

    inners = [e.inner for e in optimizer.engines] if isinstance(optimizer, PlanOptimizer) else [
        optimizer]
    total = sum(nbytes(v) for o in inners for s in o.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    if isinstance(optimizer, PlanOptimizer):
        total += sum(m.numel() * m.element_size() for e in optimizer.engines
                     for m in e.masters.values())
        total += sum(b.numel() * b.element_size() for b in optimizer.buffers.values())
    return total


def _trainable(model: nn.Module, plan: PrecisionPlan) -> list[tuple[str, nn.Parameter,
                                                                       UpdateKey]]:
    """Each trainable parameter once (a tie at its first holder), with its full name and how
    its module's plan updates it."""
    named: list[tuple[str, nn.Parameter, UpdateKey]] = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        if name not in plan:
            continue
        policy = plan[name].policy
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            named.append((f"{name}.{pname}" if name else pname, p,
                          update_key(policy.master, policy.grad, policy.optim, p)))
    return named
