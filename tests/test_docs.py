"""Every ```python block in README.md and docs/ runs, and so does every docstring example.

Each block runs on its own, as a reader who copies it would run it, unless its first line says
it goes on from the block before it.
"""

from __future__ import annotations

import contextlib
import doctest
import importlib
import importlib.util
import io
import re
import sys
from pathlib import Path

import pytest

from tests.helpers import free_port

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
PRINTS = re.compile(r"^prints\n\n```text\n(.*?)^```", re.S | re.M)


OPTIONAL = ("lightning", "deepspeed", "transformers", "accelerate", "matplotlib", "torchao")
# the first line of a block that goes on from the block before it, in its namespace
CONTINUED = "# continued from the example above"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_blocks_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = BLOCK.findall(path.read_text())
    for package in OPTIONAL:
        used = any(re.search(rf"^\s*(from|import) {package}\b", b, re.M) for b in blocks)
        if used and importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed")
    monkeypatch.chdir(tmp_path)
    # the pages' one-process groups take MASTER_PORT with setdefault: a free one here, so that
    # another run on this machine holding a page's port does not fail this one
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    if "accelerate" in sys.modules:  # Accelerate keeps one global state per process
        sys.modules["accelerate"].state.AcceleratorState._reset_state(reset_partial_state=True)
    namespace: dict[str, object] = {}
    printed = io.StringIO()
    for i, block in enumerate(blocks):
        if not block.startswith(CONTINUED):  # each block runs alone, unless it says otherwise
            namespace = {"__name__": f"docs_{path.stem}"}
        code = compile(block, f"{path.relative_to(ROOT)}[block {i}]", "exec")
        with contextlib.redirect_stdout(printed):
            exec(code, namespace)
    # output a page shows after "prints" is what its code printed (lines may be re-wrapped)
    for shown in PRINTS.findall(path.read_text()):
        assert " ".join(shown.split()) in " ".join(printed.getvalue().split()), shown


MODULES = [f"precision_annot._src.{name}" for name in (
    "policy", "annotation", "resolution", "runtime", "auditing", "scaler", "suggest.pipeline",
    "checking", "watching", "diffing", "update.optimizer")]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.attempted > 0
    assert result.failed == 0
