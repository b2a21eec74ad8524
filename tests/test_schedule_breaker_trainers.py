"""`precision_annot.schedule` in the trainers users run it in (the Hugging Face Trainer's
`schedule_callback`, Lightning's `ScheduleCallback`, Fabric, Accelerate), against the same schedule
in a plain loop (which tests/test_schedule.py shows equals the switch written by hand). Each
test was a defect found by breaking them, and failed before its fix (0.7.0's changelog says
what each was)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import precision_annot as pa
from tests.test_schedule import _hf_model, _Tokens

BF16, FP32 = torch.bfloat16, torch.float32
NARROWER = r"narrower than the plan keeps them"


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def _batches(n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, first: nn.Module) -> torch.Tensor:
    return (model(x.to(first.weight.dtype)).float() - y).pow(2).mean()


def _plain(phases: dict[int | float, Any], steps: int = 8) -> tuple[nn.Module, list[float]]:
    """The schedule in a plain loop: the reference each trainer is held to."""
    model = _net()
    opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-2)
    sched = pa.schedule(model, phases, optimizer=opt)
    losses = []
    for x, y in _batches(steps):
        loss = _loss(model, x, y, model[0])
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, losses


def _equal(model: nn.Module, other: nn.Module) -> None:
    for (name, a), b in zip(model.named_parameters(), other.parameters(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def _ours(said: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in said if "precision_annot" in w.filename
            or "schedule" in str(w.message) or "narrower" in str(w.message)
            or "phase" in str(w.message)]


# -- the Hugging Face Trainer -------------------------------------------------------------------

def _hf_trainer(out: Path, phases: dict[int | float, Any], *, give_optimizer: bool = True,
                data: Any = None, **kwargs: Any) -> tuple[nn.Module, Any, Any]:
    """A Trainer (constant lr, no clipping, no weight decay) with the schedule's callback."""
    from transformers import Trainer, TrainingArguments

    from precision_annot.adapters.transformers import schedule_callback

    hf = _hf_model()
    opt = pa.optimizer(hf, torch.optim.AdamW, lr=1e-2, weight_decay=0.0) if give_optimizer \
        else None
    args = TrainingArguments(**{
        "output_dir": str(out), "per_device_train_batch_size": 1, "report_to": [],
        "lr_scheduler_type": "constant", "learning_rate": 1e-2, "weight_decay": 0.0,
        "max_grad_norm": 0.0, "save_strategy": "no", "use_cpu": True, "disable_tqdm": True,
        "optim": "adamw_torch", **kwargs})
    data = _Tokens() if data is None else data
    trainer = Trainer(model=hf, args=args, train_dataset=data, eval_dataset=data,
                      optimizers=(opt, None))
    return hf, trainer, lambda: schedule_callback(trainer, phases)


@pytest.mark.parametrize("phases", [
    pytest.param({0: "32-true", 4: "bf16-master"}, marks=pytest.mark.slow),  # over budget
    {0: "32-true", 3: "bf16-true"}])
def test_hf_an_optimizer_the_trainer_builds_is_refused_before_the_first_step(
        tmp_path: Path, phases: dict[int | float, Any]) -> None:
    _, trainer, callback = _hf_trainer(tmp_path, phases, give_optimizer=False, max_steps=6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises((ValueError, RuntimeError)) as refused:
            callback()
            trainer.train()
    assert trainer.state.global_step == 0, "refused only at the switch, steps into the run"
    assert "optimizers=" in str(refused.value)


def test_hf_fractions_with_num_train_epochs_switch_or_name_max_steps(tmp_path: Path) -> None:
    _, trainer, callback = _hf_trainer(tmp_path, {0: "bf16-master", 0.5: "32-true"},
                                       data=_Tokens(4), num_train_epochs=2)
    try:
        cb = callback()
    except ValueError as e:
        assert "max_steps" in str(e) and "num_train_epochs" in str(e), str(e)
        return
    trainer.train()
    assert cb.schedule.switches == [4] and [s.step for s in cb.schedule.history] == [4]


@pytest.mark.slow  # over make test's budget: run by make test-all
def test_hf_a_resume_without_optimizer_state_after_a_switch_says_the_masters_are_lost(
        tmp_path: Path) -> None:
    phases: dict[int | float, Any] = {0: "32-true", 3: "bf16-master"}
    _, trainer, callback = _hf_trainer(tmp_path / "a", phases, max_steps=5,
                                       save_strategy="steps", save_steps=4,
                                       save_only_model=True)
    callback()
    trainer.train()
    assert not (tmp_path / "a" / "checkpoint-4" / "optimizer.pt").exists()
    _, trainer, callback = _hf_trainer(tmp_path / "b", phases, max_steps=6)
    cb = callback()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))
    assert cb.schedule.step_count == 6 and cb.schedule.phase == 1
    assert any("narrower" in s for s in _ours(said)), _ours(said)


@pytest.mark.slow  # over make test's budget: run by make test-all
def test_hf_load_best_model_at_end_from_another_phase_is_said(tmp_path: Path) -> None:
    _, trainer, callback = _hf_trainer(
        tmp_path, {0: "bf16-master", 3: "32-true"}, max_steps=5, save_strategy="steps",
        save_steps=1, eval_strategy="steps", eval_steps=1, load_best_model_at_end=True,
        metric_for_best_model="eval_loss", greater_is_better=True)  # the first is the best
    cb = callback()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer.train()
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-1")
    assert cb.schedule.phase == 1
    assert any("narrower" in s or "master" in s for s in _ours(said)), _ours(said)


# -- Lightning ----------------------------------------------------------------------------------

L = pytest.importorskip("lightning")
from precision_annot.adapters.lightning import (  # noqa: E402
    AnnotatedPrecision,
    ScheduleCallback,
)

QUIET = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_progress_bar": False,
         "enable_model_summary": False}


def _loader() -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    (x, y), = _batches(1)  # one batch, repeated: a mid-epoch resume sees the same data
    return DataLoader(TensorDataset(x.repeat(8, 1), y.repeat(8, 1)), batch_size=8)


class _Module(L.LightningModule):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()
        self.vals: list[tuple[int, float]] = []
        self.seen: list[tuple[bool, torch.dtype]] = []
        self.net[0].register_forward_hook(
            lambda m, a, o: self.seen.append((torch.is_grad_enabled(), a[0].dtype)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return _loss(self.net, *batch, self.net[0])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss = _loss(self.net, *batch, self.net[0])
        self.vals.append((self.global_step, loss.item()))
        self.log("val", loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return pa.optimizer(self.net, torch.optim.AdamW, lr=1e-2)


def test_lightning_validate_from_a_checkpoint_of_another_phase(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    module, callback = _Module(), ScheduleCallback({0: "bf16-master", 4: "32-true"})
    saving = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1,
                             filename="{step}")
    trainer = L.Trainer(max_steps=6, callbacks=[saving, callback], val_check_interval=1,
                        limit_val_batches=1, num_sanity_val_steps=0, **QUIET)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers
        trainer.fit(module, _loader(), _loader())
    logged = dict(module.vals)[3]
    module.vals = []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer.validate(module, _loader(), ckpt_path=tmp_path / "step=3.ckpt", verbose=False)
    assert module.vals[0][1] == logged or _ours(said), (module.vals, logged)


def test_lightning_a_plugin_default_beside_the_phases_is_refused_or_said() -> None:
    module = _Module()
    trainer = L.Trainer(max_steps=6, callbacks=[ScheduleCallback({0: "32-true",
                                                                  4: "bf16-master"})],
                        plugins=[AnnotatedPrecision(default="bf16-true")],
                        enable_checkpointing=False, **QUIET)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            trainer.fit(module, _loader())
        except ValueError as e:
            assert "default" in str(e)
            return
    assert [d for _, d in module.seen] == [FP32] * 4 + [BF16] * 2  # the phases run
    assert any("default" in str(w.message) for w in said), _ours(said)


def test_fabric_a_schedule_on_the_set_up_optimizer_equals_the_plain_loop() -> None:
    from lightning.fabric import Fabric

    phases: dict[int | float, Any] = {0: "bf16-master", 4: "32-true"}
    fabric = Fabric(accelerator="cpu", devices=1)
    raw = _net()
    model, opt = fabric.setup(raw, pa.optimizer(raw, torch.optim.AdamW, lr=1e-2))
    sched = pa.schedule(model, phases, optimizer=opt)
    losses = []
    for x, y in _batches():
        loss = _loss(model, x, y, raw[0])
        losses.append(loss.item())
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        sched.step()
    plain, plain_losses = _plain(phases)
    assert losses == plain_losses
    _equal(raw, plain)


# -- Accelerate ---------------------------------------------------------------------------------

@pytest.mark.parametrize("phases", [{0: "32-true", 4: "bf16-master"},
                                    {0: "bf16-master", 4: "32-true"}])
def test_accelerate_bf16_mixed_precision_with_a_schedule_built_after_prepare(
        phases: dict[int | float, Any]) -> None:
    """Accelerator(mixed_precision='bf16') wraps the prepared model's forward in autocast,
    which a plan applied after it does not take back (measured: the fp32 phases computed in
    bf16, weights up to 0.0203 from the plain loop): the schedule is refused there, naming
    the order that works; built before prepare, the run equals the plain loop bit for bit."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    try:
        accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
        raw = _net()
        opt = pa.optimizer(raw, torch.optim.AdamW, lr=1e-2)
        model, prepared = accelerator.prepare(raw, opt)
        with pytest.raises(ValueError, match=r"before accelerator.prepare"):
            pa.schedule(model, phases, optimizer=prepared)
        AcceleratorState._reset_state(True)
        accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
        raw = _net()
        opt = pa.optimizer(raw, torch.optim.AdamW, lr=1e-2)
        sched = pa.schedule(raw, phases, optimizer=opt)
        model, opt = accelerator.prepare(raw, opt)
        losses = []
        for x, y in _batches():
            loss = _loss(model, x, y, raw[0])
            losses.append(loss.item())
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            sched.step()
    finally:
        AcceleratorState._reset_state(True)
    plain, plain_losses = _plain(phases)
    assert losses == plain_losses
    _equal(raw, plain)
