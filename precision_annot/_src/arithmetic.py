"""The arithmetic of a Linear's GEMMs, in both passes: what `output` wider than `compute`, the
`backward` field and emulated fp32 (`compute="bf16x9"`, `"bf16x3"`) mean.

A plan used to say only dtypes: `compute=bf16,output=fp32` computed the GEMM in bf16, rounded
its result to bf16, then widened it, no better than bf16. A bf16 x bf16 product is exact in
fp32, so the same bf16 operands can give an fp32 result that was never rounded: on CUDA the
GEMM's own fp32 output (`torch.mm(..., out_dtype=torch.float32)`, which has no autograd
formula, hence the Function here), on a CPU by widening the operands first (the products are
exact; the sums run in fp32 either way).

Its backward receives an fp32 output gradient. `Arithmetic.backward` says what the GEMMs of
the backward make of it:

- "round": rounded to the compute dtype, then the compute dtype's GEMMs (0.5's backward);
- "split2" / "split3": split into 2 or 3 pieces in the compute dtype (hi, mid, lo: each holds
  the next 8 significant bits of bf16), one GEMM per piece, summed in fp32: 3 pieces hold an
  fp32 value exactly (torchtitan's `HiMidLoLinear`);
- "wide": the GEMMs in the wide dtype itself.

Emulated fp32 runs a GEMM of fp32 operands as GEMMs of their bf16 pieces, summed in fp32:
"bf16x9" all 9 products of 3 pieces each (as cuBLAS's `fp32_precision = "bfx9"`), "bf16x3"
the 3 largest (hi x hi, hi x mid, mid x hi). On CUDA with torch 2.15 "bf16x9" is torch's own,
scoped to this module's GEMMs (torch's switch is process-wide: it is set and restored around
each of them); elsewhere, and for "bf16x3", the pieces are multiplied here, exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode

from precision_annot._src import seams
from precision_annot._src.guards import warn

if TYPE_CHECKING:
    from precision_annot._src.policy import Policy

__all__ = ["Arithmetic", "ArithmeticForward", "Backward", "Emulation", "ModuleGemms", "linear",
           "mm", "of_policy", "owns_gemm_weights", "pieces", "runs_linear_forward"]

#: the values of the plan's `backward` and emulated computes (`dtypes.BACKWARDS`,
#: `dtypes.EMULATIONS`, which `Policy` checks), as types
Backward: TypeAlias = Literal["round", "split2", "split3", "wide"]
Emulation: TypeAlias = Literal["bf16x3", "bf16x9"]


@dataclasses.dataclass(frozen=True)
class Arithmetic:
    """How one Linear's GEMMs compute.

    Attributes:
        operands: the dtype the GEMM's operands are rounded to (the module's compute dtype).
        output: the dtype the GEMM accumulates in and hands back (wider than `operands`: a wide
            output, never rounded to `operands` on the way).
        backward: what the backward GEMMs make of the wide output gradient.
        emulation: fp32 operands multiplied as their bf16 pieces ("bf16x9", "bf16x3"), or None.
    """

    operands: torch.dtype
    output: torch.dtype
    backward: Backward = "round"
    emulation: Emulation | None = None

    def __str__(self) -> str:
        if self.emulation is not None:
            return f"fp32 emulated as {self.emulation}, both passes"
        short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                 torch.float64: "fp64"}
        return (f"{short.get(self.operands, self.operands)} operands, "
                f"{short.get(self.output, self.output)} output, backward {self.backward}")


@torch.library.custom_op("precision_annot::round_to", mutates_args=())
def _round_op(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype, memory_format=torch.contiguous_format, copy=True)  # as its fake


@_round_op.register_fake
def _(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.new_empty(t.shape, dtype=dtype)


def round_to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t.to(dtype)`, rounded for real under `torch.compile` too: Inductor keeps a narrow
    intermediate that a fused kernel widens again in fp32 registers, never rounded (measured:
    a wide output 1.1e-3 off eager), so there the rounding is an op of its own that no kernel
    fuses into, and `t` is materialized in `dtype` even where it is `dtype` already."""
    if torch.compiler.is_compiling():  # (also where `t` is `dtype` already: a fused kernel
        out: torch.Tensor = _round_op(t, dtype)  # before may have kept it wide)
        return out
    return t.to(dtype)


def pieces(t: torch.Tensor, count: int, dtype: torch.dtype = torch.bfloat16
           ) -> list[torch.Tensor]:
    """`t` as `count` tensors of `dtype` whose sum (in fp32) is `t` up to what `count`
    pieces hold: each piece is the rounding of what the pieces before it left."""
    out = []
    rest = t.float()
    for i in range(count):
        piece = round_to(rest, dtype)
        out.append(piece)
        if i + 1 < count:
            rest = rest - piece.float()
    return out


def _mm_wide(a: torch.Tensor, b: torch.Tensor, out: torch.dtype) -> torch.Tensor:
    """`a @ b` accumulated in and handed back as `out`, from operands of a narrower dtype:
    CUDA's GEMM with an `out_dtype`, else the operands widened (their products are exact)."""
    if a.dtype == out:
        return a @ b.to(out)
    if a.is_cuda and a.dim() == 2 and b.dim() == 2 and a.dtype == b.dtype:
        return torch.mm(a, b, out_dtype=out)
    return a.to(out) @ b.to(out)


_PAIRS = {"bf16x9": [(i, j) for i in range(3) for j in range(3)],
          "bf16x3": [(0, 0), (0, 1), (1, 0)]}


@contextlib.contextmanager
def _cuda_fp32_precision(value: str) -> Iterator[None]:
    """torch's process-wide fp32 GEMM precision, set for one GEMM and restored."""
    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision
    matmul.fp32_precision = value
    try:
        yield
    finally:
        matmul.fp32_precision = saved


def mm(a: torch.Tensor, b: torch.Tensor, emulation: Emulation) -> torch.Tensor:
    """`a @ b` of fp32 (2-D) operands as emulated fp32: their bf16 pieces multiplied and the
    products summed in fp32, smallest first (the larger terms are added last, where the
    rounding of the sum matters least)."""
    if a.is_cuda and emulation == "bf16x9" and seams.CUDA_BFX9:
        with _cuda_fp32_precision("bfx9"):
            return a.float() @ b.float()
    pa, pb = pieces(a, 3), pieces(b, 3)
    terms = sorted(_PAIRS[emulation], key=lambda ij: -(ij[0] + ij[1]))
    total: torch.Tensor | None = None
    for i, j in terms:
        term = _mm_wide(pa[i], pb[j], torch.float32)
        total = term if total is None else total + term
    assert total is not None
    return total


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _Linear(torch.autograd.Function):
    """Like `F.linear(x, w, b)`, but its GEMMs compute as `Arithmetic` says: operands rounded
    to `operands`, accumulated and handed back in `output` (or emulated fp32); its backward
    splits, rounds or keeps the wide output gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                operands: torch.dtype, output: torch.dtype, backward: str,
                emulation: str | None) -> torch.Tensor:
        arith = Arithmetic(operands, output, backward, emulation)  # type: ignore[arg-type]
        xc, wc = round_to(_flat(x), arith.operands), round_to(w, arith.operands)
        ctx.save_for_backward(xc, wc)
        ctx.arith, ctx.dtypes, ctx.shape = arith, (x.dtype, w.dtype), x.shape
        ctx.bias = None if b is None else b.dtype
        if arith.emulation is not None:
            out = mm(xc, wc.t(), arith.emulation)
        else:
            out = _mm_wide(xc, wc.t(), arith.output)
        if b is not None:
            out = out + round_to(b, arith.operands).to(arith.output)
        return out.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # once differentiable: the saved operands are rounded copies, not linked to `x` and `w`,
        # so a double backward through these GEMMs would miss their terms (41% off, silently);
        # it raises instead
        xc, wc = ctx.saved_tensors
        arith: Arithmetic = ctx.arith
        g = _flat(grad)
        x_dtype, w_dtype = ctx.dtypes
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        if need_x:
            grad_x = _backward_mm(g, wc, arith).to(x_dtype).reshape(ctx.shape)
        if need_w:
            grad_w = _backward_mm(g.t(), xc, arith).to(w_dtype)
        if need_b and ctx.bias is not None:
            rounded = round_to(g, arith.operands) if arith.backward == "round" else g
            grad_b = rounded.to(arith.output).sum(0).to(ctx.bias)  # summed in the wide dtype
        return grad_x, grad_w, grad_b, None, None, None, None


def _backward_mm(g: torch.Tensor, other: torch.Tensor, arith: Arithmetic) -> torch.Tensor:
    """`g @ other` for the backward, `g` the wide output gradient, `other` in the operands'
    dtype: what `arith.backward` says, summed in the wide dtype."""
    if arith.emulation is not None:
        return mm(g.float(), other.float(), arith.emulation)
    wide = arith.output
    if arith.backward == "wide" or arith.operands == wide:
        return g.to(wide) @ other.to(wide)
    if arith.backward == "round":
        # the compute dtype's GEMM: accumulated wide, handed back rounded (0.5's backward)
        return round_to(_mm_wide(round_to(g, arith.operands), other, wide), arith.operands)
    count = 2 if arith.backward == "split2" else 3
    total: torch.Tensor | None = None
    for piece in reversed(pieces(g, count, arith.operands)):  # the smallest first
        term = _mm_wide(piece, other, wide)
        total = term if total is None else total + term
    assert total is not None
    return total


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, arith: Arithmetic
           ) -> torch.Tensor:
    """`F.linear(x, w, b)` computed as `arith` says, autocast off inside (the operands are
    rounded as `arith` says, not as autocast would)."""
    with torch.autocast(x.device.type, enabled=False):
        out: torch.Tensor = _Linear.apply(  # type: ignore[no-untyped-call,unused-ignore]
            x, w, b, arith.operands, arith.output, arith.backward, arith.emulation)
    return out


def runs_linear_forward(module: nn.Module) -> bool:
    """True when `module` is an nn.Linear that runs nn.Linear's own forward (a subclass with a
    forward of its own computes what it likes)."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def of_policy(policy: Policy) -> Arithmetic | None:
    """The arithmetic a Linear's GEMMs run under `policy`, or None where they run as torch
    runs them (the compute dtype's own GEMMs): a wide output (`output` wider than a low
    `compute`), with its `backward`; or emulated fp32 (`compute="bf16x9"`, `"bf16x3"`)."""
    if policy.fp8 is not None:
        return None
    if policy.emulation is not None:
        return Arithmetic(torch.float32, torch.float32, "round",
                          policy.emulation)  # type: ignore[arg-type]
    if policy.wide_output:
        assert policy.compute is not None and policy.output is not None
        return Arithmetic(policy.compute, policy.output,
                          policy.backward or "round")  # type: ignore[arg-type]
    return None


def owns_gemm_weights(module: nn.Module) -> bool:
    """True when `module` holds a 2-D floating parameter of its own: the weight of a GEMM its
    forward may run through `F.linear` (a router holding its `weight`, as transformers' MoE
    routers do, or an nn.Linear subclass with a forward of its own)."""
    if type(module).__module__.startswith("torch."):
        # torch's own modules: an nn.Embedding's or an LSTM's 2-D weights feed no F.linear, and
        # MultiheadAttention's are attention's (not covered); nn.Linear is `runs_linear_forward`
        return False
    return any(p.dim() == 2 and p.is_floating_point()
               for p in module.parameters(recurse=False))


class _OwnGemms(TorchFunctionMode):
    """Routes the `F.linear` calls whose weight is one of a module's own (or the copy its
    forward reads of it) through `linear` with the module's arithmetic."""

    def __init__(self, weights: set[int], arith: Arithmetic) -> None:
        super().__init__()
        self.weights, self.arith = weights, arith
        self.reached = False  # whether a GEMM took the arithmetic (counted in eager only)

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            x = args[0] if args else kwargs["input"]
            w = args[1] if len(args) > 1 else kwargs["weight"]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if id(w) in self.weights:
                if not torch.compiler.is_compiling():
                    self.reached = True
                return linear(x, w, b, self.arith)
        return func(*args, **kwargs)


class ModuleGemms:
    """The forward of a module that is not a plain nn.Linear but runs `F.linear` on a weight
    of its own (transformers' MoE routers): run as it is, with those GEMMs computed as
    `arith` says. Set as the instance's `forward` by `apply`; `inner` is the instance forward
    it replaced, if any."""

    def __init__(self, module: nn.Module, arith: Arithmetic,
                 inner: Callable[..., Any] | None) -> None:
        self.module, self.arith, self.inner = module, arith, inner
        self.warned = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        weights: set[int] = set()
        for name, p in module.named_parameters(recurse=False):
            if p.dim() == 2:
                weights.update((id(p), id(getattr(module, name))))
        mode = _OwnGemms(weights, self.arith)
        with mode:
            if self.inner is not None:
                out = self.inner(*args, **kwargs)
            else:
                # the class's forward called with the module (Dynamo traces this; a bound
                # method made by `types.MethodType` breaks `torch.compile(fullgraph=True)`)
                out = type(module).forward(module, *args, **kwargs)
        if not mode.reached and not self.warned and not torch.compiler.is_compiling():
            self.warned = True
            warn(f"{type(module).__name__}.forward ran no F.linear on a 2-D weight of its own "
                 f"as it is held (a copy such as `self.weight.float()` is another tensor): "
                 f"its plan's arithmetic ({self.arith}) reached none of its GEMMs, which ran "
                 f"as its forward computes them")
        return out

    def __repr__(self) -> str:
        return f"ModuleGemms({self.arith})"


class ArithmeticForward:
    """A Linear's forward computed as `arith` says (`linear`), set as the instance's
    `forward` by `apply`; `inner` is the instance forward it replaced, if any, which `remove`
    gives back."""

    def __init__(self, module: nn.Linear, arith: Arithmetic,
                 inner: Callable[..., Any] | None) -> None:
        self.module, self.arith, self.inner = module, arith, inner

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        module = self.module
        return linear(input, module.weight, module.bias, self.arith)

    def __repr__(self) -> str:
        return f"ArithmeticForward({self.arith})"
