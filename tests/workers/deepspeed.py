"""One rank of a DeepSpeed run on the CPU accelerator with gloo, for ZeRO stages 0-3.

`python -m tests.workers.deepspeed MODE STAGES OUTDIR` for one rank, or under
`torch.distributed.run ... -m tests.workers.deepspeed` for two; MODE is "train" (bf16 layers and
an fp32 island) or "fp16" (with an overflow step), STAGES like "0,1,2,3". Each rank writes
OUTDIR/<mode>-stage<S>-rank<R>.json with what it observed. MODE "update" runs the update
layouts under ZeRO-2, "zero0" the plans of `ZERO0` under ZeRO-0's bf16 section
(OUTDIR/zero0-<layout>-rank<R>.json), and "buffers" a DeepSeek-V3's buffers under the configs of
`BUFFER_CASES` (OUTDIR/buffers-<case>-stage<S>-rank<R>.json).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn

from precision_annot import resolve
from precision_annot._src.dtypes import dtype_name
from precision_annot.adapters import deepspeed as ds_adapter
from tests.workers import leave
from tests.workers.collectives import recording
from tests.workers.models import Net


def gathered(params: list[nn.Parameter], stage: int) -> list[list[float]]:
    import deepspeed

    if stage == 3:
        with deepspeed.zero.GatheredParameters(params):
            return [p.detach().double().flatten().tolist() for p in params]
    return [p.detach().double().flatten().tolist() for p in params]


def train(engine: Any, net: Net, stage: int, rank: int) -> dict[str, Any]:
    """5 steps of bf16 layers around the fp32 island."""
    return _steps(engine, net, stage, rank, overflow_at=None)


def fp16(engine: Any, net: Net, stage: int, rank: int) -> dict[str, Any]:
    """5 steps of fp16 compute, with step 2 made to overflow: it must be skipped."""
    return _steps(engine, net, stage, rank, overflow_at=2)


def _steps(engine: Any, net: Net, stage: int, rank: int,
           overflow_at: int | None) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
    losses, skipped = [], []
    with recording(dist, c10d) as calls:  # ZeRO-3 calls through c10d directly
        for step in range(5):
            loss = nn.functional.mse_loss(engine(x).float(), y)
            if step == overflow_at:
                loss = loss * float("inf")
                before = gathered(list(net.parameters()), stage)
            engine.backward(loss)
            engine.step()
            if step == overflow_at:
                skipped.append(gathered(list(net.parameters()), stage) == before)
            losses.append(loss.item())
    scaler = (getattr(engine, "torch_autocast_z0_gradscaler", None)
              or getattr(engine.optimizer, "torch_autocast_gradscaler", None))
    return {
        "losses": losses,
        "skipped": skipped,
        "scale": None if scaler is None else float(scaler.get_scale()),
        "collectives": sorted({c for c in calls if c[2] > 1}),
    }


MODES = {"train": (train, "bf16"), "fp16": (fp16, "fp16")}


def run_stage(mode: str, stage: int, rank: int) -> dict[str, Any]:
    import deepspeed

    run, default = MODES[mode]
    torch.manual_seed(0)
    net = Net(rotary=True)
    plan = resolve(net, default=default)
    base = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10_000}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        translated = ds_adapter.translate(plan)
        config = ds_adapter.to_config(translated, base)
        ds_adapter.prepare(net, translated)
    island = list(net.norm.parameters())
    before = [p.detach().clone().double().flatten().tolist() for p in island]
    engine, *_ = deepspeed.initialize(
        model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.05), config=config)
    result: dict[str, Any] = {
        "config": {k: v for k, v in config.items() if k not in base},
        "warnings": [str(w.message) for w in caught],
        "island_storage": [dtype_name(getattr(p, "ds_tensor", p).dtype) for p in island],
        "inv_freq": dtype_name(net.rope.inv_freq.dtype),  # type: ignore[union-attr]
    }
    result.update(run(engine, net, stage, rank))
    result.update({
        "seen": net.seen(),
        "island_before": before,
        "island_after": gathered(island, stage),
        "params": gathered(list(net.parameters()), stage),
        "comm_dtype": {n: dtype_name(p.comm_dtype) for n, p in net.named_parameters()
                       if hasattr(p, "comm_dtype")},
    })
    engine.destroy()
    return result


#: the update layouts a bf16 model is run with under ZeRO-2 in "update" mode
UPDATES = {"bf16-state": "bf16-true,master=bf16,optim=bf16", "fp32-masters": "bf16-master"}
#: configs written by hand for the "bf16-master" plan (fp32 masters), as a user reading
#: DeepSpeed's key names would write them: run as they are, to see what DeepSpeed keeps
HAND_WRITTEN = {
    "hand-bf16-masters": {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                                   "bf16_optimizer_states": True}},
    "hand-bf16-masters-alone": {"bf16": {"enabled": True,
                                         "bf16_master_weights_and_grads": True}},
}
UPDATE_BASE = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
               "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
               "steps_per_print": 10_000}


def run_update(layout: str, rank: int) -> dict[str, Any]:
    """A uniform bf16 model (DeepSpeed's bf16 section) with the plan's update half exported by
    to_config (or a config written by hand, `HAND_WRITTEN`), under ZeRO-2: what DeepSpeed
    really keeps on this rank, or how it refuses to start."""
    import deepspeed

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    plan = resolve(net, default=UPDATES.get(layout, "bf16-master"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = ({**UPDATE_BASE, **HAND_WRITTEN[layout]} if layout in HAND_WRITTEN
                  else ds_adapter.to_config(plan, UPDATE_BASE))
        ds_adapter.prepare(net, plan)
    try:
        engine, *_ = deepspeed.initialize(
            model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-3), config=config)
    except Exception as e:  # what DeepSpeed refuses, said as it says it
        return {"config": config, "refused": f"{type(e).__name__}: {e}"}
    gen = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
    losses = []
    for _ in range(4):
        loss = nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    zero = engine.optimizer
    masters = list(zero.single_partition_of_fp32_groups)
    state = [v for s in zero.optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.numel() > 1]
    out = {
        "config": {k: v for k, v in config.items() if k in ("bf16", "data_types")},
        "refused": None,
        "losses": losses,
        "weights": sorted({dtype_name(p.dtype) for p in net.parameters()}),
        "masters": sorted({dtype_name(m.dtype) for m in masters}),
        "master_bytes": sum(m.numel() * m.element_size() for m in masters),
        "state": sorted({dtype_name(v.dtype) for v in state}),
        "state_bytes": sum(v.numel() * v.element_size() for v in state),
        "grad_accum": dtype_name(engine.get_data_types()[1]),
        "params": sum(p.numel() for p in net.parameters()),
    }
    engine.destroy()
    return out


#: plans run under ZeRO-0 with DeepSpeed's bf16 section in "zero0" mode, each exported by
#: to_config except "grad-fp32-by-hand", a config written by hand for "bf16-master"
ZERO0 = {"fp32-masters": "bf16-true,master=fp32", "no-master": "bf16-true,master=bf16,optim=bf16",
         "grad-fp32-by-hand": "bf16-master"}
#: SGD's steps in "zero0" mode: each update is below half a bf16 ulp of most weights, so a
#: weight moves only where a master copy adds the updates up
ZERO0_STEPS, ZERO0_LR = 16, 1e-3


def zero0_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))


def zero0_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch on every rank: the all-reduced gradient is then each rank's own."""
    gen = torch.Generator().manual_seed(100)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)


def run_zero0(layout: str, rank: int) -> dict[str, Any]:
    """A plan of `ZERO0` under ZeRO-0 with DeepSpeed's bf16 section and SGD: what DeepSpeed
    keeps beside the bf16 weights, and the weights after each step (or how it refuses)."""
    import deepspeed

    net = zero0_net()
    plan = resolve(net, default=ZERO0[layout])
    base = {**UPDATE_BASE, "zero_optimization": {"stage": 0},
            "gradient_clipping": 0.0}  # its default clips at 1.0, which SGD by hand does not
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = ({**base, "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}
                  if layout.endswith("by-hand") else ds_adapter.to_config(plan, base))
        ds_adapter.prepare(net, plan)
    out: dict[str, Any] = {"config": {k: v for k, v in config.items() if k not in base},
                           "warnings": [str(w.message) for w in caught], "refused": None}
    try:
        engine, *_ = deepspeed.initialize(
            model=net, optimizer=torch.optim.SGD(net.parameters(), lr=ZERO0_LR), config=config)
    except Exception as e:  # what DeepSpeed refuses, said as it says it
        return {**out, "refused": f"{type(e).__name__}: {e}"}
    x, y = zero0_batch()
    weights = []
    for _ in range(ZERO0_STEPS):
        engine.backward(nn.functional.mse_loss(engine(x).float(), y))
        engine.step()
        weights.append([p.detach().double().flatten().tolist() for p in net.parameters()])
    masters = [m for group in engine.optimizer.fp32_groups for m in group]
    out.update({
        "optimizer": type(engine.optimizer).__name__,
        "stored": sorted({dtype_name(p.dtype) for p in net.parameters()}),
        "masters": sorted({dtype_name(m.dtype) for m in masters}),
        "master_bytes": sum(m.numel() * m.element_size() for m in masters),
        "grad_accum": dtype_name(engine.get_data_types()[1]),
        "weights": weights,
    })
    engine.destroy()
    return out


def deepseek_v3() -> nn.Module:
    """A tiny Hugging Face DeepSeek-V3: its second layer's router holds the
    `e_score_correction_bias` buffer the class lists in `_keep_in_fp32_modules_strict`, and its
    rotary embedding the fp32 `inv_freq` tables (non-persistent: the plan keeps them fp32)."""
    import transformers

    cfg = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8, first_k_dense_replace=1, n_group=1, topk_group=1,
        max_position_embeddings=64)
    return transformers.DeepseekV3ForCausalLM(cfg)


#: the configs a "bf16-true" DeepSeek-V3 is started with in "buffers" mode: by hand as a user
#: would write them (DeepSpeed's own keep_in_fp32_modules reading), or through to_config
BUFFER_CASES: dict[str, tuple[bool, dict[str, Any]]] = {
    "hand-auto": (False, {"bf16": {"enabled": True}}),
    "exported": (True, {}),
    "hand-buffer-dtype": (False, {"bf16": {"enabled": True},
                                  "data_types": {"buffer_dtype": "bf16",
                                                 "keep_in_fp32_modules": []}}),
    "hand-auto-buffer-dtype": (False, {"bf16": {"enabled": True},
                                       "data_types": {"buffer_dtype": "bf16"}}),
    "exported-buffer-dtype": (True, {"data_types": {"buffer_dtype": "bf16"}}),
}


def buffer_dtypes(net: nn.Module) -> dict[str, str]:
    return {n: dtype_name(b.dtype) for n, b in net.named_buffers() if b.is_floating_point()}


def run_buffers(case: str, stage: int, rank: int) -> dict[str, Any]:
    """A "bf16-true" DeepSeek-V3 under DeepSpeed's bf16 section at `stage`, with a config of
    `BUFFER_CASES`: the dtypes its buffers really have after `prepare`, after `initialize` and
    after two steps."""
    import deepspeed

    exported, extra = BUFFER_CASES[case]
    torch.manual_seed(0)
    net = deepseek_v3()
    plan = resolve(net, default="bf16-true")
    base = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10_000, **extra}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = ds_adapter.to_config(plan, base) if exported else base
        ds_adapter.prepare(net, plan)
    prepared = buffer_dtypes(net)
    values = {n: b.detach().clone().double() for n, b in net.named_buffers()
              if b.is_floating_point()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = deepspeed.initialize(
            model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.05), config=config)
    initialized = buffer_dtypes(net)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(100 + rank))
    losses = []
    for _ in range(2):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    out = {"config": config, "plan": plan.to_json(), "prepared": prepared,
           "initialized": initialized, "stepped": buffer_dtypes(net), "losses": losses,
           "rounded": sorted(n for n, b in net.named_buffers()
                             if n in values and not torch.equal(b.double(), values[n])),
           "drift_warned": any("away from the plan" in str(w.message) for w in caught)}
    engine.destroy()
    return out


def main() -> None:
    mode, stages, outdir = sys.argv[1], [int(s) for s in sys.argv[2].split(",")], Path(sys.argv[3])
    import deepspeed

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    if mode == "buffers":
        for stage in stages:
            for case in BUFFER_CASES:
                (outdir / f"buffers-{case}-stage{stage}-rank{rank}.json").write_text(
                    json.dumps(run_buffers(case, stage, rank)))
        leave()
    if mode == "zero0":
        for layout in ZERO0:
            (outdir / f"zero0-{layout}-rank{rank}.json").write_text(
                json.dumps(run_zero0(layout, rank)))
        leave()
    if mode == "update":
        for layout in [*UPDATES, *HAND_WRITTEN]:
            (outdir / f"update-{layout}-rank{rank}.json").write_text(
                json.dumps(run_update(layout, rank)))
        leave()
    for stage in stages:
        result = run_stage(mode, stage, rank)
        (outdir / f"{mode}-stage{stage}-rank{rank}.json").write_text(json.dumps(result))
    leave()


if __name__ == "__main__":
    main()
