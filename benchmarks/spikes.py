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
from collections.abc import Callable, Iterator
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
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """The batch stream of one seed, corrupted at the workload's known batches, as (index, x, y)."""
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
        yield index, x, y
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


@dataclass(frozen=True)
class Bounds:
    """UpdateClip's fixed bounds, read off a healthy run (:func:`calibrate`)."""

    max_rms: float = math.nan  #: the largest per-tensor update RMS of a window, its 95th percentile
    max_norm: float = math.nan  #: the update norm of a window (all parameters), its 95th percentile


#: A configuration: (what it is, the ``ClippedOptimizer`` keywords besides the inner optimizer).
Factory = Callable[[torch.nn.Module, Bounds], dict[str, Any]]


def _guard() -> Any:
    return clipopt.SpikeGuard(z_thresh=6.0, window=128)


def _rewind(model: torch.nn.Module, **escalation: Any) -> Any:
    return clipopt.Rewind(every=50, keep=2, spikes=3, within=25, skip_batches=40, module=model, **escalation)


CONFIGS: dict[str, tuple[str, Factory]] = {
    "clip": ("max_norm=1.0", lambda m, b: {"max_norm": 1.0}),
    "zclip": ("max_norm=ZClip(max_grad_norm=1.0)", lambda m, b: {"max_norm": ZClip(max_grad_norm=1.0)}),
    "adagc": ("max_norm=AdaGC()", lambda m, b: {"max_norm": clipopt.AdaGC()}),
    "stablespam": ("max_norm=StableSPAM()", lambda m, b: {"max_norm": clipopt.StableSPAM()}),
    "update-rms": (
        "max_norm=1.0, update_clip=UpdateClip(max_rms=<p95>)",
        lambda m, b: {"max_norm": 1.0, "update_clip": clipopt.UpdateClip(max_rms=b.max_rms)},
    ),
    "update-norm": (
        "max_norm=1.0, update_clip=UpdateClip(max_norm=<p95>)",
        lambda m, b: {"max_norm": 1.0, "update_clip": clipopt.UpdateClip(max_norm=b.max_norm)},
    ),
    "update-z": (
        "max_norm=1.0, update_clip=UpdateClip(z=3.0, window=128)",
        lambda m, b: {"max_norm": 1.0, "update_clip": clipopt.UpdateClip(z=3.0, window=128)},
    ),
    "spikeguard": (
        "max_norm=1.0, spike_guard=SpikeGuard(z_thresh=6.0, window=128)",
        lambda m, b: {"max_norm": 1.0, "spike_guard": _guard()},
    ),
    "spikeguard+rewind": (
        "as spikeguard + rewind=Rewind(every=50, keep=2, spikes=3, within=25, skip_batches=40)",
        lambda m, b: {"max_norm": 1.0, "spike_guard": _guard(), "rewind": _rewind(m)},
    ),
    "spikeguard+rewind+lr_cut": (
        "as spikeguard+rewind, Rewind(..., lr_cut=(0.5, 50)): half the lr for 50 updates after a rewind",
        lambda m, b: {"max_norm": 1.0, "spike_guard": _guard(), "rewind": _rewind(m, lr_cut=(0.5, 50))},
    ),
    "spikeguard+rewind+reset_state": (
        "as spikeguard+rewind, Rewind(..., reset_state=True): AdamW's moments zeroed at a rewind",
        lambda m, b: {"max_norm": 1.0, "spike_guard": _guard(), "rewind": _rewind(m, reset_state=True)},
    ),
    "adagc+update-z": (
        "max_norm=AdaGC(), update_clip=UpdateClip(z=3.0, window=128)",
        lambda m, b: {"max_norm": clipopt.AdaGC(), "update_clip": clipopt.UpdateClip(z=3.0, window=128)},
    ),
    "adagc+spikeguard": (
        "max_norm=AdaGC(), spike_guard=SpikeGuard(z_thresh=6.0, window=128)",
        lambda m, b: {"max_norm": clipopt.AdaGC(), "spike_guard": _guard()},
    ),
    "update-z+spikeguard": (
        "max_norm=1.0, update_clip=UpdateClip(z=3.0, window=128), spike_guard=SpikeGuard(...)",
        lambda m, b: {
            "max_norm": 1.0,
            "update_clip": clipopt.UpdateClip(z=3.0, window=128),
            "spike_guard": _guard(),
        },
    ),
}


def make_optimizer(name: str, model: torch.nn.Module, w: Workload, bounds: Bounds) -> ClippedOptimizer:
    inner = torch.optim.AdamW(model.parameters(), lr=w.lr, weight_decay=0.01)
    return ClippedOptimizer(inner, **CONFIGS[name][1](model, bounds))


def calibrate(w: Workload, data: tuple[torch.Tensor, torch.Tensor, int]) -> Bounds:
    """UpdateClip's bounds from a healthy run: seed 0, clean data, ``max_norm=1.0``, nothing else.

    Per window, the update ``p_after - p_before`` of every tensor: its RMS (the largest over the
    tensors) and the norm over all tensors.  The bound is the 95th percentile over the windows after
    the first 20 (Adam's first updates are its largest): a healthy run exceeds it one window in 20.
    """
    train_ids, _, vocab = data
    clean = Workload(**{**asdict(w), "bad_shard": (0, 0), "poisoned": ()})
    torch.manual_seed(0)
    model = TinyGPT(vocab, clean)
    params = list(model.parameters())
    opt = make_optimizer("clip", model, clean, Bounds())
    batches = stream(train_ids, vocab, clean, seed=0)
    rms, norms = [], []
    for _ in range(clean.windows):
        _, x, y = next(batches)
        torch.nn.functional.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1)).backward()  # type: ignore[no-untyped-call]
        before = [p.detach().clone() for p in params]
        opt.step()
        opt.zero_grad()
        updates = [p.detach() - b for p, b in zip(params, before, strict=True)]
        rms.append(max(float(u.pow(2).mean().sqrt()) for u in updates))
        norms.append(float(torch.stack([u.norm() for u in updates]).norm()))

    def p95(values: list[float]) -> float:
        return statistics.quantiles(values[20:], n=20)[-1]

    return Bounds(max_rms=p95(rms), max_norm=p95(norms))


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
    batch_index: list[int] = field(default_factory=list)  #: the stream's batch trained on, per window
    loss_spikes: int = 0  #: spikes of the training loss on real text (see :func:`loss_spikes`)
    recovered: int = 0  #: of those, how many came back within RECOVERY windows
    shard_recovery: int = 0  #: real-text windows after the bad shard until the loss is back

    @property
    def lost(self) -> int:
        return self.skipped + self.undone


SPIKE = 0.25  #: nats above the median of the previous 20 real-text windows: a loss spike
RECOVERY = 50  #: real-text windows within which a spike must come back to count as recovered


def _clean_losses(run: Run, w: Workload) -> list[tuple[int, float]]:
    """(batch index, training loss) of the windows that trained on real text."""
    bad = set(range(*w.bad_shard)) | set(w.poisoned)
    return [(i, v) for i, v in zip(run.batch_index, run.losses, strict=True) if i not in bad]


def loss_spikes(run: Run, w: Workload) -> tuple[int, int]:
    """Spikes of the training loss on real text, and how many of them recovered.

    A spike starts at a real-text window whose loss is more than ``SPIKE`` nats above the median of
    the 20 real-text windows before it, and lasts while the loss stays above that median + ``SPIKE``
    (the damage a corrupted batch, or the run itself, did); it recovered when the loss came back
    within ``RECOVERY`` real-text windows.  A non-finite loss counts as above the level.
    """
    values = [v for _, v in _clean_losses(run, w)]
    spikes = recovered = 0
    i = 20
    while i < len(values):
        ref = statistics.median(values[i - 20 : i])
        if not values[i] <= ref + SPIKE:
            spikes += 1
            j = i
            while j < len(values) and not values[j] <= ref + SPIKE:
                j += 1
            recovered += j < len(values) and j - i <= RECOVERY
            i = j
        i += 1
    return spikes, recovered


def shard_recovery(run: Run, w: Workload) -> int:
    """Real-text windows after the bad shard until the training loss is at most its level before it.

    The level is the median loss of the 10 real-text windows before the shard plus 0.1 nats; a run
    that never gets back counts every window left.
    """
    clean = _clean_losses(run, w)
    before = [v for i, v in clean if i < w.bad_shard[0]][-10:]
    after = [v for i, v in clean if i >= w.bad_shard[1]]
    if not before:
        return 0
    level = statistics.median(before) + 0.1
    return next((k for k, v in enumerate(after) if v <= level), len(after))


def train(
    config: str,
    seed: int,
    w: Workload,
    data: tuple[torch.Tensor, torch.Tensor, int],
    base: float,
    bounds: Bounds,
) -> Run:
    train_ids, held, vocab = data
    torch.manual_seed(seed)
    model = TinyGPT(vocab, w)
    opt = make_optimizer(config, model, w, bounds)
    run = Run(config, seed)
    batches: Any = stream(train_ids, vocab, w, seed)
    rewind = getattr(opt, "rewind", None)
    if rewind is not None:
        batches = rewind.batches(batches)
    losses = []
    start = time.perf_counter()
    for _ in range(w.windows):
        index, x, y = next(batches)
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step(loss=loss)
        opt.zero_grad()
        losses.append(loss.detach())
        run.batch_index.append(index)
    run.seconds_per_window = (time.perf_counter() - start) / w.windows
    run.losses = [float(v) for v in losses]
    run.heldout = heldout_loss(model, held, vocab, w)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    run.diverged = not finite or not math.isfinite(run.heldout) or run.heldout > base
    run.skipped = opt.num_skipped
    run.loss_spikes, run.recovered = loss_spikes(run, w)
    run.shard_recovery = shard_recovery(run, w)
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
            kwargs["spike_guard"] = clipopt.SpikeGuard(window=128)  # the recorded runs' window
        if name == "spikeguard+rewind":
            kwargs["rewind"] = clipopt.Rewind(module=model)
        runs.append((name, model, ClippedOptimizer(inner, max_norm=1.0, **kwargs), []))
    batches = stream(train_ids, vocab, clean, seed=0)
    for _ in range(windows):
        _, x, y = next(batches)
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
    guard = clipopt.SpikeGuard(window=128)
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
    from clipopt._recovery.host_copy import TrainingState, capture

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
    out["batch_index"] = run.batch_index[::10]
    return out


def summarise(runs: list[Run], configs: list[str]) -> list[dict[str, Any]]:
    rows = []
    base = {r.seed: r.seconds_per_window for r in runs if r.config == "clip"}
    for c in configs:
        rs = [r for r in runs if r.config == c]
        ratios = [r.seconds_per_window / base[r.seed] for r in rs if r.seed in base]
        held = [r.heldout for r in rs]
        rows.append(
            {
                "config": c,
                "setting": CONFIGS[c][0],
                "heldout_mean": statistics.fmean(held),
                "heldout_sd": statistics.stdev(held) if len(held) > 1 else 0.0,
                "heldout_median": statistics.median(held),
                "heldout_per_seed": [round(v, 4) for v in held],
                "diverged": sum(r.diverged for r in rs),
                "runs": len(rs),
                "loss_spikes": sum(r.loss_spikes for r in rs),
                "recovered": sum(r.recovered for r in rs),
                "shard_recovery_median": statistics.median(r.shard_recovery for r in rs),
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


def render_runs(rows: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    """The side-by-side table of the training runs, with the settings and the bounds under it."""
    lines = [
        f"Workload: {meta['workload']}",
        f"Seeds {meta['seeds']}; unigram baseline {meta['baseline']:.3f} nats/char; torch {meta['torch']}, "
        f"{meta['threads']} thread(s).",
        "",
        "| configuration | held-out loss (mean ± sd) | median | per seed | diverged "
        "| loss spikes (recovered) | windows to recover after the shard (median) "
        "| updates lost (skipped + undone) | rewinds "
        "| ms / window | time vs clip |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per_seed = ", ".join(f"{v:.3f}" for v in r["heldout_per_seed"])
        lines.append(
            f"| {r['config']} | {r['heldout_mean']:.3f} ± {r['heldout_sd']:.3f} | {r['heldout_median']:.3f} "
            f"| {per_seed} | {r['diverged']}/{r['runs']} | {r['loss_spikes']} ({r['recovered']}) "
            f"| {r['shard_recovery_median']:g} | {r['lost']} ({r['skipped']} + {r['undone']}) "
            f"| {r['rewinds']} "
            f"| {r['ms_per_window']:.1f} | {r['time_ratio']:.3f} |"
        )
    b = meta["bounds"]
    lines += ["", "Settings (AdamW lr 1e-2, weight decay 0.01, every row):", ""]
    lines += [f"- `{r['config']}`: `{r['setting']}`" for r in rows]
    lines += [
        "",
        "UpdateClip's fixed bounds, the 95th percentile of a healthy run's windows "
        f"21-{meta['workload']['windows']} "
        f"(seed 0, clean data, max_norm=1.0): max_rms={b['max_rms']:.3g} (largest per-tensor update RMS), "
        f"max_norm={b['max_norm']:.3g} (update norm).",
        f"Loss spikes: real-text windows {SPIKE} nats above the median of the 20 before, summed over seeds; "
        f"recovered: back within {RECOVERY} windows. Windows to recover: real-text windows after the "
        "bad shard until the loss is back to the median of the 10 before it + 0.1.",
    ]
    return lines


def plot(runs: list[Run], rows: list[dict[str, Any]], w: Workload, path: Path) -> None:
    """Held-out loss per configuration (one dot per seed) and seed 0's training loss on real text."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1, 1.4]})
    names = [r["config"] for r in rows]
    for k, r in enumerate(rows):
        left.scatter(r["heldout_per_seed"], [k] * len(r["heldout_per_seed"]), color="tab:blue", s=18)
        left.errorbar(r["heldout_mean"], k, xerr=r["heldout_sd"], fmt="|", color="black", ms=14)
    left.set_yticks(range(len(names)), names)
    left.invert_yaxis()
    left.set_xlabel("held-out loss (nats/char), dots: seeds, bar: mean ± sd")
    left.grid(axis="x", alpha=0.3)
    shown = [n for n in names if "+" not in n or n == "spikeguard+rewind"]
    for name in shown:
        run = next(r for r in runs if r.config == name and r.seed == 0)
        clean = _clean_losses(run, w)
        xs, ys = [i for i, _ in clean], [v for _, v in clean]
        smooth = [statistics.fmean(ys[max(0, k - 4) : k + 1]) for k in range(len(ys))]
        gaps = [k for k in range(1, len(xs)) if xs[k] != xs[k - 1] + 1]  # the line breaks over them
        for k in reversed(gaps):
            xs.insert(k, xs[k - 1] + 1)
            smooth.insert(k, math.nan)
        right.plot(xs, smooth, label=name, lw=1.2)
    right.axvspan(*w.bad_shard, color="red", alpha=0.12, label="bad shard")
    for b in w.poisoned:
        right.axvline(b, color="red", alpha=0.3, lw=0.8)
    right.set_ylim(1.3, 3.2)
    right.set_xlabel("batch of the stream (seed 0; corrupted batches left out, mean of 5)")
    right.set_ylabel("training loss on real text")
    right.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def render(
    rows: list[dict[str, Any]], costs: dict[str, dict[str, float]], meta: dict[str, Any], over: dict[str, Any]
) -> str:
    lines = render_runs(rows, meta)
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
    ap.add_argument("--plot", default=str(ROOT / "docs" / "spikes.png"), help="the figure ('' for none)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    w = Workload()
    seeds = 1 if args.quick else args.seeds
    if args.quick or args.windows:
        w = Workload(windows=args.windows or 150, bad_shard=(90, 110), poisoned=(80, 130))
    configs = args.configs.split(",") if args.configs else list(CONFIGS)
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    data = text()
    base = unigram_baseline(data[0], data[1], data[2])
    bounds = calibrate(w, data)
    print(f"UpdateClip bounds from a healthy run: {bounds}", file=sys.stderr)
    runs: list[Run] = []
    for seed in range(seeds):  # interleaved: every configuration once per seed
        for c in configs:
            run = train(c, seed, w, data, base, bounds)
            runs.append(run)
            print(
                f"seed {seed} {c:20s} held-out {run.heldout:.3f} spikes {run.loss_spikes} ({run.recovered}) "
                f"shard recovery {run.shard_recovery} skipped {run.skipped} undone {run.undone} "
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
        "bounds": asdict(bounds),
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
    if args.plot:
        plot(runs, rows, w, Path(args.plot))
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
