"""``clipopt report`` reads the per-group columns (``group_norm.<g>``, ``group_coef.<g>``) and tags.

The logs are written here by hand in CSVLogger's format; the expected medians and counts are
computed in the tests with NumPy from the sequences written.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from clipopt._cli import main
from clipopt._diagnostics.loggers import BASE_COLUMNS, format_value
from clipopt._report.report import analyze, format_report, read_log


def _write(path: Path, rows: int, torn_cell: bool = False) -> tuple[list[float], list[float], list[float]]:
    """A clipopt CSV with two groups; group 1 clipped (coef < 1) in every third row."""
    norms0 = [0.5 + 0.01 * i for i in range(rows)]
    norms1 = [2.0 + 0.1 * i for i in range(rows)]
    coefs1 = [0.25 if i % 3 == 0 else 1.0 for i in range(rows)]
    columns = [*BASE_COLUMNS, "lr.1", "group_norm.0", "group_coef.0", "group_norm.1", "group_coef.1"]
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for i in range(rows):
            total = math.hypot(norms0[i], norms1[i])
            base = [i + 1, 1, total, 1.0, coefs1[i] < 1, False, None, 1.0, 1e-3, 1e-3]
            cells = [*base, 1e-3, norms0[i], 1.0, norms1[i], coefs1[i]]
            row = [format_value(v) for v in cells]
            if torn_cell and i == 4:
                row[columns.index("group_norm.0")] = ""  # not recorded in this row
            w.writerow(row)
    return norms0, norms1, coefs1


@pytest.mark.parametrize("rows", [12, 40_000])
def test_group_columns_are_read_into_the_log(tmp_path: Path, rows: int) -> None:
    """Both the row-by-row and the chunked reader put each group's norm and coefficient into
    GradLog.groups, aligned with the rows; an empty cell reads as nan."""
    path = tmp_path / "grads.csv"
    norms0, norms1, coefs1 = _write(path, rows, torn_cell=True)
    log = read_log(path)
    assert sorted(log.groups) == [0, 1]
    assert len(log.groups[1]["norm"]) == rows
    np.testing.assert_allclose(list(log.groups[1]["norm"]), norms1)
    np.testing.assert_array_equal(list(log.groups[1]["coef"]), coefs1)
    got0 = list(log.groups[0]["norm"])
    assert math.isnan(got0[4])
    np.testing.assert_allclose(got0[:4] + got0[5:], norms0[:4] + norms0[5:])
    assert log.layers == {}  # group columns are not mistaken for per-layer ones


def test_report_summarises_each_group(tmp_path: Path) -> None:
    """The summary has one entry per group: median and max finite norm, clipped count and fraction
    (coefficient below 1); the text report prints a line per group."""
    path = tmp_path / "grads.csv"
    norms0, norms1, coefs1 = _write(path, 30)
    report = analyze(read_log(path))
    groups = report["summary"]["groups"]
    clipped = sum(c < 1 for c in coefs1)
    assert groups[0] == {
        "group": 0,
        "norm_median": pytest.approx(float(np.median(norms0))),
        "norm_max": pytest.approx(max(norms0)),
        "clipped": 0,
        "clipped_fraction": 0.0,
    }
    assert groups[1]["clipped"] == clipped == 10
    assert groups[1]["clipped_fraction"] == pytest.approx(10 / 30)
    assert groups[1]["norm_median"] == pytest.approx(float(np.median(norms1)))
    text = format_report(report)
    line = next(x for x in text.splitlines() if x.strip().startswith("group 1"))
    assert line.split("group 1", 1)[1].strip().endswith("; clipped 10 (33.3%)")
    assert "median norm 3.45" in line  # median of 2.0 + 0.1 i, i < 30


def test_log_without_group_columns_has_no_groups(tmp_path: Path) -> None:
    """A log written without per-group clipping has an empty groups summary and no group line."""
    path = tmp_path / "plain.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(BASE_COLUMNS)
        for i in range(5):
            w.writerow([format_value(v) for v in (i + 1, 1, 1.0, 1.0, False, False, None, 1.0, 1e-3, 0.5)])
    report = analyze(read_log(path))
    assert report["summary"]["groups"] == []
    assert "group 0" not in format_report(report)


def test_cli_json_carries_the_groups(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`clipopt report --json` includes the per-group summary."""
    path = tmp_path / "grads.csv"
    _write(path, 9)
    assert main(["report", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [g["group"] for g in data["summary"]["groups"]] == [0, 1]
    assert data["summary"]["groups"][1]["clipped"] == 3


def test_tensorboard_group_tags_are_read(tmp_path: Path) -> None:
    """clipopt/group_norm/<g> and clipopt/group_coef/<g> scalars in a TensorBoard folder are read per
    step into GradLog.groups."""
    pytest.importorskip("tensorboard", reason="reading TensorBoard logs needs the extra clipopt[tensorboard]")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    for step in range(1, 6):
        writer.add_scalar("clipopt/total_norm", 1.0 + step, step)
        writer.add_scalar("clipopt/group_norm/0", 0.5 * step, step)
        writer.add_scalar("clipopt/group_coef/0", 1.0 if step < 4 else 0.5, step)
    writer.close()
    log = read_log(tmp_path / "tb")
    assert list(log.groups[0]["norm"]) == pytest.approx([0.5 * s for s in range(1, 6)])
    assert list(log.groups[0]["coef"]) == [1.0, 1.0, 1.0, 0.5, 0.5]
    assert analyze(log)["summary"]["groups"][0]["clipped"] == 2
