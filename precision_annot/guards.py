"""The argument checks every entry point shares: an error names the function and the argument,
quotes the value and says what is expected."""

from __future__ import annotations

from torch import nn

from precision_annot.plan import PrecisionPlan

__all__ = ["require_module", "require_plan"]


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
