"""One rank of a gloo run of tensor parallelism through `adapters.tp.parallelize_module`.

`python -m torch.distributed.run --nproc_per_node N -m tests.workers.tp MODE OUTDIR [ARGS]`;
each rank writes OUTDIR/MODE-rank{R}.json:

- gaps [BLOCKS D HIDDEN REPEATS SEEDS]: residual bf16 MLP blocks, TP=N against one rank under the
  same applied plan, with comm=bf16 and comm=fp32 on the Linear layers: output and gradient
  gaps, audit's reductions, thread CPU time per step and bytes reduced per step;
- fp8: Linear layers in fp8 (tensorwise) beside an fp32 router, against torchao's fp8 styles
  applied by hand on the same modules;
- fsdp: FSDP2 + TP on a 2 x 2 mesh (4 ranks), sequence-parallel LayerNorms, 3 SGD steps;
- checks: each finding of check(model, "tp", ...) against what a real run does (4 ranks);
- loops: a Hugging Face Llama, torch.compile, activation checkpointing, no_grad, DCP.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize
from torch.utils._python_dispatch import TorchDispatchMode

from precision_annot import annotate, apply, audit, check
from precision_annot._src.dtypes import dtype_name
from precision_annot.adapters import fsdp, tp
from tests.workers import leave

# -- models ---------------------------------------------------------------------------------------


class Block(nn.Module):
    """x + down(gelu(up(norm(x)))), the norm optional."""

    def __init__(self, d: int, hidden: int, norm: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d) if norm else None
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x) if self.norm is not None else x
        return x + self.down(nn.functional.gelu(self.up(h)))


class Blocks(nn.Module):
    def __init__(self, n: int, d: int, hidden: int, norm: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, hidden, norm) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def mlp_plan(n: int) -> dict[str, Any]:
    """Megatron's MLP split: up column-parallel, down row-parallel."""
    out: dict[str, Any] = {}
    for i in range(n):
        out[f"blocks.{i}.up"] = ColwiseParallel()
        out[f"blocks.{i}.down"] = RowwiseParallel()
    return out


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward: the output and every parameter's full gradient (fp64)."""
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.float().square().mean().backward()
    grads = {n: full(p.grad).detach().double() for n, p in model.named_parameters()
             if p.grad is not None}
    return full(out).detach().double(), grads


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def grad_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    num = sum(float((a[k] - b[k]).square().sum()) for k in b)
    den = sum(float(b[k].square().sum()) for k in b)
    return (num / den) ** 0.5


class Collectives(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Every collective reaching dispatch (DTensor's functional ones, FSDP's c10d ones):
    (op, dtype, elements)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.calls: list[tuple[str, str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if func.namespace in ("_c10d_functional", "c10d") and name not in (
                "wait_tensor", "_wrap_tensor_autograd") and args:
            first = args[0][0] if isinstance(args[0], (list, tuple)) and args[0] else args[0]
            if isinstance(first, torch.Tensor):
                self.calls.append((name, dtype_name(first.dtype), first.numel()))
        return func(*args, **(kwargs or {}))

    def reduced_bytes(self) -> int:
        sizes = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}
        return sum(n * sizes.get(d, 0) for op, d, n in self.calls
                   if op.startswith(("all_reduce", "reduce_scatter", "allreduce")))


@contextmanager
def quiet() -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


# -- gaps: TP=N against one rank ------------------------------------------------------------------

def gaps(mesh: DeviceMesh, args: list[str]) -> dict[str, Any]:
    defaults = ["12", "64", "256", "0", "1"]  # blocks, width, hidden, timed steps, seeds
    n, d, hidden, repeats, seeds = (int(a) for a in [*args, *defaults[len(args):]])
    torch.manual_seed(0)
    base = Blocks(n, d, hidden)
    x = torch.randn(16, d)
    reference = step(copy.deepcopy(base), x)  # fp32 throughout

    def planned(comm: str) -> nn.Module:
        model = copy.deepcopy(base)
        annotate(model, {nn.Linear: f"comm={comm}"})
        return apply(model, default="bf16-mixed")

    one = {c: step(planned(c), x) for c in ("bf16", "fp32")}
    # a second single-rank run whose GEMMs sum in another order (fp32 GEMMs of the bf16
    # operands, as the planned styles compute): what one rank differs from itself by
    reorder = step(wide(planned("fp32")), x)
    out: dict[str, Any] = {
        "world": mesh.size(),
        "bf16_vs_fp32": [gap(one["bf16"][0], reference[0]),
                         grad_gap(one["bf16"][1], reference[1])],
    }
    models = {}
    for comm in ("bf16", "fp32"):
        model = planned(comm)
        tp.parallelize_module(model, mesh, mlp_plan(n))
        models[comm] = model
        got = step(model, x)
        out[comm] = [gap(got[0], one[comm][0]), grad_gap(got[1], one[comm][1])]
        with audit(model) as report:
            step(model, x)
        out[f"{comm}_audit"] = {
            "divergences": [str(v) for v in report.divergences],
            "down_reduced": sorted(dtype_name(t) for t in report["blocks.1.down"].reduced_in()),
            "up_reduced": sorted(dtype_name(t) for t in
                                 report["blocks.1.up"].reduced_in("backward")),
            "placements": report["blocks.1.down"].placements,
        }
        out[f"{comm}_reduced_in"] = {k: dtype_name(v) for k, v in
                                     tp.reduced_in(model).items() if k.startswith("blocks.1.")}
        log = Collectives()
        with log:
            step(model, x)
        out[f"{comm}_bytes"] = log.reduced_bytes()
    out["self_gap"] = [gap(reorder[0], one["fp32"][0]), grad_gap(reorder[1], one["fp32"][1])]
    if repeats:
        out["cost"] = cost(models, x, repeats)
    out["seeds"] = [[*out["bf16"], *out["fp32"], *out["self_gap"]]]
    out["seeds"] += [seed_gaps(mesh, n, d, hidden, seed) for seed in range(1, seeds)]
    out["sequence"] = sequence(mesh)
    return out


def sequence(mesh: DeviceMesh) -> dict[str, Any]:
    """Sequence parallel (fp32 LayerNorm islands, row-parallel Linears with a bias and a
    sequence-sharded output), comm=fp32, against one rank: the gradient gap of each
    parameter, under the planned styles and under torch's; and audit of an fp32 island whose
    column-parallel output is gathered in TP's output hook."""
    torch.manual_seed(0)
    base = Blocks(1, 16, 32, norm=True)
    x = torch.randn(4, 8, 16)
    world, rank = mesh.size(), mesh.get_local_rank()

    def planned() -> nn.Module:
        model = copy.deepcopy(base)
        annotate(model, {nn.LayerNorm: "fp32", nn.Linear: "comm=fp32"})
        return apply(model, default="bf16-mixed")

    one = step(planned(), x)
    out: dict[str, Any] = {}
    for name, parallelize in (("ours", tp.parallelize_module), ("torch", torch_parallelize)):
        model = parallelize(planned(), mesh, sp_plan(1))
        model.zero_grad(set_to_none=True)
        local = model(x.chunk(world, dim=1)[rank])
        # each rank's loss is its shard's share of the mean: the TP ranks' gradients add up
        (local.float().square().mean() / world).backward()
        got = full(DTensor.from_local(local, mesh, (Shard(1),))).detach().double()
        out[name] = {"out": gap(got, one[0]), **{
            k: gap(full(p.grad).double(), one[1][k]) for k, p in model.named_parameters()}}
    # an fp32 island, column-parallel, its output gathered (all-gathered in TP's output hook)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    annotate(model, {"1": "fp32"})
    apply(model, default="bf16-mixed")
    tp.parallelize_module(model, mesh, {"1": ColwiseParallel(output_layouts=Replicate())})
    with audit(model) as report:
        model(torch.randn(4, 16)).float().sum().backward()
    out["gathered_divergences"] = [str(v) for v in report.divergences]
    return out


def seed_gaps(mesh: DeviceMesh, n: int, d: int, hidden: int, seed: int) -> list[float]:
    """Another model and batch: [bf16 output gap, bf16 gradient gap, fp32 ..., one rank
    against itself ...]."""
    torch.manual_seed(seed)
    base = Blocks(n, d, hidden)
    x = torch.randn(16, d)
    found: list[float] = []
    for comm in ("bf16", "fp32"):
        model = copy.deepcopy(base)
        annotate(model, {nn.Linear: f"comm={comm}"})
        apply(model, default="bf16-mixed")
        one = step(copy.deepcopy(model), x)
        if comm == "fp32":
            reorder = step(wide(copy.deepcopy(model)), x)
        got = step(tp.parallelize_module(model, mesh, mlp_plan(n)), x)
        found += [gap(got[0], one[0]), grad_gap(got[1], one[1])]
    return [*found, gap(reorder[0], one[0]), grad_gap(reorder[1], one[1])]


def _wide_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    compute = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype
    with torch.autocast("cpu", enabled=False):
        y = nn.functional.linear(x.to(compute).float(), module.weight.to(compute).float(),
                                 module.bias.to(compute).float())
    return y.to(compute)


def wide(model: nn.Module) -> nn.Module:
    """Every Linear's GEMM in fp32 from its bf16-rounded operands, rounded once after."""
    import functools

    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.forward = functools.partial(_wide_forward, module)  # type: ignore[method-assign]
    return model


def cost(models: dict[str, nn.Module], x: torch.Tensor, repeats: int) -> dict[str, float]:
    """Thread CPU and wall time of one forward and backward, per comm, alternating runs:
    medians, in ms."""
    times: dict[str, list[float]] = {f"{c}_{k}": [] for c in models for k in ("cpu", "wall")}
    for comm in models:
        step(models[comm], x)  # warm up
    for _ in range(repeats):
        for comm, model in models.items():
            dist.barrier()
            cpu, wall = time.thread_time(), time.perf_counter()
            model.zero_grad(set_to_none=True)
            model(x).float().square().mean().backward()
            times[f"{comm}_cpu"].append((time.thread_time() - cpu) * 1e3)
            times[f"{comm}_wall"].append((time.perf_counter() - wall) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


# -- fp8: against torchao's fp8 styles by hand ----------------------------------------------------

class Routed(nn.Module):
    """up, down in fp8 around a router kept in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64)
        self.router = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.router(x + self.down(torch.relu(self.up(x))))


def fp8(mesh: DeviceMesh, args: list[str]) -> dict[str, Any]:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
    )

    torch.manual_seed(0)
    base = Routed()
    x = torch.randn(32, 64)
    ours = copy.deepcopy(base)
    annotate(ours, {nn.Linear: "compute=fp8,comm=bf16", "router": "fp32"})
    apply(ours, default="bf16-mixed")
    with quiet() as caught:
        tp.parallelize_module(ours, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel(),
                                           "router": Float8ColwiseParallel()})
    theirs = convert_to_float8_training(
        copy.deepcopy(base), module_filter_fn=lambda m, fqn: fqn in ("up", "down"),
        config=Float8LinearConfig.from_recipe_name("tensorwise"))
    torch_parallelize(theirs, mesh, {"up": Float8ColwiseParallel(),
                                     "down": Float8RowwiseParallel(), "router": ColwiseParallel()})

    def by_hand(x: torch.Tensor) -> torch.Tensor:
        """What the plan says, written out: bf16 autocast around the fp8 layers (torchao on a
        CPU reads CUDA's autocast only, so the input is handed in bf16 as CUDA's would be),
        the router in fp32, its output back in bf16."""
        h = x.to(torch.bfloat16)
        with torch.autocast("cpu", torch.bfloat16):
            h = h + theirs.down(torch.relu(theirs.up(h)))
        return theirs.router(h.float()).to(torch.bfloat16)  # type: ignore[no-any-return]

    mine = step(ours, x)
    theirs_out = step_fn(theirs, by_hand, x)
    with audit(ours) as report:
        step(ours, x)
    return {
        "styles": {n: type(s).__name__ for n, s in tp.styles(ours).items()},
        "warnings": [str(w.message) for w in caught],
        "equal_out": bool(torch.equal(mine[0], theirs_out[0])),
        "equal_grads": {k: bool(torch.equal(mine[1][k], theirs_out[1][k])) for k in mine[1]},
        "fp8_gemms": {n: dict(report[n].fp8_gemms) for n in ("up", "down", "router")},
        "divergences": [str(v) for v in report.divergences],
    }


def step_fn(model: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = fn(x)
    out.float().square().mean().backward()
    return full(out).detach().double(), {n: full(p.grad).detach().double()
                                         for n, p in model.named_parameters()}


# -- FSDP2 + TP on a 2 x 2 mesh -------------------------------------------------------------------

def sp_plan(n: int) -> dict[str, Any]:
    """Sequence parallel: norms on sequence shards, up gathering its input, down scattering
    its output over the sequence."""
    out: dict[str, Any] = {}
    for i in range(n):
        out[f"blocks.{i}.norm"] = SequenceParallel()
        out[f"blocks.{i}.up"] = ColwiseParallel(input_layouts=Shard(1))
        out[f"blocks.{i}.down"] = RowwiseParallel(output_layouts=Shard(1))
    return out


def fsdp_tp(mesh2: DeviceMesh, args: list[str]) -> dict[str, Any]:
    dp, tp_mesh = mesh2["dp"], mesh2["tp"]
    torch.manual_seed(0)
    base = Blocks(2, 16, 32, norm=True)
    batches = [torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(10 + i))
               for i in range(dp.size())]
    mine = batches[dp.get_local_rank()].chunk(tp_mesh.size(), dim=1)[tp_mesh.get_local_rank()]

    def build(ours: bool) -> nn.Module:
        model = copy.deepcopy(base)
        annotate(model, {"blocks.1.norm": "comm=bf16"})
        apply(model, default="bf16-mixed")
        if ours:
            tp.parallelize_module(model, tp_mesh, sp_plan(2))
        else:
            torch_parallelize(model, tp_mesh, sp_plan(2))
        return fsdp.fully_shard(model, mesh=dp)

    out: dict[str, Any] = {}
    for ours in (False, True):
        model = build(ours)
        log = Collectives()
        with log:
            model(mine).float().square().mean().backward()
        norm = base.blocks[0].norm.weight.numel()
        out["ours" if ours else "torch"] = sorted({
            (op, d) for op, d, n in log.calls if n == norm and op.startswith("all_reduce")})
    model = build(True)
    out["hooks"] = sorted(repr(h) for m in model.modules() for h in m._forward_pre_hooks.values()
                          if type(h).__name__ == "ReplicatedGrads")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = model(mine).float().square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out["losses"] = losses
    out["params"] = {n: full(p).detach().double().flatten().tolist()
                     for n, p in model.named_parameters()}
    out["reference"] = reference_sgd(base, batches, tp_mesh.size())
    return out


def reference_sgd(base: nn.Module, batches: list[torch.Tensor], tp_size: int
                  ) -> dict[str, list[float]]:
    """The same 3 steps in one process, unsharded: each TP rank's loss is the mean over its
    sequence shard and the TP ranks' gradients add up, so the loss is `tp_size` times the
    mean; the data-parallel ranks' losses are averaged."""
    model = copy.deepcopy(base)
    annotate(model, {"blocks.1.norm": "comm=bf16"})
    apply(model, default="bf16-mixed")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        loss = sum(model(b).float().square().mean() * tp_size for b in batches) / len(batches)
        loss.backward()  # type: ignore[union-attr]
        opt.step()
    return {n: p.detach().double().flatten().tolist() for n, p in model.named_parameters()}


# -- checks: each finding against a real run ------------------------------------------------------

class Embedded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.proj = nn.Linear(32, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(ids))


def codes(model_or_plan: Any, config: dict[str, Any]) -> list[list[str]]:
    return [[f.severity, f.code, f.module] for f in check(model_or_plan, "tp", config)
            if f.code.startswith("tp-")]


def checks(mesh: DeviceMesh, args: list[str]) -> dict[str, Any]:
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel

    out: dict[str, Any] = {}
    world = mesh.size()
    # tp-fp8-shard: mxfp8 Linears whose local shard is not a multiple of 32
    for hidden in (64, 128):
        torch.manual_seed(0)
        model = Blocks(1, 64, hidden)
        annotate(model, {nn.Linear: "compute=mxfp8,comm=bf16"})
        apply(model, default="bf16-mixed")
        config = {"parallelize_plan": mlp_plan(1), "tp_degree": world}
        found = codes(model, config)
        with quiet():
            tp.parallelize_module(model, mesh, mlp_plan(1))
        try:
            step(model, torch.randn(64, 64))
            ran = "ok"
        except (RuntimeError, ValueError, AssertionError) as e:
            ran = f"{type(e).__name__}: {str(e)[:200]}"
        out[f"mx{hidden}"] = {"findings": found, "ran": ran}
    # tp-fp8-style-not-fp8: torchao's fp8 style on an fp32 router
    torch.manual_seed(0)
    model = Routed()
    annotate(model, {"router": "fp32"})
    apply(model, default="bf16-mixed")
    config = {"parallelize_plan": {"router": Float8ColwiseParallel()}, "tp_degree": world}
    out["router_findings"] = codes(model, config)
    plain = copy.deepcopy(model)
    try:
        torch_parallelize(plain, mesh, {"router": Float8ColwiseParallel()})
        out["router_torch"] = "ok"
    except ValueError as e:
        out["router_torch"] = str(e)
    with quiet() as caught:
        tp.parallelize_module(model, mesh, {"router": Float8ColwiseParallel()})
    out["router_ours"] = [type(model.router).__name__, [str(w.message) for w in caught]]
    # tp-comm-wire-only: an fp8 row-parallel Linear planned comm=fp32
    torch.manual_seed(0)
    model = Blocks(1, 64, 128)
    annotate(model, {nn.Linear: "compute=fp8,comm=fp32"})
    apply(model, default="bf16-mixed")
    out["wire_findings"] = codes(model, {"parallelize_plan": mlp_plan(1)})
    with quiet():
        tp.parallelize_module(model, mesh, mlp_plan(1))
    with audit(model) as report:
        step(model, torch.randn(16, 64))
    out["wire_ran"] = sorted(dtype_name(d) for d in report["blocks.0.down"].reduced_in())
    out["wire_divergences"] = [str(v) for v in report.divergences if v.field == "comm"]
    # tp-comm-wire-only (info): a row-parallel Embedding's sum is exact in bf16
    torch.manual_seed(0)
    model = Embedded()
    apply(model, default="bf16-mixed")
    one = copy.deepcopy(model)
    embed_plan = {"embed": RowwiseParallel(input_layouts=__import__(
        "torch.distributed.tensor", fromlist=["Replicate"]).Replicate())}
    out["embed_findings"] = codes(model, {"parallelize_plan": embed_plan})
    with quiet():
        tp.parallelize_module(model, mesh, embed_plan)
    ids = torch.randint(0, 64, (8, 5))
    out["embed_equal"] = bool(torch.equal(full(model(ids)), one(ids)))
    # tp-plan-unmatched: torch skips the key, the module stays whole
    torch.manual_seed(0)
    model = Blocks(1, 64, 128)
    apply(model, default="bf16-mixed")
    bad = {"blocks.0.upp": ColwiseParallel()}
    out["unmatched_findings"] = codes(model, {"parallelize_plan": bad})
    with quiet() as caught:
        torch_parallelize(model, mesh, bad)
    out["unmatched_torch"] = [isinstance(model.blocks[0].up.weight, DTensor),
                              [str(w.message)[:120] for w in caught]]
    return out


# -- users' loops: a Hugging Face Llama, torch.compile, checkpointing, DCP ------------------------

def llama_plan(layers: int) -> dict[str, Any]:
    """Megatron's split of a Llama: q, k, v, gate and up column-parallel; o and down
    row-parallel (each rank runs its own heads)."""
    out: dict[str, Any] = {}
    for i in range(layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "mlp.gate_proj", "mlp.up_proj"):
            out[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            out[f"model.layers.{i}.{name}"] = RowwiseParallel()
    return out


def llama(mesh: DeviceMesh) -> dict[str, Any]:
    """TP=N against one rank, the plan's islands (transformers' own) kept, comm=bf16 and
    comm=fp32 on the Linear layers."""
    from precision_annot.adapters import transformers as hf
    from tests.adapters.hf_models import build

    base, batch = build("llama")

    def planned(comm: str) -> nn.Module:
        model = copy.deepcopy(base)
        annotate(model, hf.rules(model))
        annotate(model, {nn.Linear: f"comm={comm}"})
        return apply(model, default="bf16-mixed")

    def run(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        out = model(**batch)
        out.loss.backward()
        return out.logits.detach().double(), {n: full(p.grad).double()
                                              for n, p in model.named_parameters()}

    result: dict[str, Any] = {}
    for comm in ("bf16", "fp32"):
        one = run(planned(comm))
        model = planned(comm)
        tp.parallelize_module(model, mesh, llama_plan(2))
        with audit(model) as report:
            got = run(model)
        result[comm] = {"logits": gap(got[0], one[0]), "grads": grad_gap(got[1], one[1]),
                        "divergences": [str(v) for v in report.divergences]}
    return result


def replicated_grads(mesh: DeviceMesh) -> dict[str, Any]:
    """TP alone, sequence-parallel LayerNorms stored in bf16 with comm=fp32: the norms'
    partial gradients are all-reduced in fp32 as they arrive (torch all-reduces them in bf16
    at the optimizer step), and the ranks' weights agree after a step."""
    torch.manual_seed(0)
    model = Blocks(1, 16, 32, norm=True)
    apply(model, default="bf16,comm=fp32")
    tp.parallelize_module(model, mesh, sp_plan(1))
    log = Collectives()
    with log:
        model(torch.randn(2, 4, 16)).float().square().mean().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    weight = model.blocks[0].norm.weight  # type: ignore[union-attr]
    local = weight.to_local().detach().clone()
    everyone = [torch.zeros_like(local) for _ in range(mesh.size())]
    dist.all_gather(everyone, local)
    return {"reduced": sorted({(op, d) for op, d, n in log.calls if n == local.numel()}),
            "grad": [dtype_name(weight.grad.dtype), str(weight.grad.placements[0])],
            "agree": all(torch.equal(everyone[0], w) for w in everyone)}


def inductor(mesh: DeviceMesh, outdir: Path) -> dict[str, Any]:
    """Sequence parallel (a row-parallel bias, an fp32 LayerNorm), comm=fp32, compiled with
    inductor against eager: inductor skips a bf16 rounding whose result a fused kernel reads
    (the planned styles' roundings, and every boundary's exit cast), unless
    `emulate_precision_casts` is set. Gaps (output, gradients) for both settings."""
    import torch._inductor.config as inductor_config

    # each rank its own cache: two ranks compiling one kernel wait on one file lock
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(outdir / f"inductor{dist.get_rank()}")
    torch.manual_seed(0)
    base = Blocks(1, 16, 32, norm=True)
    x = torch.randn(4, 8, 16).chunk(mesh.size(), dim=1)[mesh.get_local_rank()]

    def build() -> nn.Module:
        model = copy.deepcopy(base)
        annotate(model, {nn.LayerNorm: "fp32", nn.Linear: "comm=fp32"})
        apply(model, default="bf16-mixed")
        return tp.parallelize_module(model, mesh, sp_plan(1))

    eager = step(build(), x)
    out = {}
    saved = inductor_config.emulate_precision_casts
    try:
        for emulate in (False, True):
            inductor_config.emulate_precision_casts = emulate
            torch._dynamo.reset()
            model = build()
            got = step_fn(model, torch.compile(model, fullgraph=True), x)
            out[str(emulate)] = [gap(got[0], eager[0]), grad_gap(got[1], eager[1])]
    finally:
        inductor_config.emulate_precision_casts = saved
    return out


def loops(mesh: DeviceMesh, args: list[str]) -> dict[str, Any]:
    """What users run around a model: a Llama, torch.compile(fullgraph=True), activation
    checkpointing, a forward without gradients, torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.utils.checkpoint import checkpoint

    def build() -> nn.Module:
        torch.manual_seed(0)
        model = Blocks(2, 16, 32)
        annotate(model, {nn.Linear: "comm=fp32"})
        apply(model, default="bf16-mixed")
        return tp.parallelize_module(model, mesh, mlp_plan(2))

    x = torch.randn(4, 16)
    eager = step(build(), x)
    torch._dynamo.reset()
    compiled = build()
    got = step_fn(compiled, torch.compile(compiled, backend="aot_eager", fullgraph=True), x)
    checkpointed = build()

    def through_checkpoints(h: torch.Tensor) -> torch.Tensor:
        for block in checkpointed.blocks:  # type: ignore[union-attr]
            h = checkpoint(block, h, use_reentrant=False)
        return h

    ckpt = step_fn(checkpointed, through_checkpoints, x)
    model = build()
    with torch.no_grad():
        evaluated = model(x)
    path = Path(args[0]) / "dcp"
    dcp.save(model.state_dict(), checkpoint_id=str(path))
    other = build()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    state = other.state_dict()
    dcp.load(state, checkpoint_id=str(path))
    other.load_state_dict(state)
    return {
        "replicated": replicated_grads(mesh),
        "inductor": inductor(mesh, Path(args[0])),
        "llama": llama(mesh),
        "compiled": bool(torch.equal(got[0], eager[0]))
        and all(torch.equal(got[1][k], eager[1][k]) for k in eager[1]),
        "checkpointed": all(torch.equal(ckpt[1][k], eager[1][k]) for k in eager[1]),
        "no_grad": bool(torch.equal(full(evaluated).double(), eager[0])),
        "dcp": bool(torch.equal(full(other(x)).double(), eager[0])),
        "dcp_dtypes": sorted({dtype_name(p.dtype) for p in other.parameters()}),
    }


MODES: dict[str, Callable[[DeviceMesh, list[str]], dict[str, Any]]] = {
    "gaps": gaps, "fp8": fp8, "checks": checks, "loops": loops}


def main() -> None:
    mode, outdir, args = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if mode == "loops":
        args = [str(outdir)]
    if mode == "fsdp":
        mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2),
                                mesh_dim_names=("dp", "tp"))
        result = fsdp_tp(mesh, args)
    else:
        result = MODES[mode](init_device_mesh("cpu", (dist.get_world_size(),)), args)
    (outdir / f"{mode}-rank{rank}.json").write_text(json.dumps(result))
    leave()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
