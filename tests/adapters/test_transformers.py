"""Hugging Face transformers, Trainer and Accelerate, with real model classes from small configs
(random weights, no hub access)."""

from __future__ import annotations

import copy
import inspect
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from precision_annot import (
    PrecisionPlan,
    annotate,
    apply,
    audit,
    bf16,
    diff,
    fp16,
    fp32,
    optimizer,
    remove,
    resolve,
    watch,
)
from precision_annot._src.plan import parent_name
from precision_annot._src.runtime import installed_boundaries

transformers = pytest.importorskip("transformers")
from precision_annot.adapters import transformers as hf  # noqa: E402
from tests.helpers import planted_t5  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:transformers")
VOCAB = 128


def gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2,
                                  n_head=2)
    return transformers.GPT2LMHeadModel(cfg)


def llama() -> nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=4096)
    return transformers.LlamaForCausalLM(cfg)


def t5() -> nn.Module:
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=8, num_layers=2,
                                num_heads=4, decoder_start_token_id=0)
    return transformers.T5ForConditionalGeneration(cfg)


def bert() -> nn.Module:
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64)
    return transformers.BertForMaskedLM(cfg)


def randomize_norms(model: nn.Module) -> None:
    """Norm weights start at 1.0, which every dtype holds; make them need fp32."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or "ln" in name:
                p.copy_(1 + torch.randn(p.shape, generator=gen) * 0.1)


def annotated(kind: str) -> tuple[nn.Module, str]:
    """A model with its fp32 islands annotated, and its default low dtype."""
    torch.manual_seed(0)
    if kind == "gpt2":
        model = gpt2()
        annotate(model, {nn.LayerNorm: "fp32"})
        return model, "bf16"
    if kind == "llama":
        model = llama()
        annotate(model, {"*norm": "fp32", "model.rotary_emb": "fp32"})
        return model, "bf16"
    if kind == "t5":
        model = t5()
        annotate(model, hf.rules(model))  # T5's own list: its feed-forward `wo` layers
        return model, "fp16"
    model = bert()
    annotate(model, {nn.LayerNorm: "fp32"})
    return model, "bf16"


def inputs(kind: str) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    if kind == "t5":
        return {"input_ids": ids, "decoder_input_ids": ids[:, :6]}
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def hand_written(model: nn.Module, plan: PrecisionPlan) -> list[Any]:
    """The plan's computation written by hand: each tensor cast to its storage, and plain
    forward hooks that cast an island's inputs to its compute dtype and its outputs back (to
    its `output` dtype where it sets one, as the kept modules of `rules` do)."""
    def cast(obj: Any, dtype: torch.dtype) -> Any:
        if isinstance(obj, torch.Tensor):
            return obj.to(dtype) if obj.is_floating_point() else obj
        if isinstance(obj, (tuple, list)):
            return type(obj)(cast(o, dtype) for o in obj)
        if isinstance(obj, dict):
            return {k: cast(v, dtype) for k, v in obj.items()}
        return obj

    handles = []
    for name, module in model.named_modules():
        policy = plan[name].policy
        for tname, t in [*module._parameters.items(), *module._buffers.items()]:
            persistent = tname not in module._non_persistent_buffers_set
            if t is not None and t.is_floating_point() and policy.storage and persistent:
                t.data = t.data.to(policy.storage)
        if name and plan[name].boundary:
            compute = policy.compute
            back = policy.output or plan.context(name).policy.compute  # type: ignore[union-attr]
            handles.append(module.register_forward_pre_hook(
                lambda m, a, k, c=compute: (cast(a, c), cast(k, c)), with_kwargs=True))
            handles.append(module.register_forward_hook(lambda m, a, out, b=back: cast(out, b)))
    return handles


@pytest.mark.parametrize("kind", ["gpt2", "llama", "t5", "bert"])
def test_logits_are_bit_identical_to_hand_written_casts(kind: str) -> None:
    model, low = annotated(kind)
    randomize_norms(model)
    model.eval()  # no dropout: both runs must draw nothing random
    reference = copy.deepcopy(model)
    plan = resolve(model, default=low)
    assert len(plan.boundaries) > 2  # the islands are boundaries
    apply(model, plan)
    hand_written(reference, plan)
    with audit(model) as report:
        out = model(**inputs(kind))
        out.logits.float().sum().backward()
    assert report.divergences == [], str(report)
    expected = reference(**inputs(kind)).logits  # with autograd on too: it picks the kernels
    assert out.logits.dtype == expected.dtype == to(low)
    assert_close(out.logits, expected, rtol=0, atol=0)


def to(name: str) -> torch.dtype:
    return {"bf16": bf16, "fp16": fp16}[name]


def test_llama_rotary_table_stays_fp32_in_a_bf16_model() -> None:
    model, _ = annotated("llama")
    plan = resolve(model, default="bf16")
    apply(model, plan)
    rotary = model.model.rotary_emb
    assert rotary.inv_freq.dtype == fp32  # non-persistent: kept as Hugging Face keeps it
    x = torch.zeros(1, dtype=bf16)
    positions = torch.arange(4032, 4096)[None]
    cos, _ = rotary(x, positions)
    exact = (positions[0, :, None].double() * rotary.inv_freq.double()).cos()
    exact = torch.cat([exact, exact], -1)
    assert (cos[0].double() - exact).abs().max().item() < 0.005


def test_t5_rules_pick_the_wo_layers_as_hugging_faces_own_fp16_loading_does(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = t5()
    selected = sorted(n for n, m in model.named_modules()
                      if any(sel(n, m) for sel, _ in hf.rules(model)))
    assert selected and all(n.endswith(".wo") for n in selected)
    assert len(selected) == 4  # 2 encoder and 2 decoder blocks
    assert hf.rules(model, dtype="bf16") == []  # transformers keeps them fp32 only for fp16
    model.save_pretrained(tmp_path)
    native = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path, dtype=fp16)
    native_fp32 = sorted(n.rpartition(".")[0] for n, p in native.named_parameters()
                         if p.dtype == fp32)
    assert native_fp32 == selected


def deepseek_v3(dense_layers: int = 1) -> nn.Module:
    """Two layers, the first `dense_layers` of them dense, the rest mixtures of experts whose
    routers hold the `e_score_correction_bias` buffer the class keeps in fp32."""
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8, first_k_dense_replace=dense_layers, n_group=1,
        topk_group=1, max_position_embeddings=64)
    return transformers.DeepseekV3ForCausalLM(cfg)


def rwkv() -> nn.Module:
    cfg = transformers.RwkvConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                  attention_hidden_size=32, intermediate_size=64,
                                  context_length=64)
    return transformers.RwkvForCausalLM(cfg)


def fp32_tensors(model: nn.Module) -> set[str]:
    return {n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.dtype == fp32}


def natively_fp32(model: nn.Module, low: torch.dtype, tmp_path: Path) -> set[str]:
    """The tensors transformers' own `from_pretrained(dtype=low)` keeps in fp32."""
    model.save_pretrained(tmp_path)
    return fp32_tensors(type(model).from_pretrained(tmp_path, dtype=low))


def test_a_kept_buffer_keeps_its_module_in_fp32_as_transformers_keeps_the_buffer(
        tmp_path: Path) -> None:
    """DeepSeek-V3 keeps its routers' `e_score_correction_bias` (a buffer) in fp32. No module's
    parameters all match that name, so a parameters-only match selected nothing and the bias
    was rounded to bf16; the router, whose submodules hold nothing, is now an fp32 island."""
    torch.manual_seed(0)
    model = deepseek_v3()
    native = natively_fp32(model, bf16, tmp_path)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in native
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every kept tensor is expressible here: no warning
        selected = hf.rules(model, dtype="bf16")
    annotate(model, selected)
    apply(model, default="bf16")
    ours = fp32_tensors(model)
    assert native <= ours
    # wider than transformers only within a module it keeps a tensor of (asked of the installed
    # release: 5.23 kept the router's bias alone, 5.24 keeps its weight too)
    kept_owners = {parent_name(t) for t in native}
    assert {parent_name(t) for t in ours - native} <= kept_owners
    assert "model.layers.1.mlp.gate.weight" in ours
    ids = torch.randint(0, VOCAB, (2, 8))
    with audit(model) as report:
        model(input_ids=ids, labels=ids).loss.backward()
    assert report.divergences == []
    assert set(report["model.layers.1.mlp.gate"].forward_ops) == {fp32}


def test_from_pretrained_reads_a_kept_buffers_module_back_exactly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = deepseek_v3()
    router = model.model.layers[1].mlp.gate
    with torch.no_grad():
        router.e_score_correction_bias.uniform_(-1e-3, 1e-3)  # values bf16 cannot hold
        router.weight.normal_()
    model.save_pretrained(tmp_path)  # no plan file: from_pretrained reads the class's list
    back = hf.from_pretrained(type(model), tmp_path, dtype=bf16)
    loaded = back.model.layers[1].mlp.gate
    assert torch.equal(loaded.e_score_correction_bias, router.e_score_correction_bias)
    assert torch.equal(loaded.weight, router.weight)
    assert back.model.layers[0].mlp.up_proj.weight.dtype == bf16


def test_entries_for_parts_a_configuration_does_not_build_give_no_rule() -> None:
    model = deepseek_v3(dense_layers=2)  # no mixture-of-experts layer, so no router
    assert hf.rules(model, dtype="bf16") == []
    annotate(model, hf.rules(model))  # strict: would raise on a rule that matches nothing


def test_kept_tensors_beside_submodules_keep_their_module_and_its_layers_as_loaded(
        tmp_path: Path) -> None:
    """RWKV keeps `time_decay` and `time_first` in fp32 for fp16; they sit on the attention
    module beside its key, value and receptance layers. 0.4 left them in fp16 (with a warning);
    the attention module is now stored in fp32 and its layers as transformers stores them."""
    model = rwkv()
    native = natively_fp32(model, fp16, tmp_path)
    assert {n.rpartition(".")[2] for n in native} == {"time_decay", "time_first"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the dtype is given: nothing is widened to say
        selected = hf.rules(model, dtype="fp16")
    annotate(model, selected)
    apply(model, default="fp16")
    ours = fp32_tensors(model)
    assert native <= ours
    holders = {parent_name(t) for t in native}
    assert {parent_name(t) for t in ours - native} <= holders  # the holders' own tensors only
    assert model.rwkv.blocks[0].attention.key.weight.dtype == fp16
    assert model.rwkv.blocks[0].feed_forward.key.weight.dtype == fp16
    with pytest.warns(UserWarning, match=r"4 tensor\(s\).*'rwkv\.blocks\.0\.attention\."
                      r"time_decay'.*2 module\(s\) \(rwkv\.blocks\.\*\.attention\) are stored in "
                      r"fp32 with their submodules.*rules\(model, dtype='bf16'\)"):
        hf.rules(rwkv())  # the dtype not given: the layers are widened too, and said


def hy_v3() -> nn.Module:
    """Two layers, the second a mixture whose block holds the router's
    `e_score_correction_bias` beside its experts (in the class's strict list)."""
    cfg = transformers.HYV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
        max_position_embeddings=64)
    return transformers.HYV3ForCausalLM(cfg)


def test_a_strict_router_bias_beside_experts_survives_save_and_load(tmp_path: Path) -> None:
    """HY-V3 keeps its routers' `e_score_correction_bias` in fp32 (strict: bf16 too); it sits
    on the mixture block beside the experts. Through the plan it stays fp32, the experts stay
    bf16, and save_pretrained / from_pretrained bring the bias back bit for bit."""
    torch.manual_seed(0)
    model = hy_v3()
    block = model.model.layers[1].mlp
    with torch.no_grad():
        block.e_score_correction_bias.uniform_(-1e-3, 1e-3)  # values bf16 cannot hold
    native = natively_fp32(model, bf16, tmp_path / "native")
    assert "model.layers.1.mlp.e_score_correction_bias" in native
    annotate(model, hf.rules(model, dtype="bf16"))
    plan = resolve(model, default="bf16")
    apply(model, plan)
    assert native <= fp32_tensors(model)
    assert block.experts.gate_up_proj.dtype == bf16  # not widened with the block
    assert block.shared_experts.up_proj.weight.dtype == bf16
    hf.save_pretrained(model, tmp_path / "planned")
    back = hf.from_pretrained(type(model), tmp_path / "planned", dtype=bf16)
    loaded = back.model.layers[1].mlp
    assert torch.equal(loaded.e_score_correction_bias, block.e_score_correction_bias)
    assert loaded.experts.gate_up_proj.dtype == bf16
    ids = torch.randint(0, VOCAB, (2, 8))
    back(input_ids=ids, labels=ids).loss.backward()  # it runs as planned


def test_units_are_the_no_split_blocks() -> None:
    model = llama()
    assert [c.__name__ for c in hf.units(model)] == ["LlamaDecoderLayer"]
    assert [c.__name__ for c in hf.units(t5())] == ["T5Block"]


@pytest.mark.parametrize("kind", ["llama", "t5"])
def test_islands_survive_save_and_load_bit_exact(kind: str, tmp_path: Path) -> None:
    model, low = annotated(kind)
    annotate(model, {"*norm": "fp32"})  # T5's own list covers `wo` only
    randomize_norms(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("wo.weight"):
                p.add_(torch.randn_like(p) * 1e-3)
    plan = resolve(model, default=low)
    apply(model, plan)
    islands = {n: p.detach().clone() for n, p in model.named_parameters() if p.dtype == fp32}
    assert islands
    hf.save_pretrained(model, tmp_path)
    assert (tmp_path / "precision_plan.json").is_file()

    cls = type(model)
    native = cls.from_pretrained(tmp_path, dtype=to(low))  # transformers alone
    rounded = max((native.get_parameter(n).float() - w).abs().max().item()
                  for n, w in islands.items())
    assert rounded > 1e-4  # the islands came back rounded to the low dtype

    loaded = hf.from_pretrained(cls, tmp_path, dtype=to(low))
    for n, w in islands.items():
        assert loaded.get_parameter(n).dtype == fp32
        assert torch.equal(loaded.get_parameter(n), w), n
    assert installed_boundaries(loaded) == installed_boundaries(model)

    # the other way: the plan's fp32 modules as the class's own list
    sub = type(f"Island{cls.__name__}", (cls,), {
        "_keep_in_fp32_modules_strict": hf.keep_in_fp32_patterns(plan)})
    by_class = sub.from_pretrained(tmp_path, dtype=to(low))
    for n, w in islands.items():
        assert torch.equal(by_class.get_parameter(n), w), n


class Tokens(torch.utils.data.Dataset[dict[str, Any]]):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids, "note": f"row {i}"}  # a column to drop


@pytest.mark.parametrize(("default", "flags"), [("bf16", {}), ("bf16-mixed", {"bf16": True}),
                                                ("16-mixed", {"fp16": True})])
def test_trainer_with_default_arguments_trains_an_applied_model(
        default: str, flags: dict[str, bool], tmp_path: Path) -> None:
    model, _ = annotated("llama")
    plan = resolve(model, default=default)
    apply(model, plan)
    assert "input_ids" in inspect.signature(model.forward).parameters  # kept for Trainer
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=4, use_cpu=True,
        report_to=[], save_strategy="no", disable_tqdm=True, learning_rate=1e-2, **flags)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert "model.norm.weight" in changed and "model.layers.0.mlp.up_proj.weight" in changed
    assert model.model.norm.weight.dtype == fp32
    assert len(installed_boundaries(model)) == len(plan.boundaries)


def test_the_signature_name_and_docstring_of_a_boundary_are_its_modules() -> None:
    model, _ = annotated("gpt2")
    expected = inspect.signature(model.forward)
    doc, name = model.forward.__doc__, model.forward.__name__
    apply(model, default="bf16")
    assert inspect.signature(model.forward) == expected
    assert model.forward.__doc__ == doc and model.forward.__name__ == name


def test_accelerate_prepare_keeps_the_plan_and_remove_sees_through_its_wrapper() -> None:
    accelerate = pytest.importorskip("accelerate")
    model, _ = annotated("llama")
    plan = resolve(model, default="bf16")
    apply(model, plan)
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)  # Trainer set it
    prepared = accelerate.Accelerator(mixed_precision="bf16", cpu=True).prepare(model)
    assert type(prepared.forward).__name__ != "Boundary"  # Accelerate wrapped the root
    assert len(installed_boundaries(prepared)) == len(plan.boundaries)
    with audit(prepared, plan) as report:
        prepared(**inputs("llama")).logits.float().sum().backward()
    assert report.divergences == []
    remove(prepared)
    assert installed_boundaries(prepared) == []
    assert {p.dtype for p in prepared.parameters()} == {fp32}


def test_generate_runs_the_plan() -> None:
    model, _ = annotated("llama")
    reference = copy.deepcopy(model)
    plan = resolve(model, default="bf16")
    apply(model, plan)
    hand_written(reference, plan)
    ids = inputs("llama")
    with audit(model) as report:
        out = model.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert report.divergences == []
    assert torch.equal(out, reference.generate(**ids, max_new_tokens=6, do_sample=False,
                                               pad_token_id=0))


def test_gradient_checkpointing_recomputes_in_the_planned_dtypes() -> None:
    def grads(checkpointing: bool) -> dict[str, torch.Tensor]:
        model, _ = annotated("llama")
        apply(model, default="bf16")
        model.train()
        if checkpointing:
            enable = getattr(model, "activation_checkpointing_enable", None)
            (enable or model.gradient_checkpointing_enable)()
        ids = inputs("llama")["input_ids"]
        with audit(model) as report:
            model(input_ids=ids, labels=ids).loss.backward()
        assert report.divergences == []
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = grads(False), grads(True)
    assert plain.keys() == checkpointed.keys()
    for n in plain:
        assert_close(plain[n], checkpointed[n], rtol=0, atol=0)


@pytest.mark.slow  # over make test's budget (3.7 s of inductor): run by make test-all
def test_compile_fullgraph_matches_eager() -> None:
    model, _ = annotated("gpt2")
    apply(model, default="bf16")
    model.eval()  # no dropout
    ids = inputs("gpt2")
    eager = model(**ids, use_cache=False).logits
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(**ids, use_cache=False).logits
    assert out.dtype == bf16
    assert_close(out, eager, rtol=2e-2, atol=2e-2)



def test_hugging_faces_own_spelling_points_to_the_glob() -> None:
    with pytest.raises(ValueError, match=r"4 modules end in 'wo'.*write the glob '\*\.wo'"):
        annotate(t5(), {"wo": "fp32"})


def bart() -> nn.Module:
    cfg = transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1,
                                  decoder_layers=1, encoder_attention_heads=2,
                                  decoder_attention_heads=2, encoder_ffn_dim=32,
                                  decoder_ffn_dim=32, max_position_embeddings=64)
    return transformers.BartForConditionalGeneration(cfg)


def whisper() -> nn.Module:
    cfg = transformers.WhisperConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, num_mel_bins=8, max_source_positions=16, max_target_positions=32,
        decoder_start_token_id=1, pad_token_id=0, eos_token_id=2, bos_token_id=1)
    return transformers.WhisperForConditionalGeneration(cfg)


@pytest.mark.parametrize("kind", ["t5", "bart", "whisper"])
@pytest.mark.parametrize("default", ["bf16", "bf16-mixed"])
def test_generate_on_encoder_decoders_runs_the_plan(kind: str, default: str) -> None:
    """0.2: generate() calls model.get_encoder()(...), which skipped the root's boundary and
    crashed ("mat1 and mat2 must have the same dtype") or ran in fp32."""
    torch.manual_seed(0)
    model = {"t5": t5, "bart": bart, "whisper": whisper}[kind]().eval()
    annotate(model, hf.rules(model) if kind == "t5" else {nn.LayerNorm: "fp32"})
    apply(model, default=default)
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    sample = {"input_features": torch.randn(2, 8, 32)} if kind == "whisper" else {
        "input_ids": ids}
    with audit(model) as report, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(**sample, max_new_tokens=3, do_sample=False)
    assert out.shape[0] == 2 and report.divergences == []
    encoder = report["encoder" if kind == "t5" else "model.encoder"]
    assert encoder.calls == 1  # called on its own, by generate
    ffn = report["encoder.block.0.layer.1.DenseReluDense.wi" if kind == "t5" else
                 "model.encoder.layers.0.fc1"]
    assert set(ffn.forward_ops) == {bf16}
    assert ffn.autocast == {(True, bf16) if default == "bf16-mixed" else (False, None)}


def test_a_renamed_checkpoint_reads_its_islands_back_bit_for_bit(tmp_path: Path) -> None:
    """0.2 looked ViT's islands up by their model names, which transformers renames on save
    (vit.layers.0 -> vit.encoder.layer.0): 8 islands stayed rounded to bf16, silently."""
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=32, image_size=16, patch_size=8,
                                 num_labels=3)
    model = transformers.ViTForImageClassification(cfg)
    randomize_norms(model)
    annotate(model, {nn.LayerNorm: "fp32"})
    apply(model, default="bf16")
    hf.save_pretrained(model, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing lost, nothing to say
        warnings.filterwarnings("ignore", module="transformers")
        loaded = hf.from_pretrained(transformers.ViTForImageClassification, tmp_path,
                                    dtype=torch.bfloat16)
    islands = [n for n, p in model.named_parameters() if p.dtype == fp32]
    assert len(islands) == 10  # 2 norms x 2 layers x 2, and the final norm's 2
    for name in islands:
        assert torch.equal(loaded.get_parameter(name), model.get_parameter(name)), name


def test_a_tensor_that_cannot_be_read_back_is_named(tmp_path: Path) -> None:
    model, _ = annotated("gpt2")
    randomize_norms(model)
    apply(model, default="bf16")
    hf.save_pretrained(model, tmp_path)
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["transformer.ln_f.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"1 tensor\(s\).*could not be read back.*"
                                         r"'transformer.ln_f.weight'"):
        hf.from_pretrained(type(model), tmp_path, dtype=torch.bfloat16)


def test_from_pretrained_of_a_bf16_checkpoint_names_the_islands_it_rounded(
        tmp_path: Path) -> None:
    """A checkpoint written all in bf16 (model.save_pretrained of a bf16 model, as most hub
    checkpoints are) holds the fp32 islands rounded: from_pretrained keeps them fp32 and now
    says which lost their low bits before the load (0.4 widened them silently)."""
    model, _ = annotated("llama")
    randomize_norms(model)
    plan = resolve(model, default="bf16")
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    norms = [n for n, p in model.named_parameters() if "norm" in n]
    with pytest.warns(UserWarning, match=rf"from_pretrained: the checkpoint holds {len(norms)} "
                                         r"tensor\(s\) narrower than the plan keeps them") as said:
        loaded = hf.from_pretrained(type(model), tmp_path, plan=plan, dtype=torch.bfloat16)
    (message,) = [str(w.message) for w in said if "narrower" in str(w.message)]
    assert all(repr(n) in message for n in norms)
    for name in norms:  # kept fp32: the saved bf16 values, widened
        assert loaded.get_parameter(name).dtype == fp32
        assert torch.equal(loaded.get_parameter(name), model.get_parameter(name).float())
    assert loaded.model.layers[0].mlp.up_proj.weight.dtype == bf16


def test_trainer_bf16_full_eval_moving_the_model_is_said(tmp_path: Path) -> None:
    """0.2: evaluate() ran model.to(bf16) and training went on in bf16, without a word."""
    model, _ = annotated("llama")
    apply(model, default="bf16-mixed")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, use_cpu=True,
        report_to=[], save_strategy="no", disable_tqdm=True, bf16_full_eval=True,
        per_device_eval_batch_size=4)
    trainer = transformers.Trainer(model=model, args=args, eval_dataset=Tokens())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.evaluate()
    said = [w for w in caught if "away from the plan" in str(w.message)]
    assert len(said) == 1 and "planned fp32" in str(said[0].message)
    assert model.model.norm.weight.dtype == bf16  # what Trainer did; apply() restores it


def test_rules_hand_t5s_kept_output_on_in_fp32_as_transformers_does() -> None:
    """transformers runs T5's kept `wo` on fp32 weights and never casts its output back: the
    fp32 output flows into the residual sum. Handed back in fp16, an output past 65504 is
    inf; with the rules' output=fp32 the model stays finite in 16-mixed and in fp16."""
    from precision_annot import annotate

    t5, batch = planted_t5(wi=2.0 ** 4, wo=2.0 ** 12)  # wo's output past fp16's range
    assert torch.isfinite(t5(**batch).logits).all()
    rules = hf.rules(t5)
    assert [spec for _, spec in rules] == ["fp32,output=fp32"]
    for low in ("16-mixed", "fp16"):
        kept = annotate(copy.deepcopy(t5), rules)
        assert torch.isfinite(apply(kept, default=low)(**batch).logits).all(), low
        handed_back = annotate(copy.deepcopy(t5), [(sel, "fp32") for sel, _ in rules])
        assert not torch.isfinite(apply(handed_back, default=low)(**batch).logits).all(), low


def test_save_and_load_say_that_they_need_a_transformers_model(tmp_path: Path) -> None:
    """0.3 raised a raw AttributeError for an nn.Linear."""
    with pytest.raises(TypeError, match=r"save_pretrained needs a transformers model.*"
                                        r"Received: model of type Linear"):
        hf.save_pretrained(nn.Linear(2, 2), tmp_path)
    with pytest.raises(TypeError, match=r"from_pretrained needs a transformers model class.*"
                                        r"Received: model_class=<class 'torch.nn.modules.linear"):
        hf.from_pretrained(nn.Linear, tmp_path)


def test_audit_under_gradient_checkpointing_agrees_with_the_gradients() -> None:
    """0.3 reported BART's fp32 final_layer_norm as computing in bf16 in backward under
    gradient checkpointing, although every gradient equalled the run without it: transformers
    recomputes a layer through its plain forward, so the layer's own ops ran with no module
    hook and were charged to the node that asked for them. The recompute is now charged where
    it first ran; a layer really run in another dtype is still reported."""
    from tests.adapters.hf_models import build

    def norms(name: str, module: nn.Module) -> bool:  # and the feed-forward's first Linear
        return "Norm" in type(module).__name__ or name.endswith("fc1")

    def step(checkpointing: bool, islands: bool = True) -> tuple[Any, dict[str, Any]]:
        model, batch = build("bart")
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
        if islands:
            annotate(model, {norms: "fp32"})
        apply(model, default="bf16-mixed")
        annotate(model, {norms: "fp32"})  # what the plan audited against says
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        with audit(model, resolve(model, "bf16-mixed")) as report:
            model(**batch).loss.backward()
        return report, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    plain, grads = step(False)
    checkpointed, again = step(True)
    assert plain.divergences == [] and checkpointed.divergences == []
    assert grads.keys() == again.keys() and all(torch.equal(grads[n], again[n]) for n in grads)
    # islands planned fp32 but run in bf16 (the plan applied without them) are still reported
    # under checkpointing, forward and backward: nothing is silenced
    missing, _ = step(True, islands=False)
    wrong = {(d.module, d.phase) for d in missing.divergences if d.field == "compute"}
    assert {("model.encoder.layers.0.fc1", "forward"),
            ("model.encoder.layers.0.fc1", "backward")} <= wrong, wrong


def test_hf_trainer_runs_the_update_half_through_optimizers(tmp_path: Path) -> None:
    """Trainer(optimizers=(precision_annot.optimizer(model, ...), None)): bf16 weights, fp32
    masters, 8-bit state; the Trainer's clipping (max_grad_norm) acts on the gradients the
    step uses, and its checkpoint holds the masters."""
    pytest.importorskip("torchao")
    import transformers as tf

    from tests.adapters.hf_models import build

    model, batch = build("llama")
    annotate(model, {"*": "bf16-true,master=fp32,optim=8bit"})
    apply(model)
    opt = optimizer(model, torch.optim.AdamW, lr=1e-2)
    rows = [{"input_ids": batch["input_ids"][i], "labels": batch["labels"][i]} for i in (0, 1)]
    args = tf.TrainingArguments(output_dir=str(tmp_path), max_steps=4, logging_steps=1,
                                per_device_train_batch_size=2, save_steps=4, report_to=[],
                                use_cpu=True, max_grad_norm=1.0)
    trainer = tf.Trainer(model=model, args=args, train_dataset=rows, optimizers=(opt, None))
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses[-1] < losses[0], losses
    weight = model.model.layers[0].mlp.up_proj.weight
    assert weight.dtype == torch.bfloat16 and opt.master(weight).dtype == torch.float32
    saved = torch.load(tmp_path / "checkpoint-4" / "optimizer.pt", weights_only=False)
    assert set(saved) == {"state", "param_groups"}  # torch's format, masters in the state
    assert {s["master"].dtype for s in saved["state"].values()} == {torch.float32}


def test_watch_callback_puts_the_numbers_in_the_trainers_tensorboard_logs(tmp_path: Path
                                                                        ) -> None:
    """`watch_callback(trainer)`: every 2nd step's per-module numbers go into the step's logs,
    which the Trainer's TensorBoard integration writes; they are read back from its event
    files, and they are the numbers `watch` measured."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model, _ = annotated("llama")
    apply(model, default="bf16")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=4, use_cpu=True,
        report_to=["tensorboard"], logging_steps=100,
        save_strategy="no", disable_tqdm=True, learning_rate=1e-2)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
    callback = hf.watch_callback(trainer, every=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    w = callback.watch
    assert [r.step for r in w.history] == [0, 2, 4]
    record = w.history[0]
    assert record.outputs["model.layers.0.mlp"].dtype == bf16
    assert record.outputs["model.norm"].dtype == bf16  # the fp32 island hands back bf16
    events = [EventAccumulator(str(p.parent)).Reload() for p in tmp_path.rglob(
        "events.out.tfevents.*")]
    tags = {t for e in events for t in e.Tags()["scalars"]}
    tag = "train/precision/model.layers.0.mlp/out_amax"
    assert tag in tags and "train/precision/closest_margin" in tags
    logged = [(s.step, s.value) for e in events if tag in e.Tags()["scalars"]
              for s in e.Scalars(tag)]
    # the Trainer logs at its global step: a watched step k ends as the Trainer's step k + 1
    assert [step for step, _ in logged] == [1, 3, 5]
    for (_, value), rec in zip(logged, w.history, strict=True):
        assert value == pytest.approx(rec.outputs["model.layers.0.mlp"].amax, rel=1e-6)


@pytest.mark.slow  # 4 s; tests/test_watching.py shows the same on a plain loop in make test
def test_watch_callback_samples_the_training_steps_of_a_trainer_that_evaluates_every_step(
        tmp_path: Path) -> None:
    """The Trainer evaluates (a no_grad forward) after every step, between the watched ones:
    0.4 recorded the evaluation and its sampled steps held 0 of 19 gradient rows. Each record
    now holds the training step's: a gradient row for every module whose output got one in a
    step watched by hand."""
    model, _ = annotated("llama")
    apply(model, default="bf16")
    rows = Tokens()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
        per_device_eval_batch_size=2, use_cpu=True, report_to=[], eval_strategy="steps",
        eval_steps=1, save_strategy="no", disable_tqdm=True, learning_rate=1e-2)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows,
                                   eval_dataset=[rows[i] for i in range(2)])
    callback = hf.watch_callback(trainer, every=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert len([log for log in trainer.state.log_history if "eval_loss" in log]) == 3
    records = callback.watch.history
    assert [r.step for r in records] == [0, 1, 2]
    # the same step by hand, watched: which modules' outputs get gradients
    alone, _ = annotated("llama")
    apply(alone, default="bf16")
    ids = torch.stack([rows[i]["input_ids"] for i in (0, 1)])
    with watch(alone, every=1, warn=False) as w:
        alone(input_ids=ids, labels=ids).loss.backward()
        mine = w.step()
    assert mine is not None and len(mine.grads) >= 19
    for record in records:
        assert set(record.grads) == set(mine.grads)
        assert set(record.outputs) == set(mine.outputs)


def test_diff_with_a_kv_cache_leaves_the_callers_cache_and_compares_the_same_step() -> None:
    """A decoding step handed the cache of the tokens before it: 0.4 ran the plan's step on
    the caller's DynamicCache (4 tokens -> 8), then the fp32 step on what it left (-> 12)
    and raised through the first run's freed graph."""
    model, _ = annotated("llama")
    model.train()
    apply(model, default="bf16")
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model(input_ids=ids[:, :4], use_cache=True).past_key_values
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = diff(model, {"input_ids": ids[:, 4:], "past_key_values": cache,
                              "use_cache": True}, loss_fn=lambda out: out.logits.float().mean())
    assert cache.get_seq_length() == 4
    assert report.first is None and report.first_grad is None, str(report)
    assert report["lm_head"].grad_error is not None


@pytest.mark.slow  # 9 s (two Trainer runs); the Lightning test shows the same in make test
def test_watch_callback_goes_on_counting_the_steps_of_a_resumed_run(tmp_path: Path) -> None:
    """0.4 counted from 0 again: a run stopped after 3 steps and resumed to 6 wrote steps
    [0, 2, 0, 2] to one file and sampled global steps 3 and 5, not 4."""
    path = tmp_path / "watch.jsonl"

    def train(max_steps: int, resume: bool) -> Any:
        model, _ = annotated("llama")
        apply(model, default="bf16")
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=2,
            use_cpu=True, report_to=[], save_strategy="steps", save_steps=3, logging_steps=100,
            disable_tqdm=True, learning_rate=1e-2)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
        callback = hf.watch_callback(trainer, every=2, path=path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train(resume_from_checkpoint=resume or None)
        return callback

    train(3, False)
    resumed = train(6, True)
    assert [r.step for r in resumed.watch.history] == [4]
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 2, 4]


def test_watch_callback_refuses_a_trainer_that_compiles_the_model(tmp_path: Path) -> None:
    """Compiled steps run no module hook: 0.4 trained one step, then raised with a fix (call
    the uncompiled model on sampled steps) that a Trainer's user cannot apply."""
    model, _ = annotated("llama")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2, use_cpu=True,
                                          report_to=[], torch_compile=True,
                                          torch_compile_backend="eager")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
    with pytest.raises(ValueError, match=r"watch_callback: the Trainer compiles the model "
                                         r"\(TrainingArguments\(torch_compile=True\)\).*"
                                         r"torch_compile=False"):
        hf.watch_callback(trainer, every=2)
    assert not any(type(c).__name__ == "WatchCallback"
                   for c in trainer.callback_handler.callbacks)


@pytest.mark.parametrize("reentrant", [
    pytest.param(True, marks=pytest.mark.slow),  # 5 s; tests/test_watching.py has it fast
    False])
def test_watch_under_gradient_checkpointing_has_the_rows_of_a_plain_step(reentrant: bool) -> None:
    """Transformers' gradient checkpointing runs each layer again in backward (reentrant: its
    first run under no_grad). The rerun is not a second call, and the modules inside get their
    gradient rows; a layer output no gradient reaches (T5's position bias) gets none, where
    watch raised on it."""
    kind = "t5" if reentrant else "llama"  # (T5 with its fp32 islands fails torch's own
    # non-reentrant recompute check under a low-precision plan, watched or not)
    rows = {}
    for checkpointed in (False, True):
        model, low = annotated(kind)
        model.train()
        if checkpointed:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        apply(model, default=low)
        batch = inputs(kind)
        labels = batch.get("decoder_input_ids", batch["input_ids"]).contiguous()
        with watch(model, every=1, warn=False) as w, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(**batch, labels=labels).loss.backward()
            record = w.step()
        assert record is not None
        rows[checkpointed] = record
    plain, checkpointed_record = rows[False], rows[True]
    assert set(checkpointed_record.grads) == set(plain.grads)
    assert set(checkpointed_record.outputs) == set(plain.outputs)
    same = [n for n, s in plain.outputs.items() if checkpointed_record.outputs[n].tensors == 1
            and s.tensors == 1]
    assert len(same) > len(plain.outputs) / 2
    for name in same:  # the same values, measured once
        assert checkpointed_record.outputs[name].amax == plain.outputs[name].amax, name


def test_check_reads_a_hugging_face_checkpoint_by_the_names_transformers_loads_it_as(
        tmp_path: Path) -> None:
    """transformers renames keys on load: ViT's saved `encoder.layer.0.attention.attention.query`
    is the model's `layers.0.attention.q_proj`, and a hub-layout Mixtral's per-expert
    `block_sparse_moe.experts.3.w1` fuses into `mlp.experts.gate_up_proj`. 0.4 reported every
    renamed tensor missing and every saved key unexpected (32 + 32 for this ViT); given the
    model, check reads each key as from_pretrained does. Given only the plan it cannot."""
    from safetensors.torch import save_file

    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=32, image_size=16, patch_size=8)
    vit = transformers.ViTModel(cfg)
    annotate(vit, {nn.LayerNorm: "fp32"})
    apply(vit, default="bf16")
    vit.save_pretrained(tmp_path / "vit")
    from precision_annot import check

    assert check(vit, "checkpoint", {"path": tmp_path / "vit"}) == []
    mixtral = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2))
    annotate(mixtral, {"model.layers.*.mlp.gate": "fp32"})
    apply(mixtral, default="bf16")
    hub: dict[str, torch.Tensor] = {}  # the layout of Mixtral's hub checkpoints, all bf16
    for key, value in mixtral.state_dict().items():
        if ".mlp.experts." not in key:
            hub[key.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = value.to(bf16)
    for layer in range(2):
        for e in range(4):
            at = f"model.layers.{layer}.block_sparse_moe.experts.{e}"
            hub[f"{at}.w1.weight"] = hub[f"{at}.w3.weight"] = torch.zeros(64, 32, dtype=bf16)
            hub[f"{at}.w2.weight"] = torch.zeros(32, 64, dtype=bf16)
    (tmp_path / "hub").mkdir()
    save_file({k: v.clone() for k, v in hub.items()}, str(tmp_path / "hub" / "model.safetensors"))
    mixtral.config.save_pretrained(tmp_path / "hub")
    found = check(mixtral, "checkpoint", {"path": tmp_path / "hub"})
    assert [(f.severity, f.code, f.modules) for f in found] == [
        ("error", "checkpoint-narrowed", (f"model.layers.{i}.mlp.gate",)) for i in range(2)]
    loaded = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "hub")  # what it reads
    assert loaded.model.layers[0].mlp.experts.gate_up_proj.shape == (4, 128, 32)


@pytest.mark.slow  # a Llama saved and loaded: 4-11 s
def test_from_pretrained_in_fp16_reads_back_what_fp16_cannot_hold(tmp_path: Path) -> None:
    """`from_pretrained(..., dtype=torch.float16)` of a bf16 plan: fp16 has bf16's bits but not
    its range, so bf16 weights below fp16's normal range came back rounded; 0.4 read back only
    tensors planned wider than the load's dtype, and said nothing."""
    model, _ = annotated("llama")
    apply(model, default="bf16")
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(1e-4)  # fp16 subnormals
    hf.save_pretrained(model, tmp_path)
    loaded = hf.from_pretrained(type(model), tmp_path, dtype=torch.float16)
    for name, p in model.named_parameters():
        assert loaded.get_parameter(name).dtype == p.dtype
        assert torch.equal(loaded.get_parameter(name), p), name
