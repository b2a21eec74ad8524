"""`remove` and `apply` on a model whose parameters are DTensors (tensor parallel): each parameter
keeps its identity and gets its dtype, its local shard and its values back, and a run with
fp32 masters goes on through the detour as if it had not stopped.

One rank in this process (fast), and two ranks by `launch` (slow): this module is also that
launch's worker (`python -m tests.test_runtime_tp OUTDIR`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import precision_annot as pa
from tests.helpers import launch

bf16, fp32 = torch.bfloat16, torch.float32
SPEC = "bf16-true,master=fp32"


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


def batch(step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(100 + step))


def parallel(mesh: Any) -> tuple[nn.Module, Any]:
    """The MLP with the plan applied, column- then row-parallel over `mesh` by torch's own
    styles, and its planned AdamW."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = pa.apply(mlp(), default=SPEC)
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model, pa.optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


def train(model: nn.Module, opt: Any, start: int, steps: int) -> None:
    for step in range(start, start + steps):
        opt.zero_grad()
        model(batch(step).to(model[0].weight.dtype)).float().pow(2).mean().backward()
        opt.step()


def dtypes(model: nn.Module) -> dict[str, list[str]]:
    """Per parameter: its type, the dtype it says, its local shard's, and its full tensor's."""
    return {n: [type(p).__name__, str(p.dtype), str(p.to_local().dtype),
                str(p.full_tensor().dtype)] for n, p in model.named_parameters()}


def round_trip(mesh: Any) -> dict[str, Any]:
    """2 steps, `remove` (evaluate in fp32 on the masters' values), `apply` again, 2 steps;
    beside the run that did not stop."""
    whole, whole_opt = parallel(mesh)
    train(whole, whole_opt, 0, 4)
    model, opt = parallel(mesh)
    train(model, opt, 0, 2)
    ids = [id(p) for p in model.parameters()]
    masters = {n: opt.master(p).full_tensor() for n, p in model.named_parameters()}
    pa.remove(model)
    out: dict[str, Any] = {"removed": dtypes(model)}
    out["removed_equal_masters"] = all(torch.equal(p.full_tensor(), masters[n])
                                       for n, p in model.named_parameters())
    reference = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    reference.load_state_dict(masters)
    with torch.no_grad():
        got, want = model(batch(9)), reference(batch(9))
    out["fp32_output"] = [str(got.dtype), float((got - want).abs().max())]
    pa.apply(model, default=SPEC)
    out["applied"] = dtypes(model)
    out["same_objects"] = ids == [id(p) for p in model.parameters()]
    out["applied_rounded_masters"] = all(
        torch.equal(p.full_tensor(), masters[n].to(bf16)) for n, p in model.named_parameters())
    train(model, opt, 2, 2)
    out["as_the_run_that_did_not_stop"] = all(
        torch.equal(p.full_tensor(), q.full_tensor())
        and torch.equal(opt.master(p).full_tensor(), whole_opt.master(q).full_tensor())
        for p, q in zip(model.parameters(), whole.parameters(), strict=True))
    return out


def check_round_trip(out: dict[str, Any]) -> None:
    planned = ["DTensor", str(bf16), str(bf16), str(bf16)]
    assert all(v == ["DTensor", str(fp32), str(fp32), str(fp32)]
               for v in out["removed"].values()), out["removed"]
    assert out["removed_equal_masters"]
    assert out["fp32_output"][0] == str(fp32) and out["fp32_output"][1] <= 1e-6, out
    assert all(v == planned for v in out["applied"].values()), out["applied"]
    assert out["same_objects"] and out["applied_rounded_masters"]
    assert out["as_the_run_that_did_not_stop"]


@pytest.mark.usefixtures("group")
def test_remove_and_apply_round_trip_dtensor_parameters_on_one_rank() -> None:
    """Before: `remove` set each DTensor parameter's `.data`, which changed the dtype the
    DTensor says (fp32) but not its local shard (bf16): the next forward raised "mat1 and
    mat2 must have the same dtype, but got Float and BFloat16". Applied after parallelizing,
    the reverse: DTensors that said bf16 over fp32 shards."""
    from torch.distributed.device_mesh import init_device_mesh

    check_round_trip(round_trip(init_device_mesh("cpu", (1,))))


@pytest.mark.usefixtures("group")
@pytest.mark.parametrize("sharding", ["tensor parallel", "FSDP2"])
def test_apply_after_sharding_casts_the_local_shards(sharding: str) -> None:
    """torch's own `parallelize_module` or `fully_shard` first, `apply` after (a plan given to
    a model already sharded, before its first forward): every DTensor parameter's local
    shard is cast, the forward computes in bf16, and `remove` gives back the values in fp32.
    Before: the DTensors said bf16 over fp32 shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = mlp()
    values = {k: v.clone() for k, v in model.state_dict().items()}
    mesh = init_device_mesh("cpu", (1,))
    if sharding == "FSDP2":
        fully_shard(model, mesh=mesh)
    else:
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    pa.apply(model, default="bf16-true")
    assert all(v == ["DTensor", str(bf16), str(bf16), str(bf16)]
               for v in dtypes(model).values()), dtypes(model)
    pa.remove(model)
    for name, p in model.named_parameters():
        assert p.to_local().dtype == fp32 and torch.equal(
            p.full_tensor(), values[name].to(bf16).float()), name
    assert model(batch(0)).dtype == fp32


@pytest.mark.slow
def test_remove_and_apply_round_trip_dtensor_parameters_on_two_ranks(tmp_path: Path) -> None:
    """The same round trip, column- and row-parallel over 2 gloo ranks: after `remove`, each
    shard is fp32 and holds its master's values, the fp32 forward equals the MLP by hand
    with those weights; after `apply`, each shard is bf16 again and 2 steps end bit for bit
    where the run that did not stop ends, on both ranks."""
    launch("tests.test_runtime_tp", str(tmp_path), ranks=2, timeout=300)
    for rank in range(2):
        check_round_trip(json.loads((tmp_path / f"rank{rank}.json").read_text()))


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from tests.workers import leave

    outdir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    out = round_trip(init_device_mesh("cpu", (dist.get_world_size(),)))
    (outdir / f"rank{dist.get_rank()}.json").write_text(json.dumps(out))
    leave()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()


@pytest.mark.usefixtures("group")
def test_remove_leaves_no_input_cast_of_a_kept_column_parallel_style() -> None:
    """A column-parallel Linear subclass with its own forward keeps torch's style, and the
    adapter casts its input to the compute dtype first; after `remove` that cast is gone with
    the plan (it cast an fp32 input to bf16 for fp32 weights: "mat1 and mat2 must have the
    same dtype")."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from precision_annot.adapters import tp

    class Own(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x)

    torch.manual_seed(0)
    model = nn.Sequential(Own(16, 32), nn.GELU(), nn.Linear(32, 16))
    pa.apply(model, default="bf16-mixed")
    tp.parallelize_module(model, init_device_mesh("cpu", (1,)),
                          {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(4, 16)
    assert model(x).dtype == bf16
    pa.remove(model)
    out = model(x)
    assert out.dtype == fp32
    want = model[2](nn.functional.gelu(nn.functional.linear(
        x, model[0].weight.full_tensor(), model[0].bias.full_tensor())))
    assert torch.allclose(out, want, atol=1e-6)
