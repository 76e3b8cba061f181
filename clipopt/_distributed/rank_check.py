"""What the data-parallel ranks compare in every window, carried in a reduction that already runs.

Every window of a data-parallel run already reduces a few values across the ranks: the DDP
replicas' agreement packet (``all_reduce(MAX)``, :mod:`clipopt._distributed.replicas`) or,
under FSDP2, the norm of the sharded gradients (``all_reduce(SUM)`` of the p-th powers, MAX
for the inf-norm: :mod:`clipopt._distributed.collectives`).  :class:`CheckValues` rides in that reduction
as a few more float64 entries:

* the index of the window being closed and its micro-batch count;
* a key of the window settings (crc32 of their values: every part's settings record, the clip
  policy's included, :mod:`clipopt._distributed.agreement`);
* at the first window after ``load_state_dict``, a checksum of the loaded state
  (:func:`state_checksum`, :func:`tensor_checksum`);
* the window whose close failed on this rank after the ranks had agreed on it (0: none).

MAX: each value and its negation (the largest and the smallest over the ranks); an absent
value sends ``-inf``.  SUM cannot give a smallest and a largest value, so each value is split
into 16-bit limbs ``a`` and a rank sends ``e * a`` and ``e * a**2`` (``e``: 1 when the rank
carries the value) beside ``e``: the ranks hold the same limb exactly when ``E * Q == S**2``
(a variance of zero).  The host checks that with Python integers (exact); the device flag
(the window's skip) in float64, exact for up to about 1400 ranks.

The checksums are exact: the sum of a tensor's bits as integers, modulo a prime, so equal
tensors give equal checksums whatever the kernel, the thread count or the order of the sum.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .agreement import shown
from .collectives import has_dtensor

__all__ = [
    "CheckValues",
    "Differ",
    "MAX_SLOTS",
    "MODULUS",
    "SUM_SLOTS",
    "decode",
    "encode",
    "mismatch",
    "settings_key",
    "state_checksum",
    "tensor_checksum",
]

#: Checksums are taken modulo this prime (below 2**31: exact in float64 and in products of two).
MODULUS = 2**31 - 1

_LIMB = 1 << 16
#: limbs per value under SUM: window (< 2**48), micro-batches (< 2**32), settings key and state (< 2**32)
_LIMBS = (3, 2, 2, 2)
_NAMES = ("window", "micro-batches", "settings", "state")
#: float64 entries each encoding takes
MAX_SLOTS = 10
SUM_SLOTS = 1 + 2 * sum(_LIMBS) + 2


@dataclass
class CheckValues:
    """One rank's values for a window's check (see the module doc)."""

    window: int
    micro_batches: int
    settings: int
    state: int | Tensor | None = None  #: a checksum below MODULUS (a device tensor or an int), or None
    failed: int = 0  #: the window whose close failed here after the ranks agreed on it; 0: none

    def values(self) -> tuple[Any, ...]:
        return (self.window, self.micro_batches, self.settings, self.state)


def encode(v: CheckValues, summed: bool, device: torch.device) -> Tensor:
    """The float64 entries this rank adds to a reduction (``summed``: SUM, else MAX), on ``device``."""
    parts: list[Tensor] = []
    if summed:
        parts.append(_fill(1.0, device))
        for name, value, limbs in zip(_NAMES, v.values(), _LIMBS, strict=True):
            if name == "state":
                parts.append(_fill(0.0 if value is None else 1.0, device))
            for i in range(limbs):
                a = _limb(0 if value is None else value, i, device)
                parts += [a, a * a]
        parts.append(_fill(float(v.failed > 0), device))
        return torch.stack(parts)
    for value in (*v.values(), v.failed):
        if value is None:
            parts += [_fill(-math.inf, device)] * 2
        else:
            x = value.to(device, torch.float64) if isinstance(value, Tensor) else _fill(float(value), device)
            parts += [x, -x]
    return torch.stack(parts)


def _fill(x: float, device: torch.device) -> Tensor:
    """A float64 scalar on ``device`` by a fill (no host-to-device copy)."""
    return torch.full((), x, dtype=torch.float64, device=device)


def _limb(value: int | Tensor, i: int, device: torch.device) -> Tensor:
    if isinstance(value, Tensor):
        return torch.div(value, _LIMB**i, rounding_mode="floor").remainder(_LIMB).to(device, torch.float64)
    return _fill(float((value // _LIMB**i) % _LIMB), device)


def mismatch(reduced: Tensor, summed: bool) -> Tensor:
    """1.0 on the device when the ranks' values differ (the window is skipped), else 0.0."""
    if not summed:
        high, low = reduced[0:8:2], -reduced[1:8:2]
        return ((high != low) & (high > -math.inf)).any().to(torch.float32)
    e_all, bad = reduced[0], []
    at = 1
    for limbs, name in zip(_LIMBS, _NAMES, strict=True):
        e = e_all
        if name == "state":
            e, at = reduced[at], at + 1
        s, q = reduced[at : at + 2 * limbs : 2], reduced[at + 1 : at + 2 * limbs : 2]
        bad.append((e * q != s * s).any())
        at += 2 * limbs
    return torch.stack(bad).any().to(torch.float32)


@dataclass
class Differ:
    """A value the ranks do not share: its name, this rank's value, and the ranks' values in words."""

    name: str
    mine: Any
    ranks: str  #: "<low> to <high>" (MAX), or "average <mean> over <count> ranks" (SUM)


def decode(host: Sequence[float], mine: CheckValues, summed: bool) -> tuple[list[Differ], int]:
    """The values the ranks do not share (in :data:`_NAMES` order), and the failed close: under MAX
    the largest window whose close failed on some rank, under SUM the number of such ranks."""
    out: list[Differ] = []
    if not summed:
        for i, (name, value) in enumerate(zip(_NAMES, mine.values(), strict=True)):
            high, low = host[2 * i], -host[2 * i + 1]
            if high > -math.inf and high != low:
                out.append(Differ(name, _show(value), f"{_num(low)} to {_num(high)}"))
        return out, int(host[8])
    e_all, at = round(host[0]), 1
    for limbs, name, value in zip(_LIMBS, _NAMES, mine.values(), strict=True):
        e = e_all
        if name == "state":
            e, at = round(host[at]), at + 1
        pairs = [(round(host[at + 2 * i]), round(host[at + 2 * i + 1])) for i in range(limbs)]
        at += 2 * limbs
        if e and any(e * q != s * s for s, q in pairs):
            mean = sum(s / e * _LIMB**i for i, (s, _) in enumerate(pairs))
            out.append(Differ(name, _show(value), f"average {mean:.6g} over {e} ranks"))
    return out, round(host[at])


def _show(value: Any) -> Any:
    return "(not loaded)" if value is None else int(value) if isinstance(value, Tensor) else value


def _num(v: float) -> str:
    return f"{v + 0.0:.12g}"  # no "-0"


def settings_key(settings: Iterable[tuple[str, object]], policy: Any = None) -> int:
    """crc32 of the settings' names and values (the record of every part's settings,
    :mod:`clipopt._distributed.agreement`) and of ``policy`` as the record shows it
    (:func:`~clipopt._distributed.agreement.shown`)."""
    text = ";".join(f"{name}={value!r}" for name, value in settings) + ";" + shown(policy)
    return zlib.crc32(text.encode())


# ---------------------------------------------------------------------------- checksums


def tensor_checksum(tensors: Iterable[Tensor], device: torch.device) -> Tensor | None:
    """An exact checksum of ``tensors``' bits (0-d int64 below :data:`MODULUS`, on ``device``), in
    order; DTensors (each rank holds its own shard) are left out.  No host read; None: no tensor."""
    residues = [_residue(t).to(device) for t in tensors if not has_dtensor([t])]
    if not residues:
        return None
    weights = torch.arange(1, len(residues) + 1, device=device, dtype=torch.int64)
    return (torch.stack(residues) * weights).remainder(MODULUS).sum().remainder(MODULUS)


def _residue(t: Tensor) -> Tensor:
    """The sum of ``t``'s bits as integers (each element's bytes read as int32/int16/uint8), mod MODULUS."""
    flat = t.detach()
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    flat = flat.reshape(-1).contiguous()
    if flat.dtype == torch.bool or flat.numel() == 0:
        return flat.to(torch.int64).sum().remainder(MODULUS)
    as_int = {1: torch.uint8, 2: torch.int16}.get(flat.element_size(), torch.int32)
    return flat.view(as_int).to(torch.int64).sum().remainder(MODULUS)


def state_checksum(value: Any) -> int:
    """An exact checksum (below :data:`MODULUS`) of a state dict's numbers, strings and tensors, in
    order (DTensors left out).  Reads one value per device holding its tensors: for load time."""
    leaves: list[Any] = []
    _leaves(value, leaves)
    residues: list[int] = [0] * len(leaves)
    by_device: dict[torch.device, list[int]] = {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, Tensor):
            by_device.setdefault(leaf.device, []).append(i)
        else:
            residues[i] = _scalar_residue(leaf)
    for indices in by_device.values():
        found = torch.stack([_residue(leaves[i]) for i in indices]).tolist()
        for i, r in zip(indices, found, strict=True):
            residues[i] = int(r)
    return sum((i + 1) * r for i, r in enumerate(residues)) % MODULUS


def _leaves(value: Any, out: list[Any]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            out.append(str(key))
            _leaves(item, out)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _leaves(item, out)
    elif not has_dtensor([value]):
        out.append(value)


def _scalar_residue(value: Any) -> int:
    if value is None:
        return 1
    if isinstance(value, (bool, int)):
        return int(value) % MODULUS
    if isinstance(value, float):
        return int.from_bytes(struct.pack("<d", value), "little") % MODULUS
    return zlib.crc32(repr(value).encode()) % MODULUS
