"""`PrecisionPlan`: the effective policy of every module, where each field came from, and JSON."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import weakref
from collections.abc import Container, Iterable, Iterator, Mapping
from typing import Any, Literal, TypeAlias, get_args

import torch
from torch import nn

from precision_annot._src.dtypes import SHORT, dtype_from_name, dtype_name, fp16
from precision_annot._src.memory import MemoryReport, plan_memory
from precision_annot._src.policy import FIELDS, Policy, is_boundary
from precision_annot._src.tables import format_table, human_bytes

__all__ = ["TRAITS", "ModuleFacts", "ModulePlan", "PrecisionPlan", "Source", "TensorInfo",
           "nearest", "parent_name", "planned_bytes"]

Source: TypeAlias = Literal["instance", "rule", "class", "scope", "inherited", "default"]
SOURCES: frozenset[str] = frozenset(get_args(Source))

_JSON_VERSION = 1


def parent_name(name: str) -> str:
    """The qualified name of a module's parent ("" for the root's children)."""
    return name.rpartition(".")[0]


def nearest(names: Iterable[str], chosen: Container[str]) -> dict[str, str | None]:
    """For each name (listed parents first), the nearest of itself and its ancestors that is
    in `chosen`, or None: the boundary whose forward runs a module, the unit that holds it."""
    owner: dict[str, str | None] = {}
    for name in names:
        owner[name] = name if name in chosen else (owner[parent_name(name)] if name else None)
    return owner


def planned_bytes(numel: Mapping[torch.dtype, int], storage: torch.dtype | None
                  ) -> dict[torch.dtype, int]:
    """Bytes of parameters by the dtype they are stored in under a plan: floating parameters in
    `storage` (their own dtype when it is None), the others as they are. The one place a plan's
    byte counts come from."""
    out: dict[torch.dtype, int] = {}
    for dtype, n in numel.items():
        stored = storage if storage is not None and dtype.is_floating_point else dtype
        out[stored] = out.get(stored, 0) + n * stored.itemsize
    return out


#: What a module is, as far as a check needs to know once the model is gone.
TRAITS: dict[str, str] = {
    "linear": "an nn.Linear (or subclass): fp8 converts it",
    "linear-forward": "an nn.Linear subclass with a forward of its own",
    "embedding": "an nn.Embedding",
    "running-stats": "a norm that tracks running statistics (BatchNorm)",
    "multihead-attention": "an nn.MultiheadAttention, which calls its out_proj's weight itself",
}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One parameter or floating buffer a module holds, as `resolve` saw it: what `check` and
    the memory figures need once the model is gone (a plan file, or a collected model).

    Attributes:
        name: its name in the module ("weight").
        shape: its shape.
        dtype: the dtype the plan holds it in: its module's storage for a parameter or a
            persistent floating buffer, else its own.
        buffer: True for a buffer.
        trainable: a parameter's `requires_grad` (False for a buffer).
        persistent: False for a buffer left out of the state dict.
        tied: for a parameter held by several modules, the qualified name it has where it is
            first seen (module order); None for the first holder and unshared ones.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    buffer: bool = False
    trainable: bool = True
    persistent: bool = True
    tied: str | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "shape": list(self.shape),
                               "dtype": dtype_name(self.dtype)}
        for key, default in (("buffer", False), ("trainable", not self.buffer),
                             ("persistent", True), ("tied", None)):
            if getattr(self, key) != default:
                out[key] = getattr(self, key)
        return out

    @classmethod
    def from_dict(cls, data: object, where: str) -> TensorInfo:
        if not isinstance(data, dict):
            raise ValueError(f"{where} must be an object. Received: {data!r}")
        name, shape, dtype = data.get("name"), data.get("shape"), data.get("dtype")
        if not isinstance(name, str) or not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ValueError(f"{where}: needs 'name' (a string) and 'shape' (a list of sizes). "
                             f"Received: {data!r}")
        buffer = bool(data.get("buffer", False))
        return cls(name, tuple(shape), dtype_from_name(str(dtype), field=f"{where}.dtype"),
                   buffer=buffer, trainable=bool(data.get("trainable", not buffer)),
                   persistent=bool(data.get("persistent", True)),
                   tied=data.get("tied") if isinstance(data.get("tied"), str) else None)


@dataclasses.dataclass(frozen=True)
class ModuleFacts:
    """What `resolve` saw of one module that a plan needs to be checked without the model:
    its traits (`TRAITS`), its own tensors, and the lists of submodule names a Hugging Face
    model keeps in fp32 (`_keep_in_fp32_modules` and `_keep_in_fp32_modules_strict`, which
    DeepSpeed's `keep_in_fp32_modules: "auto"` reads)."""

    traits: frozenset[str] = frozenset()
    tensors: tuple[TensorInfo, ...] = ()
    keep_in_fp32: tuple[str, ...] = ()
    keep_in_fp32_strict: tuple[str, ...] = ()

    @property
    def params(self) -> tuple[TensorInfo, ...]:
        return tuple(t for t in self.tensors if not t.buffer)

    def tensor(self, name: str) -> TensorInfo | None:
        return next((t for t in self.tensors if t.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"traits": sorted(self.traits),
                               "tensors": [t.to_dict() for t in self.tensors]}
        for key in ("keep_in_fp32", "keep_in_fp32_strict"):
            if getattr(self, key):
                out[key] = list(getattr(self, key))
        return out

    @classmethod
    def from_dict(cls, data: object, where: str) -> ModuleFacts:
        if not isinstance(data, dict) or not isinstance(data.get("traits", []), list) \
                or not isinstance(data.get("tensors", []), list):
            raise ValueError(f"{where} must be an object with lists 'traits' and 'tensors'. "
                             f"Received: {data!r}")
        unknown = [t for t in data.get("traits", []) if t not in TRAITS]
        if unknown:
            raise ValueError(f"{where}: unknown trait {unknown[0]!r}; valid: {list(TRAITS)}")
        lists = {}
        for key in ("keep_in_fp32", "keep_in_fp32_strict"):
            names = data.get(key, [])
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise ValueError(f"{where}: '{key}' must be a list of module names. "
                                 f"Received: {names!r}")
            lists[key] = tuple(names)
        return cls(frozenset(data.get("traits", [])),
                   tuple(TensorInfo.from_dict(t, f"{where}.tensors[{i}]")
                         for i, t in enumerate(data.get("tensors", []))), **lists)


@dataclasses.dataclass(frozen=True)
class ModulePlan:
    """One module's row of the plan: what was declared and what it resolved to.

    Attributes:
        name: qualified module name ("" for the root).
        type: the module's class, as `module.QualifiedName`.
        policy: the effective policy.
        sources: per field, where its value came from, or None where nothing set it.
        keep_dtype: arguments never cast at this module's boundary.
        container: True for a module without a `forward` of its own (`nn.ModuleList`, ...):
            it never runs, so its children carry its policy and its boundaries.
        boundary: True when this module casts at entry or exit, or changes autocast. The
            plan derives it from the policies; a value given here is ignored.
        numel: the module's own parameter elements, by the dtype the plan stores them in
            (floating ones in its storage dtype, or the dtype they had when it sets none).
        regions: the function-form regions (`precision(...)(fn)`) its forward calls, by the
            function's qualified name.
        facts: what `resolve` saw of the module (traits, tensors), so that the plan can be
            checked once the model is gone; None in a plan file written without them.
    """

    name: str
    type: str
    policy: Policy
    sources: Mapping[str, Source | None]
    keep_dtype: tuple[str | int, ...] = ()
    container: bool = False
    boundary: bool = False
    numel: Mapping[torch.dtype, int] = dataclasses.field(default_factory=dict)
    regions: Mapping[str, Policy] = dataclasses.field(default_factory=dict)
    facts: ModuleFacts | None = None

    @property
    def own_params(self) -> tuple[TensorInfo, ...]:
        """Its own parameters as `resolve` saw them (none known without facts)."""
        return self.facts.params if self.facts is not None else ()

    def has(self, trait: str) -> bool:
        """Whether `resolve` saw this trait (`TRAITS`) on the module (False when unknown)."""
        return self.facts is not None and trait in self.facts.traits

    @property
    def params(self) -> int:
        """Number of the module's own parameter elements."""
        return sum(self.numel.values())

    @property
    def param_dtype_bytes(self) -> dict[torch.dtype, int]:
        """Bytes of its own parameters by the dtype the plan stores them in."""
        return planned_bytes(self.numel, self.policy.storage)

    @property
    def stored(self) -> torch.dtype | None:
        """The one floating dtype its own parameters are stored in under the plan; None when
        it holds none (or several: integer parameters are not counted)."""
        floating = {d for d in self.param_dtype_bytes if d.is_floating_point}
        return floating.pop() if len(floating) == 1 else None

    @property
    def trainable_dtype_bytes(self) -> dict[torch.dtype, int]:
        """Bytes of its own trainable floating parameters (each counted at its first holder)
        by planned storage dtype: the gradients a backend reduces for it. Without facts (an
        old plan file), every floating parameter counts."""
        if self.facts is None:
            return {d: n for d, n in self.param_dtype_bytes.items() if d.is_floating_point}
        out: dict[torch.dtype, int] = {}
        for t in self.facts.params:
            if t.trainable and t.tied is None and t.dtype.is_floating_point:
                out[t.dtype] = out.get(t.dtype, 0) + t.numel * t.dtype.itemsize
        return out

    @property
    def param_bytes(self) -> int:
        """Bytes of its own parameters in their planned storage dtypes."""
        return sum(self.param_dtype_bytes.values())

    def source_summary(self) -> str:
        """One word when every set field has the same source, else field:source pairs."""
        set_sources = {f: s for f, s in self.sources.items() if s is not None}
        distinct = set(set_sources.values())
        if not distinct:
            return "-"
        if len(distinct) == 1:
            return distinct.pop()
        return " ".join(f"{f}:{s}" for f, s in set_sources.items())

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.type,
            "policy": str(self.policy),
            "sources": dict(self.sources),
            "keep_dtype": list(self.keep_dtype),
            "container": self.container,
            "boundary": self.boundary,
            "params": self.params,
            "param_bytes": self.param_bytes,
            "param_dtype_bytes": {dtype_name(d): n for d, n in self.param_dtype_bytes.items()},
            "numel": {dtype_name(d): n for d, n in self.numel.items()},
            "regions": {fn: str(p) for fn, p in self.regions.items()},
            **({} if self.facts is None else {"facts": self.facts.to_dict()}),
        }

    @classmethod
    def from_dict(cls, data: object, where: str = "entry") -> ModulePlan:
        """Read one entry of `to_json`; a malformed entry raises `ValueError` naming the key."""
        read = _EntryReader(data, where)
        by_dtype = read.counts("param_dtype_bytes")
        numel = read.counts("numel") if "numel" in read.data else {  # written before "numel"
            d: n // d.itemsize for d, n in by_dtype.items()}
        facts = read.data.get("facts")
        entry = cls(name=read.name, type=read.get("type"),
                    policy=read.policy("'policy'", read.get("policy")),
                    sources=read.sources(), keep_dtype=read.keep(),
                    container=read.get("container"), numel=numel,
                    regions={fn: read.policy(f"'regions'[{fn!r}]", text)
                             for fn, text in read.get("regions").items()},
                    facts=None if facts is None else ModuleFacts.from_dict(
                        facts, f"{read.where}: 'facts'"))
        read.get("boundary")  # derived from the policies; only its type is checked
        params, param_bytes = read.get("params"), read.get("param_bytes")
        if sum(by_dtype.values()) != param_bytes:
            raise ValueError(f"{read.where}: 'param_bytes' ({param_bytes}) is not the sum of "
                             f"'param_dtype_bytes' ({sum(by_dtype.values())}).")
        if entry.param_dtype_bytes != by_dtype or entry.params != params:
            raise ValueError(
                f"{read.where}: 'numel' ({_show(numel)}) under storage "
                f"{dtype_name(entry.policy.storage)} gives {entry.params} parameters in "
                f"{_show(entry.param_dtype_bytes)} bytes, but the entry says {params} "
                f"in {_show(by_dtype)}.")
        return entry


#: the keys of a plan file's entry: their JSON type, and the value when absent (None:
#: required); "facts" and "name" are read on their own
_ENTRY_KEYS: dict[str, tuple[type, Any]] = {
    "type": (str, None), "policy": (str, None), "sources": (dict, {}), "keep_dtype": (list, []),
    "container": (bool, False), "boundary": (bool, False), "params": (int, 0),
    "param_bytes": (int, 0), "param_dtype_bytes": (dict, {}), "numel": (dict, {}),
    "regions": (dict, {}),
}


class _EntryReader:
    """One entry of a plan file, read by `_ENTRY_KEYS`: each value's type checked, each error
    naming the entry and the key."""

    def __init__(self, data: object, where: str) -> None:
        if not isinstance(data, dict):
            raise ValueError(f"{where} must be an object. Received: {data!r}")
        name = data.get("name")
        if not isinstance(name, str):
            raise ValueError(f"{where}: 'name' must be a string. Received: name={name!r}")
        self.data: dict[str, Any] = data
        self.name = name
        self.where = f"{where} ({name or '(root)'!r})"

    def get(self, key: str) -> Any:
        kind, default = _ENTRY_KEYS[key]
        value = self.data.get(key, default)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{self.where}: {key!r} must be of type {kind.__name__}. "
                             f"Received: {key}={value!r}")
        if isinstance(value, int) and value < 0:
            raise ValueError(f"{self.where}: {key!r} must be a count >= 0. Received: {value!r}")
        return value

    def policy(self, label: str, text: object) -> Policy:
        if not isinstance(text, str):
            raise ValueError(f"{self.where}: {label} must be of type str. Received: {text!r}")
        try:
            return Policy.parse(text)
        except ValueError as e:
            raise ValueError(f"{self.where}: {label} is not a policy: {e}") from e

    def sources(self) -> dict[str, Source | None]:
        raw = self.get("sources")
        out: dict[str, Source | None] = {}
        for field in (*FIELDS, *(f for f in ("gemm", "backward") if f in raw)):
            value = raw.get(field)
            if value is not None and value not in SOURCES:
                raise ValueError(f"{self.where}: 'sources' has {field}={value!r}; valid "
                                 f"sources: {', '.join(sorted(SOURCES))} or null")
            out[field] = value
        return out

    def keep(self) -> tuple[str | int, ...]:
        keep = self.get("keep_dtype")
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in keep):
            raise ValueError(f"{self.where}: 'keep_dtype' must list argument names or "
                             f"positions. Received: keep_dtype={keep!r}")
        return tuple(keep)

    def counts(self, key: str) -> dict[torch.dtype, int]:
        return _counts(self.get(key), self.where, key)


def _show(counts: Mapping[torch.dtype, int]) -> str:
    return "{" + ", ".join(f"{dtype_name(d)}: {n}" for d, n in counts.items()) + "}"


def _counts(raw: Mapping[str, object], where: str, key: str) -> dict[torch.dtype, int]:
    """A JSON map of dtype name to count, read back; a bad name or count names its key."""
    out: dict[torch.dtype, int] = {}
    for name, value in raw.items():
        try:
            dtype = dtype_from_name(name, field=key)
        except ValueError:
            raise ValueError(
                f"{where}: {key!r} has unknown dtype {name!r}; valid: a policy dtype "
                f"({', '.join(SHORT.values())}) or a torch dtype such as 'int8'."
            ) from None
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{where}: {key!r}[{name!r}] must be a count >= 0. "
                             f"Received: {value!r}")
        out[dtype] = value
    return out


class PrecisionPlan(Mapping[str, ModulePlan]):
    """The effective `Policy` of every module of one model, in module order.

    `plan[name]` gives a `ModulePlan`: the policy and, per field, its source. Boundaries are
    derived from the policies: a module that runs its own forward is a boundary where its
    compute, autocast mode or `output` differs from the nearest running ancestor's.

    A plan resolved from a model remembers that model's modules by weak reference, so an
    adapter given only the plan can find each parameter's planned dtypes. `to_json` /
    `from_json` round-trip; a saved plan re-applies to a fresh instance of the same model.

    See also: `resolve`, `apply`.
    """

    def __init__(
        self,
        entries: Mapping[str, ModulePlan],
        *,
        default: Policy | None = None,
        model_type: str = "",
        modules: Mapping[str, nn.Module] | None = None,
    ) -> None:
        self._entries: dict[str, ModulePlan] = {}
        self._context: dict[str, str | None] = {}
        for name, entry in entries.items():
            if name and parent_name(name) not in self._entries:
                raise ValueError(
                    f"Plan entry {name!r} comes before its parent {parent_name(name)!r}: "
                    "entries are listed parents first, as named_modules() gives them."
                )
            context = self._running_ancestor(name)
            boundary = is_boundary(
                entry.policy,
                None if context is None else self._entries[context].policy,
                runs=not entry.container,
            )
            self._context[name] = context
            self._entries[name] = (
                entry if entry.boundary == boundary else dataclasses.replace(entry,
                                                                               boundary=boundary)
            )
        if self._entries and "" not in self._entries:
            raise ValueError("A plan needs a root entry named ''.")
        self.default = default
        self.model_type = model_type
        self._refs: dict[str, weakref.ref[nn.Module]] = {
            name: weakref.ref(m) for name, m in (modules or {}).items()
        }

    # -- copies: the weak references follow the model, or are dropped -----------------------
    def __deepcopy__(self, memo: dict[int, Any]) -> PrecisionPlan:
        """A copy whose modules are the copies made by the same deepcopy (of the model that
        holds this plan), else the same modules."""
        new = object.__new__(PrecisionPlan)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key != "_refs":
                new.__dict__[key] = copy.deepcopy(value, memo)
        refs = {n: r() for n, r in self._refs.items()}
        new._refs = {n: weakref.ref(memo.get(id(m), m)) for n, m in refs.items() if m is not None}
        return new

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its model: a weak reference cannot be pickled, and pickling the
        modules themselves would put a whole model into every pickled plan. `applied_plan`
        binds an unpickled model's plan to that model again."""
        return {**self.__dict__, "_refs": {}}

    def bound_to(self, named: Mapping[str, nn.Module]) -> PrecisionPlan:
        """The same plan, holding these modules (`dict(model.named_modules())`) by name."""
        return PrecisionPlan(self._entries, default=self.default, model_type=self.model_type,
                             modules=named)

    def _running_ancestor(self, name: str) -> str | None:
        while name:
            name = parent_name(name)
            if not self._entries[name].container:
                return name
        return None

    # -- Mapping ------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> ModulePlan:
        try:
            return self._entries[name]
        except KeyError:
            close = difflib.get_close_matches(name, list(self._entries), n=5, cutoff=0.4)
            names = close or list(self._entries)[:8]
            hint = f" {'Closest' if close else 'Names'}: {', '.join(repr(c) for c in names)}"
            raise KeyError(f"No module named {name!r} in this plan.{hint}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PrecisionPlan):
            return NotImplemented
        return self._entries == other._entries and self.default == other.default

    __hash__ = None  # type: ignore[assignment]

    # -- queries ------------------------------------------------------------------------------
    @property
    def root(self) -> ModulePlan:
        return self._entries[""]

    @property
    def boundaries(self) -> tuple[str, ...]:
        """Names of the modules that cast at entry or exit or change autocast."""
        return tuple(name for name, e in self._entries.items() if e.boundary)

    def context(self, name: str) -> ModulePlan | None:
        """The row of the nearest ancestor of `name` that runs its own forward: the caller
        whose compute dtype a boundary hands its outputs back in. None at the top."""
        found = self._context[name]
        return None if found is None else self._entries[found]

    @property
    def needs_loss_scaling(self) -> bool:
        """True when fp16 is used anywhere, function-form regions included: every adapter then
        turns on dynamic loss scaling."""
        return any(e.policy.uses(fp16) or any(r.uses(fp16) for r in e.regions.values())
                   for e in self._entries.values())

    @property
    def param_bytes_by_dtype(self) -> dict[torch.dtype, int]:
        """Bytes of parameters per planned storage dtype, over the whole model."""
        out: dict[torch.dtype, int] = {}
        for e in self._entries.values():
            for dtype, n in e.param_dtype_bytes.items():
                out[dtype] = out.get(dtype, 0) + n
        return out

    def with_policies(self, policies: Mapping[str, Policy],
                      sources: Mapping[str, Mapping[str, Source | None]] | None = None
                      ) -> PrecisionPlan:
        """A copy with some modules' policies (and, where given, sources) replaced; boundaries
        and byte counts follow, and the copy holds the same model."""
        unknown = [n for n in policies if n not in self._entries]
        if unknown:
            raise KeyError(f"with_policies: no module named {unknown[0]!r} in this plan.")
        sources = sources or {}
        entries = {
            name: dataclasses.replace(entry, policy=policies[name],
                                      sources=sources.get(name, entry.sources))
            if name in policies else entry
            for name, entry in self._entries.items()
        }
        return PrecisionPlan(entries, default=self.default, model_type=self.model_type,
                             modules=self.modules())

    def memory(self, optimizer: Any = "adamw", **hyperparameters: Any) -> MemoryReport:
        """The bytes training holds per module under this plan: parameters, gradients,
        master copies and optimizer state, and in total and per parameter, for `optimizer`
        ("adamw", "adam", "sgd", "rmsprop", "adagrad", or their torch.optim class) with
        `hyperparameters` (`momentum=0.9` gives SGD a state), as `precision_annot.optimizer`
        keeps them. Returns a `MemoryReport`; `str()` of it is a table.

        Example:
            >>> from torch import nn
            >>> from precision_annot import resolve
            >>> plan = resolve(nn.Linear(64, 64), "bf16-true,master=fp32")
            >>> round(plan.memory("adamw").per_param(), 2)
            16.06
        """
        return plan_memory(self.items(), self.captured, optimizer, **hyperparameters)

    def with_facts(self, facts: Mapping[str, ModuleFacts]) -> PrecisionPlan:
        """A copy with these rows' `facts` set (the same policies, holding the same model)."""
        entries = {n: dataclasses.replace(e, facts=facts[n]) if n in facts else e
                   for n, e in self._entries.items()}
        return PrecisionPlan(entries, default=self.default, model_type=self.model_type,
                             modules=self.modules())

    def module(self, name: str) -> nn.Module | None:
        """The module named `name`, if the plan was resolved from a model that is still alive."""
        ref = self._refs.get(name)
        return ref() if ref else None

    def modules(self) -> dict[str, nn.Module]:
        """name -> module, for a plan resolved from a model that is still alive; else empty."""
        out = {name: ref() for name, ref in self._refs.items()}
        return {n: m for n, m in out.items() if m is not None} if self.has_model else {}

    @property
    def captured(self) -> bool:
        """True when every row holds what `resolve` saw of its module (`ModulePlan.facts`), so
        the plan can be checked without the model; False for a plan file written without
        them (precision_annot 0.3 and older)."""
        return all(e.facts is not None for e in self._entries.values())

    @property
    def has_model(self) -> bool:
        return bool(self._refs) and all(r() is not None for r in self._refs.values())

    def param_policies(self) -> Iterator[tuple[str, nn.Parameter, ModulePlan]]:
        """(qualified parameter name, parameter, owner's plan row) for every parameter once."""
        seen: set[int] = set()
        for name, entry in self._entries.items():
            module = self.module(name)
            if module is None:
                raise RuntimeError(
                    "This plan does not hold its model (loaded from JSON, or the model is gone)."
                )
            for pname, p in module.named_parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{name}.{pname}" if name else pname), p, entry

    # -- output -------------------------------------------------------------------------------
    def to_json(self, *, indent: int | None = 2) -> str:
        """The plan as JSON text; `PrecisionPlan.from_json` reads it back."""
        return json.dumps(
            {
                "format": "precision_annot.plan",
                "version": _JSON_VERSION,
                "model_type": self.model_type,
                "default": None if self.default is None else str(self.default),
                "modules": [e.to_dict() for e in self._entries.values()],
            },
            indent=indent,
        )

    @classmethod
    def from_json(cls, text: str) -> PrecisionPlan:
        """Read a plan written by `to_json`.

        Raises `ValueError` for text that is not such a plan, naming the entry and the key
        that is wrong. Boundaries are derived again from the policies, whatever the file says.
        """
        try:
            data = json.loads(text)
        except (TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"PrecisionPlan.from_json: text is not JSON ({e}).") from e
        if not isinstance(data, dict) or data.get("format") != "precision_annot.plan":
            raise ValueError(
                "PrecisionPlan.from_json expects the output of plan.to_json(): an object with "
                f'"format": "precision_annot.plan". Received: {str(text)[:80]!r}'
            )
        if data.get("version") != _JSON_VERSION:
            raise ValueError(
                f"Unsupported plan version {data.get('version')!r}; this library reads "
                f"version {_JSON_VERSION}."
            )
        modules = data.get("modules")
        if not isinstance(modules, list) or not modules:
            raise ValueError(
                "PrecisionPlan.from_json: 'modules' must be a non-empty list of entries. "
                f"Received: modules={modules!r}"
            )
        entries: dict[str, ModulePlan] = {}
        for i, raw in enumerate(modules):
            entry = ModulePlan.from_dict(raw, where=f"modules[{i}]")
            if entry.name in entries:
                raise ValueError(f"modules[{i}]: module {entry.name!r} is listed twice.")
            entries[entry.name] = entry
        default = data.get("default")
        model_type = data.get("model_type", "")
        if not isinstance(model_type, str):
            raise ValueError(f"'model_type' must be a string. Received: {model_type!r}")
        try:
            default_policy = None if default is None else Policy.parse(default)
        except (TypeError, ValueError) as e:
            raise ValueError(f"'default' is not a policy: {e}") from e
        return cls(entries, default=default_policy, model_type=model_type)

    def __str__(self) -> str:
        # the update fields get columns when the plan sets one of them
        fields = [f for f in (*FIELDS, "backward") if f in FIELDS[:4] or any(
            getattr(e.policy, f) is not None for e in self._entries.values())]
        header = ("module", "type", *fields, "source", "params", "bytes")
        rows: list[tuple[str, ...]] = [header]
        for name, e in self._entries.items():
            depth = name.count(".") + (1 if name else 0)
            label = ("  " * depth) + (name.rsplit(".", 1)[-1] if name else "(root)")
            if e.boundary:
                label += " *"
            rows.append((
                label,
                e.type.rsplit(".", 1)[-1],
                *(e.policy.show(f) for f in fields),
                e.source_summary(),
                f"{e.params:,}",
                human_bytes(e.param_bytes),
            ))
            for fn, region in e.regions.items():  # function-form regions its forward calls
                rows.append(("  " * (depth + 1) + f"{fn.rsplit('.', 1)[-1]}()", "function",
                             *(region.show(f) for f in fields), "region", "", ""))
        lines = format_table(rows, right={len(header) - 2, len(header) - 1})
        by_dtype = ", ".join(
            f"{dtype_name(d)} {human_bytes(n)}" for d, n in self.param_bytes_by_dtype.items()
        )
        lines.append("")
        lines.append(
            f"* boundary ({len(self.boundaries)}): casts inputs at entry and outputs at exit."
        )
        lines.append(f"parameters by storage dtype: {by_dtype or 'none'}")
        if self.needs_loss_scaling:
            lines.append("fp16 is used: adapters turn on dynamic loss scaling.")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"PrecisionPlan({self.model_type or 'model'}: {len(self)} modules, "
                f"{len(self.boundaries)} boundaries)")
