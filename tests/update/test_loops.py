"""The update half in the loops users run, against the hand loop: Lightning resuming a run whose
low-bit states sit beside fp32 gradients (the compiled update), and the Hugging Face Trainer
with an fp32 copy saved mid-run (the plan taken off and applied again)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import precision_annot as pa
from precision_annot._src.update import engines

bf16, fp32 = torch.bfloat16, torch.float32


@pytest.mark.slow
def test_lightning_resumes_grad_fp32_with_an_8bit_state_compiled_as_torchao_by_hand(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`bf16-true,master=fp32,grad=fp32,optim=8bit` under Lightning, the update compiled (the
    default): 6 steps, and 3 steps resumed from the checkpoint of step 3 for 3 more, end bit
    for bit where torchao's own AdamW8bit by hand ends (fp32 masters fed the fp32 gradients,
    copied back rounded). Before: the first compiled step crashed
    (`InternalTorchDynamoError`)."""
    L = pytest.importorskip("lightning")
    optim = pytest.importorskip("torchao.optim")
    from precision_annot.adapters.lightning import AnnotatedPrecision

    monkeypatch.setattr(engines, "COMPILE", True)
    spec = "bf16-true,master=fp32,grad=fp32,optim=8bit"
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 64, generator=gen), torch.randn(8, 64, generator=gen)

    def net() -> nn.Module:  # weights of 8,192 elements: their states are 8-bit
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))

    class Lit(L.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = net()

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            inputs, target = batch
            return nn.functional.mse_loss(self.net(inputs).float(), target)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return pa.optimizer(self, torch.optim.AdamW, lr=1e-2)  # type: ignore[no-any-return]

    def fit(steps: int, ckpt: str | None = None) -> tuple[Lit, Any]:
        # one batch an epoch, so that a resumed run sees the data the whole run sees
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
        module = Lit()
        trainer = L.Trainer(max_steps=steps, default_root_dir=tmp_path, accelerator="cpu",
                            devices=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False,
                            plugins=[AnnotatedPrecision(default=spec)])
        trainer.fit(module, data, ckpt_path=ckpt)
        if ckpt is None and steps == 3:
            trainer.save_checkpoint(tmp_path / "step3.ckpt")
        return module, trainer.optimizers[0]

    with torch._inductor.config.patch(fx_graph_cache=False):
        whole, opt = fit(6)
        fit(3)
        resumed, _ = fit(6, str(tmp_path / "step3.ckpt"))
        hand = pa.apply(net(), default="bf16-true")  # the plugin hands the batch in bf16
        for p in hand.parameters():
            p.grad_dtype = fp32
        masters = [p.detach().float().clone() for p in hand.parameters()]
        ref = optim.AdamW8bit(masters, lr=1e-2)
        for _ in range(6):
            hand.zero_grad()
            nn.functional.mse_loss(hand(x.to(bf16)).float(), y.to(bf16)).backward()
            for m, p in zip(masters, hand.parameters(), strict=True):
                m.grad = p.grad
            ref.step()
            with torch.no_grad():
                for m, p in zip(masters, hand.parameters(), strict=True):
                    p.copy_(m)
    assert type(opt.state[whole.net[0].weight]["exp_avg"]).__name__ == "OptimState8bit"
    for p, q, r, m in zip(whole.net.parameters(), resumed.net.parameters(), hand.parameters(),
                          masters, strict=True):
        assert p.grad_dtype == fp32 and p.dtype == bf16
        assert torch.equal(p, q) and torch.equal(p, r) and torch.equal(opt.master(p), m)


@pytest.mark.slow
def test_hf_trainer_saving_an_fp32_copy_mid_run_keeps_the_masters(tmp_path: Path) -> None:
    """The Hugging Face Trainer, a Llama class from a small config in bf16 with fp32 masters;
    after step 2 a callback saves the model in fp32 (`remove`, `save_pretrained`, `apply`
    again). The saved weights are the masters of step 2, and the run ends bit for bit where
    the run without the save ends, and where the hand loop ends. Before: the masters
    restarted from the bf16 weights after the save."""
    tf = pytest.importorskip("transformers")
    from tests.adapters.hf_models import build
    from tests.workers.grads import HandLoop

    spec, fed = "bf16-true,master=fp32", []

    def llama() -> nn.Module:
        torch.manual_seed(0)
        return build("llama")[0]

    def loss_func(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None
                  ) -> torch.Tensor:
        fed.append(labels.clone())
        logits = outputs.logits[:, :-1].float()
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           labels[:, 1:].reshape(-1))

    class SaveInFp32(tf.TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.masters: list[torch.Tensor] = []

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None,
                        optimizer: Any = None, **kwargs: Any) -> None:
            if state.global_step != 2:
                return
            held = optimizer.optimizer  # (Accelerate wraps it)
            self.masters = [held.master(p).clone() for p in model.parameters()]
            pa.remove(model)
            model.save_pretrained(tmp_path / "fp32")
            pa.apply(model, default=spec)

    def run(callbacks: list[Any]) -> tuple[nn.Module, Any]:
        model = pa.apply(llama(), default=spec)
        opt = pa.optimizer(model, torch.optim.AdamW, lr=3e-3, weight_decay=0.1)
        gen = torch.Generator().manual_seed(3)
        rows = [{"input_ids": ids, "labels": ids}
                for ids in torch.randint(0, 128, (8, 12), generator=gen)]
        args = tf.TrainingArguments(
            output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=2,
            lr_scheduler_type="constant", max_grad_norm=0.0, save_strategy="no", report_to=[],
            use_cpu=True,
            logging_strategy="no")
        tf.Trainer(model=model, args=args, train_dataset=rows, optimizers=(opt, None),
                   compute_loss_func=loss_func, callbacks=callbacks).train()
        return model, opt

    save = SaveInFp32()
    model, opt = run([save])
    whole, whole_opt = run([])
    saved = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=fp32)
    assert all(p.dtype == fp32 and torch.equal(p, m)
               for p, m in zip(saved.parameters(), save.masters, strict=True))
    hand = HandLoop(pa.apply(llama(), default="bf16-true"))
    for ids in fed[:4]:  # the batches of the first run, as the Trainer fed them
        hand.backward(loss_func(hand.model(input_ids=ids), ids))
        hand.step()
    for (name, p), q, r, m in zip(model.named_parameters(), whole.parameters(), hand.params,
                                  hand.masters, strict=True):
        master = opt.master(p)
        assert torch.equal(p, q) and torch.equal(master, whole_opt.master(q)), name
        assert torch.equal(p, r) and torch.equal(master, m), name
