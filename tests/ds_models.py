"""Module-level classes, so DeepSpeed can import them back by name."""

from torch import nn


class ScaledLinear(nn.Linear):
    """A Linear subclass: DeepSpeed matches exact classes, so it needs its own entry."""
