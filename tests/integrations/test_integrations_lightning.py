"""clipopt inside PyTorch Lightning (real Trainer, tiny models): schedulers, skips, accumulation, logs."""

from __future__ import annotations

import copy
import csv
import math
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import clipopt
from clipopt import ClippedOptimizer
from clipopt.integrations import ClipoptLightningCallback, StackedClipWarning
from tests.helpers import mlp
from tests.readme_snippets import run_snippet

LR = 1e-2


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.filterwarnings("ignore", message=".*(does not have many workers|LeafSpec|litlogger).*")


def _data(n: int = 64, seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 8, generator=gen), torch.randn(n, 1, generator=gen))


class Regressor(L.LightningModule):
    """A tiny MLP; ``nan_batches`` poison the loss of those batch indices (of every epoch)."""

    def __init__(self, nan_batches: tuple[int, ...] = (), accumulation_steps: int = 1, sched: str = "step"):
        super().__init__()
        self.net = mlp((8, 16, 1))  # Linear(8, 16), Tanh, Linear(16, 1), global seed 0
        self.nan_batches = nan_batches
        self.accumulation_steps = accumulation_steps
        self.sched = sched

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if batch_idx in self.nan_batches:
            loss = loss * float("nan")
        self.log("const", 1.0, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        opt = ClippedOptimizer(
            torch.optim.AdamW(self.parameters(), lr=LR),
            max_norm=0.5,
            accumulation_steps=self.accumulation_steps,
        )
        if self.sched == "plateau":
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
            return {
                "optimizer": opt,
                "lr_scheduler": {
                    "scheduler": clipopt.per_update(plateau),
                    "interval": "step",
                    "monitor": "const",
                },
            }
        sched = clipopt.per_update(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _trainer(tmp_path: Path, **kw) -> L.Trainer:
    defaults = dict(
        max_epochs=1,
        accumulate_grad_batches=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    defaults.update(kw)
    return L.Trainer(**defaults)


def test_readme_lightning_snippet_runs_and_logs(tmp_path: Path) -> None:
    """The documented snippet trains; per_update is accepted and advanced once per update; the callback's
    values reach Lightning's metrics.csv, one row per update, equal to what clipopt recorded."""
    ns = run_snippet("Lightning", tmp_path)
    trainer = ns["trainer"]
    opt = trainer.optimizers[0]
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert isinstance(opt, ClippedOptimizer) and isinstance(sched, clipopt.PerUpdateScheduler)
    assert (opt.num_updates, opt.num_windows, trainer.global_step) == (10, 10, 10)  # 40 batches / 4
    assert sched.last_epoch == 10
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5 ** (10 // 4))
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()))
    rows = [r for r in rows if r.get("clipopt/grad_norm")]
    assert [float(r["clipopt/updates"]) for r in rows] == [float(i) for i in range(1, 11)]
    recorded = [s.total_norm for s in opt.stats]
    assert [float(r["clipopt/grad_norm"]) for r in rows] == pytest.approx(recorded, rel=1e-6)
    assert [float(r["clipopt/clip_coef"]) for r in rows] == pytest.approx(
        [min(1.0, 1.0 / (n + 1e-6)) for n in recorded], rel=1e-6
    )
    assert all(float(r["clipopt/skipped"]) == 0.0 for r in rows)


def test_nan_batch_does_not_advance_the_schedule_automatic(tmp_path: Path) -> None:
    """Automatic optimization, accumulate_grad_batches=4: a NaN batch skips its update and the
    StepLR under per_update does not move (9 halvings for 9 applied updates, not 10)."""
    model = Regressor(nan_batches=(5,))
    logger = L.pytorch.loggers.CSVLogger(str(tmp_path))
    trainer = _trainer(tmp_path, callbacks=[ClipoptLightningCallback()], log_every_n_steps=1, logger=logger)
    trainer.fit(model, DataLoader(_data(160), batch_size=4))
    opt = trainer.optimizers[0]
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert (opt.num_windows, opt.num_skipped, opt.num_updates) == (10, 1, 9)
    assert [s.skipped for s in opt.stats] == [False, True] + [False] * 8
    assert sched.last_epoch == 9
    assert opt.param_groups[0]["lr"] == pytest.approx(LR * 0.5**9)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    logged = trainer.logged_metrics
    assert float(logged["clipopt/skipped_total"]) == 1.0 and float(logged["clipopt/updates"]) == 9.0


def test_per_update_plateau_with_monitor(tmp_path: Path) -> None:
    """per_update(ReduceLROnPlateau) is a plateau scheduler to Lightning (monitor required and passed):
    a constant metric halves the lr at each applied update after the first, never on the skipped one."""
    model = Regressor(nan_batches=(5,), sched="plateau")
    trainer = _trainer(tmp_path)
    trainer.fit(model, DataLoader(_data(96), batch_size=4))  # 24 batches: 6 windows, 5 applied
    config = trainer.lr_scheduler_configs[0]
    assert config.reduce_on_plateau and config.monitor == "const"
    assert isinstance(config.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    opt = trainer.optimizers[0]
    assert opt.num_updates == 5
    assert opt.param_groups[0]["lr"] == pytest.approx(LR * 0.5**4)


class ManualRegressor(Regressor):
    """Manual optimization with the wrapper accumulating 2 micro-batches (Lightning does not clear)."""

    def __init__(self, nan_batches: tuple[int, ...] = ()):
        super().__init__(nan_batches, accumulation_steps=2)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        sched = self.lr_schedulers()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        return loss


def test_manual_optimization_schedule_counts_applied_updates(tmp_path: Path) -> None:
    """Manual optimization: sched.step() on every batch advances only after applied updates."""
    model = ManualRegressor(nan_batches=(3,))
    trainer = _trainer(tmp_path, accumulate_grad_batches=1)
    trainer.fit(model, DataLoader(_data(48), batch_size=4))  # 12 batches: 6 windows, the 2nd skipped
    opt = trainer.optimizers[0]
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert (opt.num_windows, opt.num_updates) == (6, 5)
    assert sched.last_epoch == 5
    assert opt.param_groups[0]["lr"] == pytest.approx(LR * 0.5**5)


class _SpikeGuardedManual(L.LightningModule):
    """Manual optimization with a SpikeGuard that watches the loss, and ``opt.step()`` given none:
    the guard warns; :attr:`step_line` is the line of the user's ``opt.step()`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp((8, 16, 1))
        self.automatic_optimization = False
        self.step_line = 0

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        self.manual_backward(nn.functional.mse_loss(self.net(batch[0]), batch[1]))
        self.step_line = sys._getframe().f_lineno + 1
        opt.step()
        opt.zero_grad()

    def configure_optimizers(self):
        guard = clipopt.SpikeGuard(signals=("loss",))
        return ClippedOptimizer(torch.optim.SGD(self.parameters(), lr=LR), spike_guard=guard)


def test_warning_under_manual_optimization_names_the_users_line(tmp_path: Path) -> None:
    """Manual optimization: a warning raised in the step the user calls through LightningOptimizer
    (the SpikeGuard's: no ``loss=``) names the user's ``opt.step()`` line in training_step, not
    lightning/pytorch/plugins/precision/precision.py (before: the walk out of clipopt stopped at
    the precision plugin that LightningOptimizer.step() goes through)."""
    model = _SpikeGuardedManual()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _trainer(tmp_path, accumulate_grad_batches=1).fit(model, DataLoader(_data(8), batch_size=4))
    where = [(w.filename, w.lineno) for w in record if "SpikeGuard watches the loss" in str(w.message)]
    assert where == [(__file__, model.step_line)]


def test_stacked_accumulation_raises(tmp_path: Path) -> None:
    """accumulate_grad_batches=2 with the wrapper accumulating 2 as well: the second step() raises."""
    model = Regressor(accumulation_steps=2)
    trainer = _trainer(tmp_path, accumulate_grad_batches=2)
    with pytest.raises(RuntimeError, match=r"2 backward passes ran since the previous step\(\)") as info:
        trainer.fit(model, DataLoader(_data(32), batch_size=4))
    assert "accumulate_grad_batches" in str(info.value)
    assert "accumulation_steps=1" in str(info.value)


def test_checkpoint_resume_is_bit_identical(tmp_path: Path) -> None:
    """Save after epoch 1 (with a skipped update in it), resume for epoch 2: parameters, inner state,
    the wrapper's counters and the schedule equal two uninterrupted epochs bit for bit."""
    loader = DataLoader(_data(64), batch_size=4)  # 16 batches: 4 updates per epoch
    straight = Regressor(nan_batches=(2,))
    _trainer(tmp_path / "a", max_epochs=2).fit(straight, loader)

    first = Regressor(nan_batches=(2,))
    trainer = _trainer(tmp_path / "b", max_epochs=1)
    trainer.fit(first, loader)
    ckpt = tmp_path / "epoch1.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed = Regressor(nan_batches=(2,))
    resumed_trainer = _trainer(tmp_path / "c", max_epochs=2)
    resumed_trainer.fit(resumed, loader, ckpt_path=str(ckpt))

    for p, q in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)
    opt = resumed_trainer.optimizers[0]
    sched = resumed_trainer.lr_scheduler_configs[0].scheduler
    assert (opt.num_windows, opt.num_skipped, sched.last_epoch) == (8, 2, 6)
    assert opt.param_groups[0]["lr"] == pytest.approx(LR * 0.5**6)
    assert not math.isnan(opt.param_groups[0]["lr"])
    assert copy.deepcopy(sched.state_dict())["seen_updates"] == 6


def test_wrapper_accumulation_under_lightning_counts_micro_batches(tmp_path: Path) -> None:
    """What the docs say for the wrapper's own accumulation under Lightning: Lightning clears
    through the wrapper's zero_grad (no false alarm), per_update advances once per update, and
    global_step counts micro-batches (16), not updates (4)."""
    model = Regressor(accumulation_steps=4)
    trainer = _trainer(tmp_path, accumulate_grad_batches=1)
    trainer.fit(model, DataLoader(_data(64), batch_size=4))
    opt = trainer.optimizers[0]
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert (opt.num_updates, sched.last_epoch, trainer.global_step) == (4, 4, 16)
    assert opt.param_groups[0]["lr"] == pytest.approx(LR * 0.5**4)


class MuonRegressor(Regressor):
    """:class:`Regressor` trained by Muon (its weight matrices) and AdamW (its biases) under one wrapper."""

    def configure_optimizers(self):
        matrices = [p for p in self.parameters() if p.ndim == 2]
        others = [p for p in self.parameters() if p.ndim != 2]
        opt = ClippedOptimizer(
            [torch.optim.Muon(matrices, lr=LR), torch.optim.AdamW(others, lr=LR)], max_norm=0.5
        )
        sched = clipopt.per_update(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_muon_and_adamw_under_one_wrapper_skip_schedule_and_resume(tmp_path: Path) -> None:
    """Automatic optimization with ClippedOptimizer([Muon, AdamW]): a NaN batch skips the update of
    both, per_update halves both learning rates once per applied update, and a checkpoint taken after
    epoch 1 resumes epoch 2 bit for bit (parameters and both inner states)."""
    loader = DataLoader(_data(64), batch_size=4)  # 16 batches: 4 updates per epoch
    straight = MuonRegressor(nan_batches=(2,))
    straight_trainer = _trainer(tmp_path / "a", max_epochs=2)
    straight_trainer.fit(straight, loader)

    first = MuonRegressor(nan_batches=(2,))
    trainer = _trainer(tmp_path / "b", max_epochs=1)
    trainer.fit(first, loader)
    ckpt = tmp_path / "epoch1.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed = MuonRegressor(nan_batches=(2,))
    resumed_trainer = _trainer(tmp_path / "c", max_epochs=2)
    resumed_trainer.fit(resumed, loader, ckpt_path=str(ckpt))

    for p, q in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)
    opt = resumed_trainer.optimizers[0]
    assert (opt.num_windows, opt.num_skipped, opt.num_updates) == (8, 2, 6)
    muon, adamw = opt.optimizers
    assert muon.param_groups[0]["lr"] == pytest.approx(LR * 0.5**6)
    assert adamw.param_groups[0]["lr"] == pytest.approx(LR * 0.5**6)
    for a, b in zip(straight_trainer.optimizers[0].optimizers, opt.optimizers, strict=True):
        for p, q in zip(a.state.values(), b.state.values(), strict=True):
            assert all(torch.equal(p[k], q[k]) for k in p)


class TwoScheduleRegressor(Regressor):
    """Muon + AdamW under one wrapper, each with its own schedule: ``per_update(StepLR(inner), opt)``."""

    def configure_optimizers(self):
        matrices = [p for p in self.parameters() if p.ndim == 2]
        others = [p for p in self.parameters() if p.ndim != 2]
        muon, adamw = torch.optim.Muon(matrices, lr=LR), torch.optim.AdamW(others, lr=LR)
        opt = ClippedOptimizer([muon, adamw], max_norm=0.5)
        lrs = torch.optim.lr_scheduler
        schedules = [
            clipopt.per_update(lrs.StepLR(muon, step_size=1, gamma=0.5), opt),
            clipopt.per_update(lrs.StepLR(adamw, step_size=1, gamma=0.9), opt),
        ]
        return [opt], [{"scheduler": s, "interval": "step"} for s in schedules]


def test_a_schedule_per_inner_optimizer_counts_the_wrappers_applied_updates(tmp_path: Path) -> None:
    """Lightning accepts two per_update schedulers built on the inner optimizers of one wrapper (their
    .optimizer is the wrapper): after 4 windows with a NaN batch, Muon's lr is halved and AdamW's
    multiplied by 0.9 once per applied update (3), not per window."""
    model = TwoScheduleRegressor(nan_batches=(2,))
    trainer = _trainer(tmp_path)
    trainer.fit(model, DataLoader(_data(64), batch_size=4))
    opt = trainer.optimizers[0]
    assert (opt.num_updates, opt.num_skipped) == (3, 1)
    muon, adamw = opt.optimizers
    assert muon.param_groups[0]["lr"] == pytest.approx(LR * 0.5**3)
    assert adamw.param_groups[0]["lr"] == pytest.approx(LR * 0.9**3)


def _stacked(record: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in record if issubclass(w.category, StackedClipWarning)]


def test_lightnings_own_clip_is_warned_once(tmp_path: Path) -> None:
    """Trainer(gradient_clip_val=1.0) clips before clipopt, which then records only norms <= 1: the
    callback warns once (over two fits), at the user's trainer.fit() line, naming the setting and the
    fix (before: nothing was said)."""
    model = Regressor()
    callback = ClipoptLightningCallback()
    data = TensorDataset(40 * _data(64).tensors[0], _data(64).tensors[1])  # norms far above 1
    loader = DataLoader(data, batch_size=4)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        _trainer(tmp_path, gradient_clip_val=1.0, callbacks=[callback]).fit(model, loader)
        _trainer(tmp_path, gradient_clip_val=1.0, callbacks=[callback]).fit(Regressor(), loader)
    opt = model.trainer.optimizers[0]
    assert opt.num_updates == 4 and max(s.total_norm for s in opt.stats) <= 1.0 + 1e-5
    stacked = _stacked(record)
    assert len(stacked) == 1
    message = str(stacked[0].message)
    assert "Trainer.gradient_clip_val=1.0 clips the gradients before clipopt" in message
    assert "Trainer(gradient_clip_val=None)" in message
    assert (stacked[0].filename, stacked[0].lineno) == (__file__, line)


def test_lightnings_clip_left_off_is_not_warned(tmp_path: Path) -> None:
    """gradient_clip_val=None (Lightning's default) or 0: no warning; clipopt sees the raw norms."""
    data = TensorDataset(40 * _data(64).tensors[0], _data(64).tensors[1])
    for value in (None, 0.0):
        model = Regressor()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            trainer = _trainer(tmp_path, gradient_clip_val=value, callbacks=[ClipoptLightningCallback()])
            trainer.fit(model, DataLoader(data, batch_size=4))
        assert _stacked(record) == []
        assert max(s.total_norm for s in trainer.optimizers[0].stats) > 5.0
