"""benchmarks/stability: the LR-sensitivity formula, the helps-test, the --quick smoke run, and
docs/which-tool.md against the results file it is written from."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.stability.metrics import helps, lr_sensitivity
from benchmarks.stability.page import render_page
from benchmarks.stability.report import summarize
from benchmarks.stability.run import load, main
from benchmarks.stability.train import QUICK

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results" / "stability.json"
PAGE = REPO / "docs" / "which-tool.md"


def test_lr_sensitivity_of_a_hand_computed_sweep() -> None:
    """Wortsman et al. 2023, §2: mean over lr of min(loss, loss at init), minus the best loss.

    Losses 3.0, 2.0, 2.5, 6.0 (above the init 5.0: counts 5.0) and nan (diverged: counts 5.0):
    (3.0 + 2.0 + 2.5 + 5.0 + 5.0) / 5 - 2.0 = 17.5 / 5 - 2.0 = 1.5.
    """
    losses = {1e-3: 3.0, 3e-3: 2.0, 1e-2: 2.5, 3e-2: 6.0, 1e-1: math.nan}
    assert lr_sensitivity(losses, init_loss=5.0) == pytest.approx(1.5, abs=1e-12)
    assert lr_sensitivity({1e-3: 2.0, 1e-2: 2.0}, init_loss=5.0) == 0.0  # a flat curve
    with pytest.raises(ValueError, match="at least one learning rate"):
        lr_sensitivity({}, init_loss=5.0)


def test_helps_needs_every_seed_lower_and_a_best_loss_no_worse() -> None:
    base = [(1.0, 2.00), (1.2, 2.02), (0.9, 1.98)]
    assert helps([(0.5, 2.0), (0.6, 2.0), (0.4, 2.0)], base).helps
    one_seed_higher = [(0.5, 2.0), (1.3, 2.0), (0.4, 2.0)]
    assert not helps(one_seed_higher, base).helps
    worse_best = [(0.5, 2.1), (0.6, 2.1), (0.4, 2.1)]
    verdict = helps(worse_best, base)
    assert verdict.lower_on_every_seed and not verdict.best_no_worse and not verdict.helps
    assert not helps([(0.5, 2.0)], base[:1], min_seeds=3).helps  # one seed is not enough
    assert helps([(0.5, 2.0), (0.6, 2.0), (0.4, 2.0)], base).mean_difference == pytest.approx(
        -0.5333, abs=1e-4
    )


def test_quick_run_writes_results_plot_and_page(tmp_path: Path) -> None:
    """``--quick`` (CI's smoke run): every cell measured, the summary, the plot, the table, the page."""
    page = tmp_path / "which-tool.md"
    threads = torch.get_num_threads()
    assert main(["--quick", "--out", str(tmp_path), "--page", str(page), "--no-progress"]) == 0
    results = json.loads((tmp_path / "stability_quick.json").read_text())
    settings = results["settings"]
    planned = len(settings["treatments"]) * len(settings["lrs"]) * len(settings["seeds"])
    planned += len(settings["fault_treatments"]) * len(settings["faults"]) * len(settings["fault_seeds"])
    assert len(results["cells"]) == planned == results["summary"]["cells_planned"]
    assert all(math.isfinite(c["init_loss"]) and c["windows"] > 0 for c in results["cells"].values())
    assert (tmp_path / "stability_quick_lr.png").stat().st_size > 10_000
    assert (tmp_path / "stability_quick_logits.png").stat().st_size > 10_000
    assert (tmp_path / "stability_quick_faults.md").read_text().startswith("| treatment |")
    assert torch.get_num_threads() == threads  # the run's one thread per worker is not left behind
    rows = results["summary"]["treatments"]
    assert rows["none"]["clipped"] == 0 and rows["clip"]["clipped"] > 0  # the treatments are what they say
    assert numbers_not_in_results(page.read_text(), results) == []
    # resumable: a second run finds every cell cached and runs none
    assert main(["--quick", "--out", str(tmp_path), "--page", str(page), "--no-progress"]) == 0
    again = json.loads((tmp_path / "stability_quick.json").read_text())
    assert again["sessions"][-1]["cells_run"] == 0 and again["cells"] == results["cells"]


# ----------------------------------------------------------------------------- the page's numbers

_NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![\w.]*\])")


def _leaves(value: Any) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _leaves(v)] + [x for k in value for x in _leaves(_num(k))]
    if isinstance(value, list):
        return [x for v in value for x in _leaves(v)]
    return _leaves(_num(value)) if isinstance(value, str) else []


def _num(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _spellings(x: float) -> set[str]:
    out = {f"{x:g}", f"{x:.0f}", f"{x:.1f}", f"{x:.2f}", f"{x:.3f}", f"{x:+.3f}"}
    return out | {s.lstrip("+") for s in out}


def numbers_not_in_results(page: str, results: dict[str, Any]) -> list[str]:
    """The numbers written on ``page`` that are not a number of ``results`` (as the page spells it).

    Left out: the citation (the paper's year and arXiv number, its section sign), link targets, the
    file names and the counts of things the page names (the sums and counts are the summary's).
    """
    text = re.sub(r"\]\([^)]*\)", "]", page)  # link targets
    text = re.sub(r"`[^`]*`", "", text)  # code: names of files and treatments
    text = text.replace("Wortsman et al. 2023", "").replace("arXiv 2309.14322", "").replace("§2", "")
    for fixed in ("AdamW (0.9, 0.95)", "95th percentile"):  # definitions fixed in the code
        text = text.replace(fixed, "")
    known = {s for x in _leaves(results) for s in _spellings(x)}
    return [n for n in _NUMBER.findall(text) if n not in known]


def test_the_page_check_finds_a_number_that_is_not_in_the_results() -> None:
    results = {"summary": {"a": 0.1234, "b": [2, 3.0]}}
    assert numbers_not_in_results("sensitivity 0.123, 2 runs of 3", results) == []
    assert numbers_not_in_results("sensitivity 0.123, held-out 1.530", results) == ["1.530"]


def test_which_tool_page_quotes_only_the_results_file() -> None:
    """docs/which-tool.md: every number on it is one of benchmarks/results/stability.json's."""
    results = json.loads(RESULTS.read_text())
    assert numbers_not_in_results(PAGE.read_text(encoding="utf-8"), results) == []


def test_the_results_files_sensitivities_are_the_papers_formula_of_its_cells() -> None:
    """Recomputed here from the cells, by the formula written out again: the summary's LR sensitivity
    per treatment and seed, and that a seed is summarised only when every learning rate is measured."""
    results = json.loads(RESULTS.read_text())
    s, cells = results["settings"], results["cells"]
    for name, entry in results["summary"]["treatments"].items():
        for seed in s["seeds"]:
            runs = [cells.get(f"sweep/{name}/{lr:g}/{seed}") for lr in s["lrs"]]
            if any(r is None for r in runs):
                assert str(seed) not in entry["sensitivity"]
                continue
            init = runs[0]["init_loss"]
            vals = [min(r["heldout"], init) if math.isfinite(r["heldout"]) else init for r in runs]
            expected = sum(vals) / len(vals) - min(vals)
            assert entry["sensitivity"][str(seed)] == pytest.approx(expected, abs=1e-4), (name, seed)


# ----------------------------------------------------------------------------- the controls' gate


def _synthetic(control_losses: dict[float, float]) -> dict[str, Any]:
    """A results file of 3 seeds x 3 lrs: ``none`` and ``clip`` rise to 4.0 at lr 0.1 (init 5.0);
    both controls end at ``control_losses``."""
    lrs, seeds = [0.001, 0.01, 0.1], [0, 1, 2]
    curves = {
        "none": {0.001: 3.0, 0.01: 2.0, 0.1: 4.0},
        "qk-layernorm": control_losses,
        "z-loss": control_losses,
        "clip": {0.001: 3.0, 0.01: 2.0, 0.1: 2.5},
    }
    cells = {}
    for name, curve in curves.items():
        for seed in seeds:
            for lr in lrs:
                cells[f"sweep/{name}/{lr:g}/{seed}"] = {
                    "lr": lr, "heldout": curve[lr] + 0.01 * seed, "init_loss": 5.0, "diverged": False,
                    "max_logit": 10.0, "skipped": 0, "clipped": 0, "update_clipped": 0, "undone": 0,
                    "windows": 10, "seconds": 1.0,
                }  # fmt: skip
    settings = {
        "lrs": lrs, "seeds": seeds, "treatments": list(curves), "fault_treatments": [], "faults": [],
        "fault_seeds": [], "layers": 2, "width": 8, "heads": 2, "seq_len": 8, "batch": 2, "warmup": 1,
        "updates": 10, "fault_lr": 0.01,
    }  # fmt: skip
    session = {"processor": "cpu", "cpus": 2, "torch": "2.13.0", "wall_seconds": 1.0}
    results = {
        "settings": settings,
        "cells": cells,
        "sessions": [session],
        "wall_seconds": 1.0,
        "calibration": {},
    }
    results["summary"] = {**summarize(results), "fault_start": 6, "fault_length": 1}
    return results


def test_treatments_get_verdicts_only_when_the_controls_lower_the_baselines_sensitivity() -> None:
    """Controls flatter than the baseline on every seed: reproduced, and clip (flatter, same best loss)
    helps. Controls as steep as the baseline: the page says the proxy did not reproduce the instability."""
    good = _synthetic({0.001: 3.0, 0.01: 2.0, 0.1: 2.2})
    assert good["summary"]["reproduced"] is True
    assert good["summary"]["treatments"]["clip"]["verdict"]["helps"] is True
    page = render_page(good, "x.png")
    assert "The proxy reproduced the instability" in page and ": **helps**" in page
    bad = _synthetic({0.001: 3.0, 0.01: 2.0, 0.1: 4.5})
    assert bad["summary"]["reproduced"] is False
    page = render_page(bad, "x.png")
    assert "The proxy did not reproduce the instability" in page and ": **helps**" not in page
    partial = _synthetic({0.001: 3.0, 0.01: 2.0, 0.1: 2.2})
    del partial["cells"]["sweep/z-loss/0.1/2"]
    partial["summary"] = {**summarize(partial), "fault_start": 6, "fault_length": 1}
    assert partial["summary"]["reproduced"] is None
    assert "**Incomplete.**" in render_page(partial, "x.png")


def _file(settings: Any, cells: dict[str, Any]) -> str:
    return json.dumps({"settings": json.loads(json.dumps(dataclasses.asdict(settings))), "cells": cells})


def test_a_results_file_is_extended_by_treatments_added_to_the_end_only(tmp_path: Path) -> None:
    """A treatment added to the end of the list extends an existing results file (its cells are the
    missing ones); any other change of the settings is refused."""
    s = QUICK
    path = tmp_path / "stability_quick.json"
    cells = {"sweep/none/0.001/0": {"heldout": 2.5}}
    path.write_text(_file(dataclasses.replace(s, treatments=s.treatments[:-1]), cells))
    results = load(path, s, fresh=False)
    assert results["settings"]["treatments"] == list(s.treatments) and results["cells"] == cells
    changed = (dataclasses.replace(s, lrs=s.lrs[:-1]), dataclasses.replace(s, treatments=s.treatments[1:]))
    for other in changed:
        path.write_text(_file(other, {}))
        with pytest.raises(SystemExit, match="written under other settings"):
            load(path, s, fresh=False)


def test_the_readmes_claims_of_benefit_quote_the_results_file() -> None:
    """Every README paragraph that cites docs/which-tool.md (the claims of what a tool fixed) has only
    numbers of benchmarks/results/stability.json, spelled as the page spells them."""
    results = json.loads(RESULTS.read_text(encoding="utf-8"))
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    paragraphs = [p for p in readme.split("\n\n") if "which-tool.md" in p]
    assert len(paragraphs) >= 2 and any("SpikeGuard" in p for p in paragraphs)
    for p in paragraphs:
        assert numbers_not_in_results(p, results) == [], p
    text = " ".join(" ".join(paragraphs).split())
    faults, rows = results["summary"]["faults"], results["summary"]["treatments"]
    names = ("none", "spikeguard", "spikeguard+rewind", "spikeguard-w128")
    cost = {n: f"{faults[n]['random']['vs_clean']:+.3f}" for n in names}
    shuffled = {n: f"{faults[n]['shuffled']['vs_clean']:+.3f}" for n in names}
    assert f"plain run {cost['none']} nats" in text and f"SpikeGuard {cost['spikeguard']};" in text
    assert f"a label-shuffled shard {shuffled['none']} and {shuffled['spikeguard']}." in text
    assert f"missed that shard ({shuffled['spikeguard-w128']})" in text
    assert f"adding Rewind gave {cost['spikeguard+rewind']} on random tokens" in text
    for name, words in (("qk-clip", "by more than 0.01 nats ("), ("qk-layernorm", "qk-layernorm's ")):
        v = rows[name]["verdict"]
        assert v["lower_on_every_seed"] and f"{words}{v['mean_difference']:+.3f} ± {v['spread']:.3f}" in text
