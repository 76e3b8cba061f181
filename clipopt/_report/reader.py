"""The record a ``clipopt report`` log reader registers (:data:`clipopt._report.read.READERS`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .log import GradLog, Names

__all__ = ["Reader"]


@dataclass(frozen=True)
class Reader:
    """One log format.  ``read_log`` tries the registered readers in order.

    For a file: the first whose ``claims_file(path, head)`` is True (``head``: the file's first bytes,
    already checked to be non-empty text) reads it with ``read(path, names, None)``.  For a folder:
    the first whose ``find(folder, run)`` names a path: a file is read as a file (its own reader
    chosen again), the folder itself with ``read(folder, names, run)``.  ``reads`` says in words what
    the reader reads."""

    name: str
    reads: str
    claims_file: Callable[[str, bytes], bool]
    find: Callable[[str, str | None], str | None]
    read: Callable[[str, Names, str | None], GradLog]
