"""Declaring precision: `precision` (classes, instances, functions) and `annotate` (rules).

Declarations are only recorded, as tags on classes and instances (see `tags`); `resolve` turns
them into a plan and `apply` (or an adapter) makes the plan real. The third way to declare,
`precision_scope`, lives in `scope`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeAlias, TypeVar, overload

import torch
from torch import nn
from typing_extensions import ParamSpec

from precision_annot._src.boundary import wrap_function
from precision_annot._src.guards import require_module
from precision_annot._src.policy import Policy, SpecLike, as_policy, policy_from
from precision_annot._src.selectors import Selector, matcher
from precision_annot._src.tags import KeepDtype, keep_dtype_of, tag_class, tag_instance

__all__ = ["annotate", "precision"]

P = ParamSpec("P")
R = TypeVar("R")
M = TypeVar("M", bound=nn.Module)
S = TypeVar("S", bound=Selector)

KeepDtypeArg: TypeAlias = Sequence[str | int]

class _Annotator:
    """What `precision(...)` returns: call it on a class, an instance or a function."""

    def __init__(self, policy: Policy, keep_dtype: KeepDtype) -> None:
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
            tag_class(target, self.policy, self.keep_dtype)
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
    master: torch.dtype | str | None = None,
    grad: torch.dtype | str | None = None,
    optim: torch.dtype | str | None = None,
    keep_dtype: KeepDtypeArg = (),
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
        master: what the optimizer updates: a dtype wider than storage (a master copy) or
            "stochastic"; for `precision_annot.optimizer`. (Default: None)
        grad: the dtype gradients accumulate in, when wider than storage. (Default: None)
        optim: the dtype of the optimizer's state, or "8bit", "4bit", "fp8". (Default: None)
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
        spec, {"compute": compute, "storage": storage, "comm": comm, "output": output,
               "master": master, "grad": grad, "optim": optim}
    )
    return _Annotator(policy, keep_dtype_of(keep_dtype))


def annotate(
    model: M,
    rules: Mapping[S, SpecLike] | Iterable[tuple[Selector, SpecLike]],
    *,
    strict: bool = True,
) -> M:
    """Tag the modules of `model` by rule, in order; a later rule wins field by field.

    Args:
        model: the module tree to tag.
        rules: a mapping or a sequence of (selector, spec) pairs. A selector is a qualified
            module name (exact, or an fnmatch glob matched against the whole name, so "enc.*"
            does not match "enc"), an nn.Module subclass (isinstance), a module instance, or a
            predicate `(name, module) -> bool`. A spec is anything `precision` takes.
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
    require_module(model, "annotate")
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
    compiled = [(matcher(sel), as_policy(spec, argument=f"rules[{sel!r}]")) for sel, spec in pairs]
    # Match every rule before tagging anything, so that an error leaves the model untouched.
    matched: list[tuple[list[tuple[str, nn.Module]], Policy]] = []
    for i, (match, policy) in enumerate(compiled):
        hits = match.select(named, rule=f"annotate: rule {i} ({match.label})")
        if not hits and strict:
            raise ValueError(match.no_match(named, "annotate (strict=True)"))
        matched.append((hits, policy))
    for hits, policy in matched:
        for _, module in hits:
            tag_instance(module, policy, "rule")
    return model
