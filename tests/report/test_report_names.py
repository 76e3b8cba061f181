"""``clipopt report``: the names read as the loss and the norm, ``--loss``/``--norm``, and folders of
several TensorBoard runs (``--run``), on logs written by real runs (issue #22).

The TensorBoard logs use the names of PyTorch's own TensorBoard tutorial
(``Loss/train``, ``Grad/total_norm``) and SummaryWriter's default layout
(``runs/<run>/``); the values read are checked against TensorBoard's own
EventAccumulator, or against the values the run computed.
"""

from __future__ import annotations

import csv
import functools
import json
import re
from pathlib import Path

import pytest
import torch

from clipopt._report.read import Names, tensorboard_runs
from clipopt._report.report import analyze, read_log

from ..helpers import one_thread, run_cli

#: The updates after which the learning rate of :func:`_train` is raised.
SWITCH = 50


def _train(steps: int, lr: float) -> list[tuple[float, float]]:
    """A real run: Linear(8, 32), Tanh, Linear(32, 1) on y = sum(x), MSE, Adam at lr 0.01, raised to ``lr``
    after :data:`SWITCH` updates (3.0 blows the loss up ~600x over its trained level, and some 8x over its
    start, while the norm grows ~6x). Returns (loss, pre-clip total norm) per update; the norm is what
    ``clip_grad_norm_`` returns. Each run is trained once per test run (a new list each call)."""
    return list(_trained(steps, lr))


@functools.cache
def _trained(steps: int, lr: float) -> tuple[tuple[float, float], ...]:
    """The rows of :func:`_train` (seeded, so the same for the same arguments), on one thread."""
    with one_thread():
        return tuple(_train_once(steps, lr))


def _train_once(steps: int, lr: float) -> list[tuple[float, float]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = x.sum(1, keepdim=True)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    rows = []
    for step in range(steps):
        if step == SWITCH:
            for group in opt.param_groups:
                group["lr"] = lr
        i = (step * 16) % 256
        loss = torch.nn.functional.mse_loss(model(x[i : i + 16]), y[i : i + 16])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        rows.append((loss.item(), norm.item()))
        opt.step()
        opt.zero_grad()
    return rows


def _tutorial_writer(rows: list[tuple[float, float]], log_dir: str | None = None) -> str:
    """Log ``rows`` as PyTorch's TensorBoard tutorial does (Loss/train, Grad/total_norm; Loss/test every
    10 updates); ``log_dir`` None: SummaryWriter's default folder runs/<date>_<host>. Returns the folder."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir)
    for step, (loss, norm) in enumerate(rows):
        writer.add_scalar("Loss/train", loss, step)
        writer.add_scalar("Grad/total_norm", norm, step)
        if step % 10 == 0:
            writer.add_scalar("Loss/test", 2 * loss, step)
    writer.close()
    return str(writer.log_dir)


def _loss_onset(losses: list[float]) -> int:
    """The first step whose loss is above 10x the start (the median of the first 3 losses): where the
    documented loss rule ("Choosing max_norm") puts a blow-up."""
    start = sorted(losses[:3])[1]
    return next(step for step, loss in enumerate(losses) if loss > 10 * start)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    return run_cli(capsys, "report", *argv)


def _scalars(folder: str, tag: str) -> list[tuple[int, float]]:
    """The (step, value) events of ``tag`` in ``folder``, read with TensorBoard's EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(folder, size_guidance={"scalars": 0})
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


# ----------------------------------------------------------------------------- names


def test_tutorial_names_blowup_is_exploding_and_names_the_tags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run that blows up, logged with the tutorial's Loss/train and Grad/total_norm: the loss is read
    (exploding: the loss blew up, not "healthy" with the loss "not in the log"), and the report says
    which tags it read and that Loss/test was ignored, in the text and in --json."""
    pytest.importorskip("tensorboard")
    rows = _train(200, lr=3.0)
    folder = _tutorial_writer(rows, str(tmp_path / "tb"))
    log = read_log(folder)
    assert list(log.loss) == pytest.approx([v for _, v in _scalars(folder, "Loss/train")])
    code, out, err = _cli(capsys, folder)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == f"verdict: exploding (the loss blew up; step {_loss_onset([v for v, _ in rows])})"
    assert lines[2] == "tags read: Grad/total_norm as the norm, Loss/train as the loss; ignored: Loss/test"
    code, out, _ = _cli(capsys, folder, "--json")
    report = json.loads(out)
    assert report["verdict"] == "exploding"
    assert report["columns"] == {"norm": "Grad/total_norm", "loss": "Loss/train", "ignored": ["Loss/test"]}


def test_csv_with_tutorial_names_is_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A CSV with the columns Grad/total_norm and Loss/train (the names the TensorBoard reader takes) is
    read, not refused with "no gradient-norm column"; the same run gives the same verdict as from TB."""
    rows = _train(200, lr=3.0)
    path = tmp_path / "run.csv"
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["step", "Loss/train", "Grad/total_norm", "epoch"])
        out.writerows([step, loss, norm, step // 16] for step, (loss, norm) in enumerate(rows))
    log = read_log(path)
    assert (log.norm_column, log.loss_column, log.ignored) == ("Grad/total_norm", "Loss/train", ["epoch"])
    assert list(log.total_norm) == pytest.approx([n for _, n in rows])
    assert list(log.loss) == pytest.approx([v for v, _ in rows])
    code, out, _ = _cli(capsys, str(path))
    assert code == 0
    assert (
        out.splitlines()[0]
        == f"verdict: exploding (the loss blew up; step {_loss_onset([v for v, _ in rows])})"
    )
    assert out.splitlines()[2] == (
        "columns read: Grad/total_norm as the norm, Loss/train as the loss; ignored: epoch"
    )


def test_loss_and_norm_options_choose_other_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--loss and --norm read columns of any name (here ones no rule recognises), in CSV and TensorBoard."""
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    rows = _train(120, lr=0.01)
    path = tmp_path / "run.csv"
    path.write_text("step,objective,gnorm\n" + "".join(f"{s},{v!r},{n!r}\n" for s, (v, n) in enumerate(rows)))
    log = read_log(path, Names(loss="objective", norm="gnorm"))
    assert list(log.loss) == pytest.approx([v for v, _ in rows])
    assert list(log.total_norm) == pytest.approx([n for _, n in rows])
    writer = SummaryWriter(str(tmp_path / "tb"))
    for step, (loss, norm) in enumerate(rows):
        writer.add_scalar("Loss/train", loss, step)
        writer.add_scalar("Grad/total_norm", norm, step)
        writer.add_scalar("stats/objective", loss / 2, step)
    writer.close()
    code, out, _ = _cli(capsys, str(tmp_path / "tb"), "--loss", "stats/objective", "--json")
    report = json.loads(out)
    assert code == 0
    assert report["columns"] == {
        "norm": "Grad/total_norm",
        "loss": "stats/objective",
        "ignored": ["Loss/train"],
    }
    assert report["summary"]["loss_start"] == pytest.approx(
        sorted(v for _, v in _scalars(str(tmp_path / "tb"), "stats/objective")[:3])[1]
    )


@pytest.mark.parametrize(
    ("loss_name", "norm_name"),
    [
        ("loss", "grad_norm"),
        ("train/loss", "train/grad_norm"),
        ("Loss/train", "Grad/total_norm"),
        ("train_loss", "model/total_norm"),
        ("training_loss", "gradient_norm"),
    ],
)
def test_common_names_are_read_alike_by_csv_and_tensorboard(
    tmp_path: Path, loss_name: str, norm_name: str
) -> None:
    """Each common pair of names is read, as the same columns with the same values, from a CSV and from a
    TensorBoard folder (one table of names for every reader); a validation loss beside it is ignored."""
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    rows = _train(30, lr=0.01)
    path = tmp_path / "run.csv"
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["step", "val_loss", loss_name, norm_name])
        out.writerows([s, 9.0, v, n] for s, (v, n) in enumerate(rows))
    writer = SummaryWriter(str(tmp_path / "tb"))
    for step, (loss, norm) in enumerate(rows):
        writer.add_scalar("val_loss", 9.0, step)
        writer.add_scalar(loss_name, loss, step)
        writer.add_scalar(norm_name, norm, step)
    writer.close()
    for log in (read_log(path), read_log(tmp_path / "tb")):
        assert (log.loss_column, log.norm_column, log.ignored) == (loss_name, norm_name, ["val_loss"])
        assert list(log.loss) == pytest.approx([v for v, _ in rows])
        assert list(log.total_norm) == pytest.approx([n for _, n in rows])


@pytest.mark.parametrize(
    ("option", "name", "noun", "available"),
    [
        ("--loss", "Loss/training", "column", "step, Loss/train, Grad/total_norm"),
        ("--norm", "grad_norm", "column", "step, Loss/train, Grad/total_norm"),
    ],
)
def test_a_name_not_in_the_log_is_an_error_listing_the_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, name: str, noun: str, available: str
) -> None:
    """--loss/--norm with a name the log lacks: exit 2, one line naming it and listing the log's names."""
    path = tmp_path / "run.csv"
    rows = _train(20, lr=0.01)
    path.write_text(
        "step,Loss/train,Grad/total_norm\n" + "".join(f"{s},{v},{n}\n" for s, (v, n) in enumerate(rows))
    )
    code, out, err = _cli(capsys, str(path), option, name)
    assert (code, out) == (2, "")
    assert err == (
        f"clipopt report: error: {path} has no {noun} {name!r} ({option} {name}); its {noun}s: {available}\n"
    )


def test_tensorboard_name_not_in_the_log_lists_its_tags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same error for a TensorBoard folder names its scalar tags."""
    pytest.importorskip("tensorboard")
    folder = _tutorial_writer(_train(20, lr=0.01), str(tmp_path / "tb"))
    code, _, err = _cli(capsys, folder, "--loss", "loss")
    assert code == 2
    assert err == (
        f"clipopt report: error: {folder} has no scalar tag 'loss' (--loss loss); its scalar tags: "
        "Grad/total_norm, Loss/test, Loss/train\n"
    )


def test_healthy_without_a_loss_says_so_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A healthy run whose log has no loss: the first line says the verdict rests on the norm alone."""
    rows = _train(120, lr=0.01)
    path = tmp_path / "norms.csv"
    path.write_text("step,grad_norm\n" + "".join(f"{s},{n}\n" for s, (_, n) in enumerate(rows)))
    code, out, _ = _cli(capsys, str(path))
    assert code == 0
    assert out.splitlines()[0] == (
        "verdict: healthy (judged on the gradient norm alone: no loss was read; "
        "no blow-up, non-finite, spiking or vanishing gradients)"
    )
    assert (
        out.splitlines()[2]
        == "columns read: grad_norm as the norm, no loss (--loss NAME picks one); ignored: none"
    )


def test_healthy_with_only_non_finite_losses_says_so_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log whose loss column holds only ``nan`` (a script writing float("nan") where it had no loss)
    and whose norms are calm: no finite loss was read, so the verdict rests on the norm alone, and the
    first line says so, as it does for a log without a loss."""
    rows = _train(120, lr=0.01)
    path = tmp_path / "nanloss.csv"
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["step", "loss", "grad_norm"])
        out.writerows([s, float("nan"), n] for s, (_, n) in enumerate(rows))
    code, out, _ = _cli(capsys, str(path))
    assert code == 0
    assert out.splitlines()[0] == (
        "verdict: healthy (judged on the gradient norm alone: no finite loss was read; "
        "no blow-up, non-finite, spiking or vanishing gradients)"
    )


# ----------------------------------------------------------------------------- several runs


@pytest.fixture
def two_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str, str]:
    """runs/<blown>/ and runs/<calm>/ in SummaryWriter's default layout (SummaryWriter() twice, with a
    comment); returns the runs folder and the two run names (the one that blew up first)."""
    pytest.importorskip("tensorboard")
    monkeypatch.chdir(tmp_path)
    from torch.utils.tensorboard import SummaryWriter

    blown = _train(200, lr=3.0)
    calm = _train(150, lr=0.01)
    names = []
    for comment, rows in (("_a_blown", blown), ("_b_calm", calm)):
        writer = SummaryWriter(comment=comment)
        for step, (loss, norm) in enumerate(rows):
            writer.add_scalar("Loss/train", loss, step)
            writer.add_scalar("Grad/total_norm", norm, step)
        writer.close()
        names.append(Path(writer.log_dir).name)
    return tmp_path / "runs", names[0], names[1]


def test_two_runs_are_reported_one_by_one(
    two_runs: tuple[Path, str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A runs/ folder with two runs is never merged: each run gets its own report and verdict (the
    blown-up one exploding, the calm one healthy), with as many updates as its own events."""
    runs, blown, calm = two_runs
    assert tensorboard_runs(runs) == sorted([blown, calm])
    code, out, err = _cli(capsys, str(runs))
    assert code == 0 and err == ""
    first, order = sorted([blown, calm]), {blown: "exploding", calm: "healthy"}
    lines = out.splitlines()
    assert lines[0] == (
        f"{runs} holds 2 TensorBoard runs, each reported on its own (--run NAME picks one): "
        f"{', '.join(first)}"
    )
    heads = [i for i, line in enumerate(lines) if line.startswith("=== run ")]
    assert [lines[i] for i in heads] == [f"=== run {r} ===" for r in first]
    for i, run in zip(heads, first, strict=True):
        assert lines[i + 1].startswith(f"verdict: {order[run]}")
        n = len(_scalars(str(runs / run), "Grad/total_norm"))
        assert lines[i + 2].startswith(f"file: {runs / run} (TensorBoard; {n} updates, steps 0-{n - 1})")


def test_two_runs_as_json_and_run_picks_one(
    two_runs: tuple[Path, str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """--json on two runs: {"runs": [one report per run, each with its "run"]}; --run NAME reports that run
    alone, as reading its own folder does."""
    runs, blown, calm = two_runs
    code, out, _ = _cli(capsys, str(runs), "--json")
    both = json.loads(out)
    assert code == 0 and list(both) == ["runs"]
    assert [(r["run"], r["verdict"]) for r in both["runs"]] == sorted(
        [(blown, "exploding"), (calm, "healthy")]
    )
    code, out, _ = _cli(capsys, str(runs), "--run", calm, "--json")
    alone = json.loads(out)
    assert (code, alone["run"], alone["verdict"]) == (0, calm, "healthy")
    direct = analyze(read_log(runs / calm))
    assert alone["summary"] == json.loads(json.dumps(direct["summary"]))
    assert alone["summary"]["updates"] == len(_scalars(str(runs / calm), "Grad/total_norm"))


def test_several_runs_refused_where_one_is_needed(
    two_runs: tuple[Path, str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """read_log() of a folder of two runs, and --plot without --run, name the runs and --run; an unknown
    --run lists the runs; nothing is printed before the error."""
    runs, blown, calm = two_runs
    names = ", ".join(sorted([blown, calm]))
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{runs} holds 2 TensorBoard runs ({names}), which are never merged; pick one with --run NAME"
        ),
    ):
        read_log(runs)
    code, out, err = _cli(capsys, str(runs), "--plot", str(runs.parent / "p.png"))
    assert (code, out) == (2, "")
    assert err == (
        f"clipopt report: error: --plot draws one run and {runs} holds 2 TensorBoard runs ({names}); "
        "pick one with --run NAME\n"
    )
    code, out, err = _cli(capsys, str(runs), "--run", "nope")
    assert (code, out) == (2, "")
    assert (
        err
        == f"clipopt report: error: {runs} has no TensorBoard run 'nope' (--run nope); its runs: {names}\n"
    )


def test_add_scalars_folders_belong_to_their_run(tmp_path: Path) -> None:
    """SummaryWriter.add_scalars("Loss", {"train": ..., "test": ...}) writes a folder per key below the
    run: they are part of that run (one run, not three), and the two keys are not merged into one
    tag: the train key is read as the loss, the test key ignored."""
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    rows = _train(30, lr=0.01)
    writer = SummaryWriter(str(tmp_path / "runs" / "exp"))
    for step, (loss, norm) in enumerate(rows):
        writer.add_scalars("Loss", {"train": loss, "test": 2 * loss}, step)
        writer.add_scalar("Grad/total_norm", norm, step)
    writer.close()
    assert tensorboard_runs(tmp_path / "runs") == ["exp"]
    log = read_log(tmp_path / "runs")
    assert (log.loss_column, log.ignored) == ("Loss_train/Loss", ["Loss_test/Loss"])
    assert list(log.loss) == pytest.approx([v for v, _ in rows])


def test_run_option_on_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--run names a run of a folder: with a CSV file it is an error saying so."""
    path = tmp_path / "norms.csv"
    path.write_text("step,grad_norm\n1,1.0\n2,1.1\n")
    code, out, err = _cli(capsys, str(path), "--run", "a")
    assert (code, out) == (2, "")
    assert err == (
        f"clipopt report: error: --run a: {path} is a file, not a folder of TensorBoard runs; "
        "pass the folder\n"
    )


# ----------------------------------------------------------------------------- --plot's path


def test_plot_without_extension_says_the_file_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--plot emptydir (no extension; here an empty folder's name) writes emptydir.png, as matplotlib
    does, and the report says emptydir.png, the path actually written."""
    pytest.importorskip("matplotlib")
    path = tmp_path / "norms.csv"
    path.write_text(
        "step,grad_norm,loss\n" + "".join(f"{s},{n},{v}\n" for s, (v, n) in enumerate(_train(60, 0.01)))
    )
    (tmp_path / "emptydir").mkdir()
    code, out, _ = _cli(capsys, str(path), "--plot", str(tmp_path / "emptydir"))
    assert code == 0
    assert (tmp_path / "emptydir.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.rstrip().endswith(f"Plot written to {tmp_path / 'emptydir.png'}")


def test_plot_into_a_missing_folder_fails_before_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--plot into a folder that does not exist: exit 2 with one line naming it, and no report printed."""
    path = tmp_path / "norms.csv"
    path.write_text("step,grad_norm\n1,1.0\n2,1.1\n")
    target = tmp_path / "missing" / "p.png"
    code, out, err = _cli(capsys, str(path), "--plot", str(target))
    assert (code, out) == (2, "")
    assert err == (
        f"clipopt report: error: --plot {target}: the folder {tmp_path / 'missing'} does not exist; "
        "create it, or pass a path in an existing folder\n"
    )


def test_add_hparams_metrics_are_not_read_as_the_loss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SummaryWriter.add_hparams writes its metrics (``hparam/loss``) as scalars in a folder below the run
    named by the time: a blown-up run logging ``train/epoch_loss`` (a loss name matched by pattern, not
    in the table) and ``add_hparams(..., {"hparam/loss": ...})`` at the end is read with its training
    loss (exploding), not with the one hparams point as the loss (healthy); the hparams tag is listed
    among the ignored ones."""
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    rows = _train(200, lr=3.0)
    writer = SummaryWriter(str(tmp_path / "tb"))
    for step, (loss, norm) in enumerate(rows):
        writer.add_scalar("train/epoch_loss", loss, step)
        writer.add_scalar("train/grad_norm", norm, step)
    writer.add_hparams({"lr": 3.0}, {"hparam/loss": rows[-1][0]})
    writer.close()
    (hparams,) = [p.name for p in (tmp_path / "tb").iterdir() if p.is_dir()]
    code, out, err = _cli(capsys, str(tmp_path / "tb"))
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == f"verdict: exploding (the loss blew up; step {_loss_onset([v for v, _ in rows])})"
    assert lines[2] == (
        "tags read: train/grad_norm as the norm, train/epoch_loss as the loss; "
        f"ignored: {hparams}/hparam/loss"
    )


@pytest.mark.parametrize(
    ("held_out", "train"),
    [
        ("valLoss", "trainLoss"),
        ("evalLoss", "trainLoss"),
        ("dev_loss", "epoch_loss"),
        ("loss/dev", "loss/epoch"),
    ],
)
def test_camel_case_and_dev_set_losses_are_not_the_training_loss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], held_out: str, train: str
) -> None:
    """A held-out loss named in camelCase (``valLoss``, ``evalLoss``) or after a dev set (``dev_loss``,
    ``loss/dev``), written before the training loss of a run that blew up, is not read as the loss
    (healthy, the held-out loss being flat); the training loss is (exploding), and the held-out one is
    listed as ignored."""
    rows = _train(200, lr=3.0)
    path = tmp_path / "run.csv"
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["step", held_out, train, "grad_norm"])
        out.writerows([step, 1.0, loss, norm] for step, (loss, norm) in enumerate(rows))
    code, out, _ = _cli(capsys, str(path))
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"verdict: exploding (the loss blew up; step {_loss_onset([v for v, _ in rows])})"
    assert lines[2] == f"columns read: grad_norm as the norm, {train} as the loss; ignored: {held_out}"


@pytest.mark.parametrize("spelling", ["{run}/", "./{run}", "{run}//"])
def test_run_option_accepts_the_folder_as_a_shell_completes_it(
    two_runs: tuple[Path, str, str], capsys: pytest.CaptureFixture[str], spelling: str
) -> None:
    """--run with the run's folder as tab completion writes it (``exp1/``) or as ``./exp1`` reads that
    run, as --run exp1 does (its report names the run ``exp1``), instead of "has no TensorBoard run"."""
    runs, blown, _ = two_runs
    code, out, err = _cli(capsys, str(runs), "--run", spelling.format(run=blown), "--json")
    assert (code, err) == (0, "")
    report = json.loads(out)
    assert (report["run"], report["verdict"]) == (blown, "exploding")


def test_an_unreadable_run_of_several_names_the_run_and_run_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Of two SummaryWriter runs, one logged no gradient norm (a run stopped before its first update):
    the report of the folder fails, and its error names that run, the other and --run NAME (how to
    report the readable one), not merely --norm NAME; --run picks the readable one."""
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    rows = _train(30, lr=0.01)
    for name, with_norm in (("good", True), ("stopped", False)):
        writer = SummaryWriter(str(tmp_path / "runs" / name))
        for step, (loss, norm) in enumerate(rows[: 30 if with_norm else 1]):
            writer.add_scalar("Loss/train", loss, step)
            if with_norm:
                writer.add_scalar("Grad/total_norm", norm, step)
        writer.close()
    runs = tmp_path / "runs"
    code, out, err = _cli(capsys, str(runs))
    assert (code, out) == (2, "")
    assert err.startswith(f"clipopt report: error: {runs / 'stopped'} has no gradient-norm scalar")
    assert err.rstrip("\n").endswith(
        f"; {runs} holds 2 TensorBoard runs (good, stopped): report a readable one with --run NAME"
    )
    code, out, _ = _cli(capsys, str(runs), "--run", "good")
    assert code == 0 and out.startswith("verdict: healthy")
