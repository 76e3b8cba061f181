"""SpikeGuard on its own: the statistics against NumPy, the decisions against a plain-Python guard."""

from __future__ import annotations

import io
import math
import re
import warnings
from collections import deque

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from clipopt import ClippedOptimizer
from clipopt._recovery.spike_guard import SpikeGuard
from clipopt._recovery.spike_stats import history_mean_std, push_history, spike_scores

from ..hostreads import count_host_reads


def _ring(values: list[float], window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A one-row ring buffer holding ``values`` pushed in order (written independently of push_history)."""
    buf = [0.0] * window
    for i, v in enumerate(values):
        buf[i % window] = v
    return torch.tensor([buf], dtype=torch.float64), torch.tensor([len(values)])


@pytest.mark.parametrize("n", [0, 1, 2, 5, 8, 13, 30])
def test_history_mean_std_matches_numpy(n: int) -> None:
    """Mean and sample std (ddof=1) of the latest min(n, window) values, ring wrap-around included."""
    window = 8
    rng = np.random.default_rng(n)
    values = list(rng.normal(3.0, 2.0, size=n))
    buffer, count = _ring(values, window)
    mean, std = history_mean_std(buffer, count)
    last = np.array(values[-window:]) if n else np.array([])
    want_mean = last.mean() if n else 0.0
    want_std = last.std(ddof=1) if n >= 2 else 0.0
    assert mean.item() == pytest.approx(want_mean, rel=1e-12, abs=1e-12)
    assert std.item() == pytest.approx(want_std, rel=1e-12, abs=1e-12)


@given(
    st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=0, max_size=40),
    st.integers(2, 12),
    st.lists(st.booleans(), min_size=40, max_size=40),
)
def test_pushed_history_matches_numpy(values: list[float], window: int, accepted: list[bool]) -> None:
    """Pushing values (some rejected) then taking mean/std equals NumPy on the accepted ones' last window."""
    buffer = torch.zeros((1, window), dtype=torch.float64)
    count = torch.zeros(1, dtype=torch.int64)
    kept = []
    for v, ok in zip(values, accepted, strict=False):
        buffer, count = push_history(buffer, count, torch.tensor([v], dtype=torch.float64), torch.tensor(ok))
        if ok:
            kept.append(v)
    mean, std = history_mean_std(buffer, count)
    last = np.array(kept[-window:])
    assert count.item() == len(kept)
    assert mean.item() == pytest.approx(last.mean() if len(last) else 0.0, rel=1e-9, abs=1e-9)
    want_std = last.std(ddof=1) if len(last) >= 2 else 0.0
    assert std.item() == pytest.approx(want_std, rel=1e-9, abs=1e-7)


def test_spike_scores_matches_numpy_and_warmup() -> None:
    """z = (v - mean) / (std + eps) per row; rows below warmup or with a non-finite value are not scored."""
    rng = np.random.default_rng(1)
    a, b = list(rng.normal(size=10)), list(rng.normal(5, 1, size=3))
    ba, ca = _ring(a, 16)
    bb, cb = _ring(b, 16)
    buffer, count = torch.cat([ba, bb]), torch.cat([ca, cb])
    values = torch.tensor([4.0, 9.0], dtype=torch.float64)
    z, scored = spike_scores(values, buffer, count, warmup=5, eps=1e-3)
    want = (4.0 - np.mean(a)) / (np.std(a, ddof=1) + 1e-3)
    assert scored.tolist() == [True, False]
    assert z[0].item() == pytest.approx(want, rel=1e-12)
    assert z[1].item() == 0.0
    z, scored = spike_scores(torch.tensor([math.nan, math.inf], dtype=torch.float64), buffer, count, 2, 1e-3)
    assert scored.tolist() == [False, False] and z.tolist() == [0.0, 0.0]


def test_push_history_accepts_only_finite_accepted_values() -> None:
    """push_history writes slot count % window, only where accepted and finite; inputs are not modified."""
    buffer, count = _ring([1.0, 2.0, 3.0], 3)
    before = buffer.clone()
    b2, c2 = push_history(buffer, count, torch.tensor([7.0], dtype=torch.float64), torch.tensor(True))
    assert b2.tolist() == [[7.0, 2.0, 3.0]] and c2.tolist() == [4]
    assert torch.equal(buffer, before) and count.tolist() == [3]
    b3, c3 = push_history(b2, c2, torch.tensor([8.0], dtype=torch.float64), torch.tensor(False))
    assert torch.equal(b3, b2) and c3.tolist() == [4]
    b4, c4 = push_history(b2, c2, torch.tensor([math.inf], dtype=torch.float64), torch.tensor(True))
    assert torch.equal(b4, b2) and c4.tolist() == [4]


class _Reference:
    """A plain-Python SpikeGuard: deques of the applied updates' values."""

    def __init__(self, z: float, window: int, warmup: int, eps: float, signals: tuple[str, ...]) -> None:
        self.z, self.warmup, self.eps, self.signals = z, warmup, eps, signals
        self.hist = {s: deque(maxlen=window) for s in signals}

    def decide(self, values: dict[str, float]) -> bool:
        spike = False
        for s in self.signals:
            h, v = self.hist[s], values[s]
            if len(h) >= self.warmup and math.isfinite(v):
                mean = sum(h) / len(h)
                std = math.sqrt(sum((x - mean) ** 2 for x in h) / (len(h) - 1))
                spike |= (v - mean) / (std + self.eps) > self.z
        return spike

    def commit(self, values: dict[str, float], skipped: bool) -> None:
        if not skipped:
            for s in self.signals:
                if math.isfinite(values[s]):
                    self.hist[s].append(values[s])


def _sequence(n: int, seed: int) -> list[tuple[float, float, bool]]:
    """(loss, grad norm, skipped for another reason) per window, with spikes and gaps mixed in."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        loss, norm = 2.0 + 0.1 * rng.normal(), 1.0 + 0.05 * rng.normal()
        if i % 17 == 16:
            loss *= 5
        if i % 23 == 22:
            norm *= 30
        if i % 11 == 5:
            loss = math.nan  # no loss given this window
        out.append((loss, norm, i % 13 == 7))
    return out


@pytest.mark.parametrize(
    ("signals", "window", "warmup"), [(("loss", "grad_norm"), 16, 8), (("grad_norm",), 5, 2)]
)
def test_guard_matches_plain_python_reference(signals: tuple[str, ...], window: int, warmup: int) -> None:
    """Decisions and history equal the deque reference over 120 windows (spikes and other skips excluded)."""
    guard = SpikeGuard(z_thresh=3.0, window=window, signals=signals, warmup=warmup, eps=1e-6)
    ref = _Reference(3.0, window, warmup, 1e-6, signals)
    decisions = []
    for loss, norm, other_skip in _sequence(120, window):
        values = {"loss": loss, "grad_norm": norm}
        loss_t = None if math.isnan(loss) else torch.tensor(loss, dtype=torch.float64)
        spike = guard.decide(loss_t, torch.tensor(norm, dtype=torch.float64))
        want = ref.decide(values)
        assert bool(spike.item()) == want
        decisions.append(want)
        skipped = want or other_skip
        guard.commit(torch.tensor(float(skipped)))
        ref.commit(values, skipped)
    assert any(decisions)
    got = guard.history
    for s in signals:
        assert got[s] == pytest.approx(list(ref.hist[s]), rel=1e-12)


def test_no_spike_during_warmup() -> None:
    """Until a signal has `warmup` values even a huge value is no spike; default warmup max(20, window//2)."""
    guard = SpikeGuard(window=128)
    assert guard.warmup == 64
    assert SpikeGuard(window=10).warmup == 10
    g = SpikeGuard(z_thresh=2.0, window=10, warmup=4, signals=("grad_norm",))
    for v in [1.0, 1.1, 0.9]:
        assert g.decide(None, torch.tensor(v)).item() == 0.0
        g.commit(False)
    assert g.decide(None, torch.tensor(1e6)).item() == 0.0  # 3 values: still warming up
    g.commit(False)
    assert g.decide(None, torch.tensor(1e12)).item() == 1.0


def test_decide_and_commit_do_not_read_the_device() -> None:
    """decide() and commit() with tensor inputs make no host read (the flag stays on the device)."""
    guard = SpikeGuard(window=8, warmup=2)
    for i in range(12):
        loss, norm = torch.tensor(1.0 + 0.01 * i), torch.tensor(2.0 + 0.01 * i)
        with count_host_reads() as reads:
            flag = guard.decide(loss, norm)
            guard.commit(flag)
        assert len(reads) == 0, reads.ours
        assert flag.dtype == torch.float32 and flag.shape == ()


def _save_load(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_state_dict_round_trip_continues_identically() -> None:
    """A guard loaded (weights_only) from another's state decides and records exactly like it afterwards."""
    seq = _sequence(80, 3)
    a = SpikeGuard(z_thresh=3.0, window=16, warmup=8)
    for loss, norm, _ in seq[:40]:
        a.commit(a.decide(torch.tensor(loss), torch.tensor(norm)))
    b = SpikeGuard(z_thresh=3.0, window=16, warmup=8)
    b.load_state_dict(_save_load(a.state_dict()))
    assert b.history == a.history
    for loss, norm, _ in seq[40:]:
        fa = a.decide(torch.tensor(loss), torch.tensor(norm))
        fb = b.decide(torch.tensor(loss), torch.tensor(norm))
        assert fa.item() == fb.item()
        a.commit(fa)
        b.commit(fb)
    assert torch.equal(a.state_dict()["buffer"], b.state_dict()["buffer"])
    assert torch.equal(a.state_dict()["count"], b.state_dict()["count"])


def test_load_state_dict_rejects_mismatch_and_keeps_state() -> None:
    """A state of another window or signal set, or with negative counts, raises and changes nothing."""
    guard = SpikeGuard(window=8, warmup=2)
    guard.commit(guard.decide(torch.tensor(1.0), torch.tensor(2.0)))
    before = guard.state_dict()
    message = (
        "invalid SpikeGuard state: expected signals ['loss', 'grad_norm'], window 8, a float buffer of "
        "shape (2, 8) and non-negative integer counts of shape (2,); pass the state saved by a SpikeGuard "
        "with window=8 and signals=('loss', 'grad_norm')"
    )
    other = SpikeGuard(window=16).state_dict()
    with pytest.raises(ValueError, match=re.escape(message)):
        guard.load_state_dict(other)
    bad = dict(before, count=torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match=re.escape(message)):
        guard.load_state_dict(bad)
    with pytest.raises(ValueError, match=re.escape("invalid SpikeGuard state: expected a dict, got list")):
        guard.load_state_dict([])
    after = guard.state_dict()
    assert torch.equal(after["buffer"], before["buffer"]) and torch.equal(after["count"], before["count"])


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        (
            {"z_thresh": 0},
            ValueError,
            "z_thresh must be a positive finite number, got 0; pass e.g. z_thresh=6.0",
        ),
        (
            {"z_thresh": "6"},
            TypeError,
            "z_thresh must be a positive float, got '6' (str); pass e.g. z_thresh=6.0",
        ),
        ({"window": 1}, ValueError, "window must be an int >= 2, got 1; pass e.g. window=32"),
        ({"window": 2.0}, TypeError, "window must be an int >= 2, got 2.0 (float); pass e.g. window=32"),
        (
            {"signals": ("loss", "lr")},
            ValueError,
            "signals must name each of ('loss', 'grad_norm') at most once, and at least one, "
            "got ('loss', 'lr'); pass e.g. signals=('grad_norm',)",
        ),
        (
            {"signals": "loss"},
            TypeError,
            "signals must be a tuple of names from ('loss', 'grad_norm'), got 'loss'; "
            "pass e.g. signals=('grad_norm',)",
        ),
        (
            {"window": 10, "warmup": 11},
            ValueError,
            "warmup must be between 2 and window=10, got 11; "
            "pass e.g. warmup=10, or warmup=None for max(20, window // 2)",
        ),
        (
            {"warmup": 2.5},
            TypeError,
            "warmup must be an int or None, got 2.5 (float); "
            "pass e.g. warmup=20, or warmup=None for max(20, window // 2)",
        ),
        ({"eps": -1.0}, ValueError, "eps must be a positive finite float, got -1.0; pass e.g. eps=1e-8"),
        (
            {"eps": True},
            TypeError,
            "eps must be a positive finite float, got True (bool); pass e.g. eps=1e-8",
        ),
        (
            {"eps": "1e-8"},
            TypeError,
            "eps must be a positive finite float, got '1e-8' (str); pass e.g. eps=1e-8",
        ),
    ],
)
def test_argument_validation(kwargs: dict, exc: type, message: str) -> None:
    """Each bad argument raises its exact message naming the argument, value and fix."""
    with pytest.raises(exc, match=re.escape(message)):
        SpikeGuard(**kwargs)


def test_signals_are_stored_in_canonical_order() -> None:
    """signals=('grad_norm', 'loss') watches both, stored as ('loss', 'grad_norm'); repr shows settings."""
    g = SpikeGuard(signals=("grad_norm", "loss"), window=32)
    assert g.signals == ("loss", "grad_norm")
    assert repr(g) == "SpikeGuard(z_thresh=6, window=32, signals=('loss', 'grad_norm'), warmup=20)"


def _train_without_loss(signals: tuple[str, ...], windows: int) -> tuple[ClippedOptimizer, list[str]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        max_norm=1.0,
        spike_guard=SpikeGuard(window=4, warmup=2, signals=signals),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(windows):
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()  # no loss=
            opt.zero_grad()
    return opt, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def test_guard_watching_the_loss_warns_once_when_no_loss_is_given() -> None:
    """signals=("loss",), step() without loss=: the guard can skip nothing; it says so once."""
    opt, messages = _train_without_loss(("loss",), 10)
    assert messages == [
        "SpikeGuard watches the loss (signals=('loss',)) but step() was called without loss=: the loss "
        "signal sits out such windows and this guard skips nothing; pass opt.step(loss=loss), or "
        "signals=('grad_norm',) to watch the gradient norm only"
    ]
    assert opt.spike_guard is not None and opt.spike_guard.history == {"loss": []}
    _, both = _train_without_loss(("loss", "grad_norm"), 5)
    assert both == [
        "SpikeGuard watches the loss (signals=('loss', 'grad_norm')) but step() was called without "
        "loss=: the loss signal sits out such windows; pass opt.step(loss=loss), or "
        "signals=('grad_norm',) to watch the gradient norm only"
    ]
    _, none = _train_without_loss(("grad_norm",), 5)
    assert none == []


def test_guard_does_not_warn_about_a_gap_after_losses_were_given() -> None:
    """A window without a loss after windows with one (a documented gap) does not warn."""
    guard = SpikeGuard(window=4, warmup=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard.commit(guard.decide(torch.tensor(1.0), torch.tensor(1.0)))
        guard.commit(guard.decide(None, torch.tensor(1.0)))
    assert [w for w in caught if issubclass(w.category, UserWarning)] == []


def test_the_default_history_is_short_enough_to_see_a_shard_early_in_a_run() -> None:
    """The loss of the stability benchmark's healthy run (#34, docs/which-tool.md): an early descent
    from 5.9 towards 2.3 (here ``2.3 + 3.6 * exp(-t / 15)`` with 1 % noise), then at update 120 a
    label-shuffled batch at 3.9.  ``window=128`` holds the descent, whose spread hides the shard
    (z < 6); the default history of 32 updates sees it (z > 6), and flags none of the healthy
    updates before it."""
    gen = torch.Generator().manual_seed(0)
    healthy = [2.3 + 3.6 * math.exp(-t / 15) for t in range(120)]
    healthy = [x * (1 + 0.01 * float(torch.randn((), generator=gen))) for x in healthy]
    norm = torch.tensor(1.0)

    def flags(guard: SpikeGuard) -> tuple[list[float], float]:
        seen = []
        for x in healthy:
            flag = guard.decide(torch.tensor(x), norm)
            seen.append(float(flag))
            guard.commit(flag)
        return seen, float(guard.decide(torch.tensor(3.9), norm))

    assert SpikeGuard().window == 32 and SpikeGuard().warmup == 20
    before, shard = flags(SpikeGuard())
    assert before == [0.0] * 120 and shard == 1.0
    _, shard_128 = flags(SpikeGuard(window=128))
    assert shard_128 == 0.0  # the former default (window=128) misses it
