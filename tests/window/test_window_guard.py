"""Gradients of an open window cleared from outside, and stacked accumulation, are reported at step()."""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import os
import pickle
import warnings
from collections.abc import Iterable
from functools import partial

import pytest
import torch
from torch import nn

from clipopt import ClippedOptimizer

from ..helpers import mlp
from ..hostreads import count_host_reads

CLEARED = r"cleared or replaced from outside the wrapper before this step\(\)"


_model = partial(mlp, (6, 5, 2))  # Linear(6, 5), Tanh, Linear(5, 2), global seed 0


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return model(torch.randn(4, 6, generator=gen)).pow(2).mean()


def _opt(model: nn.Module, k: int = 4, **kw) -> ClippedOptimizer:
    return ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), max_norm=1.0, accumulation_steps=k, **kw
    )


def _clear_mid_window(model: nn.Module, opt: ClippedOptimizer, seed: int) -> None:
    """Micro-batch ``seed`` and its step(), then model.zero_grad() inside the window, then the
    backward of micro-batch ``seed + 1`` (its step() is the caller's: it must raise)."""
    _loss(model, seed).backward()
    opt.step()
    model.zero_grad()
    _loss(model, seed + 1).backward()


def _plain_update(params: list[nn.Parameter], ref_opt: torch.optim.Optimizer) -> None:
    """Plain torch at the end of a window: clip to norm 1.0 (the wrapper's max_norm), step, zero."""
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    ref_opt.step()
    ref_opt.zero_grad()


def _assert_params_close(got: Iterable[torch.Tensor], want: Iterable[torch.Tensor]) -> None:
    for p, r in zip(got, want, strict=True):
        torch.testing.assert_close(p, r)


@pytest.mark.parametrize(
    "clear",
    [
        pytest.param(lambda m: m.zero_grad(), id="model.zero_grad()"),
        pytest.param(lambda m: m.zero_grad(set_to_none=False), id="zero_grad(set_to_none=False)"),
        pytest.param(lambda m: setattr(m[0].weight, "grad", torch.zeros_like(m[0].weight)), id="assigned"),
        pytest.param(lambda m: m[0].weight.grad.mul_(0.5), id="changed-in-place"),
    ],
)
def test_outside_clearing_raises_at_next_step(clear) -> None:
    """Clearing (or replacing) the gradients between two micro-batches of a window raises at the next
    step(), naming cause and fix, before the micro-batch is counted."""
    model = _model()
    opt = _opt(model)
    _loss(model, 0).backward()
    opt.step()
    clear(model)
    _loss(model, 1).backward()
    params = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=CLEARED) as info:
        opt.step()
    msg = str(info.value)
    assert "(1 of 4 micro-batches accumulated)" in msg
    assert "model.zero_grad()" in msg and "accumulation_steps=1" in msg and "opt.zero_grad()" in msg
    assert opt.micro_batches == 1 and opt.num_windows == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True))


def test_clearing_in_the_last_micro_batch_is_caught() -> None:
    """model.zero_grad() before the window's last micro-batch raises at the closing step(); no update."""
    model = _model()
    opt = _opt(model, k=2)
    for i in range(4):  # two clean windows
        _loss(model, i).backward()
        opt.step()
        opt.zero_grad()
    _clear_mid_window(model, opt, 4)
    with pytest.raises(RuntimeError, match=CLEARED):
        opt.step()
    assert opt.num_windows == 2


def test_optimizer_zero_grad_every_micro_batch_is_fine() -> None:
    """opt.zero_grad() before each backward and after each step (the usual loops) raises nothing and
    gives the mean of the micro-batch gradients, clipped, as plain torch does."""
    model, ref = _model(), _model()
    opt = _opt(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(8):
        opt.zero_grad()
        _loss(model, i).backward()
        opt.step()
        opt.zero_grad()
        (_loss(ref, i) / 4).backward()
        if i % 4 == 3:
            _plain_update(list(ref.parameters()), ref_opt)
    assert opt.num_updates == 2
    _assert_params_close(model.parameters(), ref.parameters())


def test_stacked_accumulation_raises_and_can_be_declared() -> None:
    """Two backward passes per step() while accumulating raise; backward_passes_per_step=2 declares them
    (two losses backwarded separately), and the update equals plain torch on the summed losses."""
    model = _model()
    opt = _opt(model, k=2)
    for i in range(2):  # the first window arms the guard (one backward per step)
        _loss(model, i).backward()
        opt.step()
    opt.zero_grad()
    _loss(model, 2).backward()
    _loss(model, 3).backward()
    with pytest.raises(RuntimeError, match=r"2 backward passes ran since the previous step\(\)") as info:
        opt.step()
    msg = str(info.value)
    assert "accumulation_steps=2" in msg and "span 4 backward passes" in msg
    assert "backward_passes_per_step=2" in msg

    model, ref = _model(), _model()
    opt = _opt(model, k=2, backward_passes_per_step=2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(0, 8, 2):
        _loss(model, i).backward()
        _loss(model, i + 1).backward()
        opt.step()
        opt.zero_grad()
        ((_loss(ref, i) + _loss(ref, i + 1)) / 2).backward()
        if i % 4 == 2:
            _plain_update(list(ref.parameters()), ref_opt)
    assert opt.num_updates == 2
    _assert_params_close(model.parameters(), ref.parameters())


def test_framework_accumulation_with_accumulation_steps_1_is_fine() -> None:
    """With accumulation_steps=1 any number of backward passes per step() is the framework's business."""
    model = _model()
    opt = _opt(model, k=1)
    for i in range(3):
        for j in range(4):
            _loss(model, 4 * i + j).backward()
        opt.step()
        model.zero_grad()
    assert opt.num_updates == 3


def test_create_graph_backward_replaces_grad_without_false_alarm() -> None:
    """backward(create_graph=True) accumulates out of place (a new .grad tensor each time): no error."""
    model = _model()
    opt = _opt(model, k=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's reference-cycle warning for create_graph
        _loss(model, 0).backward(create_graph=True)
        opt.step()
        before = model[0].weight.grad
        _loss(model, 1).backward(create_graph=True)
        assert model[0].weight.grad is not before  # the out-of-place case is exercised
        opt.step()
        _loss(model, 2).backward(create_graph=True)
        opt.step()
    assert opt.num_updates == 1
    for p in model.parameters():
        p.grad = None  # break the create_graph reference cycle


def test_parameter_without_gradient_in_some_micro_batches() -> None:
    """The first parameter (the sentinel) gets no gradient in odd micro-batches: no false alarm, and the
    window's update equals plain torch."""
    torch.manual_seed(0)
    a, b = nn.Linear(6, 2), nn.Linear(6, 2)
    ref_a, ref_b = copy.deepcopy(a), copy.deepcopy(b)
    opt = ClippedOptimizer(
        torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1), max_norm=1.0, accumulation_steps=4
    )
    ref_opt = torch.optim.SGD([*ref_a.parameters(), *ref_b.parameters()], lr=0.1)
    for i in range(8):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(i))
        (a(x) if i % 2 == 0 else b(x)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ((ref_a(x) if i % 2 == 0 else ref_b(x)).pow(2).mean() / 4).backward()
        if i % 4 == 3:
            _plain_update([*ref_a.parameters(), *ref_b.parameters()], ref_opt)
    _assert_params_close([*a.parameters(), *b.parameters()], [*ref_a.parameters(), *ref_b.parameters()])


def test_activation_checkpointing_counts_one_pass() -> None:
    """torch.utils.checkpoint (non-reentrant) recomputes the forward inside backward: still one pass."""
    model = _model()
    opt = _opt(model, k=2)
    for i in range(4):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(i))
        torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert opt.num_updates == 2


def test_checkpoint_and_copies_mid_window_keep_working() -> None:
    """state_dict/load_state_dict, pickle and deepcopy in the middle of a window: the copies and the
    original continue without a false alarm (the guard is not state; it re-arms) and agree."""
    model = _model()
    opt = _opt(model)
    for i in range(2):
        _loss(model, i).backward()
        opt.step()
        opt.zero_grad()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    loaded_model = copy.deepcopy(model)
    for p in loaded_model.parameters():
        p.grad = None
    loaded = _opt(loaded_model)
    loaded.load_state_dict(torch.load(buf, weights_only=True))
    copied = copy.deepcopy(opt)  # copies its own parameters and their gradients
    pickled = pickle.loads(pickle.dumps(opt))
    for o in (opt, loaded, copied, pickled):
        params = o._params()
        for i in range(2, 4):
            loss = sum((p * p).sum() * (i + 1) for p in params)
            loss.backward()
            o.step()
            o.zero_grad()
        assert o.num_updates == 1
    for o in (loaded, copied, pickled):
        for p, q in zip(opt._params(), o._params(), strict=True):
            torch.testing.assert_close(p, q)


def test_hook_goes_with_the_optimizer() -> None:
    """The sentinel's hook is removed when the optimizer is garbage collected."""
    model = _model()
    opt = _opt(model)
    _loss(model, 0).backward()
    opt.step()
    assert any(p._backward_hooks for p in model.parameters())
    del opt
    gc.collect()
    assert not any(p._backward_hooks for p in model.parameters())


def test_guard_reads_nothing_from_the_device() -> None:
    """Backward passes (with the hook) and micro-batch step() calls make no host read."""
    model = _model()
    opt = _opt(model, k=100)
    _loss(model, 0).backward()
    opt.step()
    with count_host_reads() as reads:
        for i in range(1, 5):
            _loss(model, i).backward()
            opt.step()
    assert len(reads) == 0


@pytest.mark.parametrize(
    ("value", "exc", "match"),
    [
        (0, ValueError, r"backward_passes_per_step must be an int >= 1, got 0; pass e.g\."),
        (2.0, TypeError, r"backward_passes_per_step must be an int >= 1, got 2\.0 \(float\)"),
        (True, TypeError, r"backward_passes_per_step must be an int >= 1, got True \(bool\)"),
    ],
)
def test_backward_passes_per_step_is_validated(value, exc, match) -> None:
    """backward_passes_per_step: an int >= 1, else an error naming it, the value and the fix."""
    with pytest.raises(exc, match=match):
        _opt(_model(), backward_passes_per_step=value)


def _ddp_job(rank: int, port: int, out: str) -> None:
    """2 gloo processes: DDP with and without gradient_as_bucket_view, synchronising every micro-batch
    or through opt.no_sync; 3 windows of 3 must train, then model.zero_grad() mid-window must raise."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = {}
    for bucket_view in (False, True):
        for mode in ("sync", "no_sync"):
            ddp = nn.parallel.DistributedDataParallel(_model(), gradient_as_bucket_view=bucket_view)
            opt = _opt(ddp, k=3)
            for i in range(9):
                context = opt.no_sync(ddp) if mode == "no_sync" else contextlib.nullcontext()
                with context:
                    _loss(ddp, 10 * rank + i).backward()
                opt.step()
                opt.zero_grad()
            _clear_mid_window(ddp, opt, 100)
            try:
                opt.step()
                caught = False
            except RuntimeError as exc:
                caught = "cleared or replaced from outside" in str(exc)
            results[f"{bucket_view}-{mode}"] = (opt.num_updates, caught)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    from tests.distributed_jobs import leave_process_group

    leave_process_group()


def test_ddp_gradients_and_bucket_views_are_not_mistaken_for_clearing(tmp_path) -> None:
    """DDP writes gradients during backward (and, with gradient_as_bucket_view, keeps them as views of
    a bucket whose version counter other parameters bump): no false alarm in any combination, and
    model.zero_grad() inside a window is still caught on every rank."""
    from ..helpers import free_port, join_spawned, start_ranks

    join_spawned(start_ranks(_ddp_job, (free_port(), str(tmp_path)), 2), "DDP guard")
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        keys = ("False-sync", "False-no_sync", "True-sync", "True-no_sync")
        assert results == {key: (3, True) for key in keys}
