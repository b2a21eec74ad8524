"""The precision-annot command: report, audit, export deepspeed, and its errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import precision_annot
from precision_annot import PrecisionPlan, resolve
from precision_annot._src.cli import main

TARGET = "precision_annot._src.demo_model:build_model"


def test_report_prints_the_plan_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", TARGET]) == 0
    out = capsys.readouterr().out
    assert "TinyTransformer" in out and "boundary (7)" in out and "norm1 *" in out


def test_report_json_round_trips(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", TARGET, "--json"]) == 0
    plan = PrecisionPlan.from_json(capsys.readouterr().out)
    assert plan["head"].policy.output is not None and len(plan.boundaries) == 7


def test_report_default_and_file_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "model.py"
    script.write_text("from torch import nn\n\ndef make():\n    return nn.Linear(2, 2)\n")
    assert main(["report", f"{script}:make", "--default", "bf16-mixed", "--json"]) == 0
    plan = PrecisionPlan.from_json(capsys.readouterr().out)
    assert str(plan[""].policy) == "compute=bf16,storage=fp32,comm=fp32"


def test_export_deepspeed_to_a_file(tmp_path: Path) -> None:
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4}))
    out = tmp_path / "ds.json"
    assert main(["export", "deepspeed", TARGET, "--base", str(base), "-o", str(out)]) == 0
    config = json.loads(out.read_text())
    assert config["train_micro_batch_size_per_gpu"] == 4
    assert config["torch_autocast"]["dtype"] == "bfloat16"


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["report", "no_such_module_xyz:make"], "Cannot import 'no_such_module_xyz'"),
     (["report", "precision_annot._src.dtypes:dtype_name"], "Calling precision_annot._src.dtypes"),
     (["report", "precision_annot._src.dtypes:fp32"], "must return an nn.Module"),
     (["report", "precision_annot._src.demo_model"], "TARGET must be"),
     (["report", TARGET, "--default", "fp9"], "'fp9'"),
     (["export", "deepspeed", TARGET, "-o", "/nonexistent-dir/x/ds.json"], "Cannot write"),
     (["export", "deepspeed", TARGET, "--base", "/nonexistent.json"], "no file at")],
)
def test_errors_are_one_line_without_traceback(argv: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.splitlines()[-1].startswith("precision-annot: error:")


MYMOD = '''
from torch import nn
from precision_annot import Policy, precision, precision_scope


class Scaled(nn.Linear):
    pass


def make_model():
    with precision_scope(Policy(compute="bf16", storage="fp32", comm="bf16")):
        return nn.Sequential(nn.Embedding(16, 8), Scaled(8, 8), precision("fp32")(nn.LayerNorm(8)))
'''


@pytest.mark.slow  # over make test's budget: run by make test-all
def test_console_script_from_the_directory_of_the_model(tmp_path: Path) -> None:
    """0.1: `report mymod:make_model` failed with ModuleNotFoundError there, and
    `export deepspeed` wrote an empty lower_precision_safe_modules."""
    (tmp_path / "mymod.py").write_text(MYMOD)
    exe = str(Path(sys.executable).with_name("precision-annot"))

    def run(*argv: str) -> str:
        proc = subprocess.run([exe, *argv], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    (tmp_path / "plan.json").write_text(run("report", "mymod:make_model", "--json"))
    run("export", "deepspeed", "mymod:make_model", "-o", "from_model.json")
    run("export", "deepspeed", "plan.json", "-o", "from_plan.json")
    from_model = json.loads((tmp_path / "from_model.json").read_text())
    from_plan = json.loads((tmp_path / "from_plan.json").read_text())
    assert from_model == from_plan
    assert from_model["torch_autocast"]["lower_precision_safe_modules"] == [
        "mymod.Scaled", "torch.nn.modules.sparse.Embedding"]
    assert "Scaled" in run("report", "plan.json")

    # the Python API on the live model and on the loaded plan agree with the CLI
    import importlib

    from precision_annot.adapters import deepspeed as dsa

    sys.path.insert(0, str(tmp_path))
    sys.modules.pop("mymod", None)  # another test's mymod
    try:
        mymod = importlib.import_module("mymod")
        plan = resolve(mymod.make_model())
        assert dsa.to_config(plan) == from_model
        assert dsa.to_config(PrecisionPlan.from_json(plan.to_json())) == from_model
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("mymod", None)


def test_a_plan_file_target_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "precision_annot.plan", "version": 1, "modules": []}')
    assert main(["export", "deepspeed", str(bad)]) == 2
    assert "non-empty list" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    assert "Cannot read" in capsys.readouterr().err


SUGGEST_MODEL = '''
import torch
from torch import nn

class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.wi, self.wo = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        return self.wo(torch.relu(self.wi(x)) * 2.0 ** 16) / 2.0 ** 16

class Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 16)

    def forward(self, x):
        return self.lin(x) * 2.0 ** 32

def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), FeedForward(), nn.Linear(16, 4))

def make_root():
    return nn.Sequential(Root())[0]  # the overflow in the root's own code

def make_batch():
    return torch.randn(64, 8, generator=torch.Generator().manual_seed(0)) * 3

class Broken(nn.Linear):
    def forward(self, x):
        raise RuntimeError("the user's model is broken")

def make_broken():
    return Broken(8, 8)

def loss(output):
    return output.float().pow(2).mean()
'''


def test_suggest_writes_a_plan_the_other_commands_take(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    script = tmp_path / "sugmod.py"
    script.write_text(SUGGEST_MODEL)
    plan_path, png = tmp_path / "plan.json", tmp_path / "sensitivity.png"
    assert main(["suggest", f"{script}:make_model", "--sample", f"{script}:make_batch",
                 "--low", "fp16", "--tolerance", "1e-2", "--loss", f"{script}:loss",
                 "--out", str(plan_path), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "fp32 islands (1, " in out and "): 1\n" in out
    plan = PrecisionPlan.from_json(plan_path.read_text())
    assert plan["1"].policy.compute == torch.float32 and plan["0"].policy.compute == torch.float16
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["export", "deepspeed", str(plan_path)]) == 0  # fp32 island in fp16: mixed
    assert json.loads(capsys.readouterr().out)["torch_autocast"]["dtype"] == "float16"
    assert main(["suggest", f"{script}:make_root", "--sample", f"{script}:make_batch",
                 "--low", "fp16"]) == 1
    assert "No plan short of the whole model" in capsys.readouterr().out
    # a crash in the model is not "no plan met" (1) nor bad input (2)
    assert main(["suggest", f"{script}:make_broken", "--sample", f"{script}:make_batch"]) == 3
    err = capsys.readouterr().err
    assert "RuntimeError raised while running the command" in err
    assert "the user's model is broken" in err and "Traceback" in err


ISLANDS = '''
from torch import nn
from precision_annot import precision


def make():
    return nn.Sequential(nn.Linear(8, 8), precision("fp32")(nn.LayerNorm(8)), nn.Linear(8, 8))
'''


@pytest.mark.slow  # over make test's budget: run by make test-all
def test_check_exit_status_gates_on_errors(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`check` exits 1 when a finding is an error, 0 when there are only warnings and infos,
    2 for bad input: a CI job can gate on it."""
    (tmp_path / "islands.py").write_text(ISLANDS)
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2}}  // hjson comment')
    (tmp_path / "trainer.json").write_text('{"precision": "bf16-mixed"}')
    exe = str(Path(sys.executable).with_name("precision-annot"))

    def run(*argv: str) -> subprocess.CompletedProcess[str]:  # the installed command
        return subprocess.run([exe, "check", "islands:make", *argv], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)

    broken = run("--backend", "deepspeed", "--config", "ds.json", "--default", "16-mixed")
    assert broken.returncode == 1, broken.stderr
    lines = broken.stdout.splitlines()
    assert lines[0].startswith("error: (model): fp16 compute over fp32 storage")
    assert lines[0].endswith("[deepspeed-fp16-zero]")
    assert "1 error, 0 warnings, 0 infos (deepspeed)" in broken.stderr
    fine = run("--backend", "deepspeed", "--config", "ds.json", "--default", "bf16-mixed")
    assert fine.returncode == 0 and fine.stdout == "", fine.stdout + fine.stderr

    target = f"{tmp_path / 'islands.py'}:make"
    trainer = str(tmp_path / "trainer.json")
    capsys.readouterr()
    assert main(["check", target, "--backend", "lightning", "--config", trainer, "--json"]) == 1
    assert [f["code"] for f in json.loads(capsys.readouterr().out)] == ["lightning-no-plugin"]
    assert main(["check", target, "--backend", "fsdp", "--config", trainer]) == 2
    assert ("unknown key 'precision'; valid: ['units', 'merge_below', 'latency_s', 'bandwidth', "
            "'gradient_sync', 'grad_scaler', 'optimizer', 'fp8']") in capsys.readouterr().err
    for backend in ("deepspeed", "lightning"):  # a missing file is bad input, not a finding
        assert main(["check", target, "--backend", backend, "--config", "gone.json"]) == 2
        assert "--config: no file at 'gone.json'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # argparse names the valid choices
        main(["check", target, "--backend", "horovod"])
    assert exited.value.code == 2
    assert "invalid choice: 'horovod'" in capsys.readouterr().err


def test_check_json_lists_every_field(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", TARGET, "--backend", "fsdp", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert {f["code"] for f in found} == {"narrow-comm", "fsdp-small-units", "island-wide-output"}
    assert all(set(f) == {"severity", "code", "module", "message", "fix", "modules"}
               for f in found)


def test_a_file_target_imports_its_siblings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """0.2 put only the working directory on sys.path: `from blocks import ...` failed."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "blocks_for_cli.py").write_text("from torch import nn\n\n"
                                              "def block():\n    return nn.Linear(2, 2)\n")
    (folder / "net.py").write_text("from blocks_for_cli import block\n\n"
                                   "def make():\n    return block()\n")
    assert main(["report", f"{folder / 'net.py'}:make", "--default", "bf16"]) == 0
    assert "Linear" in capsys.readouterr().out


@pytest.mark.slow  # over make test's budget: run by make test-all
def test_a_closed_pipe_ends_quietly_and_version(tmp_path: Path) -> None:
    (tmp_path / "wide.py").write_text(
        "from torch import nn\n\ndef many():\n"
        "    return nn.Sequential(*[nn.ReLU() for _ in range(4000)])\n")
    run = subprocess.run(f"{sys.executable} -m precision_annot report wide.py:many | head -1",
                         shell=True, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.stdout.startswith("module") and "Traceback" not in run.stderr, run.stderr
    version = subprocess.run([sys.executable, "-m", "precision_annot", "--version"],
                             capture_output=True, text=True, timeout=120)
    assert version.stdout.strip() == f"precision-annot {precision_annot.__version__}"


def test_export_reminds_that_prepare_is_needed(capsys: pytest.CaptureFixture[str]) -> None:
    """0.2 wrote the config alone: without prepare(model), ZeRO-2 ran 26 modules unlike the
    plan, silently."""
    assert main(["export", "deepspeed", TARGET]) == 0
    captured = capsys.readouterr()
    assert "torch_autocast" in json.loads(captured.out)
    assert "deepspeed.prepare(model) before deepspeed.initialize" in captured.err


def test_check_takes_an_inline_config_with_units(capsys: pytest.CaptureFixture[str]) -> None:
    """0.2 read --config only as a file, and refused units for a model target (exit 2)."""
    assert main(["check", TARGET, "--backend", "fsdp", "--config",
                 '{"units": ["blocks.*"], "merge_below": 0.01}']) == 0
    assert main(["check", TARGET, "--backend", "fsdp", "--config", '{"units": [']) == 2
    assert "--config: not a JSON object" in capsys.readouterr().err


def test_check_reads_a_checkpoint_before_it_is_loaded(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """`--backend checkpoint`: the checkpoint's path as --config (or '{"path": ...}'), a plan
    file or a model as the target; a bf16 checkpoint of the fp32 norm is an error (exit 1)."""
    (tmp_path / "islands.py").write_text(ISLANDS)
    target = f"{tmp_path / 'islands.py'}:make"
    from torch import nn

    from precision_annot import precision

    model = nn.Sequential(nn.Linear(8, 8), precision("fp32")(nn.LayerNorm(8)), nn.Linear(8, 8))
    plan = resolve(model, "bf16-true")
    (tmp_path / "plan.json").write_text(plan.to_json())
    own = {k: v.to(plan[k.rpartition(".")[0]].policy.storage) for k, v in
           model.state_dict().items()}
    torch.save(own, tmp_path / "own.pt")
    torch.save({k: v.bfloat16() for k, v in model.state_dict().items()}, tmp_path / "bf16.pt")
    capsys.readouterr()
    assert main(["check", str(tmp_path / "plan.json"), "--backend", "checkpoint", "--config",
                 str(tmp_path / "bf16.pt")]) == 1
    out = capsys.readouterr().out.splitlines()
    assert [line.rsplit("[", 1)[1] for line in out] == ["checkpoint-narrowed]"] * 2
    assert "'1.weight' in bf16, and the plan keeps it in fp32" in out[0]
    config = json.dumps({"path": str(tmp_path / "own.pt")})
    assert main(["check", target, "--default", "bf16-true", "--backend", "checkpoint",
                 "--config", config]) == 0
    assert capsys.readouterr().out == ""


def test_check_tp_from_the_command_line_names_its_styles(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """0.4 gave `check --backend tp` the plan of a model it had already dropped ("this plan
    holds none"), and JSON cannot hold torch's ParallelStyle objects: the command could never
    check a TP plan. Styles are named as in the Python API's classes or their short names."""
    (tmp_path / "islands.py").write_text(ISLANDS)
    target = f"{tmp_path / 'islands.py'}:make"
    config = json.dumps({"parallelize_plan": {"0": "colwise", "2": "RowwiseParallel",
                                              "nope": "colwise"}, "tp_degree": 2})
    assert main(["check", target, "--default", "bf16-true", "--backend", "tp", "--config",
                 config, "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    # 'nope' is like no module's name: skipped, nothing it could mean runs unsharded
    assert [(f["severity"], f["code"]) for f in found if f["code"].startswith("tp-")] == [
        ("info", "tp-plan-unmatched")]
    bad = json.dumps({"parallelize_plan": {"0": "diagonal"}})
    assert main(["check", target, "--backend", "tp", "--config", bad]) == 2
    assert "parallelize_plan['0'] names a TP style" in capsys.readouterr().err


def test_check_of_a_broken_or_foreign_checkpoint_exits_as_its_findings_say(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A corrupt checkpoint is bad input (exit status 2, one line; 0.4: exit status 3 and a
    traceback from json/pickle); an optimizer's state dict is an error found (exit status 1;
    0.4: two warnings, exit status 0)."""
    (tmp_path / "islands.py").write_text(ISLANDS)
    target = f"{tmp_path / 'islands.py'}:make"
    (tmp_path / "bad.safetensors").write_bytes((2**62).to_bytes(8, "little") + b"{}")
    linear = torch.nn.Linear(2, 2)
    adam = torch.optim.Adam(linear.parameters())
    linear(torch.ones(2)).sum().backward()
    adam.step()
    torch.save(adam.state_dict(), tmp_path / "optim.pt")
    capsys.readouterr()
    assert main(["check", target, "--backend", "checkpoint", "--config",
                 str(tmp_path / "bad.safetensors")]) == 2
    assert "is not a safetensors file" in capsys.readouterr().err
    assert main(["check", target, "--backend", "checkpoint", "--config",
                 str(tmp_path / "optim.pt")]) == 1
    assert "[checkpoint-foreign]" in capsys.readouterr().out


def test_check_of_a_hostile_checkpoint_is_exit_status_2_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/checkpoints.md promises a ValueError naming the file, exit status 2: 0.5 exited 3
    with a traceback on a shard that is a symlink loop (OSError), a record declaring 2^40 bytes
    (MemoryError) and DCP metadata whose entry has no properties (AttributeError)."""
    import pickle
    import struct
    import zipfile

    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    (tmp_path / "islands.py").write_text(ISLANDS)
    target = f"{tmp_path / 'islands.py'}:make"
    (tmp_path / "loop").mkdir()
    (tmp_path / "loop" / "a.safetensors").symlink_to("a.safetensors")
    with zipfile.ZipFile(tmp_path / "declared.pt", "w") as archive:
        archive.writestr("declared/data.pkl", b"\x80\x04\x8e" + struct.pack("<Q", 2**40) + b".")
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={
        "w": TensorStorageMetadata(properties=None, size=torch.Size([2]), chunks=[])})))
    for path, named in [(tmp_path / "loop", tmp_path / "loop" / "a.safetensors"),
                        (tmp_path / "declared.pt", tmp_path / "declared.pt"),
                        (tmp_path / "dcp", tmp_path / "dcp" / ".metadata")]:
        capsys.readouterr()
        assert main(["check", target, "--backend", "checkpoint", "--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.splitlines()[-1].startswith(
            f"precision-annot: error: checkpoint: {str(named)!r} "), err


def test_check_of_a_peft_adapter_names_its_loader_without_an_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """0.5: checkpoint-foreign, exit status 1, on an adapter PeftModel.from_pretrained loads."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    (tmp_path / "islands.py").write_text(ISLANDS)
    target = f"{tmp_path / 'islands.py'}:make"
    from torch import nn

    base = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8))
    get_peft_model(base, LoraConfig(r=2, target_modules=["0", "2"])).save_pretrained(
        str(tmp_path / "adapter"))
    capsys.readouterr()
    assert main(["check", target, "--backend", "checkpoint", "--config",
                 str(tmp_path / "adapter")]) == 0
    out = capsys.readouterr().out
    assert "PeftModel.from_pretrained" in out and out.rstrip().endswith("[checkpoint-adapter]")
