"""Spike recovery, side by side: plain clipping, ZClip, SpikeGuard, SpikeGuard + Rewind (also with
``lr_cut`` and with ``reset_state``).

The workload is a small causal transformer language model (2 layers, d=64,
characters of the ``argparse`` source that ships with Python) trained with
AdamW at a high learning rate without warm-up, so that it spikes by itself,
plus corrupted stretches of data at known batches: a *bad shard* (a run of
batches of random characters — the "same batches spike again" case of
large-model practice) and single *poisoned* batches (one sequence repeated
with scrambled targets).  Every configuration sees the same batch stream from
the same initialisation, per seed; seeds and configurations run interleaved.

Reported per configuration (medians or totals over the seeds): held-out loss
at the end, runs that diverged (non-finite, or held-out loss above the unigram
baseline), updates lost (skipped windows + updates undone by rewinds), time per
window and its ratio to plain clipping, and the host memory of Rewind's copies.
A second part times Rewind's copy itself against an update, on this model and
on the 101M-parameter "large" parameter set of ``benchmarks/bench.py``.

    python benchmarks/spikes.py             # 3 seeds x 6 configurations, ~7 min on 2 shared cores
    python benchmarks/spikes.py --quick     # 1 seed, 150 windows
    python benchmarks/spikes.py --no-large  # skip the copy timing on the 101M model (needs ~3 GB)

Writes ``spikes.md`` and ``spikes.json`` into ``--out`` (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import clipopt  # noqa: E402
from clipopt import ClippedOptimizer, ZClip  # noqa: E402

# ----------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Workload:
    windows: int = 400  #: optimizer windows (step() calls) per run
    batch: int = 16
    seq_len: int = 64
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    lr: float = 1e-2
    bad_shard: tuple[int, int] = (150, 190)  #: batches [start, stop) of random characters
    poisoned: tuple[int, ...] = (90, 260, 330)  #: single batches with scrambled targets


class TinyGPT(torch.nn.Module):
    """Token + position embeddings, pre-norm causal transformer layers, a linear head."""

    def __init__(self, vocab: int, w: Workload) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, w.d_model)
        self.pos = torch.nn.Parameter(torch.zeros(w.seq_len, w.d_model))
        layer = torch.nn.TransformerEncoderLayer(
            w.d_model, w.heads, 4 * w.d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.body = torch.nn.TransformerEncoder(layer, w.layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(w.d_model)
        self.head = torch.nn.Linear(w.d_model, vocab)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(w.seq_len))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos[: x.shape[1]]
        h = self.body(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
        out: torch.Tensor = self.head(self.norm(h))
        return out


def text() -> tuple[torch.Tensor, torch.Tensor, int]:
    """Train and held-out character ids of argparse's source, and the vocabulary size."""
    source = inspect.getsource(argparse)
    chars = sorted(set(source))
    ids = torch.tensor([chars.index(c) for c in source], dtype=torch.long)
    cut = int(0.9 * len(ids))
    return ids[:cut], ids[cut:], len(chars)


def stream(
    data: torch.Tensor, vocab: int, w: Workload, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The batch stream of one seed, corrupted at the workload's known batches."""
    gen = torch.Generator().manual_seed(1000 + seed)
    index = 0
    while True:
        starts = torch.randint(0, len(data) - w.seq_len - 1, (w.batch,), generator=gen)
        window = data[starts[:, None] + torch.arange(w.seq_len + 1)]
        x, y = window[:, :-1], window[:, 1:]
        if w.bad_shard[0] <= index < w.bad_shard[1]:
            noise = torch.randint(0, vocab, (w.batch, w.seq_len + 1), generator=gen)
            x, y = noise[:, :-1], noise[:, 1:]
        elif index in w.poisoned:
            x = x[:1].expand(w.batch, -1).clone()
            y = torch.randint(0, vocab, y.shape, generator=gen)
        yield x, y
        index += 1


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, data: torch.Tensor, vocab: int, w: Workload) -> float:
    n = (len(data) - 1) // w.seq_len
    x = data[: n * w.seq_len].view(n, w.seq_len)
    y = data[1 : n * w.seq_len + 1].view(n, w.seq_len)
    losses = [
        torch.nn.functional.cross_entropy(model(x[i : i + 64]).reshape(-1, vocab), y[i : i + 64].reshape(-1))
        for i in range(0, n, 64)
    ]
    return float(torch.stack(losses).mean())


def unigram_baseline(train: torch.Tensor, heldout: torch.Tensor, vocab: int) -> float:
    """Held-out cross-entropy of predicting the training character frequencies."""
    freq = torch.bincount(train, minlength=vocab).double() + 1
    logp = (freq / freq.sum()).log()
    return float(-logp[heldout].mean())


# ----------------------------------------------------------------------------- configurations


def has_spike_recovery() -> bool:
    return "spike_guard" in inspect.signature(ClippedOptimizer.__init__).parameters


def make_optimizer(name: str, model: torch.nn.Module, w: Workload) -> ClippedOptimizer:
    inner = torch.optim.AdamW(model.parameters(), lr=w.lr, weight_decay=0.01)
    if name == "clip":
        return ClippedOptimizer(inner, max_norm=1.0)
    if name == "zclip":
        return ClippedOptimizer(inner, max_norm=ZClip(max_grad_norm=1.0))
    guard = clipopt.SpikeGuard(z_thresh=6.0, window=128)
    if name == "spikeguard":
        return ClippedOptimizer(inner, max_norm=1.0, spike_guard=guard)
    escalation: dict[str, Any] = {}
    if name == "spikeguard+rewind+lr_cut":
        escalation = {"lr_cut": (0.5, 50)}  # half the learning rate for 50 updates after a rewind
    elif name == "spikeguard+rewind+reset_state":
        escalation = {"reset_state": True}  # AdamW's moments zeroed at a rewind
    rewind = clipopt.Rewind(
        every=50, keep=2, spikes=3, within=25, skip_batches=40, module=model, **escalation
    )
    return ClippedOptimizer(inner, max_norm=1.0, spike_guard=guard, rewind=rewind)


CONFIGS = (
    "clip",
    "zclip",
    "spikeguard",
    "spikeguard+rewind",
    "spikeguard+rewind+lr_cut",
    "spikeguard+rewind+reset_state",
)


@dataclass
class Run:
    config: str
    seed: int
    heldout: float = math.nan
    diverged: bool = False
    skipped: int = 0
    undone: int = 0
    rewinds: int = 0
    seconds_per_window: float = math.nan
    copy_bytes: int = 0
    losses: list[float] = field(default_factory=list)

    @property
    def lost(self) -> int:
        return self.skipped + self.undone


def train(
    config: str, seed: int, w: Workload, data: tuple[torch.Tensor, torch.Tensor, int], base: float
) -> Run:
    train_ids, held, vocab = data
    torch.manual_seed(seed)
    model = TinyGPT(vocab, w)
    opt = make_optimizer(config, model, w)
    run = Run(config, seed)
    batches: Any = stream(train_ids, vocab, w, seed)
    rewind = getattr(opt, "rewind", None)
    if rewind is not None:
        batches = rewind.batches(batches)
    losses = []
    start = time.perf_counter()
    for _ in range(w.windows):
        x, y = next(batches)
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step(loss=loss)
        opt.zero_grad()
        losses.append(loss.detach())
    run.seconds_per_window = (time.perf_counter() - start) / w.windows
    run.losses = [float(v) for v in losses]
    run.heldout = heldout_loss(model, held, vocab, w)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    run.diverged = not finite or not math.isfinite(run.heldout) or run.heldout > base
    run.skipped = opt.num_skipped
    if rewind is not None:
        run.rewinds = rewind.rewinds
        run.undone = sum(e.undone for e in rewind.log)
        run.copy_bytes = rewind.nbytes
    return run


# ----------------------------------------------------------------------------- overhead


def overhead(w: Workload, data: tuple[torch.Tensor, torch.Tensor, int], windows: int) -> dict[str, Any]:
    """Median time of a whole training window (forward, backward, step) per configuration, on clean data.

    The configurations train side by side from the same initialisation on the same batches and are
    timed interleaved, one window each in turn (A B C A B C ...); ratios are against plain clipping.
    Rewind here keeps its default schedule: a copy every 100 updates, a check every 10 windows.
    """
    train_ids, _, vocab = data
    clean = Workload(**{**asdict(w), "bad_shard": (0, 0), "poisoned": ()})
    runs: list[tuple[str, torch.nn.Module, ClippedOptimizer, list[float]]] = []
    for name in ("clip", "spikeguard", "spikeguard+rewind"):
        torch.manual_seed(0)
        model = TinyGPT(vocab, clean)
        inner = torch.optim.AdamW(model.parameters(), lr=clean.lr, weight_decay=0.01)
        kwargs: dict[str, Any] = {}
        if name != "clip":
            kwargs["spike_guard"] = clipopt.SpikeGuard()
        if name == "spikeguard+rewind":
            kwargs["rewind"] = clipopt.Rewind(module=model)
        runs.append((name, model, ClippedOptimizer(inner, max_norm=1.0, **kwargs), []))
    batches = stream(train_ids, vocab, clean, seed=0)
    for _ in range(windows):
        x, y = next(batches)
        for _, model, opt, times in runs:
            t0 = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step(loss=loss)
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
    base, base_mean = statistics.median(runs[0][3]), statistics.fmean(runs[0][3])
    out: dict[str, Any] = {"windows": windows}
    for name, _, opt, times in runs:
        rewind = opt.rewind
        out[name] = {
            "ms_per_window": 1e3 * statistics.median(times),
            "ratio": statistics.median(times) / base,
            "mean_ratio": statistics.fmean(times) / base_mean,
            "copies_taken": 0 if rewind is None else rewind.copies_taken,
            "host_copy_mb": 0.0 if rewind is None else rewind.nbytes / 2**20,
        }
    return out


def guard_cost(calls: int = 2000) -> float:
    """Median seconds of one SpikeGuard decide + commit (both signals, window 128), alone."""
    guard = clipopt.SpikeGuard()
    loss, norm = torch.tensor(2.0), torch.tensor(1.0)
    times = []
    for i in range(calls + 200):
        t0 = time.perf_counter()
        guard.commit(guard.decide(loss + 1e-3 * (i % 7), norm))
        times.append(time.perf_counter() - t0)
    return statistics.median(times[200:])


# ----------------------------------------------------------------------------- copy cost


def _params_model(shapes: list[tuple[int, ...]]) -> torch.nn.Module:
    m = torch.nn.Module()
    m.params = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes)
    return m


def copy_cost(model: torch.nn.Module, rounds: int) -> dict[str, float]:
    """Median seconds of an AdamW update (synthetic gradients) and of one Rewind copy, interleaved."""
    from clipopt._host_copy import TrainingState, capture

    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()  # state exists
    target = TrainingState(params, list(model.buffers()), opt)
    held = capture(target, None, 0, 0)
    step_t, copy_t = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        opt.step()
        step_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        held = capture(target, None, 0, 0, reuse=held)
        held.wait()
        copy_t.append(time.perf_counter() - t0)
    return {
        "parameters": sum(p.numel() for p in params),
        "update_s": statistics.median(step_t),
        "copy_s": statistics.median(copy_t),
        "copy_bytes": held.nbytes,
    }


# ----------------------------------------------------------------------------- main


def _run_record(run: Run) -> dict[str, Any]:
    """A run for the JSON file: its figures and every 10th training loss (the curve, kept small)."""
    out = asdict(run)
    out["losses"] = [round(v, 4) for v in run.losses[::10]]
    return out


def summarise(runs: list[Run], configs: list[str]) -> list[dict[str, Any]]:
    rows = []
    base = {r.seed: r.seconds_per_window for r in runs if r.config == "clip"}
    for c in configs:
        rs = [r for r in runs if r.config == c]
        ratios = [r.seconds_per_window / base[r.seed] for r in rs if r.seed in base]
        rows.append(
            {
                "config": c,
                "heldout_median": statistics.median(r.heldout for r in rs),
                "heldout_per_seed": [round(r.heldout, 4) for r in rs],
                "diverged": sum(r.diverged for r in rs),
                "runs": len(rs),
                "skipped": sum(r.skipped for r in rs),
                "undone": sum(r.undone for r in rs),
                "lost": sum(r.lost for r in rs),
                "rewinds": sum(r.rewinds for r in rs),
                "ms_per_window": 1e3 * statistics.median(r.seconds_per_window for r in rs),
                "time_ratio": statistics.median(ratios) if ratios else math.nan,
                "copy_mb": max(r.copy_bytes for r in rs) / 2**20,
            }
        )
    return rows


def render(
    rows: list[dict[str, Any]], costs: dict[str, dict[str, float]], meta: dict[str, Any], over: dict[str, Any]
) -> str:
    lines = [
        f"Workload: {meta['workload']}",
        f"Seeds {meta['seeds']}; unigram baseline {meta['baseline']:.3f} nats/char; torch {meta['torch']}, "
        f"{meta['threads']} thread(s).",
        "",
        "| configuration | held-out loss (median) | per seed | diverged | updates lost (skipped + undone) "
        "| rewinds | ms / window | time vs clip | copies (MB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per_seed = ", ".join(f"{v:.3f}" for v in r["heldout_per_seed"])
        lines.append(
            f"| {r['config']} | {r['heldout_median']:.3f} | {per_seed} "
            f"| {r['diverged']}/{r['runs']} | {r['lost']} ({r['skipped']} + {r['undone']}) | {r['rewinds']} "
            f"| {r['ms_per_window']:.1f} | {r['time_ratio']:.3f} | {r['copy_mb']:.1f} |"
        )
    if over:
        lines += [
            "",
            f"Time per window (forward + backward + step) on clean data, {over['windows']} windows per "
            "configuration, interleaved; Rewind at its defaults (a copy every 100 updates):",
            "",
            "| configuration | ms / window (median) | median vs clip | mean vs clip | copies | host MB |",
            "|---|---|---|---|---|---|",
        ]
        for name in ("clip", "spikeguard", "spikeguard+rewind"):
            o = over[name]
            lines.append(
                f"| {name} | {o['ms_per_window']:.1f} | {o['ratio']:.3f} | {o['mean_ratio']:.3f} "
                f"| {o['copies_taken']} | {o['host_copy_mb']:.1f} |"
            )
        base_ms = over["clip"]["ms_per_window"]
        lines += [
            "",
            f"SpikeGuard's own work per window (decide + commit, measured alone): {over['guard_us']:.0f} us "
            f"= {over['guard_us'] / (10 * base_ms):.2f} % of a clip window here.",
        ]
    if costs:
        lines += [
            "",
            "Rewind's copy (parameters + AdamW state into host memory) against one AdamW update, "
            "medians, interleaved:",
            "",
            "| model | parameters | update (ms) | copy (ms) | copy / (100 updates) | host MB per copy |",
            "|---|---|---|---|---|---|",
        ]
        for name, c in costs.items():
            frac = c["copy_s"] / (100 * c["update_s"])
            update_ms, copy_ms = 1e3 * c["update_s"], 1e3 * c["copy_s"]
            lines.append(
                f"| {name} | {c['parameters'] / 1e6:.2f}M | {update_ms:.1f} | {copy_ms:.1f} "
                f"| {100 * frac:.2f} % | {c['copy_bytes'] / 2**20:.0f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--windows", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="1 seed, 150 windows, no large-model timing")
    ap.add_argument("--no-large", action="store_true", help="skip the copy timing on the 101M model")
    ap.add_argument("--configs", default=None, help="comma-separated subset of " + ",".join(CONFIGS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    w = Workload()
    seeds = 1 if args.quick else args.seeds
    if args.quick or args.windows:
        w = Workload(windows=args.windows or 150, bad_shard=(90, 110), poisoned=(80, 130))
    configs = (
        args.configs.split(",")
        if args.configs
        else [c for c in CONFIGS if has_spike_recovery() or c in CONFIGS[:2]]
    )
    data = text()
    base = unigram_baseline(data[0], data[1], data[2])
    runs: list[Run] = []
    for seed in range(seeds):  # interleaved: every configuration once per seed
        for c in configs:
            run = train(c, seed, w, data, base)
            runs.append(run)
            print(
                f"seed {seed} {c:18s} held-out {run.heldout:.3f} skipped {run.skipped} undone {run.undone} "
                f"rewinds {run.rewinds} {1e3 * run.seconds_per_window:.1f} ms/window",
                file=sys.stderr,
            )
    rows = summarise(runs, configs)
    over = overhead(w, data, windows=60 if args.quick else 300) if has_spike_recovery() else {}
    if over:
        over["guard_us"] = 1e6 * guard_cost()
    costs = {}
    torch.manual_seed(0)
    costs["tiny transformer (this workload)"] = copy_cost(TinyGPT(data[2], w), rounds=20)
    if not (args.quick or args.no_large):
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from bench import transformer_shapes

        costs["large (bench.py, 8 x d=1024)"] = copy_cost(
            _params_model(transformer_shapes(1024, 8)), rounds=5
        )
    meta = {
        "workload": asdict(w),
        "seeds": seeds,
        "baseline": base,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = render(rows, costs, meta, over)
    (out / "spikes.md").write_text(table)
    (out / "spikes.json").write_text(
        json.dumps(
            {
                "meta": meta,
                "rows": rows,
                "overhead": over,
                "copy_cost": costs,
                "runs": [_run_record(r) for r in runs],
            },
            indent=1,
        )
    )
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
