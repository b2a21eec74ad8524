"""Activation checkpointing's rerun of a forward, under the state that forward ran under.

`torch.utils.checkpoint` runs the checkpointed function again during backward (without
reentrance, to recompute what it did not keep; with `use_reentrant=True`, to build the graph
its first, gradient-free run did not). For that rerun torch restores its own state of the
forward (autocast, the random state, a device context), but a library's only through
`context_fn`, which is the caller's argument and exists only without reentrance. An applied
model's boundaries keep per-thread state while its forward runs (`boundary.ForwardState`), so
`install` has every checkpoint capture that state when it starts and rerun its function under
it.

It wraps the two names through which `torch.utils.checkpoint.checkpoint` starts each call
(`CheckpointFunction` and `_checkpoint_without_reentrant_generator`, which it looks up at every
call): callers that bound `checkpoint` itself at import (transformers, FSDP's
`checkpoint_wrapper`) and torch's composable `checkpoint(module)` go through them too, and
`torch.compile`, which traces a checkpoint as a graph of its own, calls neither. Outside an
applied forward a checkpoint costs one thread-local read more and runs as before.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

__all__ = ["Capture", "install"]

#: returns, when a checkpoint starts, what re-enters its state for the rerun (None: nothing to)
Capture = Callable[[], "Callable[[], contextlib.AbstractContextManager[Any]] | None"]

_GENERATOR = "_checkpoint_without_reentrant_generator"
_REENTRANT = "CheckpointFunction"
_COMPOSABLE = "torch.distributed._composable.checkpoint_activation"

_installed: list[Capture] = []


def _under(fn: Callable[..., Any], restored: Callable[[], contextlib.AbstractContextManager[Any]]
           ) -> Callable[..., Any]:
    """`fn`, run under `restored()`. Not `functools.wraps`: `fn` may be a module, whose
    `__dict__` it would copy."""

    def rerun(*args: Any, **kwargs: Any) -> Any:
        with restored():
            return fn(*args, **kwargs)

    return rerun


def _captured(capture: Capture, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` as the checkpoint starting now should rerun it."""
    if torch.compiler.is_compiling():
        return fn
    restored = capture()
    return fn if restored is None else _under(fn, restored)


def _reentrant(original: Any, capture: Capture) -> Any:
    """torch's `CheckpointFunction`, applying itself to the function under the captured
    state: a subclass of the same name, so its graph nodes keep their name and
    `isinstance` and subclasses keep working."""

    class CheckpointFunction(original):  # type: ignore[misc]
        __doc__ = original.__doc__

        @classmethod
        def apply(cls, function: Callable[..., Any], *args: Any) -> Any:
            return super().apply(_captured(capture, function), *args)

    CheckpointFunction.__module__ = original.__module__
    return CheckpointFunction


def install(capture: Capture) -> None:
    """Have every `torch.utils.checkpoint` checkpoint rerun its function under what `capture`
    returns when it starts. Once per process; later calls do nothing."""
    if _installed:
        return
    _installed.append(capture)
    # NOTE: torch.utils.checkpoint offers no hook for a library's forward state (context_fn is
    # the caller's, and only without reentrance). These two module-level names are private
    # but have held every checkpoint's start since torch 2.1; what is there now is wrapped,
    # so a wrapper installed before this one keeps working.
    module = torch.utils.checkpoint
    generator = getattr(module, _GENERATOR, None)
    if generator is None or not isinstance(getattr(module, _REENTRANT, None), type):
        warnings.warn(
            "precision_annot: this torch's torch.utils.checkpoint has no "
            f"{_GENERATOR} / {_REENTRANT}; a checkpointed region of an applied model reruns "
            "without the boundaries' state (fp32 islands may see other dtypes in the rerun).",
            RuntimeWarning, stacklevel=2)
        return

    def without_reentrant(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return generator(_captured(capture, fn), *args, **kwargs)

    setattr(module, _GENERATOR, without_reentrant)
    setattr(module, _REENTRANT, _reentrant(getattr(module, _REENTRANT), capture))
    composable = sys.modules.get(_COMPOSABLE)  # imported before: it holds the name it imported
    if composable is not None and getattr(composable, _GENERATOR, None) is generator:
        setattr(composable, _GENERATOR, without_reentrant)
