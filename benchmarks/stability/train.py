"""One run of the benchmark (a *cell*: treatment x learning rate x seed, or a data-fault run), and
the calibration of UpdateClip's bounds."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from clipopt import ClippedOptimizer

from .data import Corpus, batches, heldout_windows
from .metrics import diverged
from .model import GPT, ModelConfig, lm_loss
from .treatments import BY_NAME, Bounds, RunShape, Treatment, inner_optimizers


@dataclass(frozen=True)
class Settings:
    """Everything that defines the numbers of a results file (a cached cell is reused only under the
    same settings)."""

    updates: int = 200  #: optimizer steps (windows) per run
    warmup: int = 20  #: linear warm-up, then cosine decay to 0
    batch: int = 32
    seq_len: int = 128
    width: int = 128
    heads: int = 4
    layers: int = 2
    lrs: tuple[float, ...] = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1)
    seeds: tuple[int, ...] = (0, 1, 2)
    treatments: tuple[str, ...] = tuple(BY_NAME)
    bf16: bool = True  #: autocast the forward pass to bfloat16 (the paper trains in bfloat16)
    heldout_windows: int = 64  #: held-out sequences the final loss is measured on
    corpus_limit: int | None = None  #: use only the first bytes of the corpus (--quick)
    fault_lr: float = 3e-3  #: the healthy learning rate of the data-fault workload
    fault_seeds: tuple[int, ...] = (0, 1)
    fault_treatments: tuple[str, ...] = (
        "none",
        "clip",
        "zclip",
        "adagc",
        "update-z",
        "spikeguard-w128",
        "spikeguard+rewind",
        "spikeguard",
    )
    faults: tuple[str, ...] = ("clean", "random", "repeat", "shuffled")
    calibration_updates: int = 100

    @property
    def fault_start(self) -> int:
        """The first bad batch: 60 % into the run (after SpikeGuard's and AdaGC's default warm-ups)."""
        return self.updates * 6 // 10

    @property
    def fault_length(self) -> int:
        """Bad batches in a row: 5 % of the run."""
        return max(1, self.updates // 20)


FULL = Settings()
QUICK = Settings(
    updates=8,
    warmup=2,
    batch=4,
    seq_len=32,
    width=32,
    layers=1,
    lrs=(1e-3, 3e-2, 3e-1),
    seeds=(0,),
    heldout_windows=8,
    corpus_limit=200_000,
    fault_seeds=(0,),
    fault_treatments=("clip", "spikeguard"),
    calibration_updates=8,
)


def lr_factor(update: int, s: Settings) -> float:
    """The schedule: linear warm-up over ``s.warmup`` updates, then cosine decay to 0 at ``s.updates``."""
    if update < s.warmup:
        return (update + 1) / s.warmup
    progress = (update - s.warmup) / max(1, s.updates - s.warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def make_model(s: Settings, treatment: Treatment, seed: int) -> GPT:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        width=s.width, heads=s.heads, layers=s.layers, seq_len=s.seq_len, qk_layernorm=treatment.qk_layernorm
    )
    return GPT(cfg)


@torch.no_grad()
def heldout_loss(model: GPT, corpus: Corpus, s: Settings) -> float:
    x, y = heldout_windows(corpus.heldout, s.seq_len, s.heldout_windows)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.bf16):
        loss = lm_loss(model(x), y)
    return float(loss)


def faulty(
    stream: Iterator[tuple[torch.Tensor, torch.Tensor]], fault: str, s: Settings, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The batch stream with ``fault`` injected at batches ``[fault_start, fault_start + fault_length)``:
    ``random`` (uniformly random bytes), ``repeat`` (the first bad batch over and over), ``shuffled``
    (real text whose targets are shuffled across the batch); ``clean`` changes nothing."""
    gen = torch.Generator().manual_seed(20_000 + seed)
    start, stop = s.fault_start, s.fault_start + s.fault_length
    repeated: tuple[torch.Tensor, torch.Tensor] | None = None
    for index, (x, y) in enumerate(stream):
        if start <= index < stop and fault != "clean":
            if fault == "random":
                noise = torch.randint(0, 256, (x.shape[0], x.shape[1] + 1), generator=gen)
                x, y = noise[:, :-1], noise[:, 1:]
            elif fault == "repeat":
                repeated = repeated or (x, y)
                x, y = repeated
            elif fault == "shuffled":
                y = y.flatten()[torch.randperm(y.numel(), generator=gen)].view_as(y)
            else:
                raise ValueError(f"fault must be one of {s.faults}, got {fault!r}")
        yield x, y


@dataclass
class Cell:
    """What one run measured (stored in the results file as a dict)."""

    treatment: str
    lr: float
    seed: int
    fault: str | None = None  #: None in the lr sweep; the injected fault in the data-fault workload
    heldout: float = math.nan  #: final held-out cross-entropy, nats per byte
    init_loss: float = math.nan  #: held-out cross-entropy at initialisation
    diverged: bool = False
    max_logit: float = math.nan  #: the largest attention logit seen in training
    windows: int = 0  #: step() calls
    updates: int = 0  #: applied updates
    skipped: int = 0
    clipped: int = 0  #: windows whose gradient was scaled down (norm or policy)
    update_clipped: int = 0  #: windows whose update UpdateClip scaled down
    rewinds: int = 0
    undone: int = 0  #: updates undone by rewinds
    stopped_early: bool = False  #: stopped after 20 windows in a row with a non-finite loss
    seconds: float = 0.0
    train_loss: list[float] = field(default_factory=list)  #: training loss every updates/40 windows


def _set_lr(opt: ClippedOptimizer, lr: float) -> None:
    for inner in opt.optimizers:
        for group in inner.param_groups:
            group["lr"] = lr


def train_cell(
    s: Settings, name: str, lr: float, seed: int, corpus: Corpus, bounds: Bounds, fault: str | None = None
) -> Cell:
    """Train one run and measure it."""
    treatment = BY_NAME[name]
    start = time.perf_counter()
    model = make_model(s, treatment, seed)
    cell = Cell(name, lr, seed, fault)
    cell.init_loss = heldout_loss(model, corpus, s)
    inner = inner_optimizers(model, treatment, lr)
    kwargs = treatment.keywords(model, RunShape(lr, s.updates, bounds))
    opt = ClippedOptimizer(inner if treatment.muon else inner[0], **kwargs)
    stream: Iterator[tuple[torch.Tensor, torch.Tensor]] = batches(corpus.train, s.batch, s.seq_len, seed)
    if fault is not None:
        stream = faulty(stream, fault, s, seed)
    if opt.rewind is not None:
        stream = opt.rewind.batches(stream)
    model.reset_max_logit()
    every = max(1, s.updates // 40)
    nonfinite_run = 0
    for window in range(s.updates):
        _set_lr(opt, lr * lr_factor(opt.num_updates, s))
        x, y = next(stream)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.bf16):
            loss = lm_loss(model(x), y, treatment.z_loss)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step(loss=loss)
        stats = opt.last_stats
        opt.zero_grad()
        value = float(loss.detach())
        cell.clipped += bool(stats is not None and stats.clipped)
        coef = None if stats is None else stats.update_coef
        cell.update_clipped += coef is not None and coef < 1.0
        if window % every == 0:
            cell.train_loss.append(value)
        nonfinite_run = 0 if math.isfinite(value) else nonfinite_run + 1
        if nonfinite_run >= 20:
            cell.stopped_early = True
            break
        cell.windows = window + 1
    cell.max_logit = float(model.max_logit())
    cell.heldout = heldout_loss(model, corpus, s)
    cell.diverged = diverged(cell.heldout, cell.init_loss)
    cell.updates = opt.num_updates
    cell.skipped = opt.num_skipped
    if opt.rewind is not None:
        cell.rewinds = opt.rewind.rewinds
        cell.undone = sum(e.undone for e in opt.rewind.log)
    cell.seconds = time.perf_counter() - start
    return cell


def calibrate(s: Settings, corpus: Corpus) -> Bounds:
    """UpdateClip's bounds per unit of learning rate, read off a healthy run.

    The plain baseline (``none``) at the sweep's smallest learning rate, seed 0, for
    ``calibration_updates`` updates: per update after the warm-up, the largest per-tensor RMS of the
    update ``p_after - p_before`` and the update's norm over all tensors, each divided by that
    update's learning rate.  The bound per unit lr is the 95th percentile of each: a healthy run
    exceeds it about one update in 20, so a bound of ``ratio * lr`` clips only what is larger than
    healthy training at that learning rate makes.
    """
    treatment = BY_NAME["none"]
    lr = s.lrs[0]
    cal = Settings(**{**s.__dict__, "updates": s.calibration_updates})
    model = make_model(cal, treatment, 0)
    params = list(model.parameters())
    opt = ClippedOptimizer(inner_optimizers(model, treatment, lr)[0], max_norm=None)
    stream = batches(corpus.train, cal.batch, cal.seq_len, 0)
    rms, norms = [], []
    for update in range(cal.updates):
        step_lr = lr * lr_factor(update, cal)
        _set_lr(opt, step_lr)
        x, y = next(stream)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cal.bf16):
            lm_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        before = [p.detach().clone() for p in params]
        opt.step()
        opt.zero_grad()
        if update >= min(cal.warmup, cal.updates - 1):
            deltas = [p.detach() - b for p, b in zip(params, before, strict=True)]
            rms.append(max(float(d.pow(2).mean().sqrt()) for d in deltas) / step_lr)
            norms.append(float(torch.stack([d.norm() for d in deltas]).norm()) / step_lr)

    def p95(values: list[float]) -> float:
        return statistics.quantiles(values, n=20, method="inclusive")[-1] if len(values) > 1 else values[0]

    return Bounds(rms_per_lr=p95(rms), norm_per_lr=p95(norms))


def cell_to_dict(cell: Cell) -> dict[str, Any]:
    return dict(cell.__dict__)
