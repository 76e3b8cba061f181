"""TensorBoard logger (optional extra: ``pip install 'clipopt[tensorboard]'``)."""

from __future__ import annotations

import atexit
import os
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .._checks import check_path, check_positive_int
from .._distributed.collectives import check_ranks, rank_target
from .._log_names import (
    CLIP_COEF,
    CLIPPED,
    LOSS,
    MAX_NORM,
    MICRO_BATCHES,
    SKIPPED,
    TOTAL_NORM,
    UPDATE_COEF,
    UPDATE_NORM,
    column_tag,
    group_tag,
    layer_tag,
    lr_name,
)
from .._reasons import tag_of
from .files import WarnOnce, check_dir_path
from .layers import LAYER_FIELDS
from .loggers import LoggedOptimizer
from .stats import StepStats, materialize

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

__all__ = ["TensorBoardLogger"]

_INSTALL_HINT = (
    "TensorBoardLogger needs the tensorboard package; install it with pip install 'clipopt[tensorboard]'"
)


class TensorBoardLogger:
    """Each window's statistics as TensorBoard scalars, plus gradient histograms.

    Scalars, at ``global_step = stats.step`` (the window index), the same as
    the :class:`~clipopt.CSVLogger` columns: ``clipopt/total_norm`` (pre-clip),
    ``clipopt/clip_coef``, ``clipopt/clipped`` (0/1), ``clipopt/skipped``
    (0/1), ``clipopt/<reason>`` (1, only in windows skipped for that reason:
    every :attr:`StepStats.reason <clipopt.StepStats>` has its own tag, e.g.
    ``clipopt/overflow`` for a GradScaler overflow, ``clipopt/nograd``),
    ``clipopt/micro_batches``, ``clipopt/max_norm`` (only when norm
    clipping is on) and ``clipopt/lr`` (group 0), ``clipopt/lr.1``, ... for
    further parameter groups; with per-group clipping ``clipopt/group_norm/<g>``
    and ``clipopt/group_coef/<g>`` for every group ``g``; with ``update_clip`` or
    ``update_stats=True`` ``clipopt/update_norm`` and ``clipopt/update_coef``.  On windows
    with per-layer statistics
    (``layer_stats=k``, and a non-finite window's own row, as in the CSV):
    ``clipopt/layers/<name>/<field>`` for each field of
    :data:`~clipopt.LAYER_FIELDS` (statistics of the pre-clip gradient).

    Scalars are buffered and written every ``flush_every`` windows, on
    :meth:`close` and at interpreter exit, each with the wall time of its
    window; converting a buffer of scalars is one host read (plus one per
    window with per-layer statistics in it).  A window that is neither
    written nor has per-layer statistics reads nothing from the device.

    With ``histograms=True``, on windows with per-layer statistics whose update
    was applied, ``clipopt/grad/<name>`` is a histogram of each parameter's
    ``p.grad`` as the logger sees it, after the inner step: the gradient the
    inner optimizer applied — combined over the window (divided by the number
    of micro-batches with ``reduction="mean"``), value-clipped and multiplied by
    ``clip_coef`` — not the pre-clip gradient the per-layer scalars describe.
    Non-finite elements are left out (the ``nonfinite`` scalar counts them);
    skipped windows get no histograms (their gradients were never applied).
    These windows copy every gradient to the host, and histograms go to the
    event file when taken (TensorBoard's writer queue decides when they reach
    the disk), not with the buffered scalars.

    A failing event file (disk full) never interrupts training, nor
    :meth:`close`: it warns once per cause; TensorBoard's writer stops at its
    first error, so the scalars of later windows are dropped (counted in
    ``rows_dropped``) instead of piling up in memory.

    Args:
        log_dir: the run's folder (e.g. ``"runs/exp1"``); created if missing.
            Another event file is added next to existing ones.
        flush_every: windows per write of the buffered scalars.
        histograms: write gradient histograms on windows with per-layer statistics.
        ranks: under ``torch.distributed`` with several processes, ``"zero"``
            (default): only rank 0 writes; ``"all"``: every rank writes into
            ``log_dir/rank<r>``.  Decided when the logger is built.

    Raises:
        ImportError: tensorboard is not installed.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        flush_every: int = 100,
        histograms: bool = True,
        *,
        ranks: str = "zero",
    ) -> None:
        check_path("log_dir", log_dir, "runs/exp1")
        check_dir_path("log_dir", Path(log_dir), "runs/exp1")
        check_positive_int("flush_every", flush_every, 100)
        if not isinstance(histograms, bool):
            raise TypeError(
                f"histograms must be True or False, got {histograms!r}; pass e.g. histograms=False"
            )
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError(f"{_INSTALL_HINT} ({e})") from e
        self.ranks = check_ranks(ranks)
        target = rank_target(Path(log_dir), self.ranks, folder=True)
        self.log_dir = Path(log_dir) if target is None else target
        self.flush_every = flush_every
        self.histograms = histograms
        self._silent = target is None  # under torch.distributed another rank writes
        self._buffer: list[tuple[StepStats, float]] = []
        self._closed = False
        self._warn = WarnOnce()
        self.rows_dropped = 0  # windows whose scalars could not be written (the event writer failed)
        if self._silent:
            return
        self._writer: SummaryWriter = SummaryWriter(log_dir=str(self.log_dir))
        atexit.register(_close_at_exit, weakref.ref(self))

    def log(self, stats: StepStats, optimizer: LoggedOptimizer) -> None:
        """Buffer one window's scalars (write them every ``flush_every`` windows); histograms if due."""
        if self._silent:
            return
        walltime = time.time()
        if self.histograms and stats.layers is not None:
            try:
                self._write_histograms(stats, optimizer, walltime)
            except OSError as exc:
                self._failed(exc)
        self._buffer.append((stats, walltime))
        self._closed = False
        if len(self._buffer) >= self.flush_every:
            self.flush()

    @torch.no_grad()
    def _write_histograms(self, stats: StepStats, optimizer: LoggedOptimizer, walltime: float) -> None:
        materialize([stats])  # one host read for this window's scalars (the flush then reads nothing more)
        if stats.skipped:
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for name, p in zip(optimizer.layer_names(), params, strict=True):
            values = _host_values(p.grad)
            if values is not None:
                self._writer.add_histogram(f"clipopt/grad/{name}", values, stats.step, walltime=walltime)

    def _write_scalars(self, s: StepStats, walltime: float) -> None:
        def add(name: str, value: float) -> None:  # a full tag (clipopt._log_names, clipopt._reasons)
            self._writer.add_scalar(name, value, s.step, walltime=walltime)

        add(column_tag(TOTAL_NORM), s.total_norm)
        add(column_tag(CLIP_COEF), s.clip_coef)
        add(column_tag(CLIPPED), float(s.clipped))
        add(column_tag(SKIPPED), float(s.skipped))
        add(column_tag(MICRO_BATCHES), float(s.micro_batches))
        reason_tag = None if s.reason is None else tag_of(s.reason)
        if reason_tag is not None:  # every skip reason has its own tag: 1 where it skipped
            add(reason_tag, 1.0)
        if s.max_norm is not None:
            add(column_tag(MAX_NORM), float(s.max_norm))
        if s.has_loss:
            add(column_tag(LOSS), s.loss)
        for g, lr in enumerate(s.lr):
            add(column_tag(lr_name(g)), float(lr))
        for name, value in s.recovery.items():  # a Rewind's (clipopt._log_names.RECOVERY_COLUMNS)
            if isinstance(
                value, str
            ):  # a part's outcome (StepStats.rerun): a tag per outcome, 1 where it was
                add(column_tag(f"{name}/{value}"), 1.0)
            elif value is not None:
                add(column_tag(name), float(value))
        for g, (norm, coef) in enumerate(zip(s.group_norms, s.group_coefs, strict=True)):
            add(group_tag("norm", g), norm)
            add(group_tag("coef", g), coef)
        if s.update_norm is not None and s.update_coef is not None:  # update_clip / update_stats
            add(column_tag(UPDATE_NORM), s.update_norm)
            add(column_tag(UPDATE_COEF), s.update_coef)
        layers = s.logged_layers()  # also a non-finite window's own row, as CSVLogger writes it
        if layers is not None:
            for name, row in zip(layers.names, layers.rows(), strict=True):
                for field, value in zip(LAYER_FIELDS, row, strict=True):
                    add(layer_tag(name, field), value)

    def flush(self) -> None:
        """Write the buffered scalars now (one host read for all of them) and flush the event file."""
        if not self._buffer:
            return
        materialize([s for s, _ in self._buffer])
        rows, self._buffer = self._buffer, []
        try:
            for s, walltime in rows:
                self._write_scalars(s, walltime)
            self._writer.flush()
        except OSError as exc:  # the event file could not be written (disk full): training goes on
            # TensorBoard's writer thread stops at its first error and raises it on every later
            # write, so the rows are not kept for a retry (the buffer would only grow)
            self.rows_dropped += len(rows)
            self._failed(exc)

    def _failed(self, exc: OSError) -> None:
        self._warn(
            exc,
            f"clipopt could not write the TensorBoard log in {self.log_dir} ({exc}); training "
            "continues (this warning is shown once per cause)",
        )

    def close(self) -> None:
        """Write what is buffered and close the event file; may be called more than once.

        Logging after ``close()`` still works: it goes to a new event file in ``log_dir``.
        """
        if self._silent:
            return
        self.flush()
        try:
            self._writer.close()
        except OSError as exc:
            self._failed(exc)
        self._closed = True

    def __repr__(self) -> str:
        return (
            f"TensorBoardLogger({str(self.log_dir)!r}, flush_every={self.flush_every}, "
            f"histograms={self.histograms})"
        )


def _host_values(grad: Tensor | None) -> Tensor | None:
    """The finite elements of ``grad`` as a flat float32 CPU tensor, or None when there are none."""
    if grad is None:
        return None
    values = (grad.coalesce().values() if grad.is_sparse else grad).detach().reshape(-1)
    values = values.to("cpu").float()
    values = values[torch.isfinite(values)]
    return values if values.numel() else None


def _close_at_exit(ref: weakref.ref[TensorBoardLogger]) -> None:
    logger = ref()
    if logger is not None:
        logger.close()
