"""`WatchCallback`: `precision_annot.watch` in a Trainer, logged through the Trainer's loggers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from precision_annot._src.watching import WatchRecord, watch

__all__ = ["WatchCallback"]

#: the LightningModule methods a compiled module runs compiled, which a sampled step runs eager
_COMPILED_METHODS = ("forward", "training_step")


class WatchCallback(pl.Callback):
    """Watch the LightningModule's per-module numerics on every `every`-th training step, and
    log them through the Trainer's loggers (`trainer.loggers`: CSV, TensorBoard, ...): for each
    module its output's and gradient's largest magnitude and margin (the share of its dtype's
    largest value), and the closest module's margin; with the plugin's GradScaler, its scale and
    the steps it skipped. Each training batch is one watched step, and the metrics are logged
    at its index (with `accumulate_grad_batches`, micro-batches count one by one).

    A fit resumed from a checkpoint goes on counting from the checkpoint's batch (the count
    is saved in the checkpoint), so records keep their step numbers and the same batches are
    sampled. A compiled LightningModule (`trainer.fit(torch.compile(model))`) runs its sampled
    batches eager (compiled code runs no module hook) and the others compiled.

    Args:
        every: measure one training step in this many. (Default: 100)
        path: also append each sampled step to this JSON-lines file (`precision-annot
            watch-report` reads it). (Default: None)
        prefix: the metrics' prefix. (Default: "precision")

    Attributes:
        watch: the `precision_annot.watch` of the running fit (its `history` holds every
            record).

    Example:
        >>> trainer = Trainer(plugins=[AnnotatedPrecision(default="16-mixed")],  # doctest: +SKIP
        ...                   callbacks=[WatchCallback(every=100)])
    """

    def __init__(self, every: int = 100, *, path: str | Path | None = None,
                 prefix: str = "precision") -> None:
        self.every = every
        self.path = path
        self.prefix = prefix
        self.watch: watch | None = None
        self._start = 0  # the batches a resumed fit took before (from the checkpoint)
        # the compiled methods a sampled batch set aside, and the eager ones it runs
        self._compiled: dict[str, tuple[Any, Any]] = {}

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.watch = watch(pl_module, every=self.every, scaler=scaler, path=self.path,
                           start=self._start)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        if self.watch is not None and self.watch.sampling:
            self._run_eager(pl_module)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self._restore_compiled(pl_module)
        if self.watch is None:
            return
        record: WatchRecord | None = self.watch.step()
        if record is None:
            return
        metrics = self.watch.history[-1].metrics(self.prefix)  # the reduced one, if any
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=record.step)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close(pl_module)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self._close(pl_module)  # no hooks left on the model, the file closed

    @property
    @override
    def state_key(self) -> str:
        # two WatchCallbacks in one Trainer keep their counts apart in the checkpoint
        return self._generate_state_key(every=self.every, path=str(self.path),
                                        prefix=self.prefix)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"step": self.watch.index if self.watch is not None else self._start}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._start = int(state_dict.get("step", 0))

    def _close(self, pl_module: pl.LightningModule) -> None:
        self._restore_compiled(pl_module)
        if self.watch is not None:
            self._start = self.watch.index
            self.watch.close()

    def _run_eager(self, pl_module: pl.LightningModule) -> None:
        """Set the compiled methods of a module Lightning compiled aside for one batch.

        NOTE: Lightning keeps the uncompiled methods of a compiled LightningModule in
        `_compiler_ctx` (its `from_compiled`/`to_uncompiled` swap them the same way)."""
        ctx = getattr(pl_module, "_compiler_ctx", None)
        if not ctx:
            return
        for name in _COMPILED_METHODS:
            compiled, eager = pl_module.__dict__.get(name), ctx.get(f"original_{name}")
            if compiled is not None and eager is not None:
                self._compiled[name] = (compiled, eager)
                setattr(pl_module, name, eager)

    def _restore_compiled(self, pl_module: pl.LightningModule) -> None:
        """Put back the compiled methods `_run_eager` set aside, where they are still its."""
        for name, (compiled, eager) in self._compiled.items():
            if pl_module.__dict__.get(name) is eager:
                setattr(pl_module, name, compiled)
        self._compiled.clear()
