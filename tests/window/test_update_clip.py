"""``UpdateClip`` and ``update_stats``: the update the inner optimizer made, measured and bounded.

The references are written here, independently of clipopt: the bare inner optimizer steps, the
test forms ``u = p_after - p_before`` and bounds it by the formulas of optax/Levanter in float64
NumPy (``max_rms``: ``u / max(1, rms(u) / max_rms)``; ``max_norm``: ``u / max(1, ||u|| / max_norm)``;
``z``: Levanter's ``clip_update_norm``).
"""

from __future__ import annotations

import copy
import csv
import io
import math
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from clipopt import ClippedOptimizer, CSVLogger, UpdateClip
from clipopt._window import update_apply
from clipopt._window.update_clip import rms_coefs, z_bound

from ..helpers import ZeroDivideSGD, assert_tensors_close, batches_for, model_for, mse, spawn_job
from ..hostreads import count_host_reads
from ..markers import needs_gloo
from ..optim_db import OptimInfo, get, params
from ..strategies import grad_arrays, to_tensors

#: The inner optimizers the references run (cheap on CPU): AdamW and SGD with momentum, foreach and fused.
INNERS = [get("AdamW-foreach"), get("AdamW-fused"), get("SGD-momentum-foreach"), get("SGD-momentum-fused")]

#: Each mode with a limit that bounds some windows of these runs and leaves others (lr 0.01).
MODES: dict[str, dict[str, Any]] = {
    "max_rms": {"max_rms": 0.008},
    "max_norm": {"max_norm": 0.045},
    "z": {"z": 0.2, "window": 4},
}
LR = 0.01

#: The window whose gradients are made nan in the reference runs (skipped: no update, no history).
NAN_WINDOW = 4


def _backward(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], nan: bool = False) -> None:
    mse(model, batch).backward()
    if nan:
        next(iter(model.parameters())).grad.view(-1)[0] = math.nan  # type: ignore[union-attr]


def _reference_coefs(
    mode: str, limits: dict[str, Any], updates: list[np.ndarray], history: list[float]
) -> tuple[list[float], float]:
    """Each tensor's coefficient by the published rule, and the update's total norm (float64)."""
    total = math.sqrt(sum(float(np.sum(u * u)) for u in updates))
    if mode == "max_rms":
        limit = limits["max_rms"]
        return [1.0 / max(1.0, math.sqrt(float(np.mean(u * u))) / limit) for u in updates], total
    if mode == "max_norm":
        return [1.0 / max(1.0, total / limits["max_norm"])] * len(updates), total
    window, z = limits["window"], limits["z"]  # Levanter's clip_update_norm
    coef = 1.0
    if len(history) >= max(2, window // 2):
        ring = np.array(history[-window:])
        bound = ring.mean() + z * max(ring.std(), 1e-6)
        if total > bound:
            coef = bound / max(total, 1e-6)
    return [coef] * len(updates), total


def _reference_run(
    info: OptimInfo, mode: str, windows: int
) -> tuple[list[torch.Tensor], list[float], list[float]]:
    """The bare inner optimizer with its update bounded by hand after every step; the nan window is
    not stepped (and adds nothing to the history).  Returns the parameters, each window's update
    norm (0 for the nan window) and the smallest coefficient (1 for the nan window)."""
    model = model_for()
    inner = info.make(model.parameters(), lr=LR)
    history: list[float] = []
    norms, coefs = [], []
    for i, batch in enumerate(batches_for(windows, seed=3)):
        if i == NAN_WINDOW:
            norms.append(0.0)
            coefs.append(1.0)
            continue
        _backward(model, batch)
        before = [p.detach().clone() for p in model.parameters()]
        inner.step()
        inner.zero_grad()
        with torch.no_grad():
            updates = [p - b for p, b in zip(model.parameters(), before, strict=True)]
            c, total = _reference_coefs(mode, MODES[mode], [u.double().numpy() for u in updates], history)
            for p, b, u, coef in zip(model.parameters(), before, updates, c, strict=True):
                p.copy_((b.double() + coef * u.double()).float())
        history.append(total)
        norms.append(total)
        coefs.append(min(c))
    return [p.detach() for p in model.parameters()], norms, coefs


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("info", params(INNERS))
def test_each_mode_gives_the_update_bounded_by_hand(info: OptimInfo, mode: str) -> None:
    """max_rms, max_norm and z around AdamW (foreach, fused) and SGD with momentum: parameters,
    update norms and coefficients as the reference bounds them by hand (float32 against float64:
    rtol 1e-5); a window with nan gradients is skipped, records an update norm of 0 and does not
    enter z's history; some windows are bounded and some are not."""
    windows = 12
    model = model_for()
    opt = ClippedOptimizer(
        info.make(model.parameters(), lr=LR), max_norm=None, update_clip=UpdateClip(**MODES[mode])
    )
    norms, coefs = [], []
    for i, batch in enumerate(batches_for(windows, seed=3)):
        _backward(model, batch, nan=i == NAN_WINDOW)
        opt.step()
        opt.zero_grad()
        assert opt.last_stats is not None
        norms.append(opt.last_stats.update_norm)
        coefs.append(opt.last_stats.update_coef)
    want_params, want_norms, want_coefs = _reference_run(info, mode, windows)
    for got, want in zip(model.parameters(), want_params, strict=True):
        torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-7)
    assert norms == pytest.approx(want_norms, rel=1e-5)
    assert coefs == pytest.approx(want_coefs, rel=1e-5)
    assert opt.stats[NAN_WINDOW].reason == "nonfinite"
    assert any(c < 0.99 for c in coefs) and sum(c == 1.0 for c in coefs) >= 2


@pytest.mark.parametrize("options", [{"update_stats": True}, {"update_clip": UpdateClip(max_norm=1e6)}])
@pytest.mark.parametrize("info", params(INNERS))
def test_an_update_left_as_it_is_is_the_inner_optimizers_bit_for_bit(info: OptimInfo, options: dict) -> None:
    """update_stats=True, and an UpdateClip whose bound is never reached: the parameters are the bare
    inner optimizer's bit for bit (p_after - 0 * u is p_after); the recorded norm is that of the
    update the test measures, the coefficient 1."""
    model, bare = model_for(), model_for()
    opt = ClippedOptimizer(info.make(model.parameters(), lr=LR), max_norm=None, **options)
    inner = info.make(bare.parameters(), lr=LR)
    for batch in batches_for(5, seed=4):
        _backward(model, batch)
        _backward(bare, batch)
        before = [p.detach().clone() for p in bare.parameters()]
        opt.step()
        inner.step()
        opt.zero_grad()
        inner.zero_grad()
        for got, want in zip(model.parameters(), bare.parameters(), strict=True):
            assert torch.equal(got, want)
        update = torch.cat(
            [(p.detach() - b).double().reshape(-1) for p, b in zip(bare.parameters(), before, strict=True)]
        )
        assert opt.last_stats is not None
        assert opt.last_stats.update_norm == pytest.approx(float(update.norm()), rel=1e-5)
        assert opt.last_stats.update_coef == 1.0


def _state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


#: Each update option, the inner state put back or not: (options, whether the state is put back).
PUT_BACK: dict[str, tuple[dict[str, Any], bool]] = {
    "update_stats": ({"update_stats": True}, False),
    **{mode: ({"update_clip": UpdateClip(**limits)}, False) for mode, limits in MODES.items()},
    **{
        f"{mode}-restore_state": ({"update_clip": UpdateClip(**limits, restore_state=True)}, True)
        for mode, limits in MODES.items()
    },
}


def _zero_divide_run(options: dict, bad_calls: set[int], windows: int = 4) -> tuple[Any, ...]:
    """The dividing optimizer (max_norm=1.0) with ``options``: the parameters and inner state after
    each window, and the wrapper."""
    model = model_for()
    inner = ZeroDivideSGD(model.parameters(), lr=0.01, bad_calls=bad_calls)
    opt = ClippedOptimizer(inner, max_norm=1.0, **options)
    params_after, state_after = [], []
    for batch in batches_for(windows, seed=5):
        _backward(model, batch)
        opt.step()
        opt.zero_grad()
        params_after.append([p.detach().clone() for p in model.parameters()])
        state_after.append(_state(inner))
    return params_after, state_after, opt


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize(("options", "restores"), list(PUT_BACK.values()), ids=list(PUT_BACK))
def test_a_nonfinite_update_from_finite_gradients_is_put_back(
    options: dict, restores: bool, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An inner optimizer dividing by zero in its third step (finite gradients): the parameters are
    those after the second window, bit for bit; the window is skipped with reason
    "nonfinite_update", its coefficient 0 and its update norm not finite; it is not in z's history;
    the gradient norm stays finite.  The inner state (momentum, step count): with
    restore_state=True that after the second window, bit for bit; without, what the third step made
    of the window's gradient (that of the same wrapper around an optimizer that does not divide by
    zero and has no update option, after three windows).  Both the CPU's path (the decision read on
    the host) and the accelerators' (``path="device"``: a device select) are run."""
    if path == "device":
        monkeypatch.setattr(update_apply, "HOST_DECIDED", frozenset())
    params_after, state_after, opt = _zero_divide_run(copy.deepcopy(options), {3})
    stats = list(opt.stats)
    assert [s.reason for s in stats] == [None, None, "nonfinite_update", None]
    assert stats[2].skipped and math.isfinite(stats[2].total_norm) and not math.isfinite(stats[2].update_norm)
    assert stats[2].update_coef == 0.0
    assert all(torch.equal(a, b) for a, b in zip(params_after[2], params_after[1], strict=True))
    want = state_after[1] if restores else _zero_divide_run({}, set(), windows=3)[1][2]
    assert all(torch.equal(a, b) for a, b in zip(state_after[2], want, strict=True))
    if not restores:  # the rejected step did change the state
        assert not all(torch.equal(a, b) for a, b in zip(state_after[2], state_after[1], strict=True))
    assert opt.num_skipped == 1 and opt.num_updates == 3
    if opt.update_clip is not None and opt.update_clip.mode == "z":
        assert int(opt.update_clip.state_dict()["count"]) == 3


def test_after_a_put_back_update_training_goes_on_as_if_it_never_happened() -> None:
    """UpdateClip(restore_state=True), never bounding, around the dividing optimizer: after the
    rejected third window the run is, bit for bit, the run of the same optimizer that never saw
    that window's batch."""
    model, bare = model_for(), model_for()
    bound = UpdateClip(max_norm=1e6, restore_state=True)
    opt = ClippedOptimizer(ZeroDivideSGD(model.parameters(), bad_calls={3}), max_norm=None, update_clip=bound)
    inner = ZeroDivideSGD(bare.parameters())
    for i, batch in enumerate(batches_for(6, seed=6)):
        _backward(model, batch)
        opt.step()
        opt.zero_grad()
        if i != 2:
            _backward(bare, batch)
            inner.step()
            inner.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), bare.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(_state(opt), _state(inner), strict=True))


class _NanStateSGD(ZeroDivideSGD):
    """ZeroDivideSGD whose momentum becomes nan in its third step (finite gradients): from then on
    every update it makes is nan, unless its state is put back."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if self.calls + 1 == 3:
            for state in self.state.values():
                state["momentum"].fill_(math.nan)
        return super().step(closure)


@pytest.mark.parametrize("restore_state", [False, True])
def test_a_nonfinite_inner_state_is_never_left_silent(restore_state: bool) -> None:
    """The inner optimizer's state turns nan in the third step.  Without restore_state the state
    keeps it, every later update is rejected, and after 10 in a row a RuntimeWarning names
    "nonfinite_update" and restore_state=True; with it the state is put back and the fourth update
    is applied (no warning)."""
    model = model_for()
    opt = ClippedOptimizer(
        _NanStateSGD(model.parameters()), update_clip=UpdateClip(max_norm=1e6, restore_state=restore_state)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in batches_for(13, seed=10):
            _backward(model, batch)
            opt.step()
            opt.zero_grad()
    reasons = [s.reason for s in opt.stats]
    found = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    if restore_state:
        assert reasons == [None, None, "nonfinite_update", *[None] * 10] and not found
        return
    assert reasons == [None, None, *["nonfinite_update"] * 11]
    assert len(found) == 1 and "'nonfinite_update' x10" in found[0] and "restore_state=True" in found[0]
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def _reads_per_window(opt: ClippedOptimizer, model: torch.nn.Module, pattern: str) -> list[int]:
    """Host reads of each step() call ('g': good gradients, 'b': a nan gradient)."""
    counts = []
    for batch, c in zip(batches_for(len(pattern), seed=7), pattern, strict=True):
        _backward(model, batch, nan=c == "b")
        with count_host_reads() as reads:
            opt.step()
            stats = opt.last_stats  # recording and holding statistics reads nothing
        counts.append(len(reads))
        del stats
        opt.zero_grad()
    return counts


@pytest.mark.parametrize(
    "options",
    [{"update_stats": True}, *({"update_clip": UpdateClip(**limits)} for limits in MODES.values())],
    ids=["update_stats", *MODES],
)
@pytest.mark.parametrize("path", ["host", "device"])
def test_fused_adamw_with_update_clipping_reads_nothing(
    options: dict, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fused AdamW with each mode (and update_stats), on the CPU's path and on the accelerators'
    (a device select): after the first update (no state yet), an update, applied or skipped, makes
    no host read."""
    if path == "device":
        monkeypatch.setattr(update_apply, "HOST_DECIDED", frozenset())
    model = model_for()
    opt = ClippedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.01, fused=True), max_norm=0.1, **copy.deepcopy(options)
    )
    counts = _reads_per_window(opt, model, "ggbggbgg")
    assert counts[1:] == [0] * 7


@pytest.mark.parametrize("restore_state", [False, True])
@pytest.mark.parametrize("path", ["host", "device"])
def test_putting_back_a_nonfinite_update_reads_nothing(
    path: str, restore_state: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dividing optimizer (state on the parameters' device) with skip_nonfinite=False, so that
    clipopt's host path reads nothing: the rejected third update is put back without a host read.
    On the accelerators' path (a device select) with restore_state=True, the first update, which
    creates the optimizer's state, reads the flag once (its state could only be put back by
    removing it); without restore_state nothing is read at all.  On the CPU's path the decision is
    read through cpu_values only (no sync: tests/hostreads.py counts it apart), once per window;
    the other CPU reads are the norms' overflow checks (functional.py, through cpu_value: #35)."""
    if path == "device":
        monkeypatch.setattr(update_apply, "HOST_DECIDED", frozenset())
    model = model_for()
    inner = ZeroDivideSGD(model.parameters(), bad_calls={3})
    bound = UpdateClip(max_rms=1.0, restore_state=restore_state)
    opt = ClippedOptimizer(inner, max_norm=0.1, skip_nonfinite=False, update_clip=bound)
    want = [1 if restore_state and path == "device" else 0] + [0] * 4
    assert _reads_per_window(opt, model, "ggggg") == want
    assert [s.reason for s in opt.stats] == [None, None, "nonfinite_update", None, None]
    with count_host_reads() as reads:
        _backward(model, batches_for(1, seed=8)[0])
        opt.step()
    decision = [r for r in reads.cpu if r.startswith("update_apply.py")]
    assert len(decision) == (1 if path == "host" else 0)
    assert all(r.startswith(("update_apply.py", "functional.py")) for r in reads.cpu), reads.cpu


def test_update_columns_and_tags_read_back_as_recorded(tmp_path: Path) -> None:
    """CSVLogger and TensorBoardLogger (read back by csv and TensorBoard's EventAccumulator) hold
    update_norm and update_coef as StepStats had them; a first window without gradients (no update
    recorded) leaves the cells empty, and the columns are added when the first update is recorded."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from clipopt import TensorBoardLogger

    model = model_for()
    csv_path, tb_dir = tmp_path / "log.csv", tmp_path / "tb"
    opt = ClippedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.01),
        update_clip=UpdateClip(max_norm=0.03),
        loggers=[CSVLogger(csv_path), TensorBoardLogger(tb_dir)],
    )
    for i, batch in enumerate(batches_for(5, seed=8)):
        if i > 0:  # the first window has no gradient: reason "nograd", nothing recorded
            _backward(model, batch, nan=i == 3)
        opt.step()
        opt.zero_grad()
    opt.close()
    stats = list(opt.stats)
    assert stats[0].update_norm is None and stats[3].update_norm == 0.0
    rows = list(csv.DictReader(io.StringIO(csv_path.read_text())))
    assert rows[0]["update_norm"] == rows[0]["update_coef"] == ""
    assert [float(r["update_norm"]) for r in rows[1:]] == [s.update_norm for s in stats[1:]]
    assert [float(r["update_coef"]) for r in rows[1:]] == [s.update_coef for s in stats[1:]]
    events = EventAccumulator(str(tb_dir))
    events.Reload()
    for tag in ("update_norm", "update_coef"):
        scalars = events.Scalars(f"clipopt/{tag}")
        assert [e.step for e in scalars] == [2, 3, 4, 5]
        want = [getattr(s, tag) for s in stats[1:]]
        assert [e.value for e in scalars] == pytest.approx(want, rel=1e-6)


def _z_run(stop: int | None, total: int, state: dict | None = None) -> tuple[Any, ...]:
    """SGD with momentum, UpdateClip(z=0.2, window=4) and accumulation_steps=2 over ``total``
    micro-batches (the fifth with a nan gradient, the 15th and 16th with targets 5 times larger: a
    spike in the update); ``stop``: return a state dict (and the optimizer) after that many."""
    model = model_for()
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        accumulation_steps=2,
        update_clip=UpdateClip(z=0.2, window=4),
    )
    start = 0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["done"]
    for i, (x, y) in enumerate(batches_for(total, seed=9)):
        if i < start:
            continue
        _backward(model, (x, y * 5 if i in (14, 15) else y), nan=i == 4)
        opt.step()
        opt.zero_grad()
        if stop is not None and i + 1 == stop:
            return {"model": model.state_dict(), "opt": opt.state_dict(), "done": stop}, opt
    return model, opt


def test_the_z_history_resumes_from_a_checkpoint_bit_for_bit(tmp_path: Path) -> None:
    """A state dict saved mid-window (micro-batch 11 of 20, accumulation 2), written with torch.save
    and read with weights_only=True into a fresh model and optimizer, continues bit for bit as the
    uninterrupted run: parameters, the z history and every later window's update norm and
    coefficient."""
    model, opt = _z_run(None, 20)
    saved, _ = _z_run(11, 20)
    torch.save(saved, tmp_path / "ckpt.pt")
    resumed_model, resumed = _z_run(None, 20, torch.load(tmp_path / "ckpt.pt", weights_only=True))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters(), strict=True))
    history, again = opt.update_clip.state_dict(), resumed.update_clip.state_dict()
    assert all(torch.equal(history[k], again[k]) for k in ("history", "count", "next"))
    assert int(history["count"]) == 4  # 9 applied windows, 1 skipped; the ring holds the last 4
    tail = [(s.update_norm, s.update_coef) for s in list(opt.stats)[5:]]  # windows 6 to 10
    assert tail == [(s.update_norm, s.update_coef) for s in resumed.stats]
    assert any(c < 1.0 for _, c in tail)


@pytest.mark.parametrize("saved_with", [{"max_rms": 0.008}, {"max_norm": 0.045}, None])
def test_a_checkpoint_loads_across_update_clip_modes_with_an_empty_history(saved_with: dict | None) -> None:
    """A state dict saved with UpdateClip(max_rms=...), UpdateClip(max_norm=...) or no update_clip
    (3 windows) loads into an optimizer with UpdateClip(z=..., window=4) that had a history (before,
    the first two were refused as "invalid UpdateClip state"): the windows are those of the
    checkpoint and the z history starts empty.  And a z history loads into UpdateClip(max_rms=...)
    (which keeps none)."""
    model = model_for()
    options = {} if saved_with is None else {"update_clip": UpdateClip(**saved_with)}
    source = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), max_norm=None, **options)
    for batch in batches_for(3, seed=9):
        _backward(model, batch)
        source.step()
        source.zero_grad()
    saved = source.state_dict()
    z_saved, z_opt = _z_run(6, 6)
    assert int(z_opt.update_clip.state_dict()["count"]) > 0
    z_opt.load_state_dict(saved)
    if saved_with is None:  # no history saved at all: an older checkpoint's rule (kept as it is)
        return
    assert z_opt.num_windows == 3 and int(z_opt.update_clip.state_dict()["count"]) == 0
    rms = ClippedOptimizer(
        torch.optim.SGD(model_for().parameters(), lr=0.05, momentum=0.9),
        accumulation_steps=2,
        update_clip=UpdateClip(max_rms=0.01),
    )
    rms.load_state_dict(z_saved["opt"])
    assert rms.num_windows == 3


def test_a_z_history_of_another_window_is_refused_before_anything_changes() -> None:
    """Loading a state dict saved with UpdateClip(z=..., window=4) into one with window=8 raises
    ValueError naming both, and leaves the optimizer's counters and history as they were."""
    saved, _ = _z_run(6, 6)
    model = model_for()
    opt = ClippedOptimizer(torch.optim.AdamW(model.parameters()), update_clip=UpdateClip(z=1.0, window=8))
    message = (
        "invalid UpdateClip state: expected the history of 8 update norms saved by "
        "UpdateClip(z=..., window=8); load a state dict saved with the same update_clip"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        opt.load_state_dict(saved["opt"])
    assert opt.num_windows == 0 and int(opt.update_clip.state_dict()["count"]) == 0


_RING = "are not those of a ring of 4 norms (0 <= count <= 4, next the slot after the newest)"
_NORMS = "the history holds a norm that is not finite and >= 0"


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"next": torch.tensor(4)}, f"count=4 and next=4 {_RING}"),  # the slot past the ring
        ({"next": torch.tensor(-1)}, f"count=4 and next=-1 {_RING}"),
        ({"count": torch.tensor(9)}, f"count=9 and next=1 {_RING}"),
        ({"count": torch.tensor(-2)}, f"count=-2 and next=1 {_RING}"),
        ({"count": torch.tensor(2.5)}, f"count=2.5 and next=1 {_RING}"),
        ({"count": torch.tensor(2)}, f"count=2 and next=1 {_RING}"),  # a ring not yet full has next == count
        ({"history": torch.tensor([1.0, math.nan, 1.0, 1.0])}, _NORMS),
        ({"history": torch.tensor([1.0, -1.0, 1.0, 1.0])}, _NORMS),
        ({"history": torch.tensor([1.0, math.inf, 1.0, 1.0])}, _NORMS),
    ],
)
def test_a_corrupt_z_history_is_refused_before_anything_changes(entry: dict, message: str) -> None:
    """A saved z history (window 4, full: count 4, next 1) with one entry out of what a ring of 4
    norms can hold (a slot outside the ring, which the next window's index_select would fail on;
    a count outside [0, 4] or not whole; a norm nan, inf or negative, which would turn the bound
    off or make it nonsense) is a ValueError naming the problem, and the optimizer's counters and
    history stay as they were."""
    saved, _ = _z_run(20, 20)
    ring = saved["opt"]["clipopt"]["update_clip"]
    assert int(ring["count"]) == 4 and int(ring["next"]) == 1  # the valid state the entries corrupt
    saved["opt"]["clipopt"]["update_clip"] = {**ring, **entry}
    model = model_for()
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), update_clip=UpdateClip(z=0.2, window=4)
    )
    with pytest.raises(ValueError, match=re.escape(f"invalid UpdateClip state: {message}; ")):
        opt.load_state_dict(saved["opt"])
    assert opt.num_windows == 0 and int(opt.update_clip.state_dict()["count"]) == 0


def test_update_clip_with_per_group_clipping_bounds_every_tensor() -> None:
    """Per-group gradient clipping (a group with its own max_norm) and UpdateClip(max_rms=...): each
    parameter tensor's change per window, measured by the test, has rms <= max_rms (float32 slack),
    and the group statistics are recorded beside the update's."""
    model = model_for()
    params = list(model.parameters())
    inner = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "max_norm": 0.5}], lr=0.05)
    opt = ClippedOptimizer(inner, max_norm=1.0, update_clip=UpdateClip(max_rms=0.01))
    for batch in batches_for(4, seed=10):
        _backward(model, batch)
        before = [p.detach().clone() for p in params]
        opt.step()
        opt.zero_grad()
        for p, b in zip(params, before, strict=True):
            rms = float((p.detach() - b).double().pow(2).mean().sqrt())
            assert rms <= 0.01 * (1 + 1e-5)
        assert opt.last_stats is not None and opt.last_stats.has_group_stats
        assert opt.last_stats.update_coef < 1.0


def test_lbfgs_records_its_update_with_update_stats() -> None:
    """update_stats=True around LBFGS (which re-evaluates its closure): the recorded update norm is
    the norm of the change its whole step made, measured by the test."""
    model = model_for()
    opt = ClippedOptimizer(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4), update_stats=True)
    batch = batches_for(1, seed=11)[0]

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = mse(model, batch)
        loss.backward()
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    opt.step(closure)
    change = torch.cat(
        [(p.detach() - b).reshape(-1) for p, b in zip(model.parameters(), before, strict=True)]
    )
    assert opt.last_stats is not None and float(change.norm()) > 0
    assert opt.last_stats.update_norm == pytest.approx(float(change.double().norm()), rel=1e-5)


def test_the_repr_names_the_update_clip() -> None:
    """repr(ClippedOptimizer) lists update_clip (and update_stats) like the other parts; without them
    it is as before (the settings, then the inner optimizer indented)."""
    model = model_for()
    plain = repr(ClippedOptimizer(torch.optim.SGD(model.parameters())))
    assert plain.startswith(
        "ClippedOptimizer(max_norm=1.0, norm_type=2.0, clip_value=None, accumulation_steps=1, "
        "reduction='mean', skip_nonfinite=True,\n  SGD (\n"
    )
    assert plain.endswith("\n  )\n)")
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters()), update_clip=UpdateClip(z=3.0, window=16))
    assert "update_clip=UpdateClip(z=3, window=16)," in repr(opt)
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters()), update_stats=True)
    assert "update_stats=True," in repr(opt)


# ---------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {},
            ValueError,
            "UpdateClip takes exactly one of max_rms, max_norm or z, got none of them; the bound is "
            "on the update after the learning rate (with AdamW at lr=1e-3 its elements are at most "
            "about 1e-3): pass e.g. UpdateClip(max_rms=1e-3), UpdateClip(max_norm=0.5) or "
            "UpdateClip(z=3.0, window=128)",
        ),
        (
            {"max_rms": 1.0, "z": 3.0},
            ValueError,
            "UpdateClip takes exactly one of max_rms, max_norm or z, got max_rms=1.0, z=3.0; the bound",
        ),
        (
            {"max_rms": -1.0},
            ValueError,
            "max_rms must be a positive finite number or None, got -1.0; pass e.g. max_rms=1e-3, "
            "or max_rms=None to turn it off",
        ),
        (
            {"max_norm": "1"},
            TypeError,
            "max_norm must be a float or None, got '1' (str); pass e.g. max_norm=0.5, "
            "or max_norm=None to turn it off",
        ),
        ({"z": 3.0, "window": 1}, ValueError, "window must be an int >= 2, got 1; pass e.g. window=128"),
        (
            {"z": 3.0, "restore_state": 1},
            TypeError,
            "restore_state must be True or False, got 1 (int); pass restore_state=True or "
            "restore_state=False",
        ),
        (
            {"z": 3.0, "window": 8.0},
            TypeError,
            "window must be an int >= 2, got 8.0 (float); pass e.g. window=128",
        ),
        (
            {"max_rms": 1.0, "window": 64},
            ValueError,
            "window=64 is the history of UpdateClip(z=...), not of max_rms=...; "
            "pass UpdateClip(max_rms=1.0) without window, or use z=3.0",
        ),
    ],
)
def test_bad_update_clip_arguments_are_refused(kwargs: dict, error: type, message: str) -> None:
    """Each bad UpdateClip argument raises the error that names it, its value and the fix."""
    with pytest.raises(error, match=re.escape(message)):
        UpdateClip(**kwargs)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("update_clip", "max_rms", "update_clip must be an UpdateClip or None, got str; "),
        ("update_stats", "yes", "update_stats must be True or False, got 'yes' (str); "),
    ],
)
def test_update_options_reassigned_to_a_bad_value_are_refused_at_the_first_step(
    name: str, value: str, message: str
) -> None:
    """``opt.update_clip`` / ``opt.update_stats`` reassigned to a value of another type: the
    assignment itself raises the TypeError of the constructor's check (naming the argument, the
    value and the fix; #32), the setting stays, and the next step closes its window as before."""
    model = model_for()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), update_clip=UpdateClip(max_rms=1.0))
    before = getattr(opt, name)
    with pytest.raises(TypeError, match=re.escape(message)):
        setattr(opt, name, value)
    assert getattr(opt, name) is before
    _backward(model, batches_for(1, seed=0)[0])
    opt.step()
    assert opt.num_windows == 1


def test_bad_optimizer_arguments_are_refused() -> None:
    """update_clip of another type, update_stats not a bool, and update_clip around LBFGS raise errors
    naming the argument, the value and the fix."""
    model = model_for()
    with pytest.raises(
        TypeError,
        match=re.escape(
            "update_clip must be an UpdateClip or None, got float; "
            "pass e.g. update_clip=UpdateClip(max_rms=1e-3) (a bound on the update, after the "
            "learning rate)"
        ),
    ):
        ClippedOptimizer(torch.optim.SGD(model.parameters()), update_clip=1.0)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError,
        match=re.escape(
            "update_stats must be True or False, got 'yes' (str); "
            "pass update_stats=True or update_stats=False"
        ),
    ):
        ClippedOptimizer(torch.optim.SGD(model.parameters()), update_stats="yes")  # type: ignore[arg-type]
    message = (
        "update_clip=UpdateClip(max_rms=1) cannot bound the step of LBFGS: its line search and curvature "
        "pairs assume the step it took; pass update_clip=None (update_stats=True records the update norm)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        ClippedOptimizer(torch.optim.LBFGS(model.parameters()), update_clip=UpdateClip(max_rms=1.0))


# ---------------------------------------------------------------------------- the pure rules


@given(grad_arrays(), st.floats(min_value=1e-3, max_value=1e3))
def test_rms_coefficients_bound_every_tensor(arrays: list[np.ndarray], max_rms: float) -> None:
    """For random updates: each coefficient is NumPy's 1 / max(1, rms / max_rms) (rtol 1e-5), the
    bounded tensor's rms is at most max_rms (float32 slack), and a tensor already within the bound
    keeps coefficient 1."""
    tensors = to_tensors(arrays)
    norms = torch.stack([torch.linalg.vector_norm(t) for t in tensors])
    coefs = rms_coefs(norms, [t.numel() for t in tensors], max_rms).tolist()
    for a, coef in zip(arrays, coefs, strict=True):
        rms = math.sqrt(float(np.mean(a.astype(np.float64) ** 2)))
        assert coef == pytest.approx(1.0 / max(1.0, rms / max_rms), rel=1e-5)
        assert coef * rms <= max_rms * (1 + 1e-5)
        if rms < max_rms * (1 - 1e-5):
            assert coef == 1.0


@given(
    st.lists(st.floats(min_value=0.0, max_value=1e3, width=32), min_size=0, max_size=8),
    st.integers(min_value=2, max_value=8),
    st.floats(min_value=0.1, max_value=6.0),
)
def test_z_bound_is_levanters(values: list[float], window: int, z: float) -> None:
    """The bound from a ring holding ``values`` (at most ``window`` of them, in its first slots) is
    Levanter's: inf while fewer than max(2, window // 2), then mean + z * max(std, 1e-6) of the
    values (population std; float32 against NumPy float64: rtol 1e-4 + 1e-5 absolute)."""
    values = values[:window]
    history = torch.zeros(window)
    history[: len(values)] = torch.tensor(values, dtype=torch.float32)
    got = float(z_bound(history, torch.tensor(len(values)), z, window))
    if len(values) < max(2, window // 2):
        assert got == math.inf
    else:
        ring = np.array(values, dtype=np.float64)
        assert got == pytest.approx(ring.mean() + z * max(ring.std(), 1e-6), rel=1e-4, abs=1e-5)


def test_the_update_clip_survives_deepcopy_and_pickle() -> None:
    """A wrapper with UpdateClip(z=...) is copied with its history (copy.deepcopy), which then runs
    on as the original does."""
    model = model_for()
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), update_clip=UpdateClip(z=1.0, window=4)
    )
    for batch in batches_for(3, seed=12):
        _backward(model, batch)
        opt.step()
        opt.zero_grad()
    twin = copy.deepcopy(opt)
    assert twin.update_clip is not opt.update_clip
    assert int(twin.update_clip.state_dict()["count"]) == 3


# ---------------------------------------------------------------------------- combinations


@pytest.mark.parametrize("fused", [False, True])
def test_a_grad_scaler_overflow_makes_no_update_and_no_history_entry(fused: bool) -> None:
    """A GradScaler run (CPU, scale 2**8) whose third loss overflows once scaled: that window is
    skipped with reason "overflow", records an update norm of 0 and adds nothing to z's history;
    every window matches, bit for bit, the run without a scaler that never saw that batch."""
    runs = []
    for scaled in (True, False):
        model = model_for()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if scaled else None
        opt = ClippedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=LR, fused=fused),
            max_norm=1.0,
            scaler=scaler,
            update_clip=UpdateClip(z=0.2, window=4),
        )
        for i, (x, y) in enumerate(batches_for(8, seed=13)):
            if i == 2 and not scaled:
                continue
            loss = mse(model, (x, y))
            (loss if scaler is None else scaler.scale(loss * (3e38 if i == 2 else 1.0))).backward()
            opt.step()
            opt.zero_grad()
        runs.append((model, opt))
    (model, opt), (bare_model, bare) = runs
    stats = list(opt.stats)
    assert stats[2].reason == "overflow" and stats[2].update_norm == 0.0
    assert int(opt.update_clip.state_dict()["count"]) == int(bare.update_clip.state_dict()["count"]) == 4
    assert [s.update_norm for s in stats[:2] + stats[3:]] == [s.update_norm for s in bare.stats]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), bare_model.parameters(), strict=True))


def test_several_inner_optimizers_are_bounded_and_put_back_as_one() -> None:
    """ClippedOptimizer([ZeroDivideSGD(first layer), AdamW(rest)], update_clip=max_norm): one
    coefficient for all parameters (the test's own global norm of the change), and a non-finite
    update of the first optimizer puts back both optimizers' parameters and (restore_state=True)
    state."""
    model = model_for()
    params = list(model.parameters())
    first, rest = ZeroDivideSGD(params[:2], lr=0.01, bad_calls={3}), torch.optim.AdamW(params[2:], lr=LR)
    bound = UpdateClip(max_norm=0.02, restore_state=True)
    opt = ClippedOptimizer([first, rest], max_norm=None, update_clip=bound)
    snapshots = []
    for batch in batches_for(4, seed=14):
        _backward(model, batch)
        before = [p.detach().clone() for p in params]
        opt.step()
        opt.zero_grad()
        change = torch.cat(
            [(p.detach() - b).double().reshape(-1) for p, b in zip(params, before, strict=True)]
        )
        snapshots.append(([p.detach().clone() for p in params], _state(first) + _state(rest)))
        assert opt.last_stats is not None
        if opt.last_stats.reason is None:
            assert float(change.norm()) <= 0.02 * (1 + 1e-5)
    assert [s.reason for s in opt.stats] == [None, None, "nonfinite_update", None]
    for now, then in zip(snapshots[2], snapshots[1], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(now, then, strict=True))


# ---------------------------------------------------------------------------- 2 gloo ranks


@pytest.fixture(scope="module")
def gloo(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from .. import update_clip_jobs

    return spawn_job(update_clip_jobs.update_clip_job, "update_clip", tmp_path_factory.mktemp("uc"), 2)


@needs_gloo
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.parametrize("mode", ["max_rms", "max_norm"])
def test_ddp_and_fsdp2_bound_the_update_as_one_process_does(
    gloo: list[dict[str, Any]], kind: str, mode: str
) -> None:
    """2 gloo ranks, DDP and FSDP2 (a tensor's norm over its shards): every rank ends with the
    parameters, update norms and coefficients of the single-process reference bounding the update
    by hand (rtol 1e-5), the ranks alike; some windows are bounded."""
    from ..update_clip_jobs import reference

    want = reference(mode)
    for rank in gloo:
        got = rank[f"{kind}-{mode}"]
        assert_tensors_close(got["params"], want["params"])
        assert got["norms"] == pytest.approx(want["norms"], rel=1e-5)
        assert got["coefs"] == pytest.approx(want["coefs"], rel=1e-5)
    first, second = (rank[f"{kind}-{mode}"] for rank in gloo)
    assert first["norms"] == second["norms"] and first["coefs"] == second["coefs"]
    assert all(torch.equal(a, b) for a, b in zip(first["params"], second["params"], strict=True))
    assert any(c < 0.99 for c in first["coefs"])


@needs_gloo
def test_fsdp2_puts_back_a_nonfinite_update_on_every_rank(gloo: list[dict[str, Any]]) -> None:
    """FSDP2 with an inner optimizer dividing by zero in its second step: on both ranks that window
    is skipped with reason "nonfinite_update" and the (full) parameters are those of the first."""
    for rank in gloo:
        got = rank["fsdp-nonfinite"]
        assert got["reasons"] == [None, "nonfinite_update", None]
        assert all(torch.equal(a, b) for a, b in zip(got["after"][1], got["after"][0], strict=True))
        assert not all(torch.equal(a, b) for a, b in zip(got["after"][2], got["after"][1], strict=True))


@needs_gloo
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_an_update_rejected_on_one_rank_is_rejected_on_every_rank(
    gloo: list[dict[str, Any]], kind: str
) -> None:
    """DDP and FSDP2, rank 1's inner optimizer alone dividing by zero in its second step: both ranks
    skip that window with reason "nonfinite_update" and keep the parameters of the first window
    (before, under DDP rank 0 applied it: the replicas ended 0.0275 apart, silently); the replicas
    stay equal, bit for bit, in every window."""
    first, second = (rank[f"{kind}-nonfinite-one-rank"] for rank in gloo)
    assert first["reasons"] == second["reasons"] == [None, "nonfinite_update", None]
    for got in (first, second):
        assert all(torch.equal(a, b) for a, b in zip(got["after"][1], got["after"][0], strict=True))
    for mine, theirs in zip(first["after"], second["after"], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


@needs_gloo
def test_ranks_with_another_update_clip_are_refused_on_every_rank(gloo: list[dict[str, Any]]) -> None:
    """Rank 1 built UpdateClip(max_rms=0.009), rank 0 max_rms=0.008: the first step raises on both
    ranks, naming the setting and both values."""
    for rank, mine in zip(gloo, (0.008, 0.009), strict=True):
        assert rank["settings"] is not None
        assert f"update_clip.limit (from 0.008 to 0.009; this rank: {mine:g})" in rank["settings"]


def test_a_nonfinite_update_is_not_a_nonfinite_gradient() -> None:
    """Three non-finite updates in a row (finite gradients) with max_consecutive_nonfinite=2 raise
    nothing: the reason counts as a skip, not as a non-finite gradient."""
    model = model_for()
    inner = ZeroDivideSGD(model.parameters(), bad_calls={2, 3, 4})
    opt = ClippedOptimizer(inner, max_consecutive_nonfinite=2, update_stats=True)
    for batch in batches_for(5, seed=15):
        _backward(model, batch)
        opt.step()
        opt.zero_grad()
    assert [s.reason for s in opt.stats] == [None, *["nonfinite_update"] * 3, None]


def test_nonfinite_gradients_applied_on_request_stay_out_of_the_z_history() -> None:
    """skip_nonfinite=False applies a window with a nan gradient (the user's choice: it is not put
    back, its gradients were not finite); its nan update norm does not enter z's history, which
    keeps bounding later windows."""
    model = model_for()
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR),
        max_norm=None,
        skip_nonfinite=False,
        update_clip=UpdateClip(z=0.5, window=4),
    )
    for i, batch in enumerate(batches_for(4, seed=16)):
        _backward(model, batch, nan=i == 3)
        opt.step()
        opt.zero_grad()
    assert opt.stats[3].reason is None and not math.isfinite(opt.stats[3].update_norm)
    state = opt.update_clip.state_dict()
    assert int(state["count"]) == 3 and bool(torch.isfinite(state["history"]).all())


@needs_gloo
def test_pipeline_stages_bound_and_put_back_their_update_as_one(gloo: list[dict[str, Any]]) -> None:
    """norm_group (each rank a pipeline stage with its own layer): both stages record the norm of
    the whole update (the stages' changes combined, as the test measures them) and one coefficient;
    a bounded window moves both stages by 0.05 together; when stage 0's update is not finite, stage
    1 puts its own back too (both "nonfinite_update", no change)."""
    first, second = (rank["stages"] for rank in gloo)
    assert first["reasons"] == second["reasons"] == [None, None, "nonfinite_update", None]
    assert first["norms"][:2] == second["norms"][:2] and first["coefs"] == second["coefs"]
    assert first["changes"][2] == second["changes"][2] == 0.0
    for w in (0, 1, 3):
        combined = math.hypot(first["changes"][w], second["changes"][w])
        assert combined == pytest.approx(first["norms"][w] * first["coefs"][w], rel=1e-5)
        assert combined <= 0.05 * (1 + 1e-5)
    assert any(c < 1.0 for c in first["coefs"])
