"""Jobs run by ``tests/distributed/test_distributed.py`` in 2 processes on the gloo backend (CPU).

Each job runs several scenarios and saves, per rank, what clipopt did next to
an independent single-process reference (a plain model given the same data,
``torch.nn.utils.clip_grad_norm_`` and the plain optimizer).  The tests read
those files and compare; a job that raises fails the spawn and so the tests.
Spawning costs seconds, so one job covers many checks.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from clipopt import AGC, ClippedOptimizer, ClipPolicy

from .helpers import mlp

WORLD = 2
MAX_NORM = 0.05  # well below the gradient norms here, so clipping is active
LR = 1e-2

#: the process-group timeout of every spawned job (distributed, replay, spike): a regression that
#: makes the ranks wait for each other fails the job, well before the spawn's own bound
#: (helpers.spawn_job/join_spawned: 240 s), instead of blocking CI
PROCESS_GROUP_TIMEOUT_S = 60


def init_world(rank: int, port: int, world: int = WORLD) -> None:
    """Start a spawned rank: one CPU thread, then the gloo process group of ``world`` ranks whose
    rendezvous is 127.0.0.1:``port`` (timeout PROCESS_GROUP_TIMEOUT_S); :func:`leave_process_group`
    ends it."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
    )


def leave_process_group() -> None:
    """End a spawned rank: wait for every rank, destroy the group, and exit without finalization.

    On CPU, gloo's teardown races at interpreter exit: about one run in four (more on a
    loaded machine) a rank aborted with "terminate called without an active exception"
    after its work and its results were complete (seen on torch 2.13, also in
    examples/data_parallel.py; torch's own note: pytorch/pytorch#179291).  A barrier and
    ``os._exit(0)`` after ``destroy_process_group()`` measured 0 aborts in 16 runs against
    3 in 10 without.  Results must be saved (and loggers closed) before calling this.
    """
    import sys

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


_model = partial(mlp, (6, 8, 3))  # Linear(6, 8), Tanh, Linear(8, 3), global seed 0


def _batch(rank: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The deterministic micro-batch ``index`` of ``rank`` (any rank can rebuild any batch)."""
    gen = torch.Generator().manual_seed(1000 * rank + index)
    return torch.randn(5, 6, generator=gen) * 3, torch.randn(5, 3, generator=gen)


def _loss(model: nn.Module, rank: int, index: int) -> torch.Tensor:
    x, y = _batch(rank, index)
    return nn.functional.mse_loss(model(x), y)


def _reference(plain: nn.Module, windows: list[list[int]], norm_type: float = 2.0) -> list[float]:
    """Train ``plain`` in one process: per window, the mean gradient over every rank's micro-batches
    (what DDP/FSDP2 averaging plus a mean over micro-batches gives), clip_grad_norm_, AdamW.
    Returns the pre-clip norms."""
    opt = torch.optim.AdamW(plain.parameters(), lr=LR, foreach=True)
    norms = []
    for indices in windows:
        opt.zero_grad()
        count = WORLD * len(indices)
        for r in range(WORLD):
            for i in indices:
                (_loss(plain, r, i) / count).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(plain.parameters(), MAX_NORM, norm_type)))
        opt.step()
    return norms


def _gather(value: Any) -> list[Any]:
    out: list[Any] = [None] * WORLD
    dist.all_gather_object(out, value)
    return out


# ---------------------------------------------------------------------------- DDP


def _ddp(plain: nn.Module) -> tuple[nn.parallel.DistributedDataParallel, list[int], list[int]]:
    """A DDP copy of ``plain`` whose comm hook records at which micro-batch each all-reduce ran."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(plain))
    calls: list[int] = []
    current = [0]

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
        calls.append(current[0])
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    return ddp, calls, current


def _count_flush_all_reduces() -> list[int]:
    """Count the all-reduces clipopt does itself (flush() after an unsynchronised micro-batch)."""
    import clipopt._window.runtime as impl

    count = [0]
    original = impl.allreduce_mean_

    def counting(*args: Any, **kwargs: Any) -> None:
        count[0] += 1
        original(*args, **kwargs)

    impl.allreduce_mean_ = counting  # type: ignore[assignment]
    return count


def _clipped(model: nn.Module, k: int, **kwargs: Any) -> ClippedOptimizer:
    """The optimizer every DDP scenario uses: foreach AdamW, clipping at MAX_NORM, k micro-batches."""
    inner = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    return ClippedOptimizer(inner, MAX_NORM, accumulation_steps=k, **kwargs)


def ddp_job(rank: int, port: int, out_dir: str) -> None:
    init_world(rank, port)
    res: dict[str, Any] = {}
    own = _count_flush_all_reduces()

    # 1. accumulation with no_sync: all-reduce only on each window's last micro-batch;
    #    training equals one process over all ranks' micro-batches
    base = _model()
    ddp, calls, current = _ddp(base)
    opt = _clipped(ddp, 3)
    norms = []
    for i in range(1, 7):
        current[0] = i
        with opt.no_sync(ddp):
            _loss(ddp, rank, i).backward()
        opt.step()
        if opt.micro_batches == 0:
            norms.append(float(opt.last_stats.total_norm))
        opt.zero_grad()
    plain = copy.deepcopy(base)
    res["accum"] = {
        "calls": sorted(set(calls)),
        "norms": norms,
        "ref_norms": _reference(plain, [[1, 2, 3], [4, 5, 6]]),
        "params": [p.detach().clone() for p in ddp.module.parameters()],
        "ref_params": [p.detach().clone() for p in plain.parameters()],
        "clipped": [bool(s.clipped) for s in opt.stats],
    }

    # 2. flush() after unsynchronised micro-batches all-reduces them itself
    ddp, calls, current = _ddp(base)
    opt = _clipped(ddp, 3)
    for i in (1, 2):
        current[0] = i
        with opt.no_sync(ddp):
            _loss(ddp, rank, i).backward()
        opt.step()
    calls_before_flush = list(calls)
    own[0] = 0
    opt.flush()
    plain = copy.deepcopy(base)
    res["flush"] = {
        "own_all_reduces": own[0],
        "calls_before_flush": calls_before_flush,
        "norm": float(opt.last_stats.total_norm),
        "ref_norm": _reference(plain, [[1, 2]])[0],
        "params": [p.detach().clone() for p in ddp.module.parameters()],
        "ref_params": [p.detach().clone() for p in plain.parameters()],
    }

    # 3. sync=True synchronises the first micro-batch; a plain backward after an unsynced one
    #    synchronises the window, and flush() then does not all-reduce a second time
    ddp, calls, current = _ddp(base)
    opt = _clipped(ddp, 4)
    current[0] = 1
    with opt.no_sync(ddp, sync=True):
        _loss(ddp, rank, 1).backward()
    opt.step()
    current[0] = 2
    with opt.no_sync(ddp):
        _loss(ddp, rank, 2).backward()
    opt.step()
    current[0] = 3
    _loss(ddp, rank, 3).backward()  # outside no_sync: DDP synchronises the accumulated sum
    opt.step()
    own[0] = 0
    opt.flush()
    plain = copy.deepcopy(base)
    res["forced"] = {
        "own_all_reduces": own[0],
        "calls": sorted(set(calls)),
        "ref_norm": _reference(plain, [[1, 2, 3]])[0],
        "norm": float(opt.last_stats.total_norm),
        "params": [p.detach().clone() for p in ddp.module.parameters()],
        "ref_params": [p.detach().clone() for p in plain.parameters()],
    }

    # 3b. a checkpoint after an unsynchronised micro-batch, resumed (each rank its own file):
    #     the resumed flush() still all-reduces; and sync=False on the closing micro-batch with
    #     opt.step() inside the block all-reduces before the update
    ddp, calls, current = _ddp(base)
    opt = _clipped(ddp, 3)
    for i in (1, 2):
        with opt.no_sync(ddp):
            _loss(ddp, rank, i).backward()
        opt.step()
    path = os.path.join(out_dir, f"ckpt{rank}.pt")
    torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict()}, path)
    ckpt = torch.load(path, weights_only=True)
    ddp2, _, _ = _ddp(base)
    ddp2.module.load_state_dict(ckpt["model"])
    opt2 = _clipped(ddp2, 3)
    opt2.load_state_dict(ckpt["opt"])
    own[0] = 0
    opt2.flush()
    plain = copy.deepcopy(base)
    res["resumed"] = {
        "own_all_reduces": own[0],
        "ref_norm": _reference(plain, [[1, 2]])[0],  # trains plain: before ref_params
        "norm": float(opt2.last_stats.total_norm),
        "params": [p.detach().clone() for p in ddp2.module.parameters()],
        "ref_params": [p.detach().clone() for p in plain.parameters()],
    }
    ddp, calls, current = _ddp(base)
    opt = _clipped(ddp, 2)
    own[0] = 0
    for i in (1, 2):
        with opt.no_sync(ddp, sync=False):
            _loss(ddp, rank, i).backward()
            opt.step()  # closes the window on i == 2, inside the block
    plain = copy.deepcopy(base)
    res["inside"] = {
        "own_all_reduces": own[0],
        "calls": calls,
        "ref_norm": _reference(plain, [[1, 2]])[0],  # trains plain: before ref_params
        "norm": float(opt.last_stats.total_norm),
        "params": [p.detach().clone() for p in ddp.module.parameters()],
        "ref_params": [p.detach().clone() for p in plain.parameters()],
    }

    # 4. a nan in one rank's micro-batch: every rank skips, parameters bit-identical;
    #    each rank writes its own snapshot with its own batch
    ddp, calls, current = _ddp(base)
    snaps = os.path.join(out_dir, "snaps")
    opt = _clipped(ddp, 2, snapshot_dir=snaps, param_names=ddp.module.named_parameters())
    before = [p.detach().clone() for p in ddp.module.parameters()]
    for i in (1, 2):
        x, y = _batch(rank, i)
        if rank == 1 and i == 2:
            x = x.clone()
            x[0, 0] = math.nan
        with opt.no_sync(ddp):
            nn.functional.mse_loss(ddp(x), y).backward()
        opt.attach(inputs=x)
        opt.step()
    res["nan"] = {
        "snapshot": opt.last_snapshot,
        "skipped": _gather(opt.step_was_skipped),
        "unchanged": all(torch.equal(a, b) for a, b in zip(before, ddp.module.parameters(), strict=True)),
        "state_empty": len(opt.state) == 0,
    }
    res["groups"] = {p: _per_group_case(_model(), rank, p, sharded=False) for p in (2.0, math.inf)}
    torch.save(res, os.path.join(out_dir, f"ddp{rank}.pt"))
    leave_process_group()


# ---------------------------------------------------------------------------- FSDP2


def _fsdp(plain: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(plain)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _full(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _full_grads(plain: nn.Module, indices: list[int]) -> list[torch.Tensor]:
    """The mean gradient over every rank's micro-batches ``indices``, in one process."""
    model = copy.deepcopy(plain)
    count = WORLD * len(indices)
    for r in range(WORLD):
        for i in indices:
            (_loss(model, r, i) / count).backward()
    return [p.grad.detach().double() for p in model.parameters()]


def _norm64(grads: list[torch.Tensor], p: float) -> float:
    flat = torch.cat([g.reshape(-1) for g in grads]).abs()
    return float(flat.max()) if math.isinf(p) else float(flat.pow(p).sum().pow(1 / p))


def _state_tensors(opt: ClippedOptimizer) -> list[torch.Tensor]:
    """Every inner state tensor (moments as full tensors, step counters), copied."""
    return [
        (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    ]


def fsdp_job(rank: int, port: int, out_dir: str) -> None:
    init_world(rank, port)
    res: dict[str, Any] = {}
    base = _model()
    ref_grads = _full_grads(base, [1])

    # 1. the global norm of sharded (DTensor) gradients, for several p, on every rank
    norms = {}
    for p in (1.0, 2.0, 3.0, math.inf, 12.0):
        model = _fsdp(base)
        opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), None, norm_type=p)
        _loss(model, rank, 1).backward()
        opt.step()
        norms[p] = (float(opt.last_stats.total_norm), _norm64(ref_grads, p))
    res["norms"] = norms

    # 2. a nan in rank 1's shard only: every rank sees a non-finite norm and skips (p = 2 and inf);
    #    with fused AdamW (after one applied window, so the skip goes through found_inf) as well
    skipped = {}
    for p, fused in ((2.0, False), (math.inf, False), (2.0, True)):
        model = _fsdp(base)
        kind = {"fused": True} if fused else {"foreach": True}
        opt = ClippedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, **kind), MAX_NORM, norm_type=p)
        if fused:
            _loss(model, rank, 2).backward()
            opt.step()
            opt.zero_grad()
        before = _full(model)
        state_before = _state_tensors(opt)
        _loss(model, rank, 1).backward()
        if rank == 1:
            next(iter(model.parameters())).grad.to_local().view(-1)[0] = math.nan
        opt.step()
        after = _full(model)
        state_after = _state_tensors(opt)
        skipped[f"{p}{'-fused' if fused else ''}"] = {
            "skipped": _gather(opt.step_was_skipped),
            "norm_finite": _gather(math.isfinite(float(opt.last_stats.total_norm))),
            "unchanged": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
            "state_unchanged": len(state_before) == len(state_after)
            and all(torch.equal(a, b) for a, b in zip(state_before, state_after, strict=True)),
            "state_tensors": len(state_after),
        }
    res["nan"] = skipped

    # 3. accumulation with no_sync (k = 2, two windows) and clipping = one process;
    #    foreach and fused AdamW
    for fused in (False, True):
        model = _fsdp(base)
        kind = {"fused": True} if fused else {"foreach": True}
        inner = torch.optim.AdamW(model.parameters(), lr=LR, **kind)
        opt = ClippedOptimizer(inner, MAX_NORM, accumulation_steps=2)
        unsynced_grad_none = []
        for i in range(1, 5):
            with opt.no_sync(model):
                _loss(model, rank, i).backward()
            if i % 2 == 1:
                unsynced_grad_none.append(all(p.grad is None for p in model.parameters()))
            opt.step()
            opt.zero_grad()
        plain = copy.deepcopy(base)
        ref_norms = _reference(plain, [[1, 2], [3, 4]])
        res["fused" if fused else "accum"] = {
            "unsynced_grad_none": unsynced_grad_none,
            "norms": [float(s.total_norm) for s in opt.stats],
            "ref_norms": ref_norms,
            "params": _full(model),
            "ref_params": [p.detach().clone() for p in plain.parameters()],
        }

    # 4. flush() after an unsynchronised FSDP2 micro-batch raises and leaves the window open
    model = _fsdp(base)
    opt = ClippedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), MAX_NORM, accumulation_steps=3)
    with opt.no_sync(model):
        _loss(model, rank, 1).backward()
    opt.step()
    try:
        opt.flush()
        res["flush_error"] = None
    except RuntimeError as exc:
        res["flush_error"] = str(exc)
    res["flush_micro_batches"] = opt.micro_batches
    try:
        opt.state_dict()
        res["checkpoint_error"] = None
    except RuntimeError as exc:
        res["checkpoint_error"] = str(exc)

    # 5. per-layer statistics of shards are those of the full tensors (uneven shards, one empty:
    #    the last layer has a single output row), also with a nan in one rank's shard;
    #    snapshots are refused
    try:
        ClippedOptimizer(torch.optim.AdamW(model.parameters()), snapshot_dir=os.path.join(out_dir, "s"))
        res["snapshot_error"] = None
    except ValueError as exc:
        res["snapshot_error"] = str(exc)
    narrow = mlp((6, 8, 1), seed=1)
    stats = {}
    for case in ("finite", "nan"):
        model = _fsdp(narrow)
        names = [n for n, _ in narrow.named_parameters()]
        named = list(zip(names, model.parameters(), strict=True))
        opt = ClippedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0),
            MAX_NORM,
            accumulation_steps=2,
            layer_stats=True,
            param_names=named,
        )
        for i in (1, 2):
            x, _ = _batch(rank, i)
            with opt.no_sync(model):
                model(x).square().mean().backward()
            if case == "nan" and i == 2 and rank == 1:
                grad = next(iter(model.parameters())).grad
                grad.to_local().view(-1)[-1] = math.nan
            opt.step()
        assert opt.last_stats is not None and opt.last_stats.layers is not None
        stats[case] = {"got": opt.last_stats.layers.as_dict(), "names": names}
    plain = copy.deepcopy(narrow)
    for r in range(WORLD):
        for i in (1, 2):
            x, _ = _batch(r, i)
            (plain(x).square().mean() / (WORLD * 2)).backward()
    stats["grads"] = {n: p.grad.detach().double() for n, p in plain.named_parameters()}
    stats["params"] = {n: p.detach().double() for n, p in plain.named_parameters()}
    stats["local_numel"] = [p.to_local().numel() for p in _fsdp(narrow).parameters()]
    res["layer_stats"] = stats

    # 6. value clipping then the norm bound, and AGC (unit-wise), on shards = one process
    for case in ("value", "agc"):
        model = _fsdp(base)
        if case == "value":
            opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), MAX_NORM, clip_value=0.02)
        else:
            opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), AGC(clip_factor=0.01))
        _loss(model, rank, 1).backward()
        opt.step()
        plain = copy.deepcopy(base)
        grads = _full_grads(plain, [1])
        with torch.no_grad():
            for p, g in zip(plain.parameters(), grads, strict=True):
                p.grad = g.float()
            if case == "value":
                torch.nn.utils.clip_grad_value_(plain.parameters(), 0.02)
                torch.nn.utils.clip_grad_norm_(plain.parameters(), MAX_NORM)
            else:  # AGC written out: each row (a bias as a whole) to 0.01 * max(||w_row||, 1e-3)
                for p in plain.parameters():
                    dims = tuple(range(1, p.ndim)) or None
                    w = p.double().norm(dim=dims, keepdim=True) if dims else p.double().norm()
                    g = p.grad.double()
                    gn = g.norm(dim=dims, keepdim=True) if dims else g.norm()
                    limit = 0.01 * w.clamp_min(1e-3)
                    p.grad = (g * (limit / gn.clamp_min(1e-6)).clamp(max=1.0)).float()
            for p in plain.parameters():
                p -= 0.1 * p.grad
        res[case] = {
            "clipped": _gather(bool(opt.last_stats.clipped)),
            "params": _full(model),
            "ref_params": [p.detach().clone() for p in plain.parameters()],
        }
    res["groups"] = {p: _per_group_case(base, rank, p, sharded=True) for p in (2.0, math.inf)}
    torch.save(res, os.path.join(out_dir, f"fsdp{rank}.pt"))
    leave_process_group()


def _per_group_case(base: nn.Module, rank: int, p: float, *, sharded: bool) -> dict[str, Any]:
    """Per-group clipping under FSDP2 (``sharded``) or DDP: the first layer shares MAX_NORM, the last has
    its own bound 0.01; SGD with lr=1 applies the clipped gradient (fused under DDP: the groups' own
    scales before the kernel; foreach under FSDP2, which has no fused SGD for DTensors).  The reference
    is torch's clip_grad_norm_ per group on one process's full gradients."""
    model = _fsdp(base) if sharded else nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    layers = list(model.children()) if sharded else list(model.module.children())
    groups = [{"params": layers[0].parameters()}, {"params": layers[2].parameters(), "max_norm": 0.01}]
    kind = {"foreach": True} if sharded else {"fused": True}
    opt = ClippedOptimizer(torch.optim.SGD(groups, lr=1.0, **kind), MAX_NORM, norm_type=p)
    _loss(model, rank, 1).backward()
    opt.step()
    plain = copy.deepcopy(base)
    grads = _full_grads(plain, [1])
    with torch.no_grad():
        for param, g in zip(plain.parameters(), grads, strict=True):
            param.grad = g.float()
        params = list(plain.parameters())
        norms = [
            float(torch.nn.utils.clip_grad_norm_(ps, bound, norm_type=p))
            for ps, bound in ((params[:2], MAX_NORM), (params[2:], 0.01))
        ]
        for param in params:
            param -= param.grad
    stats = opt.last_stats
    assert stats is not None
    return {
        "group_norms": list(stats.group_norms),
        "ref_norms": norms,
        "total_norm": float(stats.total_norm),
        "ref_total": _norm64(grads, p),
        "params": _full(model) if sharded else [q.detach().clone() for q in model.parameters()],
        "ref_params": [q.detach().clone() for q in plain.parameters()],
    }


# ============================================================================ hardening (issue #17)
# Worlds of 2, 3 and 4 processes (init_world's timeout: a hang fails the job and the test).


def _gather_n(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


class _Collectives:
    """Counts the collectives issued while active (all_reduce, all_gather, broadcast, ...)."""

    NAMES = (
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "broadcast",
        "reduce_scatter_tensor",
        "all_gather_object",
        "barrier",
    )

    def __init__(self) -> None:
        self.count = 0
        self.active = False
        self._originals = {n: getattr(dist, n) for n in self.NAMES}
        for name, original in self._originals.items():
            setattr(dist, name, self._wrap(original))

    def _wrap(self, original: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.active:
                self.count += 1
            return original(*args, **kwargs)

        return counted

    def restore(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)


def _edge_model() -> nn.Module:
    """Parameters whose first dimension is smaller than the world: empty shards, and a size-1 bias."""
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2), nn.Tanh(), nn.Linear(2, 1))


def _edge_loss(model: nn.Module, rank: int, index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(500 + 1000 * rank + index)
    x, y = torch.randn(5, 6, generator=gen) * 3, torch.randn(5, 1, generator=gen)
    return nn.functional.mse_loss(model(x), y)


def _edge_policy(name: str) -> Any:
    from clipopt import AutoClip, ZClip

    return {
        "float": MAX_NORM,
        "autoclip": AutoClip(percentile=50),
        "zclip": ZClip(warmup_steps=2, z_thresh=0.5, skip_spikes=True),
        "agc": AGC(clip_factor=0.01),
    }[name]


def fsdp_edge_job(rank: int, port: int, out_dir: str, world: int) -> None:
    """FSDP2 with empty and size-1 shards: norms for every p, every policy = one process."""
    from clipopt import ClippedOptimizer as Clipped

    init_world(rank, port, world)
    counter = _Collectives()
    res: dict[str, Any] = {"local_numel": None, "norms": {}, "policies": {}, "collectives": {}}
    base = _edge_model()
    plain = copy.deepcopy(base)
    for r in range(world):
        (_edge_loss(plain, r, 1) / world).backward()
    ref_grads = [p.grad.detach().double() for p in plain.parameters()]
    for p in (1.0, 2.0, 3.0, math.inf):
        model = _fsdp(base)
        res["local_numel"] = [q.to_local().numel() for q in model.parameters()]
        opt = Clipped(torch.optim.SGD(model.parameters(), lr=0.0), None, norm_type=p)
        _edge_loss(model, rank, 1).backward()
        opt.step()  # the first step() also checks the settings across ranks (once)
        opt.zero_grad()
        _edge_loss(model, rank, 1).backward()
        counter.active = True
        opt.step()
        counter.active = False
        res["norms"][p] = (float(opt.last_stats.total_norm), _norm64(ref_grads, p))
        res["collectives"][p] = counter.count
        counter.count = 0
    for policy in ("float", "autoclip", "zclip", "agc"):
        for p in (1.0, 2.0, math.inf):
            model = _fsdp(base)
            opt = Clipped(torch.optim.SGD(model.parameters(), lr=0.1), _edge_policy(policy), norm_type=p)
            one = copy.deepcopy(base)
            ref = Clipped(torch.optim.SGD(one.parameters(), lr=0.1), _edge_policy(policy), norm_type=p)
            norms, ref_norms = [], []
            for i in range(1, 5):
                _edge_loss(model, rank, i).backward()
                opt.step()
                opt.zero_grad()
                for r in range(world):
                    (_edge_loss(one, r, i) / world).backward()
                ref.step()
                ref.zero_grad()
                norms.append(float(opt.last_stats.total_norm))
                ref_norms.append(float(ref.last_stats.total_norm))
            res["policies"][f"{policy}-{p}"] = {
                "norms": norms,
                "ref_norms": ref_norms,
                "skipped": [s.skipped for s in opt.stats],
                "ref_skipped": [s.skipped for s in ref.stats],
                "clipped": [s.clipped for s in opt.stats],
                "ref_clipped": [s.clipped for s in ref.stats],
                "params": _full(model),
                "ref_params": [q.detach().clone() for q in one.parameters()],
            }
    counter.restore()
    torch.save(res, os.path.join(out_dir, f"edge{rank}.pt"))
    leave_process_group()


def _catch(fn: Any) -> str | None:
    """Run ``fn``; the message of the error it raised, or None."""
    try:
        fn()
    except (RuntimeError, ValueError) as exc:
        return str(exc)
    return None


def _params_same_on_every_rank(module: nn.Module) -> bool:
    mine = [p.detach().clone() for p in module.parameters()]
    every = _gather_n(mine)
    return all(torch.equal(a, b) for other in every for a, b in zip(mine, other, strict=True))


def _divergence_case(rank: int, kind: str, k: int, snaps: str | None, corrupt: str) -> dict[str, Any]:
    """One window in which rank 1 changes its first gradient after DDP's all-reduce (``corrupt``:
    "scale" multiplies it by 1.001, "nan" writes a nan); fused optimizers get an applied window first."""
    import warnings

    base = _model()
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    inner = torch.optim.AdamW(ddp.parameters(), lr=LR, **{kind: True})
    named = {"param_names": ddp.module.named_parameters()} if snaps else {}
    opt = ClippedOptimizer(inner, MAX_NORM, accumulation_steps=k, snapshot_dir=snaps, **named)
    seen: list[str] = []
    reads: list[str] = []
    counter = _Collectives()

    def window(index: int, bad: bool) -> None:
        from .hostreads import count_host_reads

        for i in range(k):
            with opt.no_sync(ddp):
                _loss(ddp, rank, 10 * index + i).backward()
            if bad and rank == 1 and i == k - 1:
                grad = next(iter(ddp.module.parameters())).grad
                if corrupt == "nan":
                    grad.view(-1)[0] = math.nan
                else:
                    grad.mul_(1.001)
            counter.active = True
            with count_host_reads() as r:
                opt.step()
            counter.active = False
            reads.extend(r.ours)
            opt.zero_grad()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        window(0, False)  # fused: state exists, so the next windows take the sync-free path
        counter.count, reads[:] = 0, []
        window(1, True)
        bad_stats = opt.last_stats
        window(2, False)  # the fused path reports the divergence at the next window's close
        seen = [str(w.message) for w in caught if "differ" in str(w.message)]
    counter.restore()
    return {
        "skipped": [s.skipped for s in opt.stats],
        "reason": bad_stats.reason,
        "same": _params_same_on_every_rank(ddp.module),
        "warnings": seen,
        "snapshot": opt.last_snapshot,
        "collectives": counter.count,
        "reads": reads,
        "consecutive": int(opt._run.counters.consecutive),
    }


def _policy_case(rank: int) -> dict[str, Any]:
    """ZClip with spike skips under DDP (fused AdamW), rank 1's gradient scaled by 3 after the all-reduce
    in window 4: every window's decision and ZClip's statistics stay identical on every rank."""
    import warnings

    from clipopt import ZClip

    ddp = nn.parallel.DistributedDataParallel(_model())
    policy = ZClip(warmup_steps=2, z_thresh=1.0, skip_spikes=True)
    opt = ClippedOptimizer(torch.optim.AdamW(ddp.parameters(), lr=LR, fused=True), policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(6):
            _loss(ddp, rank, i).backward()
            if rank == 1 and i == 3:
                next(iter(ddp.module.parameters())).grad.mul_(3.0)
            opt.step()
            opt.zero_grad()
    return {
        "decisions": _gather_n([(s.skipped, s.reason, s.max_norm) for s in opt.stats]),
        "stats": _gather_n(policy.state_dict()["stats"].clone()),
        "same": _params_same_on_every_rank(ddp.module),
    }


def _pipeline_case(rank: int, p: float, nan: bool, rows: str | None = None) -> dict[str, Any]:
    """Rank r holds pipeline stage r (layer 2r of the model) and optimizes only its parameters;
    ``norm_group`` combines the stages' partial norms.  Activations would travel between the stages
    in a real pipeline; here every rank runs the whole model on the same data, so each stage's
    gradients are exactly those a pipeline computes.  With ``rows`` (a folder) each stage also logs
    per-layer rows (``layer_stats=2`` and a CSV logger: the norm pass keeps a candidate row)."""
    from clipopt import CSVLogger

    base = _model()
    model = copy.deepcopy(base)
    stage = model[2 * rank]
    logging: dict[str, Any] = {}
    if rows is not None:
        logging = {"layer_stats": 2, "loggers": [CSVLogger(os.path.join(rows, f"{rank}.csv"), ranks="all")]}
    opt = ClippedOptimizer(
        torch.optim.AdamW(stage.parameters(), lr=LR, foreach=True),
        MAX_NORM,
        norm_type=p,
        norm_group=dist.group.WORLD,
        **logging,
    )
    plain = copy.deepcopy(base)
    ref = torch.optim.AdamW(plain.parameters(), lr=LR, foreach=True)
    norms, ref_norms = [], []
    before = [q.detach().clone() for q in stage.parameters()]
    for i in (1, 2):
        _loss(model, 0, i).backward()
        if nan and rank == 1:
            next(iter(stage.parameters())).grad.view(-1)[0] = math.nan
        opt.step()
        opt.zero_grad()
        model.zero_grad()
        for s in range(2):  # what the pipeline's activations would carry: the other stage's new weights
            for q in model[2 * s].parameters():
                dist.broadcast(q.data, src=s)
        _loss(plain, 0, i).backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(plain.parameters(), MAX_NORM, p)))
        ref.step()
        ref.zero_grad()
        norms.append(float(opt.last_stats.total_norm))
    return {
        "norms": norms,
        "ref_norms": ref_norms,
        "skipped": [s.skipped for s in opt.stats],
        "unchanged": all(torch.equal(a, b) for a, b in zip(before, stage.parameters(), strict=True)),
        "params": [q.detach().clone() for q in stage.parameters()],
        "ref_params": [q.detach().clone() for q in plain[2 * rank].parameters()],
    }


def _loggers_case(rank: int, out_dir: str) -> dict[str, Any]:
    from clipopt import CSVLogger, TensorBoardLogger

    ddp = nn.parallel.DistributedDataParallel(_model())
    shared = os.path.join(out_dir, "grads.csv")  # the same path on every rank
    per_rank = os.path.join(out_dir, "each.csv")
    tb = os.path.join(out_dir, "tb")
    loggers = [CSVLogger(shared), CSVLogger(per_rank, ranks="all"), TensorBoardLogger(tb)]
    opt = _clipped(ddp, 1, loggers=loggers)
    for i in range(3):
        _loss(ddp, rank, i).backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    dist.barrier()
    return {"files": sorted(os.listdir(out_dir)), "tb": sorted(os.listdir(tb)) if os.path.isdir(tb) else []}


def ddp_hardening_job(rank: int, port: int, out_dir: str, world: int) -> None:
    """DDP: divergence and post-sync nan agreed across ranks, collectives per window, no_sync misuse,
    loggers, pipeline norm_group, independent ranks; misuse that used to hang comes last."""
    import warnings

    init_world(rank, port, world)
    res: dict[str, Any] = {}
    for kind, k in (("foreach", 1), ("foreach", 3), ("fused", 1), ("fused", 3)):
        res[f"diverge-{kind}-{k}"] = _divergence_case(rank, kind, k, None, "scale")
        res[f"nan-{kind}-{k}"] = _divergence_case(rank, kind, k, None, "nan")
    res["snapshot"] = _divergence_case(rank, "foreach", 1, os.path.join(out_dir, "snaps"), "scale")
    res["policy"] = _policy_case(rank)
    for p in (2.0, math.inf):
        res[f"pipeline-{p}"] = _pipeline_case(rank, p, False)
    res["pipeline-nan"] = _pipeline_case(rank, 2.0, True)
    res["pipeline-rows"] = _pipeline_case(rank, 2.0, False, os.path.join(out_dir, "pipeline-rows"))
    res["loggers"] = _loggers_case(rank, os.path.join(out_dir, "logs"))
    res["logs_dir"] = os.path.join(out_dir, "logs")

    # no_sync given the module inside DDP (it has nothing to suppress) warns once
    ddp = nn.parallel.DistributedDataParallel(_model())
    opt = _clipped(ddp, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in (1, 2):
            with opt.no_sync(ddp.module):
                _loss(ddp, rank, i).backward()
            opt.step()
    res["no_sync_warnings"] = [str(w.message) for w in caught]

    # ranks training independent models (no DDP): replica_group=None keeps decisions local
    for option in (None, "auto"):
        torch.manual_seed(rank)
        own = nn.Sequential(nn.Linear(6, 3))
        counter = _Collectives()
        counter.active = True
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = ClippedOptimizer(torch.optim.SGD(own.parameters(), lr=0.1), MAX_NORM, replica_group=option)
            for i in (1, 2):
                _loss(own, rank, i).backward()
                opt.step()
                opt.zero_grad()
        counter.restore()
        res[f"independent-{option}"] = {
            "skipped": [s.skipped for s in opt.stats],
            "reasons": [s.reason for s in opt.stats],
            "collectives": counter.count,
            "warnings": [str(w.message) for w in caught],
        }

    # misuse: different accumulation_steps per rank (raised at the first no_sync, on every rank)
    ddp = nn.parallel.DistributedDataParallel(_model())
    opt = _clipped(ddp, 2 + rank)

    def first_micro_batch() -> None:
        with opt.no_sync(ddp):
            _loss(ddp, rank, 1).backward()
        opt.step()

    res["settings_error"] = _catch(first_micro_batch)

    # misuse: uneven data at the end of an epoch (rank 0 has one micro-batch more), then flush()
    ddp = nn.parallel.DistributedDataParallel(_model())
    opt = _clipped(ddp, 2)

    def uneven() -> None:
        for i in range(5 if rank == 0 else 4):
            with opt.no_sync(ddp):
                _loss(ddp, rank, i).backward()
            opt.step()
            opt.zero_grad()
        opt.flush()

    res["flush_error"] = _catch(uneven)

    # replicas kept identical without DDP (every rank sees the same data), so clipopt's collectives
    # are the only ones: a flush() on rank 0 only meets rank 1's window; then accumulation_steps
    # changed on one rank after the first window
    for case in ("flush-one-rank", "changed-k"):
        model = _model()
        opt = _clipped(model, 2)

        def run(model: nn.Module = model, opt: ClippedOptimizer = opt, case: str = case) -> None:
            for i in range(2):  # one normal window
                _loss(model, 0, i).backward()
                opt.step()
            opt.zero_grad()
            if case == "changed-k":
                opt.accumulation_steps = 1 + rank
                for i in range(opt.accumulation_steps):  # rank 0 closes a window after 1, rank 1 after 2
                    _loss(model, 0, 3 + i).backward()
                    opt.step()
                return
            _loss(model, 0, 3).backward()
            opt.step()
            if case == "flush-one-rank":
                if rank == 0:
                    opt.flush()
                else:
                    _loss(model, 0, 4).backward()
                    opt.step()

        res[case] = {
            "error": _catch(run),
            "skipped": [s.skipped for s in opt.stats],
            "reasons": [s.reason for s in opt.stats],
        }
    torch.save(res, os.path.join(out_dir, f"hard{rank}.pt"))
    leave_process_group()


def tp_job(rank: int, port: int, out_dir: str, world: int) -> None:
    """4 processes, a 2 x 2 DeviceMesh ("dp", "tp"): tensor parallel (colwise then rowwise Linear)
    inside FSDP2.  Parameters are sharded over both dimensions or sharded over "dp" and replicated
    over "tp" (the rowwise bias); the global norm must count replicated shards once."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    init_world(rank, port, world)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    res: dict[str, Any] = {"norms": {}, "placements": set()}

    def build() -> nn.Module:
        model = _model()
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        return model

    plain = _model()
    for r in range(2):  # each dp rank's batch, averaged by FSDP over "dp"; the tp ranks share theirs
        (_loss(plain, r, 1) / 2).backward()
    ref_grads = [p.grad.detach().double() for p in plain.parameters()]
    for p in (1.0, 2.0, math.inf):
        model = build()
        res["placements"] |= {str(q.placements) for q in model.parameters()}
        opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), None, norm_type=p)
        _loss(model, dp_rank, 1).backward()
        opt.step()
        res["norms"][p] = (float(opt.last_stats.total_norm), _norm64(ref_grads, p))
    # clipping (2-norm) and AGC on the 2-D mesh give the one-process update
    for case in ("clip", "agc"):
        model = build()
        bound: Any = MAX_NORM if case == "clip" else AGC(clip_factor=0.01)
        opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bound)
        _loss(model, dp_rank, 1).backward()
        opt.step()
        one = _model()
        ref_bound: Any = MAX_NORM if case == "clip" else AGC(clip_factor=0.01)
        ref = ClippedOptimizer(torch.optim.SGD(one.parameters(), lr=0.1), ref_bound)
        for r in range(2):
            (_loss(one, r, 1) / 2).backward()
        ref.step()
        res[case] = {"params": _full(model), "ref_params": [q.detach().clone() for q in one.parameters()]}
    torch.save(res, os.path.join(out_dir, f"tp{rank}.pt"))
    leave_process_group()


# ---------------------------------------------------------------------------- the ranks' state


def _train(model: nn.Module, opt: ClippedOptimizer, rank: int, windows: range, offset: int = 0) -> None:
    """``len(windows)`` windows of ``opt.accumulation_steps`` micro-batches each (data ``offset``)."""
    for w in windows:
        for i in range(opt.accumulation_steps):
            _loss(model, rank, offset + 10 * w + i).backward()
            opt.step()
        opt.zero_grad()


def _ranks_opt(model: nn.Module, policy: bool) -> ClippedOptimizer:
    """Foreach AdamW (the host path: a check is read at its own window), ZClip or MAX_NORM."""
    from clipopt import ZClip

    bound: Any = ZClip(warmup_steps=1) if policy else MAX_NORM
    return ClippedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, foreach=True), bound)


def _load_case(rank: int, wrap: Any, other: bool, policy: bool) -> dict[str, Any]:
    """Two runs of two windows (run B on other data) give checkpoints of the same step; a fresh model
    and optimizer on every rank load run A's, except rank 1 loads run B's when ``other``; then two
    more windows.  ``wrap``: DDP or FSDP2 (each rank saves and loads its own shards)."""
    base = _model()
    saved = []
    for offset in (0, 500):  # run A, run B
        model = wrap(base)
        opt = _ranks_opt(model, policy)
        _train(model, opt, rank, range(2), offset)
        saved.append((copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())))
    model = wrap(base)
    opt = _ranks_opt(model, policy)
    model_sd, opt_sd = saved[1 if other and rank == 1 else 0]
    model.load_state_dict(model_sd)
    opt.load_state_dict(opt_sd)
    error = _catch(lambda: _train(model, opt, rank, range(2, 4)))
    return {
        "error": error,
        "skipped": [s.skipped for s in opt.stats],
        "reasons": [s.reason for s in opt.stats],
        "windows": opt.num_windows,
    }


def _fail_once(opt: ClippedOptimizer) -> None:
    """The inner optimizer's next step() raises (once), as a transient fault would."""
    inner = opt.optimizer
    original = inner.step

    def step(*args: Any, **kwargs: Any) -> Any:
        inner.step = original  # type: ignore[method-assign]
        raise RuntimeError("inner step failed")

    inner.step = step  # type: ignore[method-assign]


def _failed_step_case(rank: int, wrap: Any, p: float) -> dict[str, Any]:
    """Window 2's inner step raises on rank 1 (the loop catches it, the wrapper rolls the window
    back there) while rank 0 applies it; then window 3."""
    model = wrap(_model())
    inner = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    opt = ClippedOptimizer(inner, MAX_NORM, norm_type=p)
    _train(model, opt, rank, range(1))
    if rank == 1:
        _fail_once(opt)
    caught = _catch(lambda: _train(model, opt, rank, range(1, 2)))
    error = _catch(lambda: _train(model, opt, rank, range(2, 3)))
    return {"caught": caught, "error": error, "reasons": [s.reason for s in opt.stats]}


def _reload_case(rank: int) -> dict[str, Any]:
    """FSDP2: after two windows rank 1 reloads the optimizer's checkpoint of window 1 (an older
    step), rank 0 goes on; then one window."""
    model = _fsdp(_model())
    opt = ClippedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, foreach=True), MAX_NORM)
    _train(model, opt, rank, range(1))
    older = copy.deepcopy(opt.state_dict())
    _train(model, opt, rank, range(1, 2))
    if rank == 1:
        opt.load_state_dict(older)
    error = _catch(lambda: _train(model, opt, rank, range(2, 3)))
    return {"error": error, "reasons": [s.reason for s in opt.stats]}


def _changed_k_case(rank: int) -> dict[str, Any]:
    """FSDP2 with no_sync, k = 2; after one window every rank sets accumulation_steps, to 3 on rank 0
    and to 4 on rank 1: the next no_sync() raises on every rank (measured: seconds, not a timeout)."""
    import time

    model = _fsdp(_model())
    inner = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    opt = ClippedOptimizer(inner, MAX_NORM, accumulation_steps=2)

    def run() -> None:
        for i in range(8):
            with opt.no_sync(model):
                _loss(model, rank, i).backward()
            opt.step()
            if i == 1:
                opt.zero_grad()
                opt.accumulation_steps = 3 + rank

    start = time.monotonic()
    error = _catch(run)
    return {"error": error, "seconds": time.monotonic() - start, "windows": opt.num_windows}


def _settings_case(rank: int, case: str) -> dict[str, Any]:
    """Replicas kept identical without DDP (every rank sees the same data): "clip_value" sets
    opt.clip_value on rank 1 only after the first window; "zclip" builds ZClip with z_thresh 2.5 on
    rank 0 and 3.5 on rank 1 (the policy's settings: compared by the first step's check)."""
    from clipopt import ZClip

    model = _model()
    bound: Any = ZClip(z_thresh=2.5 + rank) if case == "zclip" else MAX_NORM
    opt = ClippedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, foreach=True), bound)

    def run() -> None:
        _train(model, opt, 0, range(1))
        if case == "clip_value" and rank == 1:
            opt.clip_value = 0.5
        _train(model, opt, 0, range(1, 3))

    return {"error": _catch(run), "reasons": [s.reason for s in opt.stats]}


class _HalfBound(ClipPolicy):
    """A clip policy of the user's own, without a ``__repr__`` (object's holds the address)."""

    def threshold(self, total_norm: torch.Tensor) -> torch.Tensor:
        return torch.full_like(total_norm, 0.5)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


def _own_policy_case(rank: int) -> dict[str, Any]:
    """The same policy class of the user's own on every rank (DDP): three windows."""
    model = nn.parallel.DistributedDataParallel(_model())
    opt = ClippedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, foreach=True), _HalfBound())
    return {
        "error": _catch(lambda: _train(model, opt, rank, range(3))),
        "reasons": [s.reason for s in opt.stats],
    }


def _reads_case(rank: int, wrap: Any) -> list[str]:
    """Fused AdamW: one window (the state is made), state_dict() and load_state_dict() of it on every
    rank, then three windows whose host reads inside opt.step() are returned."""
    from .hostreads import count_host_reads

    model = wrap(_model())
    opt = ClippedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, fused=True), MAX_NORM)
    _train(model, opt, rank, range(1))
    opt.load_state_dict(opt.state_dict())
    reads: list[str] = []
    for w in range(1, 4):
        _loss(model, rank, 10 * w).backward()
        with count_host_reads() as r:
            opt.step()
        reads.extend(r.ours)
        opt.zero_grad()
    return reads


def _pipeline_load_case(rank: int) -> str | None:
    """Pipeline stages (norm_group, each rank its own layer, replica_group left "auto") save and load
    their own, different, state: no error (the ranks' states are not compared, their counters are)."""
    model = _model()
    stage = model[2 * rank]
    inner = torch.optim.AdamW(stage.parameters(), lr=LR, foreach=True)
    opt = ClippedOptimizer(inner, MAX_NORM, norm_group=dist.group.WORLD)
    _train(model, opt, 0, range(1))
    opt.load_state_dict(opt.state_dict())
    return _catch(lambda: _train(model, opt, 0, range(1, 3)))


def ranks_job(rank: int, port: int, out_dir: str, world: int) -> None:
    """The ranks' state compared at every window: loads of another run's checkpoint, a window whose
    close failed on one rank, accumulation_steps changed to different values (DDP and FSDP2)."""
    init_world(rank, port, world)
    res: dict[str, Any] = {}
    ddp = nn.parallel.DistributedDataParallel
    wraps = {"ddp": lambda m: ddp(copy.deepcopy(m)), "fsdp": _fsdp}
    for name, wrap in wraps.items():
        for other in (False, True):
            res[f"load-{name}-{'other' if other else 'same'}"] = _load_case(rank, wrap, other, name == "fsdp")
    res["failed-ddp"] = _failed_step_case(rank, wraps["ddp"], 2.0)
    for p in (2.0, math.inf):
        res[f"failed-fsdp-{p}"] = _failed_step_case(rank, _fsdp, p)
    res["changed-k"] = _changed_k_case(rank)
    res["reload-fsdp"] = _reload_case(rank)
    for case in ("clip_value", "zclip"):
        res[f"settings-{case}"] = _settings_case(rank, case)
    for name, wrap in wraps.items():
        res[f"reads-{name}"] = _reads_case(rank, wrap)
    res["pipeline-load"] = _pipeline_load_case(rank)
    res["own-policy"] = _own_policy_case(rank)
    torch.save(res, os.path.join(out_dir, f"ranks{rank}.pt"))
    leave_process_group()


# ---------------------------------------------------------------------------- several inner optimizers


def _muon_adamw(model: nn.Module, fused: bool) -> list[torch.optim.Optimizer]:
    """Muon (or fused SGD with momentum, ``fused``) for the weight matrices, AdamW for the biases."""
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    first: torch.optim.Optimizer = torch.optim.Muon(matrices, lr=LR)
    if fused:
        first = torch.optim.SGD(matrices, lr=LR, momentum=0.9, fused=True)
    return [first, torch.optim.AdamW(others, lr=LR, fused=fused)]


def _sgd_adamw(model: nn.Module) -> list[torch.optim.Optimizer]:
    """SGD with momentum for the weight matrices, AdamW for the biases (both take DTensors)."""
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    return [torch.optim.SGD(matrices, lr=LR, momentum=0.9), torch.optim.AdamW(others, lr=LR)]


def multi_ddp_job(rank: int, port: int, out_dir: str) -> None:
    """DDP with ``ClippedOptimizer([muon, adamw], ...)`` (and all-fused [SGD, AdamW]), and FSDP2 with
    [SGD, AdamW]: three windows of two micro-batches (DDP: no_sync on the first), the second poisoned on
    rank 1 (NaN loss: skipped on both ranks); the single-process reference is clip_grad_norm_ over the
    mean gradient then each inner step()."""
    init_world(rank, port)
    res: dict[str, Any] = {}
    for kind in ("muon", "fused", "fsdp"):
        base = _model()
        if kind == "fsdp":
            model = _fsdp(base)
            opt = ClippedOptimizer(_sgd_adamw(model), MAX_NORM, accumulation_steps=2)
            ref = _sgd_adamw(plain := copy.deepcopy(base))
        else:
            model = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
            opt = ClippedOptimizer(_muon_adamw(model, kind == "fused"), MAX_NORM, accumulation_steps=2)
            ref = _muon_adamw(plain := copy.deepcopy(base), kind == "fused")
        for w in range(3):
            for i in (2 * w, 2 * w + 1):
                with opt.no_sync(model) if kind != "fsdp" else contextlib.nullcontext():
                    loss = _loss(model, rank, i)
                    (loss * math.nan if w == 1 and rank == 1 else loss).backward()
                opt.step()
                opt.zero_grad()
            if w == 1:
                continue  # the reference skips the poisoned window too
            for r in range(WORLD):
                for i in (2 * w, 2 * w + 1):
                    (_loss(plain, r, i) / (2 * WORLD)).backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), MAX_NORM)
            for o in ref:
                o.step()
            plain.zero_grad()
        res[kind] = {
            "skipped": [bool(s.skipped) for s in opt.stats],
            "params": _full(model) if kind == "fsdp" else [p.detach().clone() for p in model.parameters()],
            "ref_params": [p.detach().clone() for p in plain.parameters()],
        }
    torch.save(res, os.path.join(out_dir, f"multi{rank}.pt"))
    leave_process_group()
