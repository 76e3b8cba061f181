"""Reading a training log for ``clipopt report``: every format into one :class:`GradLog`.

The step, norm, loss and learning-rate columns (tags, keys) of every format
are chosen from one table of recognised names, :mod:`clipopt._report_names`;
:class:`Names` (``--loss``, ``--norm``) chooses others.  Formats (docs/cli.md, 'clipopt report'):

- a CSV written by :class:`~clipopt.CSVLogger`, or any CSV with a step column and
  a gradient-norm column, plus loss and lr columns when present.  Rows are
  streamed: the file is never held whole, only its columns, each as one
  ``array('d')``.  Lightning's ``metrics.csv`` writes different metrics of one
  step in separate rows; the values of one step are merged into one row.
- a Hugging Face Trainer ``trainer_state.json`` (``log_history`` entries with
  ``step``, ``grad_norm``, ``loss``, ``learning_rate``), or a folder holding
  one (the latest ``checkpoint-*`` one when only those do);
- a TensorBoard run's folder (needs the ``tensorboard`` package): its norm,
  loss and lr tags (Lightning's per-layer ``grad_2.0_norm/<name>`` too) and
  clipopt's own tags (``clipopt/clipped``, per-layer
  ``clipopt/layers/<name>/<field>``, per-group ``clipopt/group_norm/<g>`` and
  ``clipopt/group_coef/<g>``).  A folder holding several runs
  (:func:`tensorboard_runs`) is never merged: one run is read, by name.

clipopt's per-group columns (``group_norm.<g>``, ``group_coef.<g>``: per-group
clipping) are read into :attr:`GradLog.groups`.

Every failure is a :class:`ValueError` (or :class:`OSError`) with one line that
names the file and says what was expected.  A missing loss is ``nan``; a loss
that was recorded but not finite reads as ``inf``.
"""

from __future__ import annotations

import csv
import gc
import glob
import json
import math
import os
import re
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from operator import itemgetter
from typing import Any

import torch

from ._layers import LAYER_FIELDS
from ._log_names import CLIPPED, GROUP_COLUMN, GROUP_TAG, LAYERS_TAG, MAX_NORM, REASON, SKIPPED, column_tag
from ._reasons import NONFINITE, REASONS, by_code
from ._report_names import LOSS_NAMES, LR_NAMES, NORM_NAMES, STEP_NAMES, choose, pick

__all__ = [
    "LOSS_NAMES",
    "LR_NAMES",
    "NORM_NAMES",
    "STEP_NAMES",
    "GradLog",
    "Names",
    "read_log",
    "tensorboard_runs",
]

_LIGHTNING_LAYER = re.compile(r"grad_(?:[0-9.]+|inf)_norm/(.+)")
#: clipopt's TensorBoard tags read by exact name (``clipopt/<key>``), besides the norm, loss, lr and
#: the skip reasons' tags (each reason's ``tag`` in :data:`clipopt._reasons.REASONS`).
_CLIPOPT_TAGS = (MAX_NORM, CLIPPED, SKIPPED)
#: The reason of a skipped window whose log names none (TensorBoard logs of earlier versions tagged
#: only some reasons; an untagged skip was a non-finite one).
_UNMARKED = by_code(NONFINITE).name
_NAN = math.nan
#: Rows converted column by column at once.
_CHUNK = 16384
_FLAGS = {"0": 0, "1": 1, "": 0, "True": 1, "False": 0, "true": 1, "false": 0, "0.0": 0, "1.0": 1}
#: How many bytes of the file's start are checked for binary content.
_SNIFF = 4096
_EXPECTED = (
    "a step column and a gradient-norm column (total_norm, grad_norm, gradient_norm, a name ending "
    "in total_norm or grad_norm such as Grad/total_norm, or Lightning's grad_2.0_norm_total)"
)


@dataclass
class GradLog:
    """A training log, one entry per update (row), in file order.

    Float columns are ``array('d')``; ``nan`` stands for "not recorded".
    ``loss`` is ``inf`` where a loss was recorded but was not finite.
    ``max_norm`` is ``inf`` where a policy set no bound.  ``reason`` maps a row
    to its skip reason (rows without one are absent).  Per-layer statistics
    exist only in the rows listed in ``layer_rows``; ``layers[name][field]``
    is aligned with ``layer_rows``.  ``source`` names the format;
    ``has_clipping`` is True when the log records clipping (clipopt's
    ``clipped``/``max_norm`` columns); ``notes`` says what reading skipped.
    ``counted`` names the layers whose non-finite element count the log has a
    column (or tag) for: clipopt's, not Lightning's.  ``groups[g]`` holds
    parameter group ``g``'s ``"norm"`` and ``"coef"`` (per-group clipping), one
    value per row, ``nan`` where not recorded; empty without per-group clipping.
    ``norm_column`` and ``loss_column`` name the column (tag, key) read as the
    norm and the loss (None: no loss); ``ignored`` lists those read as nothing,
    in the log's order; ``run`` names the TensorBoard run read (None: the
    path holds one).
    """

    path: str
    source: str
    steps: array[int] = field(default_factory=lambda: array("q"))
    total_norm: array[float] = field(default_factory=lambda: array("d"))
    loss: array[float] = field(default_factory=lambda: array("d"))
    lr: array[float] = field(default_factory=lambda: array("d"))
    max_norm: array[float] = field(default_factory=lambda: array("d"))
    clipped: bytearray = field(default_factory=bytearray)
    skipped: bytearray = field(default_factory=bytearray)
    reason: dict[int, str] = field(default_factory=dict)
    layer_rows: array[int] = field(default_factory=lambda: array("q"))
    layers: dict[str, dict[str, array[float]]] = field(default_factory=dict)
    counted: set[str] = field(default_factory=set)
    groups: dict[int, dict[str, array[float]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    norm_column: str = "total_norm"
    loss_column: str | None = None
    ignored: list[str] = field(default_factory=list)
    run: str | None = None
    has_clipping: bool = False

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def has_loss(self) -> bool:
        """True when some row recorded a loss."""
        return any(not math.isnan(x) for x in self.loss)


# ---------------------------------------------------------------------------- entry point


@dataclass(frozen=True)
class Names:
    """The names the user chose (``--loss NAME``, ``--norm NAME``); None: recognised ones."""

    loss: str | None = None
    norm: str | None = None


def read_log(path: str | os.PathLike[str], names: Names = Names(), run: str | None = None) -> GradLog:
    """Read any supported log (see the module docstring); ``ValueError`` with one line when it is not one.

    ``names`` replaces the recognised loss and norm names; ``run`` picks one of a folder's TensorBoard
    runs (:func:`tensorboard_runs`): a folder holding several is never merged, it needs ``run``."""
    name = os.fspath(path)
    if os.path.isdir(name):
        return _read_folder(name, names, run)
    if not os.path.exists(name):
        raise FileNotFoundError(f"{name}: no such file")
    if run is not None:
        raise ValueError(f"--run {run}: {name} is a file, not a folder of TensorBoard runs; pass the folder")
    with open(name, "rb") as f:
        head = f.read(_SNIFF)
    if not head.strip(b"\xef\xbb\xbf \t\r\n"):
        raise ValueError(f"{name} is empty; expected a training log with {_EXPECTED}")
    if b"\x00" in head or _mostly_binary(head):
        raise ValueError(f"{name} is not a text file (binary data); expected a CSV or JSON training log")
    if head.lstrip(b"\xef\xbb\xbf \t\r\n")[:1] in (b"{", b"["):
        return _read_trainer_state(name, names)
    if os.path.basename(name).startswith("events.out.tfevents"):
        return _read_tensorboard(os.path.dirname(name) or ".", names)
    return _read_csv(name, names)


def _mostly_binary(head: bytes) -> bool:
    """True when the file's first bytes are not UTF-8 text or hold many control characters."""
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:  # not merely a character cut at the sniff boundary
            return True
        text = head[: exc.start].decode("utf-8")
    control = sum(1 for c in text if ord(c) < 32 and c not in "\t\r\n")
    return control > max(2, len(text) // 100)


def _read_folder(name: str, names: Names, run: str | None) -> GradLog:
    """The log in a folder: trainer_state.json, metrics.csv, event files (one run), or the latest
    checkpoint's state."""
    runs = tensorboard_runs(name)
    if run is not None or len(runs) > 1:
        return _read_run(name, runs, names, run)
    for candidate in ("trainer_state.json", "metrics.csv"):
        path = os.path.join(name, candidate)
        if os.path.isfile(path):
            return read_log(path, names)
    if runs:  # one run: the folder itself or one below it (runs/<run>/, lightning_logs/version_0/)
        log = _read_tensorboard(_run_folder(name, runs[0]), names)
        log.path = name
        return log
    states = glob.glob(os.path.join(glob.escape(name), "checkpoint-*", "trainer_state.json"))
    if states:
        latest = max(states, key=lambda p: _checkpoint_number(os.path.dirname(p)))
        return read_log(latest, names)
    below = sorted(
        p
        for c in ("metrics.csv", "trainer_state.json")
        for p in glob.glob(os.path.join(glob.escape(name), "*", c))
    )
    if below:  # Lightning's CSVLogger: lightning_logs/version_<n>/metrics.csv
        shown = ", ".join(below[:10]) + (f", ... ({len(below) - 10} more)" if len(below) > 10 else "")
        raise ValueError(f"{name} holds no training log itself; the logs below it: {shown}; pass one of them")
    raise ValueError(
        f"{name} is a folder without a training log (looked for trainer_state.json, metrics.csv and "
        "TensorBoard event files); pass the CSV file, trainer_state.json or TensorBoard log folder"
    )


def _read_run(name: str, runs: list[str], names: Names, run: str | None) -> GradLog:
    """The TensorBoard run ``run`` of the folder; several runs and no ``run``: an error naming them."""
    if run is None:
        raise ValueError(
            f"{name} holds {len(runs)} TensorBoard runs ({', '.join(runs)}), which are never merged; "
            "pick one with --run NAME"
        )
    if not runs:
        raise ValueError(f"--run {run}: {name} holds no TensorBoard runs; pass the log itself without --run")
    run = os.path.normpath(run) if os.path.normpath(run) in runs else run  # exp1/, ./exp1: exp1
    if run not in runs:
        raise ValueError(f"{name} has no TensorBoard run {run!r} (--run {run}); its runs: {', '.join(runs)}")
    log = _read_tensorboard(_run_folder(name, run), names)
    log.run = run
    return log


def tensorboard_runs(path: str | os.PathLike[str]) -> list[str]:
    """The TensorBoard runs of a folder read as TensorBoard (``[]`` for a file, or a folder read as a
    trainer_state.json or metrics.csv), sorted, as paths relative to it (``"."``: the folder itself).

    A run is a folder holding event files none of whose parents (up to ``path``) holds any, as
    SummaryWriter's ``runs/<run>/`` and Lightning's ``version_<n>/``; a folder below a run (written by
    ``add_scalars``, one per key) belongs to that run."""
    name = os.fspath(path)
    if not os.path.isdir(name) or any(
        os.path.isfile(os.path.join(name, c)) for c in ("trainer_state.json", "metrics.csv")
    ):
        return []
    events = glob.glob(os.path.join(glob.escape(name), "**", "events.out.tfevents*"), recursive=True)
    folders = {os.path.relpath(os.path.dirname(e), name) for e in events}
    return sorted(f for f in folders if not any(p in folders for p in _parents(f)))


def _run_folder(name: str, run: str) -> str:
    """The folder of the run ``run`` (:func:`tensorboard_runs`) of the folder ``name``."""
    return name if run == "." else os.path.join(name, run)


def _parents(folder: str) -> list[str]:
    """The parent folders of a relative path, ``"."`` included (none for ``"."``)."""
    if folder == ".":
        return []
    parts = folder.split(os.sep)
    return [".", *(os.sep.join(parts[:k]) for k in range(1, len(parts)))]


def _checkpoint_number(path: str) -> int:
    """The number of a ``checkpoint-<n>`` folder (-1 when it has none)."""
    tail = os.path.basename(path).rpartition("-")[2]
    return int(tail) if tail.isdigit() else -1


# ---------------------------------------------------------------------------- CSV


@dataclass
class _Columns:
    """Where each quantity is in a CSV header (-1: absent)."""

    step: int
    norm: int
    loss: int = -1
    lr: int = -1
    max_norm: int = -1
    clipped: int = -1
    skipped: int = -1
    reason: int = -1
    layers: dict[str, dict[str, int]] = field(default_factory=dict)
    groups: list[tuple[int, str, int]] = field(default_factory=list)  # (group, "norm"/"coef", column)

    def used(self) -> set[int]:
        """The columns read as something (the others are listed as ignored)."""
        singles = (self.step, self.norm, self.loss, self.lr, self.max_norm, self.clipped, self.skipped)
        used = {*singles, self.reason, *(i for _, _, i in self.groups)}
        return used | {i for fields in self.layers.values() for i in fields.values()}


def _columns(name: str, header: list[str], names: Names) -> _Columns:
    """Where the step, norm, loss, lr, clipopt, per-layer and per-group columns are in the header."""
    norm_name = choose("norm", header, names.norm, name, "column")
    if norm_name is None:
        shown = ", ".join(header[:12]) + (", ..." if len(header) > 12 else "")
        raise ValueError(
            f"{name} has no gradient-norm column; expected {_EXPECTED}; its columns: {shown}; "
            "or name the column with --norm NAME"
        )
    norm = header.index(norm_name)
    at = {n: i for i, n in enumerate(header)}
    loss_name = choose("loss", header, names.loss, name, "column")
    step, lr = pick("step", header), pick("lr", header)
    cols = _Columns(at[step] if step is not None else -1, norm)
    cols.loss = at[loss_name] if loss_name is not None else -1
    cols.lr = at[lr] if lr is not None else -1
    cols.max_norm, cols.clipped = at.get(MAX_NORM, -1), at.get(CLIPPED, -1)
    cols.skipped, cols.reason = at.get(SKIPPED, -1), at.get(REASON, -1)
    for i, col in enumerate(header):
        base, _, fld = col.rpartition(".")
        if (m := GROUP_COLUMN.fullmatch(col)) is not None:
            cols.groups.append((int(m.group(2)), m.group(1), i))
        elif base and fld in LAYER_FIELDS and i != norm:
            cols.layers.setdefault(base, {})[fld] = i
        elif (m := _LIGHTNING_LAYER.fullmatch(col)) is not None:
            cols.layers.setdefault(m.group(1), {})["grad_norm"] = i
    return cols


def _read_csv(name: str, names: Names) -> GradLog:
    """A UTF-8 byte-order mark is dropped and undecodable bytes replaced; csv errors become one line."""
    enabled = gc.isenabled()
    gc.disable()  # millions of short-lived row lists: the cyclic collector would scan them again and again
    try:
        with open(name, newline="", encoding="utf-8-sig", errors="replace") as f:
            return _read_csv_rows(name, csv.reader(f), names)
    except csv.Error as exc:
        raise ValueError(f"{name} is not readable as CSV ({exc}); expected {_EXPECTED}") from None
    finally:
        if enabled:
            gc.enable()


def _read_csv_rows(name: str, rows: Iterator[list[str]], names: Names) -> GradLog:
    """The header checked and its columns found, then every row parsed into a GradLog."""
    header = next((r for r in rows if r), None)
    if header is None:
        raise ValueError(f"{name} is empty; expected a training log with {_EXPECTED}")
    header = [c.strip() for c in header]
    if len(set(header)) != len(header):
        dup = next(c for c in header if header.count(c) > 1)
        raise ValueError(f"{name}: its header repeats the column {dup!r}; expected one column per name")
    cols = _columns(name, header, names)
    clipopt = cols.clipped >= 0 and cols.skipped >= 0 and cols.step >= 0 and header[cols.norm] == "total_norm"
    log = GradLog(name, "clipopt CSV" if clipopt else "CSV", norm_column=header[cols.norm])
    log.loss_column = header[cols.loss] if cols.loss >= 0 else None
    used = cols.used()
    log.ignored = [c for i, c in enumerate(header) if i not in used]
    log.has_clipping = cols.clipped >= 0 or cols.max_norm >= 0
    if cols.step < 0:
        log.notes.append("no step column: the row number is used as the step")
    _Parser(name, header, cols, log).run(rows)
    if not log.steps:
        raise ValueError(f"{name} has a header but no row with a gradient norm yet; expected {_EXPECTED}")
    return log


def _floats(cells: tuple[str, ...], recorded_inf: bool = False) -> array[float]:
    """Cells as floats, empty ones ``nan`` (``recorded_inf``: a written non-finite value is inf)."""
    if len(cells) > 1 and cells.count(cells[0]) == len(cells):  # constant (lr, max_norm): convert once
        return _floats(cells[:1], recorded_inf) * len(cells)
    try:
        out = array("d", map(float, cells))
    except ValueError:
        out = array("d", [float(t) if t else _NAN for t in cells])
    if recorded_inf and len(out):
        values = torch.frombuffer(out, dtype=torch.float64)
        for k in (~torch.isfinite(values)).nonzero().flatten().tolist():
            if cells[k]:
                out[k] = math.inf
    return out


@dataclass
class _ChunkValues:
    """A chunk of CSV rows converted column by column (:meth:`_Parser.fast_chunk`), ready to append."""

    steps: array[int]
    norms: array[float]
    loss: array[float]  #: nan: not recorded; inf: recorded but not finite
    lr: array[float]
    max_norm: array[float]
    groups: list[tuple[int, str, array[float]]]  #: (group, "norm"/"coef", values)
    clipped: bytearray
    skipped: bytearray
    reasons: list[tuple[int, str]]  #: (row in the log, skip reason) of the rows with a reason
    layer_rows: list[tuple[int, list[float]]]  #: (row in the log, every layer's LAYER_FIELDS in order)


class _Parser:
    """The row loop of :func:`_read_csv`: one pass, each column appended to its array."""

    def __init__(self, name: str, header: list[str], cols: _Columns, log: GradLog) -> None:
        self.name, self.header, self.cols, self.log = name, header, cols, log
        self.width = len(header)
        self.layer_names = list(cols.layers)
        self.layer_cells = [(n, f, i) for n, fields in cols.layers.items() for f, i in fields.items()]
        self.layer_first = sorted(i for _, _, i in self.layer_cells)
        for n in self.layer_names:
            log.layers[n] = {f: array("d") for f in LAYER_FIELDS}
        log.counted = {n for n, fields in cols.layers.items() if "nonfinite" in fields}
        for g, _, _ in sorted(cols.groups):
            log.groups.setdefault(g, {"norm": array("d"), "coef": array("d")})
        self.pending_loss: dict[int, float] = {}  # losses of sparse rows whose norm row is not read yet
        self.flat = [cols.layers[n].get(f, -1) for n in self.layer_names for f in LAYER_FIELDS]

    def number(self, lineno: int, i: int, text: str) -> float:
        """The cell as a float; ValueError naming the line and column otherwise."""
        try:
            return float(text)
        except ValueError:
            raise ValueError(
                f"{self.name}, line {lineno}: column {self.header[i]} holds {text.strip()[:40]!r}, "
                "not a number"
            ) from None

    def run(self, rows: Iterator[list[str]]) -> None:
        """Every row, in chunks: whole columns converted at once (:meth:`fast_chunk`) when every row of
        the chunk is well-formed; row by row (:meth:`row`: exact errors, sparse rows) otherwise."""
        self.torn: tuple[int, int] | None = None
        lineno = 2
        while chunk := list(islice(rows, _CHUNK)):
            width = self.width
            if self.torn is None and set(map(len, chunk)) == {width}:
                try:
                    self.fast_chunk(chunk)
                    lineno += len(chunk)
                    continue
                except (ValueError, KeyError):
                    pass
            for row in chunk:
                self.one(lineno, row)
                lineno += 1
        if self.torn is not None:
            self.log.notes.append(
                f"the last row (line {self.torn[0]}) has {self.torn[1]} of {self.width} cells "
                "(a run stopped while writing?); it was ignored"
            )
        self.finish()

    def one(self, lineno: int, row: list[str]) -> None:
        """One row of the slow path: blank rows skipped, a short row tolerated only as the last one."""
        if not row:
            return
        if self.torn is not None:
            line, cells = self.torn
            raise ValueError(f"{self.name}, line {line}: {cells} cells where the header has {self.width}")
        if len(row) != self.width:
            self.torn = (lineno, len(row))
            return
        self.row(lineno, row)

    def fast_chunk(self, chunk: list[list[str]]) -> None:
        """Convert the chunk's columns with C-level loops; raise (ValueError/KeyError) before appending
        anything when a cell is not well-formed, so :meth:`row` can say exactly where."""
        values = self.convert_chunk(chunk)
        if self.pending_loss:
            raise ValueError("sparse rows pending: merge row by row")
        self.append_chunk(values)

    def convert_chunk(self, chunk: list[list[str]]) -> _ChunkValues:
        """The chunk's columns converted (ValueError/KeyError on a cell that is not well-formed)."""
        c, n0 = self.cols, len(self.log.steps)
        columns = self.chunk_columns(chunk)
        empty = ("",) * len(chunk)
        flags = _FLAGS.__getitem__
        if c.step >= 0:
            steps = array("q", map(int, columns[c.step]))
        else:
            steps = array("q", range(n0 + 1, n0 + 1 + len(chunk)))
        reasons = [(n0 + k, t.strip()) for k, t in enumerate(columns[c.reason]) if t] if c.reason >= 0 else []
        return _ChunkValues(
            steps=steps,
            norms=array("d", map(float, columns[c.norm])),
            loss=_floats(columns.get(c.loss, empty) if c.loss >= 0 else empty, recorded_inf=True),
            lr=_floats(columns[c.lr] if c.lr >= 0 else empty),
            max_norm=_floats(columns[c.max_norm] if c.max_norm >= 0 else empty),
            groups=[(g, kind, _floats(columns[i])) for g, kind, i in c.groups],
            clipped=bytearray(map(flags, columns[c.clipped])) if c.clipped >= 0 else bytearray(len(chunk)),
            skipped=bytearray(map(flags, columns[c.skipped])) if c.skipped >= 0 else bytearray(len(chunk)),
            reasons=reasons,
            layer_rows=self.chunk_layer_rows(chunk, columns),
        )

    def chunk_columns(self, chunk: list[list[str]]) -> dict[int, tuple[str, ...]]:
        """Column index -> the chunk's cells, for every column read (and the first and last layer cells)."""
        c = self.cols
        first = self.layer_first[0] if self.layer_first else -1
        last = self.layer_first[-1] if self.layer_first else -1
        wanted = [c.step, c.norm, c.loss, c.lr, c.max_norm, c.clipped, c.skipped, c.reason, first, last]
        wanted += [i for _, _, i in c.groups]
        present = sorted({i for i in wanted if i >= 0} | {c.norm, -1})  # -1: two indices at least (tuples)
        # one C-level pass picks the cells of every row, a second transposes them into columns
        return dict(zip(present, zip(*map(itemgetter(*present), chunk), strict=True), strict=True))

    def chunk_layer_rows(
        self, chunk: list[list[str]], columns: dict[int, tuple[str, ...]]
    ) -> list[tuple[int, list[float]]]:
        """``(row, every layer's LAYER_FIELDS)`` of the rows whose first or last layer cell is set."""
        if not self.layer_first:
            return []
        first, last = self.layer_first[0], self.layer_first[-1]
        n0, flat = len(self.log.steps), self.flat
        marked = [k for k, (a, b) in enumerate(zip(columns[first], columns[last], strict=True)) if a or b]
        rows = []
        for k in marked:
            r = chunk[k]
            rows.append((n0 + k, [float(r[i]) if i >= 0 and r[i] else _NAN for i in flat]))
        return rows

    def append_chunk(self, values: _ChunkValues) -> None:
        """Append a converted chunk to the log."""
        log = self.log
        log.steps.extend(values.steps)
        log.total_norm.extend(values.norms)
        log.loss.extend(values.loss)
        log.lr.extend(values.lr)
        log.max_norm.extend(values.max_norm)
        log.clipped.extend(values.clipped)
        log.skipped.extend(values.skipped)
        log.reason.update(values.reasons)
        for g, kind, group_values in values.groups:
            log.groups[g][kind].extend(group_values)
        for at, layer_values in values.layer_rows:
            self.add_layers(at, layer_values)

    def row(self, lineno: int, row: list[str]) -> None:
        """One row the fast path refused: exact error messages, sparse (Lightning) rows merged."""
        c, log = self.cols, self.log
        if c.step >= 0:
            text = row[c.step]
            try:
                step = int(text)
            except ValueError:
                value = self.number(lineno, c.step, text) if text.strip() else _NAN
                if not (math.isfinite(value) and value == int(value)):
                    raise ValueError(
                        f"{self.name}, line {lineno}: step must be an integer, got {text.strip()[:40]!r}"
                    ) from None
                step = int(value)
        else:
            step = len(log.steps) + 1
        norm_text = row[c.norm]
        loss = _NAN
        if c.loss >= 0 and (t := row[c.loss]):
            loss = self.number(lineno, c.loss, t)
            if not math.isfinite(loss):
                loss = math.inf
        if not norm_text.strip():  # a sparse row (Lightning): keep its loss for the step's norm row
            if not math.isnan(loss):
                if log.steps and log.steps[-1] == step and math.isnan(log.loss[-1]):
                    log.loss[-1] = loss
                else:
                    self.pending_loss[step] = loss
            return
        log.steps.append(step)
        log.total_norm.append(self.number(lineno, c.norm, norm_text))
        log.loss.append(self.pending_loss.pop(step, loss) if math.isnan(loss) else loss)
        log.lr.append(self.optional(lineno, c.lr, row))
        log.max_norm.append(self.optional(lineno, c.max_norm, row))
        log.clipped.append(self.flag(lineno, c.clipped, row))
        log.skipped.append(self.flag(lineno, c.skipped, row))
        if c.reason >= 0 and (reason := row[c.reason].strip()):
            log.reason[len(log.steps) - 1] = reason
        for g, kind, i in c.groups:
            log.groups[g][kind].append(self.optional(lineno, i, row))
        if self.layer_cells and any(row[i].strip() for i in self.layer_first):
            self.layer_row(lineno, row)

    def optional(self, lineno: int, i: int, row: list[str]) -> float:
        """The float in column ``i`` (nan: no such column, or an empty cell)."""
        if i < 0 or not (text := row[i]).strip():
            return _NAN
        return self.number(lineno, i, text)

    def flag(self, lineno: int, i: int, row: list[str]) -> int:
        """The 0/1 flag in column ``i`` (0: no such column); ValueError naming the line otherwise."""
        if i < 0:
            return 0
        text = row[i].strip().lower()
        if text in ("0", "1", "", "true", "false", "0.0", "1.0"):
            return 1 if text in ("1", "true", "1.0") else 0
        raise ValueError(
            f"{self.name}, line {lineno}: column {self.header[i]} must be 0 or 1, got {text[:40]!r}"
        )

    def add_layers(self, at: int, values: list[float]) -> None:
        """Append one per-layer row (``values``: every layer's LAYER_FIELDS, in order) for row ``at``."""
        self.log.layer_rows.append(at)
        k = len(LAYER_FIELDS)
        for j, n in enumerate(self.layer_names):
            out = self.log.layers[n]
            for m, f in enumerate(LAYER_FIELDS):
                out[f].append(values[j * k + m])

    def layer_row(self, lineno: int, row: list[str]) -> None:
        """Append the row's per-layer cells (nan where absent) as a per-layer row of the last update."""
        self.log.layer_rows.append(len(self.log.steps) - 1)
        for n in self.layer_names:
            fields = self.cols.layers[n]
            out = self.log.layers[n]
            for f in LAYER_FIELDS:
                i = fields.get(f, -1)
                out[f].append(self.optional(lineno, i, row) if i >= 0 else _NAN)

    def finish(self) -> None:
        """Losses of sparse rows that came after their step's norm row (and not right after it)."""
        log, pending = self.log, self.pending_loss
        if not pending:
            return
        for at in range(len(log.steps)):
            step = log.steps[at]
            if step in pending and math.isnan(log.loss[at]):
                log.loss[at] = pending.pop(step)


# ---------------------------------------------------------------------------- records (JSON, TensorBoard)


def _from_records(
    name: str,
    source: str,
    records: dict[int, dict[str, float]],
    layers: dict[str, dict[int, dict[str, float]]],
    groups: dict[int, dict[str, dict[int, float]]] | None = None,
) -> GradLog:
    """A GradLog from step -> {"norm", "loss", "lr", "max_norm", "clipped", "skipped", and each skip
    reason's tag (``clipopt/nograd``, ...: 1.0 where the window was skipped for it)} (and ``groups``:
    group -> "norm"/"coef" -> step -> value).  A skipped window without a reason's tag (a log of
    an earlier version) reads as "nonfinite"."""
    log = GradLog(name, source)
    index: dict[int, int] = {}
    for step in sorted(records):
        rec = records[step]
        if "norm" not in rec:
            continue
        index[step] = len(log.steps)
        log.steps.append(step)
        log.total_norm.append(rec["norm"])
        loss = rec.get("loss", _NAN)  # a recorded loss that is not finite (NaN too) reads as inf
        log.loss.append(loss if math.isfinite(loss) or "loss" not in rec else math.inf)
        log.lr.append(rec.get("lr", _NAN))
        log.max_norm.append(rec.get(MAX_NORM, _NAN))
        log.clipped.append(1 if rec.get(CLIPPED, 0.0) > 0.5 else 0)
        skipped = rec.get(SKIPPED, 0.0) > 0.5
        log.skipped.append(1 if skipped else 0)
        if skipped:
            marked = [r.name for r in REASONS if rec.get(r.tag, 0.0) > 0.5]
            log.reason[len(log.steps) - 1] = marked[0] if marked else _UNMARKED
    rows = sorted({s for per in layers.values() for s in per if s in index})
    log.layer_rows.extend(index[s] for s in rows)
    log.counted = {n for n, per in layers.items() if any("nonfinite" in v for v in per.values())}
    for lname, per in layers.items():
        log.layers[lname] = {f: array("d", (per.get(s, {}).get(f, _NAN) for s in rows)) for f in LAYER_FIELDS}
    for g, kinds in sorted((groups or {}).items()):
        log.groups[g] = {
            k: array("d", (kinds.get(k, {}).get(s, _NAN) for s in log.steps)) for k in ("norm", "coef")
        }
    return log


def _read_trainer_state(name: str, names: Names) -> GradLog:
    """A Hugging Face Trainer trainer_state.json: the log_history entries with a gradient norm."""
    history = _log_history(name)
    entries = [e for e in history if isinstance(e, dict) and isinstance(e.get("step"), int)]
    keys = list(dict.fromkeys(k for e in entries for k in e if k != "step"))
    norm_key = choose("norm", keys, names.norm, name, "log_history key")
    if norm_key is None:
        raise ValueError(
            f"{name} has no 'grad_norm' in its log_history; expected a Trainer run with max_grad_norm > 0 "
            "that logged at least once (logging_steps)"
        )
    wanted = {"norm": norm_key, "loss": choose("loss", keys, names.loss, name, "log_history key")}
    wanted["lr"] = pick("lr", keys)
    records: dict[int, dict[str, float]] = {}
    for entry in entries:
        rec = records.setdefault(entry["step"], {})
        for out, key in wanted.items():
            value = entry.get(key) if key is not None else None
            if (isinstance(value, (int, float)) and not isinstance(value, bool)) or (
                isinstance(value, str) and value.lower() in ("nan", "inf", "infinity", "-inf")
            ):
                rec[out] = float(value)
    log = _from_records(name, "Trainer trainer_state.json", records, {})
    log.norm_column, log.loss_column = norm_key, wanted["loss"]
    log.ignored = [k for k in keys if k not in wanted.values()]
    if not log.steps:
        raise ValueError(f"{name} has no {norm_key!r} value in its log_history; expected a number there")
    return log


def _log_history(name: str) -> list[Any]:
    """The ``log_history`` list of a trainer_state.json; ValueError when it is not JSON or has none."""
    try:
        with open(name, encoding="utf-8-sig") as f:
            state = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{name} is not valid JSON ({exc}); expected a Trainer trainer_state.json") from None
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise ValueError(
            f"{name} is JSON without a 'log_history' list; expected a Hugging Face Trainer trainer_state.json"
        )
    return history


# ---------------------------------------------------------------------------- TensorBoard


def _read_tensorboard(name: str, names: Names) -> GradLog:
    """A TensorBoard run's folder: its total-norm tag, the loss, lr and clipopt's own tags, per step."""
    scalars, hparams = _tensorboard_scalars(name)
    tags = sorted(scalars)
    # add_hparams' metrics (one point each, hparam/loss) are never picked; --loss/--norm may name them
    candidates = [t for t in tags if t not in hparams]
    norm_tag = choose("norm", tags if names.norm else candidates, names.norm, name, "scalar tag")
    if norm_tag is None:
        raise ValueError(
            f"{name} has no gradient-norm scalar; expected a tag ending in total_norm or grad_norm "
            f"(e.g. train/grad_norm, Grad/total_norm); its scalar tags: {', '.join(tags[:12]) or 'none'}; "
            "or name the tag with --norm NAME"
        )
    wanted = {
        "norm": norm_tag,
        "loss": choose("loss", tags if names.loss else candidates, names.loss, name, "scalar tag"),
        "lr": pick("lr", candidates),
        **{key: column_tag(key) if column_tag(key) in scalars else None for key in _CLIPOPT_TAGS},
        **{r.tag: r.tag if r.tag in scalars else None for r in REASONS},  # the record's key is the tag
    }
    records: dict[int, dict[str, float]] = {}
    for key, tag in wanted.items():
        for step, value in scalars.get(tag, []) if tag is not None else []:
            records.setdefault(step, {})[key] = value
    layers, groups = _tensorboard_layers_and_groups(scalars)
    log = _from_records(name, "TensorBoard", records, layers, groups)
    log.norm_column, log.loss_column = norm_tag, wanted["loss"]
    log.ignored = [t for t in tags if t not in wanted.values() and not _layer_or_group_tag(t)]
    log.has_clipping = wanted[CLIPPED] is not None
    return log


def _tensorboard_scalars(name: str) -> tuple[dict[str, list[tuple[int, float]]], set[str]]:
    """Every scalar of the run in ``name``: tag -> ``(step, value)`` events, and the tags of the folders
    below it that ``add_hparams`` wrote (its metrics, e.g. ``<time>/hparam/loss``); needs tensorboard.

    The tags of a folder below it (``add_scalars`` writes one per key, e.g. ``Loss_train``) are
    named ``<folder>/<tag>``, so that two keys of one tag are never merged."""
    try:
        from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
    except ImportError:
        raise ValueError(
            f"{name} holds TensorBoard event files; reading them needs the tensorboard package: "
            "pip install 'clipopt[tensorboard]'"
        ) from None
    mux = EventMultiplexer(size_guidance={"scalars": 0})  # 0: keep every scalar
    mux.AddRunsFromDirectory(name)
    mux.Reload()
    scalars: dict[str, list[tuple[int, float]]] = {}
    hparams_runs = {r for r in mux.PluginRunToTagToContent("hparams") if r != "."}
    hparams: set[str] = set()
    for run, tags in mux.Runs().items():
        prefix = "" if run == "." else run.replace(os.sep, "/") + "/"
        for tag in tags.get("scalars", []):
            scalars.setdefault(prefix + tag, []).extend(
                (e.step, float(e.value)) for e in mux.Scalars(run, tag)
            )
            if run in hparams_runs:
                hparams.add(prefix + tag)
    return scalars, hparams


def _layer_or_group_tag(tag: str) -> bool:
    """A per-layer (clipopt's or Lightning's) or per-group (clipopt's) tag."""
    parts = tag.split("/")
    return (
        GROUP_TAG.fullmatch(tag) is not None
        or _LIGHTNING_LAYER.fullmatch(tag) is not None
        or (len(parts) >= 4 and tag.startswith(LAYERS_TAG) and parts[-1] in LAYER_FIELDS)
    )


def _tensorboard_layers_and_groups(
    scalars: dict[str, list[tuple[int, float]]],
) -> tuple[dict[str, dict[int, dict[str, float]]], dict[int, dict[str, dict[int, float]]]]:
    """Per-layer tags (clipopt's ``clipopt/layers/<name>/<field>``, Lightning's ``grad_2.0_norm/<name>``)
    as layer -> step -> field -> value, and per-group tags as group -> "norm"/"coef" -> step -> value."""
    layers: dict[str, dict[int, dict[str, float]]] = {}
    groups: dict[int, dict[str, dict[int, float]]] = {}
    for tag, events in scalars.items():
        parts = tag.split("/")
        if (m := GROUP_TAG.fullmatch(tag)) is not None:
            groups.setdefault(int(m.group(2)), {}).setdefault(m.group(1), {}).update(events)
        elif len(parts) >= 4 and tag.startswith(LAYERS_TAG) and parts[-1] in LAYER_FIELDS:
            per = layers.setdefault("/".join(parts[2:-1]), {})
            for step, value in events:
                per.setdefault(step, {})[parts[-1]] = value
        elif (m := _LIGHTNING_LAYER.fullmatch(tag)) is not None:
            per = layers.setdefault(m.group(1), {})
            for step, value in events:
                per.setdefault(step, {})["grad_norm"] = value
    return layers, groups
