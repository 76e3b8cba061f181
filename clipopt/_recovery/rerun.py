"""``Rerun``: execute an anomalous window again to tell a fault from the numerics.

With the closure form of ``step()`` (``opt.step(closure=...)``, forward + backward), a window
whose decision is an anomaly -- a non-finite gradient norm or loss (``"nonfinite"``), a spike
skip of the SpikeGuard or the clip policy (``"spike"``) -- is executed again before it is
decided: the gradients cleared, the RNG states of its first execution restored (torch's CPU and
CUDA generators, Python's ``random``, NumPy's global one), then each micro-batch's closure
called again in order.  The wrapper then decides the window again (:meth:`Part.rerun
<clipopt._part.Part.rerun>`):

* the same outcome (the total norm and the loss bit-identical, or within ``tolerance``
  relative to the larger, both non-finite counting as the same) is **persistent** -- the data
  or the numerics: the window is decided as it would have been without a rerun (skipped);
* a different outcome is **transient** -- a fault or a non-deterministic kernel: the rerun's
  decision stands, so its update is applied when it is sound (finite, no spike).

Each event is recorded: ``StepStats.rerun`` (None, ``"persistent"`` or ``"transient"``), the
loggers' ``rerun`` column, ``clipopt report``, and the ``tracker`` file (JSON lines, append-only,
each line one ``write`` then ``fsync``; :meth:`Rerun.read_tracker`; read back at construction
into :attr:`Rerun.events`).

Cost: the RNG states are captured at each window's first closure (host copies, no device
work) and the window's decision is read on the host once per window (one synchronisation); a
healthy window calls no closure again.  Under DDP the anomaly is agreed already, so every rank
reruns together; one all-gather names the ranks where a non-finite value first appeared and
one all-reduce agrees on the verdict, both only in an anomalous window.

Prior art: Megatron-LM's ``megatron/core/rerun_state_machine.py`` (correct / transient /
persistent, a tracker of results read back on restart).
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from numbers import Real
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from .._caller import user_stacklevel
from .._checks import check_names
from .._log_names import RERUN, RERUN_OUTCOMES
from .._part import Part, Window
from .._reasons import SPIKE

__all__ = ["OUTCOMES", "TRIGGERS", "Rerun"]

#: What may trigger a rerun (``Rerun(on=...)``).
TRIGGERS = ("nonfinite", "spike")
#: What a rerun finds (``StepStats.rerun``).
OUTCOMES = RERUN_OUTCOMES
#: The column of ``StepStats.rerun`` and the logs.
COLUMN = RERUN


def _check_tolerance(value: Any) -> float:
    if not isinstance(value, Real) or isinstance(value, bool):
        raise TypeError(
            f"tolerance must be a float, got {value!r} ({type(value).__name__}); pass e.g. tolerance=0.0 "
            "(bit-identical) or tolerance=1e-6 for non-deterministic kernels"
        )
    if not (float(value) >= 0 and math.isfinite(float(value))):
        raise ValueError(
            f"tolerance must be a finite number >= 0, got {value!r}; pass e.g. tolerance=0.0 "
            "(bit-identical) or tolerance=1e-6 for non-deterministic kernels"
        )
    return float(value)


def _check_tracker(value: Any) -> Path | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"tracker must be a path or None, got {value!r} ({type(value).__name__}); "
            "pass e.g. tracker='runs/rerun.jsonl'"
        )
    return Path(value)


def same_value(a: float | None, b: float | None, tolerance: float) -> bool:
    """Whether two outcomes' values are the same: both absent, both non-finite (nan or an inf of
    either sign), or finite and equal within ``tolerance`` relative to the larger magnitude."""
    if a is None or b is None:
        return a is None and b is None
    if not (math.isfinite(a) and math.isfinite(b)):
        return not math.isfinite(a) and not math.isfinite(b)
    return a == b or abs(a - b) <= tolerance * max(abs(a), abs(b))


class _RngStates:
    """The RNG states a closure may draw from: torch's CPU (and initialised CUDA) generators,
    Python's ``random``, NumPy's global generator (when NumPy is imported)."""

    __slots__ = ("cpu", "cuda", "numpy", "python")

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        cuda = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]  # (never initialise CUDA here)
        self.cuda = torch.cuda.get_rng_state_all() if cuda else None
        self.python = random.getstate()
        np = sys.modules.get("numpy")
        self.numpy = np.random.get_state() if np is not None else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.python)
        np = sys.modules.get("numpy")
        if self.numpy is not None and np is not None:
            np.random.set_state(self.numpy)


class Rerun(Part):
    """Execute a window whose decision is an anomaly again, and tell a persistent outcome (data,
    numerics: handled as without a rerun) from a transient one (a fault: the rerun's result
    stands).  ``ClippedOptimizer(..., rerun=Rerun(on=("nonfinite", "spike"), tracker=path))``
    with ``opt.step(closure=...)`` (docs/rerun.md).

    Args:
        on: what triggers a rerun: ``"nonfinite"`` (a non-finite gradient norm or loss),
            ``"spike"`` (a spike skip: SpikeGuard, or a policy's ``skip_spikes``).
        tolerance: the relative difference of the total norm and the loss under which two
            executions count as the same (0: bit-identical; more for non-deterministic kernels).
        tracker: a JSON-lines file every event is appended to (read back at construction into
            :attr:`events`; under data parallelism the replica group's rank 0 writes it).
    """

    keyword = "rerun"
    columns = (COLUMN,)

    def __init__(
        self,
        on: Sequence[str] = TRIGGERS,
        *,
        tolerance: float = 0.0,
        tracker: str | os.PathLike[str] | None = None,
    ) -> None:
        self.on = check_names("on", on, TRIGGERS, "('nonfinite',)")
        self.tolerance = _check_tolerance(tolerance)
        self.tracker = _check_tracker(tracker)
        #: Every event: those read from :attr:`tracker` at construction, then this run's.
        self.events: list[dict[str, Any]] = [] if self.tracker is None else self.read_tracker(self.tracker)
        #: This run's events by outcome (in the state dict).
        self.counts: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self._closures: list[Callable[[], Any]] = []  # the open window's closures, in order
        self._window = 0  # the number of the window they belong to
        self._rng: _RngStates | None = None  # the RNG states before its first closure
        self._first: dict[str, Any] | None = None  # the first execution's outcome, during a rerun
        self._outcome: str | None = None  # the window's verdict, until recorded
        self._event: dict[str, Any] | None = None  # the window's event, until committed
        self._local_bad: Tensor | None = None  # Rerun.watch: a non-finite value before the reduction
        self._watching = False
        self._warned = False

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave the open window's closures and RNG states behind (a closure is
        often a lambda): a copy cannot execute that window again, and warns if it must."""
        state = dict(self.__dict__)
        state.update(_closures=[], _rng=None, _local_bad=None)
        return state

    def __repr__(self) -> str:
        return f"Rerun(on={self.on!r}, tolerance={self.tolerance!r}, tracker={self.tracker!r})"

    # ------------------------------------------------------------------ settings

    def settings(self) -> Mapping[str, object]:
        return {"rerun.on": ",".join(self.on), "rerun.tolerance": self.tolerance}

    # ------------------------------------------------------------------ the tracker

    @staticmethod
    def read_tracker(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
        """The events of a tracker file, in order (``[]`` when it does not exist).  An incomplete
        last line (the process died while writing it) is left out."""
        path = Path(path)
        if not path.exists():
            return []
        events = []
        for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
            if not line.endswith("\n"):
                break
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return events

    @staticmethod
    def _append(tracker: Path, event: dict[str, Any]) -> None:
        """One line, one ``write`` on a file opened for appending, then ``fsync``."""
        tracker.parent.mkdir(parents=True, exist_ok=True)
        data = (json.dumps(event, sort_keys=True, allow_nan=False) + "\n").encode("utf-8")
        fd = os.open(tracker, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ data parallelism

    def watch(self, model: torch.nn.Module) -> torch.nn.Module:
        """Register a DDP communication hook on ``model`` (a ``DistributedDataParallel``) that notes,
        before each gradient bucket is all-reduced, whether this rank's own gradients hold a
        nan/inf: the rank where a non-finite value first appeared is then named (the event's
        ``ranks``).  Costs one ``isfinite`` pass over each bucket per backward; the bucket is then
        all-reduced as DDP's default does (``allreduce_hook``).  Returns ``model``."""
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(model, DistributedDataParallel):
            raise TypeError(
                f"Rerun.watch() takes a DistributedDataParallel model, got {type(model).__name__}; "
                "without DDP the window's own loss names nothing: leave watch() out"
            )
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        group = model.process_group

        def hook(state: object, bucket: Any) -> Any:
            bad = torch.isfinite(bucket.buffer()).logical_not().any()
            self._local_bad = bad if self._local_bad is None else self._local_bad | bad
            return allreduce_hook(group, bucket)

        hook.__annotations__ = {}  # (DDP compares them with its own classes: these are strings here)
        model.register_comm_hook(None, hook)
        self._watching = True
        return model

    # ------------------------------------------------------------------ the window's hooks

    def before_closure(self, closure: Callable[[], Any], index: int, window: int) -> None:
        if index == 0:
            self._closures, self._window = [closure], window
            self._rng = _RngStates()
            self._local_bad = None
        elif len(self._closures) == index and self._window == window:
            self._closures.append(closure)
        else:  # a micro-batch of the window came without a closure
            self._closures = []

    def rerun(self, w: Window, d: Any) -> list[Any] | None:
        if self._first is not None:  # the second decision
            first, self._first = self._first, None
            self._judge(w, d, first)
            return None
        outcome = self._outcome_of(d)
        trigger = self._trigger(outcome, local_loss=w.replica_group is None)
        if trigger is None:
            return None
        whole = len(self._closures) == w.micro_batches and self._window == w.number
        if not whole or self._rng is None or w.settings.scaled:
            self._cannot(w)
            return None
        self._first = {"trigger": trigger, **outcome, "ranks": self._first_ranks(w, d)}
        return self._execute(w)

    def _outcome_of(self, d: Any) -> dict[str, Any]:
        """The decision's total norm, loss and skip reason on the host (one read)."""
        loss = d.loss if isinstance(d.loss, Tensor) else torch.tensor(math.nan if d.loss is None else d.loss)
        reason = d.reason if isinstance(d.reason, Tensor) else torch.tensor(d.reason)
        device = d.total_norm.device
        parts = (d.total_norm, loss.to(device), reason.to(device))
        norm, value, code = torch.stack([t.reshape(()).double() for t in parts]).tolist()
        return {"total_norm": norm, "loss": None if d.loss is None else value, "reason": int(code)}

    def _trigger(self, outcome: Mapping[str, Any], local_loss: bool) -> str | None:
        """What makes the window an anomaly, or None.  Under data parallelism (``local_loss``
        False) only what the ranks agreed on counts -- the norm and the skip reason, not a rank's
        own loss -- so that every rank reruns or none."""
        loss = outcome["loss"] if local_loss else None
        if "nonfinite" in self.on and (
            not math.isfinite(outcome["total_norm"]) or (loss is not None and not math.isfinite(loss))
        ):
            return "nonfinite"
        if "spike" in self.on and outcome["reason"] == SPIKE:
            return "spike"
        return None

    def _cannot(self, w: Window) -> None:
        if self._warned:
            return
        self._warned = True
        why = (
            "a GradScaler's overflow skips are its calibration"
            if w.settings.scaled
            else "every micro-batch must be given as opt.step(closure=...)"
        )
        warnings.warn(
            f"Rerun: window {w.number} is an anomaly but cannot be executed again ({why}); it is decided "
            "as without a rerun (this warning is given once)",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )

    def _first_ranks(self, w: Window, d: Any) -> list[int] | None:
        """Under data parallelism: the ranks whose own gradients (:meth:`watch`) or else own loss
        held a non-finite value before the reduction (one all-gather); None without it."""
        if w.replica_group is None:
            return None
        import torch.distributed as dist

        device = d.total_norm.device
        if self._watching:
            local = self._local_bad if self._local_bad is not None else torch.zeros((), dtype=torch.bool)
        elif isinstance(d.loss, Tensor):
            local = torch.isfinite(d.loss).logical_not()
        else:
            local = torch.tensor(d.loss is not None and not math.isfinite(d.loss))
        flag = local.to(device, torch.float32).reshape(1)
        flags = [torch.zeros_like(flag) for _ in range(dist.get_world_size(w.replica_group))]
        dist.all_gather(flags, flag, group=w.replica_group)
        return [r for r, f in enumerate(torch.cat(flags).tolist()) if f > 0]

    def _execute(self, w: Window) -> list[Any]:
        """The window's closures again, on cleared gradients, from the first execution's RNG states."""
        for p in w.params:
            p.grad = None
        if self._rng is not None:  # (checked by rerun())
            self._rng.restore()
        try:
            with torch.enable_grad():
                return [closure() for closure in self._closures]
        except BaseException as exc:
            for p in w.params:  # part of the rerun's backward passes: never applied
                p.grad = None
            note = getattr(exc, "add_note", None)  # (Python 3.11+)
            if note is not None:
                note(f"clipopt: raised while Rerun ran window {w.number} again (its gradients were dropped)")
            raise

    def _judge(self, w: Window, d: Any, first: dict[str, Any]) -> None:
        """The second decision against the ``first``: persistent when the outcome is the same
        (agreed across the ranks)."""
        again = self._outcome_of(d)
        same = same_value(first["total_norm"], again["total_norm"], self.tolerance) and same_value(
            first["loss"], again["loss"], self.tolerance
        )
        if w.replica_group is not None:  # a rank whose own loss differed makes it transient on all
            import torch.distributed as dist

            differs = torch.tensor([0.0 if same else 1.0], device=d.total_norm.device)
            dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=w.replica_group)
            same = differs.item() == 0.0
        outcome = "persistent" if same else "transient"
        self._outcome = outcome
        self.counts[outcome] += 1
        self._event = {
            "window": w.number,
            "trigger": first["trigger"],
            "outcome": outcome,
            "first": {"total_norm": _json(first["total_norm"]), "loss": _json(first["loss"])},
            "rerun": {"total_norm": _json(again["total_norm"]), "loss": _json(again["loss"])},
            "ranks": first["ranks"],
            "time": time.time(),
        }

    def commit(self, w: Window, d: Any, skipped: bool | Tensor) -> None:
        self._closures, self._rng = [], None
        event, self._event = self._event, None
        if event is None:
            return
        event["applied"] = not bool(skipped)
        self.events.append(event)
        if self.tracker is not None and (w.replica_group is None or _rank(w.replica_group) == 0):
            self._append(self.tracker, event)

    def record(self, w: Window) -> None:
        w.cells[COLUMN], self._outcome = self._outcome, None

    # ------------------------------------------------------------------ undo and checkpoints

    def undo_state(self) -> Any:
        return dict(self.counts)

    def restore_undo(self, saved: Any) -> None:
        self.counts = dict(saved)
        self._first = self._event = self._outcome = None

    def state_dict(self) -> Any:
        return {"counts": dict(self.counts)}

    def check_state(self, saved: Any, inner: Optimizer) -> Any:
        counts = saved.get("counts") if isinstance(saved, Mapping) else None
        if not (
            isinstance(counts, Mapping)
            and set(counts) == set(OUTCOMES)
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in counts.values())
        ):
            raise ValueError(
                f"the state dict's 'rerun' entry must be {{'counts': {{'persistent': n, 'transient': n}}}}, "
                f"got {saved!r}; load a state dict saved by a ClippedOptimizer with a Rerun"
            )
        return {k: int(counts[k]) for k in OUTCOMES}

    def load_state(self, checked: Any) -> None:
        self.counts = dict(checked)


def _json(value: float | None) -> float | str | None:
    """A value as strict JSON holds it: a non-finite float as ``"nan"``, ``"inf"`` or ``"-inf"``."""
    if value is None or math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _rank(group: Any) -> int:
    import torch.distributed as dist

    return int(dist.get_rank(group))
