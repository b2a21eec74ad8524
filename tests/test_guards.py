"""The checks and helpers every entry point shares."""

from __future__ import annotations

import gc
import warnings

from torch import nn

from precision_annot import apply
from precision_annot._src.guards import paused_gc, warn


def test_the_cycle_collector_is_paused_for_the_walk_and_restored() -> None:
    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():  # nested: the outer one restores
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()  # the caller's choice is kept
    finally:
        gc.enable()


def test_a_warning_points_at_the_users_line_through_any_depth() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn("said here")
        model = apply(nn.Sequential(nn.Sequential(nn.Linear(2, 2))), default="bf16-mixed")
        model.half()  # the conversion reaches the Linear three calls deep in nn.Module
    assert [w.filename for w in caught] == [__file__, __file__]
