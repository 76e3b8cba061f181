"""The ``clipopt`` command line as a newcomer meets it: usage errors, help, names, the demo's output."""

from __future__ import annotations

import argparse
import pickle
import re
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

import clipopt
from clipopt import _cli, _demo

from ..helpers import run_cli as run

REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- usage errors


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--steps", "abc", "argument --steps: must be a whole number >= 2, got 'abc'"),
        ("--steps", "1", "argument --steps: must be a whole number >= 2, got '1'"),
        ("--seed", "x", "argument --seed: must be a whole number, got 'x'"),
        ("--threads", "0", "argument --threads: must be a whole number >= 1, got '0'"),
    ],
)
def test_demo_bad_number_names_the_argument(
    capsys: pytest.CaptureFixture[str], option: str, value: str, message: str
) -> None:
    """A bad demo number is a usage error (exit 2) naming the option and the value, under the demo's usage."""
    code, out, err = run(capsys, "demo", option, value)
    assert code == 2 and out == ""
    assert err.startswith("usage: clipopt demo ")
    assert err.splitlines()[-1] == f"clipopt demo: error: {message}"


@pytest.mark.parametrize("command", [["demo"], ["report", "grads.csv"], ["inspect", "snap.pt"]])
def test_unknown_flag_after_a_subcommand_prints_that_usage(
    capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    """An unknown flag after a subcommand is reported with the subcommand's usage, not the top-level one."""
    code, out, err = run(capsys, *command, "--bogus")
    assert code == 2 and out == ""
    assert err.startswith(f"usage: clipopt {command[0]} ")
    assert err.splitlines()[-1] == f"clipopt {command[0]}: error: unrecognized arguments: --bogus"


def test_unknown_flag_before_a_command_prints_the_top_level_usage(capsys: pytest.CaptureFixture[str]) -> None:
    """Without a subcommand the top-level usage is the right one."""
    code, _, err = run(capsys, "--bogus")
    assert code == 2
    assert err.startswith("usage: clipopt [-h]")


def test_inspect_of_a_csv_log_says_it_is_not_a_snapshot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`clipopt inspect grads.csv` says the file is a text file, not a snapshot, and points to `report`."""
    path = tmp_path / "grads.csv"
    path.write_text("step,total_norm\n1,0.5\n2,0.7\n")
    code, out, err = run(capsys, "inspect", str(path))
    assert code == 2 and out == ""
    assert err == (
        f"clipopt inspect: error: {path} is not a clipopt snapshot: it is a text file, not one torch.save "
        "wrote (a training log? clipopt report reads those); pass a file that "
        "ClippedOptimizer(snapshot_dir=...) wrote (anomaly-step*.pt)\n"
    )


@pytest.mark.parametrize(
    ("content", "reason"),
    [(b"", "the file is empty"), (b"\x00\x01\x02binary", "it is not a file that torch.save wrote")],
)
def test_load_snapshot_names_why_a_file_is_not_one(tmp_path: Path, content: bytes, reason: str) -> None:
    """Empty and foreign binary files are refused before torch.load, with the reason."""
    path = tmp_path / "x.pt"
    path.write_bytes(content)
    with pytest.raises(ValueError) as info:
        clipopt.load_snapshot(path)
    assert str(info.value) == (
        f"{path} is not a clipopt snapshot: {reason}; "
        "pass a file that ClippedOptimizer(snapshot_dir=...) wrote (anomaly-step*.pt)"
    )


# ----------------------------------------------------------------------------- help and names


@pytest.mark.parametrize("command", [[], ["demo"], ["report"], ["inspect"]])
def test_help_names_no_private_module(capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    """No --help text sends the user to a private module (clipopt._something)."""
    code, out, _ = run(capsys, *command, "--help")
    assert code == 0 and out.startswith("usage: clipopt")
    assert "clipopt._" not in out.replace("\n", " ")


def test_demo_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    """`clipopt demo --help` states each option's default."""
    _, out, _ = run(capsys, "demo", "--help")
    flat = " ".join(out.split())
    for text in ("(default: 600)", "(default: 1)", "(default: clipopt- demo)", "(default: 1: the model"):
        assert text in flat, text


def test_nonfinite_error_shows_under_its_public_name() -> None:
    """The error shows as clipopt.NonFiniteGradientError in tracebacks and pickles by that name."""
    err = clipopt.NonFiniteGradientError(3, 7)
    line = traceback.format_exception_only(type(err), err)[-1]
    assert line.startswith("clipopt.NonFiniteGradientError: 3 consecutive updates had non-finite gradients")
    assert f"{type(err).__module__}.{type(err).__qualname__}" == "clipopt.NonFiniteGradientError"
    assert pickle.loads(pickle.dumps(type(err))) is clipopt.NonFiniteGradientError


@pytest.mark.parametrize("snapshot", [None, "/runs/anomaly-step00000007-nonfinite.pt"])
def test_nonfinite_error_unpickles_as_itself(snapshot: str | None) -> None:
    """An error raised in a worker process reaches the parent through pickle: it comes back as a
    NonFiniteGradientError with the same count, step, snapshot and message (before, unpickling
    raised TypeError: __init__ got the message as its only argument)."""
    err = clipopt.NonFiniteGradientError(3, 7, snapshot)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is clipopt.NonFiniteGradientError
    assert (back.count, back.step, back.snapshot, str(back)) == (3, 7, snapshot, str(err))


def test_nonfinite_error_keeps_its_notes_and_attributes_through_pickle() -> None:
    """What pickle keeps of any exception by default, its ``__dict__``, survives too: a note added
    with ``add_note()`` (e.g. which rank raised it) and an attribute set on it (before, the fields
    alone travelled and both were lost)."""
    err = clipopt.NonFiniteGradientError(3, 7)
    err.add_note("raised on rank 1")
    err.rank = 1  # type: ignore[attr-defined]
    back = pickle.loads(pickle.dumps(err))
    assert back.__notes__ == ["raised on rank 1"]
    assert back.rank == 1
    assert (back.count, back.step, back.snapshot, str(back)) == (3, 7, None, str(err))


def test_no_numpy_warning_without_numpy() -> None:
    """Where NumPy is not installed, `clipopt --version` prints its version and nothing on stderr.

    A fresh interpreter with ``sys.modules["numpy"] = None`` (what an absent package looks like to an
    import) runs the command line; torch would warn "Failed to initialize NumPy" at its import.
    """
    code = (
        "import sys; sys.modules['numpy'] = None; "
        "from clipopt._cli import main; raise SystemExit(main(['--version']))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0
    assert proc.stdout == f"clipopt {clipopt.__version__}\n"
    assert proc.stderr == ""


# ----------------------------------------------------------------------------- the demo's output


def _demo_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["demo", "--steps", "2", "--out", str(tmp_path), *extra]


def test_demo_shows_no_progress_off_a_terminal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Progress output goes to a terminal only: with stderr captured (not a tty) none is written."""
    _cli.main(_demo_args(tmp_path))
    err = capsys.readouterr().err
    assert "plain SGD" not in err and "clipopt:" not in err


def test_demo_shows_progress_on_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a terminal each run shows its progress (tqdm's bar, or a plain line without tqdm)."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    _cli.main(_demo_args(tmp_path))
    err = capsys.readouterr().err
    assert "plain SGD" in err and "clipopt" in err


def test_demo_runs_on_the_stated_threads_and_restores_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo trains with --threads torch threads (default 1) and gives the caller's setting back."""
    seen: list[int] = []
    real = _demo.run_demo

    def recording(*args: object, **kwargs: object) -> _demo.DemoResult:
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_demo, "run_demo", recording)
    before = torch.get_num_threads()
    _cli.main(_demo_args(tmp_path))
    _cli.main(_demo_args(tmp_path, "--threads", "2"))
    capsys.readouterr()
    assert seen == [1, 2]
    assert torch.get_num_threads() == before


def test_demo_says_when_plots_are_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without matplotlib the demo says the plots were skipped and why, and still writes logs and reports."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    _cli.main(_demo_args(tmp_path, "--no-progress"))
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "clipopt demo: plots skipped: matplotlib is not installed (pip install 'clipopt[demo]'); "
        "the CSV logs and reports are written"
    ]
    assert (tmp_path / "report.txt").exists() and not (tmp_path / "demo.png").exists()


def test_command_line_page_documents_every_command() -> None:
    """docs/cli.md has a section for each subcommand of the parser, and says how many there are."""
    parser = _cli.build_parser()
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    commands = sorted(actions[0].choices)
    text = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text(encoding="utf-8")
    heads = [line for line in text.splitlines() if line.startswith("## clipopt ")]
    sections = sorted(line.removeprefix("## clipopt ") for line in heads)
    assert sections == commands
    words = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}
    assert f"has {words[len(commands)]} commands" in text


def test_the_version_has_one_place() -> None:
    """pyproject.toml takes the package version from clipopt/_version.py (``dynamic``) instead of
    holding a second copy that could drift from ``clipopt.__version__`` and ``clipopt --version``."""
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    project = text.split("[project]", 1)[1].split("\n[", 1)[0]
    assert not re.search(r"^version\s*=", project, re.M)
    assert re.search(r'^dynamic\s*=\s*\[[^\]]*"version"', project, re.M)
    assert 'version = { attr = "clipopt._version.__version__" }' in text
