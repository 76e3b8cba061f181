"""The copy ``update_clip``/``update_stats`` take before each inner step: kept from window to window.

The references are the bare inner optimizer's runs (bit for bit) and the bytes of the tensors each
``step()`` allocates, counted by a ``TorchDispatchMode`` here (independent of clipopt).
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from clipopt import ClippedOptimizer, UpdateClip

from ..helpers import ZeroDivideSGD, batches_for, model_for, mse


class _NewBytes(TorchDispatchMode):
    """The bytes of the tensors that operators return as new tensors (not written in place or
    into an ``out=`` argument)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {id(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t) not in inputs and t._base is None:
                self.bytes += t.numel() * t.element_size()
        return out


def _window(opt: ClippedOptimizer, model: torch.nn.Module, batch: Any) -> None:
    mse(model, batch).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("options", [{"update_stats": True}, {"update_clip": UpdateClip(max_rms=1e-3)}])
def test_the_copy_allocates_nothing_once_the_state_exists(options: dict) -> None:
    """Fused AdamW: from the third window on (the first creates the state, the second the
    buffers), a step() allocates less than a tenth of the parameters' bytes: the copy of the
    parameters and of the state and the update go into the same buffers every window (before,
    each window cloned 3x the parameters and made the update anew: 4x)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(128, 64)  # 33 KB of parameters: the statistics' scalars are far below a tenth
    opt = ClippedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.01, fused=True), max_norm=1.0, **options
    )
    pbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for i in range(5):
        model(torch.randn(8, 128)).pow(2).mean().backward()
        with _NewBytes() as mode:
            opt.step()
        opt.zero_grad()
        if i >= 2:
            assert mode.bytes < pbytes / 10, (i, mode.bytes, pbytes)


class _NewKeySGD(ZeroDivideSGD):
    """ZeroDivideSGD that adds a state entry at the calls in ``new_key_calls``: the state's layout
    changes within the step, so a rejected update is put back by replacing the state."""

    def __init__(self, params: Iterable[Any], bad_calls: Iterable[int], new_key_calls: Iterable[int]) -> None:
        super().__init__(params, bad_calls=bad_calls)
        self.new_key_calls = set(new_key_calls)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        out = super().step(closure)
        if self.calls in self.new_key_calls:
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["extra"] = torch.ones_like(p)
        return out


def _state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        v.clone() for s in opt.state.values() for k, v in sorted(s.items()) if isinstance(v, torch.Tensor)
    ]


def test_a_state_put_back_by_replacement_is_not_the_kept_copy() -> None:
    """The third update is rejected after the step added a state entry (the state is put back by
    replacing it), the fourth is rejected too (put back by a device select from the copy): the run
    is, bit for bit, that of the bare optimizer that never saw those two batches; the state put
    back in the third window is the optimizer's own, not the copy refilled in the fourth."""
    model, bare = model_for(), model_for()
    opt = ClippedOptimizer(_NewKeySGD(model.parameters(), {3, 4}, {3}), max_norm=None, update_stats=True)
    inner = ZeroDivideSGD(bare.parameters())
    for i, batch in enumerate(batches_for(6, seed=6)):
        _window(opt, model, batch)
        if i not in (2, 3):
            mse(bare, batch).backward()
            inner.step()
            inner.zero_grad()
    assert [s.reason for s in opt.stats][2:4] == ["nonfinite_update", "nonfinite_update"]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), bare.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(_state(opt), _state(inner), strict=True))


@pytest.mark.parametrize(
    "clone", [copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))], ids=["deepcopy", "pickle"]
)
def test_a_copy_of_the_optimizer_carries_no_buffers_and_goes_on_alike(clone: Callable[[Any], Any]) -> None:
    """After a few windows the wrapper pickles to about the size of one without update_clip (the
    kept copy, 4x the parameters' bytes, does not travel); a deep copy or pickle of it gives the
    original's parameters bit for bit in the next windows."""
    torch.manual_seed(0)
    model = torch.nn.Linear(128, 64)  # 33 KB of parameters: far above the pickles' other differences
    plain_model = copy.deepcopy(model)
    opt = ClippedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True),
        max_norm=1.0,
        update_clip=UpdateClip(max_rms=1e-3),
    )
    plain = ClippedOptimizer(torch.optim.AdamW(plain_model.parameters(), lr=0.01, foreach=True), max_norm=1.0)
    inputs = [torch.randn(8, 128) for _ in range(5)]

    def window(o: ClippedOptimizer, m: torch.nn.Module, x: torch.Tensor) -> None:
        m(x).pow(2).mean().backward()
        o.step()
        o.zero_grad()

    for x in inputs[:3]:
        window(opt, model, x)
        window(plain, plain_model, x)
    pbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert len(pickle.dumps(opt)) < len(pickle.dumps(plain)) + pbytes / 2
    twin_model, twin = clone((model, opt))
    for x in inputs[3:]:
        window(opt, model, x)
        window(twin, twin_model, x)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters(), strict=True))
