"""The text: byte-level tokens of Python's own standard-library sources (as ``clipopt demo`` reads).

The corpus is the source of a fixed list of standard-library modules, read with
:func:`inspect.getsource` (``clipopt demo`` reads ``argparse`` the same way), encoded as UTF-8 bytes
(vocabulary 256); an install without sources falls back to their docstrings.  The first 90 % is
the training text, the rest the held-out text.  Batches are random windows of the training text,
the same stream for every treatment of one seed.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import torch

#: The modules whose sources make the corpus (about 1.2 MB of text with Python 3.11).
MODULES = (
    "argparse",
    "inspect",
    "typing",
    "dataclasses",
    "pathlib",
    "collections",
    "functools",
    "enum",
    "json.decoder",
    "json.encoder",
    "textwrap",
    "configparser",
    "logging",
    "tarfile",
    "zipfile",
    "subprocess",
    "threading",
    "statistics",
)


@dataclass(frozen=True)
class Corpus:
    name: str  #: what the text is
    train: torch.Tensor  #: training tokens (int64 bytes)
    heldout: torch.Tensor  #: held-out tokens


def corpus(limit: int | None = None) -> Corpus:
    """The corpus, split 90/10; ``limit`` keeps only its first ``limit`` bytes (``--quick``)."""
    parts, kind = [], "sources"
    for name in MODULES:
        module = importlib.import_module(name)
        try:
            parts.append(inspect.getsource(module))
        except (OSError, TypeError):
            kind = "sources and docstrings"
            parts.append(inspect.getdoc(module) or "")
    raw = "\n".join(parts).encode("utf-8")
    if limit is not None:
        raw = raw[:limit]
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    cut = int(0.9 * len(data))
    return Corpus(
        f"{kind} of {len(MODULES)} standard-library modules, {len(raw)} bytes", data[:cut], data[cut:]
    )


def batches(
    data: torch.Tensor, batch: int, seq_len: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless random ``(input, next token)`` windows of ``data``, reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    offsets = torch.arange(seq_len + 1)
    while True:
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=gen)
        window = data[starts[:, None] + offsets]
        yield window[:, :-1], window[:, 1:]


def heldout_windows(data: torch.Tensor, seq_len: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` evenly spaced held-out windows as (inputs, targets): the same for every run."""
    stride = max(1, (len(data) - seq_len - 1) // count)
    starts = torch.arange(count) * stride
    window = data[starts[:, None] + torch.arange(seq_len + 1)]
    return window[:, :-1], window[:, 1:]
