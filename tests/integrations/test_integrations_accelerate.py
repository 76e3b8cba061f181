"""clipopt inside Accelerate (real Accelerator, tiny model): the documented recipe, skips, stacking."""

from __future__ import annotations

import sys
import warnings
from functools import partial
from pathlib import Path

import accelerate
import pytest
import torch
from accelerate.scheduler import AcceleratedScheduler
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import clipopt
from clipopt import ClippedOptimizer
from tests.readme_snippets import run_snippet

from ..helpers import mlp, pairs

LR = 1e-2


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


_model = partial(mlp, (8, 16, 1))  # Linear(8, 16), Tanh, Linear(16, 1), global seed 0


def _batches(n: int, nan_batch: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return pairs(n, (4, 8), (4, 1), seed=1, bad=() if nan_batch is None else {nan_batch})


def _loader(batches) -> DataLoader:
    xs = torch.cat([x for x, _ in batches])
    ys = torch.cat([y for _, y in batches])
    return DataLoader(TensorDataset(xs, ys), batch_size=4)


def _accelerate_run(batches, k: int, accumulation_steps: int = 1):
    model = _model()
    opt = ClippedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR), max_norm=0.5, accumulation_steps=accumulation_steps
    )
    sched = clipopt.per_update(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=k, cpu=True)
    model, popt, psched, loader = accelerator.prepare(model, opt, sched, _loader(batches))
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            popt.step()
            psched.step()
            popt.zero_grad()
    return model, opt, sched, psched


def test_readme_accelerate_recipe_runs_and_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented recipe trains; prepare() wraps per_update in an AcceleratedScheduler that advances once
    per update; StatsReader hands accelerator.log one dict per update, equal to what clipopt recorded."""
    logged: list[tuple[dict[str, float], int]] = []
    monkeypatch.setattr(
        accelerate.Accelerator, "log", lambda self, values, step=None: logged.append((values, step))
    )
    ns = run_snippet("Accelerate", tmp_path)
    opt, sched = ns["opt"], ns["sched"]
    assert isinstance(sched, AcceleratedScheduler) and isinstance(sched.scheduler, clipopt.PerUpdateScheduler)
    inner = opt.optimizer
    assert isinstance(inner, ClippedOptimizer)
    assert (inner.num_updates, sched.scheduler.last_epoch) == (10, 10)  # 40 batches / 4
    assert inner.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5 ** (10 // 4))
    assert [step for _, step in logged] == list(range(1, 11))
    assert [v["clipopt/grad_norm"] for v, _ in logged] == pytest.approx([s.total_norm for s in inner.stats])
    assert [v["clipopt/updates"] for v, _ in logged] == [float(i) for i in range(1, 11)]


def test_framework_accumulation_matches_plain_torch() -> None:
    """Accelerator(gradient_accumulation_steps=4) + the wrapper (accumulation_steps=1) equals plain torch:
    mean of 4 micro-batch gradients, clip_grad_norm_, AdamW.step()."""
    batches = _batches(16)
    model, _, _, _ = _accelerate_run(batches, k=4)
    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    for i in range(0, 16, 4):
        for x, y in batches[i : i + 4]:
            (nn.functional.mse_loss(ref(x), y) / 4).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_sched.step()
        ref_opt.zero_grad()
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)


def test_nan_batch_does_not_advance_the_schedule() -> None:
    """A NaN micro-batch skips its update; Accelerate's own skip check (GradScaler only) sees nothing and
    per_update keeps the schedule where it was: 3 halvings for 3 applied updates of 4."""
    _, opt, sched, psched = _accelerate_run(_batches(16, nan_batch=6), k=4)
    assert (opt.num_windows, opt.num_skipped, opt.num_updates) == (4, 1, 3)
    assert [s.skipped for s in opt.stats] == [False, True, False, False]
    assert psched.scheduler is sched and sched.last_epoch == 3
    assert opt.param_groups[0]["lr"] == pytest.approx(LR * 0.5**3)


def test_stacked_accumulation_raises() -> None:
    """Accelerate accumulating 2 on top of the wrapper's 2: the second wrapper step() raises."""
    with pytest.raises(RuntimeError, match=r"2 backward passes ran since the previous step\(\)") as info:
        _accelerate_run(_batches(8), k=2, accumulation_steps=2)
    assert "backward_passes_per_step=2" in str(info.value)


def test_warning_through_accelerated_optimizer_names_the_users_line() -> None:
    """A warning raised in a step the user calls through Accelerate's ``AcceleratedOptimizer.step()``
    (the SpikeGuard's: Accelerate passes no ``loss=``) names the user's ``opt.step()`` line, not
    accelerate/optimizer.py (before: the walk stopped at Accelerate's wrapper)."""
    model = _model()
    guard = clipopt.SpikeGuard(signals=("loss",))
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), max_norm=1.0, spike_guard=guard)
    model, opt = accelerate.Accelerator(cpu=True).prepare(model, opt)
    x, y = _batches(1)[0]
    nn.functional.mse_loss(model(x), y).backward()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        opt.step()
    where = [(w.filename, w.lineno) for w in record if "SpikeGuard watches the loss" in str(w.message)]
    assert where == [(__file__, line)]
