"""Standing adversarial suite (issue #11), part 2: files.

Torn and full CSV logs, impossible log paths, links planted where clipopt writes, temporaries of
killed writers, hostile files for ``load_snapshot`` and ``clipopt inspect``, and a fault-injection
run that kills a writing process at random moments and checks every file it left.  (Hostile files
for ``clipopt report`` belong to its own suite.)
"""

from __future__ import annotations

import csv
import errno
import io
import math
import os
import pickle
import random
import signal
import socket
import subprocess
import sys
import time
import warnings
import zipfile
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import clipopt
from clipopt import ClippedOptimizer, CSVLogger, TensorBoardLogger, load_snapshot
from clipopt._cli import main as cli_main
from clipopt._report.report import read_log

from ..helpers import mlp

REPO = Path(__file__).resolve().parents[2]


make_model = partial(mlp, (3, 4, 2))  # Linear(3, 4), Tanh, Linear(4, 2), global seed 0


def train(opt: ClippedOptimizer, model: nn.Module, steps: int, nan_at: tuple[int, ...] = ()) -> None:
    """``steps`` windows of one micro-batch; the windows in ``nan_at`` get NaN gradients."""
    for i in range(steps):
        x = torch.randn(5, 3)
        (model(x).pow(2).sum() * (math.nan if i in nan_at else 1.0)).backward()
        opt.step()
        opt.zero_grad()


def rows_of(path: Path) -> list[list[str]]:
    with path.open(newline="") as f:
        return list(csv.reader(f))


# ---------------------------------------------------------------------------------------------- torn CSV


@pytest.mark.parametrize("torn", ["3,1,0.5", "3,1,0.5,1.0,0,0,,1.0,0.1\r", "3"])
def test_resumed_csv_never_continues_a_torn_row(tmp_path: Path, torn: str) -> None:
    """Item 6: a run killed mid-write left a last row without a line end; the resumed CSVLogger
    appended its first row onto it and `clipopt report` refused the file for good.  Now the torn row
    is cut off (with a warning), every row is whole, and the report reads the file."""
    path = tmp_path / "grads.csv"
    model = make_model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), loggers=[CSVLogger(path)])
    train(opt, model, 2)
    opt.close()
    with path.open("a", newline="") as f:
        f.write(torn)  # the crash
    opt2 = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), loggers=[CSVLogger(path)])
    with pytest.warns(RuntimeWarning, match="the last row of .* was torn"):
        train(opt2, model, 2)
        opt2.close()
    rows = rows_of(path)
    assert [r[0] for r in rows] == ["step", "1", "2", "1", "2"]
    assert len({len(r) for r in rows}) == 1
    log = read_log(path)
    assert list(log.steps) == [1, 2, 1, 2] and not log.notes


def test_csv_with_a_torn_header_is_started_again(tmp_path: Path) -> None:
    """A file whose only line is a torn header (killed during the first write) is emptied and
    written afresh, instead of being refused as 'other columns'."""
    path = tmp_path / "grads.csv"
    path.write_text("step,micro_batches,total_no")
    model = make_model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), loggers=[CSVLogger(path)])
    with pytest.warns(RuntimeWarning, match="was torn"):
        train(opt, model, 1)
        opt.close()
    assert rows_of(path)[0][:3] == ["step", "micro_batches", "total_norm"] and len(rows_of(path)) == 2


def test_another_programs_csv_is_never_cut(tmp_path: Path) -> None:
    """Review of #11: a CSVLogger pointed at another program's CSV whose last row has no line end cut
    that complete row off as 'torn', then refused the file for its other columns: the user's data was
    lost.  Only clipopt's own logs are repaired; the file is refused and left byte for byte."""
    path = tmp_path / "metrics.csv"
    path.write_bytes(b"epoch,acc\n1,0.5\n2,0.7")
    model = make_model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), loggers=[CSVLogger(path)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no 'torn' warning either
        with pytest.raises(ValueError, match="already holds a CSV log with other columns"):
            train(opt, model, 1)
            opt.close()
    assert path.read_bytes() == b"epoch,acc\n1,0.5\n2,0.7"


def test_an_existing_binary_file_is_refused_not_appended_to(tmp_path: Path) -> None:
    """Review of #11: a CSVLogger path naming an existing binary file (a checkpoint, by a slip) had CSV
    rows appended to it silently (the header read failed and counted as 'no header'); now a
    ValueError names the path and the file is left byte for byte."""
    path = tmp_path / "model.pt"
    torch.save({"w": torch.arange(100.0)}, path)
    before = path.read_bytes()
    model = make_model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), loggers=[CSVLogger(path)])
    with pytest.raises(ValueError, match=r"path='.*model\.pt' already exists and is not a CSV log \("):
        train(opt, model, 1)
        opt.close()
    assert path.read_bytes() == before


# ---------------------------------------------------------------------------------------------- full disks


def test_csv_write_failure_warns_once_and_retries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 7: a disk-full error at a flush raised OSError out of opt.step() after the update was
    applied.  Now every update is applied, one warning per cause is shown, the rows are kept and
    written at the next flush that succeeds, and a partial write is cut off (no torn row)."""
    path = tmp_path / "grads.csv"
    real_write = os.write
    failing = [True]

    def full_disk(fd: int, data: Any) -> int:
        if failing[0]:
            real_write(fd, bytes(data[:7]))  # part of the chunk reaches the disk
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    model = make_model()
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), loggers=[CSVLogger(path, flush_every=1)]
    )
    monkeypatch.setattr("clipopt._diagnostics.loggers.os.write", full_disk)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        train(opt, model, 4)
    messages = [str(w.message) for w in record if "could not write" in str(w.message)]
    assert len(messages) == 1 and "No space left on device" in messages[0], messages
    assert opt.num_updates == 4
    assert not path.exists() or path.read_bytes() == b""  # the partial write was cut off
    failing[0] = False
    train(opt, model, 1)
    opt.close()
    rows = rows_of(path)
    assert [r[0] for r in rows] == ["step", "1", "2", "3", "4", "5"]


@pytest.mark.parametrize("entry", ["step", "step with a scheduler", "flush", "close"])
def test_csv_write_failure_warns_at_the_users_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, entry: str
) -> None:
    """A CSV write that fails (disk full) warns at the user's line, whichever call wrote the rows:
    ``step()`` (also through an LR scheduler's wrapper), ``flush()`` of a partial window, or
    ``close()`` (the buffered rows)."""

    def full_disk(fd: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    model = make_model()
    logger = CSVLogger(tmp_path / "grads.csv", flush_every=100 if entry == "close" else 1)
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), accumulation_steps=2, loggers=[logger]
    )
    if entry == "step with a scheduler":
        torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0)
    monkeypatch.setattr("clipopt._diagnostics.loggers.os.write", full_disk)
    model(torch.ones(5, 3)).sum().backward()
    opt.step()  # the window's first micro-batch
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model(torch.ones(5, 3)).sum().backward()
        if entry == "flush":
            line = sys._getframe().f_lineno + 1
            opt.flush()
        elif entry == "close":
            opt.step()  # the row stays in the buffer
            line = sys._getframe().f_lineno + 1
            opt.close()
        else:
            line = sys._getframe().f_lineno + 1
            opt.step()
    where = [(w.filename, w.lineno) for w in record if "could not write" in str(w.message)]
    assert where == [(__file__, line)]


def test_csv_rows_that_cannot_be_written_at_exit_are_reported_lost(tmp_path: Path) -> None:
    """The disk fills during training (warned once: "rows are kept and written at the next flush")
    and is still full at exit: the exit flush says how many rows are lost, instead of nothing (the
    cause was already warned about, so WarnOnce kept quiet and the rows vanished silently)."""
    import subprocess

    path = tmp_path / "grads.csv"
    code = (
        "import errno, warnings, torch, clipopt, clipopt._diagnostics.loggers as L\n"
        "warnings.simplefilter('default')\n"
        "def full(path, data):\n    raise OSError(errno.ENOSPC, 'No space left on device')\n"
        "L.append_bytes = full  # every append fails (os.write itself is used by tempfile too)\n"
        "m = torch.nn.Linear(2, 1)\n"
        f"opt = clipopt.ClippedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), "
        f"loggers=[clipopt.CSVLogger({str(path)!r}, flush_every=1)])\n"
        "for _ in range(3):\n    m(torch.ones(1, 2)).sum().backward(); opt.step(); opt.zero_grad()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    warned = [line for line in proc.stderr.splitlines() if "RuntimeWarning" in line]
    assert len(warned) == 2 and "rows are kept and written at the next flush" in warned[0]
    assert warned[1].endswith(
        f"RuntimeWarning: clipopt could not write the last 3 rows of the CSV log {path} at exit; they "
        "are lost (call opt.close() while the disk can still be written)"
    )


def test_csv_buffer_is_bounded_while_writes_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the disk stays full the logger keeps at most max_buffered rows and counts the dropped."""
    monkeypatch.setattr("clipopt._diagnostics.loggers.MAX_BUFFERED_ROWS", 3)
    path = tmp_path / "grads.csv"
    logger = CSVLogger(path, flush_every=1)

    def full_disk(fd: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("clipopt._diagnostics.loggers.os.write", full_disk)
    model = make_model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), loggers=[logger])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(opt, model, 7)
    assert len(logger._buffer) == 3 and logger.rows_dropped == 4 and opt.num_updates == 7
    monkeypatch.undo()
    opt.close()
    assert [r[0] for r in rows_of(path)] == ["step", "5", "6", "7"]


def test_csv_file_removed_during_training_is_written_again(tmp_path: Path) -> None:
    """The log's folder removed mid-run: the next flush creates it again, nothing is raised."""
    folder = tmp_path / "logs"
    path = folder / "grads.csv"
    model = make_model()
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), loggers=[CSVLogger(path, flush_every=1)]
    )
    train(opt, model, 2)
    path.unlink()
    folder.rmdir()
    train(opt, model, 1)
    assert [r[0] for r in rows_of(path)] == ["step", "3"]


@pytest.mark.parametrize("kind", ["directory", "under_a_file"])
def test_log_paths_that_cannot_work_are_refused_at_construction(tmp_path: Path, kind: str) -> None:
    """Item 7: a CSV path that is a directory, or lies below a regular file, was accepted and
    aborted training at the first flush; now CSVLogger and TensorBoardLogger refuse such paths when
    built, with a ValueError naming the argument."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    if kind == "directory":
        with pytest.raises(ValueError, match=r"^path='.*' is a directory, not a file; pass a file path"):
            CSVLogger(tmp_path)
        with pytest.raises(ValueError, match=r"^log_dir='.*' is an existing file, not a directory"):
            TensorBoardLogger(blocker)
    else:
        with pytest.raises(ValueError, match=r"^path='.*' lies below '.*file', which is a file"):
            CSVLogger(blocker / "sub" / "grads.csv")
        with pytest.raises(ValueError, match=r"^log_dir='.*' lies below '.*file', which is a file"):
            TensorBoardLogger(blocker / "runs")


def test_snapshot_write_failures_warn_once_per_cause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three failing snapshot writes (disk full) give one warning; training goes on, the failures
    are counted, and the next write that can succeed does."""
    calls = [0]
    real_save = torch.save

    def full_disk(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] <= 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr("clipopt._diagnostics.snapshot.torch.save", full_disk)
    model = make_model()
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        snapshot_dir=tmp_path,
        param_names=model.named_parameters(),
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        train(opt, model, 5, nan_at=(0, 1, 2, 3))
    messages = [str(w.message) for w in record if "could not write the anomaly snapshot" in str(w.message)]
    assert len(messages) == 1
    writer = opt._run.diagnostics.writer
    assert writer is not None and writer.failed == 3
    assert opt.num_skipped == 4 and opt.num_updates == 1
    assert [p.name for p in tmp_path.iterdir()] == ["anomaly-step00000004-nonfinite.pt"]


# ---------------------------------------------------------------------------------------------- links


def _nan_window(opt: ClippedOptimizer, model: nn.Module) -> None:
    train(opt, model, 1, nan_at=(0,))


def test_snapshot_never_follows_a_link_planted_at_its_old_temporary_name(tmp_path: Path) -> None:
    """Item 9: the writer opened `.<name>.<pid>.tmp` following a planted symlink, overwrote its target
    with snapshot bytes and renamed the link into place.  Now temporaries have random names and are
    created exclusively without following links: the target is untouched, the snapshot is a file."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    name = "anomaly-step00000001-nonfinite.pt"
    (snaps / f".{name}.{os.getpid()}.tmp").symlink_to(victim)
    model = make_model()
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), snapshot_dir=snaps, param_names=model.named_parameters()
    )
    _nan_window(opt, model)
    assert victim.read_text() == "precious"
    snap = snaps / name
    assert snap.is_file() and not snap.is_symlink()
    assert load_snapshot(snap)["step"] == 1


def test_snapshot_replaces_a_link_at_its_final_name_without_following_it(tmp_path: Path) -> None:
    """A symlink planted at the snapshot's own name is replaced by the snapshot; its target is untouched."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    (snaps / "anomaly-step00000001-nonfinite.pt").symlink_to(victim)
    model = make_model()
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), snapshot_dir=snaps, param_names=model.named_parameters()
    )
    _nan_window(opt, model)
    assert victim.read_text() == "precious"
    assert not (snaps / "anomaly-step00000001-nonfinite.pt").is_symlink()


def test_exclusive_temporary_refuses_a_link_even_at_a_guessed_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even if an attacker guessed the random temporary name, O_EXCL|O_NOFOLLOW refuses the planted
    link: the write fails with a warning and the link's target is untouched."""
    monkeypatch.setattr("clipopt._diagnostics.files.secrets.token_hex", lambda n: "guessed")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    target = snaps / "anomaly-step00000001-nonfinite.pt"
    clipopt._diagnostics.files.temp_name(target).symlink_to(victim)
    model = make_model()
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), snapshot_dir=snaps, param_names=model.named_parameters()
    )
    with pytest.warns(RuntimeWarning, match="could not write the anomaly snapshot"):
        _nan_window(opt, model)
    assert victim.read_text() == "precious" and not target.exists()


def test_csv_rewrite_never_follows_a_planted_link(tmp_path: Path) -> None:
    """The CSV rewrite after add_param_group goes through the same exclusive temporary: a link at
    the old predictable temporary name is left alone and its target untouched."""
    path = tmp_path / "grads.csv"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / f".grads.csv.{os.getpid()}.tmp").symlink_to(victim)
    head, trunk = nn.Linear(4, 1), nn.Linear(3, 4)
    opt = ClippedOptimizer(
        torch.optim.SGD(head.parameters(), lr=0.1), loggers=[CSVLogger(path, flush_every=1)]
    )
    x = torch.randn(2, 3)
    for i in range(2):
        if i == 1:
            opt.add_param_group({"params": list(trunk.parameters()), "lr": 0.01})
        head(trunk(x)).sum().backward()
        opt.step()
        opt.zero_grad()
        trunk.zero_grad()
    opt.close()
    assert victim.read_text() == "precious"
    assert rows_of(path)[0][-1] == "lr.1" and not path.is_symlink()


# ------------------------------------------------------------------------------ stale temporaries


def test_temporaries_of_killed_writers_are_removed(tmp_path: Path) -> None:
    """Temporaries left by a writer killed mid-write (a dead process on this host, or any older than
    an hour) are removed when the next writer starts; a live writer's temporary is kept."""
    host = socket.gethostname().replace(".", "_")[:32] or "host"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    name = "anomaly-step00000009-nonfinite.pt"
    stale = snaps / f".{name}.{host}.{dead.pid}.0a1b2c.tmp"
    old = snaps / f".{name}.12345.tmp"  # the former naming, from an earlier version
    live = snaps / f".{name}.{host}.{os.getppid()}.3d4e5f.tmp"
    for f in (stale, old, live):
        f.write_bytes(b"PK partial")
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    model = make_model()
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), snapshot_dir=snaps, param_names=model.named_parameters()
    )
    _nan_window(opt, model)
    assert sorted(p.name for p in snaps.iterdir()) == sorted([live.name, "anomaly-step00000001-nonfinite.pt"])


def test_pids_are_never_signalled_where_signal_0_is_not_a_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review of #11: on Windows os.kill(pid, 0) sends CTRL_C_EVENT (signal 0) to the process group
    pid instead of probing it; the stale-temporary cleanup must not call it there, and then keeps
    a recent temporary of another process of this host (only age decides)."""
    from clipopt._diagnostics import files as _files

    host = socket.gethostname().replace(".", "_")[:32] or "host"
    recent = tmp_path / f".grads.csv.{host}.{os.getpid() + 1}.0a1b2c.tmp"
    recent.write_bytes(b"partial")
    calls: list[int] = []
    monkeypatch.setattr(_files, "_CAN_PROBE_PIDS", False, raising=False)
    monkeypatch.setattr(_files.os, "kill", lambda pid, sig: calls.append(pid))
    assert _files.remove_stale_temps(tmp_path, "grads.csv") == 0
    assert calls == [] and recent.exists()


# ------------------------------------------------------------------------------ hostile snapshots


def _good_snapshot(tmp_path: Path) -> Path:
    model = make_model()
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        snapshot_dir=tmp_path / "good",
        param_names=model.named_parameters(),
    )
    _nan_window(opt, model)
    assert opt.last_snapshot is not None
    return Path(opt.last_snapshot)


class _Payload:
    """Would run a command if unpickled."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch PWNED",))


def _hostile(kind: str, path: Path, good: Path) -> str:
    """Write a hostile file of ``kind`` at ``path``; return the text the refusal must contain."""
    if kind == "empty":
        path.write_bytes(b"")
        return "is not a clipopt snapshot"
    if kind == "random_bytes":
        path.write_bytes(random.Random(0).randbytes(4096))
        return "is not a clipopt snapshot"
    if kind == "truncated":
        path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
        return "is not a clipopt snapshot"
    if kind == "pickle_payload":
        path.write_bytes(pickle.dumps(_Payload()))
        return "is not a clipopt snapshot"
    if kind == "torch_zip_with_payload":
        buf = io.BytesIO()
        torch.save({"format": 1}, buf)
        with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, zipfile.ZipFile(path, "w") as dst:
            for item in src.infolist():
                data = src.read(item)
                dst.writestr(item, pickle.dumps(_Payload()) if item.filename.endswith("data.pkl") else data)
        return "is not a clipopt snapshot"
    if kind == "list":
        torch.save([1, 2, 3], path)
        return "is not a clipopt snapshot"
    if kind == "wrong_types":
        snap = torch.load(good, weights_only=True)
        snap.update(step="3", params=[torch.ones(2)], layer_stats={"w": 5})
        torch.save(snap, path)
        return "damaged clipopt snapshot: wrong type of step (str), params (list), layer_stats (dict)"
    if kind == "tensor_names":
        snap = torch.load(good, weights_only=True)
        snap["grads"] = {1: torch.ones(2)}
        torch.save(snap, path)
        return "damaged clipopt snapshot: wrong type of grads (dict)"
    if kind == "nan_step":
        snap = torch.load(good, weights_only=True)
        snap["step"] = math.nan
        torch.save(snap, path)
        return "damaged clipopt snapshot: wrong type of step (float)"
    if kind == "fifo":
        os.mkfifo(path)
        return "is not a regular file"
    raise AssertionError(kind)


HOSTILE = [
    "empty",
    "random_bytes",
    "truncated",
    "pickle_payload",
    "torch_zip_with_payload",
    "list",
    "wrong_types",
    "tensor_names",
    "nan_step",
    "fifo",
]


@pytest.mark.parametrize("kind", HOSTILE)
def test_hostile_files_are_refused_by_load_snapshot_and_inspect(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hostile files (empty, random bytes, truncated, pickles with a payload, wrong types, a FIFO
    that would block a reader): load_snapshot raises a ValueError naming the file, `clipopt inspect`
    exits 2 with one line and no traceback, and no payload runs."""
    monkeypatch.chdir(tmp_path)
    good = _good_snapshot(tmp_path)
    path = tmp_path / "hostile.pt"
    expected = _hostile(kind, path, good)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=str(path).replace(".", r"\.")) as info:
            load_snapshot(path)
        assert expected in str(info.value)
        code = cli_main(["inspect", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err and expected in err, err
    assert not (tmp_path / "PWNED").exists()


# ------------------------------------------------------------------------------ fault injection


def _check_files(root: Path) -> tuple[int, int]:
    """Every snapshot loads; the CSV reads (a torn last row at most); return (snapshots, rows)."""
    snaps = [p for p in (root / "snaps").glob("anomaly-step*.pt")] if (root / "snaps").exists() else []
    for p in snaps:
        snap = load_snapshot(p)
        assert snap["reason"] == "nonfinite" and snap["params"], p
    rows = 0
    csv_path = root / "grads.csv"
    if csv_path.exists() and csv_path.stat().st_size:
        data = csv_path.read_bytes()
        lines = data.split(b"\n")
        header = lines[0]
        for line in lines[1:-1]:  # every whole row has the header's cells
            assert line.count(b",") == header.count(b","), line
        rows = len(lines) - 2
        if rows > 0:
            read_log(csv_path)
    return len(snaps), rows


def test_writer_killed_at_random_moments_leaves_every_file_usable(tmp_path: Path) -> None:
    """Fault injection: a training run writing CSV rows and snapshots is killed with SIGKILL at random
    moments, 5 times, each run resuming the same files.  After every kill each snapshot loads and
    the CSV reads; the run after a kill cuts the torn row off and removes the killed writer's
    temporaries, and the final complete run leaves no temporary and no torn row anywhere."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, str(REPO / "tests" / "fault_writer.py"), str(tmp_path)]
    kills = 0
    for _ in range(5):
        proc = subprocess.Popen([*cmd, "100000"], stdout=subprocess.PIPE, env=env, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", f"seed {seed}"
        time.sleep(rng.uniform(0.0, 0.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        proc.stdout.close()
        kills += proc.returncode == -signal.SIGKILL
        _check_files(tmp_path)
    done = subprocess.run([*cmd, "30"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and "done" in done.stdout, (seed, done.stderr)
    snaps, rows = _check_files(tmp_path)
    assert kills == 5 and snaps >= 10 and rows >= 30, seed
    leftovers = [p.name for p in tmp_path.rglob("*.tmp")]
    assert leftovers == [], (seed, leftovers)
    assert tmp_path.joinpath("grads.csv").read_bytes().endswith(b"\n")
