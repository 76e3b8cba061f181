"""``clipopt report`` on hostile, torn or odd input: one clear error line or a verdict, never a traceback."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from clipopt._cli import main
from clipopt._report.report import analyze, read_log

from ..helpers import run_cli

HEADER = "step,micro_batches,total_norm,clip_coef,clipped,skipped,reason,max_norm,lr,loss\n"


def _rows(norms: list[str]) -> str:
    return HEADER + "".join(f"{i + 1},1,{x},1.0,0,0,,,0.1,\n" for i, x in enumerate(norms))


def _cli(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
    return run_cli(capsys, "report", str(path), *extra)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is empty; expected a training log"),
        (b"\x00\x01\x02PK\x03\x04" + bytes(range(256)) * 4, "is not a text file (binary data)"),
        (bytes(range(128, 256)) * 30, "is not a text file (binary data)"),
        (HEADER.encode(), "has a header but no row with a gradient norm yet"),
        (
            b"epoch,accuracy\n1,0.5\n",
            "has no gradient-norm column; expected a step column and a gradient-norm",
        ),
        ((_rows(["1.0", "abc", "1.0"])).encode(), "line 3: column total_norm holds 'abc', not a number"),
        (
            (_rows(["1.0"]) + "x,1,1.0,1.0,0,0,,,0.1,\n").encode(),
            "line 3: column step holds 'x', not a number",
        ),
        (
            (_rows(["1.0"]) + "2.5,1,1.0,1.0,0,0,,,0.1,\n").encode(),
            "line 3: step must be an integer, got '2.5'",
        ),
        (
            (_rows(["1.0"]) + "2,1\n" + "3,1,1.0,1.0,0,0,,,0.1,\n").encode(),
            "line 3: 2 cells where the header has 10",
        ),
        (b"{not json", "is not valid JSON"),
        (b'{"log_history": [{"step": 1, "loss": 2.0}]}', "has no 'grad_norm' in its log_history"),
        (b'["a"]', "is JSON without a 'log_history' list"),
    ],
)
def test_bad_files_give_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, message: str
) -> None:
    """Each bad file: exit code 2 and exactly one line on stderr naming the file and the problem."""
    path = tmp_path / "log.csv"
    path.write_bytes(content)
    code, out, err = _cli(path, capsys)
    assert code == 2 and out == ""
    assert err.startswith(f"clipopt report: error: {path}") and err.count("\n") == 1
    assert message in err
    with pytest.raises(ValueError, match="^" + str(path).replace("\\", "\\\\")):
        read_log(path)


def test_missing_file_and_empty_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing path and a folder without a log are one error line each."""
    code, _, err = _cli(tmp_path / "nope.csv", capsys)
    assert code == 2 and err == f"clipopt report: error: {tmp_path / 'nope.csv'}: no such file\n"
    code, _, err = _cli(tmp_path, capsys)
    assert code == 2 and "is a folder without a training log" in err and err.count("\n") == 1


def test_torn_last_row_is_skipped_with_a_note(tmp_path: Path) -> None:
    """A last row cut short (a run killed while writing) is ignored and said so."""
    path = tmp_path / "g.csv"
    path.write_text(_rows(["1.0", "1.1", "0.9"]) + "4,1,1.")
    log = read_log(path)
    assert list(log.steps) == [1, 2, 3]
    assert any("line 5" in n and "ignored" in n for n in log.notes)


def test_byte_order_mark_is_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A CSV saved with a UTF-8 byte-order mark (Excel) is read, not refused as missing 'step'."""
    path = tmp_path / "bom.csv"
    path.write_bytes(b"\xef\xbb\xbf" + _rows(["1.0", "1.2", "0.8"] * 10).encode())
    log = read_log(path)
    assert list(log.steps) == list(range(1, 31))
    code, out, _ = _cli(path, capsys)
    assert code == 0 and out.startswith("verdict: healthy")


@pytest.mark.parametrize("big", ["1e200", "1e308", "1.7976931348623157e308"])
def test_huge_finite_norms_give_a_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], big: str
) -> None:
    """Finite but huge norms (no overflow in the statistics): exploding, and valid JSON."""
    norms = ["1.0", "1.1", "0.9"] * 10 + [big] * 10
    path = tmp_path / "huge.csv"
    path.write_text(_rows(norms))
    code, out, err = _cli(path, capsys, "--json")
    assert code == 0 and err == ""
    report = json.loads(out)
    assert report["verdict"] == "exploding" and report["findings"][0]["step"] == 31
    assert math.isfinite(report["suggested_max_norm"]) and report["suggested_max_norm"] < 2


def test_huge_norms_everywhere(tmp_path: Path) -> None:
    """Every norm at 1e308: a verdict (the sums are scaled, the spread is zero)."""
    path = tmp_path / "huge.csv"
    path.write_text(_rows(["1e308"] * 50))
    report = analyze(read_log(path))
    assert report["verdict"] == "healthy"
    assert [s["value"] for s in report["suggestions"] if s["name"] == "zclip"] == [1e308]


def test_nan_inf_cells_and_text_losses(tmp_path: Path) -> None:
    """nan/inf norms are non-finite updates; a non-finite loss reads as inf; a text loss is an error line."""
    path = tmp_path / "g.csv"
    body = "".join(
        f"{i},1,{'nan' if i == 20 else '-inf' if i == 21 else 1.0},1,0,0,,,0.1,{2.0}\n" for i in range(1, 41)
    )
    path.write_text(HEADER + body.replace("40,1,1.0,1,0,0,,,0.1,2.0", "40,1,1.0,1,0,0,,,0.1,nan"))
    log = read_log(path)
    assert log.loss[-1] == math.inf
    report = analyze(log)
    assert report["verdict"] == "nonfinite" and report["findings"][0]["step"] == 20
    path.write_text(HEADER + "1,1,1.0,1,0,0,,,0.1,low\n")
    with pytest.raises(ValueError, match="line 2: column loss holds 'low', not a number"):
        read_log(path)


def test_huge_file_is_streamed(tmp_path: Path) -> None:
    """200,000 rows with a long header read into one array per column (a verdict comes back)."""
    path = tmp_path / "big.csv"
    with path.open("w") as f:
        f.write(HEADER)
        for i in range(1, 200_001):
            f.write(f"{i},1,{1.0 + (i % 7) * 0.01},1,0,0,,,0.1,{3.0 - i * 1e-6}\n")
    log = read_log(path)
    assert len(log) == 200_000 and log.total_norm.typecode == "d"
    assert analyze(log)["verdict"] == "healthy"


def test_very_long_cell_is_an_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A cell longer than the csv module's field limit is refused in one line."""
    path = tmp_path / "long.csv"
    path.write_text(HEADER + "1,1," + "9" * 200_000 + ",1,0,0,,,0.1,\n")
    code, _, err = _cli(path, capsys)
    assert code == 2 and "is not readable as CSV" in err and err.count("\n") == 1


def test_cli_report_leaves_the_thread_count_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`clipopt report` computes with one torch thread but restores the caller's setting (in-process use)."""
    import torch

    path = tmp_path / "g.csv"
    path.write_text(_rows(["1.0", "1.1"] * 10))
    before = torch.get_num_threads()
    assert main(["report", str(path)]) == 0
    capsys.readouterr()
    assert torch.get_num_threads() == before


def test_constant_columns_read_like_varying_ones(tmp_path: Path) -> None:
    """Columns whose cells are all the same (lr, max_norm; an empty or an 'inf' loss) are read as that
    value on every row (converted once), and a constant text cell is still one error line."""
    head = "step,total_norm,lr,max_norm,loss\n"
    path = tmp_path / "const.csv"
    path.write_text(head + "".join(f"{i},{0.5 + i},0.001,1.0,inf\n" for i in range(1, 40)))
    log = read_log(path)
    assert list(log.lr) == [0.001] * 39 and list(log.max_norm) == [1.0] * 39
    assert list(log.loss) == [math.inf] * 39
    path.write_text(head + "".join(f"{i},{0.5 + i},fast,1.0,\n" for i in range(1, 40)))
    with pytest.raises(ValueError, match=r"line 2: column lr holds 'fast', not a number"):
        read_log(path)
