"""The parameters a wrapper steps, and the gradients one window measures and clips.

* :class:`ParamIndex` lists every parameter in group order, cached until the
  groups change, and knows whether one of them is a DTensor (FSDP2).
* :class:`WindowGrads` is one window's view of the gradients: ``p.grad`` of
  every parameter that has one (their local shards for DTensors), per
  parameter group when groups have their own options, and the norms of any
  list of them over all ranks holding shards (a collective for DTensors) or
  over a pipeline's ``norm_group``.  It lives for one window (or one closure
  re-evaluation) only: the shards are views of the gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from .. import functional as F
from .._distributed.collectives import ShardedGrads, has_dtensor, reduce_norm_over
from .._inner import inner_optimizers
from .._policies.kinds import ParamKey, param_keys

__all__ = ["ParamIndex", "WindowGrads"]


class ParamIndex:
    """All parameters of ``param_groups`` in group order; recomputed only when the groups change."""

    __slots__ = ("_key", "_keys", "has_dtensor", "params")

    def __init__(self) -> None:
        self._key: tuple[int, ...] = ()  #: identity and length of the groups and their lists
        self.params: list[Tensor] = []  #: every parameter, in group order
        self.has_dtensor = False  #: some parameter is a DTensor (FSDP2): norms are reduced across ranks
        self._keys: list[ParamKey] | None = None  #: their keys (made when first asked for)

    def of(self, groups: list[dict[str, Any]]) -> list[Tensor]:
        """The parameters of ``groups`` (the cached list while the groups are unchanged)."""
        key = (id(groups), *[id(g["params"]) for g in groups], *[len(g["params"]) for g in groups])
        if key != self._key:
            self.params = [p for group in groups for p in group["params"]]
            self._key, self._keys = key, None
            self.has_dtensor = has_dtensor(self.params)
        return self.params

    def keys(self, inner: Optimizer) -> list[ParamKey]:
        """Each of :attr:`params`' key (its inner optimizer in ``inner``, its index in that
        optimizer's state dict), by which a per-tensor policy keeps its statistics."""
        if self._keys is None or len(self._keys) != len(self.params):
            self._keys = param_keys(inner_optimizers(inner))
        return self._keys

    def __getstate__(self) -> dict[str, Any]:
        return {"has_dtensor": self.has_dtensor}  # ids mean nothing in another process

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        self.has_dtensor = state["has_dtensor"]


@dataclass
class WindowGrads:
    """The gradients of one window (see the module docstring)."""

    params: list[Tensor]  #: every parameter, in group order
    grads: list[Tensor]  #: the gradients to measure and clip (local shards for DTensors)
    shards: ShardedGrads | None  #: the DTensor gradients' shards, None for plain tensors
    by_group: list[list[Tensor]] = field(default_factory=list)  #: ``grads`` per group (per-group options)
    keys: Sequence[ParamKey] = ()  #: each of ``params``' key (``ParamIndex.keys``): for a per-tensor policy

    @classmethod
    def of(
        cls,
        params: list[Tensor],
        groups: list[dict[str, Any]],
        index: ParamIndex,
        inner: Optimizer,
        *,
        split: bool,
    ) -> WindowGrads:
        """The gradients of ``params`` (``index.of(groups)``, the parameters of ``inner``), per group
        when ``split``, with the parameters' keys (``index.keys``)."""
        grads = [p.grad for p in params if p.grad is not None]
        shards = ShardedGrads(grads) if index.has_dtensor else None
        window = cls(params, grads if shards is None else shards.locals, shards, keys=index.keys(inner))
        if split:
            window.by_group = window.split(groups)
        return window

    def split(self, groups: list[dict[str, Any]]) -> list[list[Tensor]]:
        """:attr:`grads` (one per parameter with a gradient, in group order) per parameter group."""
        out, start = [], 0
        for group in groups:
            size = sum(1 for p in group["params"] if p.grad is not None)
            out.append(self.grads[start : start + size])
            start += size
        return out

    def norms(self, grads: list[Tensor], norm_type: float, foreach: bool | None) -> Tensor:
        """Each of ``grads``' norms over all ranks holding shards of it (collective for DTensors)."""
        if self.shards is not None:
            return self.shards.norms(grads, norm_type, foreach)
        return F.get_norms(grads, norm_type, foreach=foreach)

    def total_norm(
        self, grads: list[Tensor], norm_type: float, foreach: bool | None, norm_group: Any
    ) -> Tensor:
        """The norm of ``grads`` over all ranks holding shards of them, and over ``norm_group``'s
        pipeline stages (every stage gets the norm of all of them)."""
        if self.shards is not None:
            norm = self.shards.total_norm(grads, norm_type, foreach)
        else:
            norm = F.get_total_norm(grads, norm_type, foreach=foreach)
        if norm_group is not None:
            norm = reduce_norm_over(norm, norm_type, norm_group)
        return norm
