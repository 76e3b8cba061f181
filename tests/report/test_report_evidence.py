"""The report's advice quotes the stability benchmark (#34): the packaged digest is the results
file's, the tools each sentence says fixed a kind of run are the ones the results file shows (judged
here from its summary, with the rules written out again), every number is one of the file's, and a
missing or broken digest leaves the advice without evidence rather than failing."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.stability.evidence import PACKAGED, digest
from clipopt._report import evidence

from ..project.test_bench_stability import RESULTS, numbers_not_in_results

SENTENCES = (
    evidence.learning_rate,
    evidence.bad_data,
    evidence.clipping,
    evidence.update_bounds,
    evidence.attention,
)


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(RESULTS.read_text(encoding="utf-8"))
    return loaded


@pytest.fixture(autouse=True)
def _fresh_digest() -> Iterator[None]:
    evidence.load.cache_clear()
    yield
    evidence.load.cache_clear()


def test_the_packaged_digest_is_the_results_files(results: dict[str, Any]) -> None:
    """clipopt/_report/evidence.json is what ``python -m benchmarks.stability`` writes from
    benchmarks/results/stability.json now (rerun ``--report-only`` after a new run)."""
    assert json.loads(PACKAGED.read_text(encoding="utf-8")) == digest(results)
    assert evidence.load() == digest(results)


def test_the_tools_said_to_fix_a_too_large_lr_are_the_results_files(results: dict[str, Any]) -> None:
    """Lowered the sensitivity on every seed, by more than 0.01 nats on average."""
    rows = results["summary"]["treatments"]
    verdicts = {n: e["verdict"] for n, e in rows.items() if e.get("verdict")}
    lowered = {n for n, v in verdicts.items() if v["lower_on_every_seed"] and v["mean_difference"] < -0.01}
    said = evidence.learning_rate()
    assert "docs/which-tool.md" in said
    for name in rows:
        named = re.search(rf"(?<![\w+-]){re.escape(name)} \(", said) is not None
        assert named == (name in lowered), (name, said)
    if not lowered - {"qk-layernorm", "z-loss"}:
        assert "no clipopt tool lowered" in said


def test_the_tools_said_to_fix_bad_batches_are_the_results_files(results: dict[str, Any]) -> None:
    """A tool fixed a fault when its cost (held-out loss against its own clean run) is at most half the
    plain run's; a fault that cost the plain run no more than 0.01 nats needed no fixing."""
    faults = results["summary"]["faults"]
    said = evidence.bad_data()
    assert "docs/which-tool.md" in said
    words = {"random": "random tokens", "repeat": "a repeated batch", "shuffled": "a label-shuffled shard"}
    for fault, phrase in words.items():
        cost = faults["none"][fault]["vs_clean"]
        part = next(p for p in said.split("; ") if p.lstrip().startswith(phrase) or f": {phrase}" in p)
        fixed = [n for n, row in faults.items() if n != "none" and row[fault]["vs_clean"] <= 0.5 * cost]
        if cost <= 0.01:
            assert "nothing to fix" in part
        elif fixed:
            assert f"fixed by {', '.join(fixed)} (" in part
        else:
            assert "fixed by no tool" in part
        assert f"{cost:+.3f} nats" in part


def test_every_number_in_the_advice_is_one_of_the_results_files(results: dict[str, Any]) -> None:
    for sentence in SENTENCES:
        text = sentence().replace("max_norm=1.0", "").replace("2-layer", "")
        assert text and numbers_not_in_results(text, results) == [], sentence.__name__


class _Files:
    """Stands for ``importlib.resources.files``: the digest unreadable, or its text."""

    def __init__(self, text: str | None) -> None:
        self.text = text

    def __call__(self, package: str) -> _Files:
        return self

    def joinpath(self, name: str) -> _Files:
        return self

    def read_text(self, encoding: str = "utf-8") -> str:
        if self.text is None:
            raise FileNotFoundError("evidence.json")
        return self.text


PARTIAL = json.dumps({"treatments": {"none": {"max_logit": None}}, "faults": {"none": None}, "lrs": []})


@pytest.mark.parametrize("text", [None, "{not json", '["a list"]', '{"treatments": 3}', PARTIAL])
def test_a_missing_or_broken_digest_leaves_the_advice_without_evidence(
    text: str | None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(evidence.resources, "files", _Files(text))
    assert evidence.load() is None or text == PARTIAL
    assert [s() for s in SENTENCES] == [""] * len(SENTENCES)
