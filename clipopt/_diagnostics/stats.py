"""Per-update statistics that stay on the device until they are read."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from .._log_names import PART_COLUMNS
from .._reasons import name_of
from ..functional import clip_coef
from .layers import LayerStats

__all__ = ["DecisionRecord", "StepStats", "materialize"]


class DecisionRecord(Protocol):
    """What :class:`StepStats` reads of a window's decision
    (:class:`clipopt._window.decision.WindowDecision`): diagnostics sit below the window, so they
    name the fields they read instead of importing the class."""

    @property
    def total_norm(self) -> Tensor | float: ...
    @property
    def coef(self) -> float | Tensor | None: ...
    @property
    def clipped(self) -> bool | Tensor | None: ...
    @property
    def reason(self) -> int | Tensor: ...
    @property
    def max_norm(self) -> float | Tensor | None: ...
    @property
    def loss(self) -> Tensor | float | None: ...
    @property
    def group_norms(self) -> Tensor | None: ...
    @property
    def group_coefs(self) -> Tensor | None: ...
    @property
    def update_norm(self) -> Tensor | None: ...
    @property
    def update_coef(self) -> Tensor | None: ...


def _as_float(value: float | Tensor) -> float:
    return float(value.item()) if isinstance(value, Tensor) else float(value)


def _as_bool(value: bool | Tensor) -> bool:
    return bool(value.item()) if isinstance(value, Tensor) else bool(value)


def _vector(values: Tensor | None) -> tuple[float, ...] | Tensor:
    """A per-group record: a detached 1-d tensor (read later), or ``()`` when there is none."""
    return () if values is None else values.detach().reshape(-1)


class StepStats:
    """What happened at the end of one accumulation window.

    Recording a ``StepStats`` never synchronises with the device: the
    tensor-valued fields are kept as 0-d tensors and become Python numbers the
    first time they are read (that read may wait for the device).

    Attributes:
        step: 1-based index of the window (applied and skipped updates alike).
        micro_batches: micro-batches combined in this window.
        total_norm: norm of the combined gradient *before* any clipping, in
            float32 (float64 for float64 gradients); ``nan``/``inf`` when the
            gradients were not finite.
        clip_coef: factor the norm bound applied, ``min(1, max_norm/(norm+1e-6))``;
            ``1.0`` when norm clipping is off.
        clipped: True when norm clipping scaled the gradient down or value
            clipping changed at least one element.
        skipped: True when the update was skipped.
        reason: why it was skipped (``"nonfinite"``, ``"overflow"``, ``"spike"``,
            ``"divergence"``: data-parallel replicas disagreed, ``"nograd"``: no parameter had a
            gradient, ``"rewind"``: a Rewind restored a copy and discarded the window,
            ``"norm_overflow"``: every gradient element finite but the norm beyond float32's
            range, ``inf``; a smaller norm is taken without overflow, #35), or None.
        max_norm: the norm bound used for this window (a policy's threshold), or None when off.
        lr: the learning rate of each parameter group when the window closed.
        layers: per-parameter :class:`~clipopt.LayerStats` when they were due
            (``layer_stats=k``), else None.
        loss: the window's loss -- the micro-batch losses given to ``step(loss=...)``
            (or returned by the closure), combined like the gradients (mean or
            sum); ``nan`` when none was given.
        group_norms: with per-group clipping (a parameter group carries its own
            ``max_norm`` or ``clip_value``), each group's pre-clip norm, like
            ``total_norm``; ``()`` without.
        group_coefs: with per-group clipping, the norm-clipping coefficient each
            group's gradients were multiplied by (the common ``clip_coef`` for the
            groups sharing the wrapper's bound, 1.0 for a group left out); ``()`` without.
            ``clip_coef`` and ``max_norm`` are then those of the shared groups
            (``1.0`` and None in a window where no shared group has a gradient).
        update_norm: with ``update_clip`` or ``update_stats=True``, the L2 norm of the update
            the inner optimizer made (``p_after - p_before``, all parameters) before it was
            bounded; ``0.0`` in a skipped window; None without (docs/update-clipping.md).
        update_coef: with ``update_clip``, the coefficient the update was multiplied by (with
            ``max_rms`` the smallest over the tensors); ``1.0`` with ``update_stats`` alone,
            ``0.0`` for a non-finite update (not applied); None without.
        recovery: with a :class:`~clipopt.Rewind`, its cells (host numbers, None: not recorded), by
            column name (``clipopt._log_names.RECOVERY_COLUMNS``): ``batch_start``/``batch_end``,
            the batches ``opt.rewind.batches()`` drew during the window; with ``lr_cut``,
            ``lr_factor``; with ``reset_state``, ``state_reset``; ``{}`` without a Rewind.
    """

    __slots__ = (
        "_bad_row",
        "_clip_coef",
        "_clipped",
        "_group_coefs",
        "_group_norms",
        "_loss",
        "_lr",
        "_max_norm",
        "_reason",
        "_skipped",
        "_total_norm",
        "_update_coef",
        "_update_norm",
        "layers",
        "micro_batches",
        "recovery",
        "step",
    )

    def __init__(
        self,
        *,
        step: int,
        micro_batches: int,
        decision: DecisionRecord,
        skipped: bool | Tensor,
        lr: Sequence[float | Tensor] = (),
        layers: LayerStats | None = None,
        bad_row: LayerStats | None = None,
        recovery: dict[str, float | None] | None = None,
    ) -> None:
        self.step = step
        self.micro_batches = micro_batches
        self._total_norm: float | Tensor = decision.total_norm
        self._clip_coef = decision.coef
        self._clipped = decision.clipped
        self._skipped = skipped
        self._reason: int | float | Tensor = decision.reason  # a reason code of clipopt._reasons
        self._max_norm = decision.max_norm
        self._lr: tuple[float | Tensor, ...] = tuple(lr)
        self.layers = layers
        self._loss = decision.loss  # None: no loss was given
        self._group_norms: tuple[float, ...] | Tensor = _vector(decision.group_norms)
        self._group_coefs: tuple[float, ...] | Tensor = _vector(decision.group_coefs)
        self._update_norm: float | Tensor | None = decision.update_norm
        self._update_coef: float | Tensor | None = decision.update_coef
        self._bad_row = (
            bad_row  # per-layer row to log if this window is non-finite (clipopt._diagnostics.badrow)
        )
        self.recovery: dict[str, float | None] = recovery or {}

    def __getattr__(self, name: str) -> Any:
        """A part's cell by its column name (``stats.max_logit``): a host number or string (a 0-d
        tensor is read once, then kept as a number); None when that part is off."""
        try:
            cells = object.__getattribute__(self, "recovery")
        except AttributeError:  # (not set yet: unpickling)
            raise AttributeError(name) from None
        if name in cells:
            value = cells[name]
            if isinstance(value, Tensor):
                value = cells[name] = _as_float(value)
            return value
        if name in PART_COLUMNS:
            return None
        raise AttributeError(f"'StepStats' object has no attribute {name!r}")

    @property
    def loss(self) -> float:
        if isinstance(self._loss, Tensor):
            self._loss = _as_float(self._loss)
        return math.nan if self._loss is None else self._loss

    @property
    def has_loss(self) -> bool:
        """True when a loss was given for this window (``loss`` is then that loss, ``nan`` included)."""
        return self._loss is not None

    @property
    def total_norm(self) -> float:
        if isinstance(self._total_norm, Tensor):
            if self._clip_coef is None:
                self._derive_coef()  # from the norm's tensor, before it becomes a float
            self._total_norm = _as_float(self._total_norm)
        return self._total_norm

    def _derive_coef(self) -> None:
        """A window that did not compute its coefficient (``clip_coef`` None: a plain window on a
        fused optimizer, which hands the kernel its reciprocal) gets it from its norm now, on the
        device, as the window would have: ``min(1, max_norm / (total_norm + 1e-6))``."""
        if self._clip_coef is None and isinstance(self._total_norm, Tensor) and self._max_norm is not None:
            self._clip_coef = clip_coef(self._total_norm, self._max_norm)

    @property
    def clip_coef(self) -> float:
        if self._clip_coef is None:
            self._derive_coef()
        if isinstance(self._clip_coef, Tensor):
            self._clip_coef = _as_float(self._clip_coef)
        return 1.0 if self._clip_coef is None else self._clip_coef  # (None: no bound, never recorded)

    @property
    def clipped(self) -> bool:
        if self._clipped is None:  # norm clipping alone: the window was clipped when its coef was < 1
            self._clipped = self.clip_coef < 1.0
        elif isinstance(self._clipped, Tensor):
            self._clipped = _as_bool(self._clipped)
        return self._clipped

    @property
    def skipped(self) -> bool:
        if isinstance(self._skipped, Tensor):
            self._skipped = _as_bool(self._skipped)
        return self._skipped

    def known_skipped(self) -> bool | None:
        """:attr:`skipped` when the host knows it already (decided there, or read), else None: no read."""
        return None if isinstance(self._skipped, Tensor) else bool(self._skipped)

    @property
    def lr(self) -> tuple[float, ...]:
        if any(isinstance(x, Tensor) for x in self._lr):
            self._lr = tuple(_as_float(x) for x in self._lr)
        return self._lr  # type: ignore[return-value]

    @property
    def has_group_stats(self) -> bool:
        """True when the window recorded per-group norms and coefficients (no device read)."""
        return isinstance(self._group_norms, Tensor) or len(self._group_norms) > 0

    @property
    def group_norms(self) -> tuple[float, ...]:
        if isinstance(self._group_norms, Tensor):
            self._group_norms = tuple(self._group_norms.tolist())
        return self._group_norms

    @property
    def group_coefs(self) -> tuple[float, ...]:
        if isinstance(self._group_coefs, Tensor):
            self._group_coefs = tuple(self._group_coefs.tolist())
        return self._group_coefs

    @property
    def has_update_stats(self) -> bool:
        """True when the window recorded the update's norm and coefficient (no device read)."""
        return self._update_norm is not None

    @property
    def update_norm(self) -> float | None:
        if isinstance(self._update_norm, Tensor):
            self._update_norm = _as_float(self._update_norm)
        return self._update_norm

    @property
    def update_coef(self) -> float | None:
        if isinstance(self._update_coef, Tensor):
            self._update_coef = _as_float(self._update_coef)
        return self._update_coef

    @property
    def max_norm(self) -> float | None:
        if isinstance(self._max_norm, Tensor):
            self._max_norm = _as_float(self._max_norm)
        return self._max_norm

    @property
    def reason(self) -> str | None:
        if not self.skipped:
            return None
        if isinstance(self._reason, Tensor):
            self._reason = _as_float(self._reason)
        return name_of(int(self._reason))

    def logged_layers(self) -> LayerStats | None:
        """The per-layer row a logger writes: :attr:`layers` when due, else -- when this window's
        norm is not finite -- its own row from the norm pass (:mod:`clipopt._diagnostics.badrow`),
        else None."""
        if self.layers is not None:
            return self.layers
        if self._bad_row is not None and math.isfinite(self.total_norm):
            self._bad_row = None  # a finite window: drop the candidate row
        return self._bad_row

    def as_dict(self) -> dict[str, Any]:
        """All fields as Python values (reads the device once per field)."""
        return {
            "step": self.step,
            "micro_batches": self.micro_batches,
            "total_norm": self.total_norm,
            "clip_coef": self.clip_coef,
            "clipped": self.clipped,
            "skipped": self.skipped,
            "reason": self.reason,
            "max_norm": self.max_norm,
            "lr": list(self.lr),
            "loss": self.loss,
            "group_norms": list(self.group_norms),
            "group_coefs": list(self.group_coefs),
            "update_norm": self.update_norm,
            "update_coef": self.update_coef,
        }

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items())
        return f"StepStats({fields})"


_LAZY = (
    "_total_norm",
    "_clip_coef",
    "_clipped",
    "_skipped",
    "_max_norm",
    "_reason",
    "_loss",
    "_update_norm",
    "_update_coef",
)

_FLAGS = ("_clipped", "_skipped")

#: Per-group fields: 1-d tensors until read (per-group clipping).
_VECTORS = ("_group_norms", "_group_coefs")


def materialize(stats: Sequence[StepStats]) -> None:
    """Turn the device values of many :class:`StepStats` (and their layer statistics) into
    Python values with one host read."""
    for s in stats:
        s._derive_coef()
    pending = [(s, name) for s in stats for name in _LAZY if isinstance(getattr(s, name), Tensor)]
    vectors = [(s, name) for s in stats for name in _VECTORS if isinstance(getattr(s, name), Tensor)]
    layers: list[tuple[LayerStats, Tensor]] = []
    for lay in (s.layers for s in stats):
        values = None if lay is None else lay.device_values()
        if lay is not None and values is not None:
            layers.append((lay, values))
    if not pending and not layers and not vectors:
        return
    parts = [getattr(s, name).reshape(1) for s, name in pending]
    parts += [values.reshape(-1) for _, values in layers]
    parts += [getattr(s, name) for s, name in vectors]
    device = parts[0].device
    flat = torch.cat([t.to(device, torch.float64, non_blocking=True) for t in parts]).tolist()
    for i, (s, name) in enumerate(pending):
        setattr(s, name, bool(flat[i]) if name in _FLAGS else flat[i])
    offset = len(pending)
    for lay, values in layers:
        width = values.numel()
        lay.fill_rows(flat[offset : offset + width])
        offset += width
    for s, name in vectors:
        width = getattr(s, name).numel()
        setattr(s, name, tuple(flat[offset : offset + width]))
        offset += width
