"""Undoing a failed or rejected step: the wrapper's own state, and an inner optimizer's.

* :class:`UndoPoint` holds what closing a window changes in the wrapper
  (counters, signals, policy state, the latest statistics); an error inside
  ``step()`` puts it back, so the wrapper is exactly as before the call.
* :class:`InnerBackup` copies parameters and inner state before the inner step
  of an optimizer that re-evaluates its closure (LBFGS): a re-evaluation whose
  gradients or loss are not finite happens after the parameters moved, so the
  window can only be skipped by restoring that copy.  ``UpdateClip`` copies the
  parameters (and, with ``restore_state=True``, the state) before every inner
  step, into buffers it keeps from window to window
  (:class:`~clipopt._window.update_copy.UpdateCopy`), and puts them back when the
  update is not finite: on the device (:meth:`InnerBackup.restore_where`), or by
  copies when the decision is read on the host anyway (:meth:`InnerBackup.put_back`).
"""

from __future__ import annotations

import copy
import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = ["InnerBackup", "UndoPoint", "local_view", "note_discarded", "nonfinite_loss"]


def nonfinite_loss(loss: Any) -> bool:
    """Whether a closure's return value is a non-finite number (a host read for a tensor)."""
    if isinstance(loss, Tensor):
        return loss.numel() > 0 and not bool(torch.isfinite(loss.detach()).all())
    if isinstance(loss, (int, float)):
        return not math.isfinite(loss)
    return False


class UndoPoint:
    """The wrapper's state before a window closes; :meth:`restore` puts it back.

    ``fields`` are the owner's attributes that closing a window replaces (by
    name, as the owner lists them; values that are changed in place must be
    copies); ``policy`` is the clipping policy, whose attributes are copied
    (policies replace their tensors rather than writing into them, so a
    shallow copy is a snapshot of their state); ``stats`` is the history, of
    which only the length is kept (a failed close only appends).
    """

    __slots__ = (
        "_fields",
        "_owner",
        "_policy",
        "_policy_state",
        "_stats",
        "_stats_len",
        "committed",
        "touched",
    )

    def __init__(
        self, owner: object, fields: dict[str, Any], policy: object | None, stats: deque[Any]
    ) -> None:
        self._owner = owner
        self._fields = fields
        self._policy = policy
        self._policy_state = None if policy is None else dict(vars(policy))
        self._stats = stats
        self._stats_len = len(stats)
        #: Set once the window's update has been applied or skipped: from then on it stands.
        self.committed = False
        #: Set once the gradients may have been changed in place (they cannot be restored).
        self.touched = False

    def restore(self) -> None:
        for name, value in self._fields.items():
            setattr(self._owner, name, value)
        if self._policy is not None and self._policy_state is not None:
            vars(self._policy).clear()
            vars(self._policy).update(self._policy_state)
        while len(self._stats) > self._stats_len:
            self._stats.pop()


def note_discarded(exc: BaseException) -> None:
    """Say on ``exc`` that the failed close discarded the window (its gradients were changed in place)."""
    if hasattr(exc, "add_note"):
        exc.add_note(
            "clipopt: the window's gradients were already changed in place (unscaled or clipped) "
            "when this error was raised; they were discarded and the window's micro-batches are "
            "not counted"
        )


def local_view(t: Tensor) -> Tensor:
    """A DTensor's local shard (sharing its storage), or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return t if to_local is None else to_local()


def _copy_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """A copy of one parameter's state that LBFGS's step cannot reach: tensors cloned, lists copied.

    The tensors *inside* LBFGS's history lists (``old_dirs``, ``old_stps``,
    ``ro``) are never written in place (the lists are appended to and popped),
    so they are shared, not cloned: the copy costs a few flat vectors, not the
    whole history.
    """
    out: dict[str, Any] = {}
    for key, value in entry.items():
        if isinstance(value, Tensor):
            out[key] = value.detach().clone()
        elif isinstance(value, list):
            out[key] = list(value)
        else:
            out[key] = copy.copy(value)
    return out


class InnerBackup:
    """A copy of the parameters and, unless told otherwise, their inner state, taken before an
    inner step.

    ``copies``: the copy already taken: the parameters' values, and each parameter's state entry
    (None: the state is not copied, and a restore puts back the parameters alone); without it both
    are copied here.  ``kept``: the state's copies are buffers the caller keeps and fills again for
    the next window, so that a restore that replaces state entries puts fresh clones of them into
    the state, never the buffers."""

    __slots__ = ("_kept", "_optimizer", "_params", "_state", "_values")

    def __init__(
        self,
        optimizer: Optimizer,
        params: Sequence[Tensor],
        copies: tuple[list[Tensor], dict[Tensor, dict[str, Any]] | None] | None = None,
        kept: bool = False,
    ) -> None:
        self._optimizer = optimizer
        self._params = list(params)
        self._kept = kept
        if copies is not None:
            self._values, self._state = copies
            return
        with torch.no_grad():
            self._values = [p.detach().clone() for p in self._params]
        self._state = self.copy_state(optimizer, self._params)

    @staticmethod
    def copy_state(optimizer: Optimizer, params: Sequence[Tensor]) -> dict[Tensor, dict[str, Any]]:
        """A copy of the state entries of ``params`` that the inner step cannot reach."""
        state = optimizer.state
        return {p: _copy_entry(state[p]) for p in params if p in state}

    @property
    def values(self) -> list[Tensor]:
        """The copies of the parameters, in the order given."""
        return self._values

    def _same_layout(self, device: torch.device) -> bool:
        """Whether the inner step left the state's layout as copied (the same entries, every saved
        value a tensor of the same shape on ``device``): then it can be written back in place."""
        state, saved_state = self._optimizer.state, self._state or {}
        for p in self._params:
            saved, now = saved_state.get(p), state.get(p)
            if saved is None or now is None:
                if saved is not now:
                    return False
                continue
            if saved.keys() != now.keys():
                return False
            for key, value in saved.items():
                current = now[key]
                if not (isinstance(value, Tensor) and isinstance(current, Tensor)):
                    return False
                if value.shape != current.shape or local_view(current).device != device:
                    return False
        return True

    def _pairs(self) -> list[tuple[Tensor, Tensor]]:
        """``(tensor, its copy)`` local shards: the parameters, then the state's tensors (same layout)."""
        pairs = [(local_view(p), local_view(v)) for p, v in zip(self._params, self._values, strict=True)]
        state = self._optimizer.state
        for p, saved in (self._state or {}).items():
            pairs.extend((local_view(state[p][key]), local_view(value)) for key, value in saved.items())
        return pairs

    @torch.no_grad()
    def restore_where(self, flag: Tensor) -> None:
        """What was copied back where ``flag`` (a 0/1 device tensor) is 1, without a host read when
        the step kept the state's layout (every value a tensor on ``flag``'s device, as with the
        fused and foreach optimizers once they have state; always, when the state was not copied):
        a select written into each tensor (no new tensor); else ``flag`` is read once and
        :meth:`restore` runs when it is 1 (nothing else happens when it is 0)."""
        if self._state is not None and not self._same_layout(flag.device):
            if bool(flag.item()):
                self.restore()
            return
        on = flag > 0
        for current, value in self._pairs():
            torch.where(on, value, current, out=current)

    @torch.no_grad()
    def put_back(self) -> None:
        """What was copied back, bit for bit, written into the tensors (one ``_foreach_copy_`` per
        device and dtype; :meth:`restore` where the step changed the state's layout); the gradients
        stay.  For a decision already known on the host."""
        device = local_view(self._params[0]).device if self._params else torch.device("cpu")
        if self._state is not None and not self._same_layout(device):
            self.restore(discard_grads=False)
            return
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]] = {}
        for current, value in self._pairs():
            dsts, srcs = groups.setdefault((current.device, current.dtype), ([], []))
            dsts.append(current)
            srcs.append(value)
        for dsts, srcs in groups.values():
            torch._foreach_copy_(dsts, srcs)

    @torch.no_grad()
    def restore(self, discard_grads: bool = True) -> None:
        """Parameters (and the inner state, when it was copied) back to the copy, bit for bit; the
        gradients are discarded unless told otherwise."""
        state = self._optimizer.state
        for p, value in zip(self._params, self._values, strict=True):
            local_view(p).copy_(local_view(value))
            if discard_grads:
                p.grad = None
            if self._state is None:
                continue
            if p in self._state:  # the caller's buffers are refilled: the state gets its own copies
                state[p] = _copy_entry(self._state[p]) if self._kept else self._state[p]
            else:
                state.pop(p, None)
