"""The loss in the record (docs/concepts.md, 'Signals and statistics'): step(loss=...), closures,
combination, logs, checkpoints."""

from __future__ import annotations

import csv
import math
from functools import partial
from pathlib import Path

import pytest
import torch

from clipopt import ClippedOptimizer, CSVLogger

from ..helpers import mlp
from ..hostreads import count_host_reads

_model = partial(mlp, (4, 3, 1))  # Linear(4, 3), Tanh, Linear(3, 1), global seed 0


def _loss(model: torch.nn.Module, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 4, generator=g)
    return (model(x) - x.sum(1, keepdim=True)).pow(2).mean()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_window_loss_combines_micro_batches_like_the_gradients(reduction: str) -> None:
    """With accumulation_steps=3 the window's loss is the mean (or sum) of its micro-batch losses."""
    model = _model()
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), max_norm=1.0, accumulation_steps=3, reduction=reduction
    )
    given = []
    for i in range(6):
        loss = _loss(model, i)
        loss.backward()
        given.append(float(loss))
        opt.step(loss=loss)
        opt.zero_grad()
    expect = [sum(given[:3]), sum(given[3:])]
    if reduction == "mean":
        expect = [v / 3 for v in expect]
    assert [s.loss for s in opt.stats] == pytest.approx(expect, rel=1e-6)


def test_float_loss_and_partial_window_flush() -> None:
    """A float loss works; flush() divides by the losses actually given."""
    model = _model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), accumulation_steps=4)
    for value in (2.0, 4.0):
        _loss(model, 0).backward()
        opt.step(loss=value)
    opt.flush()
    assert opt.last_stats is not None and opt.last_stats.loss == 3.0


def test_no_loss_is_nan_and_an_empty_csv_cell(tmp_path: Path) -> None:
    """Without a loss StepStats.loss is nan and the CSV's loss cell is empty; with one it is written."""
    model = _model()
    path = tmp_path / "g.csv"
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), loggers=[CSVLogger(path)])
    _loss(model, 0).backward()
    opt.step()
    opt.zero_grad()
    loss = _loss(model, 1)
    loss.backward()
    opt.step(loss=loss)
    opt.close()
    assert math.isnan(opt.stats[0].loss)
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows[0]["loss"] == "" and float(rows[1]["loss"]) == pytest.approx(float(loss))


def test_closure_return_value_is_the_loss() -> None:
    """step(closure) records what the closure returned."""
    model = _model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    seen = []

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = _loss(model, 3)
        loss.backward()
        seen.append(float(loss))
        return loss

    opt.step(closure)
    assert opt.last_stats is not None and opt.last_stats.loss == pytest.approx(seen[0])


@pytest.mark.parametrize(
    ("loss", "error", "match"),
    [
        (
            torch.ones(2),
            ValueError,
            r"loss must be a one-element tensor or a float, got a tensor of shape \(2,\)",
        ),
        ("1.0", TypeError, "loss must be a 0-d tensor or a float, got str"),
        (True, TypeError, "loss must be a 0-d tensor or a float, got bool"),
    ],
)
def test_bad_loss_is_refused_before_any_state_changes(loss: object, error: type, match: str) -> None:
    """A loss that is not a scalar is an error naming the argument; the micro-batch is not counted."""
    model = _model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), accumulation_steps=2)
    _loss(model, 0).backward()
    with pytest.raises(error, match=match):
        opt.step(loss=loss)  # type: ignore[arg-type]
    assert opt.micro_batches == 0


@pytest.mark.parametrize("give_loss", [False, True])
def test_fused_update_with_loss_reads_nothing(give_loss: bool) -> None:
    """loss= adds no host read on the fused path: after the first update (inner state not yet
    created: one read, with or without a loss) every call reads nothing."""
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    opt = ClippedOptimizer(inner, max_norm=0.1, accumulation_steps=2)
    counts = []
    for i in range(8):
        loss = _loss(model, i)
        loss.backward()
        with count_host_reads() as reads:
            opt.step(loss=loss if give_loss else None)
        counts.append(len(reads))
        opt.zero_grad()
    assert counts == [0, 1] + [0] * 6


def test_mid_window_checkpoint_keeps_the_partial_loss() -> None:
    """A state dict taken mid-window carries the loss sum: the resumed window's loss equals the unbroken one."""  # noqa: E501

    def run(stop: bool) -> float:
        model = _model()
        opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), accumulation_steps=3)
        for i in range(3):
            loss = _loss(model, i)
            loss.backward()
            opt.step(loss=loss)
            if stop and i == 1:
                sd = opt.state_dict()
                opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), accumulation_steps=3)
                opt.load_state_dict(sd)
        assert opt.last_stats is not None
        return opt.last_stats.loss

    assert run(True) == run(False)


def test_older_state_dict_without_loss_loads() -> None:
    """A state dict without the loss entries (older clipopt) loads, with an empty loss sum."""
    model = _model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    sd = opt.state_dict()
    del sd["clipopt"]["loss_sum"], sd["clipopt"]["loss_count"]
    opt.load_state_dict(sd)
    _loss(model, 0).backward()
    opt.step()
    assert opt.last_stats is not None and math.isnan(opt.last_stats.loss)


def test_tensorboard_gets_the_loss_scalar(tmp_path: Path) -> None:
    """TensorBoardLogger writes clipopt/loss when a loss was given."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from clipopt import TensorBoardLogger

    model = _model()
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), loggers=[TensorBoardLogger(tmp_path)]
    )
    loss = _loss(model, 0)
    loss.backward()
    opt.step(loss=loss)
    opt.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert acc.Scalars("clipopt/loss")[0].value == pytest.approx(float(loss))


@pytest.mark.parametrize(
    ("patch", "match"),
    [
        ({"loss_count": 5}, r"'clipopt.loss_count' must be an int from 0 to the pending .* \(1\), got 5"),
        ({"loss_sum": "x", "loss_count": 1}, "'clipopt.loss_sum' must be a float, a one-element float"),
        ({"loss_sum": None, "loss_count": 1}, "'clipopt.loss_sum' is None but 'clipopt.loss_count' is 1"),
    ],
)
def test_corrupt_loss_entries_are_refused(patch: dict[str, object], match: str) -> None:
    """A state dict with inconsistent loss entries raises ValueError and changes nothing."""
    model = _model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), accumulation_steps=2)
    loss = _loss(model, 0)
    loss.backward()
    opt.step(loss=loss)
    sd = opt.state_dict()
    sd["clipopt"].update(patch)
    fresh = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), accumulation_steps=2)
    with pytest.raises(ValueError, match=match):
        fresh.load_state_dict(sd)
    assert fresh.micro_batches == 0
