"""`WatchCallback`: `precision_annot.watch` in a Trainer, logged through the Trainer's loggers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from precision_annot._src.watching import WatchRecord, watch

__all__ = ["WatchCallback"]


class WatchCallback(pl.Callback):
    """Watch the LightningModule's per-module numerics on every `every`-th training step, and
    log them through the Trainer's loggers (`trainer.loggers`: CSV, TensorBoard, ...): for each
    module its output's and gradient's largest magnitude and margin (the share of its dtype's
    largest value), and the closest module's margin; with the plugin's GradScaler, its scale and
    the steps it skipped. Each training batch is one watched step, and the metrics are logged
    at its index (with `accumulate_grad_batches`, micro-batches count one by one).

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

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.watch = watch(pl_module, every=self.every, scaler=scaler, path=self.path)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
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
        if self.watch is not None:
            self.watch.close()
