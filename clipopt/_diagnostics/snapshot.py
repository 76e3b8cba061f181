"""Anomaly snapshots: what is needed to reproduce an update that went bad.

:class:`Snapshots` is the part ``snapshot_dir=...`` builds (an observer, :mod:`clipopt._part`): its
check, ``opt.snapshot_dir``, and the :class:`SnapshotWriter` it hands the diagnose stage
(:class:`~clipopt._window.diagnose.Diagnostics`, which decides when a window is saved).
"""

from __future__ import annotations

import datetime
import os
import platform
import stat
import warnings
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.optim import Optimizer

from .._caller import user_stacklevel
from .._distributed.collectives import has_dtensor
from .._part import Part
from .files import WarnOnce, remove_stale_temps, write_atomic

__all__ = [
    "DTENSOR_DIAGNOSTICS",
    "SNAPSHOT_FORMAT",
    "SnapshotWriter",
    "Snapshots",
    "check_snapshot_dir",
    "check_saveable",
    "load_snapshot",
    "process_rank",
    "to_saveable",
    "versions",
]

#: Why ``snapshot_dir`` is refused with DTensor parameters.
DTENSOR_DIAGNOSTICS = (
    "snapshot_dir does not support DTensor (FSDP2) parameters yet: each rank holds only "
    "shards; pass snapshot_dir=None (norms, clipping, skipping, layer_stats and loggers work)"
)

#: Version of the snapshot layout.
SNAPSHOT_FORMAT = 1

#: Keys every snapshot has.
SNAPSHOT_KEYS = (
    "format",
    "step",
    "reason",
    "micro_batches",
    "total_norm",
    "params",
    "grads",
    "optimizer",
    "layer_stats",
    "attached",
    "versions",
    "time",
)


def versions() -> dict[str, str]:
    """Versions of what produced a snapshot."""
    from .._version import __version__

    return {
        "clipopt": __version__,
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def check_saveable(value: Any, name: str) -> None:
    """Raise the ``TypeError`` of :func:`to_saveable` without copying anything."""
    if isinstance(value, Tensor) or value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_saveable(v, f"{name}[{i}]")
        return
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        for k, v in value.items():
            check_saveable(v, f"{name}[{k!r}]")
        return
    raise TypeError(
        f"attach() got {name}={type(value).__name__}, which a snapshot cannot hold; "
        "pass tensors, numbers, strings, or lists/dicts of them"
    )


def to_saveable(value: Any, name: str) -> Any:
    """A CPU copy of ``value`` that ``torch.load(weights_only=True)`` can read.

    Tensors (detached CPU copies), numbers, strings, None, and lists, tuples and
    string-keyed dicts of those; anything else is a ``TypeError`` naming ``name``.
    """
    if isinstance(value, Tensor):
        return value.detach().to("cpu", copy=True)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(to_saveable(v, f"{name}[{i}]") for i, v in enumerate(value))
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: to_saveable(v, f"{name}[{k!r}]") for k, v in value.items()}
    check_saveable(value, name)  # raises
    return value


def process_rank() -> int | None:
    """This process's rank when torch.distributed runs more than one process, else None."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return int(dist.get_rank())
    return None


class SnapshotWriter:
    """Writes snapshots atomically into ``directory``, at most ``max_snapshots`` per reason.

    The first ``max_snapshots`` anomalies of each reason (``nonfinite``,
    ``spike``) of a run are kept (the first one is usually the informative one),
    so frequent spikes never use up the room of a later non-finite window; later
    ones are counted, not written.  A write that fails (disk full, no permission)
    warns and returns None: training goes on.
    """

    def __init__(self, directory: str | os.PathLike[str], max_snapshots: int) -> None:
        self.directory = Path(directory)
        self.max_snapshots = max_snapshots
        self.saved: dict[str, list[str]] = {}  # reason -> paths written
        self.not_saved: dict[str, int] = {}  # reason -> anomalies over the limit
        self.failed = 0  # snapshots that could not be written
        self._cleaned = False
        self._warn = WarnOnce()

    def admit(self, reason: str) -> bool:
        """Whether a ``reason`` snapshot may still be written; if not, count it (and warn the first
        time).  Asked before the payload is built, so anomalies over the limit (a GradScaler's
        routine overflows) copy nothing."""
        if len(self.saved.get(reason, [])) < self.max_snapshots:
            return True
        if not self.not_saved.get(reason):
            warnings.warn(
                f"clipopt: {self.max_snapshots} {reason} snapshots are in {self.directory}; "
                f"further {reason} anomalies are not saved (raise max_snapshots to keep more)",
                RuntimeWarning,
                stacklevel=user_stacklevel(),  # the user's step() call
            )
        self.not_saved[reason] = self.not_saved.get(reason, 0) + 1
        return False

    def save(self, payload: dict[str, Any]) -> str | None:
        """Write ``payload`` as ``anomaly-step<step>-<reason>.pt``; return its path, or None.

        With several processes (torch.distributed) the name ends in ``-rank<r>``:
        each rank saves its own attached batch.
        """
        reason = payload["reason"]
        if not self.admit(reason):
            return None
        saved = self.saved.setdefault(reason, [])
        rank = process_rank()
        suffix = "" if rank is None else f"-rank{rank}"  # data parallel: every rank saves its own batch
        path = self.directory / f"anomaly-step{payload['step']:08d}-{reason}{suffix}.pt"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            if not self._cleaned:  # temporaries of a writer killed mid-write
                remove_stale_temps(self.directory, "anomaly-step")
                self._cleaned = True
            write_atomic(path, lambda f: torch.save(payload, f))
        except (OSError, RuntimeError) as exc:
            self.failed += 1
            self._warn(
                exc,
                f"clipopt could not write the anomaly snapshot {path} ({exc}); training continues "
                "(this warning is shown once per cause)",
            )
            return None
        saved.append(str(path))
        return str(path)


def check_snapshot_dir(snapshot_dir: Any) -> None:
    """``snapshot_dir``: a path or None."""
    if snapshot_dir is not None and not isinstance(snapshot_dir, (str, os.PathLike)):
        raise TypeError(
            f"snapshot_dir must be a path or None, got {type(snapshot_dir).__name__}; "
            "pass e.g. snapshot_dir='anomalies/'"
        )


class Snapshots(Part):
    """The part ``snapshot_dir=...`` builds: a :class:`SnapshotWriter` into that folder, which the
    diagnose stage writes an anomalous window's snapshot with (at most ``max_snapshots`` per reason:
    the wrapper's setting, handed over by ``Diagnostics.configure``).

    ``opt.snapshot_dir`` reads the folder as given (None when off).  Never part of the ranks'
    agreement, no state-dict entry.
    """

    keyword: ClassVar[str] = "snapshot_dir"
    observer: ClassVar[bool] = True

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = directory
        self.writer = SnapshotWriter(directory, max_snapshots=10)  # (its limit: configure)

    @classmethod
    def build(cls, value: Any, inner: Optimizer) -> Part | None:
        check_snapshot_dir(value)
        if value is None:
            return None
        if has_dtensor([p for g in inner.param_groups for p in g["params"]]):
            raise ValueError(DTENSOR_DIAGNOSTICS)
        return cls(value)

    def value(self) -> str | os.PathLike[str]:
        return self.directory

    def configure(self, diagnostics: Any) -> None:
        diagnostics.writer = self.writer


def load_snapshot(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a snapshot written by clipopt (``torch.load(path, weights_only=True)`` plus checks).

    Returns a dict with at least ``step``, ``reason``, ``micro_batches``,
    ``total_norm``, ``params`` and ``grads`` (parameter name -> tensor, so
    ``model.load_state_dict(snap["params"], strict=False)`` restores the
    weights), ``optimizer`` (state dict), ``layer_stats`` (name -> statistics),
    ``attached`` (name -> what ``attach`` received), ``versions`` and ``time``;
    snapshots of this version also hold ``rank`` (under torch.distributed, else
    None) and ``scale`` (with a GradScaler: the loss scale of the window's
    backward, reason ``"overflow"`` for a non-finite window; else None).
    """
    name = os.fspath(path)
    if os.path.exists(name) and not stat.S_ISREG(os.stat(name).st_mode):  # a folder, a FIFO, a device
        kind = "a directory" if os.path.isdir(name) else "not a regular file"
        raise ValueError(f"{name} is {kind}; pass one snapshot file (anomaly-step*.pt)")
    not_torch = _not_a_torch_file(name)
    if not_torch is not None:
        raise ValueError(
            f"{name} is not a clipopt snapshot: {not_torch}; "
            "pass a file that ClippedOptimizer(snapshot_dir=...) wrote (anomaly-step*.pt)"
        )
    try:
        snap = torch.load(name, weights_only=True, map_location="cpu")
    except OSError:
        raise
    except Exception as exc:  # not a torch file, a truncated one, or a pickle weights_only refuses
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ValueError(
            f"{name} is not a clipopt snapshot (torch.load failed: {first}); "
            "pass a file that ClippedOptimizer(snapshot_dir=...) wrote"
        ) from exc
    if not isinstance(snap, dict) or snap.get("format") != SNAPSHOT_FORMAT:
        raise ValueError(
            f"{name} is not a clipopt snapshot (format {SNAPSHOT_FORMAT}); "
            "pass a file that ClippedOptimizer(snapshot_dir=...) wrote"
        )
    missing = [k for k in SNAPSHOT_KEYS if k not in snap]
    if missing:
        raise ValueError(f"{name} is a damaged clipopt snapshot: it lacks {', '.join(missing)}")
    wrong = [k for k, ok in _SNAPSHOT_TYPES.items() if not ok(snap[k])]
    if wrong:
        shown = ", ".join(f"{k} ({type(snap[k]).__name__})" for k in wrong)
        raise ValueError(f"{name} is a damaged clipopt snapshot: wrong type of {shown}")
    return snap


#: How the files ``torch.save`` writes begin: a zip archive, or (legacy format) a pickle.
_TORCH_FILE_STARTS = (b"PK\x03\x04", b"\x80")


def _not_a_torch_file(name: str) -> str | None:
    """Why ``name`` cannot be a ``torch.save`` file, judged from its first bytes; None when it may be one.

    A text file (a CSV log, a JSON state) gets its own reason, which points to ``clipopt report``.
    Raises OSError when the file cannot be read.
    """
    with open(name, "rb") as f:
        head = f.read(4096)
    if not head:
        return "the file is empty"
    if head.startswith(_TORCH_FILE_STARTS):
        return None
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:  # a multi-byte character cut at the end of the block is still text
        text = head[: exc.start].decode("utf-8") if exc.start > len(head) - 4 else ""
    if text and "\x00" not in text:
        return "it is a text file, not one torch.save wrote (a training log? clipopt report reads those)"
    return "it is not a file that torch.save wrote"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _tensors_by_name(value: Any) -> bool:
    if not isinstance(value, dict):
        return False
    return all(isinstance(k, str) and isinstance(v, Tensor) for k, v in value.items())


#: What each key of a snapshot must hold.
_SNAPSHOT_TYPES: dict[str, Any] = {
    "step": _is_int,
    "reason": lambda v: isinstance(v, str),
    "micro_batches": _is_int,
    "total_norm": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "params": _tensors_by_name,
    "grads": _tensors_by_name,
    "optimizer": lambda v: isinstance(v, dict),
    "layer_stats": lambda v: isinstance(v, dict) and all(isinstance(s, dict) for s in v.values()),
    "attached": lambda v: isinstance(v, dict),
    "versions": lambda v: isinstance(v, dict),
    "time": lambda v: isinstance(v, str),
}


def now() -> str:
    """The current UTC time, ISO 8601."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
