"""`suggest` on planted models, against a threshold rule in the spirit of ModelOpt, against
transformers' own fp32 lists, and against plain autocast; and what `suggest` costs.

For each planted model and each method it prints the share of parameters kept in fp32, whether
the plan holds on held-out batches the method did not see (finite, and outputs, loss and
gradients within the tolerance), and for `suggest` its cost in fp32 training steps (its CPU
time over the CPU time of one fp32 forward + backward on the same batch, in the same process,
`time.process_time`: every thread of the process, so run it with OMP_NUM_THREADS=1 on a
shared machine).

- threshold: every module whose output reaches |x| > 512 in an fp32 run is kept in fp32 (the
  spirit of ModelOpt's AutoCast rule on outputs), handing back the low dtype;
- transformers: the model's `_keep_in_fp32_modules` (T5: `wo`) through
  `adapters.transformers.rules`;

and three model classes from transformers as they come (GPT-2, Llama, T5 from small configs,
random weights, nothing planted), for what `suggest` costs on models written elsewhere.
- autocast: everything in the low dtype.

Run: `python benchmarks/suggest.py [--quick]`.
"""

from __future__ import annotations

import argparse
import copy
import math
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from precision_annot import annotate, apply, resolve
from precision_annot._src.suggest import Suggestion, relative_error, suggest

LOW = "16-mixed"
TOLERANCE = 2e-2  # suggest's default for fp16: the calibration batch held to 1e-2


class Block(nn.Module):
    """A pre-norm transformer block; `gain` scales what its feed-forward adds to the
    residual stream (residual growth), `hidden_gain` its hidden state (T5's overflow)."""

    def __init__(self, d: int, gain: float = 1.0, hidden_gain: float = 1.0) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.wi, self.wo = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.gain, self.hidden_gain = gain, hidden_gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        hidden = torch.relu(self.wi(self.norm2(x))) * self.hidden_gain
        out: torch.Tensor = x + self.wo(hidden) / self.hidden_gain * self.gain
        return out


class LM(nn.Module):
    def __init__(self, d: int = 64, layers: int = 6, vocab: int = 256,
                 gains: list[float] | None = None, hidden: list[float] | None = None,
                 head_gain: float = 1.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        gains = gains or [1.0] * layers
        hidden = hidden or [1.0] * layers
        self.blocks = nn.ModuleList(Block(d, g, h) for g, h in zip(gains, hidden, strict=True))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        with torch.no_grad():
            self.head.weight.mul_(head_gain)  # the head's own output passes 65504

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(self.norm(x))
        return out


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1),
                                       ids[:, 1:].flatten())


def t5(overflowing: int = 2) -> tuple[nn.Module, Callable[..., torch.Tensor]]:
    import transformers

    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=256, d_model=64, d_ff=256, d_kv=16,
                                   num_layers=2, num_heads=4, decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(config)
    wos = [m for n, m in model.named_modules() if n.endswith("DenseReluDense.wo")]
    with torch.no_grad():
        for wo in wos[:overflowing]:  # two of the four feed-forward outputs pass 65504
            wo.weight.mul_(2.0 ** 17)
    return model, lambda out, batch: out.loss


class OffsetNorm(nn.LayerNorm):
    """A LayerNorm over its input plus 1000: bf16 keeps 8 bits, so around 1000 it rounds in
    steps of 4 and the variance it normalises by is lost; no value overflows, so only running
    each module alone finds it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x + 1000.0)


def offset_norm() -> tuple[nn.Module, Callable[..., torch.Tensor]]:
    torch.manual_seed(0)
    model = LM()
    model.blocks[2].norm2 = OffsetNorm(64)
    return model, lm_loss


def lm(**kwargs: Any) -> tuple[nn.Module, Callable[..., torch.Tensor]]:
    """The 6-layer LM, its weights from seed 0 whatever ran before."""
    torch.manual_seed(0)
    return LM(**kwargs), lm_loss


def transformers_model(kind: str) -> tuple[nn.Module, Callable[..., torch.Tensor]]:
    """A model class from transformers, from a small config (random weights, seed 0), as it
    comes: nothing planted. Its loss is its own (`labels` in the batch)."""
    import transformers

    torch.manual_seed(0)
    if kind == "GPT-2":
        model: nn.Module = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=256, n_positions=64, n_embd=128, n_layer=4, n_head=4,
            bos_token_id=0, eos_token_id=0))
    elif kind == "Llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    else:
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=256, d_model=128, d_ff=256, d_kv=32, num_layers=4, num_heads=4,
            decoder_start_token_id=0))
    return model, lambda out, batch: out.loss


CASES: dict[str, Callable[[], tuple[nn.Module, Callable[..., torch.Tensor]]]] = {
    "no hot spot": lm,
    "T5, 2 overflowing wo": t5,
    "residual growth": lambda: lm(gains=[1, 1, 1, 1, 2.0 ** 17, 1]),
    "overflowing LM head": lambda: lm(head_gain=2.0 ** 15),
    "2 overflowing feed-forwards": lambda: lm(hidden=[1, 2.0 ** 17, 1, 1, 2.0 ** 17, 1]),
    "bf16 norm over an offset": offset_norm,
    "transformers GPT-2": lambda: transformers_model("GPT-2"),
    "transformers Llama": lambda: transformers_model("Llama"),
    "transformers T5": lambda: transformers_model("T5"),
}
#: (low, tolerance) where a case runs in another dtype than LOW: one that only running each
#: module alone finds (nothing is non-finite)
SETTINGS = {"bf16 norm over an offset": ("bf16", 1e-1)}


def batches(kind: str, n: int) -> list[Any]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 256, (16, 32), generator=g)
        out.append({"input_ids": ids, "labels": ids[:, :8].contiguous()} if "T5" in kind else
                   {"input_ids": ids, "labels": ids} if kind.startswith("transformers") else ids)
    return out


def call(model: nn.Module, batch: Any) -> Any:
    return model(**batch) if isinstance(batch, dict) else model(batch)


def holds(model: nn.Module, plan_model: nn.Module, batch: Any,
          loss_fn: Callable[..., torch.Tensor], tolerance: float = TOLERANCE) -> bool:
    """Outputs, loss and gradients of the planned model within the tolerance of fp32's."""
    ref = copy.deepcopy(model).eval()
    out_ref = call(ref, batch)
    loss_ref = loss_fn(out_ref, batch)
    loss_ref.backward()
    planned = copy.deepcopy(plan_model).eval()
    out = call(planned, batch)
    loss = loss_fn(out, batch)
    if not torch.isfinite(loss):
        return False
    scale = 2.0 ** 16  # as GradScaler: scaled, backed off while a gradient is non-finite
    while True:
        (loss * scale).backward(retain_graph=True)
        if all(bool(torch.isfinite(p.grad).all()) for p in planned.parameters()
               if p.grad is not None) or scale <= 1:
            break
        planned.zero_grad(set_to_none=True)
        scale /= 2
    for p in planned.parameters():
        if p.grad is not None:
            p.grad /= scale
    logits = out.logits if hasattr(out, "logits") else out
    ref_logits = out_ref.logits if hasattr(out_ref, "logits") else out_ref
    grads = [p.grad for p in planned.parameters() if p.grad is not None]
    ref_grads = [p.grad for p in ref.parameters() if p.grad is not None]
    errors = [relative_error(logits, ref_logits), relative_error(loss, loss_ref),
              relative_error([g.double() for g in grads], [g.double() for g in ref_grads])]
    return all(math.isfinite(e) and e <= tolerance for e in errors)


def share(model: nn.Module, plan: Any) -> float:
    total = sum(p.numel() for p in model.parameters())
    kept = sum(e.params for n, e in plan.items() if e.policy.compute == torch.float32)
    return kept / total


def threshold_plan(model: nn.Module, batch: Any, limit: float = 512.0) -> Any:
    peaks: dict[str, float] = {}

    def hook(name: str) -> Callable[..., None]:
        def record(_: nn.Module, __: Any, out: Any) -> None:
            t = out.logits if hasattr(out, "logits") else out
            t = t[0] if isinstance(t, tuple) else t
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                peaks[name] = max(peaks.get(name, 0.0), float(t.detach().abs().max()))
        return record

    probe = copy.deepcopy(model).eval()
    handles = [m.register_forward_hook(hook(n)) for n, m in probe.named_modules() if n]
    with torch.no_grad():
        call(probe, batch)
    for h in handles:
        h.remove()
    hot = [n for n, p in peaks.items() if p > limit
           and not list(dict(model.named_modules())[n].children())]
    planned = copy.deepcopy(model)
    annotate(planned, [(n, "fp32") for n in hot])
    return planned


def fp32_step_seconds(model: nn.Module, batch: Any, loss_fn: Callable[..., torch.Tensor],
                      reps: int) -> float:
    m = copy.deepcopy(model)
    times = []
    for _ in range(reps + 2):
        start = time.process_time()
        loss_fn(call(m, batch), batch).backward()
        times.append(time.process_time() - start)
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repetition")
    parser.add_argument("cases", nargs="*", help="the cases to run (default: all)")
    args = parser.parse_args()
    reps = 1 if args.quick else 3
    print(f"torch {torch.__version__}, python {platform.python_version()}, "
          f"{platform.machine()}, {torch.get_num_threads()} threads; low={LOW}, "
          f"tolerance={TOLERANCE} (bf16 and 1e-1 where the case says bf16)")
    header = f"{'case':<28} {'method':<12} {'fp32 params':>11} {'holds on held-out':>18}"
    print(header + f" {'cost (fp32 steps): median [range]':>34}")
    for case, make in CASES.items():
        if args.cases and case not in args.cases:
            continue
        model, loss_fn = make()
        low, tolerance = SETTINGS.get(case, (LOW, TOLERANCE))
        sample, *held = batches(case, 4)
        costs, found = [], None
        for _ in range(reps + 1):  # the first run warms the low-precision kernels up
            before = fp32_step_seconds(model, sample, loss_fn, 3)
            start = time.process_time()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                found = suggest(model, sample, low=low, loss_fn=loss_fn, tolerance=tolerance)
            spent = time.process_time() - start
            # against the fp32 step measured right around it: the machine is shared
            costs.append(spent / statistics.median(
                [before, fp32_step_seconds(model, sample, loss_fn, 3)]))
        costs = costs[1:]
        step = fp32_step_seconds(model, sample, loss_fn, 5)
        assert isinstance(found, Suggestion)
        planned = apply(copy.deepcopy(model), found.plan)
        rows = [("suggest", share(model, found.plan), planned,
                 f"{statistics.median(costs):.1f} [{min(costs):.1f}-{max(costs):.1f}] "
                 f"({len(found.checks)} checks)")]
        low_step = fp32_step_seconds(apply(copy.deepcopy(model), default=low), sample, loss_fn, 5)
        thr = threshold_plan(model, sample)
        rows.append(("threshold", share(model, resolve(thr, low)), apply(thr, default=low), "-"))
        if "T5" in case:
            from precision_annot.adapters import transformers as hf

            listed = annotate(copy.deepcopy(model), hf.rules(model))
            rows.append(("transformers", share(model, resolve(listed, low)),
                         apply(listed, default=low), "-"))
        plain = apply(copy.deepcopy(model), default=low)
        rows.append(("autocast", 0.0, plain, "-"))
        for method, fraction, planned_model, cost in rows:
            ok = sum(holds(model, planned_model, b, loss_fn, tolerance) for b in held)
            print(f"{case:<28} {method:<12} {fraction:>10.2%} {ok:>11}/{len(held)} held"
                  f" {cost:>34}")
        print(f"{'':<28} suggest: islands {found.islands}, output fp32 {found.outputs}; "
              f"{found.message}")
        r = found.runs
        steps = (r.get("fp32", 0) + r.get("fp32 watched", 0) + r.get("checks", 0)
                 + r.get("checks (watched)", 0) + 0.5 * (r.get("fp32 forward (determinism)", 0)
                 + r.get("modules alone (forward)", 0) + r.get("backward retries", 0)))
        print(f"{'':<28} runs: {r}: {steps:g} steps (forward + backward); a {low} step costs "
              f"{low_step / step:.1f} fp32 steps on this CPU")


if __name__ == "__main__":
    main()
