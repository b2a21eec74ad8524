"""Each way the update half used to lose an update silently, now right or a clear error:
an optimizer built before `apply`, a plan re-applied with another update half, fp16 gradients
unscaled in fp16, a weight shared by two update plans, a checkpoint from another layout; and
stochastic rounding with any optimizer class."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import precision_annot as pa
from precision_annot import bf16, fp16, fp32

pytest.importorskip("torchao")


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))  # 0.weight: 8-bit


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 64, generator=gen), torch.randn(16, 4, generator=gen)


def train(model: nn.Module, opt: Any, steps: range) -> None:
    for step in steps:
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(model[0].weight.dtype)).float(), y).backward()
        opt.step()


def masters_of(opt: Any, model: nn.Module) -> list[torch.Tensor]:
    return [opt.master(p) for p in model.parameters()]


# -- an optimizer built before apply; a plan re-applied with another update half ------------------

def test_an_optimizer_built_before_apply_steps_through_the_masters_apply_plans() -> None:
    """Built over the fp32 model, then apply(bf16-true, master=fp32): it steps as one built
    after apply does, bit for bit (it used to step the bf16 weights with no master: at lr 1e-4,
    2,257 of 2,308 updates rounded away)."""
    early_model = mlp()
    early = pa.optimizer(early_model, torch.optim.AdamW, lr=1e-4)
    pa.apply(early_model, default="bf16-true,master=fp32")
    late_model = pa.apply(mlp(), default="bf16-true,master=fp32")
    late = pa.optimizer(late_model, torch.optim.AdamW, lr=1e-4)
    train(early_model, early, range(3))
    train(late_model, late, range(3))
    for p, q in zip(early_model.parameters(), late_model.parameters(), strict=True):
        assert p.dtype == bf16 and torch.equal(p, q)
        assert torch.equal(early.master(p), late.master(q))


def test_a_plan_re_applied_with_another_update_half_is_what_the_next_step_does() -> None:
    """apply(bf16-true), a step (bf16 moments, no master), apply again with master=fp32 and
    optim=8bit: the next step keeps fp32 masters and 8-bit states; apply again without them:
    each master is written back and dropped, the states go back to bf16."""
    model = pa.apply(mlp(), default="bf16-true")
    opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-4)
    train(model, opt, range(1))
    weight = model[2].weight
    assert opt.master(weight) is None and opt.state[weight]["exp_avg"].dtype == bf16
    pa.apply(model, default="bf16-true,master=fp32,optim=8bit")
    before = weight.detach().clone()
    train(model, opt, range(1, 2))
    master = opt.master(weight)
    assert master is not None and master.dtype == fp32
    assert not torch.equal(master, before.float())  # it moved, below bf16's resolution too
    big = opt.state[model[0].weight]
    assert master.dtype == fp32 and type(big["exp_avg"]).__name__ == "OptimState8bit"
    pa.apply(model, default="bf16-true")
    train(model, opt, range(2, 3))
    assert all(opt.master(p) is None for p in model.parameters())
    assert opt.state[model[0].weight]["exp_avg"].dtype == bf16


@pytest.mark.parametrize("how", ["apply fp32", "remove", "apply fp16 masters"])
def test_the_masters_are_in_the_weights_as_soon_as_a_plan_drops_or_recasts_them(how: str
                                                                               ) -> None:
    """Trained with bf16 weights and fp32 masters, then `apply(model, "fp32")` or `remove`
    (to evaluate or save in fp32), or `apply(model, "16-true,master=fp32")`: each weight holds
    its master at once, not the bf16 value cast up (0.00049 off, and lost for good when no
    step follows), and the next step starts from it, as it would by hand."""
    model = pa.apply(mlp(), default="bf16-true,master=fp32")
    opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-2)
    train(model, opt, range(2))
    masters = [m.clone() for m in masters_of(opt, model)]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        if how == "remove":
            pa.remove(model)
        else:
            pa.apply(model, default="fp32" if how == "apply fp32" else "16-true,master=fp32")
    # apply's "cast from their current values, they keep the rounding of bf16" is not said of
    # weights whose masters are written into them
    assert not [w for w in said if "keep the rounding" in str(w.message)]
    for p, m in zip(model.parameters(), masters, strict=True):
        assert torch.equal(p, m.to(p.dtype))
    if how == "apply fp16 masters":
        assert all(torch.equal(a, b) for a, b in zip(masters_of(opt, model), masters,
                                                 strict=True))


def test_a_plain_optimizer_after_a_re_apply_with_masters_is_stopped() -> None:
    model = pa.apply(mlp(), default="bf16-true")
    plain = torch.optim.SGD(model.parameters(), lr=1e-4)
    train(model, plain, range(1))
    pa.apply(model, default="bf16-true,master=fp32")
    with pytest.raises(RuntimeError, match=r"SGD.step\(\): it updates parameter '0.weight'.*"
                                           r"the plan says master=fp32"):
        train(model, plain, range(1, 2))


# -- fp16 storage, fp32 masters and a GradScaler: unscaled into fp32, as Apex O2 ------------------

def test_fp16_gradients_are_unscaled_into_fp32_as_apex_o2_does() -> None:
    """The gradients the step reads equal the fp16 gradients upcast and unscaled in fp32 (in
    fp16, gradients below 6e-8 after unscaling flush to zero: here most of them)."""
    model = pa.apply(mlp(), default="16-true,master=fp32")
    opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-3)
    scaler = pa.GradScaler(init_scale=2.0 ** 16)
    x, y = batch(0)
    loss = nn.functional.mse_loss(model(x.half()).float(), y) * 1e-9  # tiny gradients
    scaler.scale(loss).backward()
    scaled = [p.grad.clone() for p in model.parameters()]
    scaler.unscale_(opt)
    apex = [g.float() / 2.0 ** 16 for g in scaled]
    in_fp16 = [(g / 2.0 ** 16) for g in scaled]  # what unscaling in fp16 leaves
    for p, want in zip(model.parameters(), apex, strict=True):
        assert p.grad.dtype == fp32 and torch.equal(p.grad, want)
    survive = sum(int(g.ne(0).sum()) for g in apex)
    flushed = survive - sum(int(g.ne(0).sum()) for g in in_fp16)
    assert flushed > 0.5 * survive  # the ones fp16 would have lost
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # acts on the fp32 gradients
    before = [m.clone() for m in masters_of(opt, model) if m is not None]
    scaler.step(opt)
    scaler.update()
    assert not before  # the masters are made at the first step
    assert all(m is not None and m.dtype == fp32 for m in masters_of(opt, model))
    opt.zero_grad()
    scaler.scale(nn.functional.mse_loss(model(x.half()).float(), y)).backward()
    assert all(p.grad.dtype == fp16 for p in model.parameters())  # the next backward: as before


@pytest.mark.parametrize("fused", [False, True], ids=["single-tensor", "fused"])
def test_a_grad_scaler_skips_an_overflowing_step_and_unscales_into_the_masters(fused: bool
                                                                                ) -> None:
    """fp16 weights, fp32 masters, precision_annot.GradScaler: an inf step leaves the masters
    as they were; with `fused=True` torch's GradScaler hands the scale to AdamW's fused kernel,
    which unscales the fp32 gradients itself (no separate unscale)."""
    model = pa.apply(mlp(), default="16-true,master=fp32")
    opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-3, fused=fused)
    scaler = pa.GradScaler(init_scale=2.0 ** 10)
    for step in range(4):
        x, y = batch(step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x.half()).float(), y)
        scaler.scale(loss * (float("inf") if step == 2 else 1.0)).backward()
        before = [m.clone() for m in masters_of(opt, model) if m is not None]
        scaler.step(opt)
        scaler.update()
        after = [m for m in masters_of(opt, model) if m is not None]
        moved = any(not torch.equal(a, b) for a, b in zip(before, after, strict=False))
        assert (step == 2) == (bool(before) and not moved), step
    assert scaler.get_scale() == 2.0 ** 9  # halved once, at the overflow


# -- a weight shared by two update plans ----------------------------------------------------

class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight


def test_a_weight_shared_by_a_master_module_and_a_plain_one_is_an_error_naming_both() -> None:
    model = Tied()
    pa.annotate(model, {"embed": "bf16-true,master=fp32", "head": "bf16-true"})
    with pytest.raises(ValueError, match=r"Parameter 'weight' is shared by modules 'embed' "
                                         r"\(master=fp32\) and 'head' \(as stored\).*"
                                         r"annotate both modules with the same master"):
        pa.resolve(model)
    pa.annotate(model, {"head": "bf16-true,master=fp32"})
    opt = pa.optimizer(pa.apply(model), torch.optim.AdamW, lr=1e-3)
    model.head(model.embed(torch.tensor([1, 2]))).float().sum().backward()
    opt.step()
    assert opt.master(model.embed.weight).dtype == fp32


# -- checkpoints across layouts ---------------------------------------------------------------

def run(spec: str, steps: int = 3) -> tuple[nn.Module, Any]:
    model = pa.apply(mlp(), default=spec)
    opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-3)
    train(model, opt, range(steps))
    return model, opt


def test_an_8bit_checkpoint_loads_into_an_fp32_state_optimizer_with_a_warning_naming_it() -> None:
    """It used to be accepted and die inside torchao at the next step."""
    _, low = run("bf16-true,master=fp32,optim=8bit")
    model, opt = run("bf16-true,master=fp32", steps=0)
    with pytest.warns(UserWarning, match=r"holds 2 state tensor\(s\) narrower than planned "
                                         r"\(0.weight exp_avg \(8bit, planned fp32\), 0.weight "
                                         r"exp_avg_sq \(8bit, planned fp32\)\)"):
        opt.load_state_dict(copy.deepcopy(low.state_dict()))
    state = opt.state[model[0].weight]
    assert type(state["exp_avg"]) is torch.Tensor and state["exp_avg"].dtype == fp32
    train(model, opt, range(3, 4))
    _, back = run("bf16-true,master=fp32,optim=8bit", steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fp32 into 8-bit: narrowed as planned, nothing to say
        back.load_state_dict(opt.state_dict())


def test_a_load_keeps_each_state_in_its_planned_dtype() -> None:
    """torch's own load casts every state tensor to its parameter's dtype (bf16 here): the
    masters and fp32 moments stay fp32, bf16 moments stay bf16, 8-bit ones 8-bit; and a
    checkpoint holding a narrower state than planned warns, naming it."""
    model, opt = run("bf16-true,master=fp32")
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    state = opt.state[model[0].weight]
    assert {k: v.dtype for k, v in state.items()} == {"master": fp32, "step": fp32,
                                                      "exp_avg": fp32, "exp_avg_sq": fp32}
    _, narrow = run("bf16-true,master=fp32,optim=bf16")
    narrow.load_state_dict(copy.deepcopy(narrow.state_dict()))
    assert narrow.state[narrow.param_groups[0]["params"][0]]["exp_avg"].dtype == bf16
    with pytest.warns(UserWarning, match=r"0.weight exp_avg \(bf16, planned fp32\)"):
        opt.load_state_dict(narrow.state_dict())
    assert opt.state[model[0].weight]["exp_avg"].dtype == fp32
    train(model, opt, range(3, 4))


def test_the_master_is_the_truth_on_load() -> None:
    """A checkpoint's master sets the stored weight (rounded), whatever the model holds."""
    model, opt = run("bf16-true,master=fp32")
    saved = copy.deepcopy(opt.state_dict())
    again = pa.apply(mlp(seed=1), default="bf16-true,master=fp32")  # other weights
    fresh = pa.optimizer(again, torch.optim.AdamW, lr=1e-3)
    fresh.load_state_dict(saved)
    for p, q in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q) and torch.equal(opt.master(p), fresh.master(q))


# -- stochastic rounding with any class -----------------------------------------------------------

def test_loading_the_model_between_steps_restarts_its_masters_from_what_was_loaded() -> None:
    """Reload earlier weights into the model alone, mid-training: the next step starts from
    them (it used to write the old masters back over them: 0.040 off after one step). An fp32
    checkpoint gives the masters its own values; the weights loaded back unchanged keep the
    masters' bits below bf16."""
    model = pa.apply(mlp(), default="bf16-true,master=fp32")
    opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-2)
    fp32_start = {k: v.clone() for k, v in mlp().state_dict().items()}  # the fp32 values
    train(model, opt, range(3))
    # by hand: the same optimizer state, masters set from the checkpoint, one step
    hand_model = copy.deepcopy(model)
    hand = torch.optim.AdamW([p.detach().float().clone() for p in model.parameters()], lr=1e-2,
                             fused=True)
    saved = copy.deepcopy(opt.state_dict())  # (torch's state_dict holds the live tensors)
    hand.load_state_dict({**saved, "param_groups": [{**saved["param_groups"][0], "fused": True}],
                          "state": {k: {n: v for n, v in s.items() if n != "master"}
                                    for k, s in saved["state"].items()}})
    for master, key in zip(hand.param_groups[0]["params"], fp32_start, strict=True):
        master.data.copy_(fp32_start[key])
    model.load_state_dict(fp32_start)
    hand_model.load_state_dict(fp32_start)
    assert all(torch.equal(opt.master(p), fp32_start[k])
               for k, p in zip(fp32_start, model.parameters(), strict=True))
    train(model, opt, range(3, 4))
    x, y = batch(3)
    hand_model.zero_grad()
    nn.functional.mse_loss(hand_model(x.to(bf16)).float(), y).backward()
    for master, p in zip(hand.param_groups[0]["params"], hand_model.parameters(), strict=True):
        master.grad = p.grad.float()
    hand.step()
    for p, master in zip(model.parameters(), hand.param_groups[0]["params"], strict=True):
        assert torch.equal(opt.master(p), master), (opt.master(p) - master).abs().max()
        assert torch.equal(p, master.to(bf16))
    # its own weights loaded back: the masters keep what bf16 cannot hold
    kept = [opt.master(p).clone() for p in model.parameters()]
    assert any(not torch.equal(m, m.to(bf16).float()) for m in kept)
    model.load_state_dict(model.state_dict())
    assert all(torch.equal(opt.master(p), m) for p, m in zip(model.parameters(), kept,
                                                            strict=True))
    # bf16 weights from elsewhere: the masters start from them
    other = pa.apply(mlp(seed=1), default="bf16-true").state_dict()
    model.load_state_dict(other)
    assert all(torch.equal(opt.master(p), other[k].float())
               for k, p in zip(other, model.parameters(), strict=True))


def test_an_fp16_checkpoint_loaded_into_bf16_weights_gives_the_masters_its_own_values() -> None:
    """fp16 holds 3 mantissa bits bf16 drops, and widens to fp32 exactly: the masters start
    from the checkpoint, as `master.copy_(value)` by hand does (they used to start from the
    bf16-rounded weights: 0.00098 off the checkpoint, 0.0020 off the hand loop's weights two
    steps later); an fp16 checkpoint of the masters rounded keeps their bits."""
    model = pa.apply(mlp(), default="bf16-true,master=fp32")
    opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-2)
    train(model, opt, range(2))
    half = {k: v.to(fp16) for k, v in mlp(seed=1).state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (fp16 into bf16: the checkpoint's rounding warned)
        model.load_state_dict(half)
        assert all(torch.equal(opt.master(p), half[k].float())
                   for k, p in zip(half, model.parameters(), strict=True))
        kept = [opt.master(p).clone() for p in model.parameters()]
        model.load_state_dict({k: m.to(fp16) for k, m in zip(half, kept, strict=True)})
    assert all(torch.equal(opt.master(p), m)
               for p, m in zip(model.parameters(), kept, strict=True))


def test_loading_a_submodule_between_steps_restarts_the_masters_below_it() -> None:
    """`model[0].load_state_dict(...)` (a pretrained block, a reset head) mid-run: its masters
    start from the checkpoint, as a load of the whole model does (they were left as they
    were: the next step wrote them back, the weights 0.27 off the loaded ones, where one step
    moves them 0.010); the other masters stay as they were."""
    model = pa.apply(mlp(), default="bf16-true,master=fp32")
    opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-2)
    train(model, opt, range(2))
    head = [opt.master(p).clone() for p in model[2].parameters()]
    fp32_block = {k: v.float() for k, v in mlp(seed=1)[0].state_dict().items()}
    model[0].load_state_dict(fp32_block)
    assert all(torch.equal(opt.master(p), fp32_block[k])
               for k, p in model[0].named_parameters())
    assert all(torch.equal(opt.master(p), m)
               for p, m in zip(model[2].parameters(), head, strict=True))
    train(model, opt, range(2, 3))
    assert (model[0].weight.float() - fp32_block["weight"]).abs().max() < 0.02  # one step


def test_two_optimizers_stepping_one_parameter_update_one_master() -> None:
    """One optimizer over the model and one over its first layer again: by hand both update
    the one fp32 tensor. Each kept its own master and wrote it back over the other's updates
    (the weights 0.020 off the hand loop after 40 rounds at lr 5e-2, 0.00098 after 4 at
    1e-2); now they share one, also once both are loaded from their checkpoints."""
    model = pa.apply(mlp(), default="bf16-true,master=fp32")
    ref = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opts = (pa.optimizer(model, torch.optim.SGD, lr=5e-2),
            pa.optimizer(model, torch.optim.SGD, list(model[0].parameters()), lr=5e-2))
    hands = (torch.optim.SGD(ref, lr=5e-2, fused=True),
             torch.optim.SGD(ref[:2], lr=5e-2, fused=True))
    for step in range(3):
        x, y = batch(step)
        for opt, hand in zip(opts, hands, strict=True):
            opt.zero_grad()
            nn.functional.mse_loss(model(x.to(bf16)).float(), y).backward()
            for p, r in zip(model.parameters(), ref, strict=True):
                r.grad = p.grad.float()
            hand.step()
            opt.step()
    for p, r in zip(model.parameters(), ref, strict=True):
        assert torch.equal(opts[0].master(p), r) and torch.equal(p, r.to(bf16))
    saved = copy.deepcopy([opt.state_dict() for opt in opts])
    for opt, state in zip(opts, saved, strict=True):
        opt.load_state_dict(state)
    assert opts[0].master(model[0].weight) is opts[1].master(model[0].weight)


def _lion() -> type[torch.optim.Optimizer]:
    bnb = pytest.importorskip("bitsandbytes")
    return bnb.optim.Lion  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", ["SGD", "Adagrad", "Lion"])
def test_stochastic_rounding_with_any_class_lands_where_fp32_does(name: str) -> None:
    """200 small updates of weights of 1.0 (each below bf16's resolution there): plain bf16
    storage never moves; with master='stochastic' the class's own update, computed in fp32 and
    written back with torchao's stochastic rounding, lands where fp32 does."""
    cls, kwargs = {"SGD": (torch.optim.SGD, {"lr": 1e-4}),
                   "Adagrad": (torch.optim.Adagrad, {"lr": 1e-3}),
                   "Lion": (None, {"lr": 1e-4})}[name]
    cls = cls or _lion()

    def final(spec: str) -> float:
        torch.manual_seed(0)
        model = pa.apply(nn.Linear(64, 64, bias=False), default=spec)
        with torch.no_grad():
            model.weight.fill_(1.0)
        opt = pa.optimizer(model, cls, **kwargs)
        for _ in range(200):
            model.weight.grad = torch.ones_like(model.weight)
            opt.step()
        return float(model.weight.detach().float().mean())

    fp32_lands = final("fp32")
    assert fp32_lands < 0.99
    assert final("bf16-true") == 1.0  # every update rounds away
    assert abs(final("bf16-true,master=stochastic") - fp32_lands) < 2e-3
