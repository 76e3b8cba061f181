"""SpikeGuard and Rewind on CUDA: no synchronisation per window, pinned non-blocking copies, exact restore.

Skipped without a CUDA device (marked ``cuda``: ``python -m pytest -m cuda``). On CPU the same claims
are tested through intercepted host reads (tests/recovery/test_spike_recovery.py,
tests/recovery/test_rewind.py);
here ``torch.cuda.set_sync_debug_mode("error")`` makes any synchronising call raise.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import pytest
import torch

from clipopt import ClippedOptimizer, Rewind, SpikeGuard
from clipopt._recovery.host_copy import TrainingState, capture, restore

from ..helpers import mlp
from ..markers import needs_cuda

pytestmark = needs_cuda

DEVICE = "cuda"


@pytest.fixture(autouse=True)
def _sync_debug_off() -> Iterator[None]:
    """Whatever a test does, the sync debug mode is off after it."""
    yield
    torch.cuda.set_sync_debug_mode(0)


_model = partial(mlp, (16, 64, 4), device=DEVICE)  # Linear(16, 64), Tanh, Linear(64, 4), global seed 0


def _window(model: torch.nn.Module, opt: ClippedOptimizer, seed: int, scale: float = 1.0) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(32, 16, device=DEVICE, generator=gen)
    loss = model(x).pow(2).mean() * scale
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step(loss=loss)
    opt.zero_grad()


def test_fused_window_with_guard_does_not_synchronise() -> None:
    """Fused AdamW with a SpikeGuard: after the first window, windows (spikes included) never sync."""
    model = _model()
    opt = ClippedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
        spike_guard=SpikeGuard(z_thresh=6.0, window=16, warmup=4),
    )
    _window(model, opt, 0)  # the inner state is created (host path)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    for seed in range(1, 12):
        _window(model, opt, seed, scale=1e4 if seed == 9 else 1.0)
    torch.cuda.set_sync_debug_mode(0)
    assert [s.reason for s in opt.stats][-3] == "spike"


def test_rewind_copies_are_pinned_and_restore_exactly() -> None:
    """A copy of CUDA state goes to pinned host memory with an event; restore() gives it back bit for bit."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    wrapped = ClippedOptimizer(opt)
    for seed in range(3):
        _window(model, wrapped, seed)
    target = TrainingState(list(model.parameters()), list(model.buffers()), opt)
    saved = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in opt.state[next(model.parameters())].items()}
    copy = capture(target, None, 3, 3)
    assert all(t.is_pinned() for t in copy.leaves) and copy.event is not None
    for seed in range(3, 6):
        _window(model, wrapped, seed)
    restore(copy, target)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), saved, strict=True))
    live = opt.state[next(model.parameters())]
    assert all(torch.equal(live[k], v) and live[k].device == v.device for k, v in state.items())


def test_rewind_checks_synchronise_only_at_checks() -> None:
    """With a Rewind (check_every=4), windows between checks do not synchronise."""
    model = _model()
    rewind = Rewind(every=100, check_every=4, module=model)
    opt = ClippedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
        spike_guard=SpikeGuard(window=16, warmup=4),
        rewind=rewind,
    )
    for seed in range(5):  # the first check (window 5's start) takes the first copy
        _window(model, opt, seed)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    for seed in range(5, 8):  # windows 6-8: no check
        _window(model, opt, seed)
    torch.cuda.set_sync_debug_mode(0)
    assert rewind.copies_taken == 1


def test_rewind_copies_batch_norm_buffers_at_the_close_without_synchronising() -> None:
    """The close before a check copies the module's buffers to pinned host memory without a sync; the
    copy taken at the check (after the next forward pass) holds them: the batch-norm statistics as
    they were when its window closed, bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64), torch.nn.Tanh(), torch.nn.Linear(64, 4)
    ).to(DEVICE)
    rewind = Rewind(every=1, check_every=4, module=model)
    opt = ClippedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
        spike_guard=SpikeGuard(window=16, warmup=4),
        rewind=rewind,
    )
    for seed in range(5):  # the first check (window 5's start) takes the first copy
        _window(model, opt, seed)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    for seed in range(5, 8):  # windows 6-8; window 8's close copies the buffers
        _window(model, opt, seed)
    torch.cuda.set_sync_debug_mode(0)
    want = [b.detach().to("cpu", copy=True) for b in model.buffers()]
    _window(model, opt, 8, scale=1e4)  # window 9: its forward pass changes them; its check copies window 8
    assert rewind.copies[-1] == (8, 8)
    saved = rewind.state_dict()["copies"][-1]
    numbers = [leaf[1] for leaf in dict(saved["spec"][1])["buffers"][1]]
    got = [saved["leaves"][i] for i in numbers]
    assert [b.dtype for b in got] == [b.dtype for b in want]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert not torch.equal(got[0], next(model.buffers()).cpu())  # window 9's forward changed running_mean
