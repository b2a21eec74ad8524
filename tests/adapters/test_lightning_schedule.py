"""`adapters.lightning.ScheduleCallback`: a Lightning fit with a schedule of plans, against the
same schedule in a plain loop and the same switch written by hand (with Lightning's gradient
clipping, validation between steps, gradient accumulation), and a resume across a switch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import precision_annot as pa
from tests.test_schedule import _by_hand as by_hand

L = pytest.importorskip("lightning")
from precision_annot.adapters.lightning import (  # noqa: E402
    AnnotatedPrecision,
    ScheduleCallback,
)

STEPS, SWITCH, CLIP = 8, 4, 0.5
BF16, FP32 = torch.bfloat16, torch.float32
LOW_FIRST: dict[int | float, Any] = {0: "bf16-master", SWITCH: "32-true"}
FP32_FIRST: dict[int | float, Any] = {0: "32-true", SWITCH: "bf16-master"}
NO_MASTER: dict[int | float, Any] = {0: "bf16-true", SWITCH: "32-true"}  # nothing keeps fp32
QUIET = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_progress_bar": False,
         "enable_model_summary": False}


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two batches: one epoch of the Lightning runs."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(2)]


def _loader() -> DataLoader[Any]:
    xs, ys = zip(*_batches(), strict=True)
    return DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=8)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x).float() - y).pow(2).mean()


class Module(L.LightningModule):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()
        self.losses: list[float] = []
        self.seen: list[tuple[int, bool, torch.dtype, torch.dtype]] = []  # step, train, fc's
        self.current: list[torch.dtype] = []
        for linear in (self.net[0], self.net[3]):
            linear.register_forward_hook(self._record)

    def _record(self, module: nn.Module, args: tuple[torch.Tensor, ...], out: Any) -> None:
        self.current.append(args[0].dtype)  # the dtype this Linear's forward saw
        if len(self.current) == 2:
            self.seen.append((self.global_step, torch.is_grad_enabled(), *self.current))
            self.current = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = _loss(self.net, *batch)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val", _loss(self.net, *batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return pa.optimizer(self.net, torch.optim.AdamW, lr=1e-2)


def _fit(phases: dict[int | float, Any], *, steps: int = STEPS, accumulate: int = 1,
         ckpt_path: Path | None = None, save_to: Path | None = None,
         plugins: list[Any] | None = None) -> tuple[Module, ScheduleCallback]:
    module, callback = Module(), ScheduleCallback(phases)
    trainer = L.Trainer(max_steps=steps, callbacks=[callback], gradient_clip_val=CLIP,
                        accumulate_grad_batches=accumulate, check_val_every_n_epoch=1,
                        limit_val_batches=1, enable_checkpointing=False,
                        plugins=plugins or [], **QUIET)
    trainer.fit(module, _loader(), _loader(), ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return module, callback


def _plain(phases: dict[int | float, Any], *, accumulate: int = 1, clip: bool = True,
           cast: bool = False) -> tuple[nn.Module, list[float]]:
    """The same schedule in a plain loop: clipped as Lightning clips (the optimizer's
    parameters, group by group), each micro-batch's loss divided by `accumulate`; with `cast`,
    the batch cast to the phase's compute dtype first, as `AnnotatedPrecision` casts it."""
    model = _net()
    opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-2)
    sched = pa.schedule(model, phases, optimizer=opt)
    batches, losses = _batches(), []
    for _ in range(STEPS):
        opt.zero_grad()
        for _ in range(accumulate):
            x, y = batches[len(losses) % 2]
            if cast and sched.current == "bf16-master":
                x, y = x.to(BF16), y.to(BF16)
            loss = _loss(model, x, y)
            losses.append(loss.item())
            (loss / accumulate).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]],
                                           CLIP)
        opt.step()
        sched.step()
    return model, losses


def _by_hand(low: set[int]) -> tuple[nn.Module, list[float]]:
    """tests/test_schedule.py's switch by hand, over this file's model and batches, with the
    gradients clipped as Lightning clips them: in fp32 (bf16-master keeps fp32 gradients)."""
    batches = _batches()
    return by_hand(low, model=_net(), batches=[batches[i % 2] for i in range(STEPS)],
                   loss_of=_loss, clip=CLIP)


def _equal(model: nn.Module, other: nn.Module) -> None:
    for (name, a), b in zip(model.named_parameters(), other.parameters(), strict=True):
        assert a.dtype == b.dtype, name
        assert torch.equal(a, b), name


def _expected_seen(phases: dict[int | float, Any], steps: int, per_step: int
                   ) -> list[tuple[int, bool, torch.dtype, torch.dtype]]:
    """Each step's forwards in its phase's dtype; the validation after each epoch (and the
    sanity check before the first step) in the phase of the next step."""
    def dtype(step: int) -> torch.dtype:
        spec = phases[max(s for s in phases if s <= step)]
        return BF16 if spec == "bf16-master" else FP32

    out = [(0, False, dtype(0), dtype(0))]  # the sanity check
    batches = 0
    for step in range(steps):
        for _ in range(per_step):
            out.append((step, True, dtype(step), dtype(step)))
            batches += 1
            if batches % 2 == 0 and (step + 1) * per_step == batches:  # an epoch's end
                out.append((step + 1, False, dtype(step + 1), dtype(step + 1)))
    return out


@pytest.mark.parametrize(("phases", "low"), [(LOW_FIRST, set(range(SWITCH))),
                                             (FP32_FIRST, set(range(SWITCH, STEPS)))])
def test_a_fit_switches_at_the_step_as_the_plain_loop_and_the_hand_loop(
        phases: dict[int | float, Any], low: set[int]) -> None:
    module, callback = _fit(phases)
    assert module.seen == _expected_seen(phases, STEPS, 1)
    assert callback.schedule is not None and callback.schedule.step_count == STEPS
    plain, plain_losses = _plain(phases)
    hand, hand_losses = _by_hand(low)
    assert module.losses == plain_losses == hand_losses
    _equal(module.net, plain)
    _equal(module.net, hand)  # clipped bf16 gradients, masters written back whole: bit for bit
    # the clipping clipped (a run without it ends elsewhere)
    unclipped, _ = _plain(phases, clip=False)
    assert not torch.equal(unclipped[0].weight, plain[0].weight)


@pytest.mark.parametrize("phases", [LOW_FIRST, FP32_FIRST])
def test_with_accumulation_the_switch_is_at_the_optimizer_step(
        phases: dict[int | float, Any]) -> None:
    module, _ = _fit(phases, accumulate=2)
    # optimizer step 4 is batches 8 and 9: the first two in the new phase
    assert module.seen == _expected_seen(phases, STEPS, 2)
    plain, plain_losses = _plain(phases, accumulate=2)
    assert module.losses == plain_losses
    _equal(module.net, plain)


def _optimizer_state(module: Module) -> list[Any]:
    opt = module.trainer.optimizers[0]
    return [opt.state[p] for p in module.net.parameters()]


def _equal_state(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    for sa, sb in zip(a, b, strict=True):
        assert sa.keys() == sb.keys()
        for key in sa:
            if isinstance(sa[key], torch.Tensor):
                assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key
            else:
                assert sa[key] == sb[key], key


@pytest.mark.parametrize("phases", [LOW_FIRST, FP32_FIRST, NO_MASTER],
                         ids=["bf16-first", "fp32-first", "bf16-true-first"])
@pytest.mark.parametrize("at", [2, 6], ids=["before", "after"])
def test_a_resume_across_the_switch_equals_the_fit_that_did_not_stop(
        tmp_path: Path, phases: dict[int | float, Any], at: int) -> None:
    whole, _ = _fit(phases)
    first, _ = _fit(phases, steps=at, save_to=tmp_path / "at.ckpt")
    saved = torch.load(tmp_path / "at.ckpt", weights_only=False)
    state = saved["callbacks"]["ScheduleCallback"]
    assert (state["step"], state["phase"]) == (at, int(at >= SWITCH))
    resumed, callback = _fit(phases, ckpt_path=tmp_path / "at.ckpt")
    assert callback.schedule is not None and callback.schedule.step_count == STEPS
    assert first.losses + resumed.losses == whole.losses
    # the resumed fit's first step ran in the saved phase (no sanity check on a resume)
    assert resumed.seen[0][:3] == whole.seen[1 + at + at // 2][:3] == (
        at, True, FP32 if phases[0 if at < SWITCH else SWITCH] == "32-true" else BF16)
    _equal(resumed.net, whole.net)
    _equal_state(_optimizer_state(resumed), _optimizer_state(whole))


def test_the_plugin_follows_each_phase() -> None:
    plugin = AnnotatedPrecision()
    module, _ = _fit(LOW_FIRST, plugins=[plugin])
    assert module.seen == _expected_seen(LOW_FIRST, STEPS, 1)
    assert plugin.precision == "32-true" and plugin.plan is not None
    assert plugin.plan.root.policy.compute == FP32
    plain, plain_losses = _plain(LOW_FIRST, cast=True)  # the plugin casts each batch
    assert module.losses == plain_losses
    _equal(module.net, plain)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"plugins": [AnnotatedPrecision(plan=pa.resolve(_net(), default="bf16"))]},
     r"given plan= as well.*Received: a plugin with plan="),
    ({"optimizer": torch.optim.AdamW}, r"one optimizer that precision_annot.optimizer built.*"
                                       r"Received: optimizers \['AdamW'\]"),
])
def test_what_the_callback_refuses(kwargs: dict[str, Any], match: str) -> None:
    class Plain(Module):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    module = Plain() if "optimizer" in kwargs else Module()
    trainer = L.Trainer(max_steps=2, callbacks=[ScheduleCallback(LOW_FIRST)],
                        enable_checkpointing=False, plugins=kwargs.get("plugins", []), **QUIET)
    with pytest.raises(ValueError, match=match):
        trainer.fit(module, _loader())


def test_fractions_are_of_max_steps() -> None:
    module, callback = _fit({0: "bf16-master", 0.5: "32-true"})
    assert callback.schedule is not None and callback.schedule.switches == [STEPS // 2]
    assert module.seen == _expected_seen(LOW_FIRST, STEPS, 1)
    with pytest.raises(ValueError, match=r"need the fit's optimizer steps.*max_steps=-1"):
        L.Trainer(max_epochs=1, callbacks=[ScheduleCallback({0: "bf16", 0.5: "fp32"})],
                  enable_checkpointing=False, **QUIET).fit(Module(), _loader())
