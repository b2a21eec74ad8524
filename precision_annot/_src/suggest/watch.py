"""`Watch`: a dispatch mode that books the peaks and non-finite values of each module's own ops."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from precision_annot._src.casting import floating_leaves
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
                 baseline: Counts | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.tracker = tracker
        self.track_peaks = peaks
        self.baseline = baseline
        self.peaks: dict[str, float] = {}
        self.backward_peak = 0.0
        self.counts: Counts = {}
        self.first_nonfinite: str | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        results: list[torch.Tensor] = []
        floating_leaves(out, results)
        results = [t for t in results if t.dtype not in FP8_DATA  # fp8 GEMMs' scaled data
                   and not is_traceable_wrapper_subclass(t)]
        if not results:
            return out
        owner = self.tracker.owner()
        backward = torch._C._current_graph_task_id() != -1
        name, phase = owner if owner is not None else (
            OUTSIDE, "backward" if backward else "forward")
        packet = func.overloadpacket.__name__
        if packet == "_to_copy" or packet not in DATA_MOVEMENT:
            self._count(name, phase, results)
        if self.track_peaks:
            self._peak(name, phase, owner is not None, results)
        return out

    def _count(self, name: str, phase: str, results: list[torch.Tensor]) -> None:
        """Book the non-finite elements an op of `name` made; the first module past the
        baseline's count is the culprit."""
        bad = sum(int((~torch.isfinite(t)).sum()) for t in results)
        if not bad:
            return
        key = (name, phase)
        self.counts[key] = self.counts.get(key, 0) + bad
        if (self.baseline is not None and self.first_nonfinite is None
                and self.counts[key] > self.baseline.get(key, 0)):
            self.first_nonfinite = name

    def _peak(self, name: str, phase: str, owned: bool, results: list[torch.Tensor]) -> None:
        """Book the largest finite |value| of an op: per module in forward, one for backward."""
        finite = [t.detach()[torch.isfinite(t.detach())] for t in results]
        peak = max((float(t.abs().max()) for t in finite if t.numel()), default=0.0)
        if phase == "forward" and owned:
            self.peaks[name] = max(self.peaks.get(name, 0.0), peak)
        elif phase == "backward":
            self.backward_peak = max(self.backward_peak, peak)
