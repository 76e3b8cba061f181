"""SpikeGuard + Rewind under FSDP2 (2 ranks, gloo) against the same run in one process.

The model, the data, the corrupted batches, the optimizer configurations and the
held-out evaluation are those of ``benchmarks/spikes.py`` (imported from it).
The same configuration and seed run twice:

* **one process**: the whole batch of 16 sequences per window, as in ``spikes.py``;
* **FSDP2**: ``fully_shard`` on each transformer layer and on the root, ``--world``
  gloo processes (``torch.multiprocessing.spawn``, one thread each, a hard
  timeout); every rank builds the same batch stream and takes its own equal
  slice of every batch, so the global batch is the one-process run's and the
  averaged gradient is the same (up to the order of the additions).  Rewind's
  ``batches()`` wraps the stream on every rank; every rank rewinds at the same
  window (docs/spike-recovery.md, "Rewind under FSDP2 and tensor parallelism").

Reported per configuration and seed: held-out loss of each run and their
difference, spike skips and rewinds on each (and the windows at which they
happened), updates undone, the largest parameter difference at the end, the
largest training-loss difference over the windows before the first decision
that differs (if any), and time per window.  The held-out loss of the FSDP2
run is evaluated on its gathered full parameters loaded into a plain model.

Note on the guard's loss signal: under FSDP2 every rank passes the loss of its
own half batch to ``step(loss=...)`` and the guard scores the largest of them
(one scalar all-reduce per window), where the one-process run scores the mean
over the whole batch; the gradient norm is the same in both.

    python benchmarks/spikes_fsdp.py                  # spikeguard+rewind and +lr_cut, seed 0, 400 windows
    python benchmarks/spikes_fsdp.py --seeds 2 --configs spikeguard+rewind

Writes ``spikes_fsdp.md`` and ``spikes_fsdp.json`` into ``--out`` (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import spikes  # noqa: E402
from spikes import TinyGPT, Workload  # noqa: E402

from clipopt import ClippedOptimizer  # noqa: E402

CONFIGS = ("spikeguard+rewind", "spikeguard+rewind+lr_cut")

# ----------------------------------------------------------------------------- one run


def _loop(
    model: torch.nn.Module,
    opt: ClippedOptimizer,
    w: Workload,
    data: tuple[torch.Tensor, torch.Tensor, int],
    seed: int,
    parts: list[slice],
) -> tuple[list[torch.Tensor], float]:
    """``spikes.train``'s loop, the loss the mean of the losses of the rows ``parts`` of every batch
    (``[slice(None)]``: ``spikes.train`` itself): the per-window losses, seconds per window."""
    assert opt.rewind is not None
    train_ids, _, vocab = data
    batches = opt.rewind.batches(spikes.stream(train_ids, vocab, w, seed))
    losses = []
    start = time.perf_counter()
    for _ in range(w.windows):
        x, y = next(batches)
        loss = sum(
            torch.nn.functional.cross_entropy(model(x[p]).reshape(-1, vocab), y[p].reshape(-1)) for p in parts
        ) / len(parts)
        assert isinstance(loss, torch.Tensor)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step(loss=loss)
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, (time.perf_counter() - start) / w.windows


def _summary(opt: ClippedOptimizer, losses: list[float], seconds: float) -> dict[str, Any]:
    """The figures of a finished run (everything but the held-out loss)."""
    assert opt.rewind is not None
    return {
        "skipped": opt.num_skipped,
        "spike_skips": [s.step for s in opt.stats if s.reason == "spike"],
        "rewind_steps": [s.step for s in opt.stats if s.reason == "rewind"],
        "rewinds": opt.rewind.rewinds,
        "undone": sum(e.undone for e in opt.rewind.log),
        "log": [e.to_dict() for e in opt.rewind.log],
        "losses": losses,
        "seconds_per_window": seconds,
    }


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every DTensor gathered into a full tensor (a collective: every rank)."""
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def halves(batch: int, world: int) -> list[slice]:
    """The rows of every batch that each of ``world`` ranks takes."""
    rows = batch // world
    return [slice(r * rows, (r + 1) * rows) for r in range(world)]


def single(
    config: str,
    seed: int,
    w: Workload,
    data: tuple[torch.Tensor, torch.Tensor, int],
    parts: list[slice],
) -> dict[str, Any]:
    """A one-process run: with ``parts=[slice(None)]`` as ``spikes.train`` runs it; with :func:`halves`,
    the loss the mean of the halves' losses (the FSDP2 run's arithmetic, in another order)."""
    _, held, vocab = data
    torch.manual_seed(seed)
    model = TinyGPT(vocab, w)
    opt = spikes.make_optimizer(config, model, w)
    losses, seconds = _loop(model, opt, w, data, seed, parts)
    out = _summary(opt, [float(v) for v in losses], seconds)
    out["heldout"] = spikes.heldout_loss(model, held, vocab, w)
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def _fsdp_rank(rank: int, port: int, world: int, config: str, seed: int, w: Workload, out: str) -> None:
    """One rank of the FSDP2 run; rank 0 saves the figures, the full parameters and the held-out loss."""
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
    )
    warnings.filterwarnings(
        "ignore", message="FSDP2-wrapped module"
    )  # the head's output, not changed in place
    data = spikes.text()
    _, held, vocab = data
    torch.manual_seed(seed)
    model = TinyGPT(vocab, w)  # the same initialisation on every rank; fully_shard keeps each rank's shard
    for layer in model.body.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = spikes.make_optimizer(config, model, w)
    losses, seconds = _loop(model, opt, w, data, seed, [halves(w.batch, world)[rank]])
    mean = torch.stack(losses)
    dist.all_reduce(mean)  # the mean of equal halves' means: the whole batch's loss
    result = _summary(opt, (mean / world).tolist(), seconds)
    state = _full_state(model)
    if rank == 0:
        plain = TinyGPT(vocab, w)
        plain.load_state_dict(state)
        result["heldout"] = spikes.heldout_loss(plain, held, vocab, w)
        result["state"] = state
    seconds_all: list[Any] = [None] * world
    dist.all_gather_object(seconds_all, seconds)
    result["seconds_per_window"] = max(seconds_all)
    same = [None] * world
    dist.all_gather_object(same, (result["spike_skips"], result["rewind_steps"]))
    result["ranks_agree"] = all(s == same[0] for s in same)
    if rank == 0:
        torch.save(result, os.path.join(out, "fsdp.pt"))
    # gloo's teardown at interpreter exit races on CPU (tests/distributed_jobs.py, leave_process_group)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def fsdp(config: str, seed: int, w: Workload, world: int, timeout_s: float) -> dict[str, Any]:
    """The FSDP2 run in ``world`` spawned processes; killed (RuntimeError) if not done after ``timeout_s``."""
    if w.batch % world:
        raise ValueError(f"the batch ({w.batch}) must split evenly over --world {world}")
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.spawn(_fsdp_rank, args=(_free_port(), world, config, seed, w, out), nprocs=world, join=False)
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    if proc.is_alive():
                        proc.kill()
                raise RuntimeError(
                    f"the FSDP2 run ({config}, seed {seed}) did not finish within {timeout_s:g} s"
                )
        result: dict[str, Any] = torch.load(os.path.join(out, "fsdp.pt"), weights_only=False)
        return result


# ----------------------------------------------------------------------------- comparison

RUNS = ("single", "halves", "fsdp2")
LABELS = {"single": "one process", "halves": "one process, two halves", "fsdp2": "FSDP2"}


def versus(one: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """How ``other`` differs from ``one``: held-out loss, skip/rewind windows, training loss, parameters."""
    differ = set(one["spike_skips"]) ^ set(other["spike_skips"])
    differ |= set(one["rewind_steps"]) ^ set(other["rewind_steps"])
    first = min(differ) if differ else None  # 1-based window of the first decision that differs
    upto = len(one["losses"]) if first is None else first - 1
    pairs = zip(one["losses"][:upto], other["losses"][:upto], strict=True)
    return {
        "heldout_diff": other["heldout"] - one["heldout"],
        "same_decisions": not differ,
        "first_different_decision": first,
        "max_train_loss_diff_before": max((abs(a - b) for a, b in pairs), default=0.0),
        "max_param_diff": max(float((one["state"][k] - other["state"][k]).abs().max()) for k in one["state"]),
    }


def compare(config: str, seed: int, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The row of one configuration and seed: each run's figures, and each run against the one-process run."""
    keep = ("heldout", "skipped", "rewinds", "undone", "spike_skips", "rewind_steps", "log")
    row: dict[str, Any] = {"config": config, "seed": seed}
    for name, run in runs.items():
        row[name] = {k: run[k] for k in keep}
        row[name]["ms_per_window"] = 1e3 * run["seconds_per_window"]
        row[name]["losses"] = [round(v, 4) for v in run["losses"][::10]]
    row["fsdp2"]["ranks_agree"] = runs["fsdp2"]["ranks_agree"]
    row["halves_vs_single"] = versus(runs["single"], runs["halves"])
    row["fsdp2_vs_single"] = versus(runs["single"], runs["fsdp2"])
    row["fsdp2_vs_halves"] = versus(runs["halves"], runs["fsdp2"])
    return row


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration, over the seeds: median held-out loss of each run, the median and largest
    absolute difference of each pair, the spread of the one-process run over the seeds."""
    out = []
    for config in dict.fromkeys(r["config"] for r in rows):
        rs = [r for r in rows if r["config"] == config]
        one = [r["single"]["heldout"] for r in rs]
        entry: dict[str, Any] = {
            "config": config,
            "seeds": len(rs),
            "seed_spread_single": max(one) - min(one),
        }
        for name in RUNS:
            entry[f"heldout_median_{name}"] = statistics.median(r[name]["heldout"] for r in rs)
        for pair in ("fsdp2_vs_single", "halves_vs_single", "fsdp2_vs_halves"):
            diffs = [abs(r[pair]["heldout_diff"]) for r in rs]
            entry[f"{pair}_abs_median"], entry[f"{pair}_abs_max"] = statistics.median(diffs), max(diffs)
            entry[f"{pair}_same_decisions"] = sum(r[pair]["same_decisions"] for r in rs)
        out.append(entry)
    return out


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    world, rows_each = meta["world"], meta["workload"]["batch"] // meta["world"]
    lines = [
        f"Workload (as spikes.py): {meta['workload']}",
        f"FSDP2: {world} gloo processes, {rows_each} rows of every batch each, one thread each; torch "
        f'{meta["torch"]}. "one process, two halves": one process, the loss the mean of the losses of the '
        "same two halves (the FSDP2 run's arithmetic in another order: the size of rounding alone).",
        "",
        "| configuration | seeds | held-out (median): one process / two halves / FSDP2 "
        "| abs. difference FSDP2 - one (median, max) | abs. difference halves - one (median, max) "
        "| abs. difference FSDP2 - halves (median, max) | one process's spread over the seeds |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in summary(rows):
        medians = " / ".join(f"{e[f'heldout_median_{n}']:.3f}" for n in RUNS)
        pairs = " | ".join(
            f"{e[f'{p}_abs_median']:.3f}, {e[f'{p}_abs_max']:.3f}"
            for p in ("fsdp2_vs_single", "halves_vs_single", "fsdp2_vs_halves")
        )
        lines.append(
            f"| {e['config']} | {e['seeds']} | {medians} | {pairs} | {e['seed_spread_single']:.3f} |"
        )
    lines += [
        "",
        "| configuration | seed | run | held-out loss | spike skips | rewinds (at windows) | updates undone "
        "| ms / window |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for name in RUNS:
            run = r[name]
            at = ", ".join(str(s) for s in run["rewind_steps"])
            lines.append(
                f"| {r['config']} | {r['seed']} | {LABELS[name]} | {run['heldout']:.4f} "
                f"| {len(run['spike_skips'])} "
                f"| {run['rewinds']} ({at}) | {run['undone']} | {run['ms_per_window']:.1f} |"
            )
    lines += [
        "",
        "| configuration | seed | pair | held-out difference | same skip and rewind windows "
        "| first different decision | max training-loss difference before it "
        "| max parameter difference at the end |",
        "|---|---|---|---|---|---|---|---|",
    ]
    pairs = (
        ("fsdp2_vs_single", "FSDP2 - one"),
        ("halves_vs_single", "halves - one"),
        ("fsdp2_vs_halves", "FSDP2 - halves"),
    )
    for r in rows:
        for key, label in pairs:
            v = r[key]
            first = (
                "none" if v["first_different_decision"] is None else f"window {v['first_different_decision']}"
            )
            lines.append(
                f"| {r['config']} | {r['seed']} | {label} | {v['heldout_diff']:+.4f} "
                f"| {'yes' if v['same_decisions'] else 'no'} | {first} "
                f"| {v['max_train_loss_diff_before']:.1e} "
                f"| {v['max_param_diff']:.1e} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument(
        "--configs", default=",".join(CONFIGS), help="comma-separated, from spikes.py's CONFIGS with Rewind"
    )
    ap.add_argument(
        "--windows", type=int, default=None, help="shorter runs, as spikes.py --windows (both runs alike)"
    )
    ap.add_argument("--lr", type=float, default=None, help="another learning rate (all runs alike)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900, help="seconds before an FSDP2 run is killed")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument(
        "--render", action="store_true", help="only rewrite the tables from --out's spikes_fsdp.json"
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.render:
        saved = json.loads((out / "spikes_fsdp.json").read_text())
        return write(out, saved["rows"], saved["meta"])
    torch.set_num_threads(1)
    w = Workload()
    if args.windows:  # the shortened workload of spikes.py --windows
        w = Workload(windows=args.windows, bad_shard=(90, 110), poisoned=(80, 130))
    if args.lr:
        w = Workload(**{**asdict(w), "lr": args.lr})
    data = spikes.text()
    rows = []
    for seed in range(args.seeds):
        for config in args.configs.split(","):
            runs = {
                "single": single(config, seed, w, data, [slice(None)]),
                "halves": single(config, seed, w, data, halves(w.batch, args.world)),
                "fsdp2": fsdp(config, seed, w, args.world, args.timeout),
            }
            rows.append(compare(config, seed, runs))
            for name, run in runs.items():
                print(
                    f"seed {seed} {config} {name}: held-out {run['heldout']:.4f}, skips {run['skipped']}, "
                    f"rewinds {run['rewinds']} at {run['rewind_steps']}, "
                    f"{1e3 * run['seconds_per_window']:.1f} ms/window",
                    file=sys.stderr,
                )
    meta = {"workload": asdict(w), "world": args.world, "seeds": args.seeds, "torch": torch.__version__}
    return write(out, rows, meta)


def write(out: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> int:
    """``spikes_fsdp.md`` and ``spikes_fsdp.json`` into ``out``; 1 if a held-out loss is not finite."""
    out.mkdir(parents=True, exist_ok=True)
    table = render(rows, meta)
    (out / "spikes_fsdp.md").write_text(table)
    data = {"meta": meta, "summary": summary(rows), "rows": rows}
    (out / "spikes_fsdp.json").write_text(json.dumps(data, indent=1))
    print(table)
    return 0 if all(math.isfinite(r["fsdp2_vs_single"]["heldout_diff"]) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
