"""The copy ``UpdateClip`` takes before every inner step, into buffers kept from window to window.

``update_clip=`` and ``update_stats=`` copy the parameters and their inner
state just before each inner step (see :mod:`clipopt._window.update_apply`).
:class:`UpdateCopy` allocates that copy once and fills it again in every window
with one ``torch._foreach_copy_`` per device and dtype, instead of a new clone of
every tensor per window; it allocates anew only when the layout changes (a
parameter or state entry added, removed, reshaped, or moved to another dtype or
device: the first steps, a ``load_state_dict`` onto another device).  It also
holds the buffers the update ``u = p_after - p_before`` is written into.  The
memory it holds between windows is two copies of the parameters (their values
and the update) and one of their tensor state: for AdamW 4x the parameters'
bytes, what the copy and the update used to allocate anew in every window.

An inner state that holds something other than tensors (LBFGS's history lists)
is copied as :class:`~clipopt._window.rollback.InnerBackup` copies it, anew each
window, and the buffers are freed.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from .rollback import InnerBackup, local_view

__all__ = ["UpdateCopy"]


def _layout(params: Sequence[Tensor], entries: dict[Tensor, dict[str, Any]]) -> Hashable:
    """What the buffers depend on: each parameter's and state tensor's kind, shape, dtype and
    device (of its local shard), and the state's keys."""

    def one(t: Tensor) -> Hashable:
        local = local_view(t)
        return type(t), local.shape, local.dtype, local.device

    return tuple(
        (one(p), tuple((key, one(v)) for key, v in entries[p].items()) if p in entries else None)
        for p in params
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


class UpdateCopy:
    """Buffers for the copy of the parameters and inner state taken before each inner step.

    Copying the owner (``copy.deepcopy``, pickling) copies no buffer: the copy starts empty.
    """

    __slots__ = ("_layout", "_state", "_updates", "_values")

    def __init__(self) -> None:
        self._layout: Hashable = None
        self._values: list[Tensor] = []
        self._state: dict[Tensor, dict[str, Any]] = {}
        self._updates: list[Tensor] | None = None

    def _drop(self) -> None:
        """Hold nothing (the next :meth:`take` allocates anew)."""
        self._layout, self._values, self._state, self._updates = None, [], {}, None

    @property
    def updates(self) -> list[Tensor] | None:
        """Buffers for the update, one per parameter (its local shard), or None without buffers."""
        return self._updates

    def __reduce__(self) -> tuple[type[UpdateCopy], tuple[()]]:
        return UpdateCopy, ()

    @property
    def held_bytes(self) -> int:
        """The bytes the buffers hold between windows (local shards)."""
        state = [v for e in self._state.values() for v in e.values()]
        tensors = [*self._values, *(self._updates or []), *state]
        return sum(local_view(t).numel() * local_view(t).element_size() for t in tensors)

    @torch.no_grad()
    def take(self, optimizer: Optimizer, params: Sequence[Tensor]) -> InnerBackup:
        """The copy of ``params`` and their state in ``optimizer``, now (before its step)."""
        state = optimizer.state
        entries = {p: state[p] for p in params if p in state}
        if not _tensor_state(entries):
            self._drop()  # nothing held for a layout the buffers cannot hold
            return InnerBackup(optimizer, params)
        layout = _layout(params, entries)
        if layout != self._layout:
            self._values = [p.detach().clone() for p in params]
            self._updates = [torch.empty_like(local_view(p)) for p in params]
            self._state = {p: {k: v.detach().clone() for k, v in e.items()} for p, e in entries.items()}
            self._layout = layout
            return InnerBackup(optimizer, params, (self._values, self._state))
        pairs = [(local_view(b), local_view(p)) for b, p in zip(self._values, params, strict=True)]
        for p, saved in self._state.items():
            pairs.extend((local_view(b), local_view(entries[p][k])) for k, b in saved.items())
        for dsts, srcs in _grouped(pairs):
            torch._foreach_copy_(dsts, srcs)
        return InnerBackup(optimizer, params, (self._values, self._state))
