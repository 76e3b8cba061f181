"""``clipopt inspect FILE [--json]`` (docs/cli.md, 'clipopt inspect'): which parameters went bad,
and their statistics.

The snapshots come from the ``Linear -> GuardedSqrt -> Linear`` model of
``test_snapshots``: its bad batch gives ``lin1`` (and only ``lin1``) non-finite
gradients at step 3, 6 elements of ``lin1.weight`` and 2 of ``lin1.bias``.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import clipopt
from clipopt._cli import main
from clipopt._replay.inspect import rank_parameters

from ..diagnostics.test_snapshots import BAD_UNITS, BATCH, IN, OUT, make_snapshot
from ..helpers import run_cli as run

# Most tests here use unnamed parameters on purpose; the warning about it is tested elsewhere.
pytestmark = pytest.mark.filterwarnings("ignore:snapshot_dir is set but the parameters have no names")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The path of the step-3 snapshot (written once for the module)."""
    path, _ = make_snapshot(tmp_path_factory.mktemp("snaps"))
    return path


def table_names(out: str) -> list[str]:
    """Parameter names in the order of the text output's table."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["name", "shape"]) + 1
    names = []
    for line in lines[start:]:
        if not line.strip():
            break
        names.append(line.split()[0])
    return names


def reject_constant(name: str) -> Any:
    raise ValueError(f"invalid JSON constant {name}")


# ----------------------------------------------------------------------------- text


def test_inspect_text_names_the_bad_layer_first(snapshot: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The text output shows step, reason and norm, ranks lin1's parameters first, and the attached shapes."""
    code, out, err = run(capsys, "inspect", snapshot)
    assert code == 0 and err == ""
    names = table_names(out)
    assert names[:2] == ["lin1.weight", "lin1.bias"] and sorted(names[2:]) == ["lin2.bias", "lin2.weight"]
    header = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:8] if line.strip()}
    assert header["step"] == ["3"]
    assert header["reason"] == ["nonfinite"]
    assert header["total_norm"][0] == "nan"
    assert header["micro_batches"] == ["1"]
    assert f"clipopt {clipopt.__version__}" in out and f"torch {torch.__version__}" in out
    assert "2 of 4 parameters have non-finite gradients; first: lin1.weight" in out
    row = next(line.split() for line in out.splitlines() if line.strip().startswith("lin1.weight"))
    assert row[1:4] == ["(4,", "3)", str(BAD_UNITS * IN)]
    assert row[4:7] == ["nan", "nan", "nan"]
    assert f"inputs: tensor {(BATCH, IN)} float32" in out
    assert f"targets: tensor {(BATCH, OUT)} float32" in out
    assert "model.load_state_dict(snap['params'], strict=False)" in out


def test_inspect_ranks_by_gradient_norm_without_nonfinite(
    tmp_path: Path, snapshot: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without non-finite elements (e.g. a spike) parameters are listed by gradient norm, largest first."""
    snap = clipopt.load_snapshot(snapshot)
    norms = {"lin1.weight": 0.5, "lin1.bias": 3.0, "lin2.weight": 0.1, "lin2.bias": 2.0}
    for name, stats in snap["layer_stats"].items():
        stats.update(nonfinite=0.0, grad_norm=norms[name], grad_max=1.0, grad_min=0.0)
    snap.update(reason="spike", total_norm=123.0, attached={"inputs": [torch.ones(2, 3), torch.ones(2, 3)]})
    path = tmp_path / "spike.pt"
    torch.save(snap, path)
    code, out, _ = run(capsys, "inspect", str(path))
    assert code == 0
    assert table_names(out) == ["lin1.bias", "lin2.bias", "lin1.weight", "lin2.weight"]
    assert "no parameter has non-finite gradient elements" in out
    assert "inputs: list of 2" in out and "[1]: tensor (2, 3) float32" in out


def test_rank_parameters_order() -> None:
    """Most non-finite elements first; then an inf norm, finite norms descending, no gradient last."""
    nan, inf = math.nan, math.inf
    rows = [
        {"name": "no_grad", "nonfinite": 0, "grad_norm": nan},
        {"name": "small", "nonfinite": 0, "grad_norm": 0.1},
        {"name": "few_bad", "nonfinite": 1, "grad_norm": nan},
        {"name": "overflow", "nonfinite": 0, "grad_norm": inf},
        {"name": "big", "nonfinite": 0, "grad_norm": 10.0},
        {"name": "many_bad", "nonfinite": 9, "grad_norm": nan},
    ]
    ranked = [r["name"] for r in rank_parameters(rows)]
    assert ranked == ["many_bad", "few_bad", "overflow", "big", "small", "no_grad"]


def _overflow_snapshot(directory: Path, scaler: torch.amp.GradScaler) -> str:
    """The snapshot of one GradScaler window whose gradients overflow (reason "overflow")."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = clipopt.ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler, snapshot_dir=directory
    )
    x = torch.ones(4, 3)
    x[0, 0] = math.inf
    scaler.scale(model(x).sum()).backward()
    opt.step()
    assert opt.last_snapshot is not None and opt.last_stats is not None
    assert opt.last_stats.reason == "overflow"
    return opt.last_snapshot


def test_inspect_shows_the_loss_scale_of_an_overflow(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A GradScaler run's overflow snapshot: the text has a "scale" line with the window's loss scale
    and --json its value; a snapshot without a scaler has neither the line nor a value."""
    path = _overflow_snapshot(tmp_path, torch.amp.GradScaler("cpu", init_scale=2.0**10))
    code, out, _ = run(capsys, "inspect", path)
    assert code == 0 and "  scale          1024  (the GradScaler's loss scale)" in out.splitlines()
    code, out, _ = run(capsys, "inspect", path, "--json")
    assert code == 0 and json.loads(out)["scale"] == 1024.0
    plain, _ = make_snapshot(tmp_path / "plain")
    _, out, _ = run(capsys, "inspect", plain)
    assert not any(line.split()[:1] == ["scale"] for line in out.splitlines())
    _, out, _ = run(capsys, "inspect", plain, "--json")
    assert json.loads(out, parse_constant=reject_constant)["scale"] is None


def test_inspect_shows_the_default_loss_scale_in_full(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """GradScaler's default scale 2**16 is shown as 65536, the value scaler.get_scale() gives, not
    rounded to four digits (before: "6.554e+04", a value the scaler never had)."""
    path = _overflow_snapshot(tmp_path, torch.amp.GradScaler("cpu"))
    code, out, _ = run(capsys, "inspect", path)
    assert code == 0 and "  scale          65536  (the GradScaler's loss scale)" in out.splitlines()


# ----------------------------------------------------------------------------- json


def test_inspect_json(snapshot: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--json prints strictly valid JSON (non-finite numbers as strings) with the same content as the text."""
    code, out, err = run(capsys, "inspect", snapshot, "--json")
    assert code == 0 and err == ""
    data = json.loads(out, parse_constant=reject_constant)
    assert {"file", "step", "reason", "total_norm", "micro_batches", "time", "versions", "parameters"} <= set(
        data
    )
    assert {"nonfinite_parameters", "optimizer", "attached"} <= set(data)
    assert data["file"] == snapshot
    assert data["step"] == 3 and data["reason"] == "nonfinite" and data["micro_batches"] == 1
    assert data["total_norm"] == "nan"
    assert data["versions"]["clipopt"] == clipopt.__version__
    params = data["parameters"]
    assert [p["name"] for p in params][:2] == ["lin1.weight", "lin1.bias"]
    assert data["nonfinite_parameters"] == ["lin1.weight", "lin1.bias"]
    first = params[0]
    assert list(first) == [
        "name",
        "shape",
        "nonfinite",
        "grad_norm",
        "grad_max",
        "grad_min",
        "param_norm",
        "has_grad",
    ]
    assert first["shape"] == [4, 3] and first["nonfinite"] == BAD_UNITS * IN and first["grad_norm"] == "nan"
    assert isinstance(first["param_norm"], float) and first["has_grad"] is True
    snap = clipopt.load_snapshot(snapshot)
    for p in params[2:]:
        assert p["nonfinite"] == 0
        assert p["grad_norm"] == pytest.approx(snap["layer_stats"][p["name"]]["grad_norm"])
    assert data["attached"]["inputs"] == {
        "type": "tensor",
        "shape": [BATCH, IN],
        "dtype": "float32",
        "nonfinite": 0,
    }
    assert data["attached"]["targets"]["shape"] == [BATCH, OUT]
    assert data["optimizer"]["param_groups"] == 1 and data["optimizer"]["lr"] == [0.01]


def test_inspect_json_describes_nested_attachments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Lists, dicts, numbers, strings and None attached are described in JSON; inf counts as non-finite."""
    model = torch.nn.Linear(2, 1)
    opt = clipopt.ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), snapshot_dir=tmp_path)
    x = torch.tensor([[math.inf, 1.0]])
    model(x).sum().backward()
    opt.attach(inputs=x, meta={"epoch": 2, "tag": "b7", "none": None, "ids": torch.arange(3)})
    opt.attach(inputs=x)
    opt.step()
    code, out, _ = run(capsys, "inspect", opt.last_snapshot or "")
    assert code == 0
    assert "parameter names are positional" in out  # no param_names: load_state_dict cannot use them
    code, out, _ = run(capsys, "inspect", "--json", opt.last_snapshot or "")
    assert code == 0
    attached = json.loads(out, parse_constant=reject_constant)["attached"]
    assert attached["inputs"]["type"] == "list" and len(attached["inputs"]["items"]) == 2
    assert attached["inputs"]["items"][0] == {
        "type": "tensor",
        "shape": [1, 2],
        "dtype": "float32",
        "nonfinite": 1,
    }
    meta = attached["meta"]["items"]
    assert meta["epoch"] == {"type": "int", "value": 2} and meta["tag"] == {"type": "str", "value": "b7"}
    assert meta["none"] == {"type": "None", "value": None}
    assert meta["ids"] == {"type": "tensor", "shape": [3], "dtype": "int64", "nonfinite": 0}


# ----------------------------------------------------------------------------- errors


def assert_one_line_error(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("clipopt inspect: error: ")
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err


def test_inspect_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing file: exit code 2 and one line on stderr naming it."""
    missing = str(tmp_path / "nope.pt")
    assert_one_line_error(*run(capsys, "inspect", missing), missing, "no such file")


@pytest.mark.parametrize("kind", ["state_dict", "text", "pickle", "directory", "damaged"])
def test_inspect_not_a_snapshot(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Not a snapshot (another .pt, text, a pickle torch refuses, a folder, a damaged one): exit 2, one line.

    torch's own warnings about such files are not shown either.
    """
    path = tmp_path / "file.pt"
    if kind == "state_dict":
        torch.save(torch.nn.Linear(2, 1).state_dict(), path)
        expected = "is not a clipopt snapshot"
    elif kind == "text":
        path.write_text("step,total_norm\n1,0.5\n")
        expected = "is not a clipopt snapshot"
    elif kind == "pickle":
        path.write_bytes(pickle.dumps(Path("x")))  # weights_only refuses it, with a many-line message
        expected = "is not a clipopt snapshot"
    elif kind == "directory":
        path.mkdir()
        expected = "is a directory"
    else:
        torch.save({"format": 1, "step": 3}, path)
        expected = "damaged clipopt snapshot"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        result = run(capsys, "inspect", str(path))
    assert_one_line_error(*result, str(path), expected)
    assert [str(w.message) for w in record] == []


def test_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    """No command, or inspect without a file: exit code 2 with usage on stderr; --help exits 0."""
    assert main([]) == 2
    assert "inspect" in capsys.readouterr().err
    assert main(["inspect"]) == 2
    assert "the following arguments are required: file" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "inspect" in capsys.readouterr().out


# ----------------------------------------------------------------------------- python -m clipopt


def test_python_m_clipopt_inspect(snapshot: str) -> None:
    """``python -m clipopt inspect FILE`` works in a fresh interpreter, and its error path exits 2."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    ok = subprocess.run(
        [sys.executable, "-m", "clipopt", "inspect", snapshot],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert "lin1.weight" in ok.stdout and "nonfinite" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "clipopt", "inspect", snapshot + ".missing"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
