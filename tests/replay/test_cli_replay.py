"""``clipopt replay SNAPSHOT --model pkg.mod:factory --loss pkg.mod:fn [--json]``
(docs/cli.md, 'clipopt replay').

The snapshots come from real training runs of ``tests/replay_models.py``: the
log model with a batch that makes ``log`` see negative values (step 3), and the
same model with a NaN injected into the original run only (transient).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from clipopt._cli import main

from ..helpers import run_cli as run
from ..replay_models import BAD_ROW, LOG_BAD_UNITS, LOG_BAD_VALUE, batch, log_model, snapshots, train

REPO = Path(__file__).resolve().parents[2]
MODEL = "tests.replay_models:log_model"
LOSS = "tests.replay_models:mse"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The log run's snapshot ("log") and the transient run's ("transient")."""
    root = tmp_path_factory.mktemp("cli-replay")
    x, y = batch(2)
    x[BAD_ROW, 0] = LOG_BAD_VALUE
    train(log_model(), [batch(0), batch(1), (x, y)], root / "log")
    model = log_model()
    calls = [0]

    def nan_once(module: Any, args: Any, output: Any) -> Any:
        calls[0] += 1
        return output * math.nan if calls[0] == 2 else None

    model.act.register_forward_hook(nan_once)
    train(model, [batch(0), batch(1), batch(2)], root / "transient")
    return {"log": snapshots(root / "log")[0], "transient": snapshots(root / "transient")[0]}


def test_replay_text_names_operation_module_and_phase(
    files: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The account says what was compared, where the first non-finite value was made, and the cause."""
    code, out, err = run(capsys, "replay", files["log"], "--model", MODEL, "--loss", LOSS)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == f"clipopt replay {files['log']}"
    assert lines[1] == "  step 3, reason nonfinite"
    assert lines[2] == "  replayed 3 times: reproduced 3 of 3"
    assert lines[3] == "  total norm: snapshot nan, replay nan"
    assert lines[4] == "  replay loss: non-finite"
    assert lines[5] == "  non-finite gradients, snapshot: lin.weight, lin.bias, out.weight, out.bias"
    assert lines[6] == "  non-finite gradients, replay:   the same"
    assert "First non-finite value: forward, in act (LogFeatures), operator aten.log.default" in lines
    output = next(line for line in lines if line.startswith("  output:"))
    assert output.startswith(f"  output:  (8, 4) float32, {LOG_BAD_UNITS} nan, finite range [")
    assert lines[-1].startswith("Cause: operation -- the model made a non-finite value from finite inputs")


def test_replay_json(files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    """--json: the result's fields; non-finite numbers are the strings "nan"/"inf" (valid JSON)."""
    code, out, _ = run(capsys, "replay", files["log"], "--model", MODEL, "--loss", LOSS, "--json")
    assert code == 0
    data = json.loads(out, parse_constant=lambda name: pytest.fail(f"JSON constant {name}"))
    assert (data["reproduced"], data["cause"], data["phase"]) == (True, "operation", "forward")
    assert (data["module"], data["module_type"], data["op"]) == ("act", "LogFeatures", "aten.log.default")
    assert data["snapshot_norm"] == "nan" and data["replay_norm"] == "nan"
    assert data["output"]["nan"] == LOG_BAD_UNITS and data["output"]["shape"] == [8, 4]
    assert data["file"] == files["log"] and data["repeats"] == 3


def test_replay_transient_and_repeats(files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    """A transient NaN: reproduced 0 of --repeats, cause transient, no operator named."""
    argv = ["replay", files["transient"], "--model", MODEL, "--loss", LOSS, "--repeats", "2"]
    code, out, _ = run(capsys, *argv)
    assert code == 0
    assert "  replayed 2 times: reproduced 0 of 2" in out.splitlines()
    assert "First non-finite value" not in out
    code, out, _ = run(capsys, *argv[:-1], "1")
    assert "  replayed once: reproduced 0 of 1" in out.splitlines()
    assert out.splitlines()[-1].startswith("Cause: transient -- no replay showed the anomaly again")


@pytest.mark.parametrize(
    ("model", "loss", "message"),
    [
        ("nocolon", LOSS, "--model 'nocolon' is not module:name; pass e.g. --model mypkg.models:build"),
        (
            "tests.replay_models:nope",
            LOSS,
            "--model 'tests.replay_models:nope': tests.replay_models has no attribute 'nope'",
        ),
        (
            "tests.no_such_module:f",
            LOSS,
            "--model 'tests.no_such_module:f': cannot import tests.no_such_module "
            "(No module named 'tests.no_such_module')",
        ),
        (
            "tests.replay_models:BAD_ROW",
            LOSS,
            "--model 'tests.replay_models:BAD_ROW' is not callable (it is int)",
        ),
        (
            "builtins:dict",
            LOSS,
            "--model 'builtins:dict' returned dict; it must return the torch.nn.Module that was trained",
        ),
        (
            "tests.replay_models:radial_model",
            LOSS,
            "the snapshot's parameter 'lin.bias' is not in the model (Sequential, whose parameters are "
            "lin.weight, out.weight, out.bias); pass the model that was trained, built the same way",
        ),
    ],
)
def test_replay_bad_targets(
    files: dict[str, str], capsys: pytest.CaptureFixture[str], model: str, loss: str, message: str
) -> None:
    """A --model/--loss that cannot be used: exit 2 and one line on stderr naming it."""
    code, out, err = run(capsys, "replay", files["log"], "--model", model, "--loss", loss)
    assert (code, out) == (2, "")
    assert err == f"clipopt replay: error: {message}\n"


def test_replay_bad_files_and_repeats(
    files: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing file, a file that is not a snapshot, --repeats 0, --repeats abc: exit 2, one line each
    (argparse's usage first for the last)."""
    missing = str(tmp_path / "none.pt")
    code, _, err = run(capsys, "replay", missing, "--model", MODEL, "--loss", LOSS)
    assert (code, err) == (2, f"clipopt replay: error: {missing}: no such file\n")
    text = tmp_path / "notes.pt"
    text.write_text("hello")
    code, _, err = run(capsys, "replay", str(text), "--model", MODEL, "--loss", LOSS)
    assert code == 2 and err.startswith(f"clipopt replay: error: {text} is not a clipopt snapshot")
    code, _, err = run(capsys, "replay", files["log"], "--model", MODEL, "--loss", LOSS, "--repeats", "0")
    assert (code, err) == (2, "clipopt replay: error: --repeats must be at least 1, got 0\n")
    code, _, err = run(capsys, "replay", files["log"], "--model", MODEL, "--loss", LOSS, "--repeats", "abc")
    want = "clipopt replay: error: argument --repeats: must be a whole number, got 'abc'\n"
    assert code == 2 and err.endswith(want)


def test_replay_of_an_accumulated_window_with_a_one_batch_loss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A window of 2 micro-batches replayed with a loss for one batch: exit 2 and one line saying the
    attachments are lists of micro-batches and what --loss must do (before: a 40-line traceback)."""
    x, y = batch(3)
    x[BAD_ROW, 0] = LOG_BAD_VALUE
    train(log_model(), [batch(0), batch(1), batch(2), (x, y)], tmp_path / "window", accumulation_steps=2)
    code, out, err = run(
        capsys, "replay", snapshots(tmp_path / "window")[0], "--model", MODEL, "--loss", LOSS
    )
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("clipopt replay: error: replay(): loss_fn raised TypeError (")
    assert "accumulated 2 micro-batches: each attached name ('inputs', 'targets') is a list" in err


def test_replay_tells_the_users_bug_from_bad_input(
    files: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A loss function that returns no loss is bad input: exit 2 and one line.  A ValueError raised by
    the user's own loss function is their bug: it propagates with its traceback instead of being
    shown as one line as if the snapshot did not fit (what the command did before)."""
    script = tmp_path / "user_losses.py"
    script.write_text(
        "from tests.replay_models import log_model\n"
        "def build():\n    return log_model()\n"
        "def nothing(model, attached):\n    return None\n"
        "def buggy(model, attached):\n    raise ValueError('a bug in my loss')\n"
    )
    code, _, err = run(
        capsys, "replay", files["log"], "--model", f"{script}:build", "--loss", f"{script}:nothing"
    )
    want = "replay(): loss_fn returned NoneType; return the loss as a tensor with one element"
    assert (code, err) == (2, f"clipopt replay: error: {want}\n")
    with pytest.raises(ValueError) as info:
        main(["replay", files["log"], "--model", f"{script}:build", "--loss", f"{script}:buggy"])
    assert info.value.args == ("a bug in my loss",)


def test_replay_shows_an_import_error_inside_the_users_module_with_its_traceback(
    files: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A module named by --model that is found but fails to import (it imports a package that is not
    installed) is the user's code failing: the error propagates with its traceback, instead of the
    one line "cannot import user_models.py", which read as if the file itself could not be found;
    a file or module that does not exist is still one line."""
    script = tmp_path / "user_models.py"
    script.write_text("import clipopt_no_such_dependency\ndef build():\n    return None\n")
    with pytest.raises(ModuleNotFoundError) as info:
        main(["replay", files["log"], "--model", f"{script}:build", "--loss", LOSS])
    assert info.value.name == "clipopt_no_such_dependency"
    missing = tmp_path / "absent.py"
    code, _, err = run(capsys, "replay", files["log"], "--model", f"{missing}:build", "--loss", LOSS)
    want = f"--model '{missing}:build': cannot import {missing} (no such file {missing})"
    assert (code, err) == (2, f"clipopt replay: error: {want}\n")
    code, _, err = run(capsys, "replay", files["log"], "--model", "no_such_pkg.models:build", "--loss", LOSS)
    want = (
        "--model 'no_such_pkg.models:build': cannot import no_such_pkg.models (No module named 'no_such_pkg')"
    )
    assert (code, err) == (2, f"clipopt replay: error: {want}\n")


def test_replay_loads_a_python_file(
    files: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--model and --loss may name a .py file instead of a module."""
    script = tmp_path / "train_script.py"
    script.write_text(
        "from tests.replay_models import log_model, mse\n"
        "def build():\n    return log_model()\n"
        "def loss(model, attached):\n    return mse(model, attached)\n"
    )
    argv = ["replay", files["log"], "--model", f"{script}:build", "--loss", f"{script}:loss"]
    code, out, _ = run(capsys, *argv)
    assert code == 0 and "operator aten.log.default" in out


def test_replay_python_file_imports_its_neighbours_and_runs_once(
    files: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A .py file given to --model and --loss may import a module next to it (as ``python file.py``
    can), and runs once for both options (its classes are the same objects for both)."""
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    (folder / "replay_neighbour_defs.py").write_text("from tests.replay_models import log_model, mse\n")
    script = folder / "replay_neighbour_train.py"
    script.write_text(
        "import pathlib\n"
        "import replay_neighbour_defs\n"
        "with open(pathlib.Path(__file__).with_suffix('.runs'), 'a') as f:\n    f.write('ran\\n')\n"
        "def build():\n    return replay_neighbour_defs.log_model()\n"
        "def loss(model, attached):\n    return replay_neighbour_defs.mse(model, attached)\n"
    )
    argv = ["replay", files["log"], "--model", f"{script}:build", "--loss", f"{script}:loss"]
    code, out, err = run(capsys, *argv)
    assert (code, err) == (0, "")
    assert (folder / "replay_neighbour_train.runs").read_text() == "ran\n"
    assert "First non-finite value: forward, in act (LogFeatures), operator aten.log.default" in out


def test_inspect_points_to_replay(files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    """``clipopt inspect`` ends with the replay command for its file."""
    code, out, _ = run(capsys, "inspect", files["log"])
    assert code == 0
    assert (
        f"Replay: clipopt replay {files['log']} --model pkg.mod:factory --loss pkg.mod:loss_fn names the "
        "operation, module and phase that went non-finite (clipopt.replay in Python)"
    ) in out.splitlines()


def test_replay_as_a_subprocess(files: dict[str, str]) -> None:
    """``python -m clipopt replay`` from the repository root imports tests.replay_models and works."""
    proc = subprocess.run(
        [sys.executable, "-m", "clipopt", "replay", files["log"], "--model", MODEL, "--loss", LOSS, "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["op"] == "aten.log.default"
