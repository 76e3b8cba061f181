"""The digest of the results file that ``clipopt report`` quotes in its advice.

``python -m benchmarks.stability`` (the full run) writes it to ``clipopt/_report/evidence.json``,
beside the code that reads it (:mod:`clipopt._report.evidence`): the package cannot read
``benchmarks/results/`` once installed.  Every number in it is one of the summary's, copied, never
computed again; tests/project/test_bench_stability.py checks the packaged file against the results
file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: Where the package keeps the digest.
PACKAGED = Path(__file__).resolve().parents[2] / "clipopt" / "_report" / "evidence.json"

#: The summary's fields of a treatment that the advice quotes.
TREATMENT_FIELDS = ("mean_best_loss", "max_logit", "clipped", "update_clipped", "skipped", "windows")


def digest(results: dict[str, Any]) -> dict[str, Any]:
    """The advice's figures from a (full) results file: the run's shape, per treatment its verdict
    against the plain baseline, best-lr loss, final loss at the largest learning rate and counts, and
    per data fault each treatment's held-out loss against its clean run."""
    s, summary = results["settings"], results["summary"]
    largest = f"{max(s['lrs']):g}"
    treatments = {}
    for name, e in summary["treatments"].items():
        v = e.get("verdict")
        treatments[name] = {
            **{k: e[k] for k in TREATMENT_FIELDS},
            "loss_at_largest_lr": e["loss_by_lr"].get(largest),
            "vs_none": None if v is None else v["mean_difference"],
            "lower_on_every_seed": None if v is None else v["lower_on_every_seed"],
        }
    faults = {
        name: {f: row["vs_clean"] for f, row in by_fault.items() if f != "clean"}
        for name, by_fault in summary["faults"].items()
    }
    return {
        "page": "docs/which-tool.md",
        "layers": s["layers"],
        "updates": s["updates"],
        "lrs": s["lrs"],
        "seeds": len(s["seeds"]),
        "controls": ["qk-layernorm", "z-loss"],
        "reproduced": summary["reproduced"],
        "tolerance": summary["best_loss_tolerance"],
        "fault_start": summary["fault_start"],
        "fault_lr": s["fault_lr"],
        "fault_seeds": len(s["fault_seeds"]),
        "fault_length": summary["fault_length"],
        "treatments": treatments,
        "faults": faults,
    }


def write(results: dict[str, Any], path: Path = PACKAGED) -> None:
    path.write_text(json.dumps(digest(results), indent=1, sort_keys=True) + "\n", encoding="utf-8")
