"""The wrapper's running state and the close of its windows (docs/design.md, 'Order of operations').

:class:`Runtime` is what a :class:`~clipopt.ClippedOptimizer` runs on: the counters, the open
window's loss, the latest outcome and statistics, and the components each stage calls (the window
plan, the gradients' index, diagnostics, the replicas' decision, the parts).
The wrapper keeps the ``torch.optim`` face and hands this object values (a window's
:class:`~clipopt._window.settings.WindowSettings`, ``step()``'s closure and result); nothing here
reads the wrapper.  :meth:`Runtime.close` is the window's close: the plain close when nothing but a
norm bound is on (:mod:`clipopt._window.plain`), else stages 1-7, one call each.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.compiler import is_compiling
from torch.optim import Optimizer

from .._diagnostics.layers import LayerStats
from .._diagnostics.snapshot import DTENSOR_DIAGNOSTICS
from .._diagnostics.stats import StepStats
from .._distributed.agreement import Setting
from .._distributed.collectives import Unsynced, allreduce_mean_
from .._distributed.no_sync import check_reducible, pending_unsynced
from .._distributed.replicas import ReplicaDecision, settings_of
from .._part import Parts, Window
from .._reasons import NOGRAD
from .._state import WrapperState
from .apply import StateReadiness, apply_window
from .decision import SkipSource, WindowDecision
from .diagnose import Diagnostics, layer_names
from .grads import ParamIndex, WindowGrads
from .guard import WindowGuard
from .held import Held
from .loss import LossSum
from .plain import close_plain
from .plan import WindowPlan
from .rollback import UndoPoint, note_discarded
from .settings import WindowSettings
from .skip_run import SkipRun
from .stages import agree, check_clippable, clip_and_decide, measure, reclip

__all__ = ["UNDO_FIELDS", "Runtime"]

#: What closing a window replaces in the runtime: put back when it fails (``rollback.UndoPoint``).
UNDO_FIELDS = ("counters", "update_applied", "last_skipped", "unsynced", "last_stats", "diagnostics")


def _lr_value(lr: Any) -> float | Tensor:
    """A group's lr for the record: tensor learning rates are copied, not read (no host sync)."""
    return lr.detach().clone() if isinstance(lr, Tensor) else float(lr)


class Runtime:
    """The running state of one wrapper over ``inner`` and the close of its windows."""

    def __init__(
        self,
        inner: Optimizer,
        names: dict[Tensor, str],
        replicas: ReplicaDecision,
        diagnostics: Diagnostics,
        log: Callable[[], Any],
        stats_history: int,
    ) -> None:
        self.inner = inner  #: the inner optimizer (several: one ``InnerOptimizers``)
        self.names = names  #: the parameters' names (``param_names``)
        self.replicas = replicas  #: the data-parallel ranks' decision
        self.diagnostics = diagnostics  #: snapshots, attachments, the candidate bad row
        self.log = log  #: the wrapper (weakly), which the loggers are handed with each ``StepStats``
        self.stats: collections.deque[StepStats] = collections.deque(maxlen=stats_history)
        self.last_stats: StepStats | None = None
        self.counters = WrapperState()
        self.loss = LossSum()  # the open window's micro-batch losses
        self.update_applied: bool | None = False  # None: read last_skipped
        self.last_skipped: bool | Tensor = False
        self.readiness = StateReadiness()  # whether the fused path may skip (_window.apply)
        # the parameters in group order (_window.grads); what a window does, per settings (_window.plan)
        self.index, self.plan = ParamIndex(), WindowPlan()
        self.unsynced: Unsynced | None = None  # the latest micro-batch that skipped its sync (no_sync)
        self.window_guard = WindowGuard()  # outside clearing and stacked accumulation (_window.guard)
        self.skip_sources: list[SkipSource] = []  # skip signals after the built-in ones (_window.decision)
        self.skip_run = SkipRun()  # warns after 10 skipped windows in a row (_window.skip_run)
        self.parts = Parts((), {})  # the registry's parts (_part)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if self.unsynced is not None:  # the model and its process group do not travel; the fact does
            state["unsynced"] = self.unsynced.detached()
        return state

    def loaded(
        self, counters: WrapperState, loss: LossSum, unsynced: Unsynced | None, state_dict: Any
    ) -> None:
        """A checked state dict was loaded: its counters, open window's loss sum and pending-unsynced
        marker are taken over, and what was decided from the state before is forgotten."""
        self.counters, self.loss, self.unsynced = counters, loss, unsynced
        self.readiness.reset()
        self.plan.reset()  # the groups' options came from the checkpoint
        self.window_guard.reset()  # loaded gradients are new tensors
        self.update_applied, self.last_skipped = False, False
        self.replicas.loaded(state_dict, self.parts.rank_own())  # the next window compares the ranks' states

    def use(self, parts: Parts) -> None:
        """The parts are ``parts`` from now on (built by the constructor, or one assigned mid-run); the
        observers among them say what the diagnose stage does (``Diagnostics.configure``)."""
        self.parts = parts
        self.diagnostics.configure(parts)

    def agreed(self) -> list[Setting]:
        """What the data-parallel ranks compare: the wrapper's settings, then each part's own
        ``settings()`` record under its keyword (``_distributed.agreement``)."""
        c = self.plan.config
        parts: list[tuple[str, object]] = [("policy", c["max_norm"]), *self.parts.settings_pairs()]
        counters = (self.counters.windows, self.counters.micro_batches)
        return settings_of(c, counters, self.inner.param_groups, parts)

    def held(self) -> Held:
        """What a Rewind copy holds beside the parameters: the held parts (UpdateClip's history, the
        SpikeGuard's), the policy and the scaler (``_window.held``)."""
        c = self.plan.config
        policy = c["max_norm"] if not isinstance(c["max_norm"], (int, float, type(None))) else None
        return Held(self.parts.held(), policy, c["scaler"], self.inner)

    def params(self) -> list[Tensor]:
        """All parameters, in group order; cached until the groups change."""
        return self.index.of(self.inner.param_groups)

    def layer_names(self) -> list[str]:
        """The name of every parameter, in parameter-group order (see ``param_names``)."""
        return layer_names(self.inner.param_groups, self.names)

    # ------------------------------------------------------------------ the window's close

    def close(self, s: WindowSettings, loss: Any, closure: Callable[[], Any] | None) -> Any:
        """Close the window; an error before the inner step returned leaves the runtime as it was.

        An error raised once the gradients were changed in place (unscaled,
        value-clipped, scaled, or by the inner step itself) cannot give them back:
        the state is still restored, but the window's gradients are discarded
        and its micro-batches not counted (never applied twice, or divided
        twice).  Once the inner step has run, the window stands: an error while
        recording or logging it, or :class:`NonFiniteGradientError`, comes after
        an update that cannot be taken back, and the window is counted.
        """
        n = self.counters.micro_batches
        if closure is None and self.is_plain(s):
            return self.close_plain(s, n, loss)
        fields = {name: getattr(self, name) for name in UNDO_FIELDS}
        fields["counters"] = self.counters.copy()  # changed in place: copies
        fields["diagnostics"] = dataclasses.replace(self.diagnostics)
        undo, parts_undo = UndoPoint(self, fields, s.policy, self.stats), self.parts.undo_state()
        try:
            return self._finish(s, loss, closure, undo)
        except BaseException as exc:
            if not undo.committed:
                undo.restore()
                Parts.restore_undo(parts_undo)
                if undo.touched:
                    self.discard_window(exc)
            raise

    def discard_window(self, exc: BaseException) -> None:
        """Drop the open window whose gradients a failed close already changed; say so on ``exc``."""
        self.window_guard.reset()
        for p in self.params():
            p.grad = None
        self.counters.micro_batches = 0
        self.loss = LossSum()
        self.diagnostics.attached.clear()
        note_discarded(exc)

    def is_plain(self, s: WindowSettings) -> bool:
        """Whether this window closes as a plain one (:mod:`clipopt._window.plain`): its settings
        need a norm bound at most, and none of the wrapper's other features is on."""
        off = not self.skip_sources and self.diagnostics.writer is None and self.unsynced is None
        # no part, or none acts at this window (layer_stats=k: not due); no call in the common case
        plain = s.plain and (not self.parts.active or self.parts.plain(self.counters.windows + 1))
        return plain and off and not (self.index.has_dtensor or self.replicas.active or is_compiling())

    def close_plain(self, s: WindowSettings, n: int, loss: Any) -> Any:
        """Close a plain window (:mod:`clipopt._window.plain`): the stages of :meth:`_finish` for a
        norm bound alone."""
        params = self.params()
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return self.close_empty(s, n, loss)
        fused = s.fused and self.readiness.ready(self.inner, params)
        window_loss = self.loss.combined(s.config["reduction"])
        d, skipped = close_plain(self.inner, s, grads, params, window_loss, fused, self.discard_window)
        self.next_window()
        self.window_guard.reset()
        applied = not skipped if isinstance(skipped, bool) else None  # None: read last_skipped
        self.last_skipped, self.update_applied = skipped, applied
        self.counters.record(skipped, d.counted_nonfinite(skipped, s.skip_enabled))
        if self.diagnostics.bad_row is not None:  # (no row in a plain window)
            self.diagnostics.bad_row = None
        self.record(d, n, None)
        self.check_recorded(s, fused)
        return loss

    def _finish(
        self, s: WindowSettings, loss: Any, closure: Callable[[], Any] | None, undo: UndoPoint
    ) -> Any:
        """Stages 1-7 of docs/design.md, 'Order of operations': combine, measure, diagnose, clip,
        decide, apply, record (a due Rewind check and the parts' ``begin`` first, not again when a
        part reran the window)."""
        n, params = self.counters.micro_batches, self.params()
        group, active = self.replicas.process_group, self.replicas.active
        w = Window(self.counters.windows + 1, n, params, self.inner, s, closure, group, replicated=active)
        w.shared = self.parts.shared  # (Part.shares)
        if self.parts.take_copies:  # what a Rewind copy holds: built only when a part takes copies
            w.held = self.held()
        if not undo.touched and self.parts and (reason := self.parts.begin(w)) is not None:
            undo.committed = True  # (touched: a part's rerun) a Rewind restored a copy, or a part said so
            return self.close_discarded(s, n, loss, reason, w)
        g = self._combine(s, params, undo)
        if g is None:
            undo.committed = True
            return self.close_empty(s, n, loss, w=w)
        scaler = s.config["scaler"]
        try:
            with torch.no_grad():
                d = self._measure(s, g, n, w)
                layers = self._diagnose(s, d, params, w)
                undo.touched |= s.clips_in_place
                sources = [*self.skip_sources, *self.parts.flags(w)] if self.parts else self.skip_sources
                clip_and_decide(s, d, g, self.inner.param_groups, sources)
            if self.parts and (outs := self.parts.rerun(w, d, undo.restore)) is not None:  # (Part.rerun)
                return self._finish(s, self._decided_again(outs, undo), closure, undo)
            undo.touched = True  # scaling and the inner step change the gradients
            self.next_window()
            loss, fused = self._apply(s, d, g, (loss, closure), w)
            undo.committed = True
            for part in self.parts.active:
                part.commit(w, d, self.last_skipped)
            self.parts.closed(self.counters.windows)
        finally:  # also after an error: an unscaled scaler without update() would refuse every later window
            self.window_guard.reset()
            if scaler is not None:
                scaler.update()
        self.record(d, n, layers, w)
        self.check_recorded(s, fused)
        return loss

    def _decided_again(self, outs: list[Any], undo: UndoPoint) -> Any:
        """A part executed the window again (``outs``: its closures' values, the last one returned)
        and what deciding changed was put back (``undo.restore``: the counters had not moved): the
        loss is the new one, the window is decided again (the undo point keeps its copy of the
        counters; ``touched``: the gradients are not the first execution's)."""
        undo.touched, self.counters, self.loss = True, self.counters.copy(), LossSum.of(outs)
        return outs[-1]

    def next_window(self) -> None:
        """The window's micro-batches and loss are taken: the next window starts empty."""
        self.counters.micro_batches = 0
        self.counters.windows += 1
        self.loss.clear()

    def sync_unsynced(self) -> None:
        """Before closing a window whose latest micro-batch skipped its sync: do that sync now."""
        marker = pending_unsynced(self.unsynced, self.counters.micro_batches)
        if marker is not None:
            check_reducible(marker)
            allreduce_mean_([p for p in self.params() if p.requires_grad], marker.group)
        self.unsynced = None

    def _combine(self, s: WindowSettings, params: list[Tensor], undo: UndoPoint) -> WindowGrads | None:
        """Stage 1 (combine): the window's gradients, synchronised (``no_sync``) and unscaled
        (``scaler``); None when no parameter has one.  Raises before anything changed when they
        cannot be used."""
        if self.index.has_dtensor and self.diagnostics.writer is not None:
            raise ValueError(DTENSOR_DIAGNOSTICS)
        if self.unsynced is not None:  # a no_sync() marker is pending
            self.sync_unsynced()
        groups = self.inner.param_groups
        g = WindowGrads.of(params, groups, self.index, self.inner, split=s.plan is not None)
        check_clippable(s, g)  # before anything is measured, saved or clamped
        if not g.grads:
            return None
        if (scaler := s.config["scaler"]) is not None:
            undo.touched = True
            scaler.unscale_(self.inner)
        return g

    def _measure(self, s: WindowSettings, g: WindowGrads, n: int, w: Window) -> WindowDecision:
        """Stage 2 (measure): the decision's norms and flag (agreed by DDP replicas), the window's loss."""
        loss = self.loss.combined(s.config["reduction"])  # kept in the sum until the close commits
        rows = self.diagnostics.rows and g.shards is None  # the candidate bad row: plain tensors only
        window = self.counters.windows + 1
        if self.replicas.active:  # the ranks' check (data parallelism only)
            self.replicas.prepare(self.params(), s.norm_group, self.agreed(), g.shards, n, window)
        d, self.diagnostics.bad_row = measure(s, g, self.layer_names() if rows else None)
        watch, sharded = bool(self.parts) and self.parts.agrees_loss(), self.index.has_dtensor
        d, w.agreed_loss = agree(self.replicas, d, n, window, loss, watch_loss=watch, sharded=sharded)
        d.loss = loss  # before the decision: SpikeGuard scores it
        return d

    def _diagnose(
        self, s: WindowSettings, d: WindowDecision, params: list[Tensor], w: Window
    ) -> LayerStats | None:
        """Stage 3 (diagnose): the parts' own diagnoses, then per-layer statistics when due and an
        anomaly snapshot of a non-finite or spiking window (:class:`~clipopt._window.diagnose.Diagnostics`);
        all see the pre-clip gradients."""
        for part in self.parts.active:
            part.diagnose(w, d)
        if not self.diagnostics.on:  # neither per-layer statistics nor snapshots
            return None
        return self.diagnostics.diagnose(
            s,
            d,
            params,
            self.layer_names,
            window=(w.number, w.micro_batches),
            sharded=self.index.has_dtensor,
            spike=lambda: self.parts.is_spike(w, d),
            saved=(self.inner, self.counters, s.config["scaler"]),
        )

    def _apply(
        self, s: WindowSettings, d: WindowDecision, g: WindowGrads, call: tuple[Any, Any], w: Window
    ) -> tuple[Any, bool]:
        """Stage 6 (apply): the inner step or the skip (see :mod:`clipopt._window.apply`; with a Rewind,
        through its lr_cut; in the parts' contexts), then the counters; returns ``step()``'s result
        and whether the fused (host-read-free) path ran."""
        run = partial(apply_window, self.inner, s, d, g, call, self.reclip, self.readiness)
        if self.parts and self.parts.host_step(w):
            run = partial(run, host=True)
        with self.parts.step_context(w) if self.parts else nullcontext():
            for part in self.parts.active:
                part.before_step(w, d)
            out, skipped, fused = run()
        for part in self.parts.active:
            skipped = part.after_step(w, d, skipped)
        self.last_skipped = skipped
        self.update_applied = not skipped if isinstance(skipped, bool) else None  # None: read last_skipped
        self.counters.record(skipped, d.counted_nonfinite(skipped, s.skip_enabled))
        return out, fused

    def reclip(self, max_norm: float | Tensor | None) -> tuple[Tensor, list[Tensor]]:
        """A closure's re-evaluation: measured and clipped with the window's bound ``max_norm``."""
        s, params = self.plan.settings(1, self.inner), self.params()
        g = WindowGrads.of(params, self.inner.param_groups, self.index, self.inner, split=s.plan is not None)
        return reclip(s, g, self.inner.param_groups, max_norm)

    def close_discarded(self, s: WindowSettings, n: int, loss: Any, reason: int, w: Window) -> Any:
        """A window discarded before it was measured: a Rewind restored an earlier copy (the window was
        computed on the abandoned state), or a part's :meth:`~clipopt._part.Part.begin` said so; it is
        recorded as skipped with ``reason``."""
        self.readiness.reset()  # the inner state may hold new tensors
        self.window_guard.reset()
        self.diagnostics.attached.clear()
        return self.close_empty(s, n, loss, reason, w)

    def close_empty(
        self, s: WindowSettings, n: int, loss: Any, reason: int = NOGRAD, w: Window | None = None
    ) -> Any:
        """A window in which no parameter has a gradient: nothing to apply, so the inner step is not
        called; it is recorded as skipped with reason ``"nograd"`` (not a non-finite skip).
        ``reason=REWIND``: a window a rewind discarded (its gradients are gone)."""
        params = self.params()
        for p in params:
            p.grad = None
        d = WindowDecision.empty(params[0].device if params else None, s.max_norm, reason)
        d.loss = self.loss.combined(s.config["reduction"])
        self.next_window()
        self.last_skipped, self.update_applied = True, False
        self.counters.record(True, False)
        self.parts.closed(self.counters.windows)
        self.record(d, n, None, w, measured=False)
        return loss

    def record(
        self,
        d: WindowDecision,
        n: int,
        layers: LayerStats | None,
        w: Window | None = None,
        measured: bool = True,
    ) -> StepStats:
        """Stage 7 (record): the window's :class:`StepStats` (with the parts' cells; ``measured``: not
        an empty or discarded window), its history, the loggers, then the parts that read it."""
        cells: dict[str, Any] = {}
        if w is not None:
            self.parts.record(w, measured)
            cells = dict(w.cells)
        stats = StepStats(
            step=self.counters.windows,
            micro_batches=n,
            decision=d,
            skipped=self.last_skipped,
            lr=[_lr_value(g["lr"]) for g in self.inner.param_groups],
            layers=layers,
            bad_row=self.diagnostics.bad_row,
            recovery=cells,
        )
        self.last_stats = stats
        self.stats.append(stats)
        if self.parts.reporting:  # the loggers (Part.report): I/O failures warn; the window is complete
            self.parts.report(stats, self.log())
        self.diagnostics.attached.clear()
        self.skip_run.follow(stats)  # after the loggers, which may have read it
        for part in self.parts.active:
            part.logged(stats)
        return stats

    def check_recorded(self, s: WindowSettings, fused: bool) -> None:
        """The checks that may raise once a measured window is recorded: replicas out of step
        (``fused``: whether the host-read-free path ran) and ``max_consecutive_nonfinite``."""
        if self.replicas.active:  # may warn (divergence) or raise (out of step)
            self.replicas.end_window(host_read=not fused)
        if (limit := s.config["max_consecutive_nonfinite"]) is not None:  # reads one counter
            self.counters.check_consecutive(limit, self.diagnostics.last_nonfinite_snapshot)
