"""A Hugging Face ``TrainerCallback`` that adds clipopt's per-update statistics to the Trainer's logs."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ._stacked import clips_before_clipopt, warn_stacked_clip
from ._stats import StatsReader, find_clipped

__all__ = ["ClipoptTrainerCallback"]


class ClipoptTrainerCallback(TrainerCallback):
    """Add clipopt's statistics (see :data:`clipopt.integrations.STAT_KEYS`) to every training log.

    At each of the Trainer's logging steps (``logging_steps``) the statistics of
    the updates closed since the previous log are read (one host read) and
    added, under ``clipopt/``, to the ``logs`` dict and to the entry the Trainer
    just appended to ``state.log_history`` (so ``trainer_state.json`` has them).
    Callbacks that run after this one see them in ``logs``; the reporters of
    ``report_to`` are created before user callbacks, so to reach them put this
    callback first: ``trainer.callback_handler.callbacks.insert(0, ClipoptTrainerCallback())``.

    ``state.global_step`` counts ``optimizer.step()`` calls, skipped updates
    included (as the Trainer does for GradScaler overflows); ``clipopt/updates``
    counts applied updates.

    The Trainer clips before ``optimizer.step()`` whenever ``max_grad_norm > 0``, and its default is
    1.0 (TRL's ``SFTConfig`` too): clipopt would then see gradients already bounded. At the start of
    training the callback warns once (:class:`~clipopt.integrations.StackedClipWarning`) when it
    finds that setting on; pass ``max_grad_norm=0.0``.
    """

    def __init__(self) -> None:
        self._reader: StatsReader | None = None
        self._warned = False

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._reader = StatsReader(find_clipped(kwargs.get("optimizer")))
        if not self._warned and clips_before_clipopt(args.max_grad_norm):
            self._warned = True
            kind = type(args).__name__  # TrainingArguments, or a subclass such as TRL's SFTConfig
            warn_stacked_clip(f"{kind}.max_grad_norm", args.max_grad_norm, f"{kind}(max_grad_norm=0.0)")

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if self._reader is None or logs is None:
            return
        values = self._reader.read()
        if not values:
            return
        logs.update(values)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(values)
