"""Every test leaves the process environment as it found it.

The low-bit update (`optim="8bit"` and the like) runs eagerly in the tests, for speed: its
compiled default costs a compile per layout, paid by the one test of it
(tests/update/test_kernels.py).

Lightning's Trainer writes MASTER_ADDR, MASTER_PORT, NODE_RANK and LOCAL_RANK into os.environ
when it starts (even when it then refuses a strategy); a later multi-process launch that
inherits LOCAL_RANK believes it is already a child and starts no second rank.

A test that fails only because this CPU's kernels cannot run fp8 GEMMs (oneDNN limited to
AVX2, as `make test-avx2` limits it, refused them on an AVX-512 CPU: "could not create a
primitive descriptor") is reported as skipped, with that reason; every other failure of it
stays a failure.
"""

from __future__ import annotations

import functools
import gc
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

from tests.helpers import free_port


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def _eager_low_bit_update() -> Iterator[None]:
    from precision_annot._src.update import engines

    saved = engines.COMPILE
    engines.COMPILE = False
    yield
    engines.COMPILE = saved


@functools.cache
def _fp8_refusal() -> str | None:
    """Why this CPU's kernels cannot run fp8 GEMMs, or None (also where torchao is absent)."""
    import torch

    from precision_annot._src import float8

    if not float8.available():
        return None
    return float8.kernel_refusal(float8.Gemm("fp8"), torch.device("cpu"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.failed and call.excinfo is not None:
        refusal = _fp8_refusal()
        if refusal is not None and refusal.split(": ", 1)[-1] in str(call.excinfo.value):
            report.outcome = "skipped"
            report.longrepr = (str(item.path), item.location[1] or 0,
                               f"Skipped: this CPU's kernels cannot run fp8 GEMMs ({refusal})")
    return report


# `group`: a one-rank gloo process group for in-process DDP, FSDP and tensor-parallel tests
# (the environment it sets is restored by `_restore_environment`)
@pytest.fixture
def group() -> Iterator[None]:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        gc.collect()  # a DDP or FSDP wrapper left in a reference cycle goes before its group
        dist.destroy_process_group()
