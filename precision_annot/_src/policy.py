"""`Policy`: the four dtypes one module runs with, and the string grammar that round-trips."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, Literal, TypeAlias

import torch

from precision_annot._src.dtypes import (
    BACKWARDS,
    EMULATIONS,
    FP8,
    FP8_RECIPES,
    LOW_PRECISION,
    bf16,
    dtype_name,
    fp16,
    fp32,
    fp64,
    parse_compute,
    to_dtype,
    to_master,
    to_optim,
    wider,
)
from precision_annot._src.update.rule import update_rule

__all__ = ["FIELDS", "PRESETS", "UPDATE_FIELDS", "AutocastMode", "Policy", "SpecLike",
           "as_policy", "autocast_mode", "exit_dtype", "is_boundary", "policy_from",
           "preset_name"]

#: the forward fields, then the update fields; every one is inherited but `output`
FIELDS: tuple[str, ...] = ("compute", "storage", "comm", "output", "master", "grad", "optim")
#: what the optimizer step does with a module's parameters
UPDATE_FIELDS: tuple[str, ...] = ("master", "grad", "optim")

#: Short keys accepted by `Policy.parse`, after jmp's "p=f32,c=bf16" grammar.
_KEY_ALIASES: dict[str, str] = {
    "compute": "compute",
    "c": "compute",
    "storage": "storage",
    "s": "storage",
    "param": "storage",
    "p": "storage",
    "comm": "comm",
    "reduce": "comm",
    "r": "comm",
    "output": "output",
    "o": "output",
    "master": "master",
    "m": "master",
    "grad": "grad",
    "g": "grad",
    "optim": "optim",
    "state": "optim",
    "backward": "backward",
    "bwd": "backward",
}

#: each field's reader: the dtype fields take a dtype name, two of the update fields more
_READERS = {"master": to_master, "optim": to_optim}


def _read(field: str, value: object) -> object:
    reader = _READERS.get(field)
    return reader(value) if reader is not None else to_dtype(value, field=field)


@dataclasses.dataclass(frozen=True)
class Policy:
    """The dtypes one module runs with; each field left None is inherited or left alone.

    A policy is declared per module (by class, instance, scope or rule) and resolved into
    a `PrecisionPlan`, which `apply` or an adapter makes real.

    Args:
        compute: dtype the module's forward runs in. None inherits the parent's.
            (Default: None)
        storage: dtype the module's own parameters and floating buffers are kept in, and so
            the dtype the optimizer updates. None inherits the parent's; where nothing sets
            it, parameters keep the dtype they have. (Default: None)
        comm: dtype the module's parameter gradients are reduced in across ranks. None
            inherits; where nothing sets it, the backend's default. (Default: None)
        output: dtype the module's outputs are handed back in. None hands them back in the
            parent's compute dtype (see the runtime rules); unlike the other fields it is not
            inherited by children. (Default: None)
        master: what the optimizer updates, for `precision_annot.optimizer`: a dtype wider than
            storage (an fp32 master copy of each parameter, written back rounded into storage
            after each step), or "stochastic" (no copy: each update written into bf16 storage
            with stochastic rounding). None updates the stored parameters themselves.
            (Default: None)
        grad: the dtype gradients are accumulated in across micro-batches, when wider than
            storage (an fp32 buffer beside bf16 parameters). None accumulates them in storage.
            (Default: None)
        optim: the dtype of the optimizer's state (Adam's moments, SGD's momentum): a float
            dtype, or "8bit", "4bit", "fp8" (torchao's low-bit states). None keeps it in the
            dtype of what is updated. (Default: None)
        backward: what the backward GEMMs of a Linear whose `output` is wider than its
            `compute` make of the wide output gradient: "round" it to compute (the default),
            "split2" or "split3" it into 2 or 3 pieces in compute, one GEMM each, summed
            wide, or compute them "wide". Not inherited, like `output`. (Default: None)

    Compute also takes "bf16x9" or "bf16x3": fp32 compute whose Linear GEMMs are emulated
    from bf16 pieces of their fp32 operands (9 products, as cuBLAS's "bfx9"; or the 3
    largest), in both passes.

    Example:
        >>> p = Policy.parse("compute=bf16,storage=fp32")
        >>> p
        Policy(compute=bf16, storage=fp32)
        >>> Policy.parse(str(p)) == p
        True
    """

    compute: torch.dtype | None = None
    storage: torch.dtype | None = None
    comm: torch.dtype | None = None
    output: torch.dtype | None = None
    gemm: str | None = None
    master: torch.dtype | str | None = None
    grad: torch.dtype | None = None
    optim: torch.dtype | str | None = None
    backward: str | None = None

    def __post_init__(self) -> None:
        compute, gemm = (None, None) if self.compute is None else parse_compute(self.compute)
        if self.gemm is not None:
            valid = (*FP8_RECIPES, *EMULATIONS)
            if not isinstance(self.gemm, str) or self.gemm.strip().lower() not in valid:
                raise ValueError(f"gemm must be one of {', '.join(map(repr, valid))}. "
                                 f"Received: gemm={self.gemm!r}")
            gemm = self.gemm.strip().lower()
        if gemm in EMULATIONS:
            if compute not in (None, fp32):
                raise ValueError(f"compute={dtype_name(compute)} with gemm={gemm!r}: {gemm} "
                                 "emulates fp32 GEMMs; the module computes in fp32")
            compute = fp32
        object.__setattr__(self, "compute", compute)
        object.__setattr__(self, "gemm", gemm)
        if self.backward is not None:
            key = self.backward.strip().lower() if isinstance(self.backward, str) else None
            if key not in BACKWARDS:
                raise ValueError(f"backward must be one of {', '.join(map(repr, BACKWARDS))}."
                                 f" Received: backward={self.backward!r}")
            object.__setattr__(self, "backward", key)
        for field in FIELDS[1:]:
            value = getattr(self, field)
            if value is not None:
                object.__setattr__(self, field, _read(field, value))

    @classmethod
    def parse(cls, text: str) -> Policy:
        """Parse "compute=bf16,storage=fp32", a bare dtype such as "fp32", a preset, or a dtype
        or preset followed by fields ("fp32,output=fp32", "bf16-mixed,compute=fp8").

        A bare dtype sets compute, storage and comm. The presets are Lightning's precision
        strings: "32-true", "16-true", "bf16-true", "64-true", and "16-mixed" and
        "bf16-mixed", which keep storage and comm in fp32 and compute in the low dtype; and
        "bf16-master", DeepSpeed's bf16 layout: bf16 parameters and compute, fp32 master
        weights and fp32 gradient accumulation ("bf16-true,master=fp32,grad=fp32"), which is
        DeepSpeed's `bf16_master_weights_and_grads: false` (its `true` keeps bf16 masters).
        """
        if not isinstance(text, str):
            raise TypeError(
                f"Policy.parse expects a str. Received: text={text!r} "
                f"(of type {type(text).__name__})"
            )
        stripped = text.strip()
        lowered = stripped.lower()
        if lowered in ("", "inherit"):
            return cls()
        if lowered in PRESETS:
            return PRESETS[lowered]
        head, comma, rest = stripped.partition(",")
        if comma and "=" not in head and "=" in rest:  # a base, then fields: "fp32,output=fp32"
            return cls.parse(head).merge(cls.parse(rest))
        if lowered in EMULATIONS:  # fp32 throughout, its GEMMs emulated
            return cls(compute=fp32, storage=fp32, comm=fp32, gemm=lowered)
        if "=" not in stripped:
            dtype = _bare_dtype(text)
            return cls(compute=dtype, storage=dtype, comm=dtype)
        return cls(**_pairs(text))  # type: ignore[arg-type]

    def show(self, field: str) -> str:
        """One field as the table and the string form print it: "bf16", or for the compute of
        an fp8 module "fp8-rowwise/bf16" (GEMMs / other ops), "-" where unset."""
        if field == "compute" and self.gemm in EMULATIONS:
            return self.gemm
        if field == "compute" and self.gemm is not None:
            return self.gemm + (f"/{dtype_name(self.compute)}" if self.compute else "")
        value = getattr(self, field)
        if value is None:
            return "-"
        if isinstance(value, str):
            return value
        return "fp8" if value == FP8 else dtype_name(value)

    def _parts(self) -> list[str]:
        parts = [f"{f}={self.show(f)}" for f in FIELDS
                 if getattr(self, f) is not None or (f == "compute" and self.gemm)]
        return parts + ([f"backward={self.backward}"] if self.backward else [])

    def __str__(self) -> str:
        parts = self._parts()
        return ",".join(parts) if parts else "inherit"

    def __repr__(self) -> str:
        return f"Policy({', '.join(self._parts())})"

    @property
    def fp8(self) -> str | None:
        """The fp8 recipe this module's Linear GEMMs run in, or None."""
        return self.gemm if self.gemm in FP8_RECIPES else None

    @property
    def emulation(self) -> str | None:
        """"bf16x9" or "bf16x3" where this module's fp32 Linear GEMMs are emulated, or None."""
        return self.gemm if self.gemm in EMULATIONS else None

    @property
    def wide_output(self) -> bool:
        """True when this module's Linear GEMMs hand back a wider dtype than they compute
        in (`output` wider than a low `compute`): accumulated and returned in `output`, never
        rounded to `compute` on the way."""
        return (self.compute in LOW_PRECISION and self.output is not None
                and wider(self.output, self.compute))

    def items(self) -> Iterator[tuple[str, torch.dtype | str | None]]:
        """(field, value) pairs in field order: a dtype, or for master and optim a name
        ("stochastic", "8bit"), or None."""
        for field in FIELDS:
            yield field, getattr(self, field)

    def merge(self, other: Policy) -> Policy:
        """A copy where every field that `other` sets replaces this policy's. Compute and the
        fp8 GEMM recipe are one slot: a compute dtype set alone clears the recipe."""
        fields: dict[str, Any] = {f: v if v is not None else getattr(self, f)
                                  for f, v in other.items()}
        gemm = other.gemm if other.gemm is not None else (
            None if other.compute is not None else self.gemm)
        backward = other.backward if other.backward is not None else self.backward
        return Policy(**fields, gemm=gemm, backward=backward)

    @property
    def grad_comm(self) -> torch.dtype | None:
        """The dtype gradients are reduced in: `comm`, except that with comm=fp8 (weights
        all-gathered in fp8) gradients are reduced in the storage dtype (the master weights'),
        or, with storage unset, in the parameters' own dtype (None)."""
        return self.storage if self.comm == FP8 else self.comm

    def is_empty(self) -> bool:
        """True when no field is set."""
        return (all(v is None for _, v in self.items()) and self.gemm is None
                and self.backward is None)

    def uses(self, dtype: torch.dtype) -> bool:
        """True when any forward field is `dtype` (the dtypes the forward and backward run)."""
        return any(getattr(self, f) == dtype for f in FIELDS if f not in UPDATE_FIELDS)

    @property
    def copies_master(self) -> bool:
        """True when the optimizer keeps a master copy beside parameters stored in `storage`
        (what `UpdateRule` says for that dtype); with storage unset, when master is a dtype."""
        if not isinstance(self.master, torch.dtype):
            return False
        if self.storage is None:
            return True
        return update_rule(self.master, self.grad, self.optim, self.storage).master is not None

    @property
    def accumulates(self) -> bool:
        """True when gradients accumulate wider than `storage` (what `UpdateRule` says for that
        dtype: `.grad` is then held in `grad`)."""
        if self.grad is None or self.storage is None or not self.storage.is_floating_point:
            return False
        return update_rule(None, self.grad, None, self.storage).grad != self.storage


def _bare(dtype: torch.dtype) -> Policy:
    return Policy(compute=dtype, storage=dtype, comm=dtype)


PRESETS: dict[str, Policy] = {
    "64-true": _bare(fp64),
    "32-true": _bare(fp32),
    "16-true": _bare(fp16),
    "bf16-true": _bare(bf16),
    "16-mixed": Policy(compute=fp16, storage=fp32, comm=fp32),
    "bf16-mixed": Policy(compute=bf16, storage=fp32, comm=fp32),
    "bf16-master": Policy(compute=bf16, storage=bf16, comm=bf16, master=fp32, grad=fp32),
}

SpecLike: TypeAlias = Policy | torch.dtype | str


def preset_name(compute: torch.dtype | None, storage: torch.dtype | None) -> str | None:
    """The Lightning precision string with this compute and storage ("bf16-mixed"), or None.
    Storage left unset reads as storage equal to compute ("-true")."""
    for name, preset in PRESETS.items():
        if preset.compute == compute and preset.storage == (storage or compute) and (
                preset.master is None):
            return name
    return None

#: How a module's forward treats autocast: run under it, disable it, or leave it as it is.
AutocastMode: TypeAlias = Literal["autocast", "off"] | None


def autocast_mode(policy: Policy) -> AutocastMode:
    """How a module's forward treats autocast (runtime rule 3).

    - "autocast": compute is fp16 or bf16 over wider storage (or storage left alone): the
      subtree runs under `torch.autocast(dtype=compute)`, so ops autocast keeps in fp32 stay
      in fp32.
    - "off": compute at or above storage, or beside it (bf16 over fp16): autocast is disabled,
      and parameters that differ from compute are cast to it for the forward.
    - None: compute is not set; the caller's autocast state is left as it is.
    """
    if policy.compute is None:
        return None
    if policy.compute in LOW_PRECISION and (
        policy.storage is None or wider(policy.storage, policy.compute)
    ):
        return "autocast"
    return "off"


def is_boundary(policy: Policy, context: Policy | None, *, runs: bool = True) -> bool:
    """True when a module must cast at entry or exit, or change autocast.

    `context` is the policy of the nearest ancestor that runs its own forward (None at the
    top). A module that never runs (a container such as `nn.ModuleList`) is never a boundary:
    its children are. A module whose own `output` is set is always a boundary, so its output
    is honoured whatever the caller's policy is.
    """
    if not runs:
        return False
    if context is None:
        return policy.compute is not None or policy.output is not None
    return (
        policy.compute != context.compute
        or policy.output is not None
        or autocast_mode(policy) != autocast_mode(context)
    )


def exit_dtype(policy: Policy, context: Policy | None) -> tuple[torch.dtype | None, bool]:
    """Runtime rule 4, its one home: the dtype a boundary hands its floating outputs back in.

    `output` if set; else the caller's compute (`context`: the nearest running ancestor's
    policy); else, when the caller sets no compute but this module does, the dtype of its first
    floating input, said as (None, True); a top-level module's outputs are left as computed,
    said as (None, False).
    """
    if policy.output is not None:
        return policy.output, False
    if context is None:
        return None, False
    if context.compute is not None:
        return context.compute, False
    return None, policy.compute is not None


def as_policy(spec: object, *, argument: str = "spec") -> Policy:
    """A `Policy` from a Policy, a dtype (compute, storage and comm), a dtype name or a preset."""
    if isinstance(spec, Policy):
        return spec
    if isinstance(spec, torch.dtype):
        return _bare(to_dtype(spec, field=argument))
    if isinstance(spec, str):
        try:
            return Policy.parse(spec)
        except ValueError as e:
            raise ValueError(f"{argument}: {e} Received: {argument}={spec!r}") from e
    raise TypeError(
        f"{argument} must be a Policy, a torch.dtype, a dtype name or a preset string such "
        f"as 'bf16-mixed'. Received: {argument}={spec!r} (of type {type(spec).__name__})"
    )


def policy_from(
    spec: object, fields: dict[str, object], *, argument: str = "spec"
) -> Policy:
    """Combine a positional spec with keyword fields; the keywords win field by field."""
    base = Policy() if spec is None else as_policy(spec, argument=argument)
    unknown = [k for k in fields if k not in (*FIELDS, "backward")]
    if unknown:
        raise TypeError(
            f"Unknown policy field {unknown[0]!r}. Valid fields: {', '.join(FIELDS)}"
        )
    given = {k: v if k in ("compute", "backward") else _read(k, v) for k, v in fields.items()
             if v is not None}
    return base.merge(Policy(**given)) if given else base  # type: ignore[arg-type]


def _bare_dtype(text: str) -> torch.dtype:
    """The dtype a policy of one word names ("fp32"), or the error for what it is not."""
    stripped = text.strip()
    lowered = stripped.lower()
    if "," in stripped:
        raise ValueError(
            f"Cannot parse policy {text!r}: use key=dtype pairs such as "
            f"'compute=bf16,storage=fp32', after at most one dtype or preset "
            f"('fp32,output=fp32')."
        )
    if lowered in FP8_RECIPES:  # fp8 is a GEMM recipe, never storage or output
        raise ValueError(
            f"Unknown policy {text!r}: fp8 is a compute dtype for GEMMs. Write "
            f"'compute={lowered}' (storage, comm and output are then inherited, "
            f"e.g. bf16 around the fp8 GEMMs) or a base first, 'bf16,compute={lowered}'."
            f" Valid fp8 computes: {', '.join(FP8_RECIPES)}."
        )
    try:
        return to_dtype(stripped, field="spec")
    except ValueError as e:
        names = ", ".join(dtype_name(d) for d in (fp64, fp32, fp16, bf16))
        raise ValueError(
            f"Unknown policy {text!r}. Valid: a dtype name ({names}), "
            f"a preset ({', '.join(repr(p) for p in PRESETS)}), or key=dtype pairs "
            f"with keys {', '.join(FIELDS)} ('compute=fp8' and the other fp8 "
            f"recipes: {', '.join(FP8_RECIPES)})."
        ) from e


def _pairs(text: str) -> dict[str, object]:
    """The fields of "key=dtype,key=dtype", each key once (aliases read as their field)."""
    values: dict[str, object] = {}
    for part in text.strip().split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or not key or not value.strip():
            raise ValueError(
                f"Cannot parse policy {text!r}: {part.strip()!r} is not key=dtype."
            )
        if key not in _KEY_ALIASES:
            raise ValueError(
                f"Unknown policy key {key!r} in {text!r}. Valid keys: "
                f"{', '.join(repr(k) for k in _KEY_ALIASES)}"
            )
        field = _KEY_ALIASES[key]
        if field in values:
            raise ValueError(f"Policy key {field!r} is given twice in {text!r}.")
        values[field] = (value.strip() if field in ("compute", "backward") else
                         _read(field, value.strip()))
    return values
