"""``ClippedOptimizer``: clipping, accumulation and skipping around any ``torch.optim`` optimizer.

The class is the orchestration: ``step()`` gathers micro-batches and the last
one closes the window in the stages of docs/design.md, 'Order of operations'
(:meth:`clipopt._window.runtime.Runtime._finish`), each stage a call into the module that
owns it (see ARCHITECTURE.md).
"""

from __future__ import annotations

import collections
import copy
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.compiler import is_compiling
from torch.optim import Optimizer

from ._checkpoint import add_entry_slot, entry_at_top, read_checkpoint, with_entry, wrapper_entry
from ._config import (
    ASSIGNABLE,
    ASSIGNED_WITH,
    KEYWORDS,
    REGISTRY,
    check_assignment,
    check_closure,
    configure,
    describe,
)
from ._diagnostics.loggers import Logger, LogTo
from ._diagnostics.stats import StepStats
from ._distributed.no_sync import (
    check_checkpointable,
    check_no_sync_args,
    pending_unsynced,
    plan_no_sync,
)
from ._distributed.replicas import ReplicaDecision
from ._hooks import step_hooked
from ._part import Parts
from ._policies.builtin import ClipPolicy
from ._recovery.rewind import Rewind
from ._recovery.spike_guard import SpikeGuard
from ._window.diagnose import Diagnostics
from ._window.loss import check_loss, loss_of_closure
from ._window.plan import PLANNED
from ._window.runtime import Runtime
from ._window.update_clip import UpdateClip
from ._wrapping import STORED, InnerOptimizerView

__all__ = ["ClippedOptimizer"]

#: The settings the window's plan reads (``_window.plan.WindowPlan.config``): handed over at each change.
_CONFIG = (*sorted(ASSIGNABLE), "max_norm")


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

    # the settings (set from the checked WrapperConfig; assigned mid-run: checked by _assigning)
    _policy: ClipPolicy | None
    _bound: float | None
    norm_type: float
    clip_value: float | None
    accumulation_steps: int
    reduction: str
    skip_nonfinite: bool
    max_consecutive_nonfinite: int | None
    stats_history: int
    layer_stats: int
    loggers: list[Logger]
    max_snapshots: int
    norm_group: Any
    backward_passes_per_step: int
    _planned = PLANNED | ASSIGNABLE  # assigning one: _settings_changed

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
        observers = {"layer_stats": layer_stats, "loggers": loggers, "snapshot_dir": snapshot_dir}
        others: dict[str, Any] = {"update_clip": update_clip, "update_stats": update_stats}
        others.update(spike_guard=spike_guard, rewind=rewind)
        built = Parts.build(REGISTRY, {**parts, **observers, **others}, cfg.inner)  # every part, by keyword
        built.check_with(cfg.policy)  # (a Rewind needs spike skips: a guard, or the policy's)
        self.__dict__.update(cfg.settings())  # (max_norm: _policy and _bound)
        # the optimizer, or an _inner.InnerOptimizers over several; with a slot for the entry (_checkpoint)
        self._inner = add_entry_slot(cfg.inner)
        self.scaler, self.foreach = scaler, foreach
        self._init_hooks()
        replicas = ReplicaDecision(cfg.replica_group)
        diagnostics = Diagnostics(max_snapshots=self.max_snapshots)  # (the observers: run.use below)
        run = Runtime(self._inner, cfg.names, replicas, diagnostics, LogTo(self), cfg.stats_history)
        self._run = run  # the running state and the window's close (_window.runtime)
        run.use(built)
        self._forwarding = True  # the inner optimizer's public attributes: read, not hidden (_wrapping)
        self._settings_changed()

    # ------------------------------------------------------------------ delegation

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the hooks and a scheduler's ``step`` wrapper (as torch does, see
        ``_wrapping.NOT_PICKLED``); mid-window also the gradients.

        Pickling a parameter does not carry its ``.grad``, so the gradients of a
        half-accumulated window travel with the wrapper.
        """
        self._check_checkpointable()
        state = super().__getstate__()
        if self._run.counters.micro_batches > 0:
            state["_pending_grads"] = [p.grad for p in self._params()]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        pending = state.pop("_pending_grads", None)
        super().__setstate__(state)
        self._run.log = LogTo(self)
        if pending is not None:
            for p, g in zip(self._params(), pending, strict=True):
                p.grad = g

    def __repr__(self) -> str:
        return describe(self, self._inner, self._run.parts.describe())

    if not TYPE_CHECKING:  # (as InnerOptimizerView's: hidden from mypy)

        def __getattr__(self, name: str) -> Any:
            if name in KEYWORDS and "_run" in self.__dict__:  # a part's keyword: its value, None when off
                return self._run.parts.value(name)
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
            parts = self._run.parts.assigned(name, value, self._inner)
            parts.check_with(self._policy)  # beside the other parts
            self._run.use(parts)
            self._settings_changed()
            return STORED
        value = check_assignment(name, value, {n: getattr(self, n) for n in ASSIGNED_WITH}, self._inner)
        if name == "max_norm":  # the parts beside the new policy
            self._run.parts.check_with(value[0])
        if name == "stats_history":  # the newest statistics that fit stay
            self._run.stats = collections.deque(self._run.stats, maxlen=value)
        if name == "max_snapshots":
            self._run.diagnostics.limit(value)
        return value

    def add_param_group(self, param_group: dict[str, Any], optimizer: int | None = None) -> None:
        """Add a parameter group to the inner optimizer; its ``max_norm`` and ``clip_value``
        (docs/per-group-clipping.md) are checked first, so a bad one adds nothing."""
        if isinstance(param_group, dict):
            self._run.plan.check_groups([*self.param_groups, param_group], self.defaults)
        super().add_param_group(param_group, optimizer)
        self._run.plan.reset()

    def _settings_changed(self) -> None:
        """A setting changed: the window plan gets the settings as they are now (values, by name)."""
        self._run.plan.reset({name: getattr(self, name) for name in _CONFIG})

    # ------------------------------------------------------------------ signals

    @property
    def micro_batches(self) -> int:
        """Micro-batches gathered in the current, still open window."""
        return self._run.counters.micro_batches

    @property
    def num_updates(self) -> int:
        """Updates applied so far (may wait for the device)."""
        return int(self._run.counters.applied)

    @property
    def num_skipped(self) -> int:
        """Windows skipped so far (may wait for the device)."""
        return int(self._run.counters.skipped)

    @property
    def num_windows(self) -> int:
        """Windows closed so far, applied or skipped."""
        return self._run.counters.windows

    @property
    def update_applied(self) -> bool:
        """True when the latest :meth:`step` call changed the parameters (may wait for the device)."""
        if self._run.update_applied is None:  # a window decided on the device: applied unless skipped
            return not bool(self._run.last_skipped)
        return self._run.update_applied

    @property
    def step_was_skipped(self) -> bool:
        """True when the latest closed window ended in a skip (may wait for the device)."""
        return bool(self._run.last_skipped)

    @property
    def last_snapshot(self) -> str | None:
        """Path of the latest anomaly snapshot written, or None; assignable (e.g. cleared once handled)."""
        return self._run.diagnostics.last_snapshot

    @last_snapshot.setter
    def last_snapshot(self, path: str | None) -> None:
        self._run.diagnostics.last_snapshot = path

    @property
    def rewinds(self) -> int:
        """Rewinds so far (0 without a :class:`Rewind`)."""
        rewind: Rewind | None = self._run.parts.value("rewind")
        return 0 if rewind is None else rewind.rewinds

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
        c, k = self._run.counters, self.accumulation_steps
        # a plain micro-batch that leaves the window open only counts (and feeds the window guard)
        if closure is None and loss is None and c.micro_batches + 1 < k and self._run.replicas.checked_k == k:
            if not (compiling or self._run.index.has_dtensor):  # as in _step
                self._run.window_guard.step(c.micro_batches, k, self.backward_passes_per_step, self._params)
            c.micro_batches += 1
            if self._run.update_applied is not False:  # set once per window (__setattr__ is a Python call)
                self._run.update_applied = False
            return None
        return self._step(closure, loss=loss)

    # torch's profile_hook_step costs ~12 us per call (record_function) even with
    # no hook and no profiler; take it only when a hook or the profiler is active.
    step.hooked = True  # type: ignore[attr-defined]

    def _step(self, closure: Callable[[], Any] | None = None, *, loss: Tensor | float | None = None) -> Any:
        # no call while the settings check holds for this accumulation_steps (every plain micro-batch)
        if self._run.replicas.checked_k != (k := self.accumulation_steps) and self._run.replicas.due(k):
            self._check_replicas()
        given = None if loss is None else check_loss(loss)
        out = None
        if closure is not None:
            check_closure(closure, self.scaler)
            self._run.parts.before_closure(
                closure, self._run.counters.micro_batches, self._run.counters.windows + 1
            )
            with torch.enable_grad():
                out = closure()
            k = self.accumulation_steps  # (as the closure left it)
        c, window_loss = self._run.counters, self._run.loss
        if k > 1 and not self._run.index.has_dtensor and not is_compiling():
            # host bookkeeping only (see _window.guard); FSDP2 writes .grad outside autograd
            guard, allowed = self._run.window_guard, self.backward_passes_per_step
            guard.step(c.micro_batches, k, allowed, self._params)
        loss_before = window_loss.total, window_loss.count  # add() replaces, never writes into, the sum
        if given is not None or out is not None:  # a plain micro-batch has no loss to add
            window_loss.add(given if given is not None else loss_of_closure(out))
        c.micro_batches += 1
        if c.micro_batches < k:
            if self._run.update_applied is not False:  # set once per window (__setattr__ is a Python call)
                self._run.update_applied = False
            return out
        try:
            return self._run.close(self._run.plan.settings(c.micro_batches, self._inner), out, closure)
        except BaseException:
            c, window_loss = self._run.counters, self._run.loss  # (a failed close may have put back copies)
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
        if self._run.replicas.due(self.accumulation_steps):
            self._check_replicas()
        params = self._params()
        if self._run.replicas.active and params:
            counters = self._run.counters
            self._run.replicas.check_flush(counters.micro_batches, counters.windows + 1, params[0].device)
        if self._run.counters.micro_batches > 0:
            run = self._run
            run.close(run.plan.settings(run.counters.micro_batches, self._inner), None, None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients, but only when no window is open.

        Calls made while micro-batches are being accumulated do nothing, so
        ``zero_grad()`` may be called after every micro-batch.
        """
        if self._run.counters.micro_batches == 0:
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
        if self._run.replicas.due(self.accumulation_steps):
            self._check_replicas()
        index = self._run.counters.micro_batches + 1  # this micro-batch's place in the window
        context, marker = plan_no_sync(
            model, index >= self.accumulation_steps if sync is None else sync, index, self._run.replicas
        )
        before = self._run.unsynced
        if marker is not None:  # set before the body runs: an opt.step() inside may close the window
            self._run.unsynced = marker
        try:
            with context:
                yield
        except BaseException:
            if marker is not None:
                self._run.unsynced = before
            raise

    def _check_replicas(self) -> None:
        """At the first step() or no_sync() (under FSDP2 also after accumulation_steps changed): the
        ranks' settings must agree (collective)."""
        self._run.replicas.check_settings(self._run.agreed(), self._params(), self._run.index.has_dtensor)

    def _check_checkpointable(self) -> None:
        check_checkpointable(pending_unsynced(self._run.unsynced, self._run.counters.micro_batches))

    def _params(self) -> list[Tensor]:
        """All parameters, in group order; cached until the groups change."""
        return self._run.index.of(self.param_groups)

    # ------------------------------------------------------------------ diagnostics

    def layer_names(self) -> list[str]:
        """The name of every parameter, in parameter-group order (see ``param_names``)."""
        return self._run.layer_names()

    @property
    def stats(self) -> collections.deque[StepStats]:
        """The latest ``stats_history`` windows' :class:`StepStats`, oldest first."""
        return self._run.stats

    @property
    def last_stats(self) -> StepStats | None:
        """The latest closed window's :class:`StepStats`, or None before the first."""
        return self._run.last_stats

    def attach(self, **tensors: Any) -> None:
        """Register tensors (the current batch) to save if this window goes bad.

        ``opt.attach(inputs=x, targets=y)`` before ``opt.step()``; attachments are
        dropped when the window closes.  Called several times in one window, a
        name keeps a list of what it received, in order.  Only read when a
        snapshot is written (``snapshot_dir``); copies are made then.
        """
        self._run.diagnostics.attach(tensors)

    def close(self) -> None:
        """Close every logger (flushes buffered rows)."""
        for part in self._run.parts.active:  # (the loggers first: _config.REGISTRY)
            part.close()
        self._run.skip_run.advance()  # the windows the loggers' last rows read

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
            self._run.counters,
            self._params(),
            scaler=self.scaler,
            loss_sum=self._run.loss,
            policy=self._policy,
            unsynced=pending_unsynced(self._run.unsynced, self._run.counters.micro_batches),
            parts=self._run.parts,
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
        run, params, c = self._run, self._params(), self._run.plan.config
        ckpt = read_checkpoint(state_dict, params, c, inner=self._inner, parts=run.parts)
        ckpt = ckpt.with_open_window(run.counters.micro_batches > 0)  # (its gradients go, unless saved)
        counters = ckpt.take_over(self._inner, params, c, parts=run.parts)
        run.loaded(counters, ckpt.loss_sum, ckpt.unsynced, state_dict)

    def __deepcopy__(self, memo: dict[int, Any]) -> ClippedOptimizer:
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for logger in self.loggers:  # a copy logs to the same files: share the loggers, do not copy rows
            memo[id(logger)] = logger
        if self.norm_group is not None:  # process groups are shared, never copied
            memo[id(self.norm_group)] = self.norm_group
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return new
