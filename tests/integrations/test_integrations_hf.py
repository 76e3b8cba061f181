"""clipopt inside the Hugging Face Trainer (real Trainer, tiny model): schedulers, skips, clearing, logs."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

import clipopt
from clipopt import ClippedOptimizer
from clipopt.integrations import ClipoptTrainerCallback, StackedClipWarning
from tests.helpers import mlp
from tests.readme_snippets import run_snippet

LR = 1e-2


#: The Trainer builds an Accelerator: its process-wide state is reset around each test.
pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.filterwarnings("ignore", message=".*(torch.utils._pytree|LeafSpec).*")


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = mlp((8, 16, 1))  # Linear(8, 16), Tanh, Linear(16, 1), global seed 0

    def forward(self, x, labels):
        out = self.net(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


def _data(n: int, nan_rows: tuple[int, ...] = ()) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(n, 8, generator=gen), torch.randn(n, 1, generator=gen)
    for i in nan_rows:
        xs[i, 0] = float("nan")
    return [{"x": x, "labels": y} for x, y in zip(xs, ys, strict=True)]


def _args(output_dir: Path, trainer_accumulation: int, **kw) -> transformers.TrainingArguments:
    options = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=trainer_accumulation,
        max_grad_norm=0.0,
        num_train_epochs=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    options.update(kw)
    return transformers.TrainingArguments(**options)


def _build(accumulation_steps: int = 1):
    model = Regressor()
    opt = ClippedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR), max_norm=0.5, accumulation_steps=accumulation_steps
    )
    sched = clipopt.per_update(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    return model, opt, sched


def _train(tmp_path: Path, data, trainer_accumulation: int, accumulation_steps: int = 1, **kw):
    model, opt, sched = _build(accumulation_steps)
    trainer = transformers.Trainer(
        model=model,
        args=_args(tmp_path / "out", trainer_accumulation, **kw),
        train_dataset=data,
        optimizers=(opt, sched),
        callbacks=[ClipoptTrainerCallback()],
    )
    trainer.train()
    return trainer, model, opt, sched


def test_readme_trainer_snippet_runs_and_logs(tmp_path: Path) -> None:
    """The documented snippet trains; per_update advances once per update; the callback's values land in
    log_history, and clipopt's pre-clip norm equals the norm the Trainer measures itself."""
    ns = run_snippet("Hugging Face Trainer", tmp_path)
    trainer, opt, sched = ns["trainer"], ns["opt"], ns["sched"]
    assert (opt.num_updates, sched.last_epoch, trainer.state.global_step) == (10, 10, 10)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.9**10)
    logs = [e for e in trainer.state.log_history if "clipopt/grad_norm" in e]
    assert [e["clipopt/updates"] for e in logs] == [float(i) for i in range(1, 11)]
    assert [e["step"] for e in logs] == list(range(1, 11))
    for e in logs:  # the Trainer's own grad_norm (clip_grad_norm_ with max_norm=inf) of the same gradient
        assert e["clipopt/grad_norm"] == pytest.approx(e["grad_norm"], rel=1e-5)
        assert e["clipopt/clip_coef"] == pytest.approx(min(1.0, 1.0 / (e["grad_norm"] + 1e-6)), rel=1e-5)


def test_nan_batch_does_not_advance_the_schedule(tmp_path: Path) -> None:
    """gradient_accumulation_steps=4: a NaN sample skips its update; the Trainer's own skip check sees
    nothing, per_update keeps the StepLR from halving (9 halvings for 9 applied updates)."""
    trainer, model, opt, sched = _train(tmp_path, _data(160, nan_rows=(21,)), trainer_accumulation=4)
    assert (opt.num_windows, opt.num_skipped, opt.num_updates) == (10, 1, 9)
    skipped = [s.skipped for s in opt.stats]  # the Trainer shuffles: find the poisoned window
    assert skipped.count(True) == 1
    bad_step = skipped.index(True) + 1
    assert sched.last_epoch == 9
    assert opt.param_groups[0]["lr"] == pytest.approx(LR * 0.5**9)
    assert trainer.state.global_step == 10  # the Trainer counts its optimizer steps, the skipped one too
    assert all(torch.isfinite(p).all() for p in model.parameters())
    bad = next(e for e in trainer.state.log_history if e.get("step") == bad_step)
    assert bad["clipopt/skipped"] == 1.0 and bad["clipopt/skipped_nonfinite"] == 1.0
    assert [e["learning_rate"] for e in trainer.state.log_history[bad_step - 1 : bad_step + 1]] == [
        pytest.approx(LR * 0.5 ** (bad_step - 1))
    ] * 2  # the lr the skipped update saw is still the lr of the next one
    assert trainer.state.log_history[-2]["clipopt/skipped_total"] == 1.0


def test_wrapper_accumulation_under_trainer_raises(tmp_path: Path) -> None:
    """The Trainer clears with model.zero_grad() after every step: the wrapper's accumulation_steps=4
    would silently keep only the last micro-batch, so the next step() raises, naming cause and fix."""
    with pytest.raises(RuntimeError, match=r"cleared or replaced from outside the wrapper") as info:
        _train(tmp_path, _data(32), trainer_accumulation=1, accumulation_steps=4)
    msg = str(info.value)
    assert "(1 of 4 micro-batches accumulated)" in msg
    assert "Trainer(gradient_accumulation_steps=k)" in msg and "accumulation_steps=1" in msg


def test_stacked_accumulation_under_trainer_raises(tmp_path: Path) -> None:
    """Trainer accumulation 2 on top of the wrapper's 2: reported as stacked accumulation."""
    with pytest.raises(RuntimeError, match=r"2 backward passes ran since the previous step\(\)"):
        _train(tmp_path, _data(32), trainer_accumulation=2, accumulation_steps=2)


def test_resume_from_checkpoint_is_bit_identical(tmp_path: Path) -> None:
    """Checkpoint after 3 of 6 updates (a skipped one before it), resume_from_checkpoint: parameters,
    the wrapper's counters and the schedule equal the uninterrupted run bit for bit."""
    data = _data(96, nan_rows=(5,))  # 6 updates of 4 micro-batches of 4 samples
    _, straight, opt_a, sched_a = _train(tmp_path / "a", data, trainer_accumulation=4)
    _train(tmp_path / "b", data, trainer_accumulation=4, max_steps=3, save_strategy="steps", save_steps=3)
    ckpt = tmp_path / "b" / "out" / "checkpoint-3"
    assert ckpt.is_dir()
    model, opt, sched = _build()
    args = _args(tmp_path / "b" / "out", 4)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, sched))
    trainer.train(resume_from_checkpoint=str(ckpt))
    for p, q in zip(straight.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert (opt.num_windows, opt.num_skipped) == (opt_a.num_windows, opt_a.num_skipped) == (6, 1)
    assert sched.last_epoch == sched_a.last_epoch == 5
    assert opt.param_groups[0]["lr"] == opt_a.param_groups[0]["lr"]


def test_muon_and_adamw_under_one_wrapper_in_the_trainer(tmp_path: Path) -> None:
    """Trainer(optimizers=(ClippedOptimizer([Muon, AdamW]), per_update(StepLR))) through Accelerate's
    AcceleratedOptimizer: a NaN sample skips the update of both inner optimizers (every parameter
    finite), and both learning rates halve once per applied update only (9 for 9)."""
    model = Regressor()
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    opt = ClippedOptimizer(
        [torch.optim.Muon(matrices, lr=LR), torch.optim.AdamW(others, lr=LR)], max_norm=0.5
    )
    sched = clipopt.per_update(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    trainer = transformers.Trainer(
        model=model,
        args=_args(tmp_path / "out", 4),
        train_dataset=_data(160, nan_rows=(21,)),
        optimizers=(opt, sched),
        callbacks=[ClipoptTrainerCallback()],
    )
    trainer.train()
    assert (opt.num_windows, opt.num_skipped, opt.num_updates) == (10, 1, 9)
    assert [o.param_groups[0]["lr"] for o in opt.optimizers] == [pytest.approx(LR * 0.5**9)] * 2
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(len(o.state) == len(o.param_groups[0]["params"]) for o in opt.optimizers)


def _stacked(record: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in record if issubclass(w.category, StackedClipWarning)]


def test_the_trainers_own_clip_left_on_is_warned_once(tmp_path: Path) -> None:
    """TrainingArguments' default max_grad_norm=1.0 clips before clipopt: every norm clipopt records is
    at most 1 and its max_norm never acts. The callback warns once, at the user's trainer.train() line,
    naming the setting and the fix (before: nothing was said)."""
    model, opt, sched = _build()
    opt.max_norm = 5.0
    args = _args(tmp_path / "out", 1)
    args.max_grad_norm = 1.0  # what TrainingArguments() and TRL's SFTConfig() leave on
    data = [{"x": 40 * d["x"], "labels": d["labels"]} for d in _data(32)]  # norms far above 1
    callback = ClipoptTrainerCallback()
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=data, optimizers=(opt, sched), callbacks=[callback]
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        trainer.train()
        trainer.train()  # the same callback: said once
    assert max(s.total_norm for s in opt.stats) <= 1.0 + 1e-5  # what the warning is about
    assert max(e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e) > 5.0
    stacked = _stacked(record)
    assert len(stacked) == 1
    message = str(stacked[0].message)
    assert "TrainingArguments.max_grad_norm=1.0 clips the gradients before clipopt" in message
    assert "TrainingArguments(max_grad_norm=0.0)" in message
    assert (stacked[0].filename, stacked[0].lineno) == (__file__, line)


def test_the_trainers_clip_turned_off_is_not_warned(tmp_path: Path) -> None:
    """max_grad_norm=0.0, as the docs' snippet passes: no warning, and clipopt sees the raw norms."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _, _, opt, _ = _train(tmp_path, _data(32), trainer_accumulation=1)
    assert _stacked(record) == []
    assert opt.num_updates == 8
