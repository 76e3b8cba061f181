"""Loggers: where each window's statistics go (``loggers=[...]``).

:class:`Loggers` is the part that ``loggers=[...]`` builds (an observer, :mod:`clipopt._part`): its
check, the stage it runs at (stage 7, :meth:`Loggers.report`, before anything else reads the
window's record) and what it asks of the diagnose stage (the candidate per-layer row of a bad
window, with ``layer_stats``).  It is off with no logger: a plain run calls nothing here.
"""

from __future__ import annotations

import atexit
import contextlib
import csv
import io
import itertools
import math
import os
import warnings
import weakref
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

from torch.optim import Optimizer

from .._caller import user_stacklevel
from .._checks import check_path, check_positive_int
from .._distributed.collectives import check_ranks, rank_target
from .._log_names import (
    BASE_COLUMNS,
    GROUP_KINDS,
    LOSS,
    RECOVERY_COLUMNS,
    UPDATE_COEF,
    UPDATE_COLUMNS,
    UPDATE_NORM,
    group_column,
    layer_column,
    lr_name,
)
from .._part import Part
from .files import WarnOnce, check_file_path, remove_stale_temps, write_atomic
from .layers import LAYER_FIELDS
from .stats import StepStats, materialize

__all__ = [
    "BASE_COLUMNS",
    "CSVLogger",
    "LogTo",
    "LoggedOptimizer",
    "Logger",
    "Loggers",
    "check_loggers",
    "format_value",
    "log_window",
]


class LoggedOptimizer(Protocol):
    """What a logger reads from the :class:`~clipopt.ClippedOptimizer` it is given.

    A protocol, so that this module does not import the optimizer (imports point one way:
    ``_optimizer`` -> ``_diagnostics.loggers``).
    """

    #: Per-layer statistics every this many windows (0: never).
    layer_stats: int

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    def layer_names(self) -> list[str]: ...


@runtime_checkable
class Logger(Protocol):
    """What ``ClippedOptimizer(loggers=[...])`` accepts: two methods.

    ``log(stats, optimizer)`` is called at the end of every window, on the
    training thread, with that window's :class:`~clipopt.StepStats` (device
    values not read yet) and the :class:`~clipopt.ClippedOptimizer`
    (``p.grad`` still holds the window's processed gradients — ``None`` after a
    skip decided on the host; ``stats.layers`` holds the per-parameter
    statistics when they were due).  Reading a device value is a
    host-device sync: buffer the stats and convert many at once with
    :func:`clipopt.materialize`, as :class:`CSVLogger` does.

    ``close()`` flushes and releases; it may be called more than once.

    A W&B logger, for instance::

        class WandbLogger:
            def __init__(self, every=100):
                self.buffer, self.every = [], every
            def log(self, stats, optimizer):
                self.buffer.append(stats)
                if len(self.buffer) >= self.every:
                    self.close()
            def close(self):
                clipopt.materialize(self.buffer)
                for s in self.buffer:
                    wandb.log({"grad/total_norm": s.total_norm, "grad/skipped": s.skipped}, step=s.step)
                self.buffer.clear()
    """

    def log(self, stats: StepStats, optimizer: LoggedOptimizer) -> None: ...

    def close(self) -> None: ...


#: Rows a :class:`CSVLogger` keeps while its writes fail, at most (or ``flush_every`` if larger).
MAX_BUFFERED_ROWS = 10_000


_LOGGER_WARNINGS: weakref.WeakKeyDictionary[Any, WarnOnce] = weakref.WeakKeyDictionary()
_SHARED_WARNINGS = WarnOnce()  # for loggers that cannot be weakly referenced


#: This process's live CSVLoggers by a key their pickles carry, so that a copy made while its
#: original lives leaves the rows buffered then to the original (see CSVLogger.__setstate__).
_LIVE_LOGGERS: weakref.WeakValueDictionary[int, CSVLogger] = weakref.WeakValueDictionary()
_LOGGER_KEYS: weakref.WeakKeyDictionary[CSVLogger, int] = weakref.WeakKeyDictionary()
_NEXT_KEY = itertools.count()


def _track(logger: CSVLogger) -> None:
    """Give ``logger`` its key among the live loggers and register its flush at exit."""
    key = next(_NEXT_KEY)
    _LIVE_LOGGERS[key], _LOGGER_KEYS[logger] = logger, key
    atexit.register(_close_at_exit, weakref.ref(logger))


def _warnings_of(logger: Any) -> WarnOnce:
    try:
        return _LOGGER_WARNINGS.setdefault(logger, WarnOnce())
    except TypeError:
        return _SHARED_WARNINGS


def log_window(loggers: list[Logger], stats: StepStats, optimizer: LoggedOptimizer) -> None:
    """Hand ``stats`` to every logger.  A logger's ``OSError`` (disk full, a file removed) never
    interrupts training: it warns once per logger and cause, and the next window is logged again.
    Other errors (a bug in a custom logger) propagate, after the window is complete."""
    for logger in loggers:
        try:
            logger.log(stats, optimizer)
        except OSError as exc:
            _warnings_of(logger)(
                exc,
                f"clipopt: {type(logger).__name__} could not write this window's statistics ({exc}); "
                "training continues (this warning is shown once per cause)",
            )


class NoLoggers(list):  # type: ignore[type-arg]
    """What ``opt.loggers`` reads while no logger is on: an empty list that refuses to grow, since a
    logger appended to it would never be called (logging is turned on by assigning a list)."""

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "opt.loggers is off (the wrapper was built without loggers), so a logger added to it "
            "would never be called; assign a list instead: opt.loggers = [CSVLogger('grads.csv')]"
        )

    append = extend = insert = __iadd__ = __setitem__ = _refuse


class LogTo:
    """The optimizer the loggers are handed with each window's statistics, referred to weakly (the
    window's runtime does not keep the optimizer alive); a copy refers to nothing until its
    optimizer binds a new one (``ClippedOptimizer.__setstate__``).  Called: the optimizer, or None."""

    __slots__ = ("_ref",)

    def __init__(self, optimizer: Any = None) -> None:
        self._ref = None if optimizer is None else weakref.ref(optimizer)

    def __call__(self) -> Any:
        return None if self._ref is None else self._ref()

    def __reduce__(self) -> tuple[type[LogTo], tuple[()]]:
        return (LogTo, ())


def check_loggers(loggers: Any) -> list[Logger]:
    """``loggers``: an iterable of objects with ``log`` and ``close``."""
    if isinstance(loggers, (str, bytes)) or not hasattr(loggers, "__iter__"):
        raise TypeError(
            f"loggers must be a list of loggers, got {type(loggers).__name__}; "
            "pass e.g. loggers=[CSVLogger('grads.csv')]"
        )
    out = list(loggers)
    for logger in out:
        if not isinstance(logger, Logger):
            raise TypeError(
                f"loggers must hold objects with log(stats, optimizer) and close() methods, "
                f"got {type(logger).__name__}; pass e.g. loggers=[CSVLogger('grads.csv')]"
            )
    return out


class Loggers(Part):
    """The part ``loggers=[...]`` builds: every window's :class:`StepStats` handed to each logger.

    Off without a logger (``opt.loggers`` then reads ``[]``); ``opt.loggers`` is the list the
    loggers are called from, assignable mid-run (checked as the constructor checks it).  Never part
    of the ranks' agreement (a logger on rank 0 only is usual), no state-dict entry.
    """

    keyword: ClassVar[str] = "loggers"
    observer: ClassVar[bool] = True

    def __init__(self, loggers: list[Logger]) -> None:
        self.loggers = loggers

    @classmethod
    def build(cls, value: Any, inner: Optimizer) -> Part | None:
        loggers = check_loggers(value)
        return cls(loggers) if loggers else None

    def value(self) -> list[Logger]:
        return self.loggers

    @classmethod
    def unset(cls) -> list[Logger]:
        return NoLoggers()

    def configure(self, diagnostics: Any) -> None:
        diagnostics.logged = True  # a bad window's per-layer row is kept for them (with layer_stats)

    def report(self, stats: StepStats, optimizer: Any) -> None:
        """Hand ``stats`` to the loggers (``optimizer``: the wrapper, None once it is gone); an
        ``OSError`` warns (:func:`log_window`)."""
        if optimizer is not None and self.loggers:
            log_window(self.loggers, stats, optimizer)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def format_value(value: Any) -> str:
    """A CSV cell: '' for None, 0/1 for bools, repr precision for floats ('nan', 'inf')."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    return str(value)


class CSVLogger:
    """One CSV row per window: the record from which explosion and vanishing are counted.

    Columns, stable across versions: :data:`BASE_COLUMNS` — ``step``,
    ``micro_batches``, ``total_norm`` (pre-clip), ``clip_coef``, ``clipped``
    (0/1), ``skipped`` (0/1), ``reason`` (empty or a ``StepStats.reason``: ``nonfinite``,
    ``overflow``, ``spike``, ``divergence``, ``nograd``, ``rewind``),
    ``max_norm`` (empty when off), ``lr`` (group 0), ``loss`` (the window's loss, empty when
    none was given to ``step(loss=...)``) — then ``lr.<g>`` for further
    parameter groups, then, with a :class:`~clipopt.Rewind`, ``batch_start`` and
    ``batch_end`` (the batches ``opt.rewind.batches()`` drew during the window,
    ``batch_start <= n < batch_end``), ``lr_factor`` (with ``lr_cut``: the factor
    the window's learning rates were multiplied by) and ``state_reset`` (with
    ``reset_state``: 1 where a rewind zeroed the moment buffers), then, with
    per-group clipping (a group carries its own ``max_norm`` or ``clip_value``),
    ``group_norm.<g>`` and ``group_coef.<g>``
    for every group (see :attr:`StepStats.group_norms`), then, with ``update_clip`` or
    ``update_stats=True``, ``update_norm`` and ``update_coef`` (see
    :attr:`StepStats.update_norm`), then, when the
    optimizer has ``layer_stats`` on, for every
    parameter ``<name>.grad_norm``, ``.grad_max``, ``.grad_min``, ``.nonfinite``,
    ``.param_norm`` (empty in rows where they were not due).  When a parameter
    group is added during the run the file is rewritten once with the new
    columns, earlier rows left empty there; a file with more columns than this
    run needs (one that saw a later group) is appended to in its own order.

    Rows are buffered and written every ``flush_every`` windows, on
    :meth:`close` and at interpreter exit; converting a buffer is one host read.
    An existing file with the same columns is appended to (a resumed run adds
    no second header); one with different columns is an error.  A last row
    torn by a crash (no line end) is cut off before the first append.  A write
    that fails (disk full) never interrupts training: it warns once per cause
    and the rows are written at the next flush.  A ``path`` that is a
    directory, or lies below a regular file, is refused here.

    Args:
        path: the CSV file; its folder is created.
        flush_every: windows per write.
        ranks: under ``torch.distributed`` with several processes, ``"zero"``
            (default): only rank 0 writes; ``"all"``: every rank writes its own
            file, ``<stem>-rank<r><suffix>``.  Decided at the first row.
    """

    def __init__(self, path: str | os.PathLike[str], flush_every: int = 100, *, ranks: str = "zero") -> None:
        self.path = Path(check_path("path", path, "grads.csv"))
        check_file_path("path", self.path, "grads.csv")
        self.flush_every = check_positive_int("flush_every", flush_every, 100)
        self.max_buffered = max(MAX_BUFFERED_ROWS, self.flush_every)
        self.rows_dropped = 0  # rows given up after writes kept failing (see max_buffered)
        self._warn = WarnOnce()
        self._opened = False  # the file's tail was checked (a torn last row repaired)
        self.ranks = check_ranks(ranks)
        self._target: Path | bool | None = False  # False: not decided yet; None: this rank does not write
        self.columns: list[str] | None = None
        self._names: list[str] = []
        self._groups = 1
        self._per_group = False  # group_norm.<g> / group_coef.<g> columns
        self._update = False  # update_norm / update_coef columns
        self._recovery: list[str] = []  # a Rewind's columns (clipopt._log_names.RECOVERY_COLUMNS)
        self._buffer: list[StepStats] = []
        self._closed = False
        _track(self)

    def __getstate__(self) -> dict[str, Any]:
        """The attributes, and where the pickle was made (this process, this logger's key)."""
        return {**self.__dict__, "_origin": (os.getpid(), _LOGGER_KEYS.get(self))}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """An unpickled logger (a wrapper pickled with rows still buffered) also writes at exit.

        A copy made in the process whose original still lives (a pickle round trip, ``copy``)
        leaves the rows buffered then to the original, which writes them: each row is written once.
        """
        state = dict(state)
        pid, key = state.pop("_origin", (None, None))
        self.__dict__.update(state)
        if pid == os.getpid() and key is not None and _LIVE_LOGGERS.get(key) is not None:
            self._buffer = []  # a new list: copy.copy shares the original's
        _track(self)

    def log(self, stats: StepStats, optimizer: LoggedOptimizer) -> None:
        """Buffer one window; write the buffer every ``flush_every`` windows."""
        if self._target is False:
            self._target = rank_target(self.path, self.ranks)
            self.path = self._target or self.path
        if self._target is None:  # another rank writes
            return
        per_group, update = stats.has_group_stats, stats.has_update_stats
        cells = [c for c in stats.recovery if c not in self._recovery]  # a part's first cells (max_logit)
        if self.columns is None:
            self._per_group, self._update = per_group, update
            self._recovery = list(stats.recovery)
            self._set_columns(optimizer, len(stats.lr))
        elif len(stats.lr) != self._groups or per_group > self._per_group or update > self._update or cells:
            self._per_group = self._per_group or per_group  # columns are never taken away
            self._update = self._update or update
            self._recovery += cells
            self._widen(optimizer, len(stats.lr))
        self._buffer.append(stats)
        self._closed = False
        if len(self._buffer) >= self.flush_every:
            self.flush()

    def _columns_for(self, optimizer: LoggedOptimizer, groups: int) -> tuple[list[str], list[str]]:
        """The columns a new logger uses for ``optimizer`` with ``groups`` groups, and the layer names."""
        columns = list(BASE_COLUMNS) + [lr_name(g) for g in range(1, groups)] + self._recovery
        if self._per_group:
            columns += [group_column(kind, g) for g in range(groups) for kind in GROUP_KINDS]
        if self._update:
            columns += UPDATE_COLUMNS
        names = optimizer.layer_names() if optimizer.layer_stats else []
        columns += [layer_column(name, field) for name in names for field in LAYER_FIELDS]
        return columns, names

    def _set_columns(self, optimizer: LoggedOptimizer, groups: int) -> None:
        columns, names = self._columns_for(optimizer, groups)
        existing = self._existing_header()
        older = {LOSS, *RECOVERY_COLUMNS}  # files of earlier versions: no loss, no Rewind columns
        if existing is not None and not set(columns) - older <= set(existing):
            raise ValueError(
                f"{self.path} already holds a CSV log with other columns "
                f"({len(existing)} vs {len(columns)}: a different model or layer_stats setting); "
                "pass a new path to CSVLogger"
            )
        # a file with more columns (written after a later add_param_group) is appended to in its order
        self.columns, self._names, self._groups = existing or columns, names, groups

    def _widen(self, optimizer: LoggedOptimizer, groups: int) -> None:
        """Parameter groups were added (or the first cells of a part, e.g. ``max_logit`` after a first
        window without gradients): write what is buffered, then rewrite the file once with the new
        columns (in the order a new logger would use, so a resumed run appends), old rows padded.

        A failed rewrite warns and keeps the old columns (the new groups are not logged)."""
        self.flush()
        columns, names = self._columns_for(optimizer, groups)
        existing = self._existing_header()
        if existing is not None and not set(columns) <= set(existing):
            columns += [c for c in existing if c not in set(columns)]

            def rewrite(dst: Any) -> None:
                with self.path.open(newline="") as src:
                    writer = csv.DictWriter(dst, columns, restval="")
                    writer.writeheader()
                    writer.writerows(csv.DictReader(src))

            try:
                write_atomic(self.path, rewrite, binary=False)
            except OSError as exc:
                warnings.warn(
                    f"clipopt could not rewrite {self.path} with the columns of the new parameter "
                    f"group ({exc}); it keeps its columns and the new group is not logged",
                    RuntimeWarning,
                    stacklevel=user_stacklevel(),
                )
                self._groups = groups  # do not retry every window
                return
        elif existing is not None:
            columns = existing
        self.columns, self._names, self._groups = columns, names, groups

    def _existing_header(self) -> list[str] | None:
        """The header of the existing file (None: no file, an empty one, or one that cannot be read)."""
        if not self._opened:  # once: a last row (or header) torn by a crash is cut off first
            self._opened = True
            with contextlib.suppress(OSError):
                remove_stale_temps(self.path.parent, self.path.name)
                repair_torn_tail(self.path)
        try:
            if not self.path.exists() or self.path.stat().st_size == 0:
                return None
            with self.path.open(newline="") as f:
                return next(csv.reader(f), None)
        except OSError:
            return None
        except (UnicodeDecodeError, csv.Error) as exc:  # never append text to someone's binary file
            raise ValueError(
                f"path={str(self.path)!r} already exists and is not a CSV log ({exc}); "
                "pass a new path to CSVLogger, such as 'grads.csv'"
            ) from exc

    def _row(self, s: StepStats) -> dict[str, str]:
        lr: list[float | None] = list(s.lr[: self._groups])
        lr += [None] * (self._groups - len(lr))
        row = [s.step, s.micro_batches, s.total_norm, s.clip_coef, s.clipped, s.skipped, s.reason, s.max_norm]
        names = [*BASE_COLUMNS[:-2], *(lr_name(g) for g in range(self._groups))]
        cells = dict(zip(names, (format_value(v) for v in (*row, *lr)), strict=True))
        cells[LOSS] = format_value(s.loss) if s.has_loss else ""
        cells.update({name: format_value(getattr(s, name)) for name in s.recovery})  # a 0-d tensor: read once
        if s.has_update_stats:
            cells[UPDATE_NORM], cells[UPDATE_COEF] = format_value(s.update_norm), format_value(s.update_coef)
        for g, pair in enumerate(zip(s.group_norms, s.group_coefs, strict=True)):
            for kind, value in zip(GROUP_KINDS, pair, strict=True):
                cells[group_column(kind, g)] = format_value(value)
        layers = s.logged_layers() if self._names else None
        if layers is not None:
            values = layers.as_dict()
            for name in self._names:
                stats = values.get(name)
                if stats:
                    cells.update({layer_column(name, f): format_value(stats[f]) for f in LAYER_FIELDS})
        return cells

    def flush(self) -> None:
        """Write the buffered rows now (one host read for all of them).

        A write that fails (disk full, file removed, no permission) warns once per
        cause and keeps the rows buffered for the next flush (at most
        ``max_buffered``; older ones are then dropped and counted in
        ``rows_dropped``): logging never interrupts training.
        """
        if not self._buffer or self.columns is None:
            return
        materialize(self._buffer)
        try:
            self._append(self._buffer)
        except (OSError, csv.Error) as exc:
            excess = len(self._buffer) - self.max_buffered
            if excess > 0:
                del self._buffer[:excess]
                self.rows_dropped += excess
            self._warn(
                exc,
                f"clipopt could not write to the CSV log {self.path} ({exc}); training continues, "
                f"rows are kept and written at the next flush (this warning is shown once per cause)",
            )
            return
        self._buffer.clear()

    def _append(self, rows: list[StepStats]) -> None:
        """Append ``rows`` (and the header to a new file) in one write.

        Before the first write a last row torn by a crash (no line end) is cut
        off, so the new rows never continue it, and temporaries left by a
        killed writer are removed (see :meth:`_existing_header`).
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = self._existing_header() is None
        text = io.StringIO()
        writer = csv.DictWriter(text, self.columns or [], restval="", extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerows(self._row(s) for s in rows)
        append_bytes(self.path, text.getvalue().encode())

    def close(self) -> None:
        """Write what is buffered; the logger may still be used afterwards."""
        self.flush()
        self._closed = True

    def __repr__(self) -> str:
        return f"CSVLogger({str(self.path)!r}, flush_every={self.flush_every})"


def append_bytes(path: Path, data: bytes) -> None:
    """Append ``data`` to ``path`` (created if missing); after a partial write (disk full) the file is
    cut back to its previous size, so a retry never continues a torn row."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def repair_torn_tail(path: Path) -> bool:
    """Cut a last line without a line end (a row torn by a crash) off ``path``; True if one was.

    A file whose only line is torn (the header itself) is emptied.  Missing files are left alone, and
    so are files that are not clipopt logs (their header is not :data:`BASE_COLUMNS`): another
    program's CSV may end without a line end, and its last row is not ours to cut.
    """
    base = ",".join(BASE_COLUMNS).encode()
    try:
        with path.open("rb+") as f:
            if not base.startswith(f.read(len(base))):  # shorter only at the end of a torn header
                return False
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return False
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return False
            keep = 0
            position = size
            while position > 0 and keep == 0:
                start = max(0, position - 65536)
                f.seek(start)
                chunk = f.read(position - start)
                cut = chunk.rfind(b"\n")
                if cut >= 0:
                    keep = start + cut + 1
                position = start
            f.truncate(keep)
    except FileNotFoundError:
        return False
    warnings.warn(
        f"clipopt: the last row of {path} was torn (a run killed while writing); it was removed "
        "before appending",
        RuntimeWarning,
        stacklevel=user_stacklevel(),
    )
    return True


def _close_at_exit(ref: weakref.ref[CSVLogger]) -> None:
    """Write what ``ref``'s logger still buffers; rows that cannot be written now are lost: say so,
    even when their cause was warned about during training (that warning promised a next flush)."""
    logger = ref()
    if logger is None:
        return
    logger.close()
    if logger._buffer:
        warnings.warn(
            f"clipopt could not write the last {len(logger._buffer)} rows of the CSV log "
            f"{logger.path} at exit; they are lost (call opt.close() while the disk can still be written)",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )
