"""`precision_scope`: tag every module constructed inside a block, context-locally.

While at least one scope is active, `nn.Module.__init__` is wrapped so that each new module
gets the scope's policy as its scope tag. The wrapper calls whatever `__init__` was current when
it was installed, and is taken off only if it is still the one installed: another library that
patched `__init__` meanwhile keeps its patch.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import threading
from collections.abc import AsyncGenerator, Callable, Coroutine, Generator
from types import TracebackType
from typing import Any, TypeVar

import torch
from torch import nn
from typing_extensions import ParamSpec

from precision_annot._src.boundary import in_applied_forward
from precision_annot._src.policy import Policy, SpecLike, policy_from
from precision_annot._src.tags import tag_scope

__all__ = ["precision_scope"]

P = ParamSpec("P")
R = TypeVar("R")

_SCOPE: contextvars.ContextVar[Policy | None] = contextvars.ContextVar(
    "precision_annot_scope", default=None
)


class _InitHook:
    """Wraps `nn.Module.__init__` while scopes are active (counted across threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.installed: Callable[..., None] | None = None
        self.replaced: Callable[..., None] | None = None

    def install(self) -> None:
        with self.lock:
            self.users += 1
            if self.users > 1:
                return
            original = nn.Module.__init__

            @functools.wraps(original)
            def __init__(module: nn.Module, *args: Any, **kwargs: Any) -> None:
                original(module, *args, **kwargs)
                policy = _SCOPE.get()
                if policy is not None:
                    tag_scope(module, policy)

            # NOTE: the only place this package patches torch; undone in uninstall.
            nn.Module.__init__ = __init__  # type: ignore[method-assign,assignment]
            self.installed, self.replaced = __init__, original

    def uninstall(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users > 0:
                return
            if nn.Module.__init__ is self.installed and self.replaced is not None:
                nn.Module.__init__ = self.replaced  # type: ignore[method-assign]
            # else another library patched over ours: its patch stays, and ours, which it
            # calls, goes on calling the original and tags nothing outside a scope.
            self.installed = self.replaced = None


_hook = _InitHook()


class precision_scope:
    """Tag every module constructed inside this block, at scope level.

    The root, its submodules and modules without parameters are all tagged. Nested scopes
    merge field by field and the inner one wins. The scope is context-local: another thread
    or asyncio task constructing modules meanwhile is not tagged.

    Args:
        spec: as for `precision`. (Default: None)
        **fields: compute, storage, comm, output, master, grad, optim; they override `spec`.

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
        inside a fresh scope with this policy. A generator function runs each of its steps
        inside it (the caller's code between steps does not), and so does an async function
        or async generator, with the scope local to its task."""
        if isinstance(fn, type):
            raise TypeError(
                f"{self!r} decorates functions (a model factory, say). To tag a class, use "
                f"@precision({str(self.policy)!r}). Received: the class {fn.__qualname__}"
            )
        if not callable(fn):
            raise TypeError(f"{self!r} decorates functions. Received: {fn!r}")
        policy = self.policy
        if inspect.isasyncgenfunction(fn):
            return _scoped_async_generator(fn, policy)  # type: ignore[return-value]
        if inspect.iscoroutinefunction(fn):
            return _scoped_coroutine(fn, policy)  # type: ignore[return-value]
        if inspect.isgeneratorfunction(fn):
            return _scoped_generator(fn, policy)  # type: ignore[return-value]

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
        _hook.install()
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
            _hook.uninstall()


def _scoped_generator(fn: Callable[..., Generator[Any, Any, Any]], policy: Policy
                      ) -> Callable[..., Generator[Any, Any, Any]]:
    """Each step of the generator inside a scope, as torch's decorator context managers run
    each step of a generator under `no_grad`."""

    @functools.wraps(fn)
    def scoped(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
        with precision_scope(policy):
            gen = fn(*args, **kwargs)
            try:
                response = gen.send(None)
            except StopIteration as stop:
                return stop.value
        while True:
            try:
                request = yield response
            except GeneratorExit:
                with precision_scope(policy):
                    gen.close()
                raise
            except BaseException as error:
                with precision_scope(policy):
                    try:
                        response = gen.throw(error)
                    except StopIteration as stop:
                        return stop.value
            else:
                with precision_scope(policy):
                    try:
                        response = gen.send(request)
                    except StopIteration as stop:
                        return stop.value

    return scoped


def _scoped_coroutine(fn: Callable[..., Coroutine[Any, Any, Any]], policy: Policy
                      ) -> Callable[..., Coroutine[Any, Any, Any]]:
    @functools.wraps(fn)
    async def scoped(*args: Any, **kwargs: Any) -> Any:
        with precision_scope(policy):
            return await fn(*args, **kwargs)

    return scoped


def _scoped_async_generator(fn: Callable[..., AsyncGenerator[Any, Any]], policy: Policy
                            ) -> Callable[..., AsyncGenerator[Any, Any]]:
    @functools.wraps(fn)
    async def scoped(*args: Any, **kwargs: Any) -> AsyncGenerator[Any, Any]:
        gen = fn(*args, **kwargs)
        try:
            while True:
                with precision_scope(policy):
                    try:
                        item = await gen.__anext__()
                    except StopAsyncIteration:
                        return
                yield item
        finally:
            with precision_scope(policy):
                await gen.aclose()

    return scoped
