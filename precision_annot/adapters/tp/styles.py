"""Tensor-parallel styles whose reductions run in a module's planned `comm` dtype.

A row-parallel Linear hands back partial sums that an all-reduce adds up. Under torch's
`RowwiseParallel` those partial sums are the GEMM's output, already rounded to the compute
dtype (bf16), and they are added in bf16: the result depends on how many ranks split the sum.
`PlannedRowwiseParallel` computes each partial GEMM output in `comm` (fp32: on a CPU from the
bf16 operands upcast, whose products are exact in fp32; on CUDA as the GEMM's fp32 output),
all-reduces it in `comm`, adds the bias (whose gradient, a partial sum where the output is
sharded over rows, is reduced before it is rounded) and rounds once, to the dtype its GEMM
hands back on one rank. `PlannedColwiseParallel` does the same for the reduction a
column-parallel Linear owes in backward: its input's gradient, a sum over the output features
the ranks split.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.placement_types import Placement

from precision_annot._src.dtypes import widest
from precision_annot._src.runtime import ModuleState, find_boundary

__all__ = ["InputCast", "PlannedColwiseParallel", "PlannedRowwiseParallel", "TPState",
           "state_of", "wide_mm"]

STATE = "_precision_annot_tp"


@dataclasses.dataclass(frozen=True)
class TPState:
    """What a planned style leaves on its Linear: how it reduces.

    Attributes:
        kind: "rowwise" (partial sums of the output, in forward) or "colwise" (partial sums
            of the input's gradient, in backward).
        mesh: the 1-D tensor-parallel mesh.
        comm: the dtype the partial sums are computed and reduced in.
        output: the dtype a row-parallel module rounds its reduced output to; None: the dtype
            its GEMM computes in.
        layout: where the reduced tensor lands: a row-parallel module's output layout, a
            column-parallel module's input layout.
    """

    kind: str
    mesh: DeviceMesh
    comm: torch.dtype
    output: torch.dtype | None
    layout: Placement


def state_of(module: nn.Module) -> TPState | None:
    """The planned style's state on `module`, or None."""
    found = module.__dict__.get(STATE)
    return found if isinstance(found, TPState) else None


# -- the GEMMs ----------------------------------------------------------------------------------

def _gemm_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype `F.linear` computes in here: autocast's, where autocast is on."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


@functools.cache
def _cuda_out_dtype() -> bool:
    """Whether this torch has `torch.mm(..., out_dtype=)` for CUDA half-precision operands."""
    try:
        a = torch.ones(2, 2, device="cuda", dtype=torch.bfloat16)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def wide_mm(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """`a @ b` (2-D) in `acc`: on CUDA, half-precision operands multiplied with an `acc`
    output (the GEMM accumulates in fp32 anyway); elsewhere the operands upcast first, whose
    products are exact in fp32. Not differentiable (`mm.dtype` has no derivative)."""
    if a.dtype == b.dtype == acc:
        return a @ b
    if (a.is_cuda and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16)
            and acc == torch.float32 and _cuda_out_dtype()):
        return torch.mm(a, b, out_dtype=acc)
    return a.to(acc) @ b.to(acc)


def _acc(compute: torch.dtype, comm: torch.dtype) -> torch.dtype:
    """The dtype partial sums are computed in before their one rounding to `comm`: the wider of
    the two; fp32 where they are fp16 and bf16 (neither holds the other: computed in one and
    rounded to the other, a partial sum would be rounded twice, and overflow fp16's range
    where bf16's holds it)."""
    if {compute, comm} == {torch.float16, torch.bfloat16}:
        return torch.float32
    return cast(torch.dtype, widest((compute, comm)))


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _WideLinear(torch.autograd.Function):
    """Like `F.linear(x, w)` without bias, but its output is in `acc`, and so are the GEMMs of
    its backward (rounded once, to the dtypes of `x` and `w`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.acc = acc
        return wide_mm(_flat(x), w.t(), acc).reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        acc = ctx.acc
        g = _flat(grad).to(acc)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = wide_mm(g, w, acc).to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = wide_mm(g.t(), _flat(x), acc).to(w.dtype)
        return grad_x, grad_w, None


def _partial(local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """A local partial GEMM output (every rank holds a full-shaped summand) as a DTensor."""
    return DTensor.from_local(local, mesh, (Partial(),), run_check=False,
                              shape=local.shape, stride=local.stride())


class _Bias(torch.autograd.Function):
    """A row-parallel Linear's bias as its GEMM adds it: rounded to the compute dtype, added in
    `acc`. Its gradient is a sum over the output's rows: where the output is sharded over rows
    (sequence parallel), each rank holds a partial sum, reduced here in `comm` before the one
    rounding to the compute dtype that one rank's GEMM makes (rounding each partial sum first
    would add TP-degree-dependent error); then handed back replicated, in the bias's dtype."""

    @staticmethod
    def forward(ctx: Any, b: torch.Tensor, compute: torch.dtype, acc: torch.dtype,
                st: TPState) -> torch.Tensor:
        ctx.dtype, ctx.compute, ctx.st = b.dtype, compute, st
        return b.to(compute).to(acc)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        st: TPState = ctx.st
        if isinstance(st.layout, Shard):
            grad = _partial(grad.to(st.comm), st.mesh).redistribute(
                st.mesh, (Replicate(),)).to_local()
        return grad.to(ctx.compute).to(ctx.dtype), None, None, None


def _add_bias(out: DTensor, bias: torch.Tensor, compute: torch.dtype, acc: torch.dtype,
              st: TPState) -> torch.Tensor:
    """`out + bias` in `acc`, the bias's gradient reduced before it is rounded (`_Bias`)."""
    last = isinstance(st.layout, Shard) and st.layout.dim in (-1, out.dim() - 1)
    if last or not isinstance(bias, DTensor):  # each bias element's gradient on one rank
        return out.to(acc) + bias.to(compute).to(acc)
    local = out.to_local().to(acc) + _Bias.apply(  # type: ignore[no-untyped-call,unused-ignore]
        bias.to_local(), compute, acc, st)
    return DTensor.from_local(local, st.mesh, out.placements, run_check=False,
                              shape=out.shape, stride=out.stride())


def _row_forward(module: nn.Linear, st: TPState, input: torch.Tensor) -> torch.Tensor:
    """A row-parallel Linear: partial GEMM outputs in `comm`, reduced in `comm` into the
    output layout, the bias added, one rounding to the dtype the GEMM hands back on one rank
    (then cast to the module's `output`, as on one rank)."""
    x = input if isinstance(input, DTensor) else DTensor.from_local(
        input, st.mesh, (Shard(-1),), run_check=False)
    weight, bias = module.weight, module.bias
    compute = _gemm_dtype(x)
    acc = _acc(compute, st.comm)
    device = x.device.type
    with torch.autocast(device, enabled=False):
        xl = x.to_local().to(compute)  # the rounding autocast would do
        wl = cast(DTensor, weight).to_local().to(compute)
        partial = _WideLinear.apply(xl, wl, acc).to(st.comm)  # type: ignore[no-untyped-call,unused-ignore]
        out: torch.Tensor = _partial(partial, st.mesh).redistribute(st.mesh, (st.layout,))
        if bias is not None:
            out = _add_bias(cast(DTensor, out), bias, compute, acc, st)
        # one rank's GEMM rounds to its compute dtype whatever the module hands back: an
        # output=fp32 is that rounded value cast, and its gradient reaches the GEMM rounded
        return out.to(compute).to(st.output or compute)


class _ColLinear(torch.autograd.Function):
    """Like `F.linear(x, w, b)` on a column shard of `w`, with the input's gradient (a partial
    sum over this rank's output features) computed in `comm` and reduced in `comm` into the
    input's layout, then rounded once to the compute dtype, as the GEMM of one rank hands it
    back (and then cast to the input's dtype). `x` arrives in its input layout and is
    gathered here, in the compute dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                st: TPState, layout: Placement, compute: torch.dtype) -> torch.Tensor:
        xc = x.to(compute)
        if not isinstance(layout, Replicate):
            xc = DTensor.from_local(xc, st.mesh, (layout,), run_check=False).redistribute(
                st.mesh, (Replicate(),)).to_local()
        wc = w.to(compute)
        out = torch.nn.functional.linear(xc, wc, None if b is None else b.to(compute))
        ctx.save_for_backward(xc, wc)
        ctx.st, ctx.layout, ctx.bias = st, layout, b is not None
        ctx.x_dtype, ctx.x_shape = x.dtype, x.shape
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        xc, wc = ctx.saved_tensors
        st: TPState = ctx.st
        g = _flat(grad)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            acc = _acc(wc.dtype, st.comm)
            partial = wide_mm(g.to(wc.dtype), wc, acc).reshape(xc.shape)
            reduced = _partial(partial.to(st.comm), st.mesh).redistribute(
                st.mesh, (ctx.layout,)).to_local()
            # rounded once, to what the GEMM hands back (then to the input's own dtype)
            grad_x = reduced.to(wc.dtype).to(ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_w = g.t().to(wc.dtype) @ _flat(xc)
        if ctx.bias and ctx.needs_input_grad[2]:
            grad_b = g.to(wc.dtype).sum(0)
        return grad_x, grad_w, grad_b, None, None, None


def _col_forward(module: nn.Linear, st: TPState, input: torch.Tensor) -> torch.Tensor:
    """A column-parallel Linear whose input's gradient is reduced in `comm`; its output a
    DTensor sharded on the last dimension, as `ColwiseParallel` leaves it."""
    x = input if isinstance(input, DTensor) else DTensor.from_local(
        input, st.mesh, (st.layout,), run_check=False)
    weight, bias = cast(DTensor, module.weight), module.bias
    compute = _gemm_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        out = _ColLinear.apply(x.to_local(), weight.to_local(),  # type: ignore[no-untyped-call,unused-ignore]
                               None if bias is None else cast(DTensor, bias).to_local(),
                               st, x.placements[0], compute)
    rows = tuple(out.shape[:-1])
    shape = torch.Size((*rows, weight.shape[0]))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(out, st.mesh, (Shard(out.dim() - 1),), run_check=False,
                              shape=shape, stride=stride)


def _forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    st = state_of(self)
    if st is None or not isinstance(self.weight, DTensor):
        return nn.Linear.forward(self, input)
    if st.kind == "rowwise":
        return _row_forward(self, st, input)
    return _col_forward(self, st, input)


_CLASSES: dict[type, type] = {}


def _planned_class(cls: type[nn.Module]) -> type[nn.Module]:
    """`cls` with the planned forward, as FSDP2 makes `FSDPLinear`: one class per class."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"TP{cls.__name__}", (cls,), {
            "forward": _forward, "__module__": cls.__module__,
            # audit: it turns autocast off for GEMMs whose operands it rounds itself
            "_precision_annot_casts_itself": True})
    return _CLASSES[cls]


def install(module: nn.Module, st: TPState) -> None:
    """Give `module` (an nn.Linear keeping Linear's forward) the planned forward and `st`.

    NOTE: an applied boundary binds its module's class forward once (`Boundary.configure`), so
    after the class changes it is configured again, unchanged, to bind the new one."""
    if type(module).forward is not nn.Linear.forward and state_of(module) is None:
        raise TypeError(f"{type(module).__qualname__} overrides nn.Linear's forward, which "
                        "the planned tensor-parallel forward would replace.")
    if state_of(module) is None:
        module.__class__ = _planned_class(type(module))
    module.__dict__[STATE] = st
    boundary = find_boundary(module)[0]
    if boundary is not None:
        boundary.configure(boundary.spec, boundary.region, boundary.planned, boundary.swap)


class InputCast:
    """A forward pre-hook run before a plain column-parallel style's own: the module's input,
    a local tensor, is cast to `dtype` (its compute dtype) before the style makes it a
    DTensor. torch's style reduces the input's gradient where the input became a DTensor, in
    the dtype it had there; the cast autocast (or an fp8 layer) makes for the GEMM comes
    after, so an input arriving in fp32 under bf16 autocast had its gradient all-reduced in
    fp32. Cast here, the same rounding happens before, and the gradient, which the GEMM hands
    back in `dtype`, is reduced in `dtype` and cast back to the input's dtype after.

    Args:
        dtype: the dtype to cast the input to.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        x = args[0] if args else None
        if ModuleState.of(module) is None:  # `remove`d: its weights are back in their dtype
            return None
        if (not isinstance(x, torch.Tensor) or isinstance(x, DTensor)
                or not x.is_floating_point() or x.dtype == self.dtype):
            return None
        return (x.to(self.dtype), *args[1:])

    def __repr__(self) -> str:
        return f"InputCast({self.dtype})"


class PlannedRowwiseParallel(RowwiseParallel):
    """Like `RowwiseParallel`, but the partial sums are computed and all-reduced (or
    reduce-scattered, with `output_layouts=Shard(1)`) in `comm`, then rounded once to the dtype
    the GEMM computes in, as one rank's GEMM rounds, and cast to `output`. With
    `comm=torch.float32` over bf16 compute, the result equals one rank's up to the order of
    fp32 additions, whatever the TP degree. For `nn.Linear` layers.

    Args:
        comm: the dtype of the partial sums and of their reduction.
        output: the dtype the rounded output is handed back in; None: the GEMM's.
            (Default: None)
        input_layouts: as for `RowwiseParallel`. (Default: None)
        output_layouts: as for `RowwiseParallel`. (Default: None)
        use_local_output: as for `RowwiseParallel`. (Default: True)
    """

    def __init__(self, *, comm: torch.dtype, output: torch.dtype | None = None,
                 input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, use_local_output: bool = True):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts,
                         use_local_output=use_local_output)
        self.comm = comm
        self.output = output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise NotImplementedError(f"{type(self).__name__} shards nn.Linear layers; got "
                                      f"{type(module).__qualname__}.")
        out = super()._apply(module, device_mesh)
        install(module, TPState("rowwise", device_mesh, self.comm, self.output,
                                self.output_layouts[0]))
        return out

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, comm={self.comm})"


class PlannedColwiseParallel(ColwiseParallel):
    """Like `ColwiseParallel`, but the input's gradient (a partial sum over the output
    features each rank holds) is computed and reduced in `comm`, then rounded once to the
    dtype the GEMM computes in, as on one rank. For `nn.Linear` layers; its input is gathered
    (with `input_layouts=Shard(1)`) inside the layer, in the compute dtype.

    Args:
        comm: the dtype the input's gradient is computed and reduced in.
        input_layouts: as for `ColwiseParallel`. (Default: None)
        output_layouts: as for `ColwiseParallel`. (Default: None)
        use_local_output: as for `ColwiseParallel`. (Default: True)
    """

    def __init__(self, *, comm: torch.dtype, input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, use_local_output: bool = True):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts,
                         use_local_output=use_local_output)
        self.comm = comm

    @staticmethod
    def _prepare_input_fn(input_layouts: Any, desired_input_layouts: Any, mod: nn.Module,
                          inputs: Any, device_mesh: DeviceMesh) -> Any:
        # as ColwiseParallel's, without the redistribution: the layer gathers its input itself
        input_tensor = inputs[0]
        if not isinstance(input_tensor, DTensor):
            input_tensor = DTensor.from_local(input_tensor, device_mesh, input_layouts,
                                              run_check=False)
        return input_tensor

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise NotImplementedError(f"{type(self).__name__} shards nn.Linear layers; got "
                                      f"{type(module).__qualname__}.")
        out = super()._apply(module, device_mesh)
        install(module, TPState("colwise", device_mesh, self.comm, None,
                                self.input_layouts[0]))
        return out

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, comm={self.comm})"
