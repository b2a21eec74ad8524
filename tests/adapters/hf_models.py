"""Small real transformers models (random weights, no hub) and a batch for each, for the tests
that run the plan on the model classes people use."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def _lm(kind: str, **extra: Any) -> Callable[[], tuple[nn.Module, dict[str, torch.Tensor]]]:
    def build() -> tuple[nn.Module, dict[str, torch.Tensor]]:
        import transformers as tf

        config = getattr(tf, f"{kind}Config")(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, **extra)
        model: nn.Module = getattr(tf, f"{kind}ForCausalLM")(config)
        ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
        return model, {"input_ids": ids, "labels": ids}

    return build


def gpt2() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    import transformers as tf

    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128,
                                             n_positions=32))
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def t5() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    import transformers as tf

    model = tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=128, d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4,
        decoder_start_token_id=0))
    gen = torch.Generator().manual_seed(1)
    return model, {"input_ids": torch.randint(0, 128, (2, 12), generator=gen),
                   "decoder_input_ids": torch.randint(0, 128, (2, 6), generator=gen),
                   "labels": torch.randint(0, 128, (2, 6), generator=gen)}


def bart() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    import transformers as tf

    model = tf.BartForConditionalGeneration(tf.BartConfig(
        vocab_size=128, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 12), generator=gen)
    return model, {"input_ids": ids, "labels": torch.randint(3, 128, (2, 6), generator=gen)}


def whisper() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    import transformers as tf

    model = tf.WhisperForConditionalGeneration(tf.WhisperConfig(
        vocab_size=128, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=16,
        max_target_positions=32, decoder_start_token_id=1, pad_token_id=0,
        bos_token_id=1, eos_token_id=2))
    gen = torch.Generator().manual_seed(1)
    return model, {"input_features": torch.randn(2, 16, 32, generator=gen),
                   "labels": torch.randint(3, 128, (2, 6), generator=gen)}


def vit() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    import transformers as tf

    model = tf.ViTForImageClassification(tf.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        image_size=16, patch_size=4, num_labels=3))
    gen = torch.Generator().manual_seed(1)
    return model, {"pixel_values": torch.randn(2, 3, 16, 16, generator=gen),
                   "labels": torch.tensor([0, 2])}


def bert() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    import transformers as tf

    model = tf.BertForMaskedLM(tf.BertConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64))
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


MODELS: dict[str, Callable[[], tuple[nn.Module, dict[str, torch.Tensor]]]] = {
    "gpt2": gpt2,
    "llama": _lm("Llama"),
    "t5": t5,
    "bart": bart,
    "whisper": whisper,
    "vit": vit,
    "bert": bert,
    "mixtral": _lm("Mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": _lm("Qwen2Moe", num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=32, shared_expert_intermediate_size=64),
}


def build(name: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    return MODELS[name]()
