"""Activation checkpointing's rerun of a forward, under the state that forward ran under.

`torch.utils.checkpoint` runs the checkpointed function again during backward (without
reentrance, to recompute what it did not keep; with `use_reentrant=True`, to build the graph
its first, gradient-free run did not). For that rerun torch restores its own state of the
forward (autocast, the random state, a device context), but a library's only through
`context_fn`, which is the caller's argument and exists only without reentrance. An applied
model's boundaries keep per-thread state while its forward runs (`boundary.ForwardState`), so
`install` has every checkpoint capture that state when it starts and rerun its function under
it.

It wraps the two names through which `torch.utils.checkpoint` starts each call: the public
`CheckpointFunction` (reentrant) and the private generator of the non-reentrant kind
(`seams.CHECKPOINT_GENERATOR`: torch 2.14 renamed it, and the old name stayed as a wrapper
nothing calls). Callers that bound `checkpoint` itself at import (transformers, FSDP's
`checkpoint_wrapper`) and torch's composable `checkpoint(module)` go through them too;
`torch.compile`, which traces a checkpoint as a graph of its own, calls neither. Outside an
applied forward a checkpoint costs one thread-local read more and runs as before.

A rename cannot make this silent: `install` runs one checkpoint of each kind, forward and
backward, and raises if either rerun missed the captured state.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint

from precision_annot._src import seams

__all__ = ["Capture", "CheckpointSupportError", "install"]

#: returns, when a checkpoint starts, what re-enters its state for the rerun (None: nothing to)
Capture = Callable[[], "Callable[[], contextlib.AbstractContextManager[Any]] | None"]

_REENTRANT = "CheckpointFunction"
_COMPOSABLE = "torch.distributed._composable.checkpoint_activation"
#: DeepSpeed's own activation checkpointing (`deepspeed.checkpointing`), which reruns through
#: its own CheckpointFunction and `non_reentrant_checkpoint`, not torch's
_DEEPSPEED = "deepspeed.runtime.activation_checkpointing.checkpointing"
_DEEPSPEED_ALIAS = "deepspeed.checkpointing"
_DEEPSPEED_NON_REENTRANT = "non_reentrant_checkpoint"


class CheckpointSupportError(RuntimeError):
    """The installed torch's activation checkpointing does not start where this package
    captures an applied forward's state, so a checkpointed region would rerun without it."""


class _Installed(threading.local):
    """The capture every checkpoint asks; a probe overrides it in its own thread."""

    probe: Capture | None = None


_capture: list[Capture] = []
_refused: list[CheckpointSupportError] = []
_local = _Installed()


def _current() -> Capture:
    return _local.probe or _capture[0]


def _under(fn: Callable[..., Any], restored: Callable[[], contextlib.AbstractContextManager[Any]]
           ) -> Callable[..., Any]:
    """`fn`, run under `restored()`. Not `functools.wraps`: `fn` may be a module, whose
    `__dict__` it would copy."""

    def rerun(*args: Any, **kwargs: Any) -> Any:
        with restored():
            return fn(*args, **kwargs)

    return rerun


def _captured(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` as the checkpoint starting now should rerun it."""
    if torch.compiler.is_compiling():
        return fn
    restored = _current()()
    return fn if restored is None else _under(fn, restored)


def _reentrant(original: Any) -> Any:
    """torch's `CheckpointFunction`, applying itself to the function under the captured
    state: a subclass of the same name, so its graph nodes keep their name and
    `isinstance` and subclasses keep working."""

    class CheckpointFunction(original):  # type: ignore[misc]
        __doc__ = original.__doc__

        @classmethod
        def apply(cls, function: Callable[..., Any], *args: Any) -> Any:
            return super().apply(_captured(function), *args)

    CheckpointFunction.__module__ = original.__module__
    return CheckpointFunction


def install(capture: Capture) -> None:
    """Have every `torch.utils.checkpoint` checkpoint rerun its function under what `capture`
    returns when it starts. Once per process; later calls do nothing, or raise again what the
    first one raised.

    Raises:
        CheckpointSupportError: the installed torch starts checkpoints elsewhere (a rename).
    """
    if _refused:
        raise _refused[0]
    if _capture:
        _install_deepspeed()  # imported since the last apply, maybe
        return
    module = torch.utils.checkpoint
    generator: Callable[..., Any] | None = getattr(module, seams.CHECKPOINT_GENERATOR, None)
    reentrant = getattr(module, _REENTRANT, None)
    if generator is None or not isinstance(reentrant, type):
        raise _refused_for(f"torch.utils.checkpoint has no {seams.CHECKPOINT_GENERATOR} or "
                           f"{_REENTRANT}")
    # NOTE: torch.utils.checkpoint offers no hook for a library's forward state (context_fn is
    # the caller's, and only without reentrance; transformers and checkpoint_wrapper pass
    # none). What is there now is wrapped, so a wrapper installed before this one keeps working.

    def without_reentrant(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return generator(_captured(fn), *args, **kwargs)

    _capture.append(capture)
    setattr(module, seams.CHECKPOINT_GENERATOR, without_reentrant)
    setattr(module, _REENTRANT, _reentrant(reentrant))
    composable = sys.modules.get(_COMPOSABLE)  # imported before: it holds the name it imported
    if composable is None or getattr(composable, seams.CHECKPOINT_GENERATOR, None) is not generator:
        composable = None
    else:
        setattr(composable, seams.CHECKPOINT_GENERATOR, without_reentrant)
    try:
        missed = _probe_apart()
    except BaseException:
        missed = None
        raise
    finally:
        if missed != []:  # refused, or the probe itself failed: torch's own names back
            setattr(module, seams.CHECKPOINT_GENERATOR, generator)
            setattr(module, _REENTRANT, reentrant)
            if composable is not None:
                setattr(composable, seams.CHECKPOINT_GENERATOR, generator)
            _capture.clear()
    if missed:
        raise _refused_for(f"a {' and a '.join(missed)} checkpoint reran without the state "
                           "captured when it started")
    _install_deepspeed()


_deepspeed: list[object] = []  # DeepSpeed's checkpointing module, once its names are wrapped

#: the device types whose autocast state a DeepSpeed rerun restores
_AUTOCAST_DEVICES = ("cpu", "cuda")


def _captured_with_autocast(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`_captured` for DeepSpeed's checkpoints, which, unlike torch's, do not restore autocast
    for their rerun: inside an applied forward (whose boundaries enter autocast) the rerun
    enters the autocast state of the checkpoint's start too."""
    if torch.compiler.is_compiling():
        return fn
    restored = _current()()
    if restored is None:
        return fn  # outside an applied forward DeepSpeed's checkpoint is left as it is
    modes = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
             for d in _AUTOCAST_DEVICES if torch.amp.is_autocast_available(d)]

    @contextlib.contextmanager
    def under() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for device, enabled, dtype in modes:
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            stack.enter_context(restored())
            yield

    return _under(fn, under)


def _install_deepspeed() -> None:
    """DeepSpeed's activation checkpointing reruns under the captured state too, once DeepSpeed
    has imported it: its `CheckpointFunction` (what `deepspeed.checkpointing.checkpoint`
    applies, looked up at each call) and its `non_reentrant_checkpoint`, also where
    `deepspeed.checkpointing` holds it. Where DeepSpeed has renamed them, a warning says that
    its checkpointed regions of an applied model would rerun without the boundaries' state."""
    module = sys.modules.get(_DEEPSPEED)
    if module is None or _deepspeed:
        return
    _deepspeed.append(module)
    reentrant = getattr(module, _REENTRANT, None)
    non_reentrant = getattr(module, _DEEPSPEED_NON_REENTRANT, None)
    if not isinstance(reentrant, type) or not callable(non_reentrant):
        warnings.warn(
            f"precision_annot: this DeepSpeed's {_DEEPSPEED} has no {_REENTRANT} or "
            f"{_DEEPSPEED_NON_REENTRANT}; a region of an applied model checkpointed with "
            "deepspeed.checkpointing would rerun in backward without its boundaries' state, and "
            "its gradients would be another computation's. Checkpoint with "
            "torch.utils.checkpoint instead.", RuntimeWarning, stacklevel=3)
        return

    class CheckpointFunction(reentrant):  # type: ignore[misc,valid-type]
        __doc__ = reentrant.__doc__

        @classmethod
        def apply(cls, function: Callable[..., Any], *args: Any) -> Any:
            return super().apply(_captured_with_autocast(function), *args)

    CheckpointFunction.__module__ = reentrant.__module__

    def checkpointed(function: Callable[..., Any], *args: Any) -> Any:
        return non_reentrant(_captured_with_autocast(function), *args)

    setattr(module, _REENTRANT, CheckpointFunction)
    setattr(module, _DEEPSPEED_NON_REENTRANT, checkpointed)
    alias = sys.modules.get(_DEEPSPEED_ALIAS)
    if alias is not None and getattr(alias, _DEEPSPEED_NON_REENTRANT, None) is non_reentrant:
        setattr(alias, _DEEPSPEED_NON_REENTRANT, checkpointed)


def _refused_for(what: str) -> CheckpointSupportError:
    """The error `install` raises, now and at every later call."""
    error = CheckpointSupportError(
        f"precision_annot: with torch {torch.__version__}, {what}. A checkpointed region of an "
        "applied model would rerun in backward without its boundaries' state, and its "
        "gradients would be silently another computation's. Upgrade precision_annot, or use a "
        f"torch it was tested on ({seams.tested()}).")
    _refused.append(error)
    return error


def _probe_apart() -> list[str]:
    """`_probe` in a thread of its own, so that nothing of the caller's thread reaches it or
    is changed by it: grad and inference mode, autocast, saved-tensor hooks (a user's pack
    hook would see the probe's tensors) are all per thread. A CPU backward runs in the thread
    that calls it."""
    found: list[list[str]] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            found.append(_probe())
        except BaseException as e:  # handed to the caller's thread below
            failed.append(e)

    thread = threading.Thread(target=run, name="precision_annot-checkpoint-probe")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return found[0]


def _probe() -> list[str]:
    """One small checkpoint of each kind, forward and backward: the kinds whose rerun did not
    run under what was captured at its start."""
    missed = []
    for reentrant in (False, True):
        reruns: list[bool] = []

        @contextlib.contextmanager
        def marked(reruns: list[bool] = reruns) -> Iterator[None]:
            reruns.append(torch.is_grad_enabled())
            yield

        with torch.inference_mode(False), torch.enable_grad(), torch.autocast(
                "cpu", enabled=False):
            x = torch.ones(2, requires_grad=True)
            _local.probe = lambda: (lambda: marked())
            try:
                y = torch.utils.checkpoint.checkpoint(torch.sin, x, use_reentrant=reentrant)
            finally:
                _local.probe = None
            reruns.clear()  # the reentrant kind runs its function under it in the forward too
            torch.autograd.backward(y.sum())
        if not (reruns and all(reruns)):
            missed.append("reentrant" if reentrant else "non-reentrant")
    return missed
