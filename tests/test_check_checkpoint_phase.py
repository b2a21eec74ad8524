"""`check(model, "checkpoint", ...)` says which phase of a precision schedule a checkpoint holds:
checkpoints written by real scheduled runs (a plain loop's `torch.save`, the Hugging Face
Trainer's `checkpoint-N` folder, a Lightning `.ckpt`, DCP), read without their tensor data."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import precision_annot as pa
from precision_annot._src.checkpoints.phases import schedule_state
from precision_annot._src.cli import main
from tests.test_schedule import _hf_model, _Tokens

PHASES: dict[int | float, Any] = {0: "bf16-master", 4: "32-true"}
LISTED = "its phases: 0: 'bf16-master' from step 0, 1: '32-true' from step 4."


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))


def _train(model: nn.Module, opt: Any, sched: Any, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)
        loss = (model(x.to(model[0].weight.dtype)).float() - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def _scheduled(steps: int) -> tuple[nn.Module, Any, Any]:
    model = _model()
    opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-2)
    sched = pa.schedule(model, PHASES, optimizer=opt)
    _train(model, opt, sched, steps)
    return model, opt, sched


def _fresh(phase: int = 0) -> nn.Module:
    """The model in `phase`'s plan, as a resumed run holds it (phase 0 when it is built)."""
    return pa.apply(_model(), default=list(PHASES.values())[phase])


def _phase(found: list[pa.Finding]) -> list[str]:
    return [f.message for f in found if f.code == "checkpoint-phase"]


@pytest.mark.parametrize(("steps", "phase", "spec", "start"), [
    (2, 0, "bf16-master", 0), (5, 1, "32-true", 4)])
def test_a_plain_loops_checkpoint_names_its_step_phase_and_spec(
        tmp_path: Path, steps: int, phase: int, spec: str, start: int) -> None:
    model, opt, _ = _scheduled(steps)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "c.pt")
    found = pa.check(_fresh(phase), "checkpoint", {"path": tmp_path / "c.pt"})
    [said] = _phase(found)
    assert said == (
        f"The checkpoint '{tmp_path / 'c.pt'}' was saved at step {steps} in phase {phase} of a "
        f"precision schedule (from step {start}: {spec!r}), as '{tmp_path / 'c.pt'}' under "
        f"key 'optimizer.precision_annot_schedule' says; {LISTED}")
    assert [f.severity for f in found if f.code == "checkpoint-phase"] == ["info"]
    # the model in the phase saved: the rest of the check is clean, nothing about the plan
    assert [f.code for f in found if f.severity != "info"] == []


def test_a_model_in_another_phase_is_told_the_plan_checked_is_not_the_checkpoints(
        tmp_path: Path) -> None:
    """Saved after the switch to fp32 (bf16 masters dropped), checked against the model as a
    resumed run first builds it (phase 0, bf16 with fp32 masters)."""
    model, opt, _ = _scheduled(5)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "c.pt")
    found = pa.check(_fresh(0), "checkpoint", {"path": tmp_path / "c.pt"})
    [phase] = [f for f in found if f.code == "checkpoint-phase"]
    assert "in phase 1 of a precision schedule (from step 4: '32-true')" in phase.message
    assert re.search(r"The plan checked is not that phase's: 4 module\(s\) \('\(root\)', '0', "
                     r"'1' and '2'\) hold another policy \(the first 'compute=bf16,storage=bf16,"
                     r"comm=bf16,master=fp32,grad=fp32', the phase's 'compute=fp32,"
                     r"storage=fp32,comm=fp32'\)", phase.message), phase.message
    assert "check resolve(model, default='32-true')" in phase.fix
    # given the plan alone (no model to resolve the phase on), the phase is said, no more
    [alone] = _phase(pa.check(pa.resolve(_model(), "bf16-master"), "checkpoint",
                              {"path": tmp_path / "c.pt"}))
    assert "not that phase's" not in alone


def test_the_optimizers_own_file_and_a_schedule_saved_under_its_own_key(tmp_path: Path
                                                                        ) -> None:
    model, opt, sched = _scheduled(5)
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    found = pa.check(_fresh(1), "checkpoint", {"path": tmp_path / "optimizer.pt"})
    assert [f.code for f in found] == ["checkpoint-foreign", "checkpoint-phase"]
    assert "at step 5 in phase 1" in found[1].message
    assert "under key 'precision_annot_schedule' says" in found[1].message
    torch.save({"schedule": sched.state_dict(), "model": model.state_dict()}, tmp_path / "s.pt")
    [said] = _phase(pa.check(_fresh(1), "checkpoint", {"path": tmp_path / "s.pt"}))
    assert "at step 5 in phase 1" in said and "under key 'schedule' says" in said and LISTED in said


def test_a_checkpoint_without_a_schedule_has_no_phase(tmp_path: Path) -> None:
    model = pa.apply(_model(), default="bf16-master")
    opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-2)
    _train(model, opt, None, 3)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "c.pt")
    torch.save(model.state_dict(), tmp_path / "m.pt")
    for name in ("c.pt", "m.pt"):
        assert _phase(pa.check(model, "checkpoint", {"path": tmp_path / name})) == []


@pytest.mark.parametrize("value", [
    {"step": 5, "phase": 2, "phase_start": 4, "phases": [[0, "bf16"], [4, "fp32"]]},
    {"step": 5, "phase": 1, "phase_start": 3, "phases": [[0, "bf16"], [4, "fp32"]]},
    {"step": -1, "phase": 0, "phase_start": 0, "phases": [[0, "bf16"]]},
    {"step": 5, "phase": 0, "phase_start": 0, "phases": [[0, 1]]},
    {"step": 5, "phase": 0, "phase_start": 0},
])
def test_what_only_looks_like_a_schedules_state_is_none(value: dict[str, Any]) -> None:
    assert schedule_state(value, "x") is None
    good = {"step": 5, "phase": 1, "phase_start": 4, "phases": [[0, "bf16"], [4, "fp32"]]}
    assert schedule_state(good, "x") is not None


def test_a_dcp_checkpoint_holding_the_optimizers_state_dict(tmp_path: Path) -> None:
    """DCP saves the schedule's numbers as bytes beside the tensors: read from their bytes.
    DCP's own get_state_dict keeps only the optimizer's state and groups: no phase."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt, _ = _scheduled(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: one rank
        dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                 checkpoint_id=tmp_path / "plain")
        weights, state = get_state_dict(model, opt)
        dcp.save({"model": weights, "optim": state}, checkpoint_id=tmp_path / "dcp")
    [said] = _phase(pa.check(_fresh(1), "checkpoint", {"path": tmp_path / "plain"}))
    assert (f"was saved at step 5 in phase 1 of a precision schedule (from step 4: '32-true'), "
            f"as '{tmp_path / 'plain'}' under key 'optimizer.precision_annot_schedule' says; "
            f"{LISTED}") in said
    assert _phase(pa.check(_fresh(1), "checkpoint", {"path": tmp_path / "dcp"})) == []


def test_the_hf_trainers_checkpoint_folder_names_its_phase_and_its_masters(
        tmp_path: Path) -> None:
    """`checkpoint-N/` holds the weights (model.safetensors) and, beside them, optimizer.pt:
    the phase and the fp32 masters are read from it (before, the folder's masters were not
    read, and a bf16-master checkpoint was a checkpoint-no-masters warning)."""
    from transformers import Trainer, TrainingArguments

    from precision_annot.adapters.transformers import schedule_callback

    hf = _hf_model()
    opt = pa.optimizer(hf, torch.optim.AdamW, lr=1e-2)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=6, save_steps=2,
                             per_device_train_batch_size=1, report_to=[], use_cpu=True,
                             disable_tqdm=True)
    trainer = Trainer(model=hf, args=args, train_dataset=_Tokens(), optimizers=(opt, None))
    schedule_callback(trainer, {0: "bf16-master", 3: "32-true"})
    trainer.train()
    fresh = _hf_model()
    pa.schedule(fresh, {0: "bf16-master", 3: "32-true"},
                optimizer=pa.optimizer(fresh, torch.optim.AdamW))  # phase 0, as a resume builds it
    folder = tmp_path / "checkpoint-2"
    found = pa.check(fresh, "checkpoint", {"path": folder})
    assert [(f.severity, f.code) for f in found] == [
        ("info", "checkpoint-masters-by-index"), ("info", "checkpoint-phase")]
    assert "12 master copies keyed by the optimizer's parameter index" in found[0].message
    assert found[1].message == (
        f"The checkpoint '{folder}' was saved at step 2 in phase 0 of a precision schedule "
        f"(from step 0: 'bf16-master'), as '{folder / 'optimizer.pt'}' under key "
        "'precision_annot_schedule' says; its phases: 0: 'bf16-master' from step 0, 1: '32-true' "
        "from step 3.")
    fresh = pa.apply(_hf_model(), default="32-true")  # phase 1, as a resume from step 4 goes
    found = pa.check(fresh, "checkpoint", {"path": tmp_path / "checkpoint-4"})
    assert [(f.severity, f.code) for f in found] == [("info", "checkpoint-phase")]
    assert "at step 4 in phase 1 of a precision schedule (from step 3: '32-true')" in \
        found[0].message and "not that phase's" not in found[0].message
    # the model's weights file alone: the phase is not in it
    assert _phase(pa.check(fresh, "checkpoint", {"path": tmp_path / "checkpoint-4" /
                                                 "model.safetensors"})) == []


def test_a_lightning_checkpoint_names_its_phase_once(tmp_path: Path) -> None:
    """A real fit with `ScheduleCallback`, saved with `trainer.save_checkpoint`: the phase is
    held twice (the optimizer's state, the callback's), and said once."""
    L = pytest.importorskip("lightning")
    from precision_annot.adapters.lightning import ScheduleCallback

    class Module(L.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return (self.net(x.to(self.net[0].weight.dtype)).float() - y).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return pa.optimizer(self.net, torch.optim.AdamW, lr=1e-2)

    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 16, generator=g),
                                          torch.randn(8, 4, generator=g))
    trainer = L.Trainer(max_steps=5, callbacks=[ScheduleCallback(PHASES)], accelerator="cpu",
                        devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers and logging
        trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=4))
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    module = Module()
    pa.apply(module, default="32-true")  # the phase it was saved in
    found = pa.check(module, "checkpoint", {"path": tmp_path / "last.ckpt"})
    assert [f.code for f in found] == ["checkpoint-phase"]
    ckpt = tmp_path / "last.ckpt"
    assert found[0].message == (
        f"The checkpoint '{ckpt}' was saved at step 5 in phase 1 of a precision schedule "
        f"(from step 4: '32-true'), as '{ckpt}' under keys 'callbacks.ScheduleCallback' and "
        f"'optimizer_states.0.precision_annot_schedule' says; {LISTED}")


MODEL = """
import torch
from torch import nn

def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
"""


def test_the_command_line_prints_the_phase(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "mod.py").write_text(MODEL)
    model, opt, _ = _scheduled(2)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "c.pt")
    capsys.readouterr()
    assert main(["check", f"{tmp_path / 'mod.py'}:make", "--default", "bf16-master",
                 "--backend", "checkpoint", "--config", str(tmp_path / "c.pt")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.rsplit("[", 1)[1] for line in out] == ["checkpoint-masters-by-index]",
                                                        "checkpoint-phase]"]
    assert "saved at step 2 in phase 0 of a precision schedule (from step 0: 'bf16-master')" \
        in out[1]
