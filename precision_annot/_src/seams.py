"""Where torch changed between the releases the package supports, in one place.

Each seam is keyed on the installed torch's version (`TORCH`), and the rest of the package
asks here instead of testing the version itself: `tests/test_seams.py` runs each branch on
the torch that takes it. The private torch names the package must still reach are listed in
`private.py`, beside the public mechanism considered for each.
"""

from __future__ import annotations

import re

import torch

__all__ = ["CHECKPOINT_GENERATOR", "CUDA_BFX9", "FLOOR", "FSDP2_GRAD_DTYPE",
           "FSDP2_KEEPS_PARAM_DTYPE", "FSDP2_REDUCES_IN_GRAD_DTYPE", "FSDP2_TP_REDUCE_DTYPE",
           "NEWEST",
           "QUEUE_CALLBACK_PUBLIC", "TORCH", "at_least", "fsdp2_default_reduce", "parse",
           "queue_callback", "tested"]


def parse(version: str) -> tuple[int, int, int]:
    """`"2.15.0+cu132"` -> `(2, 15, 0)`; pre-releases count as their release
    (`"2.16.0a0+git..."` -> `(2, 16, 0)`)."""
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if found is None:
        raise ValueError(f"not a torch version: {version!r}")
    major, minor, patch = found.groups()
    return int(major), int(minor), int(patch or 0)


#: the installed torch, (major, minor, patch)
TORCH = parse(torch.__version__)

#: the oldest torch the package supports (pyproject.toml's floor; test_seams checks they agree)
FLOOR = (2, 13, 0)

#: the newest torch the test suite ran on (the second lock, requirements/lock-latest.txt)
NEWEST = (2, 15, 0)


def tested() -> str:
    """The torch releases the package was tested on, for messages: "2.13 to 2.15"."""
    return f"{FLOOR[0]}.{FLOOR[1]} to {NEWEST[0]}.{NEWEST[1]}"


def at_least(major: int, minor: int) -> bool:
    """The installed torch is `major.minor` or newer."""
    return TORCH[:2] >= (major, minor)


#: the generator every non-reentrant `torch.utils.checkpoint` checkpoint starts through: torch
#: 2.14 moved the work to `..._impl` and left the old name as a wrapper that `checkpoint` no
#: longer calls (wrapping the old name there changed nothing, silently)
CHECKPOINT_GENERATOR = ("_checkpoint_without_reentrant_generator_impl" if at_least(2, 14)
                        else "_checkpoint_without_reentrant_generator")


# -- FSDP2 (torch.distributed.fsdp.fully_shard) ---------------------------------------------------

#: `MixedPrecisionPolicy(param_dtype_override_fn=...)`: chosen parameters of a unit are gathered
#: in their own (original) dtype, the rest in `param_dtype` (torch 2.15)
FSDP2_KEEPS_PARAM_DTYPE = at_least(2, 15)

#: FSDP2 keeps a parameter's `Tensor.grad_dtype`: bf16 weights with grad_dtype=fp32 get fp32
#: sharded gradients (pytorch issue 170648; 2.13 and 2.14 gave bf16)
FSDP2_GRAD_DTYPE = at_least(2, 15)

#: with `reduce_dtype=None`, gradients are reduced in each parameter's `grad_dtype` (unset: its
#: original dtype), no longer in `param_dtype` (torch 2.15; FSDP1 still uses `param_dtype`)
FSDP2_REDUCES_IN_GRAD_DTYPE = at_least(2, 15)

#: the tensor-parallel `Partial -> Replicate` all-reduce of a replicated parameter's gradient (a
#: sequence-parallel norm's weight) runs in the unit's reduce dtype, not the gradient's
#: (pytorch issue 190626, torch 2.15)
FSDP2_TP_REDUCE_DTYPE = at_least(2, 15)


def fsdp2_default_reduce(param_dtype: torch.dtype | None, stored: torch.dtype | None,
                         grad_dtype: torch.dtype | None = None) -> torch.dtype | None:
    """What FSDP2 reduces a unit's gradients in when its `reduce_dtype` is None: its
    `param_dtype` up to torch 2.14; from 2.15 the parameters' `grad_dtype`, else their original
    (stored) dtype."""
    if FSDP2_REDUCES_IN_GRAD_DTYPE:
        return grad_dtype or stored
    return param_dtype or stored


# -- autograd -------------------------------------------------------------------------------------

#: `torch.autograd.graph.queue_callback(callback)`: run `callback` when the running backward
#: ends, after the callbacks queued before it. Public from torch 2.15, whose function is the very
#: call made before it on autograd's engine (NOTE: private, `Variable._execution_engine`).
QUEUE_CALLBACK_PUBLIC = at_least(2, 15)
queue_callback = (torch.autograd.graph.queue_callback  # type: ignore[attr-defined,unused-ignore]
                  if QUEUE_CALLBACK_PUBLIC
                  else torch.autograd.Variable._execution_engine.queue_callback)


# -- GEMM arithmetic ------------------------------------------------------------------------------

#: `torch.backends.cuda.matmul.fp32_precision = "bfx9"`: fp32 GEMMs emulated with bf16 pieces
#: on CUDA (torch 2.15)
CUDA_BFX9 = at_least(2, 15)
