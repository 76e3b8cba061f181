"""Writes the ``v13_*`` checkpoints of ``tests/test_checkpoint_compat.py`` with the clipopt of commit
7d2b1e2 (the code issue 12 restructures).  Not a test; run it with the OLD code on the path::

    git worktree add --detach /tmp/old13 7d2b1e2
    PYTHONPATH=/tmp/old13 python tests/data/make_v13_checkpoints.py tests/data

Per configuration it writes ``v13_<name>.pt`` (model and optimizer ``state_dict()`` cut with
micro-batches pending), ``v13_<name>.pkl`` (the pickled model and optimizer) and ``v13_<name>.json``
(what the old code itself did after the cut).  The configurations cover what the ``pre12_*`` files
do not:

- ``diag``: ``snapshot_dir`` (``max_snapshots=3``, reached after the cut), ``layer_stats=2``, a
  ``CSVLogger`` with rows still buffered, ``attach()``-ed batches pending at the cut, non-finite
  windows that write snapshots before and after it (the first window after the cut is one).
- ``rewind``: ``SpikeGuard`` + ``Rewind`` (``opt.rewind.batches`` drops batches); a rewind before the
  cut, another after it, and the copies in the state dict.
- ``groups``: per-group clipping (a group with its own ``max_norm``, one with its own
  ``clip_value``) under a ``ZClip`` bound on the shared groups.

Files are written below the current directory through RELATIVE paths (``snaps/``,
``log/grads.csv``): every run below (and the test) works in a fresh temporary directory, so the
paths inside the pickle are valid wherever it is loaded.  The JSON records, per way of resuming
(``pickle``: unpickled in an empty directory; ``load``: a new wrapper given the state dict there),
the rows of every micro-batch after the cut and the files written after it (snapshot summaries, the
CSV log's lines), plus the rows before the cut and the stats history.  Self-contained: no import
from tests/.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from clipopt import ClippedOptimizer, CSVLogger, Rewind, SpikeGuard, ZClip

NAMES = ("diag", "rewind", "groups")
#: micro-batch index -> factor of its loss (nan: a non-finite window; 500 or 1000: a spike)
FACTORS = {
    "diag": {4: float("nan"), 10: float("nan"), 16: float("nan"), 22: float("nan"), 26: float("nan")},
    "rewind": {16: 1000.0, 17: 1000.0, 18: 1000.0, 19: 1000.0, 33: 500.0, 35: 500.0, 37: 500.0},
    "groups": {5: float("nan"), 12: 1000.0, 20: float("nan"), 24: 1000.0},
}
CUT = {"diag": 17, "rewind": 36, "groups": 17}  # loop index of the cut
END = {"diag": 30, "rewind": 48, "groups": 30}


def model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def make(name: str, m: torch.nn.Sequential) -> ClippedOptimizer:
    if name == "diag":
        return ClippedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
            max_norm=0.5,
            accumulation_steps=3,
            param_names=m.named_parameters(),
            layer_stats=2,
            loggers=[CSVLogger(os.path.join("log", "grads.csv"), flush_every=4)],
            snapshot_dir="snaps",
            max_snapshots=3,
        )
    if name == "rewind":
        return ClippedOptimizer(
            torch.optim.Adam(m.parameters(), lr=0.01),
            max_norm=1.0,
            accumulation_steps=2,
            spike_guard=SpikeGuard(z_thresh=3.0, window=8, warmup=3),
            rewind=Rewind(every=2, keep=2, spikes=2, within=4, skip_batches=3, module=m, check_every=1),
        )
    groups = [
        {"params": m[0].parameters()},  # shares the ZClip bound
        {"params": [m[2].weight], "max_norm": 0.3},  # its own norm bound
        {"params": [m[2].bias], "clip_value": 0.05},  # shares the bound, its own value bound
    ]
    return ClippedOptimizer(
        torch.optim.SGD(groups, lr=0.1, momentum=0.9),
        max_norm=ZClip(warmup_steps=2, z_thresh=1.5),
        accumulation_steps=3,
        max_consecutive_nonfinite=5,
    )


def _f(value: Any) -> Any:
    """A float (or a tuple of them) as its repr, None kept."""
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        return [repr(float(v)) for v in value]
    return repr(float(value))


def _stats_row(opt: ClippedOptimizer) -> list[Any]:
    s = opt.last_stats
    if s is None:
        return []
    layers = s.logged_layers()
    per_layer = None if layers is None else {k: _f(v["grad_norm"]) for k, v in layers.as_dict().items()}
    return [
        s.step,
        s.skipped,
        s.reason,
        _f(s.total_norm),
        _f(s.loss),
        _f(s.clip_coef),
        _f(s.max_norm),
        _f(s.group_norms),
        _f(s.group_coefs),
        per_layer,
    ]


def run(m: torch.nn.Sequential, opt: ClippedOptimizer, name: str, start: int, stop: int) -> list[Any]:
    """Micro-batches ``start`` to ``stop - 1`` (through ``opt.rewind.batches`` when there is one);
    one row per micro-batch trained: counters, the latest snapshot's file name and, when it closed a
    window, that window's stats."""
    rows: list[Any] = []
    indices: Any = range(start, stop)
    if opt.rewind is not None:
        indices = opt.rewind.batches(indices)
    for i in indices:
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)
        loss = ((m(x) - y) ** 2).mean() * FACTORS[name].get(i, 1.0)
        loss.backward()
        opt.attach(inputs=x, targets=y)
        opt.step(loss=loss)
        opt.zero_grad()
        snap = None if opt.last_snapshot is None else os.path.basename(opt.last_snapshot)
        row = [i, opt.micro_batches, opt.num_windows, opt.num_skipped, opt.num_updates, opt.rewinds, snap]
        rows.append(row + (_stats_row(opt) if opt.micro_batches == 0 else []))  # a window closed
    return rows


def _summary(value: Any) -> Any:
    """A tensor as its shape and float64 sum; a list (several attach() calls) as a list of those."""
    if isinstance(value, torch.Tensor):
        return [list(value.shape), _f(value.double().sum())]
    return [_summary(v) for v in value]


def outputs(opt: ClippedOptimizer) -> dict[str, Any]:
    """What the run wrote below the current directory: a summary of each snapshot, the CSV log's lines
    (the loggers are closed first), the rewind log and what the history holds."""
    opt.close()
    snaps = {}
    for path in sorted(Path("snaps").glob("*.pt")):
        snap = torch.load(path, weights_only=True)
        snaps[path.name] = {
            "step": snap["step"],
            "reason": snap["reason"],
            "micro_batches": snap["micro_batches"],
            "total_norm": _f(snap["total_norm"]),
            "params": {k: _f(v.double().sum()) for k, v in snap["params"].items()},
            "grads": {k: _f(v.double().sum()) for k, v in snap["grads"].items()},
            "layer_stats": sorted(snap["layer_stats"]),
            "attached": {k: _summary(v) for k, v in snap["attached"].items()},
        }
    log = Path("log", "grads.csv")
    rewind = opt.rewind
    return {
        "snapshots": snaps,
        "csv": log.read_text().splitlines() if log.exists() else None,
        "rewind_log": None if rewind is None else [e.to_dict() for e in rewind.log],
        "batches_dropped": None if rewind is None else rewind.batches_dropped,
        "reasons": [s.reason for s in opt.stats],
    }


def params(m: torch.nn.Module) -> list[str]:
    return [repr(float(p.detach().double().sum())) for p in m.parameters()]


@contextlib.contextmanager
def fresh_dir() -> Iterator[None]:
    """Work in a new empty temporary directory (relative paths point into it)."""
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as d:
        os.chdir(d)
        try:
            yield
        finally:
            os.chdir(here)


def resume(name: str, how: str, blob: bytes, ck: dict[str, Any]) -> dict[str, Any]:
    """Resume the cut ``how`` (``"pickle"`` or ``"load"``) in a fresh directory; what happened."""
    with fresh_dir():
        if how == "pickle":
            m, opt = pickle.loads(blob)
        else:
            m = model()
            opt = make(name, m)
            m.load_state_dict(ck["model"])
            opt.load_state_dict(ck["optimizer"])
        return after_cut(m, opt, name)


def after_cut(m: torch.nn.Sequential, opt: ClippedOptimizer, name: str) -> dict[str, Any]:
    """Train from the cut to the end: the rows, clipopt's warnings, the final parameters, the outputs."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = run(m, opt, name, CUT[name], END[name])
    said = [f"{w.category.__name__}: {w.message}" for w in caught if "clipopt" in str(w.message)]
    return {"rows": rows, "warnings": said, "params": params(m), **outputs(opt)}


def dump(value: Any, indent: str = "") -> str:
    """JSON with one key of a dict, or one row of a list of rows, per line (small, diffable)."""
    inner = indent + " "
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(k)}: {dump(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(value, list) and value and all(isinstance(v, (list, dict)) for v in value):
        return "[\n" + ",\n".join(inner + json.dumps(v) for v in value) + "\n" + indent + "]"
    return json.dumps(value)


def main(out: Path) -> None:
    for name in NAMES:
        with fresh_dir():
            m = model()
            opt = make(name, m)
            before = run(m, opt, name, 0, CUT[name])
            assert opt.micro_batches > 0, "the cut must be mid-window"
            torch.save({"model": m.state_dict(), "optimizer": opt.state_dict()}, out / f"v13_{name}.pt")
            blob = pickle.dumps((m, opt))
            along = run(m, opt, name, CUT[name], END[name])  # the run that never stopped
            opt.close()  # here: at exit its logger would write into the directory of that moment
        (out / f"v13_{name}.pkl").write_bytes(blob)
        record = {"before": before}
        for how in ("pickle", "load"):
            record[how] = resume(name, how, blob, torch.load(out / f"v13_{name}.pt", weights_only=True))
        assert record["pickle"]["rows"] == along, "a pickle continues like the run that never stopped"
        (out / f"v13_{name}.json").write_text(dump(record) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
