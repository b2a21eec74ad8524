"""The protocol `check` asks every backend through: each declares its option keys once, `check`
validates and dispatches through it, and a new backend plugs in by one registry line."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from precision_annot import check, fp32, precision, resolve
from precision_annot._src import check_backend
from precision_annot._src.check_backend import (
    BACKENDS,
    LOOP_KEYS,
    REGISTRY,
    CheckBackend,
    Checked,
    backend_for,
)
from precision_annot._src.findings import Finding
from precision_annot._src.runtime import Subject


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 8), precision(fp32)(nn.LayerNorm(8)), nn.Linear(8, 8))


@pytest.mark.parametrize("name", BACKENDS)
def test_every_backend_is_found_through_the_registry_under_its_name(name: str) -> None:
    if name == "lightning":
        pytest.importorskip("lightning")
    if name == "deepspeed":
        pytest.importorskip("deepspeed")
    impl = backend_for(name)
    assert isinstance(impl, CheckBackend) and impl.name == name
    if impl.keys:  # a key it does not declare is refused, naming the ones it does
        said = f"unknown key 'nope'; valid: {list(impl.keys)}"
        with pytest.raises(ValueError, match=re.escape(said)):
            check(model(), name, {"nope": 1})


def test_the_core_reaches_no_adapter_until_a_backend_is_asked_for() -> None:
    """Adapters are named in the registry as strings: importing `check` imports none."""
    source = check_backend.__file__
    assert source is not None
    text = Path(source).read_text()
    assert "import precision_annot.adapters" not in text
    assert "from precision_annot.adapters" not in text
    assert all(":" in where for where in REGISTRY.values())


class Recording(CheckBackend):
    """A backend written as the module note says: keys declared once, `run` dispatched to."""

    name = "recording"
    keys = ("mesh", *LOOP_KEYS)
    seen: ClassVar[list[tuple[Subject, Any]]] = []

    def run(self, given: Subject, options: Any) -> Checked:
        self.seen.append((given, options))
        return Checked([Finding("info", "recording", "", "seen", "none")],
                       comm=dict.fromkeys([n for n, e in given.plan.items() if e.params],
                                          torch.bfloat16))


def test_a_new_backend_plugs_in_by_one_registry_line(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("recording_backend")
    module.CHECKS = Recording()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "recording_backend", module)
    monkeypatch.setitem(REGISTRY, "recording", "recording_backend:CHECKS")
    monkeypatch.setattr(check_backend, "_LOADED", {})
    plan = resolve(model(), "bf16-mixed")
    found = check(plan, "recording", {"mesh": 2, "grad_scaler": True})
    given, options = Recording.seen[-1]
    assert given.plan is plan and options == {"mesh": 2, "grad_scaler": True}
    # its own finding, and the numerics every training backend gets, from the comm it reported
    # (bf16 over fp32 storage: summed narrower than stored)
    assert [f.code for f in found] == ["narrow-comm", "recording"]
    with pytest.raises(ValueError, match=r"unknown key 'stage'; valid: \['mesh', "):
        check(plan, "recording", {"stage": 2})
    with pytest.raises(TypeError, match="config for backend='recording' is a dict"):
        check(plan, "recording", 3)


def test_loop_keys_are_read_only_for_a_backend_that_declares_them() -> None:
    """A DeepSpeed config's `optimizer` section is DeepSpeed's, never the loop's optimizer."""
    assert backend_for("local").loop({"optimizer": 1, "grad_scaler": True}) == {
        "optimizer": 1, "grad_scaler": True}

    class Own(CheckBackend):
        name = "own"
        keys = None

    assert Own().loop({"optimizer": {"type": "AdamW"}}) == {}


@pytest.mark.parametrize(("backend", "config", "said"), [
    ("local", {"grad_scaler": "yes"}, "'grad_scaler' is True when the training loop scales"),
    ("ddp", {"grad_scaler": 1}, "Received: grad_scaler=1 (of type int)"),
    ("fsdp", {"units": "blocks.*"}, "'units' is a list of selectors as annotate takes them"),
    ("fsdp", {"units": 3}, "Received: units=3 (of type int)"),
    ("fsdp1", {"use_orig_params": "no"}, "'use_orig_params' is FSDP1's flag, True or False"),
])
def test_a_config_value_of_the_wrong_type_is_refused_naming_it(
        backend: str, config: dict[str, Any], said: str) -> None:
    """0.4 took a truthy string for grad_scaler=True and use_orig_params=True, iterated a units
    string letter by letter ("the name 'b' matches no module"), and raised "'int' object is not
    iterable" for units=3."""
    with pytest.raises(TypeError, match=re.escape(said)):
        check(model(), backend, config)
