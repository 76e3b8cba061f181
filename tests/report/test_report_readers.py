"""The reader registry of ``clipopt report`` (``clipopt._report.read.READERS``): every registered
reader is the one chosen for a real log of its format, and a reader added to the registry is used."""

from __future__ import annotations

import dataclasses
import re
import shutil
from array import array
from pathlib import Path

import pytest
import torch

import clipopt._report.read as report_read
from clipopt import ClippedOptimizer, CSVLogger, TensorBoardLogger
from clipopt._cli import main
from clipopt._report.read import READERS, GradLog, Names, Reader, read_log

from ..helpers import mlp
from .test_report_formats import _train_with, _trainer_state


def _spied(monkeypatch: pytest.MonkeyPatch, readers: tuple[Reader, ...]) -> list[str]:
    """Register ``readers``, each wrapped so that its ``read`` appends the reader's name to the list
    returned (the registry's own readers otherwise unchanged)."""
    chosen: list[str] = []

    def spy(reader: Reader) -> Reader:
        def read(path: str, names: Names, run: str | None) -> GradLog:
            chosen.append(reader.name)
            return reader.read(path, names, run)

        return dataclasses.replace(reader, read=read)

    monkeypatch.setattr(report_read, "READERS", tuple(spy(r) for r in readers))
    return chosen


def test_every_registered_reader_is_chosen_for_a_real_log_of_its_format(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """clipopt's CSVLogger file, a transformers.Trainer trainer_state.json (the file, its folder, and a
    folder holding it only as checkpoint-<n>/) and clipopt's TensorBoardLogger folder are each read by
    their own reader, and together they use every reader of the registry (a reader added without a
    real log of its format here fails this test)."""
    pytest.importorskip("tensorboard")
    model = mlp((8, 4, 1))
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        max_norm=5.0,
        loggers=[CSVLogger(tmp_path / "g.csv"), TensorBoardLogger(tmp_path / "tb")],
    )
    _train_with(opt, model, 12)
    state = _trainer_state(tmp_path / "hf", max_steps=6, logging_steps=2)
    (tmp_path / "out" / "checkpoint-6").mkdir(parents=True)
    shutil.copy(state, tmp_path / "out" / "checkpoint-6" / "trainer_state.json")
    chosen = _spied(monkeypatch, READERS)
    expected = {
        tmp_path / "g.csv": ["CSV"],
        tmp_path / "tb": ["TensorBoard"],
        state: ["Trainer trainer_state.json"],
        tmp_path / "hf": ["Trainer trainer_state.json"],  # the folder's own file, then read as a file
        tmp_path / "out": ["Trainer trainer_state.json"],  # found by the checkpoints reader, read as a file
    }
    seen = {}
    for path, readers in expected.items():
        chosen.clear()
        log = read_log(path)
        assert chosen == readers, path
        assert len(log) > 0
        seen[path] = log.source
    assert seen[tmp_path / "g.csv"] == "clipopt CSV" and seen[tmp_path / "tb"] == "TensorBoard"
    found = {r.name for r in READERS if r.find(str(tmp_path / "out"), None) is not None}
    assert found == {"Trainer checkpoints"}
    used = {"CSV", "TensorBoard", "Trainer trainer_state.json", "Trainer checkpoints"}
    assert {r.name for r in READERS} == used


def _read_toy(path: str, names: Names, run: str | None) -> GradLog:
    """A toy format: a '#toy' line, then one 'step norm' pair a line."""
    log = GradLog(path, "toy", norm_column="norm")
    for line in Path(path).read_text().splitlines()[1:]:
        step, norm = line.split()
        log.steps.append(int(step))
        log.total_norm.append(float(norm))
        for column in (log.loss, log.lr, log.max_norm):
            column.append(float("nan"))
        log.clipped.append(0)
        log.skipped.append(0)
    return log


def _toy_in(folder: str, run: str | None) -> str | None:
    """A folder's ``run.toy``."""
    path = Path(folder) / "run.toy"
    return str(path) if path.is_file() else None


TOY = Reader(
    name="toy",
    reads="a toy log ('#toy', then 'step norm' lines)",
    claims_file=lambda path, head: head.startswith(b"#toy"),
    find=_toy_in,
    read=_read_toy,
)


def test_a_reader_added_to_the_registry_reads_its_files_and_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A toy reader registered before the CSV reader (one line in READERS) reads its file, is found in
    a folder, and ``clipopt report`` reports from it; registered after the CSV reader (which claims
    any text), the CSV reader takes the file: the registry is tried in order."""
    (tmp_path / "run.toy").write_text("#toy\n" + "".join(f"{s} {1.0 + s / 100}\n" for s in range(1, 31)))
    monkeypatch.setattr(report_read, "READERS", (TOY, *READERS))
    for path in (tmp_path / "run.toy", tmp_path):
        log = read_log(path)
        assert log.source == "toy" and log.steps == array("q", range(1, 31))
        assert list(log.total_norm) == pytest.approx([1.0 + s / 100 for s in range(1, 31)])
    assert main(["report", str(tmp_path / "run.toy")]) == 0
    assert f"file: {tmp_path / 'run.toy'} (toy; 30 updates, steps 1-30)" in capsys.readouterr().out
    monkeypatch.setattr(report_read, "READERS", (*READERS, TOY))
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'run.toy'} has no gradient-norm column")):
        read_log(tmp_path / "run.toy")
