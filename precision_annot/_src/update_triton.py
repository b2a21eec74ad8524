"""The masters step in one pass on a GPU: Triton kernels for Adam/AdamW and SGD.

Why: torch's fused kernels take one dtype for all their tensors, so `update_kernels.adam` (the
fused route) widens a bf16 gradient into an fp32 scratch buffer before torch's fused step and
rounds the master into the bf16 weight after it: about 40 bytes moved per parameter where the
layout needs 28 (2 of gradient, 24 of master and moments, 2 of weight). These kernels read each
tensor as stored and write each as stored in one pass, over many tensors per launch (a table
of their addresses, as torch's `multi_tensor_apply` passes its lists).

The arithmetic is torch's CPU fused kernel's vectorised loop, operation for operation, in fp32
and rounded as IEEE says (no operation fused unless written as an fma; division and square
root correctly rounded), so on every element outside torch's scalar tail the masters, moments
and weights are the fused route's bits (tests/update/test_triton.py, under Triton's
interpreter). Per element, with `g` the gradient read in fp32, `p` what is updated:

- Adam/AdamW: `g = g / grad_scale`; `g = -g` (maximize); AdamW `p = p * f32(1 - lr*wd)`, Adam
  `g = fma(p, wd, g)`; `m = fma(c, g - m, m)` (or `fma(c - 1, g - m, g)` when `1 - beta1` is
  0.5 or more: torch's lerp); `v = fma(f32(1 - beta2) * g, g, v * beta2)`; amsgrad
  `vmax = maximum(vmax, v)`; `p = p + (f32(-lr / bc1) * m) / (sqrt(v or vmax) / f32(sqrt(bc2))
  + eps)`, the bias corrections `bc = 1 - beta**step` computed per tensor in double.
- SGD: `g = fma(p, wd, g)`; `b = fma(f32(1 - dampening), g, b * momentum)` (`b = g` on the
  first step); nesterov `g = fma(b, momentum, g)`, else `g = b`; `p = fma(g, f32(-lr), p)`.

Every value narrower than fp32 (a bf16 or fp16 gradient, moment or weight) is read exactly and
written rounded to nearest even (bf16: c10's rule, a NaN written as 0x7FC0); with
`stochastic=True` a bf16 weight is written with torchao's stochastic rounding
(`_fp32_to_bf16_sr`: away from zero when a uniform 16-bit integer is below the 16 bits dropped),
its integers the low 16 bits of Philox4x32-10 as `tl.randint(seed, t * 2**40 + j)` draws it for
element `j` of the launch's tensor `t` (torchao draws from torch's generator instead: the same
rule on another stream).

API (the same as `update_kernels.adam` / `update_kernels.sgd`, so that an engine calls either;
two more keywords):

- `adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, lr, beta1, beta2, eps,
  weight_decay, decoupled, amsgrad=False, maximize=False, stored=None, grad_scale=None,
  found_inf=None, chunk=None, cache=None, stochastic=False, seed=None)`
- `sgd(params, grads, momentum_buffers, *, lr, momentum=0.0, dampening=0.0, weight_decay=0.0,
  nesterov=False, maximize=False, stored=None, grad_scale=None, found_inf=None, chunk=None,
  cache=None, stochastic=False, seed=None)`

  The tensors whose device runs Triton here (CUDA on an NVIDIA GPU; the CPU while
  `TRITON_INTERPRET=1`, Triton's interpreter, for the tests) and that compute in fp32 (the
  widest of a parameter's tensors, as in `update_kernels`) are stepped here, one launch per
  device and dtypes; the others are handed to `update_kernels` with the same arguments. `chunk`
  is the elements one Triton program steps (a multiple of 64; default 4,096); `stochastic`
  rounds each bf16 weight written (the updated `params` where bf16, `stored` where bf16)
  stochastically; `seed` (an int) seeds that stream, drawn from torch's default CPU generator
  when None. A gradient is read, never written, but where torch's fused kernel writes it back
  unscaled (a `grad_scale` given and the gradient in fp32) it is written back unscaled too; a
  gradient narrower than fp32 may have any layout (copied where not contiguous). `found_inf`
  skips the step on the device, steps included (no host sync). `cache` is the fused route's
  (the launches keep their per-size tables themselves). Each step makes its tables of
  addresses and step sizes on the host and copies them to the device: not for CUDA graphs.
- `available(device)`: whether `adam` / `sgd` run Triton for parameters on `device` in a
  training run (an NVIDIA GPU, Triton importable, not interpreting, and not turned off by
  `PRECISION_ANNOT_TRITON=0`): with `checked`, the engines' choice (`update.engines`).
- `checked(device)`: whether the kernels computed the fused route's bits on `device`, asked
  once per device (memoized for the process; `adam` / `sgd` ask it for each GPU they step on,
  the engines before they call them): a canary, two Adam (AdamW) steps and two SGD
  steps (nesterov momentum) over a few tensors of odd sizes (bf16 weights and gradients, fp32
  masters and states), through the kernels on `device` and through `update_kernels` on CPU
  copies (torch's fused CPU kernel: the formula the kernels compute; torch's fused CUDA kernel
  computes another, see below), compared bit for bit outside the CPU's scalar tail and within
  16 ulps on it. Where anything differs, or the kernel raises, it warns once, saying what
  differed, and every later call for `device` takes the fused route.

`PRECISION_ANNOT_TRITON=0` in the environment (read at each call) turns the kernels off:
`available` says no, and `adam` / `sgd` hand every tensor on a GPU to `update_kernels`.

Where the bits can differ from the fused route: on torch's CPU scalar tail (the last
`numel % 8` elements of a tensor on AVX2, `% 16` on AVX-512) torch's compiler contracts
`v * beta2 + c * g * g` (SGD: `b * momentum + (1 - dampening) * g`) into an fma the other way;
there the moments differ by an ulp and the masters by a few after some steps (the tests bound
it). On a GPU the per-tensor bias corrections come from CUDA's double `pow`, which may differ
from glibc's in the last double bit, so in the fp32 step size at a rounding tie; not measured.
torch's fused CUDA kernel, the fused route on a GPU, computes another formula by its source
(`ATen/native/cuda/fused_adam_utils.cuh`: its first moment as `fma(beta1, m, fma(-beta1, g,
g))`, AdamW's decay as `p - lr * wd * p`, the bias corrections in fp32, the rest contracted
by nvcc), so it differs from these kernels, and from itself on a CPU, in last bits (how often:
not measured): the canary compares with the CPU's.
torchao's 8-bit states are not taken: their per-block scale and table search are a kernel of
their own (`update_kernels.lowbit_adam` serves them).
"""

from __future__ import annotations

import functools
import math
import os
import types
import warnings
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from precision_annot._src import update_kernels

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["CHUNK", "SWITCH", "adam", "available", "checked", "sgd"]

#: elements one Triton program steps, by default (`BLOCK` at a time)
CHUNK = 4096
#: elements one program loads at a time: 8 per thread of 4 warps, two 16-byte loads of fp32
BLOCK = 1024
_WARPS = 4
_ALIGN = 64
#: each dtype as the kernels read it (0: no such tensor)
_KIND = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
#: the Adam and SGD kernels' rows in the address table
_ADAM_ROLES = ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "stored",
               "steps")
_SGD_ROLES = ("params", "grads", "momentum_buffers", "stored")


# --- where the kernels run --------------------------------------------------------------------


#: the oldest Triton the kernels are checked against (3.8's interpreter computed other
#: numbers than torch's fused route on the same tensors: 16 of the interpreter tests failed)
MIN_TRITON = (3, 9)


@functools.cache
def _triton() -> Any:
    """Triton, or None where it does not import or is older than `MIN_TRITON` (then every
    call takes torch's fused route)."""
    try:
        import triton
    except ImportError:
        return None
    version = tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())
    return triton if version >= MIN_TRITON else None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


#: the environment variable that turns the kernels off where it says "0" (or "false", "off",
#: "no"): the engines then take the fused route on every device
SWITCH = "PRECISION_ANNOT_TRITON"

#: tests only: `available` says yes for the CPU while Triton's interpreter runs, so that the
#: engines take the kernels there (a training run never does: the interpreter is for tests)
_TEST_ONLY_INTERPRETED_CPU = False


def _switched_off() -> bool:
    return os.environ.get(SWITCH, "1").strip().lower() in ("0", "false", "off", "no")


def available(device: torch.device) -> bool:
    """Whether `adam` / `sgd` step parameters on `device` with Triton in a training run: an
    NVIDIA GPU where Triton imports, unless `PRECISION_ANNOT_TRITON=0` (under Triton's
    interpreter, only the CPU runs it, and only for the tests)."""
    if _switched_off():
        return False
    if device.type == "cpu":
        return _TEST_ONLY_INTERPRETED_CPU and _interpreting() and _triton() is not None
    return (device.type == "cuda" and torch.version.hip is None and not _interpreting()
            and torch.cuda.is_available() and _triton() is not None)


def _runs_on(device: torch.device) -> bool:
    """Whether this process launches the kernels on `device`: the CPU only when interpreting
    (for the tests; not where the canary found them wrong), a CUDA device only when not and
    once `checked` there (its first call runs the canary)."""
    if device.type == "cpu":
        return _VERDICTS.get(device) is not False and _interpreting() and _triton() is not None
    return available(device) and checked(device)


# --- the calls --------------------------------------------------------------------------------


@torch.no_grad()
def adam(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
         exp_avg_sqs: Sequence[Tensor], max_exp_avg_sqs: Sequence[Tensor],
         steps: Sequence[Tensor], *, lr: float | Tensor, beta1: float, beta2: float,
         eps: float, weight_decay: float, decoupled: bool, amsgrad: bool = False,
         maximize: bool = False, stored: Sequence[Tensor] | None = None,
         grad_scale: Tensor | None = None, found_inf: Tensor | None = None,
         chunk: int | None = None, cache: dict[str, Any] | None = None,
         stochastic: bool = False, seed: int | None = None) -> None:
    """One Adam (AdamW when `decoupled`) step, in one Triton pass where it runs: see the
    module's docstring."""
    update_kernels._check(params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs,
                          steps=steps, max_exp_avg_sqs=max_exp_avg_sqs if amsgrad else None,
                          stored=stored)
    if amsgrad and len(max_exp_avg_sqs) != len(params):
        raise ValueError(f"`max_exp_avg_sqs` must hold one tensor per parameter "
                         f"({len(params)}) when amsgrad=True; received {len(max_exp_avg_sqs)}.")
    per_program = _chunk(chunk)
    if not params:
        return
    lists: dict[str, Sequence[Tensor] | None] = {
        "params": params, "grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs,
        "max_exp_avg_sqs": max_exp_avg_sqs if amsgrad else None, "stored": stored,
        "steps": steps}
    groups, rest = _split(lists, stochastic)
    if rest:  # (the same call over them)
        update_kernels.adam(
            _pick(params, rest), _pick(grads, rest), _pick(exp_avgs, rest),
            _pick(exp_avg_sqs, rest), _pick(max_exp_avg_sqs if amsgrad else None, rest),
            _pick(steps, rest), lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, decoupled=decoupled, amsgrad=amsgrad, maximize=maximize,
            stored=_pick(stored, rest) or None, grad_scale=grad_scale, found_inf=found_inf,
            chunk=chunk, cache=cache)
    hyper = _AdamHyper(lr, beta1, beta2, eps, weight_decay, decoupled, maximize)
    for group in groups:
        _launch_adam(group, hyper, grad_scale, found_inf, per_program,
                     (stochastic, _seed(seed) if stochastic else 0))


@torch.no_grad()
def sgd(params: Sequence[Tensor], grads: Sequence[Tensor],
        momentum_buffers: list[Tensor | None], *, lr: float | Tensor, momentum: float = 0.0,
        dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
        maximize: bool = False, stored: Sequence[Tensor] | None = None,
        grad_scale: Tensor | None = None, found_inf: Tensor | None = None,
        chunk: int | None = None, cache: dict[str, Any] | None = None,
        stochastic: bool = False, seed: int | None = None) -> None:
    """One SGD step, in one Triton pass where it runs: see the module's docstring. On the
    first step with momentum (every buffer None) the buffers are made here, in the dtype of
    `params`, and put in `momentum_buffers`, as `torch.optim.SGD(fused=True)` does."""
    update_kernels._check(params, grads=grads,
                          momentum_buffers=momentum_buffers if momentum else None,
                          stored=stored)
    per_program = _chunk(chunk)
    if not params:
        return
    first = _first_momentum(momentum_buffers, momentum)
    lists: dict[str, Sequence[Any] | None] = {
        "params": params, "grads": grads,
        "momentum_buffers": momentum_buffers if momentum and not first else None,
        "stored": stored}
    groups, rest = _split(lists, stochastic)
    hyper = _SgdHyper(lr, momentum, dampening, weight_decay, nesterov, maximize, first)
    if rest:  # (the same call over them; their buffers, made there on a first step, kept)
        buffers: list[Tensor | None] = [momentum_buffers[i] for i in rest] if momentum else []
        update_kernels.sgd(_pick(params, rest), _pick(grads, rest), buffers, lr=lr,
                           momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                           nesterov=nesterov, maximize=maximize,
                           stored=_pick(stored, rest) or None, grad_scale=grad_scale,
                           found_inf=found_inf, chunk=chunk, cache=cache)
        for b, i in zip(buffers, rest, strict=False):
            momentum_buffers[i] = b
    for group in groups:
        if first:
            _new_buffers(group, params, momentum_buffers)
        _launch_sgd(group, hyper, grad_scale, found_inf, per_program,
                    (stochastic, _seed(seed) if stochastic else 0))


def _new_buffers(group: _Group, params: Sequence[Tensor],
                 momentum_buffers: list[Tensor | None]) -> None:
    """A first step's momentum buffers, made as torch's fused SGD makes them (DTensors where
    the parameters are), for the kernel to fill."""
    made = [torch.empty_like(params[i], memory_format=torch.contiguous_format)
            for i in group.index]
    for b, i in zip(made, group.index, strict=True):
        momentum_buffers[i] = b
    group.roles["momentum_buffers"] = [_local_of(b) for b in made]


def _chunk(chunk: int | None) -> int:
    if chunk is None:
        return CHUNK
    if chunk < _ALIGN or chunk % _ALIGN:
        raise ValueError(f"`chunk` must be a positive multiple of {_ALIGN} elements; "
                         f"received chunk={chunk}.")
    return chunk


def _seed(seed: int | None) -> int:
    if seed is None:
        return int(torch.randint(0, 1 << 62, (), dtype=torch.int64))
    if not 0 <= int(seed) < 1 << 63:
        raise ValueError(f"`seed` must be an integer in [0, 2**63); received seed={seed!r}.")
    return int(seed)


def _first_momentum(buffers: Sequence[Tensor | None], momentum: float) -> bool:
    """Whether this is the first step with momentum (every buffer None)."""
    if not momentum:
        return False
    held = sum(b is not None for b in buffers)
    if held and held != len(buffers):
        raise ValueError("`momentum_buffers` holds None for some parameters and a tensor for "
                         "others; torch's fused SGD starts every buffer at the same step.")
    return not held


def _pick(values: Sequence[Any] | None, index: list[int]) -> list[Any]:
    return [values[i] for i in index] if values else []


def _local_of(t: Tensor) -> Tensor:
    local = getattr(t, "to_local", None)
    return local() if local is not None else t


# --- the check on a device's first step -------------------------------------------------------

#: each device's verdict (`checked`): False sends every later call for it to the fused route
_VERDICTS: dict[torch.device, bool] = {}
#: the canary's tensors: two programs (4,096 elements and 64 more), two whole blocks and a part
#: of one, and sizes only torch's CPU scalar tail steps (37, 1), and none
_CANARY_SHAPES = ((4160,), (33, 64), (37,), (1,), (0,))
_CANARY_ADAM: dict[str, Any] = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
                                "weight_decay": 0.01, "decoupled": True}
_CANARY_SGD: dict[str, Any] = {"lr": 1e-2, "momentum": 0.9, "nesterov": True,
                               "weight_decay": 0.01}
#: how far an element of torch's CPU scalar tail (taken here as the last `numel % 64` elements:
#: the vector widths are 4 to 16) may be from the fused route, in ulps of the tail's largest
#: value (tests/update/test_triton.py's bound: 11 measured at most there)
_TAIL_ULPS = 16


def checked(device: torch.device) -> bool:
    """Whether the kernels step parameters on `device`, checked there once per process: the
    first call runs the canary (see the module's docstring); where the kernels computed other
    bits than the fused route, or raised, it warns once and answers False from then on."""
    verdict = _VERDICTS.get(device)
    if verdict is None:
        _VERDICTS[device] = True  # (while the canary runs: its own calls launch the kernels)
        try:
            problem = _canary(device)
        except BaseException:
            del _VERDICTS[device]
            raise
        verdict = _VERDICTS[device] = problem is None
        if problem is not None:
            warnings.warn(_fallback(device, problem), UserWarning, stacklevel=2)
    return verdict


def _canary(device: torch.device) -> str | None:
    """What differed between the kernels on `device` and the fused route on CPU copies, or
    None where nothing did."""
    try:
        return _canary_adam(device) or _canary_sgd(device)
    except Exception as e:  # (a compile or launch failure: the fused route steps instead)
        return f"the kernel raised {type(e).__name__}: {e}"


def _canary_tensors(device: torch.device) -> dict[str, Any]:
    """The canary's tensors on `device`: fp32 masters and states, bf16 weights, the bf16
    gradients of two steps (the same numbers on every device)."""
    g = torch.Generator().manual_seed(0)
    shapes = _CANARY_SHAPES
    masters = [torch.randn(s, generator=g) for s in shapes]
    grads = [[(torch.randn(s, generator=g) * 1e-2).bfloat16() for s in shapes]
             for _ in range(2)]
    states = [[torch.rand(s, generator=g) * 1e-4 for s in shapes] for _ in range(2)]

    def to(tensors: list[Tensor]) -> list[Tensor]:
        return [t.to(device, copy=True) for t in tensors]

    return {"params": to(masters), "stored": to([m.bfloat16() for m in masters]),
            "grads": [to(step) for step in grads], "exp_avgs": to(states[0]),
            "exp_avg_sqs": to(states[1]), "buffers": [None] * len(shapes),
            "steps": [torch.zeros((), device=device) for _ in shapes]}


def _canary_adam(device: torch.device) -> str | None:
    ours, ref = _canary_tensors(device), _canary_tensors(torch.device("cpu"))
    for side, step in ((ours, adam), (ref, update_kernels.adam)):
        for grads in side["grads"]:
            step(side["params"], grads, side["exp_avgs"], side["exp_avg_sqs"], [],
                 side["steps"], stored=side["stored"], **_CANARY_ADAM)
    return _compare("AdamW", ours, ref, ("params", "stored", "exp_avgs", "exp_avg_sqs",
                                          "steps"))


def _canary_sgd(device: torch.device) -> str | None:
    ours, ref = _canary_tensors(device), _canary_tensors(torch.device("cpu"))
    for side, step in ((ours, sgd), (ref, update_kernels.sgd)):
        for grads in side["grads"]:  # (the first makes the momentum buffers)
            step(side["params"], grads, side["buffers"], stored=side["stored"], **_CANARY_SGD)
    return _compare("SGD", ours, ref, ("params", "stored", "buffers"))


def _compare(family: str, ours: dict[str, Any], ref: dict[str, Any], roles: Sequence[str]
             ) -> str | None:
    for role in roles:
        for i, (a, b) in enumerate(zip(ours[role], ref[role], strict=True)):
            why = _difference(a, b)
            if why is not None:
                return (f"{family}'s {role}[{i}] (shape {tuple(b.shape)}, {b.dtype}) "
                        f"{why}")
    return None


def _difference(ours: Tensor, ref: Tensor) -> str | None:
    """How `ours` differs from `ref`: bits outside torch's CPU scalar tail, more than
    `_TAIL_ULPS` on it; None where it does not."""
    a, b = ours.detach().to("cpu").reshape(-1), ref.detach().reshape(-1)
    if a.dtype != b.dtype or a.numel() != b.numel():
        return f"came back as {a.numel()} elements of {a.dtype}"
    n = a.numel()
    body = n - n % _ALIGN
    wide = torch.int16 if a.element_size() == 2 else torch.int32
    differ = (a.view(wide) != b.view(wide)) & ~(a.isnan() & b.isnan())
    bad = differ[:body].nonzero().reshape(-1)
    if bad.numel():
        k = int(bad[0])
        return (f"differs in {bad.numel()} of its first {body} elements, the first at [{k}]: "
                f"{a[k].item()!r} against {b[k].item()!r}")
    if body < n:
        gap = float((a[body:].double() - b[body:].double()).abs().max())
        step = _ulp(b[body:].abs().max())
        if not gap <= _TAIL_ULPS * step:
            return (f"differs on its last {n - body} elements (torch's scalar tail) by "
                    f"{gap / step:.3g} ulps, where at most {_TAIL_ULPS} are expected")
    return None


def _ulp(x: Tensor) -> float:
    """The gap from `x` (not negative) to the next value of its dtype."""
    a = x.reshape(1)
    wide = torch.int16 if a.element_size() == 2 else torch.int32
    return float((a.view(wide) + 1).view(a.dtype).double() - a.double())


def _fallback(device: torch.device, problem: str) -> str:
    """The warning for a device whose check failed: what differed, and how to report it."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    triton = _triton()
    versions = (f"torch {torch.__version__}, triton {getattr(triton, '__version__', None)}"
                + (f", CUDA {torch.version.cuda}" if torch.version.cuda else ""))
    return (f"precision_annot: the Triton masters step failed its check on {device} ({name}; "
            f"{versions}) against torch's fused step over the same tensors on the CPU: "
            f"{problem}. The optimizer steps through torch's fused kernels on {device} for the "
            f"rest of this process, as with {SWITCH}=0 (which skips this check). This is a bug "
            f"in precision_annot's kernel, not in your run: please report this message, with "
            f"the versions above, to precision_annot's issue tracker.")


# --- grouping: one launch per device and dtypes -----------------------------------------------


class _Group:
    """The tensors of one launch by role (local shards where DTensors), the parameters'
    indices in the call, and their dtypes by role (None: no such role)."""

    def __init__(self, device: torch.device, index: list[int],
                 roles: dict[str, list[Any]]) -> None:
        self.device = device
        self.index = index
        self.roles = roles

    def kind(self, role: str) -> int:
        tensors = self.roles.get(role)
        return _KIND[tensors[0].dtype] if tensors else 0


def _split(lists: dict[str, Sequence[Any] | None], stochastic: bool
           ) -> tuple[list[_Group], list[int]]:
    """The launches (parameters whose device runs Triton here and whose tensors compute in
    fp32, by device and dtypes) and the indices left to the fused route."""
    params = list(lists["params"] or [])
    local = _locals(lists, params)
    keys: dict[tuple[Any, ...], list[int]] = {}
    rest: list[int] = []
    runs: dict[torch.device, bool] = {}
    for i, p in enumerate(params):
        dtypes = tuple(None if not local[r] else local[r][i].dtype for r in local
                       if r != "steps")
        device = p.device
        here = runs.get(device)
        if here is None:
            here = runs[device] = _runs_on(device)
        if here and _takes(dtypes):
            keys.setdefault((p.device, dtypes), []).append(i)
        else:
            rest.append(i)
    if rest and stochastic:
        p = params[rest[0]]
        raise ValueError(f"stochastic=True rounds in the Triton kernel, which steps fp32 "
                         f"computations on an NVIDIA GPU; received params[{rest[0]}] of dtype "
                         f"{p.dtype} on {p.device}, which the fused route steps.")
    groups = []
    for (device, _), index in keys.items():
        roles = {r: [tensors[i] for i in index] for r, tensors in local.items() if tensors}
        groups.append(_Group(device, index, _checked(roles, index)))
    return groups, rest


def _takes(dtypes: tuple[torch.dtype | None, ...]) -> bool:
    """Whether a parameter with these dtypes (params, grads, states, stored) computes in fp32
    with tensors the kernels read (fp32, bf16, fp16)."""
    present = [d for d in dtypes if d is not None]
    if any(d not in _KIND for d in present):
        return False
    compute = present[0]
    for d in dtypes[:-1]:  # (all but `stored`, as `update_kernels` promotes)
        if d is not None:
            compute = torch.promote_types(compute, d)
    return compute == torch.float32


def _locals(lists: dict[str, Sequence[Any] | None], params: list[Tensor]
            ) -> dict[str, list[Any]]:
    """Each role's tensors, a DTensor's local shard for each (placed as its parameter is)."""
    out = {r: list(tensors) if tensors else [] for r, tensors in lists.items()}
    if not update_kernels._distributed(params):
        return out
    index = list(range(len(params)))
    return {r: (tensors if r == "steps" or not tensors
                else update_kernels._local(tensors, params, r, index))
            for r, tensors in out.items()}


def _checked(roles: dict[str, list[Any]], index: list[int]) -> dict[str, list[Any]]:
    """The roles, checked as the kernels read them: each tensor of a parameter on its device
    with its number of elements, contiguous (as `update_kernels` takes them: a gradient narrower
    than fp32 is copied where it is not, as the fused route widens it)."""
    params = roles["params"]
    for role, tensors in roles.items():
        for k, t in enumerate(tensors):
            p = params[k]
            if role == "steps":
                if t.numel() != 1:
                    raise ValueError(f"steps[{index[k]}] must hold one element; received "
                                     f"shape {tuple(t.shape)}.")
                continue
            if t.device != p.device or t.numel() != p.numel():
                raise ValueError(f"{role}[{index[k]}] must be on the device of params"
                                 f"[{index[k]}] ({p.device}) with its {p.numel()} elements; "
                                 f"received {t.numel()} elements on {t.device}.")
            if not t.is_contiguous():
                if role != "grads" or t.dtype == torch.float32:  # (read as stored)
                    update_kernels._flat(t, f"{role}[{index[k]}]")
                tensors[k] = t.contiguous()  # (a narrower gradient is only read)
    return roles


# --- the launches -----------------------------------------------------------------------------


class _AdamHyper:
    def __init__(self, lr: float | Tensor, beta1: float, beta2: float, eps: float,
                 weight_decay: float, decoupled: bool, maximize: bool) -> None:
        self.lr = lr
        self.beta1 = float(beta1)
        self.beta2 = float(beta2)
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.decoupled = decoupled
        self.maximize = maximize


class _SgdHyper:
    def __init__(self, lr: float | Tensor, momentum: float, dampening: float,
                 weight_decay: float, nesterov: bool, maximize: bool, first: bool) -> None:
        self.lr = lr
        self.momentum = float(momentum)
        self.dampening = float(dampening)
        self.weight_decay = float(weight_decay)
        self.nesterov = nesterov
        self.maximize = maximize
        self.first = first


def _f32(x: float) -> float:
    """`x` rounded to the nearest float32 (as C++'s `float(x)` rounds a double)."""
    return array("f", [x])[0]


def _to(t: Tensor, device: torch.device) -> Tensor:
    """A host-made table on `device`, copied without a sync."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


_TABLES: dict[tuple[Any, ...], tuple[Tensor, Tensor, int]] = {}


def _tables(numels: tuple[int, ...], per_program: int, device: torch.device
            ) -> tuple[Tensor, Tensor, int]:
    """Each tensor's number of elements, and each program's (tensor, chunk of it) as int32
    pairs (a 0-size tensor gets one program: its step count moves), and how many programs.
    Made once per list of sizes (the last 16 kept)."""
    key = (numels, per_program, device)
    held = _TABLES.get(key)
    if held is None:
        sizes = torch.tensor(numels, dtype=torch.int64)
        counts = torch.clamp((sizes + per_program - 1) // per_program, min=1)
        owner = torch.repeat_interleave(torch.arange(len(numels)), counts)
        starts = torch.cumsum(counts, 0) - counts
        chunk = torch.arange(int(counts.sum())) - torch.repeat_interleave(starts, counts)
        programs = torch.stack([owner, chunk], 1).to(torch.int32).reshape(-1)
        if len(_TABLES) >= 16:
            _TABLES.clear()
        held = _TABLES[key] = (_to(sizes, device), _to(programs, device), owner.numel())
    return held


def _addresses(group: _Group, roles: Sequence[str]) -> tuple[Tensor, bool]:
    """The address of each role's tensors, role after role (0 for a role absent), and whether
    every address is 16-byte aligned (then the kernel loads 16 bytes at a time)."""
    n = len(group.index)
    out = array("q")
    for role in roles:
        tensors = group.roles.get(role)
        out.extend([t.data_ptr() for t in tensors] if tensors else [0] * n)
    aligned = all(a % 16 == 0 for a in out)
    return _to(torch.frombuffer(out, dtype=torch.int64).clone(), group.device), aligned


def _scalar(t: Tensor | None, device: torch.device, dummy: Tensor) -> Tensor:
    """A scalar tensor on `device` for the kernel to read (`dummy`, never read, where None)."""
    return dummy if t is None else t.to(device, non_blocking=True)


def _launch(kernel: Any, programs: int, args: list[Any], constants: dict[str, Any],
            per_program: int) -> None:
    block = min(BLOCK, per_program & -per_program)
    kernel[(programs,)](*args, **constants, BLOCK=block, ITERS=per_program // block,
                        num_warps=_WARPS, enable_fp_fusion=False)


def _adam_table(steps: list[Tensor], hyper: _AdamHyper, device: torch.device) -> Tensor:
    """Per tensor, as float32: `-lr / bc1`, `sqrt(bc2)` and `1 - lr * weight_decay`, for the
    step count this step reaches, computed in double as torch's fused kernels compute them:
    on the host where the counts are (no sync), else on their device."""
    if all(s.device.type == "cpu" for s in steps):
        return _to(_host_table(steps, hyper), device)
    return _device_table(steps, hyper, device)


def _host_table(steps: list[Tensor], hyper: _AdamHyper) -> Tensor:
    lr = float(hyper.lr)
    rows = array("f")
    for s in steps:
        count = _f32(float(s) + 1.0)
        rows.extend([-(lr / (1 - hyper.beta1 ** count)), math.sqrt(1 - hyper.beta2 ** count),
                     1 - lr * hyper.weight_decay])
    return torch.frombuffer(rows, dtype=torch.float32).clone()


def _device_table(steps: list[Tensor], hyper: _AdamHyper, device: torch.device) -> Tensor:
    count = (torch.stack([s.to(device).reshape(()) for s in steps]).float() + 1).double()
    lr = (hyper.lr.to(device, torch.float64) if isinstance(hyper.lr, Tensor)
          else torch.tensor(hyper.lr, dtype=torch.float64, device=device))
    step_size = -(lr / (1 - torch.pow(hyper.beta1, count)))
    root = torch.sqrt(1 - torch.pow(hyper.beta2, count))
    decay = (1 - lr * hyper.weight_decay).expand_as(root)
    return torch.stack([step_size, root, decay], 1).float().reshape(-1)


def _launch_adam(group: _Group, hyper: _AdamHyper, grad_scale: Tensor | None,
                 found_inf: Tensor | None, per_program: int, rounding: tuple[bool, int]
                 ) -> None:
    params = group.roles["params"]
    steps = group.roles["steps"]
    device = group.device
    counted = all(s.device == device for s in steps)  # by the kernel, else here after it
    sizes, programs, count = _tables(tuple(p.numel() for p in params), per_program, device)
    table = _adam_table(steps, hyper, device)
    addrs, aligned = _addresses(group, _ADAM_ROLES if counted else _ADAM_ROLES[:-1])
    c1 = 1 - hyper.beta1
    from_grad = abs(_f32(c1)) >= 0.5  # torch's lerp: from the end nearer its weight
    consts = torch.tensor([hyper.beta2, _f32(c1) - 1 if from_grad else c1, 1 - hyper.beta2,
                           hyper.eps, hyper.weight_decay], dtype=torch.float32)
    kinds = {name: group.kind(role) for name, role in zip("PGMVXS", _ADAM_ROLES, strict=False)}
    _launch(_kernels(_interpreting())["_adam_kernel"], count,
            [programs, addrs, sizes, table, _to(consts, device),
             _scalar(grad_scale, device, sizes), _scalar(found_inf, device, sizes),
             len(params), rounding[1]],
            {**kinds, "DECOUPLED": hyper.decoupled, "MAXIMIZE": hyper.maximize,
             "HAS_WD": hyper.weight_decay != 0, "FROM_GRAD": from_grad,
             **_common(group, grad_scale, found_inf, rounding[0], aligned), "COUNT": counted},
            per_program)
    if not counted:  # (steps kept on another device than their parameters)
        for s in steps:
            s.add_(1 if found_inf is None else 1 - found_inf.to(s.device))


def _common(group: _Group, grad_scale: Tensor | None, found_inf: Tensor | None,
            stochastic: bool, aligned: bool) -> dict[str, bool]:
    return {"HAS_SCALE": grad_scale is not None, "HAS_INF": found_inf is not None,
            "WRITE_GRAD": grad_scale is not None and group.kind("grads") == 1,
            "STOCHASTIC": stochastic, "ALIGNED": aligned}


def _launch_sgd(group: _Group, hyper: _SgdHyper, grad_scale: Tensor | None,
                found_inf: Tensor | None, per_program: int, rounding: tuple[bool, int]
                ) -> None:
    params = group.roles["params"]
    device = group.device
    sizes, programs, count = _tables(tuple(p.numel() for p in params), per_program, device)
    addrs, aligned = _addresses(group, _SGD_ROLES)
    lr = hyper.lr
    consts = torch.tensor([hyper.weight_decay, hyper.momentum, 1 - hyper.dampening,
                           0.0 if isinstance(lr, Tensor) else -lr], dtype=torch.float32)
    consts = _to(consts, device)
    if isinstance(lr, Tensor):  # (on the device: no sync)
        consts[3:].copy_(-lr.reshape(1))
    kinds = {name: group.kind(role) for name, role in zip("PGBS", _SGD_ROLES, strict=True)}
    _launch(_kernels(_interpreting())["_sgd_kernel"], count,
            [programs, addrs, sizes, consts, _scalar(grad_scale, device, sizes),
             _scalar(found_inf, device, sizes), len(params), rounding[1]],
            {**kinds, "MAXIMIZE": hyper.maximize, "HAS_WD": hyper.weight_decay != 0,
             "FIRST": hyper.first, "NESTEROV": hyper.nesterov,
             **_common(group, grad_scale, found_inf, rounding[0], aligned)}, per_program)


# --- the kernels: plain functions, made Triton's by `_kernels` --------------------------------
# A bf16 tensor is read and written as its int16 bits: Triton's interpreter converts bf16 by
# truncation, so the kernels widen (exact) and round (to nearest even) with integer operations,
# which a GPU runs as fast and which give the same bits everywhere.


def _pointer(addrs: tl.tensor, row: tl.constexpr, n: tl.tensor, t: tl.tensor,
             KIND: tl.constexpr, ALIGNED: tl.constexpr) -> tl.tensor:
    """Tensor `t`'s address in `row` of the table, as a pointer to what the kernel reads."""
    address = tl.load(addrs + row * n + t)
    if KIND == 2:
        ptr = address.to(tl.pointer_type(tl.int16))
    elif KIND == 3:
        ptr = address.to(tl.pointer_type(tl.float16))
    else:
        ptr = address.to(tl.pointer_type(tl.float32))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


def _load(ptr: tl.tensor, offs: tl.tensor, mask: tl.tensor, KIND: tl.constexpr,
          MASKED: tl.constexpr) -> tl.tensor:
    """Elements as fp32 (exact from bf16 and fp16)."""
    raw = tl.load(ptr + offs, mask=mask, other=0) if MASKED else tl.load(ptr + offs)
    if KIND == 2:
        out = (raw.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32,
                                                                        bitcast=True)
    else:
        out = raw.to(tl.float32)
    return out


def _bf16_bits(x: tl.tensor) -> tl.tensor:
    """fp32 to bf16 rounded to nearest even, as int16 bits (c10's rule: a NaN is 0x7FC0)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.int16, bitcast=True)


def _draw(seed: tl.tensor, counter: tl.tensor) -> tl.tensor:
    """`tl.randint(seed, counter) & 0xFFFF`: Philox4x32-10 with Triton's constants, written out
    (Triton's own is a Triton function, which its interpreter runs only when it was imported
    interpreting)."""
    c0 = counter.to(tl.uint32)
    c1 = (counter >> 32).to(tl.uint32)
    c2 = c0 * 0
    c3 = c2
    wide = seed.to(tl.uint64)
    k0 = (wide & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((wide >> 32) & 0xFFFFFFFF).to(tl.uint32)
    for _ in tl.static_range(10):
        a0 = c0
        a2 = c2
        c0 = tl.umulhi(a2, 0xCD9E8D57) ^ c1 ^ k0
        c2 = tl.umulhi(a0, 0xD2511F53) ^ c3 ^ k1
        c1 = a2 * 0xCD9E8D57
        c3 = a0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0 & 0xFFFF


def _bf16_stochastic(x: tl.tensor, seed: tl.tensor, counter: tl.tensor) -> tl.tensor:
    """fp32 to bf16 with torchao's stochastic rounding, as int16 bits: away from zero when a
    uniform 16-bit integer is below the 16 bits dropped."""
    bits = x.to(tl.uint32, bitcast=True)
    draw = _draw(seed, counter)
    kept = (bits >> 16) + tl.where(draw < (bits & 0xFFFF), 1, 0)
    wide = (kept << 16).to(tl.float32, bitcast=True)
    kept = tl.where(wide != wide, 0x7FC0, kept)
    return kept.to(tl.uint16).to(tl.int16, bitcast=True)


def _put(ptr: tl.tensor, offs: tl.tensor, mask: tl.tensor, out: tl.tensor,
         MASKED: tl.constexpr) -> None:
    if MASKED:
        tl.store(ptr + offs, out, mask=mask)
    else:
        tl.store(ptr + offs, out)


def _store(ptr: tl.tensor, offs: tl.tensor, mask: tl.tensor, x: tl.tensor,
           KIND: tl.constexpr, MASKED: tl.constexpr) -> None:
    """fp32 values into the tensor's dtype, rounded to nearest even."""
    if KIND == 2:
        _put(ptr, offs, mask, _bf16_bits(x), MASKED)
    else:
        _put(ptr, offs, mask, x.to(ptr.dtype.element_ty), MASKED)


def _weight(p_ptr: tl.tensor, s_ptr: tl.tensor, offs: tl.tensor, mask: tl.tensor,
            x: tl.tensor, seed: tl.tensor, t: tl.tensor, P: tl.constexpr, S: tl.constexpr,
            STOCHASTIC: tl.constexpr, MASKED: tl.constexpr) -> None:
    """The updated value into what is updated (`params`) and its stored copy, each in its
    dtype: a bf16 one stochastically where asked (the copy of a bf16 value is exact)."""
    counter = (t.to(tl.int64) << 40) + offs
    if P == 2 and STOCHASTIC:
        bits = _bf16_stochastic(x, seed, counter)
        _put(p_ptr, offs, mask, bits, MASKED)
        x = (bits.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32,
                                                                       bitcast=True)
    else:
        _store(p_ptr, offs, mask, x, P, MASKED)
        if P != 1:
            x = _load(p_ptr, offs, mask, P, MASKED)
    if S == 2 and STOCHASTIC and P == 1:
        _put(s_ptr, offs, mask, _bf16_stochastic(x, seed, counter), MASKED)
    elif S != 0:
        _store(s_ptr, offs, mask, x, S, MASKED)


def _grad(g_ptr: tl.tensor, offs: tl.tensor, mask: tl.tensor, scale: tl.tensor,
          G: tl.constexpr, HAS_SCALE: tl.constexpr, WRITE_GRAD: tl.constexpr,
          MAXIMIZE: tl.constexpr, MASKED: tl.constexpr) -> tl.tensor:
    """The gradient in fp32, unscaled (written back unscaled where fp32) and negated where
    maximizing."""
    g = _load(g_ptr, offs, mask, G, MASKED)
    if HAS_SCALE:
        g = tl.div_rn(g, scale)
        if WRITE_GRAD:
            _store(g_ptr, offs, mask, g, G, MASKED)
    if MAXIMIZE:
        g = -g
    return g


def _program(chunks: tl.tensor, numels: tl.tensor, scale_ptr: tl.tensor, inf_ptr: tl.tensor,
             HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr, PER_PROGRAM: tl.constexpr
             ) -> tl.tensor:
    """This program's tensor, its first element, the tensor's size (-1 when `found_inf`
    says the step is skipped: no element is then stepped) and the gradient scale."""
    pid = tl.program_id(0)
    t = tl.load(chunks + 2 * pid)
    first = tl.load(chunks + 2 * pid + 1).to(tl.int64) * PER_PROGRAM
    numel = tl.load(numels + t)
    if HAS_INF:
        numel = tl.where(tl.load(inf_ptr) == 0, numel, -1)
    scale = 1.0
    if HAS_SCALE:
        scale = tl.load(scale_ptr)
    return t, first, numel, scale


def _adam_block(p_ptr: tl.tensor, g_ptr: tl.tensor, m_ptr: tl.tensor, v_ptr: tl.tensor,
                x_ptr: tl.tensor, s_ptr: tl.tensor, offs: tl.tensor, mask: tl.tensor,
                consts: tl.tensor, rows: tl.tensor, scale: tl.tensor, seed: tl.tensor,
                t: tl.tensor, P: tl.constexpr, G: tl.constexpr, M: tl.constexpr,
                V: tl.constexpr, X: tl.constexpr, S: tl.constexpr, DECOUPLED: tl.constexpr,
                MAXIMIZE: tl.constexpr, HAS_WD: tl.constexpr, FROM_GRAD: tl.constexpr,
                HAS_SCALE: tl.constexpr, WRITE_GRAD: tl.constexpr, STOCHASTIC: tl.constexpr,
                MASKED: tl.constexpr) -> None:
    """One block of Adam: torch's fused CPU kernel's vectorised loop, in its order."""
    g = _grad(g_ptr, offs, mask, scale, G, HAS_SCALE, WRITE_GRAD, MAXIMIZE, MASKED)
    p = _load(p_ptr, offs, mask, P, MASKED)
    if HAS_WD:
        if DECOUPLED:
            p = p * tl.load(rows + 2)
        else:
            g = tl.fma(p, tl.load(consts + 4), g)
    m = _load(m_ptr, offs, mask, M, MASKED)
    if FROM_GRAD:
        m = tl.fma(tl.load(consts + 1), g - m, g)
    else:
        m = tl.fma(tl.load(consts + 1), g - m, m)
    v = _load(v_ptr, offs, mask, V, MASKED)
    v = tl.fma(tl.load(consts + 2) * g, g, v * tl.load(consts))
    _store(m_ptr, offs, mask, m, M, MASKED)
    _store(v_ptr, offs, mask, v, V, MASKED)
    if X != 0:
        v = tl.maximum(_load(x_ptr, offs, mask, X, MASKED), v,
                       propagate_nan=tl.PropagateNan.ALL)
        _store(x_ptr, offs, mask, v, X, MASKED)
    denom = tl.div_rn(tl.sqrt_rn(v), tl.load(rows + 1)) + tl.load(consts + 3)
    p = p + tl.div_rn(tl.load(rows) * m, denom)
    _weight(p_ptr, s_ptr, offs, mask, p, seed, t, P, S, STOCHASTIC, MASKED)


def _adam_kernel(chunks: tl.tensor, addrs: tl.tensor, numels: tl.tensor, table: tl.tensor,
                 consts: tl.tensor, scale_ptr: tl.tensor, inf_ptr: tl.tensor, n: tl.tensor,
                 seed: tl.tensor, P: tl.constexpr, G: tl.constexpr, M: tl.constexpr,
                 V: tl.constexpr, X: tl.constexpr, S: tl.constexpr, DECOUPLED: tl.constexpr,
                 MAXIMIZE: tl.constexpr, HAS_WD: tl.constexpr, FROM_GRAD: tl.constexpr,
                 HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr, WRITE_GRAD: tl.constexpr,
                 STOCHASTIC: tl.constexpr, ALIGNED: tl.constexpr, COUNT: tl.constexpr,
                 BLOCK: tl.constexpr, ITERS: tl.constexpr) -> None:
    """Adam/AdamW over one program's chunk of one tensor (`_adam_block` a block at a time:
    unmasked, 16-byte loads, where the block is whole)."""
    t, first, numel, scale = _program(chunks, numels, scale_ptr, inf_ptr, HAS_SCALE,
                                      HAS_INF, BLOCK * ITERS)
    if COUNT:  # the tensor's first program counts its step (none where found_inf)
        step = tl.load(addrs + 6 * n + t).to(tl.pointer_type(tl.float32))
        tl.store(step, tl.load(step) + tl.where(numel < 0, 0.0, 1.0), mask=first == 0)
    p_ptr = _pointer(addrs, 0, n, t, P, ALIGNED)
    g_ptr = _pointer(addrs, 1, n, t, G, ALIGNED)
    m_ptr = _pointer(addrs, 2, n, t, M, ALIGNED)
    v_ptr = _pointer(addrs, 3, n, t, V, ALIGNED)
    x_ptr = _pointer(addrs, 4, n, t, X, ALIGNED)
    s_ptr = _pointer(addrs, 5, n, t, S, ALIGNED)
    for i in tl.range(ITERS):
        offs = first + i * BLOCK + tl.arange(0, BLOCK)
        if first + (i + 1) * BLOCK <= numel:
            _adam_block(p_ptr, g_ptr, m_ptr, v_ptr, x_ptr, s_ptr, offs, offs < numel, consts,
                        table + 3 * t, scale, seed, t, P, G, M, V, X, S, DECOUPLED, MAXIMIZE,
                        HAS_WD, FROM_GRAD, HAS_SCALE, WRITE_GRAD, STOCHASTIC, False)
        else:
            _adam_block(p_ptr, g_ptr, m_ptr, v_ptr, x_ptr, s_ptr, offs, offs < numel, consts,
                        table + 3 * t, scale, seed, t, P, G, M, V, X, S, DECOUPLED, MAXIMIZE,
                        HAS_WD, FROM_GRAD, HAS_SCALE, WRITE_GRAD, STOCHASTIC, True)


def _sgd_block(p_ptr: tl.tensor, g_ptr: tl.tensor, b_ptr: tl.tensor, s_ptr: tl.tensor,
               offs: tl.tensor, mask: tl.tensor, consts: tl.tensor, scale: tl.tensor,
               seed: tl.tensor, t: tl.tensor, P: tl.constexpr, G: tl.constexpr,
               B: tl.constexpr, S: tl.constexpr, MAXIMIZE: tl.constexpr,
               HAS_WD: tl.constexpr, FIRST: tl.constexpr, NESTEROV: tl.constexpr,
               HAS_SCALE: tl.constexpr, WRITE_GRAD: tl.constexpr, STOCHASTIC: tl.constexpr,
               MASKED: tl.constexpr) -> None:
    """One block of SGD: torch's fused CPU kernel's vectorised loop, in its order."""
    g = _grad(g_ptr, offs, mask, scale, G, HAS_SCALE, WRITE_GRAD, MAXIMIZE, MASKED)
    p = _load(p_ptr, offs, mask, P, MASKED)
    if HAS_WD:
        g = tl.fma(p, tl.load(consts), g)
    if B != 0:
        if FIRST:
            b = g
        else:
            b = tl.fma(tl.load(consts + 2), g, _load(b_ptr, offs, mask, B, MASKED)
                       * tl.load(consts + 1))
        _store(b_ptr, offs, mask, b, B, MASKED)
        g = tl.fma(b, tl.load(consts + 1), g) if NESTEROV else b
    p = tl.fma(g, tl.load(consts + 3), p)
    _weight(p_ptr, s_ptr, offs, mask, p, seed, t, P, S, STOCHASTIC, MASKED)


def _sgd_kernel(chunks: tl.tensor, addrs: tl.tensor, numels: tl.tensor, consts: tl.tensor,
                scale_ptr: tl.tensor, inf_ptr: tl.tensor, n: tl.tensor, seed: tl.tensor,
                P: tl.constexpr, G: tl.constexpr, B: tl.constexpr, S: tl.constexpr,
                MAXIMIZE: tl.constexpr, HAS_WD: tl.constexpr, FIRST: tl.constexpr,
                NESTEROV: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr,
                WRITE_GRAD: tl.constexpr, STOCHASTIC: tl.constexpr, ALIGNED: tl.constexpr,
                BLOCK: tl.constexpr, ITERS: tl.constexpr) -> None:
    """SGD over one program's chunk of one tensor (`_sgd_block` a block at a time)."""
    t, first, numel, scale = _program(chunks, numels, scale_ptr, inf_ptr, HAS_SCALE,
                                      HAS_INF, BLOCK * ITERS)
    p_ptr = _pointer(addrs, 0, n, t, P, ALIGNED)
    g_ptr = _pointer(addrs, 1, n, t, G, ALIGNED)
    b_ptr = _pointer(addrs, 2, n, t, B, ALIGNED)
    s_ptr = _pointer(addrs, 3, n, t, S, ALIGNED)
    for i in tl.range(ITERS):
        offs = first + i * BLOCK + tl.arange(0, BLOCK)
        if first + (i + 1) * BLOCK <= numel:
            _sgd_block(p_ptr, g_ptr, b_ptr, s_ptr, offs, offs < numel, consts, scale, seed, t,
                       P, G, B, S, MAXIMIZE, HAS_WD, FIRST, NESTEROV, HAS_SCALE, WRITE_GRAD,
                       STOCHASTIC, False)
        else:
            _sgd_block(p_ptr, g_ptr, b_ptr, s_ptr, offs, offs < numel, consts, scale, seed, t,
                       P, G, B, S, MAXIMIZE, HAS_WD, FIRST, NESTEROV, HAS_SCALE, WRITE_GRAD,
                       STOCHASTIC, True)


_JITTED = ("_pointer", "_load", "_bf16_bits", "_draw", "_bf16_stochastic", "_put", "_store",
           "_weight", "_grad", "_program", "_adam_block", "_adam_kernel", "_sgd_block",
           "_sgd_kernel")


@functools.cache
def _kernels(interpret: bool) -> dict[str, Any]:
    """The functions above as Triton's, in a namespace of their own: compiled, or run by the
    interpreter (Triton decides which when it decorates, from TRITON_INTERPRET), so that both
    may live in one process."""
    triton = _triton()
    if triton is None:
        raise ImportError("the Triton update kernels need `triton` (it comes with CUDA builds "
                          "of torch; `pip install triton`).")
    import triton.language as language

    assert interpret == _interpreting()
    space: dict[str, Any] = {**globals(), "tl": language}
    for name in _JITTED:
        fn = globals()[name]
        space[name] = types.FunctionType(fn.__code__, space, name, fn.__defaults__)
    for name in _JITTED:
        kernel = name.endswith("_kernel")
        if kernel or not interpret:  # (the interpreter calls plain helpers: it patches
            # `tl` once a launch, where it would again at each call of a Triton function)
            space[name] = triton.jit(space[name], do_not_specialize=(
                ["n", "seed"] if kernel else None))
    return space
