"""`adapters.transformers.rules` over every model class of the installed transformers that
declares `_keep_in_fp32_modules_strict` or `_keep_in_fp32_modules`: each tensor transformers
keeps in fp32 when it loads the class in fp16 or bf16 is fp32 in the plan.

The classes are enumerated here from the installed transformers (the model packages whose
modeling code names a keep-in-fp32 list, imported, and their model classes whose list is not
empty), never from a fixed list; what transformers keeps is asked of transformers itself: the
entries its loader applies for the dtype, matched by its own glob matcher. Each model is built on
the meta device (no weights), from its config class shrunk where the config takes the usual size
arguments, else from its default config.
"""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from precision_annot import annotate, resolve
from precision_annot._src.checkpoints.loading import planned_dtypes

transformers = pytest.importorskip("transformers")
from precision_annot.adapters import transformers as hf  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]

#: the usual size arguments of transformers configs, made small (those a config takes)
SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 64,
         "moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 128, "n_routed_experts": 4, "num_experts": 4, "num_local_experts": 4,
         "n_shared_experts": 1, "num_experts_per_tok": 2, "head_dim": 16, "kv_lora_rank": 16,
         "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
         "first_k_dense_replace": 1, "max_position_embeddings": 64, "n_group": 1,
         "topk_group": 1}
SUBCONFIGS = ("text_config", "vision_config", "audio_config", "encoder_config",
              "decoder_config")


def families() -> list[str]:
    """The model packages whose modeling code names a keep-in-fp32 list (read as text, so
    collecting this file imports none of them)."""
    root = Path(transformers.__file__).parent / "models"
    return sorted({f.parent.name for f in root.glob("*/modeling_*.py")
                   if "_keep_in_fp32_modules" in f.read_text()})


def declaring(family: str) -> list[type]:
    """The family's model classes (not its `*PreTrainedModel` bases) whose class declares a
    non-empty list, base models and causal LMs first."""
    root = Path(transformers.__file__).parent / "models" / family
    found = []
    for file in sorted(root.glob("modeling_*.py")):
        module = importlib.import_module(f"transformers.models.{family}.{file.stem}")
        for name, cls in vars(module).items():
            if (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)
                    and cls.__module__ == module.__name__
                    and not name.endswith("PreTrainedModel")
                    and (cls._keep_in_fp32_modules or cls._keep_in_fp32_modules_strict)):
                found.append(cls)
    return sorted(found, key=lambda c: (not c.__name__.endswith("ForCausalLM"),
                                        not c.__name__.endswith("Model"), c.__name__))


def shrink(config: Any) -> Any:
    for key, value in SMALL.items():
        if isinstance(getattr(config, key, None), int):
            setattr(config, key, value)
    if isinstance(getattr(config, "pad_token_id", None), int):
        config.pad_token_id = 0
    for sub in SUBCONFIGS:
        inner = getattr(config, sub, None)
        if hasattr(inner, "to_dict"):
            shrink(inner)
    return config


def build(classes: list[type]) -> tuple[nn.Module | None, str]:
    """The first of `classes` transformers builds on the meta device, from its config shrunk,
    else its default config; (None, why) when it builds none."""
    why = ""
    for cls in classes:
        for small in (True, False):
            try:
                config = cls.config_class()
                if small:
                    shrink(config)
                with torch.device("meta"):
                    return cls(config), ""
            except Exception as e:  # transformers' own constructor refusing its own config
                why = f"{cls.__name__}: {type(e).__name__}: {str(e)[:120]}"
    return None, why


def kept_by_transformers(model: nn.Module, low: torch.dtype) -> set[str]:
    """The tensors transformers' loader keeps in fp32 when it loads `model` in `low`.

    NOTE: transformers' own choice of entries for the dtype (`_get_dtype_plan`) and its own
    matcher (`build_glob_alternation`), as its loader applies them to each name."""
    from transformers.core_model_loading import build_glob_alternation

    entries = model._get_dtype_plan(low)
    if not entries:
        return set()
    regex = build_glob_alternation(list(entries))[0]
    names = [*dict(model.named_parameters()), *dict(model.named_buffers())]
    return {n for n in names if regex.search(n)}


@pytest.mark.parametrize("family", families())
def test_rules_keep_in_fp32_every_tensor_transformers_keeps(family: str) -> None:
    classes = declaring(family)
    if not classes:
        pytest.skip(f"{family}: its classes set the lists empty (None or [])")
    model, why = build(classes)
    if model is None:
        pytest.skip(f"transformers cannot build {family} from its own config: {why}")
    checked = 0
    for low in (torch.float16, torch.bfloat16):
        kept = kept_by_transformers(model, low)
        fresh, _ = build([type(model)])
        assert fresh is not None
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # the dtype is given: nothing widened
            warnings.filterwarnings("ignore", module="transformers")
            annotate(fresh, hf.rules(fresh, dtype=low))
        planned = planned_dtypes(resolve(fresh, default=low))
        lost = sorted(n for n in kept if n in planned and planned[n] != torch.float32)
        assert lost == [], f"{type(model).__name__} in {low}: {lost[:6]}"
        # never narrower than the dtype asked for, wider only where transformers keeps fp32 in
        # the same module or in a module holding a kept tensor
        wide = {n for n, d in planned.items() if d == torch.float32} - kept
        owners = {n.rpartition(".")[0] for n in kept}
        assert all(n.rpartition(".")[0] in owners or any(
            n.startswith(o + ".") for o in owners if o) for n in wide), sorted(wide)[:6]
        checked += len(kept)
    if checked == 0:
        pytest.skip(f"{type(model).__name__} as built here has none of the tensors its lists "
                    "name (parts this configuration does not build)")


def test_the_classes_are_enumerated_from_the_installed_transformers() -> None:
    """Not a fixed list: at least the mixture-of-experts families this library's issue names
    (56 in 5.24 declare a strict list), found by the enumeration above."""
    found = families()
    assert {"deepseek_v3", "deepseek_v4", "hy_v3", "t5"} <= set(found)
    assert len(found) >= 50
