"""`torch.distributed.checkpoint`: a load planner that says what a checkpoint lost before.

DCP loads each saved tensor into the tensor of the state dict it is given, cast to that
tensor's dtype, silently. For an applied model (or one sharded by `adapters.fsdp.fully_shard`)
those tensors are in their planned dtypes, so the plan is kept: an fp32 island stays fp32 from a
bf16 checkpoint, and a bf16 weight stays bf16 from an fp32 one. What DCP cannot give back is
precision the checkpoint does not hold: `LoadPlanner` reads the dtypes the checkpoint recorded
and warns, naming them, about tensors saved narrower than the ones they are loaded into.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from precision_annot._src.checkpoints.loading import narrowed, warn_narrowed

__all__ = ["LoadPlanner"]


class LoadPlanner(DefaultLoadPlanner):
    """Like DCP's `DefaultLoadPlanner`, but warns about tensors the checkpoint holds narrower
    than the tensors they are loaded into (their low bits are gone), naming them. Every other
    argument and behaviour is `DefaultLoadPlanner`'s.

    Example:
        >>> # import torch.distributed.checkpoint as dcp
        >>> # dcp.load(model.state_dict(), checkpoint_id=path, planner=LoadPlanner())
    """

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if metadata is None or not is_coordinator:
            return  # said once, by the coordinator (every rank loads the same keys)
        kept = {k: t.dtype for k, t in self.state_dict.items() if isinstance(t, torch.Tensor)}
        saved = [(k, item.properties.dtype) for k, item in metadata.state_dict_metadata.items()
                 if isinstance(item, TensorStorageMetadata)]
        warn_narrowed("torch.distributed.checkpoint.load", narrowed(kept, saved),
                      stacklevel=4)
