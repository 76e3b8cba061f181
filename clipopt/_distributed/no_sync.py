"""The open window's gradient synchronisation under data parallelism (``opt.no_sync(model)``).

A micro-batch run inside ``opt.no_sync(model)`` leaves an :class:`~clipopt._distributed.collectives.Unsynced`
marker; these functions say whether it is still pending (:func:`pending_unsynced`), whether the
window can be closed or saved with it (:func:`check_reducible`, :func:`check_checkpointable`),
and how one ``no_sync`` block suppresses the sync (:func:`plan_no_sync`).  The collectives are in
:mod:`clipopt._distributed.collectives`; the replicas' common decision in
:mod:`clipopt._distributed.replicas`.
"""

from __future__ import annotations

import contextlib
import warnings
from contextlib import AbstractContextManager

import torch

from .._caller import user_stacklevel
from .._checks import check_flag
from .collectives import Unsynced, suppress_sync
from .replicas import ReplicaDecision

__all__ = [
    "check_checkpointable",
    "check_no_sync_args",
    "check_reducible",
    "pending_unsynced",
    "plan_no_sync",
]


def check_no_sync_args(model: object, sync: object) -> None:
    """``opt.no_sync(model, sync=...)``'s arguments."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"model must be a torch.nn.Module (a DDP- or FSDP2-wrapped model), got "
            f"{type(model).__name__}; pass e.g. opt.no_sync(ddp_model)"
        )
    if sync is not None:
        check_flag("sync", sync)


def plan_no_sync(
    model: torch.nn.Module, sync: bool, index: int, replicas: ReplicaDecision
) -> tuple[AbstractContextManager[object], Unsynced | None]:
    """The context for one ``no_sync`` block of micro-batch ``index``, and its marker (None: synced).

    A plain module has no sync to skip: under data parallelism that is warned about, once.
    """
    if sync:
        return contextlib.nullcontext(), None
    context, kind = suppress_sync(model)
    if kind is None:
        _warn_plain_no_sync(model, replicas)
        return context, None
    return context, Unsynced(kind, index, type(model).__name__, getattr(model, "process_group", None))


def _warn_plain_no_sync(model: torch.nn.Module, replicas: ReplicaDecision) -> None:
    """no_sync(model) under data parallelism with a module that has no sync to skip: warn once."""
    if replicas.active and not replicas.warned_no_sync:
        replicas.warned_no_sync = True
        warnings.warn(
            f"opt.no_sync(model) got a {type(model).__name__}, which has no gradient sync to "
            "skip, so every micro-batch still synchronises (or none does); pass the "
            "DistributedDataParallel (or fully_shard) wrapper itself, e.g. opt.no_sync(ddp_model), "
            "not ddp_model.module",
            UserWarning,
            stacklevel=user_stacklevel(),  # the user's `with opt.no_sync(...)` line
        )


def pending_unsynced(marker: Unsynced | None, micro_batches: int) -> Unsynced | None:
    """The marker when the open window's latest micro-batch skipped its sync, else None."""
    if marker is None or micro_batches == 0 or marker.micro_batch != micro_batches:
        return None  # no window open, or a later micro-batch synchronised
    return marker


def check_reducible(marker: Unsynced) -> None:
    """Before closing a window whose latest micro-batch skipped its sync: only DDP's can be done now."""
    if marker.kind != "ddp":  # nothing changed: the window stays open and pending
        raise RuntimeError(
            f"the latest micro-batch ran inside opt.no_sync(model) without gradient sync, and "
            f"{marker.model_type} cannot reduce accumulated gradients afterwards; pass "
            "opt.no_sync(model, sync=True) for the last micro-batch before flush()"
        )


def check_checkpointable(marker: Unsynced | None) -> None:
    """Refuse to save a window whose gradients are held inside FSDP2 (``p.grad`` is None there)."""
    if marker is not None and marker.kind != "ddp":
        raise RuntimeError(
            f"the open window's latest micro-batch ran inside opt.no_sync(model) and "
            f"{marker.model_type} keeps its unsynchronised gradients internally, so they cannot "
            "be saved; checkpoint at a window boundary (opt.micro_batches == 0)"
        )
