"""Rewind's escalation: ``lr_cut=(factor, updates)`` and ``reset_state=True`` after a rewind.

Every run here spikes at batches 12 and 14 (windows 13 and 15), so that the check at the start of
window 16 rewinds to the copy of window 11 (``check_every=1``, no batch dropped); batch 17
(window 18) spikes again, inside the cut, and is skipped: it must not count as a cut update.
"""

from __future__ import annotations

import copy
import csv
import re
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import pytorch_optimizer
import torch
from torch import nn, optim
from torch.optim import lr_scheduler as lrs
from torch.utils.data import DataLoader, TensorDataset

import clipopt
from clipopt import ClippedOptimizer, CSVLogger, Rewind, SpikeGuard, TensorBoardLogger
from clipopt._report.report import analyze, format_report, read_log

from ..helpers import ZeroDivideSGD, batches_for, model_for
from ..hostreads import count_host_reads
from ..optim_db import get

Batch = tuple[torch.Tensor, torch.Tensor]
SPIKES = {12, 14, 17}
REWIND_WINDOW, CUT, FACTOR = 16, 3, 0.25
#: The applied windows the cut covers: 17, then 19 and 20 (18 is the spike skipped inside the cut).
CUT_WINDOWS = {17, 19, 20}


def _batches(n: int = 26) -> list[Batch]:
    """Seeded batches; those in SPIKES with targets 1000 times larger (a loss and norm spike)."""
    return [(x, y * 1000) if i in SPIKES else (x, y) for i, (x, y) in enumerate(batches_for(n, seed=5))]


def _rewind(**kw: Any) -> Rewind:
    return Rewind(every=5, keep=2, spikes=2, within=5, skip_batches=0, check_every=1, **kw)


def _guard() -> SpikeGuard:
    return SpikeGuard(z_thresh=50.0, window=8, warmup=4)


def _lr_seen(inner: optim.Optimizer) -> list[list[float]]:
    """What every call of ``inner.step()`` sees as its groups' learning rates (a step pre-hook)."""
    seen: list[list[float]] = []
    inner.register_step_pre_hook(
        lambda o, args, kwargs: seen.append([float(g["lr"]) for g in o.param_groups])
    )
    return seen


def _run(
    make: Callable[[Iterable[nn.Parameter]], optim.Optimizer],
    rewind: Rewind,
    scheduler: Callable[[ClippedOptimizer], Any] | None = None,
    loggers: list[Any] | None = None,
    **options: Any,
) -> tuple[ClippedOptimizer, list[dict[str, Any]]]:
    """Train on ``_batches()``; per window: reason, skipped, the lr the inner step saw (None: not
    called), the groups' lr after the scheduler's step, params before and after, and gradients.
    ``options``: more of the wrapper's arguments."""
    model = model_for()
    inner = make(model.parameters())
    seen = _lr_seen(inner)
    opt = ClippedOptimizer(
        inner, max_norm=None, spike_guard=_guard(), rewind=rewind, loggers=loggers or [], **options
    )
    sched = scheduler(opt) if scheduler is not None else None
    rows = []
    assert opt.rewind is not None
    for x, y in opt.rewind.batches(_batches()):
        before = [p.detach().clone() for p in model.parameters()]
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        calls = len(seen)
        opt.step(loss=loss)
        opt.zero_grad()
        if sched is not None:
            sched.step()
        assert opt.last_stats is not None
        rows.append(
            {
                "window": opt.num_windows,
                "reason": opt.last_stats.reason,
                "skipped": opt.last_stats.skipped,
                "step_lr": seen[-1] if len(seen) > calls else None,
                "lr": [float(g["lr"]) for g in opt.param_groups],
                "before": before,
                "after": [p.detach().clone() for p in model.parameters()],
                "grads": grads,
            }
        )
    return opt, rows


def _applied_lrs(rows: list[dict[str, Any]]) -> dict[int, list[float]]:
    """Window -> the lr its inner step saw, for the applied windows."""
    return {r["window"]: r["step_lr"] for r in rows if not r["skipped"]}


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda p: optim.SGD(p, lr=0.1), id="sgd"),
        pytest.param(lambda p: get("AdamW-fused").make(p, lr=0.01), id="adamw-fused"),
        pytest.param(lambda p: get("AdamW-foreach").make(p, lr=0.01), id="adamw-foreach"),
        pytest.param(lambda p: pytorch_optimizer.Lion(p, lr=1e-3), id="lion"),
    ],
)
def test_lr_cut_multiplies_the_lr_of_the_next_applied_updates(make: Callable[..., optim.Optimizer]) -> None:
    """After the rewind the inner step sees lr * factor for exactly `updates` applied updates (the
    spike skipped inside the cut does not count), then the lr again; the groups' lr is never left
    changed between steps; the run without lr_cut steps the same windows with the plain lr."""
    opt, rows = _run(make, _rewind(lr_cut=(FACTOR, CUT)))
    _, plain = _run(make, _rewind())
    assert [r["reason"] for r in rows] == [r["reason"] for r in plain]
    assert rows[REWIND_WINDOW - 1]["reason"] == "rewind" and rows[17]["reason"] == "spike"
    lr = plain[0]["lr"][0]
    assert all(r["lr"] == [lr] for r in rows)  # as the user set it, before and after every window
    applied = _applied_lrs(rows)
    assert set(applied) == set(_applied_lrs(plain))
    want = {w: [lr * FACTOR] if w in CUT_WINDOWS else [lr] for w in applied}
    assert applied == want
    assert rows[17]["step_lr"] is None  # skipped inside the cut: the host path never called step()
    assert opt.rewind is not None and opt.rewind.lr_cut_left == 0
    (event,) = opt.rewind.log
    assert (event.lr_factor, event.lr_updates, event.state_reset) == (FACTOR, CUT, False)


def test_lr_cut_update_is_the_sgd_formula_with_the_cut_lr() -> None:
    """Plain SGD: the first update after the rewind is p - (lr * factor) * grad, bit for bit (torch's
    own SGD step on a copy of the restored parameters, with the cut lr), the first after the cut
    p - lr * grad."""
    _, rows = _run(lambda p: optim.SGD(p, lr=0.1), _rewind(lr_cut=(FACTOR, CUT)))
    for window, lr in ((17, 0.1 * FACTOR), (21, 0.1)):
        row = rows[window - 1]
        params = [nn.Parameter(b.clone()) for b in row["before"]]
        for p, g in zip(params, row["grads"], strict=True):
            p.grad = g.clone()
        optim.SGD(params, lr=lr).step()
        for got, want in zip(row["after"], params, strict=True):
            assert torch.equal(got, want.detach()), window


def _lr_from_scheduler(kind: str) -> Callable[[ClippedOptimizer], Any]:
    if kind == "lambda-per-update":
        return lambda o: clipopt.per_update(lrs.LambdaLR(o, lambda e: 1.0 / (1 + e)))
    if kind == "onecycle":  # stepped after every window, as Lightning and the HF Trainer do
        return lambda o: lrs.OneCycleLR(o, max_lr=0.5, total_steps=40)
    return lambda o: lrs.ExponentialLR(o, gamma=0.9)  # chainable: reads group["lr"] back


@pytest.mark.parametrize("kind", ["lambda-per-update", "onecycle", "exponential"])
def test_lr_cut_leaves_the_scheduler_its_own_values(kind: str) -> None:
    """With a scheduler stepping each update (per_update LambdaLR) or each window (OneCycleLR,
    ExponentialLR, which reads group['lr'] back), its lr sequence is the same as without the cut,
    and the inner step sees the scheduler's lr * factor on the cut windows only."""
    make = lambda p: optim.SGD(p, lr=0.1)  # noqa: E731
    _, rows = _run(make, _rewind(lr_cut=(FACTOR, CUT)), _lr_from_scheduler(kind))
    _, plain = _run(make, _rewind(), _lr_from_scheduler(kind))
    assert [r["lr"] for r in rows] == [r["lr"] for r in plain]
    cut, base = _applied_lrs(rows), _applied_lrs(plain)
    assert set(cut) == set(base)
    for w, lr in base.items():
        assert cut[w] == ([lr[0] * FACTOR] if w in CUT_WINDOWS else lr), w


def test_lr_cut_with_a_tensor_lr_keeps_the_tensor_and_its_value() -> None:
    """A tensor lr (fused AdamW): the inner step sees lr * factor on the cut windows; the group keeps
    the same tensor object, bit-identical to its value before each window."""
    lr = torch.tensor(0.01)
    make = lambda p: optim.AdamW(p, lr=lr, fused=True)  # noqa: E731
    opt, rows = _run(make, _rewind(lr_cut=(FACTOR, CUT)))
    assert opt.param_groups[0]["lr"] is lr and torch.equal(lr, torch.tensor(0.01))
    applied = _applied_lrs(rows)
    assert {w for w, v in applied.items() if v != [float(torch.tensor(0.01))]} == CUT_WINDOWS
    for w in CUT_WINDOWS:
        assert applied[w] == [float(torch.tensor(0.01) * FACTOR)]


def test_lr_cut_counts_applied_updates_only_not_a_rejected_one() -> None:
    """update_stats=True around an inner optimizer whose step in window 17, the cut's first, divides
    by zero: that update is put back (reason "nonfinite_update") after the step, so it is not one of
    the cut's updates; the cut goes on for 19, 20 and 21.  It used to be counted before the update
    was checked: the cut ended after window 20."""
    _, plain = _run(lambda p: ZeroDivideSGD(p, lr=0.1), _rewind(), update_stats=True)
    call = 1 + sum(r["step_lr"] is not None for r in plain if r["window"] < 17)  # window 17's step call
    make = lambda p: ZeroDivideSGD(p, lr=0.1, bad_calls={call})  # noqa: E731
    opt, rows = _run(make, _rewind(lr_cut=(FACTOR, CUT)), update_stats=True)
    assert rows[16]["reason"] == "nonfinite_update" and rows[17]["reason"] == "spike"
    cut = {r["window"] for r in rows if r["step_lr"] is not None and r["step_lr"] != [0.1]}
    assert cut == {17, 19, 20, 21}
    assert all(rows[w - 1]["step_lr"] == [0.1 * FACTOR] for w in cut)
    assert opt.rewind is not None and opt.rewind.lr_cut_left == 0


def _two_groups(params: Iterable[nn.Parameter]) -> list[dict[str, Any]]:
    """The weights in one group, the biases in another."""
    ps = list(params)
    return [{"params": [p for p in ps if p.dim() > 1]}, {"params": [p for p in ps if p.dim() == 1]}]


@pytest.mark.parametrize("kind", [None, "lambda-per-update", "exponential"])
def test_lr_cut_cuts_a_tensor_lr_shared_by_several_groups_once(kind: str | None) -> None:
    """Fused AdamW over two groups with ``lr=torch.tensor(0.01)``: torch gives both groups the same
    tensor.  On a cut window each group's step sees lr * factor (it used to see lr * factor**2, the
    tensor multiplied once per group); the scheduler's own values are the same as without the cut,
    and the groups keep the one tensor."""
    make = lambda p: optim.AdamW(_two_groups(p), lr=torch.tensor(0.01), fused=True)  # noqa: E731
    sched = None if kind is None else _lr_from_scheduler(kind)
    opt, rows = _run(make, _rewind(lr_cut=(FACTOR, CUT)), sched)
    _, plain = _run(make, _rewind(), sched)
    groups = opt.param_groups
    assert len(groups) == 2 and groups[0]["lr"] is groups[1]["lr"]
    assert [r["lr"] for r in rows] == [r["lr"] for r in plain]  # after every window: the scheduler's
    cut, base = _applied_lrs(rows), _applied_lrs(plain)
    assert set(cut) == set(base)
    for w, lrs_seen in base.items():  # FACTOR is a power of two: lr * FACTOR is exact
        assert cut[w] == ([lr * FACTOR for lr in lrs_seen] if w in CUT_WINDOWS else lrs_seen), w


def test_lr_cut_survives_a_state_dict_round_trip() -> None:
    """A checkpoint taken inside the cut resumes it: the loaded Rewind has the same updates left."""
    opt, _ = _run(lambda p: optim.SGD(p, lr=0.1), _rewind(lr_cut=(FACTOR, 10)))
    assert opt.rewind is not None and opt.rewind.lr_cut_left == 10 - 9  # windows 17, 19-26 applied
    model = model_for()
    fresh = ClippedOptimizer(
        optim.SGD(model.parameters(), lr=0.1), spike_guard=_guard(), rewind=_rewind(lr_cut=(FACTOR, 10))
    )
    fresh.load_state_dict(opt.state_dict())
    assert fresh.rewind is not None and fresh.rewind.lr_cut_left == 1
    assert fresh.rewind.log == opt.rewind.log


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (
            0.5,
            TypeError,
            "lr_cut must be a pair (factor, updates) or None, got 0.5; pass e.g. lr_cut=(0.5, 100)",
        ),
        ((0.5, 10, 1), TypeError, "lr_cut must be a pair (factor, updates) or None, got (0.5, 10, 1); "),
        (("half", 10), TypeError, "lr_cut's factor must be a float in (0, 1], got 'half' (str); pass e.g."),
        ((0.0, 10), ValueError, "lr_cut's factor must be in (0, 1], got 0.0; pass e.g. lr_cut=(0.5, 100)"),
        ((1.5, 10), ValueError, "lr_cut's factor must be in (0, 1], got 1.5; "),
        ((float("nan"), 10), ValueError, "lr_cut's factor must be in (0, 1], got nan; "),
        ((0.5, 2.0), TypeError, "lr_cut's updates must be an int >= 1, got 2.0 (float); pass e.g."),
        ((0.5, True), TypeError, "lr_cut's updates must be an int >= 1, got True (bool); "),
        ((0.5, 0), ValueError, "lr_cut's updates must be an int >= 1, got 0; pass e.g. lr_cut=(0.5, 100) "),
    ],
)
def test_lr_cut_arguments_are_checked(value: Any, error: type[Exception], message: str) -> None:
    """A bad lr_cut raises naming the argument, the value and the fix."""
    with pytest.raises(error, match=re.escape(message)):
        _rewind(lr_cut=value)


def test_reset_state_argument_is_checked() -> None:
    """reset_state must be a real bool."""
    with pytest.raises(TypeError, match=re.escape("reset_state must be True or False, got 1 (int); ")):
        _rewind(reset_state=1)


# ----------------------------------------------------------------------------- reset_state

RESET_CASES = [
    pytest.param(lambda p: get("AdamW-fused").make(p, lr=0.01), id="adamw-fused"),
    pytest.param(lambda p: get("AdamW-foreach").make(p, lr=0.01), id="adamw-foreach"),
    pytest.param(lambda p: get("AdamW-forloop").make(p, lr=0.01), id="adamw-forloop"),
    pytest.param(lambda p: get("Adam-amsgrad-forloop").make(p, lr=0.01), id="adam-amsgrad"),
    pytest.param(lambda p: get("SGD-momentum-forloop").make(p, lr=0.01), id="sgd-momentum"),
    pytest.param(lambda p: pytorch_optimizer.Lion(p, lr=1e-3), id="lion"),
    pytest.param(lambda p: pytorch_optimizer.Adan(p, lr=1e-3), id="adan"),
]


def _state_at_rewind(make: Callable[..., optim.Optimizer], rewind: Rewind) -> tuple[dict[Any, Any], Any]:
    """The inner optimizer's state right after the rewinding window (cloned), and after window 11."""
    model = model_for()
    inner = make(model.parameters())
    opt = ClippedOptimizer(inner, spike_guard=_guard(), rewind=rewind)
    snap: dict[int, Any] = {}

    def clone(state: Any) -> dict[int, dict[str, Any]]:
        params = list(model.parameters())
        return {
            i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state[p].items()}
            for i, p in enumerate(params)
        }

    assert opt.rewind is not None
    for x, y in opt.rewind.batches(_batches()[:REWIND_WINDOW]):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
        snap[opt.num_windows] = clone(inner.state)
    return snap[REWIND_WINDOW], snap[11]


@pytest.mark.parametrize("make", RESET_CASES)
def test_reset_state_zeroes_the_moments_and_keeps_the_step(make: Callable[..., optim.Optimizer]) -> None:
    """reset_state=True: after the rewind every floating state tensor but 'step' is zero (same shape
    and dtype as in the copy), 'step' and non-float entries are the copy's; without it, the state
    is the copy's, moments included (nonzero)."""
    reset, copied = _state_at_rewind(make, _rewind(reset_state=True))
    kept, copied2 = _state_at_rewind(make, _rewind())
    moments = 0
    for i, entry in copied.items():
        assert set(reset[i]) == set(entry)
        for key, value in entry.items():
            got = reset[i][key]
            if isinstance(value, torch.Tensor) and value.is_floating_point() and key != "step":
                assert got.shape == value.shape and got.dtype == value.dtype
                assert not got.any(), (i, key)
                assert torch.equal(kept[i][key], copied2[i][key]) and kept[i][key].any(), (i, key)
                moments += 1
            elif isinstance(value, torch.Tensor):
                assert torch.equal(got, value), (i, key)
            else:
                assert got == value, (i, key)
    assert moments > 0


def test_reset_state_then_training_goes_on_like_a_fresh_adamw_state() -> None:
    """After the reset the next AdamW update is torch's AdamW step from zero moments and the kept
    step count (a plain AdamW given the same state and gradients)."""
    model = model_for()
    inner = optim.AdamW(model.parameters(), lr=0.01, foreach=False)
    opt = ClippedOptimizer(inner, max_norm=None, spike_guard=_guard(), rewind=_rewind(reset_state=True))
    assert opt.rewind is not None
    for n, (x, y) in enumerate(opt.rewind.batches(_batches())):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        if n == REWIND_WINDOW:  # window 17: the first update after the reset
            params = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
            for q, p in zip(params, model.parameters(), strict=True):
                q.grad = p.grad.detach().clone()  # type: ignore[union-attr]
            ref = optim.AdamW(params, lr=0.01, foreach=False)
            ref.load_state_dict(copy.deepcopy(inner.state_dict()))  # torch shares 'step' tensors
            ref.step()
        opt.step(loss=loss)
        opt.zero_grad()
        if n == REWIND_WINDOW:
            for p, q in zip(model.parameters(), params, strict=True):
                assert torch.equal(p.detach(), q.detach())
            break


# ----------------------------------------------------------------------------- logs and the report


def test_escalation_is_logged_in_the_csv_tensorboard_and_report(tmp_path: Path) -> None:
    """A real run with lr_cut and reset_state: opt.rewind.log, the CSV's lr_factor/state_reset/
    batch columns, the TensorBoard tags, and the report (from each) saying what the rewind did and
    listing the batches of the spike skips and the rewind as a skip= list."""
    csv_path, tb_dir = tmp_path / "log.csv", tmp_path / "tb"
    loggers = [CSVLogger(csv_path), TensorBoardLogger(str(tb_dir))]
    rewind = _rewind(lr_cut=(FACTOR, CUT), reset_state=True)
    opt, _ = _run(lambda p: optim.SGD(p, lr=0.1, momentum=0.9), rewind, loggers=loggers)
    opt.close()
    (event,) = rewind.log
    assert event.to_dict() == {
        "step": 16, "restored": 11, "first_spike": 13, "spikes": 2, "undone": 2,
        "lr_factor": FACTOR, "lr_updates": CUT, "state_reset": True,
    }  # fmt: skip
    rows = list(csv.DictReader(csv_path.open()))
    assert [r["lr_factor"] for r in rows[15:22]] == [
        "1.0",
        str(FACTOR),
        str(FACTOR),
        str(FACTOR),
        str(FACTOR),
        "1.0",
        "1.0",
    ]
    assert [w + 1 for w, r in enumerate(rows) if r["state_reset"] == "1.0"] == [16]
    # one batch per window, none dropped: window w drew batch w - 1
    assert [(r["batch_start"], r["batch_end"]) for r in rows[:3]] == [("0", "1"), ("1", "2"), ("2", "3")]
    for source in (str(csv_path), str(tb_dir)):
        report = analyze(read_log(source))
        assert report["summary"]["skip"] == [[12, 13], [14, 16], [17, 18]], source
        text = format_report(report)
        assert (
            "the learning rate was multiplied by 0.25 after them (lr_cut; 3 applied update(s) in all); "
            "1 of them zeroed the optimizer's moment buffers (reset_state)"
        ) in text, source
        assert (
            "batches drawn by opt.rewind.batches() in the spike skips and rewinds: "
            "step 13 (spike): batch 12; step 15 (spike): batch 14; step 16 (rewind): batch 15; "
            "step 18 (spike): batch 17"
        ) in text, source
        assert (
            "to leave those batches out on a restart: "
            "opt.rewind.batches(loader, skip=[(12, 13), (14, 16), (17, 18)])"
        ) in text, source


def _reads_per_window(rewind: Rewind) -> list[int]:
    """Host reads in each window of a fused AdamW run on ``_batches()``."""
    model = model_for()
    opt = ClippedOptimizer(
        get("AdamW-fused").make(model.parameters(), lr=0.01), spike_guard=_guard(), rewind=rewind
    )
    reads = []
    assert opt.rewind is not None
    for x, y in opt.rewind.batches(_batches()):
        with count_host_reads() as r:
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step(loss=loss)
            opt.zero_grad()
        reads.append(len(r))
    return reads


def test_lr_cut_reads_the_host_once_per_cut_window_only() -> None:
    """Fused AdamW: a cut window takes the host path (one more read, to count applied updates); every
    other window reads as often as without lr_cut (the checks only)."""
    cut, plain = _reads_per_window(_rewind(lr_cut=(FACTOR, CUT))), _reads_per_window(_rewind())
    extra = {w + 1 for w, (a, b) in enumerate(zip(cut, plain, strict=True)) if a != b}
    assert extra == CUT_WINDOWS | {18}  # 18: the spike skipped inside the cut, read on the host too
    assert all(cut[w - 1] == plain[w - 1] + 1 for w in extra)


def test_lr_cut_and_reset_state_are_settings_the_ranks_compare() -> None:
    """lr_cut and reset_state are in the Rewind's settings record, which every data-parallel rank
    compares (clipopt._distributed.agreement): Rewinds that differ only in them give different
    records, each naming the setting."""
    base = _rewind().settings()
    assert base["rewind.lr_cut"] is None and base["rewind.reset_state"] is False
    for kw in ({"lr_cut": (0.5, 10)}, {"lr_cut": (0.5, 11)}, {"lr_cut": (0.25, 10)}, {"reset_state": True}):
        got = _rewind(**kw).settings()
        name = "rewind." + next(iter(kw))
        assert got[name] == kw[next(iter(kw))] and {k: v for k, v in got.items() if k != name} == {
            k: v for k, v in base.items() if k != name
        }, kw


def _spiky_regressor(lr_cut: tuple[float, int] | None) -> Any:
    """A ``_SpikyRegressor`` (Lightning imported here, not with the module: it takes seconds of the
    quick loop, which leaves this test out)."""
    import lightning as L

    class _SpikyRegressor(L.LightningModule):
        """A tiny MLP under Lightning; the batches in SPIKES have targets 1000 times larger. OneCycleLR at
        interval "step": Lightning calls its step() after every optimizer step."""

        def __init__(self, lr_cut: tuple[float, int] | None) -> None:
            super().__init__()
            self.net = model_for()
            self.lr_cut = lr_cut
            self.step_lrs: dict[int, float] = {}  # window -> the lr its inner step saw
            self.sched_lrs: list[float] = []  # the group's lr after every batch: the scheduler's

        def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return ((self.net(x) - (y * 1000 if batch_idx in SPIKES else y)) ** 2).mean()

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.sched_lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

        def configure_optimizers(self) -> dict[str, Any]:
            inner = optim.SGD(self.parameters(), lr=0.1)
            rewind = _rewind(lr_cut=self.lr_cut)
            opt = ClippedOptimizer(inner, max_norm=None, spike_guard=_guard(), rewind=rewind)

            def seen(o: optim.Optimizer, args: Any, kwargs: Any) -> None:
                self.step_lrs[opt.num_windows] = o.param_groups[0]["lr"]

            inner.register_step_pre_hook(seen)
            sched = lrs.OneCycleLR(opt, max_lr=0.5, total_steps=40)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return _SpikyRegressor(lr_cut)


def _fit(lr_cut: tuple[float, int] | None, tmp_path: Path) -> tuple[Any, ClippedOptimizer]:
    import lightning as L

    x, y = zip(*batches_for(26, seed=5), strict=True)
    data = TensorDataset(torch.cat(x), torch.cat(y))
    model = _spiky_regressor(lr_cut)
    trainer = L.Trainer(
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(does not have many workers|LeafSpec|litlogger).*")
        trainer.fit(model, DataLoader(data, batch_size=8))
    opt = trainer.optimizers[0]
    assert isinstance(opt, ClippedOptimizer)
    return model, opt


def test_lr_cut_under_lightning_keeps_the_schedulers_values(tmp_path: Path) -> None:
    """A real Lightning Trainer stepping OneCycleLR after every update: with lr_cut the scheduler's
    lr sequence is the one without it, and the inner step sees it times the factor on exactly the
    cut windows (the spike skipped inside the cut not counted)."""
    cut, opt = _fit((FACTOR, CUT), tmp_path / "cut")
    plain, plain_opt = _fit(None, tmp_path / "plain")
    assert [s.reason for s in opt.stats] == [s.reason for s in plain_opt.stats]
    assert opt.rewinds == plain_opt.rewinds == 1 and opt.stats[REWIND_WINDOW - 1].reason == "rewind"
    assert cut.sched_lrs == plain.sched_lrs
    assert set(cut.step_lrs) == set(plain.step_lrs)
    for window, lr in plain.step_lrs.items():
        assert cut.step_lrs[window] == (lr * FACTOR if window in CUT_WINDOWS else lr), window


class _Rows(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """The rows of ``_batches()`` in order (an iterable dataset: the Trainer does not shuffle it)."""

    def __iter__(self) -> Any:
        for x, y in _batches():
            for i in range(x.shape[0]):
                yield {"x": x[i], "labels": y[i]}


class _HFRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = model_for()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": ((self.net(x) - labels) ** 2).mean()}


def _hf_fit(
    lr_cut: tuple[float, int] | None, out: Path
) -> tuple[dict[int, float], list[float], ClippedOptimizer]:
    """A Hugging Face Trainer run over ``_batches()`` (8 rows per step, in order), OneCycleLR stepped by
    the Trainer after every optimizer step; the lr each inner step saw (by window) and the scheduler's."""
    import transformers

    model = _HFRegressor()
    inner = optim.SGD(model.parameters(), lr=0.1)
    guard = SpikeGuard(z_thresh=50.0, window=8, warmup=4, signals=("grad_norm",))  # the Trainer gives no loss
    opt = ClippedOptimizer(inner, max_norm=None, spike_guard=guard, rewind=_rewind(lr_cut=lr_cut))
    step_lrs: dict[int, float] = {}
    inner.register_step_pre_hook(
        lambda o, a, k: step_lrs.__setitem__(opt.num_windows, o.param_groups[0]["lr"])
    )
    sched = lrs.OneCycleLR(opt, max_lr=0.5, total_steps=40)
    sched_lrs: list[float] = []

    class Record(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            sched_lrs.append(opt.param_groups[0]["lr"])

    args = transformers.TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=8,
        max_steps=26,
        max_grad_norm=0.0,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=_Rows(), optimizers=(opt, sched), callbacks=[Record()]
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(torch.utils._pytree|LeafSpec).*")
        trainer.train()
    return step_lrs, sched_lrs, opt


@pytest.mark.usefixtures("fresh_accelerate_state")  # the Trainer's Accelerator state, reset around the test
def test_lr_cut_under_the_hf_trainer_keeps_the_schedulers_values(tmp_path: Path) -> None:
    """A real Hugging Face Trainer stepping OneCycleLR after every optimizer step: with lr_cut the
    scheduler's values are those without it, and the inner step sees them times the factor on
    exactly the cut windows."""
    cut_steps, cut_sched, opt = _hf_fit((FACTOR, CUT), tmp_path / "cut")
    plain_steps, plain_sched, plain_opt = _hf_fit(None, tmp_path / "plain")
    assert [s.reason for s in opt.stats] == [s.reason for s in plain_opt.stats]
    assert opt.rewinds == 1 and opt.stats[REWIND_WINDOW - 1].reason == "rewind"
    assert cut_sched == plain_sched and set(cut_steps) == set(plain_steps)
    for window, lr in plain_steps.items():
        assert cut_steps[window] == (lr * FACTOR if window in CUT_WINDOWS else lr), window


def test_a_run_with_a_rewind_appends_to_a_log_without_its_columns(tmp_path: Path) -> None:
    """A resumed run with a Rewind appends to a CSV log whose header lacks the Rewind's columns (as an
    earlier version wrote it; here: a run without a Rewind): its rows go in the file's columns."""
    path = tmp_path / "log.csv"
    model = model_for()
    first = ClippedOptimizer(optim.SGD(model.parameters(), lr=0.1), loggers=[CSVLogger(path)])
    for x, y in _batches()[:5]:
        ((model(x) - y) ** 2).mean().backward()
        first.step()
        first.zero_grad()
    first.close()
    header = path.read_text().splitlines()[0]
    assert "batch_start" not in header
    second, _ = _run(lambda p: optim.SGD(p, lr=0.1), _rewind(), loggers=[CSVLogger(path)])
    second.close()
    assert path.read_text().splitlines()[0] == header and len(list(csv.DictReader(path.open()))) == 5 + 26


def test_escalation_over_several_inner_optimizers() -> None:
    """ClippedOptimizer([Muon, AdamW]): the rewind zeroes both optimizers' moments (AdamW's step kept)
    and the cut multiplies both optimizers' learning rates on the cut windows only."""
    model = model_for()
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    muon, adamw = optim.Muon(matrices, lr=0.02), optim.AdamW(others, lr=0.01)
    seen = [_lr_seen(muon), _lr_seen(adamw)]
    rewind = _rewind(reset_state=True, lr_cut=(FACTOR, CUT))
    opt = ClippedOptimizer([muon, adamw], max_norm=None, spike_guard=_guard(), rewind=rewind)
    windows: list[int] = []  # the window of every inner step (both step in the same windows)
    muon.register_step_pre_hook(lambda o, a, k: windows.append(opt.num_windows))
    for x, y in rewind.batches(_batches()[:REWIND_WINDOW]):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
    assert rewind.log[-1].step == REWIND_WINDOW and rewind.log[-1].state_reset
    for p in matrices:
        assert not opt.state[p]["momentum_buffer"].any()
    for p in others:
        assert not opt.state[p]["exp_avg"].any() and not opt.state[p]["exp_avg_sq"].any()
        assert opt.state[p]["step"] == 11  # the copy's (window 11's) step count
    for x, y in rewind.batches(_batches()[REWIND_WINDOW:]):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
    for lrs_seen, lr in zip(seen, (0.02, 0.01), strict=True):
        by_window = dict(zip(windows, lrs_seen, strict=True))
        assert {w for w, v in by_window.items() if v != [lr]} == CUT_WINDOWS
        assert all(by_window[w] == [lr * FACTOR] for w in CUT_WINDOWS)
