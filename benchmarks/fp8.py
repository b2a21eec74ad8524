"""fp8 GEMMs through a plan against torchao by hand, same filter.

One process, alternating runs, median ratios (applied / by hand). The model is the GPT of
`benchmarks/overhead.py` (bf16, fp32 LayerNorm islands) with every Linear but the head
running fp8 GEMMs:

- applied: `annotate(model, {nn.LayerNorm: "fp32", nn.Linear: "compute=fp8-rowwise",
  "head": "bf16"})`, then `apply(model, default="bf16")`;
- by hand: the LayerNorms cast by hand in the model's code, `model.to(bf16)`, and
  `convert_to_float8_training(model, module_filter_fn=<every Linear but the head>,
  config=Float8LinearConfig.from_recipe_name("rowwise"))`.

It checks that the two give the same logits and gradients, bit for bit, then times forward +
backward, eager and under `torch.compile`. On a GPU it also reports tokens/s against the same
model in bf16 without fp8. On a CPU fp8 is emulated (slower than bf16): only the ratio means
something there.

Run: `python benchmarks/fp8.py [--quick] [--only eager,compiled]`.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from torch import nn

from benchmarks.overhead import GPT, alternate, report, step
from precision_annot import annotate, apply, bf16, fp32

RECIPE = "fp8-rowwise"


def pair(device: str) -> tuple[nn.Module, nn.Module]:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    hand = GPT(hand_cast=True).to(device)
    applied = GPT(hand_cast=False).to(device)
    applied.load_state_dict(hand.state_dict())
    annotate(applied, {nn.LayerNorm: "fp32", nn.Linear: f"compute={RECIPE}", "head": "bf16"})
    apply(applied, default="bf16")
    hand.to(bf16)
    for m in hand.modules():
        if isinstance(m, nn.LayerNorm):
            m.to(fp32)
    convert_to_float8_training(
        hand, module_filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn != "head",
        config=Float8LinearConfig.from_recipe_name("rowwise"))
    return applied, hand


def identical(a: nn.Module, b: nn.Module, tokens: torch.Tensor) -> bool:
    out_a, out_b = a(tokens), b(tokens)
    out_a.float().mean().backward()
    out_b.float().mean().backward()
    grads = all(torch.equal(pa.grad, pb.grad)  # type: ignore[arg-type]
                for pa, pb in zip(a.parameters(), b.parameters(), strict=True))
    a.zero_grad()
    b.zero_grad()
    return torch.equal(out_a, out_b) and grads


def tokens_per_s(model: nn.Module, tokens: torch.Tensor, reps: int) -> float:
    run = step(model, tokens)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        run()
    torch.cuda.synchronize()
    return tokens.numel() * reps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--only", default="eager,compiled", help="eager, compiled")
    args = parser.parse_args()
    which = set(args.only.split(","))
    reps = 6 if args.quick else 20
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"torch {torch.__version__}, python {platform.python_version()}, "
          f"{platform.machine()}, {device}, {torch.get_num_threads()} threads, {RECIPE}")
    tokens = torch.randint(0, 512, (4, 64), device=device)

    if "eager" in which:
        applied, hand = pair(device)
        print(f"bit-identical logits and gradients: {identical(applied, hand, tokens)}")
        ta, tb = alternate(step(applied, tokens), step(hand, tokens), reps * 5)
        report("GPT d=128, 2 layers, batch 4x64, fp8 GEMMs + fp32 LayerNorms, fwd+bwd, eager",
               ta, tb)

    if "compiled" in which:
        applied, hand = pair(device)
        start = time.perf_counter()
        compiled_a, compiled_h = torch.compile(applied), torch.compile(hand)
        print(f"bit-identical logits and gradients, compiled: "
              f"{identical(compiled_a, compiled_h, tokens)}")
        print(f"compiling both: {time.perf_counter() - start:.0f} s")
        ta, tb = alternate(step(compiled_a, tokens), step(compiled_h, tokens), reps * 10)
        report("GPT as above, torch.compile, fwd+bwd", ta, tb)

    if device == "cuda":
        applied, _ = pair(device)
        torch.manual_seed(0)
        plain = GPT(hand_cast=False).to(device)
        annotate(plain, {nn.LayerNorm: "fp32"})
        apply(plain, default="bf16")
        big = torch.randint(0, 512, (32, 512), device=device)
        fp8_tps = tokens_per_s(torch.compile(applied), big, reps)
        bf16_tps = tokens_per_s(torch.compile(plain), big, reps)
        print(f"tokens/s, compiled, batch 32x512: fp8 {fp8_tps:,.0f}, bf16 {bf16_tps:,.0f}, "
              f"fp8/bf16 {fp8_tps / bf16_tps:.2f}")
    else:
        print("tokens/s against bf16: needs a GPU (on a CPU fp8 is emulated)")


if __name__ == "__main__":
    main()
