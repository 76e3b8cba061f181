"""Per-update statistics as flat ``{"clipopt/<name>": float}`` dicts for a framework's logger."""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from .._diagnostics.stats import StepStats, materialize
from .._optimizer import ClippedOptimizer

__all__ = ["STAT_KEYS", "StatsReader", "find_clipped"]

#: What :meth:`StatsReader.read` returns (``skipped_<reason>`` only for reasons that occurred,
#: ``loss`` only when the latest update recorded one).
STAT_KEYS = (
    "grad_norm",  # pre-clip total norm of the latest update
    "grad_norm_max",  # the largest pre-clip norm among the updates since the previous read
    "clip_coef",  # the latest norm-clipping coefficient
    "clipped",  # fraction of the updates since the previous read that clipping changed
    "skipped",  # how many of them were skipped
    "skipped_<reason>",  # ... for each reason (a name of clipopt._reasons.REASONS: "nonfinite", ...)
    "updates",  # updates applied since the start (opt.num_updates)
    "skipped_total",  # updates skipped since the start (opt.num_skipped)
    "loss",  # the latest update's loss (opt.step(loss=...)), when recorded
)


def find_clipped(optimizer: Any) -> ClippedOptimizer:
    """The :class:`ClippedOptimizer` inside ``optimizer`` (Accelerate's or Lightning's wrappers unwrapped)."""
    seen = optimizer
    for _ in range(8):
        if isinstance(seen, ClippedOptimizer):
            return seen
        inner = getattr(seen, "optimizer", None) or getattr(seen, "_optimizer", None)
        if inner is None or inner is seen:
            break
        seen = inner
    raise TypeError(
        f"expected a ClippedOptimizer (possibly wrapped by Accelerate or Lightning), got "
        f"{type(optimizer).__name__}; build the optimizer as ClippedOptimizer(torch.optim.AdamW(...), ...)"
    )


def _float(value: Any) -> float:
    return float(value.item()) if isinstance(value, Tensor) else float(value)


class StatsReader:
    """Reads the statistics of the updates closed since its previous :meth:`read`.

    Reading happens on the host, only when :meth:`read` is called (once per
    logging step): recording stays free of host-device synchronisation.

    Args:
        optimizer: a :class:`ClippedOptimizer`, or a framework's wrapper around one.
        prefix: put before every key (default ``"clipopt/"``).
    """

    def __init__(self, optimizer: Optimizer | Any, prefix: str = "clipopt/") -> None:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}; pass e.g. prefix='clipopt/'")
        self.optimizer = find_clipped(optimizer)
        self.prefix = prefix
        self._seen = self.optimizer.num_windows

    def pending(self) -> int:
        """Updates (applied or skipped) closed since the previous read; reads nothing from the device."""
        return self.optimizer.num_windows - self._seen

    def read(self) -> dict[str, float]:
        """The statistics since the previous read (see :data:`STAT_KEYS`); ``{}`` when no update closed."""
        opt = self.optimizer
        if opt.num_windows < self._seen:  # the optimizer was reloaded from an earlier checkpoint
            self._seen = 0
        new = [s for s in opt.stats if s.step > self._seen]
        self._seen = opt.num_windows
        if not new:
            return {}
        return {self.prefix + k: v for k, v in summarize(new, opt).items()}


def _largest(norms: list[float]) -> float:
    """The largest norm; a non-finite one (nan, inf) when there is one: it is the news."""
    bad = [v for v in norms if not math.isfinite(v)]
    return bad[0] if bad else max(norms)


def summarize(windows: list[StepStats], opt: ClippedOptimizer) -> dict[str, float]:
    """One dict for the updates ``windows`` (oldest first, at least one)."""
    materialize(windows)  # one host read for all of them
    latest = windows[-1]
    out = {
        "grad_norm": latest.total_norm,
        "grad_norm_max": _largest([s.total_norm for s in windows]),
        "clip_coef": latest.clip_coef,
        "clipped": sum(s.clipped for s in windows) / len(windows),
        "skipped": float(sum(s.skipped for s in windows)),
    }
    for s in windows:
        reason = s.reason
        if reason is not None:
            out[f"skipped_{reason}"] = out.get(f"skipped_{reason}", 0.0) + 1.0
    out["updates"] = float(opt.num_updates)
    out["skipped_total"] = float(opt.num_skipped)
    loss = getattr(latest, "loss", None)  # StepStats.loss: recorded by opt.step(loss=...)
    if loss is not None:
        value = _float(loss)
        if not math.isnan(value) or latest.skipped:  # nan without a skip: no loss was given
            out["loss"] = value
    return out
