"""Checkpoints written by the clipopt of commit 2951178 (before issue 12's restructure) load and
continue exactly as that code continued them.

The files in ``tests/data`` were written by the old code (``tests/data/make_pre12_checkpoints.py``
run with 2951178 on the path), the expected rows and parameter sums included: none of them is
produced by the code under test.  Each cut has two micro-batches pending, a ZClip policy's state
or a GradScaler's, and non-finite and spike skips before and after it.
"""

from __future__ import annotations

import importlib.util
import json
import pickle
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

DATA = Path(__file__).parent / "data"
NAMES = ("zclip", "scaler")


def _generator(version: str) -> ModuleType:
    """``tests/data/make_<version>_checkpoints.py``, the module that wrote those fixtures (its model,
    configurations and training loop, run here with the new code)."""
    spec = importlib.util.spec_from_file_location(f"make_{version}", DATA / f"make_{version}_checkpoints.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _maker() -> ModuleType:
    """The pre-12 generator."""
    return _generator("pre12")


def _expected(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"pre12_{name}.json").read_text())


def _params(m: torch.nn.Module) -> list[str]:
    return [repr(float(p.detach().double().sum())) for p in m.parameters()]


@pytest.mark.parametrize("name", NAMES)
def test_old_state_dict_loads_and_continues_as_old_code_did(name: str) -> None:
    """The old ``state_dict()`` loads into a fresh wrapper; the next 13 micro-batches give the old
    code's counters, reasons, norms and losses, and bit-identical parameters."""
    mk = _maker()
    ck = torch.load(DATA / f"pre12_{name}.pt", weights_only=True)
    m = mk.model()
    opt = mk.make(name, m)
    m.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    want = _expected(name)
    assert [opt.micro_batches, opt.num_windows, opt.num_skipped] == want["before"][-1][1:4]
    assert mk.run(m, opt, mk.CUT, mk.END) == [list(r) for r in want["after"]]
    assert _params(m) == want["params"]


@pytest.mark.parametrize("name", NAMES)
def test_old_pickle_loads_with_its_history_and_continues(name: str) -> None:
    """A wrapper pickled by the old code mid-window unpickles with its stats history's reasons
    (non-finite, overflow and spike skips) and continues as the old code did."""
    mk = _maker()
    m, opt = pickle.loads((DATA / f"pre12_{name}.pkl").read_bytes())
    want = _expected(name)
    assert [s.reason for s in opt.stats] == want["reasons"][: len(opt.stats)]
    assert [s.skipped for s in opt.stats] == [r is not None for r in want["reasons"][: len(opt.stats)]]
    assert mk.run(m, opt, mk.CUT, mk.END) == [list(r) for r in want["after"]]
    assert [s.reason for s in opt.stats] == want["reasons"]
    assert _params(m) == want["params"]


def _shape(value: Any) -> Any:
    """Keys and value types of a nested state dict (tensors by dtype and shape)."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [_shape(v) for v in value]]
    if isinstance(value, torch.Tensor):
        return ["Tensor", str(value.dtype), tuple(value.shape)]
    return type(value).__name__


@pytest.mark.parametrize("name", NAMES)
def test_new_state_dict_has_the_old_format(name: str) -> None:
    """The new code's ``state_dict()`` at the same cut has the old one's keys, types, dtypes and
    shapes (so the old code can load it), and the same counter values."""
    mk = _maker()
    m = mk.model()
    opt = mk.make(name, m)
    before = mk.run(m, opt, 0, mk.CUT)
    assert before == [list(r) for r in _expected(name)["before"]]
    old = torch.load(DATA / f"pre12_{name}.pt", weights_only=True)["optimizer"]
    new = opt.state_dict()
    assert _shape(new) == _shape(old)
    scalars = {k: v for k, v in old["clipopt"].items() if isinstance(v, (int, float, str))}
    assert {k: new["clipopt"][k] for k in scalars} == scalars


# ---------------------------------------------------------------------- v13: written by 7d2b1e2
#
# ``tests/data/make_v13_checkpoints.py`` run with commit 7d2b1e2 on the path wrote ``v13_<name>.*``:
# ``diag`` (snapshot_dir, layer_stats=2, a CSVLogger, attach()-ed batches pending at the cut),
# ``rewind`` (SpikeGuard + Rewind, a rewind before the cut and one after it) and ``groups``
# (per-group max_norm / clip_value under a ZClip bound).  Their JSON holds, for each way of resuming,
# what that code did after the cut.  Files go below the current directory through relative paths, so
# every test runs in its own ``tmp_path``.

V13 = ("diag", "rewind", "groups")


def _maker13() -> ModuleType:
    """The v13 generator (model, configurations, training loop and what is recorded)."""
    return _generator("v13")


def _expected13(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"v13_{name}.json").read_text())


def _as_json(value: Any) -> Any:
    """``value`` as the JSON file holds it (tuples become lists)."""
    return json.loads(json.dumps(value))


@pytest.mark.parametrize("name", V13)
def test_v13_state_dict_loads_and_continues_as_7d2b1e2_did(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``state_dict()`` written by 7d2b1e2 mid-window loads into a new wrapper, which then trains
    as 7d2b1e2 did: counters, reasons, norms, losses, per-group norms and coefficients, per-layer
    rows, snapshot names, the snapshots' contents and the CSV log written after the cut, the rewind
    log, the warnings and bit-identical parameters."""
    monkeypatch.chdir(tmp_path)
    mk = _maker13()
    want = _expected13(name)
    ck = torch.load(DATA / f"v13_{name}.pt", weights_only=True)
    m = mk.model()
    opt = mk.make(name, m)
    m.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    assert [opt.micro_batches, opt.num_windows, opt.num_skipped] == want["before"][-1][1:4]
    got = _as_json(mk.after_cut(m, opt, name))
    for key in want["load"]:
        assert got[key] == want["load"][key], key


@pytest.mark.parametrize("name", V13)
def test_v13_pickle_loads_and_continues_as_7d2b1e2_did(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wrapper pickled by 7d2b1e2 mid-window (with its snapshot writer and its count of snapshots
    written, CSV rows still buffered, attachments of the open window, Rewind copies) unpickles with
    its stats history and continues as 7d2b1e2 did, writing its snapshots and CSV rows into the
    directory it is loaded in."""
    monkeypatch.chdir(tmp_path)
    mk = _maker13()
    want = _expected13(name)["pickle"]
    m, opt = pickle.loads((DATA / f"v13_{name}.pkl").read_bytes())
    assert [s.reason for s in opt.stats] == want["reasons"][: len(opt.stats)]
    got = _as_json(mk.after_cut(m, opt, name))
    for key in want:
        assert got[key] == want[key], key


@pytest.mark.parametrize("name", V13)
def test_v13_new_state_dict_has_the_7d2b1e2_format(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new code trains to the cut as 7d2b1e2 did, and its ``state_dict()`` there has the old
    one's keys, types, dtypes and shapes (SpikeGuard and Rewind entries, Rewind copies included)
    and the same counter values."""
    monkeypatch.chdir(tmp_path)
    mk = _maker13()
    m = mk.model()
    opt = mk.make(name, m)
    before = mk.run(m, opt, name, 0, mk.CUT[name])
    new = opt.state_dict()
    opt.close()  # while in tmp_path: at exit its logger would write into the directory of that moment
    assert _as_json(before) == _expected13(name)["before"]
    old = torch.load(DATA / f"v13_{name}.pt", weights_only=True)["optimizer"]
    assert _shape(new) == _shape(old)
    scalars = {k: v for k, v in old["clipopt"].items() if isinstance(v, (int, float, str))}
    assert {k: new["clipopt"][k] for k in scalars} == scalars
