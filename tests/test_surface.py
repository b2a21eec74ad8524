"""The public surface as DESIGN.md fixes it, and adapters that import their backend lazily."""

from __future__ import annotations

import subprocess
import sys

import precision_annot


def test_public_names() -> None:
    assert set(precision_annot.__all__) == {
        "fp64", "fp32", "fp16", "bf16", "Policy", "precision", "precision_scope", "annotate",
        "resolve", "apply", "remove", "PrecisionPlan", "audit", "GradScaler",
    }
    for name in precision_annot.__all__:
        assert getattr(precision_annot, name) is not None


def test_core_and_adapters_import_no_backend_until_used() -> None:
    code = (
        "import sys, precision_annot\n"
        "from precision_annot.adapters import ddp, fsdp, deepspeed\n"
        "bad = [m for m in ('lightning', 'deepspeed', 'pytorch_lightning') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "assert 'torch.distributed.fsdp' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
