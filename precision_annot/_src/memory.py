"""What a plan costs in memory during training: per module, the bytes of parameters, gradients,
master copies and optimizer state, for a named optimizer, worked out from what `resolve` saw
of each parameter (its shape) by the rules `optimizer` and torchao follow. A measured run
equals it: tests/test_update.py sums the `nbytes` of every tensor after a step."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch.optim import Optimizer

from precision_annot._src.policy import Policy, update_key
from precision_annot._src.tables import format_table, human_bytes


class _Tensor(Protocol):
    """What is read of a parameter the plan saw (`plan.TensorInfo`)."""

    @property
    def numel(self) -> int: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def trainable(self) -> bool: ...
    @property
    def tied(self) -> str | None: ...


class _Row(Protocol):
    """What is read of a plan's row (`plan.ModulePlan`): the plan calls this file."""

    @property
    def policy(self) -> Policy: ...
    @property
    def own_params(self) -> tuple[Any, ...]: ...

__all__ = ["MemoryReport", "ModuleMemory", "plan_memory"]

#: torchao's low-bit states: (block size, code bytes per element, bytes of its value map);
#: a tensor is quantized when it has at least 4096 elements in whole blocks, as bitsandbytes
#: does, else its state is kept in the dtype of what is updated
_LOW_BIT: dict[str, tuple[int, float, int]] = {"8bit": (256, 1.0, 256 * 4),
                                                "4bit": (128, 0.5, 16 * 4),
                                                "fp8": (256, 1.0, 0)}
_MIN_QUANTIZED = 4096


@dataclasses.dataclass(frozen=True)
class ModuleMemory:
    """One module's own tensors during training, in bytes.

    Attributes:
        name: the module's qualified name.
        params: its parameter elements.
        param_bytes: its parameters, as stored.
        grad_bytes: its gradients (`.grad`, in the storage dtype, or in `grad` where that
            is wider).
        master_bytes: master copies (`master` wider than storage).
        state_bytes: the optimizer's state for its parameters.
    """

    name: str
    params: int
    param_bytes: int
    grad_bytes: int
    master_bytes: int
    state_bytes: int

    @property
    def total(self) -> int:
        return self.param_bytes + self.grad_bytes + self.master_bytes + self.state_bytes


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """`plan.memory(...)`: per module and in total, the bytes training holds.

    Attributes:
        optimizer: the optimizer it was worked out for.
        modules: a row per module that holds parameters.
    """

    optimizer: str
    modules: tuple[ModuleMemory, ...]

    def total(self, field: str = "total") -> int:
        """Bytes over the model: "param_bytes", "grad_bytes", "master_bytes", "state_bytes",
        or "total"."""
        return sum(getattr(m, field) for m in self.modules)

    @property
    def params(self) -> int:
        return sum(m.params for m in self.modules)

    def per_param(self, field: str = "total") -> float:
        """Bytes per parameter element."""
        return self.total(field) / max(self.params, 1)

    def __str__(self) -> str:
        rows: list[tuple[str, ...]] = [("module", "params", "parameters", "gradients",
                                        "masters", "state", "total")]
        for m in self.modules:
            rows.append((m.name or "(root)", f"{m.params:,}", human_bytes(m.param_bytes),
                         human_bytes(m.grad_bytes), human_bytes(m.master_bytes),
                         human_bytes(m.state_bytes), human_bytes(m.total)))
        fields = ("param_bytes", "grad_bytes", "master_bytes", "state_bytes", "total")
        rows.append(("total", f"{self.params:,}", *(human_bytes(self.total(f))
                                                    for f in fields)))
        rows.append(("bytes per parameter", "", *(f"{self.per_param(f):.2f}" for f in fields)))
        lines = format_table(rows, right={1, 2, 3, 4, 5, 6})
        return "\n".join([f"memory while training with {self.optimizer}:", *lines])


def _states(optimizer: str | type[Optimizer], hyperparameters: dict[str, Any]
            ) -> tuple[str, int, bool]:
    """(its name, the state tensors it keeps per parameter, whether it keeps a step counter
    tensor) for the optimizers whose state is known."""
    name = optimizer if isinstance(optimizer, str) else optimizer.__name__
    key = name.lower()
    amsgrad = bool(hyperparameters.get("amsgrad", False))
    momentum = bool(hyperparameters.get("momentum", 0))
    known: dict[str, tuple[int, bool]] = {
        "adamw": (2 + amsgrad, True), "adam": (2 + amsgrad, True),
        "sgd": (int(momentum), False),
        "rmsprop": (1 + momentum + bool(hyperparameters.get("centered", False)), True),
        "adagrad": (1, True),
    }
    if key not in known:
        raise ValueError(f"memory: the state of optimizer={name!r} is not known here. Valid: "
                         f"{', '.join(repr(k) for k in known)} (or their torch.optim classes)")
    count, step = known[key]
    return name, count, step


def _state_bytes(info: _Tensor, updated: torch.dtype, optim: torch.dtype | str | None,
                 count: int, step: bool) -> int:
    numel = info.numel
    if isinstance(optim, str):
        block, code, mapped = _LOW_BIT[optim]
        if numel >= _MIN_QUANTIZED and numel % block == 0:
            one = int(numel * code) + numel // block * 4 + mapped
        else:
            one = numel * updated.itemsize
    else:
        one = numel * (optim or updated).itemsize
    return count * one + (4 if step and count else 0)


def plan_memory(rows_of: Iterable[tuple[str, _Row]], captured: bool,
                optimizer: str | type[Optimizer] = "adamw", **hyperparameters: Any
                ) -> MemoryReport:
    """See `PrecisionPlan.memory`: `rows_of` is the plan's (name, row) pairs."""
    name, count, step = _states(optimizer, hyperparameters)
    if not captured:
        raise ValueError("memory: this plan holds no tensor shapes (a plan file written by "
                         "precision_annot 0.3 or older); resolve it from the model again.")
    rows = []
    for module, entry in rows_of:
        infos: list[_Tensor] = [t for t in entry.own_params if t.tied is None]
        if not infos:
            continue
        policy = entry.policy
        params = grads = masters = state = 0
        for info in infos:
            stored = info.dtype
            params += info.numel * stored.itemsize
            if not info.trainable or not stored.is_floating_point:
                continue
            probe = torch.empty(0, dtype=stored)
            key = update_key(policy.master, policy.grad, policy.optim, probe)
            grads += info.numel * (key.grad or stored).itemsize  # .grad accumulates in it
            updated = key.master if isinstance(key.master, torch.dtype) else stored
            if isinstance(key.master, torch.dtype):
                masters += info.numel * key.master.itemsize
            state += _state_bytes(info, updated, key.optim, count, step)
        rows.append(ModuleMemory(module, sum(t.numel for t in infos), params, grads, masters,
                                 state))
    return MemoryReport(name, tuple(rows))
