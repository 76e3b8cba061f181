"""The copy ``UpdateClip`` takes before every inner step, into buffers kept from window to window.

``update_clip=`` and ``update_stats=`` copy the parameters just before each
inner step (see :mod:`clipopt._window.update_apply`): one buffer per parameter,
allocated once and filled again in every window with one ``torch._foreach_copy_``
per device and dtype, allocated anew only when the layout changes (a parameter
added, removed, reshaped, or moved to another dtype or device).  That is the
memory held between windows: one copy of the parameters (and, on the CPU, a
scratch buffer of :data:`~clipopt._window.update_apply.PIECE_NUMEL` elements per
dtype).  The update ``u = p_after - p_before`` is never held: its norms are taken
piece by piece through that scratch buffer (:mod:`clipopt._window.update_apply`).

``UpdateClip(..., restore_state=True)`` also copies the inner optimizer's state
tensors (for AdamW twice the parameters' bytes more), into buffers kept the same
way; an inner state that holds something other than tensors (a custom optimizer's
numbers or lists) is copied as :class:`~clipopt._window.rollback.InnerBackup`
copies it, anew each window.  The buffers are held by the
:class:`~clipopt._window.update_apply.UpdateWork` that ``UpdateClip`` and
``update_stats`` share, which the wrapper's parts drop when both are turned off.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from .rollback import InnerBackup, local_view

__all__ = ["UpdateCopy"]


def _one(t: Tensor) -> Hashable:
    """What a buffer for ``t`` depends on: its kind, and its local shard's shape, dtype and device."""
    local = local_view(t)
    return type(t), local.shape, local.dtype, local.device


def _state_layout(params: Sequence[Tensor], entries: dict[Tensor, dict[str, Any]]) -> Hashable:
    """What the state buffers depend on: each state tensor's :func:`_one` and the state's keys."""
    return tuple(
        tuple((key, _one(v)) for key, v in entries[p].items()) if p in entries else None for p in params
    )


def _tensor_state(entries: dict[Tensor, dict[str, Any]]) -> bool:
    """Whether every state value is a tensor (the layout the buffers can hold)."""
    return all(isinstance(v, Tensor) for entry in entries.values() for v in entry.values())


def _grouped(pairs: list[tuple[Tensor, Tensor]]) -> list[tuple[list[Tensor], list[Tensor]]]:
    """``(destinations, sources)`` lists, one per device and dtype, in the order first seen."""
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]] = {}
    for dst, src in pairs:
        dsts, srcs = groups.setdefault((dst.device, dst.dtype), ([], []))
        dsts.append(dst)
        srcs.append(src)
    return list(groups.values())


def _copy_into(pairs: list[tuple[Tensor, Tensor]]) -> None:
    """Each destination (a local shard) filled from its source: one ``_foreach_copy_`` per group."""
    for dsts, srcs in _grouped(pairs):
        torch._foreach_copy_(dsts, srcs)


class UpdateCopy:
    """Buffers for the copy of the parameters (and, on request, of the inner state) taken before
    each inner step.

    Copying the owner (``copy.deepcopy``, pickling) copies no buffer: the copy starts empty.
    """

    __slots__ = ("_layout", "_scratch", "_state", "_state_layout", "_values")

    def __init__(self) -> None:
        self._layout: Hashable = None
        self._values: list[Tensor] = []
        self._state_layout: Hashable = None
        self._state: dict[Tensor, dict[str, Any]] = {}
        self._scratch: dict[torch.dtype, Tensor] = {}

    def release(self) -> None:
        """Hold nothing (the next :meth:`take` allocates anew)."""
        self._layout, self._values, self._state_layout, self._state = None, [], None, {}
        self._scratch = {}

    def scratch(self, dtype: torch.dtype, numel: int) -> Tensor:
        """A CPU buffer of at least ``numel`` elements of ``dtype``, kept (the update's pieces)."""
        buf = self._scratch.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = self._scratch[dtype] = torch.empty(numel, dtype=dtype)
        return buf

    def __reduce__(self) -> tuple[type[UpdateCopy], tuple[()]]:
        return UpdateCopy, ()

    @property
    def held_bytes(self) -> int:
        """The bytes the buffers hold between windows (local shards)."""
        state = [v for e in self._state.values() for v in e.values()]
        tensors = [*self._values, *state, *self._scratch.values()]
        return sum(local_view(t).numel() * local_view(t).element_size() for t in tensors)

    @torch.no_grad()
    def take(self, optimizer: Optimizer, params: Sequence[Tensor], with_state: bool) -> InnerBackup:
        """The copy of ``params`` (and, ``with_state``, of their state in ``optimizer``), now,
        before the inner step."""
        layout: Hashable = tuple(_one(p) for p in params)
        if layout != self._layout:
            self._values, self._layout = [p.detach().clone() for p in params], layout
        else:
            _copy_into([(local_view(b), local_view(p)) for b, p in zip(self._values, params, strict=True)])
        if not with_state:
            self._state_layout, self._state = None, {}
            return InnerBackup(optimizer, params, (self._values, None))
        state = optimizer.state
        entries = {p: state[p] for p in params if p in state}
        if not _tensor_state(entries):
            self._state_layout, self._state = None, {}  # nothing held for a layout the buffers cannot hold
            return InnerBackup(optimizer, params, (self._values, InnerBackup.copy_state(optimizer, params)))
        layout = _state_layout(params, entries)
        if layout != self._state_layout:
            self._state = {p: {k: v.detach().clone() for k, v in e.items()} for p, e in entries.items()}
            self._state_layout = layout
            return InnerBackup(optimizer, params, (self._values, self._state), kept=True)
        pairs: list[tuple[Tensor, Tensor]] = []
        for p, saved in self._state.items():
            pairs.extend((local_view(b), local_view(entries[p][k])) for k, b in saved.items())
        _copy_into(pairs)
        return InnerBackup(optimizer, params, (self._values, self._state), kept=True)
