"""The version is written in one place, and the package, the CLI and the build all read it
there (0.4's features shipped while `precision-annot --version` still said 0.3.0)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import tomllib

import precision_annot
from precision_annot._src.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_the_package_the_cli_and_the_build_read_the_one_version(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
        ) -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" in pyproject["project"]["dynamic"] and "version" not in pyproject["project"]
    module, _, name = pyproject["tool"]["setuptools"]["dynamic"]["version"]["attr"].rpartition(
        ".")
    version = getattr(importlib.import_module(module), name)
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|rc\d+)?", version)
    assert precision_annot.__version__ == version
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == (
        f"precision-annot {version}")
    from setuptools import build_meta

    monkeypatch.chdir(ROOT)
    info = build_meta.prepare_metadata_for_build_wheel(str(tmp_path))
    metadata = (tmp_path / info / "METADATA").read_text()
    assert f"\nVersion: {version}\n" in metadata
    # and it is written nowhere else in the package
    source = Path(importlib.import_module(module).__file__ or "")
    literal = re.compile(r"^(__version__|VERSION)\s*=\s*['\"]", re.M)
    for path in (ROOT / "precision_annot").rglob("*.py"):
        assert path == source or not literal.search(path.read_text()), path
