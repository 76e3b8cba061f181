"""``clipopt report``'s Hugging Face Trainer reader: a ``trainer_state.json`` (``log_history`` entries
with ``step``, ``grad_norm``, ``loss``, ``learning_rate``), or a folder holding one (the latest
``checkpoint-*`` one when only those do)."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

from .log import GradLog, Names, from_records
from .names import choose, pick
from .reader import Reader

__all__ = ["TRAINER_CHECKPOINTS", "TRAINER_STATE"]


def _read_trainer_state(name: str, names: Names) -> GradLog:
    """A Hugging Face Trainer trainer_state.json: the log_history entries with a gradient norm."""
    history = _log_history(name)
    entries = [e for e in history if isinstance(e, dict) and isinstance(e.get("step"), int)]
    keys = list(dict.fromkeys(k for e in entries for k in e if k != "step"))
    norm_key = choose("norm", keys, names.norm, name, "log_history key")
    if norm_key is None:
        raise ValueError(
            f"{name} has no 'grad_norm' in its log_history; expected a Trainer run with max_grad_norm > 0 "
            "that logged at least once (logging_steps)"
        )
    wanted = {"norm": norm_key, "loss": choose("loss", keys, names.loss, name, "log_history key")}
    wanted["lr"] = pick("lr", keys)
    records: dict[int, dict[str, float]] = {}
    for entry in entries:
        rec = records.setdefault(entry["step"], {})
        for out, key in wanted.items():
            value = entry.get(key) if key is not None else None
            if (isinstance(value, (int, float)) and not isinstance(value, bool)) or (
                isinstance(value, str) and value.lower() in ("nan", "inf", "infinity", "-inf")
            ):
                rec[out] = float(value)
    log = from_records(name, "Trainer trainer_state.json", records, {})
    log.norm_column, log.loss_column = norm_key, wanted["loss"]
    log.ignored = [k for k in keys if k not in wanted.values()]
    if not log.steps:
        raise ValueError(f"{name} has no {norm_key!r} value in its log_history; expected a number there")
    return log


def _log_history(name: str) -> list[Any]:
    """The ``log_history`` list of a trainer_state.json; ValueError when it is not JSON or has none."""
    try:
        with open(name, encoding="utf-8-sig") as f:
            state = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{name} is not valid JSON ({exc}); expected a Trainer trainer_state.json") from None
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise ValueError(
            f"{name} is JSON without a 'log_history' list; expected a Hugging Face Trainer trainer_state.json"
        )
    return history


def _checkpoint_number(path: str) -> int:
    """The number of a ``checkpoint-<n>`` folder (-1 when it has none)."""
    tail = os.path.basename(path).rpartition("-")[2]
    return int(tail) if tail.isdigit() else -1


def _is_json(path: str, head: bytes) -> bool:
    """A text file whose first character (after a byte-order mark and blanks) opens JSON."""
    return head.lstrip(b"\xef\xbb\xbf \t\r\n")[:1] in (b"{", b"[")


def _state_in(folder: str, run: str | None) -> str | None:
    """A folder's own ``trainer_state.json`` (none when ``--run`` asks for a TensorBoard run)."""
    path = os.path.join(folder, "trainer_state.json")
    return path if run is None and os.path.isfile(path) else None


def _latest_checkpoint(folder: str, run: str | None) -> str | None:
    """The ``trainer_state.json`` of a folder's latest ``checkpoint-<n>`` (none with ``--run``)."""
    states = glob.glob(os.path.join(glob.escape(folder), "checkpoint-*", "trainer_state.json"))
    if run is not None or not states:
        return None
    return max(states, key=lambda p: _checkpoint_number(os.path.dirname(p)))


#: A JSON file, or a folder's own trainer_state.json (before its TensorBoard runs).
TRAINER_STATE = Reader(
    name="Trainer trainer_state.json",
    reads="a Hugging Face Trainer trainer_state.json (a JSON file, or a folder holding one)",
    claims_file=_is_json,
    find=_state_in,
    read=lambda path, names, run: _read_trainer_state(path, names),
)
#: The latest checkpoint's trainer_state.json of a folder that holds no log itself (after its runs).
TRAINER_CHECKPOINTS = Reader(
    name="Trainer checkpoints",
    reads="a Hugging Face Trainer output folder: its latest checkpoint-<n>/trainer_state.json",
    claims_file=lambda path, head: False,
    find=_latest_checkpoint,
    read=lambda path, names, run: _read_trainer_state(path, names),
)
