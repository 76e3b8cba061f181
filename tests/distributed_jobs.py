"""Jobs run by ``tests/test_distributed.py`` in 2 processes on the gloo backend (CPU).

Each job runs several scenarios and saves, per rank, what clipopt did next to
an independent single-process reference (a plain model given the same data,
``torch.nn.utils.clip_grad_norm_`` and the plain optimizer).  The tests read
those files and compare; a job that raises fails the spawn and so the tests.
Spawning costs seconds, so one job covers many checks.
"""

from __future__ import annotations

import copy
import math
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from clipopt import AGC, ClippedOptimizer

WORLD = 2
MAX_NORM = 0.05  # well below the gradient norms here, so clipping is active
LR = 1e-2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


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


def _init(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)


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
    import clipopt._optimizer as impl

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
    _init(rank, port)
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
    torch.save(res, os.path.join(out_dir, f"ddp{rank}.pt"))
    dist.destroy_process_group()


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
    _init(rank, port)
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
    torch.manual_seed(1)
    narrow = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    stats = {}
    for case in ("finite", "nan"):
        model = _fsdp(narrow)
        names = [n for n, _ in narrow.named_parameters()]
        named = list(zip(names, model.parameters(), strict=True))
        opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), MAX_NORM, accumulation_steps=2,
                               layer_stats=True, param_names=named)
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
    torch.save(res, os.path.join(out_dir, f"fsdp{rank}.pt"))
    dist.destroy_process_group()
