"""clipopt demo end to end, with few updates: both halves shown, files written."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from clipopt import _cli
from clipopt._demo import DemoConfig, format_summary, run_demo

STEPS = 150


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    out = tmp_path_factory.mktemp("demo")
    return out, run_demo(out, DemoConfig(steps=STEPS, seed=1), progress=False)


def _blowup_onset(losses: list[float]) -> int | None:
    """The documented blow-up rule of ``clipopt report``, in NumPy: the first row whose loss and the
    median of the next block's losses (5 % of the rows, at least 5) stay above 3x the start (median of
    the first 3 losses), with no whole block after it whose median came back to the start or under,
    in a run where some loss exceeds 10x the start; None when it did not blow up."""
    x = np.asarray(losses, dtype=np.float64)
    start = float(np.median(x[:3]))
    if not (np.isinf(x) | (x > 10 * start)).any():
        return None
    k = min(len(x), max(5, math.ceil(0.05 * len(x))))
    back = [i for i in range(len(x) - k + 1) if np.median(x[i : i + k]) <= start]
    for j in range(back[-1] + 1 if back else 0, len(x)):
        if x[j] > 3 * start and np.median(x[j : j + k]) > 3 * start:
            return j
    return None


def test_plain_run_blows_up(demo: tuple[Path, object]) -> None:
    """Plain SGD's loss goes above 10x its start; held-out it is worse than the baseline."""
    _, result = demo
    plain = result.plain  # type: ignore[attr-defined]
    assert max(plain.losses) > 10 * plain.losses[0]
    assert not plain.heldout_loss < result.baseline  # type: ignore[attr-defined]


def test_summary_and_report_name_the_same_update(demo: tuple[Path, object]) -> None:
    """The demo's "blew up at update N (loss L)" and the report's "step N (loss L)" are the same event:
    the onset of the documented blow-up rule, recomputed with NumPy from the CSV's loss column, whose
    step column counts the updates from 1."""
    out, result = demo
    with (out / "plain.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    losses = [float(r["loss"]) for r in rows]
    j = _blowup_onset(losses)
    assert j is not None
    shown = f"{losses[j]:.4g}"
    assert f"at update {j + 1} (loss {shown})" in format_summary(result)  # type: ignore[arg-type]
    report = (out / "report.txt").read_text()
    assert f"verdict: exploding (the loss blew up; step {j + 1})" in report
    assert f"for good at step {j + 1} (loss {shown};" in report
    plain = result.plain  # type: ignore[attr-defined]
    assert (plain.blew_up_at, plain.blew_up_loss) == (j + 1, losses[j])
    assert plain.losses[j] == pytest.approx(losses[j], rel=1e-6)  # the update the demo counted


def test_clipped_run_stays_finite_and_learns(demo: tuple[Path, object]) -> None:
    """The same run under ClippedOptimizer never blows up and ends clearly below the frequency baseline."""
    _, result = demo
    clipped = result.clipped  # type: ignore[attr-defined]
    assert clipped.blew_up_at is None
    assert all(math.isfinite(v) for v in clipped.losses)
    assert clipped.heldout_loss < 0.8 * result.baseline  # type: ignore[attr-defined]
    assert clipped.clipped > 0
    assert result.shows_both_halves  # type: ignore[attr-defined]


def test_baseline_is_the_frequency_cross_entropy(demo: tuple[Path, object]) -> None:
    """The stated baseline lies between 0 and log(vocabulary), as a unigram cross-entropy must."""
    _, result = demo
    assert 0 < result.baseline < math.log(result.vocabulary)  # type: ignore[attr-defined]


def test_files_written(demo: tuple[Path, object]) -> None:
    """Both CSV logs (one row per update), the reports and the plots are in --out."""
    out, _ = demo
    for name in ("plain.csv", "clipopt.csv"):
        with (out / name).open(newline="") as f:
            rows = list(csv.DictReader(f))
        assert len(rows) == STEPS
    report = json.loads((out / "report.json").read_text())
    assert set(report["reports"]) == {"plain", "clipopt"}
    assert report["summary"]["shows_both_halves"] is True
    assert "verdict" in (out / "report.txt").read_text()
    pytest.importorskip("matplotlib", reason="plots need the plot extra")
    for name in ("demo.png", "plain-report.png", "clipopt-report.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_summary_states_baseline_and_outcome(demo: tuple[Path, object]) -> None:
    """The printed summary names both runs, the baseline and the outcome."""
    _, result = demo
    text = format_summary(result)  # type: ignore[arg-type]
    assert "plain torch.optim.SGD" in text and "ClippedOptimizer(max_norm=1)" in text
    assert "Trivial baseline (predict character frequencies)" in text
    assert "with clipopt it stayed finite and learned" in text


def test_cli_demo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`clipopt demo --steps N --seed S --out DIR --json` exits 0 and prints the summary as JSON."""
    argv = ["demo", "--steps", "120", "--seed", "2", "--out", str(tmp_path), "--no-progress", "--json"]
    code = _cli.main(argv)
    summary = json.loads(capsys.readouterr().out)
    assert code == 0
    assert summary["shows_both_halves"] is True
    assert (tmp_path / "clipopt.csv").exists()


def test_cli_demo_rejects_bad_steps(capsys: pytest.CaptureFixture[str]) -> None:
    """--steps below 2 is a usage error (exit 2) naming the option."""
    assert _cli.main(["demo", "--steps", "1"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "clipopt demo: error: argument --steps: must be a whole number >= 2, got '1'"
    )


def test_demo_reports_exploding_and_healthy(demo: tuple[Path, object]) -> None:
    """The demo's own reports: plain SGD is exploding, the clipped run healthy; the summary says so."""
    out, result = demo
    report = json.loads((out / "report.json").read_text())
    assert report["reports"]["plain"]["verdict"] == "exploding"
    assert report["reports"]["clipopt"]["verdict"] == "healthy"
    text = format_summary(result)  # type: ignore[arg-type]
    line = next(row for row in text.splitlines() if "clipopt report verdict" in row)
    assert "exploding" in line and "healthy" in line
