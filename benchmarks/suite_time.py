"""How long the test suite takes: the quick loop and the full suite, timed on this machine.

    python benchmarks/suite_time.py          # both runs (several minutes), then the record

Runs the README's two test commands (``python -m pytest -m "not slow" -q`` and ``python -m pytest
-q``), reads their summary lines (passed, skipped, deselected) and times them, with the machine's
load average before each run, and writes ``benchmarks/results/suite_time.{json,md}``.  The README's
'Development' section quotes the ``.md`` sentence (tests/project/test_docs.py checks it).  A run
that fails is recorded as such and the script exits 1.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench import cpu_name  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"

#: The README's two test commands, by name.
COMMANDS = {
    "quick": [sys.executable, "-m", "pytest", "-m", "not slow", "-q", "-p", "no:cacheprovider"],
    "full": [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
}


def counts(summary: str) -> dict[str, int]:
    """``{"passed": 1919, "skipped": 37, ...}`` from pytest's last line ("1919 passed, 37 skipped ...")."""
    return {
        word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)", summary)
    }


def run(name: str) -> dict[str, Any]:
    load = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(COMMANDS[name], cwd=ROOT, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    summary = next((line for line in reversed(lines) if re.search(r"\d+ (passed|failed)", line)), "")
    return {
        "seconds": round(seconds),
        "load_before": round(load, 1),
        "returncode": done.returncode,
        **counts(summary),
    }


def sentence(record: dict[str, Any]) -> str:
    """The README's sentence for ``record``."""
    q, f = record["runs"]["quick"], record["runs"]["full"]
    return (
        f"Measured on {record['machine']['cpu']} ({record['machine']['cores']} cores, torch "
        f"{record['machine']['torch']}, {record['date']}): the quick loop ran {q['passed']} tests "
        f"({q.get('skipped', 0)} skipped, {q.get('deselected', 0)} slow ones left out) in {q['seconds']} s "
        f"at a load average of {q['load_before']}; the full suite, which CI runs, {f['passed']} tests "
        f"({f.get('skipped', 0)} skipped) in {f['seconds']} s at a load average of {f['load_before']}."
    )


def main() -> int:
    runs = {name: run(name) for name in COMMANDS}
    record = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__},
        "runs": runs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "suite_time.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    (RESULTS / "suite_time.md").write_text(sentence(record) + "\n", encoding="utf-8")
    print(sentence(record))
    return 0 if all(r["returncode"] == 0 for r in runs.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
