"""The report's attention-logit rule (#35), on the logs of real short runs: a one-layer transformer
language model trained with AdamW at a high learning rate, whose largest attention logit grows
from 2.5 to over 13 in 40 updates; and the same run with ``qk_clip=QKClip(model, threshold=5.0)``,
which holds it near 5.  Both are written by CSVLogger, the first also by TensorBoardLogger."""

from __future__ import annotations

import functools
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from clipopt import ClippedOptimizer, CSVLogger, QKClip, TensorBoardLogger
from clipopt._report import evidence
from clipopt._report.report import analyze, format_report, read_log

V, STEPS = 32, 40


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 32)
        self.block = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.out = nn.Linear(32, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.emb(x)))


def _run(root: Path, name: str, threshold: float) -> Path:
    torch.manual_seed(0)
    model, data = TinyLM(), torch.randint(0, V, (16, 12))
    loggers: list[Any] = [CSVLogger(root / f"{name}.csv")]
    if name == "free":
        loggers.append(TensorBoardLogger(root / f"{name}_tb"))
    inner = torch.optim.AdamW(model.parameters(), lr=3e-2)
    opt = ClippedOptimizer(inner, max_norm=1.0, qk_clip=QKClip(model, threshold=threshold), loggers=loggers)
    for i in range(STEPS):
        x = data[(i * 8) % 16 : (i * 8) % 16 + 8]
        loss = nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, V), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
    opt.close()
    return root / f"{name}.csv"


@functools.cache
def _runs(root: str) -> dict[str, Path]:
    return {"free": _run(Path(root), "free", 1e30), "capped": _run(Path(root), "capped", 5.0)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _runs(str(tmp_path_factory.mktemp("attention")))


def _column(path: Path) -> list[float]:
    """The max_logit column of a CSV log, read with the csv module (empty: not measured)."""
    import csv

    with open(path, newline="") as f:
        return [float(r["max_logit"]) for r in csv.DictReader(f) if r["max_logit"] != ""]


def test_growing_attention_logits_are_flagged_with_their_figures(runs: dict[str, Path]) -> None:
    values = _column(runs["free"])
    assert len(values) == STEPS
    report = analyze(read_log(runs["free"]))
    attention = report["attention"]
    k = max(5, math.ceil(0.05 * len(values)))  # the rule's block of a run of 40 rows
    assert attention["start"] == statistics.median(values[:3])  # the report's start of a run
    assert attention["end"] == statistics.median(values[-k:])
    assert attention["max"] == max(values) and attention["recorded"] == STEPS
    assert attention["growing"] and attention["end"] >= 4 * attention["start"]
    note = next(n for n in report["notes"] if "largest attention logit grew" in n)
    assert "qk_clip=QKClip" in note
    assert note.endswith(f"; {evidence.attention()}") and "docs/which-tool.md" in note  # the benchmark (#34)
    assert "largest attention logit grew" in format_report(report)


def test_the_tensorboard_log_reads_the_same_logits(runs: dict[str, Path]) -> None:
    from_csv = analyze(read_log(runs["free"]))["attention"]
    from_tb = analyze(read_log(runs["free"].parent / "free_tb"))["attention"]
    assert from_tb["recorded"] == STEPS
    for key in ("start", "end", "max", "growing"):
        assert from_tb[key] == pytest.approx(from_csv[key], rel=1e-6)


def test_logits_held_by_qk_clip_are_not_flagged(runs: dict[str, Path]) -> None:
    values = _column(runs["capped"])
    assert max(values[-10:]) < 7.0  # measured before each window's cap: near the threshold
    report = analyze(read_log(runs["capped"]))
    assert report["attention"] is not None and not report["attention"]["growing"]
    assert not any("attention logit" in n for n in report["notes"])


def test_a_log_without_the_column_has_no_attention_key(tmp_path: Path) -> None:
    model = nn.Linear(4, 1)
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), loggers=[CSVLogger(tmp_path / "g.csv")]
    )
    for _ in range(12):
        model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    assert analyze(read_log(tmp_path / "g.csv"))["attention"] is None
