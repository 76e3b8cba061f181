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
from ._errors import NonFiniteGradientError
from ._layers import LAYER_FIELDS, LayerStats
from ._logging import CSVLogger, Logger
from ._optimizer import ClippedOptimizer
from ._policies import AGC, AutoClip, ClipPolicy, ZClip
from ._policy_adagc import AdaGC
from ._policy_stable_spam import StableSPAM
from ._replay import ReplayResult, replay
from ._rewind import Rewind, RewindEvent
from ._scheduler import PerUpdateScheduler, per_update
from ._snapshot import load_snapshot
from ._spike_guard import SpikeGuard
from ._stats import StepStats, materialize
from ._tensorboard import TensorBoardLogger
from ._version import __version__

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
    "ReplayResult",
    "Rewind",
    "RewindEvent",
    "SpikeGuard",
    "StableSPAM",
    "StepStats",
    "TensorBoardLogger",
    "ZClip",
    "__version__",
    "functional",
    "load_snapshot",
    "materialize",
    "per_update",
    "replay",
]
