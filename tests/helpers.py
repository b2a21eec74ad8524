"""Small modules that record what their forward saw, and tolerance helpers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from precision_annot import fp32, precision


class Recorder(nn.Module):
    """Wraps a module and records the dtype of its first input and whether autocast is on."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.seen: list[torch.dtype] = []
        self.autocast: list[bool] = []

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.seen.append(x.dtype)
        self.autocast.append(torch.is_autocast_enabled(x.device.type))
        return self.inner(x, *args, **kwargs)


def tol(dtype: torch.dtype) -> dict[str, float]:
    """assert_close tolerances for a computation carried out in `dtype`."""
    return {
        torch.float64: {"rtol": 1e-10, "atol": 1e-10},
        torch.float32: {"rtol": 1e-5, "atol": 1e-5},
        torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
        torch.float16: {"rtol": 2e-3, "atol": 2e-3},
    }[dtype]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


ROOT = Path(__file__).resolve().parent.parent
# DeepSpeed JIT-compiles a communication op on first use (about 30 s here). Each clone builds it
# in its own directory: torch's build lock is a bare file that a killed build leaves behind, and
# a build that finds one waits for it forever, so a lock inherited from a shared cache would
# hang every DeepSpeed launch.
EXTENSIONS = ROOT / ".torch_extensions"
STALE_LOCK_S = 600.0
_op_build: list[str] = []  # "" once built, else the failure


def deepspeed_op_built(timeout: float = 300) -> None:
    """Build DeepSpeed's CPU communication op once per session, before any launch needs it, so a
    failed or stuck build fails one step with its output instead of hanging every launch."""
    if not _op_build:
        import time

        for lock in EXTENSIONS.glob("**/lock"):
            if time.time() - lock.stat().st_mtime > STALE_LOCK_S:  # left by a killed build
                lock.unlink()
        code = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
        try:
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  timeout=timeout, env=_environment())
            failure = "" if proc.returncode == 0 else proc.stdout[-2000:] + proc.stderr[-4000:]
        except subprocess.TimeoutExpired:
            failure = (f"building DeepSpeed's communication op in {EXTENSIONS} took over "
                       f"{timeout:.0f} s; a lock file there may be held by another build")
        _op_build.append(failure)
    assert not _op_build[0], _op_build[0]


def _environment(port: str | None = None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": str(EXTENSIONS),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if port is not None:
        env["MASTER_PORT"] = port
    return env


def launch(module: str, *args: str, ranks: int, timeout: float,
           cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run `python -m module args` once, or on `ranks` processes under torch.distributed.run,
    with the repository importable; fail the test with the output if it fails."""
    port = str(free_port())
    env = _environment(port)
    if ranks == 1:
        cmd = [sys.executable, "-m", module, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
               "--master_port", port, "-m", module, *args]
    proc: subprocess.CompletedProcess[str] = run_processes(cmd, timeout=timeout, env=env, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def run_processes(cmd: list[str], *, timeout: float, **kwargs: Any) -> Any:
    """Run a launch; retry once only if it died by a signal, never after a Python error.

    Seen in 2-rank DeepSpeed launches: a rank aborting (SIGABRT, "terminate called without an
    active exception") at interpreter exit, in native teardown (the DeepSpeed worker now skips
    that teardown). torch.distributed.run reports each failed rank's exit code; a rank that
    raised exits with 1, so only launches whose every failed rank died by a signal retry.
    """
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    if proc.returncode != 0 and _died_by_signal(proc.returncode, proc.stderr):
        import warnings

        warnings.warn(f"launch retried after a death by signal (rc={proc.returncode}): "
                      f"{proc.stderr[-1500:]}", UserWarning, stacklevel=2)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    return proc


def _died_by_signal(returncode: int, stderr: str) -> bool:
    import re

    if returncode < 0:  # a single process
        return True
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", stderr)]
    return bool(codes) and all(c < 0 for c in codes)


def island_model() -> tuple[nn.Sequential, Recorder, Recorder, Recorder]:
    """DeepSpeed issue 2100's model: f (low) -> g (an fp32 island) -> f (low)."""
    torch.manual_seed(0)
    f1 = Recorder(nn.Linear(8, 8))
    g = precision(fp32)(Recorder(nn.LayerNorm(8)))
    f2 = Recorder(nn.Linear(8, 4))
    return nn.Sequential(f1, g, f2), f1, g, f2


def encdec() -> nn.Module:
    """enc and dec, each a Linear then a LayerNorm."""
    return nn.ModuleDict({
        "enc": nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)),
        "dec": nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)),
    })


def planted_t5(wi: float, wo: float) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A small T5 (random weights) whose feed-forward weights are scaled by `wi` and `wo`, to
    plant fp16 overflows as T5 checkpoints have them, and a batch with labels."""
    import transformers

    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=128, d_model=32, d_ff=64, d_kv=8, num_layers=2,
                                   num_heads=4, decoder_start_token_id=0)
    t5 = transformers.T5ForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in t5.named_parameters():
            if name.endswith("wi.weight"):
                p.mul_(wi)
            elif name.endswith("wo.weight"):
                p.mul_(wo)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    return t5, {"input_ids": ids, "labels": ids[:, :6].contiguous()}


def accumulate_as_planned(model: nn.Module) -> nn.Module:
    """Each parameter whose applied plan says grad=fp32 (wider than it is stored) accumulates
    its gradient in that dtype (`Tensor.grad_dtype`), as `apply` does with the grad=fp32 route
    through `grad_dtype`; idempotent, so it also holds where `apply` already set it."""
    from precision_annot._src.update.guard import planned
    from precision_annot._src.update.rule import rule_for

    for p in model.parameters():
        said = planned(p)
        if said is not None:
            rule = rule_for(said.fields, p.dtype)
            if rule.grad != p.dtype:
                p.grad_dtype = rule.grad
    return model


class Allocations(TorchDispatchMode):  # type: ignore[misc]
    """The bytes of every new (non-view) tensor made inside the block, and the ops run."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops.append(str(func.overloadpacket.__name__))
        mutating = func._schema.is_mutable or func.is_view
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor) and not mutating:
                self.bytes += t.untyped_storage().nbytes()
        return out
