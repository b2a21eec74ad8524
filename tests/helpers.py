"""Small modules that record what their forward saw, and tolerance helpers."""

from __future__ import annotations

import socket
from typing import Any

import torch
from torch import nn


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


def run_processes(cmd: list[str], *, timeout: float, **kwargs: Any) -> Any:
    """Run a multi-process launch; retry once only if a process died by a signal.

    Seen here once in several full runs: a 2-rank gloo launch aborting (exit -6) with no Python
    error. A test failure (a Python exception, an assertion) is never retried.
    """
    import subprocess

    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    died_by_signal = proc.returncode < 0 or "exitcode: -" in proc.stderr
    if proc.returncode != 0 and died_by_signal and "Traceback" not in proc.stderr:
        import warnings

        warnings.warn(f"multi-process launch retried after a signal death (rc="
                      f"{proc.returncode}): {proc.stderr[-1500:]}", UserWarning, stacklevel=2)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    return proc
