"""Cost of ``clipopt.replay`` against ``torch.autograd.detect_anomaly()`` and a training step.

    python benchmarks/replay.py [--rounds 7] [--threads 2] [--width 256] [--layers 2]

A small transformer encoder (``--layers`` layers of width ``--width``, 8 heads,
batch 16 x 64 tokens) is trained through ``ClippedOptimizer(snapshot_dir=...)``;
one batch carries a NaN, which writes a snapshot.  Then, interleaved A B C D E per
round, median over rounds, on that snapshot's parameters and batch:

* ``step``            forward, backward and ``ClippedOptimizer.step()`` (a training step, clean batch);
* ``fwd+bwd``         forward and backward of the clean batch;
* ``detect_anomaly``  the same under ``torch.autograd.detect_anomaly()`` (finite: it checks every node);
* ``replay finite``   ``clipopt.replay(snap, model, loss_fn, repeats=1)`` of the snapshot with its
  batch made clean (nothing goes non-finite: every operator is checked; the worst case);
* ``replay nan``      the same of the NaN snapshot (checks stop at the first origin).

``repeats=3`` (the default) costs three times the ``replay`` rows.  Prints a
markdown table with the ratios against ``fwd+bwd`` and ``detect_anomaly``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import clipopt  # noqa: E402
from clipopt import ClippedOptimizer  # noqa: E402

BATCH, TOKENS = 16, 64


def build(width: int, layers: int) -> nn.Module:
    """The encoder with a linear head, seeded."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(width, 8, 4 * width, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    return nn.Sequential(encoder, nn.Linear(width, 1))


def loss_fn(model: nn.Module, attached: dict[str, Any]) -> Tensor:
    """Mean squared error of the attached batch."""
    return nn.functional.mse_loss(model(attached["inputs"]), attached["targets"])


def make_snapshot(model: nn.Module, width: int, folder: Path) -> str:
    """Three updates, the third with a NaN in its batch: the snapshot's path."""
    opt = ClippedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-4),
        max_norm=1.0,
        param_names=model.named_parameters(),
        snapshot_dir=folder,
    )
    for i in range(3):
        x, y = torch.randn(BATCH, TOKENS, width), torch.randn(BATCH, TOKENS, 1)
        if i == 2:
            x[3, 5, 7] = float("nan")
        opt.attach(inputs=x, targets=y)
        loss_fn(model, {"inputs": x, "targets": y}).backward()
        opt.step()
        opt.zero_grad()
    assert opt.last_snapshot is not None
    return opt.last_snapshot


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = build(args.width, args.layers)
    path = make_snapshot(model, args.width, Path(tempfile.mkdtemp()))
    nan_snap = clipopt.load_snapshot(path)
    batch = {**nan_snap["attached"], "inputs": nan_snap["attached"]["inputs"].nan_to_num()}
    clean = {**nan_snap, "attached": batch}
    model.load_state_dict(nan_snap["params"])
    opt = ClippedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.0), max_norm=1.0)

    def fwd_bwd() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()

    def step() -> None:
        fwd_bwd()
        opt.step()

    def anomaly() -> None:
        with torch.autograd.detect_anomaly(check_nan=True):
            fwd_bwd()

    def replay_finite() -> None:
        result = clipopt.replay(clean, model, loss_fn, repeats=1)
        assert not result.reproduced

    def replay_nan() -> None:
        result = clipopt.replay(nan_snap, model, loss_fn, repeats=1)
        assert result.reproduced and result.cause == "data"

    cases: dict[str, Callable[[], None]] = {
        "step": step,
        "fwd+bwd": fwd_bwd,
        "detect_anomaly": anomaly,
        "replay finite": replay_finite,
        "replay nan": replay_nan,
    }
    import warnings

    warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
    for fn in cases.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    n = sum(p.numel() for p in model.parameters())
    print(
        f"torch {torch.__version__}, {args.threads} threads, {args.rounds} rounds, "
        f"encoder {args.layers} x d={args.width} ({n / 1e6:.2f}M parameters), batch {BATCH} x {TOKENS}\n"
    )
    print("| case | median ms | x fwd+bwd | x detect_anomaly |")
    print("|---|---:|---:|---:|")
    for name, t in med.items():
        print(f"| {name} | {t * 1e3:.1f} | {t / med['fwd+bwd']:.2f} | {t / med['detect_anomaly']:.2f} |")


if __name__ == "__main__":
    main()
