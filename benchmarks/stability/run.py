"""The command: run the cells that the results file lacks, then write the summary, plots and page.

    python -m benchmarks.stability                 # the full run, resumable (see benchmarks/README.md)
    python -m benchmarks.stability --workers 2     # two processes, one thread each
    python -m benchmarks.stability --quick         # smoke run: 1 seed, 3 learning rates, 8 updates
    python -m benchmarks.stability --report-only   # rewrite summary, plots and page from the file

The full run into benchmarks/results/ also writes the digest that ``clipopt report``'s advice quotes
(``clipopt/_report/evidence.json``, :mod:`benchmarks.stability.evidence`).

Every finished cell is written to the results file at once (atomically), keyed by
(treatment, lr, seed) or (treatment, fault, seed); a later run skips the cells the file holds,
so an interrupted run resumes where it stopped.  A file written under other settings is refused
(``--fresh`` starts it over), except that treatments added to the end of the lists extend it: their
cells are the ones missing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict
from datetime import datetime, timezone
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch

import clipopt
from benchmarks.bench import cpu_name

from . import evidence
from .data import Corpus, corpus
from .page import render_page
from .report import fault_key, fault_table_markdown, plot_logits, plot_sweep, summarize, sweep_key
from .train import FULL, QUICK, Settings, calibrate, cell_to_dict, train_cell
from .treatments import Bounds

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"

Task = tuple[str, str, float, int, "str | None"]  # (key, treatment, lr, seed, fault)


def tasks(s: Settings) -> list[Task]:
    """Every cell, in the order a partial run is most useful: the plain baseline and the positive
    controls on every seed first (whether the proxy reproduces the instability at all), then per
    seed the treatments and that seed's data-fault runs."""
    first = [name for name in s.treatments if name in CONTROLS]
    out: list[Task] = []
    for seed in s.seeds:
        for name in first:
            out.extend((sweep_key(name, lr, seed), name, lr, seed, None) for lr in s.lrs)
    for seed in s.seeds:
        for name in s.treatments:
            if name not in CONTROLS:
                out.extend((sweep_key(name, lr, seed), name, lr, seed, None) for lr in s.lrs)
        if seed in s.fault_seeds:
            for name in s.fault_treatments:
                out.extend((fault_key(name, f, seed), name, s.fault_lr, seed, f) for f in s.faults)
    return out


#: The baseline and the positive controls, run first.
CONTROLS = ("none", "qk-layernorm", "z-loss")


def _settings_json(s: Settings) -> dict[str, Any]:
    return json.loads(json.dumps(asdict(s)))


def load(path: Path, s: Settings, fresh: bool) -> dict[str, Any]:
    if path.exists() and not fresh:
        results: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        if _only_added_treatments(results.get("settings"), _settings_json(s)):
            results["settings"] = _settings_json(s)  # the new treatments' cells are missing: run next
        if results.get("settings") != _settings_json(s):
            raise SystemExit(
                f"{path} was written under other settings; pass --fresh to start it over, or --out to "
                "write elsewhere"
            )
        return results
    return {
        "benchmark": "stability",
        "settings": _settings_json(s),
        "calibration": None,
        "cells": {},
        "sessions": [],
    }


#: The settings a later run may extend at their end (new treatments: their cells are the missing ones).
EXTENSIBLE = ("treatments", "fault_treatments")


def _only_added_treatments(old: Any, new: dict[str, Any]) -> bool:
    """Whether settings ``old`` are ``new`` but for treatments added to the end of the lists
    (:data:`EXTENSIBLE`): a results file that such a run extends, since every cell it holds was
    measured under the new settings."""
    if not isinstance(old, dict) or old.keys() != new.keys() or old == new:
        return False
    rest_same = all(old[k] == new[k] for k in new if k not in EXTENSIBLE)
    return rest_same and all(list(new[k][: len(old[k])]) == list(old[k]) for k in EXTENSIBLE)


def save(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# Per worker process: the corpus and the bounds, set once.
_WORKER: dict[str, Any] = {}


def _init_worker(s: Settings, bounds: Bounds, threads: int) -> None:
    torch.set_num_threads(threads)
    _WORKER.update(settings=s, bounds=bounds, corpus=corpus(s.corpus_limit))


def _run_task(task: Task) -> tuple[str, dict[str, Any]]:
    key, name, lr, seed, fault = task
    s: Settings = _WORKER["settings"]
    c: Corpus = _WORKER["corpus"]
    cell = train_cell(s, name, lr, seed, c, _WORKER["bounds"], fault)
    return key, cell_to_dict(cell)


def _machine(workers: int, threads: int) -> dict[str, Any]:
    return {
        "host": platform.node(),
        "processor": cpu_name(),
        "cpus": os.cpu_count(),
        "workers": workers,
        "threads_per_worker": threads,
        "torch": torch.__version__,
        "clipopt": clipopt.__version__,
        "python": platform.python_version(),
    }


def run(
    s: Settings, path: Path, workers: int, threads: int, fresh: bool, limit: int | None, progress: bool
) -> dict[str, Any]:
    results = load(path, s, fresh)
    threads_before = torch.get_num_threads()  # restored at the end (the run sets its own)
    started = time.perf_counter()
    session: dict[str, Any] = {
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **_machine(workers, threads),
        "cells_run": 0,
    }
    results["sessions"].append(session)
    c = corpus(s.corpus_limit)
    if results["calibration"] is None:
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        b = calibrate(s, c)
        results["calibration"] = {**asdict(b), "seconds": time.perf_counter() - t0}
        save(path, results)
    bounds = Bounds(results["calibration"]["rms_per_lr"], results["calibration"]["norm_per_lr"])
    todo = [t for t in tasks(s) if t[0] not in results["cells"]]
    if limit is not None:
        todo = todo[:limit]
    bar = _bar(len(todo), len(tasks(s)) - len(todo), progress)

    def record(key: str, cell: dict[str, Any]) -> None:
        results["cells"][key] = cell
        session["cells_run"] += 1
        session["wall_seconds"] = round(time.perf_counter() - started, 1)
        results["wall_seconds"] = _wall(results)
        results["summary"] = _summary(results, s)  # the file is consistent whenever the run stops
        save(path, results)
        bar.update(1)
        bar.set_postfix_str(key, refresh=False)

    try:
        if workers <= 1:
            _init_worker(s, bounds, threads)
            for task in todo:
                record(*_run_task(task))
        else:
            ctx = get_context("fork" if sys.platform.startswith("linux") else "spawn")
            pool = ProcessPoolExecutor(workers, ctx, initializer=_init_worker, initargs=(s, bounds, threads))
            try:  # at most one task per worker in flight: an interrupt loses only the cells under way
                pending: set[Future[tuple[str, dict[str, Any]]]] = set()
                for task in todo:
                    pending.add(pool.submit(_run_task, task))
                    if len(pending) < workers:
                        continue
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for future in done:
                        record(*future.result())
                for future in pending:
                    record(*future.result())
            finally:
                pool.shutdown(wait=False, cancel_futures=True)
    finally:
        bar.close()
        torch.set_num_threads(threads_before)
        session["wall_seconds"] = round(time.perf_counter() - started, 1)
        session["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        finish(results, path, s)
    return results


def _bar(total: int, initial: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total + initial, initial=initial, unit="run", disable=not enabled, dynamic_ncols=True)


def _summary(results: dict[str, Any], s: Settings) -> dict[str, Any]:
    """The summary, with where the data-fault workload puts its bad batches."""
    return {**summarize(results), "fault_start": s.fault_start, "fault_length": s.fault_length}


def _wall(results: dict[str, Any]) -> float:
    """The wall time of every session that added to the file, together."""
    return round(sum(x.get("wall_seconds", 0.0) for x in results["sessions"]), 1)


def finish(results: dict[str, Any], path: Path, s: Settings) -> None:
    """Write the summary into the results file, then the plot and the bad-data table beside it."""
    results["summary"] = _summary(results, s)
    results["wall_seconds"] = _wall(results)
    save(path, results)
    stem = path.stem
    plot_sweep(results, path.with_name(f"{stem}_lr.png"))
    plot_logits(results, path.with_name(f"{stem}_logits.png"))
    path.with_name(f"{stem}_faults.md").write_text(fault_table_markdown(results), encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.stability", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--quick", action="store_true", help="1 seed, 3 learning rates, 8 updates, a tiny model"
    )
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help="folder of the results (default benchmarks/results)"
    )
    parser.add_argument("--workers", type=int, default=1, help="processes (default 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument(
        "--limit", type=int, default=None, help="run at most this many missing cells, then stop"
    )
    parser.add_argument("--fresh", action="store_true", help="start the results file over")
    parser.add_argument(
        "--report-only", action="store_true", help="run nothing; rewrite summary, plot and page"
    )
    parser.add_argument(
        "--page", type=Path, default=None, help="where to write which-tool.md (full run: docs/)"
    )
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    s = QUICK if args.quick else FULL
    path = args.out / ("stability_quick.json" if args.quick else "stability.json")
    if args.report_only:
        results = load(path, s, fresh=False)
        finish(results, path, s)
    else:
        results = run(s, path, args.workers, args.threads, args.fresh, args.limit, not args.no_progress)
    page = args.page or (
        path.with_name("which-tool_quick.md") if args.quick else ROOT / "docs" / "which-tool.md"
    )
    for figure in ("lr", "logits"):  # the page's figures beside it
        image = page.with_name(f"{path.stem}_{figure}.png")
        if image != path.with_name(image.name):
            image.write_bytes(path.with_name(image.name).read_bytes())
    page.write_text(render_page(results, f"{path.stem}_lr.png", f"{path.stem}_logits.png"), encoding="utf-8")
    if not args.quick and args.out == RESULTS:  # the run the package's advice quotes
        evidence.write(results)
    summary = results["summary"]
    print(
        f"{summary['cells_measured']} of {summary['cells_planned']} cells measured; "
        f"controls reproduced the instability: {summary['reproduced']}; "
        f"wall time {results['wall_seconds']:.0f} s; results in {path}, page {page}"
    )
    return 0
