"""`audit`: what really ran, module by module, against the plan."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from precision_annot import Policy, apply, audit, bf16, fp16, fp32, precision, resolve
from precision_annot._src.cli import main
from precision_annot._src.demo_model import build_model


def step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).float().sum().backward()


def test_the_demo_model_runs_exactly_as_planned() -> None:
    torch.manual_seed(0)
    model = apply(build_model())
    with audit(model) as report:
        step(model, torch.randint(0, 64, (2, 8)))
    assert report.divergences == []
    norm = report["blocks.0.norm1"]
    assert norm.forward_ops.keys() == {fp32} and norm.autocast == {(False, None)}
    assert set(norm.backward_ops) == {fp32}
    qkv = report["blocks.0.qkv"]
    assert set(qkv.forward_ops) == {bf16} and qkv.autocast == {(True, bf16)}
    assert qkv.grads == {"weight": fp32, "bias": fp32}  # fp32 master gradients
    assert report["head"].outputs == {fp32}
    assert "No divergence" in str(report)


def test_the_benchmark_gpt_runs_exactly_as_planned() -> None:
    from benchmarks.overhead import GPT

    torch.manual_seed(0)
    model = GPT(vocab=64, d=32, layers=2, heads=2)
    from precision_annot import annotate

    annotate(model, {nn.LayerNorm: "fp32"})
    apply(model, default="bf16")
    with audit(model) as report:
        step(model, torch.randint(0, 64, (2, 16)))
    assert report.divergences == []
    assert set(report["blocks.0.ln1"].forward_ops) == {fp32}
    assert set(report["blocks.0.qkv"].backward_ops) == {bf16}


def test_an_unapplied_model_diverges_everywhere_the_plan_is_not_real() -> None:
    model = build_model()
    with audit(model) as report:  # the plan is resolved, but never applied
        step(model, torch.randint(0, 64, (2, 8)))
    found = {(d.module, d.field) for d in report.divergences}
    assert ("", "boundary") in found and ("blocks.0.norm1", "boundary") in found
    assert ("blocks.0.qkv", "autocast") in found  # planned bf16 under autocast, ran without
    assert ("blocks.0.norm1", "output") in found  # the island's fp32 leaked into the block
    assert "divergences from the plan" in str(report)


def test_autocast_leaking_into_a_planned_fp32_module_is_a_compute_divergence() -> None:
    class Sneaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=bf16):  # not the plan's doing
                out: torch.Tensor = self.head(x)
            return out

    model = apply(Sneaky(), default="fp32")
    with audit(model) as report:
        step(model, torch.randn(2, 4))
    by_field = {(d.module, d.field, d.phase): d for d in report.divergences}
    assert by_field[("head", "compute", "forward")].actual == "bf16:1"
    assert by_field[("head", "compute", "backward")].actual.startswith("bf16")
    assert by_field[("head", "autocast", "forward")].planned == "off"


def test_drifted_storage_and_gradients_are_divergences() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    plan = resolve(model, default=Policy(compute=fp32, storage=fp32))
    apply(model, plan)
    model[1].to(fp16)  # behind the plan's back: no boundary notices a compute change
    with audit(model) as report:
        model[1](torch.randn(2, 4, dtype=fp16)).float().sum().backward()
    fields = {(d.module, d.field, d.phase) for d in report.divergences}
    assert ("1", "storage", "state") in fields
    assert ("1", "grad", "backward") in fields
    assert ("1", "compute", "forward") in fields and ("1", "compute", "backward") in fields


def test_audit_refuses_a_plan_for_another_model_and_bad_input() -> None:
    plan = resolve(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    with pytest.raises(ValueError, match="another model"), audit(nn.Linear(2, 2), plan):
        pass
    with pytest.raises(TypeError, match="audit expects an nn.Module"):
        audit("model")  # type: ignore[arg-type]
    probe = audit(nn.Linear(2, 2))
    with probe:
        pass
    with pytest.raises(RuntimeError, match="already run"), probe:
        pass


def test_audit_leaves_no_hook_behind() -> None:
    model = apply(nn.Sequential(nn.Linear(2, 2), precision(fp32)(nn.LayerNorm(2))),
                  default="bf16")
    with audit(model):
        step(model, torch.randn(2, 2))
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


MYMOD = '''
import torch
from torch import nn
from precision_annot import precision

class Sneaky(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = precision("fp32")(nn.LayerNorm(4))
        self.tail = nn.Linear(4, 4)

    def forward(self, x):
        x = self.norm(self.lin(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.tail(x)

def make_model():
    return nn.Sequential(nn.Linear(4, 4), precision("fp32")(nn.LayerNorm(4)))

def make_sneaky():
    return Sneaky()

def make_batch():
    return torch.randn(2, 4)
'''


def test_the_audit_command_exits_1_on_divergence(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "mymod.py").write_text(MYMOD)
    script = tmp_path / "mymod.py"
    assert main(["audit", f"{script}:make_model", "--sample", f"{script}:make_batch",
                 "--default", "bf16"]) == 0
    assert "No divergence" in capsys.readouterr().out
    assert main(["audit", f"{script}:make_sneaky", "--sample", f"{script}:make_batch",
                 "--default", "fp32"]) == 1
    out = capsys.readouterr().out
    assert "tail: compute planned fp32, ran bf16" in out


@pytest.mark.slow  # over make test's budget: run by make test-all
def test_the_audit_command_from_the_console_script(tmp_path: Path) -> None:
    (tmp_path / "mymod.py").write_text(MYMOD)
    exe = Path(sys.executable).with_name("precision-annot")
    proc = subprocess.run([str(exe), "audit", "mymod:make_model", "--sample", "mymod:make_batch",
                           "--default", "bf16-mixed"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "No divergence" in proc.stdout


def test_a_function_region_is_audited_against_its_own_policy() -> None:
    """0.2 charged an fp16 region's ops to its fp32 island: a divergence of the island."""
    @precision(compute=fp16)
    def half(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    class Island(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = half(self.lin(x)) + 1
            return out

    model = apply(nn.Sequential(nn.Linear(4, 4), precision(fp32)(Island())), default="bf16")
    assert resolve(model, default="bf16").needs_loss_scaling
    with audit(model) as report:
        step(model, torch.randn(2, 4))
    assert report.divergences == []
    region = report["1::test_a_function_region_is_audited_against_its_own_policy.<locals>.half"]
    assert set(region.forward_ops) == {fp16} and set(region.backward_ops) == {fp16}
    assert set(report["1"].forward_ops) == {fp32}  # the island's own add, in fp32
    assert "(region)" in str(report)


def test_an_accumulating_index_put_and_a_hook_registered_inside_are_audited() -> None:
    """0.2 took index_put(accumulate=True) for data movement, and charged a hook registered
    inside the block to the root."""
    class Accumulate(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(4, dtype=torch.bfloat16)
            return out.index_put((torch.tensor([0, 0, 1]),), x[0, :3].bfloat16(),
                                 accumulate=True).float()

    model = apply(nn.Sequential(nn.Linear(4, 4), Accumulate()), default="fp32")
    with audit(model) as report:
        model(torch.randn(2, 4))
    assert ("1", "compute") in {(d.module, d.field) for d in report.divergences}

    plain = apply(nn.Sequential(nn.Linear(4, 4)), default="fp32")
    with audit(plain) as report:
        handle = plain[0].register_forward_hook(lambda m, a, out: out.bfloat16() * 2)
        plain(torch.randn(2, 4))
    handle.remove()
    assert report["0"].forward_ops[bf16] == 1 and report[""].forward_ops == {}
