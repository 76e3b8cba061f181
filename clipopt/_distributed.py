"""Data-parallel training: gradient-sync suppression and global norms of sharded gradients.

* :func:`suppress_sync` — the context that skips a model's gradient
  synchronisation for one backward: DDP's ``no_sync()``, FSDP2's
  ``set_requires_gradient_sync(False)``, nothing for a plain module.
* :func:`allreduce_mean_` — what DDP would have done to gradients that were
  accumulated without sync (used by ``flush()`` after an unsynced micro-batch).
* :class:`ShardedGrads` — the local shards of DTensor gradients (FSDP2) and the
  process groups over which their norm has to be reduced, so that every rank
  computes the same global norm, and so takes the same skip decision.
* :func:`sharded_layer_stats` — per-layer statistics of the full tensors from shards.
* :class:`Unsynced` — the record of a micro-batch whose backward skipped its sync.

Norm reductions are done on the device (``all_reduce`` of a few scalars);
nothing is read back to the host.  Non-finite values survive them: p-norms are reduced
with SUM (a ``nan``/``inf`` term stays ``nan``/``inf``), and the inf-norm
carries an explicit non-finite indicator because gloo's MAX drops ``nan``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from . import functional as F
from ._layers import LayerStats, compute_layer_stats

__all__ = [
    "ShardedGrads",
    "Unsynced",
    "allreduce_mean_",
    "has_dtensor",
    "sharded_layer_stats",
    "suppress_sync",
]


def _dtensor_type() -> Any:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def has_dtensor(tensors: Sequence[Tensor]) -> bool:
    """Whether any of ``tensors`` is a DTensor (FSDP2 / tensor-parallel parameters)."""
    dtensor = _dtensor_type()
    return dtensor is not None and any(isinstance(t, dtensor) for t in tensors)


def _is_ddp(model: torch.nn.Module) -> bool:
    return torch.distributed.is_available() and isinstance(
        model, torch.nn.parallel.DistributedDataParallel
    )


def _is_fsdp2(model: torch.nn.Module) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def _fsdp2_no_sync(model: Any) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def suppress_sync(model: torch.nn.Module) -> tuple[contextlib.AbstractContextManager[Any], str | None]:
    """The context that skips ``model``'s gradient sync, and the kind of model.

    Kind: ``"ddp"``, ``"fsdp2"``, ``"other"`` (a module with its own
    ``no_sync()``, such as FSDP1), or None (a plain module: nothing to skip).
    """
    if _is_fsdp2(model):
        return _fsdp2_no_sync(model), "fsdp2"
    if _is_ddp(model):
        ddp: Any = model
        return ddp.no_sync(), "ddp"
    no_sync = getattr(model, "no_sync", None)
    if callable(no_sync):
        return no_sync(), "other"
    return contextlib.nullcontext(), None


class Unsynced:
    """A micro-batch whose backward ran inside ``no_sync`` (its gradients are rank-local).

    Attributes:
        kind: ``"ddp"``, ``"fsdp2"`` or ``"other"`` (see :func:`suppress_sync`).
        micro_batch: its place in the window (1-based); the window still needs
            a sync when it is the window's latest micro-batch.
        model_type: the model's class name, for messages.
        group: DDP's process group (None: the default group); not saved.
    """

    __slots__ = ("group", "kind", "micro_batch", "model_type")

    def __init__(self, kind: str, micro_batch: int, model_type: str, group: Any = None) -> None:
        self.kind = kind
        self.micro_batch = micro_batch
        self.model_type = model_type
        self.group = group

    def detached(self) -> Unsynced:
        """A copy without the process group (for pickling: groups do not travel)."""
        return Unsynced(self.kind, self.micro_batch, self.model_type)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "micro_batch": self.micro_batch, "model_type": self.model_type}

    @classmethod
    def from_dict(cls, value: Any, micro_batches: int) -> Unsynced | None:
        """Read :meth:`to_dict`'s output back; ValueError when it cannot be from a state dict."""
        if value is None:
            return None
        ok = (
            isinstance(value, dict)
            and value.get("kind") == "ddp"
            and isinstance(value.get("micro_batch"), int)
            and value["micro_batch"] == micro_batches
            and isinstance(value.get("model_type"), str)
        )
        if not ok:
            raise ValueError(
                f"invalid state_dict: 'clipopt.unsynced' must be None or a DDP marker of the open "
                f"window's latest micro-batch ({micro_batches}), got {value!r:.120}; "
                "pass the dict returned by opt.state_dict()"
            )
        return cls("ddp", value["micro_batch"], value["model_type"])


@torch.no_grad()
def allreduce_mean_(params: Sequence[Tensor], group: Any = None) -> None:
    """Average the gradients of ``params`` over ``group`` (None: the default group), as DDP does.

    A parameter without a gradient on this rank contributes zeros when another
    rank has one; parameters without a gradient anywhere stay without.  Every
    rank must call this with the same parameters (it is collective).  Reads
    one small mask to the host.  DDP's communication hooks are not applied.
    """
    dist = torch.distributed
    if not params:
        return
    present = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
    dist.all_reduce(present, op=dist.ReduceOp.SUM, group=group)
    world = dist.get_world_size(group)
    for p, count in zip(params, present.tolist(), strict=True):
        if count == 0:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
        p.grad.div_(world)


class ShardedGrads:
    """Local shards of (some DTensor) gradients, grouped by the process groups their norm spans.

    A gradient sharded (``Shard``) over some mesh dimensions contributes a
    partial norm that must be reduced over those dimensions' process groups;
    a replicated one, or a plain tensor, is complete on every rank already.

    Attributes:
        locals: the gradients as plain tensors, in order (a DTensor's local
            shard shares its storage, so in-place clipping and scaling of
            ``locals`` change the gradients themselves).
    """

    __slots__ = ("_groups", "locals")

    def __init__(self, grads: Sequence[Tensor]) -> None:
        dtensor = _dtensor_type()
        self.locals: list[Tensor] = []
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, g in enumerate(grads):
            if dtensor is not None and isinstance(g, dtensor):
                if any(placement.is_partial() for placement in g.placements):
                    raise ValueError(
                        f"a gradient has a Partial placement ({g.placements}), i.e. it is still to "
                        "be reduced; clip after the gradients are reduced (FSDP2 and DDP do this "
                        "in backward) or redistribute them to Shard/Replicate first"
                    )
                self.locals.append(g.to_local())
            else:
                self.locals.append(g)
            groups.setdefault(_shard_groups(g, dtensor), []).append(i)
        self._groups = list(groups.items())

    def total_norm(self, grads: Sequence[Tensor], norm_type: float, foreach: bool | None) -> Tensor:
        """The global ``norm_type``-norm of ``grads`` (this object's :attr:`locals`, possibly clipped since).

        Collective: every rank holding shards must call it, in the same order.
        """
        parts = []
        for pgs, indices in self._groups:
            local = F.get_total_norm([grads[i] for i in indices], norm_type, foreach=foreach)
            parts.append(_reduce_norm(local, norm_type, pgs) if pgs else local)
        if len(parts) == 1:
            return parts[0]
        return F.get_total_norm(parts, norm_type)


def _reduce_norm(local: Tensor, p: float, groups: Sequence[Any]) -> Tensor:
    """Combine a rank-local p-norm into the norm over ``groups`` (each reduced in turn)."""
    dist = torch.distributed
    if math.isinf(p):
        # gloo's MAX drops nan: carry "some rank is nan" as a second, finite value
        packed = torch.stack([local, torch.isnan(local).to(local.dtype)])
        for pg in groups:
            dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=pg)
        return torch.where(packed[1] > 0, torch.full_like(local, math.nan), packed[0])
    # float64: a float32 partial norm's p-th power is below 3.4e38 (torch computed it as a
    # float32 sum), so summing WORLD of them cannot overflow where one process would not
    acc = local.double().pow(p)
    for pg in groups:
        dist.all_reduce(acc, op=dist.ReduceOp.SUM, group=pg)
    return acc.pow(1.0 / p).to(local.dtype)


def _shard_groups(t: Any, dtensor: Any) -> tuple[Any, ...]:
    """The process groups of the mesh dimensions over which ``t`` is sharded (none: complete here)."""
    if dtensor is None or not isinstance(t, dtensor):
        return ()
    return tuple(t.device_mesh.get_group(d) for d, pl in enumerate(t.placements) if pl.is_shard())


@torch.no_grad()
def sharded_layer_stats(
    params: Sequence[Tensor], names: Sequence[str], scale: float, count_nonfinite: bool
) -> LayerStats:
    """:func:`compute_layer_stats` of DTensor parameters: of the full tensors, on every rank.

    Each rank computes the statistics of its shards, then they are combined over
    the shard groups: squared norms and non-finite counts summed, max |g| and
    min |g| by MAX (of ``|g|`` and ``-|g|``).  Collective: every rank calls it.
    """
    dist = torch.distributed
    dtensor = _dtensor_type()
    local_params: list[Tensor] = []
    local_grads: list[Tensor | None] = []
    rows: dict[tuple[Any, ...], list[int]] = {}
    for i, p in enumerate(params):
        key = _shard_groups(p, dtensor)
        sharded: Any = p
        grad: Any = p.grad
        local_params.append(sharded.to_local() if key else p)
        local_grads.append(grad.to_local() if key and grad is not None else grad)
        if key:
            rows.setdefault(key, []).append(i)
    values = compute_layer_stats(local_params, names, scale, count_nonfinite, grads=local_grads)._values
    if values is None or not rows:
        return LayerStats(names, [] if values is None else values)
    for key, indices in rows.items():
        index = torch.tensor(indices, device=values.device)
        sub = values.index_select(0, index).double()
        numel = torch.tensor(
            [float(g.numel()) if (g := local_grads[i]) is not None else 0.0 for i in indices],
            dtype=torch.float64,
            device=values.device,
        )
        has_grad = torch.tensor([local_grads[i] is not None for i in indices], device=values.device)
        # an empty local shard must not win the minimum: |g| >= 0, so -inf is neutral for MAX(-min)
        low = torch.where(numel > 0, -sub[:, 2], torch.full_like(numel, -math.inf))
        nan_seen = (sub[:, 1].isnan() | sub[:, 2].isnan()).double()  # gloo's MAX drops nan: carry it
        summed = torch.stack([sub[:, 0].square(), sub[:, 3], sub[:, 4].square(), numel], dim=1)
        extremes = torch.stack([sub[:, 1].nan_to_num(0.0), low.nan_to_num(-math.inf), nan_seen], dim=1)
        for pg in key:
            dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=pg)
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=pg)
        nan = torch.full_like(numel, math.nan)
        high = torch.where(extremes[:, 2] > 0, nan, extremes[:, 0])
        low = torch.where(summed[:, 3] > 0, -extremes[:, 1], torch.zeros_like(numel))
        low = torch.where(extremes[:, 2] > 0, nan, low)
        grad_cols = torch.stack([summed[:, 0].sqrt(), high, low], dim=1)
        grad_cols = torch.where(has_grad[:, None], grad_cols, nan[:, None])  # no gradient: nan, as elsewhere
        full = torch.cat([grad_cols, summed[:, 1:2], summed[:, 2:3].sqrt()], dim=1)
        values.index_copy_(0, index, full.to(values.dtype))
    return LayerStats(names, values)
