"""``clipopt report CSV [--plot PNG] [--json]`` (SPEC §3 "Threshold from statistics").

The logs are written here in :class:`clipopt.CSVLogger`'s format (its
``BASE_COLUMNS``, then ``<name>.<field>`` per-layer columns, cells through
``format_value``); the expected steps, layers and values are computed in the
tests, with NumPy, from the sequences written -- not from ``clipopt._report``.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from clipopt import LAYER_FIELDS, ClippedOptimizer, CSVLogger
from clipopt._cli import main
from clipopt._logging import BASE_COLUMNS, format_value
from clipopt._report import VERDICTS, analyze, format_report, percentile, plot_log, read_log

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


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


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


@pytest.mark.parametrize("every", [1, 5])
def test_exploding_nonfinite_names_step_and_first_layer(tmp_path: Path, every: int) -> None:
    """NaN from step 37 with b.weight and c.weight non-finite: exploding at step 37, layer b.weight.

    With per-layer rows every 5 steps the layer comes from the first per-layer row after it (step 40).
    """
    norms = stable_norms(60)
    norms[36:] = np.nan

    def layer(count: float) -> LayerFn:
        return lambda step: {
            "nonfinite": count if step >= 37 else 0.0,
            "grad_norm": math.nan if step >= 37 else 1,
        }

    layers = {"a.weight": flat_layers("a")["a"], "b.weight": layer(3), "c.weight": layer(5)}
    report = analyze(read_log(write_log(tmp_path / "g.csv", norms, layers, every=every)))
    assert report["verdict"] == "exploding"
    f = report["findings"][0]
    assert (f["kind"], f["step"], f["layer"]) == ("nonfinite", 37, "b.weight")
    assert f["values"]["count"] == 24 and f["values"]["applied"] == 0
    assert f["values"]["layer_step"] == (37 if every == 1 else 40)
    assert f["values"]["nonfinite_layers"] == {"b.weight": 3, "c.weight": 5}
    text = format_report(report)
    assert text.splitlines()[0] == "verdict: exploding (non-finite gradient norm; step 37, layer b.weight)"


def test_nonfinite_without_layer_counts_names_the_largest_layer(tmp_path: Path) -> None:
    """One NaN at step 37, none in the layers at step 40: the layer with the largest grad_norm there."""
    norms = stable_norms(60)
    norms[36] = np.inf
    sizes = {"a.weight": 1.0, "b.weight": 0.5, "c.weight": 7.0, "d.weight": 2.0}
    layers = {n: (lambda step, v=v: {"grad_norm": v}) for n, v in sizes.items()}
    f = analyze(read_log(write_log(tmp_path / "g.csv", norms, layers, every=5)))["findings"][0]
    assert (f["kind"], f["step"], f["layer"], f["values"]["layer_step"]) == ("nonfinite", 37, "c.weight", 40)
    assert "largest gradient norm" in f["evidence"]
    f = analyze(read_log(write_log(tmp_path / "h.csv", norms)))["findings"][0]
    assert (f["kind"], f["step"], f["layer"]) == ("nonfinite", 37, None)


def test_overflow_is_not_exploding(tmp_path: Path) -> None:
    """GradScaler overflows (reason 'overflow') are counted and noted, not taken for an explosion."""
    norms = stable_norms(200)
    norms[[0, 1, 2, 120]] = np.inf
    report = analyze(read_log(write_log(tmp_path / "g.csv", norms, reason="overflow")))
    assert report["verdict"] == "healthy"
    assert report["summary"]["overflow"] == 4 and report["summary"]["skipped"] == 4
    assert any("overflow" in note for note in report["notes"])


def test_exploding_growth(tmp_path: Path) -> None:
    """Norms growing 5% per update (noisy) explode; onset and fastest-growing layer match NumPy's."""
    n = 300
    t = np.arange(n)
    norms = np.exp(0.05 * t) * stable_norms(n, seed=3)
    layers = {
        "a.weight": lambda step: {"grad_norm": 1.0},
        "b.weight": lambda step: {"grad_norm": math.exp(0.05 * step)},
        "c.weight": lambda step: {"grad_norm": math.exp(0.01 * step)},
    }
    report = analyze(read_log(write_log(tmp_path / "g.csv", norms, layers, every=10)))
    assert report["verdict"] == "exploding"
    f = finding(report, "growth")
    k = math.ceil(0.1 * n)
    head, tail = np.median(norms[:k]), np.median(norms[-k:])
    onset = next(i for i in range(n) if norms[i] > 10 * head and np.median(norms[i : i + k]) > 10 * head)
    assert f["step"] == onset + 1
    assert f["layer"] == "b.weight"
    assert f["values"]["ratio"] == pytest.approx(tail / head)
    assert f["values"]["layer_ratio"] == pytest.approx(math.exp(0.05 * 300) / math.exp(0.05 * 10))
    assert "spikes" not in kinds(report)  # updates from the onset on are the explosion, not spikes


def test_growth_thresholds(tmp_path: Path) -> None:
    """A step from 1 to 99 is not an explosion, to 100 is (>= 100x); under 20 updates growth is not judged."""
    for n, factor, exploding in [(200, 99.0, False), (200, 100.0, True), (19, 1e4, False), (20, 1e4, True)]:
        norms = np.where(np.arange(n) < n // 2, 1.0, factor)
        report = analyze(read_log(write_log(tmp_path / f"g{n}-{factor}.csv", norms, max_norm=None)))
        assert ("growth" in kinds(report)) is exploding, (n, factor)
        if exploding:
            assert finding(report, "growth")["step"] == n // 2 + 1


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


def test_most_severe_verdict_wins(tmp_path: Path) -> None:
    """NaN, spike and a vanishing layer together: exploding; findings ordered exploding, spikes, vanishing."""
    norms = stable_norms(400)
    norms[199] *= 50
    norms[350] = np.nan
    layers = {**flat_layers("a.weight", "b.weight"), "c.weight": lambda step: {"grad_norm": 1e-9}}
    report = analyze(read_log(write_log(tmp_path / "g.csv", norms, layers, every=10)))
    assert report["verdict"] == "exploding"
    assert kinds(report) == ["nonfinite", "spikes", "vanishing"]


# ------------------------------------------------------------------------------ suggestions and summary


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


def test_read_log_columns(tmp_path: Path) -> None:
    """read_log returns aligned lists; per-layer values are None in rows without layer statistics."""
    path = write_log(
        tmp_path / "g.csv", [1.0, math.nan, 3.0, 4.0], flat_layers("0.weight", "0.bias"), every=2
    )
    log = read_log(path)
    assert log.steps == [1, 2, 3, 4]
    assert log.total_norm[0] == 1.0 and math.isnan(log.total_norm[1])  # type: ignore[arg-type]
    assert log.skipped == [False, True, False, False] and log.reason == [None, "nonfinite", None, None]
    assert list(log.layers) == ["0.weight", "0.bias"]
    assert log.layers["0.bias"]["param_norm"] == [None, 10.0, None, 10.0]
    assert log.layer_rows() == [1, 3]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "is empty"),
        ("a,b,c\n1,2,3\n", "is not a clipopt CSV log (its first line is not the header"),
        ("step,total_norm\n1,2\n", "not a clipopt CSV log: missing column(s) micro_batches, clip_coef"),
        ("x" * 200_000 + "\n", "not readable as CSV"),
        (",".join(BASE_COLUMNS) + "\n1,1,,1,0,0,,1,0.1\n", "line 2: total_norm is empty"),
        (",".join(BASE_COLUMNS) + "\n", "no rows yet"),
        (
            ",".join(BASE_COLUMNS) + "\n1,1,abc,1,0,0,,1,0.1\n2,1,1,1,0,0,,1,0.1\n",
            "line 2: column total_norm",
        ),
        (",".join(BASE_COLUMNS) + "\n1,1,1,1,0,0,,1,0.1\n2,1\n3,1,1,1,0,0,,1,0.1\n", "line 3: 2 cells"),
    ],
)
def test_read_log_rejects(tmp_path: Path, content: str, message: str) -> None:
    """Files that are not usable clipopt logs raise ValueError naming the file and the problem."""
    path = tmp_path / "bad.csv"
    path.write_text(content)
    with pytest.raises(ValueError, match=r"bad\.csv") as info:
        read_log(path)
    assert message in str(info.value)


def test_read_log_skips_an_incomplete_last_row(tmp_path: Path) -> None:
    """A last row cut short (a run killed while writing) is ignored with a note."""
    path = tmp_path / "g.csv"
    path.write_text(",".join(BASE_COLUMNS) + "\n1,1,1.5,1,0,0,,1,0.1\n2,1,1.2\n")
    log = read_log(path)
    assert log.steps == [1] and "ignored" in log.notes[0]
    assert "ignored" in analyze(log)["notes"][0]


# ------------------------------------------------------------------------------ plot


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


def test_cli_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`clipopt report` prints the verdict first, the evidence, the three suggestions and the summary."""
    norms = stable_norms(800)
    norms[[299, 499]] *= 50
    code, out, err = run(capsys, "report", str(write_log(tmp_path / "g.csv", norms)))
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith("verdict: spikes (gradient norm spikes; step 300")
    assert "step(s) 300, 500" in out
    for heading in ("Evidence:", "Suggested max_norm:", "Summary:"):
        assert heading in lines
    for name in ("autoclip", "pascanu", "zclip"):
        assert any(line.split()[:1] == [name] for line in lines)


def test_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--json prints strict JSON (nan as a string) with the verdict, findings, suggestions and summary."""
    norms = stable_norms(100)
    norms[40:] = np.nan
    code, out, _ = run(capsys, "report", str(write_log(tmp_path / "g.csv", norms)), "--json")
    assert code == 0

    def reject(name: str) -> Any:
        raise ValueError(name)

    report = json.loads(out, parse_constant=reject)
    assert report["verdict"] == "exploding"
    assert report["findings"][0]["step"] == 41 and report["findings"][0]["values"]["total_norm"] == "nan"
    assert [s["name"] for s in report["suggestions"]] == ["autoclip", "pascanu", "zclip"]
    assert report["summary"]["updates"] == 100


def test_cli_missing_and_invalid_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing file or a CSV that is not a clipopt log: exit 2 and one line on stderr."""
    code, out, err = run(capsys, "report", str(tmp_path / "nope.csv"))
    assert code == 2 and out == ""
    assert err == f"clipopt report: error: {tmp_path / 'nope.csv'}: no such file\n"
    bad = tmp_path / "other.csv"
    bad.write_text("epoch,loss\n1,0.5\n")
    code, out, err = run(capsys, "report", str(bad))
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("clipopt report: error: ") and "not a clipopt CSV log" in err


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


def test_end_to_end_training_with_a_nan_window(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Train with ClippedOptimizer + CSVLogger (layer_stats=5); a NaN put in 2.weight's gradient at
    update 25 makes `clipopt report` say exploding at step 25, layer 2.weight."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    path = tmp_path / "grads.csv"
    opt = ClippedOptimizer(
        torch.optim.SGD(model.named_parameters(), lr=0.05),
        max_norm=1.0,
        layer_stats=5,
        loggers=[CSVLogger(path, flush_every=16)],
    )
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 61):
        x = torch.randn(8, 4, generator=gen)
        model(x).pow(2).mean().backward()
        if step == 25:
            model[2].weight.grad[0, 0] = float("nan")  # type: ignore[index]
        opt.step()
        opt.zero_grad()
    opt.close()
    code, out, _ = run(capsys, "report", str(path), "--json")
    assert code == 0
    report = json.loads(out)
    assert report["verdict"] == "exploding"
    f = report["findings"][0]
    assert (f["kind"], f["step"], f["layer"]) == ("nonfinite", 25, "2.weight")
    assert f["values"]["nonfinite_layers"] == {"2.weight": 1}
    assert report["summary"]["skipped"] == 1 and report["summary"]["layer_rows"] == 12


def test_spikes_with_zero_and_negative_norms(tmp_path: Path) -> None:
    """Zero norms (vanished gradients) do not make equal non-zero norms "spikes" (their log-std is 0
    but ln x is not above the log-mean), and a negative norm in a foreign CSV does not crash."""
    norms = [1.0, 0.0, 0.0, 0.0] * 100
    assert "spikes" not in kinds(analyze(read_log(write_log(tmp_path / "z.csv", norms))))
    norms = [1.0, 2.0] * 20 + [-1.0] + [1.0, 2.0] * 20
    assert analyze(read_log(write_log(tmp_path / "n.csv", norms)))["verdict"] in VERDICTS
    norms = [-3.0] * 20 + [-0.5, 0.0]
    assert analyze(read_log(write_log(tmp_path / "m.csv", norms)))["verdict"] in VERDICTS
