"""The copy ``update_clip``/``update_stats`` take before each inner step: kept from window to window.

The references are the bare inner optimizer's runs (bit for bit) and the bytes of the tensors each
``step()`` allocates, counted by a ``TorchDispatchMode`` here (independent of clipopt).
"""

from __future__ import annotations

import collections
import copy
import pickle
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from clipopt import ClippedOptimizer, UpdateClip
from clipopt._window import update_apply, update_copy

from ..helpers import ZeroDivideSGD, batches_for, model_for, mse


class _NewBytes(TorchDispatchMode):
    """The bytes of the storages that operators return anew (not an input's storage: neither
    written in place, into an ``out=`` argument, nor a view of an input)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.bytes += t.numel() * t.element_size()
        return out


def _window(opt: ClippedOptimizer, model: torch.nn.Module, batch: Any) -> None:
    mse(model, batch).backward()
    opt.step()
    opt.zero_grad()


def _held_bytes(opt: ClippedOptimizer, model: torch.nn.Module) -> int:
    """The bytes of the tensor storages reachable from ``opt`` (attributes, slots, containers; a
    walk written here, not clipopt's own accounting), less the parameters, their gradients and
    the inner optimizer's state: what the wrapper holds beside the training state."""
    training = {p.untyped_storage().data_ptr() for p in model.parameters()}
    training |= {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    for entry in opt.optimizer.state.values():
        training |= {v.untyped_storage().data_ptr() for v in entry.values() if isinstance(v, torch.Tensor)}
    seen: set[int] = set()
    found: dict[int, int] = {}
    todo: list[Any] = [opt]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in training:
                found[storage.data_ptr()] = storage.nbytes()
            continue
        if isinstance(obj, dict):
            todo.extend(obj.keys())
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            todo.extend(obj)
        elif type(obj).__module__.startswith("clipopt"):
            todo.extend(vars(obj).values() if hasattr(obj, "__dict__") else [])
            for cls in type(obj).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    if hasattr(obj, name):
                        todo.append(getattr(obj, name))
    return sum(found.values())


#: The update's pieces on the CPU go through a kept scratch buffer of this many bytes (float32).
SCRATCH = update_apply.PIECE_NUMEL * 4


@pytest.mark.parametrize(
    ("options", "held"),
    [
        ({"update_stats": True}, 1),
        ({"update_clip": UpdateClip(max_rms=1e-3)}, 1),
        ({"update_clip": UpdateClip(max_rms=1e-3, restore_state=True)}, 3),
    ],
    ids=["update_stats", "max_rms", "max_rms-restore_state"],
)
def test_the_copy_allocates_nothing_once_the_state_exists(options: dict, held: int) -> None:
    """Fused AdamW, a layer of 262k weights: from the third window on (the first creates the state,
    the second the buffers), a step() allocates less than a tenth of the parameters' bytes (the
    update is never written whole: its norms are taken piece by piece); between windows the wrapper
    holds one copy of the parameters (plus the pieces' scratch buffer) beyond a wrapper without
    update options, three with restore_state=True (the parameters and AdamW's two state tensors).
    Before, it held four (the update and the state's copy) in every case."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 256)  # 1 MB of parameters: the statistics' scalars are far below a tenth
    plain_model = copy.deepcopy(model)
    opt = ClippedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.01, fused=True), max_norm=1.0, **copy.deepcopy(options)
    )
    plain = ClippedOptimizer(torch.optim.AdamW(plain_model.parameters(), lr=0.01, fused=True), max_norm=1.0)
    pbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for i in range(5):
        x = torch.randn(8, 1024)
        plain_model(x).pow(2).mean().backward()
        plain.step()
        model(x).pow(2).mean().backward()
        with _NewBytes() as mode:
            opt.step()
        opt.zero_grad()
        if i >= 2:
            assert mode.bytes < pbytes / 10, (i, mode.bytes, pbytes)
    added = _held_bytes(opt, model) - _held_bytes(plain, plain_model)
    # (beside the buffers: the recorded update norms and coefficients, a few bytes per window)
    assert held * pbytes <= added <= held * pbytes + SCRATCH + 4096, (added, pbytes)


@pytest.mark.parametrize("turned_off", ["update_clip", "update_stats"])
def test_turning_the_update_options_off_frees_the_copy(turned_off: str) -> None:
    """After opt.update_clip = None (or update_stats = False), with the other one off, the copy's
    buffers are freed: the wrapper holds what one built without them holds; turning it on again
    makes a new copy that bounds as before."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 256)
    options = (
        {"update_clip": UpdateClip(max_rms=1e-3)} if turned_off == "update_clip" else {"update_stats": True}
    )
    opt = ClippedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), max_norm=1.0, **options)
    pbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for _ in range(2):
        model(torch.randn(8, 1024)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    before = _held_bytes(opt, model)
    setattr(opt, turned_off, None if turned_off == "update_clip" else False)
    after = _held_bytes(opt, model)
    assert before - after >= pbytes, (before, after, pbytes)
    model(torch.randn(8, 1024)).pow(2).mean().backward()
    opt.step()  # a window without the update options: nothing is copied again
    assert _held_bytes(opt, model) < after + pbytes / 10  # (the window's statistics: a few bytes)


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


@pytest.mark.parametrize("path", ["host", "device"])
def test_a_state_put_back_by_replacement_is_not_the_kept_copy(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """UpdateClip(restore_state=True): the third update is rejected after the step added a state
    entry (the state is put back by replacing it), the fourth is rejected too (put back in place
    from the copy: by copies on the CPU's path, a device select on the accelerators'): the run is,
    bit for bit, that of the bare optimizer that never saw those two batches; the state put back in
    the third window is the optimizer's own, not the copy refilled in the fourth."""
    if path == "device":
        monkeypatch.setattr(update_apply, "HOST_DECIDED", frozenset())
    model, bare = model_for(), model_for()
    bound = UpdateClip(max_norm=1e6, restore_state=True)
    opt = ClippedOptimizer(_NewKeySGD(model.parameters(), {3, 4}, {3}), max_norm=None, update_clip=bound)
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
    kept copy of the parameters does not travel); a deep copy or pickle of it gives the
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_update_norms_taken_piece_by_piece_are_the_norms_of_the_differences(dtype: torch.dtype) -> None:
    """update_norms of tensors above, at and below the piece size, one of them transposed (not
    contiguous: taken whole): each the norm of ``now - before`` (the difference in the tensors'
    dtype, as the update is; the norm in float64 here), within float32 summation error."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(300, 300), (update_apply.PIECE_NUMEL,), (1000,), (7,)]
    before = [torch.randn(s, generator=gen).to(dtype) for s in shapes] + [torch.randn(400, 200).to(dtype).t()]
    now = [b + 1e-3 * torch.randn(b.shape, generator=gen).to(dtype) for b in before]
    kept: dict[torch.dtype, torch.Tensor] = {}

    def scratch(dt: torch.dtype, numel: int) -> torch.Tensor:
        return kept.setdefault(dt, torch.empty(numel, dtype=dt))

    got = update_apply.update_norms(now, before, scratch)
    want = [float(torch.linalg.vector_norm((a - b).double())) for a, b in zip(now, before, strict=True)]
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx(want, rel=1e-5)
    assert kept and all(t.numel() == update_apply.PIECE_NUMEL for t in kept.values())  # the pieces ran


def test_with_both_update_options_the_update_is_copied_and_measured_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """update_clip and update_stats=True together: each window copies the parameters once and takes
    the update's norms once (counted at UpdateCopy.take and update_norms), and records what
    update_clip alone records, bit for bit."""
    calls = collections.Counter()
    take, norms = update_copy.UpdateCopy.take, update_apply.update_norms

    def counted_take(self: Any, *args: Any) -> Any:
        calls["take"] += 1
        return take(self, *args)

    def counted_norms(*args: Any) -> Any:
        calls["norms"] += 1
        return norms(*args)

    monkeypatch.setattr(update_copy.UpdateCopy, "take", counted_take)
    monkeypatch.setattr(update_apply, "update_norms", counted_norms)
    runs = []
    for options in ({"update_stats": True}, {}):
        model = model_for()
        opt = ClippedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=0.01), update_clip=UpdateClip(max_rms=1e-3), **options
        )
        calls.clear()
        for batch in batches_for(4, seed=3):
            _window(opt, model, batch)
        assert calls == {"take": 4, "norms": 4}, (options, calls)
        runs.append([(float(s.update_norm), float(s.update_coef)) for s in opt.stats])
    assert runs[0] == runs[1]


def test_the_copy_is_kept_while_one_update_option_stays_on() -> None:
    """The copy's buffers outlive the assignments that leave one update option on: update_stats
    turned on beside an UpdateClip, the UpdateClip replaced by another, then turned off: the
    window after each assignment allocates less than a tenth of the parameters' bytes (the
    buffers are refilled, not made anew; a new copy would allocate all of them)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 256)
    opt = ClippedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.01, fused=True),
        max_norm=1.0,
        update_clip=UpdateClip(max_rms=1e-3),
    )
    pbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for _ in range(2):  # the state and the buffers
        model(torch.randn(8, 1024)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    for assign in (
        lambda: setattr(opt, "update_stats", True),
        lambda: setattr(opt, "update_clip", UpdateClip(max_norm=1.0)),
        lambda: setattr(opt, "update_clip", None),
    ):
        assign()
        model(torch.randn(8, 1024)).pow(2).mean().backward()
        with _NewBytes() as mode:
            opt.step()
        opt.zero_grad()
        assert mode.bytes < pbytes / 10, (mode.bytes, pbytes)
        assert opt.last_stats is not None and opt.last_stats.update_norm is not None
