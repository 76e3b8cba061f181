"""``SpikeGuard``: skip an update whose loss or gradient norm is a z-score outlier.

For each signal (the window's loss, its pre-clip gradient norm) the guard
keeps the values of the previous ``window`` *applied* updates in a ring buffer
on the device.  A window whose value is more than ``z_thresh`` standard
deviations above the mean of that history is a spike; the optimizer skips it
with reason ``"spike"`` (as if it never happened) and its values never enter
the history, nor do those of any other skipped window.  The decision is a 0/1
tensor computed on the device: deciding reads nothing back to the host.

Prior art: OLMo-core's ``SkipStepOptimizer`` (6 sigma over the previous 128
steps).  Differences, on purpose: the default history is 32 updates, not 128
(#34: in clipopt's stability benchmark, docs/which-tool.md, a history of 128
updates still held the loss's early descent 120 updates into a run, whose
spread hid a label-shuffled shard that lifted the loss from 2.3 to 3.9; 32
updates skipped it, at no cost across the learning-rate sweep); the score is one-sided (a loss or norm far
*below* its history is not a spike), skipped updates do not enter the history,
and a non-finite value is neither scored nor recorded (non-finite gradients
are ``skip_nonfinite``'s, reason ``"nonfinite"``); a missing loss (``nan``,
``step()`` called without ``loss=``) leaves the loss signal out.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from numbers import Integral, Real
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from .._caller import user_stacklevel
from .._checks import check_int_at_least, check_names, check_positive_float
from .._part import Part, Window, outcome_flag
from .._reasons import SPIKE
from .spike_stats import push_history, spike_scores

__all__ = ["SIGNALS", "GuardPart", "SpikeGuard"]

#: The signals a guard can watch, in the order they are stored.
SIGNALS = ("loss", "grad_norm")


def _check_warmup(value: Any, window: int) -> int:
    if value is None:
        return min(window, max(20, window // 2))  # OLMo-core's default
    if not isinstance(value, Integral) or isinstance(value, bool):
        raise TypeError(
            f"warmup must be an int or None, got {value!r} ({type(value).__name__}); "
            f"pass e.g. warmup={min(window, 20)}, or warmup=None for max(20, window // 2)"
        )
    if not 2 <= int(value) <= window:
        raise ValueError(
            f"warmup must be between 2 and window={window}, got {value!r}; "
            f"pass e.g. warmup={min(window, 20)}, or warmup=None for max(20, window // 2)"
        )
    return int(value)


class SpikeGuard:
    """Skip an update whose loss or pre-clip gradient norm is an outlier (reason ``"spike"``).

    ``z = (value - mean) / (std + eps)`` against the mean and sample standard
    deviation of the previous ``window`` applied updates' values; the window is
    a spike when ``z > z_thresh`` for any watched signal that has at least
    ``warmup`` values of history.

    Args:
        z_thresh: how many standard deviations above the mean make a spike.
        window: how many applied updates the history holds (>= 2; 32 by default, see above).
        signals: ``"loss"`` (the window's loss, from ``step(loss=...)`` or the
            closure) and/or ``"grad_norm"`` (the pre-clip total norm).
        warmup: values of history a signal needs before it is scored
            (2 ... ``window``; None: ``max(20, window // 2)``, at most ``window``).
        eps: added to the standard deviation (a constant history scores finitely).
    """

    def __init__(
        self,
        z_thresh: float = 6.0,
        window: int = 32,
        signals: Sequence[str] = SIGNALS,
        warmup: int | None = None,
        eps: float = 1e-8,
    ) -> None:
        self.z_thresh = check_positive_float("z_thresh", z_thresh, "6.0")
        self.window = check_int_at_least("window", window, 2, 32)
        named = check_names("signals", signals, SIGNALS, "('grad_norm',)")
        self.signals = tuple(s for s in SIGNALS if s in named)  # in the order they are stored
        self.warmup = _check_warmup(warmup, self.window)
        if not isinstance(eps, Real) or isinstance(eps, bool):
            raise TypeError(
                f"eps must be a positive finite float, got {eps!r} ({type(eps).__name__}); pass e.g. eps=1e-8"
            )
        if not (float(eps) > 0 and math.isfinite(eps)):
            raise ValueError(f"eps must be a positive finite float, got {eps!r}; pass e.g. eps=1e-8")
        self.eps: float = float(eps)
        # replaced, never written into: an optimizer undoing a failed step puts the old tensors back
        self._buffer: Tensor = torch.zeros((len(self.signals), self.window), dtype=torch.float64)
        self._count: Tensor = torch.zeros(len(self.signals), dtype=torch.int64)
        self._values: Tensor | None = None  # the latest window's values, until commit()
        #: The latest window's z-scores (one per signal; 0 where not scored), or None.
        self.last_z: Tensor | None = None
        self._loss_seen: bool = False  # a window with a loss was decided, or the no-loss warning was given

    def _to(self, device: torch.device) -> None:
        if self._buffer.device != device:
            self._buffer = self._buffer.to(device)
            self._count = self._count.to(device)

    def values(self, loss: Tensor | float | None, grad_norm: Tensor) -> Tensor:
        """The watched signals of one window as a float64 vector on ``grad_norm``'s device.

        ``loss`` None (not given) becomes ``nan``: the loss signal sits that window out.
        """
        device = grad_norm.device
        out = []
        for name in self.signals:
            if name == "grad_norm":
                out.append(grad_norm.detach().reshape(()).to(torch.float64))
            elif isinstance(loss, Tensor):
                out.append(loss.detach().reshape(()).to(device, torch.float64))
            else:
                v = math.nan if loss is None else float(loss)
                out.append(torch.full((), v, dtype=torch.float64, device=device))  # a fill: no host copy
        return torch.stack(out)

    def decide(self, loss: Tensor | float | None, grad_norm: Tensor) -> Tensor:
        """1.0 when this window is a spike, else 0.0 (float32, 0-d, on the device; no host read).

        Remembers the window's values for :meth:`commit`; the history is unchanged.
        """
        self._to(grad_norm.device)
        self._check_loss_given(loss)
        values = self.values(loss, grad_norm)
        z, scored = spike_scores(values, self._buffer, self._count, self.warmup, self.eps)
        self._values = values
        self.last_z = z
        return (scored & (z > self.z_thresh)).any().to(torch.float32)

    def _check_loss_given(self, loss: Tensor | float | None) -> None:
        """Warn once when the guard watches the loss and a window comes without one before any had one."""
        if loss is not None or "loss" not in self.signals:
            self._loss_seen = self._loss_seen or loss is not None
            return
        if not self._loss_seen:
            self._loss_seen = True  # once
            alone = " and this guard skips nothing" if self.signals == ("loss",) else ""
            warnings.warn(
                f"SpikeGuard watches the loss (signals={self.signals!r}) but step() was called without "
                f"loss=: the loss signal sits out such windows{alone}; pass opt.step(loss=loss), "
                "or signals=('grad_norm',) to watch the gradient norm only",
                UserWarning,
                stacklevel=user_stacklevel(),
            )

    def is_spike(self, loss: Tensor | float | None, grad_norm: Tensor) -> Tensor:
        """Like :meth:`decide`, but remembers nothing (for diagnostics)."""
        self._to(grad_norm.device)
        z, scored = spike_scores(
            self.values(loss, grad_norm), self._buffer, self._count, self.warmup, self.eps
        )
        return (scored & (z > self.z_thresh)).any().to(torch.float32)

    def commit(self, skipped: Tensor | bool) -> None:
        """Add the latest decided window's values to the history unless the window was ``skipped``.

        ``skipped`` is the window's final decision (any reason), a bool or a 0/1
        tensor; a tensor is not read.  Without a pending :meth:`decide`, nothing happens.
        """
        if self._values is None:
            return
        skip = torch.as_tensor(skipped, device=self._buffer.device)
        accept = skip.reshape(()) == 0
        self._buffer, self._count = push_history(self._buffer, self._count, self._values, accept)
        self._values = None

    @property
    def history(self) -> dict[str, list[float]]:
        """Each signal's history, oldest first (reads the device: for inspection and tests)."""
        count = self._count.tolist()
        buffer = self._buffer.tolist()
        out = {}
        for i, name in enumerate(self.signals):
            n = min(count[i], self.window)
            start = count[i] % self.window if count[i] > self.window else 0
            row = buffer[i]
            out[name] = [row[(start + k) % self.window] for k in range(n)]
        return out

    def state_dict(self) -> dict[str, Any]:
        """The history: ``signals``, ``window``, ``buffer`` and ``count`` (cloned on their device:
        taking it reads nothing back to the host)."""
        return {
            "signals": list(self.signals),
            "window": self.window,
            "buffer": self._buffer.detach().clone(),
            "count": self._count.detach().clone(),
        }

    def load_state_dict(self, state: Any) -> None:
        """Load a state from :meth:`state_dict`; everything is checked before anything changes."""
        expect = f"a SpikeGuard with window={self.window} and signals={self.signals!r}"
        if not isinstance(state, dict):
            raise ValueError(
                f"invalid SpikeGuard state: expected a dict, got {type(state).__name__}; "
                f"pass the state saved by {expect}"
            )
        buffer, count = state.get("buffer"), state.get("count")
        signals = state.get("signals")
        shape = (len(self.signals), self.window)
        if (
            signals is None
            or tuple(signals) != self.signals
            or state.get("window") != self.window
            or not isinstance(buffer, Tensor)
            or tuple(buffer.shape) != shape
            or not buffer.is_floating_point()
            or not isinstance(count, Tensor)
            or tuple(count.shape) != shape[:1]
            or count.is_floating_point()
            or count.is_complex()
            or bool((count < 0).any())
        ):
            raise ValueError(
                f"invalid SpikeGuard state: expected signals {list(self.signals)}, window {self.window}, "
                f"a float buffer of shape {shape} and non-negative integer counts of shape {shape[:1]}; "
                f"pass the state saved by {expect}"
            )
        device = self._buffer.device
        self._buffer = buffer.detach().to(device, torch.float64, copy=True)
        self._count = count.detach().to(device, torch.int64, copy=True)
        self._values = None
        self.last_z = None

    def settings(self) -> dict[str, object]:
        """What data-parallel ranks must share (:mod:`clipopt._distributed.agreement`): ranks that
        score the same values differently would skip different windows."""
        return {
            "spike_guard.z_thresh": self.z_thresh,
            "spike_guard.window": self.window,
            "spike_guard.warmup": self.warmup,
            "spike_guard.signals": self.signals,
            "spike_guard.eps": self.eps,
        }

    def __repr__(self) -> str:
        return (
            f"SpikeGuard(z_thresh={self.z_thresh:g}, window={self.window}, signals={self.signals!r}, "
            f"warmup={self.warmup})"
        )


class GuardPart(Part):
    """A :class:`SpikeGuard` as a part of the wrapper (``spike_guard=``): a skip source (reason
    ``"spike"``) scoring the window's loss -- as the ranks agree it -- and pre-clip norm in stage 5,
    its history committed once the outcome stands, its state in the checkpoint and in each Rewind
    copy.  (A part of its own: ``SpikeGuard.commit`` keeps its public signature.)"""

    keyword = "spike_guard"
    example = "SpikeGuard(z_thresh=6.0, window=32)"
    code = SPIKE
    held = True

    def __init__(self, guard: SpikeGuard) -> None:
        self.guard = guard

    @classmethod
    def build(cls, value: Any, inner: Optimizer) -> GuardPart | None:
        return None if cls.checked(value, SpikeGuard) is None else cls(value)

    def value(self) -> SpikeGuard:
        return self.guard

    def settings(self) -> dict[str, object]:
        return self.guard.settings()

    def describe(self) -> str:
        return f"{self.keyword}={self.guard!r}"

    def agrees_loss(self) -> bool:
        return "loss" in self.guard.signals

    @staticmethod
    def _loss(w: Window, d: Any) -> Tensor | float | None:
        """The loss scored: the ranks' agreed one when there is one, else the window's own."""
        return w.agreed_loss if w.agreed_loss is not None else d.loss

    def is_spike(self, w: Window, d: Any) -> Tensor:
        return self.guard.is_spike(self._loss(w, d), d.total_norm)

    def flag(self, w: Window, d: Any) -> Tensor:
        return self.guard.decide(self._loss(w, d), d.total_norm)

    def commit(self, w: Window, d: Any, skipped: bool | Tensor) -> None:
        """The window's values enter the history unless it was skipped (no host read)."""
        self.guard.commit(outcome_flag(skipped, d.total_norm.device))

    def state_dict(self) -> dict[str, Any]:
        return self.guard.state_dict()

    def check_state(self, saved: Any, inner: Optimizer) -> Any:
        """``ValueError`` (touching the guard not at all) unless it could load ``saved``."""
        probe = SpikeGuard(window=self.guard.window, signals=self.guard.signals, warmup=2)
        probe.load_state_dict(saved)
        return saved

    def load_state(self, checked: Any) -> None:
        self.guard.load_state_dict(checked)
