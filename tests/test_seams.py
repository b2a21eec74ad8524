"""The torches the package supports: the floor and the newest agree everywhere they are
stated, and each version seam takes the branch its torch needs, shown on that torch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib
import torch

from precision_annot._src import seams

ROOT = Path(__file__).resolve().parent.parent


def test_versions_are_read_as_releases() -> None:
    assert seams.parse("2.15.0+cu132") == (2, 15, 0)
    assert seams.parse("2.13.0+cpu") == (2, 13, 0)
    assert seams.parse("2.16.0a0+git1234") == (2, 16, 0)
    assert seams.parse("2.14") == (2, 14, 0)
    with pytest.raises(ValueError, match="not a torch version: 'nightly'"):
        seams.parse("nightly")
    assert seams.parse(torch.__version__) == seams.TORCH
    assert seams.at_least(*seams.TORCH[:2]) and not seams.at_least(seams.TORCH[0],
                                                                 seams.TORCH[1] + 1)


def test_the_floor_is_the_same_in_pyproject_the_lock_and_the_package() -> None:
    """pyproject.toml's floor is the torch the floor lock's suite runs on (the Makefile's
    TORCH), and the newest lock pins the newest release the package names."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (torch_req,) = [d for d in project["dependencies"] if d.startswith("torch")]
    floor = re.fullmatch(r"torch>=([\d.]+)", torch_req)
    assert floor, torch_req
    assert seams.parse(floor.group(1)) == seams.FLOOR
    makefile = (ROOT / "Makefile").read_text()
    pinned = re.search(r"^TORCH\s+\?= torch==([\d.]+)$", makefile, re.M)
    assert pinned and seams.parse(pinned.group(1)) == seams.FLOOR
    newest = re.search(r"^NEWEST_TORCH \?= torch==([\d.]+)$", makefile, re.M)
    assert newest and seams.parse(newest.group(1)) == seams.NEWEST
    lock = (ROOT / "requirements" / "lock-newest.txt").read_text()
    assert f"\ntorch=={'.'.join(map(str, seams.NEWEST))}\n" in lock
    assert "\ntorch==" not in (ROOT / "requirements" / "lock.txt").read_text()
    assert seams.FLOOR <= seams.TORCH, "the suite runs on a torch older than the floor"


@pytest.mark.skipif("PA_EXPECT_TORCH" not in os.environ,
                    reason="make test-floor and make test-newest name the torch they test")
def test_the_suite_runs_on_the_torch_the_makefile_names() -> None:
    """`make test-newest` on a venv that holds another torch would skip every test of the
    newest torch's branches and pass: it names the torch it means, and this test fails."""
    expected = os.environ["PA_EXPECT_TORCH"].removeprefix("torch==")
    assert seams.parse(expected) == seams.TORCH, (torch.__version__, expected)


_CALLED = """
import torch, torch.utils.checkpoint as c
calls = []
for name in {names!r}:
    real = getattr(c, name, None)
    if real is not None:
        def counted(*a, real=real, name=name, **k):
            calls.append(name)
            return real(*a, **k)
        setattr(c, name, counted)
c.checkpoint(torch.sin, torch.ones(2, requires_grad=True), use_reentrant=False).sum().backward()
print(sorted(set(calls)))
"""


def _generators_called() -> list[str]:
    """The generator names a plain non-reentrant checkpoint goes through, in a process where
    precision_annot is not imported (and so wraps nothing)."""
    names = ["_checkpoint_without_reentrant_generator",
             "_checkpoint_without_reentrant_generator_impl"]
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_CALLED.format(names=names))],
                          capture_output=True, text=True, timeout=120, check=True)
    return eval(done.stdout.strip())  # type: ignore[no-any-return]


@pytest.mark.skipif(seams.at_least(2, 14), reason="the branch of torch 2.13")
def test_before_2_14_checkpoint_starts_through_the_old_generator() -> None:
    assert seams.CHECKPOINT_GENERATOR == "_checkpoint_without_reentrant_generator"
    assert _generators_called() == ["_checkpoint_without_reentrant_generator"]


@pytest.mark.skipif(not seams.at_least(2, 14), reason="the branch of torch 2.14 and later")
def test_from_2_14_checkpoint_starts_through_impl_and_not_the_old_name() -> None:
    """torch 2.14 kept the old name beside the new one, and `checkpoint` calls only the new:
    wrapping the old one (0.5) changed nothing, silently."""
    assert seams.CHECKPOINT_GENERATOR == "_checkpoint_without_reentrant_generator_impl"
    assert _generators_called() == ["_checkpoint_without_reentrant_generator_impl"]


def _queued_after_the_backward() -> list[str]:
    """What `grads` relies on: a callback queued during a backward runs when it ends, after
    the hooks, and one it queues runs after it."""
    ran: list[str] = []
    x = torch.ones(2, requires_grad=True)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        def first() -> None:
            ran.append("first")
            seams.queue_callback(lambda: ran.append("queued by first"))

        seams.queue_callback(first)
        ran.append("hook")
        return grad

    y = x * 2
    y.register_hook(hook)
    y.sum().backward()
    return ran


@pytest.mark.skipif(seams.at_least(2, 15), reason="the branch of torch 2.13 and 2.14")
def test_before_2_15_callbacks_are_queued_on_autograds_engine() -> None:
    assert not seams.QUEUE_CALLBACK_PUBLIC
    assert seams.queue_callback == torch.autograd.Variable._execution_engine.queue_callback
    assert _queued_after_the_backward() == ["hook", "first", "queued by first"]


@pytest.mark.skipif(not seams.at_least(2, 15), reason="public from torch 2.15")
def test_from_2_15_callbacks_are_queued_through_the_public_function() -> None:
    assert seams.QUEUE_CALLBACK_PUBLIC
    assert seams.queue_callback is torch.autograd.graph.queue_callback  # type: ignore[attr-defined]
    assert _queued_after_the_backward() == ["hook", "first", "queued by first"]
