"""``clipopt report`` on logs with the update norm (``update_stats=True``, ``update_clip=``): the
update-spike rule and the suggested ``UpdateClip`` (docs/choosing-max-norm.md, 'The update norm').

Every log comes from a real training run: a small network trained by ``ClippedOptimizer(AdamW,
max_norm=1.0, update_stats=True)`` with a :class:`~clipopt.CSVLogger` and a
:class:`~clipopt.TensorBoardLogger`.  Its ``rare`` layer reads 256 features that are zero in every
batch but one (a rare token's embedding): its gradient is 0 for 349 updates, then small, and
Adam's second moment, still near zero, turns that small gradient into a full-size step on all 256
weights -- the update norm jumps about 10x while the gradient norm stays ordinary.  The expected
steps, values and suggestions are recomputed here with NumPy from the CSV's columns (the rule as the
documentation states it), and the suggested bounds are tried with the real ``UpdateClip``.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from clipopt import ClippedOptimizer, CSVLogger, TensorBoardLogger, UpdateClip
from clipopt._report import evidence
from clipopt._report.plot import plot_log
from clipopt._report.report import analyze, format_report, read_log

from ..helpers import run_cli

STEPS = 400
#: The one update whose batch has the rare features.
RARE_STEP = 350

ADVICE = (
    "the inner optimizer's state amplified an ordinary gradient (e.g. Adam's second moment, still "
    "small after a quiet stretch of a parameter); bound the update: "
    "update_clip=UpdateClip(max_norm=...) or UpdateClip(z=...) (suggested below)"
)


class RareFeatureNet(torch.nn.Module):
    """An MLP on 8 dense features plus a linear read-out of 256 rare ones."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.rare = torch.nn.Linear(256, 1, bias=False)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return self.body(x) + self.rare(r)


def train(
    folder: Path,
    *,
    rare_step: int | None = RARE_STEP,
    bad_batch: int | None = None,
    lr_jump: int | None = None,
    max_norm: float | None = 1.0,
    update_stats: bool = True,
    update_clip: UpdateClip | None = None,
    tensorboard: bool = False,
) -> ClippedOptimizer:
    """Train ``STEPS`` updates, logging to ``folder/grads.csv`` (and ``folder/tb``: ``tensorboard``).

    ``rare_step``: the batch with the rare features; ``bad_batch``: a batch whose targets are off by
    10 (a gradient spike); ``lr_jump``: the learning rate is 4x from that update on (a warm restart);
    ``max_norm``: the gradient clipping's bound."""
    torch.manual_seed(0)
    net = RareFeatureNet()
    inner = torch.optim.AdamW(net.parameters(), lr=1e-3)
    opt = ClippedOptimizer(
        inner,
        max_norm=max_norm,
        update_stats=update_stats and update_clip is None,
        update_clip=update_clip,
        loggers=[
            CSVLogger(folder / "grads.csv"),
            *([TensorBoardLogger(folder / "tb", histograms=False)] if tensorboard else []),
        ],
    )
    for step in range(1, STEPS + 1):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(32, 8, generator=g)
        y = (x[:, :4].sum(1, keepdim=True) - x[:, 4:].sum(1, keepdim=True)).tanh() - 10.0 * (
            step == bad_batch
        )
        r = torch.randn(32, 256, generator=g) * 0.1 if step == rare_step else torch.zeros(32, 256)
        if step == lr_jump:
            inner.param_groups[0]["lr"] *= 4.0
        loss = torch.nn.functional.mse_loss(net(x, r), y)
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
    opt.close()
    return opt


def columns(path: Path) -> dict[str, np.ndarray]:
    """The CSV's columns as float arrays (``reason`` left out)."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    return {k: np.array([float(r[k]) if r[k] else math.nan for r in rows]) for k in rows[0] if k != "reason"}


def outliers(x: np.ndarray) -> list[tuple[int, float, float]]:
    """``(row, ratio to the mean, z)`` of the values that are spikes by the documented rule: the
    log's z-score over the previous up to 128 finite positive values (at least 16) above 5, and at
    least 2x their mean."""
    rows = np.flatnonzero(np.isfinite(x) & (x > 0))
    out = []
    for k in range(16, len(rows)):
        prev = x[rows[max(0, k - 128) : k]]
        mean_log, std_log = np.log(prev).mean(), np.log(prev).std()
        z = (math.log(x[rows[k]]) - mean_log) / std_log
        if z > 5 and x[rows[k]] >= 2 * prev.mean():
            out.append((int(rows[k]), float(x[rows[k]] / prev.mean()), float(z)))
    return out


def update_spikes(c: dict[str, np.ndarray]) -> list[tuple[int, float, float]]:
    """The update spikes (per unit of learning rate) with no gradient spike at their row or in the
    10 rows before."""
    grad_rows = {r for r, _, _ in outliers(c["total_norm"])}
    found = outliers(c["update_norm"] / c["lr"])
    return [s for s in found if not grad_rows & set(range(s[0] - 10, s[0] + 1))]


def num(v: float) -> str:
    return f"{v:.4g}"


def expected_evidence(c: dict[str, np.ndarray]) -> str:
    """The ``update_spikes`` evidence line, its numbers computed from the CSV's columns."""
    spikes = update_spikes(c)
    row, ratio, z = max(spikes, key=lambda s: s[2])
    grad = c["total_norm"]
    steps = ", ".join(str(int(c["step"][r])) for r, _, _ in spikes)
    return (
        f"  - [update_spikes] {len(spikes)} update-norm spike(s) without a gradient-norm spike (log of the "
        "update norm per unit of learning rate: z > 5 over the previous up to 128 updates and >= 2x their "
        f"mean; no gradient-norm spike at that step or in the 10 before it) at step(s) {steps}; largest at "
        f"step {int(c['step'][row])}: update norm {num(c['update_norm'][row])}, {num(ratio)}x the rolling "
        f"mean, z = {num(z)}, while the gradient norm was {num(grad[row])}, "
        f"{num(grad[row] / grad[max(0, row - 128) : row].mean())}x its rolling mean: {ADVICE}"
    )


def healthy_rows(c: dict[str, np.ndarray]) -> np.ndarray:
    """The rows of the healthy stretch: every update spike and gradient spike and the 10 rows after
    each left out."""
    spikes = {r for r, _, _ in outliers(c["total_norm"])} | {
        r for r, _, _ in outliers(c["update_norm"] / c["lr"])
    }
    out = {r + k for r in spikes for k in range(11)}
    return np.array([r for r in range(len(c["step"])) if r not in out])


def smallest_z(c: dict[str, np.ndarray]) -> float:
    """UpdateClip's history replayed (the last 128 update norms, a bound from 64 on): the smallest z in
    half steps, at least 3, under which no row of the healthy stretch exceeds mean + z * std."""
    u, keep = c["update_norm"], set(healthy_rows(c).tolist())
    need = [
        (u[r] - u[max(0, r - 128) : r].mean()) / max(u[max(0, r - 128) : r].std(), 1e-6)
        for r in range(64, len(u))
        if r in keep
    ]
    return max(3.0, math.ceil(2 * max(need)) / 2)


@pytest.fixture(scope="module")
def spiky(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ClippedOptimizer]:
    folder = tmp_path_factory.mktemp("spiky")
    return folder, train(folder, tensorboard=True)


def test_the_readers_read_the_update_norm_and_coefficient(spiky: tuple[Path, ClippedOptimizer]) -> None:
    """The CSV and TensorBoard readers give each window's ``StepStats.update_norm`` and
    ``update_coef`` (float32 in TensorBoard) and name the column or tag read."""
    folder, opt = spiky
    want_norm = [s.update_norm for s in opt.stats]
    want_coef = [s.update_coef for s in opt.stats]
    from_csv, from_tb = read_log(folder / "grads.csv"), read_log(folder / "tb")
    assert list(from_csv.update_norm) == want_norm and list(from_csv.update_coef) == want_coef
    assert from_csv.update_column == "update_norm" and from_tb.update_column == "clipopt/update_norm"
    np.testing.assert_allclose(from_tb.update_norm, want_norm, rtol=1e-6)
    np.testing.assert_allclose(from_tb.update_coef, want_coef, rtol=1e-6)
    assert "update_norm" not in from_csv.ignored and "clipopt/update_coef" not in from_tb.ignored


def test_an_update_spike_without_a_gradient_spike_is_a_finding(
    spiky: tuple[Path, ClippedOptimizer], capsys: pytest.CaptureFixture[str]
) -> None:
    """The rare batch's update spike (about 10x, its gradient norm ordinary) is the verdict
    ``spikes``, with the evidence line of the documented rule, in the CSV and in TensorBoard."""
    folder, _ = spiky
    c = columns(folder / "grads.csv")
    spikes = update_spikes(c)
    assert spikes and int(c["step"][spikes[0][0]]) == RARE_STEP  # the rare batch, by construction
    assert not {r for r, _, _ in outliers(c["total_norm"])}  # no gradient spike anywhere
    code, out, _ = run_cli(capsys, "report", str(folder / "grads.csv"))
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"verdict: spikes (update norm spikes without a gradient spike; step {RARE_STEP})"
    assert lines[2] == (
        "columns read: total_norm as the norm, loss as the loss, update_norm as the update norm; "
        "ignored: micro_batches, clip_coef"
    )
    assert expected_evidence(c) in lines
    # the run went wrong: the UpdateClip suggestion quotes the stability benchmark (#34); a healthy
    # run's does not (test_a_healthy_run_gets_no_finding_and_an_update_clip_suggestion)
    at = next(i for i, ln in enumerate(lines) if ln.startswith("Suggested update_clip:"))
    said = next(ln for ln in lines[at:] if ln.startswith("  evidence: "))
    assert said == f"  evidence: {evidence.update_bounds()}" and "docs/which-tool.md" in said
    _, out_tb, _ = run_cli(capsys, "report", str(folder / "tb"))
    assert out_tb.splitlines()[0] == lines[0]
    assert out_tb.splitlines()[2] == (
        "tags read: clipopt/total_norm as the norm, clipopt/loss as the loss, clipopt/update_norm as the "
        "update norm; ignored: clipopt/clip_coef, clipopt/micro_batches"
    )
    assert (
        next(ln for ln in out_tb.splitlines() if "[update_spikes]" in ln).split("; largest")[0]
        == (expected_evidence(c).split("; largest")[0])
    )


def test_the_json_suggests_update_clip_bounds_from_the_healthy_stretch(
    spiky: tuple[Path, ClippedOptimizer], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--json``'s ``update``: the column, the applied updates' median and maximum, and the
    suggestion -- the largest update norm of the healthy stretch, and the smallest z (half steps, at
    least 3) UpdateClip's history bounds none of it with -- and how many update spikes each bounds."""
    import json

    folder, _ = spiky
    c = columns(folder / "grads.csv")
    _, out, _ = run_cli(capsys, "report", str(folder / "grads.csv"), "--json")
    update = json.loads(out)["update"]
    u = c["update_norm"]
    healthy = u[healthy_rows(c)]
    spikes = update_spikes(c)
    assert update["column"] == "update_norm" and update["recorded"] == STEPS and update["bounded"] == 0
    assert update["median"] == pytest.approx(float(np.median(u)), rel=1e-12)
    assert update["max"] == float(u.max())
    sug = update["suggested"]
    assert sug["max_norm"] == float(healthy.max()) and sug["healthy_updates"] == len(healthy)
    assert sug["z"] == smallest_z(c) and sug["window"] == 128
    assert sug["spikes"] == len(spikes)
    assert sug["spikes_bounded"]["max_norm"] == sum(u[r] > healthy.max() for r, _, _ in spikes) == len(spikes)


def test_the_suggested_bounds_leave_the_healthy_updates_alone_and_bound_the_spike(
    spiky: tuple[Path, ClippedOptimizer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same run under ``UpdateClip(max_norm=...)`` and ``UpdateClip(z=...)`` as suggested: every
    update before the rare batch is applied whole (coefficient 1), the rare batch's is bounded, and
    the report of that run counts the bounded spikes as handled (a note), not as a finding."""
    folder, _ = spiky
    sug = analyze(read_log(folder / "grads.csv"))["update"]["suggested"]
    for name, bound in (("norm", UpdateClip(max_norm=sug["max_norm"])), ("z", UpdateClip(z=sug["z"]))):
        opt = train(tmp_path / name, update_clip=bound)
        coefs = [s.update_coef for s in opt.stats]
        assert coefs[: RARE_STEP - 1] == [1.0] * (RARE_STEP - 1), name
        assert coefs[RARE_STEP - 1] < 0.5, name
        _, out, _ = run_cli(capsys, "report", str(tmp_path / name / "grads.csv"))
        assert "[update_spikes]" not in out, name
        note = next(ln for ln in out.splitlines() if "bounded by update_clip and the loss" in ln)
        assert note.startswith(f"  - {note.split()[1]} large update norm(s) (at step(s) {RARE_STEP}"), name
        assert note.endswith("they are not counted as update spikes"), name


def test_a_healthy_run_gets_no_finding_and_an_update_clip_suggestion(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without the rare batch: healthy, and the text suggests ``UpdateClip(max_norm=<the largest
    update norm>)`` or ``UpdateClip(z=3)`` with how each was chosen, and sums the update norms up."""
    train(tmp_path, rare_step=None)
    c = columns(tmp_path / "grads.csv")
    assert not outliers(c["update_norm"] / c["lr"]) and not outliers(c["total_norm"])
    _, out, _ = run_cli(capsys, "report", str(tmp_path / "grads.csv"))
    lines = out.splitlines()
    assert lines[0] == "verdict: healthy (no blow-up, non-finite, spiking or vanishing gradients)"
    u = c["update_norm"]
    at = lines.index(
        f"Suggested update_clip: UpdateClip(max_norm={num(u.max())}) or UpdateClip(z={smallest_z(c):g})"
    )
    assert lines[at + 1 : at + 3] == [
        f"  max_norm: the largest of the healthy stretch's {STEPS} update norms (spikes left out): it bounds "
        "no healthy update",
        "  z: the smallest (in half steps, at least 3) under which the bound of UpdateClip(z=..., "
        "window=128) bounds no update of that stretch",
    ]
    assert lines[at + 3] == ""
    median = num(float(np.median(u)))
    assert (
        f"  update norm    median {median}, max {num(u.max())} ({STEPS} applied); bounded by update_clip 0"
        in lines
    )


def test_an_update_spike_that_follows_a_gradient_spike_is_not_a_finding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad batch, not clipped, spikes the gradient norm and the update norm (and Adam's momentum
    carries it into the next updates): the update spikes are the gradient's (the gradient rules
    report it), not ones of their own."""
    train(tmp_path, rare_step=None, bad_batch=300, max_norm=None)
    c = columns(tmp_path / "grads.csv")
    assert [r for r, _, _ in outliers(c["total_norm"])] == [299]
    update_rows = [r for r, _, _ in outliers(c["update_norm"] / c["lr"])]
    assert update_rows[0] == 299 and len(update_rows) > 1  # the update spiked too, and the next ones
    assert all(r <= 299 + 10 for r in update_rows)
    _, out, _ = run_cli(capsys, "report", str(tmp_path / "grads.csv"))
    assert out.splitlines()[0] == "verdict: spikes (gradient norm spikes; step 300)"
    assert "[update_spikes]" not in out


def test_a_learning_rate_jump_is_not_an_update_spike(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A warm restart (the learning rate 4x from update 300 on) multiplies the update norm by 4; per
    unit of learning rate it is ordinary, and the report finds nothing."""
    train(tmp_path, rare_step=None, lr_jump=300)
    c = columns(tmp_path / "grads.csv")
    assert 299 in [r for r, _, _ in outliers(c["update_norm"])]  # the raw update norm jumped
    _, out, _ = run_cli(capsys, "report", str(tmp_path / "grads.csv"))
    assert out.splitlines()[0] == "verdict: healthy (no blow-up, non-finite, spiking or vanishing gradients)"


def test_a_log_without_the_update_norm_reads_as_before(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The rare-batch run without ``update_stats``: no update column, so nothing about the update in
    the text, ``update`` null in the JSON, and the gradient rules alone (healthy)."""
    import json

    train(tmp_path, update_stats=False, tensorboard=True)
    report = analyze(read_log(tmp_path / "grads.csv"))
    assert report["update"] is None and report["verdict"] == "healthy"
    text = format_report(report)
    assert not [
        w for w in ("update norm", "update_norm", "update_clip", "UpdateClip", "update spike") if w in text
    ]
    _, out, _ = run_cli(capsys, "report", str(tmp_path / "tb"), "--json")
    assert json.loads(out)["update"] is None
    _, out, _ = run_cli(capsys, "report", str(tmp_path / "grads.csv"))
    assert out == text + "\n"


def test_norm_option_naming_the_update_norm_reads_it_as_the_norm_alone(
    spiky: tuple[Path, ClippedOptimizer],
) -> None:
    """``--norm update_norm`` reads the update norm as the norm; it is then not also the update norm."""
    from clipopt._report.log import Names

    folder, _ = spiky
    log = read_log(folder / "grads.csv", Names(norm="update_norm"))
    assert log.norm_column == "update_norm" and log.update_column is None and len(log.update_norm) == 0


def test_the_plot_has_an_update_norm_panel(spiky: tuple[Path, ClippedOptimizer], tmp_path: Path) -> None:
    """``--plot`` of a log with the update norm: a panel below the gradient norm's with the update
    norm of every update, the update spikes circled and the suggested ``UpdateClip(max_norm=...)``."""
    pytest.importorskip("matplotlib")
    folder, opt = spiky
    log = read_log(folder / "grads.csv")
    report = analyze(log)
    fig = plot_log(log, report, tmp_path / "p.png")
    norm_ax, update_ax, loss_ax = fig.axes
    assert norm_ax.get_ylabel() == "gradient norm" and update_ax.get_ylabel() == "update norm"
    assert loss_ax.get_ylabel() == "loss"
    line = update_ax.lines[0]
    assert list(line.get_ydata()) == [s.update_norm for s in opt.stats]
    circled = [int(x) for x, _ in update_ax.collections[0].get_offsets()]
    c = columns(folder / "grads.csv")
    assert circled == [int(c["step"][r]) for r, _, _ in update_spikes(c)]
    bound = update_ax.lines[1]
    assert list(bound.get_ydata()) == [report["update"]["suggested"]["max_norm"]] * 2
    assert (
        bound.get_label()
        == f"suggested UpdateClip(max_norm={num(float(c['update_norm'][healthy_rows(c)].max()))})"
    )
