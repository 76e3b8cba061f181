"""A :class:`~clipopt.ClippedOptimizer` pickled by an earlier clipopt: its attributes in today's layout.

Pickles carry the wrapper's attributes by name, so each attribute added since
a release gets its default here, and each one moved into a component (see
ARCHITECTURE.md) is moved there.  ``tests/test_checkpoint_compat.py`` loads
pickles written by earlier versions.
"""

from __future__ import annotations

from typing import Any

from ._apply import StateReadiness
from ._diagnostics import Diagnostics
from ._distributed_decision import ReplicaDecision
from ._loss import LossSum
from ._recovery import SpikeRecovery
from ._skip_run import SkipRun
from ._window_grads import ParamIndex
from ._window_guard import WindowGuard

__all__ = ["upgrade_pickled"]

#: Attributes of the parameter cache before :class:`ParamIndex` (recomputed when read).
_OLD_INDEX = ("_params_key", "_params_cache", "_shards")
#: Attributes of the diagnostics before :class:`Diagnostics`, in its field order.
_OLD_DIAGNOSTICS = ("_snapshots", "_attached", "_bad_row", "last_snapshot", "_last_nonfinite_snapshot")


def upgrade_pickled(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (a pickled wrapper's ``__dict__``) with every attribute today's code reads."""
    state.setdefault("norm_group", None)
    state.setdefault("_replicas", ReplicaDecision("auto"))
    state.setdefault("backward_passes_per_step", 1)
    state.setdefault("_window_guard", WindowGuard())
    state.pop("_ready_state", None)  # before StateReadiness
    state.pop("_ready_size", None)
    state.setdefault("_readiness", StateReadiness())
    state.setdefault("_skip_sources", [])
    state.setdefault("_loss", LossSum())  # before the loss
    state.setdefault("_recovery", SpikeRecovery(None, None))  # before SpikeGuard / Rewind
    state.setdefault("_skip_run", SkipRun())  # before the consecutive-skip warning
    if "_index" not in state:
        index = ParamIndex()
        index.has_dtensor = bool(state.pop("_has_dtensor", False))
        for name in _OLD_INDEX:
            state.pop(name, None)
        state["_index"] = index
    if "_diagnostics" not in state:
        old = [state.pop(name, None) for name in _OLD_DIAGNOSTICS]
        state["_diagnostics"] = Diagnostics(old[0], old[1] or {}, *old[2:])
    return state
