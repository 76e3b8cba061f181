"""clipopt: safe gradient clipping, accumulation and non-finite skipping for PyTorch.

Swap ``torch.optim.AdamW(...)`` for
``ClippedOptimizer(torch.optim.AdamW(...), max_norm=1.0, accumulation_steps=4)``
and keep calling ``step()``.
"""

from __future__ import annotations

import importlib.util as _importlib_util
import warnings as _warnings

if _importlib_util.find_spec("numpy") is None:
    # torch warns "Failed to initialize NumPy" at import when NumPy is absent. clipopt never uses NumPy
    # (torch is its one dependency), so a wheel-only install would print that line on every `clipopt`
    # command. The filter covers torch's import only, and only that message; Tensor.numpy() still raises.
    with _warnings.catch_warnings():
        _warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
        import torch as _torch  # noqa: F401

from . import functional
from ._diagnostics.layers import LAYER_FIELDS, LayerStats
from ._diagnostics.loggers import CSVLogger, Logger
from ._diagnostics.snapshot import load_snapshot
from ._diagnostics.stats import StepStats, materialize
from ._diagnostics.tensorboard import TensorBoardLogger
from ._errors import NonFiniteGradientError
from ._optimizer import ClippedOptimizer
from ._policies.adagc import AdaGC
from ._policies.builtin import AGC, AutoClip, ClipPolicy, ZClip
from ._policies.stable_spam import StableSPAM
from ._recovery.qk_clip import QKClip
from ._recovery.rerun import Rerun
from ._recovery.rewind import Rewind, RewindEvent
from ._recovery.spike_guard import SpikeGuard
from ._replay.replay import ReplayResult, replay
from ._scheduler import PerUpdateScheduler, per_update
from ._version import __version__
from ._window.update_clip import UpdateClip

__all__ = [
    "AGC",
    "AdaGC",
    "AutoClip",
    "CSVLogger",
    "ClipPolicy",
    "ClippedOptimizer",
    "LAYER_FIELDS",
    "LayerStats",
    "Logger",
    "NonFiniteGradientError",
    "PerUpdateScheduler",
    "QKClip",
    "ReplayResult",
    "Rerun",
    "Rewind",
    "RewindEvent",
    "SpikeGuard",
    "StableSPAM",
    "StepStats",
    "TensorBoardLogger",
    "UpdateClip",
    "ZClip",
    "__version__",
    "functional",
    "load_snapshot",
    "materialize",
    "per_update",
    "replay",
]
