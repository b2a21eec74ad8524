"""What one batch is to `suggest`, and what its fp32 run recorded."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

Counts = dict[tuple[str, str], int]  # (module, "forward" | "backward") -> non-finite elements


@dataclasses.dataclass
class Reference:
    """An fp32 run: its output, loss and gradients; watched, also every module's first
    inputs and output, the peak its own ops produce, and the non-finite values each makes."""

    output: Any
    loss: torch.Tensor | None
    grads: dict[str, torch.Tensor]
    inputs: dict[str, tuple[tuple[Any, ...], dict[str, Any]]]
    outputs: dict[str, Any]
    peaks: dict[str, float]
    backward_peak: float
    nonfinite: Counts
    #: for each module whose own code made a value past the low dtype's largest, the modules
    #: whose outputs that value was computed from (watched runs only)
    feeds: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    #: the largest finite |value| each module's forward returned, by module (plain runs only)
    output_peaks: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def output_peak(self) -> float:
        """The largest finite |value| any module's forward returned (plain runs only)."""
        return max(self.output_peaks.values(), default=0.0)


@dataclasses.dataclass
class Sample:
    """One batch the plans are checked on: its call, its fp32 reference and its label."""

    label: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    ref: Reference | None = None  # the full one (inputs, outputs, peaks), when it was needed
    light: Reference | None = None  # outputs, loss, gradients and non-finite counts
    original: Any = None  # the batch as the user gave it (what a two-argument loss_fn gets)
    #: the share of the low dtype's largest value a module's output held in it may reach: the
    #: margin on the calibration batch, so that a plan keeps room on data it was not chosen on
    room: float = 1.0

LossFn = Callable[[Any, Sample], torch.Tensor]
