"""What a Rewind copy holds beside the parameters (``_window/held.py``, #32): every part with
``held = True`` under its keyword (``"update_clip"``, ``"spike_guard"``: the keys copies have always
had; an entry of a part that is off is absent, where earlier copies held None), and the policy and
scaler under ``"policy"`` and ``"scaler"``."""

from __future__ import annotations

from typing import Any

import torch
from torch import optim

from clipopt import ClippedOptimizer, Rewind, SpikeGuard
from clipopt._part import Part
from clipopt._recovery.host_copy import copy_extra
from clipopt._window.held import Held

from ..helpers import batches_for, model_for


class _Counter(Part):
    """A held part of the test's own: its state is one number."""

    keyword = "counter"
    held = True

    def __init__(self, n: int) -> None:
        self.n = n

    def state_dict(self) -> Any:
        return {"n": self.n}

    def load_state(self, checked: Any) -> None:
        self.n = checked["n"]


class _Record(Part):
    """A part that is not held: a copy leaves it out."""

    keyword = "record"

    def state_dict(self) -> Any:
        return {"seen": 1}


def test_a_held_part_is_copied_and_restored_by_its_keyword() -> None:
    part = _Counter(3)
    held = Held((part,), None, None, None)
    saved = held.state()
    assert saved == {"policy": None, "scaler": None, "counter": {"n": 3}}
    part.n = 7
    held.restore(saved)
    assert part.n == 3
    held.restore({"policy": None, "scaler": None, "update_clip": None})  # taken while it was off (older)
    assert part.n == 3


def test_only_the_parts_marked_held_are_in_a_copy() -> None:
    record = _Record()
    assert not record.held and record.state_dict() is not None
    saved = Held((_Counter(1),), None, None, None).state()
    assert "record" not in saved and saved["counter"] == {"n": 1}


def test_a_rewind_copy_keeps_its_layout_with_the_guard_as_a_part() -> None:
    """A copy taken by an optimizer holds the guard's history under ``"spike_guard"`` beside
    ``"policy"`` and ``"scaler"`` (the layout saved copies have; no UpdateClip here): the guard's
    state at the copy, equal to its ``state_dict()`` then."""
    model = model_for()
    guard = SpikeGuard(z_thresh=50.0, window=8, warmup=4)
    rewind = Rewind(every=2, check_every=1)
    opt = ClippedOptimizer(optim.SGD(model.parameters(), lr=0.1), spike_guard=guard, rewind=rewind)
    history = None
    for i, (x, y) in enumerate(batches_for(5, seed=3)):
        torch.nn.functional.mse_loss(model(x), y).backward()
        if i == 3:  # this close starts with the check after window 3, which takes a copy (3 - 1 >= 2)
            history = guard.state_dict()
        opt.step(loss=torch.tensor(1.0 + i))
        opt.zero_grad()
    newest = rewind._copies[-1]
    assert newest.step == 3 and history is not None
    extra = copy_extra(newest.spec, newest.leaves)
    assert set(extra) == {"policy", "scaler", "spike_guard"}
    assert extra["policy"] is None and extra["scaler"] is None
    assert torch.equal(extra["spike_guard"]["buffer"], history["buffer"])
    assert torch.equal(extra["spike_guard"]["count"], history["count"])
    assert history["count"].tolist() == [3, 3]  # windows 1-3, both signals


def _count_helds(monkeypatch: Any) -> list[int]:
    """Count the ``Held`` records the runtime builds (its constructor, wrapped)."""
    import clipopt._window.runtime as runtime

    built = [0]

    def counting(*args: Any) -> Held:
        built[0] += 1
        return Held(*args)

    monkeypatch.setattr(runtime, "Held", counting)
    return built


def test_a_window_builds_what_a_copy_holds_only_when_a_part_takes_copies(monkeypatch: Any) -> None:
    """Without a Rewind no window builds a ``Held`` record (a SpikeGuard, a held part, is on: its
    windows close by the general path); with one, every measured window does, and the copy holds it."""
    built = _count_helds(monkeypatch)
    for rewind in (None, Rewind(every=2, check_every=1)):
        model = model_for()
        opt = ClippedOptimizer(
            optim.SGD(model.parameters(), lr=0.1), spike_guard=SpikeGuard(window=8, warmup=4), rewind=rewind
        )
        built[0] = 0
        for x, y in batches_for(4, seed=3):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step(loss=torch.tensor(1.0))
            opt.zero_grad()
        assert opt.num_windows == 4
        if rewind is None:
            assert built[0] == 0
        else:
            assert built[0] == 4 and rewind.copies_taken > 0
