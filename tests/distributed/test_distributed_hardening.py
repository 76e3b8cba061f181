"""Distributed hardening (docs/design.md, 'Data-parallel agreement'): edge shapes under FSDP2,
one decision on every rank, misuse that fails fast instead of hanging, loggers on rank 0,
tensor-parallel and pipeline-parallel norms.

Each job in ``tests/distributed_jobs.py`` runs in 2, 3 or 4 gloo processes (CPU) with a 30 s
process-group timeout, and the spawn itself is bounded: a regression that makes ranks wait for each
other fails here instead of blocking CI.  The jobs save what each rank saw next to an independent
reference (one process, torch's own functions or the formula written out).
"""

from __future__ import annotations

import math
import re
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from .. import distributed_jobs as jobs
from ..helpers import assert_tensors_close, spawn_job
from ..markers import needs_gloo

pytestmark = needs_gloo

#: a job that has not finished by then is stuck: fail instead of waiting for CI's own timeout
JOB_TIMEOUT_S = 240
# job(rank, port, out, world) in ``world`` processes; what each rank saved (it pickles more than tensors)
_spawn = partial(spawn_job, pass_world=True, weights_only=False, timeout_s=JOB_TIMEOUT_S)


#: the fix every settings error names
_SETTINGS_FIX = (
    "; build the optimizer with the same settings on every rank, change them on every rank alike (and "
    "resume every rank from the same checkpoint step), or pass replica_group=None if the ranks train "
    "independent models"
)


# ---------------------------------------------------------------------------- FSDP2 edge shapes


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def edge(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _spawn(jobs.fsdp_edge_job, "edge", tmp_path_factory.mktemp("edge"), request.param)


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, math.inf])
def test_fsdp2_norm_with_empty_and_size1_shards(edge: list[dict[str, Any]], p: float) -> None:
    """Parameters whose first dimension is below the world size leave some ranks an empty shard (and
    the size-1 bias); every rank records the full gradient's norm (float64 in one process) for every p,
    including the inf-norm that used to raise on an empty shard, with one collective per window."""
    assert 0 in edge[-1]["local_numel"] and 1 in edge[0]["local_numel"]  # the edge cases are exercised
    for rank in edge:
        got, want = rank["norms"][p]
        assert got == pytest.approx(want, rel=1e-5)
        assert rank["collectives"][p] == 1


@pytest.mark.parametrize("policy", ["float", "autoclip", "zclip", "agc"])
@pytest.mark.parametrize("p", [1.0, 2.0, math.inf])
def test_fsdp2_every_policy_with_empty_and_size1_shards_equals_one_process(
    edge: list[dict[str, Any]], policy: str, p: float
) -> None:
    """Four windows of each policy (a float bound, AutoClip, ZClip with spike skips, AGC — whose
    size-1 bias used to raise 'in-place operations that require placement changes') under FSDP2 give
    the norms, clip/skip decisions and full parameters of the same optimizer in one process."""
    for rank in edge:
        res = rank["policies"][f"{policy}-{p}"]
        assert res["norms"] == pytest.approx(res["ref_norms"], rel=1e-5)
        assert res["skipped"] == res["ref_skipped"]
        assert res["clipped"] == res["ref_clipped"]
        assert_tensors_close(res["params"], res["ref_params"])


# ---------------------------------------------------------------------------- DDP: one decision


@pytest.fixture(scope="module")
def hard(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _spawn(jobs.ddp_hardening_job, "hard", tmp_path_factory.mktemp("hard"), 2)


@pytest.fixture(scope="module")
def tp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _spawn(jobs.tp_job, "tp", tmp_path_factory.mktemp("tp"), 4)


@pytest.mark.parametrize("case", ["foreach-1", "foreach-3", "fused-1", "fused-3"])
def test_ddp_gradient_changed_after_all_reduce_skips_on_every_rank(
    hard: list[dict[str, Any]], case: str
) -> None:
    """Rank 1 scales one gradient by 1.001 after DDP's all-reduce (a buggy hook): every rank skips that
    window with reason 'divergence', the replicas stay bit-identical, every rank warns, the skip does
    not count as non-finite, and the decision costs one collective per window (k = 1 and 3, foreach
    AdamW and fused AdamW)."""
    for rank in hard:
        res = rank[f"diverge-{case}"]
        assert res["skipped"] == [False, True, False]
        assert res["reason"] == "divergence"
        assert res["same"]
        assert len(res["warnings"]) == 1
        assert "synchronised gradient norms differ at window 2" in res["warnings"][0]
        assert res["consecutive"] == 0
        assert res["collectives"] == 2  # windows 2 and 3: one each, none on the other micro-batches


@pytest.mark.parametrize("case", ["foreach-1", "foreach-3", "fused-1", "fused-3"])
def test_ddp_nan_written_after_all_reduce_skips_on_every_rank(hard: list[dict[str, Any]], case: str) -> None:
    """A nan written into rank 1's gradient after the all-reduce: rank 0's gradients are finite, yet
    both ranks skip with reason 'nonfinite' and the replicas stay bit-identical."""
    for rank in hard:
        res = rank[f"nan-{case}"]
        assert res["skipped"] == [False, True, False]
        assert res["reason"] == "nonfinite"
        assert res["same"]
        assert res["warnings"] == []


@pytest.mark.parametrize("k", [1, 3])
def test_ddp_fused_decision_reads_nothing_of_its_window(hard: list[dict[str, Any]], k: int) -> None:
    """Fused AdamW under DDP: the agreed flag reaches the kernel as found_inf; the only host read clipopt
    makes in a window is the deferred check of the previous window's agreed values (on CPU the copy
    is already on the host; on CUDA a pinned copy is read two windows later)."""
    for rank in hard:
        for corrupt in ("diverge", "nan"):
            reads = rank[f"{corrupt}-fused-{k}"]["reads"]
            assert reads and all(r.startswith("replicas.py") and "tolist" in r for r in reads)
            assert len(reads) <= 2  # at most one per window (windows 2 and 3)


def test_ddp_divergence_writes_a_snapshot_on_every_rank(hard: list[dict[str, Any]]) -> None:
    """With snapshot_dir, each rank saves its own snapshot of the diverged window, reason 'divergence'."""
    import clipopt

    for r, rank in enumerate(hard):
        path = rank["snapshot"]["snapshot"]
        assert Path(path).name == f"anomaly-step00000002-divergence-rank{r}.pt"
        assert clipopt.load_snapshot(path)["reason"] == "divergence"


@pytest.mark.parametrize("case", ["2.0", "inf", "rows"])
def test_pipeline_norm_group_gives_every_stage_the_global_norm(hard: list[dict[str, Any]], case: str) -> None:
    """Two pipeline stages, each optimizing its own layer with norm_group=WORLD: both record the norm of
    the whole model's gradient and update as clip_grad_norm_ + AdamW on the whole model in one process
    (p = 2 and inf; "rows": p = 2 with per-layer rows logged, whose norm pass keeps a candidate row)."""
    for rank in hard:
        res = rank[f"pipeline-{case}"]
        assert res["norms"] == pytest.approx(res["ref_norms"], rel=1e-5)
        assert_tensors_close(res["params"], res["ref_params"])


def test_pipeline_nan_in_one_stage_skips_every_stage(hard: list[dict[str, Any]]) -> None:
    """A nan in stage 1's gradient: both stages see a non-finite norm and skip, parameters untouched."""
    for rank in hard:
        res = rank["pipeline-nan"]
        assert res["skipped"] == [True, True]
        assert res["unchanged"]
        assert all(math.isnan(n) for n in res["norms"])


def test_loggers_write_on_rank_zero_unless_told(hard: list[dict[str, Any]], tmp_path: Path) -> None:
    """CSVLogger with one path on every rank: one file with each row once (3 windows, 3 rows);
    ranks='all': one file per rank; TensorBoardLogger: one event file, rank 0's."""
    import csv

    files = hard[0]["loggers"]["files"]
    assert files == ["each-rank0.csv", "each-rank1.csv", "grads.csv", "tb"]
    assert len(hard[0]["loggers"]["tb"]) == 1
    logs = Path(hard[0]["logs_dir"])
    for name in files[:3]:
        with (logs / name).open() as f:
            rows = list(csv.DictReader(f))
        assert [row["step"] for row in rows] == ["1", "2", "3"]


def test_no_sync_with_the_unwrapped_module_warns(hard: list[dict[str, Any]]) -> None:
    """opt.no_sync(ddp.module) suppresses nothing: it warns once, naming the fix."""
    for rank in hard:
        assert rank["no_sync_warnings"] == [
            "opt.no_sync(model) got a Sequential, which has no gradient sync to skip, so every micro-batch "
            "still synchronises (or none does); pass the DistributedDataParallel (or fully_shard) wrapper "
            "itself, e.g. opt.no_sync(ddp_model), not ddp_model.module"
        ]


def test_independent_models_per_rank(hard: list[dict[str, Any]]) -> None:
    """Ranks training their own models: replica_group=None adds no collective and skips nothing; the
    default ('auto') treats them as replicas, skips with reason 'divergence' and says to pass None."""
    for rank in hard:
        off, auto = rank["independent-None"], rank["independent-auto"]
        assert off == {"skipped": [False, False], "reasons": [None, None], "collectives": 0, "warnings": []}
        assert auto["reasons"] == ["divergence", "divergence"]
        assert all(
            w.endswith("If the ranks train independent models, pass replica_group=None")
            for w in auto["warnings"]
        )


def test_different_accumulation_steps_fail_fast(hard: list[dict[str, Any]]) -> None:
    """accumulation_steps=2 on rank 0 and 3 on rank 1 used to hang at the first mismatched collective;
    now the first no_sync() raises on every rank, naming the setting."""
    for r, rank in enumerate(hard):
        assert rank["settings_error"] == (
            "ClippedOptimizer settings differ across the ranks of the replica group: accumulation_steps "
            f"(from 2 to 3; this rank: {2 + r})" + _SETTINGS_FIX
        )


def test_flush_with_uneven_partial_windows_fails_fast(hard: list[dict[str, Any]]) -> None:
    """Rank 0 has one micro-batch more than rank 1 at the end of the data: its flush() used to wait
    forever in the gradient all-reduce; now flush() raises on every rank."""
    for r, rank in enumerate(hard):
        assert rank["flush_error"] == (
            f"flush() found different partial windows on the ranks of the replica group: this rank has "
            f"{1 - r} micro-batches pending in window 3, the ranks from 0 to 1 (windows 3 to 3); give every "
            "rank the same number of micro-batches (e.g. DistributedSampler(drop_last=True)) and call "
            "flush() on every rank"
        )


# ---------------------------------------------------------------------------- 2-D mesh


@pytest.mark.parametrize("p", [1.0, 2.0, math.inf])
def test_tensor_parallel_inside_fsdp2_gives_the_global_norm(tp: list[dict[str, Any]], p: float) -> None:
    """4 ranks, mesh ("dp", "tp") = (2, 2): placements sharded over both dimensions (FSDP2's
    _StridedShard included) and sharded over dp but replicated over tp; every rank records the norm of
    the full gradient (replicated shards counted once)."""
    assert "(Shard(dim=0), Replicate())" in tp[0]["placements"]
    assert any("_StridedShard" in pl for pl in tp[0]["placements"])
    for rank in tp:
        got, want = rank["norms"][p]
        assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("case", ["clip", "agc"])
def test_tensor_parallel_clipping_equals_one_process(tp: list[dict[str, Any]], case: str) -> None:
    """Norm clipping and AGC (row norms split over tp) on the 2-D mesh give the one-process update."""
    for rank in tp:
        assert_tensors_close(rank[case]["params"], rank[case]["ref_params"])


# ---------------------------------------------------------------------------- the ranks' state


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _spawn(jobs.ranks_job, "ranks", tmp_path_factory.mktemp("ranks"), 2)


_STATE_DIFFERS = (
    "the ranks of the replica group hold different training states at window 3, the first after "
    "load_state_dict: the checksums of the parameters and of the loaded optimizer state differ ({}); "
    "a rank loaded another run's checkpoint or another step's; load the same checkpoint on every rank "
    "(under FSDP2 each rank's file of the same save); the window was skipped on every rank"
)


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_load_of_another_runs_checkpoint_fails_on_every_rank(ranks: list[dict[str, Any]], wrap: str) -> None:
    """Rank 1 loads a checkpoint of another run (other data) at the same step, rank 0 this run's: the
    next window is skipped on both ranks and both raise, naming each rank's checksum and their range
    (DDP: MAX, the smallest and the largest) or mean (FSDP2: a SUM), instead of training on with the
    replicas drifting apart.  DDP compares the parameters and the whole optimizer state; FSDP2 (each
    rank holds its own shards) the replicated part of the state: here ZClip's statistics."""
    head, tail = _STATE_DIFFERS.split("{}")
    spreads, mine = [], []
    for rank in ranks:
        res = rank[f"load-{wrap}-other"]
        assert res["error"].startswith(head) and res["error"].endswith(tail)
        spread, this = res["error"][len(head) : -len(tail)].split("; this rank: ")
        spreads.append(spread)
        mine.append(int(this))
        assert res["skipped"] == [True] and res["reasons"] == ["divergence"] and res["windows"] == 3
    assert spreads[0] == spreads[1] and mine[0] != mine[1]
    if wrap == "ddp":
        assert spreads[0] == f"{min(mine)} to {max(mine)}"
    else:
        assert spreads[0] == f"average {sum(mine) / 2:.6g} over 2 ranks"


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_load_of_the_same_checkpoint_trains_on(ranks: list[dict[str, Any]], wrap: str) -> None:
    """Every rank loads the same run's checkpoint (under FSDP2 each its own shards of it): no error,
    the two windows after the load are applied."""
    for rank in ranks:
        res = rank[f"load-{wrap}-same"]
        assert res == {"error": None, "skipped": [False, False], "reasons": [None, None], "windows": 4}


def test_ddp_failed_step_on_one_rank_names_the_failure(ranks: list[dict[str, Any]]) -> None:
    """Rank 1's inner step raises in window 2 (the loop catches it; rank 1 rolls the window back,
    rank 0 applied it).  Window 3 is skipped on both and both raise, naming the failed close (not
    flush() or accumulation_steps, which the message used to blame)."""
    common = (
        "after the ranks had agreed on it (e.g. an error in the inner optimizer's step, caught by the "
        "training loop): that rank rolled the window back while the others applied it, so the replicas "
        "differ now; the window was skipped on every rank; resume every rank from the same checkpoint"
    )
    assert ranks[1]["failed-ddp"]["caught"] == "inner step failed"
    for r, rank in enumerate(ranks):
        res = rank["failed-ddp"]
        who = "this rank" if r == 1 else "another rank"
        assert res["error"] == (
            f"the window counters of the ranks of the replica group differ: this rank closed window {3 - r} "
            f"after 1 micro-batches, the ranks' windows: 2 to 3; the close of window 2 raised on {who} "
            + common
        )
        assert res["reasons"] == [None, None, "divergence"][r:]


@pytest.mark.parametrize("p", [2.0, math.inf])
def test_fsdp2_window_counters_out_of_step_fail_on_every_rank(ranks: list[dict[str, Any]], p: float) -> None:
    """FSDP2: rank 1's inner step raises in window 2, so it closes window 2 again while rank 0 closes
    window 3.  The window index rides in the norm's reduction (SUM of p-th powers for p = 2, MAX for
    the inf-norm; no extra collective): both ranks skip that window and raise, naming the counters,
    where they used to train on with 3 and 2 windows."""
    tail = (
        "after the ranks had agreed on it (e.g. an error in the inner optimizer's step, caught by the "
        "training loop): that rank rolled the window back while the others applied it, so the replicas "
        "differ now; the window was skipped on every rank; resume every rank from the same checkpoint"
    )
    for r, rank in enumerate(ranks):
        res = rank[f"failed-fsdp-{p}"]
        head = (
            f"the window counters of the ranks of the replica group differ: this rank closed window {3 - r} "
            "after 1 micro-batches, the ranks' windows: "
        )
        if math.isinf(p):
            who = "this rank" if r == 1 else "another rank"
            cause = f"2 to 3; the close of window 2 raised on {who} "
        else:
            who = ", this one among them" if r == 1 else ""
            cause = f"average 2.5 over 2 ranks; a window's close raised on 1 rank(s){who} "
        assert res["error"] == head + cause + tail
        assert res["reasons"] == [None, None, "divergence"][r:]


def test_fsdp2_rank_that_reloaded_an_older_checkpoint_fails_on_every_rank(
    ranks: list[dict[str, Any]],
) -> None:
    """FSDP2: rank 1 reloads the checkpoint of window 1 after window 2 while rank 0 goes on: the next
    window is skipped on both ranks and both raise, naming the counters (they used to end with 3 and
    2 windows and no error)."""
    for r, rank in enumerate(ranks):
        res = rank["reload-fsdp"]
        assert res["error"] == (
            f"the window counters of the ranks of the replica group differ: this rank closed window {3 - r} "
            "after 1 micro-batches, the ranks' windows: average 2.5 over 2 ranks; a rank loaded a checkpoint "
            "of another step, or skipped a window the others closed; the window was skipped on every rank; "
            "resume every rank from the same checkpoint"
        )
        assert res["reasons"][-1] == "divergence"


def test_fsdp2_accumulation_steps_changed_to_different_values_fails_fast(ranks: list[dict[str, Any]]) -> None:
    """FSDP2 with no_sync: after one window rank 0 sets accumulation_steps to 3 and rank 1 to 4.  Their
    collectives no longer pair up; this used to hang until the process group's timeout (30 minutes by
    default, 60 s here).  Now the next no_sync() checks the settings again: both raise at once."""
    for r, rank in enumerate(ranks):
        res = rank["changed-k"]
        assert res["error"] == (
            "ClippedOptimizer settings differ across the ranks of the replica group: accumulation_steps "
            f"(from 3 to 4; this rank: {3 + r})" + _SETTINGS_FIX
        )
        assert res["windows"] == 1
        assert res["seconds"] < jobs.PROCESS_GROUP_TIMEOUT_S / 4


def test_setting_changed_on_one_rank_mid_run_is_named(ranks: list[dict[str, Any]]) -> None:
    """opt.clip_value set on rank 1 only after the first window: the settings key in window 2's check
    differs, the window is skipped on both ranks and the settings check runs again to name it (it used
    to go unnoticed: the ranks clipped differently from then on)."""
    for r, rank in enumerate(ranks):
        res = rank["settings-clip_value"]
        assert res["error"] == (
            "ClippedOptimizer settings differ across the ranks of the replica group: clip_value (from -1 "
            f"to 0.5; this rank: {0.5 if r else -1})" + _SETTINGS_FIX
        )
        assert res["reasons"] == [None, "divergence"]


def test_clip_policies_with_different_settings_differ(ranks: list[dict[str, Any]]) -> None:
    """ZClip(z_thresh=2.5) on rank 0 and ZClip(z_thresh=3.5) on rank 1: the policy is one of the parts
    whose settings the ranks compare (its repr), so the first step raises on both ranks, naming it,
    before any window closed (the first step's check used to compare the policy's type only, and the
    first window was skipped with a message that named no setting)."""
    zclip = (
        "ZClip(alpha=0.97, z_thresh={}, max_grad_norm=None, warmup_steps=25, clip_option='adaptive_scaling', "
    )
    a, b = (zclip.format(z) + "skip_spikes=False)" for z in ("2.5", "3.5"))
    for r, rank in enumerate(ranks):
        res = rank["settings-zclip"]
        assert res["error"] == (
            "ClippedOptimizer settings differ across the ranks of the replica group: "
            f"policy ({a} on rank 0, {b} on rank 1; this rank: {b if r else a})" + _SETTINGS_FIX
        )
        assert res["reasons"] == []


def test_a_clip_policy_of_ones_own_trains_under_ddp(ranks: list[dict[str, Any]]) -> None:
    """A ClipPolicy subclass of the user's own without ``__repr__``, the same on both DDP ranks: the
    settings key held ``repr(policy)``, which holds the object's address, different in every process,
    so the first window was skipped on both ranks and both raised "settings differ".  Now the key
    holds the class's name for a policy not of clipopt's: three windows train, none skipped."""
    for rank in ranks:
        assert rank["own-policy"] == {"error": None, "reasons": [None, None, None]}


def test_pipeline_stages_load_their_own_state(ranks: list[dict[str, Any]]) -> None:
    """Pipeline stages (norm_group) hold different parameters and optimizer state: each loads its own
    checkpoint and trains on (only the counters and settings are compared across them)."""
    assert [rank["pipeline-load"] for rank in ranks] == [None, None]


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_ranks_check_adds_no_host_read_to_fused_windows(ranks: list[dict[str, Any]], wrap: str) -> None:
    """Fused AdamW under DDP and FSDP2, three windows after a load_state_dict: the check (the loaded
    state's checksum included) reaches the host only as the deferred read of an earlier window's
    reduced values (on CUDA a pinned copy two windows old), at most one per window."""
    for rank in ranks:
        reads = rank[f"reads-{wrap}"]
        assert reads and all(r.startswith("replicas.py") and "tolist" in r for r in reads)
        assert len(reads) <= 3


# ---------------------------------------------------------------------------- one process


def test_distributed_arguments_are_checked() -> None:
    """replica_group, norm_group and the loggers' ranks get errors naming the value and the fix."""
    from clipopt import ClippedOptimizer, CSVLogger

    params = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(
        TypeError,
        match=r"^replica_group must be 'auto', None or a torch.distributed "
        r"ProcessGroup, got 'all' \(str\); pass replica_group='auto'",
    ):
        ClippedOptimizer(torch.optim.SGD(params, lr=0.1), replica_group="all")
    with pytest.raises(
        TypeError,
        match=r"^norm_group must be a torch.distributed ProcessGroup or None, "
        r"got 'auto' \(str\); pass the group of the ranks holding the other "
        r"parameters \(pipeline stages\)",
    ):
        ClippedOptimizer(torch.optim.SGD(params, lr=0.1), norm_group="auto")
    with pytest.raises(TypeError, match=r"^norm_group must be .* got 3 \(int\)"):
        ClippedOptimizer(torch.optim.SGD(params, lr=0.1), norm_group=3)
    with pytest.raises(ValueError, match=r"^ranks must be 'zero' or 'all', got 'first'; pass ranks='zero'"):
        CSVLogger("grads.csv", ranks="first")


def test_one_process_adds_no_collective_and_no_divergence_reason(tmp_path: Path) -> None:
    """Without torch.distributed nothing is agreed: a non-finite window is skipped with reason
    'nonfinite' as before, and CSVLogger writes its own path (no -rank suffix)."""
    from clipopt import ClippedOptimizer, CSVLogger

    w = torch.nn.Parameter(torch.ones(3))
    path = tmp_path / "grads.csv"
    opt = ClippedOptimizer(torch.optim.SGD([w], lr=0.1), 1.0, loggers=[CSVLogger(path, ranks="all")])
    w.grad = torch.tensor([1.0, math.nan, 0.0])
    opt.step()
    opt.close()
    assert opt.last_stats is not None and opt.last_stats.reason == "nonfinite"
    assert opt._run.replicas.divergence is None and not opt._run.replicas.active
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grads.csv"]


def test_flush_on_one_rank_meeting_a_window_fails_on_every_rank(hard: list[dict[str, Any]]) -> None:
    """rank 0 calls flush() mid-window while rank 1 closes the window: the flush's check meets the
    window's agreement; both ranks raise (rank 1 after skipping that window) instead of hanging."""
    message = (
        "flush() was called on some ranks of the replica group only: one rank's flush() met another "
        "rank's window; call flush() on every rank (it is collective under data parallelism)"
    )
    for r, rank in enumerate(hard):
        res = rank["flush-one-rank"]
        assert res["error"] == message
        assert res["skipped"] == ([False] if r == 0 else [False, True])
        assert res["reasons"][1:] == ([] if r == 0 else ["divergence"])


def test_windows_out_of_step_fail_on_every_rank(hard: list[dict[str, Any]]) -> None:
    """accumulation_steps changed on one rank after the settings check: rank 0 closes a window after 1
    micro-batch while rank 1 closes one after 2; the agreement sees it, both skip and raise."""
    for r, rank in enumerate(hard):
        res = rank["changed-k"]
        assert res["error"] == (
            f"the ranks of the replica group closed different accumulation windows: this rank closed "
            f"window 2 after {1 + r} micro-batches, the ranks windows 2 to 2 after 1 to 2 micro-batches; "
            "call flush() on every rank (it is collective under data parallelism) and give every rank the "
            "same accumulation_steps; the window was skipped on every rank"
        )
        assert res["skipped"] == [False, True] and res["reasons"] == [None, "divergence"]


def test_ddp_policy_state_and_spike_decisions_stay_identical(hard: list[dict[str, Any]]) -> None:
    """ZClip (spike skips) under DDP with fused AdamW and one rank's gradient changed after the
    all-reduce: every rank records the same decisions and bounds in every window (the corrupted one
    skipped as 'divergence'), ZClip's statistics are bit-identical and so are the replicas."""
    res = hard[0]["policy"]
    first = res["decisions"][0]
    assert all(d == first for d in res["decisions"])
    assert first[3][1] == "divergence"
    assert all(torch.equal(s, res["stats"][0]) for s in res["stats"])
    assert res["same"]


_CHECK_FIELDS = ("window", "micro_batches", "settings", "state")


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"window": 2**40 + 6},  # a limb carries over: the higher limbs differ too
        {"micro_batches": 3},
        {"settings": 2**32 - 1},
        {"state": 17},
        {"window": 2**40 + 4, "settings": 5},
    ],
)
def test_rank_check_encodings_name_every_value_the_ranks_do_not_share(changes: dict[str, int]) -> None:
    """Three ranks' check entries reduced as the collectives do (elementwise MAX; SUM): both encodings
    name exactly the values that differ (compared field by field in plain Python), the device flag
    agrees, and a state carried by some ranks only is no difference."""
    from clipopt._distributed.rank_check import MAX_SLOTS, SUM_SLOTS, CheckValues, decode, encode, mismatch

    cpu = torch.device("cpu")
    ranks = [
        CheckValues(2**40 + 5, 2, 2**31 + 7, 99),
        CheckValues(2**40 + 5, 2, 2**31 + 7, None),
        CheckValues(
            **{"window": 2**40 + 5, "micro_batches": 2, "settings": 2**31 + 7, "state": 99, **changes}
        ),
    ]
    want = {
        ("micro-batches" if name == "micro_batches" else name)
        for name in _CHECK_FIELDS
        if len({getattr(v, name) for v in ranks if getattr(v, name) is not None}) > 1
    }
    for summed in (False, True):
        entries = torch.stack([encode(v, summed, cpu) for v in ranks])
        assert entries.shape == (3, SUM_SLOTS if summed else MAX_SLOTS) == (3, 21 if summed else 10)
        reduced = entries.sum(0) if summed else entries.max(0).values
        for v in ranks:
            differ, _ = decode(reduced.tolist(), v, summed)
            assert {d.name for d in differ} == want
        assert float(mismatch(reduced, summed)) == float(bool(want))


def test_rank_check_checksums_are_exact() -> None:
    """tensor_checksum is the sum of the tensors' bits read as int32 (numpy), each modulo 2**31 - 1,
    weighted by position: the same for any thread count, changed by one flipped bit or by a swap of
    two tensors; state_checksum tells a state dict from one with a float one ulp away."""
    import numpy as np

    from clipopt._distributed.rank_check import MODULUS, state_checksum, tensor_checksum

    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(1000, generator=gen), torch.randn(3, 4, generator=gen).double()]
    residues = [
        int(np.frombuffer(t.numpy().tobytes(), dtype=np.int32).astype(np.int64).sum()) % MODULUS
        for t in tensors
    ]
    want = sum((i + 1) * r for i, r in enumerate(residues)) % MODULUS
    cpu = torch.device("cpu")
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert int(tensor_checksum(tensors, cpu)) == want
    finally:
        torch.set_num_threads(threads)
    flipped = tensors[0].clone()
    flipped.view(torch.int32)[500] ^= 1
    assert int(tensor_checksum([flipped, tensors[1]], cpu)) != want
    assert int(tensor_checksum(tensors[::-1], cpu)) != want
    state = {"state": {0: {"exp_avg": tensors[0]}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    other = {
        "state": {0: {"exp_avg": tensors[0].clone()}},
        "param_groups": [{"lr": math.nextafter(0.1, 1), "params": [0]}],
    }
    assert state_checksum(state) == state_checksum({**state, "state": {0: {"exp_avg": tensors[0].clone()}}})
    assert state_checksum(state) != state_checksum(other)


def test_checks_copied_from_an_accelerator_are_read_at_the_same_window_on_every_rank() -> None:
    """A window's reduced check copied from an accelerator (a pinned copy and its event) is read
    exactly LAG checks after it was sent, whether or not the copy has completed: the rule depends on
    the sequence only, so every rank raises at the same window.  It used to be read as soon as the
    event had completed, which differs between ranks: one rank raised while another went on into
    the next window's collective and waited there."""
    from clipopt._distributed.rank_check import CheckValues, encode
    from clipopt._distributed.replicas import _HEAD, LAG, ReplicaDecision

    class Done:  # a CUDA event whose copy has completed
        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

    cpu = torch.device("cpu")
    mine, other = CheckValues(5, 1, 7), CheckValues(4, 1, 7)  # window counters out of step
    check = torch.stack([encode(mine, False, cpu), encode(other, False, cpu)]).max(0).values
    head = torch.tensor([0.0, 1.0, -1.0, 0.0, 0.0, -math.inf], dtype=torch.float64)
    assert head.numel() == _HEAD
    replicas = ReplicaDecision("auto")
    replicas._pending.append((torch.cat([head, check]), Done(), 0, "ddp", mine))
    for now in range(1, LAG):
        replicas.settle(now)  # the copy is complete, yet not read before LAG more checks went out
    with pytest.raises(RuntimeError, match=re.escape("this rank closed window 5 after 1 micro-batches")):
        replicas.settle(LAG)
