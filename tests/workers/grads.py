"""`grad=fp32` against the loop written by hand, and one rank of its 2-rank DDP run.

The hand loop is the Apex O2 loop with fp32 gradient accumulation: a bf16 (or fp16) model,
fp32 masters, each micro-batch's gradient added into an fp32 sum by hand, clipping on the sums,
AdamW on the masters, masters copied back rounded. Under DDP the sums are reduced by hand: cast
to the plan's comm dtype, divided by the world size, all-reduced, cast back.

`python -m torch.distributed.run --nproc_per_node 2 -m tests.workers.grads CASE[,CASE] OUTDIR`:
for each case each rank trains the planned model under DDP and the hand loop beside it, and
writes OUTDIR/CASE-rank{N}.json with the largest difference between the two and what it saw.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

import precision_annot as pa

SPEC = "bf16-true,master=fp32,grad=fp32"  # bf16 comm (the bare dtype sets it)


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64), nn.GELU(),
                         nn.LayerNorm(64), nn.Linear(64, 64))


def batch(step: int, rank: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(
        100 + 1000 * rank + step))


def loss_of(model: nn.Module, tokens: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    return nn.functional.cross_entropy(model(tokens).float(), tokens) * scale


class HandLoop:
    """The loop by hand: fp32 masters and fp32 gradient sums beside a low-precision model."""

    def __init__(self, model: nn.Module, *, lr: float = 3e-3, weight_decay: float = 0.1,
                 fused: bool = True) -> None:
        self.model = model
        self.params = list(model.parameters())
        self.masters = [p.detach().float().clone() for p in self.params]
        self.sums: list[torch.Tensor | None] = [None] * len(self.params)
        # fused: what precision_annot.optimizer's AdamW runs over bf16 weights' masters, bit
        # for bit; not fused: torch's default AdamW, which steps fp32 parameters (FSDP2's fp32
        # shards) that the plan leaves to the class's own step
        self.inner = torch.optim.AdamW(self.masters, lr=lr, weight_decay=weight_decay,
                                       fused=fused)

    def backward(self, loss: torch.Tensor) -> None:
        """One micro-batch: its gradient, in the model's dtype, added into the fp32 sums."""
        for p in self.params:
            p.grad = None
        loss.backward()
        for i, p in enumerate(self.params):
            if p.grad is not None:
                grad = p.grad.float()
                total = self.sums[i]
                self.sums[i] = grad if total is None else total + grad

    def reduce(self, comm: torch.dtype) -> None:
        """DDP's average across ranks, by hand, in `comm`: a sum no rank has stays None, a sum
        only some ranks have counts as zeros on the others."""
        world = dist.get_world_size()
        for i, total in enumerate(self.sums):
            flag = torch.tensor([0.0 if total is None else 1.0])
            dist.all_reduce(flag)
            if flag.item() == 0:
                continue
            local = torch.zeros_like(self.params[i], dtype=torch.float32) if total is None \
                else total
            wire = local.to(comm).div_(world)
            dist.all_reduce(wire)
            self.sums[i] = wire.float()

    def unscale(self, scale: float) -> bool:
        """A GradScaler's unscale, by hand; True when every sum is finite."""
        inv = torch.full((), scale, dtype=torch.float64).reciprocal().float()
        finite = True
        for total in self.sums:
            if total is not None:
                total.mul_(inv)
                finite = finite and bool(total.isfinite().all())
        return finite

    def step(self, clip: float | None = None, *, skip: bool = False) -> None:
        for m, total in zip(self.masters, self.sums, strict=True):
            m.grad = total
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(self.masters, clip)
        if not skip:
            self.inner.step()
            with torch.no_grad():
                for p, m in zip(self.params, self.masters, strict=True):
                    p.copy_(m)
        for m in self.masters:
            m.grad = None
        self.sums = [None] * len(self.params)


def worst(model: nn.Module, hand: HandLoop, opt: Any) -> dict[str, float]:
    """The largest difference between the planned run and the hand loop: stored weights and
    masters (a parameter no step has reached yet has no master: its weight, widened, is what
    its first step starts from)."""
    weights = max(float((p.detach().float() - q.detach().float()).abs().max())
                  for p, q in zip(model.parameters(), hand.params, strict=True))

    def master(p: torch.Tensor) -> torch.Tensor:
        held = opt.master(p)
        return held if held is not None else p.detach().float()

    masters = max(float((master(p) - m).abs().max())
                  for p, m in zip(model.parameters(), hand.masters, strict=True))
    return {"weights": weights, "masters": masters}


# -- 2 ranks under DDP -------------------------------------------------------------------------

class Net(nn.Module):
    """The test MLP, and for find_unused_parameters: a Linear rank 0 uses before the
    synchronising micro-batch and rank 1 in it, one that both use only before it, and one
    that none uses."""

    def __init__(self, seed: int, extra: bool) -> None:
        super().__init__()
        self.body = mlp(seed)
        self.extra = nn.Linear(64, 64) if extra else None
        self.early = nn.Linear(64, 64) if extra else None
        self.dead = nn.Linear(4, 4) if extra else None

    def forward(self, tokens: torch.Tensor, use_extra: bool = False, last: bool = True
                ) -> torch.Tensor:
        out: torch.Tensor = self.body(tokens)
        if use_extra and self.extra is not None:
            out = out + self.extra(out) * 0.5
        if not last and self.early is not None:
            out = out + self.early(out) * 0.5
        return out


class Case(NamedTuple):
    """One DDP loop: the plan, micro-batches per step (all but the last under `no_sync`), the
    plan's comm hook, find_unused_parameters with the layers of `Net`, DDP's other arguments,
    `model.zero_grad()` after the first forward instead of before it, a forward under grad
    mode outside `no_sync` and without a backward before each micro-batch, and torch.compile
    ("outside": torch.compile(DDP(model)), "inside": DDP(torch.compile(model)))."""

    spec: str = SPEC
    micro: int = 3
    hooked: bool = False
    unused: bool = False
    ddp: dict[str, Any] = {}  # noqa: RUF012 (never mutated)
    zero_late: bool = False
    stray_forward: bool = False
    compiled: str | None = None


def _wrap(model: nn.Module, case: Case) -> tuple[nn.Module, nn.Module]:
    """(the DDP module, what the loop calls)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from precision_annot.adapters import ddp as ddp_adapter

    inner = torch.compile(model) if case.compiled == "inside" else model
    wrapped = DDP(inner, find_unused_parameters=case.unused, **case.ddp)
    if case.hooked:
        wrapped.register_comm_hook(None, ddp_adapter.comm_hook(pa.applied_plan(model)))
    return wrapped, torch.compile(wrapped) if case.compiled == "outside" else wrapped


def _ddp_loop(name: str, rank: int) -> dict[str, Any]:
    case = CASES[name]
    model = pa.apply(Net(seed=rank, extra=case.unused), default=case.spec)
    wrapped, runner = _wrap(model, case)  # DDP broadcasts rank 0's weights
    hand_model = pa.apply(Net(seed=0, extra=case.unused), default=case.spec.split(",")[0])
    with torch.no_grad():  # the same storage, no update plan; rank 0's weights
        for p, q in zip(hand_model.parameters(), model.parameters(), strict=True):
            p.copy_(q)
    hand = HandLoop(hand_model)
    hand_runner = torch.compile(hand_model) if case.compiled else hand_model
    opt = pa.optimizer(model, torch.optim.AdamW, lr=3e-3, weight_decay=0.1)
    plan = pa.applied_plan(model)
    assert plan is not None
    comm = plan["body.1"].policy.grad_comm or torch.bfloat16
    dtypes = set()
    for step in range(3):
        if not case.zero_late:
            model.zero_grad()  # the model's, as the HF Trainer calls it
        for m in range(case.micro):
            tokens, last = batch(10 * step + m, rank), m == case.micro - 1
            # find_unused: rank 0 uses `extra` before the synchronising micro-batch, rank 1 in it
            use = case.unused and ((rank == 0) != last)
            if case.stray_forward:  # DDP's reducer then reduces in the next backward
                wrapped(batch(99, rank))
            with contextlib.nullcontext() if last else wrapped.no_sync():
                out = runner(tokens, use_extra=use, last=last)
                if case.zero_late and m == 0:
                    model.zero_grad()
                nn.functional.cross_entropy(out.float(), tokens).backward()
            hand.backward(loss_of_net(hand_runner, tokens, use, last))
            if case.stray_forward and not last:
                hand.reduce(comm)
        dtypes |= {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        hand.reduce(comm)
        hand.step(clip=0.5)
    return {**worst(model, hand, opt), "grads": sorted(dtypes),
            "dead": None if model.dead is None else model.dead.weight.grad is None}


def loss_of_net(net: nn.Module, tokens: torch.Tensor, use: bool, last: bool) -> torch.Tensor:
    return nn.functional.cross_entropy(net(tokens, use_extra=use, last=last).float(), tokens)


def _fsdp2(case: str, rank: int) -> dict[str, Any]:
    """FSDP2 through `adapters.fsdp.fully_shard`: with master=fp32 the shards are fp32 (the
    masters), so each micro-batch's gradient, reduce-scattered in bf16 (comm), is accumulated
    into the fp32 gradient shard. The hand loop does the same on a whole replica: each
    micro-batch's bf16 gradient averaged across ranks in bf16, then added into fp32 sums."""
    from torch.distributed.tensor import DTensor

    from precision_annot.adapters import fsdp

    model = fsdp.fully_shard(pa.apply(mlp(), default=SPEC))
    opt = pa.optimizer(model, torch.optim.AdamW, lr=3e-3, weight_decay=0.1)
    hand = HandLoop(pa.apply(mlp(), default="bf16-true"), fused=False)
    world = dist.get_world_size()
    kinds = set()
    for step in range(3):
        model.zero_grad()
        for m in range(3):
            tokens = batch(10 * step + m, rank)
            loss_of(model, tokens).backward()
            for p in hand.params:
                p.grad = None
            loss_of(hand.model, tokens).backward()
            for i, p in enumerate(hand.params):
                assert p.grad is not None
                wire = p.grad.div(world)
                dist.all_reduce(wire)
                total = hand.sums[i]
                hand.sums[i] = wire.float() if total is None else total + wire.float()
        kinds |= {f"{type(p.grad).__name__} {p.grad.dtype}" for p in model.parameters()}
        opt.step()
        hand.step()

    def whole(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    weights = max(float((whole(p.detach()).bfloat16().float() - q.detach().float()).abs().max())
                  for p, q in zip(model.parameters(), hand.params, strict=True))
    masters = max(float((whole(p.detach()) - m).abs().max())
                  for p, m in zip(model.parameters(), hand.masters, strict=True))
    return {"weights": weights, "masters": masters, "grads": sorted(kinds)}


def _fsdp2_grad(case: str, rank: int) -> dict[str, Any]:
    """torch 2.15: FSDP2 keeps a parameter's `grad_dtype`, so bf16 shards take fp32 gradients
    without a master (`bf16-true,grad=fp32`): each micro-batch's bf16 gradient,
    reduce-scattered in bf16 (comm), is added into the fp32 gradient shard, and the step
    reads it. The same by hand on a whole replica: each micro-batch's bf16 gradient averaged
    across ranks in bf16, added into fp32 sums, handed to the same plan's optimizer on a local
    model."""
    from torch.distributed.tensor import DTensor

    from precision_annot.adapters import fsdp

    spec = "bf16-true,grad=fp32"
    model = fsdp.fully_shard(pa.apply(mlp(), default=spec))
    opt = pa.optimizer(model, torch.optim.AdamW, lr=3e-3, weight_decay=0.1)
    local = pa.apply(mlp(), default=spec)
    local_opt = pa.optimizer(local, torch.optim.AdamW, lr=3e-3, weight_decay=0.1)
    params = list(local.parameters())
    world = dist.get_world_size()
    kinds = set()
    for step in range(3):
        model.zero_grad()
        sums: list[torch.Tensor | None] = [None] * len(params)
        for m in range(3):
            tokens = batch(10 * step + m, rank)
            loss_of(model, tokens).backward()
            grads = torch.autograd.grad(loss_of(local, tokens), params, allow_unused=True)
            for i, g in enumerate(grads):
                if g is None:
                    continue
                wire = g.to(torch.bfloat16).div(world)
                dist.all_reduce(wire)
                total = sums[i]
                sums[i] = wire.float() if total is None else total + wire.float()
        kinds |= {f"{type(p.grad).__name__} {p.dtype} {p.grad.dtype}"
                  for p in model.parameters()}
        for p, total in zip(params, sums, strict=True):
            p.grad = total
        opt.step()
        local_opt.step()
        local.zero_grad()

    def whole(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    weights = max(float((whole(p.detach()).float() - q.detach().float()).abs().max())
                  for p, q in zip(model.parameters(), params, strict=True))
    return {"weights": weights, "grads": sorted(kinds)}


def _fsdp2_no_sync(case: str, rank: int) -> dict[str, Any]:
    """FSDP2 with `set_requires_gradient_sync(False)` on the first two of three micro-batches:
    the dtype FSDP2 keeps their unsharded sum in (its reduce dtype, the plan's comm), read off
    each of its parameters before the synced micro-batch reduces it."""
    from precision_annot.adapters import fsdp

    model = fsdp.fully_shard(pa.apply(mlp(), default=SPEC))
    model.set_requires_gradient_sync(False)
    for m in range(2):
        loss_of(model, batch(m, rank)).backward()
    sums = set()
    for state in [model, *[u for u in model.modules() if u is not model]]:
        group = getattr(getattr(state, "_get_fsdp_state", lambda: None)(), "_fsdp_param_group",
                        None)
        for param in getattr(group, "fsdp_params", []):
            held = param.unsharded_accumulated_grad
            if held is None:
                held = param._unsharded_param.grad
            if held is not None:
                sums.add(str(held.dtype))
    model.set_requires_gradient_sync(True)
    loss_of(model, batch(2, rank)).backward()
    return {"sums": sorted(sums), "grads": sorted({str(p.grad.dtype) for p in model.parameters()
                                                   if p.grad is not None})}


def _misconfigured(case: str, rank: int) -> dict[str, Any]:
    """comm=fp32 over bf16 storage, no comm hook: DDP would reduce the rounding in bf16."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = pa.apply(mlp(), default="bf16-true,comm=fp32,master=fp32,grad=fp32")
    wrapped = DDP(model)
    try:
        loss_of(wrapped, batch(0, rank)).backward()
    except RuntimeError as e:
        return {"error": str(e)}
    return {"error": None}


CASES: dict[str, Case] = {
    "sync": Case(micro=1),
    "no_sync": Case(),
    "no_sync_hook": Case(hooked=True),
    "fp32_comm_hook": Case(spec="bf16-true,comm=fp32,master=fp32,grad=fp32", hooked=True),
    "find_unused": Case(unused=True),
    "bucket_view": Case(ddp={"gradient_as_bucket_view": True}),
    "small_buckets": Case(ddp={"bucket_cap_mb": 0.001}),
    "static_graph": Case(micro=1, ddp={"static_graph": True}),  # DDP refuses no_sync with it
    "zero_late": Case(zero_late=True),
    "stray_forward": Case(stray_forward=True),
    "compiled_outside": Case(compiled="outside"),
    "compiled_inside": Case(compiled="inside"),
}


def main() -> None:
    from tests.workers import leave

    cases, outdir = sys.argv[1].split(","), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for case in cases:
        run: Callable[[str, int], dict[str, Any]] = {
            "misconfigured": _misconfigured, "fsdp2": _fsdp2, "fsdp2_grad": _fsdp2_grad,
            "fsdp2_no_sync": _fsdp2_no_sync}.get(case, _ddp_loop)
        (outdir / f"{case}-rank{rank}.json").write_text(json.dumps(run(case, rank)))
    leave()


if __name__ == "__main__":
    main()
