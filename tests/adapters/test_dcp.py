"""`torch.distributed.checkpoint` into an applied model, in one process: DCP loads each saved
tensor into the state dict's own tensor, so the plan's dtypes are kept; `adapters.dcp.LoadPlanner`
says what a checkpoint held narrower than the plan keeps (DCP alone casts silently), and reads
an optimizer's state saved under another update layout as `load_state_dict` reads it. The
2-rank FSDP2 case is tests/adapters/test_fsdp.py's."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from precision_annot import apply
from precision_annot.adapters.dcp import LoadPlanner
from tests.test_checkpoints import ISLANDS, PLANNED, Net, by_hand, loaded, saved

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def load(path: Path, planner: LoadPlanner | None) -> tuple[dict[str, torch.Tensor], list[str]]:
    model = apply(Net(), default="bf16-true")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(model.state_dict(), checkpoint_id=str(path), planner=planner)
    return loaded(model), [str(w.message) for w in caught]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dcp_loads_into_the_planned_dtypes_and_the_planner_names_what_was_lost(
        dtype: torch.dtype, tmp_path: Path) -> None:
    state = saved(dtype)
    dcp.save(state, checkpoint_id=str(tmp_path))
    for planner in (None, LoadPlanner()):
        after, said = load(tmp_path, planner)
        assert {k: v.dtype for k, v in after.items()} == PLANNED
        assert all(torch.equal(after[k], v) for k, v in by_hand(state).items())
        if planner is None or dtype == torch.float32:
            assert said == []  # DCP alone casts silently
        else:
            (message,) = said
            assert message.startswith("torch.distributed.checkpoint.load: the checkpoint holds "
                                      "4 tensor(s) narrower than the plan keeps them")
            assert all(repr(n) in message for n in ISLANDS)


def test_the_planner_reads_a_nested_state_as_dcp_flattens_it(tmp_path: Path) -> None:
    """The usual app state, {"model": ...}: keys are flattened by DCP itself."""
    dcp.save({"model": saved(torch.bfloat16)}, checkpoint_id=str(tmp_path))
    model = apply(Net(), default="bf16-true")
    with pytest.warns(UserWarning, match=r"'model.norm.weight'"):
        dcp.load({"model": model.state_dict()}, checkpoint_id=str(tmp_path),
                 planner=LoadPlanner())
    assert model.norm.weight.dtype == torch.float32


# -- an optimizer's state across update layouts -------------------------------------------------

#: the update layouts a checkpoint may be saved in and loaded into
LAYOUTS = {"plain bf16": "bf16-true", "masters": "bf16-true,master=fp32",
           "8-bit": "bf16-true,master=fp32,optim=8bit",
           "bf16 state": "bf16-true,master=fp32,optim=bf16"}
#: the pairs the fast suite loads across (the others are slow)
FAST_PAIRS = {("plain bf16", "masters"), ("8-bit", "plain bf16")}


def mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # 8,192 elements in each weight: an 8-bit state quantizes them
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, 64))


def step_batch(step: int) -> torch.Tensor:
    return torch.randn(8, 64, generator=torch.Generator().manual_seed(50 + step))


def trained(spec: str, seed: int, steps: int, start: int = 0) -> tuple[torch.nn.Module, Any]:
    import precision_annot as pa

    model = apply(mlp(seed), default=spec)
    opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    train(model, opt, start, steps)
    return model, opt


def train(model: torch.nn.Module, opt: Any, start: int, steps: int) -> None:
    for step in range(start, start + steps):
        opt.zero_grad()
        model(step_batch(step).to(model[0].weight.dtype)).float().pow(2).mean().backward()
        opt.step()


def save_both(model: torch.nn.Module, opt: Any, path: Path) -> None:
    """One run saved twice: by DCP (get_*_state_dict) and by torch.save (state_dict)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(
        model, opt)}, checkpoint_id=str(path / "dcp"))
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path / "ckpt.pt")


def dcp_resume(spec: str, path: Path, planner: Any, *, optimizer_first: bool = False,
               stepped: int = 0, model_set: bool = True
               ) -> tuple[torch.nn.Module, Any, list[str]]:
    """A fresh run (another initialisation; `stepped` steps taken), set from the DCP
    checkpoint as DCP's recipe does: get_*_state_dict, dcp.load (into the model's own
    tensors), set_*_state_dict (the model's left out unless `model_set`)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model, opt = trained(spec, 1, stepped, start=10)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path / "dcp"), planner=planner)
        sets = [lambda: set_model_state_dict(model, state["model"]),
                lambda: set_optimizer_state_dict(model, opt, state["optim"])][not model_set:]
        for set_one in reversed(sets) if optimizer_first else sets:
            set_one()
    return model, opt, [str(w.message) for w in caught]


def torch_resume(spec: str, path: Path) -> tuple[torch.nn.Module, Any, list[str]]:
    model, opt = trained(spec, 1, 0)
    saved = torch.load(path / "ckpt.pt", weights_only=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
    return model, opt, [str(w.message) for w in caught]


def same_value(a: Any, b: Any) -> bool:
    if hasattr(a, "codes") or hasattr(b, "codes"):  # torchao's low-bit states
        return type(a) is type(b) and all(torch.equal(getattr(a, n), getattr(b, n))
                                          for n in a.__tensor_flatten__()[0])
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return bool(a == b)


def assert_same_runs(a: torch.nn.Module, oa: Any, b: torch.nn.Module, ob: Any) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert p.dtype == q.dtype and torch.equal(p, q), name
        sa, sb = oa.state.get(p, {}), ob.state.get(q, {})
        assert sorted(sa) == sorted(sb), (name, sorted(sa), sorted(sb))
        assert all(same_value(sa[k], sb[k]) for k in sa), name


PAIRS = [pytest.param(s, t, marks=() if (s, t) in FAST_PAIRS else pytest.mark.slow,
                      id=f"{s} -> {t}") for s in LAYOUTS for t in LAYOUTS if s != t]


@pytest.mark.parametrize(("source", "target"), PAIRS)
def test_dcp_across_layouts_does_what_load_state_dict_does(source: str, target: str,
                                                          tmp_path: Path) -> None:
    """A checkpoint of one update layout loaded into an optimizer of another, by DCP with
    `LoadPlanner` (get_*_state_dict, dcp.load, set_*_state_dict) and by torch.load with
    load_state_dict: the same weights, masters and states (formats included), the same
    warnings, and the same two steps after. Before: DCP refused 8 of these 12 pairs ("Missing
    key in checkpoint state_dict: optim.state.0.weight.master", "... exp_avg", "...
    exp_avg.__tensor_subclass__"), and read bf16 moments into fp32 ones without the warning
    load_state_dict gives."""
    pytest.importorskip("torchao")
    save_both(*trained(LAYOUTS[source], 0, 2), tmp_path)
    by_dcp, opt_dcp, said_dcp = dcp_resume(LAYOUTS[target], tmp_path, LoadPlanner())
    by_torch, opt_torch, said_torch = torch_resume(LAYOUTS[target], tmp_path)
    assert said_dcp == said_torch
    assert_same_runs(by_dcp, opt_dcp, by_torch, opt_torch)
    train(by_dcp, opt_dcp, 2, 2)
    train(by_torch, opt_torch, 2, 2)
    assert_same_runs(by_dcp, opt_dcp, by_torch, opt_torch)


class HandMasters:
    """The hand loop a plain run resumes into with fp32 masters: the masters from the
    checkpoint's weights (bf16 ones widened, fp32 ones as they are), the moments its own
    widened, its step count; torch's AdamW(fused=True) over the masters, copied back
    rounded."""

    def __init__(self, path: Path) -> None:
        saved = torch.load(path / "ckpt.pt", weights_only=True)
        self.model = apply(mlp(1), default="bf16")
        self.model.load_state_dict(saved["model"])
        self.masters = [saved["model"][n].float().clone()
                        for n, _ in self.model.named_parameters()]
        self.opt = torch.optim.AdamW(self.masters, lr=1e-2, weight_decay=0.1, fused=True)
        for i, m in enumerate(self.masters):
            held = saved["optim"]["state"][i]
            self.opt.state[m] = {"step": held["step"].float().clone(),
                                 "exp_avg": held["exp_avg"].float(),
                                 "exp_avg_sq": held["exp_avg_sq"].float()}

    def train(self, start: int, steps: int) -> None:
        for step in range(start, start + steps):
            self.model.zero_grad()
            self.model(step_batch(step).to(torch.bfloat16)).float().pow(2).mean().backward()
            for m, p in zip(self.masters, self.model.parameters(), strict=True):
                m.grad = p.grad.float()
            self.opt.step()
            with torch.no_grad():
                for m, p in zip(self.masters, self.model.parameters(), strict=True):
                    p.copy_(m)


@pytest.mark.parametrize("how", ["LoadPlanner", "allow_partial_load", "partial, optimizer first",
                                 "partial, into a run under way"])
def test_a_plain_bf16_checkpoint_resumes_a_masters_run_as_by_hand(how: str,
                                                                   tmp_path: Path) -> None:
    """A plain bf16 run's DCP checkpoint into a run with fp32 masters: the masters start from
    the loaded weights, then 3 steps equal the hand loop bit for bit, whichever planner,
    whichever of set_model_state_dict and set_optimizer_state_dict comes first, and into a
    run that has stepped (its own masters held) with the model loaded in place by dcp.load
    alone (no set_model_state_dict). Before, with
    DCP's `DefaultLoadPlanner(allow_partial_load=True)`: the fresh optimizer's masters (the new
    model's own initial weights) were written over the loaded weights (up to 2.6e-1 off the
    checkpoint here), with no warning; without that flag, DCP refuses (its own "Missing key in
    checkpoint state_dict: optim.state.0.weight.master", kept: LoadPlanner is the way)."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    save_both(*trained(LAYOUTS["plain bf16"], 0, 2), tmp_path)
    planner = LoadPlanner() if how == "LoadPlanner" else DefaultLoadPlanner(
        allow_partial_load=True)
    under_way = how.endswith("under way")
    model, opt, said = dcp_resume(LAYOUTS["masters"], tmp_path, planner,
                                  optimizer_first=how.endswith("first"),
                                  stepped=2 if under_way else 0, model_set=not under_way)
    if how == "LoadPlanner":  # the moments read as saved, then widened: as load_state_dict
        (message,) = said
        assert message.startswith("load_state_dict: the checkpoint holds 8 state tensor(s) "
                                  "narrower than planned (0.weight exp_avg (bf16, planned fp32)")
    else:  # DCP casts them into the fp32 state it loads into, silently
        assert said == []
    hand = HandMasters(tmp_path)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), hand.model.parameters(),
                                                 strict=True))
    train(model, opt, 2, 3)
    hand.train(2, 3)
    for (name, p), q, m in zip(model.named_parameters(), hand.model.parameters(), hand.masters,
                               strict=True):
        assert torch.equal(p, q) and torch.equal(opt.master(p), m), name
    with pytest.raises(CheckpointException, match=r"Missing key in checkpoint state_dict: "
                                                  r"optim\.state\.0\.weight\.master"):
        dcp_resume(LAYOUTS["masters"], tmp_path, DefaultLoadPlanner())


def test_a_partial_load_that_leaves_states_unloaded_says_so(tmp_path: Path) -> None:
    """DCP's own planner with `allow_partial_load=True`, a plain run's checkpoint into an
    8-bit optimizer: its moments are not in the checkpoint under the names the 8-bit layout
    saves, so they keep the fresh optimizer's zeros beside a loaded step count; a warning
    names them and the planner that loads them."""
    pytest.importorskip("torchao")
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    save_both(*trained(LAYOUTS["plain bf16"], 0, 2), tmp_path)
    *_, said = dcp_resume(LAYOUTS["8-bit"], tmp_path, DefaultLoadPlanner(allow_partial_load=True))
    (message,) = said
    assert message.startswith("load_state_dict: 4 state tensor(s) were not loaded (0.weight "
                              "exp_avg, 0.weight exp_avg_sq")
    assert "planner=precision_annot.adapters.dcp.LoadPlanner()" in message


def test_an_fp32_run_resumes_a_meta_initialised_run_with_masters_as_by_hand(
        tmp_path: Path) -> None:
    """Meta-device init, `apply`, `to_empty`, the optimizer, then DCP's recipe from an fp32
    run's checkpoint (plain fp32 weights and AdamW moments, no masters): the weights are its
    bf16 rounding, the masters its own fp32 values, and 3 steps equal the hand loop bit for
    bit. Before: DCP refused the load ("Missing key ... .master"); loaded partially, the
    masters were the rounded weights (and, set after the model, the fresh masters were
    written over it)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    import precision_annot as pa

    save_both(*trained("fp32", 0, 2), tmp_path)
    with torch.device("meta"):
        model = mlp(1)
    apply(model, default=LAYOUTS["masters"])
    model.to_empty(device="cpu")
    opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fp32 into bf16 weights with masters: nothing lost
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), planner=LoadPlanner())
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
    hand = HandMasters(tmp_path)
    saved = opt.state_dict()["state"]
    for i, ((name, p), q, m) in enumerate(zip(model.named_parameters(), hand.model.parameters(),
                                              hand.masters, strict=True)):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q), name
        assert torch.equal(saved[i]["master"], m), name
    train(model, opt, 2, 3)
    hand.train(2, 3)
    for (name, p), q, m in zip(model.named_parameters(), hand.model.parameters(), hand.masters,
                               strict=True):
        assert torch.equal(p, q) and torch.equal(opt.master(p), m), name


@pytest.mark.usefixtures("group")
def test_dcp_resumes_the_dtensor_masters_of_a_tensor_parallel_run(tmp_path: Path) -> None:
    """Masters that are DTensors (tensor parallel, one rank here): DCP loads into their local
    tensors, which leaves each DTensor's own version counter as it was; the load is still
    seen (the local tensor's counter is read), the masters are loaded, and a step after
    equals the run that saved them."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    import precision_annot as pa
    from precision_annot.adapters.tp import parallelize_module

    mesh = init_device_mesh("cpu", (1,))

    def build(seed: int) -> tuple[torch.nn.Module, Any]:
        model = apply(mlp(seed), default=LAYOUTS["masters"])
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        return model, pa.optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)

    model, opt = build(0)
    train(model, opt, 0, 2)
    assert type(opt.master(model[0].weight)).__name__ == "DTensor"
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(
        model, opt)}, checkpoint_id=str(tmp_path))
    again, reopened = build(1)
    state = {"model": get_model_state_dict(again),
             "optim": get_optimizer_state_dict(again, reopened)}
    dcp.load(state, checkpoint_id=str(tmp_path))
    set_model_state_dict(again, state["model"])
    set_optimizer_state_dict(again, reopened, state["optim"])
    train(model, opt, 2, 1)
    train(again, reopened, 2, 1)
    for (name, p), q in zip(model.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(p.full_tensor(), q.full_tensor()), name
        assert torch.equal(opt.master(p).full_tensor(), reopened.master(q).full_tensor()), name
