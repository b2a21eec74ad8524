"""Declaring precision: `precision` (classes, instances, functions), `precision_scope`, `annotate`.

Declarations are only recorded here, as tags on classes and instances; `resolve` turns them
into a plan and `apply` (or an adapter) makes the plan real.
"""

from __future__ import annotations

import contextvars
import dataclasses
import difflib
import fnmatch
import functools
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeAlias, TypeVar, overload

import torch
from torch import nn
from typing_extensions import ParamSpec

from precision_annot.boundary import in_applied_forward, wrap_function
from precision_annot.policy import Policy, SpecLike, as_policy, policy_from

__all__ = ["Selector", "annotate", "precision", "precision_scope"]

P = ParamSpec("P")
R = TypeVar("R")
M = TypeVar("M", bound=nn.Module)

KeepDtype: TypeAlias = Sequence[str | int]
Selector: TypeAlias = str | type[nn.Module] | Callable[[str, nn.Module], bool]

# Attribute names of the tags. Class tags live in the class's own __dict__ so the nearest
# decorated class in the MRO wins; instance and scope tags live in the instance __dict__.
CLASS_TAG = "__precision_annot_class__"
INSTANCE_TAG = "_precision_annot_instance"
SCOPE_TAG = "_precision_annot_scope"


@dataclasses.dataclass(frozen=True)
class ClassTag:
    """What `@precision(...)` recorded on a class."""

    policy: Policy
    keep_dtype: tuple[str | int, ...] = ()


@dataclasses.dataclass(frozen=True)
class InstanceTag:
    """What `precision(...)(module)` and `annotate` recorded on an instance, field by field."""

    fields: Mapping[str, tuple[torch.dtype, str]]  # field -> (dtype, "instance" | "rule")
    keep_dtype: tuple[str | int, ...] = ()

    def policy(self) -> Policy:
        return Policy(**{f: dt for f, (dt, _) in self.fields.items()})

    def source(self, field: str) -> str | None:
        entry = self.fields.get(field)
        return entry[1] if entry else None


def _keep_dtype(value: object) -> tuple[str | int, ...]:
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        value = (value,)
    if not isinstance(value, (tuple, list)) or not all(
        isinstance(v, (str, int)) and not isinstance(v, bool) for v in value
    ):
        raise TypeError(
            "keep_dtype must be a sequence of keyword names (str) or positional indexes (int). "
            f"Received: keep_dtype={value!r}"
        )
    return tuple(value)


def tag_instance(
    module: nn.Module, policy: Policy, source: str, keep_dtype: tuple[str | int, ...] = ()
) -> None:
    """Merge `policy` into the instance tag of `module`; the fields it sets win."""
    old: InstanceTag | None = module.__dict__.get(INSTANCE_TAG)
    fields = dict(old.fields) if old else {}
    for field, dtype in policy.items():
        if dtype is not None:
            fields[field] = (dtype, source)
    keep = keep_dtype or (old.keep_dtype if old else ())
    object.__setattr__(module, INSTANCE_TAG, InstanceTag(fields, keep))


def instance_tag(module: nn.Module) -> InstanceTag | None:
    return module.__dict__.get(INSTANCE_TAG)


def class_tag(cls: type) -> ClassTag | None:
    """The tag of the nearest decorated class in `cls`'s MRO."""
    for klass in cls.__mro__:
        tag = klass.__dict__.get(CLASS_TAG)
        if tag is not None:
            return tag  # type: ignore[no-any-return]
    return None


def scope_tag(module: nn.Module) -> Policy | None:
    return module.__dict__.get(SCOPE_TAG)


class _Annotator:
    """What `precision(...)` returns: call it on a class, an instance or a function."""

    def __init__(self, policy: Policy, keep_dtype: tuple[str | int, ...]) -> None:
        self.policy = policy
        self.keep_dtype = keep_dtype

    def __repr__(self) -> str:
        return f"precision({str(self.policy)!r})"

    @overload
    def __call__(self, target: type[M]) -> type[M]: ...
    @overload
    def __call__(self, target: M) -> M: ...
    @overload
    def __call__(self, target: Callable[P, R]) -> Callable[P, R]: ...
    def __call__(self, target: Any) -> Any:
        if isinstance(target, type):
            if not issubclass(target, nn.Module):
                raise TypeError(
                    "precision(...) decorates nn.Module subclasses, nn.Module instances or "
                    f"functions. Received: the class {target.__qualname__}, which is not an "
                    "nn.Module subclass"
                )
            setattr(target, CLASS_TAG, ClassTag(self.policy, self.keep_dtype))
            return target
        if isinstance(target, nn.Module):
            tag_instance(target, self.policy, "instance", self.keep_dtype)
            return target
        if callable(target):
            return wrap_function(target, self.policy, self.keep_dtype)
        raise TypeError(
            "precision(...) decorates nn.Module subclasses, nn.Module instances or functions. "
            f"Received: {target!r} (of type {type(target).__name__})"
        )


def precision(
    spec: SpecLike | None = None,
    /,
    *,
    compute: torch.dtype | str | None = None,
    storage: torch.dtype | str | None = None,
    comm: torch.dtype | str | None = None,
    output: torch.dtype | str | None = None,
    keep_dtype: KeepDtype = (),
) -> _Annotator:
    """Declare the precision of a module class, a module instance or a function.

    On a class it returns the same class, tagged (subclasses inherit it, the nearest tag in
    the MRO wins). On an instance it tags and returns the instance. On a function it returns
    a wrapper that runs the function with its floating tensor arguments cast to `compute`,
    outer autocast disabled, and the result cast to `output` or back to the dtype of the
    first floating argument.

    Args:
        spec: a `Policy`, a dtype (compute, storage and comm), a dtype name, a preset such
            as "bf16-mixed", or "compute=bf16,storage=fp32". (Default: None)
        compute: the compute field; overrides `spec`. (Default: None)
        storage: the storage field; overrides `spec`. (Default: None)
        comm: the comm field; overrides `spec`. (Default: None)
        output: the output field; overrides `spec`. (Default: None)
        keep_dtype: keyword names or positional indexes of arguments never cast at this
            boundary, such as an fp32 rotary table. (Default: ())

    Example:
        >>> from torch import nn
        >>> from precision_annot import precision, fp32
        >>> norm = precision(fp32)(nn.LayerNorm(4))
        >>> @precision(compute="bf16")
        ... class Block(nn.Module):
        ...     pass

    See also: `precision_scope`, `annotate`, `resolve`.
    """
    if isinstance(spec, nn.Module) or (isinstance(spec, type) and issubclass(spec, nn.Module)):
        raise TypeError(
            "precision takes a spec, not the target: write @precision(fp32) or "
            f"precision(fp32)(module). Received: spec={spec!r}"
        )
    if callable(spec) and not isinstance(spec, (Policy, torch.dtype, str)):
        raise TypeError(
            "precision takes a spec, not the target: write @precision(fp32) above a function. "
            f"Received: spec={spec!r}"
        )
    policy = policy_from(
        spec, {"compute": compute, "storage": storage, "comm": comm, "output": output}
    )
    return _Annotator(policy, _keep_dtype(keep_dtype))


# ---------------------------------------------------------------------------------------------
# precision_scope: tag every module constructed inside, context-locally.

_SCOPE: contextvars.ContextVar[Policy | None] = contextvars.ContextVar(
    "precision_annot_scope", default=None
)
_PATCH_LOCK = threading.Lock()
_PATCH_USERS = 0
_ORIGINAL_INIT = nn.Module.__init__


def _scoped_init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
    _ORIGINAL_INIT(self, *args, **kwargs)
    policy = _SCOPE.get()
    if policy is not None:
        object.__setattr__(self, SCOPE_TAG, policy)


def _patch(enable: bool) -> None:
    global _PATCH_USERS
    with _PATCH_LOCK:
        _PATCH_USERS += 1 if enable else -1
        if enable and _PATCH_USERS == 1:
            nn.Module.__init__ = _scoped_init  # type: ignore[method-assign]
        elif not enable and _PATCH_USERS == 0:
            nn.Module.__init__ = _ORIGINAL_INIT  # type: ignore[method-assign]


class precision_scope:
    """Tag every module constructed inside this block, at scope level.

    The root, its submodules and modules without parameters are all tagged. Nested scopes
    merge field by field and the inner one wins. The scope is context-local: another thread
    or asyncio task constructing modules meanwhile is not tagged.

    Args:
        spec: as for `precision`. (Default: None)
        **fields: compute, storage, comm, output; they override `spec`.

    Example:
        >>> from torch import nn
        >>> from precision_annot import precision_scope, resolve, bf16
        >>> with precision_scope(compute=bf16):
        ...     block = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> resolve(block)["1"].policy.compute
        torch.bfloat16

    See also: `precision` (the function form pins a region of forward),
    `annotate`.
    """

    def __init__(self, spec: SpecLike | None = None, /, **fields: torch.dtype | str | None):
        self.policy = policy_from(spec, dict(fields))
        self._token: contextvars.Token[Policy | None] | None = None

    def __repr__(self) -> str:
        return f"precision_scope({str(self.policy)!r})"

    def __call__(self, fn: Callable[P, R]) -> Callable[P, R]:
        """Use the scope as a decorator, as `torch.no_grad` is used: every call of `fn` runs
        inside a fresh scope with this policy."""
        if isinstance(fn, type):
            raise TypeError(
                f"{self!r} decorates functions (a model factory, say). To tag a class, use "
                f"@precision({str(self.policy)!r}). Received: the class {fn.__qualname__}"
            )
        if not callable(fn):
            raise TypeError(f"{self!r} decorates functions. Received: {fn!r}")
        policy = self.policy

        @functools.wraps(fn)
        def scoped(*args: Any, **kwargs: Any) -> Any:
            with precision_scope(policy):
                return fn(*args, **kwargs)

        return scoped

    def __enter__(self) -> precision_scope:
        if in_applied_forward():
            raise RuntimeError(
                f"{self!r} was entered while the forward of an applied model is running. "
                "A scope only tags modules at construction; to run a region of forward in "
                "another dtype use the function form, e.g. precision(fp32)(fn)(x)."
            )
        if self._token is not None:
            raise RuntimeError(f"{self!r} is already active; create a new scope to nest.")
        outer = _SCOPE.get()
        self._token = _SCOPE.set(outer.merge(self.policy) if outer else self.policy)
        _patch(True)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self._token is not None:
                _SCOPE.reset(self._token)
        finally:
            self._token = None
            _patch(False)


# ---------------------------------------------------------------------------------------------
# annotate: tag instances by rule.

_GLOB_CHARS = re.compile(r"[*?\[]")


def _check_glob(pattern: str) -> None:
    depth = 0
    for ch in pattern:
        if ch == "[":
            if depth:
                raise ValueError(f"Invalid glob {pattern!r}: nested '['.")
            depth = 1
        elif ch == "]" and depth:
            depth = 0
    if depth:
        raise ValueError(
            f"Invalid glob {pattern!r}: '[' is never closed. Globs use fnmatch syntax: "
            "*, ?, [seq], [!seq]."
        )


def _matcher(selector: object) -> tuple[Callable[[str, nn.Module], bool], str]:
    if isinstance(selector, nn.Module):
        target = selector
        return (lambda _n, m: m is target), f"instance {type(target).__qualname__}"
    if isinstance(selector, str):
        if _GLOB_CHARS.search(selector):
            _check_glob(selector)
            regex = re.compile(fnmatch.translate(selector))
            return (lambda name, _m: regex.match(name) is not None), f"glob {selector!r}"
        return (lambda name, _m: name == selector), f"name {selector!r}"
    if isinstance(selector, type):
        if not issubclass(selector, nn.Module):
            raise TypeError(
                "A class selector must be an nn.Module subclass. "
                f"Received: selector={selector.__qualname__}"
            )
        cls = selector
        return (lambda _n, m: isinstance(m, cls)), f"class {cls.__qualname__}"
    if callable(selector):
        fn: Callable[[str, nn.Module], bool] = selector
        return (lambda name, m: bool(fn(name, m))), f"predicate {selector!r}"
    raise TypeError(
        "A selector is a module name or glob (str), an nn.Module subclass, or a predicate "
        f"(name, module) -> bool. Received: selector={selector!r} "
        f"(of type {type(selector).__name__})"
    )


def annotate(
    model: M,
    rules: Mapping[Any, SpecLike] | Iterable[tuple[Any, SpecLike]],
    *,
    strict: bool = True,
) -> M:
    """Tag the modules of `model` by rule, in order; a later rule wins field by field.

    Args:
        model: the module tree to tag.
        rules: a mapping or a sequence of (selector, spec) pairs. A selector is a qualified
            module name (exact, or an fnmatch glob matched against the whole name, so "enc.*"
            does not match "enc"), an nn.Module subclass (isinstance), or a predicate
            `(name, module) -> bool`. A spec is anything `precision` takes.
        strict: raise when a selector matches nothing, naming the closest module names.
            (Default: True)

    Returns:
        `model`, tagged.

    Example:
        >>> from torch import nn
        >>> from precision_annot import annotate, resolve
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
        >>> _ = annotate(model, {nn.LayerNorm: "fp32", "0": "bf16"})
        >>> resolve(model)["1"].sources["compute"]
        'rule'
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"annotate expects an nn.Module. Received: model={model!r} "
            f"(of type {type(model).__name__})"
        )
    if isinstance(rules, Mapping):
        pairs = list(rules.items())
    elif isinstance(rules, Iterable) and not isinstance(rules, (str, bytes)):
        pairs = list(rules)
        for i, pair in enumerate(pairs):
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise TypeError(
                    "rules must be a mapping or a sequence of (selector, spec) pairs. "
                    f"Received: rules[{i}]={pair!r}"
                )
    else:
        raise TypeError(
            "rules must be a mapping or a sequence of (selector, spec) pairs. "
            f"Received: rules={rules!r} (of type {type(rules).__name__})"
        )
    named = list(model.named_modules())
    compiled = [
        (*_matcher(sel), as_policy(spec, argument=f"rules[{sel!r}]")) for sel, spec in pairs
    ]
    # Match every rule before tagging anything, so that an error leaves the model untouched.
    matched: list[tuple[list[nn.Module], Policy]] = []
    for i, (match, label, policy) in enumerate(compiled):
        hits = []
        for name, m in named:
            try:
                hit = match(name, m)
            except Exception as e:
                if not _rewrappable(e):
                    raise
                raise type(e)(
                    f"annotate: rule {i} ({label}) raised on module {name or '(root)'!r}: "
                    f"{type(e).__name__}: {e}"
                ) from e
            if hit:
                hits.append(m)
        if not hits and strict:
            names = [n for n, _ in named]
            raise ValueError(_no_match_message(label, names, named))
        matched.append((hits, policy))
    for hits, policy in matched:
        for module in hits:
            tag_instance(module, policy, "rule")
    return model


def _rewrappable(error: Exception) -> bool:
    """True when `type(error)(message)` builds the same kind of error with a new message."""
    try:
        return type(error)("probe").args == ("probe",)
    except Exception:
        return False


def _no_match_message(label: str, names: list[str], named: list[tuple[str, nn.Module]]) -> str:
    if label.startswith(("name ", "glob ")):
        text = label.split(" ", 1)[1].strip("'\"")
        leaves = [n for n in names if n.rsplit(".", 1)[-1] == text]
        if leaves:
            shown = ", ".join(repr(n) for n in leaves[:3]) + (", ..." if len(leaves) > 3 else "")
            hint = (f"{len(leaves)} modules end in {text!r} ({shown}): a selector matches the "
                    f"whole name, so write the glob {'*.' + text!r} to select them all.")
        else:
            close = difflib.get_close_matches(text, [n for n in names if n], n=5, cutoff=0.4)
            hint = f"Closest module names: {', '.join(repr(c) for c in close)}" if close else (
                f"Module names start with: {', '.join(repr(n) for n in names[1:6])}"
            )
    elif label.startswith("instance "):
        hint = "The module instance is not part of this model."
    else:
        types = sorted({type(m).__qualname__ for _, m in named})
        hint = f"Module classes in the model: {', '.join(types[:10])}"
    return f"annotate: the {label} matches no module (strict=True). {hint}"

