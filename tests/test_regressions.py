"""Regression tests for defects found in review: each names what went wrong before."""

from __future__ import annotations

import copy
import csv
import math
import re
from pathlib import Path

import pytest
import torch

import clipopt
from clipopt import AutoClip, ClippedOptimizer, CSVLogger

from .hostreads import count_host_reads


class TwoHeads(torch.nn.Module):
    """A trunk and two heads; each task's loss reaches only its own head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Linear(3, 4)
        self.a = torch.nn.Linear(4, 1)
        self.b = torch.nn.Linear(4, 1)

    def loss(self, task: str, x: torch.Tensor) -> torch.Tensor:
        head = self.a if task == "a" else self.b
        return head(torch.tanh(self.trunk(x))).pow(2).sum()


def _task_run(model: TwoHeads, opt: torch.optim.Optimizer, plan: list[tuple[str, bool]]) -> None:
    """Train on the plan; batch i is the same tensor whatever came before (a bad batch is a NaN one)."""
    for i, (task, bad) in enumerate(plan):
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(100 + i))
        if bad:
            x[0, 0] = float("nan")
        model.loss(task, x).backward()
        opt.step()
        opt.zero_grad()


# Fused SGD with momentum cannot train a parameter that first gets a gradient after other parameters
# have momentum buffers (torch 2.13 raises TypeError in _fused_sgd), with or without clipopt.
MULTI_TASK = {
    "AdamW-fused": lambda p: torch.optim.AdamW(p, lr=0.1, fused=True),
    "SGD-momentum-foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
}


@pytest.mark.parametrize("name", list(MULTI_TASK))
def test_skip_on_a_parameter_without_state_is_clean(name: str) -> None:
    """A skipped window reaching a head that has no optimizer state yet leaves no (garbage) state.

    Before: the 'state ready' cache was keyed on the number of gradients, so a window whose
    gradients reached a different head of the same size took the fused path, leaving state
    behind (fused AdamW: step 0 and zero moments; fused SGD: an uninitialised momentum buffer).
    """
    model = TwoHeads()
    ref = copy.deepcopy(model)
    opt = ClippedOptimizer(MULTI_TASK[name](list(model.parameters())))
    ref_opt = ClippedOptimizer(MULTI_TASK[name](list(ref.parameters())))
    _task_run(model, opt, [("a", False), ("a", False), ("b", True)])
    assert all(p not in opt.state for p in model.b.parameters())  # as if the window never happened
    _task_run(model, opt, [("a", False), ("b", False)])
    _task_run(ref, ref_opt, [("a", False), ("a", False)])
    _task_run(ref, ref_opt, [("a", False), ("b", False)])
    assert opt.num_skipped == 1
    assert len(opt.state) == len(ref_opt.state)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


def test_fused_state_cache_does_not_survive_load_state_dict() -> None:
    """After loading a state dict without state, a skipped first window leaves no state behind."""
    model = TwoHeads()
    opt = ClippedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1, fused=True))
    fresh = copy.deepcopy(opt.state_dict())
    _task_run(model, opt, [("a", False), ("b", False)])
    opt.load_state_dict(fresh)
    _task_run(model, opt, [("a", True)])
    assert opt.step_was_skipped
    assert len(opt.state) == 0


def test_disabled_scaler_state_is_rejected_untouched() -> None:
    """A scaler state saved from a disabled GradScaler ({}) is refused before anything is loaded."""
    model = TwoHeads()
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler, accumulation_steps=2)
    scaler.scale(model.loss("a", torch.ones(2, 3))).backward()
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["clipopt"]["scaler"] = {}
    opt2 = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        scaler=torch.amp.GradScaler("cpu", init_scale=8.0),
        accumulation_steps=2,
    )
    with pytest.raises(ValueError, match=re.escape("the GradScaler rejected 'clipopt.scaler'")):
        opt2.load_state_dict(sd)
    assert opt2.micro_batches == 0 and len(opt2.state) == 0


def test_tensor_learning_rate_is_not_read_on_the_fused_path() -> None:
    """A tensor lr (fused AdamW) is recorded without a host read; it becomes a float when read."""
    model = TwoHeads()
    opt = ClippedOptimizer(torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), fused=True))
    reads = []
    for _ in range(3):
        model.loss("a", torch.ones(2, 3)).backward()
        with count_host_reads() as r:
            opt.step()
        reads.append(len(r))
        opt.zero_grad()
    assert reads[1:] == [0, 0]
    assert opt.last_stats is not None and opt.last_stats.lr == (pytest.approx(0.01),)


def test_per_update_reads_nothing_inside_a_window() -> None:
    """per_update.step() on micro-batch calls reads nothing, also once fused skips made counters tensors."""
    model = TwoHeads()
    opt = ClippedOptimizer(torch.optim.AdamW(model.parameters(), fused=True), accumulation_steps=3)
    sched = clipopt.per_update(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    reads = []
    for i in range(9):
        x = torch.ones(2, 3)
        if i == 4:
            x[0, 0] = float("nan")
        model.loss("a", x).backward()
        opt.step()
        with count_host_reads() as r:
            sched.step()
        reads.append(len(r))
        opt.zero_grad()
    assert [reads[i] for i in (0, 1, 3, 4, 6, 7)] == [0] * 6
    assert sched.last_epoch == 2  # windows 1 and 3 applied, window 2 skipped


def test_sparse_gradients_with_layer_stats() -> None:
    """SparseAdam with clipping off and per-layer statistics works (sparse gradients are coalesced)."""
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = ClippedOptimizer(
        torch.optim.SparseAdam(emb.parameters()),
        max_norm=None,
        layer_stats=True,
        param_names=emb.named_parameters(),
    )
    emb(torch.tensor([1, 2, 2])).sum().backward()
    dense = emb.weight.grad.to_dense().clone()  # type: ignore[union-attr]
    opt.step()
    assert opt.last_stats is not None and opt.last_stats.layers is not None
    assert opt.last_stats.layers["weight"]["grad_norm"] == pytest.approx(dense.norm().item(), rel=1e-6)


def test_foreach_true_with_sparse_gradients_says_so() -> None:
    """foreach=True with sparse gradients is a ValueError that names the cause, not the device."""
    g = torch.sparse_coo_tensor([[0]], [1.0], (3,), check_invariants=True)
    msg = "foreach=True does not support sparse gradients; pass foreach=None (the default)"
    with pytest.raises(ValueError, match=re.escape(msg)):
        clipopt.functional.get_total_norm([g], 2.0, foreach=True)


def test_csv_rows_keep_their_width_after_add_param_group(tmp_path: Path) -> None:
    """A group added mid-run does not shift the per-layer columns of later rows."""
    model = TwoHeads()
    path = tmp_path / "g.csv"
    params = list(model.trunk.parameters()) + list(model.a.parameters())
    opt = ClippedOptimizer(torch.optim.SGD(params, lr=0.1), layer_stats=True, loggers=[CSVLogger(path)])
    _task_run(model, opt, [("a", False)])
    opt.add_param_group({"params": list(model.b.parameters()), "lr": 0.2})
    _task_run(model, opt, [("b", False)])
    opt.close()
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    assert len({len(r) for r in rows}) == 1


def test_names_of_groups_added_later() -> None:
    """add_param_group with param_names names those parameters in per-layer output."""
    model = TwoHeads()
    opt = ClippedOptimizer(torch.optim.SGD(model.trunk.named_parameters(), lr=0.1))
    opt.add_param_group({"params": list(model.a.parameters()), "param_names": ["a.weight", "a.bias"]})
    assert opt.layer_names() == ["weight", "bias", "a.weight", "a.bias"]


def test_deepcopy_shares_loggers(tmp_path: Path) -> None:
    """A deep copy of the optimizer logs into the same logger, so buffered rows are not written twice."""
    model = TwoHeads()
    path = tmp_path / "g.csv"
    logger = CSVLogger(path)
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), loggers=[logger])
    _task_run(model, opt, [("a", False)] * 3)
    twin = copy.deepcopy(opt)
    assert twin.loggers[0] is logger
    opt.close()
    twin.close()
    with path.open(newline="") as f:
        steps = [r["step"] for r in csv.DictReader(f)]
    assert steps == ["1", "2", "3"]


def test_policy_sees_each_window_once_with_lbfgs() -> None:
    """LBFGS re-evaluations are clipped with the window's bound; AutoClip records one norm per step()."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    policy = AutoClip(percentile=50, history=16)
    opt = ClippedOptimizer(torch.optim.LBFGS(model.parameters(), max_iter=5), max_norm=policy)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    opt.step(closure)
    opt.step(closure)
    recorded = policy.state_dict()["buffer"]
    assert int((~torch.isnan(recorded)).sum()) == 2
    assert math.isfinite(opt.last_stats.max_norm)  # type: ignore[union-attr, arg-type]


def test_zclip_with_a_low_max_grad_norm_does_not_call_everything_a_spike() -> None:
    """max_grad_norm below the usual norm caps the bound but not ZClip's statistics (as the zclip package).

    Before: the EMAs were fed the capped norm, so nearly every later window became a spike.
    """
    policy = clipopt.ZClip(max_grad_norm=1.0, warmup_steps=10, skip_spikes=True)
    gen = torch.Generator().manual_seed(0)
    norms = 10 + 0.5 * torch.randn(200, generator=gen)
    spikes = 0
    for g in norms:
        bound = policy.threshold(g.clone())
        spike = policy.spike()
        assert spike is not None
        spikes += int(spike.item())
        assert bound.item() <= 1.0
    assert spikes < 10


def test_spike_skips_do_not_count_as_nonfinite() -> None:
    """Skipped spikes do not extend max_consecutive_nonfinite's count (finite gradients never raise)."""
    model = TwoHeads()
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1e-4),
        max_norm=clipopt.ZClip(warmup_steps=3, skip_spikes=True),
        max_consecutive_nonfinite=2,
    )
    for i in range(12):
        scale = 1.0 if i < 6 else 100.0  # the norm level jumps: several spikes in a row
        model.loss("a", torch.full((2, 3), scale)).backward()
        opt.step()
        opt.zero_grad()
    assert [s.reason for s in opt.stats].count("spike") >= 2


def test_agc_float64_parameters() -> None:
    """AGC works on float64 models (the norms are not forced to float32)."""
    model = TwoHeads().double()
    agc = clipopt.AGC(clip_factor=1e-3)
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), max_norm=agc)
    model.loss("a", torch.ones(2, 3, dtype=torch.float64) * 10).backward()
    opt.step()
    assert opt.last_stats is not None and opt.last_stats.clipped


def test_autoclip_nonfinite_windows_keep_the_history() -> None:
    """A non-finite window does not push a finite norm out of AutoClip's ring buffer."""
    policy = clipopt.AutoClip(percentile=50, history=3)
    for v in (1.0, 2.0, 3.0):
        policy.threshold(torch.tensor(v))
    policy.threshold(torch.tensor(float("nan")))
    bound = policy.threshold(torch.tensor(float("inf")))
    assert bound.item() == 2.0
    saved = policy.state_dict()
    policy.threshold(torch.tensor(10.0))
    assert sorted(saved["buffer"].tolist()) == [1.0, 2.0, 3.0]  # a copy, not the live buffer


def test_scaler_recovers_after_an_error_inside_a_window() -> None:
    """An exception between unscale_ and the step still updates the scaler, so the next window works."""
    model = TwoHeads()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)

    class Failing(torch.optim.SGD):
        fail = True

        def step(self, closure: object = None) -> object:
            if Failing.fail:
                Failing.fail = False
                raise RuntimeError("boom")
            return super().step(closure)  # type: ignore[arg-type]

    opt = ClippedOptimizer(Failing(model.parameters(), lr=0.1), scaler=scaler)
    scaler.scale(model.loss("a", torch.ones(2, 3))).backward()
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    opt.zero_grad()
    scaler.scale(model.loss("a", torch.ones(2, 3))).backward()
    opt.step()
    assert opt.update_applied


def test_csv_logger_widens_when_a_parameter_group_is_added(tmp_path: Path) -> None:
    """Before: CSVLogger fixed its columns at the first row, so a group added later (unfreezing a
    layer) had no lr and no per-layer columns.  Now the file is rewritten once with the columns a new
    logger would use: earlier rows empty there, later rows filled, and a resumed run appends."""
    torch.manual_seed(0)
    trunk, head = torch.nn.Linear(3, 4), torch.nn.Linear(4, 1)
    path = tmp_path / "grads.csv"
    opt = ClippedOptimizer(
        torch.optim.SGD(head.parameters(), lr=0.1),
        param_names=[("head.weight", head.weight), ("head.bias", head.bias)],
        layer_stats=True,
        loggers=[CSVLogger(path, flush_every=1)],
    )
    x = torch.randn(6, 3)

    def window() -> None:
        head(torch.tanh(trunk(x))).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        trunk.zero_grad()

    window()
    window()
    opt.add_param_group({"params": list(trunk.parameters()), "lr": 0.01})
    trunk_ref, head_ref = copy.deepcopy(trunk), copy.deepcopy(head)
    head_ref(torch.tanh(trunk_ref(x))).pow(2).sum().backward()
    assert trunk_ref.weight.grad is not None
    want = float(trunk_ref.weight.grad.double().norm())
    window()
    opt.close()
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        header, rows = reader.fieldnames, list(reader)
    assert header is not None
    assert [r["step"] for r in rows] == ["1", "2", "3"]
    assert "lr.1" in header and header.index("lr.1") < header.index("head.weight.grad_norm")
    assert [r["lr.1"] for r in rows] == ["", "", "0.01"]
    new_column = "group1.0.grad_norm"  # the trunk's weight (unnamed: it was added later)
    assert [r[new_column] == "" for r in rows] == [True, True, False]
    assert float(rows[2][new_column]) == pytest.approx(want, rel=1e-6)
    assert all(r["head.weight.grad_norm"] != "" for r in rows)

    # a resumed run (a new logger, the same groups) appends without a second header
    opt2 = ClippedOptimizer(
        torch.optim.SGD(head.parameters(), lr=0.1),
        param_names=[("head.weight", head.weight), ("head.bias", head.bias)],
        layer_stats=True,
        loggers=[CSVLogger(path, flush_every=1)],
    )
    opt2.add_param_group({"params": list(trunk.parameters()), "lr": 0.01})
    opt2.load_state_dict(opt.state_dict())
    head(torch.tanh(trunk(x))).pow(2).sum().backward()
    opt2.step()
    opt2.close()
    text = path.read_text()
    assert text.count("step,micro_batches") == 1
    assert text.strip().splitlines()[-1].startswith("4,")


def _unfreeze_run(path: Path, logger: CSVLogger) -> tuple[ClippedOptimizer, torch.nn.Linear, torch.nn.Linear]:
    """Two windows on the head, then the trunk is added as a second group and one more window runs."""
    torch.manual_seed(0)
    trunk, head = torch.nn.Linear(3, 4), torch.nn.Linear(4, 1)
    opt = ClippedOptimizer(torch.optim.SGD(head.parameters(), lr=0.1), loggers=[logger])
    x = torch.randn(6, 3)
    for i in range(3):
        if i == 2:
            opt.add_param_group({"params": list(trunk.parameters()), "lr": 0.01})
        head(torch.tanh(trunk(x))).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        trunk.zero_grad()
    opt.close()
    return opt, trunk, head


def test_csv_widening_that_fails_warns_and_keeps_a_consistent_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: a failed rewrite (disk full) escaped opt.step(), lost the row, left a .tmp file and
    later rows longer than the header.  Now it warns, keeps the old columns, and every row fits."""
    path = tmp_path / "grads.csv"

    def no_space(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("clipopt._logging.os.replace", no_space)
    with pytest.warns(RuntimeWarning, match="could not rewrite .* No space left on device"):
        _unfreeze_run(path, CSVLogger(path, flush_every=1))
    monkeypatch.undo()
    with path.open(newline="") as f:
        lines = list(csv.reader(f))
    assert lines[0][-2:] == ["lr", "loss"] and len({len(line) for line in lines}) == 1
    assert [line[0] for line in lines[1:]] == ["1", "2", "3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grads.csv"]


def test_csv_resume_from_before_a_group_was_added_appends(tmp_path: Path) -> None:
    """Before: a file widened by add_param_group refused a run resumed from an earlier checkpoint
    (one group: fewer columns).  Now it is appended to in the file's column order, lr.1 empty."""
    path = tmp_path / "grads.csv"
    _unfreeze_run(path, CSVLogger(path, flush_every=1))
    torch.manual_seed(0)
    head = torch.nn.Linear(4, 1)
    opt = ClippedOptimizer(torch.optim.SGD(head.parameters(), lr=0.1), loggers=[CSVLogger(path)])
    head(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.close()
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames is not None and reader.fieldnames[-1] == "lr.1"
    assert [(r["step"], r["lr"], r["lr.1"]) for r in rows] == [
        ("1", "0.1", ""), ("2", "0.1", ""), ("3", "0.1", "0.01"), ("1", "0.1", "")
    ]
