"""The 2-process gloo job of ``tests/recovery/test_spike_distributed.py``: SpikeGuard and Rewind under DDP.

Rank 1 alone gets spiking batches (targets 1000 times larger) at known windows,
and the guard watches the loss only: without agreement rank 0 (normal loss)
would apply what rank 1 skips.  Each rank saves what it decided and its final
state; the test compares the ranks.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from clipopt import ClippedOptimizer, Rewind, SpikeGuard

from .distributed_jobs import _catch, init_world, leave_process_group
from .helpers import mlp

WORLD = 2
SPIKES = (12, 14)  #: batch indices (0-based) that spike on rank 1
WINDOWS = 24


def spike_job(rank: int, port: int, out_dir: str) -> None:
    init_world(rank, port, WORLD)
    for kind in ("ddp", "fsdp"):
        result = _run(kind, rank)
        torch.save(result, os.path.join(out_dir, f"{kind}{rank}.pt"))
    leave_process_group()


def _run(kind: str, rank: int) -> dict[str, Any]:
    """DDP: SpikeGuard + Rewind; FSDP2 (DTensor parameters): SpikeGuard (with Rewind: test_rewind_fsdp)."""
    plain = mlp((5, 4, 3))  # Linear(5, 4), Tanh, Linear(4, 3), global seed 0
    rewind = None
    if kind == "ddp":
        model: nn.Module = nn.parallel.DistributedDataParallel(plain)
        rewind = Rewind(every=5, keep=2, spikes=2, within=5, skip_batches=2, module=model, check_every=1)
    else:
        from torch.distributed.fsdp import fully_shard

        model = plain
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    opt = ClippedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.01),
        spike_guard=SpikeGuard(z_thresh=50.0, window=8, warmup=4, signals=("loss",)),
        rewind=rewind,
    )
    gen = torch.Generator().manual_seed(10 + rank)  # every rank its own data
    batches = []
    for i in range(WINDOWS):
        x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen)
        batches.append((x, y * 1000 if rank == 1 and i in SPIKES else y))
    reasons, losses = [], []
    for x, y in opt.rewind.batches(batches) if opt.rewind is not None else batches:
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
        assert opt.last_stats is not None
        reasons.append(opt.last_stats.reason)
        losses.append(float(loss))
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in plain.parameters()]
    return {
        "reasons": reasons,
        "rewinds": opt.rewinds,
        "log": [] if rewind is None else [e.to_dict() for e in rewind.log],
        "params": [p.detach().clone() for p in params],
        "history": opt.spike_guard.history["loss"] if opt.spike_guard is not None else [],
        "losses": losses,
    }


# ---------------------------------------------------------------------------- the ranks' agreement

#: The cases of :func:`agreement_job`: what differs on rank 1 (``"same"``: nothing).
AGREEMENT_CASES = ("same", "keep", "skip_batches", "skip", "skip-late", "signals")


def _wrapped(kind: str) -> nn.Module:
    """``mlp((5, 4, 3))`` under DDP, or under FSDP2 (each Linear sharded, then the whole)."""
    plain = mlp((5, 4, 3))
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(plain)
    from torch.distributed.fsdp import fully_shard

    for layer in plain:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(plain)
    return plain


def _agreement_case(kind: str, case: str, rank: int) -> dict[str, Any]:
    """SpikeGuard + Rewind on every rank, rank 1's built (or its skip list given) differently as
    ``case`` says; six windows of each rank's own data.  "skip" gives the lists to the first
    ``rewind.batches()``, "skip-late" to the second, after two windows.  The listed batch (100) is
    never drawn: the ranks differ in the list only.  Returns the error raised, if any, and the
    reasons of the windows closed."""
    model = _wrapped(kind)
    differs = rank == 1
    rewind = Rewind(
        every=5,
        keep=3 if differs and case == "keep" else 2,
        spikes=2,
        within=5,
        skip_batches=3 if differs and case == "skip_batches" else 2,
        check_every=1,
    )
    signals = ("loss", "grad_norm") if differs and case == "signals" else ("loss",)
    opt = ClippedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.01),
        spike_guard=SpikeGuard(z_thresh=50.0, window=8, warmup=4, signals=signals),
        rewind=rewind,
    )
    gen = torch.Generator().manual_seed(10 + rank)
    batches = [(torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen)) for _ in range(6)]
    listed = [(100, 101)] if differs or case == "same" else []

    calls: list[list[str]] = []  # per step(): the all_reduce / all_gather calls made in it

    def train(epoch: Any) -> None:
        for x, y in epoch:
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            with _collectives() as made:
                opt.step(loss=loss)
            calls.append(made)
            opt.zero_grad()

    def run() -> None:
        if case == "skip-late":
            train(rewind.batches(batches[:2]))
            train(rewind.batches(batches[2:], skip=listed))
        else:
            train(rewind.batches(batches, skip=listed if case in ("skip", "same") else ()))

    return {"error": _catch(run), "reasons": [s.reason for s in opt.stats], "collectives": calls}


@contextlib.contextmanager
def _collectives() -> Iterator[list[str]]:
    """The names of the ``torch.distributed.all_reduce``/``all_gather`` calls made inside the block."""
    import torch.distributed as dist

    made: list[str] = []
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather")}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            made.append(name)
            return originals[name](*args, **kwargs)

        return call

    for name in originals:
        setattr(dist, name, counting(name))
    try:
        yield made
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def agreement_job(rank: int, port: int, out_dir: str) -> None:
    """Every case of :data:`AGREEMENT_CASES` under DDP and FSDP2, one after the other."""
    init_world(rank, port, WORLD)
    res = {
        f"{kind}-{case}": _agreement_case(kind, case, rank)
        for kind in ("ddp", "fsdp")
        for case in AGREEMENT_CASES
    }
    torch.save(res, os.path.join(out_dir, f"agreement{rank}.pt"))
    leave_process_group()
