"""docs/distributed.md: ``no_sync`` with DDP and FSDP2, global norms of sharded gradients, one skip decision.

Two processes on the gloo backend (CPU) run the jobs in ``tests/distributed_jobs.py``
once per module; the tests compare what each rank recorded with the single-process
reference computed there (``clip_grad_norm_`` and AdamW on a plain model).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import clipopt
from clipopt import ClippedOptimizer

from .. import distributed_jobs as jobs
from ..helpers import assert_tensors_close, free_port, spawn_job
from ..markers import needs_gloo

pytestmark = needs_gloo


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_job(jobs.ddp_job, "ddp", tmp_path_factory.mktemp("ddp"), jobs.WORLD)


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_job(jobs.fsdp_job, "fsdp", tmp_path_factory.mktemp("fsdp"), jobs.WORLD)


# ---------------------------------------------------------------------------- DDP


def test_ddp_no_sync_all_reduces_only_on_the_last_micro_batch(ddp: list[dict[str, Any]]) -> None:
    """With accumulation_steps=3, DDP's comm hook runs only for micro-batches 3 and 6."""
    for rank in ddp:
        assert rank["accum"]["calls"] == [3, 6]


def test_ddp_accumulation_equals_one_process(ddp: list[dict[str, Any]]) -> None:
    """2 ranks x 3 micro-batches per window give the norms and parameters of one process that
    averages all 6 micro-batch gradients, clips with clip_grad_norm_ and steps AdamW."""
    for rank in ddp:
        res = rank["accum"]
        assert res["clipped"] == [True, True]
        assert res["norms"] == pytest.approx(res["ref_norms"], rel=1e-5)
        assert_tensors_close(res["params"], res["ref_params"])


def test_ddp_flush_after_unsynced_micro_batches_all_reduces(ddp: list[dict[str, Any]]) -> None:
    """A partial window of 2 unsynchronised micro-batches: no all-reduce ran during backward,
    flush() averages the gradients over the ranks itself, and the update equals the reference."""
    for rank in ddp:
        res = rank["flush"]
        assert res["calls_before_flush"] == []
        assert res["own_all_reduces"] == 1
        assert res["norm"] == pytest.approx(res["ref_norm"], rel=1e-5)
        assert_tensors_close(res["params"], res["ref_params"])


def test_ddp_sync_true_and_plain_backward(ddp: list[dict[str, Any]]) -> None:
    """sync=True synchronises micro-batch 1; a backward outside no_sync synchronises micro-batch 3;
    flush() then does not all-reduce a second time (the update equals the reference)."""
    for rank in ddp:
        res = rank["forced"]
        assert res["calls"] == [1, 3]
        assert res["own_all_reduces"] == 0
        assert res["norm"] == pytest.approx(res["ref_norm"], rel=1e-5)
        assert_tensors_close(res["params"], res["ref_params"])


def test_ddp_checkpoint_after_unsynced_micro_batches_resumes_exactly(ddp: list[dict[str, Any]]) -> None:
    """state_dict() after 2 unsynchronised micro-batches (one file per rank) carries the fact that
    they are rank-local: the resumed optimizer's flush() all-reduces them, as the original would."""
    for rank in ddp:
        res = rank["resumed"]
        assert res["own_all_reduces"] == 1
        assert res["norm"] == pytest.approx(res["ref_norm"], rel=1e-5)
        assert_tensors_close(res["params"], res["ref_params"])


def test_ddp_window_closed_inside_an_unsynced_block_is_all_reduced(ddp: list[dict[str, Any]]) -> None:
    """sync=False on every micro-batch and opt.step() inside the block: DDP never synchronises, so the
    window's close all-reduces once itself, and the update equals the reference."""
    for rank in ddp:
        res = rank["inside"]
        assert res["calls"] == [] and res["own_all_reduces"] == 1
        assert res["norm"] == pytest.approx(res["ref_norm"], rel=1e-5)
        assert_tensors_close(res["params"], res["ref_params"])


def test_ddp_nan_on_one_rank_skips_on_every_rank(ddp: list[dict[str, Any]]) -> None:
    """A nan in one rank's input: both ranks skip, parameters stay bit-identical, no state is made."""
    for rank in ddp:
        res = rank["nan"]
        assert res["skipped"] == [True, True]
        assert res["unchanged"]
        assert res["state_empty"]


def test_ddp_every_rank_snapshots_its_own_batch(ddp: list[dict[str, Any]]) -> None:
    """With several processes a snapshot's name ends in -rank<r>: both ranks keep their own file,
    and only rank 1's attached batch holds the nan that caused the window to go bad."""
    for r, rank in enumerate(ddp):
        path = rank["nan"]["snapshot"]
        assert Path(path).name == f"anomaly-step00000001-nonfinite-rank{r}.pt"
        snap = clipopt.load_snapshot(path)
        assert snap["rank"] == r
        assert [bool(torch.isnan(x).any()) for x in snap["attached"]["inputs"]] == [False, r == 1]


# ---------------------------------------------------------------------------- FSDP2


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, math.inf, 12.0])
def test_fsdp2_global_norm_for_every_p(fsdp: list[dict[str, Any]], p: float) -> None:
    """Every rank records the norm of the full (unsharded) gradient, computed in float64 by one process."""
    for rank in fsdp:
        got, want = rank["norms"][p]
        assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("case", ["2.0", "inf", "2.0-fused"])
def test_fsdp2_nan_in_one_shard_skips_on_every_rank(fsdp: list[dict[str, Any]], case: str) -> None:
    """A nan in rank 1's shard only: both ranks see a non-finite norm (also for the inf-norm, where
    gloo's MAX would drop the nan) and skip; full parameters and optimizer state are bit-identical
    (fused AdamW: the skip reaches the kernel as found_inf, moments and step counters included)."""
    for rank in fsdp:
        res = rank["nan"][case]
        assert res["skipped"] == [True, True]
        assert res["norm_finite"] == [False, False]
        assert res["unchanged"]
        assert res["state_unchanged"]
        assert res["state_tensors"] == (12 if case.endswith("fused") else 0)


@pytest.mark.parametrize("variant", ["accum", "fused"])
def test_fsdp2_accumulation_with_no_sync_equals_one_process(fsdp: list[dict[str, Any]], variant: str) -> None:
    """k=2 with no_sync: the unsynchronised micro-batch leaves p.grad None (FSDP2 keeps it), and the
    norms and full parameters equal the single-process reference (foreach and fused AdamW)."""
    for rank in fsdp:
        res = rank[variant]
        assert res["unsynced_grad_none"] == [True, True]
        assert res["norms"] == pytest.approx(res["ref_norms"], rel=1e-5)
        assert_tensors_close(res["params"], res["ref_params"])


def test_fsdp2_flush_after_unsynced_micro_batch_raises(fsdp: list[dict[str, Any]]) -> None:
    """FSDP2 cannot reduce accumulated gradients after the fact: flush() says so and keeps the window."""
    for rank in fsdp:
        assert rank["flush_error"] == (
            "the latest micro-batch ran inside opt.no_sync(model) without gradient sync, and "
            "FSDPSequential cannot reduce accumulated gradients afterwards; pass "
            "opt.no_sync(model, sync=True) for the last micro-batch before flush()"
        )
        assert rank["flush_micro_batches"] == 1
        assert rank["checkpoint_error"] == (
            "the open window's latest micro-batch ran inside opt.no_sync(model) and FSDPSequential "
            "keeps its unsynchronised gradients internally, so they cannot be saved; checkpoint at "
            "a window boundary (opt.micro_batches == 0)"
        )


@pytest.mark.parametrize("case", ["value", "agc"])
def test_fsdp2_value_clipping_and_agc_equal_one_process(fsdp: list[dict[str, Any]], case: str) -> None:
    """clip_value before the norm bound (against clip_grad_value_ + clip_grad_norm_), and AGC's
    unit-wise bound (against the formula written out), applied to shards give the full-model update."""
    for rank in fsdp:
        res = rank[case]
        assert res["clipped"] == [True, True]
        assert_tensors_close(res["params"], res["ref_params"])


def test_fsdp2_layer_stats_are_those_of_the_full_tensors(fsdp: list[dict[str, Any]]) -> None:
    """layer_stats=True on shards: every rank records, per parameter, the full gradient's norm,
    max |g|, min |g| and the full parameter's norm, as NumPy computes them from one process's
    gradients (accumulated over both ranks' micro-batches); the last weight has an empty shard."""
    assert 0 in fsdp[1]["layer_stats"]["local_numel"]  # the empty-shard case is exercised
    for rank in fsdp:
        res = rank["layer_stats"]
        for name in res["finite"]["names"]:
            g = res["grads"][name].numpy().ravel()
            w = res["params"][name].numpy().ravel()
            row = res["finite"]["got"][name]
            assert row["grad_norm"] == pytest.approx(float(np.sqrt(np.dot(g, g))), rel=1e-5)
            assert row["grad_max"] == pytest.approx(float(np.abs(g).max()), rel=1e-6)
            assert row["grad_min"] == pytest.approx(float(np.abs(g).min()), rel=1e-6, abs=1e-12)
            assert row["nonfinite"] == 0
            assert row["param_norm"] == pytest.approx(float(np.sqrt(np.dot(w, w))), rel=1e-5)


def test_fsdp2_layer_stats_count_a_nan_in_one_shard(fsdp: list[dict[str, Any]]) -> None:
    """A nan in rank 1's shard of the first weight: both ranks count 1 non-finite element there and
    report max |g| and min |g| as nan (gloo's MAX would drop it); the other layers are unaffected."""
    for rank in fsdp:
        res = rank["layer_stats"]
        names = res["nan"]["names"]
        first = res["nan"]["got"][names[0]]
        assert first["nonfinite"] == 1
        assert math.isnan(first["grad_max"]) and math.isnan(first["grad_min"])
        assert math.isnan(first["grad_norm"])
        for name in names[1:]:
            assert res["nan"]["got"][name]["nonfinite"] == 0
            assert math.isfinite(res["nan"]["got"][name]["grad_norm"])


def test_fsdp2_snapshots_are_refused(fsdp: list[dict[str, Any]]) -> None:
    """snapshot_dir with DTensor parameters raises a ValueError that names the way out."""
    for rank in fsdp:
        assert rank["snapshot_error"] == (
            "snapshot_dir does not support DTensor (FSDP2) parameters yet: each rank holds only "
            "shards; pass snapshot_dir=None (norms, clipping, skipping, layer_stats and loggers work)"
        )


# ---------------------------------------------------------------------------- one process


def test_no_sync_on_a_plain_module_changes_nothing() -> None:
    """Without data parallelism no_sync is a no-op: the same loop runs in one process."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), None, accumulation_steps=2)
    ref = torch.nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    x = torch.randn(4, 3)
    for _ in range(2):
        with opt.no_sync(model):
            model(x).sum().backward()
        opt.step()
    ref(x).sum().backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    opt.flush()  # nothing pending, nothing unsynchronised


def test_no_sync_rejects_bad_arguments() -> None:
    """A model that is not a Module, and a non-bool sync, get TypeErrors naming the fix."""
    model = torch.nn.Linear(2, 2)
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    expected = (
        r"^model must be a torch.nn.Module \(a DDP- or FSDP2-wrapped model\), "
        r"got list; pass e.g. opt.no_sync\(ddp_model\)$"
    )
    with pytest.raises(TypeError, match=expected), opt.no_sync([model]):  # type: ignore[arg-type]
        pass
    expected = r"^sync must be True or False, got 'yes' \(str\); pass sync=True or sync=False$"
    with pytest.raises(TypeError, match=expected), opt.no_sync(model, sync="yes"):  # type: ignore[arg-type]
        pass


def test_copies_keep_the_unsynced_marker_without_the_model() -> None:
    """A deepcopy of the optimizer after an unsynchronised DDP micro-batch still knows that its
    gradients are rank-local (so its flush() all-reduces) but holds no process group or model."""
    from clipopt._distributed.collectives import Unsynced

    model = torch.nn.Linear(2, 2)
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    opt._run.counters.micro_batches = 1
    opt._run.unsynced = Unsynced("ddp", 1, "DistributedDataParallel", group=object())
    clone = copy.deepcopy(opt)
    assert clone._run.unsynced is not None and clone._run.unsynced.group is None
    assert (clone._run.unsynced.kind, clone._run.unsynced.micro_batch) == ("ddp", 1)
    sd = opt.state_dict()
    want = {"kind": "ddp", "micro_batch": 1, "model_type": "DistributedDataParallel"}
    assert sd["clipopt"]["unsynced"] == want


def test_partial_gradient_is_refused_before_the_scaler_is_touched() -> None:
    """A DTensor gradient with a Partial placement raises a ValueError naming the fix, and the
    GradScaler is not left half-used, and the failed call is not counted (issue #11: an error leaves
    the wrapper as before the call): with proper gradients the next step() applies the update."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, init_device_mesh

    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        w = torch.nn.Parameter(DTensor.from_local(torch.ones(4), mesh, [Replicate()]))
        opt = ClippedOptimizer(torch.optim.SGD([w], lr=0.1), 1.0, scaler=torch.amp.GradScaler("cpu"))
        assert opt.scaler is not None
        opt.scaler.scale(torch.tensor(1.0))
        w.grad = DTensor.from_local(torch.ones(4), mesh, [Partial()])
        with pytest.raises(ValueError, match=r"^a gradient has a Partial placement"):
            opt.step()
        assert opt.micro_batches == 0 and opt.num_windows == 0  # as before the call
        w.grad = DTensor.from_local(torch.ones(4), mesh, [Replicate()])
        opt.scaler.scale(torch.tensor(1.0))
        scale = opt.scaler.get_scale()
        opt.step()
        assert opt.update_applied
        # the gradient was not scaled by the scaler here, so unscaling divides the norm by the scale
        assert float(opt.last_stats.total_norm) == pytest.approx(2.0 / scale)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("flag", ["", "--fsdp"])
def test_data_parallel_example_runs(flag: str, tmp_path: Path) -> None:
    """examples/data_parallel.py (2 gloo processes): the nan on one rank skips exactly one update on
    both; the rest are applied; the CSVLogger given on both ranks writes each row once (rank 0)."""
    import csv
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    log = tmp_path / "grads.csv"
    cmd = [sys.executable, str(root / "examples" / "data_parallel.py"), "--steps", "8", "--csv", str(log)]
    cmd += [flag] if flag else []
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=root, check=True).stdout
    name = "FSDP2" if flag else "DDP"
    assert f"{name}: 7 updates applied, 1 skipped;" in out
    with log.open() as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == [str(i) for i in range(1, 9)]
    assert [r["reason"] for r in rows].count("nonfinite") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grads.csv"]


@pytest.mark.parametrize("job", ["ddp", "fsdp"])
@pytest.mark.parametrize("p", [2.0, math.inf])
def test_per_group_clipping_equals_one_process(
    ddp: list[dict[str, Any]], fsdp: list[dict[str, Any]], job: str, p: float
) -> None:
    """A group with its own max_norm next to a group sharing the wrapper's: under DDP and FSDP2 (sharded
    gradients: the group norms are reduced over the ranks) every rank records the full gradients'
    group norms and total norm, and SGD (fused under DDP) applies torch's clip_grad_norm_ per group."""
    for rank in ddp if job == "ddp" else fsdp:
        res = rank["groups"][p]
        assert res["group_norms"] == pytest.approx(res["ref_norms"], rel=1e-5)
        assert res["total_norm"] == pytest.approx(res["ref_total"], rel=1e-5)
        assert_tensors_close(res["params"], res["ref_params"])
