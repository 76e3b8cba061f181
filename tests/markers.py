"""Skip conditions shared by the test modules: each written once, imported where it applies.

``needs_gloo``: the module spawns process groups on the gloo backend (CPU collectives).
``needs_cuda``: the module runs on a CUDA device; it carries the ``cuda`` marker too, so that
``python -m pytest -m cuda`` selects it.
"""

from __future__ import annotations

import pytest
import torch

#: Whether this torch build has ``torch.distributed`` with the gloo backend.
GLOO = torch.distributed.is_available() and torch.distributed.is_gloo_available()

needs_gloo = pytest.mark.skipif(
    not GLOO, reason="this torch build has no torch.distributed with the gloo backend"
)

needs_cuda = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
