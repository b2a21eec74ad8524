"""Gradients accumulated wider than their parameters (`grad=fp32` over bf16 storage).

torch does this itself since 2.10: with `Tensor.grad_dtype` set on a leaf, autograd casts each
incoming gradient to that dtype and accumulates `.grad` in it (the contributions of a weight
used twice in one backward are summed in it too). `apply` sets it on every parameter whose
plan accumulates wider than it is stored, so `.grad` *is* the fp32 accumulation:
`model.zero_grad()`, `clip_grad_norm_`, a GradScaler's unscale and any optimizer act on it as on
any gradient. `remove` sets it back to the parameter's dtype.

DDP. DDP's reducer copies each gradient into a bucket of its parameter's dtype and refuses one
of another dtype (`RuntimeError: Expected BFloat16, got Float` at the first synchronising
backward, torch 2.13). Ignoring those parameters in DDP (its `_ddp_params_and_buffers_to_ignore`)
would leave a bf16 model with nothing for DDP to wrap ("DistributedDataParallel is not needed
when a module doesn't have any parameter that requires a gradient") and their first values
unbroadcast. So DDP keeps them, with their buckets, broadcast, `no_sync`, unused-parameter
search and comm hooks, and only the synchronising backward changes:

- across `no_sync` micro-batches, and in the synchronising one up to its accumulation, `.grad`
  accumulates in fp32 as everywhere else;
- right after a parameter's accumulation (its post-accumulate-grad hook, which runs before the
  reducer's hook on the same node), the fp32 sum is kept aside and `.grad` becomes its
  rounding to the parameter's dtype, which the reducer copies into its bucket;
- the bucket is reduced in that dtype, or by `adapters.ddp.comm_hook` in the plan's `comm`,
  from the fp32 sum itself when `comm` is wider than the bucket;
- after DDP's own end-of-backward callback has written the reduced values back, `.grad` is the
  fp32 tensor again, holding the reduced gradient.

Which backward synchronises is read where DDP decides it: in the model's forward, from the DDP
module running it (`require_backward_grad_sync`, under grad mode). With
`find_unused_parameters=True` a parameter that gets no gradient in the synchronising micro-batch
still has its earlier micro-batches' sum reduced: its rounding is handed over at the end of
that forward instead, and the gradients that arrive later are added to the fp32 sum as they
come.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.weak import WeakIdKeyDictionary

from precision_annot._src import seams
from precision_annot._src.boundary import get_tensor
from precision_annot._src.dtypes import dtype_name
from precision_annot._src.execution import Key, Target
from precision_annot._src.plan import PrecisionPlan
from precision_annot._src.update.rule import update_rule

__all__ = ["Pending", "WideGrads", "own_dtype", "pending", "planned", "set_grad_dtype", "stale"]

#: (module name, parameter name, accumulation dtype, comm dtype or None) for one parameter
Entry = tuple[str, str, torch.dtype, torch.dtype | None]


class Wide(NamedTuple):
    """One parameter whose gradient accumulates wider than it is stored."""

    param: nn.Parameter
    name: str
    dtype: torch.dtype
    comm: torch.dtype | None


def set_grad_dtype(param: torch.Tensor, dtype: torch.dtype) -> None:
    """Accumulate `param`'s gradients in `dtype` from now on; a gradient it holds is cast
    (torch refuses to change `grad_dtype` under an existing gradient of another dtype)."""
    _OWN.pop(param, None)  # type: ignore[no-untyped-call]
    if param.grad_dtype == dtype:
        return
    grad = param.grad
    if grad is not None:
        param.grad = None
    param.grad_dtype = dtype
    if grad is not None:
        param.grad = grad.detach().to(dtype)


def planned(plan: PrecisionPlan, named: dict[str, nn.Module],
            targets: Mapping[Key, Target]) -> tuple[Entry, ...]:
    """The parameters whose plan accumulates gradients wider than their planned dtype (the
    execution's `targets`), each once (a tied one at its first holder, with the widest
    accumulation among its holders)."""
    first: dict[int, int] = {}
    out: list[Entry] = []
    for name, entry in plan.items():
        policy = entry.policy
        if policy.grad is None:
            continue
        for pname, p in named[name].named_parameters(recurse=False):
            target = targets.get((name, "param", pname))
            dtype = p.dtype if target is None else target.dtype
            if not dtype.is_floating_point:
                continue
            wide = update_rule(policy.master, policy.grad, policy.optim, dtype).grad
            if wide is None or wide == dtype:
                continue
            at = first.get(id(p))
            if at is None:
                first[id(p)] = len(out)
                out.append((name, pname, wide, policy.grad_comm))
            elif wide.itemsize > out[at][2].itemsize:
                out[at] = (*out[at][:2], wide, out[at][3])
    return tuple(out)


# -- DDP ----------------------------------------------------------------------------------------

class Pending:
    """One parameter's gradient while DDP reduces it.

    Attributes:
        wide: its fp32 (the plan's `grad`) sum, what `.grad` holds again once reduced.
        narrow: the rounding to the parameter's dtype handed to DDP's bucket, or None before.
        version: `narrow`'s version when handed over: DDP writing the reduced values into it
            changes it.
        reduced: True when the plan's comm hook reduced `wide` itself (a `comm` wider than
            the bucket).
    """

    __slots__ = ("dtype", "narrow", "owner", "reduced", "version", "wide")

    def __init__(self, owner: WideGrads, dtype: torch.dtype) -> None:
        self.owner = owner
        self.dtype = dtype
        self.wide: torch.Tensor | None = None
        self.narrow: torch.Tensor | None = None
        self.version = 0
        self.reduced = False


#: the parameters DDP is reducing now, for the plan's comm hook
_PENDING: WeakIdKeyDictionary = WeakIdKeyDictionary()


def pending(param: torch.Tensor) -> Pending | None:
    """The fp32 sum of `param`'s gradient while DDP reduces it, else None."""
    found: Pending | None = _PENDING.get(param)  # type: ignore[no-untyped-call]
    return found


def _active_ddp() -> Any:
    """The DistributedDataParallel module whose forward is running, or None.

    NOTE: DDP's private class attribute, which its forward sets around the wrapped module's
    call (`_inside_ddp_forward`, for Dynamo, which runs that part eagerly); DDP's
    Python-reducer mode does not set it."""
    return getattr(DistributedDataParallel, "_active_ddp_module", None)


def _arm(wide: WideGrads) -> None:
    wide._arm()


_EAGER_ARM: list[Callable[[WideGrads], None]] = []


def _eager_arm() -> Callable[[WideGrads], None]:
    """`WideGrads._arm`, run eagerly from a compiled forward (a graph break, taken only under
    DDP): `torch.compiler.disable` made once, by the first `WideGrads` (at `apply`), not at
    import, since applying it imports Dynamo, which `import precision_annot` does not."""
    if not _EAGER_ARM:
        _EAGER_ARM.append(torch.compiler.disable(_arm))  # type: ignore[no-untyped-call,unused-ignore]
    return _EAGER_ARM[0]


def _ddp_parameters(ddp: Any) -> list[torch.Tensor]:
    """The parameters DDP reduces: the module's, less those it was told to ignore (its public
    `parameters_to_ignore`, names), the list DDP's constructor builds."""
    ignored = ddp.parameters_to_ignore
    return [p for n, p in ddp.module.named_parameters() if n not in ignored]


def _comm_hook(ddp: Any) -> str:
    """"plan" when the plan's comm hook is registered on `ddp`, "other" for another hook,
    "none" for none.

    NOTE: DDP's private `_comm_hooks` (the list `register_comm_hook` appends to) and its
    logger's record, which also names a built-in hook registered in C++."""
    hooks = [h for h, _ in getattr(ddp, "_comm_hooks", None) or ()]
    if any(getattr(h, "precision_plan", None) is not None for h in hooks):
        return "plan"
    if hooks:
        return "other"
    try:
        name = ddp.logger._get_ddp_logging_data().strs_map.get("comm_hook")
    except Exception:
        name = None
    return "other" if name else "none"


class WideGrads:
    """What `apply` keeps for the parameters it gives a wider gradient dtype: their names, and
    under DDP the hooks that hand DDP a gradient in the parameter's dtype and take the fp32
    one back."""

    def __init__(self, entries: tuple[Entry, ...]) -> None:
        self.entries = entries
        self._reset()

    def _reset(self) -> None:
        self.params: list[Wide] = []
        self._handles: list[Any] = []
        self._hooked: set[int] = set()
        self._ddps: weakref.WeakKeyDictionary[Any, list[Wide]] = weakref.WeakKeyDictionary()
        self._armed: list[Wide] = []
        self._queued = False
        self._outside_the_graph = _eager_arm()

    # -- copies and pickles: a copied Parameter starts with its own dtype as grad_dtype ------
    def __getstate__(self) -> dict[str, Any]:
        return {"entries": self.entries, "params": [w.param for w in self.params]}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.entries = state["entries"]
        self._reset()
        for p, (module, pname, dtype, comm) in zip(state["params"], self.entries, strict=False):
            set_grad_dtype(p, dtype)
            self.params.append(Wide(p, f"{module}.{pname}" if module else pname, dtype, comm))

    # -- installing ------------------------------------------------------------------------
    def bind(self, root: nn.Module) -> None:
        """Find the parameters by name under `root`, give each its accumulation dtype, and
        watch `root`'s forward for DDP."""
        self._release_hooks()
        named = dict(root.named_modules())
        self.params = []
        for module, pname, dtype, comm in self.entries:
            p = get_tensor(named[module], "param", pname)
            assert isinstance(p, nn.Parameter)
            set_grad_dtype(p, dtype)
            self.params.append(Wide(p, f"{module}.{pname}" if module else pname, dtype, comm))
        hooks = root._forward_hooks
        if not any(getattr(h, "__self__", None) is self for h in hooks.values()):
            for key in [k for k, h in hooks.items()
                        if isinstance(getattr(h, "__self__", None), WideGrads)]:
                del hooks[key]  # an earlier apply's, or a copy's
            root.register_forward_hook(self.after_forward)

    def release(self, root: nn.Module) -> list[nn.Parameter]:
        """Take off the forward and DDP hooks; returns the parameters it widened (their
        `grad_dtype` is the caller's to set)."""
        self._settle()
        self._release_hooks()
        hooks = root._forward_hooks
        for key in [k for k, h in hooks.items() if getattr(h, "__self__", None) is self]:
            del hooks[key]
        return [w.param for w in self.params]

    def _release_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooked = set()
        self._ddps = weakref.WeakKeyDictionary()

    # -- DDP --------------------------------------------------------------------------------
    def after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        """After each forward: arm the next backward when DDP will synchronise in it."""
        if torch.compiler.is_compiling():
            # compiled under DDP (either way round): armed outside the graph; compiled alone,
            # nothing to do and nothing traced (fullgraph holds)
            if DistributedDataParallel._active_ddp_module is not None:
                self._outside_the_graph(self)
            return
        self._arm()

    def _arm(self) -> None:
        ddp = _active_ddp()
        if ddp is None or not (torch.is_grad_enabled() and ddp.require_backward_grad_sync):
            return  # armed parameters stay armed: DDP's reducer, too, waits for a backward
        managed = self._ddps.get(ddp)
        if managed is None:
            managed = self._ddps[ddp] = self._adopt(ddp)
        self._settle()  # a synchronising forward whose backward never came: armed again
        early = bool(getattr(ddp, "find_unused_parameters", False))
        for wide in managed:
            entry = Pending(self, wide.dtype)
            _PENDING[wide.param] = entry
            self._armed.append(wide)
            grad = wide.param.grad
            if early and grad is not None:  # DDP may read it with no gradient arriving
                _hand_over(wide.param, entry, grad)

    def _adopt(self, ddp: Any) -> list[Wide]:
        """The parameters of this DDP module that accumulate wide, now hooked; refuses a plan
        whose `comm` DDP would narrow for want of the plan's comm hook."""
        reduced = {id(p) for p in _ddp_parameters(ddp)}
        managed = [w for w in self.params if id(w.param) in reduced]
        narrowed = [w for w in managed if w.comm is not None and w.comm != w.param.dtype]
        if narrowed and _comm_hook(ddp) == "none":
            w = narrowed[0]
            raise RuntimeError(
                f"DistributedDataParallel reduces each gradient in its parameter's dtype "
                f"({dtype_name(w.param.dtype)} for {w.name!r}), and the plan accumulates that "
                f"gradient in {dtype_name(w.dtype)} and reduces it in {dtype_name(w.comm)} "
                f"(comm={dtype_name(w.comm)}, {len(narrowed)} parameter(s)): without the "
                f"plan's comm hook it would be reduced in {dtype_name(w.param.dtype)}, "
                "silently. Register the "
                "hook before training: ddp_model.register_comm_hook(None, "
                "precision_annot.adapters.ddp.comm_hook(precision_annot.applied_plan(model)))"
                f"; or plan comm={dtype_name(w.param.dtype)} for those modules.")
        for w in managed:
            if id(w.param) in self._hooked:  # by another DDP module wrapping it before
                continue
            self._hooked.add(id(w.param))
            self._handles.append(w.param.register_hook(  # type: ignore[no-untyped-call]
                self._arrive(w.param)))
            self._handles.append(w.param.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                self._accumulated))
        return managed

    def _arrive(self, param: nn.Parameter) -> Any:
        ref = weakref.ref(param)

        def arrive(grad: torch.Tensor) -> torch.Tensor:
            """A gradient arriving after the fp32 sum was handed over early: added to it."""
            p = ref()
            entry: Pending | None = None if p is None else _PENDING.get(p)  # type: ignore[no-untyped-call]
            if entry is not None and entry.owner is self and entry.narrow is not None:
                if p is not None and p.grad is entry.narrow and entry.wide is not None:
                    entry.wide.add_(grad)
                else:  # .grad was set to None since (zero_grad after the forward)
                    entry.wide = entry.narrow = None
            return grad

        return arrive

    def _accumulated(self, p: torch.Tensor) -> None:
        """Right after `p`'s accumulation in a synchronising backward: hand DDP the rounding."""
        entry: Pending | None = _PENDING.get(p)  # type: ignore[no-untyped-call]
        grad = p.grad
        if entry is None or entry.owner is not self or grad is None:
            return
        with torch.no_grad():
            if entry.narrow is not None and entry.wide is not None:  # handed over early
                if grad is entry.narrow:  # accumulated into in place: round the sum again
                    grad.copy_(entry.wide)
                    entry.version = grad._version
                else:
                    _hand_over(p, entry, entry.wide)
            else:
                _hand_over(p, entry, grad if grad.dtype == entry.dtype else grad.to(entry.dtype))
        self._finish_soon()

    def _finish_soon(self) -> None:
        """Restore the fp32 gradients after DDP's own end-of-backward callback, which the
        reducer queues only once its last bucket is launched: this callback queues itself again
        when it runs, so it runs after every callback queued during the backward."""
        if self._queued:
            return
        self._queued = True

        def later() -> None:
            seams.queue_callback(self._finish)

        seams.queue_callback(later)

    def _finish(self) -> None:
        self._queued = False
        self._settle()

    def _settle(self) -> None:
        """Each armed parameter's `.grad` back to its fp32 tensor, holding what DDP reduced (or,
        when no backward reduced it, what it held)."""
        armed, self._armed = self._armed, []
        for wide in armed:
            entry: Pending | None = _PENDING.pop(wide.param, None)  # type: ignore[no-untyped-call]
            if entry is not None:
                _settle(wide.param, entry)


def _hand_over(p: torch.Tensor, entry: Pending, wide: torch.Tensor) -> None:
    """Keep `wide` aside and give `p` its rounding to `p`'s dtype as `.grad`, for DDP."""
    entry.wide = wide
    p.grad = None
    p.grad_dtype = p.dtype
    with torch.no_grad():
        narrow = wide.to(p.dtype)
    entry.narrow = narrow
    entry.version = narrow._version
    p.grad = narrow


def _settle(p: torch.Tensor, entry: Pending) -> None:
    grad, wide, narrow, dtype = p.grad, entry.wide, entry.narrow, entry.dtype
    with torch.no_grad():
        if narrow is None or wide is None:  # nothing handed over: DDP may still have set one
            result = grad if grad is None or grad.dtype == dtype else grad.to(dtype)
        elif entry.reduced:
            result = wide
        elif grad is None:  # set to None since (zero_grad)
            result = None
        elif grad is narrow and narrow._version == entry.version:  # never reduced
            result = wide
        else:  # DDP wrote the reduced values into it, or gave it its bucket's view
            wide.copy_(grad)
            result = wide
    p.grad = None
    p.grad_dtype = dtype
    p.grad = result


#: the dtype `own_dtype` gave each parameter as `grad_dtype`: torch has no way back to "follow
#: the dtype", so a later cast of the parameter (the next `apply`, `remove`) leaves it behind
_OWN: WeakIdKeyDictionary = WeakIdKeyDictionary()


def own_dtype(params: Iterable[nn.Parameter]) -> None:
    """Give each parameter its own dtype back as `grad_dtype` (torch has no way back to
    "follow the dtype": it is set to the dtype the parameter has now, and noted, for `stale`)."""
    for p in params:
        set_grad_dtype(p, p.dtype)
        _OWN[p] = p.dtype


def stale(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """Those of `params` whose `grad_dtype` is the dtype `own_dtype` gave them, which a cast
    since left behind (an fp32 one, from a `grad=fp32` plan then an fp32 one, stored in bf16
    by the next): `own_dtype` gives them their dtype now, as an unset `grad_dtype` would."""
    out = []
    for p in params:
        given: torch.dtype | None = _OWN.get(p)  # type: ignore[no-untyped-call]
        if given is not None and p.grad_dtype == given != p.dtype:
            out.append(p)
    return out
