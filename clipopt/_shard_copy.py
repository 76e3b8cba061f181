"""Local shards of DTensor state (FSDP2, tensor parallel) for :class:`~clipopt.Rewind`'s host copies.

Under FSDP2 or tensor parallelism the parameters, and the inner optimizer's
state that mirrors them (``exp_avg`` of ``torch.zeros_like(p)``), are DTensors:
each rank holds its own shard.  A copy holds each rank's local shard
(``DTensor.to_local()``, which shares the DTensor's storage) as a plain
tensor, and restoring writes the shard back into the live DTensor's local
tensor in place: FSDP2 all-gathers from that storage at the next forward pass,
so every rank's full parameters are those of the copy's window once every rank
restored its own shard (every rank rewinds at the same window: the decision is
one, see docs/spike-recovery.md).  A state DTensor with no live counterpart
left (state cleared since) is rebuilt around the copied shard with its
parameter's mesh and placements.  A copy records the mesh coordinates of its
parameters' shards, so that a copy loaded on another rank than the one that
took it (another rank's state dict) is refused instead of restoring the wrong
shards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ._distributed import has_dtensor

__all__ = [
    "coordinates",
    "coordinates_problem",
    "fits",
    "is_shard",
    "local",
    "locals_of",
    "shard_like",
    "shard_problem",
]


def is_shard(t: Any) -> bool:
    """Whether ``t`` is a DTensor (a copy holds its local shard)."""
    return isinstance(t, Tensor) and has_dtensor([t])


def local(t: Tensor) -> Tensor:
    """``t``'s local shard when it is a DTensor (sharing its storage: writing it writes ``t``; no autograd
    record), else ``t``."""
    if not is_shard(t):
        return t
    with torch.no_grad():
        return t.to_local()  # type: ignore[attr-defined,no-any-return]


def fits(src: Tensor, live: Any) -> bool:
    """Whether ``live`` is a DTensor whose local shard has ``src``'s shape and dtype."""
    return is_shard(live) and (local(live).shape, local(live).dtype) == (src.shape, src.dtype)


def shard_problem(src: Tensor, live: Any, like: Tensor) -> str | None:
    """Why the copied shard ``src`` of a state DTensor cannot be restored, or None.

    It goes into ``live`` (the live state tensor at its place) when that fits,
    else into a new DTensor laid out as the parameter ``like``, which needs
    ``like`` to be a DTensor whose local shard has ``src``'s shape.
    """
    if fits(src, live):
        return None
    if is_shard(like) and local(like).shape == src.shape:
        return None
    return (
        f"a copied optimizer-state shard of shape {tuple(src.shape)} fits neither the live state "
        "nor its parameter's shard"
    )


def shard_like(src: Tensor, live: Any, like: Tensor) -> Tensor:
    """The copied shard ``src`` back as a state DTensor: written into ``live`` when it fits (kept), else a
    new DTensor of ``like``'s mesh and placements (:func:`shard_problem` said it can)."""
    if fits(src, live):
        local(live).copy_(src)
        return live  # type: ignore[no-any-return]
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        src.to(local(like).device, copy=True),
        like.device_mesh,  # type: ignore[attr-defined]
        like.placements,  # type: ignore[attr-defined]
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def locals_of(tensors: Sequence[Tensor]) -> list[Tensor]:
    """:func:`local` of each tensor."""
    return [local(t) for t in tensors]


def coordinates(params: Sequence[Tensor]) -> list[list[int] | None] | None:
    """Where each parameter's shard lies: its DTensor's coordinate in its device mesh (None: not a
    DTensor); None when no parameter is a DTensor."""
    if not any(is_shard(p) for p in params):
        return None
    out: list[list[int] | None] = []
    for p in params:
        where = p.device_mesh.get_coordinate() if is_shard(p) else None  # type: ignore[attr-defined]
        out.append(None if where is None else [int(c) for c in where])
    return out


def coordinates_problem(saved: Any, live: list[list[int] | None] | None) -> str | None:
    """Why a copy whose shards lie at ``saved`` (:func:`coordinates` when it was taken) cannot go into
    parameters whose shards lie at ``live``, or None."""
    if saved == live:
        return None
    if live is None:
        return "its copies hold DTensor shards (FSDP2, tensor parallel); these parameters are not DTensors"
    if saved is None:
        return "its copies hold whole tensors but this optimizer's parameters are DTensor shards"
    return (
        f"its copies hold the shards at mesh coordinates {saved[:4]!r} but this rank's are at {live[:4]!r}: "
        "another rank's state; load each rank's own state dict"
    )
