"""`torch.distributed.checkpoint`: a load planner that keeps the plan across layouts and says
what a checkpoint lost before.

DCP loads each saved tensor into the tensor of the state dict it is given, cast to that
tensor's dtype, silently. For an applied model (or one sharded by `adapters.fsdp.fully_shard`)
those tensors are in their planned dtypes, so the plan is kept: an fp32 island stays fp32 from a
bf16 checkpoint, and a bf16 weight stays bf16 from an fp32 one. What DCP cannot give back is
precision the checkpoint does not hold: `LoadPlanner` reads the dtypes the checkpoint recorded
and warns, naming them, about tensors saved narrower than the ones they are loaded into.

An optimizer's state is another matter: DCP loads it key by key, and a checkpoint saved under
another update layout holds other keys (no master, an 8-bit state's codes for a plain moment),
which DCP refuses ("Missing key in checkpoint state_dict: ....master"), or, with
`allow_partial_load=True`, leaves as the fresh optimizer had them. `LoadPlanner` reads each
parameter's state in the layout the checkpoint holds it in, and
`set_optimizer_state_dict` then converts it as `optimizer.load_state_dict` does.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from precision_annot._src.checkpoints.loading import narrowed, warn_narrowed
from precision_annot._src.dtypes import wider
from precision_annot._src.update import guard

__all__ = ["LoadPlanner"]

#: the state entry whose presence depends on the layout (a master is kept, or not)
_MASTER = "master"

_Stored = TensorStorageMetadata | BytesStorageMetadata


class LoadPlanner(DefaultLoadPlanner):
    """Like DCP's `DefaultLoadPlanner`, but reads an optimizer's state in the layout the
    checkpoint holds it in, and warns about tensors the checkpoint holds narrower than the
    tensors they are loaded into (their low bits are gone), naming them. Every other argument
    and behaviour is `DefaultLoadPlanner`'s.

    For each parameter's state in an optimizer state dict (`get_optimizer_state_dict`'s, or
    `optimizer.state_dict()`), where the checkpoint holds it in another layout: a master the
    checkpoint lacks is taken out of the state dict (the optimizer then makes it from the
    loaded weights, as `load_state_dict` does from a checkpoint without masters), one only
    the checkpoint holds is read, and a state the checkpoint holds in another format (an
    8-bit state's codes and scales for a plain moment, or the reverse) is read in its own.
    A state saved in another dtype is read in it too. `set_optimizer_state_dict` (or
    `load_state_dict`) then converts each into the planned format, naming any state saved
    narrower than planned: what it holds is what `torch.load` of the same state would give.

    Example:
        >>> # import torch.distributed.checkpoint as dcp
        >>> # dcp.load(model.state_dict(), checkpoint_id=path, planner=LoadPlanner())
    """

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        if metadata is not None:
            follow_layouts(state_dict, metadata)
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self._wide = {} if metadata is None else _wide_targets(self.state_dict, metadata)
        if metadata is None or not is_coordinator:
            return  # said once, by the coordinator (every rank loads the same keys)
        _say_no_phase(self.state_dict, metadata)
        kept = {k: t.dtype for k, t in self.state_dict.items() if isinstance(t, torch.Tensor)}
        saved = [(k, item.properties.dtype) for k, item in metadata.state_dict_metadata.items()
                 if isinstance(item, TensorStorageMetadata)]
        warn_narrowed("torch.distributed.checkpoint.load", narrowed(kept, saved),
                      stacklevel=4)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """DCP's tensor to read into; for a weight the checkpoint holds wider than it is
        stored, whose plan keeps a master, a tensor in the checkpoint's dtype (see
        `commit_tensor`)."""
        tensor: torch.Tensor = super().resolve_tensor(read_item)
        wide = self._wide.get(read_item.dest_index.fqn)
        if wide is not None and not any(read_item.dest_offsets) and tuple(
                read_item.lengths) == tuple(tensor.shape) == tuple(wide[0].shape):
            return torch.empty_like(tensor, dtype=wide[1])
        return tensor

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """A weight read wider than it is stored goes into it rounded, as DCP would cast it,
        and its masters (made now or later) start from the checkpoint's own values, as after
        `load_state_dict`."""
        wide = self._wide.get(read_item.dest_index.fqn)
        if wide is not None and tensor.dtype == wide[1] != wide[0].dtype:
            with torch.no_grad():
                super().resolve_tensor(read_item).copy_(tensor)
            guard.loaded({wide[0]: tensor})
        super().commit_tensor(read_item, tensor)


def _say_no_phase(flat: dict[str, Any], metadata: Metadata) -> None:
    """A model a `precision_annot.schedule` drives, loaded from a checkpoint that holds no
    phase (`get_state_dict` leaves the optimizer's out): the run would go on in the phase the
    schedule is in now, whatever step the checkpoint was taken at."""
    if any(key.rsplit(".", 1)[-1] == "phase_start" for key in metadata.state_dict_metadata):
        return  # the checkpoint holds a schedule's state (loaded by the caller)
    storages = guard.scheduled_storages()
    if not storages or not any(
            isinstance(t, torch.Tensor) and _storage(t) in storages for t in flat.values()):
        return
    warnings.warn(
        "torch.distributed.checkpoint.load: these tensors belong to a model a "
        "precision_annot.schedule drives, and the checkpoint holds no phase "
        "(get_state_dict leaves the optimizer's 'precision_annot_schedule' out), so the run "
        "would go on in the phase the schedule is in now. Save the schedule's state with the "
        "checkpoint ({'model': ..., 'optim': ..., 'schedule': sched.state_dict()}) and load it "
        "first: dcp.load({'schedule': sched.state_dict()}, ...), then "
        "sched.load_state_dict(...).", UserWarning, stacklevel=5)


def _storage(t: torch.Tensor) -> int:
    to_local = getattr(t, "to_local", None)
    local = to_local() if to_local is not None else t
    return int(local.untyped_storage().data_ptr())


def _view(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes a tensor a view of one parameter's values (a state dict holds each weight
    detached: the same storage, offset, shape and strides)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type == "meta":
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


def _wide_targets(flat: dict[str, Any], metadata: Metadata
                  ) -> dict[str, tuple[torch.Tensor, torch.dtype]]:
    """The weights of `flat` (by name) the checkpoint holds wider than they are stored whose
    plan keeps a master, with the parameter and the dtype saved."""
    params = {v: p for p in guard.mastered_params() if (v := _view(p)) is not None}
    out: dict[str, tuple[torch.Tensor, torch.dtype]] = {}
    if not params:
        return out
    for fqn, t in flat.items():
        item = metadata.state_dict_metadata.get(fqn)
        if (isinstance(t, torch.Tensor) and t.is_floating_point()
                and isinstance(item, TensorStorageMetadata)
                and wider(item.properties.dtype, t.dtype)
                and (view := _view(t)) is not None and (param := params.get(view)) is not None):
            out[fqn] = (param, item.properties.dtype)
    return out


# -- an optimizer's state in the checkpoint's layout ---------------------------------------------

def follow_layouts(state_dict: dict[str, Any], metadata: Metadata) -> None:
    """Each parameter's state of every optimizer state dict inside `state_dict` (nested as DCP
    flattens it: keys joined with "."), made to hold the entries the checkpoint holds for it,
    in place: see `LoadPlanner`."""
    states = dict(_optimizer_states(state_dict, ()))
    if not states:
        return
    saved = _saved_by_state(states, metadata)
    for prefix, state in states.items():
        held = saved.get(prefix)
        if held:  # (a parameter the checkpoint has no state for is DCP's to refuse)
            _follow(state, held)


def _optimizer_states(tree: Any, path: tuple[Any, ...]
                      ) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each parameter's state dict inside an optimizer state dict ("state" and
    "param_groups") of `tree`, by its flattened name."""
    if not isinstance(tree, Mapping):
        return
    state, groups = tree.get("state"), tree.get("param_groups")
    if isinstance(state, dict) and isinstance(groups, list):
        for key, value in state.items():
            if isinstance(value, dict):
                yield ".".join(map(str, (*path, "state", key))), value
        return
    for key, value in tree.items():
        yield from _optimizer_states(value, (*path, key))


def _saved_by_state(states: Mapping[str, Any], metadata: Metadata
                    ) -> dict[str, dict[str, dict[str, _Stored]]]:
    """What the checkpoint holds under each parameter's state: {prefix: {entry: {rest:
    metadata}}} ("" for a tensor saved as the entry itself), one pass over its keys."""
    out: dict[str, dict[str, dict[str, _Stored]]] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        cut = fqn.rfind(".")
        while cut > 0:
            prefix = fqn[:cut]
            if prefix in states:
                entry, _, rest = fqn[cut + 1:].partition(".")
                out.setdefault(prefix, {}).setdefault(entry, {})[rest] = item
                break
            cut = fqn.rfind(".", 0, cut)
    return out


def _follow(state: dict[str, Any], saved: dict[str, dict[str, _Stored]]) -> None:
    """One parameter's state, its entries made as the checkpoint holds them."""
    if _MASTER in state and _MASTER not in saved:
        del state[_MASTER]  # made from the loaded weights, as load_state_dict does
    for entry, items in saved.items():
        if entry not in state and entry != _MASTER:
            continue  # (a state this layout does not keep, left in the checkpoint)
        if entry in state and _shape(state[entry]) == _shape_saved(items):
            continue  # the same layout and dtypes: DCP loads into it
        like = state.get(entry)
        state[entry] = _skeleton(items, like if isinstance(like, torch.Tensor) else _any(
            state))


def _shape(value: Any, rest: str = "") -> dict[str, Any]:
    """What a state entry holds, as its flattened leaves: a tensor's size and dtype, else a
    value."""
    if isinstance(value, torch.Tensor):
        return {rest: (tuple(value.shape), value.dtype)}
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, inner in value.items():
            out.update(_shape(inner, f"{rest}.{key}" if rest else str(key)))
        return out
    return {rest: None}


def _shape_saved(items: dict[str, _Stored]) -> dict[str, Any]:
    return {rest: (tuple(item.size), item.properties.dtype)
            if isinstance(item, TensorStorageMetadata) else None for rest, item in items.items()}


def _any(state: dict[str, Any]) -> torch.Tensor | None:
    return next((v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0),
                None)


def _skeleton(items: dict[str, _Stored], like: torch.Tensor | None) -> Any:
    """Tensors (and placeholders for the values) to load an entry into as the checkpoint
    holds it: each tensor in its saved dtype, shaped as saved (a DTensor where `like` is one
    of that shape)."""
    if set(items) == {""}:
        return _empty(items[""], like)
    out: dict[str, Any] = {}
    for rest, item in items.items():
        *outer, last = rest.split(".")
        node = out
        for key in outer:
            node = node.setdefault(key, {})
        node[last] = _empty(item, None) if isinstance(item, TensorStorageMetadata) else None
    return out


def _empty(item: _Stored, like: torch.Tensor | None) -> torch.Tensor | None:
    if not isinstance(item, TensorStorageMetadata):
        return None  # a value DCP reads back as it was saved
    dtype = item.properties.dtype
    if like is not None and tuple(like.shape) == tuple(item.size):
        return torch.empty_like(like, dtype=dtype)
    return torch.empty(tuple(item.size), dtype=dtype)
