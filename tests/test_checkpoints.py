"""Loading a checkpoint into an applied model keeps the plan: every tensor in its planned dtype
after `load_state_dict` (plain and `assign=True`) and `set_model_state_dict`, with a warning
naming the tensors a checkpoint holds narrower than the plan keeps them. Judged against the
same load written by hand (each tensor cast to its planned dtype)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from precision_annot import (
    Finding,
    PrecisionPlan,
    applied_plan,
    apply,
    bf16,
    check,
    fp32,
    precision,
)
from precision_annot.adapters.dcp import LoadPlanner

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

PLANNED = {"up.weight": bf16, "up.bias": bf16, "norm.weight": fp32, "norm.bias": fp32,
           "router.weight": fp32, "router.bias": fp32, "down.weight": bf16, "down.bias": bf16}
ISLANDS = ["norm.weight", "norm.bias", "router.weight", "router.bias"]


class Net(nn.Module):
    """A bf16 model with an fp32 norm and an fp32 router, as an MoE block keeps them."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.norm = precision(fp32)(nn.LayerNorm(16))
        self.router = precision(fp32)(nn.Linear(16, 4))
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.up(x))
        return self.down(h) * self.router(h).softmax(-1).sum(-1, keepdim=True)


def saved(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A checkpoint of another instance, every tensor in `dtype` (norm weights off 1.0, so
    that bf16 rounds them)."""
    torch.manual_seed(1)
    source = Net()
    with torch.no_grad():
        source.norm.weight.add_(torch.randn(16) * 0.1)
    return {k: v.detach().to(dtype) for k, v in source.state_dict().items()}


def by_hand(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the load should give: each saved tensor cast to its planned dtype."""
    return {k: v.to(PLANNED[k]) for k, v in state.items()}


def loaded(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict_keeps_every_planned_dtype(assign: bool) -> None:
    """0.4: assign=True put the checkpoint's bf16 tensors in the fp32 islands and its fp32
    tensors in the bf16 layers (a warning said so; the plan was gone until apply again)."""
    for dtype in (torch.float32, bf16):
        model = apply(Net(), default="bf16-true")
        state = saved(dtype)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.load_state_dict(state, assign=assign)
        after = loaded(model)
        assert {k: v.dtype for k, v in after.items()} == PLANNED
        for key, value in by_hand(state).items():
            assert torch.equal(after[key], value), key
        said = [str(w.message) for w in caught]
        if dtype == fp32:  # wider than the plan keeps anything: nothing is lost
            assert said == []
        else:  # the islands were saved in bf16: their precision was gone before this load
            (message,) = said
            assert message.startswith("load_state_dict: the checkpoint holds 4 tensor(s) "
                                       "narrower than the plan keeps them (saved in bf16, "
                                       "kept in fp32)")
            assert all(repr(n) in message for n in ISLANDS)
            assert not any(repr(n) in message for n in PLANNED if n not in ISLANDS)
        out = model(torch.randn(4, 8, dtype=bf16))  # it runs as planned
        assert out.dtype == bf16


def test_assign_keeps_the_parameters_the_plan_guards() -> None:
    """After assign=True the model holds new parameter objects; the step guard that refuses a
    plain optimizer for a plan with masters knows them too."""
    model = apply(Net(), default="bf16-true,master=fp32")
    model.load_state_dict(saved(fp32), assign=True)
    assert model.up.weight.dtype == bf16
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 8, dtype=bf16)).float().sum().backward()
    with pytest.raises(RuntimeError, match=r"SGD.step\(\): it updates parameter 'up.weight'"):
        sgd.step()


def test_set_model_state_dict_keeps_the_plan_and_names_what_was_lost() -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    model = apply(Net(), default="bf16-true")
    state = saved(bf16)
    with pytest.warns(UserWarning, match=r"4 tensor\(s\) narrower.*'norm.weight'"):
        set_model_state_dict(model, state)
    after = loaded(model)
    assert {k: v.dtype for k, v in after.items()} == PLANNED
    assert all(torch.equal(after[k], v) for k, v in by_hand(state).items())


def test_a_load_into_a_submodule_prefix_and_a_wrapper_is_read_with_its_prefix() -> None:
    """DDP-style and nested loads reach the applied root with a prefix: the names are the
    root's own."""
    outer = nn.Sequential(apply(Net(), default="bf16-true"))
    with pytest.warns(UserWarning, match=r"'0.norm.weight'"):
        outer.load_state_dict({f"0.{k}": v for k, v in saved(bf16).items()})
    assert outer[0].norm.weight.dtype == fp32


# -- check(..., "checkpoint"): what a load would do, read before loading ------------------------

def masters_plan() -> tuple[nn.Module, PrecisionPlan]:
    """bf16 weights with fp32 masters, an fp32 norm and an fp32 router: applied."""
    model = apply(Net(), default="bf16-master")
    plan = applied_plan(model)
    assert plan is not None
    return model, plan


def app_state(model: nn.Module, masters: torch.dtype | None) -> dict[str, Any]:
    """What a training checkpoint holds, the DCP way: the model's state dict, and, with
    `masters`, the optimizer's state by parameter name with each master copy (the layout an
    optimizer state dict has under DCP: state.<name>.<state>) in that dtype."""
    out: dict[str, Any] = {"model": model.state_dict()}
    if masters is not None:
        out["optim"] = {"state": {n: {"master": p.detach().to(masters), "step": torch.tensor(1.0)}
                                  for n, p in model.named_parameters()
                                  if p.dtype == bf16}}
    return out


def codes(found: list[Finding]) -> list[tuple[str, str, str]]:
    """(severity, code, the first tensor it names: the quoted name after the path)."""
    return [(f.severity, f.code, re.findall(r"'([^']*)'", f.message)[1]) for f in found]


def test_a_checkpoint_of_the_plan_itself_is_clean_in_every_format(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model, plan = masters_plan()
    state = app_state(model, fp32)
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    torch.save(state, tmp_path / "ckpt.pt")
    torch.save({"state_dict": model.state_dict(), "epoch": 3}, tmp_path / "lightning.ckpt")
    save_file(model.state_dict(), str(tmp_path / "model.safetensors"))
    for path in ("dcp", "ckpt.pt"):
        assert check(plan, "checkpoint", {"path": tmp_path / path}) == []
    # the model's weights alone: clean but for the masters it does not hold
    for path in ("lightning.ckpt", "model.safetensors"):
        found = check(plan, "checkpoint", {"path": str(tmp_path / path)})
        assert [(f.severity, f.code) for f in found] == [("warning", "checkpoint-no-masters")]
        assert found[0].modules == ("up", "down")


def test_a_bf16_checkpoint_names_every_narrowed_tensor_as_the_load_rounds_it(
        tmp_path: Path) -> None:
    """Every tensor saved in bf16, the masters too: the 4 island tensors and the 4 masters
    are errors, each named; loading it gives what the errors say (the islands come back with
    bf16's rounding, and the load's own warning names the same 4 tensors)."""
    model, plan = masters_plan()
    with torch.no_grad():
        model.norm.weight.add_(torch.randn(16) * 0.1)
    state = app_state(model, bf16)
    state["model"] = {k: v.to(bf16) for k, v in state["model"].items()}
    dcp.save(state, checkpoint_id=str(tmp_path))
    found = check(plan, "checkpoint", {"path": tmp_path})
    narrowed = sorted(name for severity, code, name in codes(found)
                      if (severity, code) == ("error", "checkpoint-narrowed"))
    assert narrowed == sorted([*ISLANDS, "up.weight (its master)", "up.bias (its master)",
                               "down.weight (its master)", "down.bias (its master)"])
    assert {f.severity for f in found} == {"error"}
    # what the load does: the islands widened with bf16's rounding, named again
    fresh, _ = masters_plan()
    with pytest.warns(UserWarning, match="narrower") as said:
        dcp.load({"model": fresh.state_dict()}, checkpoint_id=str(tmp_path),
                 planner=LoadPlanner())
    message = next(str(w.message) for w in said if "narrower" in str(w.message))
    assert all(repr(f"model.{n}") in message for n in ISLANDS)
    assert torch.equal(fresh.norm.weight, model.norm.weight.to(bf16).float())


def test_missing_unexpected_and_reshaped_tensors_are_what_load_state_dict_refuses(
        tmp_path: Path) -> None:
    model, plan = masters_plan()
    state = dict(model.state_dict())
    del state["router.bias"]
    state["extra.weight"] = torch.zeros(3)
    state["down.weight"] = torch.zeros(8, 17, dtype=bf16)
    torch.save(state, tmp_path / "other.pt")
    found = check(plan, "checkpoint", {"path": tmp_path / "other.pt"})
    assert sorted(codes(found)) == [
        ("error", "checkpoint-shape", "down.weight"),
        ("warning", "checkpoint-missing", "router.bias"),
        ("warning", "checkpoint-no-masters", "up.weight"),
        ("warning", "checkpoint-unexpected", "extra.weight")]
    fresh, _ = masters_plan()
    with pytest.raises(RuntimeError) as refused:
        fresh.load_state_dict(state)
    for said in ("Missing key(s) in state_dict: \"router.bias\"",
                 "Unexpected key(s) in state_dict: \"extra.weight\"",
                 "size mismatch for down.weight"):
        assert said in str(refused.value)


def test_a_checkpoint_is_read_without_its_tensor_data(tmp_path: Path) -> None:
    """The data is made unreadable (DCP's data files deleted, a safetensors file's data replaced
    by a hole, a torch.save file's data records cut out): the dtypes are still read."""
    import json
    import struct
    import zipfile

    from safetensors.torch import save_file

    model, plan = masters_plan()
    bf16_state = {k: v.to(bf16) for k, v in model.state_dict().items()}
    dcp.save(bf16_state, checkpoint_id=str(tmp_path / "dcp"))
    for data in (tmp_path / "dcp").glob("*.distcp"):
        data.unlink()
    shards = {"model-1.safetensors": ["up.weight", "up.bias", "norm.weight", "norm.bias"],
              "model-2.safetensors": ["router.weight", "router.bias", "down.weight",
                                      "down.bias"]}
    (tmp_path / "hf").mkdir()
    for shard, keys in shards.items():
        save_file({k: bf16_state[k] for k in keys}, str(tmp_path / "hf" / shard))
        raw = (tmp_path / "hf" / shard).read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        with (tmp_path / "hf" / shard).open("wb") as f:  # the header, then a hole for the data
            f.write(raw[:8 + length])
            f.truncate(len(raw))
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: s for s, ks in shards.items() for k in ks}}))
    torch.save(bf16_state, tmp_path / "full.pt")
    with zipfile.ZipFile(tmp_path / "full.pt") as full, \
            zipfile.ZipFile(tmp_path / "cut.pt", "w") as cut:
        for item in full.infolist():
            if "/data/" not in item.filename:
                cut.writestr(item, full.read(item))
    for path in ("dcp", "hf", "hf/model.safetensors.index.json", "cut.pt"):
        found = check(plan, "checkpoint", {"path": tmp_path / path})
        assert sorted(n for s, c, n in codes(found) if c == "checkpoint-narrowed") == sorted(
            ISLANDS), path
    with pytest.raises(Exception):  # noqa: B017  # the data itself is gone
        torch.load(tmp_path / "cut.pt")


def test_bad_checkpoint_configs_name_what_is_valid(tmp_path: Path) -> None:
    _, plan = masters_plan()
    with pytest.raises(ValueError, match=r"needs config=\{'path': \.\.\.\}"):
        check(plan, "checkpoint")
    with pytest.raises(ValueError, match=r"unknown key 'file'; valid: \['path'\]"):
        check(plan, "checkpoint", {"file": "x"})
    with pytest.raises(ValueError, match="no file or directory at"):
        check(plan, "checkpoint", {"path": tmp_path / "gone"})
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="nor a file torch.save writes"):
        check(plan, "checkpoint", {"path": tmp_path / "notes.txt"})


def test_masters_are_found_by_name_in_dcp_and_in_an_optimizer_state_dict_with_param_names(
        tmp_path: Path) -> None:
    """A training checkpoint as users write it: DCP's `get_optimizer_state_dict` (state by
    name), or the state dict of an optimizer given named parameters, in another order than
    the model's (its groups' `param_names`): each master is found and compared by name; a
    `torch.save`d `optimizer.state_dict()` without names is compared as a whole."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    import precision_annot as pa

    model, plan = masters_plan()
    opt = pa.optimizer(model, torch.optim.AdamW, lr=1e-3)
    model(torch.randn(4, 8, dtype=bf16)).float().sum().backward()
    opt.step()
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=str(tmp_path / "dcp"))
    assert check(plan, "checkpoint", {"path": tmp_path / "dcp"}) == []
    names = [n for n, _ in model.named_parameters()][::-1]

    def named(masters: torch.dtype) -> dict[str, Any]:
        state = opt.state_dict()
        entries = {k: dict(state["state"][len(names) - 1 - k]) for k in range(len(names))}
        for entry in entries.values():
            if "master" in entry:
                entry["master"] = entry["master"].to(masters)
        return {"state": entries, "param_groups": [{**state["param_groups"][0], "params": list(
            range(len(names))), "param_names": names}]}

    torch.save({"model": model.state_dict(), "optimizer": named(fp32)}, tmp_path / "n.pt")
    assert check(plan, "checkpoint", {"path": tmp_path / "n.pt"}) == []
    torch.save({"model": model.state_dict(), "optimizer": named(bf16)}, tmp_path / "b.pt")
    found = check(plan, "checkpoint", {"path": tmp_path / "b.pt"})
    assert sorted(name for _, _, name in codes(found)) == [
        "down.bias (its master)", "down.weight (its master)", "up.bias (its master)",
        "up.weight (its master)"]
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "a.pt")
    assert [f.code for f in check(plan, "checkpoint", {"path": tmp_path / "a.pt"})] == [
        "checkpoint-masters-by-index"]


# -- what b35 broke: a checkpoint of another thing, masters by name, tied tensors ---------------

def test_an_optimizers_state_dict_is_one_error_saying_what_it_is(tmp_path: Path) -> None:
    """0.4 listed every model tensor as missing and every moment as unexpected (2 warnings,
    exit status 0): a load of this file into the model loads nothing."""
    _, plan = masters_plan()
    plain = Net()
    adam = torch.optim.Adam(plain.parameters())
    plain(torch.randn(2, 8)).sum().backward()
    adam.step()
    torch.save(adam.state_dict(), tmp_path / "optim.pt")
    found = check(plan, "checkpoint", {"path": tmp_path / "optim.pt"})
    assert [(f.severity, f.code) for f in found] == [("error", "checkpoint-foreign")]
    assert "none of the model's 8 tensor(s)" in found[0].message
    assert "an optimizer's state_dict" in found[0].message
    fresh, _ = masters_plan()
    loaded = fresh.load_state_dict(torch.load(tmp_path / "optim.pt"), strict=False)
    assert len(loaded.missing_keys) == 8  # what a load of it does


class Nested(nn.Module):
    """`block.fc` before `fc`: a name that ends another ('fc.weight' ends 'block.fc.weight')."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Module()
        self.block.fc = nn.Linear(4, 4)
        self.fc = nn.Linear(4, 4)


def test_each_master_is_the_one_saved_under_its_own_name(tmp_path: Path) -> None:
    """0.4 took the first master whose key ended with the parameter's name: 'fc.weight' was
    judged by 'block.fc.weight''s bf16 master."""
    model = apply(Nested(), default="bf16-master")
    plan = applied_plan(model)
    assert plan is not None
    masters = {n: p.detach().to(bf16 if n.startswith("block.") else fp32)
               for n, p in model.named_parameters()}
    dcp.save({"model": model.state_dict(),
              "optim": {"state": {n: {"master": m} for n, m in masters.items()}}},
             checkpoint_id=str(tmp_path))
    found = check(plan, "checkpoint", {"path": tmp_path})
    assert sorted(name for _, code, name in codes(found) if code == "checkpoint-narrowed") == [
        "block.fc.bias (its master)", "block.fc.weight (its master)"]


def test_a_checkpoint_holding_the_model_twice_says_which_copy_it_read(tmp_path: Path) -> None:
    """An EMA copy saved beside the weights: both prefixes hold every tensor."""
    model, plan = masters_plan()
    state = model.state_dict()
    torch.save({"model": state, "ema": {k: v.to(bf16) for k, v in state.items()}},
               tmp_path / "ema.pt")
    found = check(plan, "checkpoint", {"path": tmp_path / "ema.pt"})
    (said,) = [f for f in found if f.code == "checkpoint-prefix"]
    assert said.severity == "info" and "under 2 prefixes ('ema.' and 'model.')" in said.message
    assert "read those under 'ema.'" in said.message


def test_assign_keeps_tied_tensors_in_one_storage_as_plain_torch_does() -> None:
    """An embedding tied to its head, loaded with assign=True from a state dict that holds the
    one tensor under both names: torch gives the two modules parameters over one storage
    (an update of one is an update of the other); 0.4 cast each on its own into two
    storages, so the tie was silently gone."""

    def tied() -> nn.Module:
        model = nn.Sequential(nn.Embedding(10, 8), precision(fp32)(nn.LayerNorm(8)),
                              nn.Linear(8, 10, bias=False))
        model[2].weight = model[0].weight
        return model

    source = tied()
    state = source.state_dict()
    assert state["0.weight"].data_ptr() == state["2.weight"].data_ptr()
    plain = tied()
    plain.load_state_dict(state, assign=True)
    model = apply(tied(), default="bf16-true")
    model.load_state_dict(state, assign=True)
    for loaded in (plain, model):
        assert loaded[0].weight.data_ptr() == loaded[2].weight.data_ptr()
    assert model[0].weight.dtype == bf16 and model[1].weight.dtype == fp32
    with torch.no_grad():
        model[0].weight.add_(1.0)
    assert torch.equal(model[2].weight, model[0].weight)


def test_assign_into_fp8_all_gather_layers_keeps_the_wrapper_and_the_loaded_values() -> None:
    """comm=fp8: torchao wraps the weight for FSDP2's fp8 all-gather. assign=True put a plain
    parameter there; 0.4 left it plain (the fp8 all-gather silently gone) and `remove` then gave
    back the weight from before the load (the loaded values lost). Judged against apply on a
    model that loaded the same state dict before it was applied."""
    pytest.importorskip("torchao")
    from precision_annot import annotate, remove

    def fp8_model() -> nn.Module:
        model = nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 32))
        annotate(model, {nn.Linear: "compute=fp8,comm=fp8"})
        return model

    state = fp8_model().state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchao's import notes
        model = apply(fp8_model(), default="bf16-mixed")
        model.load_state_dict(state, assign=True)
        reference = fp8_model()
        reference.load_state_dict(state)
        apply(reference, default="bf16-mixed")
    for i in (0, 2):
        assert type(model[i].weight) is type(reference[i].weight)
        assert type(model[i].weight).__name__ != "Parameter"
    x = torch.randn(4, 32)
    assert torch.equal(model(x), reference(x))
    remove(model)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_a_floating_tensor_saved_as_integers_or_complex_is_an_error(tmp_path: Path) -> None:
    """What torch does with each, by hand: int8 codes and bools are copied in as numbers and a
    complex value loses its imaginary part, silently; a quantized tensor is refused. 0.4
    compared floating dtypes only, and said nothing of any of them."""
    model, plan = masters_plan()
    state = dict(model.state_dict())
    state["up.weight"] = torch.randint(-8, 8, (16, 8), dtype=torch.int8)
    state["up.bias"] = torch.ones(16, dtype=torch.bool)
    state["down.bias"] = torch.ones(8, dtype=torch.complex64)
    torch.save(state, tmp_path / "codes.pt")
    found = check(plan, "checkpoint", {"path": tmp_path / "codes.pt"})
    kinds = {name: f.message for f in found for s, c, name in codes([f])
             if c == "checkpoint-kind"}
    assert set(kinds) == {"up.weight", "up.bias", "down.bias"}
    assert "as values, silently" in kinds["up.weight"]
    assert "imaginary part away" in kinds["down.bias"]
    fresh, _ = masters_plan()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own complex-to-real note
        fresh.load_state_dict(state)
    assert torch.equal(fresh.up.weight, state["up.weight"].to(bf16))  # the codes, as values


def test_masters_saved_by_parameter_index_are_counted_not_called_missing(tmp_path: Path) -> None:
    """`torch.save({"model": ..., "optimizer": optimizer.state_dict()})` keys the state by the
    parameter's index (`optimizer.state.0.master`): 0.4 warned that the checkpoint held no
    masters at all. Their dtypes are compared as a whole."""
    model, plan = masters_plan()
    weights = [p for p in model.parameters() if p.dtype == bf16]
    for dtype, expected in ((fp32, ("info", "checkpoint-masters-by-index")),
                            (bf16, ("error", "checkpoint-narrowed"))):
        state = {i: {"master": p.detach().to(dtype), "exp_avg": torch.zeros_like(p)}
                 for i, p in enumerate(weights)}
        torch.save({"model": model.state_dict(),
                    "optimizer": {"state": state, "param_groups": [{"params": [0, 1, 2, 3]}]}},
                   tmp_path / "run.pt")
        found = check(plan, "checkpoint", {"path": tmp_path / "run.pt"})
        assert [(f.severity, f.code) for f in found] == [expected], dtype
        assert "4 master copies keyed by the optimizer's parameter index" in found[0].message


# -- PEFT adapters -----------------------------------------------------------------------------

def llama(layers: int = 2, hidden: int = 16) -> nn.Module:
    """A Llama of a small configuration (random weights, no hub)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=hidden, intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32))


def lora_adapter(path: Path, dtype: torch.dtype = fp32, **config: Any) -> dict[str, torch.Tensor]:
    """A PEFT LoRA adapter of `llama()` (q_proj and v_proj), trained to random values (B starts
    at zero), saved by PEFT's `save_pretrained`; its tensors, by the names PEFT saved them."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    model = get_peft_model(llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                               **config))
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.normal_()
    model.to(dtype).save_pretrained(str(path))
    return load_file(str(path / "adapter_model.safetensors"))


LORA_MODULES = tuple(f"model.layers.{i}.self_attn.{p}" for i in (0, 1)
                     for p in ("q_proj", "v_proj"))


def test_a_peft_adapter_is_read_as_weights_peft_model_from_pretrained_adds(tmp_path: Path) -> None:
    """0.5 called a LoRA adapter `checkpoint-foreign` (an error; the CLI: exit status 1), though
    PeftModel.from_pretrained loads it bit for bit: its keys are LoRA weights beside the base
    model's modules, not the model's own tensors."""
    pytest.importorskip("peft")
    from peft import PeftModel

    saved_lora = lora_adapter(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(llama(), str(tmp_path / "adapter"))
    own = {k.replace(".default", ""): v for k, v in loaded.state_dict().items()}
    assert all(torch.equal(own[k], v) for k, v in saved_lora.items())  # bit for bit
    for base in (llama(), apply(llama(), default="bf16-true")):
        found = check(base, "checkpoint", {"path": tmp_path / "adapter"})
        assert [(f.severity, f.code) for f in found] == [("info", "checkpoint-adapter")]
        assert found[0].modules == LORA_MODULES
        assert "a PEFT LORA adapter (its adapter_config.json): 8 tensor(s) in fp32" in (
            found[0].message) and "PeftModel.from_pretrained(model, path)" in found[0].message
    # checked against the PeftModel it makes, each adapter tensor is one of the model's own
    assert check(loaded, "checkpoint", {"path": tmp_path / "adapter"}) == []


def test_a_peft_adapter_is_compared_where_the_model_holds_its_tensors(tmp_path: Path) -> None:
    """The adapter's copy of a module (`modules_to_save`) is a tensor of the base model, and
    its LoRA weights are tensors of the PeftModel: each compared as any checkpoint's tensor."""
    pytest.importorskip("peft")
    from peft import PeftModel

    lora_adapter(tmp_path / "fp32", modules_to_save=["lm_head"])
    lora_adapter(tmp_path / "bf16", dtype=bf16, modules_to_save=["lm_head"])
    base = llama()
    precision(fp32)(base.lm_head)
    found = check(apply(base, default="bf16-true"), "checkpoint", {"path": tmp_path / "bf16"})
    assert [(f.code, f.module) for f in found if f.severity != "info"] == [
        ("checkpoint-narrowed", "lm_head")]
    found = check(apply(llama(), default="bf16-true"), "checkpoint", {"path": tmp_path / "fp32"})
    assert [(f.code, f.module) for f in found] == [("checkpoint-widened", "lm_head"),
                                                   ("checkpoint-adapter", "")]
    loaded = PeftModel.from_pretrained(llama(), str(tmp_path / "fp32"))
    assert check(loaded, "checkpoint", {"path": tmp_path / "fp32"}) == []
    found = check(loaded, "checkpoint", {"path": tmp_path / "bf16"})  # into its fp32 LoRA
    narrowed = sorted(f.message.split("'")[3] for f in found)
    assert {f.code for f in found} == {"checkpoint-narrowed"} and narrowed == sorted(
        [f"base_model.model.{m}.lora_{ab}.default.weight" for m in LORA_MODULES for ab in "AB"]
        + ["base_model.model.lm_head.modules_to_save.default.weight"])


def test_a_peft_adapter_of_another_model_is_judged_as_peft_loads_it(tmp_path: Path) -> None:
    """Each finding against what PeftModel.from_pretrained does with the adapter: refuses one
    for another model, drops a layer's weights the model lacks without a word, refuses LoRA
    weights of another width."""
    pytest.importorskip("peft")
    from peft import PeftModel

    lora_adapter(tmp_path / "adapter")
    other = nn.Sequential(nn.Linear(16, 16))
    found = check(other, "checkpoint", {"path": tmp_path / "adapter"})
    assert [(f.severity, f.code) for f in found] == [("error", "checkpoint-foreign")]
    with pytest.raises(ValueError, match="not found in the base model"):
        PeftModel.from_pretrained(other, str(tmp_path / "adapter"))

    found = check(llama(layers=1), "checkpoint", {"path": tmp_path / "adapter"})
    assert [(f.severity, f.code) for f in found] == [("warning", "checkpoint-unexpected"),
                                                     ("info", "checkpoint-adapter")]
    assert "model.layers.1.self_attn" in found[0].message and found[1].modules == LORA_MODULES[:2]
    shallow = PeftModel.from_pretrained(llama(layers=1), str(tmp_path / "adapter"))
    assert not [n for n in shallow.state_dict() if "layers.1." in n]  # dropped, silently

    found = check(llama(hidden=32), "checkpoint", {"path": tmp_path / "adapter"})
    assert [(f.severity, f.code) for f in found] == [("error", "checkpoint-shape")] * 8 + [
        ("info", "checkpoint-adapter")]
    assert "'model.layers.0.self_attn.q_proj.lora_A.weight' with shape [4, 16]" in (
        found[0].message)
    with pytest.raises(RuntimeError, match="size mismatch"):
        PeftModel.from_pretrained(llama(hidden=32), str(tmp_path / "adapter"))
