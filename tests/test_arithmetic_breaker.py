"""The arithmetic of a Linear's GEMMs (`_src/arithmetic.py`) as users' loops meet it, against
the same computation written by hand in plain torch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import precision_annot as pa
from precision_annot._src.arithmetic import Arithmetic, linear

bf16, fp32, fp64 = torch.bfloat16, torch.float32, torch.float64


class _Router(nn.Module):
    """A router holding its weight and calling F.linear, as transformers' MoE routers do."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 32) / 32 ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


@pytest.mark.slow
def test_a_router_holding_its_weight_compiles_with_fullgraph() -> None:
    """`torch.compile(fullgraph=True)` over a router given a wide output: traced whole (the
    class's forward was bound with `types.MethodType`, which Dynamo cannot trace: Unsupported),
    and equal to eager bit for bit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), _Router())
    pa.annotate(model, {"1": "bf16-mixed,output=fp32"})
    pa.apply(model, default="bf16-mixed")
    x = torch.randn(16, 32).to(bf16)
    eager = model(x)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)(x)
    h = torch.nn.functional.linear(x, model[0].weight.to(bf16), model[0].bias.to(bf16))
    assert eager.dtype == fp32
    assert torch.equal(eager, h.float() @ model[1].weight.to(bf16).float().t())
    assert torch.equal(compiled, eager)


def test_a_double_backward_raises_instead_of_missing_terms() -> None:
    """A gradient penalty (a backward through the input gradient) needs the GEMMs' second
    derivative, which the saved, rounded operands do not carry: by hand in torch the weight's
    gradient is found; here it was 41% off without a word. It raises now."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, generator=gen, requires_grad=True)
    w = torch.randn(8, 16, generator=gen, requires_grad=True)
    out = linear(x, w, None, Arithmetic(bf16, fp32, "wide"))
    (grad_x,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad_x.pow(2).sum().backward()
    # the first backward is untouched: the input gradient is the wide GEMM's, by hand
    xc, wc = x.detach().to(bf16).to(fp32), w.detach().to(bf16).to(fp32)
    assert torch.equal(grad_x, (2 * (xc @ wc.t())) @ wc)


def test_the_bias_gradient_of_an_fp64_output_is_summed_in_fp64() -> None:
    """`output=fp64`: the bias gradient is the fp64 output gradient summed in fp64, as torch
    sums it by hand (it was summed in fp32: 1.7e-7 off)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=gen, dtype=fp64)
    w = torch.randn(8, 16, generator=gen, dtype=fp64)
    bias = torch.zeros(8, dtype=fp64, requires_grad=True)
    g = torch.randn(64, 8, generator=gen, dtype=fp64)
    for backward in ("wide", "split2"):
        bias.grad = None
        linear(x, w, bias, Arithmetic(bf16, fp64, backward)).backward(g)  # type: ignore[arg-type]
        assert bias.grad is not None and torch.equal(bias.grad, g.sum(0))


def test_an_embedding_with_a_wide_output_claims_no_gemm_arithmetic() -> None:
    """`{"*": "bf16-mixed,output=fp32"}` reaches an nn.Embedding too: its 2-D table feeds no
    GEMM, so its forward stays torch's and `audit` names no arithmetic for it (it said "bf16
    operands, fp32 output, backward round"); the Linear after it gets the wide output."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 4))
    pa.annotate(model, {"*": "bf16-mixed,output=fp32"})
    pa.apply(model)
    tokens = torch.randint(0, 16, (6,))
    with pa.audit(model) as report:
        out = model(tokens)
    assert report["0"].arithmetic == set()
    assert report["1"].arithmetic == {"bf16 operands, fp32 output, backward round"}
    h = model[0].weight[tokens].to(bf16).float()
    want = h @ model[1].weight.to(bf16).float().t() + model[1].bias.to(bf16).float()
    assert torch.equal(out, want)


class _CopyingRouter(nn.Module):
    """DeepSeek-V3's router: `F.linear(x.type(torch.float32), self.weight.type(torch.float32))`,
    whose weight, held in bf16, reaches the GEMM as an fp32 copy."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 32) / 32 ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.type(fp32), self.weight.type(fp32))


def test_a_router_whose_gemm_misses_its_arithmetic_says_so() -> None:
    """A router that multiplies a copy of its weight (DeepSeek-V3's, with bf16 storage) runs
    its GEMM as its forward computes it, not as the plan says: a warning names it, once (it
    was silent, and audit names the arithmetic). One that multiplies the weight it holds does
    not warn."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), _CopyingRouter())
    pa.annotate(model, {"1": "bf16,output=fp32,backward=split2"})
    pa.apply(model, default="bf16-true")
    x = torch.randn(4, 32)
    with pytest.warns(UserWarning, match=r"_CopyingRouter.forward ran no F.linear on a 2-D "
                                         r"weight of its own.*backward split2"):
        model(x)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x)  # once
        held = nn.Sequential(nn.Linear(32, 32), _Router())
        pa.annotate(held, {"1": "bf16,output=fp32,backward=split2"})
        pa.apply(held, default="bf16-true")
        assert held(x).dtype == fp32
