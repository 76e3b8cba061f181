"""SpikeGuard and Rewind under DDP: 2 processes on gloo decide, skip and rewind alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from .. import spike_jobs as jobs
from ..helpers import free_port, join_spawned, start_ranks
from ..markers import needs_gloo

pytestmark = needs_gloo


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out: Path = tmp_path_factory.mktemp("spike")
    ctx = start_ranks(jobs.spike_job, (free_port(), str(out)), jobs.WORLD)
    join_spawned(ctx, "spike")
    return [
        {kind: torch.load(out / f"{kind}{r}.pt", weights_only=True) for kind in ("ddp", "fsdp")}
        for r in range(jobs.WORLD)
    ]


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_every_rank_skips_the_spike_of_one_rank(ranks: list[dict[str, Any]], kind: str) -> None:
    """A loss spike on rank 1 only is skipped on both ranks (the loss is agreed in the window collective)."""
    a, b = (r[kind] for r in ranks)
    assert a["reasons"] == b["reasons"]
    assert a["reasons"][12] == "spike" and a["reasons"][14] == "spike"
    assert a["losses"][12] < 100 < b["losses"][12]  # rank 0's own loss was normal
    assert a["history"] == b["history"]  # the agreed (largest) loss entered both histories


def test_every_rank_rewinds_together_and_stays_identical(ranks: list[dict[str, Any]]) -> None:
    """Both ranks rewind at the same window to the same copy; their parameters end bit-identical."""
    a, b = (r["ddp"] for r in ranks)
    assert a["rewinds"] == b["rewinds"] == 1
    assert a["log"] == b["log"] and a["log"][0]["restored"] == 11
    assert a["reasons"][15] == "rewind"
    for p, q in zip(a["params"], b["params"], strict=True):
        assert torch.equal(p, q)
