"""``clipopt report`` on logs written by the real libraries (docs/cli.md, 'clipopt report'): Trainer,
Lightning, TensorBoard, CSV.

Each test makes the file with the library itself (a tiny run of a few seconds)
and checks the values read against the file's own content, read here with
the json/csv modules or TensorBoard's EventAccumulator.
"""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from clipopt import ClippedOptimizer, CSVLogger, TensorBoardLogger
from clipopt._cli import main
from clipopt._report.report import analyze, read_log

from ..helpers import mlp


def _xy(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return x, x.sum(1, keepdim=True)


#: The log_history keys the report reads (step, norm, loss, lr); the others are listed as ignored.
READ_KEYS = ("step", "grad_norm", "loss", "learning_rate")


def _trainer_state(out: Path, max_steps: int, logging_steps: int) -> Path:
    """The trainer_state.json of a tiny transformers.Trainer run (Linear(8, 1), MSE, max_grad_norm 1.0)."""
    transformers = pytest.importorskip("transformers")
    x, y = _xy()

    class Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return len(x)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"x": x[i], "labels": y[i]}

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 1)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            out = self.lin(x)
            return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=max_steps,
        per_device_train_batch_size=8,
        logging_steps=logging_steps,
        max_grad_norm=1.0,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        learning_rate=0.05,
    )
    trainer = transformers.Trainer(model=Model(), args=args, train_dataset=Data())
    trainer.train()
    trainer.save_state()
    return out / "trainer_state.json"


def test_trainer_state_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tiny transformers.Trainer run: grad_norm, loss and learning_rate of log_history are read per step."""
    path = _trainer_state(tmp_path / "out", max_steps=20, logging_steps=1)
    history = [e for e in json.loads(path.read_text())["log_history"] if "grad_norm" in e]
    log = read_log(path)
    assert list(log.steps) == [e["step"] for e in history]
    assert list(log.total_norm) == pytest.approx([e["grad_norm"] for e in history])
    assert list(log.loss) == pytest.approx([e["loss"] for e in history])
    assert list(log.lr) == pytest.approx([e["learning_rate"] for e in history])
    assert read_log(tmp_path / "out").steps == log.steps  # the folder works too
    capsys.readouterr()  # the Trainer's own printing
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("verdict: healthy") and "Trainer trainer_state.json" in out
    assert f"file: {path} (Trainer trainer_state.json; 20 updates, steps 1-20)" in out.splitlines()


def test_trainer_state_logged_every_few_updates_counts_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Trainer run of 60 updates with logging_steps=10 logs 6 rows: the report says "6 rows logged at
    steps 10-60", not "6 updates" (issue #22: 60 logged rows were called 60 updates)."""
    path = _trainer_state(tmp_path / "out", max_steps=60, logging_steps=10)
    history = json.loads(path.read_text())["log_history"]
    assert [e["step"] for e in history if "grad_norm" in e] == list(range(10, 61, 10))
    others = [k for k in dict.fromkeys(k for e in history for k in e) if k not in READ_KEYS]
    capsys.readouterr()
    assert main(["report", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == f"file: {path} (Trainer trainer_state.json; 6 rows logged at steps 10-60)"
    assert "updates" not in "\n".join(lines[lines.index("Summary:") :])
    assert lines[lines.index("Summary:") + 1].split() == ["logged", "rows", "6"]
    assert "train_runtime" in others and "train_loss" in others  # the Trainer's closing entry
    assert lines[2] == (
        f"log_history keys read: grad_norm as the norm, loss as the loss; ignored: {', '.join(others)}"
    )


def _lightning_fit(logger: Any, nan_at_step: int | None = None, loss_name: str = "train_loss") -> None:
    """A tiny Lightning fit (Linear(8, 1), SGD lr 0.01, 16 steps of 8 rows) that logs ``loss_name`` and
    grad_norm() to ``logger``; at global step ``nan_at_step`` lin.bias's gradient is set to NaN.
    ``loss_name`` "loss" is logged on_step and on_epoch (Lightning writes loss_step and loss_epoch)."""
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.utilities import grad_norm

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 1)

        def training_step(self, batch: list[torch.Tensor], i: int) -> torch.Tensor:
            loss = torch.nn.functional.mse_loss(self.lin(batch[0]), batch[1])
            self.log(loss_name, loss, on_step=True, on_epoch=loss_name == "loss")
            return loss

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            if self.global_step == nan_at_step:
                self.lin.bias.grad.fill_(math.nan)
            self.log_dict(grad_norm(self, norm_type=2))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    x, y = _xy()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    trainer = pl.Trainer(
        max_steps=16,
        logger=logger,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        accelerator="cpu",
    )
    trainer.fit(Module(), loader)


def test_lightning_metrics_csv(tmp_path: Path) -> None:
    """A tiny Lightning run with CSVLogger and grad_norm(): total and per-layer norms, train_loss read."""
    pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import CSVLogger as LightningCSV

    _lightning_fit(LightningCSV(str(tmp_path)))
    path = next(tmp_path.rglob("metrics.csv"))
    with path.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["grad_2.0_norm_total"]]
    log = read_log(path)
    assert list(log.steps) == [int(r["step"]) for r in rows]
    assert list(log.total_norm) == pytest.approx([float(r["grad_2.0_norm_total"]) for r in rows])
    assert list(log.loss) == pytest.approx([float(r["train_loss"]) for r in rows])
    assert set(log.layers) == {"lin.weight", "lin.bias"}
    assert list(log.layers["lin.weight"]["grad_norm"]) == pytest.approx(
        [float(r["grad_2.0_norm/lin.weight"]) for r in rows]
    )
    assert analyze(log)["verdict"] == "healthy"


def test_lightning_loss_step_is_read_as_the_loss(tmp_path: Path) -> None:
    """``self.log("loss", loss, on_step=True, on_epoch=True)`` makes Lightning write ``loss_step`` (per
    update) and ``loss_epoch``: ``loss_step`` is read as the loss, with the values of metrics.csv, and
    ``loss_epoch`` is ignored."""
    pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import CSVLogger as LightningCSV

    _lightning_fit(LightningCSV(str(tmp_path)), loss_name="loss")
    path = next(tmp_path.rglob("metrics.csv"))
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    log = read_log(path)
    assert log.loss_column == "loss_step" and "loss_epoch" in log.ignored
    steps = {int(r["step"]): float(r["loss_step"]) for r in rows if r["loss_step"]}
    assert list(log.loss) == pytest.approx([steps[s] for s in log.steps])


def test_lightning_csv_versions_folder_names_its_logs(tmp_path: Path) -> None:
    """Two fits with Lightning's CSVLogger write lightning_logs/version_0/metrics.csv and version_1/: the
    folder lightning_logs holds no log itself, and the error lists the metrics.csv files below it (the
    way to read each), instead of only "a folder without a training log"."""
    pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import CSVLogger as LightningCSV

    for _ in range(2):
        _lightning_fit(LightningCSV(str(tmp_path)))
    folder = tmp_path / "lightning_logs"
    found = ", ".join(str(folder / f"version_{v}" / "metrics.csv") for v in (0, 1))
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{folder} holds no training log itself; the logs below it: {found}; pass one of them"
        ),
    ):
        read_log(folder)


def test_sparse_csv_rows_of_one_step_are_merged(tmp_path: Path) -> None:
    """Loss and norm of one step in separate rows (either order) make one update."""
    path = tmp_path / "metrics.csv"
    lines = ["step,grad_norm,train_loss"]
    for s in range(1, 31):
        first, second = (f"{s},{1 + s % 3},", f"{s},,{5 - s / 10}")
        lines += [first, second] if s % 2 else [second, first]
    path.write_text("\n".join(lines) + "\n")
    log = read_log(path)
    assert list(log.steps) == list(range(1, 31))
    assert list(log.loss) == pytest.approx([5 - s / 10 for s in range(1, 31)])


def test_plain_csv_without_step_column(tmp_path: Path) -> None:
    """A CSV with only grad_norm and loss: the row number is the step, and a note says so."""
    path = tmp_path / "plain.csv"
    path.write_text("grad_norm,loss\n" + "".join(f"{1 + i % 2},{3 - i / 100}\n" for i in range(40)))
    report = analyze(read_log(path))
    assert report["summary"]["first_step"] == 1 and report["summary"]["last_step"] == 40
    assert any("no step column" in n for n in report["notes"])
    assert report["verdict"] == "healthy"


def _train_with(opt: ClippedOptimizer, model: torch.nn.Module, steps: int, nan_at: int | None = None) -> None:
    x, y = _xy()
    for step in range(1, steps + 1):
        i = (step * 8) % len(x)
        loss = torch.nn.functional.mse_loss(model(x[i : i + 8]), y[i : i + 8])
        loss.backward()
        if step == nan_at:
            model[0].weight.grad[0, 0] = math.nan
        opt.step(loss=loss)
        opt.zero_grad()
    opt.close()


def test_tensorboard_summary_writer(tmp_path: Path) -> None:
    """A folder written by torch.utils.tensorboard.SummaryWriter with train/grad_norm and train/loss."""
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    for step in range(1, 41):
        writer.add_scalar("train/grad_norm", 1.0 + (step % 4) / 10, step)
        writer.add_scalar("train/loss", 3.0 - step / 40, step)
        writer.add_scalar("val/loss", 9.0, step)
    writer.close()
    log = read_log(tmp_path)
    assert (
        log.source == "TensorBoard"
        and log.norm_column == "train/grad_norm"
        and log.loss_column == "train/loss"
    )
    assert list(log.steps) == list(range(1, 41))
    assert list(log.loss) == pytest.approx([3.0 - s / 40 for s in range(1, 41)])
    assert analyze(log)["verdict"] == "healthy"


def test_tensorboard_from_clipopt_logger_and_csv_agree(tmp_path: Path) -> None:
    """clipopt's TensorBoardLogger and CSVLogger of one run give the same verdict, step and norms."""
    pytest.importorskip("tensorboard")
    model = mlp((8, 4, 1))
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        max_norm=5.0,
        param_names=model.named_parameters(),
        layer_stats=5,
        loggers=[CSVLogger(tmp_path / "g.csv"), TensorBoardLogger(tmp_path / "tb")],
    )
    _train_with(opt, model, 30, nan_at=12)
    from_csv, from_tb = read_log(tmp_path / "g.csv"), read_log(tmp_path / "tb")
    assert list(from_tb.steps) == list(from_csv.steps)
    assert list(from_tb.total_norm)[:11] == pytest.approx(list(from_csv.total_norm)[:11], rel=1e-6)
    assert list(from_tb.loss) == pytest.approx(list(from_csv.loss), rel=1e-6, nan_ok=True)
    csv_report, tb_report = analyze(from_csv), analyze(from_tb)
    assert csv_report["verdict"] == tb_report["verdict"] == "nonfinite"
    assert csv_report["findings"][0]["step"] == tb_report["findings"][0]["step"] == 12
    assert csv_report["findings"][0]["layer"] == tb_report["findings"][0]["layer"] == "0.weight"


def test_tensorboard_gradscaler_overflows_are_not_nonfinite(tmp_path: Path) -> None:
    """An fp16 run under a GradScaler logged by TensorBoardLogger: the scaler's overflow updates (skipped,
    reason 'overflow' in the CSV of the same run) are calibration, so both logs give ``healthy``."""
    pytest.importorskip("tensorboard")
    model = mlp((8, 16, 1))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=20)
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        scaler=scaler,
        max_norm=1.0,
        loggers=[CSVLogger(tmp_path / "g.csv"), TensorBoardLogger(tmp_path / "tb")],
    )
    x, y = _xy()
    for step in range(120):
        i = (step * 8) % len(x)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x[i : i + 8]).float(), y[i : i + 8])
        scaler.scale(loss).backward()
        opt.step(loss=loss)
        opt.zero_grad()
    opt.close()
    from_csv, from_tb = read_log(tmp_path / "g.csv"), read_log(tmp_path / "tb")
    overflows = [i for i, r in from_csv.reason.items() if r == "overflow"]
    assert len(overflows) >= 3  # the label is true: the scaler overflowed
    assert sorted(from_tb.reason.items()) == sorted(from_csv.reason.items())
    assert analyze(from_csv)["verdict"] == analyze(from_tb)["verdict"] == "healthy"


def test_lightning_nonfinite_gradient_names_its_layer(tmp_path: Path) -> None:
    """A Lightning run whose lin.bias gradient goes nan at step 6 (logged by grad_norm(), which writes
    no non-finite count): the nonfinite finding names lin.bias, from the nan in its own norm column."""
    pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import CSVLogger as LightningCSV

    _lightning_fit(LightningCSV(str(tmp_path)), nan_at_step=6)
    path = next(tmp_path.rglob("metrics.csv"))
    with path.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["grad_2.0_norm_total"]]
    first_bad = next(r for r in rows if not math.isfinite(float(r["grad_2.0_norm_total"])))
    assert first_bad["step"] == "6" and math.isfinite(float(first_bad["grad_2.0_norm/lin.weight"]))
    finding = next(f for f in analyze(read_log(path))["findings"] if f["kind"] == "nonfinite")
    assert (finding["step"], finding["layer"]) == (6, "lin.bias")


def test_lightning_tensorboard_logger(tmp_path: Path) -> None:
    """A Lightning run with its TensorBoardLogger (Lightning's default) and grad_norm(): the tags
    grad_2.0_norm_total, grad_2.0_norm/<name> and train_loss are read."""
    pytest.importorskip("lightning.pytorch")
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger as LightningTB
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _lightning_fit(LightningTB(str(tmp_path)))
    events = EventAccumulator(str(next(tmp_path.rglob("events.out.tfevents*")).parent))
    events.Reload()
    total = events.Scalars("grad_2.0_norm_total")
    log = read_log(tmp_path)
    assert log.source == "TensorBoard" and log.norm_column == "grad_2.0_norm_total"
    assert list(log.steps) == [e.step for e in total]
    assert list(log.total_norm) == pytest.approx([e.value for e in total])
    assert list(log.loss) == pytest.approx([e.value for e in events.Scalars("train_loss")])
    assert set(log.layers) == {"lin.weight", "lin.bias"}
    assert list(log.layers["lin.bias"]["grad_norm"]) == pytest.approx(
        [e.value for e in events.Scalars("grad_2.0_norm/lin.bias")]
    )
    assert analyze(log)["verdict"] == "healthy"


def test_a_nan_loss_is_recorded_non_finite_in_every_format(tmp_path: Path) -> None:
    """A run whose loss and norm turn NaN at update 50, logged as a CSV, by SummaryWriter and as a
    Trainer log_history (json writes NaN): every reader reads the NaN losses as recorded and not finite
    (inf), as the CSV reader does, so the summaries agree: 99 losses logged, 50 non-finite."""
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    rows = [
        (s, 2 - s / 100 if s < 50 else math.nan, 1 + s % 3 / 10 if s < 50 else math.nan)
        for s in range(1, 100)
    ]
    (tmp_path / "run.csv").write_text("step,loss,grad_norm\n" + "".join(f"{s},{v},{n}\n" for s, v, n in rows))
    writer = SummaryWriter(str(tmp_path / "tb"))
    for s, v, n in rows:
        writer.add_scalar("loss", v, s)
        writer.add_scalar("grad_norm", n, s)
    writer.close()
    history = [{"loss": v, "grad_norm": n, "learning_rate": 1e-3, "step": s} for s, v, n in rows]
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    for path in ("run.csv", "tb", "trainer_state.json"):
        log = read_log(tmp_path / path)
        assert [math.isinf(v) for v in log.loss] == [math.isnan(v) for _, v, _ in rows], path
        summary = analyze(log)["summary"]
        assert (summary["losses"], summary["loss_nonfinite"]) == (99, 50), path
