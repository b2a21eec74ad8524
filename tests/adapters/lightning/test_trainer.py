"""The Trainer plugin, `AnnotatedPrecision`, on CPU for real: one device, then 2 processes
under DDPStrategy, ModelParallelStrategy (FSDP2) and DeepSpeedStrategy."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from precision_annot import bf16, fp16, fp32, resolve

L = pytest.importorskip("lightning")
from precision_annot.adapters.lightning import AnnotatedPrecision  # noqa: E402
from tests.adapters.lightning.models import QUIET, Net, data, seen  # noqa: E402
from tests.helpers import deepspeed_op_built, launch  # noqa: E402


@pytest.mark.parametrize(("default", "low"), [("bf16-mixed", bf16), ("16-true", fp16)])
def test_trainer_fits_with_an_fp32_island(default: str, low: torch.dtype) -> None:
    torch.manual_seed(0)
    model = Net()
    plugin = AnnotatedPrecision(default=default)
    L.Trainer(max_steps=12, plugins=[plugin], enable_checkpointing=False, **QUIET).fit(model,
                                                                                        data())
    # batches are cast before they are moved (Lightning issue 17727); integers untouched
    assert model.batch_dtypes[0] == (low, low, torch.int64)
    assert seen(model) == {"fc1": low, "norm": fp32, "fc2": low}
    storage = fp32 if default.endswith("mixed") else low
    assert model.fc1.weight.dtype == storage and model.norm.weight.dtype == fp32
    assert model.losses[-1] < model.losses[0] * 0.7, model.losses
    assert plugin.precision == default
    assert (plugin.scaler is not None) == (low == fp16)


def test_fp16_unscales_before_clipping_and_skips_a_non_finite_step() -> None:
    torch.manual_seed(0)
    model = Net(inf_at=3)
    plugin = AnnotatedPrecision(default="16-mixed")
    L.Trainer(max_steps=8, plugins=[plugin], gradient_clip_val=1.0, enable_checkpointing=False,
              **QUIET).fit(model, data())
    assert plugin.scaler is not None
    # unscaled before the clipping hook: gradient norms are O(1), not O(2**16)
    finite = [g for g in model.grad_norms if math.isfinite(g)]
    assert finite and max(finite) < 100, model.grad_norms
    # the non-finite step changed nothing, and the scale was lowered
    before, after = model.snapshots[3], model.snapshots[4]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(model.snapshots[4], model.snapshots[5],
                                                      strict=True))
    assert plugin.scaler.get_scale() < 2.0**16


def test_scaler_state_is_saved_and_restored(tmp_path: Path) -> None:
    torch.manual_seed(0)
    plugin = AnnotatedPrecision(default="16-mixed")
    trainer = L.Trainer(max_steps=4, plugins=[plugin], default_root_dir=tmp_path, **QUIET)
    trainer.fit(Net(inf_at=1), data())
    assert plugin.scaler is not None
    saved_scale = plugin.scaler.get_scale()
    assert saved_scale < 2.0**16  # lowered by the overflow
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    state = torch.load(ckpt, weights_only=False)
    assert state["AnnotatedPrecision"]["scale"] == saved_scale

    resumed = AnnotatedPrecision(default="16-mixed")
    seen: list[float] = []

    class Probe(L.Callback):  # type: ignore[misc]
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            assert resumed.scaler is not None
            seen.append(resumed.scaler.get_scale())

    L.Trainer(max_steps=6, plugins=[resumed], callbacks=[Probe()], default_root_dir=tmp_path,
              **QUIET).fit(Net(), data(), ckpt_path=ckpt)
    assert seen == [saved_scale]


@pytest.mark.slow  # 4 Trainer runs
def test_resume_keeps_the_plan_and_names_what_a_bf16_checkpoint_lost(tmp_path: Path) -> None:
    """Lightning's restore (`fit(ckpt_path=...)`): the weights are loaded before the plugin
    applies the plan, then each tensor is in its planned dtype. A checkpoint of the plan's own
    run resumes exactly and says nothing; one written by Lightning's own "bf16-true" (the fp32
    island saved in bf16) resumes as planned and names the island's tensors (0.4: silent)."""
    def fit(module: Net, ckpt: Path | None, **kwargs: Any) -> dict[str, Any]:
        at_start: dict[str, Any] = {}

        class Probe(L.Callback):  # type: ignore[misc]
            def on_train_start(self, trainer: Any, pl_module: Any) -> None:
                at_start.update({k: v.detach().clone() for k, v in
                                 pl_module.state_dict().items()})

        trainer = L.Trainer(max_steps=2 if ckpt is None else 3, callbacks=[Probe()],
                            default_root_dir=tmp_path, **kwargs, **QUIET)
        trainer.fit(module, data(), ckpt_path=ckpt)
        if ckpt is None:
            trainer.save_checkpoint(tmp_path / "run.ckpt")
        return at_start

    torch.manual_seed(0)
    fit(Net(), None, precision="bf16-true")  # Lightning's own: every tensor bf16
    lightnings = torch.load(tmp_path / "run.ckpt", weights_only=False)["state_dict"]
    assert {v.dtype for v in lightnings.values()} == {bf16}
    with pytest.warns(UserWarning, match=r"Lightning's checkpoint restore: the checkpoint holds "
                                         r"2 tensor\(s\) narrower.*'norm.weight', 'norm.bias'"):
        start = fit(Net(), tmp_path / "run.ckpt",
                    plugins=[AnnotatedPrecision(default="bf16-true")])
    assert {k: v.dtype for k, v in start.items()} == {
        "fc1.weight": bf16, "fc1.bias": bf16, "norm.weight": fp32, "norm.bias": fp32,
        "fc2.weight": bf16, "fc2.bias": bf16}
    assert all(torch.equal(start[k], v.to(start[k].dtype)) for k, v in lightnings.items())

    torch.manual_seed(0)
    fit(Net(), None, plugins=[AnnotatedPrecision(default="bf16-true")])  # the plan's own run
    own = torch.load(tmp_path / "run.ckpt", weights_only=False)["state_dict"]
    assert own["norm.weight"].dtype == fp32
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", module="lightning")
        start = fit(Net(), tmp_path / "run.ckpt",
                    plugins=[AnnotatedPrecision(default="bf16-true")])
    assert all(torch.equal(start[k], v) and start[k].dtype == v.dtype for k, v in own.items())


def test_trainer_precision_and_plugin_together_raise() -> None:
    with pytest.raises(ValueError, match="precision"):
        L.Trainer(precision="bf16-mixed", plugins=[AnnotatedPrecision()], **QUIET)


def test_plugin_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError, match="plan must be a PrecisionPlan"):
        AnnotatedPrecision(plan="bf16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="default is only used"):
        AnnotatedPrecision(plan=resolve(nn.Linear(2, 2)), default="bf16")
    with pytest.raises(ValueError, match="'fp9'"):
        AnnotatedPrecision(default="fp9")


def test_explicit_plan_is_used() -> None:
    torch.manual_seed(0)
    model = Net()
    plan = resolve(model, default="bf16-mixed")
    plugin = AnnotatedPrecision(plan)
    L.Trainer(max_steps=2, plugins=[plugin], enable_checkpointing=False, **QUIET).fit(model,
                                                                                       data())
    assert plugin.plan is plan and seen(model)["norm"] == fp32


# --- 2 processes ------------------------------------------------------------------------------

def run(strategy: str, tmp_path: Path) -> list[dict[str, Any]]:
    """Lightning's launcher starts the second process itself."""
    if strategy == "deepspeed":
        deepspeed_op_built()
    launch("tests.workers.lightning", strategy, str(tmp_path), ranks=1, timeout=300,
           cwd=tmp_path)
    return [json.loads((tmp_path / f"{strategy}-rank{r}.json").read_text()) for r in (0, 1)]


def check(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["batch"] == ["bf16"]  # cast before the transfer
        assert r["seen"] == {"fc1": ["bf16"], "norm": ["fp32"], "fc2": ["bf16"]}
        assert set(r["storage"].values()) == {"fp32"}
        assert r["losses"][-1] < r["losses"][0] * 0.7, r["losses"]
        dtypes = {d for d, _ in r["reduced"]}
        assert dtypes == {"bf16", "fp32"}, r["reduced"]  # bf16 for the Linears, fp32 island
        bf16_n = max(n for d, n in r["reduced"] if d == "bf16")
        fp32_n = max(n for d, n in r["reduced"] if d == "fp32")
        assert bf16_n > fp32_n >= 32
    assert ranks[0]["params"] == ranks[1]["params"]


@pytest.mark.slow  # over make test's budget: run by make test-all
@pytest.mark.parametrize("strategy", [
    "ddp", "model_parallel"])  # FSDP2: test_fsdp.py
def test_two_process_strategies_train_with_planned_dtypes(strategy: str, tmp_path: Path) -> None:
    check(run(strategy, tmp_path))


@pytest.mark.slow  # over make test's budget: run by make test-all
def test_check_says_what_lightning_reduces_in_on_cpu(tmp_path: Path) -> None:
    """With the user's own ddp_comm_hook beside the plugin, Lightning on CPU reduces every
    gradient in fp32 (it registers the hook only on CUDA, and the plugin registers none beside
    it): check says the plan's bf16 comm is widened, and no longer claims a bf16 reduction
    (0.3's narrow-comm info)."""
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from precision_annot import check as check_plan
    from tests.workers.models import POLICY, Net

    ranks = run("ddp-own-hook", tmp_path)
    for r in ranks:
        assert {d for d, _ in r["reduced"]} == {"fp32"}, r["reduced"]
    config = {"strategy": DDPStrategy(ddp_comm_hook=default_hooks.bf16_compress_hook),
              "plugins": [AnnotatedPrecision(default=POLICY)], "accelerator": "cpu"}
    plan = resolve(Net(8, 16, 1), default=POLICY)
    found = check_plan(plan, "lightning", config)
    assert [(f.severity, f.code) for f in found] == [("warning", "lightning-ddp-hook")]
    assert "planned bf16, fp32 instead" in found[0].message


@pytest.mark.slow  # 16 s; DeepSpeed on 2 ranks stays in make test (adapters/test_deepspeed.py)
def test_deepspeed_strategy_with_lightnings_cuda_only_check_bypassed(tmp_path: Path) -> None:
    """Lightning's DeepSpeedStrategy refuses non-CUDA accelerators; the worker skips only that
    check (and gives CPU devices an index). DeepSpeed itself runs for real on its CPU
    accelerator with gloo, ZeRO-2, with the config the plugin fills from the DeepSpeed adapter."""
    ranks = run("deepspeed", tmp_path)
    check(ranks)
    assert ranks[0]["config"] == {"torch_autocast": {
        "enabled": True, "dtype": "bfloat16",
        "lower_precision_safe_modules": ["torch.nn.modules.linear.Linear"]}}


def test_lightnings_own_demo_transformer_runs_as_lightnings_bf16_true() -> None:
    """Lightning's demo Transformer builds its positional table in forward with torch.zeros:
    under Lightning's "bf16-true" that table is bf16 (the default dtype), and 0.3's plugin left
    it fp32, which promoted the activations: MultiheadAttention then failed with "expected m1
    and m2 to have the same dtype". The plugin sets the default dtype as Lightning does: the
    same losses, step for step."""
    from lightning.pytorch.demos import Transformer

    class Lit(L.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = Transformer(vocab_size=64, ninp=32, nhead=2, nhid=32, nlayers=1,
                                     dropout=0.0)
            self.losses: list[float] = []

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.nll_loss(self.model(x, y), y.view(-1))
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def losses(**kwargs: Any) -> list[float]:
        gen = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, 64, (12, 8), generator=gen)
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
            tokens, torch.randint(0, 64, (12, 8), generator=gen)), batch_size=4)
        module = Lit()
        L.Trainer(max_steps=3, enable_checkpointing=False, **QUIET, **kwargs).fit(module, data)
        return module.losses

    lightnings = losses(precision="bf16-true")
    ours = losses(plugins=[AnnotatedPrecision(default="bf16-true")])
    assert ours == lightnings and all(math.isfinite(v) for v in ours)
    assert torch.get_default_dtype() == torch.float32  # restored after each forward


def test_the_update_half_under_the_trainer_resumes_exactly(tmp_path: Path) -> None:
    """configure_optimizers returns precision_annot.optimizer (the plugin has applied the plan
    by then); a run stopped at step 3 and resumed from its checkpoint ends where the run that
    did not stop ends, bit for bit: the checkpoint holds the fp32 masters and 8-bit states."""
    pytest.importorskip("torchao")
    import precision_annot as pa

    class Lit(L.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 128), nn.GELU(), nn.Linear(128, 64))

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return pa.optimizer(self, torch.optim.AdamW, lr=1e-2)

    def fit(steps: int, ckpt: str | None = None) -> Lit:
        # one batch an epoch: Lightning resumes a loader without state at another batch, and
        # with one batch every step sees the same data
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(8, 8, generator=gen)
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
            x, torch.randn(8, 64, generator=gen)), batch_size=8)
        module = Lit()
        trainer = L.Trainer(max_steps=steps, default_root_dir=tmp_path, **QUIET,
                            plugins=[AnnotatedPrecision(
                                default="bf16-true,master=fp32,optim=8bit")])
        trainer.fit(module, data, ckpt_path=ckpt)
        if ckpt is None and steps == 3:
            trainer.save_checkpoint(tmp_path / "step3.ckpt")
        return module

    whole = fit(6)
    fit(3)
    resumed = fit(6, str(tmp_path / "step3.ckpt"))
    assert whole.net[0].weight.dtype == torch.bfloat16
    assert not torch.equal(whole.net[0].weight, Lit().net[0].weight.to(torch.bfloat16))
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
