"""UpdateClip and update_stats together with the clipping policies built beside them (AdaGC,
StableSPAM): a window whose update is put back leaves every part of the wrapper as if it never
happened (docs/update-clipping.md, 'Combinations')."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from clipopt import AdaGC, ClippedOptimizer, StableSPAM, UpdateClip

from ..helpers import ZeroDivideSGD, batches_for, model_for, mse

#: The per-tensor policies, with a warm-up short enough that the runs reach their per-tensor rule.
POLICIES: dict[str, Callable[[], Any]] = {"AdaGC": lambda: AdaGC(warmup=3), "StableSPAM": StableSPAM}
#: The update options that take a copy before the inner step: bounded (max_rms) or only measured.
UPDATES: dict[str, dict[str, Any]] = {
    "max_rms": {"update_clip": UpdateClip(max_rms=0.004)},
    "update_stats": {"update_stats": True},
}


def _run(
    policy: Callable[[], Any], update: dict[str, Any], bad_calls: tuple[int, ...], drop: int | None
) -> Any:
    """ZeroDivideSGD (its update divided by zero at ``bad_calls``) with ``policy`` as max_norm and
    ``update`` over 10 batches, batch ``drop`` left out; the model, the optimizer and the policy."""
    model = model_for()
    clip = policy()
    opt = ClippedOptimizer(
        ZeroDivideSGD(model.parameters(), lr=0.05, bad_calls=bad_calls), max_norm=clip, **dict(update)
    )
    for i, batch in enumerate(batches_for(10, seed=3)):
        if i == drop:
            continue
        mse(model, batch).backward()
        opt.step()
        opt.zero_grad()
    return model, opt, clip


@pytest.mark.parametrize("update", list(UPDATES.values()), ids=list(UPDATES))
@pytest.mark.parametrize("policy", list(POLICIES.values()), ids=list(POLICIES))
def test_a_nonfinite_update_leaves_the_per_tensor_policy_as_if_it_never_happened(
    policy: Callable[[], Any], update: dict[str, Any]
) -> None:
    """The last window's update is non-finite (the inner optimizer divides by zero) from finite
    gradients: it is put back (reason "nonfinite_update"), and the policy's statistics as well as
    the parameters end bit for bit as in the run that never saw that batch (the policy had already
    moved its statistics when the update was found bad).  (The inner state keeps what the rejected
    step made of the gradient: see test_update_clip.py for it.)"""
    model, opt, clip = _run(policy, update, bad_calls=(10,), drop=None)
    ref_model, _, ref_clip = _run(policy, update, bad_calls=(), drop=9)
    assert [s.reason for s in opt.stats].count("nonfinite_update") == 1 and opt.stats[
        9
    ].reason == "nonfinite_update"
    state, want = clip.state_dict(), ref_clip.state_dict()
    assert state.keys() == want.keys()
    for key in state:
        assert torch.equal(state[key], want[key]), key
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q)
