"""Rewind on its own: host copies restore bit-identically, the rule, batches(), checkpoints."""

from __future__ import annotations

import io
import re
from typing import Any

import pytest
import torch

from clipopt._recovery.host_copy import TrainingState, capture, restore
from clipopt._recovery.rewind import Rewind, RewindEvent, rewind_target

from ..optim_db import OptimInfo, get


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Tanh(), torch.nn.Linear(6, 2)
    )


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Independent clones of everything a rewind must bring back."""
    state = {
        i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
        for i, p in enumerate(model.parameters())
        if p in opt.state
    }
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "buffers": [b.clone() for b in model.buffers()],
        "state": state,
    }


def _assert_same(model: torch.nn.Module, opt: torch.optim.Optimizer, snap: dict[str, Any]) -> None:
    for p, q in zip(model.parameters(), snap["params"], strict=True):
        assert p.dtype == q.dtype and torch.equal(p.detach(), q)
    for b, c in zip(model.buffers(), snap["buffers"], strict=True):
        assert b.dtype == c.dtype and torch.equal(b, c)
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    assert {index[id(p)] for p in opt.state} == set(snap["state"])
    for i, entry in snap["state"].items():
        live = opt.state[params[i]]
        assert set(live) == set(entry)
        for k, v in entry.items():
            if isinstance(v, torch.Tensor):
                assert live[k].dtype == v.dtype and torch.equal(live[k], v), k
            else:
                assert live[k] == v, k


# (optim_db entry, constructor arguments replaced); foreach=None is torch's default implementation
# choice (on CPU: the for-loop), 0.01 AdamW's default weight decay.
OPTIMIZERS = [
    pytest.param(get("AdamW-forloop"), {"lr": 1e-2, "weight_decay": 0.01, "foreach": None}, id="adamw"),
    pytest.param(get("AdamW-forloop"), {"lr": 1e-2, "weight_decay": 0.01}, id="adamw-single"),
    pytest.param(get("AdamW-foreach"), {"lr": 1e-2, "weight_decay": 0.01}, id="adamw-foreach"),
    pytest.param(get("SGD-momentum-forloop"), {"lr": 1e-2, "foreach": None}, id="sgd"),
    pytest.param(get("Adagrad-forloop"), {"lr": 1e-2, "foreach": None}, id="adagrad"),
    pytest.param(get("RMSprop-forloop"), {"lr": 1e-3, "centered": True, "foreach": None}, id="rmsprop"),
]


@pytest.mark.parametrize(("info", "overrides"), OPTIMIZERS)
def test_capture_restore_is_bit_identical(info: OptimInfo, overrides: dict[str, Any]) -> None:
    """After more training, restore() gives back parameters, buffers and optimizer state bit for bit."""
    model = _model()
    opt = info.make(model.parameters(), **overrides)
    _train(model, opt, 3, seed=1)
    target = TrainingState(list(model.parameters()), list(model.buffers()), opt)
    saved = _snapshot(model, opt)
    copy = capture(target, {"note": torch.tensor([1.5])}, step=3, applied=3)
    _train(model, opt, 4, seed=2)
    extra = restore(copy, target)
    _assert_same(model, opt, saved)
    assert torch.equal(extra["note"], torch.tensor([1.5]))
    assert all(p.grad is None for p in model.parameters())


def test_restore_does_not_alias_the_copy() -> None:
    """Training after a restore leaves the copy intact: restoring it twice gives the same state."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # CPU: a restore must not share the host tensors
    _train(model, opt, 2, seed=1)
    target = TrainingState(list(model.parameters()), list(model.buffers()), opt)
    saved = _snapshot(model, opt)
    copy = capture(target, None, 2, 2)
    for seed in (5, 6):
        _train(model, opt, 3, seed=seed)
        restore(copy, target)
        _assert_same(model, opt, saved)


def test_restore_of_a_copy_without_state_clears_it() -> None:
    """A copy taken before the first update restores an empty optimizer state (Adam's lazy state)."""
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    target = TrainingState(list(model.parameters()), list(model.buffers()), opt)
    saved = _snapshot(model, opt)
    copy = capture(target, None, 0, 0)
    _train(model, opt, 2, seed=3)
    assert len(opt.state) > 0
    restore(copy, target)
    assert len(opt.state) == 0
    _assert_same(model, opt, saved)


def test_capture_reuses_host_buffers() -> None:
    """A capture that replaces a copy writes into its host tensors (same storage) and holds the new values."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt, 1, seed=1)
    target = TrainingState(list(model.parameters()), list(model.buffers()), opt)
    first = capture(target, None, 1, 1)
    pointers = [t.data_ptr() for t in first.leaves]
    _train(model, opt, 2, seed=2)
    saved = _snapshot(model, opt)
    second = capture(target, None, 3, 3, reuse=first)
    assert [t.data_ptr() for t in second.leaves] == pointers
    _train(model, opt, 2, seed=3)
    restore(second, target)
    _assert_same(model, opt, saved)


def test_restore_refuses_changed_parameters() -> None:
    """A copy whose parameter shapes no longer match raises ValueError and leaves the parameters alone."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    target = TrainingState(list(model.parameters()), [], opt)
    copy = capture(target, None, 0, 0)
    other = torch.nn.Linear(3, 3)
    wrong = TrainingState(list(other.parameters()), [], torch.optim.SGD(other.parameters(), lr=0.1))
    before = [p.detach().clone() for p in other.parameters()]
    message = (
        "a Rewind cannot restore its copy: the parameters changed since the copy was taken (count, shape or "
        "dtype); a Rewind needs the same model and parameter groups throughout training"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        restore(copy, wrong)
    assert all(torch.equal(p, q) for p, q in zip(other.parameters(), before, strict=True))


def test_rewind_target_rule() -> None:
    """spikes within `within` windows fire; the copy is the newest taken strictly before the first spike."""
    assert rewind_target([], [0, 100], 3, 50) is None
    assert rewind_target([110, 120], [0, 100], 3, 50) is None  # two spikes only
    assert rewind_target([110, 120, 130], [0, 100], 3, 50) == (110, 100)
    assert rewind_target([60, 120, 130, 140], [0, 100], 3, 50) == (120, 100)  # 60 is too old
    assert rewind_target([100, 120, 130], [0, 100], 3, 50) == (100, 0)  # copy 100 is not before 100
    assert rewind_target([111, 159, 160], [0, 100], 3, 50) == (111, 100)  # 111..160: 50 windows
    assert rewind_target([110, 159, 160], [0, 100], 3, 50) is None  # 110..160: 51 windows
    assert rewind_target([5, 6, 7], [10], 3, 50) == (5, -1)  # no copy older than the first spike
    # spikes back before a new copy: the copy the last rewind restored is passed over, unless alone
    assert rewind_target([110, 120, 130], [0, 100], 3, 50, avoid=100) == (110, 0)
    assert rewind_target([110, 120, 130], [100], 3, 50, avoid=100) == (110, 100)


def _bound(rewind: Rewind, model: torch.nn.Module, opt: torch.optim.Optimizer) -> Rewind:
    rewind.bind(list(model.parameters()), opt)
    return rewind


def _drive(
    rewind: Rewind,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    spikes: set[int],
    start: int,
    stop: int,
) -> list[tuple[int, RewindEvent]]:
    """Windows start..stop-1: a spike window is skipped (no update), others train; checks when due."""
    events = []
    for step in range(start, stop):
        spike = step in spikes
        if not spike:
            _train(model, opt, 1, seed=step)
        if rewind.observe(step, float(spike), float(not spike)):
            hit = rewind.check(step, lambda s=step: {"guard": torch.tensor([float(s)])})
            if hit is not None:
                events.append((step, hit[0]))
    return events


def test_rewind_restores_copy_before_first_spike_and_drops_batches() -> None:
    """Three spikes in 50 windows rewind to the newest copy before the first; batches() then drops 7."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rewind = _bound(
        Rewind(every=20, keep=2, spikes=3, within=50, skip_batches=7, module=model, check_every=5), model, opt
    )
    _drive(rewind, model, opt, set(), 1, 41)  # copies at windows 5 (first check), 25
    assert rewind.copies == [(5, 5), (25, 25)]
    _drive(rewind, model, opt, set(), 41, 46)  # check at 45: 20 applied since 25, a copy replaces 5
    assert rewind.copies == [(25, 25), (45, 45)]
    saved = _snapshot(model, opt)
    events = _drive(rewind, model, opt, {47, 52, 58}, 46, 61)
    assert [(s, e.restored, e.first_spike, e.spikes, e.undone) for s, e in events] == [(60, 45, 47, 3, 12)]
    _assert_same(model, opt, saved)
    assert rewind.rewinds == 1 and rewind.pending_skip == 7 and rewind.spike_steps == []
    assert rewind.copies == [(25, 25), (45, 45)] and rewind.applied == 45
    assert list(rewind.batches(range(10))) == [7, 8, 9]
    assert rewind.batches_dropped == 7 and rewind.pending_skip == 0


def test_rewind_drops_copies_newer_than_the_restored_one() -> None:
    """No copy is taken while a spike skip is within `within` windows; the rewind keeps older copies."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    rewind = _bound(Rewind(every=5, keep=3, spikes=2, within=30, skip_batches=0, check_every=5), model, opt)
    events = _drive(rewind, model, opt, {12, 28}, 1, 31)
    assert [(s, e.restored) for s, e in events] == [(30, 10)]
    # no copy during the spike episode (spike 12 is within 30 windows of the checks at 15-25)
    assert rewind.copies == [(5, 5), (10, 10)] and rewind.copies_taken == 2


def test_rewind_without_older_copy_warns_once_and_keeps_training() -> None:
    """Spikes before any usable copy: no restore, one UserWarning naming the windows."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rewind = _bound(Rewind(every=100, spikes=2, within=10, check_every=5), model, opt)
    with pytest.warns(UserWarning, match=re.escape("no copy older than the first of them (window 2)")):
        events = _drive(rewind, model, opt, {2, 3}, 1, 11)
    assert events == [] and rewind.rewinds == 0


def test_check_reads_the_device_once() -> None:
    """observe() reads nothing; check() reads the pending flags in one host read."""
    from ..hostreads import count_host_reads

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rewind = _bound(Rewind(every=100, check_every=4), model, opt)
    with count_host_reads() as reads:
        due = [rewind.observe(s, torch.tensor(0.0), torch.tensor(1.0)) for s in range(1, 5)]
    assert len(reads) == 0 and due == [False, False, False, True]
    with count_host_reads() as reads:
        rewind.check(4, lambda: None)
    assert len(reads) == 1, reads.ours
    assert rewind.applied == 4


def _save_load(state: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_state_dict_round_trip_resumes_exactly() -> None:
    """A Rewind loaded (weights_only) mid-run, with model and optimizer, rewinds and trains identically."""
    runs = []
    for resume in (False, True):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        rewind = _bound(
            Rewind(every=10, keep=2, spikes=2, within=20, skip_batches=3, check_every=5), model, opt
        )
        _drive(rewind, model, opt, {22}, 1, 24)  # copies at 5 and 15; spike 22 saved unchecked
        if resume:
            ckpt = _save_load({"m": model.state_dict(), "o": opt.state_dict(), "r": rewind.state_dict()})
            model = _model()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            rewind = _bound(
                Rewind(every=10, keep=2, spikes=2, within=20, skip_batches=3, check_every=5), model, opt
            )
            model.load_state_dict(ckpt["m"])
            opt.load_state_dict(ckpt["o"])
            rewind.load_state_dict(ckpt["r"])
        events = _drive(rewind, model, opt, {27}, 24, 40)
        runs.append((events, _snapshot(model, opt), rewind.state_dict()))
    (ev_a, snap_a, sd_a), (ev_b, snap_b, sd_b) = runs
    assert [e for _, e in ev_a] == [e for _, e in ev_b] and len(ev_a) == 1
    for p, q in zip(snap_a["params"], snap_b["params"], strict=True):
        assert torch.equal(p, q)
    for key in ("rewinds", "pending_skip", "applied", "spike_steps", "log"):
        assert sd_a[key] == sd_b[key], key
    assert [c["step"] for c in sd_a["copies"]] == [c["step"] for c in sd_b["copies"]]
    for ca, cb in zip(sd_a["copies"], sd_b["copies"], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(ca["leaves"], cb["leaves"], strict=True))


def test_load_state_dict_rejects_bad_state_and_keeps_own() -> None:
    """A corrupt or mismatched Rewind state raises ValueError with the cause; nothing changes."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rewind = _bound(Rewind(every=5, check_every=5), model, opt)
    _drive(rewind, model, opt, set(), 1, 6)
    good = rewind.state_dict()
    tail = "; pass the state saved by Rewind.state_dict() (opt.state_dict()['clipopt'])"
    cases = [
        ([], "invalid Rewind state: expected a dict with format 1, got list"),
        (dict(good, rewinds=-1), "invalid Rewind state: 'rewinds' must be an int >= 0, got -1"),
        (
            dict(good, spike_steps=[1.5]),
            "invalid Rewind state: 'spike_steps' must be a list of window numbers",
        ),
        (
            dict(good, spike_steps=[True]),
            "invalid Rewind state: 'spike_steps' must be a list of window numbers",
        ),
        (
            dict(good, flags=[[3, torch.zeros(2, device="meta")]]),
            "invalid Rewind state: 'flags' must be a list of [window, tensor of 2 flags]",
        ),
        (
            dict(good, log=[{"step": "9", "restored": 5, "first_spike": 6, "spikes": 3, "undone": 2}]),
            "invalid Rewind state: 'log' must be a list of rewind records of ints",
        ),
        (
            dict(good, staged={"step": 5, "buffers": [1.0]}),
            "invalid Rewind state: 'staged' must be None or a dict with 'step' and a list of tensors "
            "'buffers'",
        ),
        (
            dict(good, staged={"step": -5, "buffers": []}),
            "invalid Rewind state: 'step' must be an int >= 0, got -5",
        ),
        (
            dict(good, staged={"step": 5, "buffers": [torch.zeros(6)]}),  # this Rewind has no module
            "invalid Rewind state: its 'staged' buffers have other shapes or dtypes than the module's",
        ),
    ]
    other = torch.nn.Linear(2, 2)
    foreign = Rewind()
    foreign.bind(list(other.parameters()), torch.optim.SGD(other.parameters(), lr=0.1))
    foreign.capture(0, None)
    cases.append(
        (
            dict(good, copies=foreign.state_dict()["copies"]),
            "invalid Rewind state: its copies hold parameters of other shapes or dtypes "
            "than this optimizer's",
        )
    )
    for state, message in cases:
        with pytest.raises(ValueError, match=re.escape(message + tail)):
            rewind.load_state_dict(state)
    assert rewind.copies == [(5, 5)] and rewind.applied == 5


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        ({"every": 0}, ValueError, "every must be an int >= 1, got 0; pass e.g. every=100"),
        ({"keep": 1.5}, TypeError, "keep must be an int >= 1, got 1.5 (float); pass e.g. keep=2"),
        ({"spikes": 0}, ValueError, "spikes must be an int >= 1, got 0; pass e.g. spikes=3"),
        ({"within": -1}, ValueError, "within must be an int >= 1, got -1; pass e.g. within=50"),
        (
            {"skip_batches": -1},
            ValueError,
            "skip_batches must be an int >= 0, got -1; pass e.g. skip_batches=200",
        ),
        (
            {"module": "model"},
            TypeError,
            "module must be a torch.nn.Module or None, got str; "
            "pass e.g. module=model to copy its buffers too",
        ),
        ({"check_every": 0}, ValueError, "check_every must be an int >= 1, got 0; pass e.g. check_every=10"),
        (
            {"spikes": 6, "within": 5},
            ValueError,
            "spikes must be <= within: 6 spike skips can never fall within 5 windows "
            "(spikes=6, within=5), so this Rewind would never rewind; pass e.g. spikes=3, within=50, "
            "or within=60",
        ),
        ({"every": True}, TypeError, "every must be an int >= 1, got True (bool); pass e.g. every=100"),
    ],
)
def test_argument_validation(kwargs: dict[str, Any], exc: type, message: str) -> None:
    """Each bad argument raises its exact message naming the argument, value and fix."""
    with pytest.raises(exc, match=re.escape(message)):
        Rewind(**kwargs)


def test_unbound_rewind_says_how_to_attach() -> None:
    """check() before the optimizer bound the Rewind raises a RuntimeError that says how to pass it."""
    with pytest.raises(RuntimeError, match=re.escape("pass it as ClippedOptimizer(..., rewind=Rewind(...))")):
        Rewind().check(1, lambda: None)


def test_deepcopy_and_pickle_keep_copies() -> None:
    """A Rewind (with its model and optimizer) survives pickling; the copy restores the same state."""
    import pickle

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    rewind = _bound(Rewind(every=5, check_every=5, module=model), model, opt)
    _drive(rewind, model, opt, set(), 1, 6)
    saved = _snapshot(model, opt)
    bundle = pickle.loads(pickle.dumps((model, opt, rewind)))
    m2, o2, r2 = bundle
    _train(m2, o2, 2, seed=9)
    r2.spike_steps = [6, 7, 8]
    hit = r2.check(10, lambda: None)
    assert hit is not None and hit[0].restored == 5
    _assert_same(m2, o2, saved)


def test_restore_writes_matching_state_tensors_in_place() -> None:
    """Restoring reuses the live optimizer state tensors (same storage): no new memory at a rewind."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 2, seed=1)
    target = TrainingState(list(model.parameters()), list(model.buffers()), opt)
    copy = capture(target, None, 2, 2)
    saved = _snapshot(model, opt)
    _train(model, opt, 2, seed=2)
    pointers = {(id(p), k): v.data_ptr() for p, st in opt.state.items() for k, v in st.items()}
    restore(copy, target)
    assert {(id(p), k): v.data_ptr() for p, st in opt.state.items() for k, v in st.items()} == pointers
    _assert_same(model, opt, saved)


@pytest.mark.parametrize(
    ("spikes_again", "restored"), [((21, 22), 11), ((30, 31), 16)], ids=["soon", "later"]
)
def test_spikes_back_soon_after_a_rewind_go_to_an_older_copy(
    spikes_again: tuple[int, int], restored: int
) -> None:
    """Spikes back within `within` windows of a rewind (no copy since) go past its copy; later ones not."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    rewind = _bound(Rewind(every=5, keep=3, spikes=2, within=6, skip_batches=0, check_every=1), model, opt)
    events = _drive(rewind, model, opt, {18, 19}, 1, 20)
    assert [(s, e.restored) for s, e in events] == [(19, 16)] and rewind.copies[-1] == (16, 16)
    rewind.every = 100  # no new copy from here on
    events = _drive(rewind, model, opt, set(spikes_again), 20, 33)
    assert [e.restored for _, e in events] == [restored]


def _with_copy(good: dict[str, Any], **change: Any) -> dict[str, Any]:
    """``good`` with its first copy's entries replaced by ``change``."""
    first = dict(good["copies"][0], **change)
    return dict(good, copies=[first, *good["copies"][1:]])


def test_load_state_dict_refuses_corrupt_copies_before_anything_changes() -> None:
    """A copy whose structure refers to missing leaves, misses buffers, holds state of a parameter the
    optimizer lacks, or names no device is refused at load (ValueError, nothing changed), not at the
    rewind that would restore it half-way."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    rewind = _bound(Rewind(every=5, check_every=5, module=model), model, opt)
    _drive(rewind, model, opt, set(), 1, 6)
    good = rewind.state_dict()
    spec = good["copies"][0]["spec"]
    body = dict(spec[1])
    n = len(good["copies"][0]["leaves"])

    def respec(**parts: Any) -> tuple[str, list[tuple[str, Any]]]:
        return ("d", [(k, parts.get(k, v)) for k, v in spec[1]])

    state_entries = body["state"][1]
    stray = ("u", [("v", 99), state_entries[0][1][1]])  # state of parameter 99
    pointer = ("l", [*body["buffers"][1][:-1], ("t", n + 5)])  # a buffer referring past the leaves
    tail = "; pass the state saved by Rewind.state_dict() (opt.state_dict()['clipopt'])"
    cases = [
        (
            _with_copy(good, spec=respec(buffers=pointer)),
            f"its 'spec' refers to leaf {n + 5}, not one of its {n} leaves",
        ),
        (
            _with_copy(good, spec=respec(buffers=("l", []))),
            "its copies hold buffers of other shapes or dtypes than this optimizer's",
        ),
        (
            _with_copy(good, spec=respec(params=("v", 3))),
            "its 'spec' holds params, buffers or state of another structure than Rewind's",
        ),
        (
            _with_copy(good, spec=respec(state=("l", [stray]))),
            "its copies hold optimizer state of parameters this optimizer does not have",
        ),
        (_with_copy(good, spec=("d", "x")), "a 'd' node of its 'spec' does not hold a list"),
        (
            _with_copy(good, devices=["no-such-device"] * n),
            "a copy's 'devices' must name devices, got ['no-such-device'",
        ),
    ]
    for state, message in cases:
        with pytest.raises(ValueError, match=re.escape("invalid Rewind state: " + message)) as info:
            rewind.load_state_dict(state)
        assert str(info.value).endswith(tail)
    assert rewind.copies == [(5, 5)] and rewind.applied == 5


def test_state_with_copies_loads_with_weights_only_into_a_fresh_optimizer() -> None:
    """torch.load(weights_only=True) of the state, loaded by a fresh Rewind on a fresh model, restores
    what the original held, bit for bit; a Rewind with another module's buffers refuses it at load."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    rewind = _bound(Rewind(every=5, check_every=5, module=model), model, opt)
    _drive(rewind, model, opt, set(), 1, 6)
    want = _snapshot(model, opt)
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "rewind": rewind.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    fresh = _model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    fresh_opt.load_state_dict(saved["opt"])
    fresh_rewind = _bound(Rewind(every=5, spikes=2, check_every=5, module=fresh), fresh, fresh_opt)
    fresh_rewind.load_state_dict(saved["rewind"])
    events = _drive(fresh_rewind, fresh, fresh_opt, {6, 7}, 6, 11)  # trains 8-9, rewinds at 10
    assert [(s, e.restored) for s, e in events] == [(10, 5)]
    _assert_same(fresh, fresh_opt, want)
    other = _bound(Rewind(every=5, check_every=5), fresh, fresh_opt)  # no module: no buffers
    with pytest.raises(ValueError, match="its copies hold buffers of other shapes or dtypes"):
        other.load_state_dict(saved["rewind"])
    assert other.copies == []


def test_copy_loaded_from_other_devices_restores_onto_the_live_state() -> None:
    """A state saved on another device (here its device names rewritten to 'meta', as a GPU checkpoint
    resumed on the CPU names 'cuda:0') restores onto the parameters' and live state's devices, bit for
    bit, not onto the saved device names."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    rewind = _bound(Rewind(every=5, spikes=2, check_every=5, module=model), model, opt)
    _drive(rewind, model, opt, set(), 1, 6)
    want = _snapshot(model, opt)
    saved = rewind.state_dict()
    for entry in saved["copies"]:
        entry["devices"] = ["meta"] * len(entry["devices"])
    fresh = _model()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    fresh_opt.load_state_dict(opt.state_dict())
    fresh_rewind = _bound(Rewind(every=5, spikes=2, check_every=5, module=fresh), fresh, fresh_opt)
    fresh_rewind.load_state_dict(saved)
    events = _drive(fresh_rewind, fresh, fresh_opt, {6, 7}, 6, 11)
    assert [(s, e.restored) for s, e in events] == [(10, 5)]
    assert all(t.device.type == "cpu" for st in fresh_opt.state.values() for t in st.values())
    _assert_same(fresh, fresh_opt, want)
