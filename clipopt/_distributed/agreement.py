"""The settings every data-parallel rank must share: each part's own record, compared and named.

A *part* (a clip policy, a SpikeGuard, a Rewind, an UpdateClip, any feature added later) states
what the ranks must share through a ``settings()`` method: a mapping (or a list of pairs) of
names to values — numbers, bools, strings, None, or tuples of them, whose ``repr`` is the same in
every process.  By convention each name starts with the part's keyword (``"rewind.keep"``).  The
optimizer hands its parts to :func:`settings_record` as ``(keyword, part)`` pairs; nothing here
names a part, so a new part is compared as soon as it is in that list.

The record rides in the ranks' per-window check as one crc32 key
(:func:`~clipopt._distributed.rank_check.settings_key`, no collective of its own).  When the keys
differ, or once at the first step, :func:`compare` runs on every rank alike: the key first (one
small ``all_reduce``), then, only when it differs, every rank's record (:func:`gather_texts`:
one ``all_reduce`` and one ``all_gather``), from which each rank names the settings that differ.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["Setting", "Shown", "compare", "describe", "differences", "gather_texts", "part_settings", "shown"]

#: One entry of the record: a setting's name and its value.
Setting = tuple[str, object]

#: A name some ranks' records do not have (a part on some ranks only).
_ABSENT = "(absent)"

#: Ranks listed by number for one value before the rest are counted.
_LISTED = 4


class Shown(str):
    """A part's text as the record shows it (its ``repr`` is the text itself, without quotes)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


def shown(part: object) -> Shown:
    """How a part without ``settings()`` appears in the record: the ``repr`` of clipopt's own
    classes (their settings only), of any other only the class's name (``object``'s ``repr``
    holds the address, a ``repr`` of one's own may hold a tensor's device: each rank's own)."""
    kind = type(part)
    if kind.__module__.startswith("clipopt.") or part is None or isinstance(part, (int, float, str)):
        return Shown(repr(part))
    return Shown(f"{kind.__module__}.{kind.__qualname__}")


def part_settings(keyword: str, part: object) -> list[Setting]:
    """The record's entries of the part given as ``keyword``: ``(keyword, None)`` when it is off;
    else ``(keyword, its class)`` followed by its own ``settings()``; when it has none,
    ``(keyword, shown(part))`` and, for clipopt's own classes, their plain public attributes
    (:func:`_attributes`; a policy of the user's own, a value of another type assigned mid-run: its
    entry alone, the window's own check refuses that one with its message)."""
    if part is None:
        return [(keyword, None)]
    own = getattr(part, "settings", None)
    if not callable(own):
        return [(keyword, shown(part)), *_attributes(keyword, part)]
    record = own()
    items = record.items() if isinstance(record, Mapping) else record
    return [(keyword, Shown(type(part).__qualname__)), *((str(name), value) for name, value in items)]


def _attributes(keyword: str, part: object) -> list[Setting]:
    """A clipopt part without ``settings()`` (the clip policies): its public attributes holding a
    number, bool, string or None, which are its constructor's arguments.  Its ``repr`` may leave
    some out (ZClip's ``clip_factor`` and ``skip_update_on_spike``) or round them (``:g``)."""
    if not type(part).__module__.startswith("clipopt."):
        return []  # a class of one's own: its attributes may hold what differs by rank (a device)
    attributes = getattr(part, "__dict__", {})
    return [
        (f"{keyword}.{name}", value)
        for name, value in attributes.items()
        if not name.startswith("_") and (value is None or isinstance(value, (bool, int, float, str)))
    ]


def settings_record(core: Iterable[Setting], parts: Iterable[tuple[str, object]]) -> list[Setting]:
    """The optimizer's own settings, then every part's entries, in the order given."""
    out = list(core)
    for keyword, part in parts:
        out += part_settings(keyword, part)
    return out


# ---------------------------------------------------------------------------- comparing the ranks'


def _encode(record: Sequence[Setting]) -> str:
    """The record as text that every rank can read back: ``[name, is a number, repr]`` rows."""
    rows = [[name, _is_number(value), repr(value)] for name, value in record]
    return json.dumps(rows, separators=(",", ":"))


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def differences(texts: Sequence[str], rank: int) -> list[str]:
    """Each setting whose value differs across the ranks' records (``texts``, in rank order), in
    words: ``name (from low to high; this rank: value)`` for numbers, else the values with the
    ranks holding them.  A setting of a part whose own entry differs (on some ranks only, or of
    another class) is left out: the part's entry says it."""
    records = [{name: (number, text) for name, number, text in json.loads(t)} for t in texts]
    names: list[str] = []
    for record in records:
        names += [n for n in record if n not in names]
    out: list[str] = []
    differing: list[str] = []
    for name in names:
        values = [record.get(name) for record in records]
        if len(set(values)) == 1:
            continue
        if any(name.startswith(d + ".") for d in differing):
            continue
        differing.append(name)
        out.append(f"{name} ({describe(values, rank)})")
    return out


def describe(values: Sequence[tuple[bool, str] | None], rank: int) -> str:
    """The ranks' values of one setting (``(is a number, repr)``, None: absent), in words."""
    mine = _text(values[rank])
    if all(v is not None and v[0] for v in values):
        numbers = {float(v[1]) for v in values if v is not None}
        fmt = _num if len({_num(x) for x in numbers}) == len(numbers) else repr  # else closer than 6 digits
        return f"from {fmt(min(numbers))} to {fmt(max(numbers))}; this rank: {fmt(float(mine))}"
    held: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        held.setdefault(_text(v), []).append(r)
    return ", ".join(f"{text} on {_ranks(ranks)}" for text, ranks in held.items()) + f"; this rank: {mine}"


def _text(value: tuple[bool, str] | None) -> str:
    return _ABSENT if value is None else value[1]


def _num(v: float) -> str:
    return f"{v + 0.0:g}"  # no "-0"


def _ranks(ranks: list[int]) -> str:
    listed = ", ".join(map(str, ranks[:_LISTED]))
    more = f" and {len(ranks) - _LISTED} more" if len(ranks) > _LISTED else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {listed}{more}"


def gather_texts(text: str, device: torch.device, group: Any) -> list[str]:
    """Every rank's ``text`` (in the group's rank order): one ``all_reduce`` of the longest length,
    one ``all_gather`` of the padded bytes, on ``device`` (the parameters': NCCL needs it)."""
    dist = torch.distributed
    data = torch.tensor(list(text.encode()), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.all_reduce(size, op=dist.ReduceOp.MAX, group=group)
    padded = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data.to(device)
    out = [torch.empty_like(padded) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, padded, group=group)
    return [bytes(t.cpu().tolist()).rstrip(b"\0").decode() for t in out]  # JSON holds no NUL byte


def compare(record: Sequence[Setting], key: int, device: torch.device, group: Any) -> list[str]:
    """The settings that differ across the ranks of ``group``, in words (empty: none), the same
    list on every rank but for each one's own value.  Collective: every rank must call it.
    ``key``: the record's :func:`~clipopt._distributed.rank_check.settings_key`."""
    dist = torch.distributed
    packet = torch.tensor([float(key), -float(key)], dtype=torch.float64).to(device)
    dist.all_reduce(packet, op=dist.ReduceOp.MAX, group=group)
    high, low = packet.tolist()
    if high == -low and not math.isnan(high):
        return []
    texts = gather_texts(_encode(record), device, group)
    return differences(texts, dist.get_rank(group))
