"""A Lightning ``Callback`` that logs clipopt's per-update statistics through Lightning's loggers."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from .._optimizer import ClippedOptimizer
from ._stacked import clips_before_clipopt, warn_stacked_clip
from ._stats import StatsReader

__all__ = ["ClipoptLightningCallback"]


class ClipoptLightningCallback(Callback):
    """Log clipopt's statistics (:data:`~clipopt.integrations.STAT_KEYS`) with ``LightningModule.log_dict``.

    At every step where Lightning writes to its loggers (``log_every_n_steps``)
    the statistics of the updates closed since the previous write are read
    (one host read) and logged on step, under ``clipopt/`` (``clipopt<i>/``
    for the *i*-th of several clipped optimizers).  ``clipopt/updates`` counts
    applied updates; Lightning's ``global_step`` counts ``optimizer.step()``
    calls, skipped updates included (and micro-batches when the wrapper
    accumulates: use Lightning's ``accumulate_grad_batches`` with
    ``accumulation_steps=1`` instead).

    Lightning clips before ``optimizer.step()`` when ``Trainer(gradient_clip_val=...)`` is above 0
    (automatic optimization): clipopt would then see gradients already bounded. At the start of
    training the callback warns once (:class:`~clipopt.integrations.StackedClipWarning`) when it
    finds that setting on; leave ``gradient_clip_val=None``.

    Args:
        prog_bar: also show the values in the progress bar.
    """

    def __init__(self, prog_bar: bool = False) -> None:
        if not isinstance(prog_bar, bool):
            raise TypeError(f"prog_bar must be a bool, got {prog_bar!r}; pass prog_bar=True or False")
        self.prog_bar = prog_bar
        self._readers: list[StatsReader] = []
        self._warned = False

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        clipped = [opt for opt in trainer.optimizers if isinstance(opt, ClippedOptimizer)]
        self._readers = [
            StatsReader(opt, prefix="clipopt/" if len(clipped) == 1 else f"clipopt{i}/")
            for i, opt in enumerate(clipped)
        ]
        value = trainer.gradient_clip_val
        if clipped and pl_module.automatic_optimization and not self._warned and clips_before_clipopt(value):
            self._warned = True
            warn_stacked_clip("Trainer.gradient_clip_val", value, "Trainer(gradient_clip_val=None)")

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not any(r.pending() for r in self._readers):
            return
        connector = getattr(trainer, "_logger_connector", None)
        due = getattr(connector, "should_update_logs", True) or bool(getattr(trainer, "fast_dev_run", False))
        if not due:
            return
        values: dict[str, float] = {}
        for reader in self._readers:
            values.update(reader.read())
        pl_module.log_dict(values, on_step=True, on_epoch=False, prog_bar=self.prog_bar, logger=True)
