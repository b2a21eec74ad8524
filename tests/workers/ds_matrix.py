"""More DeepSpeed scenarios for `check`'s real-run matrix: the update half at ZeRO 0, configs
`to_config` exports under torch_autocast at ZeRO 1-3, Hugging Face-style "auto" precision keys,
class lists written by hand, and engines started in a process that started a torch_autocast
engine before (`run["after_autocast"]`: DeepSpeed leaves a module-level flag on, and later
ZeRO 1-3 engines reduce each parameter in its own comm_dtype).

`python -m torch.distributed.run --nproc_per_node 2 -m tests.workers.ds_matrix OUTDIR` runs each
of `SCENARIOS` as tests/workers/matrix.py runs its DeepSpeed ones (3 steps on 2 gloo ranks, the
same record), and adds what DeepSpeed's optimizer keeps: `update` holds the dtype of its master
weights (None where it steps the parameters themselves) and the dtype it accumulates gradients
in. tests/adapters/test_check_matrix.py judges `check` on them.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from precision_annot._src.dtypes import dtype_name
from tests.workers import leave, matrix
from tests.workers.collectives import register_recording_gloo
from tests.workers.scenarios import BF16_COMM, FP32_FC2, MIXED, Scenario, plain


def zero(stage: int, **more: Any) -> dict[str, Any]:
    return {"zero_optimization": {"stage": stage}, **more}


BF16 = {"bf16": {"enabled": True}}
#: a Hugging Face-style base: every precision key "auto", for the Trainer or to_config to fill
HF_PRECISION_AUTO = {"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
                     "torch_autocast": {"enabled": "auto"}, "communication_data_type": "auto"}


def autocast_listing(*classes: str) -> dict[str, Any]:
    return {"torch_autocast": {"enabled": True, "dtype": "bfloat16",
                               "lower_precision_safe_modules": list(classes)}}


SCENARIOS: list[Scenario] = [
    # -- the update half at ZeRO 0: DeepSpeed's bf16 mode keeps fp32 masters there
    Scenario("ds-zero0-masters-exported", "deepspeed", plain("bf16-true,master=fp32", {}),
             run={"to_config": zero(0)}),
    Scenario("ds-zero0-masters-by-hand", "deepspeed", plain("bf16-true,master=fp32", {}),
             run={"config": zero(0, **BF16)}),
    Scenario("ds-zero0-no-master-exported", "deepspeed",
             plain("bf16-true,master=bf16,optim=bf16", {}), run={"to_config": zero(0)}),
    Scenario("ds-zero0-no-master-by-hand", "deepspeed",
             plain("bf16-true,master=bf16,optim=bf16", {}), run={"config": zero(0, **BF16)}),
    Scenario("ds-zero0-grad-fp32-by-hand", "deepspeed", plain("bf16-master", {}),
             run={"config": zero(0, **BF16, data_types={"grad_accum_dtype": "fp32"})}),
    Scenario("ds-zero0-grad-bf16-by-hand", "deepspeed", plain("bf16-master", {}),
             run={"config": zero(0, **BF16)}),
    Scenario("ds-zero2-masters-exported", "deepspeed", plain("bf16-master", {}),
             run={"to_config": zero(2)}),
    # -- torch_autocast configs to_config exports at ZeRO 1-3
    Scenario("ds-to-config-zero2-mixed-comm", "deepspeed", plain(BF16_COMM),
             run={"to_config": zero(2)}),
    Scenario("ds-to-config-zero2-comm-by-parameter", "deepspeed", plain(BF16_COMM, FP32_FC2),
             run={"to_config": zero(2)}),
    Scenario("ds-to-config-zero2-comm-unset", "deepspeed", plain("compute=bf16,storage=fp32"),
             run={"to_config": zero(2)}),
    Scenario("ds-to-config-zero3-islands-mixed", "deepspeed", plain(MIXED),
             run={"to_config": zero(3)}),
    # -- Hugging Face-style "auto" in the precision keys, through to_config
    Scenario("ds-hf-precision-auto-exported", "deepspeed", plain(MIXED),
             run={"to_config": zero(2, **HF_PRECISION_AUTO)}),
    Scenario("ds-hf-precision-auto-exported-bf16", "deepspeed", plain("bf16", {}),
             run={"to_config": zero(2, **HF_PRECISION_AUTO)}),
    Scenario("ds-hf-cdt-auto-exported-islands", "deepspeed", plain("bf16"),
             run={"to_config": zero(2, communication_data_type="auto")}),
    # -- class lists written by hand: DeepSpeed imports each name and matches exact classes
    Scenario("ds-autocast-alias-class-by-hand", "deepspeed", plain(BF16_COMM, FP32_FC2),
             run={"config": zero(2, **autocast_listing("torch.nn.Linear"))}),
    Scenario("ds-autocast-unimportable-class-by-hand", "deepspeed", plain(BF16_COMM),
             run={"config": zero(2, **autocast_listing("tests.workers.scenarios.Missing"))}),
    # -- a later engine in a process that started a torch_autocast engine
    Scenario("ds-bf16-section-one-fp32-comm-after-autocast", "deepspeed",
             plain("bf16", {"norm": "comm=fp32"}),
             run={"to_config": zero(2), "after_autocast": True}),
    Scenario("ds-bf16-section-zero1-mixed-comm-after-autocast", "deepspeed",
             plain("bf16", {"norm": "comm=fp32"}),
             run={"to_config": zero(1), "after_autocast": True}),
    Scenario("ds-bf16-section-zero3-mixed-comm-after-autocast", "deepspeed",
             plain("bf16", {"norm": "comm=fp32"}),
             run={"to_config": zero(3), "after_autocast": True}),
    Scenario("ds-zero0-uniform-comm-after-autocast", "deepspeed", plain(BF16_COMM),
             run={"to_config": zero(0), "after_autocast": True}),
]

BY_NAME = {s.name: s for s in SCENARIOS}
assert len(BY_NAME) == len(SCENARIOS)

#: where DeepSpeed's optimizers keep their master weights: the unfused and fused fp16/bf16
#: optimizers (ZeRO 0), BF16_Optimizer, ZeRO 1-2 and ZeRO 3
_MASTERS = ("fp32_groups", "fp32_groups_flat_partition", "single_partition_of_fp32_groups",
            "fp32_partitioned_groups_flat")


def update(engine: Any) -> dict[str, Any]:
    """The dtype of the master weights DeepSpeed's optimizer keeps (None: it steps the
    parameters themselves) and the dtype it accumulates gradients in."""
    optimizer = engine.optimizer
    masters: set[str] = set()
    for attr in _MASTERS:
        for group in getattr(optimizer, attr, None) or []:
            for t in group if isinstance(group, (list, tuple)) else [group]:
                if isinstance(t, torch.Tensor) and t.numel():
                    masters.add(dtype_name(t.dtype))
        if masters:
            break
    (held,) = masters or {None}
    return {"optimizer": type(optimizer).__name__, "masters": held,
            "grad_accum": dtype_name(engine.get_data_types()[1])}


def autocast_engine(initialize: Any) -> None:
    """Start and destroy a DeepSpeed engine with torch_autocast, as a process that trained one
    model before another does: DeepSpeed's torch_autocast flag stays on for the process."""
    net = torch.nn.Linear(4, 4)
    engine, *_ = initialize(
        model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.0),
        config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
                "zero_allow_untested_optimizer": True, "steps_per_print": 10_000,
                "torch_autocast": {"enabled": True, "dtype": "bfloat16"}})
    engine.destroy()


@contextlib.contextmanager
def engines(after_autocast: bool = False) -> Iterator[list[Any]]:
    """The engines matrix.setup builds inside the block, in order; with `after_autocast`, each
    started right after a torch_autocast engine (`autocast_engine`)."""
    import deepspeed

    built: list[Any] = []
    saved, initialize = matrix.setup, deepspeed.initialize

    def setup(scenario: Scenario, model: torch.nn.Module, plan: Any) -> tuple[Any, Any]:
        runner, optimizer = saved(scenario, model, plan)
        built.append(runner)
        return runner, optimizer

    def later(*args: Any, **kwargs: Any) -> Any:
        autocast_engine(initialize)
        return initialize(*args, **kwargs)

    matrix.setup = setup
    if after_autocast:
        deepspeed.initialize = later
    try:
        yield built
    finally:
        matrix.setup, deepspeed.initialize = saved, initialize


def observe(scenario: Scenario, rank: int) -> dict[str, Any]:
    with engines(after_autocast=scenario.run.get("after_autocast", False)) as built:
        out = matrix.observe(scenario, rank)
    out["update"] = update(built[0]) if built and out["refused"] is None else None
    return out


def main() -> None:
    outdir = Path(sys.argv[1])
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(BY_NAME)
    warnings.simplefilter("ignore")
    register_recording_gloo()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    for name in names:
        result = observe(BY_NAME[name], rank)
        if rank == 0:
            (outdir / f"{name}.json").write_text(json.dumps(result))
        dist.barrier()
    leave()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
