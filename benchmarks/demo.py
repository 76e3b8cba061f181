"""The figures of ``clipopt demo`` that the README and docs/getting-started.md quote, and docs/demo.png.

    python benchmarks/demo.py                     # this CPU's kernels, then avx2 and default (3-4 min)
    python benchmarks/demo.py --capabilities ""   # this CPU's kernels only

Runs the demo as ``clipopt demo`` does (the default configuration, one thread) once with the CPU's
own kernels and once per ``ATEN_CPU_CAPABILITY`` of ``--capabilities`` (each in its own process: the
variable is read when torch loads), and writes into ``--out``:

* ``demo.json``: per run the machine (CPU model, the kernels torch used, torch and Python versions),
  the summary ``clipopt demo --json`` prints, and the rows of the side-by-side table;
* ``demo.md``: the table of the native run as the README shows it (a ```text block), then the
  held-out losses of every run.

and copies the native run's plot to ``docs/demo.png``.  The plain run is chaotic once it has blown
up: its held-out loss and largest norm change with the CPU's vector width (and the corpus, the source
of Python's own ``argparse`` module, with the Python version), so the pages say where they were
measured; ``tests/project/test_docs.py`` checks that they quote this file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
#: The rows of ``clipopt demo``'s table that the pages show (the final training loss and the times
#: are left out: the time depends on the machine's load).
SHOWN_ROWS = (
    "",
    "blew up (onset, as clipopt report finds it)",
    "held-out loss, nats/char",
    "largest gradient norm (finite)",
    "updates applied / clipped / skipped",
    "clipopt report verdict",
)


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (``platform.processor()`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_once(out: Path) -> dict[str, Any]:
    """One demo in this process: the machine, the summary and the shown rows."""
    import torch

    from clipopt._demo import DemoConfig, _comparison_rows, run_demo, summary_dict
    from clipopt._report.text import json_safe

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as clipopt demo runs
    try:
        demo = run_demo(out, DemoConfig(), progress=False)
    finally:
        torch.set_num_threads(threads)
    rows = [list(row) for row in _comparison_rows(demo) if row[0] in SHOWN_ROWS]
    return {
        "machine": {
            "cpu": cpu_model(),
            "kernels": torch.backends.cpu.get_cpu_capability(),
            "ATEN_CPU_CAPABILITY": os.environ.get("ATEN_CPU_CAPABILITY"),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "summary": json_safe(summary_dict(demo)),
        "rows": rows,
    }


def text_block(rows: list[list[str]], baseline_line: str) -> str:
    """The table as the pages show it: aligned as ``clipopt demo`` prints it, then the baseline line."""
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"  {a:<{w0}}  {b:<{w1}}  {c}".rstrip() for a, b, c in rows]
    return "\n".join([*lines, baseline_line])


def baseline_line(summary: dict[str, Any]) -> str:
    """``Trivial baseline (...): 2.939 nats/char (uniform over 88 symbols: 4.477).``"""
    return (
        f"Trivial baseline (predict character frequencies): {summary['baseline_frequencies']:.3f} nats/char "
        f"(uniform over {summary['vocabulary']} symbols: {summary['baseline_uniform']:.3f})."
    )


def _num(value: Any, digits: int) -> str:
    """A recorded figure with ``digits`` decimals (json_safe wrote nan and inf as strings)."""
    return f"{value:.{digits}f}" if isinstance(value, int | float) else str(value)


def measured_line(record: dict[str, Any]) -> str:
    """Where and when the native run was measured, and how long its two runs took."""
    native = record["runs"][0]
    m, runs = native["machine"], native["summary"]["runs"]
    seconds = sum(r["seconds"] for r in runs.values())
    return (
        f"Measured with `python benchmarks/demo.py` on {m['cpu']} ({m['kernels']} kernels), "
        f"torch {m['torch']}, Python {m['python']}, {record['date']}; the two runs took {seconds:.0f} s."
    )


def kernels_line(record: dict[str, Any]) -> str:
    """What the other kernels' runs gave (empty when none ran)."""
    parts = []
    for run in record["runs"][1:]:
        plain, clipped = run["summary"]["runs"]["plain SGD"], run["summary"]["runs"]["clipopt"]
        loss, norm, ending = (
            _num(plain["heldout_loss"], 3),
            _num(plain["max_grad_norm"], 1),
            _num(clipped["heldout_loss"], 3),
        )
        parts.append(
            f"with `ATEN_CPU_CAPABILITY={run['machine']['ATEN_CPU_CAPABILITY']}` the plain run ends at "
            f"{loss} (largest norm {norm}, blew up at update {plain['blew_up_at']}) and the clipped one at "
            f"{ending} ({clipped['clipped']} clipped, {clipped['verdict']})"
        )
    return ("On the same machine " + "; ".join(parts) + ".") if parts else ""


def write_markdown(record: dict[str, Any], path: Path) -> None:
    """demo.md: where it was measured, the native run's table, the other kernels' figures."""
    runs = record["runs"]
    native = runs[0]
    lines = [
        measured_line(record),
        "",
        "```text",
        text_block(native["rows"], baseline_line(native["summary"])),
        "```",
        "",
        kernels_line(record),
        "",
        "| kernels | plain: held-out loss | plain: largest norm | clipopt: held-out loss | clipped |",
        "|---|---|---|---|---|",
    ]
    for run in runs:
        plain, clipped = run["summary"]["runs"]["plain SGD"], run["summary"]["runs"]["clipopt"]
        cells = [
            run["machine"]["kernels"],
            _num(plain["heldout_loss"], 3),
            _num(plain["max_grad_norm"], 1),
            _num(clipped["heldout_loss"], 3),
            str(clipped["clipped"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def run_in_process(capability: str | None, folder: Path) -> dict[str, Any]:
    """One demo in a new Python process (``ATEN_CPU_CAPABILITY=capability`` when given)."""
    env = dict(os.environ)
    env.pop("ATEN_CPU_CAPABILITY", None)
    if capability:
        env["ATEN_CPU_CAPABILITY"] = capability
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    code = "import json, sys; from benchmarks.demo import run_once; print(json.dumps(run_once(sys.argv[1])))"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(folder)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for demo.json and demo.md")
    parser.add_argument(
        "--capabilities", default="avx2,default", help="ATEN_CPU_CAPABILITY values to run besides the native"
    )
    parser.add_argument("--no-plot", action="store_true", help="leave docs/demo.png as it is")
    parser.add_argument("--markdown-only", action="store_true", help="rewrite demo.md from demo.json only")
    args = parser.parse_args()
    if args.markdown_only:
        record = json.loads((args.out / "demo.json").read_text(encoding="utf-8"))
    else:
        runs = []
        with tempfile.TemporaryDirectory() as tmp:
            for i, capability in enumerate([None, *filter(None, args.capabilities.split(","))]):
                folder = Path(tmp) / f"run{i}"
                runs.append(run_in_process(capability, folder))
                print(f"{runs[-1]['machine']['kernels']}: {runs[-1]['rows'][2]}", flush=True)
                if i == 0 and not args.no_plot and (folder / "demo.png").is_file():
                    shutil.copyfile(folder / "demo.png", ROOT / "docs" / "demo.png")
        args.out.mkdir(parents=True, exist_ok=True)
        record = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "runs": runs}
        (args.out / "demo.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    write_markdown(record, args.out / "demo.md")
    print((args.out / "demo.md").read_text(encoding="utf-8"))


if __name__ == "__main__":
    main()
