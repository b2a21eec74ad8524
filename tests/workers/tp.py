"""One rank of a gloo run of tensor parallelism through `adapters.tp.parallelize_module`.

`python -m torch.distributed.run --nproc_per_node N -m tests.workers.tp MODE OUTDIR [ARGS]`;
each rank writes OUTDIR/MODE-rank{R}.json:

- gaps [BLOCKS D HIDDEN REPEATS SEEDS]: residual bf16 MLP blocks, TP=N against one rank under the
  same applied plan, with comm=bf16 and comm=fp32 on the Linear layers: output and gradient
  gaps, audit's reductions, thread CPU time per step and bytes reduced per step; the reductions
  of a column-parallel Linear whose input arrives in fp32; the `FAST` scenarios of the matrix;
- fp8: Linear layers in fp8 (tensorwise) beside an fp32 router, against torchao's fp8 styles
  applied by hand on the same modules;
- fsdp: FSDP2 + TP on a 2 x 2 mesh (4 ranks), sequence-parallel LayerNorms, 3 SGD steps; an
  Embedding in front of a block, one step, against one process;
- matrix: every `SCENARIOS` run, what it did recorded by hand, for check(model, "tp", ...) to
  be judged on (2 ranks);
- mx: mxfp8 MLPs of 6 hidden sizes on TP 2 and 4 (4 ranks): which run, and what check says;
- loops: a Hugging Face Llama, torch.compile, activation checkpointing, no_grad, DCP.
"""

from __future__ import annotations

import copy
import dataclasses
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
    out["fp32_input"] = fp32_input(mesh)
    out["matrix"] = {s.name: run_scenario(s, mesh) for s in SCENARIOS if s.name in FAST}
    return out


def fp32_input(mesh: DeviceMesh) -> dict[str, Any]:
    """comm=bf16 under bf16 autocast, the column-parallel Linear's input arriving in fp32 (the
    residual stream behind an Embedding, as in a Llama): the reducing collectives recorded by
    hand (phase, dtype), against what `tp.reduced_in` and `audit` say ran, under this
    adapter and under torch's own parallelize_module."""
    out: dict[str, Any] = {}
    ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(1))
    for name, parallelize in (("ours", tp.parallelize_module), ("torch", torch_parallelize)):
        torch.manual_seed(0)
        model = apply(Tokens(32, 64), default="bf16-mixed,comm=bf16")
        parallelize(model, mesh, mlp_plan(1))
        log = Collectives()
        with audit(model) as report, log:
            h = model(ids)
            forward = len(log.calls)
            h.float().square().mean().backward()
        out[name] = {
            "ran": [[phase, d] for i, (op, d, n) in enumerate(log.calls)
                    if op.startswith("all_reduce")
                    for phase in ["forward" if i < forward else "backward"]],
            "reduced_in": {k: dtype_name(v) for k, v in tp.reduced_in(model).items()},
            "audit": {m: sorted(dtype_name(d) for d in report[m].reduced_in(phase))
                      for m, phase in (("blocks.0.up", "backward"),
                                       ("blocks.0.down", "forward"))},
            "divergences": [str(v) for v in report.divergences if v.field == "comm"],
        }
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
    out["embedding"] = embedding_grads(mesh2)
    return out


def embedding_grads(mesh2: DeviceMesh) -> dict[str, Any]:
    """An Embedding in front of a block (bf16-mixed), TP over the block's MLP and FSDP2 over
    the data-parallel ranks, against the same step in one process: the gap of every gradient
    (relative, over all parameters), and the dtype the lookup handed back under FSDP2."""
    dp, tp_mesh = mesh2["dp"], mesh2["tp"]
    torch.manual_seed(0)
    base = Tokens(16, 32)
    batches = [torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(20 + i))
               for i in range(dp.size())]
    model = apply(copy.deepcopy(base), default="bf16-mixed")
    tp.parallelize_module(model, tp_mesh, mlp_plan(1))
    fsdp.fully_shard(model, mesh=dp)
    seen: list[torch.dtype] = []
    model.embed.register_forward_hook(lambda m, a, o: seen.append(o.dtype))
    model(batches[dp.get_local_rank()]).float().square().mean().backward()
    got = {n: full(p.grad).detach().double() for n, p in model.named_parameters()}
    one = apply(copy.deepcopy(base), default="bf16-mixed")
    (sum(one(b).float().square().mean() for b in batches) / len(batches)).backward()
    want = {n: p.grad.double() for n, p in one.named_parameters()}
    return {"grads": grad_gap(got, want), "lookup": dtype_name(seen[0])}


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


# -- check(model, "tp"): the scenarios its findings are judged on ---------------------------

class Embedded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.proj = nn.Linear(32, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(ids))


class OwnLinear(nn.Linear):
    """A Linear subclass with its own forward (the planned styles cannot replace it)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(input, self.weight, self.bias)


def own(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OwnLinear
    return model


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One TP run that `check(model, "tp", ...)` is asked about beforehand.

    Attributes:
        name: unique.
        model: () -> the model, annotated (seeded: every call builds the same).
        default: the plan's default (`apply(model, default=...)`).
        tp_plan: () -> the TP plan.
        rows: the input's leading shape (tokens), its last dimension the model's width.
        meant: the modules the TP plan means to shard (a misspelled key's too).
        tokens: the model takes token ids (a vocabulary of 64).
        sequence: each rank is handed its shard of the sequence (dimension 1).
        fp8: needs torchao.
    """

    name: str
    model: Callable[[], nn.Module]
    default: str
    tp_plan: Callable[[], dict[str, Any]]
    rows: tuple[int, ...] = (8,)
    meant: tuple[str, ...] = ()
    tokens: bool = False
    sequence: bool = False
    fp8: bool = False

    def build(self) -> nn.Module:
        torch.manual_seed(0)
        return apply(self.model(), default=self.default)

    def sample(self, width: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1)
        if self.tokens:
            return torch.randint(0, 64, self.rows, generator=gen)
        return torch.randn(*self.rows, width, generator=gen)


def _blocks(d: int = 32, hidden: int = 64, norm: bool = True,
            rules: dict[Any, str] | None = None, subclass: bool = False
            ) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        model = Blocks(1, d, hidden, norm=norm)
        if rules:
            annotate(model, rules)
        return own(model) if subclass else model

    return build


class Tokens(Blocks):
    """Blocks behind an Embedding: under bf16 autocast the residual stream is fp32 (the
    lookup's dtype), as in a Hugging Face Llama, so the first block's norm, which autocast
    leaves in its input's dtype, hands its Linear an fp32 input."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__(1, d, hidden, norm=True)
        self.embed = nn.Embedding(64, d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(self.embed(ids))


def _tokens(d: int = 32, hidden: int = 64, rules: dict[Any, str] | None = None,
            subclass: bool = False) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        model = Tokens(d, hidden)
        if rules:
            annotate(model, rules)
        return own(model) if subclass else model

    return build


def _routed(rules: dict[Any, str]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        model = Routed()
        annotate(model, rules)
        return model

    return build


def _mlp() -> Callable[[], dict[str, Any]]:
    return lambda: {"blocks.0.up": ColwiseParallel(), "blocks.0.down": RowwiseParallel()}


def _keys(plan: dict[str, str]) -> Callable[[], dict[str, Any]]:
    """A TP plan from style names (layouts Replicate where the name says so)."""
    def make() -> dict[str, Any]:
        from torch.distributed.tensor.parallel import SequenceParallel

        def style(name: str) -> Any:
            if name == "sp":
                return SequenceParallel()
            if name.startswith("float8"):
                from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel

                return Float8ColwiseParallel(output_layouts=Replicate())
            cls = ColwiseParallel if name.startswith("col") else RowwiseParallel
            if name.endswith("-sp"):
                return cls(input_layouts=Shard(1)) if cls is ColwiseParallel else cls(
                    output_layouts=Shard(1))
            if name.endswith("-rep"):
                return cls(output_layouts=Replicate()) if cls is ColwiseParallel else cls(
                    input_layouts=Replicate())
            return cls()

        return {k: style(v) for k, v in plan.items()}

    return make


MLP = ("blocks.0.up", "blocks.0.down")
FP8_ROUTER = {nn.Linear: "compute=fp8", "router": "fp32"}

SCENARIOS = [
    # comm=bf16 under bf16 autocast, the input arriving in fp32 (autocast runs the norm in
    # fp32): the column-parallel input gradient was all-reduced in fp32
    Scenario("comm-bf16-fp32-input", _tokens(), "bf16-mixed,comm=bf16", _mlp(), meant=MLP,
             tokens=True),
    Scenario("comm-bf16-bf16-input", _blocks(), "bf16-mixed,comm=bf16", _mlp(), meant=MLP),
    Scenario("comm-fp32", _blocks(), "bf16-mixed", _mlp(), meant=MLP),
    Scenario("fp32", _blocks(), "fp32", _mlp(), meant=MLP),
    Scenario("bf16-true", _blocks(), "bf16", _mlp(), meant=MLP),
    Scenario("fp32-island-row", _blocks(rules={"blocks.0.down": "fp32"}),
             "bf16-mixed,comm=bf16", _mlp(), meant=MLP),
    Scenario("norm-island", _blocks(rules={nn.LayerNorm: "fp32"}), "bf16-mixed,comm=bf16",
             _mlp(), meant=MLP),
    Scenario("sequence-parallel", _blocks(rules={nn.LayerNorm: "fp32"}), "bf16-mixed",
             _keys({"blocks.0.norm": "sp", "blocks.0.up": "col-sp", "blocks.0.down": "row-sp"}),
             rows=(2, 4), meant=MLP, sequence=True),
    Scenario("sequence-parallel-bf16-norm", _blocks(rules={nn.LayerNorm: "bf16"}),
             "bf16-mixed,comm=bf16",
             _keys({"blocks.0.norm": "sp", "blocks.0.up": "col-sp", "blocks.0.down": "row-sp"}),
             rows=(2, 4), meant=MLP, sequence=True),
    # uneven shards: 15 hidden features on 2 ranks
    Scenario("uneven-comm-fp32", _blocks(16, 15), "bf16-mixed", _mlp(), meant=MLP),
    Scenario("uneven-comm-bf16", _blocks(16, 15), "bf16-mixed,comm=bf16", _mlp(), meant=MLP),
    Scenario("uneven-fp32", _blocks(16, 15), "fp32", _mlp(), meant=MLP),
    Scenario("uneven-subclass", _blocks(16, 15, subclass=True), "fp32", _mlp(), meant=MLP),
    Scenario("uneven-column-only", _blocks(16, 15, subclass=True), "fp32",
             _keys({"blocks.0.up": "col-rep"}), meant=("blocks.0.up",)),
    # styles torch refuses, keys naming no module
    Scenario("colwise-norm-island", _blocks(rules={nn.LayerNorm: "fp32"}), "bf16-mixed",
             _keys({"blocks.0.norm": "col-rep"}), meant=("blocks.0.norm",)),
    Scenario("rowwise-norm", _blocks(), "bf16-mixed", _keys({"blocks.0.norm": "row-rep"}),
             meant=("blocks.0.norm",)),
    Scenario("unmatched-pair", _blocks(), "bf16-mixed",
             _keys({"blocks.0.up": "col", "blocks.0.dwn": "row"}), meant=MLP),
    Scenario("unmatched-pair-first", _blocks(), "bf16-mixed,comm=bf16",
             _keys({"blocks.0.upp": "col", "blocks.0.down": "row"}), meant=MLP),
    Scenario("unmatched-alone", _blocks(), "bf16-mixed", _keys({"blocks.0.upp": "col-rep"}),
             meant=("blocks.0.up",)),
    Scenario("unmatched-alone-row", _blocks(), "bf16-mixed", _keys({"blocks.0.dwn": "row-rep"}),
             meant=("blocks.0.down",)),
    Scenario("unmatched-extra", _blocks(), "bf16-mixed",
             _keys({"blocks.0.up": "col", "blocks.0.down": "row", "head": "col"}), meant=MLP),
    # comm a kept style cannot reduce in
    Scenario("fp8-comm-fp32", _tokens(64, 128, rules={nn.Linear: "compute=fp8"}),
             "bf16-mixed", _mlp(), rows=(32,), meant=MLP, tokens=True, fp8=True),
    Scenario("fp8-comm-bf16", _tokens(64, 128, rules={nn.Linear: "compute=fp8"}),
             "bf16-mixed,comm=bf16", _mlp(), rows=(32,), meant=MLP, tokens=True, fp8=True),
    Scenario("fp8-style-on-a-router", _routed(FP8_ROUTER), "bf16-mixed",
             _keys({"router": "float8"}), rows=(32,), meant=("router",), fp8=True),
    Scenario("subclass-comm-fp32", _tokens(subclass=True), "bf16-mixed", _mlp(), meant=MLP,
             tokens=True),
    Scenario("subclass-comm-bf16", _tokens(subclass=True), "bf16-mixed,comm=bf16", _mlp(),
             meant=MLP, tokens=True),
    Scenario("subclass-island-row", _blocks(rules={"blocks.0.down": "fp32"}, subclass=True),
             "bf16-mixed,comm=bf16", _mlp(), meant=MLP),
    Scenario("subclass-island-col-comm-bf16",
             _blocks(rules={"blocks.0.up": "compute=fp32,comm=bf16"}, subclass=True),
             "bf16-mixed,comm=bf16", _mlp(), meant=MLP),
    Scenario("subclass-comm-narrower", _blocks(rules={nn.Linear: "comm=bf16"}, subclass=True),
             "fp32", _mlp(), meant=MLP),
    Scenario("embedding-row", Embedded, "bf16-mixed", _keys({"embed": "row-rep"}),
             rows=(4, 5), meant=("embed",), tokens=True),
    Scenario("embedding-row-comm-bf16", Embedded, "bf16-mixed,comm=bf16",
             _keys({"embed": "row-rep"}), rows=(4, 5), meant=("embed",), tokens=True),
    # mxfp8 blocks of 32: 96 features are 3 blocks, which 2 ranks do not divide; 1 block runs
    Scenario("mxfp8-3-blocks", _blocks(64, 96, norm=False, rules={nn.Linear: "compute=mxfp8"}),
             "bf16-mixed,comm=bf16", _mlp(), rows=(64,), meant=MLP, fp8=True),
    Scenario("mxfp8-1-block", _blocks(64, 32, norm=False, rules={nn.Linear: "compute=mxfp8"}),
             "bf16-mixed,comm=bf16", _mlp(), rows=(64,), meant=MLP, fp8=True),
]


#: the scenarios the fast suite judges check on, in the one launch it makes ("gaps"): each
#: severity, and what 0.5 said wrong (the whole matrix is under `pytest -m slow`)
FAST = ("comm-bf16-fp32-input", "subclass-comm-bf16", "uneven-subclass", "colwise-norm-island",
        "unmatched-pair", "unmatched-alone", "embedding-row-comm-bf16", "unmatched-extra")


def _width(model: nn.Module) -> int:
    first = next(m for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding)))
    return first.in_features if isinstance(first, nn.Linear) else 0


def run_scenario(scenario: Scenario, mesh: DeviceMesh) -> dict[str, Any]:
    """What the run did, recorded by hand: whether it was refused (raised), every reducing
    collective (phase, dtype, elements), the modules meant to be sharded that were not, and
    the gap of the output and gradients to the same plan on one rank."""
    model = scenario.build()
    one = copy.deepcopy(model)
    x = scenario.sample(_width(model))
    if x.is_floating_point():  # every column-parallel layer owes its input's gradient
        x.requires_grad_(True)
    world = mesh.size() if scenario.sequence else 1
    # sequence parallel: each rank is handed its shard of the sequence
    x_local = x.chunk(world, dim=1)[mesh.get_local_rank()] if scenario.sequence else x
    x_local = x_local.detach().requires_grad_(x.requires_grad)
    log = Collectives()
    record: dict[str, Any] = {"refused": None, "forward": [], "backward": [], "unsharded": [],
                              "classes": {}, "gap": None, "skipped": skipped(model, scenario, mesh)}
    try:
        with quiet():
            tp.parallelize_module(model, mesh, scenario.tp_plan())
        model.zero_grad(set_to_none=True)
        with log:
            out = model(x_local)
            forward = len(log.calls)
            (out.float().square().mean() / world).backward()
    except Exception as e:  # a run that fails, however it fails, is refused
        record["refused"] = f"{type(e).__name__}: {str(e)[:200]}"
        return record
    for phase, calls in (("forward", log.calls[:forward]), ("backward", log.calls[forward:])):
        record[phase] = [[d, n] for op, d, n in calls
                         if op.startswith(("all_reduce", "reduce_scatter", "allreduce"))
                         and d in ("fp32", "bf16", "fp16")]
    named = dict(model.named_modules())
    record["unsharded"] = [n for n in scenario.meant
                           if n not in named or not isinstance(named[n].weight, DTensor)]
    record["classes"] = {n: type(named[n]).__name__ for n in scenario.meant if n in named}
    got = full(DTensor.from_local(out, mesh, (Shard(1),))) if scenario.sequence else full(out)
    one.zero_grad(set_to_none=True)
    ref = one(x.detach())
    ref.float().square().mean().backward()
    grads = {k: full(p.grad).double() for k, p in model.named_parameters() if p.grad is not None}
    want = {k: p.grad.double() for k, p in one.named_parameters() if p.grad is not None}
    record["gap"] = max(gap(got.double(), ref.double()),
                        grad_gap(grads, want) if grads.keys() == want.keys() else 1.0)
    return record


def skipped(model: nn.Module, scenario: Scenario, mesh: DeviceMesh) -> list[str]:
    """The TP plan's keys torch's own parallelize_module cannot resolve (it warns and skips
    them), asked with a style that only adds hooks, on a copy."""
    from torch.distributed.tensor.parallel import PrepareModuleInput

    out = []
    for key in scenario.tp_plan():
        with quiet() as caught:
            torch_parallelize(copy.deepcopy(model), mesh, {key: PrepareModuleInput()})
        if any("could not be resolved" in str(w.message) for w in caught):
            out.append(key)
    return out


def matrix(mesh: DeviceMesh, args: list[str]) -> dict[str, Any]:
    import importlib.util

    fp8 = importlib.util.find_spec("torchao") is not None
    return {s.name: run_scenario(s, mesh) for s in SCENARIOS if fp8 or not s.fp8}


def mx_shapes(mesh2: DeviceMesh, args: list[str]) -> dict[str, Any]:
    """mxfp8 MLPs (64 -> hidden -> 64) on TP 2 (the "tp" dimension of a 2 x 2 mesh of 4 ranks)
    and TP 4: whether each runs, and what check says beforehand."""
    out: dict[str, Any] = {}
    for mesh in (mesh2["tp"], init_device_mesh("cpu", (dist.get_world_size(),))):
        for hidden in MX_HIDDEN:
            model = _blocks(64, hidden, norm=False, rules={nn.Linear: "compute=mxfp8"})()
            torch.manual_seed(0)
            apply(model, default="bf16-mixed,comm=bf16")
            config = {"parallelize_plan": mlp_plan(1), "tp_degree": mesh.size()}
            found = [f.code for f in check(model, "tp", config) if f.severity == "error"]
            try:
                with quiet():
                    tp.parallelize_module(model, mesh, mlp_plan(1))
                step(model, torch.randn(64, 64))
                ran = "ok"
            except Exception as e:  # a run that fails, however it fails
                ran = f"{type(e).__name__}: {str(e)[:120]}"
            out[f"{mesh.size()}x{hidden}"] = {"errors": found, "ran": ran}
    return out


#: the hidden sizes of the mxfp8 shapes (multiples of 32: 1 to 8 blocks)
MX_HIDDEN = (32, 64, 96, 128, 192, 256)


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
    columns = [k for k, v in llama_plan(2).items() if isinstance(v, ColwiseParallel)]
    for comm in ("bf16", "fp32"):
        one = run(planned(comm))
        model = planned(comm)
        tp.parallelize_module(model, mesh, llama_plan(2))
        log = Collectives()
        with audit(model) as report, log:
            got = run(model)
        result[comm] = {"logits": gap(got[0], one[0]), "grads": grad_gap(got[1], one[1]),
                        "divergences": [str(v) for v in report.divergences],
                        # by hand: every all-reduce's dtype (the column-parallel layers' input
                        # gradients and the row-parallel layers' outputs, 2 x 12 x 64 each)
                        "all_reduced": sorted({d for op, d, n in log.calls
                                               if op.startswith("all_reduce") and n == 1536}),
                        "reduced_in": sorted({dtype_name(v) for v in
                                              tp.reduced_in(model).values()}),
                        "audit_columns": sorted({dtype_name(d) for c in columns
                                                 for d in report[c].reduced_in("backward")}),
                        "audited_columns": sum(bool(report[c].reduced_in("backward"))
                                               for c in columns)}
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
    "gaps": gaps, "fp8": fp8, "matrix": matrix, "loops": loops}


def main() -> None:
    mode, outdir, args = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if mode == "loops":
        args = [str(outdir)]
    if mode in ("fsdp", "mx"):
        mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2),
                                mesh_dim_names=("dp", "tp"))
        result = (fsdp_tp if mode == "fsdp" else mx_shapes)(mesh, args)
    else:
        result = MODES[mode](init_device_mesh("cpu", (dist.get_world_size(),)), args)
    (outdir / f"{mode}-rank{rank}.json").write_text(json.dumps(result))
    leave()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
