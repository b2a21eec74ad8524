"""What modules return, recorded once for `watch`, `diff` and `suggest`, and the one error
measure they compare runs with.

Recording "each module's output" with a forward hook is easy to get subtly wrong, and each
way is a wrong number somewhere else: a module called twice (a shared block, a tied head) has
two outputs; a module returning a tuple (attention weights, a cache, a second head) has several;
a container hands on its child's tensor, which must not be measured as if it had made it; a
module handing back one of its own inputs unchanged did not make it either; an evaluation
forward run between training steps is not a training step; and gradient checkpointing runs a
module's forward twice, the second time in backward. `Recorder` handles each once.

`relative_error` is the distance between a run and the fp32 run of the same step.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from precision_annot._src.casting import floating_leaves

__all__ = ["Inputs", "Recorder", "Returned", "drop_recorders", "dtensors", "in_backward",
           "relative_error"]


@dataclasses.dataclass(frozen=True, eq=False)
class Returned:
    """One floating tensor that one call of a module returned.

    Attributes:
        name: the module's qualified name.
        call: which of its recorded calls returned it (0: the first).
        index: its place among the floating tensors that call returned (nested outputs
            included, in `floating_leaves` order).
        same: the earlier `Returned` that is this very tensor, unchanged (a container handing
            on its child's output), else None: its values and gradient are that one's.
    """

    name: str
    call: int
    index: int
    same: Returned | None = None

    @property
    def key(self) -> tuple[str, int, int]:
        """(name, call, index): the same tensor of the same call in another run of the step."""
        return self.name, self.call, self.index


#: a call's positional and keyword arguments, `(args, kwargs)`
Inputs = tuple[tuple[Any, ...], dict[str, Any]]
OnOutput = Callable[[Returned, torch.Tensor, nn.Module, Inputs], None]
OnGrad = Callable[[Returned, torch.Tensor], None]


def dtensors() -> Any:
    """torch's DTensor module once something loaded it, else None: no DTensor exists before, so
    a tensor-parallel output is told apart at no import cost (`watch` measures a DTensor on its
    local shard, `diff` compares it whole)."""
    return sys.modules.get("torch.distributed.tensor")


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread.

    NOTE: torch offers no public flag for it; `_current_graph_task_id` is -1 outside a
    backward. Gradient checkpointing runs forwards again inside the backward, and those are
    not new calls (`tracking.py` reads the same id to charge backward ops)."""
    return bool(torch._C._current_graph_task_id() != -1)


class _Seen:
    """A tensor a module returned: who returned it first, and every `Returned` sharing it (one
    gradient hook per tensor hands its gradient to each, in the order they returned it)."""

    __slots__ = ("owners", "ref", "version")

    def __init__(self, tensor: torch.Tensor, first: Returned) -> None:
        self.ref = weakref.ref(tensor)
        self.version = version(tensor)
        self.owners = [first]

    def holds(self, tensor: torch.Tensor) -> bool:
        return self.ref() is tensor and self.version == version(tensor)


def version(t: torch.Tensor) -> int:
    """`t`'s version counter, which in-place ops advance.

    NOTE: torch offers `_version` only; an inference tensor (made under
    `torch.inference_mode`) has none and raises on reading it, and cannot be changed in place
    outside that mode, so its identity alone tells it apart (-1 here)."""
    return -1 if t.is_inference() else t._version


class _Call:
    """One open module call: whether it is recorded, and its floating inputs as they entered
    (identity and version), so that an input handed back unchanged is told from an output."""

    __slots__ = ("inputs", "recorded")

    def __init__(self, recorded: bool, inputs: dict[int, int]) -> None:
        self.recorded = recorded
        self.inputs = inputs


class Recorder:
    """Forward hooks on every module of `named` that hand each floating tensor every call
    returns to `on_output`, and (with `on_grad`) its gradient, once the backward computes it.

    - Every call counts: `Returned.call` numbers a module's calls, in the order they end.
    - Every floating tensor counts, nested outputs included (`Returned.index`).
    - A tensor another module already returned, unchanged, is handed on with `same` set (the
      caller reuses what it measured); a module's own input handed back unchanged is not its
      output and is not handed on.
    - `training_only`: a call is recorded only when the outermost module call it runs in was
      made with gradients enabled, so an evaluation forward between steps (`no_grad`,
      `inference_mode`) is not recorded, while a `no_grad` region inside a training forward
      (reentrant gradient checkpointing) is.
    - A forward run again in backward (gradient checkpointing) is not a new call: where the
      first run's tensors had no gradient (reentrant checkpointing runs it under `no_grad`), the
      tensors of the run in backward get the gradient hooks, under the first run's `Returned`.
      Where the first run was not recorded at all (`training_only`, and reentrant
      checkpointing called outside any module's forward, so under `no_grad` at the top), the
      run in backward is recorded as the call, with the same values.
    - Gradient hooks are removed on `close` (one on a parameter a module returns as it is
      would otherwise stay on it).
    - Code that torch.compile compiled runs no hook: a hook reached while it traces sets
      `compiled` (replayed by each compiled call) and records nothing.

    Args:
        named: the modules, by the names they are recorded under.
        on_output: `(returned, tensor, module, (args, kwargs))` for each floating tensor: the
            call's positional and keyword arguments both (transformers calls its attention
            with `hidden_states=...`).
        on_grad: `(returned, gradient)` for each of those tensors that gets a gradient.
            (Default: None)
        training_only: record training forwards only. (Default: False)
    """

    def __init__(self, named: Mapping[str, nn.Module], on_output: OnOutput,
                 on_grad: OnGrad | None = None, *, training_only: bool = False) -> None:
        self.on_output = on_output
        self.on_grad = on_grad
        self.training_only = training_only
        self.compiled = False
        self.calls: dict[str, int] = {}
        self._seen: dict[int, _Seen] = {}
        # calls whose tensors got no gradient hook, for a run in backward to give them one
        self._ungraded: dict[str, deque[dict[int, list[Returned]]]] = {}
        self._local = threading.local()
        self._handles: list[RemovableHandle] = []
        # gradient hooks, removed on close: one on a tensor that outlives the step (a
        # parameter a module returns as it is) would fire on every later backward
        self._grad_handles: list[RemovableHandle] = []
        # a deep copy of a module keeps its hooks (the same functions, in dicts of its own):
        # they record the modules they were put on, never a copy; a DataParallel replica
        # shares the module's hook dicts (torch copies its __dict__), and is recorded as it
        self._dicts = {id(m._forward_pre_hooks) for m in named.values()}
        pre = _marked(self._pre)
        for name, module in named.items():
            self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            self._handles.append(module.register_forward_hook(
                _marked(self._post_hook(name, module._forward_hooks)), with_kwargs=True,
                always_call=True))

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Remove every hook."""
        for handle in (*self._handles, *self._grad_handles):
            handle.remove()
        self._handles.clear()
        self._grad_handles.clear()

    # -- the hooks --------------------------------------------------------------------------
    def _stack(self) -> list[_Call]:
        stack: list[_Call] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if torch.compiler.is_compiling():
            self.compiled = True
            return
        if id(module._forward_pre_hooks) not in self._dicts:
            return
        stack = self._stack()
        recorded = stack[-1].recorded if stack else (
            not self.training_only or torch.is_grad_enabled())
        inputs: dict[int, int] = {}
        if recorded:
            leaves: list[torch.Tensor] = []
            floating_leaves((args, kwargs), leaves)
            inputs = {id(t): version(t) for t in leaves}
        stack.append(_Call(recorded, inputs))

    def _post_hook(self, name: str, hooks: dict[int, Any]) -> Callable[..., None]:
        def post(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 output: Any) -> None:
            if torch.compiler.is_compiling():
                self.compiled = True
                return
            if module._forward_hooks is not hooks:
                return
            stack = self._stack()
            if not stack:
                return  # the hooks were installed while this call was running
            call = stack.pop()
            if not call.recorded or output is None:
                return
            leaves: list[torch.Tensor] = []
            floating_leaves(output, leaves)
            made = [(i, t) for i, t in enumerate(leaves)
                    if call.inputs.get(id(t), -2) != version(t)]
            if not made:
                return
            if in_backward() and name in self.calls:
                self._recomputed(name, made)
            else:  # (in backward: a first run not recorded, under no_grad outside any module)
                self._returned(name, module, (args, kwargs), made)

        return post

    def _returned(self, name: str, module: nn.Module, inputs: Inputs,
                  made: list[tuple[int, torch.Tensor]]) -> None:
        call = self.calls.get(name, 0)
        self.calls[name] = call + 1
        ungraded: dict[int, list[Returned]] = {}
        for index, t in made:
            seen = self._seen.get(id(t))
            if seen is not None and seen.holds(t):
                returned = Returned(name, call, index, seen.owners[0])
                seen.owners.append(returned)
                self.on_output(returned, t, module, inputs)
                continue
            returned = Returned(name, call, index)
            seen = self._seen[id(t)] = _Seen(t, returned)
            self.on_output(returned, t, module, inputs)
            if self.on_grad is None:
                continue
            if t.requires_grad:
                self._hook_grad(t, seen.owners)
            else:
                ungraded[index] = seen.owners
        if ungraded:
            self._ungraded.setdefault(name, deque()).append(ungraded)

    def _recomputed(self, name: str, made: list[tuple[int, torch.Tensor]]) -> None:
        """A forward run again in backward: its tensors stand in for the first run's that got
        no gradient (matched by their place in the output)."""
        waiting = self._ungraded.get(name)
        if not waiting:
            return
        first = waiting.popleft()
        for index, t in made:
            if index in first and t.requires_grad:
                self._hook_grad(t, first[index])

    def _hook_grad(self, t: torch.Tensor, owners: list[Returned]) -> None:
        on_grad = self.on_grad
        assert on_grad is not None

        def grad(g: torch.Tensor | None) -> None:
            if g is None:  # no gradient reached it (reentrant checkpointing passes None)
                return
            for owner in owners:
                on_grad(owner, g)

        self._grad_handles.append(t.register_hook(grad))  # type: ignore[no-untyped-call]


# -- hooks a copy must not keep -------------------------------------------------------------------

_MARK = "__precision_annot_recorder__"


def _marked(hook: Callable[..., None]) -> Callable[..., None]:
    """`hook` as a plain function marked as a recorder's. A function, not a bound method: a
    deep copy of the model shares functions, where it would copy a bound method's recorder."""
    def marked(*args: Any) -> None:
        hook(*args)

    setattr(marked, _MARK, True)
    return marked


def drop_recorders(model: nn.Module) -> None:
    """Remove from `model` (a deep copy) the hooks a `Recorder` put on the model it was copied
    from: a recorder records the model it was made for, never a copy of it (`diff` copies a
    model in the middle of a watched step).

    NOTE: torch removes a hook only through the handle that added it, and the copy's handles
    are the recorder's (for the original); its hook dicts are read directly, by the mark."""
    for module in model.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for hook_id in [i for i, h in hooks.items() if getattr(h, _MARK, False)]:
                del hooks[hook_id]
                module._forward_pre_hooks_with_kwargs.pop(hook_id, None)
                module._forward_hooks_with_kwargs.pop(hook_id, None)
                module._forward_hooks_always_called.pop(hook_id, None)


# -- the error measure ----------------------------------------------------------------------------

def relative_error(actual: Any, expected: Any) -> float:
    """||actual - expected|| / ||expected|| over every floating tensor of two runs' values, in
    float64.

    Where `expected` (the fp32 run) holds a value that is not finite (a masked `-inf`), the
    same value at the same place in `actual` is the same result, and those places are left
    out; any other value there is an error of inf. Elsewhere a value of `actual` that is not
    finite is an error of inf. nan when the two do not hold the same tensors (their number or
    shapes differ, or there is none)."""
    got: list[torch.Tensor] = []
    want: list[torch.Tensor] = []
    floating_leaves(actual, got)
    floating_leaves(expected, want)
    if len(got) != len(want) or not want:
        return math.nan
    diff = norm = 0.0
    for a, b in zip(got, want, strict=True):
        a64, b64 = a.detach().double(), b.detach().double()
        if a64.shape != b64.shape:
            return math.nan
        finite = torch.isfinite(b64)
        if not bool(finite.all()):
            same = (a64 == b64) | (a64.isnan() & b64.isnan())
            if not bool(same[~finite].all()):
                return math.inf
            a64, b64 = a64[finite], b64[finite]
        if not bool(torch.isfinite(a64).all()):
            return math.inf
        diff += float((a64 - b64).pow(2).sum())
        norm += float(b64.pow(2).sum())
    return math.sqrt(diff) / max(math.sqrt(norm), 1e-30)
