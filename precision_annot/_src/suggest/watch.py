"""`Watch`: a dispatch mode that books the peaks and non-finite values of each module's own ops."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from precision_annot._src.casting import floating_leaves
from precision_annot._src.float8 import is_wrapper_subclass
from precision_annot._src.suggest.compare import scan
from precision_annot._src.suggest.constants import OUTSIDE
from precision_annot._src.suggest.records import Counts
from precision_annot._src.tracking import DATA_MOVEMENT, ModuleTracker

FP8_DATA = frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
                       torch.float8_e5m2fnuz, torch.float8_e8m0fnu})


class Watch(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Watches the ops of a run: the largest |value| each module's own ops produce in forward,
    the largest in backward, how many non-finite elements each module's own ops produce, and
    the first module whose count goes past the reference's.

    Some code makes non-finite values on purpose (an attention mask of -inf, or
    `finfo.min + bias`, which overflows even in fp32), so a module counts as the culprit only
    when it makes more of them than it did in the fp32 reference. Ops that only move data
    (a `masked_fill`, a copy) pass values on and are not counted; a cast is.
    """

    def __init__(self, tracker: ModuleTracker, *, peaks: bool = False,
                 baseline: Counts | None = None, feeds_above: float | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.tracker = tracker
        self.track_peaks = peaks
        self.baseline = baseline
        self.peaks: dict[str, float] = {}
        self.backward_peak = 0.0
        self.counts: Counts = {}
        self.first_nonfinite: str | None = None
        #: with `feeds_above`: for each module whose own code (in forward) made a value above
        #: it, the modules whose outputs that value was computed from (a tensor is tagged with
        #: the module that returned it, and the tag follows it through the ops of the code
        #: that uses it)
        self.feeds_above = feeds_above
        self.feeds: dict[str, set[str]] = {}
        self._sources: dict[int, tuple[weakref.ref[torch.Tensor], frozenset[str]]] = {}
        self.paused = False

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Ops run inside are not the model's (the copies a reference run keeps of inputs
        and outputs): not booked to the module they run under."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False

    def _resting(self) -> bool:
        """Nothing to book: the watcher's own copies run, or a check's culprit is found
        (all a check reads)."""
        return self.paused or (self.baseline is not None and self.first_nonfinite is not None)

    def returned(self, name: str, output: Any) -> None:
        """`name`'s forward returned `output`: its tensors are tagged as coming from it."""
        if self.feeds_above is not None:
            leaves: list[torch.Tensor] = []
            floating_leaves(output, leaves)
            for t in leaves:
                self._sources[id(t)] = (weakref.ref(t), frozenset({name}))

    def _from(self, args: Any, kwargs: Any) -> frozenset[str]:
        """The modules the tensors an op is given were computed from."""
        leaves: list[torch.Tensor] = []
        floating_leaves((args, kwargs), leaves)
        found: frozenset[str] = frozenset()
        for t in leaves:
            entry = self._sources.get(id(t))
            if entry is not None and entry[0]() is t:
                found |= entry[1]
        return found

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self._resting():
            return out
        tracing = self.feeds_above is not None and torch._C._current_graph_task_id() == -1
        sources = self._from(args, kwargs) if tracing else frozenset()
        if func.is_view and not sources:
            return out
        results = _results(out)
        for t in results if sources else ():  # the tag follows the value, views included
            self._sources[id(t)] = (weakref.ref(t), sources)
        if func.is_view or not results:
            return out
        packet = func.overloadpacket.__name__
        counted = packet == "_to_copy" or packet not in DATA_MOVEMENT
        if counted or self.track_peaks:
            self._book(results, counted, sources if tracing else None)
        return out

    def _book(self, results: list[torch.Tensor], counted: bool,
              sources: frozenset[str] | None) -> None:
        """One op's results, booked to the module whose own code ran it: its non-finite
        elements (`counted`), its peak, and (`sources`, forward with `feeds_above`) the
        modules a value past `feeds_above` was computed from."""
        owner = self.tracker.owner()
        backward = torch._C._current_graph_task_id() != -1
        name, phase = owner if owner is not None else (
            OUTSIDE, "backward" if backward else "forward")
        bad, peak = 0, 0.0
        for t in results:
            n, top = scan(t.detach(), self.track_peaks)
            bad, peak = bad + n, max(peak, top)
        if counted and bad:
            self._count(name, phase, bad)
        if self.track_peaks:
            self._peak(name, phase, owner is not None, peak)
        if sources is not None and owner is not None and peak > cast(float, self.feeds_above):
            # (no sources: made from the module's own inputs and weights alone)
            self.feeds.setdefault(name, set()).update(sources)

    def _count(self, name: str, phase: str, bad: int) -> None:
        """Book the non-finite elements an op of `name` made; the first module past the
        baseline's count is the culprit."""
        key = (name, phase)
        self.counts[key] = self.counts.get(key, 0) + bad
        if (self.baseline is not None and self.first_nonfinite is None
                and self.counts[key] > self.baseline.get(key, 0)):
            self.first_nonfinite = name

    def _peak(self, name: str, phase: str, owned: bool, peak: float) -> None:
        """Book the largest finite |value| of an op: per module in forward, one for backward."""
        if phase == "forward" and owned:
            self.peaks[name] = max(self.peaks.get(name, 0.0), peak)
        elif phase == "backward":
            self.backward_peak = max(self.backward_peak, peak)


def _results(out: Any) -> list[torch.Tensor]:
    """The floating tensors an op made, but fp8 GEMMs' scaled data and tensor subclasses."""
    results: list[torch.Tensor] = []
    floating_leaves(out, results)
    return [t for t in results if t.dtype not in FP8_DATA
            and not is_wrapper_subclass(t)]
