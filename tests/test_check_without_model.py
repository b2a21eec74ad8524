"""A check never loses what it was given: a plan whose model is gone (collected, or a plan file)
says what the model said, and the CLI, whose model is always gone, says what the API says.

0.3 lost every finding that needed the model's modules once the model was collected: the fp8
findings, `fsdp-tied-units` and `fsdp1-frozen-mixed`, so `precision-annot check` passed runs
that fail or lose updates (DeepSpeed refuses comm=fp8, FSDP1 breaks a tie)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from torch import nn

import precision_annot as pa
from precision_annot import PrecisionPlan, check, resolve
from precision_annot._src import seams
from precision_annot._src.cli import main

pytest.importorskip("torchao")

FACTORIES = '''
import torch
from torch import nn
import precision_annot as pa


class Scaled(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x)[0]


def fp8_comm():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    pa.annotate(model, {nn.Linear: "compute=fp8,comm=fp8"})
    return model


def fp8_odd():
    model = nn.Sequential(nn.Linear(30, 64), nn.ReLU(), Scaled(64, 32), Attention())
    pa.annotate(model, {nn.Linear: "compute=fp8"})
    return model


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.relu(self.body(self.emb(x))))


def tied():
    model = Tied()
    pa.annotate(model, {"head": "compute=fp32"})
    return model


def frozen():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model[0].weight.requires_grad_(False)
    return model


def norms():
    return nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64),
                         nn.BatchNorm1d(64, track_running_stats=False))
'''

#: (factory, default, backend, config, the codes the model's own check gives)
CASES: list[tuple[str, str, str | None, Any, set[str]]] = [
    ("fp8_comm", "bf16-mixed", "deepspeed", {"zero_optimization": {"stage": 2}},
     {"fp8-comm-refused"}),
    ("fp8_odd", "bf16-mixed", None, None,
     {"fp8-dims", "fp8-linear-subclass", "fp8-not-converted", "fp8-small-gemm"}),
    # (from torch 2.15 FSDP2 keeps the fp32 head in its parent's unit: the tie holds)
    ("tied", "bf16-mixed", "fsdp", None,
     set() if seams.FSDP2_KEEPS_PARAM_DTYPE else {"fsdp-tied-units"}),
    ("frozen", "bf16-mixed", "fsdp1", None, {"fsdp1-frozen-mixed"}),
    ("norms", "bf16-true", "local", None, {"low-running-stats", "low-storage"}),
]


@pytest.fixture(scope="module")
def factories(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("factories") / "check_factories.py"
    path.write_text(FACTORIES)
    return path


def load(path: Path, name: str) -> nn.Module:
    namespace: dict[str, Any] = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    model: nn.Module = namespace[name]()
    return model


def said(found: list[pa.Finding]) -> list[tuple[str, str, tuple[str, ...]]]:
    return [(f.severity, f.code, f.modules) for f in found]


@pytest.mark.parametrize(("name", "default", "backend", "config", "codes"), CASES,
                         ids=[c[0] for c in CASES])
def test_a_plan_whose_model_is_gone_checks_like_the_model(
        factories: Path, name: str, default: str, backend: str | None, config: Any,
        codes: set[str]) -> None:
    model = load(factories, name)
    alive = check(resolve(model, default), backend, config)
    assert codes <= {f.code for f in alive}, alive
    gone = resolve(load(factories, name), default)  # its model is dropped here
    gc.collect()
    assert not gone.has_model and gone.captured
    assert said(check(gone, backend, config)) == said(alive)
    from_file = PrecisionPlan.from_json(gone.to_json())
    assert said(check(from_file, backend, config)) == said(alive)


@pytest.mark.parametrize(("name", "default", "backend", "config", "codes"), CASES,
                         ids=[c[0] for c in CASES])
def test_the_cli_says_what_the_api_says(
        factories: Path, name: str, default: str, backend: str | None, config: Any,
        codes: set[str], capsys: pytest.CaptureFixture[str]) -> None:
    api = check(resolve(load(factories, name), default), backend, config)
    argv = ["check", f"{factories}:{name}", "--default", default, "--json"]
    argv += ["--backend", backend] if backend else []
    argv += ["--config", json.dumps(config)] if config else []
    status = main(argv)
    out = json.loads(capsys.readouterr().out)
    assert [(f["severity"], f["code"], tuple(f["modules"])) for f in out] == said(api)
    assert status == (1 if any(f.severity == "error" for f in api) else 0)


def test_a_plan_file_without_facts_is_refused_and_its_model_fills_them_in() -> None:
    """A plan file written by 0.3 holds no facts: check refuses to guess, naming the fix; the
    same plan applied to its model is checked in full."""
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64))
    plan = resolve(model, "bf16-true")
    data = json.loads(plan.to_json())
    for entry in data["modules"]:
        del entry["facts"]
    old = PrecisionPlan.from_json(json.dumps(data))
    assert not old.captured
    with pytest.raises(ValueError, match=r"check needs what resolve saw of each module.*"
                                         r"0\.3 or older.*Pass the model"):
        check(old, "local")
    pa.apply(model, old)
    assert {f.code for f in check(model, "local")} == {"low-storage", "low-running-stats"}


def test_facts_round_trip_and_a_bad_entry_names_its_key() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model.add_module("head", nn.Linear(4, 4))
    model.head.weight = model[0].weight
    model[0].bias.requires_grad_(False)
    plan = resolve(model, "bf16-mixed")
    facts = plan["head"].facts
    assert facts is not None and plan["0"].facts is not None
    assert facts.tensor("weight").tied == "0.weight"  # type: ignore[union-attr]
    assert plan["0"].facts.tensor("bias").trainable is False  # type: ignore[union-attr]
    assert plan["1"].has("running-stats") and plan["head"].has("linear")
    assert PrecisionPlan.from_json(plan.to_json()) == plan
    data = json.loads(plan.to_json())
    data["modules"][1]["facts"]["traits"] = ["lineare"]
    with pytest.raises(ValueError, match=r"unknown trait 'lineare'; valid: \['linear'"):
        PrecisionPlan.from_json(json.dumps(data))


@pytest.mark.slow  # over make test's budget: run by make test-all
def test_json_output_is_json_under_deepspeed(factories: Path) -> None:
    """DeepSpeed prints "Setting accelerator to CPU" on stdout when it is imported; the CLI
    keeps stdout for its result."""
    config = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}
    run = subprocess.run([sys.executable, "-m", "precision_annot", "check",
                          f"{factories}:fp8_comm", "--default", "bf16-mixed", "--backend",
                          "deepspeed", "--json", "--config", json.dumps(config)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr
    assert [f["code"] for f in json.loads(run.stdout)] == [
        "deepspeed-auto", "fp8-comm-refused", "fp8-small-gemm"]
    assert "Setting accelerator to CPU" in run.stderr  # DeepSpeed said it, on stderr


BROKEN = '''
from torch import nn


def make():
    raise RuntimeError("the factory is broken")


def needs(width):
    return nn.Linear(width, width)


def batch():
    raise OSError("no data here")
'''


def test_a_factory_or_loader_that_raises_exits_3_with_its_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/suggest.md: 3 when the model or a loader raises; 0.3 exited 2 without a trace."""
    script = tmp_path / "broken_models.py"
    script.write_text(BROKEN)
    assert main(["report", f"{script}:make"]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: the factory is broken" in err
    ok = tmp_path / "fine_models.py"
    ok.write_text("from torch import nn\n\ndef make():\n    return nn.Linear(2, 2)\n")
    assert main(["suggest", f"{ok}:make", "--sample", f"{script}:batch"]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "OSError: no data here" in err
    assert main(["report", f"{script}:needs"]) == 2  # a factory that takes arguments: bad input
    err = capsys.readouterr().err
    assert "must be callable with no arguments" in err and "Traceback" not in err
    assert main(["report", "no_such_module_xyz:make"]) == 2
    assert "Cannot import 'no_such_module_xyz'" in capsys.readouterr().err
