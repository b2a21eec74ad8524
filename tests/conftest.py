"""Every test leaves the process environment as it found it.

The low-bit update (`optim="8bit"` and the like) runs eagerly in the tests, for speed: its
compiled default costs a compile per layout, paid by the one test of it
(tests/update/test_kernels.py).

Lightning's Trainer writes MASTER_ADDR, MASTER_PORT, NODE_RANK and LOCAL_RANK into os.environ
when it starts (even when it then refuses a strategy); a later multi-process launch that
inherits LOCAL_RANK believes it is already a child and starts no second rank.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


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
