"""`UpdateRule`: how one parameter is updated, decided once per (policy, stored dtype).

A module's `master`, `grad` and `optim` fields say what the optimizer step should do with its
parameters; what that means for one parameter depends on the dtype it is stored in (a master
of fp32 beside fp32 weights is no master at all). `update_rule` decides it, and everything that
asks "how is this parameter updated" asks it: `precision_annot.optimizer` (at every step, from
the dtype the parameter has then), the step guard `apply` installs, `plan.memory`, `audit`,
`check` and its findings, and the DeepSpeed export. tests/test_update_rule.py shows they agree.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping
from typing import Any, Literal, NamedTuple, Protocol, TypeAlias

import torch

from precision_annot._src.dtypes import (
    LOW_BIT_STATES,
    STOCHASTIC,
    bf16,
    dtype_name,
    fp16,
    fp32,
    fp64,
    wider,
)
from precision_annot._src.update.formats import low_bit_bytes

__all__ = ["Engine", "Item", "UpdateFields", "UpdateRule", "fields_of", "module_rules",
           "update_rule"]

#: how a step runs for a parameter:
#: "direct": the optimizer class's own step on the stored parameter;
#: "master": the class's own step on its master copy, written back rounded;
#: "copy": the class's own step on a copy made for the step in the working dtype (stochastic
#:     rounding, or a gradient or state wider than the parameter), written back rounded;
#: "torchao": torchao's Adam update over low-bit states (Adam and AdamW only)
Engine: TypeAlias = Literal["direct", "master", "copy", "torchao"]

#: the complex dtype whose parts are each real dtype, and back
_COMPLEX = {fp32: torch.complex64, fp64: torch.complex128, fp16: torch.complex32}
_REAL = {c: r for r, c in _COMPLEX.items()}


class UpdateFields(NamedTuple):
    """A module's three update fields, as its policy holds them."""

    master: torch.dtype | str | None = None
    grad: torch.dtype | None = None
    optim: torch.dtype | str | None = None

    def __str__(self) -> str:
        parts = [f"{k}={v if isinstance(v, str) else dtype_name(v)}"
                 for k, v in self._asdict().items() if v is not None]
        return ",".join(parts) or "as stored"


class _HasUpdateFields(Protocol):
    @property
    def master(self) -> torch.dtype | str | None: ...
    @property
    def grad(self) -> torch.dtype | None: ...
    @property
    def optim(self) -> torch.dtype | str | None: ...


def fields_of(policy: _HasUpdateFields) -> UpdateFields:
    """The update fields of a `Policy` (or anything holding the three)."""
    return UpdateFields(policy.master, policy.grad, policy.optim)


@dataclasses.dataclass(frozen=True)
class UpdateRule:
    """How one parameter is updated: whether there is a master, the dtype its gradient
    accumulates in, the format its optimizer state is kept in, and the engine that steps it.

    Attributes:
        stored: the dtype the parameter is stored in.
        master: the dtype of its master copy (wider than `stored`), or None.
        stochastic: each update is written into bf16 storage with stochastic rounding.
        grad: the dtype its gradient accumulates in (`.grad`'s dtype): `stored`, or wider.
        state: the format its optimizer state (moments, momentum) is kept in between steps: a
            dtype, or a low-bit state ("8bit", "4bit", "fp8", torchao's).
    """

    stored: torch.dtype
    master: torch.dtype | None = None
    stochastic: bool = False
    grad: torch.dtype | None = None
    state: torch.dtype | str | None = None

    def __post_init__(self) -> None:
        if self.grad is None:
            object.__setattr__(self, "grad", self.stored)
        if self.state is None:
            object.__setattr__(self, "state", self.updated)

    @property
    def updated(self) -> torch.dtype:
        """The dtype of what the step updates and keeps: the master, else the parameter."""
        return self.master if self.master is not None else self.stored

    @property
    def low_bit(self) -> bool:
        return isinstance(self.state, str)

    @property
    def working(self) -> torch.dtype:
        """The dtype the optimizer class computes in: the master's, fp32 for stochastic
        rounding, else the widest of the parameter, its gradient and its state."""
        if self.master is not None:
            return self.master
        if self.stochastic:
            return fp32
        widest = self.stored
        for dtype in (self.grad, self.state):
            if isinstance(dtype, torch.dtype) and _wider(dtype, widest):
                widest = dtype
        return widest

    @property
    def engine(self) -> Engine:
        if self.low_bit:
            return "torchao"
        if self.master is not None:
            return "master"
        return "copy" if self.working != self.stored else "direct"

    @property
    def torchao(self) -> str | None:
        """What this update takes from torchao (a low-bit format, or "stochastic" for its
        rounding; see `formats.torchao_use`), or None when it needs none."""
        if isinstance(self.state, str):
            return self.state
        return STOCHASTIC if self.stochastic else None

    @property
    def plain(self) -> bool:
        """True when a plain optimizer over the parameter makes this update: nothing kept
        beside it, its gradient and state in its own dtype."""
        return self.engine == "direct" and self.state == self.stored

    def describe(self) -> str:
        """What differs from a plain update, as the plan's fields say it ("master=fp32",
        "master=stochastic,optim=8bit"); "as stored" when nothing does."""
        parts = []
        if self.master is not None:
            parts.append(f"master={dtype_name(self.master)}")
        if self.stochastic:
            parts.append(f"master={STOCHASTIC}")
        if self.grad != self.stored:
            parts.append(f"grad={dtype_name(self.grad)}")
        if self.state != self.updated:
            state = self.state
            parts.append(f"optim={state if isinstance(state, str) else dtype_name(state)}")
        return ",".join(parts) or "as stored"

    def state_bytes(self, numel: int) -> int:
        """The bytes of one state tensor shaped like the parameter, in this rule's format (a
        low-bit state's codes, scales and value map; a tensor too small to quantize is kept
        in the dtype of what is updated, as torchao and bitsandbytes do)."""
        state = self.state
        if isinstance(state, str):
            quantized = low_bit_bytes(state, numel)
            return quantized if quantized is not None else numel * self.updated.itemsize
        assert state is not None
        return numel * state.itemsize


def _wider(a: torch.dtype, b: torch.dtype) -> bool:
    return wider(_REAL.get(a, a), _REAL.get(b, b))


def _complex_of(dtype: torch.dtype | None) -> torch.dtype | None:
    return None if dtype is None else _COMPLEX.get(dtype)


@functools.lru_cache(maxsize=1024)
def update_rule(master: torch.dtype | str | None, grad: torch.dtype | None,
                optim: torch.dtype | str | None, stored: torch.dtype) -> UpdateRule:
    """The rule for a parameter stored in `stored` whose module says `master`, `grad` and
    `optim`: a master or a gradient dtype only where wider than the parameter, a state format
    only where it differs from what is updated. A complex parameter takes the complex dtype of
    each field (fp32 -> complex64: a complex64 parameter has no fp32 master, which would drop
    its imaginary part), and keeps a state no complex dtype or low-bit format holds as what is
    updated.

    Raises:
        ValueError: master="stochastic" over fp16 storage (torchao rounds into bf16 only).
    """
    if stored.is_complex:
        return _complex_rule(master, grad, optim, stored)
    if not stored.is_floating_point:
        return UpdateRule(stored)
    copy = master if isinstance(master, torch.dtype) and wider(master, stored) else None
    stochastic = master == STOCHASTIC and stored == bf16
    if master == STOCHASTIC and stored == fp16:
        raise ValueError("master='stochastic' writes updates into bf16 with stochastic "
                         "rounding (torchao's), and this parameter is stored in fp16. Store "
                         "it in bf16, or use master=fp32.")
    accumulate = grad if grad is not None and wider(grad, stored) else None
    updated = copy if copy is not None else stored
    state = None if optim is None or optim == updated else optim
    return UpdateRule(stored, copy, stochastic, accumulate, state)


def _complex_rule(master: torch.dtype | str | None, grad: torch.dtype | None,
                  optim: torch.dtype | str | None, stored: torch.dtype) -> UpdateRule:
    real = _REAL.get(stored)
    if real is None:  # no real dtype of its parts to compare with
        return UpdateRule(stored)
    copy = _complex_of(master) if isinstance(master, torch.dtype) and wider(master, real) else None
    accumulate = _complex_of(grad) if grad is not None and wider(grad, real) else None
    updated = copy if copy is not None else stored
    state = _complex_of(optim) if isinstance(optim, torch.dtype) else None
    return UpdateRule(stored, copy, False, accumulate, None if state == updated else state)


def rule_for(fields: UpdateFields, stored: torch.dtype) -> UpdateRule:
    """`update_rule` for a module's fields."""
    return update_rule(fields.master, fields.grad, fields.optim, stored)


# -- a plan's rows, without the model -----------------------------------------------------------

class _Tensor(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def numel(self) -> int: ...
    @property
    def trainable(self) -> bool: ...
    @property
    def tied(self) -> str | None: ...
    @property
    def buffer(self) -> bool: ...


class _Row(Protocol):
    @property
    def policy(self) -> Any: ...
    @property
    def facts(self) -> Any: ...
    @property
    def numel(self) -> Mapping[torch.dtype, int]: ...


def module_rules(row: _Row, *, tied: bool = False) -> Iterator[tuple[_Tensor, UpdateRule]]:
    """Each trainable parameter a plan's row holds (each shared one at its first holder only,
    unless `tied`), with its rule: from the dtype the plan holds it in. A row of a plan file
    written without tensor facts gives one entry per stored dtype it counted."""
    fields = fields_of(row.policy)
    if row.facts is None:
        for dtype, numel in row.numel.items():
            yield _Unknown(dtype, numel=numel), rule_for(fields, dtype)
        return
    for info in row.facts.params:
        if not info.trainable or (info.tied is not None and not tied):
            continue
        yield info, rule_for(fields, info.dtype)


@dataclasses.dataclass(frozen=True)
class _Unknown:
    """A parameter a plan file did not describe: only the storage its module plans."""

    dtype: torch.dtype
    name: str = "?"
    numel: int = 0
    trainable: bool = True
    tied: str | None = None
    buffer: bool = False


def low_bit_name(state: object) -> str | None:
    return state if isinstance(state, str) and state in LOW_BIT_STATES else None


@dataclasses.dataclass
class Item:
    """One parameter of a step: where it sits in the groups, its name and rule."""

    group: int
    param: torch.Tensor
    rule: UpdateRule
    name: str
