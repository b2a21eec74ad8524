"""`precision_scope`: what it tags, nesting, threads and tasks, and the `__init__` hook."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch
from torch import nn

from precision_annot import (
    Policy,
    apply,
    bf16,
    fp16,
    fp32,
    precision_scope,
    resolve,
)


def test_scope_tags_root_submodules_and_parameterless_modules() -> None:
    with precision_scope(compute=bf16):
        model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Sequential(nn.GELU()))
    plan = resolve(model)
    assert all(e.sources["compute"] == "scope" for e in plan.values())


def test_nested_scopes_merge_and_inner_wins() -> None:
    with precision_scope(compute=bf16, storage=fp32):
        outer = nn.Linear(2, 2)
        with precision_scope(compute=fp16, comm=bf16):
            inner = nn.Linear(2, 2)
        after = nn.Linear(2, 2)
    assert resolve(outer)[""].policy == Policy(compute=bf16, storage=fp32)
    assert resolve(inner)[""].policy == Policy(compute=fp16, storage=fp32, comm=bf16)
    assert resolve(after)[""].policy == Policy(compute=bf16, storage=fp32)
    assert resolve(nn.Linear(2, 2))[""].policy == Policy()


def test_scope_restores_state_after_an_exception() -> None:
    before = nn.Module.__init__  # torch.compile may have wrapped it already: that stays
    with pytest.raises(RuntimeError, match="boom"), precision_scope(compute=bf16):
        raise RuntimeError("boom")
    assert resolve(nn.Linear(2, 2))[""].policy == Policy()
    assert nn.Module.__init__ is before


def test_a_patch_another_library_makes_inside_a_scope_is_kept() -> None:
    """0.1 put back the __init__ it saw at import, dropping any patch made meanwhile (torch's
    Dynamo wraps nn.Module.__init__ the first time torch.compile runs)."""
    before = nn.Module.__init__
    seen: list[str] = []
    with precision_scope(compute=bf16):
        ours = nn.Module.__init__

        def theirs(self: nn.Module, *args: Any, **kwargs: Any) -> None:
            ours(self, *args, **kwargs)
            seen.append(type(self).__name__)

        nn.Module.__init__ = theirs  # type: ignore[method-assign]
        inside = nn.Linear(2, 2)
    try:
        assert nn.Module.__init__ is theirs  # kept
        outside = nn.Linear(2, 2)
        assert seen == ["Linear", "Linear"]
        assert resolve(inside)[""].policy.compute == bf16
        assert resolve(outside)[""].policy == Policy()  # our wrapper, still called, tags nothing
    finally:
        nn.Module.__init__ = before  # type: ignore[method-assign]


def test_scope_does_not_leak_into_another_thread() -> None:
    entered, built = threading.Event(), threading.Event()
    other: list[nn.Module] = []

    def construct() -> None:
        entered.wait(5)
        other.append(nn.Linear(2, 2))
        built.set()

    thread = threading.Thread(target=construct)
    thread.start()
    with precision_scope(compute=bf16):
        entered.set()
        built.wait(5)
        mine = nn.Linear(2, 2)
    thread.join()
    assert resolve(mine)[""].policy.compute == bf16
    assert resolve(other[0])[""].policy.compute is None


def test_scope_does_not_leak_into_another_asyncio_task() -> None:
    async def scoped(gate: asyncio.Event, done: asyncio.Event) -> nn.Module:
        with precision_scope(compute=fp16):
            gate.set()
            await done.wait()
            return nn.Linear(2, 2)

    async def plain(gate: asyncio.Event, done: asyncio.Event) -> nn.Module:
        await gate.wait()
        module = nn.Linear(2, 2)
        done.set()
        return module

    async def main() -> tuple[nn.Module, nn.Module]:
        gate, done = asyncio.Event(), asyncio.Event()
        return await asyncio.gather(scoped(gate, done), plain(gate, done))  # type: ignore[return-value]

    mine, other = asyncio.run(main())
    assert resolve(mine)[""].policy.compute == fp16
    assert resolve(other)[""].policy.compute is None


def test_scope_rejects_unknown_fields() -> None:
    with pytest.raises(TypeError, match="Unknown policy field 'speed'"):
        precision_scope(speed=bf16)


def test_precision_scope_as_a_decorator() -> None:
    @precision_scope(compute="bf16")
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(2, 2))

    first, second = build(), build()
    assert resolve(first)["0"].policy.compute == bf16 == resolve(second)["0"].policy.compute
    assert resolve(nn.Linear(2, 2))[""].policy.compute is None  # nothing leaks after the call
    assert build.__name__ == "build"
    with pytest.raises(TypeError, match=r"@precision\('compute=bf16'\)"):
        precision_scope(compute="bf16")(nn.Linear)


def test_scope_inside_an_applied_forward_points_to_the_function_form() -> None:
    class Bad(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with precision_scope(fp32):
                return x

    model = apply(Bad(), default="bf16")
    with pytest.raises(RuntimeError, match=r"function form.*precision\(fp32\)\(fn\)"):
        model(torch.randn(2))
    with precision_scope(fp32):  # the depth counter was restored
        pass


def test_the_decorator_scopes_each_step_of_a_generator_and_async_factories() -> None:
    """0.2 tagged nothing: the scope closed before the generator's body ran."""
    @precision_scope(compute=bf16)
    def layers() -> Any:
        first = nn.Linear(2, 2)
        yield first
        yield nn.Linear(2, 2)
        return "done"

    steps = layers()
    first = next(steps)
    between = nn.Linear(2, 2)  # the caller's code between steps is not in the scope
    second = next(steps)
    with pytest.raises(StopIteration) as stop:
        next(steps)
    assert stop.value.value == "done"
    assert [resolve(m).root.policy.compute for m in (first, between, second)] == [bf16, None,
                                                                                  bf16]

    @precision_scope(compute=fp16)
    async def build() -> nn.Module:
        await asyncio.sleep(0)
        return nn.Linear(2, 2)

    @precision_scope(compute=fp16)
    async def stream() -> Any:
        yield nn.Linear(2, 2)

    async def collect() -> list[nn.Module]:
        return [m async for m in stream()]

    assert resolve(asyncio.run(build())).root.policy.compute == fp16
    assert [resolve(m).root.policy.compute for m in asyncio.run(collect())] == [fp16]
    assert resolve(nn.Linear(2, 2)).root.policy.compute is None  # nothing leaked
