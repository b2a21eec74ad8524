"""`AnnotatedDeepSpeedPrecision`: the Trainer plugin for Lightning's `DeepSpeedStrategy`, as
Lightning has `DeepSpeedPrecision` beside its other precision plugins.

The DeepSpeed engine runs the plan: the strategy's config is filled from the plan
(`adapters.deepspeed.to_config`), `adapters.deepspeed.prepare` applies it and sets each
parameter's comm dtype, and the engine does backward, loss scaling, clipping (the config's
`gradient_clipping`) and the step. `AnnotatedPrecision` takes this path by itself when the
Trainer's strategy is a `DeepSpeedStrategy`; this plugin says so in the code.
"""

from __future__ import annotations

from torch import nn
from typing_extensions import override

from precision_annot.adapters.lightning.strategies import DeepSpeedHooks, strategy_of
from precision_annot.adapters.lightning.trainer import AnnotatedPrecision

__all__ = ["AnnotatedDeepSpeedPrecision"]


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
