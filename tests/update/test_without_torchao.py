"""Without torchao: a plan whose update needs it (a low-bit state, stochastic rounding) is
refused when its optimizer is built, saying what torchao is needed for and how to install it;
an update that needs none builds and steps as before.

torchao is made unimportable for each test only (every `torchao` module in `sys.modules` set
to None, as Python reads an absent package), so the real package runs everywhere else.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import precision_annot as pa

#: the words every refusal says: how to install torchao
INSTALL = "Install it with the fp8 extra: pip install 'precision-annot[fp8]'"


@pytest.fixture
def no_torchao(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in sys.modules if n == "torchao" or n.startswith("torchao.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "torchao", None)


def mlp(spec: str) -> nn.Module:
    torch.manual_seed(0)
    return pa.apply(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)),
                    default=spec)


@pytest.mark.usefixtures("no_torchao")
@pytest.mark.parametrize(("spec", "why"), [
    ("bf16-true,master=fp32,optim=8bit",
     "optim='8bit' keeps the optimizer state in torchao's 8bit format (OptimState8bit) and "
     "steps it with torchao's Adam update ('0.weight', '0.bias', '2.weight' and 1 more)"),
    ("bf16-true,optim=4bit",
     "optim='4bit' keeps the optimizer state in torchao's 4bit format (OptimState4bit)"),
    ("bf16-true,optim=fp8", "optim='fp8' keeps the optimizer state in torchao's fp8 format"),
    ("bf16-true,master=stochastic",
     "master='stochastic' writes each update into bf16 storage with torchao's stochastic "
     "rounding ('0.weight', '0.bias', '2.weight' and 1 more)"),
])
def test_an_update_that_needs_torchao_is_refused_when_the_optimizer_is_built(
        spec: str, why: str) -> None:
    """Before: `optimizer(...)` built it, and the first `step()` raised "optim=8bit runs its
    GEMMs in fp8 through torchao, which is not installed" (master=stochastic: "... runs its
    GEMMs in fp8"), though the plan runs no fp8 GEMM."""
    model = mlp(spec)
    with pytest.raises(ImportError) as raised:
        pa.optimizer(model, torch.optim.AdamW, lr=1e-3)
    message = str(raised.value)
    assert message.startswith(f"optimizer: {why}"), message
    assert INSTALL in message and "GEMM" not in message
    assert isinstance(raised.value.__cause__, ModuleNotFoundError)


@pytest.mark.usefixtures("no_torchao")
def test_an_update_planned_after_the_optimizer_is_built_says_why_at_its_step() -> None:
    """An optimizer built before the plan that needs torchao (it may be): the step that
    makes the 8-bit state says the same."""
    torch.manual_seed(0)
    model = nn.Linear(64, 128)
    opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-3)
    pa.apply(model, default="bf16-true,optim=8bit")
    model(torch.randn(4, 64, dtype=torch.bfloat16)).float().sum().backward()
    with pytest.raises(ImportError, match=r"optim='8bit' keeps the optimizer state in "
                                          r"torchao's 8bit format .*" + INSTALL.replace(
                                              "[", r"\[").replace("]", r"\]")):
        opt.step()


@pytest.mark.usefixtures("no_torchao")
def test_an_update_without_a_low_bit_state_needs_no_torchao() -> None:
    """fp32 masters and a bf16 state build and step without torchao."""
    model = mlp("bf16-true,master=fp32,optim=bf16")
    opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-3)
    model(torch.randn(4, 64, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    assert opt.master(model[0].weight) is not None
    assert "torchao" not in sys.modules or sys.modules["torchao"] is None


def test_the_docs_say_which_example_needs_the_fp8_extra() -> None:
    """docs/update.md's first example keeps 8-bit states: the text before it says that it
    needs the `fp8` extra (before, nothing said so, and a plain install failed at its first
    step)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "update.md").read_text()
    before, _, rest = text.partition("```python")
    example = rest.partition("```")[0]
    assert any(f"optim={fmt}" in example for fmt in ("8bit", "4bit", "fp8"))
    said = " ".join(before.strip().split("\n\n")[-1].split())
    assert "needs the `fp8` extra (`pip install 'precision-annot[fp8]'`" in said, said
