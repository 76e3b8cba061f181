"""``clipopt report CSV [--plot PNG] [--json]`` (docs/cli.md, 'clipopt report').

The logs are written here in :class:`clipopt.CSVLogger`'s format (its
``BASE_COLUMNS``, then ``<name>.<field>`` per-layer columns, cells through
``format_value``); the expected steps, layers and values are computed in the
tests, with NumPy, from the sequences written -- not from ``clipopt._report.report``.
"""

from __future__ import annotations

import csv
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from clipopt import LAYER_FIELDS
from clipopt._diagnostics.loggers import BASE_COLUMNS, format_value
from clipopt._report.report import VERDICTS, analyze, format_report, percentile, plot_log, read_log

from ..helpers import run_cli as run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

#: A per-layer row: field -> value (missing fields are written as healthy defaults).
LayerFn = Callable[[int], dict[str, float]]


def write_log(
    path: Path,
    norms: Sequence[float],
    layers: dict[str, LayerFn] | None = None,
    every: int = 1,
    max_norm: float | None = 1.0,
    reason: str = "nonfinite",
) -> Path:
    """Write a CSVLogger-format file: one row per norm (step = index + 1), layers every ``every`` steps."""
    names = list(layers or {})
    columns = [*BASE_COLUMNS, *(f"{n}.{f}" for n in names for f in LAYER_FIELDS)]
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for i, value in enumerate(norms):
            step, x = i + 1, float(value)
            finite = math.isfinite(x)
            coef = min(1.0, max_norm / (x + 1e-6)) if (max_norm is not None and finite) else 1.0
            row: list[Any] = [
                step,
                1,
                x,
                coef,
                coef < 1.0,
                not finite,
                None if finite else reason,
                max_norm,
                0.01,
                None,  # loss: not given
            ]
            cells = [format_value(v) for v in row]
            for name in names:
                if step % every:
                    cells += [""] * len(LAYER_FIELDS)
                    continue
                values = {
                    "grad_norm": 1.0,
                    "grad_max": 0.1,
                    "grad_min": 0.0,
                    "nonfinite": 0.0,
                    "param_norm": 10.0,
                }
                values.update(layers[name](step))  # type: ignore[index]
                cells += [format_value(float(values[f])) for f in LAYER_FIELDS]
            writer.writerow(cells)
    return path


def stable_norms(n: int, seed: int = 0, sigma: float = 0.1) -> np.ndarray:
    """Lognormal norms around 1: a healthy run."""
    return np.exp(np.random.default_rng(seed).normal(0.0, sigma, n))


def flat_layers(*names: str, seed: int = 1) -> dict[str, LayerFn]:
    """Layers whose gradient norms are ~U(0.5, 1.5) (parameter norm 10)."""
    rng = np.random.default_rng(seed)
    return {n: (lambda step: {"grad_norm": float(rng.uniform(0.5, 1.5))}) for n in names}


def kinds(report: dict[str, Any]) -> list[str]:
    return [f["kind"] for f in report["findings"]]


def finding(report: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(f for f in report["findings"] if f["kind"] == kind)


# ------------------------------------------------------------------------------ verdicts


def test_healthy(tmp_path: Path) -> None:
    """Lognormal norms around 1 with flat layers: verdict healthy, no finding, the text says so first."""
    path = write_log(
        tmp_path / "g.csv", stable_norms(1000, sigma=0.2), flat_layers("a.weight", "b.weight"), every=10
    )
    report = analyze(read_log(path))
    assert report["verdict"] == "healthy"
    assert report["findings"] == []
    assert format_report(report).splitlines()[0].startswith("verdict: healthy")


def test_overflow_is_not_exploding(tmp_path: Path) -> None:
    """GradScaler overflows (reason 'overflow') are counted and noted, not taken for an explosion."""
    norms = stable_norms(200)
    norms[[0, 1, 2, 120]] = np.inf
    report = analyze(read_log(write_log(tmp_path / "g.csv", norms, reason="overflow")))
    assert report["verdict"] == "healthy"
    assert report["summary"]["overflow"] == 4 and report["summary"]["skipped"] == 4
    assert any("overflow" in note for note in report["notes"])


def test_spikes(tmp_path: Path) -> None:
    """Two 50x spikes at steps 300 and 500 in a stable run: verdict spikes, both steps, z as NumPy's."""
    norms = stable_norms(800)
    norms[[299, 499]] *= 50
    layers = {
        "a.weight": lambda step: {"grad_norm": 50.0 if step in (300, 500) else 1.0},
        **flat_layers("b.weight"),
    }
    report = analyze(read_log(write_log(tmp_path / "g.csv", norms, layers, every=10)))
    assert report["verdict"] == "spikes"
    f = finding(report, "spikes")
    assert f["step"] == 300 and f["values"]["steps"] == [300, 500] and f["values"]["count"] == 2
    for top in f["values"]["top"]:
        j = top["step"] - 1
        window = norms[max(0, j - 128) : j]
        logs = np.log(window)
        assert top["z"] == pytest.approx((np.log(norms[j]) - logs.mean()) / logs.std())
        assert top["mean"] == pytest.approx(window.mean())
    assert f["values"]["top"][0]["z"] >= f["values"]["top"][1]["z"]
    assert f["layer"] == "a.weight"  # the layer far above its own median at the largest spike


def test_spike_z_threshold(tmp_path: Path) -> None:
    """After 128 norms alternating 1 and e^2 (log-norms 0 and 2: mean 1, std 1), e^6.01 (log-norm
    z = 5.01) is a spike and e^5.99 is not."""
    for log_x, spike in [(6.01, True), (5.99, False)]:
        norms = [1.0, math.exp(2.0)] * 64 + [math.exp(log_x)] + [1.0, math.exp(2.0)] * 8
        report = analyze(read_log(write_log(tmp_path / f"{log_x}.csv", norms)))
        assert kinds(report) == (["spikes"] if spike else []), log_x
        if spike:
            assert finding(report, "spikes")["values"]["top"][0]["z"] == pytest.approx(5.01)


def test_heavy_tailed_healthy_run_has_no_spikes(tmp_path: Path) -> None:
    """Log-normal norms with log-std 0.5 (a heavy tail, no spike): healthy.  A z-score on the raw
    norms (z > 6 and >= 2x the rolling mean, the rule before) calls this run "spikes"."""
    norms = stable_norms(5000, seed=3, sigma=0.5)
    assert analyze(read_log(write_log(tmp_path / "g.csv", norms)))["verdict"] == "healthy"
    raw_spikes = 0
    for j in range(16, len(norms)):
        window = norms[max(0, j - 128) : j]
        if norms[j] >= 2 * window.mean() and (norms[j] - window.mean()) / window.std() > 6:
            raw_spikes += 1
    assert raw_spikes > 0  # the data does exercise the difference


def test_spike_needs_history(tmp_path: Path) -> None:
    """A 50x spike at update 10 (fewer than 16 earlier norms) is not judged; at update 17 it is."""
    norms = stable_norms(100)
    norms[9] *= 50
    assert analyze(read_log(write_log(tmp_path / "a.csv", norms)))["verdict"] == "healthy"
    norms = stable_norms(100)
    norms[16] *= 50
    f = analyze(read_log(write_log(tmp_path / "b.csv", norms)))["findings"][0]
    assert (f["kind"], f["step"]) == ("spikes", 17)


def test_vanishing(tmp_path: Path) -> None:
    """A layer at grad_norm 1e-9 among layers at ~1 vanishes (relative rule), named with its first step."""
    layers = {**flat_layers("a.weight", "b.weight"), "c.weight": lambda step: {"grad_norm": 1e-9}}
    report = analyze(read_log(write_log(tmp_path / "g.csv", stable_norms(200), layers, every=10)))
    assert report["verdict"] == "vanishing"
    assert [(f["kind"], f["layer"], f["step"]) for f in report["findings"]] == [("vanishing", "c.weight", 10)]
    assert report["findings"][0]["values"]["relative"] is True
    assert format_report(report).splitlines()[0] == (
        "verdict: vanishing (vanishing layer gradient; step 10, layer c.weight)"
    )


def test_vanishing_against_parameter_norm(tmp_path: Path) -> None:
    """grad_norm 5e-3 against param_norm 1e4 (ratio 5e-7 < 1e-6) vanishes; against 1e3 (5e-6) it does not."""
    for param_norm, vanishing in [(1e4, True), (1e3, False)]:
        layers = {
            **flat_layers("a.weight", "b.weight"),
            "emb.weight": lambda step, p=param_norm: {"grad_norm": 5e-3, "param_norm": p},
        }
        report = analyze(read_log(write_log(tmp_path / "g.csv", stable_norms(100), layers, every=5)))
        assert report["verdict"] == ("vanishing" if vanishing else "healthy")
        if vanishing:
            f = report["findings"][0]
            assert f["layer"] == "emb.weight" and f["values"]["relative"] is False
            assert f["values"]["median_grad_to_param"] == pytest.approx(5e-7)


def test_without_layer_columns_vanishing_is_not_checked(tmp_path: Path) -> None:
    """No per-layer columns: no vanishing verdict possible, and a note says so."""
    report = analyze(read_log(write_log(tmp_path / "g.csv", stable_norms(100))))
    assert report["verdict"] == "healthy"
    assert any("layer_stats" in note for note in report["notes"])


def test_suggestions_match_numpy(tmp_path: Path) -> None:
    """AutoClip p10, Pascanu 0.5-10x mean, mean + 2.5 population std: NumPy's over the finite norms."""
    rng = np.random.default_rng(7)
    norms = rng.lognormal(0.0, 0.8, 500)
    norms[[5, 50, 400]] = [np.nan, np.inf, np.nan]
    report = analyze(read_log(write_log(tmp_path / "g.csv", norms)))
    finite = norms[np.isfinite(norms)]
    sug = {s["name"]: s for s in report["suggestions"]}
    assert sug["autoclip"]["value"] == pytest.approx(np.percentile(finite, 10), rel=1e-12)
    assert sug["pascanu"]["low"] == pytest.approx(0.5 * finite.mean(), rel=1e-12)
    assert sug["pascanu"]["high"] == pytest.approx(10 * finite.mean(), rel=1e-12)
    assert sug["pascanu"]["value"] is None
    assert sug["zclip"]["value"] == pytest.approx(finite.mean() + 2.5 * finite.std(ddof=0), rel=1e-12)
    assert "Seetharaman" in sug["autoclip"]["rule"] and "Pascanu" in sug["pascanu"]["rule"]
    assert "ZClip" in sug["zclip"]["rule"]


@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=50),
    st.floats(0.0, 100.0),
)
def test_percentile_matches_numpy(values: list[float], q: float) -> None:
    """percentile() is numpy.percentile's default (linear) interpolation."""
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-6)


def test_summary(tmp_path: Path) -> None:
    """Counts of updates, clipped and skipped updates, and min/median/max of the finite norms."""
    norms = np.array([0.5, 2.0, np.nan, 3.0, 0.25, 1.5])
    s = analyze(read_log(write_log(tmp_path / "g.csv", norms, max_norm=1.0)))["summary"]
    finite = norms[np.isfinite(norms)]
    assert (s["updates"], s["clipped"], s["skipped"], s["nonfinite"]) == (6, 3, 1, 1)
    assert s["clipped_fraction"] == pytest.approx(0.5)
    assert (s["norm_min"], s["norm_max"]) == (0.25, 3.0)
    assert s["norm_median"] == pytest.approx(np.median(finite))
    assert s["max_norm"] == {"min": 1.0, "max": 1.0, "last": 1.0}
    s = analyze(read_log(write_log(tmp_path / "h.csv", norms, max_norm=None)))["summary"]
    assert s["max_norm"] is None and s["clipped"] == 0


# ------------------------------------------------------------------------------ reading


@pytest.mark.parametrize("with_layers", [True, False])
def test_plot_is_a_png(tmp_path: Path, with_layers: bool) -> None:
    """plot_log writes a PNG, with and without per-layer columns, leaving pyplot and the backend alone."""
    matplotlib = pytest.importorskip("matplotlib")
    backend = matplotlib.rcParams._get("backend")
    pyplot_loaded = "matplotlib.pyplot" in sys.modules
    norms = stable_norms(300)
    norms[[100, 200]] = [np.nan, 40.0]
    layers = (
        {**flat_layers("a.weight"), "b.weight": lambda step: {"grad_norm": 1e-9}} if with_layers else None
    )
    log = read_log(write_log(tmp_path / "g.csv", norms, layers, every=10))
    out = tmp_path / "plot.png"
    plot_log(log, analyze(log), out)
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000
    assert matplotlib.rcParams._get("backend") == backend
    assert ("matplotlib.pyplot" in sys.modules) == pyplot_loaded


def hide_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every `import matplotlib...` fail, as if it were not installed."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def test_plot_without_matplotlib_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without matplotlib, plot_log raises ImportError with the pip command of the plot extra."""
    log = read_log(write_log(tmp_path / "g.csv", stable_norms(50)))
    hide_matplotlib(monkeypatch)
    with pytest.raises(ImportError, match=r"pip install 'clipopt\[plot\]'"):
        plot_log(log, analyze(log), tmp_path / "p.png")
    assert not (tmp_path / "p.png").exists()


# ------------------------------------------------------------------------------ command line


def test_cli_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--plot writes the PNG and says where."""
    pytest.importorskip("matplotlib")
    out_png = tmp_path / "out.png"
    code, out, err = run(
        capsys, "report", str(write_log(tmp_path / "g.csv", stable_norms(50))), "--plot", str(out_png)
    )
    assert code == 0 and err == ""
    assert out_png.read_bytes()[:8] == PNG_MAGIC
    assert out.rstrip().endswith(f"Plot written to {out_png}")


def test_cli_plot_without_matplotlib(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--plot without matplotlib: the report is printed, then one line on how to install it, exit 2."""
    path = write_log(tmp_path / "g.csv", stable_norms(50))
    hide_matplotlib(monkeypatch)
    code, out, err = run(capsys, "report", str(path), "--plot", str(tmp_path / "p.png"))
    assert code == 2
    assert out.startswith("verdict: healthy")
    assert err.count("\n") == 1 and "matplotlib" in err and "pip install 'clipopt[plot]'" in err


# ------------------------------------------------------------------------------ end to end


def test_spikes_with_zero_and_negative_norms(tmp_path: Path) -> None:
    """Zero norms (vanished gradients) do not make equal non-zero norms "spikes" (their log-std is 0
    but ln x is not above the log-mean), and a negative norm in a foreign CSV does not crash."""
    norms = [1.0, 0.0, 0.0, 0.0] * 100
    assert "spikes" not in kinds(analyze(read_log(write_log(tmp_path / "z.csv", norms))))
    norms = [1.0, 2.0] * 20 + [-1.0] + [1.0, 2.0] * 20
    assert analyze(read_log(write_log(tmp_path / "n.csv", norms)))["verdict"] in VERDICTS
    norms = [-3.0] * 20 + [-0.5, 0.0]
    assert analyze(read_log(write_log(tmp_path / "m.csv", norms)))["verdict"] in VERDICTS
