"""Exceptions raised by clipopt."""

from __future__ import annotations

from typing import Any

__all__ = ["NonFiniteGradientError"]


class NonFiniteGradientError(RuntimeError):
    """Raised after ``max_consecutive_nonfinite`` skipped updates in a row.

    Attributes:
        count: the number of consecutive non-finite updates.
        step: the window index of the latest one.
        snapshot: path of the latest anomaly snapshot, or None when none was saved.
    """

    def __init__(self, count: int, step: int, snapshot: str | None = None) -> None:
        self.count = count
        self.step = step
        self.snapshot = snapshot
        msg = (
            f"{count} consecutive updates had non-finite gradients (latest at step {step}); "
            "training is diverging: lower the learning rate, check the data, or use a loss scaler"
        )
        if snapshot is not None:
            msg += f"; latest anomaly snapshot: {snapshot}"
        super().__init__(msg)

    def __reduce__(
        self,
    ) -> tuple[type[NonFiniteGradientError], tuple[int, int, str | None], dict[str, Any]]:
        """Pickled by its fields (the default passes the message alone, which ``__init__`` refuses), so
        the error travels between processes (a ``multiprocessing`` pool, a ``ProcessPoolExecutor``); its
        ``__dict__`` travels too, as by default (notes from ``add_note()``, attributes set on it)."""
        return type(self), (self.count, self.step, self.snapshot), dict(self.__dict__)


# Shown where users meet it (tracebacks, reprs, the API reference) under the name they import.
NonFiniteGradientError.__module__ = "clipopt"
