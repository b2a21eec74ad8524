"""The argument checks every entry point shares: an error names the function and the argument,
quotes the value and says what is expected."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import warnings
from collections.abc import Iterator

from torch import nn

from precision_annot._src.plan import PrecisionPlan

__all__ = ["paused_gc", "require_module", "require_plan", "warn"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_TORCH_MODULE = os.path.join("torch", "nn", "modules", "module.py")


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn, pointing at the user's line: the first frame outside this package and outside
    `nn.Module`'s own code (a `.to()` reaches modules through a recursion of any depth)."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None:
        path = frame.f_code.co_filename
        if not (path.startswith(_PACKAGE) or path.endswith(_TORCH_MODULE)):
            break
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    warnings.warn(message, category, stacklevel=level + 1)


def require_module(value: object, where: str, argument: str = "model") -> None:
    if not isinstance(value, nn.Module):
        raise TypeError(
            f"{where} expects an nn.Module. Received: {argument}={value!r} "
            f"(of type {type(value).__name__})"
        )


def require_plan(value: object, where: str, argument: str = "plan") -> None:
    if not isinstance(value, PrecisionPlan):
        raise TypeError(
            f"{where}: {argument} must be a PrecisionPlan from resolve(model) or "
            f"PrecisionPlan.from_json(text). Received: {argument}={value!r} "
            f"(of type {type(value).__name__})"
        )


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cycle collector paused for a walk over the whole model: `resolve` and `apply`
    allocate a few objects per module, and on a model of 100,000 modules the collections they
    trigger, each scanning every object alive, took a third of the time. Objects are freed as
    usual; cycles wait for the next collection."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
