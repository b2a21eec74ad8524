"""The one place wrappers around a model are seen through: `DistributedDataParallel`,
`DataParallel`, FSDP1's root, `torch.compile`, DeepSpeed's engine and Lightning Fabric.

Every entry point (`resolve`, `apply`, `remove`, `audit`, `check`, the adapters) calls
`unwrap` first, so a plan made for a model also fits the model wrapped.
"""

from __future__ import annotations

from torch import nn

__all__ = ["compiled", "unwrap"]

# wrapper class name -> the attribute holding the wrapped model
_WRAPPERS: dict[str, str] = {
    "DistributedDataParallel": "module",
    "DataParallel": "module",
    "FullyShardedDataParallel": "_fsdp_wrapped_module",
    "OptimizedModule": "_orig_mod",  # torch.compile
    "DeepSpeedEngine": "module",
    "_FabricModule": "module",  # Lightning Fabric's setup(): a property
}


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside every known wrapper around `model` (itself when there is none)."""
    for _ in range(16):
        inner = unwrap_once(model)
        if inner is None:
            return model
        model = inner
    return model


def compiled(model: nn.Module) -> bool:
    """Whether `model`, or a wrapper around it, runs compiled: `torch.compile(model)`, or
    `model.compile()`, whose compiled call torch keeps on the module itself.

    NOTE: `nn.Module.compile` leaves no public trace but `_compiled_call_impl`."""
    for _ in range(16):
        if type(model).__name__ == "OptimizedModule" or getattr(
                model, "_compiled_call_impl", None) is not None:
            return True
        inner = unwrap_once(model)
        if inner is None:
            return False
        model = inner
    return False


def unwrap_once(model: nn.Module) -> nn.Module | None:
    """The model one known wrapper holds, or None when `model` is not one."""
    attr = _WRAPPERS.get(type(model).__name__)
    if attr is None:
        return None
    if isinstance(getattr(type(model), attr, None), property):  # the wrapper's own accessor
        inner = getattr(model, attr)
    else:  # a plain attribute, or registered as a submodule
        inner = model.__dict__.get(attr)
        if inner is None:
            inner = model._modules.get(attr)
    return inner if isinstance(inner, nn.Module) else None
