"""Lightning: a Trainer precision plugin and a Fabric precision plugin that run the plan.

Lightning has one precision string for the whole model. These plugins take the plan from the
annotations on the LightningModule (or an explicit `plan=`), apply it in `convert_module`, cast
floating tensors in each batch to the root's compute dtype before the batch is moved to the
device (Lightning issue 17727), run `training_step` under the root's autocast state, and use a
`precision_annot.GradScaler` when fp16 is used anywhere (its state is saved in checkpoints).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from precision_annot.boundary import autocast_context
from precision_annot.casting import cast_tree
from precision_annot.plan import PrecisionPlan
from precision_annot.policy import SpecLike, as_policy, autocast_mode
from precision_annot.resolution import resolve
from precision_annot.runtime import apply
from precision_annot.scaler import GradScaler

try:
    from lightning.fabric.plugins.precision import Precision as _FabricPrecision
    from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
    from lightning.pytorch.plugins.precision import FSDPPrecision as _FSDPPrecision
    from lightning.pytorch.plugins.precision import Precision as _TrainerPrecision
except ImportError as e:  # pragma: no cover - exercised only without lightning installed
    raise ImportError(
        "precision_annot.adapters.lightning needs Lightning: "
        "pip install 'precision-annot[lightning]'"
    ) from e

__all__ = ["AnnotatedFSDPPrecision", "AnnotatedPrecision", "FabricAnnotatedPrecision"]


class _Annotated:
    """What the Trainer and Fabric plugins share: the plan, the input cast, autocast, the scaler."""

    precision: Any  # Lightning's precision string, derived from the plan's root
    scaler: Any  # a GradScaler when fp16 is used (FSDP: ShardedGradScaler), else None

    def __init__(
        self,
        plan: PrecisionPlan | None = None,
        *,
        default: SpecLike | None = None,
        device: str | None = None,
    ) -> None:
        if plan is not None and not isinstance(plan, PrecisionPlan):
            raise TypeError(
                f"{type(self).__name__}(plan={plan!r}): plan must be a PrecisionPlan from "
                "resolve(model), or None to resolve the model's annotations."
            )
        if plan is not None and default is not None:
            raise ValueError(
                f"{type(self).__name__}(plan=..., default={default!r}): default is only used to "
                "resolve a plan; pass it to resolve() instead."
            )
        self._given_plan = plan
        self._default = None if default is None else as_policy(default, argument="default")
        self._device = device
        self.plan: PrecisionPlan | None = plan
        self.scaler = None
        self.precision = "32-true"  # Lightning reads this string; set from the plan's root
        self._hook_checked = False

    def _convert(self, module: nn.Module) -> nn.Module:
        plan = self._given_plan or resolve(module, self._default)
        apply(module, plan)
        self.plan = plan
        if self._device is None:
            param = next(module.parameters(), None)
            self._device = param.device.type if param is not None else "cpu"
        root = plan.root.policy
        if plan.needs_loss_scaling and self.scaler is None:
            self.scaler = GradScaler(device=self._device)
        self.precision = _lightning_name(root.compute, root.storage)
        return module

    def convert_input(self, data: Any) -> Any:
        """Cast floating tensors in the batch to the root's compute dtype (before the transfer)."""
        dtype = None if self.plan is None else self.plan.root.policy.compute
        return data if dtype is None else cast_tree(data, dtype)

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        """The root's autocast state, so code that calls submodules directly runs as the root."""
        return self._root_context()

    def tensor_init_context(self) -> contextlib.AbstractContextManager[None]:
        # Storage differs per module, so no default dtype is set: modules are built in fp32 and
        # each is cast to its own storage dtype in convert_module.
        return contextlib.nullcontext()

    def module_init_context(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def state_dict(self) -> dict[str, Any]:
        """The GradScaler's state, saved in checkpoints; empty without fp16."""
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)

    def _root_context(self) -> contextlib.AbstractContextManager[Any]:
        if self.plan is None:
            return contextlib.nullcontext()
        root = self.plan.root.policy
        context = autocast_context(autocast_mode(root), self._device or "cpu", root.compute)
        return context or contextlib.nullcontext()


def _lightning_name(compute: torch.dtype | None, storage: torch.dtype | None) -> str:
    names = {torch.float16: "16", torch.bfloat16: "bf16", torch.float32: "32", torch.float64: "64"}
    if compute is None:
        return "32-true"
    if storage is None or storage == compute:
        return f"{names[compute]}-true"
    return f"{names[compute]}-mixed"


def _deepspeed_strategy(module: Any) -> Any:
    """The Trainer's DeepSpeedStrategy, if `module` is attached to one."""
    strategy = getattr(getattr(module, "_trainer", None), "strategy", None)
    if strategy is None:
        return None
    from lightning.pytorch.strategies import DeepSpeedStrategy

    return strategy if isinstance(strategy, DeepSpeedStrategy) else None


class AnnotatedPrecision(_Annotated, _TrainerPrecision):
    """The Trainer precision plugin: `Trainer(plugins=[AnnotatedPrecision()])`.

    With `DeepSpeedStrategy(config=base)` the plugin fills the strategy's config from
    `precision_annot.adapters.deepspeed.to_config(plan, base)` (a contradiction raises), runs
    `deepspeed.prepare`, and leaves backward, loss scaling and the step to the DeepSpeed engine.
    With `DDPStrategy` it registers `ddp.comm_hook(plan)`.

    Args:
        plan: the plan to run; None resolves the LightningModule's annotations in
            `convert_module`. (Default: None)
        default: the root's defaults when resolving, e.g. "bf16-mixed". (Default: None)
        device: the autocast and GradScaler device type; None takes the model's. (Default: None)

    Example:
        >>> trainer = Trainer(plugins=[AnnotatedPrecision(default="bf16-mixed")])  # doctest: +SKIP
    """

    _deepspeed: bool = False

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        strategy = _deepspeed_strategy(module)
        if strategy is None:
            return self._convert(module)
        from precision_annot.adapters import deepspeed as ds_adapter

        plan = self._given_plan or resolve(module, self._default)
        translated = ds_adapter.translate(plan)
        config = ds_adapter.to_config(translated, strategy.config)
        strategy.config.clear()
        strategy.config.update(config)
        ds_adapter.prepare(module, translated)
        self.plan, self._deepspeed = plan, True
        param = next(module.parameters(), None)
        self._device = self._device or (param.device.type if param is not None else "cpu")
        return module  # precision stays "32-true": the config already holds the sections

    @override
    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any,
                 **kwargs: Any) -> None:
        if self._deepspeed:
            model.trainer.model.backward(tensor, *args, **kwargs)
            return
        super().backward(tensor, model, optimizer, *args, **kwargs)

    @override
    def clip_gradients(self, optimizer: Any, clip_val: Any = 0.0,
                       gradient_clip_algorithm: Any = None) -> None:
        if self._deepspeed:
            return  # DeepSpeed clips with the config's gradient_clipping
        if gradient_clip_algorithm is None:
            super().clip_gradients(optimizer, clip_val)
        else:
            super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def _register_comm_hook(self, module: Any) -> None:
        """Reduce gradients in the plan's comm dtypes under DDPStrategy.

        Lightning registers `DDPStrategy(ddp_comm_hook=...)` only on CUDA, so on CPU a hook
        would be dropped silently. The plugin registers `ddp.comm_hook(plan)` itself, once,
        before the first backward, unless the user gave a hook of their own.
        """
        self._hook_checked = True
        from torch.nn.parallel import DistributedDataParallel

        strategy = getattr(getattr(module, "_trainer", None), "strategy", None)
        wrapped = getattr(strategy, "model", None)
        if self.plan is None or not isinstance(wrapped, DistributedDataParallel):
            return
        if all(e.policy.comm is None for e in self.plan.values()):
            return
        if getattr(strategy, "_ddp_comm_hook", None) is not None:
            if strategy.root_device.type != "cuda":  # type: ignore[union-attr]
                warnings.warn(
                    "DDPStrategy(ddp_comm_hook=...) is registered by Lightning only on CUDA; on "
                    f"{strategy.root_device.type} it is not used and gradients reduce in the "  # type: ignore[union-attr]
                    "parameter dtype. Drop the hook to let AnnotatedPrecision register the plan's.",
                    UserWarning, stacklevel=2,
                )
            return
        from precision_annot.adapters.ddp import comm_hook

        wrapped.register_comm_hook(None, comm_hook(self.plan))

    @override
    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        if not self._hook_checked:
            self._register_comm_hook(module)
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        out: torch.Tensor = super().pre_backward(tensor, module)
        return out

    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: Any,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        # The same sequence as Lightning's MixedPrecision: unscale before clipping, and let the
        # scaler skip the step when gradients are not finite.
        if self._deepspeed:
            closure_result = closure()
            self._after_closure(model, optimizer)
            if closure_result is None and model.automatic_optimization:
                raise ValueError("Skipping backward by returning None from training_step is not "
                                 "supported by DeepSpeed.")
            return model.trainer.model.step(**kwargs)
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, LBFGS):
            raise ValueError("AnnotatedPrecision with fp16 (a GradScaler) does not support LBFGS.")
        closure_result = closure()
        skip_unscaling = closure_result is None and model.automatic_optimization
        if not _optimizer_handles_unscaling(optimizer) and not skip_unscaling:
            self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        if skip_unscaling:
            return closure_result
        step_output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return step_output


class FabricAnnotatedPrecision(_Annotated, _FabricPrecision):
    """The Fabric precision plugin: `Fabric(plugins=[FabricAnnotatedPrecision()])`.

    Fabric casts a module's inputs in its forward; this plugin casts them to the root's compute
    dtype, applies the plan in `fabric.setup`, and scales the loss when fp16 is used.
    """

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        return self._convert(module)

    @override
    def backward(self, tensor: torch.Tensor, model: nn.Module | None, *args: Any,
                 **kwargs: Any) -> None:
        # Fabric ignores what pre_backward returns; like its MixedPrecision, scale here.
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        super().backward(tensor, model, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if self.scaler is None:
            return optimizer.step(**kwargs)
        if isinstance(optimizer, LBFGS):
            raise ValueError("FabricAnnotatedPrecision with fp16 does not support LBFGS.")
        step_output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return step_output

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if self.scaler is not None:
            if _optimizer_handles_unscaling(optimizer):
                raise NotImplementedError(
                    "Gradient clipping is not implemented for fused optimizers."
                )
            self.scaler.unscale_(optimizer)


class AnnotatedFSDPPrecision(AnnotatedPrecision, _FSDPPrecision):
    """`AnnotatedPrecision` for Lightning's `FSDPStrategy` (FSDP1), which accepts only
    `FSDPPrecision` subclasses.

    It applies the plan, gives FSDP the root's `MixedPrecision` from `fsdp.mixed_precision(plan)`,
    sets the strategy's `auto_wrap_policy` to `fsdp.wrap_policy(plan)` unless you set one, and
    uses FSDP's `ShardedGradScaler` (which agrees on overflow across ranks) when fp16 is used.

    Example:
        >>> trainer = Trainer(strategy=FSDPStrategy(),  # doctest: +SKIP
        ...                   plugins=[AnnotatedFSDPPrecision(default="bf16-mixed")])
    """

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        module = super().convert_module(module)
        assert self.plan is not None
        if self.plan.needs_loss_scaling:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device=self._device or "cpu")
        strategy = getattr(getattr(module, "_trainer", None), "strategy", None)
        kwargs = getattr(strategy, "kwargs", None)
        if isinstance(kwargs, dict) and "auto_wrap_policy" not in kwargs:
            from precision_annot.adapters.fsdp import wrap_policy

            kwargs["auto_wrap_policy"] = wrap_policy(self.plan)
        return module

    @property
    @override
    def mixed_precision_config(self) -> Any:
        from precision_annot.adapters.fsdp import mixed_precision

        # Lightning reads this for configure_model's wrapping context, before convert_module
        # resolves the plan; modules wrapped there get no mixed precision from the plan.
        return None if self.plan is None else mixed_precision(self.plan)

    @override
    def convert_output(self, data: Any) -> Any:
        return data  # outputs leave in the dtype the plan gives them
