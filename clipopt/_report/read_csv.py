"""``clipopt report``'s CSV reader: a CSV written by :class:`~clipopt.CSVLogger`, or any CSV with a
step column and a gradient-norm column, plus loss and lr columns when present (Lightning's
``metrics.csv`` too).

Rows are streamed: the file is never held whole, only its columns, each as one ``array('d')``.
Lightning's ``metrics.csv`` writes different metrics of one step in separate rows; the values of one
step are merged into one row.  clipopt's per-group columns (``group_norm.<g>``, ``group_coef.<g>``:
per-group clipping) are read into :attr:`GradLog.groups`, and its ``update_norm``/``update_coef`` columns
(``update_clip=``, ``update_stats=True``) into :attr:`GradLog.update_norm` and :attr:`GradLog.update_coef`.
"""

from __future__ import annotations

import csv
import gc
import math
import os
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from operator import itemgetter

import torch

from .._diagnostics.layers import LAYER_FIELDS
from .._log_names import (
    BATCH_START,
    CLIPPED,
    GROUP_COLUMN,
    MAX_NORM,
    MICRO_BATCHES,
    PART_NUMBERS,
    REASON,
    RECOVERY_COLUMNS,
    RERUN,
    SKIPPED,
)
from .log import EXPECTED as _EXPECTED
from .log import LIGHTNING_LAYER as _LIGHTNING_LAYER
from .log import GradLog, Names
from .names import choose, pick
from .reader import Reader

__all__ = ["CSV"]

_NAN = math.nan
#: Rows converted column by column at once.
_CHUNK = 16384
_FLAGS = {"0": 0, "1": 1, "": 0, "True": 1, "False": 0, "true": 1, "false": 0, "0.0": 0, "1.0": 1}


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
    rerun: int = -1  #: a Rerun's outcome
    update: int = -1  #: the update norm (update_clip / update_stats)
    update_coef: int = -1
    layers: dict[str, dict[str, int]] = field(default_factory=dict)
    groups: list[tuple[int, str, int]] = field(default_factory=list)  # (group, "norm"/"coef", column)
    recovery: list[tuple[str, int]] = field(default_factory=list)  # a Rewind's (name, column)

    def used(self) -> set[int]:
        """The columns read as something (the others are listed as ignored)."""
        singles = (self.step, self.norm, self.loss, self.lr, self.max_norm, self.clipped, self.skipped)
        used = {
            *singles,
            self.reason,
            self.rerun,
            self.update,
            self.update_coef,
            *(i for _, _, i in self.groups),
        }
        used |= {i for _, i in self.recovery}
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
    cols.skipped, cols.reason, cols.rerun = at.get(SKIPPED, -1), at.get(REASON, -1), at.get(RERUN, -1)
    cols.recovery = [(c, at[c]) for c in (*RECOVERY_COLUMNS, *PART_NUMBERS) if c in at]
    if BATCH_START in at and MICRO_BATCHES in at:  # a Rewind's log: the batches each window used
        cols.recovery.append((MICRO_BATCHES, at[MICRO_BATCHES]))
    update, update_coef = pick("update", header), pick("update_coef", header)
    if update is not None and at[update] != norm:  # --norm update_norm reads it as the norm alone
        cols.update = at[update]
        cols.update_coef = at[update_coef] if update_coef is not None else -1
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
    log.update_column = header[cols.update] if cols.update >= 0 else None
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
    recovery: list[tuple[str, array[float]]]  #: (a Rewind's column, values)
    update: tuple[array[float], array[float]]  #: update norms and coefficients (empty: no such columns)
    clipped: bytearray
    skipped: bytearray
    reasons: list[tuple[int, str]]  #: (row in the log, skip reason) of the rows with a reason
    reruns: list[tuple[int, str]]  #: (row in the log, Rerun outcome) of the rows executed again
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
        for name, _ in cols.recovery:
            log.recovery[name] = array("d")
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
            recovery=[(name, _floats(columns[i])) for name, i in c.recovery],
            update=self.chunk_update(columns, empty),
            clipped=bytearray(map(flags, columns[c.clipped])) if c.clipped >= 0 else bytearray(len(chunk)),
            skipped=bytearray(map(flags, columns[c.skipped])) if c.skipped >= 0 else bytearray(len(chunk)),
            reasons=reasons,
            reruns=[(n0 + k, t.strip()) for k, t in enumerate(columns[c.rerun]) if t] if c.rerun >= 0 else [],
            layer_rows=self.chunk_layer_rows(chunk, columns),
        )

    def chunk_update(
        self, columns: dict[int, tuple[str, ...]], empty: tuple[str, ...]
    ) -> tuple[array[float], array[float]]:
        """The chunk's update norms and coefficients (empty arrays: the log has no update norm)."""
        c = self.cols
        if c.update < 0:
            return array("d"), array("d")
        return _floats(columns[c.update]), _floats(columns[c.update_coef] if c.update_coef >= 0 else empty)

    def chunk_columns(self, chunk: list[list[str]]) -> dict[int, tuple[str, ...]]:
        """Column index -> the chunk's cells, for every column read (and the first and last layer cells)."""
        c = self.cols
        first = self.layer_first[0] if self.layer_first else -1
        last = self.layer_first[-1] if self.layer_first else -1
        wanted = [
            c.step,
            c.norm,
            c.loss,
            c.lr,
            c.max_norm,
            c.clipped,
            c.skipped,
            c.reason,
            c.rerun,
            first,
            last,
        ]
        wanted += [c.update, c.update_coef, *(i for _, _, i in c.groups)] + [i for _, i in c.recovery]
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
        log.rerun.update(values.reruns)
        for g, kind, group_values in values.groups:
            log.groups[g][kind].extend(group_values)
        for name, recovery_values in values.recovery:
            log.recovery[name].extend(recovery_values)
        log.update_norm.extend(values.update[0])
        log.update_coef.extend(values.update[1])
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
        if c.rerun >= 0 and (outcome := row[c.rerun].strip()):
            log.rerun[len(log.steps) - 1] = outcome
        for g, kind, i in c.groups:
            log.groups[g][kind].append(self.optional(lineno, i, row))
        for name, i in c.recovery:
            log.recovery[name].append(self.optional(lineno, i, row))
        if c.update >= 0:
            log.update_norm.append(self.optional(lineno, c.update, row))
            log.update_coef.append(self.optional(lineno, c.update_coef, row))
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


def _metrics_csv(folder: str, run: str | None) -> str | None:
    """A folder's ``metrics.csv`` (Lightning's CSVLogger), unless ``--run`` asks for a TensorBoard run."""
    path = os.path.join(folder, "metrics.csv")
    return path if run is None and os.path.isfile(path) else None


#: Any text file the other readers do not claim (so: last among the files), and a folder's metrics.csv.
CSV = Reader(
    name="CSV",
    reads="a CSV with a step and a gradient-norm column (CSVLogger's, Lightning's metrics.csv, any other)",
    claims_file=lambda path, head: True,
    find=_metrics_csv,
    read=lambda path, names, run: _read_csv(path, names),
)
