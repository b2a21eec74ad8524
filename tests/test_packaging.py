"""What a newcomer meets first: the license, the source distribution, the README's loop."""

from __future__ import annotations

import re
import tarfile
import warnings
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_the_license_is_shipped_and_named_as_spdx() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]


def test_the_sdist_ships_no_test_rather_than_some(tmp_path: Path) -> None:
    """0.2's sdist carried tests/test_*.py without their helpers, so its tests could not run."""
    from setuptools import build_meta

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the license-table deprecation
        with pytest.MonkeyPatch.context() as patch:
            patch.chdir(ROOT)
            name = build_meta.build_sdist(str(tmp_path))
    with tarfile.open(tmp_path / name) as archive:
        names = archive.getnames()
    assert not [n for n in names if "/tests/" in n or n.endswith(("conftest.py", "helpers.py"))]
    assert any(n.endswith("/LICENSE") for n in names)
    assert any(n.endswith("precision_annot/_src/runtime.py") for n in names)


def test_the_readme_loop_runs_in_bf16_too() -> None:
    """0.2's loop crashed on scaler.scale when switched to bf16 (the scaler was None)."""
    readme = (ROOT / "README.md").read_text()
    (loop,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "GradScaler" in b]
    assert '"16-mixed"' in loop
    exec(compile(loop.replace('"16-mixed"', '"bf16-mixed"'), "README.md", "exec"), {})
