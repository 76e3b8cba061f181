"""``per_update``: LR schedulers that advance only on applied updates."""

from __future__ import annotations

from typing import Any

from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from ._optimizer import ClippedOptimizer

__all__ = ["PerUpdateScheduler", "per_update"]


class PerUpdateScheduler(LRScheduler):
    """A scheduler proxy whose :meth:`step` advances only after an applied update.

    ``step()`` may be called after every micro-batch: it advances the wrapped
    scheduler once if at least one update was applied since the previous call,
    and does nothing otherwise (micro-batch calls, skipped updates).  Deciding
    reads the applied-update counter, which may wait for the device.

    It is an instance of ``torch.optim.lr_scheduler.LRScheduler`` (and of
    ``ReduceLROnPlateau`` when it wraps one), so training frameworks that check
    the scheduler's type (Lightning, Accelerate, Hugging Face Trainer) accept it;
    everything is delegated to the wrapped scheduler, whose own ``__init__`` has
    already set the learning rates (this proxy's base ``__init__`` is not run).

    Attributes:
        scheduler: the wrapped scheduler.
        optimizer: the :class:`ClippedOptimizer` whose applied updates it counts (the
            wrapped scheduler's own optimizer may be one of its inner optimizers).
    """

    def __init__(self, scheduler: Any, clipped: ClippedOptimizer | None = None) -> None:
        # LRScheduler.__init__ is deliberately not called
        if not hasattr(scheduler, "step"):
            raise TypeError(
                f"scheduler must be an LR scheduler with a step() method, got "
                f"{type(scheduler).__name__}; pass e.g. per_update(StepLR(opt, step_size=10))"
            )
        if isinstance(scheduler, PerUpdateScheduler):
            raise TypeError("scheduler is already a per_update(...) scheduler; wrap the plain scheduler once")
        optimizer = _counting_optimizer(scheduler, clipped)
        self.scheduler = scheduler
        self.optimizer = optimizer
        self._clipped = optimizer
        self._step_count = 1  # Accelerate's AcceleratedScheduler adjusts it; torch's own start
        self._seen = optimizer.num_updates
        self._seen_windows = optimizer.num_windows

    def step(self, *args: Any, **kwargs: Any) -> bool:  # type: ignore[override]
        """Advance the scheduler if an update was applied since the last call.

        Arguments (e.g. ``ReduceLROnPlateau``'s metric) are passed through.
        Returns whether the scheduler advanced.  Calls inside an open window
        read nothing from the device; after a window closed, reading the
        update count may wait for it (fused skips are decided there).
        """
        windows = self._clipped.num_windows  # a host int: micro-batch calls read nothing
        if windows == self._seen_windows:
            return False
        self._seen_windows = windows
        applied = self._clipped.num_updates
        if applied == self._seen:
            return False
        self._seen = applied
        self.scheduler.step(*args, **kwargs)
        return True

    def get_last_lr(self) -> list[float]:  # type: ignore[override]
        """The wrapped scheduler's ``get_last_lr()``."""
        return list(self.scheduler.get_last_lr())

    def get_lr(self) -> list[float]:  # type: ignore[override]
        """The wrapped scheduler's ``get_lr()`` (its learning rates for the current epoch)."""
        return list(self.scheduler.get_lr())

    @property
    def last_epoch(self) -> int:  # type: ignore[override]
        """How many times the wrapped scheduler has advanced (its ``last_epoch``)."""
        return int(self.scheduler.last_epoch)

    @property
    def base_lrs(self) -> list[float]:  # type: ignore[override]
        """The wrapped scheduler's initial learning rates."""
        if hasattr(self.scheduler, "base_lrs"):
            return list(self.scheduler.base_lrs)
        return [g["initial_lr"] for g in self.scheduler.optimizer.param_groups]

    @property
    def _last_lr(self) -> list[float]:  # type: ignore[override]  # read by LRScheduler's own helpers (e.g. print_lr)
        return self.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped scheduler's state dict plus the update count last seen."""
        return {"scheduler": self.scheduler.state_dict(), "seen_updates": self._seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned."""
        if not isinstance(state_dict, dict) or "scheduler" not in state_dict:
            raise ValueError(
                "invalid state_dict for per_update: expected keys 'scheduler' and "
                "'seen_updates'; pass the dict returned by per_update(...).state_dict()"
            )
        self.scheduler.load_state_dict(state_dict["scheduler"])
        self._seen = int(state_dict["seen_updates"])
        self._seen_windows = -1  # re-check the update count at the next step()

    def __repr__(self) -> str:
        return f"per_update({self.scheduler!r})"


def _counting_optimizer(scheduler: Any, clipped: Any) -> ClippedOptimizer:
    """The :class:`ClippedOptimizer` whose applied updates ``scheduler`` advances on: its own
    optimizer, or ``clipped`` when it is built on ``clipped`` or one of ``clipped.optimizers``."""
    own = getattr(scheduler, "optimizer", None)
    name = type(scheduler).__name__
    if clipped is None:
        if not isinstance(own, ClippedOptimizer):
            raise TypeError(
                f"per_update needs a scheduler built on a ClippedOptimizer, but "
                f"{name}.optimizer is {type(own).__name__}; build the scheduler on the wrapper: "
                "per_update(StepLR(clipped_opt, ...)), or, for a schedule of one of its inner optimizers, "
                "pass the wrapper too: per_update(StepLR(clipped_opt.optimizers[i], ...), clipped_opt)"
            )
        return own
    if not isinstance(clipped, ClippedOptimizer):
        raise TypeError(
            f"per_update's optimizer must be a ClippedOptimizer, got {type(clipped).__name__}; pass "
            "the wrapper whose applied updates count: per_update(scheduler, clipped_opt)"
        )
    if own is not clipped and not any(own is o for o in clipped.optimizers):
        inner = ", ".join(type(o).__name__ for o in clipped.optimizers)
        raise ValueError(
            f"{name}.optimizer ({type(own).__name__}) is neither this ClippedOptimizer nor one of its "
            f"inner optimizers ({inner}); pass the ClippedOptimizer that wraps it"
        )
    return clipped


class PerUpdatePlateauScheduler(PerUpdateScheduler, ReduceLROnPlateau):  # type: ignore[misc]
    """:class:`PerUpdateScheduler` around a ``ReduceLROnPlateau``: frameworks see a plateau scheduler.

    Lightning then asks for a ``monitor`` and passes the metric to ``step``;
    Hugging Face Trainer steps it after evaluation with the metric.
    """

    def __getattr__(self, name: str) -> Any:
        # ReduceLROnPlateau's public settings (mode, patience, best, ...) read from the wrapped one
        wrapped = self.__dict__.get("scheduler")
        if name.startswith("_") or wrapped is None:
            raise AttributeError(name)
        return getattr(wrapped, name)


def per_update(scheduler: Any, optimizer: ClippedOptimizer | None = None) -> PerUpdateScheduler:
    """Return a scheduler whose ``step()`` advances only after applied updates.

    ``scheduler`` must be built on a :class:`ClippedOptimizer`, or on one of the inner
    optimizers of ``optimizer`` (a wrapper over several, each with its own schedule:
    ``per_update(CosineAnnealingLR(opt.optimizers[0], ...), opt)``)::

        opt = ClippedOptimizer(torch.optim.AdamW(model.parameters()), accumulation_steps=4)
        sched = clipopt.per_update(torch.optim.lr_scheduler.StepLR(opt, step_size=100))
        for x, y in loader:
            loss_fn(model(x), y).backward()
            opt.step()
            sched.step()      # advances once per applied update
            opt.zero_grad()

    The result is a ``torch.optim.lr_scheduler.LRScheduler`` (a
    ``ReduceLROnPlateau`` for one), so Lightning, Accelerate and Hugging Face
    Trainer accept it as their scheduler.
    """
    if isinstance(scheduler, ReduceLROnPlateau):
        return PerUpdatePlateauScheduler(scheduler, optimizer)
    return PerUpdateScheduler(scheduler, optimizer)
