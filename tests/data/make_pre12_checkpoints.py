"""Writes the checkpoints of ``tests/test_checkpoint_compat.py`` with the clipopt of commit 2951178
(before issue 12's restructure). Not a test; run it with the OLD code on the path::

    git worktree add /tmp/old 2951178
    PYTHONPATH=/tmp/old python tests/data/make_pre12_checkpoints.py tests/data

It writes, per configuration, ``pre12_<name>.pt`` (model and optimizer ``state_dict()`` cut
with two micro-batches pending), ``pre12_<name>.pkl`` (the pickled model and optimizer, stats
history included) and ``pre12_<name>.json`` (what the old code itself did after the cut: the
steps' counters, reasons and the final parameter sums).  Self-contained: no import from tests/.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path
from typing import Any

import torch

from clipopt import ClippedOptimizer, ZClip

NAN_STEPS = {4, 5, 6, 12, 13, 14, 21}  # micro-batch indices whose loss is NaN
BIG_STEPS = {10, 19, 25}  # micro-batch indices whose loss is scaled by 1000 (a spike for ZClip)
CUT, END = 17, 30  # 5 windows of 3 closed and 2 micro-batches pending at the cut


def model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def make(name: str, m: torch.nn.Module) -> ClippedOptimizer:
    if name == "zclip":
        return ClippedOptimizer(
            torch.optim.Adam(m.parameters(), lr=0.01),
            max_norm=ZClip(warmup_steps=1, z_thresh=1.0, skip_spikes=True),
            accumulation_steps=3,
            max_consecutive_nonfinite=5,
        )
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2)
    return ClippedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
        max_norm=0.5,
        clip_value=0.2,
        accumulation_steps=3,
        max_consecutive_nonfinite=5,
        scaler=scaler,
    )


def run(m: torch.nn.Module, opt: ClippedOptimizer, start: int, stop: int) -> list[Any]:
    rows: list[Any] = []
    for i in range(start, stop):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)
        loss = ((m(x) - y) ** 2).mean()
        if i in NAN_STEPS:
            loss = loss * float("nan")
        if i in BIG_STEPS:
            loss = loss * 1000.0
        (loss if opt.scaler is None else opt.scaler.scale(loss)).backward()
        opt.step(loss=loss)
        opt.zero_grad()
        s = opt.last_stats
        rows.append(
            [i, opt.micro_batches, opt.num_windows, opt.num_skipped, opt.num_updates]
            + ([] if s is None else [s.step, s.skipped, s.reason, repr(s.total_norm), repr(s.loss)])
        )
    return rows


def main(out: Path) -> None:
    for name in ("zclip", "scaler"):
        m = model()
        opt = make(name, m)
        before = run(m, opt, 0, CUT)
        assert opt.micro_batches == 2
        torch.save({"model": m.state_dict(), "optimizer": opt.state_dict()}, out / f"pre12_{name}.pt")
        (out / f"pre12_{name}.pkl").write_bytes(pickle.dumps((m, opt)))
        after = run(m, opt, CUT, END)
        record = {
            "before": before,
            "after": after,
            "reasons": [s.reason for s in opt.stats],
            "params": [repr(float(p.detach().double().sum())) for p in m.parameters()],
        }
        (out / f"pre12_{name}.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
