"""The batches `suggest` checks on: the calibration batch and the held-out ones, cut from the
sample or given, and the loss function as one signature."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch

from precision_annot._src.casting import map_tree
from precision_annot._src.samples import as_call, takes_sample
from precision_annot._src.suggest.records import LossFn, Sample


def as_loss_fn(loss_fn: Callable[..., torch.Tensor] | None) -> LossFn | None:
    """`loss_fn(output)` or `loss_fn(output, sample)`, as one signature."""
    if loss_fn is None:
        return None
    if not callable(loss_fn):
        raise TypeError(f"suggest(loss_fn=...) must be callable: output -> loss, or "
                        f"(output, sample) -> loss. Received: loss_fn={loss_fn!r}")
    if takes_sample(loss_fn):
        return lambda output, sample: loss_fn(output, sample.original)
    return lambda output, sample: loss_fn(output)


def _batch_leaf(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The first tensor along the batch dimension: the first dimension most of the sample's
    tensors share, a leading 1 only where none is larger (a 0-dim tensor, or `position_ids`
    of shape (1, S) broadcast over the batch, is not the batch)."""
    leaves: list[torch.Tensor] = []
    _tensor_leaves((args, kwargs), leaves)
    sized = [t for t in leaves if t.dim()]
    if not sized:
        return None
    counts = Counter(int(t.shape[0]) for t in sized)
    size = max(counts, key=lambda n: (n > 1, counts[n]))  # the first of equals
    return next(t for t in sized if t.shape[0] == size)


def _batch_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    leaf = _batch_leaf(args, kwargs)
    return 0 if leaf is None else int(leaf.shape[0])


def _tensor_leaves(obj: Any, out: list[torch.Tensor]) -> None:
    def keep(t: torch.Tensor) -> torch.Tensor:
        out.append(t)
        return t

    map_tree(obj, keep, floating_only=False)


def rows_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """How many rows (tokens, samples) the sample holds: all but the last dimension of a
    floating input, every element of an integer one."""
    t = _batch_leaf(args, kwargs)
    if t is None:
        return 0
    return int(t.numel() // (t.shape[-1] if t.is_floating_point() and t.dim() > 1 else 1))


def _split(args: tuple[Any, ...], kwargs: dict[str, Any], parts: int
           ) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The sample cut along its batch dimension (see `_batch_leaf`): every tensor with that
    first dimension is cut, others are shared."""
    size = _batch_size(args, kwargs)
    bounds = [size * i // parts for i in range(parts + 1)]

    def cut(lo: int, hi: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda t: t[lo:hi] if t.dim() and t.shape[0] == size else t

    return [map_tree((args, kwargs), cut(lo, hi), floating_only=False)
            for lo, hi in itertools.pairwise(bounds)]


def as_given(sample: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A part of `sample` in the form `sample` was given in: a tensor, a mapping, or
    `(args, kwargs)`."""
    if isinstance(sample, Mapping):
        return kwargs
    if (isinstance(sample, tuple) and len(sample) == 2 and isinstance(sample[0], (tuple, list))
            and isinstance(sample[1], Mapping)):
        return (args, kwargs)
    return args[0]


def split_samples(sample: Any, args: tuple[Any, ...], kwargs: dict[str, Any], held_out: Any,
             loss_fn: LossFn | None) -> tuple[Sample, list[Sample], str]:
    """The calibration batch and the held-out ones, and a warning to give (or "")."""
    if held_out is not None:
        if not isinstance(held_out, (list, tuple)) or (isinstance(held_out, tuple) and len(
                held_out) == 2 and isinstance(held_out[1], Mapping)):
            raise TypeError("suggest(held_out=...) is a list of samples (each as `sample` is "
                            f"given), or [] to hold nothing out. Received: {held_out!r}"[:300])
        calib = Sample("calibration", args, kwargs, original=as_given(sample, args, kwargs))
        others = []
        for i, extra in enumerate(held_out, 1):
            a, k = as_call(extra)
            a, k = map_tree((a, k), lambda t: t.float())
            others.append(Sample(f"held-out {i}", a, k, original=as_given(extra, a, k)))
        return calib, others, ""
    size = _batch_size(args, kwargs)
    whole = Sample("calibration", args, kwargs, original=as_given(sample, args, kwargs))
    if size < 4:
        return whole, [], (f"the sample's batch has {size} rows, too few to hold any out: the "
                           "plan is checked on that batch alone. Pass a larger batch, or "
                           "held_out=[batch, ...].")
    halves = _split(args, kwargs, 2)
    calib = Sample("calibration", *halves[0], original=as_given(sample, *halves[0]))
    rest = _split(*halves[1], 2)
    others = [Sample(f"held-out {i}", *part, original=as_given(sample, *part))
              for i, part in enumerate(rest, 1)]
    return calib, others, ""
