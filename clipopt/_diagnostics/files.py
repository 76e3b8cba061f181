"""Safe file writing for loggers and snapshots: no link followed, no stale temporaries, no crash.

* :func:`check_file_path` / :func:`check_dir_path` refuse, at construction, a
  path that can never be written (a directory where a file is wanted, a path
  below a regular file).
* :func:`write_atomic` writes a file through a temporary created with
  ``O_CREAT | O_EXCL | O_NOFOLLOW`` under a random name (a link planted at that
  name is never followed, an existing file never reused), then renames it over
  the target (``rename`` replaces a link at the target, it does not follow it).
* :func:`remove_stale_temps` removes the temporaries of writers that were
  killed mid-write.
* :class:`WarnOnce` warns once per cause (exception type and errno), so a
  failing disk does not flood the output while training goes on.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from .._caller import user_stacklevel

__all__ = [
    "STALE_TEMP_AGE_S",
    "WarnOnce",
    "check_dir_path",
    "check_file_path",
    "remove_stale_temps",
    "temp_name",
    "write_atomic",
]

#: A temporary file of another host (or of a process that cannot be checked)
#: older than this is considered left behind by a killed writer.
STALE_TEMP_AGE_S = 3600.0

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_HOST = socket.gethostname().replace(".", "_")[:32] or "host"


def _first_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (``.`` at worst)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(".")


def check_file_path(name: str, path: Path, example: str) -> None:
    """Refuse a file path that can never be written: a directory, or a path below a regular file."""
    if path.is_dir():
        raise ValueError(
            f"{name}={str(path)!r} is a directory, not a file; pass a file path such as {example!r}"
        )
    _check_parents(name, path.parent, example)


def check_dir_path(name: str, path: Path, example: str) -> None:
    """Refuse a directory path that can never be created: an existing file, or a path below one."""
    if path.exists() and not path.is_dir():
        raise ValueError(
            f"{name}={str(path)!r} is an existing file, not a directory; pass a folder such as {example!r}"
        )
    _check_parents(name, path, example)


def _check_parents(name: str, folder: Path, example: str) -> None:
    existing = _first_existing(folder)
    if not existing.is_dir():
        raise ValueError(
            f"{name}={str(folder)!r} lies below {str(existing)!r}, which is a file, so nothing can be "
            f"created there; pass a path in a folder, such as {example!r}"
        )


def temp_name(target: Path) -> Path:
    """A fresh temporary name next to ``target``: ``.<name>.<host>.<pid>.<random>.tmp``."""
    return target.with_name(f".{target.name}.{_HOST}.{os.getpid()}.{secrets.token_hex(6)}.tmp")


def _open_exclusive(path: Path, mode: str) -> IO[Any]:
    """Create ``path`` for writing; fails if anything (a link included) is already there."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
    try:
        if "b" in mode:
            return os.fdopen(fd, "wb")
        return os.fdopen(fd, "w", newline="")
    except BaseException:
        os.close(fd)
        raise


def write_atomic(target: Path, write: Callable[[IO[Any]], None], *, binary: bool = True) -> None:
    """Write ``target`` through an exclusive temporary, fsync it, then rename it into place.

    On failure the temporary is removed and the error raised; ``target`` is then
    untouched.
    """
    tmp = temp_name(target)
    try:
        with _open_exclusive(tmp, "wb" if binary else "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


#: Whether ``os.kill(pid, 0)`` only probes a process.  On Windows signal 0 is ``CTRL_C_EVENT``: it
#: would interrupt the process group ``pid`` instead of probing it, so there only age decides.
_CAN_PROBE_PIDS = os.name != "nt"


def _pid_alive(pid: int) -> bool:
    if not _CAN_PROBE_PIDS:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _is_stale(entry: Path, now: float, max_age: float) -> bool:
    parts = entry.name.rsplit(".", 4)  # [.<target>, host, pid, random, tmp]
    if len(parts) == 5 and parts[1] == _HOST and parts[2].isdigit():
        pid = int(parts[2])
        if pid != os.getpid() and not _pid_alive(pid):
            return True
    try:
        return now - entry.lstat().st_mtime > max_age
    except OSError:
        return False


def remove_stale_temps(folder: Path, target_prefix: str, max_age: float | None = None) -> int:
    """Remove the temporaries of killed writers in ``folder`` whose target name starts with
    ``target_prefix``: those of a dead process on this host, and any older than ``max_age``.

    Returns how many were removed; errors (a read-only folder) are ignored.
    """
    age = STALE_TEMP_AGE_S if max_age is None else max_age
    now = time.time()
    removed = 0
    try:
        entries = list(folder.iterdir())
    except OSError:
        return 0
    for entry in entries:
        name = entry.name
        if not (name.startswith("." + target_prefix) and name.endswith(".tmp")):
            continue
        if _is_stale(entry, now, age):
            with contextlib.suppress(OSError):
                entry.unlink()
                removed += 1
    return removed


class WarnOnce:
    """Warns once per cause (exception type and errno) of a failing writer; counts every failure."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, int | None]] = set()
        self.failures = 0

    def __call__(self, exc: BaseException, message: str) -> None:
        """Count the failure; warn (at the user's line) the first time ``exc``'s cause is seen."""
        self.failures += 1
        cause = (type(exc).__name__, getattr(exc, "errno", None))
        if cause in self.seen:
            return
        self.seen.add(cause)
        warnings.warn(message, RuntimeWarning, stacklevel=user_stacklevel())

    def __getstate__(self) -> dict[str, Any]:
        return {"seen": set(self.seen), "failures": self.failures}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.seen, self.failures = state["seen"], state["failures"]
