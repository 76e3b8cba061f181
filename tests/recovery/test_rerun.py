"""Rerun: an anomalous window executed again tells a fault (transient) from the data (persistent).

The faults are injected by the tests' own hooks in the closure (:class:`Fault`): a NaN written
into a gradient, a flipped bit, a corrupted input -- on the first execution only (a fault) or on
every execution (the data).  The reference for a transient fault is the same run without the
fault and without Rerun: the rerun restores the RNG states (the model has dropout, the loss
draws from Python's ``random`` and NumPy's global RNG), so it computes the same gradients with
the same kernels in the same order, and the parameters must be bit-identical.
"""

from __future__ import annotations

import json
import math
import random
import struct
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from clipopt import AutoClip, ClippedOptimizer, CSVLogger, Rerun, SpikeGuard, StepStats

from .. import rerun_jobs as jobs
from ..helpers import free_port, join_spawned, start_ranks
from ..hostreads import count_host_reads
from ..markers import needs_gloo

WINDOWS = 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.25), nn.Linear(8, 3))


def _batches(n: int = WINDOWS, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen) * 3) for _ in range(n)]


@dataclass
class Fault:
    """The tests' fault injection: at batch ``batch``, on the executions listed in ``calls`` (1: the
    first), ``on_input`` changes the input before the forward pass, ``on_grads`` the gradients
    after the backward pass."""

    batch: int
    calls: tuple[int, ...] = (1,)
    on_input: Callable[[torch.Tensor], torch.Tensor] | None = None
    on_grads: Callable[[nn.Module], None] | None = None

    def hits(self, batch: int, call: int) -> bool:
        return batch == self.batch and call in self.calls


@dataclass
class Run:
    params: list[torch.Tensor]
    stats: list[StepStats]
    calls: Counter[int]
    opt: ClippedOptimizer


def _train(
    rerun: Rerun | None,
    *,
    fault: Fault | None = None,
    batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    k: int = 1,
    spike_guard: Callable[[], SpikeGuard] | None = None,
    max_norm: Any = 1.0,
    **options: Any,
) -> Run:
    """Train ``_model()`` with SGD + momentum through ``step(closure=...)``, ``k`` micro-batches per
    window; the loss is scaled by draws of Python's and NumPy's global RNGs."""
    model = _model()
    random.seed(3)
    np.random.seed(4)
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        max_norm=max_norm() if callable(max_norm) else max_norm,
        accumulation_steps=k,
        rerun=rerun,
        spike_guard=None if spike_guard is None else spike_guard(),
        **options,
    )
    calls: Counter[int] = Counter()
    stats = []
    for i, (x, y) in enumerate(batches or _batches()):

        def closure(i: int = i, x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            calls[i] += 1
            hit = fault is not None and fault.hits(i, calls[i])
            if hit and fault is not None and fault.on_input is not None:
                x = fault.on_input(x)
            jitter = (1 + 0.01 * random.random()) * (1 + 0.01 * float(np.random.rand()))
            loss = ((model(x) - y) ** 2).mean() * jitter
            loss.backward()
            if hit and fault is not None and fault.on_grads is not None:
                fault.on_grads(model)
            return loss

        opt.step(closure=closure)
        opt.zero_grad()
        if opt.micro_batches == 0:
            assert opt.last_stats is not None
            stats.append(opt.last_stats)
    return Run([p.detach().clone() for p in model.parameters()], stats, calls, opt)


def _nan_grad(model: nn.Module) -> None:
    model[0].weight.grad[1, 2] = math.nan


def _flip_bit(model: nn.Module) -> None:
    """Flip bit 30 (the exponent's highest) of the largest gradient element of the last layer: an
    element of magnitude >= 1 becomes inf or nan (exponent 255)."""
    grad = model[2].weight.grad
    index = int(grad.abs().argmax())
    value = float(grad.view(-1)[index])
    assert abs(value) >= 1.0, "the test needs a gradient element of magnitude >= 1"
    bits = struct.unpack("<I", struct.pack("<f", value))[0] ^ (1 << 30)
    flipped = struct.unpack("<f", struct.pack("<I", bits))[0]
    assert not math.isfinite(flipped)
    grad.view(-1)[index] = flipped


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


# ---------------------------------------------------------------------------- transient faults


@pytest.mark.parametrize("k", [1, 2])
def test_a_nan_in_the_first_execution_only_is_transient_and_the_update_is_applied(k: int) -> None:
    """A NaN written into a gradient on the first execution of batch 5 (with k=2: the second
    micro-batch of window 3): the window is executed again, its outcome differs (transient), and
    its update is applied -- the parameters equal a clean run's, bit for bit."""
    clean = _train(None, k=k)
    run = _train(Rerun(), k=k, fault=Fault(5, on_grads=_nan_grad))
    assert _equal(run.params, clean.params)
    window = 5 // k
    assert [s.rerun for s in run.stats] == [
        ("transient" if i == window else None) for i in range(WINDOWS // k)
    ]
    assert not any(s.skipped for s in run.stats)
    # every micro-batch of the window executed twice, every other one once
    rerun_batches = set(range(window * k, window * k + k))
    assert all(run.calls[i] == (2 if i in rerun_batches else 1) for i in range(WINDOWS))
    (event,) = run.opt.rerun.events
    assert event["window"] == window + 1 and event["trigger"] == "nonfinite" and event["applied"] is True
    assert event["first"]["total_norm"] == "nan" and math.isfinite(event["rerun"]["total_norm"])
    assert run.opt.rerun.counts == {"persistent": 0, "transient": 1}


def test_a_clip_policy_sees_the_window_once() -> None:
    """With an AutoClip threshold (its history of norms updated when a window is clipped), the
    transient window's first decision (a spike: a large finite norm) is put back before the
    second: the run equals the clean one (were the first execution's norm in the history, or the
    window's twice, it would not)."""

    def policy() -> AutoClip:
        return AutoClip(percentile=50.0, history=16)

    def guard() -> SpikeGuard:
        return SpikeGuard(z_thresh=6.0, window=8, warmup=3, signals=("loss",))

    clean = _train(None, max_norm=policy, spike_guard=guard)
    fault = Fault(5, on_input=lambda x: x * 1000)  # a finite spike: its norm would enter the history
    run = _train(Rerun(), fault=fault, max_norm=policy, spike_guard=guard)
    assert run.stats[5].rerun == "transient"
    assert _equal(run.params, clean.params)
    assert [s.max_norm for s in run.stats] == [s.max_norm for s in clean.stats]


def test_without_rerun_the_fault_is_skipped_and_the_run_differs() -> None:
    """The premise of the transient tests: the injected NaN alone skips the window (the parameters
    then differ from the clean run's)."""
    clean = _train(None)
    faulty = _train(None, fault=Fault(5, on_grads=_nan_grad))
    assert faulty.stats[5].skipped and faulty.stats[5].reason == "nonfinite"
    assert not _equal(faulty.params, clean.params)


def test_a_flipped_bit_in_one_gradient_is_transient() -> None:
    """A flipped exponent bit in one element of one parameter's gradient, on the first execution:
    transient, applied, the parameters equal the clean run's."""
    clean = _train(None)
    run = _train(Rerun(on=("nonfinite",)), fault=Fault(4, on_grads=_flip_bit))
    assert run.stats[4].rerun == "transient" and not run.stats[4].skipped
    assert _equal(run.params, clean.params)


def test_a_spike_in_the_first_execution_only_is_transient() -> None:
    """A corrupted input (x 1000) on the first execution of batch 6 is a SpikeGuard spike; the rerun
    is sound, so it is applied (the guard's history too): the run equals the clean one."""

    def guard() -> SpikeGuard:
        return SpikeGuard(z_thresh=6.0, window=8, warmup=3, signals=("loss",))

    clean = _train(None, spike_guard=guard)
    run = _train(Rerun(on=("spike",)), spike_guard=guard, fault=Fault(6, on_input=lambda x: x * 1000))
    assert run.stats[6].rerun == "transient" and not run.stats[6].skipped
    assert run.opt.rerun.events[0]["trigger"] == "spike"
    assert _equal(run.params, clean.params)
    assert run.opt.spike_guard.history == clean.opt.spike_guard.history


# ---------------------------------------------------------------------------- persistent anomalies


def _bad_data(batch: int, scale: float | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = _batches()
    x, y = batches[batch]
    x = x.clone()
    if scale is None:
        x[0, 0] = math.nan
    else:
        x = x * scale
    batches[batch] = (x, y)
    return batches


def test_a_nan_in_the_batch_is_persistent_and_skipped_as_without_rerun() -> None:
    """A NaN in the batch itself: the rerun finds the same outcome (persistent) and the window is
    skipped as without Rerun (same reason, same parameters)."""
    batches = _bad_data(2)
    plain = _train(None, batches=batches)
    run = _train(Rerun(), batches=batches)
    assert run.stats[2].rerun == "persistent"
    assert run.stats[2].skipped and run.stats[2].reason == plain.stats[2].reason == "nonfinite"
    assert _equal(run.params, plain.params)
    assert run.calls[2] == 2
    assert run.opt.rerun.events[0]["applied"] is False


def test_a_spike_in_the_batch_is_persistent() -> None:
    """A batch whose input is 1000 times larger on every execution: persistent, skipped as without
    Rerun."""

    def guard() -> SpikeGuard:
        return SpikeGuard(z_thresh=6.0, window=8, warmup=3, signals=("loss",))

    batches = _bad_data(6, scale=1000.0)
    plain = _train(None, batches=batches, spike_guard=guard)
    run = _train(Rerun(), batches=batches, spike_guard=guard)
    assert plain.stats[6].reason == "spike"
    assert run.stats[6].rerun == "persistent" and run.stats[6].reason == "spike"
    assert _equal(run.params, plain.params)


def test_a_spike_is_not_rerun_unless_asked() -> None:
    """on=("nonfinite",): a spike is decided as without Rerun, its closure called once."""

    def guard() -> SpikeGuard:
        return SpikeGuard(z_thresh=6.0, window=8, warmup=3, signals=("loss",))

    run = _train(Rerun(on=("nonfinite",)), batches=_bad_data(6, scale=1000.0), spike_guard=guard)
    assert run.stats[6].reason == "spike" and run.stats[6].rerun is None
    assert run.calls[6] == 1


@pytest.mark.parametrize(("tolerance", "outcome"), [(0.0, "transient"), (1e-3, "persistent")])
def test_a_difference_within_the_tolerance_is_persistent(tolerance: float, outcome: str) -> None:
    """A NaN gradient on both executions, with losses that differ by a relative 1e-5 (a
    non-deterministic kernel): transient at tolerance 0 (and skipped, the rerun being unsound),
    persistent within tolerance 1e-3."""
    model = _model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), rerun=Rerun(tolerance=tolerance))
    calls: Counter[int] = Counter()
    for i, (x, y) in enumerate(_batches(4)):

        def closure(i: int = i, x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            calls[i] += 1
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            if i == 3:
                _nan_grad(model)
                return loss.detach().double() * (1 + 1e-5 * calls[i])
            return loss

        opt.step(closure=closure)
        opt.zero_grad()
    assert opt.stats[3].rerun == outcome and opt.stats[3].skipped
    first, again = opt.rerun.events[0]["first"]["loss"], opt.rerun.events[0]["rerun"]["loss"]
    assert first != again and abs(first - again) <= 1e-3 * abs(again)


# ---------------------------------------------------------------------------- cost and recording


def test_a_healthy_run_calls_each_closure_once_and_equals_a_run_without_rerun() -> None:
    """No anomaly: no closure is called again (0 extra calls), nothing is recorded, and the
    parameters are those of the same run without Rerun."""
    plain = _train(None)
    run = _train(Rerun())
    assert sum(run.calls.values()) == WINDOWS and set(run.calls.values()) == {1}
    assert [s.rerun for s in run.stats] == [None] * WINDOWS
    assert run.opt.rerun.events == [] and run.opt.rerun.counts == {"persistent": 0, "transient": 0}
    assert _equal(run.params, plain.params)


def test_a_healthy_window_reads_its_decision_on_the_host_once() -> None:
    """The documented cost: with Rerun on, each healthy window makes one host read more than
    without it (its decision: norm, loss and reason in one read), made by the Rerun."""

    def reads(rerun: Rerun | None) -> list[str]:
        model = _model()
        opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), max_norm=1.0, rerun=rerun)
        x, y = _batches(1)[0]

        def closure() -> torch.Tensor:
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            return loss

        opt.step(closure=closure)  # the first window checks more
        opt.zero_grad()
        with count_host_reads() as counted:
            for _ in range(3):
                opt.step(closure=closure)
                opt.zero_grad()
        return counted.ours

    base, mine = reads(None), reads(Rerun())
    assert len(mine) == len(base) + 3
    assert len([r for r in mine if "rerun.py" in r]) == 3


def test_the_csv_log_has_the_rerun_column(tmp_path: Path) -> None:
    """The loggers' ``rerun`` column: empty on healthy windows, the outcome where one reran."""
    path = tmp_path / "log.csv"
    logger = CSVLogger(path)
    _train(Rerun(), fault=Fault(5, on_grads=_nan_grad), loggers=[logger])
    logger.close()
    import csv

    rows = list(csv.DictReader(path.open()))
    assert [r["rerun"] for r in rows] == ["transient" if i == 5 else "" for i in range(WINDOWS)]


def test_the_tensorboard_log_has_one_tag_per_outcome(tmp_path: Path) -> None:
    """TensorBoard takes numbers: an outcome is the tag ``clipopt/rerun/<outcome>`` (1 where it
    happened), as each skip reason has its own tag."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from clipopt import TensorBoardLogger

    logger = TensorBoardLogger(tmp_path)
    _train(Rerun(), fault=Fault(5, on_grads=_nan_grad), loggers=[logger])
    logger.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    events = acc.Scalars("clipopt/rerun/transient")
    assert [(e.step, e.value) for e in events] == [(6, 1.0)]
    assert "clipopt/rerun/persistent" not in acc.Tags()["scalars"]


def test_the_tracker_is_read_back_after_a_restart(tmp_path: Path) -> None:
    """Every event is one JSON line, appended; a new Rerun on the same file reads the events back
    (``events``), the counts come back with the checkpoint, an incomplete last line is ignored."""
    path = tmp_path / "sub" / "rerun.jsonl"
    first = _train(Rerun(tracker=path), fault=Fault(5, on_grads=_nan_grad))
    lines = path.read_text().splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0]) == first.opt.rerun.events[0]
    assert Rerun.read_tracker(path) == first.opt.rerun.events

    state = first.opt.state_dict()
    with path.open("a") as f:  # a process that died while writing a line
        f.write('{"window": 9, "outc')
    restarted = Rerun(tracker=path)
    assert restarted.events == first.opt.rerun.events
    model = _model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), rerun=restarted)
    opt.load_state_dict(state)
    assert opt.rerun.counts == {"persistent": 0, "transient": 1}
    assert Rerun.read_tracker(tmp_path / "absent.jsonl") == []


def test_the_state_dict_entry_is_checked() -> None:
    model = _model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), rerun=Rerun())
    state = opt.state_dict()
    state["clipopt"]["rerun"] = {"counts": {"transient": -1, "persistent": 0}}
    with pytest.raises(ValueError, match="'rerun' entry"):
        opt.load_state_dict(state)
    assert opt.rerun.counts == {"persistent": 0, "transient": 0}


# ---------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"on": ("bogus",)}, ValueError, r"on must name each of .* got \('bogus',\)"),
        ({"on": ()}, ValueError, "at least one"),
        ({"on": ("spike", "spike")}, ValueError, "at most once"),
        ({"on": "nonfinite"}, TypeError, "on must be a tuple"),
        ({"tolerance": -1e-3}, ValueError, "tolerance must be a finite number >= 0, got -0.001"),
        ({"tolerance": math.inf}, ValueError, "tolerance must be a finite number"),
        ({"tolerance": "0"}, TypeError, "tolerance must be a float"),
        ({"tracker": 3}, TypeError, "tracker must be a path or None"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        Rerun(**kwargs)


def test_rerun_must_be_a_rerun() -> None:
    model = _model()
    with pytest.raises(TypeError, match="rerun must be a Rerun or None, got int"):
        ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), rerun=3)


@pytest.mark.parametrize("mixed", [False, True])
def test_without_a_closure_the_window_is_decided_as_without_rerun_and_it_warns_once(mixed: bool) -> None:
    """``step()`` without a closure cannot be executed again: one RuntimeWarning, then the window
    is skipped as without Rerun.  ``mixed``: windows of 2 micro-batches, the first given without
    a closure, the second with one."""
    model = _model()
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), rerun=Rerun(), accumulation_steps=2 if mixed else 1
    )
    x, y = _batches(1)[0]
    x = x.clone()
    x[0, 0] = math.nan

    def closure() -> torch.Tensor:
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        return loss

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            closure()
            opt.step()
            if mixed:
                opt.step(closure=closure)
            opt.zero_grad()
    mine = [w for w in caught if "Rerun" in str(w.message)]
    assert len(mine) == 1 and issubclass(mine[0].category, RuntimeWarning)
    assert "opt.step(closure=...)" in str(mine[0].message)
    assert all(s.skipped and s.rerun is None for s in opt.stats)


# ---------------------------------------------------------------------------- data parallelism


@needs_gloo
def test_two_gloo_ranks_rerun_together_and_name_the_faulty_rank(tmp_path: Path) -> None:
    """DDP, 2 gloo ranks, a NaN in rank 1's input on its first execution of window 4: both ranks
    rerun, agree on "transient", apply the update (their parameters equal a clean DDP run's) and
    the event names rank 1 (``Rerun.watch``: the check before the reduction); only rank 0 writes
    the tracker.  A NaN on rank 1 in every execution is persistent on both; a NaN loss of rank 1
    alone (finite gradients) reruns on no rank; NaN gradients of rank 1 alone with a finite loss
    are named only with watch().  Under FSDP2 the transient fault is applied alike."""
    join_spawned(start_ranks(jobs.rerun_job, (free_port(), str(tmp_path)), jobs.WORLD), "rerun")
    a, b = (torch.load(tmp_path / f"rerun{r}.pt", weights_only=False) for r in range(jobs.WORLD))
    for r in (a, b):
        assert r["transient"]["reruns"] == [
            ("transient" if i == jobs.FAULT else None) for i in range(jobs.WINDOWS)
        ]
        assert r["transient"]["ranks"] == [1]
        assert _equal(r["transient"]["params"], r["clean"]["params"])
        assert r["persistent"]["reruns"][jobs.FAULT] == "persistent"
        assert r["persistent"]["skipped"][jobs.FAULT] is True
    assert _equal(a["clean"]["params"], b["clean"]["params"])
    for r in (a, b):  # rank 1's own gradients NaN before the reduction, its loss finite: named by watch()
        assert r["grad-fault"]["reruns"] == r["transient"]["reruns"]
        assert r["grad-fault"]["ranks"] == [1]
        assert _equal(r["grad-fault"]["params"], r["clean"]["params"])
        assert r["grad-fault-unwatched"]["ranks"] == []  # without watch(): the losses name no rank
    for r in (a, b):  # one rank's own NaN loss, its gradients finite: no rank reruns (none hangs)
        assert r["local-loss"]["reruns"] == [None] * jobs.WINDOWS
        assert _equal(r["local-loss"]["params"], r["clean"]["params"])
    for r in (a, b):  # FSDP2: the same, the rank named by its own loss
        assert r["fsdp-transient"]["reruns"] == r["transient"]["reruns"]
        assert r["fsdp-transient"]["ranks"] == [1]
        assert _equal(r["fsdp-transient"]["params"], r["fsdp-clean"]["params"])
    events = Rerun.read_tracker(tmp_path / "tracker.jsonl")
    assert [e["outcome"] for e in events] == ["transient", "persistent"]  # rank 0 alone wrote them


# ---------------------------------------------------------------------------- the report


def _logged_run(tmp_path: Path, faults: list[int]) -> tuple[Path, Path]:
    """A real run, logged to a CSV file and a TensorBoard folder, with a NaN gradient on the first
    execution of each batch in ``faults`` and a NaN in the input of batch 1 (persistent)."""
    from clipopt import TensorBoardLogger

    csv_path, tb_path = tmp_path / "log.csv", tmp_path / "tb"
    loggers = [CSVLogger(csv_path), TensorBoardLogger(tb_path)]
    batches = _bad_data(1, None) + _batches(16, seed=2)
    model = _model()
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), max_norm=1.0, rerun=Rerun(), loggers=loggers
    )
    calls: Counter[int] = Counter()
    for i, (x, y) in enumerate(batches):

        def closure(i: int = i, x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            calls[i] += 1
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            if i in faults and calls[i] == 1:
                _nan_grad(model)
            return loss

        opt.step(closure=closure)
        opt.zero_grad()
    for logger in loggers:
        logger.close()
    return csv_path, tb_path


@pytest.mark.parametrize("kind", ["csv", "tensorboard"])
def test_the_report_counts_transient_events_and_suspects_a_device_when_they_repeat(
    tmp_path: Path, kind: str
) -> None:
    """The log of a real run with two transient faults (windows 6 and 15) and one persistent NaN
    batch (window 2): the report counts them, gives the transient steps, and says a device may be
    faulty; with one transient fault it does not."""
    from clipopt._report.read import read_log
    from clipopt._report.rules.analysis import analyze

    csv_path, tb_path = _logged_run(tmp_path / "two", faults=[5, 14])
    report = analyze(read_log(csv_path if kind == "csv" else tb_path))
    assert report["summary"]["rerun"] == {"persistent": 1, "transient": 2}
    notes = " | ".join(report["notes"])
    assert "3 anomalous update(s) executed again (Rerun): 1 persistent" in notes
    assert "2 transient at step(s) 6, 15" in notes
    assert "a device may be faulty" in notes

    csv_path, tb_path = _logged_run(tmp_path / "one", faults=[5])
    report = analyze(read_log(csv_path if kind == "csv" else tb_path))
    assert report["summary"]["rerun"] == {"persistent": 1, "transient": 1}
    assert "a device may be faulty" not in " | ".join(report["notes"])
