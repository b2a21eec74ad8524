"""`WatchCallback`: `watch` in a real Trainer, its numbers read back from the CSV logger."""

from __future__ import annotations

import csv
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from precision_annot import applied_plan, fp16, fp32
from precision_annot._src.watching import report

L = pytest.importorskip("lightning")
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from precision_annot.adapters.lightning import AnnotatedPrecision, WatchCallback  # noqa: E402
from tests.adapters.lightning.models import QUIET, Net, data  # noqa: E402


def test_watch_callback_logs_each_modules_margin_and_the_scalers_skips(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net(inf_at=3)  # the loss at step 3 is inf: the GradScaler skips that step
    callback = WatchCallback(every=2, path=tmp_path / "watch.jsonl")
    quiet = {k: v for k, v in QUIET.items() if k != "logger"}
    trainer = L.Trainer(max_steps=8, plugins=[AnnotatedPrecision(default="16-mixed")],
                        callbacks=[callback], logger=CSVLogger(tmp_path, name="run"),
                        log_every_n_steps=1, enable_checkpointing=False, **quiet)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data())
    said = [str(c.message) for c in caught if "watch:" in str(c.message)]
    w = callback.watch
    assert w is not None and [r.step for r in w.history] == [0, 2, 4, 6]
    # what each module's forward handed on: the fp32 island computes in fp32 and hands back
    # to its fp16 caller, as the plan says when it names no output dtype
    first, plan = w.history[0], applied_plan(model)
    assert plan is not None and plan["norm"].policy.compute == fp32
    assert plan["norm"].policy.output is None
    assert [first.outputs[n].dtype for n in ("fc1", "norm", "fc2")] == [fp16, fp16, fp16]
    assert first.grads["fc1"].dtype == fp16
    assert len(model.fc1._forward_hooks) == 0  # closed at the end
    assert not said  # the scaler's gradients are its own to keep in range: nothing to say
    rows = list(csv.DictReader((Path(trainer.logger.log_dir) / "metrics.csv").open()))
    logged = [r for r in rows if r.get("precision/fc1/out_amax")]
    assert [int(r["step"]) for r in logged] == [0, 2, 4, 6]
    for row, record in zip(logged, w.history, strict=True):
        assert float(row["precision/fc1/out_amax"]) == pytest.approx(
            record.outputs["fc1"].amax, rel=1e-6)
        assert float(row["precision/norm/out_margin"]) == pytest.approx(
            record.outputs["norm"].margin, rel=1e-6, abs=1e-12)
    # the steps the GradScaler skipped (those that left the weights as they were: the first
    # ones, while its scale comes down from 2**16, and step 3) as the records count them
    snaps = model.snapshots
    skipped = [k for k in range(7) if all(torch.equal(a, b) for a, b in
                                           zip(snaps[k], snaps[k + 1], strict=True))]
    assert 3 in skipped
    assert [float(r["precision/skipped"]) for r in logged] == [
        float(sum(k <= step for k in skipped)) for step in (0, 2, 4, 6)]
    assert float(logged[2]["precision/scale"]) < float(logged[0]["precision/scale"])
    assert len((tmp_path / "watch.jsonl").read_text().splitlines()) == 4


class Validated(Net):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x * 50).float(), y.float()))


def test_watch_callback_samples_training_batches_not_the_validation_between_epochs(
        tmp_path: Path) -> None:
    """Lightning validates at each epoch's end, under inference_mode: 0.4 recorded that
    forward in the next sampled step, which then held 0 of its 4 gradient rows."""
    torch.manual_seed(0)
    model = Validated()
    callback = WatchCallback(every=1)
    trainer = L.Trainer(max_epochs=2, plugins=[AnnotatedPrecision(default="bf16-true")],
                        callbacks=[callback], enable_checkpointing=False,
                        num_sanity_val_steps=0, **QUIET)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, data(), data())
    w = callback.watch
    assert w is not None and [r.step for r in w.history] == list(range(8))
    assert [len(r.grads) for r in w.history] == [4] * 8  # 0.4: [4, 4, 4, 4, 0, 4, 4, 4]
    for record in w.history:
        assert set(record.grads) == set(record.outputs) == {"fc1", "norm", "fc2", ""}
        assert all(s.tensors == 1 for s in record.outputs.values())


def test_a_fit_resumed_from_a_checkpoint_goes_on_counting_its_steps(tmp_path: Path) -> None:
    """0.4 counted from 0 again after a resume: a run stopped after 5 batches and resumed to
    10 wrote steps [0, 3, 0, 3] to its file (watch-report: 2 sampled steps for 4) and logged
    them back in time; the batches sampled were 5 and 8, not 6 and 9."""
    torch.manual_seed(0)
    path = tmp_path / "watch.jsonl"

    def fit(max_steps: int, ckpt: str | None = None) -> tuple[Any, WatchCallback]:
        callback = WatchCallback(every=3, path=path)
        trainer = L.Trainer(max_steps=max_steps, plugins=[AnnotatedPrecision(default="bf16-true")],
                            callbacks=[callback], default_root_dir=tmp_path,
                            **{k: v for k, v in QUIET.items() if k != "logger"},
                            logger=CSVLogger(tmp_path, name="run", version=max_steps))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(Net(), data(), ckpt_path=ckpt)
        return trainer, callback

    first, _ = fit(5)
    _, resumed = fit(10, first.checkpoint_callback.best_model_path)
    assert resumed.watch is not None and [r.step for r in resumed.watch.history] == [6, 9]
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 3, 6, 9]
    assert report(path).startswith("4 sampled steps")
    rows = list(csv.DictReader((tmp_path / "run" / "version_10" / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows if r.get("precision/fc1/out_amax")] == [6, 9]


@pytest.mark.slow  # 6 s (compiling); tests/test_watching.py shows watch on compiled models
def test_a_compiled_lightning_module_runs_its_sampled_batches_eager() -> None:
    """`trainer.fit(torch.compile(model))`: compiled code runs no module hook, and 0.4 raised
    after the first batch with a fix a Lightning user cannot apply. The sampled batches run
    Lightning's own uncompiled methods; the others stay compiled."""
    torch.manual_seed(0)
    model = Net()
    callback = WatchCallback(every=2)
    trainer = L.Trainer(max_steps=4, plugins=[AnnotatedPrecision(default="bf16-true")],
                        callbacks=[callback], enable_checkpointing=False, **QUIET)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(torch.compile(model, backend="eager"), data())
    w = callback.watch
    assert w is not None and [r.step for r in w.history] == [0, 2]
    for record in w.history:
        assert set(record.grads) == set(record.outputs) == {"fc1", "norm", "fc2", ""}
    ctx = model._compiler_ctx
    assert ctx is not None and model.training_step is not ctx["original_training_step"]
    assert model.forward is not ctx["original_forward"]  # compiled again after the batch


class Crashing(Net):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 2:
            raise RuntimeError("a bad batch")
        return super().training_step(batch, batch_idx)


def test_a_fit_that_raises_leaves_no_watch_hooks_on_the_model(tmp_path: Path) -> None:
    """0.4 closed the watch at on_train_end only: after a fit that raised, the sampled step's
    hooks stayed on the model and recorded every later forward (a notebook's next fit)."""
    model = Crashing()
    callback = WatchCallback(every=1, path=tmp_path / "watch.jsonl")
    trainer = L.Trainer(max_steps=4, plugins=[AnnotatedPrecision(default="bf16-true")],
                        callbacks=[callback], enable_checkpointing=False, **QUIET)
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="a bad batch"):
        warnings.simplefilter("ignore")
        trainer.fit(model, data())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert callback.watch is not None and callback.watch._file is None
