"""fp8 plans on real backends (FSDP2, DDP, FSDP1, DeepSpeed, Accelerate, Lightning), the
Hugging Face fp8 rules on real model classes, the Megatron/TE settings, and `check`'s fp8
findings, each judged against a run."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import precision_annot as pa
from precision_annot.adapters import fp8
from tests.helpers import ROOT, deepspeed_op_built, launch

torchao = pytest.importorskip("torchao")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402


def _ranks(mode: str, tmp_path: Path, ranks: int = 2) -> list[dict[str, Any]]:
    launch("tests.workers.fp8", mode, str(tmp_path), ranks=ranks, timeout=400)
    return [json.loads((tmp_path / f"{mode}-rank{r}.json").read_text()) for r in range(ranks)]


# -- FSDP2, DDP, DeepSpeed on gloo ranks ------------------------------------------------------

@pytest.mark.slow  # over make test's budget: run by make test-all
def test_fsdp2_all_gathers_fp8_weights_and_trains_like_one_process(tmp_path: Path) -> None:
    ranks = _ranks("fsdp2", tmp_path)
    for r in ranks:
        assert r["types"]["up"] == "FSDPFloat8Linear" and r["types"]["head"] == "FSDPLinear"
        assert set(r["storage"].values()) == {"fp32"}  # master weights stay fp32
        # a unit of an fp8 weight and a bf16 bias is gathered as bytes: 1 byte per weight
        # element (fp8) + 2 per bias element; the head and the norm in bf16
        gathers = {(d, n) for op, d, n in r["calls"] if op.startswith("all_gather")}
        assert gathers == {("uint8", 32 * 64 + 64 * 2), ("uint8", 64 * 64 + 64 * 2),
                           ("bf16", 64 * 16 + 16), ("bf16", 64 * 2)}, gathers
        # gradients of the fp8 layers (and the norm) reduced in their storage dtype, fp32;
        # the head in its comm, bf16
        assert r["reduces"] == ["bf16", "fp32"]
        assert r["losses"][-1] < r["losses"][0]
        assert r["worst"] < 1e-3, r["worst"]  # the same as one process on both ranks' data


@pytest.mark.slow  # 7 s, 2 ranks: make test keeps FSDP2 and DeepSpeed with fp8
def test_ddp_reduces_fp8_comm_layers_in_their_own_dtype_as_check_warns(tmp_path: Path) -> None:
    ranks = _ranks("ddp", tmp_path)
    for r in ranks:
        assert r["types"]["up"] == "Float8Linear"
        # no fp8 on the wire: up, norm and down (6,400 parameters) in fp32, the head in bf16
        assert {tuple(w) for w in r["wire"]} == {("allreduce", "fp32", 6400),
                                                 ("allreduce", "bf16", 1040)}
        assert "fp8-comm" in r["findings"]
        assert r["losses"][-1] < r["losses"][0]


@pytest.mark.slow  # over make test's budget: run by make test-all
def test_deepspeed_trains_fp8_gemms_and_check_refuses_fp8_comm(tmp_path: Path) -> None:
    deepspeed_op_built()
    (r,) = _ranks("deepspeed", tmp_path, ranks=1)
    assert r["fp8_comm_error"] is not None and "Couldn't swap" in r["fp8_comm_error"]
    assert ("error", "fp8-comm-refused") in [tuple(f) for f in r["fp8_comm_findings"]]
    for stage in ("stage2", "stage3"):
        run = r[stage]
        assert run["types"]["up"] == "Float8Linear"
        assert run["fp8_gemms"] == {"up": {"forward": 1, "backward": 2},
                                    "down": {"forward": 1, "backward": 2}, "head": {}}
        assert not [d for d in run["divergences"] if ": gemm " in d]
        assert "fp8-comm-refused" not in run["findings"]
        assert run["losses"][-1] < run["losses"][0]


@pytest.mark.slow  # 6.5 s: make test keeps FSDP2 and DeepSpeed with fp8
def test_fsdp1_runs_fp8_gemms_with_fp8_comm_on_one_rank() -> None:
    code = """
import os, torch, torch.nn as nn, torch.distributed as dist
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
dist.init_process_group("gloo")
import precision_annot as pa
from precision_annot.adapters import fsdp
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
m = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 16))
pa.annotate(m, {nn.Linear: "compute=fp8,comm=fp8"})
plan = pa.resolve(m, "bf16-mixed")
pa.apply(m, plan)
w = FSDP(m, auto_wrap_policy=fsdp.wrap_policy(plan), mixed_precision=fsdp.mixed_precision(plan),
         use_orig_params=True, device_id=torch.device("cpu"))
with pa.audit(w) as r:
    w(torch.randn(8, 32)).float().sum().backward()
print({n: dict(r[n].fp8_gemms) for n in ("0", "2")}, [f.code for f in pa.check(plan, "fsdp1")])
dist.destroy_process_group()
"""
    from tests.helpers import _environment, free_port

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env=_environment(str(free_port())), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert ("{'0': {'forward': 1, 'backward': 2}, '2': {'forward': 1, 'backward': 2}}"
            in out.stdout)
    assert "'fp8-comm'" in out.stdout


# -- Accelerate and Lightning -----------------------------------------------------------------

class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.mid = nn.Linear(64, 64)
        self.head = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.up(x).relu()).relu())


@pytest.fixture
def accelerator_state() -> Any:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # a Trainer in another test file leaves its state
    yield accelerate
    AcceleratorState._reset_state(True)


def test_accelerate_converts_exactly_the_planned_layers(accelerator_state: Any) -> None:
    torch.manual_seed(0)
    model = Small()
    pa.annotate(model, {nn.Linear: "compute=fp8-rowwise", "head": "compute=bf16"})
    kwargs = fp8.ao_recipe_kwargs(model)
    plan = pa.resolve(model)  # torchao's new modules do not carry the annotations: resolve first
    assert kwargs.config.cast_config_input.scaling_granularity.value == "axiswise"
    accelerator = accelerator_state.Accelerator(mixed_precision="fp8", cpu=True,
                                                kwargs_handlers=[kwargs])
    prepared = accelerator.prepare(model)
    inner = accelerator.unwrap_model(prepared)
    # Accelerate's own default would skip the first and last Linear: up would stay high
    assert [type(inner.up), type(inner.mid), type(inner.head)] == [Float8Linear, Float8Linear,
                                                                   nn.Linear]
    with pa.audit(inner, plan) as report:
        inner(torch.randn(8, 32)).sum().backward()
    assert not [d for d in report.divergences if d.field == "gemm"]


def test_accelerate_keeps_an_fp32_island_only_with_the_plan_applied(
        accelerator_state: Any) -> None:
    """docs/fp8.md's 0.3 recipe (annotate, then Accelerate) ran an fp32 LayerNorm island's
    native_layer_norm on bf16 inputs under Accelerate's autocast, silently. Unapplied, the
    recipe is refused with the fix; applied first, the same run audits clean."""
    def build() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 64),
                              nn.Linear(64, 16))
        pa.annotate(model, {nn.Linear: "compute=fp8", "1": "fp32", "3": "compute=fp32"})
        return model

    with pytest.raises(ValueError, match=r"computes '1' and '3' in another dtype than "
                                         r"Accelerate's bf16 autocast.*precision_annot\.apply"):
        fp8.ao_recipe_kwargs(build())
    # check says the refusal before launch (0.4 said only info fp8-small-gemm), for the plan and
    # for the model, and only when Accelerate converts the fp8 layers
    plan = pa.resolve(build(), default="bf16-mixed")
    with pytest.raises(ValueError, match="computes '1' and '3'"):
        fp8.ao_recipe_kwargs(plan)
    for given in (plan, build()):
        errors = [f for f in pa.check(given, "ddp", {"fp8": "accelerate"})
                  if f.severity == "error"]
        assert [(f.code, f.modules) for f in errors] == [("fp8-accelerate-refused", ("1", "3"))]
        assert "pa.apply" not in errors[0].fix and "precision_annot.apply(" in errors[0].fix
    assert not [f for f in pa.check(plan, "ddp") if f.severity == "error"]  # apply converts
    model = pa.apply(build(), default="bf16-mixed")
    assert not [f for f in pa.check(model, "ddp", {"fp8": "accelerate"}) if f.severity == "error"]
    accelerator = accelerator_state.Accelerator(mixed_precision="fp8", cpu=True,
                                                kwargs_handlers=[fp8.ao_recipe_kwargs(model)])
    prepared = accelerator.prepare(model)
    with pa.audit(prepared) as report:
        prepared(torch.randn(16, 32)).float().sum().backward()
    assert report.divergences == []
    assert set(report["1"].forward_ops) == {torch.float32}  # native_layer_norm in fp32
    assert report["0"].fp8_gemms["forward"] == 1


def test_accelerate_leaves_a_model_apply_converted_alone(accelerator_state: Any) -> None:
    model = Small()
    pa.annotate(model, {nn.Linear: "compute=fp8", "head": "compute=fp32"})
    pa.apply(model)
    up = model.up
    accelerator = accelerator_state.Accelerator(mixed_precision="fp8", cpu=True,
                                                kwargs_handlers=[fp8.ao_recipe_kwargs(model)])
    inner = accelerator.unwrap_model(accelerator.prepare(model))
    assert inner.up is up and type(inner.head) is nn.Linear  # not converted twice


def test_one_config_backends_refuse_a_plan_of_two_recipes() -> None:
    model = Small()
    pa.annotate(model, {nn.Linear: "compute=fp8", "mid": "compute=fp8-rowwise"})
    with pytest.raises(ValueError, match=r"one fp8 config.*compute=fp8, compute=fp8-rowwise"):
        fp8.float8_config(model)
    with pytest.raises(ValueError, match="runs no GEMM in fp8"):
        fp8.float8_config(Small())


def test_lightning_plugin_converts_what_configure_model_annotates() -> None:
    L = pytest.importorskip("lightning")
    from precision_annot.adapters.lightning import AnnotatedPrecision

    class Module(L.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.losses: list[float] = []

        def configure_model(self) -> None:
            self.net = Small()
            pa.annotate(self.net, {nn.Linear: "compute=fp8", "head": "bf16"})

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x).float(), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :16] * 0.5),
                                       batch_size=16)
    module = Module()
    L.Trainer(max_steps=16, plugins=[AnnotatedPrecision(default="bf16-mixed")],
              accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
              enable_model_summary=False, enable_checkpointing=False).fit(module, data)
    assert isinstance(module.net.up, Float8Linear) and type(module.net.head) is nn.Linear
    first, last = sum(module.losses[:4]), sum(module.losses[-4:])  # an epoch each
    assert last < first * 0.9, module.losses
    with pa.audit(module) as report:
        module.net(x[:16]).float().sum().backward()
    assert report["net.up"].fp8_gemms["forward"] == 1 and not report["net.head"].fp8_gemms
    assert not [d for d in report.divergences if d.field == "gemm"]


# -- Hugging Face ------------------------------------------------------------------------------

def _hf(kind: str) -> nn.Module:
    tf = pytest.importorskip("transformers")
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2)
    extra: dict[str, dict[str, Any]] = {
        "Llama": {},
        "Mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
        # 32 experts: as wide as k_proj and v_proj (2 heads of 16), which are not routers
        "Qwen2Moe": dict(num_experts=32, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=64),
        "DeepseekV3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32,
                           qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_group=1,
                           topk_group=1, num_key_value_heads=4),
    }
    config = getattr(tf, f"{kind}Config")(**{**base, **extra[kind]})
    torch.manual_seed(0)
    model: nn.Module = getattr(tf, f"{kind}ForCausalLM")(config)
    return model


@pytest.mark.parametrize("kind", ["Llama", "Mixtral", "Qwen2Moe", "DeepseekV3"])
def test_fp8_rules_keep_what_deepseek_v3_keeps_and_train(kind: str) -> None:
    from precision_annot.adapters import transformers as hf

    model = _hf(kind)
    if kind in ("Mixtral", "Qwen2Moe", "DeepseekV3"):  # experts fused in 3-D weights
        with pytest.warns(UserWarning, match="grouped GEMMs are not nn.Linear"):
            rules = hf.fp8_rules(model)
    else:
        rules = hf.fp8_rules(model)
    pa.annotate(model, rules)
    plan = pa.resolve(model, default="bf16-mixed")
    fp8_layers = {n for n, e in plan.items() if e.policy.gemm}
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    head = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
    # the routers, as the installed transformers declares them (whatever their class: in 5.24
    # Mixtral's and Qwen2-MoE's hold their own weight), and Qwen2-MoE's shared-expert gate
    recorded = type(model.model)._can_record_outputs.get("router_logits")  # type: ignore[union-attr]
    router_class = getattr(recorded, "target_class", recorded)
    routers = {n for n, m in model.named_modules()
               if (router_class is not None and isinstance(m, router_class))
               or n.endswith(".shared_expert_gate")}
    if kind != "Llama":
        assert routers and set(hf.router_names(model)) == routers
        assert all(plan[n].policy.compute == pa.fp32 and not plan[n].policy.gemm for n in routers)
    assert head not in fp8_layers and not routers & fp8_layers
    assert not {n for n, m in model.named_modules()
                if isinstance(m, (nn.Embedding,)) or "Norm" in type(m).__name__} & fp8_layers
    assert fp8_layers == linears - {head} - routers  # every other Linear: fp8, k_proj included
    pa.apply(model)
    ids = torch.randint(0, 128, (2, 16))
    with pa.audit(model) as report:
        out = model(ids, labels=ids)
        out.loss.backward()
    assert torch.isfinite(out.loss)
    assert not [d for d in report.divergences if d.field == "gemm"], report.divergences
    assert all(report[n].fp8_gemms["forward"] for n in fp8_layers if report[n].calls)
    assert not report[head].fp8_gemms
    for name in routers:  # the router's logits ran in fp32 (0.3: bf16, its class missed)
        assert set(report[name].forward_ops) == {pa.fp32}, (name, report[name].forward_ops)


def test_megatron_and_te_settings_from_a_plan() -> None:
    model = _hf("Llama")
    from precision_annot.adapters import transformers as hf

    pa.annotate(model, hf.fp8_rules(model, recipe="fp8"))
    pa.annotate(model, {"model.layers.0.*": "compute=bf16", "model.layers.2.*": "compute=bf16"})
    megatron = fp8.megatron_args(model)
    assert megatron.exact, megatron
    assert megatron.settings == {"fp8": "e4m3", "fp8_recipe": "tensorwise",
                                 "first_last_layers_bf16": True,
                                 "num_layers_at_start_in_bf16": 1,
                                 "num_layers_at_end_in_bf16": 1}
    te = fp8.te_settings(model)
    assert te.settings["fp8_recipe"] == "Float8CurrentScaling()"
    assert te.settings["fp8_autocast_disabled"] == ["model.layers.0", "model.layers.2",
                                                     "lm_head"]
    pa.annotate(model, {"model.layers.1.self_attn.*": "compute=bf16"})
    partial = fp8.megatron_args(model)
    assert not partial.exact and "converts whole layers" in str(partial)


# -- check's fp8 findings, against what runs ---------------------------------------------------

def test_small_gemm_thresholds_are_torchaos_own() -> None:
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    from precision_annot._src.float8 import Gemm
    from precision_annot._src.float8_checks import too_small

    sizes = [16, 512, 1024, 1040, 2048, 2064, 4096, 4112, 8192]
    for recipe, name in (("fp8", "tensorwise"), ("fp8-rowwise", "rowwise")):
        keep = _auto_filter_for_recipe(name, filter_fqns=[])
        for n in sizes:
            for k in sizes:
                layer = nn.Linear(k, n, device="meta")
                assert too_small(Gemm(recipe), n, k) == (not keep(layer, "x")), (recipe, n, k)


def test_fp8_dims_finding_cuda_only_kernels_refuse_odd_shapes() -> None:
    # CUDA-only: torch._scaled_mm on a GPU refuses dimensions not divisible by 16, and a CPU
    # emulates fp8 and runs them (shown here), so the finding cannot be checked by a run here
    model = nn.Sequential(nn.Linear(32, 40), nn.Linear(40, 64))
    pa.annotate(model, {nn.Linear: "compute=fp8"})
    found = {f.code: f for f in pa.check(model)}
    assert found["fp8-dims"].modules == ("0", "1") and found["fp8-dims"].severity == "error"
    pa.apply(model)
    assert model(torch.randn(16, 32)).shape == (16, 64)  # runs here


def test_fp8_not_converted_names_what_audit_sees_running_high() -> None:
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128,
                                            n_positions=32))
    with pytest.raises(ValueError, match="no nn.Linear under them.*'transformer.h'"):
        pa.resolve(pa.annotate(gpt2, {"transformer.h": "compute=fp8"}))  # GPT-2: Conv1D only
    gpt2 = tf.GPT2LMHeadModel(gpt2.config)
    pa.annotate(gpt2, {"": "compute=fp8"})  # its lm_head is a Linear, its blocks are not
    found = {f.code: f for f in pa.check(gpt2)}
    claimed = set(found["fp8-not-converted"].modules)
    pa.apply(gpt2)
    with pa.audit(gpt2) as report:
        gpt2(torch.randint(0, 128, (2, 16))).logits.float().sum().backward()
    ran_high = {d.module for d in report.divergences if d.field == "gemm"}
    assert claimed == ran_high and claimed  # GPT-2's Conv1D layers: fp8 planned, ran high
    assert found["fp8-not-converted"].severity == "warning"


class SharedWeight(nn.Module):
    """A parent that multiplies by its child's weight itself, and a MultiheadAttention, which
    calls its out_proj's weight without calling out_proj."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.out = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.linear(x, self.fc.weight) + self.fc(x)
        return self.out(self.attn(h, h, h)[0])


def test_audit_reports_an_fp8_weight_whose_gemm_ran_high_outside_its_layer() -> None:
    """0.3's audit counted GEMMs per running module only: `F.linear(x, fc.weight)` in a parent
    ran in bf16 with 0 GEMMs charged to `fc`, and MultiheadAttention's out_proj, which check
    flags, left audit clean."""
    torch.manual_seed(0)
    model = SharedWeight()
    pa.annotate(model, {nn.Linear: "compute=fp8"})
    claimed = {m for f in pa.check(model) if f.code == "fp8-not-converted" for m in f.modules}
    pa.apply(model, default="bf16-mixed")
    with pa.audit(model) as report:
        model(torch.randn(2, 16, 32, requires_grad=True)).float().sum().backward()
    high = {(d.module, d.phase) for d in report.divergences if d.field == "gemm"}
    assert high == {("fc", "forward"), ("fc", "backward"), ("attn.out_proj", "forward"),
                    ("attn.out_proj", "backward")}
    assert report["fc"].fp8_gemms["forward"] == 1  # its own call still ran in fp8
    assert claimed == {"attn.out_proj"}  # check sees the MHA case before launch
    fine = SharedWeight()
    pa.annotate(fine, {"out": "compute=fp8"})
    pa.apply(fine, default="bf16-mixed")
    with pa.audit(fine) as clean:
        fine(torch.randn(2, 16, 32)).float().sum().backward()
    assert [d for d in clean.divergences if d.field == "gemm"] == []


def test_refusals_check_names_are_the_refusals_apply_makes() -> None:
    """Each of float8.REFUSALS, made real: apply raises its text and check reports its code
    with the same text, for every rule in the table."""
    from precision_annot._src.float8 import REFUSALS, Gemm

    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    subclass = nn.Sequential(Scaled(16, 16), nn.Linear(16, 16))
    pa.annotate(subclass, {nn.Linear: "compute=fp8"})
    rowwise = nn.Sequential(nn.Linear(16, 16))
    pa.annotate(rowwise, {nn.Linear: "compute=fp8-rowwise,comm=fp8"})
    mx = nn.Sequential(nn.Linear(32, 32))  # mxfp8 over fp16: resolve refuses it, a file does not
    data = json.loads(pa.resolve(mx, default="bf16").to_json())
    data["modules"][1]["policy"] = "compute=mxfp8/fp16,storage=bf16,comm=bf16"
    mx_plan = pa.PrecisionPlan.from_json(json.dumps(data))
    cases = {"fp8-linear-subclass": (subclass, subclass, Gemm("fp8")),
             "fp8-comm-recipe": (rowwise, rowwise, Gemm("fp8-rowwise", True)),
             "fp8-mx-compute": (mx_plan, mx, Gemm("mxfp8", compute=torch.float16))}
    assert set(cases) == {r.code for r in REFUSALS}
    for refusal in REFUSALS:
        subject, model, gemm = cases[refusal.code]
        why = refusal.why(gemm)
        found = [f for f in pa.check(subject) if f.code == refusal.code]
        assert [f.severity for f in found] == ["error"], refusal.code
        assert why in found[0].message and found[0].fix == refusal.fix(found[0].module, gemm)
        with pytest.raises(ValueError) as raised:
            pa.apply(model, mx_plan) if refusal.code == "fp8-mx-compute" else pa.apply(model)
        assert why in str(raised.value), refusal.code
        assert all(type(m) in (nn.Sequential, nn.Linear, Scaled) for m in model.modules())


@pytest.mark.slow  # over make test's budget (a process without torchao): run by make test-all;
# tests/test_float8.py's import without torchao stays in make test
def test_fp8_unavailable_is_the_error_apply_raises_without_torchao() -> None:
    code = (
        "import sys; sys.modules['torchao'] = None\n"
        "import torch, precision_annot as pa\n"
        "m = torch.nn.Sequential(torch.nn.Linear(16, 16))\n"
        "pa.annotate(m, {torch.nn.Linear: 'compute=fp8'})\n"
        "print([(f.severity, f.code) for f in pa.check(m)])\n"
        "try:\n"
        "    pa.apply(m)\n"
        "except ImportError:\n"
        "    print('refused')\n"
    )
    with warnings.catch_warnings():
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             cwd=ROOT, check=True).stdout
    assert "('error', 'fp8-unavailable')" in out and "refused" in out
