"""The report's advice fixes the run (#33): each rule checked on a small real training run logged with
CSVLogger (the corpus's model and data, tests/report/test_report_corpus.py), whose truth is known
by construction and checked from the losses the run returned.

- the blow-up's onset is where the loss stays up, not a turbulent start that settled;
- a loss that blew up and came back is the learning rate's doing: the report says so;
- loss spikes that clipping does not stop (a bad shard) get SpikeGuard, not "max_norm looks right";
- spikes that SpikeGuard skipped are handled, not the verdict ``spikes``;
- the ``skip=`` list holds the batches that a rewind dropped;
- the run-of-skips warning of a bad shard does not blame the spike rule.
"""

from __future__ import annotations

import functools
import itertools
import statistics
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from clipopt import ClippedOptimizer, CSVLogger, Rewind, SpikeGuard, TensorBoardLogger
from clipopt._report import evidence
from clipopt._report.report import analyze, format_report, read_log

from ..helpers import one_thread
from .test_report_corpus import _LAMBDA_MAX, _data, _full_batch, _linear, _mlp, train

#: The bad shard: steps whose targets are off by SHARD_OFFSET (a corrupted stretch of data).
SHARD = range(120, 136)
SHARD_OFFSET = 25.0


def _bad_shard(step: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (x, y + SHARD_OFFSET) if step in SHARD else (x, y)


Run = Callable[[str], tuple[Path, tuple[float, ...]]]


@pytest.fixture(scope="session")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Each run of this module, trained once per session when first asked for: its CSV and losses."""
    out = tmp_path_factory.mktemp("advice")

    @functools.cache
    def get(name: str) -> tuple[Path, tuple[float, ...]]:
        path = out / f"{name}.csv"
        with one_thread():
            return path, tuple(_RUNS[name](path))

    return get


def _turbulent_then_blowup(path: Path) -> list[float]:
    """Full-batch linear regression with SGD (the error's component along an eigenvector of the
    Hessian is multiplied by ``1 - lr * lambda`` per step): a learning-rate burst at steps 12-15 sends
    the loss hundreds of times over its start, a small learning rate brings it back down and it
    settles; from step 332 the learning rate is past the edge for good and the loss grows
    geometrically to the end (400 steps)."""

    def lr(step: int) -> float:
        if 12 <= step < 16:
            return 4.0 / _LAMBDA_MAX
        if step >= 332:
            return 3.0 / _LAMBDA_MAX
        return (0.1 if step < 12 else 0.05) / _LAMBDA_MAX

    torch.manual_seed(0)
    net = _linear()
    inner = torch.optim.SGD(net.parameters(), lr=lr(1))
    opt = ClippedOptimizer(inner, max_norm=None, loggers=[CSVLogger(path)])
    losses = []
    for step in range(1, 401):
        for group in inner.param_groups:
            group["lr"] = lr(step)
        x, y = _full_batch(step)
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
        losses.append(float(loss.detach()))
    opt.close()
    return losses


def _adamw_lr_one(path: Path) -> list[float]:
    """AdamW at lr 1.0, as a new user would try it: the loss jumps hundreds of times its start in the
    first updates, and comes back down by itself."""
    return train(
        path,
        lambda m: torch.optim.AdamW(m.parameters(), lr=1.0),
        model=_mlp(depth=3, width=32),
        steps=300,
        layer_stats=False,
    )


def _shard_clipped(path: Path) -> list[float]:
    """SGD with max_norm=1.0 through a bad shard (16 batches whose targets are off by 25)."""
    return train(
        path, lambda m: torch.optim.SGD(m.parameters(), lr=0.05), max_norm=1.0, corrupt=_bad_shard, steps=300
    )


def _shard_guarded(path: Path) -> list[float]:
    """The same run with a SpikeGuard instead of clipping (the shard's windows are skipped)."""
    return train(
        path,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05),
        corrupt=_bad_shard,
        steps=300,
        spike_guard=SpikeGuard(window=32),
    )


def _spikes_guarded(path: Path) -> list[float]:
    """Two corrupted batches (steps 80 and 140, targets off by 10) under SpikeGuard."""

    def corrupt(step: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (x, y - 10.0) if step in (80, 140) else (x, y)

    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.02)  # noqa: E731
    return train(path, sgd, corrupt=corrupt, spike_guard=SpikeGuard(window=32))


_RUNS = {
    "turbulent-then-blowup": _turbulent_then_blowup,
    "adamw-lr-1": _adamw_lr_one,
    "shard-clipped": _shard_clipped,
    "shard-guarded": _shard_guarded,
    "spikes-guarded": _spikes_guarded,
}


def _median(values: tuple[float, ...] | list[float]) -> float:
    return statistics.median(values)


def test_blowup_onset_is_where_the_loss_stays_up(run: Run) -> None:
    """The loss went hundreds of times over its start from step 14, settled under 3x it (the rule's
    LOSS_STAY) from step 100 to 331, then blew up for good: the explosion's onset is the first step of
    that last rise over 3x the start, not the turbulent start (before: "left its start for good at
    step 14"); the turbulent start is a blow-up that came back."""
    path, losses = run("turbulent-then-blowup")
    start = _median(losses[:3])
    assert max(losses[12:20]) > 100 * start  # the label is true: turbulent,
    assert max(losses[99:331]) < 3 * start  # settled,
    onset = next(s for s in range(332, 401) if losses[s - 1] > 3 * start)
    assert all(b > a for a, b in itertools.pairwise(losses[onset - 1 :]))  # then up for good
    assert losses[-1] > 100 * start
    report = analyze(read_log(path))
    assert report["verdict"] == "exploding"
    head = report["findings"][0]
    assert (head["kind"], head["step"]) == ("blowup", onset)
    assert f"for good at step {onset} " in head["evidence"]
    assert all(f["step"] >= 332 for f in report["findings"] if f["verdict"] == "exploding")
    turbulent = [f for f in report["findings"] if f["kind"] == "recovered_blowup"]
    assert len(turbulent) == 1 and 12 <= turbulent[0]["step"] <= 16


def test_a_loss_that_blew_up_and_came_back_gets_the_learning_rate_advice(run: Run) -> None:
    """AdamW at lr 1.0: the loss rose over 100x its start and came back below it by the end. That is
    no explosion and no call for a tighter max_norm (Adam's step does not shrink with the gradient):
    the report says the learning rate (or a warm-up) and names the lr the log recorded (before:
    "exploding", "use max_norm=0.7537")."""
    path, losses = run("adamw-lr-1")
    start = _median(losses[:1])
    assert max(losses[:10]) > 100 * start and _median(losses[-20:]) < start  # the label is true
    report = analyze(read_log(path))
    assert report["verdict"] == "spikes", report["findings"]
    head = report["findings"][0]
    assert head["kind"] == "recovered_blowup" and head["step"] <= 5
    clipping = report["clipping"]
    assert clipping["assessment"] == "learning rate"
    assert "lower the learning rate (lr 1 at step" in clipping["advice"]
    assert "warm-up" in clipping["advice"] and "use max_norm" not in clipping["advice"]
    text = format_report(report)
    assert text.startswith("verdict: spikes (the loss blew up and came back; step ")
    # what fixed such runs in the stability benchmark, with its page (#34)
    assert clipping["evidence"] == evidence.learning_rate() and "docs/which-tool.md" in clipping["evidence"]
    assert f"  clipping: {clipping['advice']}\n  evidence: {clipping['evidence']}\n" in text


def test_loss_spikes_of_a_bad_shard_under_clipping_get_spike_guard(run: Run) -> None:
    """A bad shard under max_norm=1.0: the loss jumps while every large norm was clipped. The advice is
    SpikeGuard, not "it looks right" (before: "max_norm 1 clipped ...; it looks right")."""
    path, losses = run("shard-clipped")
    before = _median(losses[100:119])
    assert min(losses[119:135]) > 20 * before  # the label is true: the shard's losses
    log = read_log(path)
    report = analyze(log)
    assert report["verdict"] == "spikes", report["findings"]
    rows = [r for f in report["findings"] if f["kind"] == "spikes" for r in f["values"]["rows"]]
    assert all(log.clipped[r] for r in rows)  # every norm spike was clipped
    clipping = report["clipping"]
    assert clipping["assessment"] == "bad data"
    assert "spike_guard=SpikeGuard()" in clipping["advice"] and "looks right" not in clipping["advice"]
    assert clipping["evidence"] == evidence.bad_data() and "spikeguard" in clipping["evidence"]
    assert f"  evidence: {clipping['evidence']}" in format_report(report)


def test_spikes_that_spike_guard_skipped_are_handled(run: Run) -> None:
    """SpikeGuard skipped the two corrupted batches and the loss stayed calm: the verdict is healthy and
    says they were handled (before: "spikes", from the skipped windows' own norms and losses)."""
    path, losses = run("spikes-guarded")
    log = read_log(path)
    assert log.reason == {79: "spike", 139: "spike"}  # the label is true
    assert losses[79] > 50 * _median(losses[60:79])
    report = analyze(log)
    assert report["verdict"] == "healthy" and report["findings"] == []
    assert report["summary"]["skipped_spikes_handled"] == [80, 140]
    assert format_report(report).startswith(
        "verdict: healthy (2 spike(s) skipped and handled, at step(s) 80, 140; no blow-up"
    )
    assert any("the skips handled them" in n for n in report["notes"])


def test_a_bad_shard_that_spike_guard_skipped_is_handled(run: Run) -> None:
    """The shard's 16 windows were all skipped as spikes and the loss after the shard is back to its
    level: healthy, the skips handled (before: "spikes")."""
    path, losses = run("shard-guarded")
    log = read_log(path)
    assert sorted(log.reason) == [s - 1 for s in SHARD]  # the label is true
    assert set(log.reason.values()) == {"spike"}
    assert _median(losses[140:160]) < 1.5 * _median(losses[100:119])
    report = analyze(log)
    assert report["verdict"] == "healthy", report["findings"]
    assert report["summary"]["skipped_spikes_handled"] == list(SHARD)


def test_the_run_of_skips_warning_of_a_bad_shard_names_the_data(tmp_path: Path) -> None:
    """A SpikeGuard skipping a bad shard window after window warns after ten; the message says bad data
    (or a diverging run) first, and no longer that "the spike rule is too strict for this run"."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with one_thread():
            _shard_guarded(tmp_path / "warned.csv")
    messages = [str(w.message) for w in caught if "in a row were skipped" in str(w.message)]
    assert len(messages) == 1
    (message,) = messages
    assert "(steps 120-129, reasons: 'spike' x10)" in message
    assert "too strict" not in message
    assert "a stretch of bad data (a corrupted shard" in message
    assert "or a run that diverges (lower the learning rate)" in message


#: The rewind run: batches whose targets are 1000x (spikes) at these numbers.
_SPIKE_BATCHES = {60, 62}
_SKIP_BATCHES = 5


def _rewind_run(path: Path, tensorboard: Path) -> tuple[Rewind, list[int]]:
    """SGD through ``opt.rewind.batches()`` over numbered batches, with SpikeGuard and a Rewind that
    drops 5 batches after a rewind; two spike batches close together make one rewind. Returns the
    Rewind and the numbers of the batches the loop received (logged to a CSV and a TensorBoard folder)."""
    torch.manual_seed(0)
    net = _mlp()
    rewind = Rewind(every=10, keep=2, spikes=2, within=5, skip_batches=_SKIP_BATCHES, check_every=1)
    opt = ClippedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.05),
        spike_guard=SpikeGuard(window=32),
        rewind=rewind,
        loggers=[CSVLogger(path), TensorBoardLogger(str(tensorboard))],
    )
    received = []
    for n in rewind.batches(range(120)):
        x, y = _data(n)
        if n in _SPIKE_BATCHES:
            y = y * 1000
        received.append(n)
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
    opt.close()
    return rewind, received


def test_skip_list_holds_the_batches_a_rewind_dropped(tmp_path: Path) -> None:
    """The skip= list of a run with one rewind holds the spike batches, the rewound window's batch and
    the 5 batches the rewind dropped after it: every batch the loop drew but never received (counted
    here from the loop itself), so a restart with that list sees none of them (before: the dropped
    batches were missing)."""
    path, tensorboard = tmp_path / "rewind.csv", tmp_path / "tb"
    with one_thread():
        rewind, received = _rewind_run(path, tensorboard)
    assert len(rewind.log) == 1 and rewind.batches_dropped == _SKIP_BATCHES  # the label is true
    dropped = sorted(set(range(120)) - set(received))
    assert len(dropped) == _SKIP_BATCHES
    for source in (str(path), str(tensorboard)):
        report = analyze(read_log(source))
        skip: list[list[int]] = report["summary"]["skip"]
        listed = {n for a, b in skip for n in range(a, b)}
        assert set(dropped) <= listed, source
        assert listed >= _SPIKE_BATCHES, source
        assert all(n in received for n in listed - set(dropped)), source  # else only batches the run saw
        pairs = ", ".join(f"({a}, {b})" for a, b in skip)
        text = format_report(report)
        assert f"opt.rewind.batches(loader, skip=[{pairs}])" in text, source
        assert f"then dropped batch {dropped[0]}-{dropped[-1]}" in text, source
        restarted = list(Rewind(skip_batches=0).batches(range(120), skip=[(a, b) for a, b in skip]))
        assert not set(restarted) & (set(dropped) | _SPIKE_BATCHES), source
