"""Listed skips: ``opt.rewind.batches(loader, skip=[(start, end), ...])``, numbered over the whole run."""

from __future__ import annotations

import copy
import io
import pickle
import re
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn, optim

from clipopt import ClippedOptimizer, Rewind, SpikeGuard

from .helpers import batches_for, model_for


def _complement(n: int, ranges: list[tuple[int, int]]) -> list[int]:
    """The batch numbers below ``n`` that no ``[start, end)`` range holds (plain Python)."""
    return [i for i in range(n) if not any(a <= i < b for a, b in ranges)]


def test_listed_ranges_are_dropped_like_range() -> None:
    """(start, end) drops start <= n < end; overlapping and unsorted ranges are a union; the counts
    say how many were drawn and how many dropped."""
    skip = [(20, 21), (4, 8), (3, 5), (28, 40)]
    rewind = Rewind()
    assert list(rewind.batches(range(30), skip=skip)) == _complement(30, skip)
    assert rewind.batch_count == 30 and rewind.batches_listed == 30 - len(_complement(30, skip))


def test_numbers_continue_across_calls() -> None:
    """Two loaders (epochs) in a row: the second's batches are numbered after the first's."""
    rewind = Rewind()
    skip = [(8, 12)]
    first = list(rewind.batches(["a"] * 10, skip=skip))
    second = list(rewind.batches(list(range(10, 20)), skip=skip))
    assert len(first) == 8 and second == _complement(20, skip)[8:]
    assert rewind.batch_count == 20


def test_a_rewind_drops_count_batches_drawn_listed_or_not() -> None:
    """After a rewind (pending_skip) the next batches drawn are dropped whatever the list says; a
    listed batch among them counts as a rewind drop, the later listed ones as listed."""
    rewind = Rewind()
    rewind.pending_skip = 3
    assert list(rewind.batches(range(10), skip=[(1, 2), (5, 6)])) == [3, 4, 6, 7, 8, 9]
    assert (rewind.batches_dropped, rewind.batches_listed, rewind.pending_skip) == (3, 1, 0)


def _guard() -> SpikeGuard:
    return SpikeGuard(z_thresh=50.0, window=8, warmup=4)


def _build() -> tuple[nn.Module, ClippedOptimizer]:
    model = model_for()
    rewind = Rewind(every=4, spikes=2, within=5, skip_batches=0, check_every=2)
    opt = ClippedOptimizer(
        optim.AdamW(model.parameters(), lr=0.01), accumulation_steps=2, spike_guard=_guard(), rewind=rewind
    )
    return model, opt


def _train(model: nn.Module, opt: ClippedOptimizer, batch: tuple[int, Any]) -> None:
    x, y = batch[1]
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step(loss=loss)
    opt.zero_grad()


SKIP = [(5, 9), (14, 15), (15, 17), (30, 33)]


@pytest.mark.parametrize("stop", [3, 4, 9, 13, 20])
def test_listed_skips_survive_a_state_dict_round_trip(stop: int) -> None:
    """Train, save after `stop` batches were trained (torch.save, weights_only load), restart with a
    new model, optimizer and a loader that starts at opt.rewind.batch_count: the batches trained
    in both runs are exactly those no range lists, each once, in order."""
    data = list(enumerate(batches_for(40, seed=3)))
    model, opt = _build()
    assert opt.rewind is not None
    seen: list[int] = []
    for batch in opt.rewind.batches(data, skip=SKIP):
        _train(model, opt, batch)
        seen.append(batch[0])
        if len(seen) == stop:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
            break
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model2, opt2 = _build()
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    assert opt2.rewind is not None and opt2.rewind.batch_count == opt.rewind.batch_count == seen[-1] + 1
    for batch in opt2.rewind.batches(data[opt2.rewind.batch_count :], skip=SKIP):
        _train(model2, opt2, batch)
        seen.append(batch[0])
    assert seen == _complement(40, SKIP)
    assert opt2.rewind.batch_count == 40
    assert opt2.rewind.batches_listed == 40 - len(seen)  # over the whole run: loaded, then counted on


def test_a_state_saved_before_listed_skips_loads_with_the_count_at_zero() -> None:
    """A Rewind state without the batch count (written by an earlier version) loads; counting starts at 0."""
    model, opt = _build()
    assert opt.rewind is not None
    for batch in opt.rewind.batches(list(enumerate(batches_for(6, seed=3)))):
        _train(model, opt, batch)
    state = opt.state_dict()
    for key in ("batch_next", "batch_window_start", "batches_listed", "lr_cut_left"):
        del state["clipopt"]["rewind"][key]
    _, opt2 = _build()
    opt2.load_state_dict(state)
    assert opt2.rewind is not None and (opt2.rewind.batch_count, opt2.rewind.batches_listed) == (0, 0)


def test_a_bad_batch_count_in_the_state_is_refused() -> None:
    """A negative batch count in a Rewind state raises naming the field; nothing is loaded."""
    _, opt = _build()
    state = opt.state_dict()
    state["clipopt"]["rewind"]["batch_next"] = -1
    with pytest.raises(
        ValueError, match=re.escape("invalid Rewind state: 'batch_next' must be an int >= 0, got -1")
    ):
        opt.load_state_dict(state)


@pytest.mark.parametrize(
    ("skip", "error", "message"),
    [
        (5, TypeError, "skip must be a list of (start, end) pairs, got int; pass e.g. skip=[(1200, 1300)]"),
        ("5-9", TypeError, "skip must be a list of (start, end) pairs, got str; "),
        ([5], TypeError, "skip must hold (start, end) pairs, got 5; pass e.g. skip=[(1200, 1300)]"),
        ([(1, 2, 3)], TypeError, "skip must hold (start, end) pairs, got (1, 2, 3); "),
        ([(1.0, 2)], TypeError, "skip's start must be an int, got 1.0 (float) in (1.0, 2); pass e.g."),
        ([(1, True)], TypeError, "skip's end must be an int, got True (bool) in (1, True); "),
        ([(-1, 2)], ValueError, "skip's start must be >= 0, got (-1, 2); batches count from 0; pass e.g."),
        (
            [(4, 4)],
            ValueError,
            "skip's ranges must have start < end, got (4, 4): it drops no batch; pass e.g.",
        ),
        (
            [(0, 3), (9, 2)],
            ValueError,
            "skip's ranges must have start < end, got (9, 2): it drops no batch; ",
        ),
    ],
)
def test_skip_is_checked_before_anything_is_drawn(skip: Any, error: type[Exception], message: str) -> None:
    """A bad skip raises at the call, naming the argument, the value and the fix; the loader is
    not touched and the count does not move."""
    rewind = Rewind()
    loader = iter(range(10))
    with pytest.raises(error, match=re.escape(message)):
        rewind.batches(loader, skip=skip)
    assert next(loader) == 0 and rewind.batch_count == 0


@given(
    st.lists(st.tuples(st.integers(0, 60), st.integers(1, 20)), max_size=8),
    st.integers(0, 80),
)
def test_any_ranges_drop_exactly_the_listed_batches(pairs: list[tuple[int, int]], n: int) -> None:
    """For any list of ranges (overlapping, unsorted, adjacent) and loader length, batches() yields
    exactly the numbers no range holds, in order."""
    skip = [(start, start + length) for start, length in pairs]
    rewind = Rewind()
    assert list(rewind.batches(range(n), skip=skip)) == _complement(n, skip)
    assert rewind.batch_count == n and rewind.batches_listed == n - len(_complement(n, skip))


@pytest.mark.parametrize("protocol", [0, pickle.HIGHEST_PROTOCOL])
def test_a_pickled_rewind_keeps_its_count_and_cut(protocol: int) -> None:
    """Pickling (any protocol) and deep copies keep the batch count, the listed count and the cut."""
    rewind = Rewind(lr_cut=(0.5, 3))
    assert list(rewind.batches(range(6), skip=[(1, 3)])) == [0, 3, 4, 5]
    for copied in (pickle.loads(pickle.dumps(rewind, protocol=protocol)), copy.deepcopy(rewind)):
        assert (copied.batch_count, copied.batches_listed, copied.lr_cut) == (6, 2, (0.5, 3))
        assert list(copied.batches(range(6, 8), skip=[(7, 9)])) == [6]
