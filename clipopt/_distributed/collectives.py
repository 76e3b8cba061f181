"""Data-parallel training: gradient-sync suppression and global norms of sharded gradients.

* :func:`suppress_sync` — the context that skips a model's gradient
  synchronisation for one backward: DDP's ``no_sync()``, FSDP2's
  ``set_requires_gradient_sync(False)``, nothing for a plain module.
* :func:`allreduce_mean_` — what DDP would have done to gradients that were
  accumulated without sync (used by ``flush()`` after an unsynced micro-batch).
* :class:`ShardedGrads` — the local shards of DTensor gradients (FSDP2) and the
  process groups over which their norm has to be reduced, so that every rank
  computes the same global norm, and so takes the same skip decision.
* :func:`local_shards`, :func:`combined_rows` — per-layer rows of shards combined over the shard groups.
* :class:`Unsynced` — the record of a micro-batch whose backward skipped its sync.
* :func:`reduce_norm_over` — a partial norm combined over a process group
  (``norm_group``: pipeline stages holding different parameters).
* :func:`sharded_unit_norms` — AGC's row norms of DTensor shards, as of the full tensors.
* :func:`rank_target` / :func:`check_ranks` — where a logger writes under
  ``torch.distributed`` (rank 0 by default, or one file per rank).

The skip decision shared by data-parallel replicas lives in ``_distributed/replicas.py``.

Norm reductions are done on the device (``all_reduce`` of a few scalars);
nothing is read back to the host.  Non-finite values survive them: p-norms are reduced
with SUM (a ``nan``/``inf`` term stays ``nan``/``inf``), and the inf-norm
carries an explicit non-finite indicator because gloo's MAX drops ``nan``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import torch
from torch import Tensor

from .. import functional as F
from .._state import bad

__all__ = [
    "ShardedGrads",
    "Unsynced",
    "allreduce_mean_",
    "has_dtensor",
    "combined_rows",
    "local_shards",
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
    return torch.distributed.is_available() and isinstance(model, torch.nn.parallel.DistributedDataParallel)


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
            raise bad(
                "'clipopt.unsynced' must be None or a DDP marker of the open "
                f"window's latest micro-batch ({micro_batches}), got {value!r:.120}"
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

    __slots__ = ("_groups", "carry", "locals")

    def __init__(self, grads: Sequence[Tensor]) -> None:
        dtensor = _dtensor_type()
        #: What rides in the first reduction of the norm (the ranks' check,
        #: ``ReplicaDecision``): its ``encode(summed, device)`` gives float64 entries
        #: appended to the reduced values, ``receive(reduced, summed)`` gets them back.
        self.carry: Any = None
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
            local = _local_norm([grads[i] for i in indices], norm_type, foreach)
            parts.append(self._reduce(local, norm_type, pgs) if pgs else local)
        if len(parts) == 1:
            return parts[0]
        return F.get_total_norm(parts, norm_type)

    def norms(self, grads: Sequence[Tensor], norm_type: float, foreach: bool | None) -> Tensor:
        """The global ``norm_type``-norm of each gradient in ``grads`` (as :meth:`total_norm`), stacked.

        Per-group clipping composes group norms from these.  Collective: one
        reduction of a vector per set of process groups (as many as
        :meth:`total_norm` makes, of scalars).
        """
        found: list[Tensor | None] = [None] * len(grads)
        for pgs, indices in self._groups:
            local = _local_norms([grads[i] for i in indices], norm_type, foreach)
            if pgs:
                local = self._reduce(local, norm_type, pgs)
            for slot, i in enumerate(indices):
                found[i] = local[slot]
        if not found:
            return torch.zeros(0, dtype=torch.float32)
        return torch.stack([n for n in found if n is not None])

    def _reduce(self, local: Tensor, p: float, groups: Sequence[Any]) -> Tensor:
        """:func:`_reduce_norm`; the first one carries :attr:`carry` (then cleared)."""
        carry, self.carry = self.carry, None
        if carry is None:
            return _reduce_norm(local, p, groups)
        summed = not math.isinf(p)
        extra = carry.encode(summed, local.device)
        norm, reduced = _reduce_norm(local, p, groups, extra)
        carry.receive(reduced, summed)
        return norm


def _local_norms(grads: Sequence[Tensor], p: float, foreach: bool | None) -> Tensor:
    """Each of this rank's shards' norm (an empty shard counts 0), in a dtype every rank shares."""
    wide = any(g.dtype == torch.float64 for g in grads)
    zero = torch.zeros((), dtype=torch.float64 if wide else torch.float32, device=grads[0].device)
    kept = [g for g in grads if g.numel() > 0]
    found = iter(F.get_norms(kept, p, foreach=foreach).to(zero.dtype).unbind() if kept else ())
    return torch.stack([next(found) if g.numel() > 0 else zero for g in grads])


def _local_norm(grads: Sequence[Tensor], p: float, foreach: bool | None) -> Tensor:
    """The norm of this rank's shards; empty shards (a dimension smaller than the world) count 0.

    The inf-norm kernels refuse empty tensors, so they are left out; a rank whose
    shards are all empty contributes a zero of the dtype the others use (the
    collective needs the same dtype on every rank).
    """
    kept = [g for g in grads if g.numel() > 0]
    if kept:
        return F.get_total_norm(kept, p, foreach=foreach)
    wide = any(g.dtype == torch.float64 for g in grads)
    return torch.zeros((), dtype=torch.float64 if wide else torch.float32, device=grads[0].device)


def reduce_norm_over(local: Tensor, p: float, group: Any) -> Tensor:
    """``local`` (this rank's partial ``p``-norm) combined over ``group``: every rank gets the total.

    For ``norm_group=pg`` (pipeline stages: each rank holds different parameters).
    One scalar collective (two values for the inf-norm).
    """
    return _reduce_norm(local, p, [group])


@overload
def _reduce_norm(local: Tensor, p: float, groups: Sequence[Any]) -> Tensor: ...
@overload
def _reduce_norm(local: Tensor, p: float, groups: Sequence[Any], extra: Tensor) -> tuple[Tensor, Tensor]: ...
def _reduce_norm(
    local: Tensor, p: float, groups: Sequence[Any], extra: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """Combine a rank-local p-norm (a scalar or a vector) into the norm over ``groups`` (each
    reduced in turn).  ``extra`` (float64 entries, encoded for SUM, or MAX for the inf-norm) rides
    in the same collectives: then ``(norm, extra reduced)``."""
    dist = torch.distributed
    k = local.numel()
    if math.isinf(p):
        # gloo's MAX drops nan: carry "some rank is nan" as a second, finite value
        packed = torch.cat([local.double().reshape(-1), torch.isnan(local).double().reshape(-1)])
        op = dist.ReduceOp.MAX
    else:
        # float64: a float32 partial norm's p-th power is below 3.4e38 (torch computed it as a
        # float32 sum), so summing WORLD of them cannot overflow where one process would not
        packed = local.double().pow(p).reshape(-1)
        op = dist.ReduceOp.SUM
    if extra is not None:
        packed = torch.cat([packed, extra])
    for pg in groups:
        dist.all_reduce(packed, op=op, group=pg)
    if math.isinf(p):
        value = packed[:k].reshape(local.shape).to(local.dtype)
        norm = torch.where(
            packed[k : 2 * k].reshape(local.shape) > 0, torch.full_like(local, math.nan), value
        )
    else:
        norm = packed[:k].reshape(local.shape).pow(1.0 / p).to(local.dtype)
    if extra is None:
        return norm
    return norm, packed[packed.numel() - extra.numel() :]


def _shard_groups(t: Any, dtensor: Any) -> tuple[Any, ...]:
    """The process groups of the mesh dimensions over which ``t`` is sharded (none: complete here)."""
    if dtensor is None or not isinstance(t, dtensor):
        return ()
    return tuple(t.device_mesh.get_group(d) for d, pl in enumerate(t.placements) if _splits(pl))


def _splits(placement: Any) -> bool:
    """Whether a mesh dimension splits the tensor: ``Shard``, and also ``_StridedShard`` (FSDP2 over
    tensor parallel), whose ``is_shard()`` is False.  Partial placements are refused earlier."""
    return not placement.is_replicate() and not placement.is_partial()


def local_shards(
    params: Sequence[Tensor],
) -> tuple[list[Tensor], list[Tensor | None], dict[tuple[Any, ...], list[int]]]:
    """Each parameter's local shard and its gradient's (the tensors themselves when not sharded),
    and the indices of the sharded parameters by their shard groups."""
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
    return local_params, local_grads, rows


def combined_rows(sub: Tensor, grads: list[Tensor | None], key: tuple[Any, ...]) -> Tensor:
    """The statistics rows of full tensors from ``sub``, this rank's float64 rows of their local
    shards (gradients ``grads``), combined over the process groups ``key``.  Collective."""
    dist = torch.distributed
    numel = torch.tensor(
        [float(g.numel()) if g is not None else 0.0 for g in grads], dtype=torch.float64, device=sub.device
    )
    has_grad = torch.tensor([g is not None for g in grads], device=sub.device)
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
    return torch.cat([grad_cols, summed[:, 1:2], summed[:, 2:3].sqrt()], dim=1)


def unit_norm_dims(t: Tensor) -> tuple[int, ...] | None:
    """The dimensions AGC reduces for one unit: all but the first (a row); None: the whole tensor."""
    return tuple(range(1, t.ndim)) if t.ndim > 1 else None


@torch.no_grad()
def sharded_unit_norms(pairs: Sequence[tuple[Tensor, Tensor]]) -> list[tuple[Tensor, Tensor, Tensor]]:
    """AGC's unit norms ``(||W_i||, ||G_i||, local G)`` of DTensor parameters, as of the full tensors.

    A unit is a row (dimension 0) of a parameter with two or more dimensions,
    else the whole tensor.  Each rank computes the sums of squares of its shard;
    those over mesh dimensions that split a unit (``Shard(d)`` with ``d >= 1``,
    or any ``Shard`` of a vector) are summed over that dimension's process group,
    one collective per distinct set of groups.  Empty and size-1 shards are fine.
    The local gradient returned shares storage with the DTensor gradient, so
    scaling it in place clips the gradient without any placement change.
    """
    dtensor = _dtensor_type()
    rows: list[tuple[Tensor, Tensor, Tensor]] = []
    pending: dict[tuple[Any, ...], list[int]] = {}
    for i, (p, grad) in enumerate(pairs):
        g: Any = grad
        sharded = dtensor is not None and isinstance(g, dtensor)
        local_g: Tensor = g.to_local() if sharded else g
        detached: Any = p.detach()
        local_p: Tensor = detached.to_local() if sharded else detached
        dims = unit_norm_dims(local_g)
        acc = torch.float32 if local_g.dtype in (torch.float16, torch.bfloat16) else None
        w_sq = torch.linalg.vector_norm(local_p, dim=dims, keepdim=True, dtype=acc).square()
        g_sq = torch.linalg.vector_norm(local_g, dim=dims, keepdim=True, dtype=acc).square()
        rows.append((w_sq, g_sq, local_g))
        if sharded:
            groups = tuple(
                g.device_mesh.get_group(d)
                for d, pl in enumerate(g.placements)
                if _splits(pl) and (g.ndim <= 1 or getattr(pl, "dim", 0) >= 1)
            )
            if groups:
                pending.setdefault(groups, []).append(i)
    dist = torch.distributed
    for groups, indices in pending.items():
        flat = torch.cat([t.reshape(-1).double() for i in indices for t in rows[i][:2]])
        for pg in groups:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=pg)
        offset = 0
        for i in indices:
            w_sq, g_sq, local_g = rows[i]
            k = w_sq.numel()
            w_sq = flat[offset : offset + k].reshape(w_sq.shape).to(w_sq.dtype)
            g_sq = flat[offset + k : offset + 2 * k].reshape(g_sq.shape).to(g_sq.dtype)
            rows[i] = (w_sq, g_sq, local_g)
            offset += 2 * k
    return [(w_sq.sqrt(), g_sq.sqrt(), local_g) for w_sq, g_sq, local_g in rows]


#: ``ranks=`` of the loggers: who writes under ``torch.distributed``.
LOGGER_RANKS = ("zero", "all")


def check_ranks(value: Any) -> str:
    """A logger's ``ranks``: ``"zero"`` (rank 0 writes) or ``"all"`` (every rank, its own file)."""
    if value not in LOGGER_RANKS:
        raise ValueError(
            f"ranks must be 'zero' or 'all', got {value!r}; pass ranks='zero' (rank 0 writes, the "
            "default) or ranks='all' (every rank writes its own file, name ending in -rank<r>)"
        )
    return str(value)


def rank_target(path: Path, ranks: str, *, folder: bool = False) -> Path | None:
    """Where this process's logger writes: ``path`` in one process or on rank 0, None on other ranks
    with ``ranks="zero"``, ``<stem>-rank<r><suffix>`` (a folder: ``path/rank<r>``) with ``"all"``."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return path
    rank = dist.get_rank()
    if ranks == "zero":
        return path if rank == 0 else None
    return path / f"rank{rank}" if folder else path.with_name(f"{path.stem}-rank{rank}{path.suffix}")
