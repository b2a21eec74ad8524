"""`grad=fp32`: `.grad` is the fp32 accumulation itself (torch's `Tensor.grad_dtype`).

Each loop a user writes around `.grad` (the model's `zero_grad`, micro-batches, torch's
`clip_grad_norm_`, torch's GradScaler and ours) is run with `precision_annot.optimizer` and
compared, bit for bit, with the same loop written by hand: fp32 masters, each micro-batch's
gradient added into an fp32 sum by hand (`tests.workers.grads.HandLoop`).
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import precision_annot as pa
from precision_annot import bf16, fp16, fp32
from tests.workers.grads import SPEC, HandLoop, batch, loss_of, mlp, worst


def planned_and_hand(spec: str = SPEC, storage: str = "bf16-true"
                     ) -> tuple[nn.Module, pa.PlanOptimizer, HandLoop]:
    model = pa.apply(mlp(), default=spec)
    opt = pa.optimizer(model, torch.optim.AdamW, lr=3e-3, weight_decay=0.1)
    return model, opt, HandLoop(pa.apply(mlp(), default=storage))


def test_apply_sets_grad_dtype_and_remove_gives_the_parameters_own_back() -> None:
    model = pa.apply(mlp(), default=SPEC)
    assert {(p.dtype, p.grad_dtype) for p in model.parameters()} == {(bf16, fp32)}
    loss_of(model, batch(0)).backward()
    assert {p.grad.dtype for p in model.parameters()} == {fp32}  # type: ignore[union-attr]
    pa.apply(model, default="bf16-true,master=fp32")  # a plan without grad: its own dtype
    assert {(p.grad_dtype, p.grad.dtype) for p in model.parameters()} == {(bf16, bf16)}  # type: ignore[union-attr]
    pa.apply(model, default=SPEC)
    pa.remove(model)
    assert {(p.dtype, p.grad_dtype, p.grad.dtype) for p in model.parameters()} == {  # type: ignore[union-attr]
        (fp32, fp32, fp32)}
    assert not model._forward_hooks


def _grads(model: nn.Module) -> list[tuple[torch.dtype, torch.dtype | None, torch.Tensor]]:
    """Each parameter's dtype, `grad_dtype` and gradient after one backward from zero."""
    model.zero_grad()
    loss_of(model, batch(0)).backward()
    out = []
    for p in model.parameters():
        assert p.grad is not None
        out.append((p.dtype, p.grad_dtype, p.grad))
    return out


@pytest.mark.filterwarnings("ignore:.* stored narrower than before:UserWarning")
@pytest.mark.parametrize("specs", [
    ("bf16-master", "32-true", "bf16-true"),
    ("32-true", "bf16-master", "32-true", "bf16-true"),
    ("bf16-master", "bf16-true", "16-true"),
    ("bf16-master", "32-true", "bf16-true", None),  # None: remove
    ("bf16-master", "bf16-true", None),
])
def test_each_plan_of_a_sequence_accumulates_as_that_plan_applied_alone(
        specs: tuple[str | None, ...]) -> None:
    """A `grad_dtype` given back after a `grad=fp32` plan (the parameter's dtype then: torch
    keeps a set one through later casts) follows the parameter into the dtype the next plan
    stores it in (measured before: an fp32 `.grad` on the bf16 weights of "bf16-true", which
    torch's AdamW refuses: "expected dtype c10::BFloat16 for `end` but got dtype float"), and
    `remove` gives it the original dtype."""
    model = mlp()
    for spec in specs:
        if spec is None:
            pa.remove(model)
        else:
            pa.apply(model, default=spec)
        alone = mlp()  # the same values, only this plan applied
        for p, q in zip(alone.parameters(), model.parameters(), strict=True):
            p.data = q.detach().float()
        if spec is not None:
            pa.apply(alone, default=spec)
        for (dtype, grad_dtype, grad), (want, want_grad_dtype, want_grad) in zip(
                _grads(model), _grads(alone), strict=True):
            assert (dtype, grad_dtype, grad.dtype) == (want, want_grad_dtype, want_grad.dtype)
            assert torch.equal(grad, want_grad)
    opt = torch.optim.AdamW(model.parameters())  # a plain update: as stored
    opt.step()


def test_copies_pickles_and_an_assigned_state_dict_keep_the_accumulation_dtype() -> None:
    """A copied or unpickled Parameter, or one `load_state_dict(assign=True)` puts in place,
    starts with its own dtype as `grad_dtype`; the applied model gives it the plan's again."""
    model = pa.apply(mlp(), default=SPEC)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert {p.grad_dtype for p in other.parameters()} == {fp32}
        loss_of(other, batch(0)).backward()
        assert {p.grad.dtype for p in other.parameters()} == {fp32}  # type: ignore[union-attr]
    model.load_state_dict(state, assign=True)
    assert {p.grad_dtype for p in model.parameters()} == {fp32}


def test_model_zero_grad_between_steps_equals_the_hand_loop() -> None:
    """`model.zero_grad()` (what the HF Trainer calls) empties what the step reads: no step
    sees the previous batch's gradient."""
    model, opt, hand = planned_and_hand()
    for step in range(4):
        model.zero_grad()
        loss_of(model, batch(step)).backward()
        opt.step()
        hand.backward(loss_of(hand.model, batch(step)))
        hand.step()
    assert worst(model, hand, opt) == {"weights": 0.0, "masters": 0.0}


def test_micro_batches_accumulate_in_fp32_in_grad_itself() -> None:
    model, opt, hand = planned_and_hand()
    for step in range(2):
        opt.zero_grad()
        for micro in range(4):
            loss_of(model, batch(10 * step + micro)).backward()
            hand.backward(loss_of(hand.model, batch(10 * step + micro)))
        for p, total in zip(model.parameters(), hand.sums, strict=True):
            assert p.grad is not None and p.grad.dtype == fp32 and torch.equal(p.grad, total)
        opt.step()
        hand.step()
    assert worst(model, hand, opt) == {"weights": 0.0, "masters": 0.0}
    # what the sums would be in bf16: the accumulation is what makes the difference
    bf16_sums = [torch.zeros_like(p) for p in hand.params]
    for micro in range(4):
        hand.backward(loss_of(hand.model, batch(20 + micro)))
        for s, p in zip(bf16_sums, hand.params, strict=True):
            s += p.grad  # type: ignore[operator]
    assert any(not torch.equal(s.float(), t) for s, t in zip(bf16_sums, hand.sums, strict=True))


def test_torchs_clip_grad_norm_on_the_model_equals_clipping_the_fp32_sums() -> None:
    model, opt, hand = planned_and_hand()
    for step in range(3):
        opt.zero_grad()
        for micro in range(2):
            loss_of(model, batch(10 * step + micro)).backward()
            hand.backward(loss_of(hand.model, batch(10 * step + micro)))
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        assert norm > 0.05  # it clips
        opt.step()
        hand.step(clip=0.05)
    assert worst(model, hand, opt) == {"weights": 0.0, "masters": 0.0}


@pytest.mark.parametrize("scaler_class", ["torch", "precision_annot"])
def test_a_grad_scalers_unscale_acts_on_the_fp32_sums(scaler_class: str) -> None:
    """fp16 weights with fp32 accumulation: `.grad` is fp32, so torch's own GradScaler unscales
    it (it refuses fp16 gradients), and an overflowing step is skipped as by hand."""
    model, opt, hand = planned_and_hand("16-true,master=fp32,grad=fp32", "16-true")
    assert {p.dtype for p in model.parameters()} == {fp16}
    scaler = (torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
              if scaler_class == "torch" else pa.GradScaler(init_scale=1024.0,
                                                            growth_interval=1000))
    scale = 1024.0
    for step in range(4):
        blow = float("inf") if step == 2 else 1.0
        opt.zero_grad()
        for micro in range(2):
            loss = loss_of(model, batch(10 * step + micro), blow)
            scaler.scale(loss).backward()
            hand.backward(loss_of(hand.model, batch(10 * step + micro), blow) * scale)
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        finite = hand.unscale(scale)
        hand.step(clip=1.0, skip=not finite)
        scale = scale if finite else scale / 2
    assert scaler.get_scale() == scale == 512.0
    assert worst(model, hand, opt) == {"weights": 0.0, "masters": 0.0}


def test_audit_expects_the_gradient_in_the_accumulation_dtype() -> None:
    model = pa.apply(mlp(), default=SPEC)
    with pa.audit(model) as report:
        loss_of(model, batch(0)).backward()
    assert [d for d in report.divergences if d.field == "grad"] == []
    assert report["1"].grads == {"weight": fp32, "bias": fp32}


def test_the_memory_figure_counts_grad_as_fp32_without_a_second_copy() -> None:
    plan = pa.resolve(mlp(), SPEC)
    rows = {r.name: r for r in plan.memory("adamw").modules}
    weight = mlp()[1].weight.numel() + mlp()[1].bias.numel()
    assert rows["1"].grad_bytes == 4 * weight  # fp32 .grad, no bf16 one beside it


@pytest.mark.slow  # 15 s: a compile
def test_compile_fullgraph_traces_no_break_for_the_ddp_watch() -> None:
    model = pa.apply(mlp(), default=SPEC)
    compiled = torch.compile(model, fullgraph=True)
    loss_of(compiled, batch(0)).backward()
    assert {p.grad.dtype for p in model.parameters()} == {fp32}  # type: ignore[union-attr]


def test_checkpointing_and_a_weight_used_twice() -> None:
    """Activation checkpointing gives the same fp32 gradients as without; a weight used twice
    in one backward has its two contributions summed in fp32 (a bf16 .grad would round the
    sum)."""
    plain, checkpointed = pa.apply(mlp(), default=SPEC), pa.apply(mlp(), default=SPEC)
    loss_of(plain, batch(1)).backward()
    tokens = batch(1)
    out = torch.utils.checkpoint.checkpoint(checkpointed, tokens, use_reentrant=False)
    nn.functional.cross_entropy(out.float(), tokens).backward()
    for p, q in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]

    twice = pa.apply(nn.Linear(1, 1, bias=False), default=SPEC)
    with torch.no_grad():
        twice.weight.fill_(1.0)
    x = torch.tensor([[1.0], [2.0 ** -9]], dtype=bf16)
    (twice(x[:1]) + twice(x[1:])).float().sum().backward()
    assert twice.weight.grad is not None and twice.weight.grad.item() == 1.0 + 2.0 ** -9
