"""Diagnostics of a window: parameter names, per-layer statistics, the candidate bad row, snapshots.

:class:`LayerStatistics` is the part ``layer_stats=k`` builds (an observer, :mod:`clipopt._part`):
its check, the windows it leaves plain (those between two statistics windows) and the period it
sets for this stage.  :class:`Diagnostics` is the wrapper's diagnostics state (the snapshot writer,
:meth:`~Diagnostics.attach`-ed tensors, the window's candidate row, the
snapshots written) and its stage of a window's close, stage 3 (diagnose) of
docs/design.md, 'Order of operations': :meth:`~Diagnostics.diagnose`, per-layer
statistics when ``layer_stats=k`` is due, and a snapshot when
:func:`clipopt._window.decision.read_anomaly` finds the window non-finite, diverged or
spiking.  The functions compute *what*: the
norm pass that also keeps a per-layer row (:func:`norm_with_row`), the names
(:func:`layer_names`) and the payload a
:class:`~clipopt._diagnostics.snapshot.SnapshotWriter` saves (:func:`snapshot_payload`).
Everything sees the pre-clip gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.optim import Optimizer

from .._diagnostics.layers import LayerStats, compute_layer_stats, sharded_layer_stats
from .._diagnostics.snapshot import SnapshotWriter, check_saveable, now, process_rank, to_saveable, versions
from .._part import Part
from .._reasons import NONFINITE_NAMES, NORM_OVERFLOW, by_code
from .._state import WrapperState
from .decision import WindowDecision, read_anomaly
from .settings import WindowSettings

__all__ = ["Diagnostics", "LayerStatistics", "check_layer_stats", "layer_names", "snapshot_payload"]


def layer_names(param_groups: list[dict[str, Any]], names: Mapping[Tensor, str]) -> list[str]:
    """The name of every parameter, in parameter-group order (see ``param_names``)."""
    out: list[str] = []
    seen: set[str] = set()
    for gi, group in enumerate(param_groups):
        own = group.get("param_names")
        for i, p in enumerate(group["params"]):
            name = names.get(p) or (own[i] if own is not None and i < len(own) else None)
            name = name or f"group{gi}.{i}"
            if name in seen:  # a group added later repeats a name: qualified, so no tensor is lost
                name = f"group{gi}.{name}" if f"group{gi}.{name}" not in seen else f"group{gi}.{i}"
            seen.add(name)
            out.append(name)
    return out


def snapshot_payload(
    *,
    step: int,
    reason: str,
    micro_batches: int,
    total_norm: Tensor,
    names: list[str],
    params: list[Tensor],
    inv: float,
    optimizer_state: dict[str, Any],
    layers: LayerStats,
    attached: Mapping[str, list[Any]],
    scale: float | None,
) -> dict[str, Any]:
    """What an anomaly snapshot holds (format 1; see :func:`clipopt.load_snapshot`).

    ``scale`` is the GradScaler's loss scale of the window (None without a scaler):
    :func:`clipopt.replay` needs it to tell an overflow of the scale from a fault.
    """
    return {
        "format": 1,
        "step": step,
        "reason": reason,
        "micro_batches": micro_batches,
        "total_norm": float(total_norm.item()),
        "params": {name: p.detach().to("cpu", copy=True) for name, p in zip(names, params, strict=True)},
        "grads": {
            name: (p.grad.detach() * inv).to("cpu")
            for name, p in zip(names, params, strict=True)
            if p.grad is not None
        },
        "optimizer": optimizer_state,
        "layer_stats": layers.as_dict(),
        "attached": {
            name: to_saveable(values[0] if len(values) == 1 else values, name)
            for name, values in attached.items()
        },
        "versions": versions(),
        "time": now(),
        "rank": process_rank(),
        "scale": scale,
    }


def check_layer_stats(value: Any) -> int:
    """``layer_stats``: False -> 0 (off), True -> 1, k -> every k windows."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int) and value >= 1:
        return value
    raise (TypeError if not isinstance(value, int) else ValueError)(
        f"layer_stats must be True, False or an int >= 1, got {value!r}; "
        "pass e.g. layer_stats=10 for statistics every 10 updates"
    )


class LayerStatistics(Part):
    """The part ``layer_stats=k`` builds: per-parameter statistics (``StepStats.layers``) every
    ``k``-th window, computed by :meth:`Diagnostics.diagnose` on the pre-clip gradients.

    ``opt.layer_stats`` reads ``k`` (0 when off); assigning it mid-run is checked as the constructor
    checks it.  The windows between two statistics windows close plain (:meth:`plain`).  Never part
    of the ranks' agreement, no state-dict entry.
    """

    keyword: ClassVar[str] = "layer_stats"
    observer: ClassVar[bool] = True

    def __init__(self, every: int) -> None:
        self.every = every  #: statistics at every ``every``-th window

    @classmethod
    def build(cls, value: Any, inner: Optimizer) -> Part | None:
        every = check_layer_stats(value)
        return cls(every) if every else None

    def value(self) -> int:
        return self.every

    @classmethod
    def unset(cls) -> int:
        return 0

    def plain(self, window: int) -> bool:
        return window % self.every != 0  # no statistics due at it

    def configure(self, diagnostics: Any) -> None:
        diagnostics.every = self.every


def _look_at_elements(d: WindowDecision, layers: LayerStats) -> None:
    """The window's elements as the full statistics counted them (a non-finite window): whether
    any is nan/inf, on the device (``d.elements``; kept when the candidate row set it already)."""
    values = layers.device_values()
    if d.elements is None and values is not None and values.numel():
        d.elements = (values[:, 3].nan_to_num(0.0) > 0).any().to(torch.float32)


@dataclass
class Diagnostics:
    """The wrapper's diagnostics state; closing a window replaces a copy of it on failure (``UndoPoint``)."""

    writer: SnapshotWriter | None = None  #: writes the snapshots (``snapshot_dir``), None without
    attached: dict[str, list[Any]] = field(default_factory=dict)  #: :meth:`attach`-ed, for this window
    bad_row: LayerStats | None = None  #: the window's candidate per-layer row (_diagnostics/badrow.py)
    last_snapshot: str | None = None  #: the latest snapshot written, or None
    last_nonfinite_snapshot: str | None = None  #: the latest non-finite/overflow one (the error names it)
    #: What the observers ask (:meth:`configure`): per-layer statistics every ``every`` windows (0:
    #: never), a logger (``logged``), so the measure keeps each gradient's norm (``rows``).
    every: int = 0
    logged: bool = False
    rows: bool = False
    max_snapshots: int = 10  #: the writer's limit per reason (the wrapper's ``max_snapshots``)

    def configure(self, parts: Any) -> None:
        """The active ``parts`` (``_part.Parts``) say what this stage does (:meth:`Part.configure`):
        per-layer statistics, a logger, the snapshot writer."""
        self.every, self.logged, self.writer = 0, False, None
        parts.configure(self)
        self.rows = bool(self.every) and self.logged
        self.limit(self.max_snapshots)

    def limit(self, max_snapshots: int) -> None:
        """At most ``max_snapshots`` snapshots per reason from now on."""
        self.max_snapshots = max_snapshots
        if self.writer is not None:
            self.writer.max_snapshots = max_snapshots

    @property
    def on(self) -> bool:
        """Whether the stage runs: per-layer statistics or snapshots are on."""
        return bool(self.every) or self.writer is not None

    def attach(self, tensors: Mapping[str, Any]) -> None:
        """Keep ``tensors`` for this window's snapshot; every value is checked before any is kept."""
        for name, value in tensors.items():
            check_saveable(value, name)
        for name, value in tensors.items():
            self.attached.setdefault(name, []).append(value)

    def diagnose(
        self,
        s: WindowSettings,
        d: WindowDecision,
        params: list[Tensor],
        names: Callable[[], list[str]],
        *,
        window: tuple[int, int],
        sharded: bool,
        spike: Callable[[], Tensor | None],
        saved: tuple[Optimizer, WrapperState, Any],
    ) -> LayerStats | None:
        """Per-layer statistics of the window when due, and its anomaly snapshot when it needs one.

        ``window``: its step and micro-batches; ``spike()``: the SpikeGuard's spike rule; ``saved``:
        the inner optimizer, the counters and the GradScaler (or None), whose state a snapshot
        holds.  Either one reads the decision's ``nonfinite`` (and divergence, and the spike rules)
        from the device, once (``read_anomaly``).
        """
        step = window[0]
        due = bool(self.every) and step % self.every == 0
        if due:
            self.bad_row = None  # the full statistics are this window's row
        if not due and self.writer is None:
            return None
        snapshots = self.writer is not None
        guard_spike = spike() if snapshots else None
        bad, reason = read_anomaly(d, s.policy if snapshots else None, snapshots, s.scaled, guard_spike)
        stats_of = sharded_layer_stats if sharded else compute_layer_stats  # the former: collective
        layers = stats_of(params, names(), 1.0 / s.divisor, bad) if due else None
        if bad and layers is not None and not sharded:
            _look_at_elements(d, layers)
        if reason is not None and self.writer is not None and self.writer.admit(reason):
            self._snapshot(
                self.writer, s, d, params, names(), (layers, bad), window=window, reason=reason, saved=saved
            )
        return layers

    def _snapshot(
        self,
        writer: SnapshotWriter,
        s: WindowSettings,
        d: WindowDecision,
        params: list[Tensor],
        names: list[str],
        due: tuple[LayerStats | None, bool],
        *,
        window: tuple[int, int],
        reason: str,
        saved: tuple[Optimizer, WrapperState, Any],
    ) -> None:
        """Write the window's ``reason`` snapshot with its full per-layer statistics (``due``: those
        computed already, or None, and whether the window is non-finite)."""
        layers, bad = due
        inv = 1.0 / s.divisor
        if layers is None:
            layers = compute_layer_stats(params, names, inv, bad)
            self.bad_row = layers if self.every else None  # the full row, computed anyway
            if bad:
                _look_at_elements(d, layers)
        if bad and not any(row[3] > 0 for row in layers.rows()):  # read for the payload anyway
            reason = by_code(NORM_OVERFLOW).name  # every element finite: the float32 norm overflowed
        inner, counters, scaler = saved
        payload = snapshot_payload(
            step=window[0],
            reason=reason,
            micro_batches=window[1],
            total_norm=d.total_norm,
            names=names,
            params=params,
            inv=inv,
            optimizer_state={
                **inner.state_dict(),
                "clipopt": counters.to_dict(pending_grads=None, scaler=None),
            },
            layers=layers,
            attached=self.attached,
            scale=None if scaler is None else float(scaler.get_scale()),
        )
        path = writer.save(payload)
        self.last_snapshot = path or self.last_snapshot
        if path is not None and reason in NONFINITE_NAMES:
            self.last_nonfinite_snapshot = path
