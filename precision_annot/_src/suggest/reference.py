"""The fp32 reference run every plan is compared with, and the checks that it can serve as one."""

from __future__ import annotations

import contextlib
import copy
import math
import types
from typing import Any

import torch
from torch import nn

from precision_annot._src.casting import floating_leaves
from precision_annot._src.dtypes import fp16
from precision_annot._src.recording import Recorder, Returned
from precision_annot._src.runtime import remove
from precision_annot._src.suggest.compare import detached, relative_error, scan
from precision_annot._src.suggest.constants import SEED
from precision_annot._src.suggest.records import LossFn, Reference, Sample
from precision_annot._src.suggest.watch import Watch
from precision_annot._src.tracking import ModuleTracker


def require_real_data(model: nn.Module, sample: Any) -> None:
    leaves: list[torch.Tensor] = []
    floating_leaves(sample, leaves)
    tensors = [*model.parameters(), *model.buffers(), *leaves]
    if any(t.is_meta for t in tensors):
        raise ValueError("suggest runs the model and compares numbers: its parameters and the "
                         "sample must hold data, and some are on the meta device. Materialize "
                         "the model (model.to_empty(device=...) and load its weights) first.")


def require_outputs(output: Any, loss_fn: LossFn | None) -> None:
    """suggest compares floating outputs (or, with `loss_fn`, the loss and the gradients)."""
    if isinstance(output, types.GeneratorType):
        raise TypeError(
            "suggest: the model returned a generator, so there is no output to compare until "
            "the caller runs it. Pass a model that returns its outputs, e.g. a wrapper whose "
            "forward returns list(model(...)).")
    leaves: list[torch.Tensor] = []
    floating_leaves(output, leaves)
    if not leaves and loss_fn is None:
        raise TypeError(
            "suggest: the model returned no floating tensor (it returned "
            f"{describe(output)}), so no plan can be compared with the fp32 run. Return the "
            "outputs, or pass loss_fn=... to compare the loss and the gradients.")


def require_deterministic(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                           ref: Reference, tolerance: float) -> None:
    """A second fp32 run from the same seed must give the same output: a plan's error is
    measured against the first, so noise would read as precision loss."""
    torch.manual_seed(SEED)
    with torch.no_grad():
        again = model(*copy.deepcopy(args), **copy.deepcopy(kwargs))
    drift = relative_error(again, ref.output)
    if math.isfinite(drift) and drift <= min(tolerance * 0.1, 1e-4):
        return
    raise ValueError(
        "suggest: two fp32 runs of the model on the same sample, each from the same torch "
        f"seed, differ (relative error {drift:.2e}), so a plan's error could not be told from "
        "that noise. Its forward draws randomness that torch's seed does not fix (Python's "
        "random, NumPy, a generator of its own) or reads state that changes between calls. "
        "Make the forward deterministic for suggest: eval() mode, sampling off (e.g. "
        "do_sample=False), or seed that randomness inside the forward.")


def require_finite_reference(ref: Reference) -> None:
    """Every plan is compared with the fp32 run, so that run must not give nan (an output of
    inf may be meant: masked logits) nor a non-finite loss."""
    leaves: list[torch.Tensor] = []
    floating_leaves(ref.output, leaves)
    if ref.loss is not None and not bool(torch.isfinite(ref.loss).all()):
        what = "the loss is"
    elif any(bool(torch.isnan(t).any()) for t in leaves):
        what = "its output holds nan"
    else:
        return
    raise ValueError(
        f"suggest: the model's fp32 run on this sample is not finite ({what}). Every candidate "
        "plan is measured against that run, so suggest needs a sample the model handles in "
        "fp32: check the sample for nan or inf values.")


def run_reference(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                  loss_fn: LossFn | None, sample: Sample, *, watch: bool = True,
                  feeds_above: float | None = None) -> Reference:
    """The fp32 run plans are compared with. Watched (`watch`), it records every module's
    first inputs and output, the peak its own ops produce and the non-finite values each makes;
    unwatched (the first run, and each held-out batch's), only the output, loss, gradients and
    the largest gradient of a module output (for fp16's loss scale): one plain step."""
    if not watch:
        return _plain_reference(model, args, kwargs, loss_fn, sample)
    inputs: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
    outputs: dict[str, Any] = {}

    def enter(name: str, module: nn.Module, a: tuple[Any, ...], k: dict[str, Any]) -> None:
        if name not in inputs:  # an argument that cannot be copied: the module is not measured
            with contextlib.suppress(Exception), mode.pause():
                inputs[name] = (detached(a), detached(k))

    def leave(name: str, module: nn.Module, output: Any) -> None:
        mode.returned(name, output)
        if name not in outputs:
            with contextlib.suppress(Exception), mode.pause():
                outputs[name] = detached(output)

    names = {m: n for n, m in model.named_modules()}
    tracker = ModuleTracker(names, enter, leave)
    mode = Watch(tracker, peaks=True, feeds_above=feeds_above)
    with tracker, mode:
        output, loss = _reference_step(model, args, kwargs, loss_fn, sample)
    return Reference(detached(output), loss, _take_gradients(model), inputs, outputs,
                     mode.peaks, mode.backward_peak, mode.counts, mode.feeds)


def _plain_reference(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                     loss_fn: LossFn | None, sample: Sample) -> Reference:
    peak = [0.0]
    largest: dict[str, float] = {}  # of each module's output in forward

    def on_output(r: Returned, t: torch.Tensor, module: nn.Module, a: tuple[Any, ...]) -> None:
        largest[r.name] = max(largest.get(r.name, 0.0), scan(t.detach(), peaks=True)[1])

    def on_grad(r: Returned, grad: torch.Tensor) -> None:
        peak[0] = max(peak[0], scan(grad.detach(), peaks=True)[1])

    with Recorder(dict(model.named_modules()), on_output, on_grad):
        output, loss = _reference_step(model, args, kwargs, loss_fn, sample)
    return Reference(detached(output), loss, _take_gradients(model), {}, {}, {}, peak[0], {},
                     output_peaks=largest)


def _reference_step(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                    loss_fn: LossFn | None, sample: Sample
                    ) -> tuple[Any, torch.Tensor | None]:
    """One seeded fp32 forward on copies of the sample, and the backward of `loss_fn`'s loss:
    the output and the (detached) loss."""
    try:
        torch.manual_seed(SEED)
        output = model(*copy.deepcopy(args), **copy.deepcopy(kwargs))
    except TypeError as e:
        if not (len(args) == 1 and isinstance(args[0], tuple) and not kwargs):
            raise
        raise TypeError(f"suggest: the model failed on the sample ({e}). A tuple sample is "
                        "passed as one argument; for several positional arguments pass "
                        "(args, kwargs), e.g. suggest(model, ((x1, x2), {})).") from e
    loss = loss_fn(output, sample) if loss_fn is not None else None
    if loss is None:
        return output, None
    require_loss(loss)
    loss.backward()  # type: ignore[no-untyped-call]
    return output, loss.detach()


def _take_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """The gradients a step left, by parameter name; the model's own are cleared."""
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def require_loss(loss: Any) -> None:
    if not (isinstance(loss, torch.Tensor) and loss.is_floating_point()
            and loss.numel() == 1 and loss.requires_grad):
        raise TypeError(
            "suggest(loss_fn=...) must return a one-element floating tensor computed "
            "from the output, so that its backward reaches the parameters. Received: "
            f"{describe(loss)}.")


def describe(value: Any) -> str:
    if not isinstance(value, torch.Tensor):
        return f"{value!r} (of type {type(value).__name__})"
    return (f"a tensor of shape {tuple(value.shape)}, dtype {value.dtype}, "
            f"requires_grad={value.requires_grad}")


def fp32_copy(model: nn.Module, training: bool) -> nn.Module:
    """A deep copy of `model` with no plan applied, every floating tensor in fp32, in eval
    mode (dropout off, so that runs compare). With `training` (a loss to train on), the
    normalisations that keep running statistics (BatchNorm) run as in training, on the
    batch's own statistics: eval mode would normalise with the running ones, which training
    never computes in, and a plan would be chosen for values training does not see."""
    reference = copy.deepcopy(model)
    remove(reference)
    _eager(reference)
    reference.float()
    reference.eval()
    if training:
        for module in reference.modules():
            if isinstance(getattr(module, "running_mean", None), torch.Tensor):
                module.train()
    reference.zero_grad(set_to_none=True)
    return reference


def _eager(model: nn.Module) -> None:
    """The copy runs eager: a module compiled in place (`module.compile()`, as FSDP2 recipes
    compile each layer) would compile again in every copy a check makes.

    NOTE: `nn.Module.compile` keeps its compiled call in `_compiled_call_impl`, which no public
    API clears; a copy carries it along."""
    for module in model.modules():
        if module.__dict__.get("_compiled_call_impl") is not None:
            module._compiled_call_impl = None


def first_scale(low: torch.dtype, ref: Reference) -> float:
    """The loss scale fp16 checks start from: the largest power of two (up to 2**64) that
    keeps the fp32 run's largest gradient in fp16; 1 for other dtypes. A GradScaler has no
    ceiling: it doubles its scale after every `growth_interval` steps without overflow, so a
    model whose gradients are all tiny trains at a scale far above its initial 2**16."""
    if low != fp16 or ref.backward_peak <= 0:
        return 1.0
    return float(2.0 ** max(0, min(MAX_SCALE_BITS, math.floor(
        math.log2(65504 / ref.backward_peak)))))


MAX_SCALE_BITS = 64
