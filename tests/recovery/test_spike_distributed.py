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


# ---------------------------------------------------------------------------- the ranks' agreement

#: the fix every settings error names
_SETTINGS_FIX = (
    "; build the optimizer with the same settings on every rank, change them on every rank alike (and "
    "resume every rank from the same checkpoint step), or pass replica_group=None if the ranks train "
    "independent models"
)
_SETTINGS_DIFFER = "ClippedOptimizer settings differ across the ranks of the replica group: "


@pytest.fixture(scope="module")
def agreement(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out: Path = tmp_path_factory.mktemp("agreement")
    join_spawned(start_ranks(jobs.agreement_job, (free_port(), str(out)), jobs.WORLD), "agreement")
    return [torch.load(out / f"agreement{r}.pt", weights_only=True) for r in range(jobs.WORLD)]


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.parametrize(
    ("case", "named"),
    [
        ("keep", "rewind.keep (from 2 to 3; this rank: {})"),
        ("skip_batches", "rewind.skip_batches (from 2 to 3; this rank: {})"),
        ("skip", "rewind.skip ([] on rank 0, [(100, 101)] on rank 1; this rank: {})"),
        (
            "signals",
            "spike_guard.signals (('loss',) on rank 0, ('loss', 'grad_norm') on rank 1; this rank: {})",
        ),
    ],
)
def test_a_rewind_or_guard_built_differently_is_an_error_on_every_rank(
    agreement: list[dict[str, Any]], kind: str, case: str, named: str
) -> None:
    """Rank 1's Rewind keeps 3 copies (or drops 3 batches after a rewind, or is given another skip
    list by its first ``batches()`` call), or its SpikeGuard scores other signals: the first
    step raises on both ranks, naming the setting and each rank's value, before any window closed.
    Different keep values used to train on silently (DDP replicas ended 0.0226 apart; under FSDP2
    each rank restored its shards from another window), different skip lists drew other batches."""
    mine = {
        "keep": ("2", "3"),
        "skip_batches": ("2", "3"),
        "skip": ("[]", "[(100, 101)]"),
        "signals": ("('loss',)", "('loss', 'grad_norm')"),
    }[case]
    for r, rank in enumerate(agreement):
        res = rank[f"{kind}-{case}"]
        assert res["error"] == _SETTINGS_DIFFER + named.format(mine[r]) + _SETTINGS_FIX
        assert res["reasons"] == []


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_skip_list_given_later_on_one_rank_is_an_error_at_its_next_window(
    agreement: list[dict[str, Any]], kind: str
) -> None:
    """Two windows train alike; then rank 1 alone lists a batch to skip in its second
    ``rewind.batches()`` call.  The next window's check (the settings key riding in the window's
    own reduction, no collective added) differs: that window is skipped on both ranks and both
    raise, naming the skip list."""
    for r, rank in enumerate(agreement):
        res = rank[f"{kind}-skip-late"]
        mine = "[(100, 101)]" if r else "[]"
        assert res["error"] == (
            _SETTINGS_DIFFER
            + f"rewind.skip ([] on rank 0, [(100, 101)] on rank 1; this rank: {mine})"
            + _SETTINGS_FIX
        )
        assert res["reasons"] == [None, None, "divergence"]


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_ranks_with_the_same_rewind_and_skip_list_train_on(
    agreement: list[dict[str, Any]], kind: str
) -> None:
    """The same Rewind, SpikeGuard and skip list on both ranks: six windows, none refused.  The
    settings are compared once at the first step (one all_reduce of their key) and then only ride
    in each window's own reduction: no all_gather, and every window makes as many collectives as
    the next (DDP: the agreement packet; FSDP2: the norm's reduction and the guard's loss)."""
    for rank in agreement:
        res = rank[f"{kind}-same"]
        assert (res["error"], res["reasons"]) == (None, [None] * 6)
        first, *rest = res["collectives"]
        per_window = ["all_reduce"] if kind == "ddp" else ["all_reduce", "all_reduce"]
        assert first == ["all_reduce", *per_window] and rest == [per_window] * 5
