"""A small Mixtral (transformers, random weights) trained 200 steps on CPU, its routers in five
arithmetics: loss and routing changes against fp32, and the thread CPU time of each.

The model: `MixtralForCausalLM` from a config (hidden 128, 2 layers, 8 experts, top-2,
vocabulary 1,000), 512 tokens a step from a fixed Markov token stream, AdamW. Every
configuration starts from the same weights and sees the same batches:

1. fp32: no plan (the reference);
2. bf16: `apply(model, default="bf16-mixed")`;
3. fp32 router island: the routers (`*.gate`: projection, softmax and top-k) "fp32";
4. fp32 output: the router's projection (`*.gate.proj`) "bf16-mixed,output=fp32": bf16
   operands, its GEMM's fp32 output never rounded to bf16;
5. fp32 output, 2-piece backward: "bf16-mixed,output=fp32,backward=split2".

transformers 5 writes a router as a module of its own (`MixtralTopKRouter`: a `weight` and
`F.linear`), not an nn.Linear, and a plan's arithmetic reaches nn.Linear only: here each
`gate` becomes the same router with its projection an nn.Linear, `gate.proj`, the same weights
(`LinearRouter`). `--with-transformers-router` adds a row with (4)'s plan on transformers' own
`*.gate`, which computes exactly as (2).

The experts run transformers' "eager" implementation (one `F.linear` per expert, which autocast
computes in bf16): its default, `grouped_mm`, is outside autocast and casts its input to the
weights' dtype, so under "bf16-mixed" (fp32 weights) the experts' GEMMs would run in fp32.

Routing: the top-2 expert set of every token in every layer (the indices the router hands the
experts, recorded by a forward hook on each `gate`) on a held-out batch of 2,048 tokens,
against the fp32 model's: at step 0 on the same weights (what the arithmetic alone moves);
after training against the fp32-trained model (the row "fp32, perturbed", fp32 again from
initial weights moved by one part in 1e7, is the noise floor of that column); after training
against the same trained weights computed in fp32 (a copy with the plan removed). And the
share of sets that differ from the top-k of the exact (fp64) product of the router's own
operands: what the router's GEMM alone moves.

The configurations train in lockstep, one step each in turn, the order rotating every step,
in one process on one thread: each configuration's 200 steps run once, interleaved with the
others'. Its time is the sum of `time.thread_time()` over its steps (forward, backward,
optimizer step). A second table times the router's Linear alone in each arithmetic. Run with
OMP_NUM_THREADS=1 on a shared machine.

Run: `OMP_NUM_THREADS=1 python benchmarks/moe_router.py [--quick] [--steps N]`.
"""

from __future__ import annotations

import argparse
import bisect
import copy
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

import precision_annot as pa

VOCAB, HIDDEN, LAYERS, EXPERTS, TOP = 1000, 128, 2, 8, 2
BATCH, SEQ = 8, 64
HELD = 32  # held-out sequences
LR = 2e-3


def mixtral(seed: int = 0) -> nn.Module:
    """A small MixtralForCausalLM with random weights (no hub)."""
    from transformers import MixtralConfig, MixtralForCausalLM
    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=EXPERTS, num_experts_per_tok=TOP, max_position_embeddings=SEQ,
        attn_implementation="eager", experts_implementation="eager")
    torch.manual_seed(seed)
    return MixtralForCausalLM(config).train()


class LinearRouter(nn.Module):
    """Like transformers' `MixtralTopKRouter`, but its projection is an nn.Linear (`proj`), so
    that a plan can give that GEMM its own arithmetic."""

    def __init__(self, router: nn.Module) -> None:
        super().__init__()
        self.top_k, self.hidden_dim = router.top_k, router.hidden_dim
        weight = router.weight
        self.proj = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(weight)

    def forward(self, hidden_states: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits: torch.Tensor = self.proj(hidden_states)
        probs = F.softmax(logits.float(), dim=-1)
        top, indices = torch.topk(probs, self.top_k, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True)
        return logits, top, indices


def with_linear_routers(model: nn.Module) -> nn.Module:
    """`model` with each MoE block's `gate` a `LinearRouter` of the same weights."""
    for layer in model.model.layers:  # type: ignore[union-attr]
        layer.mlp.gate = LinearRouter(layer.mlp.gate)
    return model


# -- data -------------------------------------------------------------------------------------

def token_stream(tokens: int, seed: int) -> torch.Tensor:
    """A Markov chain over the vocabulary: each token is followed by one of 8 successors of
    its own (fixed by seed 0), with skewed probabilities; the walk itself drawn from `seed`."""
    table = torch.Generator().manual_seed(0)
    successors = torch.randint(0, VOCAB, (VOCAB, 8), generator=table)
    probs = torch.softmax(2 * torch.randn(VOCAB, 8, generator=table), -1)
    walk = torch.Generator().manual_seed(seed)
    draws = torch.rand(tokens, generator=walk, dtype=torch.float64).tolist()
    cumulative, nexts = probs.double().cumsum(-1).tolist(), successors.tolist()
    out = [0]
    for u in draws[1:]:
        row = cumulative[out[-1]]
        out.append(nexts[out[-1]][min(bisect.bisect(row, u), 7)])
    return torch.tensor(out)


def batches(steps: int, seed: int = 1) -> list[torch.Tensor]:
    stream = token_stream(steps * BATCH * SEQ, seed)
    return list(stream.view(steps, BATCH, SEQ))


# -- routing ----------------------------------------------------------------------------------

@dataclass
class Routing:
    """What the routers did on a held-out batch: each layer's top-k sets (sorted indices, as
    handed to the experts), and the share of (token, layer) pairs whose set differs from the
    top-k of the exact (fp64) product of the router's own operands (its input and weight
    rounded to `operands`): what the router's GEMM alone moves."""

    sets: list[torch.Tensor]
    own: float
    fp32: float = 0.0  # the share whose set differs from the same weights' in fp32


def routing(model: nn.Module, ids: torch.Tensor, operands: torch.dtype) -> Routing:
    """`Routing` of `model` on `ids`, recorded by a forward hook on each `gate` (no gradient,
    the model's mode kept)."""
    sets: list[torch.Tensor] = []
    own: list[torch.Tensor] = []

    def hook(gate: nn.Module, args: tuple[torch.Tensor, ...],
             out: tuple[torch.Tensor, ...]) -> None:
        indices = out[2]
        sets.append(indices.sort(-1).values)
        weight = gate.proj.weight if isinstance(gate, LinearRouter) else gate.weight
        x = args[0].reshape(-1, weight.shape[1])
        exact = x.to(operands).double() @ weight.to(operands).double().t()
        own.append((sets[-1] != top_sets(exact, indices.shape[-1])).any(-1))

    handles = [layer.mlp.gate.register_forward_hook(hook)
               for layer in model.model.layers]  # type: ignore[union-attr]
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    return Routing(sets, float(torch.cat(own).double().mean()))


def top_sets(logits: torch.Tensor, k: int) -> torch.Tensor:
    return logits.double().topk(k, -1).indices.sort(-1).values


def changed(sets: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """The share of (token, layer) pairs whose top-k set differs from `ref`'s."""
    diff = [(a != b).any(-1) for a, b in zip(sets, ref, strict=True)]
    return float(torch.cat(diff).double().mean())


# -- the configurations -----------------------------------------------------------------------

bf16, fp32 = torch.bfloat16, torch.float32


@dataclass
class Config:
    label: str
    plan: dict[str, str] | None  # annotations over "bf16-mixed"; None: no plan (fp32)
    operands: torch.dtype  # what the router's GEMM rounds its operands to
    linear_routers: bool = True
    perturb: float = 0.0  # the initial weights moved by this relative noise


CONFIGS = [
    Config("fp32 (reference)", None, fp32),
    Config("bf16 (all)", {}, bf16),
    Config("fp32 router island (`*.gate`: fp32)", {"*.gate": "fp32"}, fp32),
    Config("router fp32 output (`*.gate.proj`: bf16-mixed,output=fp32)",
           {"*.gate.proj": "bf16-mixed,output=fp32"}, bf16),
    Config("router fp32 output, 2-piece backward (`...,backward=split2`)",
           {"*.gate.proj": "bf16-mixed,output=fp32,backward=split2"}, bf16),
    Config("fp32, initial weights x (1 + 1e-7 noise) (noise floor)", None, fp32, perturb=1e-7),
]
TRANSFORMERS_ROUTER = Config(
    "transformers' own router (`*.gate`: bf16-mixed,output=fp32)",
    {"*.gate": "bf16-mixed,output=fp32"}, bf16, linear_routers=False)


@dataclass
class Run:
    config: Config
    model: nn.Module
    opt: torch.optim.Optimizer
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def step(self, ids: torch.Tensor) -> None:
        start = time.thread_time()
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.seconds += time.thread_time() - start
        self.losses.append(float(loss.detach()))


def build(config: Config, initial: dict[str, torch.Tensor]) -> nn.Module:
    """The model of `config` with the weights `initial` (a LinearRouter model's), its plan
    applied."""
    model = mixtral()
    if config.linear_routers:
        with_linear_routers(model)
    else:
        initial = {k.replace("gate.proj.weight", "gate.weight"): v for k, v in initial.items()}
    model.load_state_dict(initial)
    if config.perturb:
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + config.perturb * torch.randn(p.shape, generator=gen))
    if config.plan is not None:
        pa.annotate(model, config.plan)
        pa.apply(model, default="bf16-mixed")
    return model


def train(configs: list[Config], steps: int, held: torch.Tensor
          ) -> tuple[list[Run], list[Routing], list[Routing]]:
    """Each configuration trained `steps` steps in lockstep, the order rotating every step;
    with each one's routing on `held` before and after."""
    initial = with_linear_routers(mixtral()).state_dict()
    runs = []
    for config in configs:
        model = build(config, initial)
        runs.append(Run(config, model, torch.optim.AdamW(model.parameters(), lr=LR)))
    before = [routing(r.model, held, r.config.operands) for r in runs]
    for i, ids in enumerate(batches(steps)):
        k = i % len(runs)
        for run in runs[k:] + runs[:k]:
            run.step(ids)
    after = [routing(r.model, held, r.config.operands) for r in runs]
    for r, a in zip(runs, after, strict=True):
        a.fp32 = changed(a.sets, routing(in_fp32(r.model), held, fp32).sets)
    return runs, before, after


def in_fp32(model: nn.Module) -> nn.Module:
    """A copy of `model` with its plan removed: the same weights, computed in fp32."""
    copied = copy.deepcopy(model)
    pa.remove(copied)
    return copied


def table(runs: list[Run], before: list[Routing], after: list[Routing]) -> list[str]:
    """The markdown table: the first run is the reference."""
    last = min(20, len(runs[0].losses))
    mean = [sum(r.losses[-last:]) / last for r in runs]
    rows = ["| configuration | final loss | mean loss, last 20 | final - fp32 | mean - fp32 "
            "| top-k sets changed vs fp32, step 0 | vs fp32-trained, after training "
            "| vs the same weights in fp32, after training "
            "| changed by the router GEMM alone, step 0 / after | thread CPU s | / fp32 |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r, m, b, a in zip(runs, mean, before, after, strict=True):
        rows.append(
            f"| {r.config.label} | {r.losses[-1]:.4f} | {m:.4f} "
            f"| {r.losses[-1] - runs[0].losses[-1]:+.4f} | {m - mean[0]:+.4f} "
            f"| {100 * changed(b.sets, before[0].sets):.2f}% "
            f"| {100 * changed(a.sets, after[0].sets):.2f}% | {100 * a.fp32:.2f}% "
            f"| {100 * b.own:.2f}% / {100 * a.own:.2f}% "
            f"| {r.seconds:.1f} | {r.seconds / runs[0].seconds:.2f} |")
    return rows


# -- the router's GEMM alone ------------------------------------------------------------------

ROUTER_SPECS = {"bf16": "bf16-mixed", "fp32": "fp32", "bf16, fp32 output": "bf16-mixed,output=fp32",
                "bf16, fp32 output, split2": "bf16-mixed,output=fp32,backward=split2"}


def router_alone(reps: int) -> list[str]:
    """The router's Linear (HIDDEN -> EXPERTS, one step's tokens) alone in each arithmetic,
    forward and backward (an fp32 output gradient), alternating, the order rotating; median
    thread CPU time."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(BATCH * SEQ, HIDDEN, generator=gen).requires_grad_(True)
    grad = torch.randn(BATCH * SEQ, EXPERTS, generator=gen)
    steps = []
    for spec in ROUTER_SPECS.values():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(HIDDEN, EXPERTS, bias=False))
        pa.annotate(model, {"0": spec})
        pa.apply(model, default="bf16-mixed")

        def step(model: nn.Module = model) -> float:
            start = time.thread_time()
            model(x).float().backward(grad)
            return time.thread_time() - start
        steps.append(step)
    times: list[list[float]] = [[] for _ in steps]
    for i in range(reps + 3):
        k = i % len(steps)
        for j in list(range(k, len(steps))) + list(range(k)):
            t = steps[j]()
            if i >= 3:
                times[j].append(t)
    rows = [f"| router Linear {HIDDEN} -> {EXPERTS}, {BATCH * SEQ} tokens, fwd + bwd "
            f"| median thread CPU us ({reps} alternating runs) | / bf16 |", "|---|---|---|"]
    base = statistics.median(times[0])
    for label, t in zip(ROUTER_SPECS, times, strict=True):
        rows.append(f"| {label} | {1e6 * statistics.median(t):.0f} "
                    f"| {statistics.median(t) / base:.2f} |")
    return rows


def main(argv: list[str] | None = None, out: Callable[[str], None] = print) -> list[Run]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="20 steps")
    parser.add_argument("--with-transformers-router", action="store_true",
                        help="a row with the fp32 output plan on transformers' own router")
    args = parser.parse_args(argv)
    steps = 20 if args.quick else args.steps
    torch.set_num_threads(1)
    configs = CONFIGS + ([TRANSFORMERS_ROUTER] if args.with_transformers_router else [])
    import transformers
    out(f"torch {torch.__version__}, transformers {transformers.__version__}, python "
        f"{platform.python_version()}, {platform.machine()}, {torch.get_num_threads()} thread")
    out(f"Mixtral hidden {HIDDEN}, {LAYERS} layers, {EXPERTS} experts, top-{TOP}, vocabulary "
        f"{VOCAB}; {steps} steps of {BATCH}x{SEQ} tokens, AdamW lr {LR}; routing on a held-out "
        f"batch of {HELD}x{SEQ} tokens x {LAYERS} layers; configurations in lockstep, order "
        "rotating each step")
    held = token_stream(HELD * SEQ, seed=2).view(HELD, SEQ)
    runs, before, after = train(configs, steps, held)
    for row in table(runs, before, after):
        out(row)
    out("")
    for row in router_alone(50 if args.quick else 400):
        out(row)
    return runs


if __name__ == "__main__":
    main()
