"""The settings record the data-parallel ranks compare (clipopt/_distributed/agreement.py), in one
process: every part's settings are in it, and the words naming what differs.  The ranks themselves
(2 gloo processes, DDP and FSDP2) are in tests/recovery/test_spike_distributed.py and
tests/distributed/test_distributed_hardening.py."""

from __future__ import annotations

import inspect
import json
from typing import Any

import pytest
import torch

from clipopt import ClippedOptimizer, Rewind, SpikeGuard, UpdateClip, ZClip
from clipopt._distributed.agreement import differences, part_settings, settings_record, shown
from clipopt._distributed.rank_check import settings_key

from ..helpers import model_for


def _texts(*records: list[tuple[str, object]]) -> list[str]:
    """The ranks' records as gather_texts() returns them (the encoding written out here)."""
    return [
        json.dumps([[n, isinstance(v, (int, float)) and not isinstance(v, bool), repr(v)] for n, v in r])
        for r in records
    ]


def test_numbers_are_named_with_their_range_and_this_ranks_value() -> None:
    texts = _texts([("rewind.keep", 2), ("x", 1.0)], [("rewind.keep", 3), ("x", 1.0)])
    assert differences(texts, 0) == ["rewind.keep (from 2 to 3; this rank: 2)"]
    assert differences(texts, 1) == ["rewind.keep (from 2 to 3; this rank: 3)"]


def test_numbers_closer_than_six_digits_are_shown_in_full() -> None:
    texts = _texts([("z", 2.5)], [("z", 2.5000001)])
    assert differences(texts, 1) == ["z (from 2.5 to 2.5000001; this rank: 2.5000001)"]


def test_other_values_are_named_with_the_ranks_holding_each() -> None:
    """Lists, tuples and bools: each value with its ranks (more than four counted), and this rank's."""
    records = [[("rewind.skip", [(5, 9)] if r in (1, 6) else []), ("on", r == 2)] for r in range(7)]
    assert differences(_texts(*records), 6) == [
        "rewind.skip ([] on ranks 0, 2, 3, 4 and 1 more, [(5, 9)] on ranks 1, 6; this rank: [(5, 9)])",
        "on (False on ranks 0, 1, 3, 4 and 2 more, True on rank 2; this rank: False)",
    ]


def test_a_part_on_some_ranks_only_is_named_once() -> None:
    """A Rewind on rank 1 only: its entry says so; its settings, absent on rank 0, are not listed."""
    off = settings_record([("k", 1.0)], [("rewind", None)])
    on = settings_record([("k", 1.0)], [("rewind", Rewind())])
    assert differences(_texts(off, on), 0) == ["rewind (None on rank 0, Rewind on rank 1; this rank: None)"]


class _Part:
    """A part of one's own: its settings record is compared with nothing else to edit."""

    def __init__(self, level: int) -> None:
        self.level = level

    def settings(self) -> dict[str, object]:
        return {"mine.level": self.level}


def test_a_new_parts_settings_are_compared_without_naming_it() -> None:
    a, b = (settings_record([], [("mine", _Part(level))]) for level in (1, 2))
    assert a == [("mine", "_Part"), ("mine.level", 1)]
    assert settings_key(a) != settings_key(b)
    assert differences(_texts(a, b), 0) == ["mine.level (from 1 to 2; this rank: 1)"]


def test_a_part_without_settings_shows_its_class_not_its_address() -> None:
    """object's repr holds the address (each process its own): a class of one's own shows its name;
    clipopt's own classes their repr (their settings)."""

    class Plain:
        pass

    assert part_settings("policy", Plain()) == [("policy", f"{__name__}.{Plain.__qualname__}")]
    assert shown(ZClip(z_thresh=2.5)) == repr(ZClip(z_thresh=2.5))
    assert repr(shown(ZClip())) == repr(ZClip())  # no quotes in the message


@pytest.mark.parametrize("policy", ["AutoClip", "ZClip", "AGC", "AdaGC", "StableSPAM"])
def test_every_argument_of_a_policy_is_in_the_record(policy: str) -> None:
    """A clip policy has no ``settings()``: its ``repr`` and its public settings are the record, so every
    constructor argument is compared (ZClip's repr leaves out ``clip_factor`` and
    ``skip_update_on_spike``: ranks with another value clipped differently, unnoticed)."""
    import clipopt

    kind = getattr(clipopt, policy)
    names = {name for name, _ in part_settings("policy", kind())}
    assert {f"policy.{a}" for a in inspect.signature(kind).parameters} <= names


def test_a_policy_setting_its_repr_leaves_out_is_named() -> None:
    a, b = (settings_record([], [("policy", ZClip(clip_factor=c))]) for c in (1.0, 2.0))
    assert settings_key(a) != settings_key(b)
    assert differences(_texts(a, b), 1) == ["policy.clip_factor (from 1 to 2; this rank: 2)"]


def _every_argument_named(part: Any, keyword: str, renamed: dict[str, str]) -> set[str]:
    """The constructor's arguments missing from ``part.settings()`` (``renamed``: argument -> entry)."""
    names = set(part.settings())
    arguments = inspect.signature(type(part)).parameters
    return {a for a in arguments if f"{keyword}.{renamed.get(a, a)}" not in names}


def test_every_rewind_and_guard_argument_is_in_their_settings() -> None:
    """Every argument of Rewind (keep, skip_batches, lr_cut, reset_state, ...) and SpikeGuard is in
    the record the ranks compare; so are the Rewind's skip list and its rewinds so far."""
    rewind = Rewind(keep=3, skip_batches=7, lr_cut=(0.5, 4))
    assert _every_argument_named(rewind, "rewind", {}) == set()
    assert _every_argument_named(SpikeGuard(), "spike_guard", {}) == set()
    record = rewind.settings()
    assert (record["rewind.keep"], record["rewind.skip_batches"], record["rewind.lr_cut"]) == (3, 7, (0.5, 4))
    assert record["rewind.skip"] == [] and record["rewind.rewinds"] == 0 and record["rewind.module"] is False


def test_the_skip_list_enters_the_settings_when_batches_is_called() -> None:
    """The list given to ``rewind.batches()`` is in the settings from that call on (merged ranges:
    lists that drop the same batches are the same), before any batch is drawn."""
    rewind = Rewind()
    rewind.batches(range(3), skip=[(4, 8), (2, 5), (10, 11)])
    assert rewind.settings()["rewind.skip"] == [(2, 8), (10, 11)]
    rewind.batches(range(3), skip=[(2, 8), (10, 11)])
    again = rewind.settings()["rewind.skip"]
    rewind.batches(range(3))
    assert again == [(2, 8), (10, 11)] and rewind.settings()["rewind.skip"] == []


def test_the_wrapper_puts_every_part_in_the_record() -> None:
    """The record a wrapper's ranks compare holds the policy, the guard, the Rewind (its skip list
    included) and the UpdateClip, each under its keyword."""
    model = model_for()
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        max_norm=ZClip(),
        spike_guard=SpikeGuard(),
        rewind=Rewind(keep=3),
        update_clip=UpdateClip(max_rms=1.0),
    )
    assert opt.rewind is not None
    opt.rewind.batches(range(2), skip=[(1, 2)])
    record = dict(opt._run.agreed())
    assert record["policy"] == repr(ZClip()) and record["spike_guard"] == "SpikeGuard"
    assert record["rewind"] == "Rewind" and record["rewind.keep"] == 3 and record["rewind.skip"] == [(1, 2)]
    assert record["spike_guard.signals"] == ("loss", "grad_norm") and record["update_clip"] == "UpdateClip"
    assert {"update_clip.mode", "update_clip.limit", "accumulation_steps", "max_norm"} <= set(record)


@pytest.mark.parametrize("part", ["spike_guard", "rewind", "update_clip", "update_stats"])
def test_a_wrapper_without_a_part_records_it_as_off(part: str) -> None:
    model = model_for()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), max_norm=1.0)
    record = opt._run.agreed()
    assert (part, None) in record and not any(name.startswith(part + ".") for name, _ in record)


def test_observers_are_not_compared_across_ranks(tmp_path: Any) -> None:
    """Loggers and per-layer statistics may differ by rank (a logger on rank 0 only): a wrapper with
    them records exactly what one without them records (the agreement would otherwise refuse a run
    logging on rank 0 only)."""
    from clipopt import CSVLogger

    def record(**observers: Any) -> list[Any]:
        model = model_for()
        opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), max_norm=1.0, **observers)
        return opt._run.agreed()

    bare = record()
    assert record(loggers=[CSVLogger(tmp_path / "g.csv")], layer_stats=3) == bare
    assert not any(name.startswith(("loggers", "layer_stats")) for name, _ in bare)
