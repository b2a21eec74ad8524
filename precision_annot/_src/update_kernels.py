"""The step kernels of the update half: one optimizer step over lists of tensors.

These are plain functions in the manner of `torch.optim`'s functional API (`_fused_adamw`):
the optimizer class gathers each group's tensors and calls one of them. They read every
tensor as it is stored, compute in the widest dtype of a parameter's tensors (the master's
fp32 in every planned layout), and write each tensor back in its own dtype. Nothing here
keeps state between calls but a scratch buffer per thread.

API (every list holds one entry per parameter, in the same order; the tensors of one
parameter are on one device, have its shape and are contiguous, as torch's fused kernels
take them; a gradient stored narrower than the compute dtype may have any layout (one that
is cut into chunks and is not contiguous is copied contiguous first, in its own dtype);
states, `params`, `stored` and `steps` are updated in place):

- `adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, lr, beta1, beta2,
  eps, weight_decay, decoupled, amsgrad=False, maximize=False, stored=None, grad_scale=None,
  found_inf=None, chunk=None, cache=None)`: one Adam (`decoupled=False`) or AdamW
  (`decoupled=True`) step through torch's fused kernel (`torch._fused_adam_` /
  `_fused_adamw_`), bit for bit what `torch.optim.Adam(W)(fused=True)` does to `params`
  given the same gradients upcast.
  `params` are what is updated (the fp32 masters, or the parameters themselves when there is
  no master); `grads` as stored (bf16, fp16 or fp32); `exp_avgs`, `exp_avg_sqs` (and
  `max_exp_avg_sqs` when `amsgrad`, else `[]`) in the dtype of `params` or narrower (a bf16
  state is read and written rounded to nearest); `steps` one float32 scalar tensor per
  parameter (incremented here, as torch does); `stored`, when given, one tensor per
  parameter that receives each updated value rounded into its dtype (the bf16 or fp16 weight
  the model computes with). `grad_scale` / `found_inf` are a GradScaler's (the gradient is
  divided by the scale in the compute dtype; on `found_inf` nothing changes). Where anything
  is stored narrower than `params` (the gradient, a state, the stored weight), the step runs
  over chunks of `chunk` elements (default `CHUNK`; a parameter is split, small ones are
  grouped), widening each chunk into a scratch buffer and narrowing it back after: no
  full-size temporary is made. `cache`, a dict the caller keeps between steps (one per list
  of parameters), keeps what a step works out from the tensors but the gradients (the
  loops by device and dtype, each tensor's pieces): reused while every one of them is the
  same tensor object, so that a step cuts only the gradients.
- `sgd(params, grads, momentum_buffers, *, lr, momentum=0.0, dampening=0.0, weight_decay=0.0,
  nesterov=False, maximize=False, stored=None, grad_scale=None, found_inf=None, chunk=None,
  cache=None)`: the same for SGD (`torch._fused_sgd_`); `momentum_buffers` holds a tensor
  or None per parameter; when every entry is None (the first step) it is filled in place with new
  buffers in the dtype of `params`, as `torch.optim.SGD(fused=True)` does.
- `lowbit_state(p, state, signed, block_size=None)`: a zero optimizer state for `p` in
  torchao's format (`state` is "8bit", "4bit" or "fp8": torchao's `OptimState8bit`,
  `OptimState4bit`, `OptimStateFp8`), or a plain zero tensor in `p`'s dtype where torchao
  keeps one (under 4,096 elements, or not a multiple of the block size). `signed` is True for
  the first moment, False for the second.
- `lowbit_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, lr, beta1,
  beta2, eps, weight_decay, decoupled, maximize=False, stored=None, stochastic=False,
  grad_scale=None, found_inf=None, compiled=True)`: torchao's Adam/AdamW update
  (`single_param_adam`'s math, bit for bit what `torchao.optim.AdamW8bit` by hand gives)
  over states made by `lowbit_state` (or any float tensors), compiled once per layout
  (state format, flags, dtypes) and reused for every shape: one `torch.compile` per
  layout, not per shape (`compiled=False` runs the same operations eagerly: no compile,
  many passes). `params` are fp32 masters or the parameters; `stored` as in `adam`;
  `stochastic` rounds a bf16 `params` stochastically (torchao's `bf16_stochastic_round`).
- `fused_available(device)`: whether torch has fused kernels for that device: `adam` and
  `sgd` use them on every device (a CUDA device runs torch's fused CUDA kernel, chunked only
  to bound the scratch memory), and refuse a device without them.

What `adam` costs against torch's own fused fp32 step, and why it is not 1.0x, is in
docs/performance.md ("The optimizer step").
"""

from __future__ import annotations

import contextlib
import functools
import operator
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from precision_annot._src.update.formats import torchao_module

__all__ = ["CHUNK", "LowBit", "adam", "fused_available", "lowbit_adam", "lowbit_state", "sgd"]

#: elements per chunk on a CPU, where a chunk's scratch stays in cache between widening and
#: narrowing (a multiple of 64, so that splitting a tensor keeps torch's vectorised loop and
#: its tail exactly where they fall on the whole tensor)
CHUNK = 1 << 18
#: elements per chunk on an accelerator: only the scratch memory is bounded there
_DEVICE_CHUNK = 1 << 25
_ALIGN = 64

LowBit = Literal["8bit", "4bit", "fp8"]


def fused_available(device: torch.device) -> bool:
    """Whether torch has fused optimizer kernels for `device`'s type."""
    return device.type in _fused_devices()


@functools.cache
def _fused_devices() -> tuple[str, ...]:
    # NOTE: torch's own list of the devices with fused kernels is private; reading it here
    # (one place) keeps the choice of engine the same as torch.optim's `fused=True` check.
    from torch.optim import optimizer

    return tuple(optimizer._get_fused_kernels_supported_devices())  # type: ignore[attr-defined]


# --- the fused engine: chunks through scratch buffers ----------------------------------------

_scratch = threading.local()

#: one fused call: each role's tensors, widened where stored narrower
_Call = Callable[[list[list[Tensor]]], None]


def _buffer(device: torch.device, dtype: torch.dtype, slot: int, numel: int) -> Tensor:
    """A scratch buffer of `numel` elements: kept per thread on a CPU (a fresh allocation of
    that size costs page faults at every step), made anew on an accelerator (its caching
    allocator makes that free, and a buffer kept across streams would not be)."""
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    cache: dict[tuple[torch.dtype, int], Tensor] | None = getattr(_scratch, "cache", None)
    if cache is None:
        cache = _scratch.cache = {}
    buf = cache.get((dtype, slot))
    if buf is None or buf.numel() < numel:
        buf = cache[(dtype, slot)] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


def _flat(t: Tensor, what: str) -> Tensor:
    if not t.is_contiguous():
        raise ValueError(f"the update kernels step contiguous tensors only; received {what} "
                         f"of shape {tuple(t.shape)} and stride {t.stride()}.")
    return t.view(-1)


def _flat_any(t: Tensor) -> Tensor:
    """`t` flat: a view where it is contiguous (every tensor a loop cuts but a gradient stored
    narrower than the compute dtype, which `_prepare` lets have any layout), else a contiguous
    copy in its own dtype (a transposed bf16 gradient: its pieces are widened into the
    chunks' scratch from that copy)."""
    return t.view(-1) if t.is_contiguous() else t.reshape(-1)


class _Layout:
    """How a list of parameter shapes is cut into chunks of `chunk` elements: each chunk
    filled, a tensor that fits in what is left of one joining it whole, one that does not
    split (flat, at multiples of 64 elements from its start) to fill it and the chunks after
    it. Made once per list of shapes (kept per thread, with the scratch views it widens
    into), so that a step only slices lists."""

    def __init__(self, shapes: Sequence[torch.Size], chunk: int) -> None:
        self.chunk = chunk
        self.splits: list[list[int] | None] = []  # per parameter: its pieces, None if whole
        self.shapes: list[torch.Size] = []  # per piece
        self.bounds: list[tuple[int, int]] = []  # per chunk: its range of pieces
        self._views: dict[tuple[torch.device, torch.dtype, int], list[list[Tensor]]] = {}
        self._used = 0
        for shape in shapes:
            self._place(shape)
        self._close()
        self.cut = [k for k, split in enumerate(self.splits) if split]  # parameters split

    def _place(self, shape: torch.Size) -> None:
        numel = shape.numel()
        room = self.chunk - self._used
        if numel > room and room < _ALIGN:
            self._close()
            room = self.chunk
        if numel <= room:
            self.splits.append(None if numel else [])
            if numel:
                self._piece(shape, numel)
            return
        first = room - room % _ALIGN
        rest = numel - first
        sizes = [first] + [self.chunk] * (rest // self.chunk)
        sizes += [rest % self.chunk] if rest % self.chunk else []
        self.splits.append(sizes)
        for k, size in enumerate(sizes):
            self._piece(torch.Size([size]), size)
            if k < len(sizes) - 1:
                self._close()

    def _piece(self, shape: torch.Size, numel: int) -> None:
        self.shapes.append(shape)
        self._used += numel

    def _close(self) -> None:
        begin = self.bounds[-1][1] if self.bounds else 0
        if len(self.shapes) > begin:
            self.bounds.append((begin, len(self.shapes)))
        self._used = 0

    def scratch(self, device: torch.device, dtype: torch.dtype, slot: int
                ) -> list[list[Tensor]]:
        """Per chunk, views of one scratch buffer shaped as the chunk's pieces."""
        key = (device, dtype, slot)
        if key in self._views:
            return self._views[key]
        buf = _buffer(device, dtype, slot, self.chunk)
        out = []
        for begin, end in self.bounds:
            shapes = self.shapes[begin:end]
            sizes = [s.numel() for s in shapes]
            flat = buf[:sum(sizes)].split_with_sizes(sizes)
            out.append([f if len(s) == 1 else f.view(s) for f, s in zip(flat, shapes,
                                                                        strict=True)])
        if device.type == "cpu":  # (an accelerator's buffer is made for each step)
            self._views[key] = out
        return out

    def pieces(self, tensors: list[Tensor], repeat: bool = False) -> list[Tensor]:
        """One role's tensors as the layout's pieces (or, with `repeat`, each parameter's
        tensor once per piece: its step count)."""
        out: list[Tensor] = []
        for t, split in zip(tensors, self.splits, strict=True):
            if split is None:
                out.append(t)
            elif repeat:
                out.extend([t] * len(split))
            elif split:
                out.extend(_flat_any(t).split_with_sizes(split))
        return out


def _layout(shapes: tuple[torch.Size, ...], chunk: int) -> _Layout:
    cache: dict[tuple[tuple[torch.Size, ...], int], _Layout] | None = getattr(
        _scratch, "layouts", None)
    if cache is None:
        cache = _scratch.layouts = {}
    layout = cache.get((shapes, chunk))
    if layout is None:
        if len(cache) >= 16:
            cache.clear()
        layout = cache[(shapes, chunk)] = _Layout(shapes, chunk)
    return layout


class _Loop:
    """One fused loop of a step: the parameters of one device and compute dtype (the widest of
    a parameter's tensors), their tensors by role ("params" first, then the others in the order
    the fused call reads them; "steps" holds one tensor a parameter, given to each of its
    pieces; a DTensor's local shard), and, once it has run in chunks, each role's pieces. Made
    once per list of tensors: a caller's `cache` keeps it across steps, so that a step cuts
    only the gradients (which it never keeps: a gradient set to None is freed)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, index: list[int],
                 roles: dict[str, list[Tensor]], chunk: int | None, distributed: bool) -> None:
        self.distributed = distributed
        self.device = device
        self.dtype = dtype
        self.index = index
        self.roles = {name: ([] if name == "grads" else tensors)
                      for name, tensors in roles.items()}
        self.chunk = chunk
        self.narrow = {name: name not in ("stored", "steps", "grads") and any(
            t.dtype != dtype for t in tensors) for name, tensors in self.roles.items()}
        self.layout: _Layout | None = None
        self.pieces: dict[str, tuple[list[int], list[Tensor]]] = {}

    def grads_of(self, grads: Sequence[Tensor], params: Sequence[Tensor]) -> list[Tensor]:
        """This loop's gradients, local shards where DTensors, checked as `_prepare` checks
        them (one stored in the compute dtype is cut into pieces: it must be contiguous)."""
        mine = [grads[i] for i in self.index] if len(self.index) != len(grads) else list(grads)
        if self.distributed:
            mine = _local(mine, [params[i] for i in self.index], "grads", self.index)
        dtype = self.dtype
        for k, g in enumerate(mine):
            if g.dtype == dtype and not g.is_contiguous():
                _flat(g, f"grads[{self.index[k]}]")
        return mine

    def run(self, grads: list[Tensor], written: Sequence[str], call: _Call) -> None:
        """`call` over the loop's tensors: at once when every tensor is stored in the compute
        dtype and nothing is written to a `stored` copy, else a chunk at a time, the roles
        stored narrower widened into scratch views before each call and the written ones
        narrowed back after it."""
        roles = {**self.roles, "grads": grads}
        narrow_grads = any(g.dtype != self.dtype for g in grads)
        if not narrow_grads and not any(self.narrow.values()) and not roles.get("stored"):
            call(list(roles.values()))
            return
        layout = self.layout
        if layout is None:
            layout = self.layout = _layout(tuple(p.shape for p in roles["params"]),
                                           _chunk_for(self.device, self.chunk))
        names = list(roles)
        pieces = [self._pieces(layout, name, roles[name]) for name in names]
        narrow = [narrow_grads if name == "grads" else self.narrow[name] for name in names]
        scratch = {r: layout.scratch(self.device, self.dtype, r)
                   for r, n in enumerate(narrow) if n}
        _chunks(layout, pieces, scratch, [r for r in scratch if names[r] in written], call)

    def _pieces(self, layout: _Layout, name: str, tensors: list[Tensor]) -> list[Tensor]:
        if not tensors:
            return []
        if name == "grads":
            return layout.pieces(tensors)
        # a split tensor's pieces are views of its storage: one given new storage since
        # (`p.data = ...`, `model.float().bfloat16()`) is cut again
        where = [] if name == "steps" else [tensors[k].data_ptr() for k in layout.cut]
        held = self.pieces.get(name)
        if held is None or held[0] != where:
            held = self.pieces[name] = (where, layout.pieces(tensors, name == "steps"))
        return held[1]


def _chunks(layout: _Layout, pieces: list[list[Tensor]], scratch: dict[int, list[list[Tensor]]],
            back: list[int], call: _Call) -> None:
    """One fused call a chunk: the narrow roles widened into their scratch views first, the
    written ones among them narrowed back after."""
    for k, (begin, end) in enumerate(layout.bounds):
        lists = [p[begin:end] for p in pieces]
        for r, views in scratch.items():
            torch._foreach_copy_(views[k], lists[r])
            lists[r] = views[k]
        call(lists)
        for r in back:
            torch._foreach_copy_(pieces[r][begin:end], lists[r])


def _check(params: Sequence[Tensor], **lists: Sequence[Any] | None) -> None:
    """Each list holds one entry per parameter (an optional one may be None or empty)."""
    n = len(params)
    for name, values in lists.items():
        if values is None or (not values and name in _OPTIONAL):
            continue
        if len(values) != n:
            raise ValueError(f"`{name}` must hold one entry per parameter ({n}); received "
                             f"{len(values)}.")


_OPTIONAL = ("max_exp_avg_sqs", "stored", "momentum_buffers")


def _skipped(found_inf: Tensor | None) -> bool:
    """True when a CPU `found_inf` says this step is skipped (read here only on a CPU, where
    it costs no sync; elsewhere the fused kernel skips on the device)."""
    return found_inf is not None and found_inf.device.type == "cpu" and bool(found_inf.item())


def _chunk_for(device: torch.device, chunk: int | None) -> int:
    if chunk is None:
        return CHUNK if device.type == "cpu" else _DEVICE_CHUNK
    if chunk < _ALIGN or chunk % _ALIGN:
        raise ValueError(f"`chunk` must be a positive multiple of {_ALIGN} elements; "
                         f"received chunk={chunk}.")
    return chunk


def _groups(params: Sequence[Tensor], *others: Sequence[Tensor] | None
            ) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """The parameters' indices by device and compute dtype (the widest of a parameter's
    tensors: what it updates, its gradient and its states): one fused call, or one loop of
    chunks, each."""
    kinds = [{(t.device, t.dtype) for t in tensors} for tensors in (params, *others) if tensors]
    if all(len(kind) == 1 for kind in kinds):  # (the usual case: one dtype a role)
        device, dtype = next(iter(kinds[0]))
        for kind in kinds[1:]:
            dtype = torch.promote_types(dtype, next(iter(kind))[1])
        return {(device, dtype): list(range(len(params)))}
    out: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, p in enumerate(params):
        dtype = p.dtype
        for tensors in others:
            if tensors:
                dtype = torch.promote_types(dtype, tensors[i].dtype)
        out.setdefault((p.device, dtype), []).append(i)
    return out


def _pick(values: Sequence[Tensor] | None, index: list[int]) -> list[Tensor]:
    return [values[i] for i in index] if values else []


def _require_fused(device: torch.device, what: str) -> None:
    if not fused_available(device):
        raise ValueError(f"{what} runs torch's fused kernels, which torch has for device types "
                         f"{', '.join(_fused_devices())}; received parameters on {device}.")


@torch.no_grad()
def adam(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
         exp_avg_sqs: Sequence[Tensor], max_exp_avg_sqs: Sequence[Tensor],
         steps: Sequence[Tensor], *, lr: float | Tensor, beta1: float, beta2: float,
         eps: float, weight_decay: float, decoupled: bool, amsgrad: bool = False,
         maximize: bool = False, stored: Sequence[Tensor] | None = None,
         grad_scale: Tensor | None = None, found_inf: Tensor | None = None,
         chunk: int | None = None, cache: dict[str, Any] | None = None) -> None:
    """One Adam (AdamW when `decoupled`) step through torch's fused kernel: see the module's
    docstring."""
    _check(params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, steps=steps,
           max_exp_avg_sqs=max_exp_avg_sqs if amsgrad else None, stored=stored)
    if amsgrad and len(max_exp_avg_sqs) != len(params):
        raise ValueError(f"`max_exp_avg_sqs` must hold one tensor per parameter "
                         f"({len(params)}) when amsgrad=True; received {len(max_exp_avg_sqs)}.")
    if not params or _skipped(found_inf):
        return
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
    loops = _loops(cache, {"params": params, "grads": grads, "exp_avgs": exp_avgs,
                           "exp_avg_sqs": exp_avg_sqs,
                           "max_exp_avg_sqs": max_exp_avg_sqs if amsgrad else None,
                           "stored": stored, "steps": steps},
                   "the Adam step", chunk, (amsgrad, chunk))
    torch._foreach_add_(list(steps), 1)

    def call(lists: list[list[Tensor]]) -> None:
        fused(lists[0], lists[1], lists[2], lists[3], lists[4], lists[6], lr=lr, beta1=beta1,
              beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=amsgrad,
              maximize=maximize, grad_scale=grad_scale, found_inf=found_inf)
        if lists[5]:
            torch._foreach_copy_(lists[5], lists[0])

    for loop, loop_grads in loops:
        loop.run(loop_grads, ("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"), call)
    if found_inf is not None:
        torch._foreach_sub_(list(steps), [found_inf] * len(steps))


def _distributed(params: list[Tensor]) -> bool:
    """Whether any parameter is a DTensor (then each of its tensors must be one, placed alike;
    a plain parameter's tensors are plain)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in params)


def _local(tensors: list[Tensor], params: list[Tensor], name: str, index: list[int]
           ) -> list[Tensor]:
    """Each DTensor's local shard: the step is elementwise, so each rank steps its own shard
    (as torch's fused step does under FSDP2), provided every tensor of a parameter is placed
    as the parameter is (a gradient still partial, not yet reduced, is refused)."""
    from torch.distributed.tensor import DTensor

    out = []
    for k, t in enumerate(tensors):
        if isinstance(t, DTensor):
            p = params[k]
            if not isinstance(p, DTensor) or (t.device_mesh, t.placements) != (
                    p.device_mesh, p.placements):
                raise ValueError(
                    f"{name}[{index[k]}] is a DTensor placed {t.placements}; the step takes "
                    f"the tensors of a parameter placed as the parameter is "
                    f"({getattr(p, 'placements', 'not a DTensor')}).")
            t = t.to_local()
        out.append(t)
    return out


def _prepare(lists: dict[str, Sequence[Tensor] | None], what: str, chunk: int | None
             ) -> list[_Loop]:
    """The fused loops of one step, by device and compute dtype, after checking everything a
    loop would refuse halfway (so that a refused step changes nothing)."""
    if chunk is not None:
        _chunk_for(torch.device("cpu"), chunk)
    state = [lists[name] for name in lists if name not in ("params", "stored", "steps")]
    loops: list[_Loop] = []
    for (device, dtype), index in _groups(lists["params"] or [], *state).items():
        _require_fused(device, what)
        params = _pick(lists["params"], index)
        roles = {name: _pick(tensors, index) for name, tensors in lists.items()}
        distributed = _distributed(params)
        if distributed:
            roles = {name: (tensors if name == "steps" else _local(tensors, params, name, index))
                     for name, tensors in roles.items()}
        _require_flat(roles, dtype, index)
        loops.append(_Loop(device, dtype, index, roles, chunk, distributed))
    return loops


def _require_flat(roles: dict[str, list[Tensor]], dtype: torch.dtype, index: list[int]
                  ) -> None:
    """Every tensor a loop views flat is contiguous (a gradient narrower than the compute
    dtype is copied wider anyway, so any layout does)."""
    for name, tensors in roles.items():
        for k, t in enumerate(tensors):
            if name != "steps" and not t.is_contiguous() and (
                    name != "grads" or t.dtype == dtype):
                _flat(t, f"{name}[{index[k]}]")


def _same(held: dict[str, list[Tensor]], lists: dict[str, Sequence[Tensor] | None]) -> bool:
    """Whether every role but the gradients holds the very tensors it held."""
    for name, tensors in lists.items():
        if name == "grads":
            continue
        old = held.get(name, [])
        new = tensors or []
        if len(old) != len(new) or not all(map(operator.is_, old, new)):
            return False
    return True


def _loops(cache: dict[str, Any] | None, lists: dict[str, Sequence[Tensor] | None], what: str,
           chunk: int | None, key: tuple[Any, ...]) -> list[tuple[_Loop, list[Tensor]]]:
    """The fused loops of this step with their gradients: made by `_prepare`, or taken from
    `cache` (a dict the caller keeps between steps) when every tensor but the gradients is the
    one it held and the gradients' dtypes are as they were."""
    grads = lists["grads"] or []
    params = lists["params"] or []
    dtypes = tuple(g.dtype for g in grads)
    held = None if cache is None else cache.get(what)
    if held is not None and held[0] == (key, dtypes) and _same(held[1], lists):
        loops: list[_Loop] = held[2]
        return [(loop, loop.grads_of(grads, params)) for loop in loops]
    loops = _prepare(lists, what, chunk)
    if cache is not None:
        cache[what] = ((key, dtypes), {n: list(t) for n, t in lists.items()
                                       if n != "grads" and t}, loops)
    return [(loop, loop.grads_of(grads, params)) for loop in loops]


def _momentum(params: Sequence[Tensor], momentum_buffers: list[Tensor | None],
              momentum: float) -> tuple[bool, list[Tensor]]:
    """Whether this is the first step with momentum (every buffer None: each is made here, as
    torch's fused SGD does), and the buffers."""
    if momentum == 0:
        return False, []
    if all(b is None for b in momentum_buffers):
        return True, [torch.empty_like(p, memory_format=torch.contiguous_format)
                      for p in params]
    buffers = [b for b in momentum_buffers if b is not None]
    if len(buffers) != len(params):
        raise ValueError("`momentum_buffers` holds None for some parameters and a tensor for "
                         "others; torch's fused SGD starts every buffer at the same step.")
    return False, buffers


@torch.no_grad()
def sgd(params: Sequence[Tensor], grads: Sequence[Tensor],
        momentum_buffers: list[Tensor | None], *, lr: float | Tensor, momentum: float = 0.0,
        dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
        maximize: bool = False, stored: Sequence[Tensor] | None = None,
        grad_scale: Tensor | None = None, found_inf: Tensor | None = None,
        chunk: int | None = None, cache: dict[str, Any] | None = None) -> None:
    """One SGD step through torch's fused kernel: see the module's docstring."""
    _check(params, grads=grads, momentum_buffers=momentum_buffers if momentum else None,
           stored=stored)
    if not params or _skipped(found_inf):
        return
    first, buffers = _momentum(params, momentum_buffers, momentum)
    loops = _loops(None if first else cache,
                   {"params": params, "grads": grads, "momentum_buffers": buffers,
                    "stored": stored}, "the SGD step", chunk, (chunk,))
    if first:
        momentum_buffers[:] = buffers

    def call(lists: list[list[Tensor]]) -> None:
        torch._fused_sgd_(lists[0], lists[1], lists[2], weight_decay=weight_decay,
                          momentum=momentum, lr=lr, dampening=dampening, nesterov=nesterov,
                          maximize=maximize, is_first_step=first, grad_scale=grad_scale,
                          found_inf=found_inf)
        if lists[3]:
            torch._foreach_copy_(lists[3], lists[0])

    for loop, loop_grads in loops:
        loop.run(loop_grads, ("params", "momentum_buffers"), call)


# --- low-bit states (torchao) -----------------------------------------------------------------


def _torchao(name: str) -> Any:
    return torchao_module(name, "low-bit")


#: torchao's quantization functions, looked up once (outside the compiled step, which reads
#: them from here)
_AO: dict[str, Callable[..., Any]] = {}


def _load_torchao() -> None:
    if _AO:
        return
    utils = _torchao("torchao.optim.quant_utils")
    for name in ("dequant_with_qmap", "scale_tensor", "quantize_8bit_with_qmap",
                 "quantize_4bit_with_qmap", "_fp32_to_bf16_sr"):
        _AO[name] = getattr(utils, name)
    _AO["quantize_fp8"] = _torchao("torchao.optim.subclass_fp8").quantize_fp8


def lowbit_state(p: Tensor, state: LowBit, signed: bool, block_size: int | None = None
                 ) -> Tensor:
    """A zero optimizer state for `p` in torchao's format, or a plain zero tensor where torchao
    keeps one (fewer than 4,096 elements, or not a whole number of blocks)."""
    optim = _torchao("torchao.optim")
    cls, default = {"8bit": (optim.subclass_8bit.OptimState8bit, 256),
                    "4bit": (optim.subclass_4bit.OptimState4bit, 128),
                    "fp8": (optim.subclass_fp8.OptimStateFp8, 256)}.get(state, (None, 0))
    if cls is None:
        raise ValueError(f"`state` must be one of '8bit', '4bit', 'fp8'; received "
                         f"state={state!r}.")
    block = block_size or default
    from torch.distributed.tensor import DTensor

    local = p.to_local() if isinstance(p, DTensor) else p
    if local.numel() < 4096 or local.numel() % block:
        out = torch.zeros_like(local, memory_format=torch.contiguous_format)
    elif state == "fp8":
        out = cls.zeros(local.shape, block, local.device, dtype=local.dtype)
    else:
        out = cls.zeros(local.shape, signed, block, local.device, dtype=local.dtype)
    if isinstance(p, DTensor):  # each rank's shard quantized on its own, as torchao does
        out = DTensor.from_local(out, p.device_mesh, p.placements, run_check=False,
                                 shape=p.shape, stride=p.stride())
    return out


#: a state as the compiled step sees it: its format and its tensors, blocked
_Parts = tuple[str, tuple[Tensor, ...]]


def _parts(state: Tensor, block: int) -> _Parts:
    """A state's format and its tensors, each viewed as (blocks, block) where it has blocks."""
    # NOTE: torchao's state subclasses keep their data in `codes`, `scale` and `qmap` (their
    # `tensor_attrs`, which `__tensor_flatten__` exposes); the compiled step reads and writes
    # those plain tensors so that it compiles once for every shape (a subclass with a dynamic
    # shape does not trace), with the same arithmetic as the subclass's own ops.
    name = type(state).__name__
    if name == "OptimState8bit":
        s: Any = state
        table = _floor_table(s.qmap)
        return "8bit", (s.codes.view(-1, block), s.scale, s.qmap) + (
            (table,) if table is not None else ())
    if name == "OptimState4bit":
        s = state
        return "4bit", (s.codes.view(-1, block // 2), s.scale, s.qmap)
    if name == "OptimStateFp8":
        s = state
        return "fp8", (s.codes.view(-1, block), s.scale)
    if not state.is_floating_point():
        raise ValueError(f"an optimizer state must be a float tensor or one of torchao's "
                         f"OptimState8bit, OptimState4bit, OptimStateFp8; received "
                         f"{type(state).__name__} of dtype {state.dtype}.")
    flat = _flat(state, "a state")
    return "plain", (flat.view(-1, block) if block > 1 else flat,)


def _block(states: Sequence[Tensor]) -> int:
    """The block size shared by a parameter's quantized states (1 when none is quantized)."""
    sizes = {int(getattr(s, "block_size", 1)) for s in states}
    sizes.discard(1)
    if len(sizes) > 1:
        raise ValueError(f"a parameter's quantized states must share one block size; "
                         f"received {sorted(sizes)}.")
    return sizes.pop() if sizes else 1


def _read(parts: _Parts) -> Tensor:
    """The state in fp32, as torchao's `dequantize` computes it."""
    dequant_with_qmap = _AO["dequant_with_qmap"]
    kind, t = parts
    if kind == "8bit":
        return dequant_with_qmap(t[0], t[2], t[1])  # type: ignore[no-any-return]
    if kind == "4bit":
        codes = torch.stack([t[0] >> 4, t[0] & 0b1111], dim=-1)
        return dequant_with_qmap(codes, t[2], t[1]).view(t[1].shape[0], -1)  # type: ignore[no-any-return]
    if kind == "fp8":
        return t[0].float() * t[1].view(-1, 1)
    return t[0].float()


def _write(parts: _Parts, value: Tensor) -> None:
    """`value` (fp32) into the state, as torchao's `copy_` into it quantizes it."""
    kind, t = parts
    if kind == "plain":
        t[0].copy_(value)
        return
    if kind == "fp8":
        codes, scale = _AO["quantize_fp8"](value, t[0].shape[1])
        t[0].copy_(codes)
        t[1].copy_(scale)
        return
    scaled, scale = _AO["scale_tensor"](value, value.shape[1])
    if kind == "8bit":
        t[0].copy_(_quantize_8bit(scaled, t[2], t[3]) if len(t) > 3 else
                   _AO["quantize_8bit_with_qmap"](scaled, t[2]))
    else:
        codes = _AO["quantize_4bit_with_qmap"](scaled, t[2])
        t[0].copy_((codes[:, ::2] << 4) | codes[:, 1::2])
    t[1].copy_(scale)


_tables: dict[tuple[torch.device, bytes], Tensor | None] = {}


def _floor_table(qmap: Tensor) -> Tensor | None:
    """For each bf16 bit pattern (an fp32 value's upper 16 bits), the code torchao's search
    finds for the lowest fp32 value that starts with it: the largest code whose map value is
    at most that value (0 when there is none, and for a NaN or an infinity). None when some
    such bucket of fp32 values holds more than one map value above its lowest (then one step
    up from the table's code would not always reach torchao's). Made once per map."""
    key = (qmap.device, qmap.cpu().numpy().tobytes())
    if key not in _tables:
        bits = torch.arange(1 << 16, dtype=torch.int32, device=qmap.device) << 16
        low = torch.where(bits < 0, bits | 0xFFFF, bits).view(torch.float32)
        high = torch.where(bits < 0, bits, bits | 0xFFFF).view(torch.float32)
        below = torch.searchsorted(qmap, low, right=True)
        inside = torch.searchsorted(qmap, high, right=True) - below
        finite = low.isfinite() & high.isfinite()
        ordered = bool((qmap[1:] > qmap[:-1]).all())
        codes = torch.where(finite, (below - 1).clamp(min=0), 0)
        _tables[key] = codes.to(torch.uint8) if ordered and int(
            inside[finite].max()) <= 1 else None
    return _tables[key]


def _quantize_8bit(x: Tensor, qmap: Tensor, table: Tensor) -> Tensor:
    """torchao's `quantize_8bit_with_qmap`, the same codes found in 4 lookups instead of 10.

    torchao's branchless binary search (8 lookups) finds the largest code whose map value is
    at most `x`; its rounding then picks it or the next (2 lookups). Here the search starts
    from the code `_floor_table` gives for the bf16 bucket that holds `x` (all fp32 values
    sharing its upper 16 bits) and moves up by at most one: no bucket of torchao's signed or
    unsigned 8-bit map holds more than one map value above its lowest value (`_floor_table`
    checks this for the map at hand; torchao's own search serves a map where it fails).
    `test_the_8bit_quantizer_finds_torchaos_codes` compares the codes at every bucket edge,
    every map value and midpoint and their neighbours. The rounding is torchao's, op for op.
    """
    start = table[(x.view(torch.int32) >> 16) & 0xFFFF].int()
    after = (start + 1).clamp(max=255)
    codes = torch.where(x >= qmap[after], after, start)
    codes_up = (codes + 1).clip(max=255)
    val_down = qmap[codes]
    val_up = qmap[codes_up]
    residual = x - val_down
    codes = torch.where(residual >= (val_up - val_down) * 0.5, codes_up, codes)
    return codes.to(torch.uint8)


def _lowbit_kernel(p: Tensor, grad: Tensor, step: Tensor, m: _Parts, v: _Parts,
                   vmax: _Parts | None, lr: Tensor, beta1: float, beta2: float,
                   weight_decay: float, eps: float, grad_scale: Tensor | None,
                   stored: Tensor | None, flags: tuple[bool, bool, bool]) -> None:
    """torchao's `single_param_adam`, over the states' own tensors (compiled once per layout):
    the same operations in the same order, so the same bits."""
    decoupled, maximize, stochastic = flags
    p_f32 = p.float()
    grad_f32 = grad.float()
    if grad_scale is not None:
        grad_f32 = grad_f32 / grad_scale
    if maximize:
        grad_f32 = -grad_f32
    if decoupled:
        p_f32 = p_f32 - lr * weight_decay * p_f32
    else:
        grad_f32 = grad_f32 + weight_decay * p_f32
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    exp_avg_f32 = _read(m).lerp(grad_f32, 1 - beta1)
    exp_avg_sq_f32 = _read(v).lerp(grad_f32.square(), 1 - beta2)
    _write(m, exp_avg_f32)
    _write(v, exp_avg_sq_f32)
    if vmax is not None:
        max_f32 = torch.maximum(_read(vmax), exp_avg_sq_f32)
        _write(vmax, max_f32)
        denom = (max_f32.sqrt() / bias_correction2.sqrt()) + eps
    else:
        denom = (exp_avg_sq_f32.sqrt() / bias_correction2.sqrt()) + eps
    p_f32 = p_f32 - lr * (exp_avg_f32 / bias_correction1) / denom
    if stochastic:
        p.copy_(_AO["_fp32_to_bf16_sr"](p_f32))
    else:
        p.copy_(p_f32)
    if stored is not None:
        stored.copy_(p)


_compiled: list[Callable[..., None]] = []


def _kernel() -> Callable[..., None]:
    """The compiled step: one `torch.compile` whose graphs (one per layout: state formats,
    flags, dtypes) take every shape, the number of blocks being dynamic."""
    if not _compiled:
        _compiled.append(torch.compile(_lowbit_kernel, fullgraph=True))
    return _compiled[0]


@contextlib.contextmanager
def _any_number_of_layouts() -> Iterator[None]:
    # NOTE: dynamo caps the graphs kept per function (8 by default); a model has a fixed,
    # small number of layouts, each compiled once, so the cap only risks a silent fall-back
    # to an eager step (torchao lifts it around its own compiled step for the same reason).
    from torch._dynamo.utils import disable_cache_limit

    with disable_cache_limit():
        yield


def _dynamic(tensors: Sequence[Tensor | None]) -> None:
    """The number of blocks (rows) of each tensor is dynamic: one graph takes every shape (a
    qmap, the third tensor of a state, keeps its fixed size)."""
    for t in tensors:
        if t is not None:
            torch._dynamo.maybe_mark_dynamic(t, 0)


@torch.no_grad()
def lowbit_adam(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                exp_avg_sqs: Sequence[Tensor], max_exp_avg_sqs: Sequence[Tensor],
                steps: Sequence[Tensor], *, lr: float | Tensor, beta1: float, beta2: float,
                eps: float, weight_decay: float, decoupled: bool, maximize: bool = False,
                stored: Sequence[Tensor] | None = None, stochastic: bool = False,
                grad_scale: Tensor | None = None, found_inf: Tensor | None = None,
                compiled: bool = True) -> None:
    """torchao's Adam/AdamW update over low-bit (or any float) states, compiled once per
    layout (`compiled=False`: the same operations run eagerly): see the module's docstring."""
    _check(params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, steps=steps,
           max_exp_avg_sqs=max_exp_avg_sqs, stored=stored)
    if not params or (found_inf is not None and bool(found_inf.item())):
        return
    lr_t = lr if isinstance(lr, Tensor) else torch.tensor(lr, dtype=torch.float32)
    torch._foreach_add_(list(steps), 1)
    _load_torchao()
    flags = (decoupled, maximize)
    with _any_number_of_layouts():
        for i, p in enumerate(params):
            row = [p, grads[i], exp_avgs[i], exp_avg_sqs[i]] + (
                [max_exp_avg_sqs[i]] if max_exp_avg_sqs else []) + (
                [stored[i]] if stored else [])
            row = _local(row, [p] * len(row), "the tensors of params", [i] * len(row))
            _lowbit_one(i, row[0], row[1], steps[i], row[2:4 + bool(max_exp_avg_sqs)],
                        row[-1] if stored else None,
                        (lr_t, beta1, beta2, weight_decay, eps, grad_scale),
                        (*flags, stochastic and p.dtype == torch.bfloat16), compiled)


def _lowbit_one(i: int, p: Tensor, grad: Tensor, step: Tensor, states: list[Tensor],
                stored: Tensor | None, scalars: tuple[Any, ...], flags: tuple[bool, ...],
                compiled: bool) -> None:
    """One parameter's step: its tensors viewed as blocks, the number of blocks dynamic."""
    block = _block(states)
    if p.numel() % block:
        raise ValueError(f"params[{i}] has {p.numel()} elements, not a whole number of its "
                         f"states' blocks of {block}.")
    parts = [_parts(s, block) for s in states]
    # detached: a view of a parameter is traced with its base, and a parameter whose
    # `grad_dtype` is wider than it (grad=fp32) cannot be faked with its gradient
    flat = [None if t is None else _flat(t.detach(), f"{name}[{i}]").view(-1, block)
            if block > 1 else _flat(t.detach(), f"{name}[{i}]")
            for name, t in (("params", p), ("grads", grad), ("stored", stored))]
    kernel: Callable[..., None] = _lowbit_kernel
    if compiled:
        _dynamic([*flat, *(t for _, ts in parts for t in ts[:2])])
        kernel = _kernel()
    kernel(flat[0], flat[1], step, parts[0], parts[1], parts[2] if len(parts) > 2 else None,
              *scalars, flat[2], flags)
