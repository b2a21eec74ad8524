"""`precision_annot.schedule`: a plan that changes at chosen steps, against the same switch
written by hand (Apex-O2-style fp32 masters, then fp32 weights, or the reverse), a resume across
a switch, the Hugging Face Trainer, and the errors."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import precision_annot as pa

STEPS = 10


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
            for _ in range(STEPS)]


def _scheduled(phases: dict[int | float, Any], *, stop: int = STEPS,
               resume: dict[str, Any] | None = None
               ) -> tuple[nn.Module, list[float], list[torch.dtype], dict[str, Any]]:
    model = _model()
    opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-2)
    sched = pa.schedule(model, phases, optimizer=opt, total_steps=STEPS)
    start = 0
    if resume is not None:
        sched.load_state_dict(resume["schedule"])  # first: the model loads into its phase
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["optimizer"])
        start = sched.step_count
    losses, dtypes = [], []
    for x, y in _batches()[start:stop]:
        dtypes.append(model[0].weight.dtype)
        loss = (model(x).float() - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    saved = {"model": model.state_dict(), "optimizer": opt.state_dict(),
             "schedule": sched.state_dict()}
    return model, losses, dtypes, saved


def _by_hand(low: set[int]) -> tuple[nn.Module, list[float]]:
    """fp32 masters stepped by torch's AdamW: in the bf16 steps (`low`) the model holds them
    rounded and its bf16 gradients are upcast into them (Apex O2, masters made from the bf16
    weights, fused step); in the others it holds them as they are (torch's default step)."""
    model = _model()
    first = torch.bfloat16 if 0 in low else torch.float32
    masters = [p.detach().to(first).float().requires_grad_() for p in model.parameters()]
    opt: torch.optim.AdamW | None = None
    losses = []
    for i, (x, y) in enumerate(_batches()):
        dtype = torch.bfloat16 if i in low else torch.float32
        for p, m in zip(model.parameters(), masters, strict=True):
            p.data = m.detach().to(dtype)
        loss = (model(x.to(dtype)).float() - y).pow(2).mean()
        for p in model.parameters():
            p.grad = None
        loss.backward()
        for p, m in zip(model.parameters(), masters, strict=True):
            assert p.grad is not None
            m.grad = p.grad.float()
        new = torch.optim.AdamW(masters, lr=1e-2, fused=True if i in low else None)
        if opt is not None:
            new.state.update(opt.state)  # the moments carry over
        opt = new
        opt.step()
        losses.append(loss.item())
    for p, m in zip(model.parameters(), masters, strict=True):
        p.data = m.detach().to(p.dtype)  # the last step written back
    return model, losses


def _equal(model: nn.Module, other: nn.Module) -> None:
    for (name, a), b in zip(model.named_parameters(), other.parameters(), strict=True):
        assert a.dtype == torch.float32 or a.dtype == b.dtype, name
        assert torch.equal(a.float(), b.float()), name


def test_bf16_masters_then_fp32_equals_the_switch_by_hand() -> None:
    model, losses, dtypes, _ = _scheduled({0: "bf16-master", 6: "32-true"})
    hand, hand_losses = _by_hand(set(range(6)))
    assert dtypes == [torch.bfloat16] * 6 + [torch.float32] * 4
    assert losses == hand_losses
    _equal(model, hand)  # the masters went into the fp32 weights whole, bit for bit


def test_a_fraction_of_total_steps_switches_at_its_step() -> None:
    _, losses, dtypes, _ = _scheduled({0: "bf16-master", 0.6: "32-true"})
    assert dtypes == [torch.bfloat16] * 6 + [torch.float32] * 4
    assert losses == _by_hand(set(range(6)))[1]


def test_fp32_then_bf16_masters_makes_the_masters_from_the_fp32_weights() -> None:
    model, losses, dtypes, _ = _scheduled({0: "32-true", 4: "bf16-master"})
    hand, hand_losses = _by_hand(set(range(4, STEPS)))
    assert dtypes == [torch.float32] * 4 + [torch.bfloat16] * 6
    assert losses == hand_losses
    _equal(model, hand)
    # masters made from the rounded weights at the switch would not match
    rounded, _ = _by_hand(set(range(STEPS)))
    assert not all(torch.equal(a.float(), b.float())
                   for a, b in zip(model.parameters(), rounded.parameters(), strict=True))


@pytest.mark.parametrize("at", [3, 8])
def test_a_resume_across_a_switch_equals_the_run_that_did_not_stop(at: int) -> None:
    phases: dict[int | float, Any] = {0: "bf16-master", 6: "32-true"}
    whole, losses, _, _ = _scheduled(phases)
    _, first, _, saved = _scheduled(phases, stop=at)
    assert saved["schedule"]["step"] == at and saved["schedule"]["phase"] == (at >= 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: the checkpoint is loaded next
        resumed, rest, _, _ = _scheduled(phases, resume=saved)
    assert first + rest == losses
    _equal(resumed, whole)


def test_a_checkpoint_from_other_phases_is_refused() -> None:
    _, _, _, saved = _scheduled({0: "bf16-master", 6: "32-true"}, stop=7)
    model = _model()
    sched = pa.schedule(model, {0: "bf16-master", 8: "32-true"})
    with pytest.raises(ValueError, match="saved at step 7 in phase 1"):
        sched.load_state_dict(saved["schedule"])


@pytest.mark.parametrize(("phases", "kwargs", "match"), [
    ({0: "bf16", -1: "fp32"}, {}, r"a step in phases must be >= 0.*Received: key -1"),
    ({0: "bf16", 0.5: "fp32"}, {}, r"fraction 0.5, which needs total_steps=.*total_steps=None"),
    ({0: "bf16", 1.0: "fp32"}, {"total_steps": 10}, r"float in \[0, 1\).*Received: key 1.0"),
    ({3: "bf16"}, {}, r"a phase at step 0.*Received: phases starting at steps \[3\]"),
    ({0: "bogus"}, {}, r"phases\[0\] is not a plan or spec: Unknown policy 'bogus'"),
    ({0: 3}, {}, r"phases\[0\] must be a PrecisionPlan.*of type int"),
    ({0: "bf16", 0.5: "fp32", 5: "bf16"}, {"total_steps": 10}, r"both start at step 5"),
    ({}, {}, r"non-empty dict.*Received: phases=\{\}"),
    ({0: "bf16"}, {"total_steps": 0}, r"positive int.*Received: total_steps=0"),
])
def test_bad_phases_are_refused(phases: Any, kwargs: Any, match: str) -> None:
    model = _model()
    with pytest.raises(ValueError, match=match):
        pa.schedule(model, phases, **kwargs)
    assert model[0].weight.dtype == torch.float32  # nothing applied


def test_a_plain_optimizer_is_refused() -> None:
    model = _model()
    with pytest.raises(ValueError, match="precision_annot.optimizer.*of type AdamW"):
        pa.schedule(model, {0: "bf16-master"}, optimizer=torch.optim.AdamW(model.parameters()))


def _hf_model() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=32)
    model: nn.Module = transformers.LlamaForCausalLM(config)
    return model


class _Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(2))

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids, "labels": self.ids}


@pytest.mark.slow
def test_the_hf_trainer_switches_at_the_step_as_the_plain_loop(tmp_path: Any) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from precision_annot.adapters.transformers import schedule_callback

    phases: dict[int | float, Any] = {0: "bf16-master", 4: "32-true"}
    steps = 6
    data = _Tokens()

    model = _hf_model()
    opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.0)
    sched = pa.schedule(model, phases, optimizer=opt)
    batch = {k: v[None] for k, v in data[0].items()}
    plain, plain_dtypes = [], []
    for _ in range(steps):
        plain_dtypes.append(model.lm_head.weight.dtype)
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        plain.append(loss.item())

    hf = _hf_model()
    hf_opt = pa.optimizer(hf, torch.optim.AdamW, lr=1e-2, weight_decay=0.0)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=steps, max_grad_norm=0.0,
                             per_device_train_batch_size=1, lr_scheduler_type="constant",
                             logging_steps=1, report_to=[], save_strategy="no",
                             use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=hf, args=args, train_dataset=data, optimizers=(hf_opt, None))
    callback = schedule_callback(trainer, phases)
    seen: list[torch.dtype] = []

    class Record(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            seen.append(hf.lm_head.weight.dtype)

    trainer.add_callback(Record())
    trainer.train()
    assert seen == plain_dtypes == [torch.bfloat16] * 4 + [torch.float32] * 2
    assert callback.schedule.step_count == steps and callback.schedule.phase == 1
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert logged == pytest.approx(plain, rel=1e-6, abs=0)
    _equal(hf, model)
