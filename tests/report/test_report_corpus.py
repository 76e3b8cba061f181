"""A labelled corpus of small real training runs; ``clipopt report`` must be right on every one.

Each run trains a small network on synthetic data on the CPU (well under a
second) through ClippedOptimizer with a CSVLogger and ``step(loss=loss)``;
its truth is known by construction.  The runs are generated once per session.
"""

from __future__ import annotations

import copy
import csv
import itertools
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from clipopt import ClippedOptimizer, CSVLogger, SpikeGuard
from clipopt._cli import main
from clipopt._report.plot import short_names
from clipopt._report.report import analyze, read_log

STEPS = 200


def _mlp(depth: int = 2, width: int = 16, act: type[torch.nn.Module] = torch.nn.Tanh) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = [torch.nn.Linear(8, width), act()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), act()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 8, generator=g)
    return x, (x[:, :4].sum(1, keepdim=True) - x[:, 4:].prod(1, keepdim=True)).tanh()


def train(
    path: Path,
    make_opt: Callable[[torch.nn.Module], torch.optim.Optimizer],
    *,
    model: torch.nn.Module | None = None,
    max_norm: float | None = None,
    layer_stats: bool | int = 10,
    corrupt: Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
    nan_at: tuple[int, str] | None = None,
    steps: int = STEPS,
    scaler: torch.amp.GradScaler | None = None,
    warmup: int = 0,
    data: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.nn.functional.mse_loss,
    skip_nonfinite: bool = True,
    spike_guard: SpikeGuard | None = None,
    update_stats: bool = False,
) -> list[float]:
    """Train and log to ``path`` (``update_stats``: with the update norm); return the losses."""
    torch.manual_seed(0)
    net = model if model is not None else _mlp()
    inner = make_opt(net)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: min(1.0, (s + 1) / warmup)) if warmup else None
    opt = ClippedOptimizer(
        inner,
        scaler=scaler,
        max_norm=max_norm,
        skip_nonfinite=skip_nonfinite,
        spike_guard=spike_guard,
        update_stats=update_stats,
        param_names=net.named_parameters(),
        layer_stats=layer_stats,
        loggers=[CSVLogger(path)],
    )
    losses = []
    for step in range(1, steps + 1):
        x, y = (data or _data)(step)
        if corrupt is not None:
            x, y = corrupt(step, x, y)
        with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
            loss = loss_fn(net(x).float(), y)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if nan_at is not None and step == nan_at[0]:
            dict(net.named_parameters())[nan_at[1]].grad.view(-1)[0] = math.nan
        opt.step(loss=loss)
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(float(loss.detach()))
    opt.close()
    return losses


def _corrupted(step: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (x, y - 10.0) if step in (80, 140) else (x, y)


def _bad_labels(step: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (x, y + 25.0) if step in (90, 150) else (x, y)


#: Full-batch linear regression: plain SGD multiplies the error by |1 - lr * lambda_max| per step.
_X = torch.randn(64, 8, generator=torch.Generator().manual_seed(7))
_Y = _X @ torch.linspace(-1, 1, 8).unsqueeze(1)
_LAMBDA_MAX = float(torch.linalg.eigvalsh(2 * _X.T @ _X / len(_X)).max())


def _full_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _X, _Y


def _linear() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 1, bias=False)


def _deep_sigmoid() -> torch.nn.Module:
    torch.manual_seed(0)
    return _mlp(depth=14, width=16, act=torch.nn.Sigmoid)


def _conv_batchnorm() -> torch.nn.Module:
    """Two Conv2d (with biases) each followed by BatchNorm2d and ReLU, then a linear read-out: the conv
    biases get no gradient (BatchNorm subtracts the batch mean of each channel)."""
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 4),
    )


def _quadrant_images(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """8x8 noise images; the class is the quadrant with the largest mean (4 classes)."""
    x = torch.randn(32, 1, 8, 8, generator=torch.Generator().manual_seed(step))
    quadrants = x.view(32, 2, 4, 2, 4).mean((2, 4)).flatten(1)
    return x, quadrants.argmax(1)


#: name -> (train kwargs, expected verdict, expected step or None, expected layer or None)
CORPUS: dict[str, tuple[dict[str, Any], str, int | None, str | None]] = {
    "healthy-sgd": ({"make_opt": lambda m: torch.optim.SGD(m.parameters(), lr=0.05)}, "healthy", None, None),
    "healthy-adamw": (
        {"make_opt": lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3)},
        "healthy",
        None,
        None,
    ),
    "healthy-momentum": (
        {"make_opt": lambda m: torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9)},
        "healthy",
        None,
        None,
    ),
    "healthy-clipped": (
        {"make_opt": lambda m: torch.optim.SGD(m.parameters(), lr=0.3), "max_norm": 0.5},
        "healthy",
        None,
        None,
    ),
    "early-blowup": (
        {"make_opt": lambda m: torch.optim.SGD(m.parameters(), lr=1.0)},
        "exploding",
        None,
        None,
    ),
    "corrupted-batches": (
        {"make_opt": lambda m: torch.optim.SGD(m.parameters(), lr=0.02), "corrupt": _corrupted},
        "spikes",
        80,
        None,
    ),
    "loss-spikes-clipped": (
        {
            "make_opt": lambda m: torch.optim.SGD(m.parameters(), lr=0.05),
            "max_norm": 1.0,
            "corrupt": _bad_labels,
        },
        "spikes",
        90,
        None,
    ),
    "nan-first-layer": (
        {"make_opt": lambda m: torch.optim.SGD(m.parameters(), lr=0.05), "nan_at": (21, "0.weight")},
        "nonfinite",
        21,
        "0.weight",
    ),
    "nan-last-layer": (
        {"make_opt": lambda m: torch.optim.SGD(m.parameters(), lr=0.05), "nan_at": (57, "4.bias")},
        "nonfinite",
        57,
        "4.bias",
    ),
    "slow-growth-to-overflow": (
        {
            "make_opt": lambda m: torch.optim.SGD(m.parameters(), lr=2.3 / _LAMBDA_MAX),
            "model": _linear(),
            "data": _full_batch,
            "layer_stats": False,
        },
        "exploding",
        None,
        None,
    ),
    "gradscaler-overflows": (
        {
            "make_opt": lambda m: torch.optim.SGD(m.parameters(), lr=0.05),
            "scaler": torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=20),
        },
        "healthy",
        None,
        None,
    ),
    "warmup": (
        {"make_opt": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), "warmup": 50},
        "healthy",
        None,
        None,
    ),
    "healthy-conv-batchnorm": (
        {
            "make_opt": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
            "model": _conv_batchnorm(),
            "data": _quadrant_images,
            "loss_fn": torch.nn.functional.cross_entropy,
        },
        "healthy",
        None,
        None,
    ),
    "vanishing-deep-sigmoid": (
        {"make_opt": lambda m: torch.optim.SGD(m.parameters(), lr=0.05), "model": _deep_sigmoid()},
        "vanishing",
        None,
        "0.weight",
    ),
}


#: The corpus's models as they are before any training (a run trains the model object it is given).
_UNTRAINED = {name: copy.deepcopy(kw["model"]) for name, (kw, *_) in CORPUS.items() if "model" in kw}


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[float]]]:
    out = tmp_path_factory.mktemp("corpus")
    runs = {}
    for name, (kwargs, *_) in CORPUS.items():
        path = out / f"{name}.csv"
        runs[name] = (path, train(path, **kwargs))
    return runs


@pytest.mark.parametrize("name", list(CORPUS))
def test_report_is_right_on_the_corpus(name: str, corpus: dict[str, tuple[Path, list[float]]]) -> None:
    """The verdict (and where known, the step and the layer) of each labelled run."""
    _, verdict, step, layer = CORPUS[name]
    report = analyze(read_log(corpus[name][0]))
    assert report["verdict"] == verdict, report["findings"]
    head = report["findings"][0] if report["findings"] else None
    if step is not None:
        assert head is not None and head["step"] == step
    if layer is not None:
        assert head is not None and head["layer"] == layer


@pytest.fixture(scope="session")
def corpus_with_update_norm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The corpus trained again with ``update_stats=True`` (the same trajectories, plus the update norm)."""
    out = tmp_path_factory.mktemp("corpus-update")
    runs = {}
    for name, (kwargs, *_) in CORPUS.items():
        runs[name] = out / f"{name}.csv"
        fresh = {"model": copy.deepcopy(_UNTRAINED[name])} if name in _UNTRAINED else {}
        train(runs[name], update_stats=True, **{**kwargs, **fresh})
    return runs


@pytest.mark.parametrize("name", list(CORPUS))
def test_the_update_norm_changes_no_verdict_of_the_corpus(
    name: str, corpus_with_update_norm: dict[str, Path], corpus: dict[str, tuple[Path, list[float]]]
) -> None:
    """With the update norm in the log, each labelled run keeps its verdict and findings: none of them
    has an update spike without a gradient spike (SGD, momentum, AdamW, warm-up, a GradScaler, a
    blow-up, corrupted batches), and each gets an ``UpdateClip`` suggestion."""
    with_update = analyze(read_log(corpus_with_update_norm[name]))
    without = analyze(read_log(corpus[name][0]))
    assert with_update["update"]["recorded"] > 0
    assert [f["kind"] for f in with_update["findings"]] == [f["kind"] for f in without["findings"]]
    assert with_update["verdict"] == CORPUS[name][1]
    assert with_update["update"]["suggested"]["max_norm"] > 0


def test_early_blowup_is_real(corpus: dict[str, tuple[Path, list[float]]]) -> None:
    """The exploding run's loss did rise above 10x its start (the label is true), healthy ones fell."""
    losses = corpus["early-blowup"][1]
    assert any(not math.isfinite(v) or v > 10 * losses[0] for v in losses[:50])
    for name in ("healthy-sgd", "healthy-adamw", "healthy-clipped"):
        losses = corpus[name][1]
        assert sum(losses[-20:]) / 20 < losses[0]


def test_suggested_max_norm_makes_the_exploding_run_train(
    corpus: dict[str, tuple[Path, list[float]]], tmp_path: Path
) -> None:
    """Re-training the exploding run with the suggested max_norm stays finite and ends below its start loss."""  # noqa: E501
    report = analyze(read_log(corpus["early-blowup"][0]))
    suggested = report["suggested_max_norm"]
    assert report["clipping"]["assessment"] == "missing"
    losses = train(tmp_path / "retrained.csv", CORPUS["early-blowup"][0]["make_opt"], max_norm=suggested)
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-20:]) / 20 < losses[0]


def test_labels_of_growth_and_overflow_runs_are_true(corpus: dict[str, tuple[Path, list[float]]]) -> None:
    """The slow-growth run's loss grows geometrically to a non-finite value; the GradScaler run had
    overflow updates (reason 'overflow') and learned."""
    losses = corpus["slow-growth-to-overflow"][1]
    assert not math.isfinite(losses[-1])
    assert all(b > a for a, b in itertools.pairwise(losses[20:61]))
    log = read_log(corpus["gradscaler-overflows"][0])
    assert set(log.reason.values()) == {"overflow"} and len(log.reason) >= 3
    losses = corpus["gradscaler-overflows"][1]
    assert sum(losses[-20:]) / 20 < losses[0]


def test_conv_batchnorm_run_learns_and_its_conv_biases_get_no_gradient(
    corpus: dict[str, tuple[Path, list[float]]],
) -> None:
    """The label of the Conv+BatchNorm run is true -- it learns (the loss falls to under half its start)
    and the conv biases' gradient norms are below 1e-5 of their weights' in every per-layer row (zero
    by construction) -- and the report says so in a note while its verdict stays healthy."""
    path, losses = corpus["healthy-conv-batchnorm"]
    assert sum(losses[-20:]) / 20 < 0.5 * sum(losses[:3]) / 3
    log = read_log(path)
    assert len(log.layer_rows) >= 10
    for conv in ("0", "3"):
        bias, weight = log.layers[f"{conv}.bias"]["grad_norm"], log.layers[f"{conv}.weight"]["grad_norm"]
        assert all(b < 1e-5 * w for b, w in zip(bias, weight, strict=True))
    report = analyze(log)
    assert report["verdict"] == "healthy" and not report["findings"]
    note = next(n for n in report["notes"] if "zero by construction" in n)
    assert note.startswith(
        "2 parameter(s) with a gradient far below that of another parameter of the same module: "
        "0.bias (median "
    )
    assert "; 0.weight " in note and "3.bias (median " in note and "; 3.weight " in note


def test_vanishing_is_not_taken_for_zero_by_construction(corpus: dict[str, tuple[Path, list[float]]]) -> None:
    """In the deep-sigmoid run, weight and bias of each vanishing layer shrink together (within 10x of
    each other in every module), so every vanishing finding stays, none becomes a note."""
    log = read_log(corpus["vanishing-deep-sigmoid"][0])
    report = analyze(log)
    layers = [f["layer"] for f in report["findings"] if f["kind"] == "vanishing"]
    assert layers[:2] == ["0.weight", "0.bias"] and len(layers) >= 10
    assert not any("zero by construction" in n for n in report["notes"])


@pytest.mark.parametrize("name", ["early-blowup", "slow-growth-to-overflow"])
def test_references_of_an_exploded_run_come_from_before_the_blow_up(
    corpus: dict[str, tuple[Path, list[float]]], name: str
) -> None:
    """AutoClip's percentile, Pascanu's range and the ZClip bound of an exploded run are computed (NumPy
    here) on the norms before the blow-up -- before the explosion's first step and the first norm above
    10x the start (median of the first 3) -- not on norms that reach 1e16 and more; the rules say so."""
    with corpus[name][0].open(newline="") as f:
        norms = np.array([float(r["total_norm"]) for r in csv.DictReader(f)])
    assert np.nanmax(norms[np.isfinite(norms)]) > 1e15  # the label is true: the norms blew up
    report = analyze(read_log(corpus[name][0]))
    onset = min(f["step"] for f in report["findings"] if f["kind"] in ("blowup", "growth")) - 1
    start = float(np.median(norms[:3]))
    end = min(onset, int(np.argmax(norms > 10 * start)))
    stretch = norms[:end]
    sug = {s["name"]: s for s in report["suggestions"]}
    assert sug["autoclip"]["value"] == pytest.approx(np.percentile(stretch, 10), rel=1e-12)
    assert sug["pascanu"]["low"] == pytest.approx(0.5 * stretch.mean(), rel=1e-12)
    assert sug["pascanu"]["high"] == pytest.approx(10 * stretch.mean(), rel=1e-12)
    assert sug["zclip"]["value"] == pytest.approx(stretch.mean() + 2.5 * stretch.std(), rel=1e-12)
    assert f"of the {end} finite norms before step {end + 1} (AutoClip" in sug["autoclip"]["rule"]
    assert f"before step {end + 1} (Pascanu" in sug["pascanu"]["rule"]


def test_cli_json_and_text_on_a_corpus_run(
    corpus: dict[str, tuple[Path, list[float]]], capsys: pytest.CaptureFixture[str]
) -> None:
    """--json has verdict, findings (kind, step, layer, evidence), the suggestion and the clipped fraction;
    the text starts with the verdict line naming step and layer."""
    path = corpus["nan-first-layer"][0]
    assert main(["report", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "nonfinite"
    head = report["findings"][0]
    assert {"kind", "step", "layer", "evidence"} <= set(head)
    assert (head["kind"], head["step"], head["layer"]) == ("nonfinite", 21, "0.weight")
    assert "in its own per-layer row" in head["evidence"]
    assert report["suggested_max_norm"] > 0 and report["clipping"]["clipped_fraction"] == 0.0
    assert main(["report", str(path)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("verdict: nonfinite (non-finite gradient; step 21, layer 0.weight)")
    assert "Suggested max_norm: " in text


def test_plot_has_the_loss_panel(corpus: dict[str, tuple[Path, list[float]]], tmp_path: Path) -> None:
    """--plot writes a PNG with three panels (norm, loss, per-layer heatmap) for a run with all three."""
    pytest.importorskip("matplotlib")
    from clipopt._report.plot import plot_log

    path = corpus["nan-first-layer"][0]
    log = read_log(path)
    figures: list[Any] = []
    import matplotlib.figure

    original = matplotlib.figure.Figure.savefig

    def keep(self: Any, *args: Any, **kwargs: Any) -> None:
        figures.append(self)
        original(self, *args, **kwargs)

    matplotlib.figure.Figure.savefig = keep  # type: ignore[method-assign]
    try:
        plot_log(log, analyze(log), tmp_path / "p.png")
    finally:
        matplotlib.figure.Figure.savefig = original  # type: ignore[method-assign]
    axes = figures[0].axes
    assert [ax.get_ylabel() for ax in axes] == ["gradient norm", "loss", ""]
    colorbar = axes[2].child_axes[0]  # beside the heatmap, not taking width from it
    assert colorbar.get_ylabel() == "log10 grad_norm"
    figures[0].canvas.draw()
    heat, bar = axes[2].get_position(), colorbar.get_position()
    assert bar.x0 >= heat.x1 and axes[0].get_position().x1 == pytest.approx(heat.x1)
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _figure(log: Any, tmp_path: Path) -> Any:
    """The figure ``plot_log`` draws for ``log`` (and saves under tmp_path), drawn once more so that the
    positions in display coordinates are final."""
    from clipopt._report.plot import plot_log

    fig = plot_log(log, analyze(log), tmp_path / "plot.png")
    fig.canvas.draw()
    return fig


def _collection(ax: Any, label: str) -> Any:
    """The scatter of ``ax`` with that legend label (the labels there are in the failure message)."""
    found = [c for c in ax.collections if c.get_label() == label]
    assert len(found) == 1, [c.get_label() for c in ax.collections]
    return found[0]


def _inside(ax: Any, collection: Any) -> bool:
    """Every marker of ``collection`` lies inside ``ax`` (display coordinates) and is clipped to it."""
    points = collection.get_offset_transform().transform(collection.get_offsets())
    box = ax.get_window_extent()
    xs, ys = points[:, 0], points[:, 1]
    inside = (xs >= box.x0) & (xs <= box.x1) & (ys >= box.y0) & (ys <= box.y1)
    return bool(inside.all()) and collection.get_clip_on()


def _legend_labels(ax: Any) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_plot_of_a_run_ending_in_skipped_nonfinite_updates(
    corpus: dict[str, tuple[Path, list[float]]], tmp_path: Path
) -> None:
    """The slow-growth run, its data non-finite from step 168 on, ends in 33 non-finite, skipped updates
    (steps 168-200; before #35 the run itself got there, its float32 norm overflowing, which is now
    taken without overflow and clipped): the x axis spans all 200 steps, their crosses sit at those
    steps inside the norm panel (not over the legend) and the legend says what they are."""
    pytest.importorskip("matplotlib")
    path = tmp_path / "slow-growth-to-nan.csv"

    def nan_from_168(step: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (x * math.nan, y) if step >= 168 else (x, y)

    name = "slow-growth-to-overflow"
    train(path, **{**CORPUS[name][0], "model": copy.deepcopy(_UNTRAINED[name])}, corrupt=nan_from_168)
    log = read_log(path)
    bad = [s for s, x in zip(log.steps, log.total_norm, strict=True) if not math.isfinite(x)]
    assert bad == list(range(168, 201))  # the label is true
    bad_losses = sum(1 for x in log.loss if not math.isfinite(x))
    fig = _figure(log, tmp_path)
    norm_ax, loss_ax = fig.axes
    lo, hi = norm_ax.get_xlim()
    assert lo <= 1 and hi >= 200 and loss_ax.get_xlim() == (lo, hi)
    crosses = _collection(norm_ax, f"non-finite, skipped ({len(bad)})")
    assert list(crosses.get_offsets()[:, 0]) == bad
    assert _inside(norm_ax, crosses)
    assert _legend_labels(norm_ax) == [
        "total norm (pre-clip)",
        f"suggested max_norm {analyze(log)['suggested_max_norm']:.4g}",
        "explosion (step 6)",
        f"non-finite, skipped ({len(bad)})",
    ]
    losses = _collection(loss_ax, f"non-finite loss ({bad_losses})")
    assert _inside(loss_ax, losses)


def _applied_nan_run(path: Path) -> None:
    """A run with skipping off and a nan put into one gradient at step 120: applied, the parameters go
    non-finite and every later norm too."""
    train(
        path,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05),
        nan_at=(120, "2.weight"),
        skip_nonfinite=False,
        layer_stats=False,
    )


def test_plot_does_not_call_applied_nonfinite_updates_skipped(tmp_path: Path) -> None:
    """Non-finite updates that were applied (skip_nonfinite=False) are "non-finite, applied" in a clipopt
    log and "non-finite" in a log with only step, norm and loss (which records no skips); never
    "skipped".  The x axis spans every step, the crosses are inside the panel."""
    pytest.importorskip("matplotlib")
    _applied_nan_run(tmp_path / "applied.csv")
    with (tmp_path / "applied.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert sum(r["skipped"] == "1" for r in rows) == 0  # the label is true: nothing skipped
    bad = [int(r["step"]) for r in rows if not math.isfinite(float(r["total_norm"]))]
    assert bad == list(range(120, 201))
    with (tmp_path / "plain.csv").open("w", newline="") as f:  # a user's own logger: no skip column
        writer = csv.writer(f)
        writer.writerow(["step", "grad_norm", "loss"])
        writer.writerows([r["step"], r["total_norm"], r["loss"]] for r in rows)
    for name, label in (("applied.csv", "non-finite, applied (81)"), ("plain.csv", "non-finite (81)")):
        norm_ax = _figure(read_log(tmp_path / name), tmp_path)
        norm_ax = norm_ax.axes[0]
        assert not any("skipped" in text for text in _legend_labels(norm_ax)), name
        crosses = _collection(norm_ax, label)
        assert list(crosses.get_offsets()[:, 0]) == bad and _inside(norm_ax, crosses)
        lo, hi = norm_ax.get_xlim()
        assert lo <= 1 and hi >= 200


def test_plot_marks_skipped_spikes_on_the_line(tmp_path: Path) -> None:
    """A SpikeGuard skips the two corrupted batches (steps 80 and 140; finite norms): they are red
    crosses at their own norm, labelled "skipped (2)", inside the panel; nothing is drawn as non-finite."""
    pytest.importorskip("matplotlib")
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.02)  # noqa: E731
    train(tmp_path / "guarded.csv", sgd, corrupt=_corrupted, spike_guard=SpikeGuard(window=32))
    log = read_log(tmp_path / "guarded.csv")
    assert log.reason == {79: "spike", 139: "spike"}  # the label is true
    norm_ax = _figure(log, tmp_path).axes[0]
    crosses = _collection(norm_ax, "skipped (2)")
    assert [list(p) for p in crosses.get_offsets()] == [[80, log.total_norm[79]], [140, log.total_norm[139]]]
    assert _inside(norm_ax, crosses)
    assert not any("non-finite" in text for text in _legend_labels(norm_ax))


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = torch.nn.ModuleDict(
            {"q_proj": torch.nn.Linear(8, 8), "k_proj": torch.nn.Linear(8, 8)}
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.self_attn["q_proj"](x)) * torch.sigmoid(self.self_attn["k_proj"](x))


class _Decoder(torch.nn.Module):
    """Parameter names as a Hugging Face decoder's: ``model.layers.<i>.self_attn.q_proj.weight``."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(_Block() for _ in range(depth))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.model.layers:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def test_heatmap_labels_keep_the_layer_index(tmp_path: Path) -> None:
    """The heatmap's rows of a decoder with 12 layers are labelled with the layer index and the
    parameter kept (``…10.self_attn.q_proj.weight``), every label distinct; names that fit are whole."""
    pytest.importorskip("matplotlib")
    torch.manual_seed(0)
    train(
        tmp_path / "dec.csv",
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
        model=_Decoder(12),
        steps=20,
    )
    log = read_log(tmp_path / "dec.csv")
    heat = _figure(log, tmp_path).axes[2]
    labels = [t.get_text() for t in heat.get_yticklabels()]
    assert len(log.layers) == 12 * 4 + 2 and len(labels) == 25  # every 2nd of 50 names
    names = [
        f"…{i}.self_attn.{p}_proj.{kind}" for i in range(12) for p in "qk" for kind in ("weight", "bias")
    ]
    expected = [*names[::2], "head.weight"]
    assert len(set(labels)) == 25  # layers 0 and 10 apart
    assert labels == expected


def _classifier_diverging_to_chance(path: Path, jump_at: int, steps: int) -> list[float]:
    """Adam on a 10-class problem (cross-entropy) that learns, then its lr jumps 500x (a bad
    schedule) and the run falls back to chance, where it stays; losses returned."""
    torch.manual_seed(0)
    w = torch.randn(20, 10)
    lin, relu = torch.nn.Linear, torch.nn.ReLU
    net = torch.nn.Sequential(lin(20, 64), relu(), lin(64, 64), relu(), lin(64, 10))
    inner = torch.optim.Adam(net.parameters(), lr=1e-3)
    opt = ClippedOptimizer(inner, loggers=[CSVLogger(path)])
    losses = []
    for step in range(steps):
        if step == jump_at:
            for group in inner.param_groups:
                group["lr"] = 0.5
        x = torch.randn(64, 20, generator=torch.Generator().manual_seed(step))
        loss = torch.nn.functional.cross_entropy(net(x), (x @ w).argmax(1))
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
        losses.append(float(loss.detach()))
    opt.close()
    return losses


def test_divergence_back_to_chance_is_exploding(tmp_path: Path) -> None:
    """A classifier that learned to a fraction of its start loss and then diverged back to chance for
    the rest of the run (its loss never above its start's) is ``exploding`` from the divergence, and
    the advice is the learning rate, which jumped there (not a max_norm)."""
    path = tmp_path / "diverged.csv"
    losses = _classifier_diverging_to_chance(path, jump_at=600, steps=900)
    chance = math.log(10)
    before, after = sorted(losses[550:600])[25], sorted(losses[-100:])[50]
    assert before < 0.5 and abs(after - chance) < 0.1  # the label is true: learned, then back to chance
    report = analyze(read_log(path))
    assert report["verdict"] == "exploding", report["findings"]
    head = report["findings"][0]
    assert head["kind"] == "blowup" and 600 < head["step"] <= 610
    # the norm did not grow before the loss did (Adam's step does not follow the gradient's size): the
    # advice is the learning rate the log recorded there, not a max_norm (#33)
    assert not any(f["kind"] == "growth" and f["step"] <= head["step"] for f in report["findings"])
    assert report["clipping"]["assessment"] == "learning rate"
    assert f"lower the learning rate (lr 0.5 at step {head['step']})" in report["clipping"]["advice"]


@pytest.mark.parametrize(("layer_stats", "nan_step"), [(10, 60), (1000, 57)])
def test_nonfinite_layer_with_a_frozen_layer_in_the_optimizer(
    tmp_path: Path, layer_stats: int, nan_step: int
) -> None:
    """Fine-tuning with the first layer frozen but still given to the optimizer: its per-layer cells
    have no gradient norm (nan), so the layer named for a non-finite update -- on a due per-layer row
    (step 60, layer_stats=10) or on the bad window's own row (step 57) -- is the parameter that went
    bad, not the frozen one."""
    model = _mlp()
    for p in model[0].parameters():
        p.requires_grad_(False)
    train(
        tmp_path / "frozen.csv",
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
        model=model,
        layer_stats=layer_stats,
        nan_at=(nan_step, "4.bias"),
    )
    log = read_log(tmp_path / "frozen.csv")
    pos = list(log.layer_rows).index(nan_step - 1)
    assert math.isnan(log.layers["0.weight"]["grad_norm"][pos])  # the label is true: no gradient there
    report = analyze(log)
    assert report["verdict"] == "nonfinite"
    head = report["findings"][0]
    assert (head["step"], head["layer"]) == (nan_step, "4.bias")
    assert list(head["values"]["nonfinite_layers"]) == ["4.bias"]


class _SideInput(torch.nn.Module):
    """``deep`` reads the first four features; ``mid`` reads ``deep``'s output plus the last four
    (a side input, as a skip connection from the data would): a huge side value makes ``mid``'s
    gradient overflow to ``inf`` while ``deep``'s stays finite (but its float32 norm overflows)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.deep = torch.nn.Linear(4, 4)
        self.mid = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mid(torch.tanh(self.deep(x[:, :4])) + x[:, 4:])


def _side_input_run(
    csv: Path, snapshots: Path | None, layer_stats: int, bad_step: int, side: float
) -> ClippedOptimizer:
    """SGD on ``_SideInput`` for 30 steps, one batch at ``bad_step`` with a side input of ``side``
    (a snapshot of an anomaly computes the full statistics: the window's own row is then those)."""
    model = _SideInput()
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        max_norm=1.0,
        param_names=model.named_parameters(),
        layer_stats=layer_stats,
        loggers=[CSVLogger(csv)],
        snapshot_dir=snapshots,
    )
    for step in range(1, 31):
        x, y = _data(step)
        if step == bad_step:
            x = x.clone()
            x[0, 4:] = side
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if step == bad_step:  # what the label claims: deep's gradient finite, mid's holds inf
            grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            assert torch.isfinite(grads["deep.weight"]).all()
            if side > 1e29:  # deep's norm overflows, mid holds the inf
                assert not torch.isfinite(torch.linalg.vector_norm(grads["deep.weight"]))
                assert (grads["mid.weight"].abs() == math.inf).any()
            else:  # every element finite, the total norm (as clip_grad_norm_ takes it) not
                assert all(torch.isfinite(g).all() for g in grads.values())
                assert torch.nn.utils.get_total_norm(list(grads.values())) == math.inf
        opt.step(loss=loss)
        opt.zero_grad()
    opt.close()
    return opt


@pytest.mark.parametrize(("layer_stats", "bad_step"), [(10, 17), (10, 20), (1, 17)])
def test_nonfinite_layer_behind_a_layer_whose_float32_norm_overflows(
    tmp_path: Path, layer_stats: int, bad_step: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real run in which ``deep.weight``'s gradient is finite (elements ~1e27, so its float32 norm
    overflows) and ``mid.weight``'s, later in parameter order, holds the inf: the per-layer row --
    the window's own (step 17 with layer_stats=10) or the due statistics -- flags ``mid.weight``
    only, and ``clipopt report`` and ``clipopt inspect`` name it (before: ``deep.weight``)."""
    snaps = tmp_path / "snaps"
    for log_path, snapshots in ((tmp_path / "run.csv", None), (tmp_path / "snapshotted.csv", snaps)):
        _side_input_run(log_path, snapshots, layer_stats, bad_step, side=1e30)
        log = read_log(log_path)
        pos = list(log.layer_rows).index(bad_step - 1)
        flags = {name: log.layers[name]["nonfinite"][pos] for name in log.layers}
        assert flags["mid.weight"] >= 1 and flags["deep.weight"] == 0 and flags["deep.bias"] == 0
        report = analyze(log)
        assert report["verdict"] == "nonfinite"
        head = report["findings"][0]
        assert (head["step"], head["layer"]) == (bad_step, "mid.weight")
        assert main(["report", str(log_path)]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"verdict: nonfinite (non-finite gradient; step {bad_step}, layer mid.weight)")
    (snapshot,) = snaps.glob("*.pt")
    assert main(["inspect", str(snapshot), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["nonfinite_parameters"] == ["mid.weight"]


def test_a_window_whose_float32_norm_overflows_on_finite_gradients_is_clipped(tmp_path: Path) -> None:
    """A real run whose bad batch makes every gradient finite (``mid.weight`` ~1e28) but the float32
    total norm overflow (as clip_grad_norm_ takes it): the norm is taken without overflow (#35), the
    window is clipped and applied (before: skipped with reason 'norm_overflow'), its finite norm
    logged; the report finds no skip in it."""
    csv = tmp_path / "run.csv"
    opt = _side_input_run(csv, None, 10, 17, side=1e15)
    assert opt.num_skipped == 0
    log = read_log(csv)
    assert log.reason == {} and 1e25 < log.total_norm[16] < math.inf


def test_an_earlier_logs_norm_overflow_skip_still_reads_as_an_explosion(tmp_path: Path) -> None:
    """A log written before #35, where such a window was skipped with reason 'norm_overflow' (the
    real run's row 17 as that version wrote it): the report still calls it an explosion at that
    step, naming no non-finite layer."""
    csv = tmp_path / "run.csv"
    _side_input_run(csv, None, 10, 17, side=1e15)
    lines = csv.read_text().splitlines()
    header = lines[0].split(",")
    row = lines[17].split(",")
    assert row[0] == "17"
    for column, value in (
        ("total_norm", "inf"),
        ("clip_coef", "0.0"),
        ("clipped", "1"),
        ("skipped", "1"),
        ("reason", "norm_overflow"),
    ):
        row[header.index(column)] = value
    lines[17] = ",".join(row)
    csv.write_text("\n".join(lines) + "\n")
    log = read_log(csv)
    assert log.reason == {16: "norm_overflow"} and log.total_norm[16] == math.inf
    report = analyze(log)
    assert report["verdict"] == "exploding"
    head = report["findings"][0]
    assert (head["kind"], head["step"], head["layer"]) == ("nonfinite", 17, None)
    assert head["evidence"].endswith(
        "its gradients were finite, their float32 norm overflowed (reason 'norm_overflow')"
    )


class _BiaslessDeepSigmoid(torch.nn.Module):
    """A 14-layer sigmoid MLP without biases whose weights are one ``nn.ParameterList`` (``ws.0`` ...
    ``ws.14``): every weight is a parameter of the same module, ``ws``."""

    def __init__(self, depth: int = 14, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        dims = [8] + [width] * depth + [1]
        self.ws = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(o, i) / i**0.5) for i, o in itertools.pairwise(dims)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, w in enumerate(self.ws):
            x = x @ w.T
            x = torch.sigmoid(x) if k < len(self.ws) - 1 else x
        return x


def test_vanishing_weights_of_one_parameter_list_are_not_zero_by_construction(tmp_path: Path) -> None:
    """A deep sigmoid MLP whose bias-free weights sit in one ParameterList (one module, ``ws``) vanishes:
    the first weight's median gradient norm is below 1e-3 of the median over layers (checked here from
    the CSV) and the report says ``vanishing`` at ``ws.0`` -- another layer's weight of the same
    module is no evidence that the gradient is zero by construction (only a bias against its own
    weight is)."""
    path = tmp_path / "paramlist.csv"
    train(path, lambda m: torch.optim.SGD(m.parameters(), lr=0.05), model=_BiaslessDeepSigmoid())
    with path.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["ws.0.grad_norm"]]
    medians = {k: float(np.median([float(r[f"ws.{k}.grad_norm"]) for r in rows])) for k in range(15)}
    assert medians[0] < 1e-3 * float(np.median(list(medians.values())))  # the label is true
    report = analyze(read_log(path))
    assert report["verdict"] == "vanishing"
    assert report["findings"][0]["layer"] == "ws.0"
    assert not any("zero by construction" in n for n in report["notes"])


def test_a_blow_up_in_the_first_updates_leaves_its_norms_out_of_the_suggestion(tmp_path: Path) -> None:
    """Full-batch regression with SGD at 3001 / lambda_max multiplies the error ~3000x per update: the
    norm of the second update is already over 1000x the first's. The healthy stretch is the first
    update alone -- each of the first START_ROWS norms is compared with the start norms before it --
    so the suggestion (the stretch's median) and the reference values are that first norm (read from
    the CSV), "before step 2", not the mean of the first and the blown-up second (~5000)."""
    path = tmp_path / "early.csv"
    lr = 3001 / _LAMBDA_MAX
    train(path, lambda m: torch.optim.SGD(m.parameters(), lr=lr), model=_linear(), data=_full_batch, steps=30)
    with path.open(newline="") as f:
        norms = [float(r["total_norm"]) for r in csv.DictReader(f)]
    assert norms[1] > 1000 * norms[0]  # the label is true: the second update already blew up
    report = analyze(read_log(path))
    assert report["verdict"] == "exploding"
    assert report["suggested_max_norm"] == pytest.approx(norms[0], rel=1e-12)
    sug = {s["name"]: s for s in report["suggestions"]}
    assert sug["autoclip"]["value"] == pytest.approx(norms[0], rel=1e-12)
    assert sug["pascanu"]["high"] == pytest.approx(10 * norms[0], rel=1e-12)
    assert "of the 1 finite norms before step 2 (AutoClip" in sug["autoclip"]["rule"]


def test_heatmap_labels_of_encoder_and_decoder_stay_apart() -> None:
    """The parameter names of torch's own nn.Transformer: ``encoder.layers.0.self_attn.in_proj_weight``
    and ``decoder.layers.0.self_attn.in_proj_weight`` differ only in their first part, which the
    shortening dropped (both ``…0.self_attn.in_proj_weight``); every label is now distinct, within
    the width, and keeps encoder/decoder."""
    model = torch.nn.Transformer(
        d_model=8, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=8
    )
    names = [n for n, _ in model.named_parameters()]
    labels = short_names(names)
    assert len(set(labels)) == len(names)
    assert all(len(label) <= 28 for label in labels)
    label = dict(zip(names, labels, strict=True))
    assert label["encoder.layers.0.self_attn.in_proj_weight"] == "encoder…0…in_proj_weight"
    assert label["decoder.layers.0.self_attn.in_proj_weight"] == "decoder…0…in_proj_weight"
    assert label["encoder.layers.1.linear1.bias"] == "encoder…1.linear1.bias"
    assert label["decoder.layers.1.norm3.weight"] == "…layers.1.norm3.weight"  # only the decoder has norm3
