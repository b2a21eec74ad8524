"""The phase of a precision schedule a checkpoint was saved in, read without its tensor data.

`Schedule.state_dict()` is `{"step": N, "phase": i, "phase_start": s, "phases": [[start,
"spec"], ...]}`; a `precision_annot.optimizer` that a schedule follows saves it in its own
`state_dict()` (under "precision_annot_schedule"), and Lightning's `ScheduleCallback` in the
checkpoint's "callbacks". It is found by that shape wherever a checkpoint holds it, a few levels
down: a `torch.save` of the optimizer's state dict (the Hugging Face Trainer's `optimizer.pt`,
read beside the weights of a `checkpoint-N` folder), of `{"model": ..., "optimizer": ...}` or of
`{"schedule": sched.state_dict(), ...}`, a Lightning `.ckpt` (its "optimizer_states" and
"callbacks"), or a DCP checkpoint holding it under some key (DCP's `get_state_dict` keeps only
the optimizer's "state" and "param_groups", so one saved through it holds none).
"""

from __future__ import annotations

import dataclasses
import os
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from precision_annot._src.checkpoints.reading import (
    dcp_objects,
    is_dcp,
    optimizer_beside,
    torch_save_record,
)

__all__ = ["FIELDS", "SavedPhase", "saved_phases", "schedule_state"]

#: the fields of `Schedule.state_dict()`
FIELDS = ("step", "phase", "phase_start", "phases")
#: how deep under a `torch.save` file's object a schedule's state is looked for: the optimizer's
#: state dict in a Lightning checkpoint's "optimizer_states" list is 3 down
_DEPTH = 3


@dataclasses.dataclass(frozen=True)
class SavedPhase:
    """A schedule's state as a checkpoint holds it.

    Attributes:
        file: the file holding it (a DCP checkpoint's directory).
        key: its key there, nested keys joined by "." ("" for the file's whole object).
        step: the optimizer steps taken when it was saved.
        phase: the index of the phase the next step runs in.
        phases: each phase's first step and its spec, as text ("<plan>" for a plan).
    """

    file: str
    key: str
    step: int
    phase: int
    phases: tuple[tuple[int, str], ...]

    @property
    def start(self) -> int:
        return self.phases[self.phase][0]

    @property
    def spec(self) -> str:
        return self.phases[self.phase][1]


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _pairs(phases: object) -> tuple[tuple[int, str], ...] | None:
    """`phases` as (first step, spec text) pairs, None unless it is a list of them."""
    if not isinstance(phases, list):
        return None
    pairs = []
    for item in phases:
        if not (isinstance(item, (list, tuple)) and len(item) == 2
                and _count(item[0]) and isinstance(item[1], str)):
            return None
        pairs.append((item[0], item[1]))
    return tuple(pairs)


def schedule_state(value: object, file: str, key: str = "") -> SavedPhase | None:
    """`value` as a schedule's state (`Schedule.state_dict()`'s shape, its phase one of its
    phases and starting where it says), None for anything else."""
    if not (isinstance(value, Mapping) and all(field in value for field in FIELDS)):
        return None
    step, phase, start = value["step"], value["phase"], value["phase_start"]
    pairs = _pairs(value["phases"])
    if not (_count(step) and _count(phase) and _count(start) and pairs is not None
            and phase < len(pairs) and pairs[phase][0] == start):
        return None
    return SavedPhase(file, key, step, phase, pairs)


def _children(value: object) -> list[tuple[str, Any]]:
    if isinstance(value, Mapping):
        return [(str(k), v) for k, v in value.items() if isinstance(k, (str, int))
                and not isinstance(k, bool)]
    if isinstance(value, (list, tuple)):
        return [(str(i), v) for i, v in enumerate(value)]
    return []


def _found(root: object, file: str) -> list[SavedPhase]:
    """Each schedule state under `root` (the object of a `torch.save` file), breadth first,
    at most `_DEPTH` containers down."""
    out = []
    queue: deque[tuple[str, Any, int]] = deque([("", root, 0)])
    seen: set[int] = set()
    while queue:
        key, value, depth = queue.popleft()
        if id(value) in seen:
            continue
        seen.add(id(value))
        state = schedule_state(value, file, key)
        if state is not None:
            out.append(state)
        elif depth < _DEPTH:
            queue.extend((f"{key}.{k}" if key else k, v, depth + 1)
                         for k, v in _children(value))
    return out


def _dcp_found(directory: Path) -> list[SavedPhase]:
    """Each schedule state a DCP checkpoint holds as bytes: the keys `<prefix>step`,
    `<prefix>phase`, ... all saved, read from their bytes."""
    def wanted(keys: list[str]) -> list[str]:
        held = set(keys)
        return [prefix + field for prefix in _prefixes(held) for field in FIELDS]

    values = dcp_objects(directory, wanted)
    out = []
    for prefix in _prefixes(set(values)):
        state = schedule_state({field: values[prefix + field] for field in FIELDS},
                               str(directory), prefix.rstrip("."))
        if state is not None:
            out.append(state)
    return out


def _prefixes(keys: set[str]) -> list[str]:
    """The prefixes under which `keys` hold every field of a schedule's state."""
    return sorted({key[:-len("phases")] for key in keys if key.endswith("phases")
                   and (key == "phases" or key.endswith(".phases"))
                   and all(key[:-len("phases")] + field in keys for field in FIELDS)})


def saved_phases(path: str | os.PathLike[str]) -> list[SavedPhase]:
    """The schedule states a checkpoint at `path` holds (read as `saved_tensors` reads it; for a
    folder of a model's weights, its `optimizer.pt` beside them), in the order found; empty
    for one saved without a schedule, and for safetensors (which hold tensors only).

    Raises:
        ValueError: naming the file, for one this cannot read.
    """
    try:
        return _phases(Path(path))
    except OSError as e:
        raise ValueError(
            f"checkpoint: {str(e.filename or path)!r} cannot be read ({type(e).__name__}: "
            f"{e.strerror or e}).") from e


def _phases(where: Path) -> list[SavedPhase]:
    if is_dcp(where):
        return _dcp_found(where)
    beside = optimizer_beside(where)
    if beside is not None:
        return _found(torch_save_record(beside), str(beside))
    if where.is_dir() or where.suffix in (".safetensors", ".json"):
        return []
    return _found(torch_save_record(where), str(where))
