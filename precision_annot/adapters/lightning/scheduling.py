"""`ScheduleCallback`: `precision_annot.schedule` in a Trainer, resumed in the saved phase."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from precision_annot._src.runtime import applied_plan
from precision_annot._src.schedule import Phase, Schedule, phases_of, unwrapped_optimizer
from precision_annot._src.update.optimizer import PlanOptimizer
from precision_annot.adapters.lightning.base import PlanPrecision

__all__ = ["ScheduleCallback"]


class ScheduleCallback(pl.Callback):
    """Change the LightningModule's plan at chosen optimizer steps of a fit
    (`precision_annot.schedule` in a Trainer): bf16 with fp32 masters, then the last 10% in
    fp32; or fp32 warm-up steps, then bf16.

    The phase the fit starts in is applied in `on_fit_start`, once `configure_optimizers` has
    built the optimizer (a `precision_annot.optimizer`, which follows each switch) and, in a
    fit resumed with `ckpt_path=`, once the Trainer has loaded the weights into the model as
    built: the checkpoint's phase is applied then, alone, and the optimizer's state loads
    into it. After each optimizer step (`trainer.global_step` moves: with
    `accumulate_grad_batches` a step is several batches) the next phase is applied where it
    starts, before the validation that may follow. The schedule's step and phase are saved in
    checkpoints. With `AnnotatedPrecision` the phases give the plan: the plugin applies
    nothing itself and its batch cast, autocast and GradScaler follow each phase; its
    `default` is not used (give it no `plan=`).

    Args:
        phases: as `precision_annot.schedule` takes them: from the optimizer step where each
            phase starts (an int, or a float in [0, 1) of `total_steps`) to its plan or spec.
        total_steps: the optimizer steps of the fit, for fractions. (Default: the Trainer's
            `max_steps` where it is set)

    Attributes:
        schedule: the `Schedule` of the running fit (None before it starts).

    Example:
        >>> callback = ScheduleCallback({0: "bf16-master", 0.9: "32-true"})  # doctest: +SKIP
        >>> Trainer(max_steps=1000, callbacks=[callback]).fit(model)  # doctest: +SKIP
    """

    def __init__(self, phases: Mapping[int | float, Phase], *,
                 total_steps: int | None = None) -> None:
        if total_steps is not None or not any(isinstance(k, float) for k in phases):
            phases_of(phases, total_steps)  # refused now where nothing waits for the Trainer
        self.phases = phases
        self.total_steps = total_steps
        self.schedule: Schedule | None = None
        self._steps: list[tuple[int, Phase]] = []
        self._start = 0  # the optimizer steps a resumed fit took before
        self._saved: dict[str, Any] | None = None  # the schedule's state in its checkpoint

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        from lightning.pytorch.strategies import SingleDeviceStrategy

        if not isinstance(trainer.strategy, SingleDeviceStrategy):
            raise ValueError(
                "ScheduleCallback runs on one device (SingleDeviceStrategy) for now: a switch "
                "changes the dtypes of parameters that a distributed strategy has already "
                "wrapped or sharded. Received: strategy "
                f"{type(trainer.strategy).__name__}")
        total = self.total_steps
        if total is None and trainer.max_steps > 0:
            total = int(trainer.max_steps)
        if total is None and any(isinstance(k, float) for k in self.phases):
            raise ValueError(
                "ScheduleCallback: phases has fractions, which need the fit's optimizer steps: "
                "give Trainer(max_steps=...) or ScheduleCallback(..., total_steps=...). "
                f"Received: max_steps={trainer.max_steps}, total_steps=None")
        self._steps = phases_of(self.phases, total)
        self.schedule, self._saved, self._start = None, None, int(trainer.global_step)
        plugin = trainer.precision_plugin
        if isinstance(plugin, PlanPrecision):
            if plugin.given_plan is not None:
                raise ValueError(
                    f"ScheduleCallback: the phases give the plan, and {type(plugin).__name__} "
                    "was given plan= as well; give the plugin no plan (put a plan in a phase "
                    "instead). Received: a plugin with plan=<PrecisionPlan>")
            if plugin.default is not None:
                raise ValueError(
                    f"ScheduleCallback: the phases give the plan, and {type(plugin).__name__} "
                    f"was given default={str(plugin.default)!r}, which would not be used; give "
                    "the plugin no default (put it in the phase of step 0 instead). Received: "
                    f"a plugin with default={str(plugin.default)!r}")
            plugin.scheduled = True  # it applies nothing in convert_module: see on_fit_start

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        # a checkpoint saved without this callback: the phase of its step
        self._start = int(checkpoint.get("global_step", 0))

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved = dict(state_dict) if state_dict else None

    @override
    def state_dict(self) -> dict[str, Any]:
        return {} if self.schedule is None else self.schedule.state_dict()

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning has loaded a checkpoint's weights into the model as built (before this
        # callback's state) and loads the optimizer's state after this hook: the phase is
        # applied once, between the two, so neither is held narrower than it was saved
        optimizer = self._optimizer(trainer)
        saved = self._saved
        step = saved.get("step") if saved is not None else self._start
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(
                "ScheduleCallback: the checkpoint's schedule state has no int 'step' >= 0. "
                f"Received: {saved!r}")
        self.schedule = Schedule(pl_module, self._steps, optimizer, step=step)
        if saved is not None:
            self.schedule.load_state_dict(saved)  # refuses a checkpoint of other phases
        self._follow(trainer, pl_module)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        sched = self.schedule
        if sched is None:
            return
        while sched.step_count < trainer.global_step:  # optimizer steps, not batches
            if sched.step():
                self._follow(trainer, pl_module)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        plugin = trainer.precision_plugin
        if stage == "fit" and isinstance(plugin, PlanPrecision):
            plugin.scheduled = False

    @staticmethod
    def _optimizer(trainer: pl.Trainer) -> PlanOptimizer:
        optimizers = [unwrapped_optimizer(opt) for opt in trainer.optimizers]
        if len(optimizers) != 1 or not isinstance(optimizers[0], PlanOptimizer):
            kinds = [type(opt).__name__ for opt in optimizers]
            raise ValueError(
                "ScheduleCallback: configure_optimizers must return one optimizer that "
                "precision_annot.optimizer built (it follows each switch: masters, moments and "
                "their formats), such as precision_annot.optimizer(self, torch.optim.AdamW, "
                f"lr=...). Received: optimizers {kinds}")
        return optimizers[0]

    @staticmethod
    def _follow(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The plugin's batch cast, autocast and GradScaler follow the phase applied now."""
        plugin = trainer.precision_plugin
        plan = applied_plan(pl_module)
        if isinstance(plugin, PlanPrecision) and plan is not None:
            plugin.follow(plan, pl_module)
