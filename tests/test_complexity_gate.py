"""The complexity gate of `make lint` (tools/complexity.py): it passes on the package as it is,
and fails on a function above 15 that the baseline does not list, on a listed one that rises,
and on a listed one that is no longer needed."""

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


BRANCHY = "def f(x):\n" + "".join(f"    if x == {i} or x < -{i}:\n        return {i}\n"
                                  for i in range(9)) + "    return -1\n"


def test_the_package_passes_its_own_gate() -> None:
    assert gate().main([]) == 0


def test_the_gate_fails_on_new_risen_and_stale_entries(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    g = gate()
    code = tmp_path / "branchy.py"
    code.write_text(BRANCHY)
    found = g.scores([code])
    assert list(found.values()) == [19]  # 9 ifs, 9 ors, 1
    name = next(iter(found))
    baseline = tmp_path / "baseline.txt"
    baseline.write_text("")
    assert g.main([str(code), "--baseline", str(baseline)]) == 1
    assert "complexity 19, above 15: split it" in capsys.readouterr().err
    baseline.write_text(f"{name} 18\n")
    assert g.main([str(code), "--baseline", str(baseline)]) == 1
    assert "up from 18 in the baseline" in capsys.readouterr().err
    baseline.write_text(f"{name} 19\n")
    assert g.main([str(code), "--baseline", str(baseline)]) == 0
    code.write_text("def f(x):\n    return x\n")
    assert g.main([str(code), "--baseline", str(baseline)]) == 1
    assert "remove it from the baseline" in capsys.readouterr().err
