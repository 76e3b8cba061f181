"""``Rewind``: go back to an earlier copy of the training state after repeated spikes.

Large-model practice (PaLM, Chowdhery et al. 2022): when loss spikes repeat,
restart from a state from before the first of them and skip the batches that
follow, since the same weights on different data usually pass the spike.

The optimizer reports every closed window to :meth:`Rewind.observe` as two
device flags (spike skip, applied); every ``check_every`` windows
:meth:`Rewind.check` reads the flags gathered since the last check in one host
read, and then either

* restores the newest copy taken before the first spike when ``spikes`` spike
  skips fell within ``within`` windows, or
* takes a new copy (into host memory, see :mod:`clipopt._recovery.host_copy`) when
  ``every`` updates were applied since the newest one (or there is none yet)
  and no spike skip fell in the last ``within`` windows (a copy in the middle
  of a spike episode may already hold damage, and could not be restored to
  for that episode anyway).

A rewind may therefore happen up to ``check_every - 1`` windows after the
spike that triggers it; those windows are undone by the rewind as well.

In an optimizer the check after window ``c`` runs in the close of window
``c + 1``, after that window's forward pass; so the module's buffers are copied
at window ``c``'s close (:meth:`Rewind.stage_buffers`), and the copy holds
those: a copy is the state at its window's close, buffers included.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.optim import Optimizer

from .._caller import user_stacklevel
from .._checks import check_flag, check_int_at_least, check_positive_int
from .._log_names import BATCH_END, BATCH_START, LR_FACTOR, RECOVERY_COLUMNS, STATE_RESET
from .._part import Part, Window, outcome_flag
from .._reasons import REWIND, SPIKE
from .._state import StateDictError, bad, int_field
from .batch_skips import BatchCount, check_skip
from .host_copy import (
    HostCopy,
    HostTensors,
    TrainingState,
    capture,
    copy_extra,
    copy_problem,
    host_tensors,
    plain,
    restore,
)
from .lr_cut import LrCut, check_lr_cut, cut_applied
from .state_reset import reset_moments

__all__ = ["Rewind", "RewindEvent", "RewindPart", "rewind_target"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class RewindEvent:
    """One rewind, as logged."""

    step: int  #: the window at whose check the rewind happened (in an optimizer: the discarded window)
    restored: int  #: the window count of the copy that was restored
    first_spike: int  #: the first spike skip of the group that triggered it
    spikes: int  #: spike skips in that group
    undone: int  #: applied updates the rewind took back
    lr_factor: float = 1.0  #: the learning-rate cut it started (``lr_cut``'s factor; 1.0: none)
    lr_updates: int = 0  #: applied updates that cut lasts (0: none)
    state_reset: bool = False  #: whether it zeroed the inner optimizer's moment buffers (``reset_state``)

    def to_dict(self) -> dict[str, int | float | bool]:
        return dataclasses.asdict(self)


def rewind_target(
    spike_steps: list[int], copies: list[int], spikes: int, within: int, avoid: int | None = None
) -> tuple[int, int] | None:
    """``(first spike, copy step)`` when the rule fires, else None.  Pure: host integers only.

    The group is every spike skip within ``within`` windows up to the newest one
    (``step > newest - within``); it fires with at least ``spikes`` of them.
    The copy is the newest one taken before the group's first spike
    (``copy step < first``), passing over ``avoid`` (the copy the latest rewind
    restored, when the spikes came back within ``within`` windows of it and
    no copy was taken since: it may already hold the damage) unless it is the
    only one; none qualifying: ``(first, -1)``.
    """
    if not spike_steps:
        return None
    newest = spike_steps[-1]
    group = [s for s in spike_steps if s > newest - within]
    if len(group) < spikes:
        return None
    first = group[0]
    older = [c for c in copies if c < first]
    if avoid is not None and len(older) > 1:
        older = [c for c in older if c != avoid]
    return first, (max(older) if older else -1)


class Rewind:
    """Keep copies of the training state; after repeated spike skips, restore one.

    The object the user passes (``rewind=``) and reads back (``opt.rewind``): its settings, its
    copies, :meth:`batches` and its state dict.  In the wrapper it runs as :class:`RewindPart`: every
    ``check_every`` windows the close of the next window starts with its :meth:`check` (a copy, or
    back to one, and that window is discarded, reason ``"rewind"``).  A copy holds, beside the
    parameters and the inner state, every held part's state (``_window.held.Held``).

    Args:
        every: take a copy every ``every`` applied updates (at the next check).
        keep: how many copies are kept (the oldest is replaced, its host buffers reused).
        spikes: spike skips that trigger a rewind ...
        within: ... when they fall within this many windows.
        skip_batches: batches :meth:`batches` drops after each rewind.
        module: a ``torch.nn.Module`` whose buffers (batch-norm statistics, ...)
            are copied and restored too; parameters come from the optimizer.
        check_every: windows between the checks (one host read each).
        lr_cut: ``(factor, updates)``: after a rewind, every group's learning rate is multiplied
            by ``factor`` (in (0, 1]) for the next ``updates`` applied updates (see
            :mod:`clipopt._recovery.lr_cut`); None: no cut.
        reset_state: zero the inner optimizer's moment buffers at a rewind, keeping its step
            counters (SPAM; see :mod:`clipopt._recovery.state_reset`).
    """

    def __init__(
        self,
        every: int = 100,
        keep: int = 2,
        spikes: int = 3,
        within: int = 50,
        skip_batches: int = 200,
        module: torch.nn.Module | None = None,
        *,
        check_every: int = 10,
        lr_cut: tuple[float, int] | None = None,
        reset_state: bool = False,
    ) -> None:
        self.every = check_positive_int("every", every, 100)
        self.keep = check_positive_int("keep", keep, 2)
        self.spikes = check_positive_int("spikes", spikes, 3)
        self.within = check_positive_int("within", within, 50)
        if self.spikes > self.within:
            raise ValueError(
                f"spikes must be <= within: {self.spikes} spike skips can never fall within {self.within} "
                f"windows (spikes={self.spikes}, within={self.within}), so this Rewind would never rewind; "
                f"pass e.g. spikes=3, within=50, or within={self.spikes * 10}"
            )
        self.skip_batches = check_int_at_least("skip_batches", skip_batches, 0, 200)
        if module is not None and not isinstance(module, torch.nn.Module):
            raise TypeError(
                f"module must be a torch.nn.Module or None, got {type(module).__name__}; "
                "pass e.g. module=model to copy its buffers too"
            )
        self.module = module
        self.check_every = check_positive_int("check_every", check_every, 10)
        self.lr_cut = check_lr_cut(lr_cut)
        self.reset_state = check_flag("reset_state", reset_state)
        self._cut = None if self.lr_cut is None else LrCut(*self.lr_cut)
        self._count = BatchCount()
        self._listed = check_skip(())  # the skip list of the latest batches() call
        self.rewinds = 0  #: rewinds so far
        self.pending_skip = 0  #: batches :meth:`batches` still drops
        self.batches_dropped = 0  #: batches dropped so far
        self.copies_taken = 0  #: copies taken so far
        self.spike_steps: list[int] = []  #: recent spike skips (window numbers), since the latest rewind
        self.log: list[RewindEvent] = []  #: every rewind
        self.applied = 0  #: updates applied to the current training state, as of the latest check
        self._copies: list[HostCopy] = []  # oldest first
        self._flags: list[tuple[int, Tensor]] = []  # (window, [spike, applied]) not yet checked
        self._target: TrainingState | None = None
        self._staged: HostTensors | None = None  # the module's buffers at the close before a check
        self._warned = False

    def bind(self, params: list[Tensor], optimizer: Optimizer) -> None:
        """Called by the optimizer: the parameters and inner optimizer to copy."""
        buffers = [] if self.module is None else list(self.module.buffers())
        self._target = TrainingState(list(params), buffers, optimizer)

    @property
    def copies(self) -> list[tuple[int, int]]:
        """``(window, applied updates)`` of every copy held, oldest first."""
        return [(c.step, c.applied) for c in self._copies]

    @property
    def nbytes(self) -> int:
        """Host memory held by the copies."""
        return sum(c.nbytes for c in self._copies)

    def observe(self, step: int, spike: Tensor | float, applied: Tensor | float) -> bool:
        """Record window ``step``'s flags (not read); True when a :meth:`check` is due now."""
        flags = torch.stack(
            [torch.as_tensor(spike, dtype=torch.float32), torch.as_tensor(applied, dtype=torch.float32)]
        )
        self._flags.append((step, flags))
        return step % self.check_every == 0

    def _read_flags(self) -> None:
        """Fold the pending flags into the spike log and the applied count (one host read)."""
        if not self._flags:
            return
        flags = [f for _, f in self._flags]
        if len({f.device for f in flags}) > 1:  # flags loaded from a checkpoint (CPU) among device ones
            flags = [f.cpu() for f in flags]
        values = torch.stack(flags).tolist()  # the one host read: stacked on their device first
        for (step, _), (spike, applied) in zip(self._flags, values, strict=True):
            if spike > 0:
                self.spike_steps.append(step)
            self.applied += int(applied > 0)
        self._flags = []
        newest = self.spike_steps[-1] if self.spike_steps else 0
        self.spike_steps = [s for s in self.spike_steps if s > newest - self.within]

    def check(self, step: int, wrapper_state: Callable[[], Any]) -> tuple[RewindEvent, Any] | None:
        """Read the pending flags; rewind, or take a copy when one is due.

        ``wrapper_state()`` gives the wrapper's state to copy along (policy,
        guard, scaler, update-clip history).  After a rewind returns the event and the restored wrapper state
        (CPU tensors) for the optimizer to load; else None.
        """
        target = self._bound_target()
        self._read_flags()
        steps = [c.step for c in self._copies]
        hit = rewind_target(self.spike_steps, steps, self.spikes, self.within)
        last = self.log[-1] if self.log else None
        if (
            hit is not None
            and last is not None
            and steps[-1:] == [last.restored]
            and hit[0] - last.step <= self.within
        ):
            # the spikes came back within `within` windows of the latest rewind, before any new copy
            hit = rewind_target(self.spike_steps, steps, self.spikes, self.within, avoid=last.restored)
        if hit is not None and hit[1] >= 0:
            return self._rewind(target, step, hit[0], hit[1])
        if hit is not None and not self._warned:
            self._warned = True
            warnings.warn(
                f"Rewind: {len(self.spike_steps)} spike skips by window {step} but no copy older than the "
                f"first of them (window {hit[0]}); nothing was restored. Take copies more often "
                f"(every={self.every} applied updates now)",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        newest = self._copies[-1].applied if self._copies else None
        quiet = not self.spike_steps or self.spike_steps[-1] <= step - self.within
        if quiet and (newest is None or self.applied - newest >= self.every):
            self.capture(step, wrapper_state())
        return None

    def _bound_target(self) -> TrainingState:
        if self._target is None:
            raise RuntimeError(
                "this Rewind is not attached to an optimizer; "
                "pass it as ClippedOptimizer(..., rewind=Rewind(...))"
            )
        return self._target

    def stage_buffers(self, step: int) -> None:
        """Window ``step`` has closed and the next check may take a copy: copy the module's buffers now.

        That check runs in the next window's close, after its forward pass changed
        them (batch-norm statistics); the copy it takes holds these instead, the
        buffers as they were at window ``step``'s close.  Non-blocking from an
        accelerator (pinned host memory, the host tensors of the last ones reused).
        """
        buffers = [] if self.module is None else list(self.module.buffers())
        if buffers and all(plain(b) for b in buffers):  # else the copy itself says why it cannot be taken
            self._staged = host_tensors(buffers, step, self._staged)

    def capture(self, step: int, extra: Any) -> None:
        """Take a copy now (window ``step``), replacing the oldest when ``keep`` are held.

        The module's buffers are those :meth:`stage_buffers` copied at window ``step``'s close, when it
        did; else the live ones.
        """
        target = self._bound_target()
        staged = self._staged if self._staged is not None and self._staged.step == step else None
        reuse = self._copies.pop(0) if len(self._copies) >= self.keep else None
        self._copies.append(capture(target, extra, step, self.applied, reuse, staged))
        if staged is not None:
            self._staged = None  # its host tensors belong to the copy now
        self.copies_taken += 1

    def _rewind(
        self, target: TrainingState, step: int, first: int, copy_step: int
    ) -> tuple[RewindEvent, Any]:
        index = [c.step for c in self._copies].index(copy_step)
        chosen = self._copies[index]
        restored = restore(chosen, target)
        if self.reset_state:
            reset_moments(target.optimizer.state)
        if self._cut is not None:
            self._cut.start()
        self._copies = self._copies[: index + 1]  # newer copies belong to the abandoned run
        factor, updates = self.lr_cut if self.lr_cut is not None else (1.0, 0)
        event = RewindEvent(
            step=step,
            restored=copy_step,
            first_spike=first,
            spikes=len(self.spike_steps),
            undone=self.applied - chosen.applied,
            lr_factor=factor,
            lr_updates=updates,
            state_reset=self.reset_state,
        )
        self.log.append(event)
        self.rewinds += 1
        self.applied = chosen.applied
        self.spike_steps = []
        self.pending_skip = self.skip_batches
        return event, restored

    def batches(self, iterable: Iterable[T], skip: Iterable[tuple[int, int]] = ()) -> Iterator[T]:
        """Yield from ``iterable``, dropping ``skip_batches`` batches after each rewind and the listed ones.

        ``skip``: ``(start, end)`` ranges of batch numbers to drop, ``start <= n < end`` (see
        :mod:`clipopt._recovery.batch_skips`); batches are numbered from 0 over the whole run, across calls
        and restarts (:attr:`batch_count` is in the state dict).  Checked here, before anything is drawn.
        """
        listed = check_skip(skip)
        self._listed = listed  # compared across data-parallel ranks from the next window on
        return self._batches(iterable, listed.__contains__)

    def _batches(self, iterable: Iterable[T], listed: Callable[[int], bool]) -> Iterator[T]:
        """The generator of :meth:`batches`: every batch drawn is numbered; a rewind's drops, then the
        listed ones, are not yielded."""
        count = self._count
        for item in iterable:
            n = count.next
            count.next += 1
            if self.pending_skip > 0:  # a rewind's drops first: they count batches drawn, listed or not
                self.pending_skip -= 1
                self.batches_dropped += 1
                continue
            if listed(n):
                count.listed += 1
                continue
            yield item

    @property
    def batch_count(self) -> int:
        """Batches drawn by :meth:`batches` over the run (dropped ones included): the next one's number."""
        return self._count.next

    @property
    def batches_listed(self) -> int:
        """Batches dropped because :meth:`batches`'s ``skip`` listed them."""
        return self._count.listed

    def settings(self) -> dict[str, object]:
        """What data-parallel ranks must share (:mod:`clipopt._distributed.agreement`): every
        setting, the skip list of the latest :meth:`batches` call (its merged ranges) and the
        rewinds so far.  Ranks that differ in any of them would copy, restore, cut or drop batches
        differently, and their replicas (under FSDP2: their shards) drift apart."""
        return {
            "rewind.every": self.every,
            "rewind.keep": self.keep,
            "rewind.spikes": self.spikes,
            "rewind.within": self.within,
            "rewind.skip_batches": self.skip_batches,
            "rewind.module": self.module is not None,
            "rewind.check_every": self.check_every,
            "rewind.lr_cut": self.lr_cut,
            "rewind.reset_state": self.reset_state,
            "rewind.skip": list(self._listed.ranges),
            "rewind.rewinds": self.rewinds,
        }

    # ------------------------------------------------------------------ the optimizer's window

    def lr_factor(self) -> float | None:
        """The factor the next update's learning rates are multiplied by, or None (no cut active)."""
        return self._cut.factor if self._cut is not None and self._cut.active else None

    def lr_counted(self, skipped: bool) -> None:
        """A window with an active cut was decided (``skipped``: its outcome, read on the host)."""
        if self._cut is not None:
            self._cut.counted(skipped)

    @property
    def lr_cut_left(self) -> int:
        """Applied updates the current learning-rate cut still lasts (0: none)."""
        return 0 if self._cut is None else self._cut.left

    def window_record(self, factor: float | None, rewound: bool) -> dict[str, float | None]:
        """A closed window's cells for the log (``clipopt._log_names``): the batches drawn during it,
        and, when on, the cut's factor it used and whether its rewind reset the optimizer state."""
        start, end = self._count.closed()
        drawn = end > 0  # batches() has drawn a batch (in this run or before a restart)
        cells: dict[str, float | None] = {
            BATCH_START: start if drawn else None,
            BATCH_END: end if drawn else None,
        }
        if self.lr_cut is not None:
            cells[LR_FACTOR] = 1.0 if factor is None else factor
        if self.reset_state:
            cells[STATE_RESET] = 1.0 if rewound else 0.0
        return cells

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Counters, pending skips, the spike log, unchecked flags, the rewind log and the copies.

        The copies are included (cloned CPU tensors): without them a run resumed
        from a checkpoint would have nothing to rewind to until its next copy,
        and would not train like the run that never stopped.  They make the
        checkpoint up to ``keep`` times the size of parameters + optimizer state
        larger.  ``"staged"`` (when there are any): the module's buffers copied at
        the close before a check (:meth:`stage_buffers`), so that a run resumed between that
        close and the check takes the same copy.  Only tensors, numbers, strings,
        lists, tuples and dicts: loadable with ``torch.load(..., weights_only=True)``.
        """
        copies = []
        for c in self._copies:
            c.wait()
            copies.append(
                {
                    "step": c.step,
                    "applied": c.applied,
                    "spec": c.spec,
                    "leaves": [t.clone() for t in c.leaves],
                    "devices": [str(d) for d in c.devices],
                }
            )
        out: dict[str, Any] = {
            "format": 1,
            "rewinds": self.rewinds,
            "pending_skip": self.pending_skip,
            "batches_dropped": self.batches_dropped,
            "copies_taken": self.copies_taken,
            "applied": self.applied,
            "spike_steps": list(self.spike_steps),
            "flags": [[step, f.detach().to("cpu", copy=True)] for step, f in self._flags],
            "log": [e.to_dict() for e in self.log],
            "copies": copies,
            "lr_cut_left": self.lr_cut_left,
            **self._count.state(),
        }
        if self._staged is not None:  # only then: the state of a Rewind without buffers keeps its format
            self._staged.wait()
            out["staged"] = {"step": self._staged.step, "buffers": [t.clone() for t in self._staged.leaves]}
        return out

    def validate_state(self, state: Any, check_extra: Callable[[Any], None] | None = None) -> tuple[Any, ...]:
        """Check a state from :meth:`state_dict` (``ValueError`` naming the cause); changes nothing.

        ``check_extra``: called with each copy's wrapper state (what ``check``'s
        ``wrapper_state()`` gave), raises ``ValueError`` when it could not be loaded
        at a rewind.  Returns what :meth:`load_state_dict` loads (its parsed form).
        """
        parsed = _parse_state(state, self._target)
        if check_extra is not None:
            for c in parsed[-3]:  # the copies (see _parse_state)
                check_extra(copy_extra(c.spec, c.leaves))
        return parsed

    def load_state_dict(self, state: Any, parsed: tuple[Any, ...] | None = None) -> None:
        """Load a state from :meth:`state_dict`; everything is checked before anything changes.

        ``parsed``: the result of :meth:`validate_state` for this ``state`` (not checked twice).
        """
        if parsed is None:
            parsed = _parse_state(state, self._target)
        (
            self.rewinds,
            self.pending_skip,
            self.batches_dropped,
            self.copies_taken,
            self.applied,
            self.spike_steps,
            self._flags,
            self.log,
            copies,
            self._staged,
            (cut_left, *count),
        ) = parsed
        self._copies = copies[-self.keep :]
        if self._cut is not None:
            self._cut.left = min(cut_left, self._cut.updates)
        self._count.load((count[0], count[1], count[2]))

    def __getstate__(self) -> dict[str, Any]:
        """Pickling / deep copies: the copies' pending events are waited for (events do not travel)."""
        for c in self._copies:
            c.wait()
        if self._staged is not None:
            self._staged.wait()
        return self.__dict__.copy()

    def __repr__(self) -> str:
        return (
            f"Rewind(every={self.every}, keep={self.keep}, spikes={self.spikes}, within={self.within}, "
            f"skip_batches={self.skip_batches}, check_every={self.check_every}, lr_cut={self.lr_cut}, "
            f"reset_state={self.reset_state})"
        )


class RewindPart(Part):
    """A :class:`Rewind` as a part of the wrapper (``rewind=``): every ``check_every`` windows the
    close of the next window starts with its check (:meth:`begin`: a copy, or back to one, and that
    window is discarded, reason ``"rewind"``); it sees each window's outcome (:meth:`commit`), copies
    the module's buffers at the close before a check (:meth:`closed`), runs the inner step under an
    active learning-rate cut (:meth:`step_context`, on the host path) and records the batch columns
    (:meth:`record`).  Its state-dict entry is the Rewind's own (:meth:`Rewind.state_dict`)."""

    keyword = "rewind"
    example = "Rewind(every=100, keep=2, spikes=3, within=50)"
    columns = RECOVERY_COLUMNS
    #: It records the batch columns of every window, an empty or discarded one included.
    records_unmeasured = True
    #: Its entry (the copies, of this rank's shards under FSDP2) is each rank's own.
    rank_own = True
    #: Its checks take copies, which hold every held part's state (``Window.held``).
    takes_copies = True

    def __init__(self, rewind: Rewind) -> None:
        self.rewind = rewind
        self._window: tuple[float | None, bool] = (None, False)  # this window's lr factor, rewound

    @classmethod
    def build(cls, value: Any, inner: Optimizer) -> RewindPart | None:
        """``value`` (a Rewind or None), bound to ``inner``'s parameters (DTensors: their shards)."""
        rewind = cls.checked(value, Rewind)
        if rewind is None:
            return None
        rewind.bind([p for group in inner.param_groups for p in group["params"]], inner)
        return cls(rewind)

    def value(self) -> Rewind:
        return self.rewind

    def settings(self) -> dict[str, object]:
        return self.rewind.settings()

    def check_with(self, active: Mapping[str, Part], max_norm: Any) -> None:
        """It rewinds after spike skips: a part must skip spikes (a SpikeGuard), or the policy."""
        guarded = any(p.code == SPIKE and type(p).flag is not Part.flag for p in active.values())
        if not guarded and not getattr(max_norm, "skip_spikes", False):
            raise ValueError(
                "rewind=Rewind(...) rewinds after spike skips, but nothing skips spikes here; "
                "pass spike_guard=SpikeGuard() (or max_norm=ZClip(skip_spikes=True))"
            )

    def due(self, closed: int) -> bool:
        """Whether the close of the next window starts with a check (``closed`` windows so far)."""
        return closed > 0 and closed % self.rewind.check_every == 0

    def begin(self, w: Window) -> int | None:
        """A due check after ``w.number - 1`` windows: a copy (holding ``w.held``'s state), or a
        rewind (then ``w.held`` is loaded from the copy and this window is discarded)."""
        closed = w.number - 1
        if not self.due(closed):
            return None
        self.rewind.bind(w.params, w.inner)  # parameter groups may have been added since
        hit = self.rewind.check(closed, w.held.state)
        if hit is None:
            return None
        # the check runs in the close of window closed + 1, the one discarded (StepStats, CSV: "rewind")
        self.rewind.log[-1] = dataclasses.replace(hit[0], step=closed + 1)
        self._window = (None, True)
        w.held.restore(hit[1])
        return REWIND

    def host_step(self, w: Window) -> bool:
        """An active cut's window takes the host path: its outcome is read there."""
        return self.rewind.lr_factor() is not None

    def step_context(self, w: Window) -> AbstractContextManager[Any]:
        """The learning-rate cut when one is active: every group's lr multiplied by its factor around
        the inner step only (:func:`~clipopt._recovery.lr_cut.cut_applied`); :meth:`commit` counts it."""
        factor = self.rewind.lr_factor()
        self._window = (factor, False)
        return nullcontext() if factor is None else cut_applied(factor, w.inner.param_groups)

    def commit(self, w: Window, d: Any, skipped: bool | Tensor) -> None:
        """The window's flags (spike skip, applied), not read; on a window with an active cut its
        final outcome (an update put back is not applied) is read and counted against the cut."""
        device = d.total_norm.device
        skip = outcome_flag(skipped, device)
        if self._window[0] is not None:  # a cut: applied updates count
            self.rewind.lr_counted(bool(skipped))  # read on a cut window only (put back: a device flag)
        if isinstance(d.reason, Tensor):
            spike = (d.reason == SPIKE).to(torch.float32)
        else:  # decided on the host
            spike = torch.full((), float(d.reason == SPIKE), dtype=torch.float32, device=device)
        self.rewind.observe(w.number, spike * (skip > 0), 1.0 - skip)

    def closed(self, windows: int) -> None:
        """When the next close starts with a check, copy the module's buffers now, at this close."""
        if self.due(windows):
            self.rewind.stage_buffers(windows)

    def record(self, w: Window) -> None:
        """The window's batch columns (and the cut's factor, the state reset, when on)."""
        factor, rewound = self._window
        self._window = (None, False)
        w.cells.update(self.rewind.window_record(factor, rewound))

    def state_dict(self) -> dict[str, Any]:
        return self.rewind.state_dict()

    def check_state(self, saved: Any, inner: Optimizer) -> Any:
        return saved, self.rewind.validate_state(saved)

    def check_held(self, checked: Any, check: Callable[[Any], None]) -> None:
        for c in checked[1][-3]:  # the copies (see _parse_state)
            check(copy_extra(c.spec, c.leaves))

    def load_state(self, checked: Any) -> None:
        self.rewind.load_state_dict(*checked)


_BAD_STATE = (
    "invalid Rewind state: {}; pass the state saved by Rewind.state_dict() (opt.state_dict()['clipopt'])"
)


def _bad(why: str) -> StateDictError:
    """The state dict's :func:`~clipopt._state.bad` in the Rewind's own form."""
    return bad(why, _BAD_STATE)


def _int_field(state: dict[str, Any], key: str) -> int:
    """:func:`~clipopt._state.int_field` (an int >= 0) in the Rewind's own form."""
    return int_field(state, key, where="", message=_BAD_STATE)


def _leaf_numbers(spec: Any, part: str) -> list[int]:
    """The leaf numbers of the ``params`` or ``buffers`` of a structure :func:`copy_problem` accepted."""
    return [child[1] for child in dict(spec[1])[part][1]]


def _parse_copy(entry: Any, target: TrainingState | None) -> HostCopy:
    if not isinstance(entry, dict):
        raise _bad(f"a copy must be a dict, got {type(entry).__name__}")
    leaves, devices, spec = entry.get("leaves"), entry.get("devices"), entry.get("spec")
    if not isinstance(leaves, list) or not all(isinstance(t, Tensor) for t in leaves):
        raise _bad("a copy's 'leaves' must be a list of tensors")
    if not isinstance(devices, list) or len(devices) != len(leaves):
        raise _bad("a copy's 'devices' must name one device per leaf")
    if not (isinstance(spec, tuple) and len(spec) == 2 and spec[0] == "d"):
        raise _bad("a copy's 'spec' is not a structure saved by Rewind")
    why = copy_problem(spec, leaves, target)
    if why is not None:
        raise _bad(why)
    try:
        places = [torch.device(str(d)) for d in devices]
    except RuntimeError:
        raise _bad(f"a copy's 'devices' must name devices, got {devices!r:.80}") from None
    if target is not None:  # saved on other devices (a GPU run resumed on the CPU): the parameters' now
        params = _leaf_numbers(spec, "params")
        moved = {places[i]: p.device for i, p in zip(params, target.params, strict=True)}
        places = [moved.get(d, d) for d in places]
    step, applied = _int_field(entry, "step"), _int_field(entry, "applied")
    pin = torch.cuda.is_available()
    host = [t.detach().to("cpu", copy=True) for t in leaves]
    if pin:
        host = [t.pin_memory() for t in host]
    return HostCopy(step, applied, spec, host, places)


def _parse_staged(entry: Any, target: TrainingState | None) -> HostTensors | None:
    """The ``"staged"`` buffers of a state (None: none, or a state saved before they existed)."""
    if entry is None:
        return None
    buffers = entry.get("buffers") if isinstance(entry, dict) else None
    if not isinstance(buffers, list) or not all(isinstance(t, Tensor) for t in buffers):
        raise _bad("'staged' must be None or a dict with 'step' and a list of tensors 'buffers'")
    host = [t.detach().to("cpu", copy=True) for t in buffers]
    if torch.cuda.is_available():
        host = [t.pin_memory() for t in host]
    staged = HostTensors(_int_field(entry, "step"), host)
    if target is not None and not staged.fits(target.buffers):
        raise _bad("its 'staged' buffers have other shapes or dtypes than the module's")
    return staged


def _parse_state(state: Any, target: TrainingState | None) -> tuple[Any, ...]:
    if not isinstance(state, dict) or state.get("format") != 1:
        raise _bad(f"expected a dict with format 1, got {type(state).__name__}")
    ints = [
        _int_field(state, k)
        for k in ("rewinds", "pending_skip", "batches_dropped", "copies_taken", "applied")
    ]
    spikes = state.get("spike_steps")
    if not isinstance(spikes, list) or not all(type(s) is int for s in spikes):
        raise _bad("'spike_steps' must be a list of window numbers")
    flags = state.get("flags")
    if not isinstance(flags, list) or not all(
        isinstance(f, list)
        and len(f) == 2
        and isinstance(f[0], int)
        and isinstance(f[1], Tensor)
        and f[1].shape == (2,)
        and not (f[1].is_meta or f[1].is_complex())
        for f in flags
    ):
        raise _bad("'flags' must be a list of [window, tensor of 2 flags]")
    log = state.get("log")
    try:
        events = [RewindEvent(**e) for e in log]  # type: ignore[union-attr]
    except TypeError as exc:
        raise _bad(f"'log' must be a list of rewind records ({exc})") from None
    if not all(_event_ok(e) for e in events):
        raise _bad("'log' must be a list of rewind records of ints")  # lr_factor a float, state_reset a bool
    copies = state.get("copies")
    if not isinstance(copies, list):
        raise _bad("'copies' must be a list")
    parsed = [_parse_copy(c, target) for c in copies]
    pending = [(step, f.detach().to("cpu", torch.float32, copy=True)) for step, f in flags]
    staged = _parse_staged(state.get("staged"), target)
    return (*ints, list(spikes), pending, events, parsed, staged, _escalation_fields(state))


#: Fields added with ``lr_cut`` and listed skips: 0 when a state saved before them lacks them.
_ESCALATION_FIELDS = ("lr_cut_left", "batch_next", "batch_window_start", "batches_listed")


def _escalation_fields(state: dict[str, Any]) -> tuple[int, ...]:
    """``lr_cut_left`` and the batch count of a state, each an int >= 0 (0 when absent)."""
    return tuple(_int_field(state, k) if k in state else 0 for k in _ESCALATION_FIELDS)


def _event_ok(e: RewindEvent) -> bool:
    """A loaded log record of the right types (ints, a float ``lr_factor``, a bool ``state_reset``)."""
    ints = (e.step, e.restored, e.first_spike, e.spikes, e.undone, e.lr_updates)
    factor_ok = type(e.lr_factor) is float or type(e.lr_factor) is int
    return all(type(v) is int for v in ints) and factor_ok and type(e.state_reset) is bool
