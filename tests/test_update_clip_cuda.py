"""``UpdateClip`` on a CUDA device: fused AdamW stays free of synchronising calls
(``torch.cuda.set_sync_debug_mode("error")``); the CPU tests (tests/test_update_clip.py,
tests/hostreads.py) cover the same code for host reads."""

from __future__ import annotations

import pytest
import torch

from clipopt import ClippedOptimizer, UpdateClip

from .helpers import batches_for, model_for
from .markers import needs_cuda
from .test_update_clip import LR, MODES, _backward

pytestmark = needs_cuda


@pytest.mark.parametrize(
    "options",
    [{"update_stats": True}, *({"update_clip": UpdateClip(**limits)} for limits in MODES.values())],
    ids=["update_stats", *MODES],
)
def test_fused_adamw_on_cuda_with_update_clipping_does_not_sync(options: dict) -> None:
    """Fused AdamW on CUDA with each mode (accumulation 2, one window with a nan gradient) under
    torch.cuda.set_sync_debug_mode("error") after the first update: no synchronising call."""
    model = model_for().cuda()
    inner = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    opt = ClippedOptimizer(inner, max_norm=1.0, accumulation_steps=2, **options)
    batches = [(x.cuda(), y.cuda()) for x, y in batches_for(10, seed=17)]
    try:
        for i, batch in enumerate(batches):
            if i == 2:  # the first update, which creates the optimizer's state, may read once
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            _backward(model, batch, nan=i == 6)
            opt.step()
            opt.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert [s.reason for s in opt.stats] == [None, None, None, "nonfinite", None]
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
