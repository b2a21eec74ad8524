"""`precision_annot.schedule` in a plain Accelerate loop (`Accelerator(cpu=True)`, the prepared
optimizer given as `optimizer=`): against the plain loop and the switch written by hand, with
gradient accumulation, and a `save_state` / `load_state` resume across a switch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import precision_annot as pa
from tests.test_schedule import STEPS, _batches, _by_hand, _equal, _model, _scheduled

accelerate = pytest.importorskip("accelerate")

BF16, FP32 = torch.bfloat16, torch.float32
LOW_FIRST: dict[int | float, Any] = {0: "bf16-master", 6: "32-true"}
FP32_FIRST: dict[int | float, Any] = {0: "32-true", 4: "bf16-master"}
NO_MASTER: dict[int | float, Any] = {0: "bf16-true", 6: "32-true"}  # nothing keeps fp32 values


@pytest.fixture(autouse=True)
def _fresh_state() -> Any:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # one global state per process: each test its own
    yield
    AcceleratorState._reset_state(True)


def _loader() -> DataLoader[Any]:
    xs, ys = zip(*_batches(), strict=True)
    return DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=8)


def _hooks(accelerator: Any, sched: pa.Schedule) -> None:
    """The schedule's state saved beside the checkpoint and loaded first, before Accelerate
    loads the model's weights and the optimizer's state (in the phase they were saved in)."""
    def save(models: Any, weights: Any, output_dir: str) -> None:
        torch.save(sched.state_dict(), Path(output_dir) / "schedule.pt")

    def load(models: Any, input_dir: str) -> None:
        sched.load_state_dict(torch.load(Path(input_dir) / "schedule.pt"))

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)


def _run(phases: dict[int | float, Any], *, accumulate: int = 1, stop: int = STEPS,
         save: Path | None = None, load: Path | None = None, hooks: bool = True,
         prepared_first: bool = False) -> tuple[nn.Module, Any, list[float], list[torch.dtype]]:
    """The Accelerate loop: `stop` optimizer steps (from a checkpoint's, with `load`). The
    schedule is built before `prepare` (`prepared_first`: after it, on the prepared
    optimizer)."""
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    model = _model()
    opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-2)
    if not prepared_first:
        sched = pa.schedule(model, phases, optimizer=opt, total_steps=STEPS)
    model, opt, loader = accelerator.prepare(model, opt, _loader())
    if prepared_first:
        sched = pa.schedule(model, phases, optimizer=opt, total_steps=STEPS)
    accelerator.register_for_checkpointing(sched)
    if hooks:
        _hooks(accelerator, sched)
    if load is not None:
        accelerator.load_state(str(load))
        loader = accelerator.skip_first_batches(loader, sched.step_count * accumulate)
    losses: list[float] = []
    seen: list[torch.dtype] = []  # the dtype the first Linear's forward saw, batch by batch
    model[0].register_forward_hook(lambda m, args, out: seen.append(args[0].dtype))
    while sched.step_count < stop:
        for x, y in loader:
            if sched.step_count == stop:
                break
            with accelerator.accumulate(model):
                loss = (model(x).float() - y).pow(2).mean()
                losses.append(loss.item())
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
            if accelerator.sync_gradients:  # an optimizer step, not a micro-batch
                sched.step()
    if save is not None:
        accelerator.save_state(str(save))
    return model, opt, losses, seen


@pytest.mark.parametrize(("phases", "low"), [(LOW_FIRST, set(range(6))),
                                             (FP32_FIRST, set(range(4, STEPS)))])
def test_the_accelerate_loop_equals_the_plain_loop_and_the_hand_loop(
        phases: dict[int | float, Any], low: set[int]) -> None:
    model, opt, losses, seen = _run(phases)
    assert isinstance(opt, accelerate.optimizer.AcceleratedOptimizer)
    assert seen == [BF16 if i in low else FP32 for i in range(STEPS)]
    plain, plain_losses, _, _ = _scheduled(phases)
    hand, hand_losses = _by_hand(low)
    assert losses == plain_losses == hand_losses
    _equal(model, plain)
    _equal(model, hand)


def test_a_schedule_built_on_the_prepared_optimizer_makes_the_masters_as_the_plain_loop(
        ) -> None:
    """AcceleratedOptimizer's constructor loads the state_dict() of the optimizer not stepped
    yet (step 0, zero moments): that is not a run going on, and the first phase's masters are
    made from the rounded weights, as in the plain loop."""
    _, _, losses, _ = _run(LOW_FIRST, prepared_first=True)
    assert losses == _scheduled(LOW_FIRST)[1]


def _plain_accumulated(phases: dict[int | float, Any], steps: int) -> tuple[nn.Module, list[float]]:
    model = _model()
    opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-2)
    sched = pa.schedule(model, phases, optimizer=opt)
    batches, losses = _batches(), []
    for step in range(steps):
        for x, y in batches[2 * step:2 * step + 2]:
            loss = (model(x).float() - y).pow(2).mean()
            losses.append(loss.item())
            (loss / 2).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, losses


@pytest.mark.parametrize("phases", [{0: "bf16-master", 3: "32-true"},
                                    {0: "32-true", 3: "bf16-master"}])
def test_with_accumulation_the_switch_is_at_the_optimizer_step(
        phases: dict[int | float, Any]) -> None:
    steps = STEPS // 2
    model, _, losses, seen = _run(phases, accumulate=2, stop=steps)
    first = BF16 if phases[0] == "bf16-master" else FP32
    then = FP32 if first == BF16 else BF16
    assert seen == [first] * 6 + [then] * 4  # optimizer step 3 is batches 6 and 7
    plain, plain_losses = _plain_accumulated(phases, steps)
    assert losses == plain_losses
    _equal(model, plain)


def _states(opt: Any, model: nn.Module) -> list[dict[str, Any]]:
    return [opt.optimizer.state[p] for p in model.parameters()]


def _equal_states(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    for sa, sb in zip(a, b, strict=True):
        assert sa.keys() == sb.keys()
        for key, value in sa.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == sb[key].dtype and torch.equal(value, sb[key]), key
            else:
                assert value == sb[key], key


@pytest.mark.parametrize("phases", [LOW_FIRST, FP32_FIRST, NO_MASTER],
                         ids=["bf16-first", "fp32-first", "bf16-true-first"])
@pytest.mark.parametrize("at", [3, 8], ids=["before", "after"])
@pytest.mark.parametrize("hooks", [False, True], ids=["registered", "loaded-first"])
def test_a_resume_across_a_switch_equals_the_run_that_did_not_stop(
        tmp_path: Path, phases: dict[int | float, Any], at: int, hooks: bool) -> None:
    """Registered with `register_for_checkpointing` alone, Accelerate loads the weights, then
    the optimizer's state, then the schedule's: the optimizer's state holds the phase and goes
    to it first, and the fp32 weights a load gave a bf16 first phase (`bf16-true`, no master
    to hold them) come back whole. Loading the schedule's state first (the hooks) works too."""
    whole, whole_opt, losses, _ = _run(phases)
    _, _, first, _ = _run(phases, stop=at, save=tmp_path / "at", hooks=hooks)
    if hooks:
        assert torch.load(tmp_path / "at" / "schedule.pt")["step"] == at
    resumed, resumed_opt, rest, seen = _run(phases, load=tmp_path / "at", hooks=hooks)
    assert seen[0] == (FP32 if phases[max(s for s in phases if s <= at)] == "32-true" else BF16)
    assert first + rest == losses
    _equal(resumed, whole)
    _equal_states(_states(resumed_opt, resumed), _states(whole_opt, whole))
