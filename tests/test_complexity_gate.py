"""The complexity gate of `make lint` (tools/complexity.py): it passes on the package as it is,
and fails, naming the function, on one above 15 in radon's count."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers import ROOT

pytest.importorskip("radon")


def gate() -> ModuleType:
    spec = importlib.util.spec_from_file_location("complexity", ROOT / "tools" / "complexity.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def branchy(n: int) -> str:
    """A function of complexity 2n + 1: n ifs, each with an `or`."""
    return "def f(x):\n" + "".join(f"    if x == {i} or x < -{i}:\n        return {i}\n"
                                   for i in range(n)) + "    return -1\n"


def test_the_package_passes_its_own_gate() -> None:
    assert gate().main([]) == 0


def test_the_gate_fails_above_15_counting_and_or(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    g = gate()
    code = tmp_path / "branchy.py"
    code.write_text(branchy(7))
    assert list(g.scores([code]).values()) == []  # 15: at the limit
    assert g.main([str(code)]) == 0
    code.write_text(branchy(8))  # 8 ifs, 8 ors, 1: ruff's C901 counts 9 of these 17
    assert list(g.scores([code]).values()) == [17]
    assert g.main([str(code)]) == 1
    assert "branchy.py:f: complexity 17, above 15" in capsys.readouterr().err
