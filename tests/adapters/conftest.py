"""`group`: a one-rank gloo process group for the in-process DDP and FSDP tests (the
environment it sets is restored by tests/conftest.py)."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from tests.helpers import free_port


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
