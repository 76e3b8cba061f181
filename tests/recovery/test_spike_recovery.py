"""SpikeGuard and Rewind inside ClippedOptimizer: exact skips, rewinds, checkpoints, host reads."""

from __future__ import annotations

import copy
import csv
import io
import pickle
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn, optim

from clipopt import (
    AdaGC,
    AutoClip,
    ClippedOptimizer,
    CSVLogger,
    Rewind,
    SpikeGuard,
    StableSPAM,
    UpdateClip,
    ZClip,
)
from clipopt._report.report import analyze, format_report, read_log

from ..helpers import batches_for, model_for
from ..hostreads import count_host_reads
from ..optim_db import OptimInfo, get, params, pick

# ----------------------------------------------------------------------------- the optimizer table


# The optim_db entries the guard is checked against, in each implementation they have.
_FUSED_TOO = ("Adam", "AdamW", "SGD-momentum", "Adagrad")
_NOT_FUSED = ("Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop-centered-momentum", "Rprop")
CASES = pick(
    *(f"{name}-{impl}" for name in _FUSED_TOO for impl in ("foreach", "forloop", "fused")),
    *(f"{name}-{impl}" for name in _NOT_FUSED for impl in ("foreach", "forloop")),
    "Adafactor-forloop",
    "SGD-forloop",
    "LBFGS-closure",
    "SparseAdam-sparse",
)
# The constructor arguments these runs replace in their optim_db entry. foreach=None is torch's
# default implementation choice, which on CPU is the for-loop.
OVERRIDES: dict[str, dict[str, Any]] = {
    "Adafactor-forloop": {"foreach": None},
    "SGD-forloop": {"foreach": None},
    "LBFGS-closure": {"lr": 0.1},
}


def _make(case: OptimInfo, params: Iterable[nn.Parameter]) -> optim.Optimizer:
    """The case's optimizer over ``params``, with this file's overrides."""
    return case.make(params, **OVERRIDES.get(case.id, {}))


def _max_norm(case: OptimInfo) -> float | None:
    """The norm bound: none for sparse gradients."""
    return None if case.model == "sparse" else 1.0


def _spike(batch: tuple[torch.Tensor, torch.Tensor], sparse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch with targets 1000 times larger: loss and gradient norm far above their history."""
    return batch[0], batch[1] * 1000


def _window(
    case: OptimInfo, opt: ClippedOptimizer, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
) -> None:
    x, y = batch
    if "closure" in case.tags:

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            return loss

        opt.step(closure)
        return
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step(loss=loss)
    opt.zero_grad()


def _state(opt: ClippedOptimizer, model: nn.Module) -> dict[str, Any]:
    params = list(model.parameters())
    return {
        "params": [p.detach().clone() for p in params],
        "state": {i: copy.deepcopy(dict(opt.state[p])) for i, p in enumerate(params) if p in opt.state},
    }


def _assert_identical(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(
            a.detach().reshape(-1).contiguous().view(torch.uint8),
            b.detach().reshape(-1).contiguous().view(torch.uint8),
        ), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            _assert_identical(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_identical(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def _guard() -> SpikeGuard:
    return SpikeGuard(z_thresh=50.0, window=8, warmup=4)


@pytest.mark.parametrize("case", params(CASES))
def test_spike_is_skipped_as_if_it_never_happened(case: OptimInfo) -> None:
    """A spike window is skipped (reason 'spike') bit-exactly; the run then equals one that never saw it."""
    model, ref_model = model_for(case.model), model_for(case.model)
    opt = ClippedOptimizer(_make(case, model.parameters()), max_norm=_max_norm(case), spike_guard=_guard())
    ref = ClippedOptimizer(_make(case, ref_model.parameters()), max_norm=_max_norm(case))
    good = batches_for(9, seed=1, kind=case.model)
    for i, b in enumerate(good):
        if i == 6:
            before = _state(opt, model)
            _window(case, opt, model, _spike(b, case.model == "sparse"))
            assert opt.step_was_skipped and opt.last_stats is not None and opt.last_stats.reason == "spike"
            _assert_identical(_state(opt, model), before)
        _window(case, opt, model, b)
        _window(case, ref, ref_model, b)
        assert not opt.step_was_skipped, (i, opt.last_stats and opt.last_stats.reason)
    _assert_identical(_state(opt, model), _state(ref, ref_model))
    assert (opt.num_windows, opt.num_skipped) == (10, 1)
    assert all(v < 50 for v in opt.spike_guard.history["grad_norm"])  # the spike never entered it


FUSED = [c for c in CASES if "fused" in c.tags]


@pytest.mark.parametrize("case", params(FUSED))
def test_fused_windows_with_guard_and_rewind_read_the_host_only_at_checks(case: OptimInfo) -> None:
    """Fused optimizers: no host read per window with a SpikeGuard; a Rewind adds one read per check."""
    model = model_for()
    rewind = Rewind(every=4, spikes=2, within=4, skip_batches=0, check_every=4)
    opt = ClippedOptimizer(_make(case, model.parameters()), max_norm=1.0, spike_guard=_guard(), rewind=rewind)
    batches = batches_for(14, seed=2)
    reads = []
    for b in batches:
        with count_host_reads() as r:
            _window(case, opt, model, b)
        reads.append(len(r))
    # window 1 creates the inner state (host path); checks run at the start of windows 5, 9 and 13
    assert reads[1:] == [0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0], reads
    m2 = model_for()
    guard_only = ClippedOptimizer(_make(case, m2.parameters()), max_norm=1.0, spike_guard=_guard())
    counts = []
    for b in batches:
        with count_host_reads() as r:
            _window(case, guard_only, m2, b)
        counts.append(len(r))
    assert counts[1:] == [0] * 13, counts


def test_nonfinite_has_priority_and_neither_enters_the_history() -> None:
    """A non-finite window is skipped with reason 'nonfinite'; only applied windows enter the history."""
    model = model_for()
    opt = ClippedOptimizer(optim.SGD(model.parameters(), lr=0.1), spike_guard=_guard())
    good = batches_for(8, seed=3)
    for i, (x, y) in enumerate(good):
        if i == 5:
            bad = x.clone()
            bad[0, 0] = float("nan")
            _window(CASES[0], opt, model, (bad, y))
            assert opt.last_stats is not None and opt.last_stats.reason == "nonfinite"
            _window(CASES[0], opt, model, _spike((x, y), False))
            assert opt.last_stats is not None and opt.last_stats.reason == "spike"
        _window(CASES[0], opt, model, (x, y))
    history = opt.spike_guard.history
    assert len(history["grad_norm"]) == 8 and len(history["loss"]) == 8


@pytest.mark.parametrize(
    "policy", [lambda: ZClip(warmup_steps=3), lambda: AutoClip(10)], ids=["zclip", "autoclip"]
)
def test_guard_composes_with_clipping_policies(policy: Callable[[], Any]) -> None:
    """With an adaptive max_norm the guard changes no clipping and skips the spike bit-exactly; the
    policy sees the spike's norm as it does without a guard (it is a finite window)."""
    model, ref_model = model_for(), model_for()
    opt = ClippedOptimizer(optim.SGD(model.parameters(), lr=0.1), max_norm=policy(), spike_guard=_guard())
    ref = ClippedOptimizer(optim.SGD(ref_model.parameters(), lr=0.1), max_norm=policy())
    for i, b in enumerate(batches_for(7, seed=4)):
        if i == 6:
            before = _state(opt, model)
            b = _spike(b, False)
        _window(CASES[0], opt, model, b)
        _window(CASES[0], ref, ref_model, b)
        assert opt.last_stats is not None and ref.last_stats is not None
        assert (opt.last_stats.clip_coef, opt.last_stats.max_norm) == (
            ref.last_stats.clip_coef,
            ref.last_stats.max_norm,
        )
    assert opt.last_stats.reason == "spike" and not ref.step_was_skipped
    _assert_identical(_state(opt, model), before)
    _assert_identical(opt.state_dict()["clipopt"]["policy"], ref.state_dict()["clipopt"]["policy"])


# ----------------------------------------------------------------------------- rewind


def _rewind_run(
    opt: ClippedOptimizer, model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], start: int = 0
) -> tuple[list[str | None], dict[int, list[torch.Tensor]]]:
    """Train on ``opt.rewind.batches(batches)``; the reasons per window and the params after each."""
    reasons, after = [], {}
    assert opt.rewind is not None
    for b in opt.rewind.batches(batches):
        _window(CASES[0], opt, model, b)
        assert opt.last_stats is not None
        reasons.append(opt.last_stats.reason)
        after[opt.num_windows] = [p.detach().clone() for p in model.parameters()]
    return reasons, after


def _spiky(n: int, spikes: set[int], seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [_spike(b, False) if i in spikes else b for i, b in enumerate(batches_for(n, seed))]


def test_rewind_restores_the_copy_before_the_first_spike(tmp_path: Path) -> None:
    """2 spikes within 5 windows: back to the copy before the first (bit-identical), 3 batches dropped,
    the rewinding window recorded with reason 'rewind' in StepStats and the CSV log."""
    model = model_for()
    rewind = Rewind(every=5, keep=2, spikes=2, within=5, skip_batches=3, module=model, check_every=1)
    log = tmp_path / "log.csv"
    opt = ClippedOptimizer(
        optim.AdamW(model.parameters(), lr=0.01),
        spike_guard=_guard(),
        rewind=rewind,
        loggers=[CSVLogger(log)],
    )
    reasons, after = _rewind_run(opt, model, _spiky(30, {12, 14}))
    opt.close()
    # batches 12 and 14 are windows 13 and 15; the check at the start of window 16 rewinds
    assert reasons[12] == "spike" and reasons[14] == "spike" and reasons[15] == "rewind"
    assert opt.rewinds == 1 and opt.num_skipped == 3
    (event,) = rewind.log
    # copies at the start of windows 2, 7, 12 (after 1, 6, 11 windows): the newest before window 13 is 11
    # its step is the rewinding window's, as in StepStats, the CSV log and the report
    assert (event.step, event.restored, event.first_spike, event.spikes) == (16, 11, 13, 2)
    assert event.undone == 2  # windows 12 and 14 were applied after the copy
    _assert_identical(after[16], after[11])  # bit-identical to the state the copy was taken of
    assert rewind.batches_dropped == 3 and len(reasons) == 27  # batches 16-18 dropped
    rows = list(csv.DictReader(log.open()))
    assert [(r["step"], r["reason"]) for r in rows if r["reason"]] == [
        ("13", "spike"),
        ("15", "spike"),
        ("16", "rewind"),
    ]
    assert rows[15]["skipped"] == "1"
    report = analyze(read_log(str(log)))
    assert report["summary"]["rewinds"] == 1 and report["summary"]["spike_skips"] == 2
    assert any(n.startswith("1 rewind(s) (reason 'rewind') at step(s) 16:") for n in report["notes"])
    assert "rewinds" in format_report(report)


def test_checkpoint_after_a_rewind_resumes_exactly() -> None:
    """state_dict() after a rewind, loaded (weights_only) into a fresh run, trains bit-identically on."""
    batches = _spiky(40, {12, 14, 30, 31})

    def build() -> tuple[nn.Module, ClippedOptimizer]:
        model = model_for()
        rewind = Rewind(every=5, keep=2, spikes=2, within=5, skip_batches=2, module=model, check_every=2)
        opt = ClippedOptimizer(optim.AdamW(model.parameters(), lr=0.01), spike_guard=_guard(), rewind=rewind)
        return model, opt

    model, opt = build()
    stream = opt.rewind.batches(batches)
    for _ in range(20):
        _window(CASES[0], opt, model, next(stream))
    assert opt.rewinds == 1
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    for b in stream:
        _window(CASES[0], opt, model, b)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model2, opt2 = build()
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    assert opt2.rewinds == 1 and opt2.rewind.pending_skip == 0
    consumed = 20 + opt2.rewind.batches_dropped
    for b in opt2.rewind.batches(batches[consumed:]):
        _window(CASES[0], opt2, model2, b)
    assert opt2.rewinds == opt.rewinds == 2
    _assert_identical(_state(opt2, model2), _state(opt, model))
    assert [s.reason for s in list(opt2.stats)[-5:]] == [s.reason for s in list(opt.stats)[-5:]]


# ----------------------------------------------------------------------------- arguments


def test_arguments_are_checked() -> None:
    """spike_guard/rewind of the wrong type, or a Rewind with nothing that skips spikes, raise clearly."""
    params = model_for().parameters()
    with pytest.raises(TypeError, match=re.escape("spike_guard must be a SpikeGuard or None, got float; ")):
        ClippedOptimizer(optim.SGD(params, lr=0.1), spike_guard=6.0)  # type: ignore[arg-type]
    params = model_for().parameters()
    with pytest.raises(TypeError, match=re.escape("rewind must be a Rewind or None, got int; ")):
        ClippedOptimizer(optim.SGD(params, lr=0.1), spike_guard=SpikeGuard(), rewind=100)  # type: ignore[arg-type]
    params = model_for().parameters()
    message = (
        "rewind=Rewind(...) rewinds after spike skips, but nothing skips spikes here; "
        "pass spike_guard=SpikeGuard() (or max_norm=ZClip(skip_spikes=True))"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        ClippedOptimizer(optim.SGD(params, lr=0.1), rewind=Rewind())
    model = model_for()
    opt = ClippedOptimizer(
        optim.SGD(model.parameters(), lr=0.1), max_norm=ZClip(skip_spikes=True), rewind=Rewind()
    )
    assert opt.rewind is not None and opt.spike_guard is None and opt.rewinds == 0


def test_the_guard_and_rewind_are_assigned_mid_run_as_the_constructor_checks_them() -> None:
    """``opt.spike_guard`` and ``opt.rewind`` are parts (#32): assigned mid-run, they are checked as the
    constructor checks them -- beside each other and the policy, an assigned ``max_norm`` included --
    and a refused assignment changes nothing."""
    model = model_for()
    guard, rewind = _guard(), Rewind()
    opt = ClippedOptimizer(optim.SGD(model.parameters(), lr=0.1), spike_guard=guard, rewind=rewind)
    message = "rewind=Rewind(...) rewinds after spike skips, but nothing skips spikes here; "
    with pytest.raises(TypeError, match=re.escape("spike_guard must be a SpikeGuard or None, got float; ")):
        opt.spike_guard = 6.0
    with pytest.raises(ValueError, match=re.escape(message)):
        opt.spike_guard = None  # the Rewind would be left without spike skips
    assert opt.spike_guard is guard and opt.rewind is rewind
    opt.rewind = None
    opt.spike_guard = None
    assert opt.rewind is None and opt.spike_guard is None and opt.rewinds == 0
    with pytest.raises(ValueError, match=re.escape(message)):
        opt.rewind = Rewind()
    assert opt.rewind is None
    opt.max_norm = ZClip(skip_spikes=True)
    again = Rewind(keep=3)
    opt.rewind = again  # ZClip skips spikes: a Rewind may go without a guard
    assert opt.rewind is again and "rewind=Rewind(every=100, keep=3," in repr(opt)
    with pytest.raises(ValueError, match=re.escape(message)):
        opt.max_norm = 1.0
    assert isinstance(opt.max_norm, ZClip)


def test_the_repr_lists_the_guard_then_the_rewind() -> None:
    model = model_for()
    opt = ClippedOptimizer(optim.SGD(model.parameters(), lr=0.1), spike_guard=_guard(), rewind=Rewind())
    text = repr(opt)
    guard = "SpikeGuard(z_thresh=50, window=8, signals=('loss', 'grad_norm'), warmup=4)"
    assert f", spike_guard={guard}, " in text
    assert "warmup=4), rewind=Rewind(every=100, keep=2, spikes=3, within=50, skip_batches=200, " in text


def test_guard_spike_writes_a_snapshot(tmp_path: Path) -> None:
    """With snapshot_dir, a window the guard skips is saved with reason 'spike' (step, params, grads)."""
    from clipopt import load_snapshot

    model = model_for()
    opt = ClippedOptimizer(
        optim.SGD(model.parameters(), lr=0.1),
        spike_guard=_guard(),
        snapshot_dir=tmp_path,
        param_names=model.named_parameters(),
    )
    for i, b in enumerate(batches_for(8, seed=6)):
        _window(CASES[0], opt, model, _spike(b, False) if i == 6 else b)
    assert [s.reason for s in opt.stats].count("spike") == 1
    assert opt.last_snapshot is not None
    snap = load_snapshot(opt.last_snapshot)
    assert snap["reason"] == "spike" and snap["step"] == 7 and set(snap["grads"]) == set(snap["params"])


def test_rewind_restores_scaler_and_policy_state() -> None:
    """A rewind puts the GradScaler's scale and the policy's statistics back to those of the copy."""
    model = model_for()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    policy = ZClip(warmup_steps=3)
    rewind = Rewind(every=5, spikes=2, within=5, skip_batches=0, check_every=1)
    opt = ClippedOptimizer(
        optim.SGD(model.parameters(), lr=0.1),
        max_norm=policy,
        scaler=scaler,
        spike_guard=_guard(),
        rewind=rewind,
    )
    saved: dict[int, tuple[float, torch.Tensor]] = {}
    for x, y in _spiky(20, {12, 14}):
        if opt.num_windows == 11:  # the state the copy taken at the start of window 12 holds
            saved[11] = (scaler.get_scale(), policy.state_dict()["stats"].clone())
        loss = ((model(x) - y) ** 2).mean()
        scaler.scale(loss).backward()
        opt.step(loss=loss)
        opt.zero_grad()
        if opt.last_stats is not None and opt.last_stats.reason == "rewind":
            assert rewind.log[-1].restored == 11
            assert scaler.get_scale() == saved[11][0]
            assert torch.equal(policy.state_dict()["stats"], saved[11][1])
            break
    assert opt.rewinds == 1
    assert saved[11][0] != 2.0**10  # the scale had grown, so restoring it is visible


@pytest.mark.parametrize("policy", [AdaGC, StableSPAM])
def test_rewind_restores_the_policy_and_the_update_clip_history(policy: Callable[[], Any]) -> None:
    """With a per-tensor policy and UpdateClip(z=...), a rewind to the copy taken after window 11
    puts back the policy's statistics and the z history of update norms as they were then (the
    windows undone, 12 and 14, leave no norm behind, as they leave no gradient statistics), and the
    parameters."""
    model = model_for()
    rewind = Rewind(every=5, spikes=2, within=5, skip_batches=0, check_every=1)
    clip = policy()
    update_clip = UpdateClip(z=2.0, window=8)
    opt = ClippedOptimizer(
        optim.SGD(model.parameters(), lr=0.1),
        max_norm=clip,
        spike_guard=_guard(),
        rewind=rewind,
        update_clip=update_clip,
    )
    saved: dict[str, Any] = {}
    for x, y in _spiky(20, {12, 14}):
        if opt.num_windows == 11:  # the state the copy taken at the start of window 12 holds
            saved = copy.deepcopy({"policy": clip.state_dict(), "update_clip": update_clip.state_dict()})
            saved["params"] = [p.detach().clone() for p in model.parameters()]
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
        if opt.last_stats is not None and opt.last_stats.reason == "rewind":
            break
    assert opt.rewinds == 1 and rewind.log[-1].restored == 11
    assert int(saved["update_clip"]["count"]) == 8  # a full ring: the windows undone replaced two norms
    _assert_identical(update_clip.state_dict(), saved["update_clip"])
    _assert_identical(clip.state_dict(), saved["policy"])
    _assert_identical([p.detach() for p in model.parameters()], saved["params"])


def test_an_update_clip_assigned_after_the_copy_keeps_its_own_history_at_a_rewind() -> None:
    """``opt.update_clip`` replaced by one with another window after the copy was taken: the rewind
    restores the parameters and leaves the new UpdateClip's history as it was (the copy's ring of 8
    norms cannot be its ring of 4), instead of failing halfway through the rewind."""
    model = model_for()
    rewind = Rewind(every=5, spikes=2, within=5, skip_batches=0, check_every=1)
    opt = ClippedOptimizer(
        optim.SGD(model.parameters(), lr=0.1),
        spike_guard=_guard(),
        rewind=rewind,
        update_clip=UpdateClip(z=2.0, window=8),
    )
    for x, y in _spiky(20, {12, 14}):
        if opt.num_windows == 11:  # the parameters the copy taken at the start of window 12 holds
            saved = [p.detach().clone() for p in model.parameters()]
        if opt.num_windows == 12:  # after that copy
            opt.update_clip = UpdateClip(z=2.0, window=4)
        if opt.num_windows == 15:
            history = copy.deepcopy(opt.update_clip.state_dict())
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
        if opt.last_stats is not None and opt.last_stats.reason == "rewind":
            break
    assert opt.rewinds == 1 and rewind.log[-1].restored == 11
    assert int(history["count"]) == 1  # window 14 was applied with the new UpdateClip (13, 15: spikes)
    _assert_identical(opt.update_clip.state_dict(), history)
    _assert_identical([p.detach() for p in model.parameters()], saved)


@pytest.mark.parametrize("adam", params(pick("Adam-foreach", "Adam-forloop", "Adam-fused")))
def test_spike_in_one_micro_batch_skips_the_window(adam: OptimInfo) -> None:
    """accumulation_steps=3: a spiking micro-batch skips its whole window; the run then equals one
    without that window (the guard scores the window's mean loss and combined norm); for each of
    Adam's implementations."""
    model, ref_model = model_for(), model_for()
    make = adam.make
    opt = ClippedOptimizer(make(model.parameters()), accumulation_steps=3, spike_guard=_guard())
    ref = ClippedOptimizer(make(ref_model.parameters()), accumulation_steps=3)
    windows = [batches_for(3, seed=20 + w) for w in range(9)]
    for w, micro in enumerate(windows):
        runs = [(opt, model)] if w == 6 else [(opt, model), (ref, ref_model)]
        for o, m in runs:
            for k, (x, y) in enumerate(micro):
                if w == 6 and k == 1:
                    y = y * 1000
                loss = ((m(x) - y) ** 2).mean()
                loss.backward()
                o.step(loss=loss)
                o.zero_grad()
        expect = "spike" if w == 6 else None
        assert opt.last_stats is not None and opt.last_stats.reason == expect, w
    _assert_identical(_state(opt, model), _state(ref, ref_model))


def test_load_state_dict_checks_the_guard_and_rewind_entries_first() -> None:
    """A corrupt 'spike_guard' or 'rewind' entry raises ValueError and leaves the optimizer as it was."""
    model = model_for()
    rewind = Rewind(every=2, check_every=1)
    opt = ClippedOptimizer(optim.Adam(model.parameters(), lr=0.01), spike_guard=_guard(), rewind=rewind)
    for b in batches_for(6, seed=7):
        _window(CASES[0], opt, model, b)
    good = opt.state_dict()
    before = _state(opt, model)
    bad_guard = copy.deepcopy(good)
    bad_guard["clipopt"]["spike_guard"]["count"] = torch.tensor([-1, 0])
    bad_rewind = copy.deepcopy(good)
    bad_rewind["clipopt"]["rewind"]["pending_skip"] = -3
    bad_rewind["state"] = {}  # would change the inner state if anything were loaded before the check
    for sd, message in [
        (bad_guard, "invalid SpikeGuard state: expected signals ['loss', 'grad_norm'], window 8"),
        (bad_rewind, "invalid Rewind state: 'pending_skip' must be an int >= 0, got -3"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            opt.load_state_dict(sd)
        _assert_identical(_state(opt, model), before)
    assert opt.rewind is not None and opt.rewind.pending_skip == 0
    older = copy.deepcopy(good)
    del older["clipopt"]["spike_guard"], older["clipopt"]["rewind"]  # a state dict from before them
    history = opt.spike_guard.history
    opt.load_state_dict(older)
    assert opt.spike_guard.history == history


@pytest.mark.parametrize("impl", ["foreach", "forloop", "fused"])
def test_guard_composes_with_per_group_clipping(impl: str) -> None:
    """Groups with their own max_norm: the spike is skipped bit-exactly, other windows clip as without
    it; for each of AdamW's implementations."""

    def build(model: nn.Module, **kw: Any) -> ClippedOptimizer:
        first, second = list(model.parameters())[:2], list(model.parameters())[2:]
        groups = [{"params": first, "max_norm": 0.5}, {"params": second}]
        inner = get(f"AdamW-{impl}").make(groups, lr=0.05, weight_decay=0.01)  # AdamW's default decay
        return ClippedOptimizer(inner, max_norm=1.0, **kw)

    model, ref_model = model_for(), model_for()
    opt, ref = build(model, spike_guard=_guard()), build(ref_model)
    for i, b in enumerate(batches_for(9, seed=8)):
        if i == 6:
            before = _state(opt, model)
            _window(CASES[0], opt, model, _spike(b, False))
            assert opt.last_stats is not None and opt.last_stats.reason == "spike"
            _assert_identical(_state(opt, model), before)
        _window(CASES[0], opt, model, b)
        _window(CASES[0], ref, ref_model, b)
        assert opt.last_stats is not None and ref.last_stats is not None
        assert opt.last_stats.clip_coef == ref.last_stats.clip_coef
    _assert_identical(_state(opt, model), _state(ref, ref_model))


@pytest.mark.parametrize(
    ("part", "leaf", "copy_index", "bad_value", "message"),
    [
        ("spike_guard", "count", 0, torch.tensor([-1, 0]), "invalid SpikeGuard state: expected signals"),
        (
            "policy",
            "stats",
            1,
            torch.zeros(3, dtype=torch.float64),
            "invalid ZClip state: expected 5 statistics",
        ),
        ("update_clip", "next", 1, torch.tensor(9), "and next=9 are not those of a ring of 4 norms"),
    ],
)
def test_load_state_dict_checks_the_wrapper_parts_inside_rewind_copies(
    part: str, leaf: str, copy_index: int, bad_value: torch.Tensor, message: str
) -> None:
    """A Rewind copy whose SpikeGuard, policy (ZClip) or UpdateClip(z=...) history part is corrupt is
    refused at load (ValueError, nothing changed), not loaded after the parameters were already
    restored at a rewind; the intact state still loads."""
    model = model_for()
    opt = ClippedOptimizer(
        optim.Adam(model.parameters(), lr=0.01),
        max_norm=ZClip(warmup_steps=2) if part == "policy" else 1.0,
        spike_guard=_guard(),
        rewind=Rewind(every=2, check_every=1),
        update_clip=UpdateClip(z=2.0, window=4) if part == "update_clip" else None,
    )
    for b in batches_for(6, seed=7):
        _window(CASES[0], opt, model, b)
    good = opt.state_dict()
    assert opt.rewind is not None and len(good["clipopt"]["rewind"]["copies"]) == 2
    before, copies = _state(opt, model), opt.rewind.copies
    bad = copy.deepcopy(good)
    entry = bad["clipopt"]["rewind"]["copies"][copy_index]
    extra = dict(dict(entry["spec"][1])["extra"][1])
    index = dict(extra[part][1])[leaf][1]  # ("t", number)
    entry["leaves"][index] = bad_value
    with pytest.raises(ValueError, match=re.escape(message)):
        opt.load_state_dict(bad)
    _assert_identical(_state(opt, model), before)
    assert opt.rewind.copies == copies
    opt.load_state_dict(good)


# ----------------------------------------------------------------------------- rewind: module buffers


def _bn_model() -> nn.Module:
    """A model with batch-norm statistics (running_mean, running_var, num_batches_tracked)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 3))


def _wild(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets 1000 times larger: a loss spike, and batch statistics far off the running ones."""
    return batch[0] * 1000, batch[1] * 1000


def _full_state(opt: ClippedOptimizer, model: nn.Module) -> dict[str, Any]:
    """Independent clones of parameters, module buffers and inner state."""
    return {**_state(opt, model), "buffers": {k: v.clone() for k, v in model.named_buffers()}}


def _record_rewinds(
    opt: ClippedOptimizer, model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> list[tuple[int, dict[str, Any], dict[str, Any]]]:
    """Train on ``opt.rewind.batches(batches)`` (micro-batches), recording the state right after
    every window's close as the reference.  Per rewind: (restored window, the state right after the
    rewinding window, the reference of the restored window)."""
    assert opt.rewind is not None
    refs: dict[int, dict[str, Any]] = {opt.num_windows: _full_state(opt, model)}
    out = []
    for b in opt.rewind.batches(batches):
        closed = opt.num_windows
        _window(CASES[0], opt, model, b)
        if opt.num_windows == closed:  # a micro-batch of an open window
            continue
        assert opt.last_stats is not None
        if opt.last_stats.reason == "rewind":
            restored = opt.rewind.log[-1].restored
            out.append((restored, _full_state(opt, model), refs[restored]))
        refs[opt.num_windows] = _full_state(opt, model)
    return out


def _bn_rewind_run(
    rewind: Rewind, wild: set[int], n: int = 26
) -> list[tuple[int, dict[str, Any], dict[str, Any]]]:
    """:func:`_record_rewinds` of a batch-norm model with a guard and ``rewind`` on ``n`` batches,
    those in ``wild`` wild."""
    model = _bn_model()
    rewind.module = model
    opt = ClippedOptimizer(optim.AdamW(model.parameters(), lr=0.01), spike_guard=_guard(), rewind=rewind)
    batches = [_wild(b) if i in wild else b for i, b in enumerate(batches_for(n, seed=11))]
    return _record_rewinds(opt, model, batches)


def test_rewind_restores_batch_norm_statistics_of_the_copy_window() -> None:
    """The copy of window 12 is taken while window 13 closes, after window 13's (wild) forward pass:
    the rewind still brings back the running statistics as they were when window 12 closed
    (running_var not the wild batch's, num_batches_tracked 12), bit for bit, with the parameters."""
    rewind = Rewind(every=1, keep=2, spikes=2, within=4, skip_batches=0, check_every=1)
    rewinds = _bn_rewind_run(rewind, wild={12, 13})  # windows 13 and 14
    (restored, got, want) = rewinds[0]
    assert restored == 12
    assert int(want["buffers"]["1.num_batches_tracked"]) == 12
    assert float(want["buffers"]["1.running_var"].max()) < 10  # the reference is not the wild batch's
    _assert_identical(got, want)


@pytest.mark.parametrize("check_every", [1, 2, 3])
@pytest.mark.parametrize("keep", [1, 2, 3])
@pytest.mark.parametrize("every", [1, 2, 3])
def test_rewind_restores_module_buffers_bit_identically(every: int, keep: int, check_every: int) -> None:
    """Every combination of every/keep/check_every: each rewind restores parameters, inner state and
    batch-norm buffers bit for bit to their values right after the restored copy's window closed."""
    rewind = Rewind(every=every, keep=keep, spikes=2, within=4, skip_batches=1, check_every=check_every)
    rewinds = _bn_rewind_run(rewind, wild={12, 13, 24, 25}, n=34)
    assert rewinds, "the run must rewind"
    for restored, got, want in rewinds:
        _assert_identical(got, want, f"window {restored}")


@given(
    every=st.integers(1, 3),
    keep=st.integers(1, 3),
    check_every=st.integers(1, 3),
    accumulation=st.integers(1, 3),
    first=st.integers(6, 10),
    gap=st.integers(1, 3),
    micro=st.integers(0, 2),
)
def test_rewind_restores_module_buffers_under_accumulation(
    every: int, keep: int, check_every: int, accumulation: int, first: int, gap: int, micro: int
) -> None:
    """Drawn every/keep/check_every, accumulation_steps and two spike windows (one wild micro-batch in
    each): every rewind restores parameters, inner state and batch-norm buffers bit for bit to their
    values right after the restored copy's window closed (all its micro-batches' forward passes)."""
    model = _bn_model()
    rewind = Rewind(
        every=every, keep=keep, spikes=2, within=4, skip_batches=0, module=model, check_every=check_every
    )
    opt = ClippedOptimizer(
        optim.AdamW(model.parameters(), lr=0.01),
        accumulation_steps=accumulation,
        spike_guard=_guard(),
        rewind=rewind,
    )
    windows = first + gap + check_every + 2
    wild = {w * accumulation + min(micro, accumulation - 1) for w in (first, first + gap)}
    batches = batches_for(windows * accumulation, seed=11)
    rewinds = _record_rewinds(opt, model, [_wild(b) if i in wild else b for i, b in enumerate(batches)])
    assert rewinds, "the run must rewind"
    for restored, got, want in rewinds:
        _assert_identical(got, want, f"window {restored}")


def test_checkpoint_between_a_close_and_its_check_resumes_exactly() -> None:
    """A checkpoint saved right after a window whose next close checks (and copies) carries the buffers
    copied at that close: the resumed run's copy, and the state after a later rewind to it, equal the
    uninterrupted run's bit for bit (without them the copy would hold the buffers after the next
    forward pass)."""
    batches = [_wild(b) if i in {22, 23} else b for i, b in enumerate(batches_for(30, seed=11))]

    def build() -> tuple[nn.Module, ClippedOptimizer]:
        model = _bn_model()
        rewind = Rewind(every=2, keep=2, spikes=2, within=4, skip_batches=0, module=model, check_every=3)
        opt = ClippedOptimizer(optim.AdamW(model.parameters(), lr=0.01), spike_guard=_guard(), rewind=rewind)
        return model, opt

    model, opt = build()
    for b in batches[:21]:
        _window(CASES[0], opt, model, b)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    for b in batches[21:]:
        _window(CASES[0], opt, model, b)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model2, opt2 = build()
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    for b in batches[21:]:
        _window(CASES[0], opt2, model2, b)
    assert opt.rewind is not None and opt2.rewind is not None
    assert opt2.rewinds == opt.rewinds == 1 and opt.rewind.log[0].restored == 21
    _assert_identical(_full_state(opt2, model2), _full_state(opt, model))
    _assert_identical(opt2.rewind.state_dict()["copies"], opt.rewind.state_dict()["copies"])


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_wrapper_with_guard_and_rewind_recovers_on_its_own(how: str) -> None:
    """copy.deepcopy (or a pickle round trip) of a wrapper with a SpikeGuard and a Rewind of a batch-norm
    model: the copy's Rewind holds the copied model, whose parameters are the copy's; spikes fed to the
    copy make it rewind, bit for bit to its own reference; the original (parameters, buffers, inner
    state, guard, Rewind, counters) is untouched."""
    model = _bn_model()
    rewind = Rewind(every=1, keep=2, spikes=2, within=4, skip_batches=0, module=model, check_every=1)
    opt = ClippedOptimizer(optim.AdamW(model.parameters(), lr=0.01), spike_guard=_guard(), rewind=rewind)
    batches = batches_for(18, seed=11)
    for b in batches[:10]:
        _window(CASES[0], opt, model, b)
    assert opt.spike_guard is not None
    before = _full_state(opt, model)
    guard, copies, windows = copy.deepcopy(opt.spike_guard.state_dict()), rewind.copies, opt.num_windows
    dup = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    assert dup.rewind is not None and dup.rewind is not rewind and dup.rewind.module is not None
    twin = dup.rewind.module
    assert [id(p) for p in twin.parameters()] == [id(p) for p in dup.param_groups[0]["params"]]
    rewinds = _record_rewinds(dup, twin, [_wild(b) if i in {1, 2} else b for i, b in enumerate(batches[10:])])
    assert [r[0] for r in rewinds] == [11] and dup.rewinds == 1
    for _, got, want in rewinds:
        _assert_identical(got, want)
    _assert_identical(_full_state(opt, model), before)
    _assert_identical(opt.spike_guard.state_dict(), guard)
    assert opt.rewinds == 0 and rewind.copies == copies and opt.num_windows == windows


def test_a_buffer_a_copy_cannot_hold_is_refused_at_the_check_not_after_an_update() -> None:
    """A module with a sparse buffer: the window before a check closes and is recorded as usual (its
    buffers are not copied at its close), and the check refuses with the TypeError naming the fix
    before the next window changes anything."""
    model = model_for()
    model.register_buffer("counts", torch.zeros(4, 3).to_sparse())
    opt = ClippedOptimizer(
        optim.SGD(model.parameters(), lr=0.1),
        spike_guard=_guard(),
        rewind=Rewind(every=1, module=model, check_every=1),
    )
    first, second = batches_for(2, seed=3)
    _window(CASES[0], opt, model, first)
    assert opt.num_windows == 1 and opt.last_stats is not None and opt.last_stats.step == 1
    before = _state(opt, model)
    message = "Rewind copies dense tensors only, got a Tensor with layout torch.sparse_coo; "
    with pytest.raises(TypeError, match=re.escape(message)):
        _window(CASES[0], opt, model, second)
    assert opt.num_windows == 1
    _assert_identical(_state(opt, model), before)


def _old_rewind_entry() -> dict[str, Any]:
    """A ``"rewind"`` entry as the Rewind wrote it before its part moved to ``RewindPart``, written out
    literally: two copies (windows 2 and 4) of a ``Linear(2, 1, bias=False)`` under SGD with momentum,
    each holding its SpikeGuard's history, and window 5's unchecked flags (applied)."""

    def spec() -> tuple[Any, ...]:
        guard = ("d", [("signals", ("l", [("v", "grad_norm")])), ("window", ("v", 2))])
        guard[1].extend([("buffer", ("t", 2)), ("count", ("t", 3))])
        extra = ("d", [("policy", ("v", None)), ("scaler", ("v", None)), ("spike_guard", guard)])
        state = ("l", [("u", [("v", 0), ("d", [("momentum_buffer", ("t", 1))])])])
        return (
            "d",
            [("params", ("l", [("t", 0)])), ("buffers", ("l", [])), ("state", state), ("extra", extra)],
        )

    def copy_at(
        step: int, weight: list[float], momentum: list[float], history: list[float]
    ) -> dict[str, Any]:
        leaves = [
            torch.tensor([weight]),
            torch.tensor([momentum]),
            torch.tensor([history], dtype=torch.float64),
        ]
        leaves.append(torch.tensor([step]))
        return {"step": step, "applied": step, "spec": spec(), "leaves": leaves, "devices": ["cpu"] * 4}

    return {
        "format": 1,
        "rewinds": 0,
        "pending_skip": 0,
        "batches_dropped": 0,
        "copies_taken": 2,
        "applied": 4,
        "spike_steps": [],
        "flags": [[5, torch.tensor([0.0, 1.0])]],
        "log": [],
        "copies": [
            copy_at(2, [0.25, 0.75], [0.5, 1.0], [1.0, 1.5]),
            copy_at(4, [0.5, -0.25], [1.0, 2.0], [2.0, 3.0]),
        ],
        "lr_cut_left": 0,
        "batch_next": 0,
        "batch_window_start": 0,
        "batches_listed": 0,
    }


def test_a_rewind_entry_of_the_old_layout_loads_and_rewinds_to_its_copy() -> None:
    """A checkpoint's ``"rewind"`` entry in the layout written before the Rewind's part hooks moved
    to their own class loads into a fresh wrapper, saves back with the same keys and values, and a
    rewind restores its copy: the parameter, the momentum and the guard's history written there."""

    def wrapper() -> tuple[nn.Module, ClippedOptimizer]:
        model = nn.Linear(2, 1, bias=False)
        guard = SpikeGuard(window=2, signals=("grad_norm",), warmup=2)
        rewind = Rewind(every=1, keep=2, spikes=2, within=4, skip_batches=0, check_every=2)
        inner = optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
        return model, ClippedOptimizer(inner, max_norm=1000.0, spike_guard=guard, rewind=rewind)

    def window(model: nn.Module, opt: ClippedOptimizer, x: list[float]) -> None:
        model(torch.tensor([x])).sum().backward()  # the gradient is x
        opt.step()
        opt.zero_grad()

    model, opt = wrapper()
    for _ in range(5):
        window(model, opt, [1.0, 2.0])
    saved = opt.state_dict()
    saved["clipopt"]["rewind"] = _old_rewind_entry()
    model, opt = wrapper()
    opt.load_state_dict(copy.deepcopy(saved))
    assert opt.rewind is not None and opt.rewind.copies == [(2, 2), (4, 4)] and opt.rewind.applied == 4
    again = opt.state_dict()["clipopt"]["rewind"]
    old = _old_rewind_entry()
    assert list(again) == list(old)
    assert {k: v for k, v in again.items() if k not in ("flags", "copies")} == {
        k: v for k, v in old.items() if k not in ("flags", "copies")
    }
    for mine, theirs in zip(again["copies"], old["copies"], strict=True):
        assert list(mine) == list(theirs) and mine["spec"] == theirs["spec"]
        assert all(torch.equal(a, b) for a, b in zip(mine["leaves"], theirs["leaves"], strict=True))
    for x in ([100.0, 0.0], [100.0, 0.0], [1.0, 2.0], [1.0, 2.0]):  # windows 6-7 spike; 9's check rewinds
        window(model, opt, x)
    assert [(e.step, e.restored) for e in opt.rewind.log] == [(9, 4)]
    assert opt.last_stats is not None and opt.last_stats.reason == "rewind"
    assert torch.equal(model.weight.detach(), torch.tensor([[0.5, -0.25]]))
    assert torch.equal(opt.state[model.weight]["momentum_buffer"], torch.tensor([[1.0, 2.0]]))
    assert opt.spike_guard is not None and opt.spike_guard.history == {"grad_norm": [2.0, 3.0]}
