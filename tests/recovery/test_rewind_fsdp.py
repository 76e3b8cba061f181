"""Rewind under FSDP2 (2 ranks) and FSDP2 x tensor parallel (2 x 2 mesh, 4 ranks), gloo.

docs/spike-recovery.md, "Rewind under FSDP2 and tensor parallelism": a spike on one
rank only; every rank rewinds at the same window to the same copy, each restoring
its own shards; the restored state is bit-identical to the state at the copy's
window (buffers included), and the run goes on like one process that never saw the
spike batches.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from .. import fsdp_jobs as jobs
from ..helpers import spawn_job
from ..markers import needs_gloo

pytestmark = needs_gloo

#: the batches the runs keep: 0-10 (the copy of window 11), then 18-23 (15 discarded by the
#: rewind, 16 and 17 dropped by skip_batches=2); 11 and 13, applied after the copy, are undone
KEPT = [*range(11), *range(18, jobs.WINDOWS)]
#: the rewind: in the close of window 16 (batch 15), back to the copy of window 11
#: The rewind every rank logs (no lr_cut, no reset_state: the escalation's fields at their "off" values).
EVENT = {
    "step": 16,
    "restored": 11,
    "first_spike": 13,
    "spikes": 2,
    "undone": 2,
    "lr_factor": 1.0,
    "lr_updates": 0,
    "state_reset": False,
}


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_job(jobs.fsdp_rewind_job, "fsdp", tmp_path_factory.mktemp("fsdp"), 2, pass_world=True)


@pytest.fixture(scope="module")
def tp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_job(jobs.tp_rewind_job, "tp", tmp_path_factory.mktemp("tp"), 4, pass_world=True)


def _at(run: dict[str, Any], windows: int) -> dict[str, Any]:
    """The rank's record after the step that closed window ``windows`` (the first such step)."""
    return next(r for r in run["after"] if r["windows"] == windows)


def _rewound(run: dict[str, Any]) -> dict[str, Any]:
    """The rank's record after the step that rewound."""
    return run["after"][run["reasons"].index("rewind")]


def _assert_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)


def _assert_same_record(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Bit-identical parameters, inner state (every key) and buffers."""
    _assert_equal(got["params"], want["params"])
    _assert_equal(got["buffers"], want["buffers"])
    assert [sorted(s) for s in got["state"]] == [sorted(s) for s in want["state"]]
    for g, w in zip(got["state"], want["state"], strict=True):
        _assert_equal([g[k] for k in sorted(g)], [w[k] for k in sorted(w)])


def _reference(model: torch.nn.Module, dp_ranks: int, features: int) -> list[dict[str, Any]]:
    """One process, AdamW under clipping at 1.0 (no guard, no rewind), each window the mean of the
    data-parallel ranks' losses on batch ``i`` for ``i`` in :data:`KEPT`; the state after each."""
    opt = jobs.wrapper(model.parameters(), None)
    out = []
    for i in KEPT:
        pairs = [jobs.batch(r, i, features) for r in range(dp_ranks)]
        (sum(((model(x) - y) ** 2).mean() for x, y in pairs) / dp_ranks).backward()
        opt.step()
        opt.zero_grad()
        out.append(jobs.record(model, opt))
    return out


def _assert_close(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Parameters and inner state (moments, step counters) within float32 rounding of the reference."""
    for g, w in zip(got["params"], want["params"], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert len(got["state"]) == len(want["state"])
    for g, w in zip(got["state"], want["state"], strict=True):
        assert sorted(g) == sorted(w)
        for k in g:
            torch.testing.assert_close(g[k], w[k], rtol=1e-5, atol=1e-6)


def test_fsdp2_every_rank_rewinds_at_the_same_window_to_the_same_copy(fsdp: list[dict[str, Any]]) -> None:
    """Rank 1's loss spikes at batches 12 and 14 (rank 0's never): both ranks skip them, rewind in the
    same window to the copy of window 11, and drop the same two batches after it."""
    for run in fsdp:
        assert run["log"] == [EVENT]
        assert [r for r in run["reasons"] if r is not None] == ["spike", "spike", "rewind"]
        assert run["used"] == [*range(16), *range(18, jobs.WINDOWS)]
        assert run["copies"] == fsdp[0]["copies"]


def test_fsdp2_rewind_restores_the_copy_window_bit_for_bit(fsdp: list[dict[str, Any]]) -> None:
    """After the rewind, every rank's full parameters (gathered), full inner state and its own
    BatchNorm buffers are bit-identical to that rank's state at window 11's close: the buffers as
    they were then, not as the discarded window's forward pass left them."""
    for run in fsdp:
        before = run["after"][run["reasons"].index("rewind") - 1]
        assert not torch.equal(before["buffers"][0], _at(run, 11)["buffers"][0])  # the forward moved them
        _assert_same_record(_rewound(run), _at(run, 11))
    assert not torch.equal(fsdp[0]["after"][-1]["buffers"][0], fsdp[1]["after"][-1]["buffers"][0])


def test_fsdp2_rewind_rebuilds_state_dtensors_that_are_gone(fsdp: list[dict[str, Any]]) -> None:
    """The same run with the inner optimizer's state emptied just before the window whose close
    rewinds: the copy's moment shards come back as new DTensors laid out as their parameters (the
    step counters as plain tensors): the state after the rewind, and at the end, is bit-identical to
    the run's."""
    for run in fsdp:
        assert run["cleared"]["log"] == [EVENT]
        _assert_same_record(run["cleared"]["rewound"], _rewound(run))
        _assert_same_record(run["cleared"]["last"], run["after"][-1])


def test_fsdp2_run_after_the_rewind_equals_one_process_without_the_spike_batches(
    fsdp: list[dict[str, Any]],
) -> None:
    """The state at the rewind and at the end equals one process trained on the kept batches only
    (the mean of both ranks' losses; float32 rounding of the reduce-scatter: rtol 1e-5, atol 1e-6)."""
    ref = _reference(jobs.bn_model(), 2, 5)
    for run in fsdp:
        _assert_close(_rewound(run), ref[KEPT.index(10)])
        _assert_close(run["after"][-1], ref[-1])


def test_fsdp2_state_dict_holds_each_ranks_shards_and_resumes_exactly(fsdp: list[dict[str, Any]]) -> None:
    """``opt.state_dict()`` on each rank holds that rank's local shards of the copies (of the Linear(4, 1)
    weight: its one row on rank 0, an empty shard on rank 1; of the Linear(1, 3) weight: rows 0-1 on
    rank 0, row 2 on rank 1); together they make the full parameters at the copy's window.  A run
    stopped between the spikes and resumed from each rank's state dicts rewinds at the same window and
    ends bit-identical to the run that never stopped."""
    last = {"step": 21, "applied": 16}
    for run in fsdp:
        copy = run["rewind_state"]["copies"][-1]
        assert {k: copy[k] for k in last} == last
    # the leaves start with the parameters: Linear(5, 4), BatchNorm1d(4), Linear(4, 1), Linear(1, 3)
    for weight, shapes in ((4, [(1, 4), (0, 4)]), (6, [(2, 1), (1, 1)])):
        shards = [run["rewind_state"]["copies"][-1]["leaves"][weight] for run in fsdp]
        assert [tuple(s.shape) for s in shards] == shapes
        assert torch.equal(torch.cat(shards), _at(fsdp[0], 21)["params"][weight])
    for run in fsdp:
        resumed = run["resumed"]
        assert resumed["log"] == [EVENT]
        assert resumed["used"] == [14, 15, *range(18, jobs.WINDOWS)]
        _assert_same_record(resumed["last"], run["after"][-1])


def test_tensor_parallel_inside_fsdp2_rewinds_on_every_rank(tp: list[dict[str, Any]]) -> None:
    """2 x 2 mesh, colwise/rowwise tensor parallel inside FSDP2: only rank 3's targets spike (its
    tensor-parallel partner's do not); all four ranks rewind together, each state after the rewind is
    bit-identical to its state at the copy's window, and the end equals one process trained on the
    kept batches (rtol 1e-5, atol 1e-6)."""
    assert "(_StridedShard(dim=0, sf=2), Shard(dim=0))" in tp[0]["placements"]  # sharded over both
    ref = _reference(jobs.tp_model(), 2, 6)
    for run in tp:
        assert run["log"] == [EVENT]
        assert run["used"] == [*range(16), *range(18, jobs.WINDOWS)]
        _assert_same_record(_rewound(run), _at(run, 11))
        _assert_close(run["after"][-1], ref[-1])


def test_fsdp2_rewind_state_of_another_rank_is_refused(fsdp: list[dict[str, Any]]) -> None:
    """Each rank's Rewind state holds its own shards (and their mesh coordinates): loading the other
    rank's into an optimizer raises ValueError naming both coordinates, instead of restoring the wrong
    shards at the next rewind."""
    for rank, run in enumerate(fsdp):
        other = 1 - rank
        assert run["other_rank"] == (
            f"invalid Rewind state: its copies hold the shards at mesh coordinates {[[other]] * 4!r} but "
            f"this rank's are at {[[rank]] * 4!r}: another rank's state; load each rank's own state dict; "
            "pass the state saved by Rewind.state_dict() (opt.state_dict()['clipopt'])"
        )


def test_rewind_state_across_sharding_is_refused(fsdp: list[dict[str, Any]]) -> None:
    """A one-process run's Rewind state (whole tensors) loaded into an FSDP2 optimizer, an FSDP2
    rank's (shards) into a one-process optimizer, and a rank's own with one parameter's shard marked
    whole: each a ValueError saying which is which."""
    end = "; pass the state saved by Rewind.state_dict() (opt.state_dict()['clipopt'])"
    for run in fsdp:
        assert run["unsharded"] == [
            "invalid Rewind state: its copies hold whole tensors but this optimizer's parameters are "
            "DTensor shards" + end,
            "invalid Rewind state: its copies hold DTensor shards (FSDP2, tensor parallel); these "
            "parameters are not DTensors" + end,
            "invalid Rewind state: its copies hold whole tensors and DTensor shards at other places than "
            "these parameters" + end,
        ]
