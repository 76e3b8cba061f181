"""Reading a training log for ``clipopt report``: every format into one :class:`GradLog`.

The step, norm, loss and learning-rate columns (tags, keys) of every format
are chosen from one table of recognised names, :mod:`clipopt._report.names`;
:class:`Names` (``--loss``, ``--norm``) chooses others.  Formats (docs/cli.md, 'clipopt report'):

- a CSV written by :class:`~clipopt.CSVLogger`, or any CSV with a step column and
  a gradient-norm column, plus loss and lr columns when present.  Rows are
  streamed: the file is never held whole, only its columns, each as one
  ``array('d')``.  Lightning's ``metrics.csv`` writes different metrics of one
  step in separate rows; the values of one step are merged into one row.
- a Hugging Face Trainer ``trainer_state.json`` (``log_history`` entries with
  ``step``, ``grad_norm``, ``loss``, ``learning_rate``), or a folder holding
  one (the latest ``checkpoint-*`` one when only those do);
- a TensorBoard run's folder (needs the ``tensorboard`` package): its norm,
  loss and lr tags (Lightning's per-layer ``grad_2.0_norm/<name>`` too) and
  clipopt's own tags (``clipopt/clipped``, per-layer
  ``clipopt/layers/<name>/<field>``, per-group ``clipopt/group_norm/<g>`` and
  ``clipopt/group_coef/<g>``).  A folder holding several runs
  (:func:`tensorboard_runs`) is never merged: one run is read, by name.

clipopt's per-group columns (``group_norm.<g>``, ``group_coef.<g>``: per-group
clipping) are read into :attr:`GradLog.groups`, and its update norm and coefficient
(``update_norm``/``update_coef``, TensorBoard ``clipopt/update_norm``/``clipopt/update_coef``:
``update_clip=``, ``update_stats=True``) into :attr:`GradLog.update_norm` and
:attr:`GradLog.update_coef`.

Each format is one module defining a :class:`Reader` (:mod:`clipopt._report.read_csv`,
:mod:`clipopt._report.read_trainer`, :mod:`clipopt._report.read_tensorboard`), registered by one line in
:data:`READERS`; this module sniffs a file (empty, binary), asks the readers in order and searches a
folder with them.  :class:`GradLog` and :class:`Names` live in :mod:`clipopt._report.log`.

Every failure is a :class:`ValueError` (or :class:`OSError`) with one line that
names the file and says what was expected.  A missing loss is ``nan``; a loss
that was recorded but not finite reads as ``inf``.
"""

from __future__ import annotations

import glob
import os

from .log import EXPECTED as _EXPECTED
from .log import GradLog, Names
from .names import LOSS_NAMES, LR_NAMES, NORM_NAMES, STEP_NAMES
from .read_csv import CSV
from .read_tensorboard import TENSORBOARD, tensorboard_runs
from .read_trainer import TRAINER_CHECKPOINTS, TRAINER_STATE
from .reader import Reader

__all__ = [
    "LOSS_NAMES",
    "LR_NAMES",
    "NORM_NAMES",
    "READERS",
    "STEP_NAMES",
    "GradLog",
    "Names",
    "Reader",
    "read_log",
    "tensorboard_runs",
]

#: The registry: every log format's reader, tried in this order (:class:`Reader`).  A new format is
#: one module defining a :class:`Reader` and one line here.  Files: a JSON text is a Trainer state,
#: an event file's name is TensorBoard's, any other text is a CSV (last).  Folders: their own
#: trainer_state.json, their TensorBoard runs (``--run``: only those), their metrics.csv, their
#: latest Trainer checkpoint.
READERS: tuple[Reader, ...] = (TRAINER_STATE, TENSORBOARD, CSV, TRAINER_CHECKPOINTS)
#: How many bytes of the file's start are checked for binary content.
_SNIFF = 4096
#: No name chosen: the recognised ones.
_RECOGNISED = Names()


def read_log(path: str | os.PathLike[str], names: Names = _RECOGNISED, run: str | None = None) -> GradLog:
    """Read any supported log (see the module docstring); ``ValueError`` with one line when it is not one.

    ``names`` replaces the recognised loss and norm names; ``run`` picks one of a folder's TensorBoard
    runs (:func:`tensorboard_runs`): a folder holding several is never merged, it needs ``run``."""
    name = os.fspath(path)
    if os.path.isdir(name):
        return _read_folder(name, names, run)
    if not os.path.exists(name):
        raise FileNotFoundError(f"{name}: no such file")
    if run is not None:
        raise ValueError(f"--run {run}: {name} is a file, not a folder of TensorBoard runs; pass the folder")
    with open(name, "rb") as f:
        head = f.read(_SNIFF)
    if not head.strip(b"\xef\xbb\xbf \t\r\n"):
        raise ValueError(f"{name} is empty; expected a training log with {_EXPECTED}")
    if b"\x00" in head or _mostly_binary(head):
        raise ValueError(f"{name} is not a text file (binary data); expected a CSV or JSON training log")
    reader = next(r for r in READERS if r.claims_file(name, head))  # the CSV reader claims any text
    return reader.read(name, names, None)


def _mostly_binary(head: bytes) -> bool:
    """True when the file's first bytes are not UTF-8 text or hold many control characters."""
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:  # not merely a character cut at the sniff boundary
            return True
        text = head[: exc.start].decode("utf-8")
    control = sum(1 for c in text if ord(c) < 32 and c not in "\t\r\n")
    return control > max(2, len(text) // 100)


def _read_folder(name: str, names: Names, run: str | None) -> GradLog:
    """The log in a folder: the first reader's (:data:`READERS`) that finds one, or an error naming
    the logs below it."""
    for reader in READERS:
        found = reader.find(name, run)
        if found is not None:  # a file is read as any file is; the folder itself by its reader
            return read_log(found, names) if found != name else reader.read(name, names, run)
    below = sorted(
        p
        for c in ("metrics.csv", "trainer_state.json")
        for p in glob.glob(os.path.join(glob.escape(name), "*", c))
    )
    if below:  # Lightning's CSVLogger: lightning_logs/version_<n>/metrics.csv
        shown = ", ".join(below[:10]) + (f", ... ({len(below) - 10} more)" if len(below) > 10 else "")
        raise ValueError(f"{name} holds no training log itself; the logs below it: {shown}; pass one of them")
    raise ValueError(
        f"{name} is a folder without a training log (looked for trainer_state.json, metrics.csv and "
        "TensorBoard event files); pass the CSV file, trainer_state.json or TensorBoard log folder"
    )
