"""One rank of a 2-rank gloo run of `watch` and `diff` under tensor parallelism (torch's own
styles): `python -m torch.distributed.run --nproc_per_node 2 -m tests.workers.watch_tp MODE
OUTDIR`, MODE "mlp" or "sp"; each rank writes OUTDIR/MODE-rank{R}.json.

- mlp: a Megatron MLP (up column-parallel, down row-parallel handing back a replicated DTensor)
  and a column-parallel head gathering its output, in fp16. Step 0 is clean; on step 1 rank 1's
  shard of `mlp.up` overflows.
- sp: sequence parallel and loss parallel: a vocabulary-parallel embedding, sequence-parallel
  LayerNorms, the MLP between them, and a column-parallel head whose logits stay sharded by
  vocabulary for torch's `loss_parallel` cross-entropy, in bf16.

Beside `watch`, hand-written hooks on the same runs record each module's output and output
gradient whole (`full_tensor()`; a plain tensor that is a shard is made a DTensor of the layout
the styles give it first): its largest finite magnitude, its counts past half of fp16's or
bf16's largest value, below its smallest normal and not finite, and its elements; and each
rank's local one. `diff` runs on the model, and the same errors are computed by hand from full
tensors.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.nn import functional as F

import precision_annot as pa
from precision_annot._src.recording import relative_error
from tests.workers import leave

D, HIDDEN, VOCAB = 16, 64, 32


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, HIDDEN)
        self.down = nn.Linear(HIDDEN, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(F.gelu(self.up(x)))
        return out


class MLPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.mlp(x))
        return out


class SPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.norm = nn.LayerNorm(D)
        self.mlp = MLP()
        self.final_norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.mlp(self.norm(h))
        out: torch.Tensor = self.head(self.final_norm(h))
        return out


#: the layout of each module's output that the styles hand back as a plain local tensor
MLP_LOCAL: dict[str, Placement] = {"mlp.up": Shard(-1)}
SP_LOCAL: dict[str, Placement] = {"embed": Shard(1), "mlp.up": Shard(-1), "mlp.down": Shard(1),
                                  "mlp": Shard(1)}


def mlp_model(mesh: DeviceMesh, default: str | None = "16-true") -> nn.Module:
    torch.manual_seed(0)
    model = MLPNet() if default is None else pa.apply(MLPNet(), default=default)
    return parallelize_module(model, mesh, {
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(use_local_output=False),  # a replicated DTensor
        "head": ColwiseParallel(output_layouts=Replicate(), use_local_output=False)})


def sp_model(mesh: DeviceMesh, default: str | None = "bf16-true") -> nn.Module:
    torch.manual_seed(0)
    model = SPNet() if default is None else pa.apply(SPNet(), default=default)
    return parallelize_module(model, mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
        "final_norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                use_local_output=False)})


def stats(t: torch.Tensor) -> dict[str, float]:
    """Largest finite magnitude, past half the largest value, below the smallest normal (not
    zero), not finite, elements: of a plain tensor, by hand."""
    finfo = torch.finfo(t.dtype)
    a = t.detach().double().abs()
    finite = torch.isfinite(a)
    return {"amax": float(torch.where(finite, a, 0.0).amax()) if a.numel() else 0.0,
            "over": int((a > finfo.max * 0.5).sum()),
            "under": int(((a > 0) & (a < finfo.tiny)).sum()),
            "nonfinite": int((~finite).sum()), "numel": a.numel()}


class Hand:
    """Hooks written by hand: each module's output and its gradient, whole and local."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, local: dict[str, Placement]) -> None:
        self.mesh, self.local = mesh, local
        self.outputs: dict[str, list[dict[str, Any]]] = {}
        self.grads: dict[str, list[dict[str, Any]]] = {}
        self.handles = [m.register_forward_hook(self.hook(n)) for n, m in model.named_modules()]

    def whole(self, name: str, t: torch.Tensor) -> dict[str, Any]:
        if isinstance(t, DTensor):
            mine = t.redistribute(t.device_mesh, [Replicate() if p.is_partial() else p
                                                  for p in t.placements]).to_local()
            return {"whole": stats(t.full_tensor()), "local": stats(mine),
                    "placements": [str(p) for p in t.placements]}
        if name in self.local:
            full = DTensor.from_local(t, self.mesh, [self.local[name]]).full_tensor()
            return {"whole": stats(full), "local": stats(t), "placements": ["local shard"]}
        return {"whole": stats(t), "local": stats(t), "placements": ["plain"]}

    def hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor):
                return
            self.outputs.setdefault(name, []).append(self.whole(name, output.detach()))
            if output.requires_grad:
                output.register_hook(lambda g: self.grads.setdefault(name, []).append(
                    self.whole(name, g.detach())))
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def watched(model: nn.Module, mesh: DeviceMesh, local: dict[str, Placement], steps: list[Any]
            ) -> dict[str, Any]:
    """Each step (a function running one forward and backward) under `watch` and the hooks."""
    out: dict[str, Any] = {"hand": [], "mine": [], "all": []}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with pa.watch(model, every=1) as w:
            for run in steps:
                hand = Hand(model, mesh, local)
                model.zero_grad(set_to_none=True)
                run()
                hand.close()
                w.step()
                out["hand"].append({"outputs": hand.outputs, "grads": hand.grads})
    out["mine"] = [r.to_dict() for r in w.records(dist.get_rank())]
    out["all"] = [r.to_dict() for r in w.records("all")]
    out["said"] = [str(s.message) for s in said if "watch:" in str(s.message)]
    return out


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def by_hand(model: nn.Module, fp32: nn.Module, sample: torch.Tensor, loss_fn: Any
            ) -> dict[str, float]:
    """The errors `diff` reports for the root, computed by hand from full tensors: a copy of the
    model as it runs, and `fp32`, the same model parallelized alike without a plan, given its
    values in fp32; each one's output and that output's gradient."""
    with torch.no_grad():
        for mine, theirs in zip(fp32.parameters(), model.parameters(), strict=True):
            mine.to_local().copy_(theirs.to_local().float())
    runs = []
    for run, x in ((copy.deepcopy(model), sample), (fp32, sample if not sample.is_floating_point()
                                                    else sample.float())):
        out = run(x)
        out.retain_grad()
        loss_fn(out).backward()
        assert out.grad is not None
        runs.append((full(out.detach()), full(out.grad.detach())))
    (low, low_grad), (exact, exact_grad) = runs
    return {"output_error": relative_error(low, exact),
            "grad_error": relative_error(low_grad, exact_grad)}


def mlp(mesh: DeviceMesh) -> dict[str, Any]:
    model = mlp_model(mesh)
    gen = torch.Generator().manual_seed(5)  # the same batch on both ranks: TP
    x = torch.randn(8, D, generator=gen).half()

    def clean() -> None:
        model(x).to_local().float().pow(2).mean().backward()

    def overflow() -> None:
        local = model.mlp.up.weight.to_local()
        saved = local.detach().clone()
        if dist.get_rank() == 1:
            with torch.no_grad():
                local[:4] *= 5e4  # 4 of rank 1's 32 output features
        try:
            clean()
        finally:
            with torch.no_grad():
                local.copy_(saved)

    out = watched(model, mesh, MLP_LOCAL, [clean, overflow])

    def loss(o: torch.Tensor) -> torch.Tensor:
        return o.to_local().float().pow(2).mean()

    report = pa.diff(model, x, loss_fn=loss)
    out["diff"] = report.to_dict()
    out["diff_default"] = pa.diff(model, x).to_dict()
    out["hand_diff"] = by_hand(model, mlp_model(mesh, None), x, loss)
    return out


def sp(mesh: DeviceMesh) -> dict[str, Any]:
    model = sp_model(mesh)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, 8), generator=gen)
    labels = torch.randint(0, VOCAB, (2, 8), generator=gen)

    def loss(logits: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        return out

    def run() -> None:
        with loss_parallel():
            loss(model(ids)).backward()

    out = watched(model, mesh, SP_LOCAL, [run])
    with loss_parallel():
        out["diff"] = pa.diff(model, ids, loss_fn=loss).to_dict()
        out["hand_diff"] = by_hand(model, sp_model(mesh, None), ids, loss)
    out["diff_default"] = pa.diff(model, ids).to_dict()
    return out


MODES = {"mlp": mlp, "sp": sp}


def main() -> None:
    mode, outdir = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    result = MODES[mode](mesh)
    (outdir / f"{mode}-rank{dist.get_rank()}.json").write_text(json.dumps(result))
    leave()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
