"""The optimizer's spike recovery: its :class:`SpikeGuard` and :class:`Rewind`, as one part.

:class:`SpikeRecovery` is what :class:`~clipopt.ClippedOptimizer` talks to:

* :meth:`SpikeRecovery.signal`: the guard's spike flag for a window's skip
  decision (on the device);
* :meth:`SpikeRecovery.commit`: once the window is decided, its values enter
  the guard's history unless it was skipped, and the Rewind sees its flags
  (and counts an applied update against an active lr_cut);
* :meth:`SpikeRecovery.check`: at the start of a window's close, every
  ``check_every`` windows: the Rewind reads its flags (one host read), takes a
  copy or rewinds; a rewound window is discarded (reason ``"rewind"``);
* the ``"spike_guard"`` and ``"rewind"`` entries of the state dict.

Options are checked by :func:`check_recovery` before the optimizer exists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from .._reasons import SPIKE
from .._window.decision import WindowDecision
from .lr_cut import cut_applied
from .rewind import Rewind, RewindEvent
from .spike_guard import SpikeGuard

__all__ = ["SpikeRecovery", "WrapperParts", "check_recovery"]

#: The wrapper's parts whose state a Rewind copy holds beside the guard's: its policy (None: a float
#: bound), its GradScaler and the parts that a copy holds (``_part.Held``).
WrapperParts = tuple[Any, Any, Any]

#: What stage 6 returns (``apply_window``): ``step()``'s result, the outcome, whether fused.
_Applied = tuple[Any, bool | Tensor, bool]


def check_recovery(spike_guard: Any, rewind: Any, policy: Any) -> None:
    """``spike_guard``/``rewind`` must be a SpikeGuard/Rewind or None; a Rewind needs spike skips
    (a guard, or a ``policy`` that skips spikes: ``ZClip(skip_spikes=True)``)."""
    spikes_skipped_by_policy = bool(getattr(policy, "skip_spikes", False))
    if spike_guard is not None and not isinstance(spike_guard, SpikeGuard):
        raise TypeError(
            f"spike_guard must be a SpikeGuard or None, got {type(spike_guard).__name__}; "
            "pass e.g. spike_guard=SpikeGuard(z_thresh=6.0, window=128)"
        )
    if rewind is not None and not isinstance(rewind, Rewind):
        raise TypeError(
            f"rewind must be a Rewind or None, got {type(rewind).__name__}; "
            "pass e.g. rewind=Rewind(every=100, keep=2, spikes=3, within=50)"
        )
    if rewind is not None and spike_guard is None and not spikes_skipped_by_policy:
        raise ValueError(
            "rewind=Rewind(...) rewinds after spike skips, but nothing skips spikes here; "
            "pass spike_guard=SpikeGuard() (or max_norm=ZClip(skip_spikes=True))"
        )


class SpikeRecovery:
    """A guard and/or a rewind attached to one optimizer.

    With a guard it is one of the optimizer's skip sources (``_window.decision.SkipSource``):
    :attr:`code` and :meth:`flag`.
    """

    #: The reason recorded when the guard skips a window.
    code = SPIKE

    def __init__(self, guard: SpikeGuard | None, rewind: Rewind | None) -> None:
        self.guard = guard  #: the SpikeGuard, or None
        self.rewind = rewind  #: the Rewind, or None
        #: This window's loss as agreed by the data-parallel ranks (set by the optimizer), or None.
        self.shared_loss: Tensor | None = None
        self._window: tuple[float | None, bool] = (None, False)  # this window's lr factor, rewound

    @classmethod
    def attach(
        cls, guard: SpikeGuard | None, rewind: Rewind | None, params: list[Tensor], optimizer: Optimizer
    ) -> SpikeRecovery:
        """The recovery of a new optimizer; binds the Rewind to its parameters (DTensors: their shards)."""
        if rewind is not None:
            rewind.bind(params, optimizer)
        return cls(guard, rewind)

    def watches_loss(self) -> bool:
        """Whether the guard scores the loss (under data parallelism the ranks then agree on it)."""
        return self.guard is not None and "loss" in self.guard.signals

    def flag(self, d: WindowDecision) -> Tensor | None:
        """The skip source's flag: :meth:`signal` with the ranks' agreed loss when there is one."""
        return self.signal(d, self.shared_loss)

    def signal(self, d: WindowDecision, agreed_loss: Tensor | None = None) -> Tensor | None:
        """The guard's 0/1 spike flag for the window, or None without a guard.

        The loss is ``agreed_loss`` (data parallelism: the largest over the
        ranks, the same on each) or else the window's own ``d.loss``.
        """
        if self.guard is None:
            return None
        loss = agreed_loss if agreed_loss is not None else d.loss
        return self.guard.decide(loss, d.total_norm)

    def is_spike(self, d: WindowDecision, agreed_loss: Tensor | None = None) -> Tensor | None:
        """The guard's spike rule for the window, remembering nothing (for snapshots), or None."""
        if self.guard is None:
            return None
        return self.guard.is_spike(agreed_loss if agreed_loss is not None else d.loss, d.total_norm)

    def commit(self, d: WindowDecision, step: int, skipped: bool | Tensor) -> None:
        """The decided window ``step`` (``skipped``: its outcome, a bool or a 0/1 device flag): its
        values enter the history unless skipped; the Rewind sees its flags.  No host read, but on a
        window with an active lr_cut: its final outcome (an update put back after the step is not
        applied: reason ``"nonfinite_update"``) counts against the cut."""
        device = d.total_norm.device
        if isinstance(skipped, Tensor):
            skip = skipped.to(device, torch.float32)
        else:  # decided on the host: a fill on the device, no host-to-device copy
            skip = torch.full((), float(skipped), dtype=torch.float32, device=device)
        if self.guard is not None:
            self.guard.commit(skip)
        if self.rewind is not None and self._window[0] is not None:  # a cut: applied updates count
            self.rewind.lr_counted(bool(skipped))  # read on a cut window only (put back: a device flag)
        if self.rewind is not None:
            if isinstance(d.reason, Tensor):
                spike = (d.reason == SPIKE).to(torch.float32)
            else:  # decided on the host
                spike = torch.full((), float(d.reason == SPIKE), dtype=torch.float32, device=device)
            self.rewind.observe(step, spike * (skip > 0), 1.0 - skip)
        self.closed(step)

    def closed(self, windows: int) -> None:
        """Window ``windows`` has closed (applied, skipped or empty): when the next close starts with a
        :meth:`check`, the Rewind copies the module's buffers now, as they are at this close."""
        if self.rewind is not None and self.due(windows):
            self.rewind.stage_buffers(windows)

    def due(self, closed: int) -> bool:
        """Whether the close of the next window starts with a :meth:`check` (``closed`` windows so far)."""
        return self.rewind is not None and closed > 0 and closed % self.rewind.check_every == 0

    def check(
        self, closed: int, params: list[Tensor], optimizer: Optimizer, wrapper: WrapperParts
    ) -> tuple[RewindEvent, Any] | None:
        """The Rewind's check after ``closed`` windows: a copy or a rewind (then the event and the
        restored wrapper state, which :meth:`restore_wrapper` loads).  A copy holds the ``wrapper``'s
        policy, update-clip history, guard and scaler state beside the parameters and the inner state."""
        if self.rewind is None:
            return None
        self.rewind.bind(params, optimizer)  # parameter groups may have been added since
        hit = self.rewind.check(closed, lambda: self.wrapper_state(wrapper))
        if hit is None:
            return None
        # the check runs in the close of window closed + 1, the one discarded (StepStats, CSV: "rewind")
        event = dataclasses.replace(hit[0], step=closed + 1)
        self.rewind.log[-1] = event
        self._window = (None, True)
        return event, hit[1]

    def apply(self, inner: Optimizer, run: Callable[..., _Applied]) -> _Applied:
        """Stage 6 through ``run(host=...)`` (``apply_window``), with the Rewind's learning-rate cut
        when one is active: every group of ``inner`` gets its lr multiplied by the factor around the
        inner step only (:func:`~clipopt._recovery.lr_cut.cut_applied`), on the host path, so that
        the outcome is read there; :meth:`commit` counts it once it is final."""
        factor = None if self.rewind is None else self.rewind.lr_factor()
        self._window = (factor, False)
        if factor is None:
            return run()
        with cut_applied(factor, inner.param_groups):
            return run(host=True)

    def record(self) -> dict[str, float | None]:
        """The closed window's cells for the log (``StepStats.recovery``); ``{}`` without a Rewind."""
        factor, rewound = self._window
        self._window = (None, False)
        return {} if self.rewind is None else self.rewind.window_record(factor, rewound)

    def wrapper_state(self, wrapper: WrapperParts) -> dict[str, Any]:
        """The wrapper state a Rewind copy holds: policy, SpikeGuard, scaler and the held parts'
        states by keyword (``_part.Held``: the history of ``UpdateClip(z=...)``, device tensors)."""
        policy, scaler, held = wrapper
        return {
            "policy": None if policy is None else policy.state_dict(),
            "spike_guard": None if self.guard is None else self.guard.state_dict(),
            "scaler": None if scaler is None else scaler.state_dict(),
            **held.state(),
        }

    def restore_wrapper(self, restored: dict[str, Any], wrapper: WrapperParts) -> None:
        """Load the wrapper state of the copy a rewind went back to (see :meth:`wrapper_state`); a copy
        without a held part's state (or one it cannot load: an ``UpdateClip`` of another window
        was assigned since) leaves that part as it is."""
        policy, scaler, held = wrapper
        if restored.get("policy") is not None and policy is not None:
            policy.load_state_dict(restored["policy"])
        if restored.get("spike_guard") is not None and self.guard is not None:
            self.guard.load_state_dict(restored["spike_guard"])
        if restored.get("scaler") is not None and scaler is not None:
            scaler.load_state_dict(restored["scaler"])
        held.restore(restored)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """``{"spike_guard": ..., "rewind": ...}``, each only when that part is on: a wrapper
        without them writes the same ``"clipopt"`` entry as before they existed."""
        out: dict[str, Any] = {}
        if self.guard is not None:
            out["spike_guard"] = self.guard.state_dict()
        if self.rewind is not None:
            out["rewind"] = self.rewind.state_dict()
        return out

    def validate(
        self, entry: dict[str, Any], check_wrapper: Callable[[Any], None] | None = None
    ) -> tuple[Any, Any]:
        """Check the saved parts (``ValueError``, changing nothing); returns what :meth:`load` takes.

        A part saved without one here (or missing from an older state dict) is ignored.
        ``check_wrapper``: checks the rest of each Rewind copy's wrapper state (policy, scaler).
        """
        guard_state, rewind_state = entry.get("spike_guard"), entry.get("rewind")
        guard_ok = None
        if self.guard is not None and guard_state is not None:
            self._check_guard_state(guard_state)
            guard_ok = guard_state
        rewind_ok = None
        if self.rewind is not None and rewind_state is not None:
            parsed = self.rewind.validate_state(rewind_state, lambda e: self._check_copied(e, check_wrapper))
            rewind_ok = (rewind_state, parsed)
        return guard_ok, rewind_ok

    def _check_guard_state(self, guard_state: Any) -> None:
        """``ValueError`` (touching nothing of ours) unless this guard could load ``guard_state``."""
        if self.guard is not None:
            probe = SpikeGuard(window=self.guard.window, signals=self.guard.signals, warmup=2)
            probe.load_state_dict(guard_state)

    def _check_copied(self, extra: Any, check_wrapper: Callable[[Any], None] | None) -> None:
        """A Rewind copy's wrapper state must be loadable (it is, at a rewind): the guard's part here,
        the rest by ``check_wrapper``."""
        guard_state = extra.get("spike_guard") if isinstance(extra, dict) else None
        if guard_state is not None:
            self._check_guard_state(guard_state)
        if check_wrapper is not None:
            check_wrapper(extra)

    def load(self, checked: tuple[Any, Any]) -> None:
        guard_state, rewind_state = checked
        if self.guard is not None and guard_state is not None:
            self.guard.load_state_dict(guard_state)
        if self.rewind is not None and rewind_state is not None:
            self.rewind.load_state_dict(*rewind_state)
