"""``UpdateClip``: a bound on the *update* the inner optimizer made, and its pure rules.

The update of a window is ``u = p_after - p_before`` for every parameter: what
the inner optimizer's step changed (learning rate and weight decay included), so
the bounds are in the units of the parameters, *after* the learning rate: with
AdamW each element of the update is at most about the learning rate, not 1.
:class:`UpdateClip` decides, on the device, one coefficient per parameter
tensor (``max_rms``) or one for all of them (``max_norm``, ``z``);
:mod:`clipopt._window.update_apply` forms the update and applies the coefficients.

* ``max_rms``: each tensor's update is divided by ``max(1, rms(u) / max_rms)``,
  ``rms(u) = ||u|| / sqrt(numel)`` (optax ``clip_by_block_rms``, Levanter's
  update RMS clipping).
* ``max_norm``: the update of all parameters together is divided by
  ``max(1, ||u|| / max_norm)`` (optax ``clip_by_global_norm``).
* ``z``: Levanter's ``clip_update_norm`` (``clip_update_by_historical_norm``),
  rule for rule: a ring of the last ``window`` update norms *before* clipping;
  while it holds fewer than ``max(2, window // 2)`` there is no bound, then the
  bound is ``mean + z * max(std, 1e-6)`` (population std of the ring), and an
  update whose norm exceeds it is multiplied by ``bound / max(norm, 1e-6)``.
  One difference: Levanter appends every step's norm; here a window that was
  skipped (it made no update) adds nothing to the ring.

Everything is a tensor operation on the device: no host read.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from .._checks import check_flag, check_int_at_least, check_optional_positive_float
from .._inner import inner_optimizers, reevaluates
from .._part import Part, Window
from .update_apply import UpdateWork

__all__ = [
    "MODES",
    "UpdateClip",
    "global_coef",
    "rms_coefs",
    "z_bound",
    "z_coef",
]

#: The three ways to bound the update, in the order of the constructor's arguments.
MODES = ("max_rms", "max_norm", "z")

#: Levanter's floor for the ring's standard deviation and for the norm it divides by.
_EPS = 1e-6

#: Realistic examples for the error messages: the bound is on the update after the learning rate
#: (with AdamW at lr=1e-3 its elements are at most about 1e-3), so 1.0 would bound nothing.
_EXAMPLES = {"max_rms": "1e-3", "max_norm": "0.5", "z": "3.0"}


def rms_coefs(norms: Tensor, numels: Sequence[int], max_rms: float) -> Tensor:
    """Each tensor's coefficient ``1 / max(1, rms / max_rms)``, ``rms = norm / sqrt(numel)`` (an empty
    tensor counts one element: its coefficient is 1)."""
    roots = [math.sqrt(max(n, 1)) for n in numels]  # Python numbers: no host-to-device copy
    rms = torch.stack(torch._foreach_div(list(norms.unbind()), roots))
    return torch.clamp(rms / max_rms, min=1.0).reciprocal()


def global_coef(norm: Tensor, max_norm: float) -> Tensor:
    """The coefficient of every tensor under a global bound: ``1 / max(1, norm / max_norm)``."""
    return torch.clamp(norm / max_norm, min=1.0).reciprocal()


def z_bound(history: Tensor, count: Tensor, z: float, window: int) -> Tensor:
    """Levanter's bound from the ring ``history`` holding ``count`` valid norms (its first
    ``count`` slots): ``mean + z * max(std, 1e-6)``, or ``inf`` while ``count < max(2, window // 2)``."""
    valid = (torch.arange(history.numel(), device=history.device) < count).to(history.dtype)
    n = count.to(history.dtype)
    mean = (history * valid).sum() / n
    std = (((history - mean) ** 2) * valid).sum().div(n).sqrt()
    bound = mean + z * torch.clamp(std, min=_EPS)
    enough = count >= max(2, window // 2)
    return torch.where(enough, bound, torch.full_like(bound, math.inf))


def z_coef(norm: Tensor, bound: Tensor) -> Tensor:
    """Levanter's coefficient: ``bound / max(norm, 1e-6)`` when ``norm > bound``, else 1."""
    return torch.where(norm > bound, bound / torch.clamp(norm, min=_EPS), torch.ones_like(norm))


class UpdateClip(Part):
    """Bound the update the inner optimizer makes (``ClippedOptimizer(..., update_clip=UpdateClip(...))``).

    Give exactly one of ``max_rms``, ``max_norm`` or ``z``.  The bound is on the
    *update*, after the learning rate (and weight decay): in the parameters' units, not the
    gradient's.  With AdamW at ``lr=1e-3`` each element of the update is at most about ``1e-3``
    (its RMS less), so ``max_rms=1e-3`` bounds only unusually large updates, and ``max_rms=1.0``
    bounds nothing.

    Args:
        max_rms: per parameter tensor, ``u / max(1, rms(u) / max_rms)`` (optax
            ``clip_by_block_rms``; Levanter's update RMS clipping).
        max_norm: over all parameters, ``u / max(1, ||u|| / max_norm)``.
        z: adaptive, Levanter's ``clip_update_norm``: the bound is
            ``mean + z * max(std, 1e-6)`` of the last ``window`` update norms
            (before clipping, of the windows that were applied), once the
            history holds ``max(2, window // 2)`` of them; no bound before.
        window: the history's length for ``z`` (default 128).
        restore_state: also put the inner optimizer's state back when an update is rejected (not
            finite although the gradients were): a copy of the state is then taken before every
            inner step and held between windows (for AdamW twice the parameters' bytes, and about
            as much time again as the default).  By default only the parameters are put back and
            the state keeps what the rejected step made of the window's gradient (see
            docs/update-clipping.md, "A non-finite update is never applied").

    The update is ``p_after - p_before`` (learning rate and weight decay
    included); the coefficient applied is ``StepStats.update_coef`` (with
    ``max_rms`` the smallest over the tensors) and the norm before clipping
    ``StepStats.update_norm``.  See docs/update-clipping.md.

    As a part (:class:`~clipopt._part.Part`, keyword ``update_clip``): the parameters are copied
    just before the inner step (:meth:`before_step`, into the buffers it shares with
    ``update_stats``: :class:`~clipopt._window.update_apply.UpdateWork`), the update measured,
    bounded or put back just after it (:meth:`after_step`, before the other parts' hooks), its
    ``z`` history is its state-dict entry and is held by a Rewind copy.
    """

    keyword = "update_clip"
    takes = "an UpdateClip"
    example = "UpdateClip(max_rms=1e-3) (a bound on the update, after the learning rate)"
    held = True
    shares = UpdateWork

    def __init__(
        self,
        *,
        max_rms: float | None = None,
        max_norm: float | None = None,
        z: float | None = None,
        window: int = 128,
        restore_state: bool = False,
    ) -> None:
        restore = check_flag("restore_state", restore_state)
        given = {
            "max_rms": check_optional_positive_float("max_rms", max_rms, _EXAMPLES["max_rms"]),
            "max_norm": check_optional_positive_float("max_norm", max_norm, _EXAMPLES["max_norm"]),
            "z": check_optional_positive_float("z", z, _EXAMPLES["z"]),
        }
        chosen = [name for name, value in given.items() if value is not None]
        if len(chosen) != 1:
            got = ", ".join(f"{name}={given[name]!r}" for name in chosen) or "none of them"
            raise ValueError(
                f"UpdateClip takes exactly one of max_rms, max_norm or z, got {got}; "
                "the bound is on the update after the learning rate (with AdamW at lr=1e-3 its "
                "elements are at most about 1e-3): pass e.g. UpdateClip(max_rms=1e-3), "
                "UpdateClip(max_norm=0.5) or UpdateClip(z=3.0, window=128)"
            )
        self.window = check_int_at_least("window", window, 2, 128)
        if self.window != 128 and chosen[0] != "z":
            raise ValueError(
                f"window={window!r} is the history of UpdateClip(z=...), not of {chosen[0]}=...; "
                f"pass UpdateClip({chosen[0]}={given[chosen[0]]!r}) without window, or use z=3.0"
            )
        #: ``"max_rms"``, ``"max_norm"`` or ``"z"``.
        self.mode: str = chosen[0]
        #: The value of that argument.
        self.limit: float = float(given[self.mode])  # type: ignore[arg-type]
        #: Whether a rejected update also puts the inner optimizer's state back (a copy per window).
        self.restore_state: bool = restore
        self._history = torch.zeros(self.window, dtype=torch.float32)  # the ring (z only)
        self._count = torch.zeros((), dtype=torch.int64)  # valid entries, at most window
        self._next = torch.zeros((), dtype=torch.int64)  # the slot the next norm goes to
        self._fresh = True  # nothing recorded or loaded yet: made anew on the device, not copied there

    @property
    def per_tensor(self) -> bool:
        """Whether each tensor has its own coefficient (``max_rms``)."""
        return self.mode == "max_rms"

    def coefficients(self, norms: Tensor, numels: Sequence[int], total: Tensor) -> Tensor:
        """The coefficient of each tensor (``max_rms``: a vector) or of all (0-d), on the device.

        ``norms``: each tensor's update norm (float32), ``numels`` their sizes, ``total`` the
        norm of the whole update.  Reads the history (``z``); :meth:`remember` adds to it.
        """
        if self.mode == "max_rms":
            return rms_coefs(norms, numels, self.limit)
        if self.mode == "max_norm":
            return global_coef(total, self.limit)
        self._to(total.device)
        return z_coef(total, z_bound(self._history, self._count, self.limit, self.window))

    @classmethod
    def build(cls, value: Any, inner: Optimizer) -> UpdateClip | None:
        """An ``UpdateClip`` or None (``TypeError``); an inner optimizer that re-evaluates its
        closure (LBFGS) cannot have its step bounded afterwards (``ValueError``)."""
        clip = cls.checked(value, UpdateClip)
        if clip is None:
            return None
        lbfgs = [type(o).__name__ for o in inner_optimizers(inner) if reevaluates(o)]
        if lbfgs:
            raise ValueError(
                f"update_clip={clip!r} cannot bound the step of {lbfgs[0]}: its line search and "
                "curvature pairs assume the step it took; pass update_clip=None "
                "(update_stats=True records the update norm)"
            )
        return clip

    def before_step(self, w: Window, d: Any) -> None:
        """Copy the parameters (and, with ``restore_state=True``, the inner state) just before the
        inner step."""
        w.shared[UpdateWork].start(self, w)

    def after_step(self, w: Window, d: Any, skipped: bool | Tensor) -> bool | Tensor:
        """Measure, reject or bound the update the inner step made; the window's outcome."""
        out: bool | Tensor = w.shared[UpdateWork].finish(w, d, skipped)
        return out

    def check_state(self, saved: Any, inner: Optimizer) -> Any:
        """``ValueError`` unless this UpdateClip can load ``saved`` (loaded into a copy)."""
        copy.deepcopy(self).load_state_dict(saved)
        return saved

    def load_state(self, checked: Any) -> None:
        self.load_state_dict(checked)

    def remember(self, total: Tensor, applied: Tensor) -> None:
        """Add the window's update norm ``total`` (before clipping) to the history when ``applied``
        (a 0/1 flag on the device): a skipped window made no update.  No host read."""
        if self.mode != "z":
            return
        self._to(total.device)
        on = applied > 0
        slot = self._next.reshape(1)
        old = self._history.index_select(0, slot)
        value = torch.where(on, total.to(torch.float32).reshape(1), old)
        self._history = self._history.scatter(0, slot, value)  # replaced, never written into
        self._fresh = False
        self._next = torch.where(on, (self._next + 1) % self.window, self._next)
        self._count = torch.where(on, torch.clamp(self._count + 1, max=self.window), self._count)

    def _to(self, device: torch.device) -> None:
        """The history on ``device`` (the update norms'); a fresh one is made there (no copy)."""
        if self._history.device == device:
            return
        if self._fresh:
            self._history = torch.zeros(self.window, dtype=torch.float32, device=device)
            self._count = torch.zeros((), dtype=torch.int64, device=device)
            self._next = torch.zeros((), dtype=torch.int64, device=device)
        else:
            self._history = self._history.to(device)
            self._count, self._next = self._count.to(device), self._next.to(device)

    def state_dict(self) -> dict[str, Any]:
        """The history of ``z`` (the ring, its count and next slot); empty for the other modes."""
        if self.mode != "z":
            return {}
        return {"history": self._history.clone(), "count": self._count.clone(), "next": self._next.clone()}

    def load_state_dict(self, state: Any) -> None:
        """Load :meth:`state_dict` of an ``UpdateClip``: a ``z`` history of the same window, or the
        empty state of ``max_rms``/``max_norm`` (which leaves ``z``'s history empty: the modes load
        each other's checkpoints).  ``ValueError`` before anything changes for a history of another
        window, or one whose values cannot be a saved history."""
        if self.mode != "z":
            return
        if isinstance(state, dict) and not state:  # saved by max_rms/max_norm: no history
            self._reset()
            return
        history, count, nxt = _checked_ring(state, self.window)
        device = self._history.device
        self._history = history.to(device, torch.float32, copy=True)
        self._count = count.to(device, torch.int64, copy=True)
        self._next = nxt.to(device, torch.int64, copy=True)
        self._fresh = False

    def _reset(self) -> None:
        """An empty history (made anew on the device of the first update norms, as a fresh one)."""
        self._history = torch.zeros(self.window, dtype=torch.float32)
        self._count = torch.zeros((), dtype=torch.int64)
        self._next = torch.zeros((), dtype=torch.int64)
        self._fresh = True

    def settings(self) -> dict[str, object]:
        """What data-parallel ranks must share: the mode as a code (plus 3 with ``restore_state``:
        ranks that put the state back differently would drift), the limit, the window."""
        return {
            f"{self.keyword}.mode": float(MODES.index(self.mode) + 3 * self.restore_state),
            f"{self.keyword}.limit": self.limit,
            f"{self.keyword}.window": float(self.window),
        }

    def __repr__(self) -> str:
        window = f", window={self.window}" if self.mode == "z" else ""
        restore = ", restore_state=True" if self.restore_state else ""
        return f"UpdateClip({self.mode}={self.limit:g}{window}{restore})"


def _checked_ring(state: Any, window: int) -> tuple[Tensor, Tensor, Tensor]:
    """The ``history``, ``count`` and ``next`` of a saved ``z`` history of ``window`` norms, checked
    (``ValueError`` otherwise): real tensors of the right shapes, ``count`` in [0, window], ``next``
    the slot after the newest norm, every norm finite and >= 0.  Reads the saved values (a load,
    not a step)."""
    parts = [state.get(k) for k in ("history", "count", "next")] if isinstance(state, dict) else []
    tensors = [t.detach() for t in parts if isinstance(t, Tensor) and not t.is_complex()]
    fix = f"load a state dict saved with the same update_clip (UpdateClip(z=..., window={window}))"
    if len(tensors) != 3 or tensors[0].shape != (window,) or not all(t.numel() == 1 for t in tensors[1:]):
        raise ValueError(
            f"invalid UpdateClip state: expected the history of {window} update norms saved by "
            f"UpdateClip(z=..., window={window}); load a state dict saved with the same update_clip"
        )
    history, count, nxt = tensors[0], tensors[1].reshape(()), tensors[2].reshape(())
    n, at = count.double().item(), nxt.double().item()
    if not (n in range(window + 1) and at in range(window) and (n == window or at == n)):
        raise ValueError(
            f"invalid UpdateClip state: count={n:g} and next={at:g} are not those of a ring of "
            f"{window} norms (0 <= count <= {window}, next the slot after the newest); {fix}"
        )
    if not bool((torch.isfinite(history) & (history >= 0)).all()):
        raise ValueError(
            f"invalid UpdateClip state: the history holds a norm that is not finite and >= 0; {fix}"
        )
    return history, count, nxt
