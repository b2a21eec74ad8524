"""DeepSpeed adapter: every mapping row and error, then real training on ZeRO 0-3."""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from precision_annot import Policy, annotate, bf16, check, fp16, fp32, precision, resolve
from precision_annot.adapters import deepspeed as dsa
from tests.helpers import deepspeed_op_built, launch
from tests.workers.models import ScaledLinear, linear_elements, norm_elements

pytest.importorskip("deepspeed")
from deepspeed.runtime.config import DeepSpeedConfig

BASE = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}


def island() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), precision(fp32)(nn.LayerNorm(4)), nn.Linear(4, 2))


def export(model_or_plan: Any, base: Any = BASE) -> tuple[dict[str, Any], list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = dsa.to_config(model_or_plan, base)
    DeepSpeedConfig(config)  # DeepSpeed's own validation
    return config, [str(w.message) for w in caught]


def test_uniform_bf16_storage_maps_to_bf16_section() -> None:
    config, caught = export(resolve(nn.Sequential(nn.Linear(4, 4)), default="bf16"))
    assert config["bf16"] == {"enabled": True}
    assert "torch_autocast" not in config and "fp16" not in config and not caught


def test_uniform_fp16_storage_maps_to_fp16_with_dynamic_loss_scaling() -> None:
    config, _ = export(resolve(nn.Sequential(nn.Linear(4, 4)), default="fp16"))
    assert config["fp16"] == {"enabled": True, "loss_scale": 0}


def test_uniform_comm_under_bf16_maps_to_communication_data_type() -> None:
    plan = resolve(nn.Linear(4, 4), default=Policy(compute=bf16, storage=bf16, comm=fp32))
    config, _ = export(plan)
    assert config["communication_data_type"] == "fp32" and config["bf16"]["enabled"]


def test_mixed_precision_maps_to_torch_autocast_with_exact_classes() -> None:
    model = nn.Sequential(nn.Linear(4, 4), ScaledLinear(4, 4), precision(fp32)(nn.LayerNorm(4)))
    config, caught = export(resolve(model, default=Policy(compute=bf16, storage=fp32, comm=bf16)))
    assert config["torch_autocast"] == {
        "enabled": True, "dtype": "bfloat16",
        # exact classes: the subclass is listed by itself; the LayerNorm reduces in fp32
        "lower_precision_safe_modules": ["tests.workers.models.ScaledLinear",
                                         "torch.nn.modules.linear.Linear"],
    }
    assert not caught


def test_plan_not_expressible_by_class_uses_per_parameter_comm_dtype() -> None:
    model = nn.Sequential(nn.Linear(4, 4), precision(comm=fp32)(nn.Linear(4, 4)))
    plan = resolve(model, default=Policy(compute=bf16, storage=fp32, comm=bf16))
    config, _ = export(plan)
    assert config["torch_autocast"]["lower_precision_safe_modules"] == []
    dsa.prepare(model, plan)
    assert [p.comm_dtype for p in model[0].parameters()] == [bf16, bf16]  # type: ignore[attr-defined]
    assert [p.comm_dtype for p in model[1].parameters()] == [fp32, fp32]  # type: ignore[attr-defined]


def test_mixed_storage_translates_to_fp32_storage_with_a_warning() -> None:
    model = island()
    plan = resolve(model, default="bf16")
    config, caught = export(plan)
    assert config["torch_autocast"]["dtype"] == "bfloat16"
    assert len(caught) == 1 and "mixes storage dtypes (bf16, fp32)" in caught[0]
    with pytest.warns(UserWarning, match="mixes storage"):
        dsa.prepare(model, plan)
    assert {p.dtype for p in model.parameters()} == {fp32}
    with torch.autocast("cpu", dtype=bf16):
        model(torch.randn(2, 4))  # the island still computes in fp32 inside autocast


def test_fp32_plan_adds_no_precision_section() -> None:
    config, _ = export(resolve(nn.Linear(4, 4), default="fp32"))
    assert config == BASE


def test_base_settings_win_and_base_is_not_modified(tmp_path: Path) -> None:
    base = {**BASE, "bf16": {"enabled": True, "immediate_grad_update": True},
            "gradient_clipping": 1.0}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(base))
    plan = resolve(nn.Linear(4, 4), default="bf16")
    for given in (base, str(path), path):
        config, _ = export(plan, given)
        assert config["bf16"] == {"enabled": True, "immediate_grad_update": True}
        assert config["gradient_clipping"] == 1.0
    assert "communication_data_type" not in base


@pytest.mark.parametrize(
    ("default", "base", "key"),
    [("bf16", {"fp16": {"enabled": True}}, "fp16.enabled"),
     ("bf16", {"bf16": {"enabled": False}}, "bf16.enabled"),
     ("bf16-mixed", {"bf16": {"enabled": True}}, "bf16.enabled"),
     ("bf16-mixed", {"torch_autocast": {"dtype": "float16"}}, "torch_autocast.dtype"),
     ("bf16", {"torch_autocast": {"enabled": True}}, "torch_autocast.enabled"),
     ("fp32", {"fp16": {"enabled": True}}, "fp16.enabled"),
     (Policy(compute=bf16, storage=bf16, comm=fp32), {"communication_data_type": "fp16"},
      "communication_data_type")],
)
def test_contradictions_name_the_keys(default: Any, base: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=f"contradicts the plan at {key}"):
        dsa.to_config(resolve(nn.Linear(4, 4), default=default), {**BASE, **base})


def test_user_class_list_that_contradicts_the_plan() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    plan = resolve(model, default=Policy(compute=bf16, storage=fp32, comm=fp32))
    linear = "torch.nn.modules.linear.Linear"
    base = {**BASE, "torch_autocast": {"lower_precision_safe_modules": [linear]}}
    with pytest.raises(ValueError, match="lower_precision_safe_modules"):
        dsa.to_config(plan, base)


def test_class_lists_are_read_as_deepspeed_imports_them() -> None:
    """DeepSpeed imports each name of lower_precision_safe_modules and tags the exact classes:
    `torch.nn.Linear` is nn.Linear, so the Linear planned to reduce in fp32 is reduced in bf16
    (ds-autocast-alias-class-by-hand in tests/adapters/test_check_matrix.py, 2 ranks, measures
    it), and a name it cannot import stops `initialize`. 0.5 compared the spelling with the
    plan's class path, and said nothing of either."""
    model = nn.Sequential(nn.Linear(4, 4), precision(comm=fp32)(nn.Linear(4, 4)))
    plan = resolve(model, default=Policy(compute=bf16, storage=fp32, comm=bf16))

    def listing(*names: str) -> dict[str, Any]:
        return {**BASE, "torch_autocast": {"enabled": True, "dtype": "bfloat16",
                                           "lower_precision_safe_modules": list(names)}}

    for spelt in ("torch.nn.Linear", "torch.nn.modules.linear.Linear"):
        found = codes_of(plan, listing(spelt))
        assert (found["deepspeed-comm"].severity, found["deepspeed-comm"].modules) == (
            "error", ("1",))  # planned fp32, bf16 instead
        with pytest.raises(ValueError, match=r"contradicts the plan at torch_autocast.lower_pr"
                                             r"ecision_safe_modules.*'1' reduced in fp32"):
            dsa.to_config(plan, listing(spelt))
    missing = listing("torch.nn.Linear", "torch.nn.NoSuchLayer")
    (refused,) = codes_of(plan, missing).values()
    assert (refused.severity, refused.code) == ("error", "deepspeed-config")
    assert refused.message.startswith("DeepSpeed refuses to start with torch_autocast.lower_"
                                      "precision_safe_modules=")
    assert "['torch.nn.NoSuchLayer']" in refused.message
    with pytest.raises(ValueError, match=r"cannot import \['torch.nn.NoSuchLayer'\]"):
        dsa.to_config(plan, missing)


def test_fp16_compute_over_fp32_storage_under_zero_1_3_is_refused() -> None:
    plan = resolve(island(), default="fp16")
    with pytest.raises(ValueError, match=r"zero_optimization.stage=2.*does not update"):
        dsa.to_config(plan, BASE)
    config, _ = export(plan, {**BASE, "zero_optimization": {"stage": 0}})
    assert config["torch_autocast"]["dtype"] == "float16"


def test_both_low_compute_dtypes_over_fp32_are_refused() -> None:
    model = nn.Sequential(precision(compute=fp16)(nn.Linear(4, 4)), nn.Linear(4, 4))
    with pytest.raises(ValueError, match="both fp16 and bf16"):
        dsa.to_config(resolve(model, default="bf16-mixed"), BASE)


def test_bases_as_deepspeed_and_hugging_face_write_them(tmp_path: Path) -> None:
    """0.1 gave AttributeError on null sections, "not valid JSON" on comments, reported "auto"
    as "the base has True", and silently overwrote a string "false"."""
    plan = resolve(nn.Linear(4, 4), default="bf16")
    config, _ = export(plan, {**BASE, "bf16": None, "fp16": None, "torch_autocast": None})
    assert config["bf16"] == {"enabled": True} and "torch_autocast" not in config
    auto = {**BASE, "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
            "communication_data_type": "auto"}
    config, _ = export(resolve(nn.Linear(4, 4), default=Policy(bf16, bf16, fp32)), auto)
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}
    assert config["communication_data_type"] == "fp32"
    # where the plan has no one comm dtype to write, what DeepSpeed reduces in without the key:
    # 0.5 left "auto", which DeepSpeed, the Hugging Face Trainer and Accelerate all refuse
    per_module = nn.Sequential(nn.Linear(4, 4), precision(comm=fp32)(nn.Linear(4, 4)))
    for default, model, said in (("bf16", nn.Linear(4, 4), "bf16"), ("bf16", island(), "fp32"),
                                 (Policy(compute=bf16, storage=fp32, comm=bf16), per_module,
                                  "fp32")):
        for stage in (0, 2):
            config, _ = export(resolve(model, default=default),
                               {**auto, "zero_optimization": {"stage": stage}})
            assert config["communication_data_type"] == said, (default, stage)
    mixed = resolve(island(), default=Policy(compute=bf16, storage=fp32))
    config, _ = export(mixed, {**BASE, "bf16": {"enabled": "auto"},
                               "torch_autocast": {"enabled": "auto", "dtype": "auto"}})
    assert config["torch_autocast"]["dtype"] == "bfloat16" and config["bf16"]["enabled"] is False
    with pytest.raises(ValueError, match=r"contradicts the plan at bf16.enabled: the base has "
                                         r"'false'"):
        dsa.to_config(plan, {**BASE, "bf16": {"enabled": "false"}})
    with pytest.raises(ValueError, match=r"bf16.enabled must be a boolean.*'maybe'"):
        dsa.to_config(plan, {**BASE, "bf16": {"enabled": "maybe"}})
    with pytest.raises(ValueError, match=r"'bf16' must be an object or null.*bf16=True"):
        dsa.to_config(plan, {**BASE, "bf16": True})
    with pytest.raises(ValueError, match=r"zero_optimization.stage must be 0, 1, 2 or 3.*'two'"):
        dsa.to_config(plan, {**BASE, "zero_optimization": {"stage": "two"}})
    commented = tmp_path / "ds.json"
    commented.write_text('{\n  // DeepSpeed reads hjson\n  "train_micro_batch_size_per_gpu": 2,'
                         '\n  "zero_optimization": {"stage": 2},  # trailing\n}\n')
    config, _ = export(plan, commented)
    assert config == {**BASE, "bf16": {"enabled": True}}


def test_bad_input(tmp_path: Path) -> None:
    plan = resolve(nn.Linear(4, 4), default="bf16")
    with pytest.raises(TypeError, match="base must be a dict"):
        dsa.to_config(plan, 42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no file at"):
        dsa.to_config(plan, str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON or hjson"):
        dsa.to_config(plan, bad)
    with pytest.raises(ValueError, match=r"communication_data_type='fp8'"):
        dsa.to_config(plan, {**BASE, "communication_data_type": "fp8"})
    with pytest.raises(ValueError, match=r"torch_autocast.dtype='int8'"):
        dsa.to_config(plan, {**BASE, "torch_autocast": {"dtype": "int8"}})
    with pytest.raises(TypeError, match="nn.Module or a PrecisionPlan"):
        dsa.to_config("model")  # type: ignore[arg-type]
    other = resolve(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    with pytest.raises(ValueError, match=r"another model.*'1'"):
        dsa.prepare(nn.Sequential(nn.Linear(4, 4)), other)
    with pytest.raises(TypeError, match="prepare expects an nn.Module"):
        dsa.prepare(plan)  # type: ignore[arg-type]


# --- real DeepSpeed, CPU accelerator, gloo ------------------------------------------------------

STAGES = [0, 1, 2, 3]
LINEAR, NORM = linear_elements(16, 32, 4), norm_elements(32)


def run(mode: str, stages: list[int], ranks: int, tmp_path: Path) -> dict[tuple[int, int], Any]:
    deepspeed_op_built()
    launch("tests.workers.deepspeed", mode, ",".join(map(str, stages)), str(tmp_path),
           ranks=ranks, timeout=540)
    return {(s, r): json.loads((tmp_path / f"{mode}-stage{s}-rank{r}.json").read_text())
            for s in stages for r in range(ranks)}


def check_training(result: dict[str, Any]) -> None:
    assert result["seen"] == {"fc1": ["bf16"], "norm": ["fp32"], "fc2": ["bf16"], "rope": ["fp32"]}
    assert result["island_storage"] == ["fp32", "fp32"]
    assert result["inv_freq"] == "fp32"  # DeepSpeed issue 5812
    before, after = result["island_before"], result["island_after"]
    assert all(a != b for a, b in zip(before, after, strict=True))  # the optimizer updated it
    assert result["losses"][-1] < result["losses"][0] * 0.85, result["losses"]
    assert result["comm_dtype"]["norm.inner.weight"] == "fp32"
    assert result["comm_dtype"]["fc1.inner.weight"] == "bf16"


def codes_of(model_or_plan: Any, base: Any = BASE) -> dict[str, Any]:
    """`check(..., "deepspeed", base)` by code; it warns nothing (the warnings are findings)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = check(model_or_plan, "deepspeed", base)
    return {f.code: f for f in found if f.code.startswith("deepspeed-")}


def test_check_says_what_to_config_refuses_in_its_words() -> None:
    plan = resolve(nn.Linear(4, 4), default="bf16")
    base = {**BASE, "bf16": {"enabled": False}}
    with pytest.raises(ValueError) as refused:
        dsa.to_config(plan, base)
    found = codes_of(plan, base)
    assert found["deepspeed-config"].severity == "error"
    assert found["deepspeed-config"].message.startswith(str(refused.value))
    assert "mat1 and mat2 must have the same dtype" in found["deepspeed-config"].message
    assert ".." not in found["deepspeed-config"].message  # 0.4 doubled the period
    with pytest.raises(ValueError, match=r"zero_optimization.stage must be 0, 1, 2 or 3"):
        codes_of(plan, {"zero_optimization": {"stage": "two"}})  # bad input, not a finding
    assert codes_of(plan, dsa.to_config(plan, BASE)) == {}
    assert codes_of(plan, None) == {}  # no config: what to_config(plan) exports


def test_a_deepspeed_config_s_optimizer_section_is_deepspeed_s(tmp_path: Path) -> None:
    """0.4 read a config dict's "optimizer" as the loop's optimizer and raised TypeError ("config
    'optimizer' is the optimizer you will step"), while the same config as a file was accepted:
    a DeepSpeed config's keys mean what DeepSpeed says, dict or file."""
    config = {**BASE, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    assert DeepSpeedConfig(config).optimizer_name == "adamw"  # DeepSpeed's own section
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    plan = resolve(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), default="bf16")
    found = check(plan, "deepspeed", config)
    assert found == check(plan, "deepspeed", str(path))
    assert not [f for f in found if f.severity == "error"]


def test_a_misspelt_top_level_key_is_named_as_deepspeed_ignores_it() -> None:
    """DeepSpeed reads no `zero_optimisation` and says nothing: the run is ZeRO stage 0. `check`
    names the key and the one DeepSpeed reads; correctly spelt configs (and keys far from any
    DeepSpeed knows) get no such finding."""
    from precision_annot.adapters.deepspeed.checks import known_keys

    typo = {"train_micro_batch_size_per_gpu": 2, "zero_optimisation": {"stage": 2}}
    assert DeepSpeedConfig(typo).zero_optimization_stage == 0  # ignored, silently
    assert DeepSpeedConfig(BASE).zero_optimization_stage == 2
    plan = resolve(nn.Linear(4, 4), default="bf16")
    found = [f for f in check(plan, "deepspeed", typo) if f.code == "deepspeed-unknown-key"]
    assert len(found) == 1 and found[0].severity == "warning"
    assert "'zero_optimisation'" in found[0].message and "'zero_optimization'" in found[0].message
    for config in (BASE, {**BASE, "my_run_name": "x", "gradient_clipping": 1.0,
                          "activation_checkpointing": {}, "flops_profiler": {}}):
        assert not [f for f in check(plan, "deepspeed", config)
                    if f.code == "deepspeed-unknown-key"]
    # every top-level key the installed DeepSpeed's config reads is known
    read: set[str] = set()

    class Recording(dict[str, Any]):
        def get(self, key: Any, *default: Any) -> Any:
            read.add(key)
            return super().get(key, *default)

        def __getitem__(self, key: Any) -> Any:
            read.add(key)
            return super().__getitem__(key)

        def __contains__(self, key: object) -> bool:
            read.add(str(key))
            return super().__contains__(key)

    DeepSpeedConfig(Recording({"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1}))
    assert len(read) > 40 and read <= known_keys(), sorted(read - known_keys())


def test_check_evaluates_the_config_as_deepspeed_gets_it() -> None:
    """Measured on 2 ranks (tests/adapters/test_check_matrix.py): a base without the plan's
    sections runs DeepSpeed's defaults."""
    plan = resolve(nn.Sequential(nn.Linear(4, 4)), default="bf16")
    (found,) = codes_of(plan, BASE).values()  # no bf16 section: fp32 on the wire
    assert (found.severity, found.code) == ("warning", "deepspeed-comm")
    assert "to_config(plan, config)" in found.fix
    refused = codes_of(plan, {**BASE, "bf16": {"enabled": True},
                              "communication_data_type": "auto"})
    assert list(refused) == ["deepspeed-config"]
    assert "refuses to start with communication_data_type='auto'" in \
        refused["deepspeed-config"].message
    fp16 = codes_of(resolve(nn.Linear(4, 4), default="fp16"), {**BASE, "fp16": {"enabled": True}})
    from deepspeed.accelerator import get_accelerator

    # DeepSpeed refuses the fp16 section where its accelerator has no fp16 (CPUs without
    # AVX512-FP16 or AMX-FP16): asked of DeepSpeed on this machine, not assumed
    refuses = not get_accelerator().is_fp16_supported()
    assert ("deepspeed-fp16-device" in fp16) == refuses


@pytest.mark.slow
def test_communication_data_type_auto_is_filled_by_to_config_alone() -> None:
    """`communication_data_type: "auto"` is no value Hugging Face fills: Accelerate, through
    which the Trainer starts DeepSpeed, refuses it by name, and DeepSpeed's parser refuses it
    (the 2-rank run ds-communication-data-type-auto of tests/adapters/test_check_matrix.py).
    So `check` keeps the error for such a config as given, and to_config fills it."""
    import copy

    pytest.importorskip("accelerate")
    from accelerate.utils import DeepSpeedPlugin

    config = {**BASE, "bf16": {"enabled": "auto"}, "communication_data_type": "auto"}
    plugin = DeepSpeedPlugin(hf_ds_config=copy.deepcopy(config))
    with pytest.raises(ValueError, match="`communication_data_type` not found in kwargs"):
        plugin.deepspeed_config_process(must_match=False, **{"bf16.enabled": True})
    with pytest.raises(ValueError, match="Invalid communication_data_type.*Got: auto"):
        DeepSpeedConfig({**BASE, "communication_data_type": "auto"})
    plan = resolve(nn.Linear(4, 4), default="bf16")
    (found,) = codes_of(plan, config).values()
    assert found.message.startswith("DeepSpeed refuses to start with communication_data_type="
                                    "'auto'")
    assert "Accelerate refuses it" in found.message and "(\"auto\" included)" in found.fix
    exported, _ = export(plan, config)
    assert exported["communication_data_type"] == "bf16" and codes_of(plan, exported) == {}


def test_check_speaks_for_an_engine_started_in_its_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed keeps "torch_autocast was initialized" in a module-level flag that no engine
    resets: a ZeRO 1-3 engine started after a torch_autocast one in the same process reduces
    each parameter in its comm_dtype, its config's communication_data_type aside (2 ranks
    measure it: the *-after-autocast scenarios of tests/adapters/test_check_matrix.py). 0.5
    said "fp32 instead of the planned bf16" there, for gradients reduced in bf16 as planned."""
    from deepspeed.runtime import torch_autocast

    plan = resolve(nn.Sequential(nn.Linear(4, 4), precision(comm=fp32)(nn.LayerNorm(4))),
                   default="bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the two comm dtypes: fp32 for all, said
        config = dsa.to_config(plan, BASE)
    assert config["communication_data_type"] == "fp32"
    fresh = codes_of(plan, config)["deepspeed-comm"]
    assert (fresh.severity, fresh.modules) == ("warning", ("0",))
    monkeypatch.setattr(torch_autocast, "TORCH_AUTOCAST_INITIALIZED", True)  # as an engine does
    assert codes_of(plan, config) == {}
    assert dsa.reduced(dsa.translate(plan), config, 2) == {"0": bf16, "1": fp32}
    assert set(dsa.reduced(dsa.translate(plan), config, 0).values()) == {fp32}  # ZeRO 0: one


def test_check_asks_deepspeed_which_auto_values_it_refuses() -> None:
    """A config written for Hugging Face's Trainer holds "auto" values, which DeepSpeed itself
    refuses outside its own sections (the 2-rank run of the check matrix, ds-hf-auto-values,
    fails with "'>' not supported between instances of 'str' and 'int'"); 0.3 said nothing."""
    from tests.workers.scenarios import HF_AUTO

    refused = dsa.unresolved_auto(HF_AUTO)
    assert [k for k, _ in refused] == ["train_micro_batch_size_per_gpu",
                                       "gradient_accumulation_steps", "gradient_clipping"]
    assert "'>' not supported" in refused[0][1]
    plan = resolve(island(), default="bf16-mixed")
    found = codes_of(plan, HF_AUTO)
    assert list(found) == ["deepspeed-auto"]
    assert "train_micro_batch_size_per_gpu, gradient_accumulation_steps, gradient_clipping" in \
        found["deepspeed-auto"].message
    resolved_inside = {"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": "auto"},
                       "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}
    assert dsa.unresolved_auto(resolved_inside) == []


def test_check_mixed_storage_with_its_byte_cost() -> None:
    plan = resolve(island(), default="bf16")
    found = codes_of(plan, dsa.to_config(plan, BASE))
    assert list(found) == ["deepspeed-mixed-storage"]
    # the Linears' 20 + 10 parameters grow from 2 to 4 bytes each
    assert "60 more bytes of parameters" in found["deepspeed-mixed-storage"].message
    assert dsa.translate(resolve(island(), default="bf16"), warn=False).extra_bytes == 60
    uniform = resolve(nn.Sequential(nn.Linear(4, 4)), default="bf16")
    assert codes_of(uniform, dsa.to_config(uniform, BASE)) == {}


def test_check_fp16_autocast_under_zero_1_to_3() -> None:
    plan = resolve(island(), default="16-mixed")
    for stage in (1, 2, 3):
        found = codes_of(plan, {"zero_optimization": {"stage": stage}})
        assert list(found) == ["deepspeed-fp16-zero"], found
        assert f"zero_optimization.stage={stage}" in found["deepspeed-fp16-zero"].message
    assert codes_of(plan, {"zero_optimization": {"stage": 0}}) == {}
    assert codes_of(resolve(island(), default="bf16-mixed")) == {}


def test_check_zero_0_ignores_per_module_comm() -> None:
    """The 2-rank run below shows it: ZeRO 0 reduces every gradient in fp32."""
    plan = resolve(nn.Sequential(nn.Linear(4, 4), precision(comm=fp32)(ScaledLinear(4, 4))),
                   default=Policy(compute=bf16, storage=fp32, comm=bf16))
    found = codes_of(plan, dsa.to_config(plan, {"zero_optimization": {"stage": 0}}))
    assert list(found) == ["deepspeed-zero0-comm"] and found["deepspeed-zero0-comm"].modules == (
        "0",)  # the Linear planned in bf16, reduced in fp32
    assert codes_of(plan, dsa.to_config(plan, {"zero_optimization": {"stage": 1}})) == {}


def test_check_a_plan_that_needs_prepare() -> None:
    """Two Linears reduced in different dtypes cannot be said by class in the config."""
    model = nn.Sequential(nn.Linear(4, 4), precision(comm=fp32)(nn.Linear(4, 4)))
    plan = resolve(model, default=Policy(compute=bf16, storage=fp32, comm=bf16))
    found = codes_of(plan, dsa.to_config(plan, BASE))
    assert list(found) == ["deepspeed-needs-prepare"]
    assert "prepare(model)" in found["deepspeed-needs-prepare"].fix
    by_class = nn.Sequential(nn.Linear(4, 4), precision(comm=fp32)(ScaledLinear(4, 4)))
    plan = resolve(by_class, default=Policy(compute=bf16, storage=fp32, comm=bf16))
    assert codes_of(plan, dsa.to_config(plan, BASE)) == {}


def test_check_a_static_fp16_loss_scale_as_on_a_gpu_machine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's fp16 section refuses this CPU (the finding below); where fp16 runs, a
    static loss scale is what is left to say. Mocked: only the device's answer."""
    from precision_annot.adapters.deepspeed import checks

    monkeypatch.setattr(checks, "_fp16_supported", lambda: True)
    plan = resolve(nn.Sequential(nn.Linear(4, 4)), default="fp16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = dsa.to_config(plan, {**BASE, "fp16": {"loss_scale": 128}})
    found = codes_of(plan, config)
    assert found["deepspeed-static-loss-scale"].severity == "warning"
    assert "fp16.loss_scale=128" in found["deepspeed-static-loss-scale"].message
    assert "still skips a step whose gradients overflow" in \
        found["deepspeed-static-loss-scale"].message  # measured: it does
    assert "deepspeed-static-loss-scale" not in codes_of(plan, dsa.to_config(plan, BASE))


@pytest.mark.slow  # over make test's budget: run by make test-all
@pytest.mark.parametrize("ranks", [1, 2])
def test_fp32_island_trains_under_zero_0_to_3(ranks: int, tmp_path: Path) -> None:
    results = run("train", STAGES, ranks, tmp_path)
    for stage in STAGES:
        for rank in range(ranks):
            check_training(results[stage, rank])
        if ranks == 2:
            assert results[stage, 0]["params"] == results[stage, 1]["params"]
            reduced = {(d, n) for op, d, n in results[stage, 0]["collectives"]
                       if op in ("all_reduce", "reduce_scatter_single", "reduce_scatter_tensor")}
            if stage == 0:  # ZeRO 0 reduces in the parameter dtype (the adapter warns)
                assert reduced == {("fp32", LINEAR + NORM)}
            else:  # each parameter's planned dtype reaches the collective
                assert reduced == {("bf16", LINEAR), ("fp32", NORM)}, results[stage, 0]


@pytest.mark.slow  # over make test's budget: run by make test-all
@pytest.mark.parametrize("ranks", [1, 2])
def test_fp16_trains_with_dynamic_loss_scaling_and_skips_overflow(ranks: int,
                                                                    tmp_path: Path) -> None:
    results = run("fp16", [0], ranks, tmp_path)
    for rank in range(ranks):
        r = results[0, rank]
        assert r["config"]["torch_autocast"]["dtype"] == "float16"
        assert r["seen"]["fc1"] == ["fp16"] and r["seen"]["norm"] == ["fp32"]
        assert r["skipped"] == [True]  # the overflow step changed no parameter
        assert r["scale"] == 2.0**15  # dynamic: halved from 2**16 by the overflow
        finite = [x for x in r["losses"] if x != float("inf")]
        assert finite[-1] < finite[0] * 0.85


def test_to_config_and_prepare_start_from_the_plan_applied_to_the_model() -> None:
    """0.2 resolved the bare annotations again: the config said fp32 and prepare turned the
    model back to fp32."""
    from precision_annot import apply, audit

    model = nn.Sequential(nn.Linear(4, 4), precision(fp32)(nn.LayerNorm(4)), nn.Linear(4, 2))
    apply(model, default="bf16-mixed")
    assert dsa.to_config(model)["torch_autocast"]["dtype"] == "bfloat16"
    dsa.prepare(model)
    assert model[0].weight.dtype == fp32 and model[0].weight.comm_dtype == fp32
    with audit(model) as report:
        model(torch.randn(2, 4)).float().sum().backward()
    assert report.divergences == [] and set(report["0"].forward_ops) == {bf16}
    assert [f.code for f in dsa.findings(model, {"zero_optimization": {"stage": 2}})] == \
        [f.code for f in dsa.findings(resolve(model, default="bf16-mixed"),
                                      {"zero_optimization": {"stage": 2}})]


# -- the update half ----------------------------------------------------------------------------

@pytest.mark.slow  # over make test's budget: run by make test-all
def test_the_update_half_runs_on_two_zero_2_ranks_as_exported(tmp_path: Path) -> None:
    """to_config says the plan's masters, state and gradient accumulation in DeepSpeed's keys,
    and ZeRO-2 on 2 ranks keeps exactly that: bf16 masters and bf16 state, or fp32 masters,
    fp32 state and fp32 accumulation, with each rank holding half the elements."""
    deepspeed_op_built()
    launch("tests.workers.deepspeed", "update", "2", str(tmp_path), ranks=2, timeout=300)
    for rank in (0, 1):
        low = json.loads((tmp_path / f"update-bf16-state-rank{rank}.json").read_text())
        assert low["config"] == {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                                          "bf16_optimizer_states": True}}
        half = low["params"] // 2
        assert (low["masters"], low["state"], low["grad_accum"]) == (["bf16"], ["bf16"], "bf16")
        assert (low["master_bytes"], low["state_bytes"]) == (half * 2, 2 * half * 2)
        wide = json.loads((tmp_path / f"update-fp32-masters-rank{rank}.json").read_text())
        assert wide["config"]["data_types"] == {"grad_accum_dtype": "fp32"}
        assert (wide["masters"], wide["state"], wide["grad_accum"]) == (["fp32"], ["fp32"],
                                                                         "fp32")
        assert (wide["master_bytes"], wide["state_bytes"]) == (half * 4, 2 * half * 4)
        for r in (low, wide):
            assert r["weights"] == ["bf16"] and r["losses"][-1] < r["losses"][0]
        # each plan checked against the other's config: what check says the masters become is
        # what DeepSpeed kept (the preset "bf16-master" is fp32 masters; DeepSpeed's
        # bf16_master_weights_and_grads: true is bf16 masters)
        fp32_masters = resolve(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4)),
                               default="bf16-master")
        bf16_masters = resolve(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4)),
                               default="bf16-true,master=bf16,optim=bf16")
        hand = json.loads((tmp_path / f"update-hand-bf16-masters-rank{rank}.json").read_text())
        assert (hand["refused"], hand["masters"], hand["state"]) == (None, ["bf16"], ["bf16"])
        (narrowed,) = [f for f in check(fp32_masters, "deepspeed", {**BASE, **hand["config"]})
                       if f.code == "deepspeed-masters"]
        assert narrowed.severity == "error" and "keeps bf16 master weights" in narrowed.message
        assert '"bf16-master" (master=fp32) keeps fp32 master weights' in narrowed.message
        (widened,) = [f for f in check(bf16_masters, "deepspeed", {**BASE, **wide["config"]})
                      if f.code == "deepspeed-masters"]
        assert widened.severity == "warning" and wide["masters"] == ["fp32"]
        assert f"{low['params'] * 2:,} more bytes of masters" in widened.message
        alone = json.loads(
            (tmp_path / f"update-hand-bf16-masters-alone-rank{rank}.json").read_text())
        said = "Master weights feature requires ZeRO-2 Offload with DeepSpeedCPUAdam"
        assert said in alone["refused"]
        (refused,) = [f for f in check(fp32_masters, "deepspeed", alone["config"])
                      if f.severity == "error"]
        assert refused.code == "deepspeed-masters"
        assert refused.message.startswith("DeepSpeed refuses to start with")
        assert said in refused.message


def test_check_says_what_deepspeed_cannot_do_with_the_update_half() -> None:
    def codes(spec: Any, stage: int = 2) -> dict[str, Any]:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        if isinstance(spec, dict):
            annotate(model, spec)
            spec = None
        return codes_of(resolve(model, default=spec), {"zero_optimization": {"stage": stage}})

    for spec, says in (("bf16-true,master=fp32,optim=8bit", "optim=8bit has no DeepSpeed"),
                       ("bf16-true,master=stochastic", "master='stochastic' has no DeepSpeed"),
                       ({"*": "bf16-true,master=fp32", "1": "master=bf16"},
                        "updates its modules in 2 ways")):
        found = codes(spec)  # besides, that hand-written config has no bf16 section at all
        assert found["deepspeed-update"].severity == "error", found
        assert says in found["deepspeed-update"].message
        with pytest.raises(ValueError, match="DeepSpeed cannot run the plan's update half"), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dsa.to_config(resolve(nn.Linear(4, 4), spec if isinstance(spec, str) else
                                      "bf16-true,master=fp32,optim=8bit"),
                              {"zero_optimization": {"stage": 2}})
    assert "deepspeed-update" not in codes("bf16-master")  # what DeepSpeed does
    assert "deepspeed-update" not in codes("bf16-true")


def test_zero_0_exports_the_fp32_masters_deepspeed_keeps() -> None:
    """DeepSpeed's bf16 section at ZeRO 0 keeps fp32 masters (the 2-rank run below measures
    it): to_config exports master=fp32 there, and warns where the plan keeps no master;
    grad=fp32 ("bf16-master") it cannot say at ZeRO 0. 0.5 refused masters at ZeRO 0 "with
    no master copy"."""

    def exported(spec: str) -> tuple[dict[str, Any], list[str]]:
        plan = resolve(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), default=spec)
        return export(plan, {**BASE, "zero_optimization": {"stage": 0}})

    config, caught = exported("bf16-true,master=fp32")
    assert (config["bf16"], caught) == ({"enabled": True}, [])
    config, caught = exported("bf16-true,master=bf16,optim=bf16")
    assert config["bf16"] == {"enabled": True}  # both keys: refused at ZeRO 0
    (said,) = caught
    assert "ZeRO stage 0 DeepSpeed's bf16 mode always keeps fp32 master weights" in said
    assert "160 more bytes of masters and twice the bytes of optimizer state" in said
    from precision_annot.adapters.deepspeed.export import GRAD_ACCUM_WORDS

    with pytest.raises(ValueError, match=r"grad=fp32 over bf16 weights needs ZeRO stage 1-3.*"
                                         + re.escape(GRAD_ACCUM_WORDS)):
        exported("bf16-master")


def hand_zero0(masters: bool) -> list[list[list[float]]]:
    """The "zero0" worker's model and steps written by hand on one process: SGD on fp32
    copies of the bf16 weights written back rounded (`masters`), or on the bf16 weights."""
    from precision_annot import apply
    from tests.workers.deepspeed import ZERO0_LR, ZERO0_STEPS, zero0_batch, zero0_net

    net = zero0_net()
    apply(net, resolve(net, default="bf16-true"))
    params = list(net.parameters())
    copies = [p.detach().float().clone().requires_grad_() for p in params] if masters else params
    sgd = torch.optim.SGD(copies, lr=ZERO0_LR)
    x, y = zero0_batch()
    out = []
    for _ in range(ZERO0_STEPS):
        for p in params:
            p.grad = None
        nn.functional.mse_loss(net(x).float(), y).backward()
        for copy, p in zip(copies, params, strict=True):
            copy.grad = p.grad if copy is p else p.grad.float()  # type: ignore[union-attr]
        sgd.step()
        with torch.no_grad():
            for copy, p in zip(copies, params, strict=True):
                p.copy_(copy)
        out.append([p.detach().double().flatten().tolist() for p in params])
    return out


def moved(steps: list[list[list[float]]], start: list[list[float]]) -> float:
    """The share of weight elements the steps moved from `start`."""
    pairs = [(a, b) for end, first in zip(steps[-1], start, strict=True)
             for a, b in zip(end, first, strict=True)]
    return sum(a != b for a, b in pairs) / len(pairs)


@pytest.mark.slow
def test_zero_0_keeps_fp32_masters_on_two_ranks(tmp_path: Path) -> None:
    """DeepSpeed 0.19.8's bf16 section at ZeRO 0 steps the optimizer on fp32 copies of the
    weights and writes them back rounded (its unfused fp16/bf16 optimizer): 16 SGD steps,
    most below half a bf16 ulp of their weight, move the weights of 2 ranks exactly as a
    hand-written fp32-master loop does, where the bf16 weights stepped themselves barely move.
    The config to_config exports for master=fp32 runs it; a plan with no master gets the same
    fp32 masters, as to_config and check now say; grad=fp32 DeepSpeed refuses at ZeRO 0."""
    from precision_annot.adapters.deepspeed.export import GRAD_ACCUM_WORDS
    from tests.workers.deepspeed import ZERO0, zero0_net

    deepspeed_op_built()
    launch("tests.workers.deepspeed", "zero0", "0", str(tmp_path), ranks=2, timeout=300)
    want, bare = hand_zero0(masters=True), hand_zero0(masters=False)
    start = [p.detach().to(bf16).double().flatten().tolist() for p in zero0_net().parameters()]
    params = sum(p.numel() for p in zero0_net().parameters())
    assert moved(want, start) > 0.3 > 0.05 > moved(bare, start), (moved(want, start),
                                                                 moved(bare, start))
    base = {**BASE, "zero_optimization": {"stage": 0}}
    for rank in (0, 1):
        def ran(layout: str, rank: int = rank) -> dict[str, Any]:
            return json.loads((tmp_path / f"zero0-{layout}-rank{rank}.json").read_text())

        for layout in ("fp32-masters", "no-master"):
            r = ran(layout)
            assert r["refused"] is None and r["config"] == {"bf16": {"enabled": True}}
            assert (r["optimizer"], r["stored"], r["masters"], r["grad_accum"]) == (
                "FP16_UnfusedOptimizer", ["bf16"], ["fp32"], "bf16")
            assert r["master_bytes"] == params * 4
            assert r["weights"] == want  # bit for bit, at every step
        assert ran("fp32-masters")["warnings"] == []
        plan = resolve(zero0_net(), default=ZERO0["fp32-masters"])
        assert not [f for f in check(plan, "deepspeed", {**base, **ran("fp32-masters")["config"]})
                    if f.code.startswith("deepspeed-")]
        (warned,) = ran("no-master")["warnings"]
        assert f"{params * 4:,} more bytes of masters" in warned
        plan = resolve(zero0_net(), default=ZERO0["no-master"])
        (found,) = [f for f in check(plan, "deepspeed", {**base, **ran("no-master")["config"]})
                    if f.code.startswith("deepspeed-")]
        assert (found.severity, found.code) == ("warning", "deepspeed-masters")
        assert f"{params * 4:,} more bytes of masters" in found.message
        refused = ran("grad-fp32-by-hand")
        assert "unsupported mix of model_dtype" in refused["refused"]
        plan = resolve(zero0_net(), default=ZERO0["grad-fp32-by-hand"])
        (found,) = [f for f in check(plan, "deepspeed", {**base, **refused["config"]})
                    if f.severity == "error"]
        assert found.code == "deepspeed-update" and GRAD_ACCUM_WORDS in found.message


# -- buffers: data_types.keep_in_fp32_modules -----------------------------------------------------

class Scaled(nn.Module):
    """A module holding only buffers: a persistent `scale` and a non-persistent `table`."""

    _keep_in_fp32_modules_strict: ClassVar[list[str]] = ["table"]  # under its own name

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("table", torch.linspace(0, 1, 4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.table.to(x.dtype)


class Listed(nn.Module):
    """Declares both Hugging Face lists, as a transformers model class does."""

    _keep_in_fp32_modules: ClassVar[list[str]] = ["1.scale"]  # fp16 only
    _keep_in_fp32_modules_strict: ClassVar[list[str]] = ["bias_*"]

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("bias_a", torch.zeros(4))
        self.register_buffer("bias_b", torch.zeros(4), persistent=False)
        self.inner = nn.Sequential(nn.Linear(4, 4), Scaled())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner(self.lin(x) + self.bias_a + self.bias_b)
        return out


def deepspeed_keeps(model: nn.Module, setting: Any, low: torch.dtype) -> set[str]:
    """The buffers DeepSpeed's own code keeps in fp32 for this setting."""
    from deepspeed.runtime.keep_in_fp32 import buffers_to_keep_in_fp32, keep_in_fp32_pattern

    pattern = keep_in_fp32_pattern(model, setting, low)
    kept = {id(b) for b in buffers_to_keep_in_fp32(model, pattern)} if pattern else set()
    return {n for n, b in model.named_buffers() if id(b) in kept}


def test_keep_in_fp32_modules_is_read_as_deepspeed_reads_it() -> None:
    """The buffers the check says DeepSpeed keeps in fp32 are the ones DeepSpeed's own
    matching keeps, for "auto" (each module's lists under its name; the fp16-only list under
    fp16 only), lists of patterns and [], with the model here and with only its plan file."""
    from precision_annot import PrecisionPlan
    from precision_annot.adapters.deepspeed import buffers
    from precision_annot.adapters.deepspeed import export as ds_export
    from tests.workers.deepspeed import deepseek_v3

    def ours(plan: PrecisionPlan, setting: Any, low: torch.dtype) -> set[str]:
        config = {"bf16" if low == bf16 else "fp16": {"enabled": True},
                  "data_types": {"keep_in_fp32_modules": setting}}
        patterns = buffers.keep_patterns(plan, setting, low)
        assert ds_export.section_dtype(config) == low
        return {n for n in buffers.planned_buffers(plan)
                if patterns and re.search("|".join(patterns), n)}

    for model in (Listed(), deepseek_v3()):
        plan = resolve(model, default="bf16-true")
        loaded = PrecisionPlan.from_json(plan.to_json())  # no model: the classes' lists
        for setting in ("auto", [], ["bias_*"], ["inv_freq", "scale"], ["^inner\\.1\\."],
                        buffers.exact_patterns(["inner.1.scale"])):
            for low in (bf16, fp16):
                theirs = deepspeed_keeps(model, setting, low)
                assert ours(plan, setting, low) == theirs, (type(model), setting, low)
                assert ours(loaded, setting, low) == theirs, (type(model), setting, low)
    listed = Listed()
    assert deepspeed_keeps(listed, "auto", bf16) == {"bias_a", "bias_b", "inner.1.table"}
    assert deepspeed_keeps(listed, "auto", fp16) == {"bias_a", "bias_b", "inner.1.table",
                                                     "inner.1.scale"}
    assert deepspeed_keeps(deepseek_v3(), "auto", bf16) == {
        "model.layers.1.mlp.gate.e_score_correction_bias"}


def test_a_plan_file_of_a_class_that_cannot_be_imported_keeps_its_fp32_lists() -> None:
    """A plan saves the Hugging Face lists it saw, so a plan read from JSON whose model class
    was defined in a script (no import path) says what "auto" keeps as the model does."""
    from precision_annot import PrecisionPlan
    from precision_annot.adapters.deepspeed import buffers

    class Local(Listed):  # defined here: `resolve` records it, nothing can import it again
        _keep_in_fp32_modules_strict: ClassVar[list[str]] = ["bias_b"]

    model = Local()
    loaded = PrecisionPlan.from_json(resolve(model, default="bf16-true").to_json())
    assert loaded.module("") is None
    for low in (bf16, fp16):
        assert buffers.kept_by(loaded, "auto", low) == deepspeed_keeps(model, "auto", low)
    assert buffers.kept_by(loaded, "auto", bf16) == {"bias_b", "inner.1.table"}  # not bias_a


def test_to_config_keeps_the_buffers_the_plan_keeps_in_fp32() -> None:
    from tests.workers.deepspeed import deepseek_v3

    rotary = ["^model\\.rotary_emb\\.inv_freq$", "^model\\.rotary_emb\\.original_inv_freq$"]
    plan = resolve(deepseek_v3(), default="bf16-true")
    config, caught = export(plan)
    assert config["bf16"] == {"enabled": True} and not caught
    # "auto" would keep the router's bias (planned bf16) in fp32; the plan keeps the rotary
    # tables (built in fp32, not in the state dict) in fp32
    assert config["data_types"] == {"keep_in_fp32_modules": rotary}
    for given in ("auto", None):
        data = {"keep_in_fp32_modules": given} if given else {}
        config, _ = export(plan, {**BASE, "data_types": {**data, "grad_accum_dtype": "fp32"}})
        assert config["data_types"] == {"keep_in_fp32_modules": rotary, "grad_accum_dtype": "fp32"}
    config, _ = export(plan, {**BASE, "data_types": {"buffer_dtype": "bf16"}})
    assert config["data_types"] == {"buffer_dtype": "bf16", "keep_in_fp32_modules": rotary}
    # a value of the base's own that holds every buffer as planned is kept
    for same in (["inv_freq"], [], ["rotary_emb"]):
        config, _ = export(plan, {**BASE, "data_types": {"keep_in_fp32_modules": same}})
        assert config["data_types"] == {"keep_in_fp32_modules": same}
    with pytest.raises(ValueError, match=r"contradicts the plan at data_types.keep_in_fp32_modules:"
                                         r" the base has \['e_score_correction_bias'\]"):
        dsa.to_config(plan, {**BASE, "data_types": {
            "keep_in_fp32_modules": ["e_score_correction_bias"]}})
    with pytest.raises(ValueError, match=r"contradicts the plan at data_types.keep_in_fp32_modules"
                                         r".*'model.rotary_emb.inv_freq' in fp32"):
        dsa.to_config(plan, {**BASE, "data_types": {"buffer_dtype": "bf16",
                                                    "keep_in_fp32_modules": []}})
    with pytest.raises(ValueError, match=r"contradicts the plan at data_types.buffer_dtype: the "
                                         r"base has 'fp32'.*gate.e_score_correction_bias' in bf16"):
        dsa.to_config(plan, {**BASE, "data_types": {"buffer_dtype": "fp32"}})
    with pytest.raises(ValueError, match=r"DeepSpeed refuses data_types.keep_in_fp32_modules=None"):
        dsa.to_config(plan, {**BASE, "data_types": {"keep_in_fp32_modules": None}})
    with pytest.raises(Exception, match="must be \"auto\" or a list"):  # as DeepSpeed says it
        DeepSpeedConfig({**BASE, "data_types": {"keep_in_fp32_modules": None}})
    # nothing to say: no buffer, or "auto" keeps what the plan keeps, or no bf16/fp16 section
    assert "data_types" not in export(resolve(nn.Linear(4, 4), default="bf16"))[0]
    only = nn.Sequential(nn.Linear(4, 4), Scaled())  # "auto" keeps its fp32 table: as planned
    assert "data_types" not in export(resolve(only, default="bf16-true"))[0]
    kept = nn.Sequential(nn.Linear(4, 4), precision(storage=fp32)(Scaled()))
    config, _ = export(resolve(kept, default="bf16-true"))
    assert config["data_types"] == {"keep_in_fp32_modules": ["^1\\.scale$", "^1\\.table$"]}
    mixed = resolve(nn.Sequential(nn.Linear(4, 4), Scaled()), default="bf16-mixed")
    assert "data_types" not in export(mixed)[0]


def test_keep_in_fp32_modules_is_left_alone_for_a_deepspeed_that_does_not_read_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Read since DeepSpeed 0.19.8: for an older release the key is neither written nor
    checked. Patched: only the version the adapter reads."""
    from precision_annot.adapters.deepspeed import export as ds_export
    from tests.workers.deepspeed import deepseek_v3

    plan = resolve(deepseek_v3(), default="bf16-true")
    hand = {**BASE, "bf16": {"enabled": True}}
    assert [f.code for f in check(plan, "deepspeed", hand)].count("deepspeed-buffers") == 1
    monkeypatch.setattr(ds_export, "deepspeed_version", lambda: "0.19.7")
    assert not ds_export.reads_keep_in_fp32()
    assert "data_types" not in dsa.to_config(plan, BASE)
    assert "deepspeed-buffers" not in [f.code for f in check(plan, "deepspeed", hand)]
    monkeypatch.setattr(ds_export, "deepspeed_version", lambda: "0.19.8")
    assert "data_types" in dsa.to_config(plan, BASE)
    monkeypatch.setattr(ds_export, "deepspeed_version", lambda: "unknown")  # not installed here
    assert "data_types" in dsa.to_config(plan, BASE)


#: the buffers of tests/workers/deepspeed.py's DeepSeek-V3
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"
TABLES = {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}


@pytest.mark.slow  # over make test's budget: run by make test-all
def test_check_says_what_deepspeed_does_to_buffers_as_two_ranks_measure(tmp_path: Path) -> None:
    """A "bf16-true" DeepSeek-V3 (router bias planned bf16, rotary tables fp32) under
    DeepSpeed's bf16 section on 2 ranks, ZeRO 0-3, with each config of `BUFFER_CASES`: the
    dtypes its buffers have after initialize and after two steps are what `check` says, narrowed
    (an error) and widened (a warning) alike, with the model and with its plan file alone."""
    from precision_annot import PrecisionPlan
    from precision_annot._src.dtypes import dtype_from_name
    from precision_annot.adapters.deepspeed.export import buffer_dtypes
    from tests.workers.deepspeed import BUFFER_CASES, deepseek_v3

    deepspeed_op_built()
    stages = [0, 1, 2, 3]
    launch("tests.workers.deepspeed", "buffers", ",".join(map(str, stages)), str(tmp_path),
           ranks=2, timeout=540)
    expected = {"hand-auto": ({BIAS}, set()), "hand-buffer-dtype": (set(), TABLES),
                "hand-auto-buffer-dtype": ({BIAS}, TABLES),
                "exported": (set(), set()), "exported-buffer-dtype": (set(), set())}
    live = resolve(deepseek_v3(), default="bf16-true")
    for case in BUFFER_CASES:
        for stage in stages:
            for rank in (0, 1):
                r = json.loads((tmp_path / f"buffers-{case}-stage{stage}-rank{rank}.json")
                               .read_text())
                planned, seen = r["prepared"], r["initialized"]
                assert r["stepped"] == seen and len(seen) == 3
                widened = {n for n in seen if planned[n] == "bf16" and seen[n] == "fp32"}
                narrowed = {n for n in seen if planned[n] == "fp32" and seen[n] == "bf16"}
                assert (widened, narrowed) == expected[case], (case, stage, seen)
                assert set(r["rounded"]) == narrowed  # widening is exact, narrowing rounds
                assert r["drift_warned"] == bool(widened or narrowed)
                assert all(math.isfinite(x) for x in r["losses"])
                for plan in (PrecisionPlan.from_json(r["plan"]), live):
                    said = buffer_dtypes(plan, r["config"])
                    assert {n: dtype_from_name(d) for n, d in seen.items()} == said
                    found = {f.severity: f for f in check(plan, "deepspeed", r["config"])
                             if f.code == "deepspeed-buffers"}
                    assert set(found) == {s for s, names in (("warning", widened),
                                                             ("error", narrowed)) if names}
                    if narrowed:
                        assert found["error"].modules == ("model.rotary_emb",)
                        assert "planned fp32, bf16 instead" in found["error"].message
                    if widened:
                        assert found["warning"].modules == ("model.layers.1.mlp.gate",)
                        assert "planned bf16, fp32 instead" in found["warning"].message
                        assert '"auto" (DeepSpeed\'s default)' in found["warning"].message


def test_check_reads_a_hugging_face_auto_bf16_section_as_to_config_does() -> None:
    """A Hugging Face style config, `"bf16": {"enabled": "auto"}` (the Trainer fills it; the
    docs say to_config fills it from the plan, and to_config reads it as true): check says
    nothing of the buffers DeepSpeed will hold other than planned, where with `true` it gives
    the warning (the router bias kept fp32 by "auto") and, with buffer_dtype bf16, the error
    (the fp32 rotary tables narrowed to bf16)."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    from precision_annot.adapters import deepspeed as dsa
    from tests.workers.deepspeed import deepseek_v3

    plan = resolve(deepseek_v3(), default="bf16-true")
    base = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    assert dsa.to_config(plan, {"bf16": {"enabled": "auto"}})["bf16"] == {"enabled": True}
    for extra in ({}, {"data_types": {"buffer_dtype": "bf16"}}):
        def said(enabled: Any, extra: dict[str, Any] = extra) -> list[str]:
            config = {**base, "bf16": {"enabled": enabled}, **extra}
            return sorted(f.severity for f in check(plan, "deepspeed", config)
                          if f.code == "deepspeed-buffers")
        assert said(True) in (["warning"], ["error", "warning"])
        assert said("auto") == said(True), (extra, said("auto"), said(True))


