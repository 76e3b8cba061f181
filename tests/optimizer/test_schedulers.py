"""LR schedulers on a ClippedOptimizer, and clipopt.per_update."""

from __future__ import annotations

import copy
import io
import pickle
import re
import warnings
from functools import partial

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as lrs
from torch.optim.swa_utils import SWALR

import clipopt
from clipopt import ClippedOptimizer

from ..helpers import TwoHeads
from ..hostreads import count_host_reads
from ..optim_db import get


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(3, 2)


def backward(model: nn.Module, seed: int, nonfinite: bool = False) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 3, generator=gen)
    loss = model(x).pow(2).mean()
    if nonfinite:
        loss = loss * float("nan")
    loss.backward()


sgd = partial(get("SGD-momentum-forloop").make, lr=0.1)  # SGD, lr 0.1, momentum 0.9
adam = partial(get("Adam-forloop").make, lr=0.1, betas=(0.9, 0.99))


# Each factory builds the scheduler on the optimizer it is given; the reference uses
# the same factory on a plain optimizer.
SCHEDULERS = {
    "StepLR": (sgd, lambda o: lrs.StepLR(o, step_size=2, gamma=0.5)),
    "OneCycleLR-sgd": (sgd, lambda o: lrs.OneCycleLR(o, max_lr=1.0, total_steps=8)),
    "OneCycleLR-adam": (adam, lambda o: lrs.OneCycleLR(o, max_lr=1.0, total_steps=8)),
    "CosineAnnealingLR": (sgd, lambda o: lrs.CosineAnnealingLR(o, T_max=5)),
    "LambdaLR": (sgd, lambda o: lrs.LambdaLR(o, lambda e: 1.0 / (1 + e))),
    "SWALR": (sgd, lambda o: SWALR(o, swa_lr=0.01, anneal_epochs=3)),
    "SequentialLR": (
        sgd,
        lambda o: lrs.SequentialLR(
            o,
            schedulers=[lrs.ConstantLR(o, factor=0.5, total_iters=2), lrs.ExponentialLR(o, gamma=0.8)],
            milestones=[3],
        ),
    ),
    "ChainedScheduler": (
        sgd,
        lambda o: lrs.ChainedScheduler(
            [lrs.StepLR(o, step_size=2, gamma=0.5), lrs.ExponentialLR(o, gamma=0.9)]
        ),
    ),
}


def _run(optimizer, scheduler, model, steps, metric=None):
    lrs_seen, moms = [], []
    for i in range(steps):
        backward(model, i)
        optimizer.step()
        optimizer.zero_grad()
        if metric is None:
            scheduler.step()
        else:
            scheduler.step(metric)
        group = optimizer.param_groups[0]
        lrs_seen.append(group["lr"])
        moms.append(group.get("momentum", group.get("betas")))
    return lrs_seen, moms


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_scheduler_accepts_wrapper_without_warnings(name):
    """Each torch scheduler takes the wrapper silently and sets the lr/momentum a plain optimizer gets."""
    make_opt, make_sched = SCHEDULERS[name]
    model = make_model()
    ref_model = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = ClippedOptimizer(make_opt(model.parameters()), max_norm=1.0)
        sched = make_sched(opt)
        got_lr, got_mom = _run(opt, sched, model, 7)
    assert [str(w.message) for w in caught] == []
    ref_opt = make_opt(ref_model.parameters())
    ref_sched = make_sched(ref_opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_lr, ref_mom = [], []
        for i in range(7):
            backward(ref_model, i)
            torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
            ref_sched.step()
            ref_lr.append(ref_opt.param_groups[0]["lr"])
            g = ref_opt.param_groups[0]
            ref_mom.append(g.get("momentum", g.get("betas")))
    assert got_lr == pytest.approx(ref_lr, rel=1e-12)
    assert len(set(got_lr)) > 1, "the scheduler did not change the lr"
    assert got_mom == ref_mom
    # the lr lives in the inner optimizer's own groups
    assert opt.optimizer.param_groups[0]["lr"] == got_lr[-1]
    assert sched.get_last_lr() == pytest.approx(ref_sched.get_last_lr(), rel=1e-12)
    for p, r in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, r)


def test_reduce_lr_on_plateau_accepts_wrapper_without_warnings():
    """ReduceLROnPlateau on the wrapper reduces the inner optimizer's lr, silently."""
    model = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = ClippedOptimizer(sgd(model.parameters()), max_norm=1.0)
        sched = lrs.ReduceLROnPlateau(opt, factor=0.5, patience=0)
        got, _ = _run(opt, sched, model, 4, metric=1.0)
    assert [str(w.message) for w in caught] == []
    assert got == pytest.approx([0.1, 0.05, 0.025, 0.0125])
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.0125)


# ---------------------------------------------------------------- per_update


def _accumulating(k=4, **kw):
    model = make_model(1)
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), accumulation_steps=k, **kw)
    return model, opt


def test_per_update_advances_once_per_applied_update():
    """accumulation_steps=4, sched.step() on every micro-batch: the scheduler advances once per update."""
    model, opt = _accumulating(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched = clipopt.per_update(lrs.StepLR(opt, step_size=1, gamma=0.5))
        advanced = []
        for i in range(12):
            backward(model, i)
            opt.step()
            advanced.append(sched.step())
            opt.zero_grad()
    assert [str(w.message) for w in caught] == []
    assert advanced == [False, False, False, True] * 3
    assert sched.last_epoch == 3
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.125)
    assert sched.get_last_lr() == pytest.approx([0.125])


def test_per_update_does_not_advance_on_skipped_window():
    """A window skipped for a NaN gradient does not advance the scheduler."""
    model, opt = _accumulating(4)
    sched = clipopt.per_update(lrs.StepLR(opt, step_size=1, gamma=0.5))
    for i in range(12):
        backward(model, i, nonfinite=(i == 5))  # poisons the second window
        opt.step()
        sched.step()
        opt.zero_grad()
    assert opt.num_skipped == 1
    assert opt.num_updates == 2
    assert sched.last_epoch == 2
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.25)
    assert [s.skipped for s in opt.stats] == [False, True, False]


def test_per_update_passes_metric_to_reduce_lr_on_plateau():
    """per_update(ReduceLROnPlateau).step(metric) passes the metric through, once per update."""
    model, opt = _accumulating(2)
    sched = clipopt.per_update(lrs.ReduceLROnPlateau(opt, factor=0.5, patience=0))
    for i in range(6):  # 3 updates, metric never improves: reduce at updates 2 and 3
        backward(model, i)
        opt.step()
        sched.step(1.0)
        opt.zero_grad()
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.25)

    model, opt = _accumulating(2)
    sched = clipopt.per_update(lrs.ReduceLROnPlateau(opt, factor=0.5, patience=0))
    for i in range(6):  # metric improves at every update: never reduces
        backward(model, i)
        opt.step()
        sched.step(10.0 - i)
        opt.zero_grad()
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(1.0)


def test_per_update_state_dict_round_trip():
    """per_update's state_dict reloads into a fresh proxy that continues identically."""
    model, opt = _accumulating(3)
    sched = clipopt.per_update(lrs.StepLR(opt, step_size=1, gamma=0.5))
    for i in range(7):  # 2 updates + 1 pending micro-batch
        backward(model, i)
        opt.step()
        sched.step()
        opt.zero_grad()
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)

    model2 = copy.deepcopy(model)
    opt2 = ClippedOptimizer(torch.optim.SGD(model2.parameters(), lr=1.0), accumulation_steps=3)
    sched2 = clipopt.per_update(lrs.StepLR(opt2, step_size=1, gamma=0.5))
    opt2.load_state_dict(ckpt["opt"])
    sched2.load_state_dict(ckpt["sched"])
    assert sched2.last_epoch == sched.last_epoch == 2
    assert sched2.get_last_lr() == sched.get_last_lr()
    for o, s, m in ((opt, sched, model), (opt2, sched2, model2)):
        res = []
        for i in range(7, 13):
            backward(m, i)
            o.step()
            res.append(s.step())
            o.zero_grad()
        assert res == [False, True, False, False, True, False]
    assert sched2.last_epoch == sched.last_epoch == 4
    assert (
        opt2.optimizer.param_groups[0]["lr"] == opt.optimizer.param_groups[0]["lr"] == pytest.approx(1 / 16)
    )


def test_per_update_rejects_scheduler_on_plain_optimizer():
    """per_update on a scheduler built on a plain optimizer raises TypeError naming the fix."""
    model = make_model()
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="ClippedOptimizer") as info:
        clipopt.per_update(lrs.StepLR(plain, step_size=1))
    assert "per_update(StepLR(clipped_opt" in str(info.value)


# ----------------------------------------------------------------------- per_update: host reads


def test_per_update_reads_nothing_inside_a_window() -> None:
    """per_update.step() on micro-batch calls reads nothing, also once fused skips made counters tensors."""
    model = TwoHeads()
    opt = ClippedOptimizer(torch.optim.AdamW(model.parameters(), fused=True), accumulation_steps=3)
    sched = clipopt.per_update(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    reads = []
    for i in range(9):
        x = torch.ones(2, 3)
        if i == 4:
            x[0, 0] = float("nan")
        model.loss("a", x).backward()
        opt.step()
        with count_host_reads() as r:
            sched.step()
        reads.append(len(r))
        opt.zero_grad()
    assert [reads[i] for i in (0, 1, 3, 4, 6, 7)] == [0] * 6
    assert sched.last_epoch == 2  # windows 1 and 3 applied, window 2 skipped


# ----------------------------------------------------------------------- copies of a wrapper with a scheduler


def _pickled(opt: ClippedOptimizer) -> ClippedOptimizer:
    copied: ClippedOptimizer = pickle.loads(pickle.dumps(opt))
    return copied


# The schedulers a copy is taken under: torch's (SCHEDULERS) and per_update.
COPIED = {
    **{name: SCHEDULERS[name] for name in ("StepLR", "OneCycleLR-sgd", "LambdaLR", "SequentialLR")},
    "per_update": (sgd, lambda o: clipopt.per_update(lrs.StepLR(o, step_size=2, gamma=0.5))),
}


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("name", list(COPIED))
def test_a_copy_of_a_wrapper_with_a_scheduler_steps_only_itself(name: str, how: str) -> None:
    """copy.deepcopy, or pickle.dumps/loads, of a wrapper a scheduler is attached to: the copy's step()
    closes a window on the copy only (the original's parameters and counters unchanged; before, the
    copy carried the scheduler's step wrapper, which steps the original, and pickling failed); the
    original then trains on with its scheduler, without a warning, exactly as a twin never copied."""
    make_opt, make_sched = COPIED[name]
    runs = []
    for copied in (False, True):
        model = make_model()
        opt = ClippedOptimizer(make_opt(model.parameters()), max_norm=1.0, accumulation_steps=2)
        sched = make_sched(opt)
        _run(opt, sched, model, 4)  # two windows
        if copied:
            before = [p.detach().clone() for p in model.parameters()]
            counters = (opt.num_windows, opt.num_updates, opt.micro_batches)
            dup = copy.deepcopy(opt) if how == "deepcopy" else _pickled(opt)
            assert dup.step.__func__ is type(dup).step  # its own plain method
            for p in dup.param_groups[0]["params"]:
                p.grad = torch.ones_like(p)
            dup.step()
            dup.step()  # closes the copy's window
            assert (dup.num_windows, dup.num_updates) == (counters[0] + 1, counters[1] + 1)
            moved = dup.param_groups[0]["params"]
            assert all(not torch.equal(p, q) for p, q in zip(moved, before, strict=True))
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
            assert (opt.num_windows, opt.num_updates, opt.micro_batches) == counters
        with warnings.catch_warnings():
            # e.g. torch's "Detected call of `lr_scheduler.step()` before `optimizer.step()`"
            warnings.simplefilter("error")
            lrs_seen, _ = _run(opt, sched, model, 4)
        runs.append((lrs_seen, opt.num_windows, [p.detach().clone() for p in model.parameters()]))
    (lr_a, windows_a, params_a), (lr_b, windows_b, params_b) = runs
    assert lr_a == lr_b and windows_a == windows_b == 4
    assert all(torch.equal(p, q) for p, q in zip(params_a, params_b, strict=True))


def test_pickling_a_lambda_scheduler_names_the_lambda_but_the_wrapper_pickles() -> None:
    """With a LambdaLR on a lambda attached, pickle.dumps(opt) works (the lambda is the scheduler's, not the
    optimizer's); pickling the per_update scheduler itself fails on the user's lambda, and the error names
    it (not the wrapper's step)."""
    model = make_model()
    opt = ClippedOptimizer(sgd(model.parameters()), max_norm=1.0)
    sched = clipopt.per_update(lrs.LambdaLR(opt, lambda e: 1.0 / (1 + e)))
    copied = _pickled(opt)
    assert copied.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    # pickle's own message: a local lambda is an AttributeError, a module-level one a PicklingError
    with pytest.raises((AttributeError, pickle.PicklingError), match=re.escape("<lambda>")):
        pickle.dumps(sched)
