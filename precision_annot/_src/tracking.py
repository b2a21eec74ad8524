"""Which module's own code is running an op, in forward and in backward.

In forward, module hooks keep a stack: the innermost module running. In backward, the autograd
node being executed says which op is running; each node carries the sequence number it was
created with, and the forward pass recorded which module was innermost for each range of
sequence numbers. `audit` and `suggest` both charge ops to modules this way.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal, TypeAlias

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from precision_annot._src.boundary import REGION_OBSERVERS
from precision_annot._src.policy import Policy

__all__ = ["DATA_MOVEMENT", "ModuleTracker", "Phase"]

Phase: TypeAlias = Literal["forward", "backward"]
Pre: TypeAlias = Callable[[str, nn.Module, tuple[Any, ...], dict[str, Any]], None]
Post: TypeAlias = Callable[[str, nn.Module, Any], None]
OnRegion: TypeAlias = Callable[[str, Policy], None]

# Ops that move or select data rather than compute: a cast, a copy, a view, a concatenation, a
# gather. Their dtype is whatever they were given, so they say nothing about compute.
DATA_MOVEMENT = frozenset({
    "_to_copy", "to", "copy", "copy_", "clone", "detach", "alias", "lift_fresh",
    "lift_fresh_copy", "contiguous", "_unsafe_view", "cat", "stack", "index", "index_select",
    "gather", "scatter", "select_scatter", "slice_scatter", "masked_fill", "masked_fill_",
    "masked_select", "fill", "fill_", "zero_", "where", "embedding", "roll", "flip", "repeat",
    "repeat_interleave", "constant_pad_nd", "index_put", "index_put_", "zeros_like",
    "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "new_empty",
    "new_zeros", "new_ones", "new_full", "_local_scalar_dense", "split_with_sizes",
    "unbind", "split", "chunk", "narrow", "tril", "triu", "_reshape_alias", "unfold",
})

# A cast's backward node also accumulates the gradient of the tensor it was cast from, in the
# caller's dtype: that work is the caller's, not the module's. AccumulateGrad belongs to none.
_NO_OWNER_NODES = frozenset({"ToCopyBackward0", "AccumulateGrad"})


def recomputing() -> bool:
    """Whether a gradient checkpoint is running its forward again, in backward.

    NOTE: torch.utils.checkpoint (non-reentrant) recomputes under a saved-tensors hook of its
    own, `_recomputation_hook`, and no public flag says so. Without this, a checkpointed layer
    whose own forward runs again outside its module hooks (transformers 5 calls the layer's
    plain `forward` in its recompute) had its ops charged to the module whose backward node
    asked for them, BART's fp32 `final_layer_norm`, as bf16 backward ops."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    pack = top[0] if top else None
    return "_recomputation_hook" in getattr(pack, "__qualname__", "")


class ModuleTracker:
    """While active, `owner()` names the module whose own code is running the current op.

    Args:
        names: the modules to track, with the names ops are charged to.
        on_enter: called as `(name, module, args, kwargs)` before each tracked forward.
        on_exit: called as `(name, module, output)` after it.
        on_region: when given, function-form regions (`precision(...)(fn)`) are tracked too,
            as `module::function`, and it is called as `(that name, policy)` when one starts.

    Run the model in one thread while it is active: forward events from other threads are
    ignored. Hooks registered meanwhile run after its pre-hook, and its forward hook is kept
    the last to run, so they are charged to their module; hooks registered before it (FSDP's
    gathers) run before its pre-hook, outside the module's own code.
    """

    def __init__(self, names: dict[nn.Module, str], on_enter: Pre | None = None,
                 on_exit: Post | None = None, on_region: OnRegion | None = None) -> None:
        self.names = names
        self.on_enter = on_enter
        self.on_exit = on_exit
        self.on_region = on_region
        self.ids: dict[nn.Module, int] = {}  # each module's forward hook id
        self.stack: list[str] = []
        self.seqs: list[int] = []  # sorted: a node with this sequence number or later ...
        self.owners: list[str | None] = []  # ... was made while this module was innermost
        self.thread = threading.get_ident()
        self.handles: list[RemovableHandle] = []

    def owner(self) -> tuple[str, Phase] | None:
        """The module whose own code runs the current op, and whether in forward or backward;
        None for code outside every tracked module (a loss function, say)."""
        if self.stack:
            return self.stack[-1], "forward"
        if torch._C._current_graph_task_id() == -1:
            return None
        if torch.is_grad_enabled() and recomputing():
            return None  # a checkpoint's forward run again in backward: charged when it first ran
        node = torch._C._current_autograd_node()
        if node is None or type(node).__name__ in _NO_OWNER_NODES:
            return None
        i = bisect.bisect_right(self.seqs, node._sequence_nr()) - 1
        owner = self.owners[i] if i >= 0 else None
        return None if owner is None else (owner, "backward")

    def _mark(self) -> None:
        self.seqs.append(torch._C._autograd._get_sequence_nr())
        self.owners.append(self.stack[-1] if self.stack else None)

    def _pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        name = self.names.get(module)
        if name is None or threading.get_ident() != self.thread:
            return
        post = self.ids[module]
        hooks: Any = module._forward_hooks  # an OrderedDict
        if next(reversed(hooks)) != post:  # a hook registered since: ours runs last
            hooks.move_to_end(post)
        if self.on_enter is not None:
            self.on_enter(name, module, args, kwargs)
        self.stack.append(name)
        self._mark()

    def _post(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              output: Any) -> None:
        name = self.names.get(module)
        if name is None or threading.get_ident() != self.thread:
            return
        if self.stack and self.stack[-1] == name:
            self.stack.pop()
        self._mark()
        if self.on_exit is not None:
            self.on_exit(name, module, output)

    # a `boundary.RegionObserver`
    def enter_region(self, function: str, policy: Policy) -> None:
        if threading.get_ident() != self.thread or self.on_region is None:
            return
        name = f"{self.stack[-1] if self.stack else ''}::{function}"
        self.on_region(name, policy)
        self.stack.append(name)
        self._mark()

    def exit_region(self, function: str) -> None:
        if threading.get_ident() != self.thread or self.on_region is None:
            return
        if self.stack and self.stack[-1].endswith(f"::{function}"):
            self.stack.pop()
        self._mark()

    def __enter__(self) -> ModuleTracker:
        for module in self.names:
            pre = module.register_forward_pre_hook(self._pre, with_kwargs=True)
            post = module.register_forward_hook(self._post, with_kwargs=True, always_call=True)
            self.handles += [pre, post]
            self.ids[module] = post.id
        if self.on_region is not None:
            REGION_OBSERVERS.append(self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.ids.clear()
        if self in REGION_OBSERVERS:
            REGION_OBSERVERS.remove(self)
