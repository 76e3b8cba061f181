"""``ClippedOptimizer``: clipping, accumulation and skipping around any ``torch.optim`` optimizer.

The class is the orchestration: ``step()`` gathers micro-batches and the last
one closes the window in the stages of docs/design.md, 'Order of operations'
(:meth:`ClippedOptimizer._finish_window`), each stage a call into the module that
owns it (see ARCHITECTURE.md).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.compiler import is_compiling
from torch.optim import Optimizer

from ._checkpoint import add_entry_slot, entry_at_top, read_checkpoint, with_entry, wrapper_entry
from ._config import (
    ASSIGNABLE,
    ASSIGNED_WITH,
    DTENSOR_DIAGNOSTICS,
    KEYWORDS,
    REGISTRY,
    check_assignment,
    check_closure,
    configure,
    describe,
)
from ._diagnostics.layers import LayerStats
from ._diagnostics.loggers import Logger, log_window
from ._diagnostics.snapshot import SnapshotWriter
from ._diagnostics.stats import StepStats
from ._distributed.collectives import Unsynced, allreduce_mean_
from ._distributed.no_sync import (
    check_checkpointable,
    check_no_sync_args,
    check_reducible,
    pending_unsynced,
    plan_no_sync,
)
from ._distributed.replicas import ReplicaDecision, settings_of
from ._hooks import step_hooked
from ._part import Parts, Window
from ._policies.builtin import ClipPolicy
from ._reasons import NOGRAD, REWIND
from ._recovery.part import SpikeRecovery, WrapperParts, check_recovery
from ._recovery.rewind import Rewind
from ._recovery.spike_guard import SpikeGuard
from ._state import WrapperState
from ._window.apply import StateReadiness, apply_window
from ._window.decision import SkipSource, WindowDecision
from ._window.diagnose import Diagnostics, layer_names
from ._window.grads import ParamIndex, WindowGrads
from ._window.guard import WindowGuard
from ._window.loss import LossSum, check_loss, loss_of_closure
from ._window.plain import close_plain
from ._window.plan import PLANNED, WindowPlan
from ._window.rollback import UndoPoint, note_discarded
from ._window.settings import WindowSettings
from ._window.skip_run import SkipRun
from ._window.stages import agree, check_clippable, clip_and_decide, measure, reclip
from ._window.update_apply import check_update_options, start_update
from ._window.update_clip import UpdateClip
from ._window.update_copy import UpdateCopy
from ._wrapping import STORED, InnerOptimizerView

__all__ = ["ClippedOptimizer"]

#: What closing a window replaces in the wrapper: put back when it fails (see ``_window.rollback.UndoPoint``).
_UNDO_FIELDS = ("_counters", "_update_applied", "_last_skipped", "_unsynced", "last_stats", "_diagnostics")


def _lr_value(lr: Any) -> float | Tensor:
    """A group's lr for the record: tensor learning rates are copied, not read (no host sync)."""
    return lr.detach().clone() if isinstance(lr, Tensor) else float(lr)


class ClippedOptimizer(InnerOptimizerView):
    r"""Wrap ``optimizer`` to clip, accumulate and skip non-finite updates.

    Call :meth:`step` after every ``backward()``; every ``accumulation_steps``-th
    call closes a *window* in these stages (docs/design.md, 'Order of operations'):

    1. **combine** the micro-batch gradients (``reduction="mean"`` divides their
       sum by the number of micro-batches actually accumulated);
    2. **measure** the total ``norm_type``-norm of the combined gradient in
       float32 — the recorded ``total_norm``, which decides finiteness;
    3. **diagnose**: per-layer statistics and anomaly snapshots, when asked for;
    4. **clip**: clamp every element into ``[-clip_value, clip_value]`` (if set),
       then multiply by ``min(1, max_norm / (norm + 1e-6))`` (if ``max_norm`` is
       set), with ``norm`` taken after the clamp;
    5. **decide** whether to skip (non-finite, a spike, replicas that diverged);
    6. **apply**: call the inner ``step()`` — or skip: a skipped update is as if it
       never happened (parameters and inner state untouched, gradients discarded);
    7. **record** the window's :class:`StepStats`.

    ``param_groups``, ``state`` and ``defaults`` are the inner optimizer's own
    objects, so LR schedulers, ``add_param_group`` and checkpoints work as usual.
    Other public attributes the wrapper does not define are read from the inner
    optimizer (``train()``/``eval()`` of schedule-free optimizers,
    ``consolidate_state_dict()`` of ``ZeroRedundancyOptimizer``); assigning one
    on the wrapper raises (set it on :attr:`optimizer`).
    Reading :attr:`update_applied`, :attr:`step_was_skipped` or a field of
    :attr:`last_stats` may wait for the device; recording them does not.

    An error raised inside :meth:`step` or :meth:`flush` before the inner step
    has run (bad gradients, a failing policy) leaves the wrapper's counters,
    window and policy state exactly as before the call; when the gradients
    were already changed in place (unscaled, clipped, or by the inner step
    raising), they are discarded with the window's micro-batches.
    Loggers and snapshots never interrupt training for I/O errors: they warn
    once per cause.  A window in which no parameter has a gradient is not
    applied (``update_applied`` False); it is recorded as skipped with reason
    ``"nograd"``.  Complex parameters are measured and clipped by norm like
    ``clip_grad_norm_`` does (the norm of ``|g|``); ``clip_value`` refuses them.

    Like torch's optimizers, a ``ClippedOptimizer`` is not thread-safe: call
    :meth:`step` from one thread at a time (concurrent calls miscount windows).

    The options a loop needs day to day are the first six (``Args``); the others
    (``Other Parameters``) come in groups: how the norm is taken, non-finite
    updates, what is recorded, several processes, the window's checks, and
    recovery beyond clipping.

    Args:
        optimizer: any ``torch.optim.Optimizer`` (also third-party subclasses), or a list of
            optimizers over disjoint parameters (``[Muon(matrices), AdamW(others)]``): one decision
            for all (one norm, coefficient and skip); :attr:`optimizers` lists them, and
            ``param_groups`` is their groups in order (docs/concepts.md, "Several inner optimizers").
        max_norm: global norm bound (a float), None to turn norm clipping off, or a
            :class:`ClipPolicy` that sets the bound on the device at every window: a
            threshold on the total norm (:class:`AutoClip`, :class:`ZClip`), unit-wise
            (:class:`AGC`), or per gradient tensor (:class:`AdaGC`, :class:`StableSPAM`)
            (docs/choosing-max-norm.md).  A parameter group of the inner
            optimizer with its own ``"max_norm"`` key (a float, or None to leave
            it out of norm clipping) is clipped by its own norm instead; the
            groups without the key share this bound (per-group clipping).
        accumulation_steps: micro-batches per optimizer update (1 under a framework
            that accumulates itself: docs/integrations.md).
        clip_value: element-wise bound applied before the norm bound, or None;
            a group's own ``"clip_value"`` key replaces it for that group.
        scaler: a ``torch.amp.GradScaler`` whose ``scale(loss)`` you backward;
            the wrapper unscales, steps and updates it at each window's end.
        loggers: objects with ``log(stats, optimizer)`` and ``close()`` called at
            every window's end (:class:`CSVLogger`, :class:`TensorBoardLogger`).

    Other Parameters:
        norm_type: ``p > 0`` or ``float("inf")``, as in ``clip_grad_norm_``.
        reduction: ``"mean"`` or ``"sum"`` of the micro-batch gradients.
        foreach: passed to the foreach kernels (None: where supported).
        skip_nonfinite: skip (and zero) an update whose gradients are not finite.
        max_consecutive_nonfinite: raise :class:`NonFiniteGradientError` after
            this many skipped updates in a row (None: never).  Checking it reads
            one flag from the device per update.
        stats_history: how many :class:`StepStats` :attr:`stats` keeps.
        param_names: names for per-parameter output: ``model.named_parameters()``,
            a ``{name: param}`` dict or names in parameter order (default: the
            inner optimizer's ``param_names``, else ``group<g>.<i>``).
        layer_stats: per-parameter statistics (:class:`LayerStats`) every
            ``k`` windows (True: every window; False: never).  A window with
            statistics reads one flag from the device.
        snapshot_dir: folder for anomaly snapshots: on a non-finite window the
            parameters, pre-clip gradients, optimizer state, statistics and
            :meth:`attach`-ed tensors are saved (see :func:`load_snapshot`);
            with a ``scaler`` such a window has reason ``"overflow"`` and the
            snapshot holds the loss scale (:func:`clipopt.replay` tells an
            overflow of the scale from a genuine fault).
            Deciding reads one flag from the device per update.
        max_snapshots: at most this many snapshots are written per run and reason
            (non-finite, overflow, spike), so spikes never crowd out a later non-finite one.
        norm_group: a process group whose ranks hold *different* parameters
            (pipeline stages): the partial norms are combined over it (one scalar
            collective per norm), so every stage clips and skips alike.
        replica_group: the ranks holding replicas of these parameters (DDP):
            ``"auto"`` (the default group when ``torch.distributed`` is
            initialised with more than one rank), a process group, or None
            (decisions stay rank-local: ranks training independent models).
            Costs one scalar collective per window with plain-tensor parameters
            (none added for DTensor ones) and one settings check at the first
            ``step()``; see docs/distributed.md.
        backward_passes_per_step: backward passes expected per :meth:`step` call
            while accumulating (``accumulation_steps > 1``).  More is reported as
            an accumulation stacked on the wrapper's (``RuntimeError``); raise it
            when a micro-batch legitimately runs several (two losses backwarded
            separately).  Gradients of an open window cleared or replaced from
            outside (``model.zero_grad()``) raise ``RuntimeError`` as well.
        spike_guard: a :class:`SpikeGuard`: skip (reason ``"spike"``) a window whose
            loss or pre-clip norm is a z-score outlier against the previous applied
            updates; decided on the device (docs/spike-recovery.md).
        rewind: a :class:`Rewind`: copies of the training state in host memory, restored
            after repeated spike skips (reason ``"rewind"``); ``opt.rewind.batches(loader)``
            drops the batches that follow a rewind (docs/spike-recovery.md).
        update_clip: an :class:`UpdateClip`: bound the update the inner step made
            (``p_after - p_before``, after the learning rate: ``max_rms`` per tensor, ``max_norm``
            over all, or ``z`` adaptive), on the device; costs a copy of the parameters per window
            (docs/update-clipping.md).
        update_stats: record ``StepStats.update_norm`` without bounding the update (the same copy).
            With either, a non-finite update from finite gradients is not applied: the parameters
            are put back (the inner state too with ``UpdateClip(..., restore_state=True)``) and
            the window is skipped with reason ``"nonfinite_update"``.
        **parts: the parts beyond these, each by its keyword and checked by its own class (docs/api.md,
            'Parts'); ``opt.<keyword>`` reads one back (None when off), and assigning it mid-run is
            checked as the constructor checks it.
    """

    _policy: ClipPolicy | None
    _bound: float | None
    _planned = PLANNED | {"update_clip", "update_stats"}  # assigning one: _settings_changed

    def __init__(
        self,
        optimizer: Optimizer | Sequence[Optimizer],
        max_norm: float | ClipPolicy | None = 1.0,
        norm_type: float = 2.0,
        clip_value: float | None = None,
        accumulation_steps: int = 1,
        reduction: str = "mean",
        skip_nonfinite: bool = True,
        max_consecutive_nonfinite: int | None = None,
        *,
        scaler: torch.amp.GradScaler | None = None,
        stats_history: int = 1024,
        foreach: bool | None = None,
        param_names: Any = None,
        layer_stats: bool | int = False,
        loggers: Sequence[Logger] = (),
        snapshot_dir: str | os.PathLike[str] | None = None,
        max_snapshots: int = 10,
        norm_group: Any = None,
        replica_group: Any = "auto",
        backward_passes_per_step: int = 1,
        spike_guard: SpikeGuard | None = None,
        rewind: Rewind | None = None,
        update_clip: UpdateClip | None = None,
        update_stats: bool = False,
        **parts: Any,
    ) -> None:
        options = {name: value for name, value in locals().items() if name not in ("self", "parts")}
        cfg = configure(optimizer, ClippedOptimizer, options)  # raises before any state exists
        check_recovery(spike_guard, rewind, cfg.policy)
        self.update_clip, self.update_stats = check_update_options(update_clip, update_stats, cfg.inner)
        self._policy, self._bound = cfg.policy, cfg.bound  # what the max_norm property returns
        self.norm_type, self.clip_value = cfg.norm_type, cfg.clip_value
        self.accumulation_steps, self.reduction = cfg.accumulation_steps, cfg.reduction
        self.skip_nonfinite = cfg.skip_nonfinite
        self.max_consecutive_nonfinite = cfg.max_consecutive_nonfinite
        self.stats_history, self.layer_stats, self.loggers = cfg.stats_history, cfg.layer_stats, cfg.loggers
        self.max_snapshots, self.norm_group = cfg.max_snapshots, cfg.norm_group
        self._replicas = ReplicaDecision(cfg.replica_group)
        self.backward_passes_per_step = cfg.backward_passes_per_step
        self._names = cfg.names
        # the optimizer, or an _inner.InnerOptimizers over several; with a slot for the entry (_checkpoint)
        self._inner = add_entry_slot(cfg.inner)
        self.scaler, self.foreach = scaler, foreach
        self._init_hooks()
        self._init_state(snapshot_dir)
        self._recovery = SpikeRecovery.attach(spike_guard, rewind, self._params(), self._inner)
        self._parts = Parts.build(REGISTRY, parts, self._inner)  # every other part, by its keyword (_parts)
        if spike_guard is not None:
            self._skip_sources.append(self._recovery)  # reason "spike"
        self._forwarding = True  # the inner optimizer's public attributes: read, not hidden (_wrapping)

    def _init_state(self, snapshot_dir: str | os.PathLike[str] | None) -> None:
        """What the wrapper records and caches while it runs (beside the configuration)."""
        self.stats: collections.deque[StepStats] = collections.deque(maxlen=self.stats_history)
        self.last_stats: StepStats | None = None
        self._counters = WrapperState()
        self._loss = LossSum()  # the open window's micro-batch losses
        self._update_applied: bool | None = False  # None: read _last_skipped
        self._last_skipped: bool | Tensor = False
        # whether the fused path may skip (_window.apply); the update's copy (_window.update_copy)
        self._readiness, self._update_copy = StateReadiness(), UpdateCopy()
        # the parameters in group order (_window.grads); what a window does, per settings (_window.plan)
        self._index, self._plan = ParamIndex(), WindowPlan()
        self._unsynced: Unsynced | None = None  # the latest micro-batch that skipped its sync, see no_sync()
        writer = None if snapshot_dir is None else SnapshotWriter(snapshot_dir, self.max_snapshots)
        self._diagnostics = Diagnostics(writer)  # snapshots, attachments, the candidate bad row
        self._window_guard = WindowGuard()  # outside clearing and stacked accumulation, see _window.guard
        self._skip_sources: list[SkipSource] = []  # skip signals after the built-in ones (_window.decision)
        self._skip_run = SkipRun()  # warns after 10 skipped windows in a row (see _window.skip_run)

    # ------------------------------------------------------------------ delegation

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the hooks and a scheduler's ``step`` wrapper (as torch does, see
        ``_wrapping.NOT_PICKLED``); mid-window also the gradients.

        Pickling a parameter does not carry its ``.grad``, so the gradients of a
        half-accumulated window travel with the wrapper.
        """
        self._check_checkpointable()
        state = super().__getstate__()
        if self._unsynced is not None:  # the model and its process group do not travel; the fact does
            state["_unsynced"] = self._unsynced.detached()
        if self._counters.micro_batches > 0:
            state["_pending_grads"] = [p.grad for p in self._params()]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        pending = state.pop("_pending_grads", None)
        super().__setstate__(state)
        if pending is not None:
            for p, g in zip(self._params(), pending, strict=True):
                p.grad = g

    def __repr__(self) -> str:
        return describe(self, self._inner)

    if not TYPE_CHECKING:  # (as InnerOptimizerView's: hidden from mypy)

        def __getattr__(self, name: str) -> Any:
            if name in KEYWORDS and "_parts" in self.__dict__:  # a part's keyword: its value, None when off
                return self._parts.value(name)
            return super().__getattr__(name)

    @property
    def max_norm(self) -> float | ClipPolicy | None:
        """The norm bound: a float, None (off), or a :class:`ClipPolicy` (:class:`AutoClip`, :class:`ZClip`,
        :class:`AGC`, :class:`AdaGC`, :class:`StableSPAM`); may be changed between windows."""
        return self._policy if self._policy is not None else self._bound

    @max_norm.setter
    def max_norm(self, value: float | ClipPolicy | None) -> None:
        self._policy, self._bound = self._assigning("max_norm", value)

    _assignable = (
        ASSIGNABLE | KEYWORDS
    )  # assigned after the constructor: checked as it checks them (_assigning)

    def _assigning(self, name: str, value: Any) -> Any:
        """A setting assigned mid-run, checked as the constructor checks it, before anything changes."""
        if name in KEYWORDS:  # a part: checked by its class, held by the parts
            self._parts = self._parts.assigned(name, value, self._inner)
            self._settings_changed()
            return STORED
        value = check_assignment(name, value, {n: getattr(self, n) for n in ASSIGNED_WITH}, self._inner)
        if name == "stats_history":  # the newest statistics that fit stay
            self.stats = collections.deque(self.stats, maxlen=value)
        if name == "max_snapshots" and self._diagnostics.writer is not None:
            self._diagnostics.writer.max_snapshots = value
        return value

    def add_param_group(self, param_group: dict[str, Any], optimizer: int | None = None) -> None:
        """Add a parameter group to the inner optimizer; its ``max_norm`` and ``clip_value``
        (docs/per-group-clipping.md) are checked first, so a bad one adds nothing."""
        if isinstance(param_group, dict):
            self._plan.check_groups(self, [*self.param_groups, param_group])
        super().add_param_group(param_group, optimizer)
        self._plan.reset()

    def _settings_changed(self) -> None:
        self._plan.reset()
        self._update_copy.keep(self.update_clip is not None or self.update_stats is not False)

    # ------------------------------------------------------------------ signals

    @property
    def micro_batches(self) -> int:
        """Micro-batches gathered in the current, still open window."""
        return self._counters.micro_batches

    @property
    def num_updates(self) -> int:
        """Updates applied so far (may wait for the device)."""
        return int(self._counters.applied)

    @property
    def num_skipped(self) -> int:
        """Windows skipped so far (may wait for the device)."""
        return int(self._counters.skipped)

    @property
    def num_windows(self) -> int:
        """Windows closed so far, applied or skipped."""
        return self._counters.windows

    @property
    def update_applied(self) -> bool:
        """True when the latest :meth:`step` call changed the parameters (may wait for the device)."""
        if self._update_applied is None:  # a window decided on the device: applied unless skipped
            return not bool(self._last_skipped)
        return self._update_applied

    @property
    def step_was_skipped(self) -> bool:
        """True when the latest closed window ended in a skip (may wait for the device)."""
        return bool(self._last_skipped)

    @property
    def last_snapshot(self) -> str | None:
        """Path of the latest anomaly snapshot written, or None; assignable (e.g. cleared once handled)."""
        return self._diagnostics.last_snapshot

    @last_snapshot.setter
    def last_snapshot(self, path: str | None) -> None:
        self._diagnostics.last_snapshot = path

    @property
    def spike_guard(self) -> SpikeGuard | None:
        """The :class:`SpikeGuard` given as ``spike_guard``, or None."""
        return self._recovery.guard

    @property
    def rewind(self) -> Rewind | None:
        """The :class:`Rewind` given as ``rewind`` (``opt.rewind.batches(loader)``), or None."""
        return self._recovery.rewind

    @property
    def rewinds(self) -> int:
        """Rewinds so far (0 without a ``rewind``)."""
        return 0 if self._recovery.rewind is None else self._recovery.rewind.rewinds

    # ------------------------------------------------------------------ step

    def step(self, closure: Callable[[], Any] | None = None, *, loss: Tensor | float | None = None) -> Any:
        """Record one micro-batch; at the window's end combine, clip, and step or skip.

        ``loss`` (a one-element tensor or a float), or else the closure's return
        value, is the micro-batch's loss: the window's losses are combined like
        the gradients (``reduction``) into ``StepStats.loss`` without a host read.

        With a ``closure`` the wrapper evaluates it (forward + backward) once per
        call; optimizers that re-evaluate it (LBFGS) get the re-evaluated
        gradients clipped the same way.  Step hooks registered on the wrapper
        (and global optimizer hooks) run around every call.
        """
        compiling = is_compiling()
        if self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks or step_hooked(compiling):
            return self._profiled_step(closure, loss=loss)
        c, k = self._counters, self.accumulation_steps
        # a plain micro-batch that leaves the window open only counts (and feeds the window guard)
        if closure is None and loss is None and c.micro_batches + 1 < k and self._replicas.checked_k == k:
            if not (compiling or self._index.has_dtensor):  # as in _step
                self._window_guard.step(c.micro_batches, k, self.backward_passes_per_step, self._params)
            c.micro_batches += 1
            if self._update_applied is not False:  # set once per window (__setattr__ is a Python call)
                self._update_applied = False
            return None
        return self._step(closure, loss=loss)

    # torch's profile_hook_step costs ~12 us per call (record_function) even with
    # no hook and no profiler; take it only when a hook or the profiler is active.
    step.hooked = True  # type: ignore[attr-defined]

    def _step(self, closure: Callable[[], Any] | None = None, *, loss: Tensor | float | None = None) -> Any:
        # no call while the settings check holds for this accumulation_steps (every plain micro-batch)
        if self._replicas.checked_k != (k := self.accumulation_steps) and self._replicas.due(k):
            self._check_replicas()
        given = None if loss is None else check_loss(loss)
        out = None
        if closure is not None:
            check_closure(closure, self.scaler)
            with torch.enable_grad():
                out = closure()
            k = self.accumulation_steps  # (as the closure left it)
        c, window_loss = self._counters, self._loss
        if k > 1 and not self._index.has_dtensor and not is_compiling():
            # host bookkeeping only (see _window.guard); FSDP2 writes .grad outside autograd
            guard, allowed = self._window_guard, self.backward_passes_per_step
            guard.step(c.micro_batches, k, allowed, self._params)
        loss_before = window_loss.total, window_loss.count  # add() replaces, never writes into, the sum
        if given is not None or out is not None:  # a plain micro-batch has no loss to add
            window_loss.add(given if given is not None else loss_of_closure(out))
        c.micro_batches += 1
        if c.micro_batches < k:
            if self._update_applied is not False:  # set once per window (__setattr__ is a Python call)
                self._update_applied = False
            return out
        try:
            return self._close_window(out, closure)
        except BaseException:
            c, window_loss = self._counters, self._loss  # (a failed close may have put back copies)
            if c.micro_batches > 0:  # rolled back: this call's micro-batch is not counted
                c.micro_batches -= 1
                window_loss.total, window_loss.count = loss_before
            raise

    _profiled_step = Optimizer.profile_hook_step(_step)

    def flush(self) -> None:
        """Apply the micro-batches gathered so far (a partial window), dividing by their count.

        A no-op when no micro-batch is pending.  Under data parallelism it is
        collective: call it on every rank (ranks with different partial windows raise).
        """
        if self._replicas.due(self.accumulation_steps):
            self._check_replicas()
        params = self._params()
        if self._replicas.active and params:
            counters = self._counters
            self._replicas.check_flush(counters.micro_batches, counters.windows + 1, params[0].device)
        if self._counters.micro_batches > 0:
            self._close_window(None, None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients, but only when no window is open.

        Calls made while micro-batches are being accumulated do nothing, so
        ``zero_grad()`` may be called after every micro-batch.
        """
        if self._counters.micro_batches == 0:
            self._inner.zero_grad(set_to_none=set_to_none)

    @contextmanager
    def no_sync(self, model: torch.nn.Module, *, sync: bool | None = None) -> Iterator[None]:
        """Skip ``model``'s gradient synchronisation unless this micro-batch closes the window.

        ::

            with opt.no_sync(model):
                loss = loss_fn(model(x), y)  # DDP decides in the forward pass: run it inside
                loss.backward()
            opt.step()

        For every micro-batch of a window but the last, the backward inside runs
        without DDP's all-reduce (``model.no_sync()``) or FSDP2's reduce-scatter
        (``set_requires_gradient_sync(False)``); gradients accumulate locally and
        the last micro-batch's backward synchronises their sum.  A plain module
        (no data parallelism) is left alone, so the same loop runs in one process.

        Args:
            model: the DDP- or FSDP2-wrapped model (or a plain module).
            sync: None decides by the window; True synchronises this backward
                (the last micro-batch of the data, before :meth:`flush`); False
                never does.

        :meth:`flush` after an unsynchronised micro-batch all-reduces the DDP
        gradients itself (a plain average over the process group, without
        DDP's communication hooks); FSDP2 cannot reduce them afterwards, so there
        it raises: pass ``sync=True`` for the last micro-batch instead.  A
        checkpoint taken mid-window holds the rank's own unsynchronised gradients
        (save one per rank); under FSDP2 it is refused while they are pending.
        """
        check_no_sync_args(model, sync)
        if self._replicas.due(self.accumulation_steps):
            self._check_replicas()
        index = self._counters.micro_batches + 1  # this micro-batch's place in the window
        context, marker = plan_no_sync(
            model, index >= self.accumulation_steps if sync is None else sync, index, self._replicas
        )
        before = self._unsynced
        if marker is not None:  # set before the body runs: an opt.step() inside may close the window
            self._unsynced = marker
        try:
            with context:
                yield
        except BaseException:
            if marker is not None:
                self._unsynced = before
            raise

    def _check_replicas(self) -> None:
        """At the first step() or no_sync() (under FSDP2 also after accumulation_steps changed): the
        ranks' settings must agree (collective)."""
        self._replicas.check_settings(self._agreed_settings(), self._params(), self._index.has_dtensor)

    def _agreed_settings(self) -> list[tuple[str, object]]:
        """What the data-parallel ranks compare: the window settings, then each part's own
        ``settings()`` record under its keyword (a new part: one more pair here)."""
        parts = (("policy", self._policy), ("spike_guard", self.spike_guard), ("rewind", self.rewind))
        return settings_of(self, (*parts, ("update_clip", self.update_clip), *self._parts.settings_pairs()))

    def _sync_unsynced(self) -> None:
        """Before closing a window whose latest micro-batch skipped its sync: do that sync now."""
        marker = pending_unsynced(self._unsynced, self._counters.micro_batches)
        if marker is not None:
            check_reducible(marker)
            allreduce_mean_([p for p in self._params() if p.requires_grad], marker.group)
        self._unsynced = None

    def _check_checkpointable(self) -> None:
        check_checkpointable(pending_unsynced(self._unsynced, self._counters.micro_batches))

    def _params(self) -> list[Tensor]:
        """All parameters, in group order; cached until the groups change."""
        return self._index.of(self.param_groups)

    # ------------------------------------------------------------------ the window's close

    def _close_window(self, loss: Any, closure: Callable[[], Any] | None) -> Any:
        """Close the window; an error before the inner step returned leaves the wrapper as it was.

        An error raised once the gradients were changed in place (unscaled,
        value-clipped, scaled, or by the inner step itself) cannot give them back:
        the wrapper is still restored, but the window's gradients are discarded
        and its micro-batches not counted (never applied twice, or divided
        twice).  Once the inner step has run, the window stands: an error while
        recording or logging it, or :class:`NonFiniteGradientError`, comes after
        an update that cannot be taken back, and the window is counted.
        """
        n = self._counters.micro_batches
        s = self._plan.settings(self, n)  # group options checked (when changed) before any change
        if closure is None and self._is_plain(s):
            return self._close_plain(s, n, loss)
        fields = {name: getattr(self, name) for name in _UNDO_FIELDS}
        fields["_counters"] = self._counters.copy()  # changed in place: copies
        fields["_diagnostics"] = dataclasses.replace(self._diagnostics)
        undo, parts_undo = UndoPoint(self, fields, self._policy, self.stats), self._parts.undo_state()
        try:
            return self._finish_window(s, loss, closure, undo)
        except BaseException as exc:
            if not undo.committed:
                undo.restore()
                Parts.restore_undo(parts_undo)
                if undo.touched:
                    self._discard_window(exc)
            raise

    def _discard_window(self, exc: BaseException) -> None:
        """Drop the open window whose gradients a failed close already changed; say so on ``exc``."""
        self._window_guard.reset()
        for p in self._params():
            p.grad = None
        self._counters.micro_batches = 0
        self._loss = LossSum()
        self._diagnostics.attached.clear()
        note_discarded(exc)

    def _is_plain(self, s: WindowSettings) -> bool:
        """Whether this window closes as a plain one (:mod:`clipopt._window.plain`): its settings
        need a norm bound at most, and none of the wrapper's other features is on."""
        r, features = self._recovery, self.loggers or self.update_stats or self._skip_sources
        off = r.guard is None and r.rewind is None and self.update_clip is None and not features
        off = off and self._diagnostics.writer is None and self._unsynced is None and not self._parts.active
        plain = s.plain or s.between_stats(self._counters.windows + 1)  # (no call in the common case)
        return plain and off and not (self._index.has_dtensor or self._replicas.active or is_compiling())

    def _close_plain(self, s: WindowSettings, n: int, loss: Any) -> Any:
        """Close a plain window (:mod:`clipopt._window.plain`): the stages of :meth:`_finish_window`
        for a norm bound alone."""
        params = self._params()
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return self._close_empty(n, loss)
        fused = s.fused and self._readiness.ready(self._inner, params)
        window_loss = self._loss.combined(self.reduction)
        d, skipped = close_plain(self._inner, s, grads, params, window_loss, fused, self._discard_window)
        self._next_window()
        self._window_guard.reset()
        applied = not skipped if isinstance(skipped, bool) else None  # None: read _last_skipped
        # the wrapper's own attributes, none of them a setting: no __setattr__ (a Python call each)
        self.__dict__.update(_last_skipped=skipped, _update_applied=applied)
        self._counters.record(skipped, d.counted_nonfinite(skipped, s.skip_enabled))
        if self._diagnostics.bad_row is not None:  # (no row in a plain window)
            self._diagnostics.bad_row = None
        self._record(d, n, None)
        self._check_recorded(fused)
        return loss

    def _finish_window(
        self, s: WindowSettings, loss: Any, closure: Callable[[], Any] | None, undo: UndoPoint
    ) -> Any:
        """Stages 1-7 of docs/design.md, 'Order of operations': combine, measure, diagnose, clip,
        decide, apply, record (a due Rewind check first)."""
        n, params = self._counters.micro_batches, self._params()
        w = self._window(s, n, params, closure)  # what the parts see
        if (reason := self._begin(w)) is not None:
            undo.committed = True  # a Rewind restored a copy, or a part discarded the window
            return self._close_discarded(n, loss, reason)
        g = self._combine(s, params, undo)
        if g is None:
            undo.committed = True
            return self._close_empty(n, loss)
        try:
            with torch.no_grad():
                d = self._measure(s, g, n)
                layers = self._diagnose(s, d, params, n, w)
                undo.touched |= s.clips_in_place
                sources = [*self._skip_sources, *self._parts.flags(w)] if self._parts else self._skip_sources
                clip_and_decide(s, d, g, self.param_groups, sources)
            undo.touched = True  # scaling and the inner step change the gradients
            self._next_window()
            loss, fused = self._apply(s, d, g, (loss, closure), w)
            undo.committed = True
            if self._recovery.guard is not None or self._recovery.rewind is not None:
                self._recovery.commit(d, self._counters.windows, self._last_skipped)
            for part in self._parts.active:
                part.commit(w, d, self._last_skipped)
        finally:  # also after an error: an unscaled scaler without update() would refuse every later window
            self._window_guard.reset()
            if self.scaler is not None:
                self.scaler.update()
        self._record(d, n, layers, w)
        self._check_recorded(fused)
        return loss

    def _begin(self, w: Window) -> int | None:
        """Before the window is combined: a due Rewind check (a copy, or back to one: reason
        ``"rewind"``), then the parts' :meth:`~clipopt._part.Part.begin`; the reason that discards
        the window, or None."""
        if self._recovery.due(self._counters.windows):
            hit = self._recovery.check(self._counters.windows, w.params, self._inner, self._wrapper_parts())
            if hit is not None:  # the training state was restored: this window is discarded
                self._recovery.restore_wrapper(hit[1], self._wrapper_parts())
                return REWIND
        return self._parts.begin(w) if self._parts else None

    def _window(
        self, s: WindowSettings, n: int, params: list[Tensor], closure: Callable[[], Any] | None
    ) -> Window:
        """What the parts see of the window being closed."""
        group = self._replicas.group if self._replicas.active else None
        number, active = self._counters.windows + 1, self._replicas.active
        return Window(number, n, params, self._inner, s, closure, group, replicated=active)

    def _next_window(self) -> None:
        """The window's micro-batches and loss are taken: the next window starts empty."""
        self._counters.micro_batches = 0
        self._counters.windows += 1
        self._loss.clear()

    def _combine(self, s: WindowSettings, params: list[Tensor], undo: UndoPoint) -> WindowGrads | None:
        """Stage 1 (combine): the window's gradients, synchronised (``no_sync``) and unscaled
        (``scaler``); None when no parameter has one.  Raises before anything changed when they
        cannot be used."""
        if self._index.has_dtensor and self._diagnostics.writer is not None:
            raise ValueError(DTENSOR_DIAGNOSTICS)
        if self._unsynced is not None:  # a no_sync() marker is pending
            self._sync_unsynced()
        g = WindowGrads.of(params, self.param_groups, self._index, self._inner, split=s.plan is not None)
        check_clippable(s, g)  # before anything is measured, saved or clamped
        if not g.grads:
            return None
        if self.scaler is not None:
            undo.touched = True
            self.scaler.unscale_(self._inner)
        return g

    def _measure(self, s: WindowSettings, g: WindowGrads, n: int) -> WindowDecision:
        """Stage 2 (measure): the decision's norms and flag (agreed by DDP replicas), the window's loss."""
        loss = self._loss.combined(self.reduction)  # kept in the sum until the close commits
        rows = s.rows and g.shards is None  # the candidate bad row: plain tensors only
        if self._replicas.active:  # the ranks' check (data parallelism only)
            self._replicas.prepare(self, self._agreed_settings(), g.shards, n, self._counters.windows + 1)
        d, self._diagnostics.bad_row = measure(s, g, self.layer_names() if rows else None)
        watch, sharded = self._recovery.watches_loss(), self._index.has_dtensor
        d, self._recovery.shared_loss = agree(
            self._replicas, d, n, self._counters.windows + 1, loss, watch_loss=watch, sharded=sharded
        )
        d.loss = loss  # before the decision: SpikeGuard scores it
        return d

    def _diagnose(
        self, s: WindowSettings, d: WindowDecision, params: list[Tensor], n: int, w: Window
    ) -> LayerStats | None:
        """Stage 3 (diagnose): per-layer statistics when due, and an anomaly snapshot of a non-finite
        or spiking window (:class:`~clipopt._window.diagnose.Diagnostics`); both see the pre-clip
        gradients; then the parts' own diagnoses."""
        for part in self._parts.active:
            part.diagnose(w, d)
        if not s.layer_stats and self._diagnostics.writer is None:  # neither is on
            return None
        return self._diagnostics.diagnose(
            s,
            d,
            params,
            self.layer_names,
            window=(self._counters.windows + 1, n),
            sharded=self._index.has_dtensor,
            spike=lambda: self._recovery.is_spike(d, self._recovery.shared_loss),
            saved=(self._inner, self._counters, self.scaler),
        )

    def _apply(
        self, s: WindowSettings, d: WindowDecision, g: WindowGrads, call: tuple[Any, Any], w: Window
    ) -> tuple[Any, bool]:
        """Stage 6 (apply): the inner step or the skip (see :mod:`clipopt._window.apply`; with a Rewind,
        through its lr_cut; in the parts' contexts), then the counters; returns ``step()``'s result
        and whether the fused (host-read-free) path ran."""
        upd = start_update(self, self._params(), self._inner, (self._update_copy, self._replicas))
        run = partial(apply_window, self._inner, s, d, g, call, self._reclip, self._readiness)
        if any(part.host_step(w) for part in self._parts.active):
            run = partial(run, host=True)
        with self._parts.step_context(w) if self._parts else nullcontext():
            for part in self._parts.active:
                part.before_step(w, d)
            out, skipped, fused = self._recovery.apply(self._inner, run) if self._recovery.rewind else run()
        skipped = skipped if upd is None else upd.finish(d, skipped)  # measured, bounded, or put back
        for part in self._parts.active:
            skipped = part.after_step(w, d, skipped)
        # assigned here, not in a helper: torch.compile loses the helper's assignment to the wrapper
        self._last_skipped = skipped
        self._update_applied = not skipped if isinstance(skipped, bool) else None  # None: read _last_skipped
        self._counters.record(skipped, d.counted_nonfinite(skipped, s.skip_enabled))
        return out, fused

    def _reclip(self, max_norm: float | Tensor | None) -> tuple[Tensor, list[Tensor]]:
        """A closure's re-evaluation: measured and clipped with the window's bound ``max_norm``."""
        s, params = self._plan.settings(self, 1), self._params()
        g = WindowGrads.of(params, self.param_groups, self._index, self._inner, split=s.plan is not None)
        return reclip(s, g, self.param_groups, max_norm)

    def _close_discarded(self, n: int, loss: Any, reason: int) -> Any:
        """A window discarded before it was measured: a Rewind restored an earlier copy (the window was
        computed on the abandoned state), or a part's :meth:`~clipopt._part.Part.begin` said so; it is
        recorded as skipped with ``reason``."""
        self._readiness.reset()  # the inner state may hold new tensors
        self._window_guard.reset()
        self._diagnostics.attached.clear()
        return self._close_empty(n, loss, reason)

    def _wrapper_parts(self) -> WrapperParts:
        """What a Rewind copy holds of the wrapper beside the guard (see ``_recovery.part``)."""
        return self._policy, self.scaler, self.update_clip

    def _close_empty(self, n: int, loss: Any, reason: int = NOGRAD) -> Any:
        """A window in which no parameter has a gradient: nothing to apply, so the inner step is not
        called; it is recorded as skipped with reason ``"nograd"`` (not a non-finite skip).
        ``reason=REWIND``: a window a rewind discarded (its gradients are gone)."""
        params = self._params()
        for p in params:
            p.grad = None
        d = WindowDecision.empty(params[0].device if params else None, self._bound, reason)
        d.loss = self._loss.combined(self.reduction)
        self._next_window()
        self._last_skipped, self._update_applied = True, False
        self._counters.record(True, False)
        self._recovery.closed(self._counters.windows)
        self._record(d, n, None)
        return loss

    def _record(
        self, d: WindowDecision, n: int, layers: LayerStats | None, w: Window | None = None
    ) -> StepStats:
        """Stage 7 (record): the window's :class:`StepStats` (with the parts' cells), its history, the
        loggers, then the parts that read it."""
        cells = {} if self._recovery.rewind is None else self._recovery.record()
        if w is not None:
            for part in self._parts.active:
                part.record(w)
            cells.update(w.cells)
        stats = StepStats(
            step=self._counters.windows,
            micro_batches=n,
            decision=d,
            skipped=self._last_skipped,
            lr=[_lr_value(g["lr"]) for g in self.param_groups],
            layers=layers,
            bad_row=self._diagnostics.bad_row,
            recovery=cells,
        )
        self.last_stats = stats
        self.stats.append(stats)
        if self.loggers:
            log_window(self.loggers, stats, self)  # I/O failures warn; the window is complete either way
        self._diagnostics.attached.clear()
        self._skip_run.follow(stats)  # after the loggers, which may have read it
        for part in self._parts.active:
            part.logged(stats)
        return stats

    def _check_recorded(self, fused: bool) -> None:
        """The checks that may raise once a measured window is recorded: replicas out of step
        (``fused``: whether the host-read-free path ran) and ``max_consecutive_nonfinite``."""
        if self._replicas.active:  # may warn (divergence) or raise (out of step)
            self._replicas.end_window(host_read=not fused)
        if self.max_consecutive_nonfinite is not None:  # reads one counter
            snapshot = self._diagnostics.last_nonfinite_snapshot
            self._counters.check_consecutive(self.max_consecutive_nonfinite, snapshot)

    # ------------------------------------------------------------------ diagnostics

    def layer_names(self) -> list[str]:
        """The name of every parameter, in parameter-group order (see ``param_names``)."""
        return layer_names(self.param_groups, self._names)

    def attach(self, **tensors: Any) -> None:
        """Register tensors (the current batch) to save if this window goes bad.

        ``opt.attach(inputs=x, targets=y)`` before ``opt.step()``; attachments are
        dropped when the window closes.  Called several times in one window, a
        name keeps a list of what it received, in order.  Only read when a
        snapshot is written (``snapshot_dir``); copies are made then.
        """
        self._diagnostics.attach(tensors)

    def close(self) -> None:
        """Close every logger (flushes buffered rows)."""
        for logger in self.loggers:
            logger.close()
        for part in self._parts.active:
            part.close()
        self._skip_run.advance()  # the windows the loggers' last rows read

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus a ``"clipopt"`` entry with the wrapper state.

        The result has the usual ``"state"`` and ``"param_groups"`` keys (a plain
        optimizer can load it; over several inner optimizers, ``"optimizers"``: a
        list of their state dicts) and only tensors, numbers, strings, lists and
        dicts, so ``torch.load(..., weights_only=True)`` reads it.  Taken
        mid-window it holds a copy of the gradients accumulated so far.  The
        same entry is also under ``"clipopt"`` in the first parameter group, so
        that savers which keep only ``"state"`` and ``"param_groups"`` (torch's
        ``get_optimizer_state_dict``, Composer, torchtitan) keep it too.
        """
        return self._hooked_state_dict(self._state_dict)

    def _state_dict(self) -> dict[str, Any]:
        self._check_checkpointable()
        entry = wrapper_entry(
            self._counters,
            self._params(),
            scaler=self.scaler,
            loss_sum=self._loss,
            policy=self._policy,
            unsynced=pending_unsynced(self._unsynced, self._counters.micro_batches),
            recovery=self._recovery,
            update_clip=self.update_clip,
            parts=self._parts,
        )
        return with_entry(self._inner.state_dict(), entry)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` or from a plain optimizer.

        Everything is validated before anything changes: a mismatched or corrupt
        state dict raises ``ValueError`` and leaves this optimizer as it was.
        """
        self._hooked_load(state_dict, self._load_state_dict)

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = entry_at_top(state_dict, self._inner)  # a saver may have kept only the group's copy
        params = self._params()
        ckpt = read_checkpoint(
            state_dict,
            params,
            accumulation_steps=self.accumulation_steps,
            inner=self._inner,
            policy=self._policy,
            scaler=self.scaler,
            recovery=self._recovery,
            norm_group=self.norm_group,
            update_clip=self.update_clip,
            parts=self._parts,
        ).with_open_window(self._counters.micro_batches > 0)  # (its gradients go, unless saved)
        self._counters = ckpt.take_over(
            self._inner,
            params,
            scaler=self.scaler,
            policy=self._policy,
            recovery=self._recovery,
            parts=self._parts,
        )
        self._readiness.reset()
        self._plan.reset()  # the groups' options came from the checkpoint
        self._window_guard.reset()  # loaded gradients are new tensors
        self._loss = ckpt.loss_sum
        self._update_applied, self._last_skipped = False, False
        self._unsynced = ckpt.unsynced
        self._replicas.loaded(state_dict)  # the next window compares the ranks' states

    def __deepcopy__(self, memo: dict[int, Any]) -> ClippedOptimizer:
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for logger in self.loggers:  # a copy logs to the same files: share the loggers, do not copy rows
            memo[id(logger)] = logger
        if self.norm_group is not None:  # process groups are shared, never copied
            memo[id(self.norm_group)] = self.norm_group
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return new
