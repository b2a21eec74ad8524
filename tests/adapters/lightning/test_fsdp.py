"""`AnnotatedFSDPPrecision` under Lightning's FSDPStrategy (FSDP1), 2 processes on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lightning")
from tests.adapters.lightning.test_trainer import check, run


@pytest.mark.slow  # over make test's budget: run by make test-all
def test_fsdp_strategy_with_lightnings_cpu_device_id_bypassed(tmp_path: Path) -> None:
    """Lightning's FSDPStrategy passes device_id=None on CPU, which FSDP1 refuses; the worker's
    subclass passes device_id=cpu instead. FSDP1 itself runs for real with gloo, wrapped by the
    plugin's auto_wrap_policy and MixedPrecision from the plan."""
    check(run("fsdp", tmp_path))
