"""`AnnotatedDeepSpeedPrecision`: the Trainer plugin for Lightning's `DeepSpeedStrategy`, as
Lightning has `DeepSpeedPrecision` beside its other precision plugins.

The DeepSpeed engine runs the plan: the strategy's config is filled from the plan
(`adapters.deepspeed.to_config`), `adapters.deepspeed.prepare` applies it and sets each
parameter's comm dtype, and the engine does backward, loss scaling, clipping (the config's
`gradient_clipping`) and the step. `AnnotatedPrecision` takes this path by itself when the
Trainer's strategy is a `DeepSpeedStrategy`; this plugin says so in the code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.types import Steppable
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from precision_annot.adapters.lightning.strategies import LocalHooks, strategy_of
from precision_annot.adapters.lightning.trainer import AnnotatedPrecision

__all__ = ["AnnotatedDeepSpeedPrecision", "DeepSpeedHooks"]


class DeepSpeedHooks(LocalHooks):
    """The DeepSpeed engine runs the plan: the config comes from the plan, and the engine does
    backward, loss scaling, clipping (the config's `gradient_clipping`) and the step."""

    def convert(self, module: nn.Module) -> nn.Module:
        from precision_annot.adapters import deepspeed as ds_adapter

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



class AnnotatedDeepSpeedPrecision(AnnotatedPrecision):
    """The Trainer plugin for `DeepSpeedStrategy`:
    `Trainer(strategy=DeepSpeedStrategy(config=base), plugins=[AnnotatedDeepSpeedPrecision()])`.

    It fills the strategy's config from the plan (a contradiction with `base` raises), runs
    `precision_annot.adapters.deepspeed.prepare`, and leaves backward, loss scaling, clipping
    and the step to the DeepSpeed engine.

    Args: as for `AnnotatedPrecision`.
    """

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        from lightning.pytorch.strategies import DeepSpeedStrategy

        strategy = strategy_of(module)
        if strategy is not None and not isinstance(strategy, DeepSpeedStrategy):
            raise TypeError(
                "AnnotatedDeepSpeedPrecision runs the plan through DeepSpeed's engine, so it "
                "needs Trainer(strategy=DeepSpeedStrategy(...)). Received: strategy="
                f"{type(strategy).__name__}; for other strategies use AnnotatedPrecision.")
        self.hooks = DeepSpeedHooks(self)
        return self.hooks.convert(module)
