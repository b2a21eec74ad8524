"""The Trainer plugin's hooks that depend on the strategy: `hooks_for` picks one set.

`LocalHooks` runs the plan in this process (single device, DDP, FSDP): the plan is applied,
Lightning's own backward and clipping run, and an fp16 plan steps through the `GradScaler`.
Under DDP it registers `ddp.comm_hook(plan)` before the first backward. `DeepSpeedHooks` fills
the strategy's config from the plan and leaves backward, loss scaling, clipping and the step to
the DeepSpeed engine (`deepspeed.py` holds the plugin that names that path).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
from lightning.fabric.utilities.types import Steppable
from lightning.pytorch.plugins.precision import Precision as TrainerPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer

from precision_annot.adapters import deepspeed as ds_adapter
from precision_annot.adapters.ddp import comm_hook, hooked_modules
from precision_annot.adapters.lightning.base import TrainerPlanPrecision

__all__ = ["DeepSpeedHooks", "LocalHooks", "hooks_for", "strategy_of"]


def strategy_of(module: nn.Module) -> Any:
    """The strategy of the Trainer the LightningModule is attached to, or None (a plain module,
    one not attached, or one run by Fabric, whose `trainer` stands in for Fabric)."""
    if not isinstance(module, pl.LightningModule) or module.fabric is not None:
        return None
    try:
        trainer = module.trainer
    except RuntimeError:  # "... is not attached to a `Trainer`"
        return None
    return getattr(trainer, "strategy", None)


class LocalHooks:
    """The plan runs here: apply it, back-propagate and clip as Lightning does, scale fp16."""

    def __init__(self, plugin: TrainerPlanPrecision) -> None:
        self.plugin = plugin
        self.hook_checked = False

    def convert(self, module: nn.Module) -> nn.Module:
        return self.plugin.apply_plan(module)

    def before_backward(self, module: pl.LightningModule) -> None:
        """Under DDPStrategy, reduce gradients in the plan's comm dtypes.

        Lightning registers `DDPStrategy(ddp_comm_hook=...)` only on CUDA, so on CPU a hook
        would be dropped silently. The plan's `ddp.comm_hook` is registered here, once, before
        the first backward, unless the user gave a hook of their own.
        """
        if self.hook_checked:
            return
        self.hook_checked = True
        from torch.nn.parallel import DistributedDataParallel

        plan = self.plugin.plan
        strategy = strategy_of(module)
        wrapped = getattr(strategy, "model", None)
        if plan is None or not isinstance(wrapped, DistributedDataParallel):
            return
        if not hooked_modules(plan):  # every gradient reduces in its planned comm already
            return
        if getattr(strategy, "_ddp_comm_hook", None) is not None:
            device = strategy.root_device.type
            if device != "cuda":
                warnings.warn(
                    "DDPStrategy(ddp_comm_hook=...) is registered by Lightning only on CUDA; on "
                    f"{device} it is not used and gradients reduce in the parameter dtype. Drop "
                    "the hook to let AnnotatedPrecision register the plan's.",
                    UserWarning, stacklevel=3,
                )
            return
        wrapped.register_comm_hook(None, comm_hook(plan))

    def backward(self, tensor: Tensor, model: pl.LightningModule, optimizer: Steppable | None,
                 *args: Any, **kwargs: Any) -> None:
        TrainerPrecision.backward(self.plugin, tensor, model, optimizer, *args, **kwargs)

    def clip_gradients(self, optimizer: Optimizer, clip_val: int | float,
                       algorithm: GradClipAlgorithmType) -> None:
        TrainerPrecision.clip_gradients(self.plugin, optimizer, clip_val, algorithm)

    def optimizer_step(self, optimizer: Steppable, model: pl.LightningModule,
                       closure: Callable[[], Any], **kwargs: Any) -> Any:
        plugin = self.plugin
        scaler = plugin.scaler
        if scaler is None:
            return TrainerPrecision.optimizer_step(plugin, optimizer, model, closure, **kwargs)
        # The same sequence as Lightning's MixedPrecision: unscale before clipping, and let the
        # scaler skip the step when gradients are not finite.
        if isinstance(optimizer, LBFGS):
            raise ValueError(f"{type(plugin).__name__} with fp16 (a GradScaler) does not "
                             "support LBFGS.")
        closure_result = closure()
        skip_unscaling = closure_result is None and model.automatic_optimization
        if not _optimizer_handles_unscaling(optimizer) and not skip_unscaling:
            scaler.unscale_(optimizer)
        plugin._after_closure(model, optimizer)
        if skip_unscaling:
            return closure_result
        step_output = scaler.step(optimizer, **kwargs)
        scaler.update()
        return step_output


class DeepSpeedHooks(LocalHooks):
    """The DeepSpeed engine runs the plan: the config comes from the plan, and the engine does
    backward, loss scaling, clipping (the config's `gradient_clipping`) and the step."""

    def convert(self, module: nn.Module) -> nn.Module:
        plugin = self.plugin
        strategy = strategy_of(module)
        plan = plugin.plan_for(module)
        translated = ds_adapter.translate(plan)
        config = ds_adapter.to_config(translated, strategy.config)
        strategy.config.clear()
        strategy.config.update(config)
        ds_adapter.prepare(module, translated)
        plugin.adopt(plan, module)
        return module  # precision stays "32-true": the config already holds the sections

    def before_backward(self, module: pl.LightningModule) -> None:
        return

    def backward(self, tensor: Tensor, model: pl.LightningModule, optimizer: Steppable | None,
                 *args: Any, **kwargs: Any) -> None:
        engine: Any = model.trainer.model  # the DeepSpeedEngine
        engine.backward(tensor, *args, **kwargs)

    def clip_gradients(self, optimizer: Optimizer, clip_val: int | float,
                       algorithm: GradClipAlgorithmType) -> None:
        return

    def optimizer_step(self, optimizer: Steppable, model: pl.LightningModule,
                       closure: Callable[[], Any], **kwargs: Any) -> Any:
        closure_result = closure()
        self.plugin._after_closure(model, optimizer)
        if closure_result is None and model.automatic_optimization:
            raise ValueError("Skipping backward by returning None from training_step is not "
                             "supported by DeepSpeed.")
        engine: Any = model.trainer.model
        return engine.step(**kwargs)



def hooks_for(plugin: TrainerPlanPrecision, module: nn.Module) -> LocalHooks:
    """The hooks for the strategy `module`'s Trainer runs: DeepSpeed's engine, or this
    process."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if isinstance(strategy_of(module), DeepSpeedStrategy):
        return DeepSpeedHooks(plugin)
    return LocalHooks(plugin)
