"""`grad=fp32` in the loops users run: DDP (2 gloo ranks, with and without `no_sync`), the
Hugging Face Trainer, the Lightning Trainer and FSDP2, each against the loop written by hand
(`tests.workers.grads.HandLoop`: fp32 masters, fp32 gradient sums by hand)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from precision_annot._src import seams
from tests.helpers import launch


def ddp_cases(cases: list[str], tmp_path: Path) -> dict[str, list[dict[str, Any]]]:
    launch("tests.workers.grads", ",".join(cases), str(tmp_path), ranks=2, timeout=300)
    return {c: [json.loads((tmp_path / f"{c}-rank{r}.json").read_text()) for r in (0, 1)]
            for c in cases}


def assert_equals_the_hand_loop(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["weights"] == 0.0 and r["masters"] == 0.0, r
        assert r["grads"] == ["torch.float32"], r  # .grad is fp32 after DDP's reduction


@pytest.mark.slow  # over make test's budget (6 s a torch); the Trainer and Lightning loops stay
def test_ddp_no_sync_and_fsdp2_accumulate_in_fp32_as_by_hand(tmp_path: Path) -> None:
    """DDP: 3 micro-batches per step, the first two under `no_sync`, `model.zero_grad()` and
    `clip_grad_norm_` on the model: equal to the hand loop (sums reduced in bf16, the plan's
    comm) bit for bit on both ranks. A plan reducing in fp32 without the comm hook that can is
    refused at the first forward, naming the fix. FSDP2 (`adapters.fsdp.fully_shard`): the
    fp32 shards are the masters, and each micro-batch's gradient, reduce-scattered in bf16,
    accumulates into their fp32 gradients, as the hand loop does on a replica."""
    found = ddp_cases(["no_sync", "misconfigured", "fsdp2", "fsdp2_no_sync"], tmp_path)
    assert_equals_the_hand_loop(found["no_sync"])
    for r in found["misconfigured"]:
        assert r["error"] is not None and "reduces it in fp32 (comm=fp32" in r["error"]
        assert "register_comm_hook(None, precision_annot.adapters.ddp.comm_hook(" in r["error"]
    for r in found["fsdp2"]:
        assert r["weights"] == 0.0 and r["masters"] == 0.0, r
        assert r["grads"] == ["DTensor torch.float32"], r
    # with set_requires_gradient_sync(False), FSDP2 itself sums the unsynced micro-batches in
    # its reduce dtype (the plan's bf16 comm), as docs/update.md says; the shards stay fp32
    for r in found["fsdp2_no_sync"]:
        assert r["sums"] == ["torch.bfloat16"] and r["grads"] == ["torch.float32"], r


@pytest.mark.skipif(seams.FSDP2_GRAD_DTYPE, reason="torch 2.15's FSDP2 keeps grad_dtype")
def test_fsdp2_refuses_grad_fp32_without_a_master_before_sharding() -> None:
    import torch

    import precision_annot as pa
    from precision_annot.adapters import fsdp
    from tests.workers.grads import mlp

    model = pa.apply(mlp(), default="bf16-true,grad=fp32")
    with pytest.raises(ValueError, match=r"accumulates gradients in fp32 over bf16 storage "
                                         r"without a master for 4 module\(s\).*Plan "
                                         r"master=fp32 for them too"):
        fsdp.fully_shard(model)
    assert {(p.dtype, p.grad_dtype) for p in model.parameters()} == {
        (torch.bfloat16, torch.float32)}  # untouched


@pytest.mark.skipif(not seams.FSDP2_GRAD_DTYPE, reason="FSDP2 keeps grad_dtype from torch 2.15")
def test_fsdp2_keeps_fp32_gradients_of_bf16_shards_without_a_master(tmp_path: Path) -> None:
    """From torch 2.15 FSDP2 keeps each parameter's `grad_dtype`: `bf16-true,grad=fp32`
    without masters shards bf16 weights with fp32 gradient shards, each micro-batch's bf16
    reduce-scatter added into them, and the step reads them; equal bit for bit to the same
    plan's optimizer on one process fed the same reduced gradients by hand."""
    (ranks,) = ddp_cases(["fsdp2_grad"], tmp_path).values()
    for r in ranks:
        assert r["weights"] == 0.0, r
        assert r["grads"] == ["DTensor torch.bfloat16 torch.float32"], r


@pytest.mark.slow  # 25 s: 11 more DDP loops on 2 ranks
def test_ddp_in_every_arrangement_equals_the_hand_loop(tmp_path: Path) -> None:
    """Without `no_sync`; with the plan's comm hook (bf16 comm, and fp32 comm, where the hook
    reduces the fp32 sums themselves); with `find_unused_parameters=True` and a Linear that
    rank 0 uses only before the synchronising micro-batch and rank 1 only in it, one that both
    use only before it, and one that no rank uses (its `.grad` stays None);
    `gradient_as_bucket_view`, many small buckets, `static_graph`; `model.zero_grad()` between
    the forward and the backward; a stray forward under grad mode without a backward (DDP then
    reduces in the next backward, `no_sync` or not, and so does the hand loop); and
    torch.compile outside and inside DDP (against the hand loop compiled)."""
    cases = ["sync", "no_sync_hook", "fp32_comm_hook", "find_unused", "bucket_view",
             "small_buckets", "static_graph", "zero_late", "stray_forward", "compiled_outside",
             "compiled_inside"]
    found = ddp_cases(cases, tmp_path)
    for case, ranks in found.items():
        assert_equals_the_hand_loop(ranks)
        assert all(r["dead"] is (True if case == "find_unused" else None) for r in ranks)


# -- the Hugging Face Trainer ---------------------------------------------------------------------

def test_hf_trainer_with_evaluation_accumulation_and_max_grad_norm_equals_the_hand_loop(
        tmp_path: Path) -> None:
    """A Llama class from a small config, bf16 with fp32 masters and fp32 accumulation: the
    Trainer's `model.zero_grad()`, 2 accumulated micro-batches, `max_grad_norm` clipping and an
    evaluation every 2 steps; equal to the hand loop on the batches the Trainer fed, bit for
    bit."""
    tf = pytest.importorskip("transformers")
    import torch
    from torch import nn

    import precision_annot as pa
    from tests.adapters.hf_models import build
    from tests.workers.grads import HandLoop

    accumulate, clip, fed = 2, 0.05, []

    def loss_func(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None
                  ) -> torch.Tensor:
        if torch.is_grad_enabled():  # training, not evaluation
            fed.append(labels.clone())
        logits = outputs.logits[:, :-1].float()
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           labels[:, 1:].reshape(-1)) / accumulate

    def llama() -> nn.Module:
        torch.manual_seed(0)
        return build("llama")[0]

    model = pa.apply(llama(), default="bf16-true,master=fp32,grad=fp32")
    opt = pa.optimizer(model, torch.optim.AdamW, lr=3e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(3)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (16, 12),
                                                                      generator=gen)]
    args = tf.TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulate, max_grad_norm=clip, eval_strategy="steps",
        eval_steps=2, per_device_eval_batch_size=4, lr_scheduler_type="constant",
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True)
    trainer = tf.Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows[:4],
                         optimizers=(opt, None), compute_loss_func=loss_func)
    trainer.train()
    logs = trainer.state.log_history
    assert sum("eval_loss" in log for log in logs) == 2
    assert max(log["grad_norm"] for log in logs if "grad_norm" in log) > clip  # it clipped
    assert {p.grad_dtype for p in model.parameters()} == {torch.float32}

    hand = HandLoop(pa.apply(llama(), default="bf16-true"))
    assert len(fed) == 4 * accumulate
    for step in range(4):
        for ids in fed[step * accumulate:(step + 1) * accumulate]:
            hand.backward(loss_func(hand.model(input_ids=ids), ids))
        hand.step(clip=clip)
    for (name, p), q, m in zip(model.named_parameters(), hand.params, hand.masters,
                               strict=True):
        assert torch.equal(p, q) and torch.equal(opt.master(p), m), name


# -- the Lightning Trainer ------------------------------------------------------------------------

def test_lightning_trainer_with_validation_accumulation_and_clipping_equals_the_hand_loop(
        ) -> None:
    """`AnnotatedPrecision("bf16-true,master=fp32,grad=fp32")`, `configure_optimizers`
    returning `precision_annot.optimizer`, `accumulate_grad_batches=2`, `gradient_clip_val` and
    a validation run every 2 batches: equal to the hand loop bit for bit."""
    L = pytest.importorskip("lightning")
    import torch
    from torch import nn

    import precision_annot as pa
    from precision_annot.adapters.lightning import AnnotatedPrecision
    from tests.adapters.lightning.models import QUIET
    from tests.workers.grads import HandLoop

    accumulate, clip = 2, 0.05

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))

    class Lit(L.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = net()
            self.validated = 0

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x).float(), y)

        def validation_step(self, batch: Any, index: int) -> None:
            self.validated += 1

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return pa.optimizer(self, torch.optim.AdamW, lr=3e-3, weight_decay=0.1)

    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 8, generator=gen), torch.randn(64, 4, generator=gen)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    lit = Lit()
    trainer = L.Trainer(max_steps=3, accumulate_grad_batches=accumulate, gradient_clip_val=clip,
                        val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0,
                        enable_checkpointing=False, **QUIET,
                        plugins=[AnnotatedPrecision(default="bf16-true,master=fp32,grad=fp32")])
    trainer.fit(lit, loader, loader)
    assert lit.validated >= 2
    assert {p.grad_dtype for p in lit.parameters()} == {torch.float32}

    hand = HandLoop(pa.apply(net(), default="bf16-true"))
    batches = list(loader)
    for step in range(3):
        for bx, by in batches[step * accumulate:(step + 1) * accumulate]:
            bx, by = bx.bfloat16(), by.bfloat16()  # the plugin casts the batch before moving it
            hand.backward(nn.functional.mse_loss(hand.model(bx).float(), by) / accumulate)
        hand.step(clip=clip)
    optimizer = trainer.optimizers[0]
    for p, q, m in zip(lit.net.parameters(), hand.params, hand.masters, strict=True):
        assert torch.equal(p, q) and torch.equal(optimizer.master(p), m)
