"""The gloo jobs of ``tests/test_rewind_fsdp.py``: Rewind under FSDP2 (2 ranks) and FSDP2 x tensor
parallel (a 2 x 2 mesh, 4 ranks).

One rank alone gets spiking batches (targets 1000 times larger) at :data:`SPIKES`;
the guard watches the loss only, so the ranks agree on it.  After every
``step()`` each rank records its full parameters (gathered), its inner state
(moments gathered, step counters) and its module's buffers (its own), so
that the test can compare the state after the rewind with the state at the
restored copy's window, and the end of the run with one process that trained
on the batches the run kept.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from torch import nn

from clipopt import ClippedOptimizer, Rewind, SpikeGuard

from .distributed_jobs import init_world, leave_process_group

SPIKES = (12, 14)  #: batch indices (0-based) that spike on one rank
WINDOWS = 24
STOP = 14  #: the resumed run stops after this many batches (between the two spikes) and resumes
SPIKED = 1  #: the data-parallel rank whose batches spike (its last tensor-parallel rank, on the mesh)
LR = 0.01


def batch(dp_rank: int, index: int, features: int, spiked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``index`` of data-parallel rank ``dp_rank`` (any process can rebuild any batch);
    ``spiked``: its targets 1000 times larger when ``index`` is in :data:`SPIKES`."""
    gen = torch.Generator().manual_seed(100 * dp_rank + index)
    x, y = torch.randn(8, features, generator=gen), torch.randn(8, 3, generator=gen)
    return x, (y * 1000 if spiked and index in SPIKES else y)


def bn_model() -> nn.Sequential:
    """``Linear(5, 4), Tanh, BatchNorm1d(4), Linear(4, 1), Tanh, Linear(1, 3)``, seed 0: parameters
    whose shards over two ranks are uneven or empty (``Linear(4, 1)``: rank 1 holds none of it) and
    buffers (running statistics) that every forward pass changes.  (No bias straight before the batch
    norm: its gradient would be rounding noise, which Adam scales up to full steps.)"""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 4), nn.Tanh(), nn.BatchNorm1d(4), nn.Linear(4, 1), nn.Tanh(), nn.Linear(1, 3)
    )


def tp_model() -> nn.Sequential:
    """``Linear(6, 8), Tanh, Linear(8, 3)``, seed 0 (colwise then rowwise under tensor parallelism)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def wrapper(params: Any, rewind: Rewind | None) -> ClippedOptimizer:
    """AdamW (lr 0.01) under clipping at 1.0, with the test's SpikeGuard (loss only) when ``rewind`` is on."""
    guard = SpikeGuard(z_thresh=50.0, window=8, warmup=4, signals=("loss",)) if rewind is not None else None
    return ClippedOptimizer(torch.optim.AdamW(params, lr=LR), max_norm=1.0, spike_guard=guard, rewind=rewind)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def record(model: nn.Module, opt: ClippedOptimizer) -> dict[str, Any]:
    """This rank's state now: full parameters, full inner state (in parameter order), its own buffers."""
    params = list(model.parameters())
    state = [{k: _full(v) for k, v in sorted(opt.state[p].items())} for p in params if p in opt.state]
    return {
        "params": [_full(p) for p in params],
        "state": state,
        "buffers": [b.detach().clone() for b in model.buffers()],
        "windows": opt.num_windows,
    }


def _train(
    model: nn.Module,
    opt: ClippedOptimizer,
    dp_rank: int,
    spiked: bool,
    features: int,
    numbers: range,
    clear_at: int | None = None,
) -> dict[str, Any]:
    """The run over batches ``numbers`` (through ``opt.rewind.batches``), one micro-batch per window;
    ``clear_at``: the inner optimizer's state is emptied before that batch."""
    assert opt.rewind is not None
    numbered = [(i, batch(dp_rank, i, features, spiked)) for i in numbers]
    used, reasons, after = [], [], []
    for i, (x, y) in opt.rewind.batches(numbered):
        if i == clear_at:
            opt.state.clear()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
        assert opt.last_stats is not None
        used.append(i)
        reasons.append(opt.last_stats.reason)
        after.append(record(model, opt))
    return {
        "used": used,
        "reasons": reasons,
        "after": after,
        "log": [e.to_dict() for e in opt.rewind.log],
        "copies": opt.rewind.copies,
        "rewind_state": opt.state_dict()["clipopt"]["rewind"],
    }


def _fsdp_run() -> tuple[nn.Module, ClippedOptimizer]:
    """:func:`bn_model` under FSDP2 (every Linear/BatchNorm and the root), AdamW with guard and Rewind."""
    from torch.distributed.fsdp import fully_shard

    model = bn_model()
    for layer in model:
        if isinstance(layer, (nn.Linear, nn.BatchNorm1d)):
            fully_shard(layer)
    fully_shard(model)
    rewind = Rewind(every=5, keep=2, spikes=2, within=5, skip_batches=2, module=model, check_every=1)
    return model, wrapper(model.parameters(), rewind)


def _load_other_ranks(opt: ClippedOptimizer, own: dict[str, Any], rank: int, world: int) -> str | None:
    """``opt.load_state_dict`` of its own state with the Rewind part of the next rank's: the error."""
    import torch.distributed as dist

    states: list[Any] = [None] * world
    dist.all_gather_object(states, own)
    state = opt.state_dict()
    state["clipopt"]["rewind"] = states[(rank + 1) % world]
    try:
        opt.load_state_dict(state)
    except ValueError as exc:
        return str(exc)
    return None


def _load_across_sharding(sharded: ClippedOptimizer, own: dict[str, Any]) -> list[str | None]:
    """The errors of loading a one-process run's Rewind state into ``sharded`` (FSDP2), ``own`` (this
    rank's, FSDP2) into the one-process run's optimizer, and ``own`` with its first parameter marked
    whole (not a shard) into ``sharded``."""
    model = bn_model()
    plain = wrapper(model.parameters(), Rewind(every=1, module=model, check_every=1))
    for i in range(3):
        x, y = batch(0, i, 5)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        plain.step(loss=loss)
        plain.zero_grad()
    errors: list[str | None] = []
    tampered = copy.deepcopy(own)
    spec = tampered["copies"][-1]["spec"]
    parts = dict(spec[1])
    parts["params"][1][0] = ("t", parts["params"][1][0][1])
    cases = ((sharded, plain.state_dict()["clipopt"]["rewind"]), (plain, own), (sharded, tampered))
    for target, rewind_state in cases:
        state = target.state_dict()
        state["clipopt"]["rewind"] = rewind_state
        try:
            target.load_state_dict(state)
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def fsdp_rewind_job(rank: int, port: int, out_dir: str, world: int) -> None:
    """World 2, FSDP2; rank :data:`SPIKED`'s batches spike.  Then the same run stopped after
    :data:`STOP` batches, its model's and optimizer's state dicts (each rank its own) loaded into a
    new FSDP2 model and optimizer, which train on the rest: ``"resumed"``, its final record; and the
    same run with the inner state emptied just before the batch whose close rewinds: ``"cleared"``."""
    init_world(rank, port, world)
    model, opt = _fsdp_run()
    res = _train(model, opt, rank, rank == SPIKED, 5, range(WINDOWS))
    first, first_opt = _fsdp_run()
    _train(first, first_opt, rank, rank == SPIKED, 5, range(STOP))
    saved = copy.deepcopy((first.state_dict(), first_opt.state_dict()))
    second, second_opt = _fsdp_run()
    second.load_state_dict(saved[0])
    second_opt.load_state_dict(saved[1])
    rest = _train(second, second_opt, rank, rank == SPIKED, 5, range(STOP, WINDOWS))
    res["resumed"] = {"used": rest["used"], "log": rest["log"], "last": rest["after"][-1]}
    cleared, cleared_opt = _fsdp_run()
    again = _train(cleared, cleared_opt, rank, rank == SPIKED, 5, range(WINDOWS), clear_at=15)
    rewound = again["after"][again["reasons"].index("rewind")]
    res["cleared"] = {"log": again["log"], "rewound": rewound, "last": again["after"][-1]}
    res["other_rank"] = _load_other_ranks(second_opt, res["rewind_state"], rank, world)
    res["unsharded"] = _load_across_sharding(second_opt, res["rewind_state"])
    torch.save(res, os.path.join(out_dir, f"fsdp{rank}.pt"))
    leave_process_group()


def tp_rewind_job(rank: int, port: int, out_dir: str, world: int) -> None:
    """World 4, mesh ("dp", "tp") = (2, 2): colwise then rowwise Linear over "tp", FSDP2 over "dp".  The
    ranks of one tensor-parallel group share their data; only the last rank's targets spike (its
    tensor-parallel partner's do not)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    init_world(rank, port, world)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    model = tp_model()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    rewind = Rewind(every=5, keep=2, spikes=2, within=5, skip_batches=2, check_every=1)
    opt = wrapper(model.parameters(), rewind)
    res = _train(model, opt, dp_rank, rank == world - 1, 6, range(WINDOWS))
    res["placements"] = sorted({str(p.placements) for p in model.parameters()})
    torch.save(res, os.path.join(out_dir, f"tp{rank}.pt"))
    leave_process_group()
