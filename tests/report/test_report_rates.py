"""The report's rates (#35): the spike score of the loss and a norm bound that throttles the run,
on real training runs logged by ``CSVLogger``; the score checked against the rule written here with
NumPy, independently of the report's code."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from clipopt import ClippedOptimizer, CSVLogger
from clipopt._report.report import analyze, format_report, read_log


def _spike_score_reference(losses: list[float], window: int = 128, sigmas: float = 6.0) -> float:
    """OLMo-core's SpikeScore as the issue states it: the share (percent) of updates whose loss is more
    than ``sigmas`` standard deviations above the mean of the ``window`` updates before it."""
    x = np.array([v for v in losses if np.isfinite(v)], dtype=np.float64)
    hits = [x[i] > x[i - window : i].mean() + sigmas * x[i - window : i].std() for i in range(window, len(x))]
    return 100.0 * sum(hits) / len(hits)


def _regression_run(path: Path, bad: set[int]) -> Path:
    """A small regression trained for 300 updates; the batches in ``bad`` have targets 100x larger
    (a corrupted shard): loss spikes that the clipped run survives."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = ClippedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=3e-3), max_norm=1.0, loggers=[CSVLogger(path)]
    )
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(8, 1, generator=gen)
    for step in range(300):
        x = torch.randn(32, 8, generator=gen)
        y = x @ w + 0.1 * torch.randn(32, 1, generator=gen)
        if step in bad:
            y = 100.0 * y
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
    opt.close()
    return path


@functools.cache
def _runs(root: str) -> dict[str, Any]:
    base = Path(root)
    return {
        "clean": analyze(read_log(_regression_run(base / "clean.csv", set()))),
        "shard": analyze(read_log(_regression_run(base / "shard.csv", {150, 151, 220, 260}))),
    }


def test_the_spike_score_counts_the_losses_far_above_their_window(tmp_path_factory: Any) -> None:
    root = tmp_path_factory.getbasetemp() / "rates"
    runs = _runs(str(root))
    shard, clean = runs["shard"]["spike_score"], runs["clean"]["spike_score"]
    losses = [float(v) for v in read_log(root / "shard.csv").loss]
    assert shard["score"] == _spike_score_reference(losses)
    assert shard["spikes"] >= 3 and {151, 221, 261} & set(shard["steps"])  # steps count from 1
    assert clean["score"] == _spike_score_reference([float(v) for v in read_log(root / "clean.csv").loss])
    assert clean["score"] < shard["score"]
    assert "spike score" in format_report(runs["shard"])


def test_a_short_run_has_no_spike_score(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), loggers=[CSVLogger(tmp_path / "g.csv")]
    )
    for _ in range(50):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
    opt.close()
    assert analyze(read_log(tmp_path / "g.csv"))["spike_score"] is None


def _muon_run(path: Path, muon_group: dict[str, Any]) -> dict[str, Any]:
    """Muon on the weight matrices, AdamW on the rest, one wrapper with max_norm=0.05, 60 updates."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.Tanh(), nn.Linear(64, 4))
    matrices = [p for p in net.parameters() if p.ndim == 2]
    others = [p for p in net.parameters() if p.ndim != 2]
    inner = [
        torch.optim.Muon([{"params": matrices, **muon_group}], lr=0.02),
        torch.optim.AdamW(others, lr=1e-2),
    ]
    opt = ClippedOptimizer(inner, max_norm=0.05, loggers=[CSVLogger(path)])
    gen = torch.Generator().manual_seed(2)
    for _ in range(60):
        x, y = torch.randn(32, 16, generator=gen), torch.randn(32, 4, generator=gen)
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
    opt.close()
    return analyze(read_log(path))


def test_a_global_bound_that_throttles_every_update_is_reported(tmp_path: Path) -> None:
    report = _muon_run(tmp_path / "global.csv", {})
    throttle = report["throttle"]
    assert throttle["throttled"] and throttle["share"] >= 0.5 and throttle["median_coef"] <= 0.2
    assert "scales every step" in format_report(report)
    assert any("scales every step" in n for n in report["notes"])


def test_muons_groups_left_out_of_norm_clipping_are_not_throttled(tmp_path: Path) -> None:
    """The recipe of docs/concepts.md: Muon's groups with their own ``max_norm: None``."""
    report = _muon_run(tmp_path / "split.csv", {"max_norm": None})
    assert report["throttle"] is not None and 0 not in report["throttle"]["groups"]
    assert not any("scales every step" in n for n in report["notes"])
