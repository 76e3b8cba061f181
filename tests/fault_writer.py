"""A training run that writes CSV rows and anomaly snapshots as fast as it can, to be killed.

``python tests/fault_writer.py DIR STEPS`` trains a small model with
``ClippedOptimizer(loggers=[CSVLogger(DIR/grads.csv, flush_every=1)], snapshot_dir=DIR/snaps)``;
every third window has a NaN gradient (a snapshot and a skipped row).  It prints ``ready``
once the first window is written, then keeps going; the fault-injection test kills it with
SIGKILL at a random moment and checks every file it left.  A run started again appends to
the same files (a resumed run).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from torch import nn

from clipopt import ClippedOptimizer, CSVLogger


def main(folder: str, steps: int) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    root = Path(folder)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    opt = ClippedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-3),
        max_norm=1.0,
        layer_stats=1,
        param_names=model.named_parameters(),
        loggers=[CSVLogger(root / "grads.csv", flush_every=1)],
        snapshot_dir=root / "snaps",
        max_snapshots=100_000,
    )
    x = torch.randn(16, 64)
    for i in range(steps):
        loss = model(x).pow(2).mean() * (math.nan if i % 3 == 2 else 1.0)
        loss.backward()
        opt.attach(inputs=x)
        opt.step()
        opt.zero_grad()
        if i == 0:
            print("ready", flush=True)
    opt.close()
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
