"""DDP: a communication hook that reduces each parameter's gradient in its planned `comm` dtype.

DDP buckets gradients by parameter dtype and reduces each bucket in that dtype. With fp32
master weights that means fp32 reduction, even when the user wants bf16 on the wire. This
hook groups a bucket's gradients by `comm` dtype, reduces each group once (pre-divided by the
world size, as `torch.distributed.algorithms.ddp_comm_hooks.default_hooks` does), and writes
the averages back into the bucket in the parameter's dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import GradBucket  # type: ignore[attr-defined]  # public, not in stubs

from precision_annot._src.check_backend import LOOP_KEYS, CheckBackend, Checked
from precision_annot._src.dtypes import dtype_name, wider
from precision_annot._src.findings import Finding, drift, listing
from precision_annot._src.grads import Pending, pending
from precision_annot._src.guards import require_plan
from precision_annot._src.plan import PrecisionPlan
from precision_annot._src.runtime import Subject

__all__ = ["CHECKS", "Bucket", "DDPChecks", "buckets", "comm_hook", "findings", "hook_name",
           "hooked_modules", "reduced", "registered_hooks"]

#: DDP's defaults: `bucket_cap_mb`, and the smaller first bucket it rebuilds after one step.
BUCKET_CAP_MB = 25
FIRST_BUCKET_BYTES = 1024 * 1024
_PLAN_ATTR = "precision_plan"  # set on the hooks comm_hook returns, to know them again

CommHook = Callable[[Any, GradBucket], "torch.futures.Future[torch.Tensor]"]


class _Span(NamedTuple):
    """One parameter's gradient in a bucket: where, and its fp32 sum when the reduction reads
    that instead (`grad=fp32` with a `comm` wider than the parameter)."""

    offset: int
    numel: int
    wide: Pending | None


def _wide_source(p: torch.Tensor, comm: torch.dtype, bucket: torch.dtype) -> Pending | None:
    """The fp32 gradient sum of a parameter whose plan accumulates wider than it is stored,
    when its `comm` is wider than the bucket DDP gave it: the reduction reads the sum, not its
    rounding in the bucket."""
    found = pending(p)
    if found is None or found.wide is None or comm == bucket or not wider(comm, bucket):
        return None
    return found


def comm_hook(plan: PrecisionPlan) -> CommHook:
    """A DDP communication hook reducing each parameter's gradient in its `comm` dtype.

    Parameters whose module sets no `comm` reduce in their own dtype (DDP's default).

    Args:
        plan: a plan resolved from the model DDP wraps (it finds parameters through the plan's
            weak references), e.g. `applied_plan`'s.

    Returns:
        `hook(state, bucket)`, for `ddp_model.register_comm_hook(state=None, hook=...)`;
        `state` may be a process group, or None for the default group.

    Example:
        >>> from precision_annot.adapters import ddp  # doctest: +SKIP
        >>> ddp_model.register_comm_hook(None, ddp.comm_hook(resolve(model)))  # doctest: +SKIP
    """
    require_plan(plan, "comm_hook")
    comm_of: dict[int, torch.dtype | None] = {
        id(p): entry.policy.grad_comm for _, p, entry in plan.param_policies()
    }

    def hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        group = state if isinstance(state, dist.ProcessGroup) else None
        world = dist.get_world_size(group)
        buffer = bucket.buffer()
        groups: dict[torch.dtype, list[_Span]] = {}
        offset = 0
        for p in bucket.parameters():
            n = p.numel()
            dtype = comm_of.get(id(p)) or buffer.dtype
            groups.setdefault(dtype, []).append(_Span(offset, n, _wide_source(p, dtype,
                                                                              buffer.dtype)))
            offset += n
        if list(groups) == [buffer.dtype]:
            buffer.div_(world)
            work = dist.all_reduce(buffer, group=group, async_op=True)
            assert work is not None
            fut: torch.futures.Future[torch.Tensor] = work.get_future().then(
                lambda f: f.value()[0]
            )
            return fut
        packed: list[tuple[list[_Span], torch.Tensor]] = []
        futures = []
        for dtype, spans in groups.items():
            flat = torch.cat([buffer[s.offset:s.offset + s.numel] if s.wide is None
                              else s.wide.wide.reshape(-1) for s in spans]  # type: ignore[union-attr]
                             ).to(dtype).div_(world)
            work = dist.all_reduce(flat, group=group, async_op=True)
            assert work is not None
            futures.append(work.get_future())
            packed.append((spans, flat))

        def unpack(_: Any) -> torch.Tensor:
            for spans, flat in packed:
                at = 0
                for span in spans:
                    part = flat[at:at + span.numel]
                    buffer[span.offset:span.offset + span.numel].copy_(part)
                    if span.wide is not None:  # the fp32 sum itself, reduced in comm
                        span.wide.wide.view(-1).copy_(part)  # type: ignore[union-attr]
                        span.wide.reduced = True
                    at += span.numel
            return buffer

        done: torch.futures.Future[torch.Tensor] = torch.futures.collect_all(futures).then(unpack)
        return done

    setattr(hook, _PLAN_ATTR, plan)
    # DDP checks the hook's annotations by identity; postponed (string) annotations fail that.
    hook.__annotations__ = {
        "state": object, "bucket": GradBucket, "return": torch.futures.Future[torch.Tensor]
    }
    return hook


# -- what DDP will do with the plan ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Bucket:
    """One of DDP's gradient buckets, as `buckets` predicts it.

    Attributes:
        dtype: the parameter (and bucket) dtype.
        modules: the modules whose gradients it holds, in the order they arrive.
        bytes: its size.
        comms: the dtypes its gradients are reduced in under `comm_hook` (one all-reduce each).
    """

    dtype: torch.dtype
    modules: tuple[str, ...]
    bytes: int
    comms: frozenset[torch.dtype]


def buckets(plan: PrecisionPlan, *, bucket_cap_mb: float | None = None) -> list[Bucket]:
    """DDP's gradient buckets for the plan from its second step on, module by module.

    After one step DDP rebuilds its buckets in the order gradients arrive (taken here as the
    reverse of module order, which is what backward gives a sequential model), one series per
    parameter dtype. As in DDP, with `bucket_cap_mb=None` the first is capped at 1 MiB and the
    rest at 25 MiB; a value you give caps them all.
    """
    require_plan(plan, "buckets")
    if bucket_cap_mb is not None and (not isinstance(bucket_cap_mb, (int, float))
                                      or isinstance(bucket_cap_mb, bool) or bucket_cap_mb <= 0):
        raise ValueError(f"bucket_cap_mb is DDP's bucket size in MiB, a positive number or "
                         f"None (DDP's default). Received: bucket_cap_mb={bucket_cap_mb!r}")
    cap = int((bucket_cap_mb or BUCKET_CAP_MB) * 1024 * 1024)
    first = FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
    open_: dict[torch.dtype, tuple[list[str], int, set[torch.dtype]]] = {}
    done: dict[torch.dtype, int] = {}
    out = []
    for name, entry in reversed(list(plan.items())):
        for dtype, size in entry.trainable_dtype_bytes.items():  # DDP reduces these alone
            names, total, comms = open_.setdefault(dtype, ([], 0, set()))
            names.append(name)
            comms.add(entry.policy.grad_comm or dtype)
            total += size
            open_[dtype] = (names, total, comms)
            if total >= (first if not done.get(dtype) else cap):
                out.append(Bucket(dtype, tuple(names), total, frozenset(comms)))
                done[dtype] = done.get(dtype, 0) + 1
                del open_[dtype]
    out += [Bucket(d, tuple(n), t, frozenset(c)) for d, (n, t, c) in open_.items()]
    return out


def hooked_modules(plan: PrecisionPlan) -> list[str]:
    """The modules whose gradients DDP reduces in another dtype than the plan's `comm`
    without `comm_hook` (their parameters are stored in another dtype)."""
    return [n for n, e in plan.items() if e.params and e.policy.grad_comm is not None
            and any(d.is_floating_point and d != e.policy.grad_comm for d in e.param_dtype_bytes)]


def registered_hooks(ddp_model: nn.Module) -> list[Callable[..., Any]] | None:
    """The Python comm hooks registered on a DistributedDataParallel model, or None when this
    torch does not say (NOTE: reads DDP's private `_comm_hooks`, the list `register_comm_hook`
    appends to; a built-in hook registered in C++ is not in it: see `hook_name`)."""
    hooks = getattr(ddp_model, "_comm_hooks", None)
    if not isinstance(hooks, list):
        return None
    return [hook for hook, _ in hooks]


def hook_name(ddp_model: nn.Module) -> str | None:
    """The name DDP's own logger keeps for the comm hook registered on it, Python or built-in
    ("BuiltinCommHookType.FP16_COMPRESS"), or None when there is none or this torch does not
    say (NOTE: DDP's private logger, which records `_register_builtin_comm_hook` too)."""
    try:
        name = ddp_model.logger._get_ddp_logging_data().strs_map.get("comm_hook")  # type: ignore[union-attr,operator]
    except Exception:
        return None
    return name or None


#: what DDP's own hooks reduce in: None is each parameter's own dtype
_KNOWN_HOOKS: dict[str, torch.dtype | None] = {
    "allreduce_hook": None, "BuiltinCommHookType.ALLREDUCE": None,
    "fp16_compress_hook": torch.float16, "BuiltinCommHookType.FP16_COMPRESS": torch.float16,
    "bf16_compress_hook": torch.bfloat16,
}


def reduced(plan: PrecisionPlan, ddp_model: nn.Module | None = None
            ) -> tuple[dict[str, torch.dtype] | None, str]:
    """What DDP will reduce each parameter-holding module's gradients in, and why: with the
    plan's hook as planned, with none in their parameters' dtype, with DDP's own compress
    hooks in fp16 or bf16; (None, why) for a hook this library does not know, or no model."""
    stored = {n: e.stored for n, e in plan.items() if e.stored is not None}  # floating only
    if ddp_model is None:
        return None, "no DDP model was given"
    hooks = registered_hooks(ddp_model) or []
    if any(getattr(h, _PLAN_ATTR, None) is not None for h in hooks):
        return {n: plan[n].policy.grad_comm or d for n, d in stored.items()}, "its comm hook"
    name = hook_name(ddp_model)
    if name is None:
        return dict(stored), "no comm hook is registered, so each gradient reduces in its " \
            "parameter's dtype"
    if name in _KNOWN_HOOKS:
        dtype = _KNOWN_HOOKS[name]
        return ({n: dtype or d for n, d in stored.items()},
                f"the comm hook {name!r} reduces every gradient in "
                f"{dtype_name(dtype) if dtype else 'its parameter dtype'}")
    return None, f"the comm hook {name!r} is not the plan's, and its dtypes are unknown"


_HOOK_FIX = ("ddp_model.register_comm_hook(None, precision_annot.adapters.ddp.comm_hook("
             "precision_annot.applied_plan(model))), in place of any other hook")


def findings(plan: PrecisionPlan, ddp_model: nn.Module | None = None, *,
             bucket_cap_mb: float | None = None) -> list[Finding]:
    """What DDP will drop or run badly for this plan: gradients reduced in another dtype than
    the plan's comm (by no hook, or another hook), and buckets the hook splits into several
    all-reduces."""
    require_plan(plan, "findings")
    out: list[Finding] = []
    narrowed = hooked_modules(plan)
    actual, why = reduced(plan, ddp_model)
    if actual is not None:
        code = "ddp-no-hook" if why.startswith("no comm hook") else "ddp-other-hook"
        out += drift(plan, "comm", actual, code=code, backend="DDP", cause=why, fix=_HOOK_FIX)
    elif narrowed and ddp_model is None:
        comms = sorted({dtype_name(plan[n].policy.grad_comm) for n in narrowed})
        out.append(Finding(
            "info", "ddp-needs-hook", narrowed[0] if len(narrowed) == 1 else "",
            f"DDP reduces each gradient in its parameter dtype, so the plan's comm "
            f"({', '.join(comms)}) for {len(narrowed)} modules ({listing(narrowed, 3)}) holds "
            "only through the plan's comm hook; without it they reduce in their parameter "
            "dtype.",
            f"{_HOOK_FIX} after wrapping (Lightning's AnnotatedPrecision registers it itself).",
            tuple(narrowed),
        ))
    elif narrowed:
        out.append(Finding(
            "warning", "ddp-other-hook", narrowed[0] if len(narrowed) == 1 else "",
            f"This DDP model reduces through a comm hook of its own: {why}. The plan's "
            f"per-module comm for {listing(narrowed, 3)} holds only if that hook does the same.",
            _HOOK_FIX, tuple(narrowed),
        ))
    out += _mixed_buckets(plan, bucket_cap_mb)
    return out


def _mixed_buckets(plan: PrecisionPlan, bucket_cap_mb: float | None) -> list[Finding]:
    predicted = buckets(plan, bucket_cap_mb=bucket_cap_mb)
    split = [b for b in predicted if len(b.comms) > 1]
    if not split:
        return []
    total = len(predicted)
    extra = sum(len(b.comms) - 1 for b in split)
    mixed = sorted({dtype_name(c) for b in split for c in b.comms})
    names = [m for b in split for m in b.modules]
    return [Finding(
        "info", "ddp-mixed-bucket", "",
        f"{len(split)} of DDP's {total} gradient buckets mix comm dtypes "
        f"({', '.join(mixed)}); the comm hook reduces each dtype of a bucket separately, "
        f"copying the gradients out and back: {total + extra} all-reduces per step "
        f"instead of {total}.",
        "Give modules that share a bucket one comm dtype (e.g. an island's comm equal to "
        "the model's), or accept the extra all-reduces.",
        tuple(names),
    )]


class DDPChecks(CheckBackend):
    """`check(..., "ddp")`: a `DistributedDataParallel` model's comm hook (or the plan's, when
    given a plan or an unwrapped model), and its buckets."""

    name = "ddp"
    keys = ("bucket_cap_mb", *LOOP_KEYS)

    def run(self, given: Subject, options: Any) -> Checked:
        wrapped = given.wrapped
        ddp_model = wrapped if isinstance(wrapped, nn.parallel.DistributedDataParallel) else None
        return Checked(findings(given.plan, ddp_model, **self.without_loop(options)),
                       reduced(given.plan, ddp_model)[0])


CHECKS = DDPChecks()
