"""Hypothesis strategies shared by the tests."""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

#: p-norms the tests cover: the named ones and random p > 0.
named_norm_types = st.sampled_from([1.0, 2.0, 3.0, math.inf])
random_norm_types = st.floats(min_value=0.25, max_value=8.0, allow_nan=False)
norm_types = st.one_of(named_norm_types, random_norm_types)

max_norms = st.floats(min_value=1e-3, max_value=1e3, allow_nan=False, allow_infinity=False)
clip_values = st.floats(min_value=1e-3, max_value=1e2, allow_nan=False, allow_infinity=False)

_shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=6)
_elements = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, width=32)


@st.composite
def grad_arrays(draw: st.DrawFn, min_size: int = 1, max_size: int = 5) -> list[np.ndarray]:
    """A list of finite float32 arrays of random shapes (a model's gradients)."""
    n = draw(st.integers(min_size, max_size))
    return [draw(hnp.arrays(np.float32, draw(_shapes), elements=_elements)) for _ in range(n)]


def to_tensors(arrays: list[np.ndarray], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Fresh torch tensors (copies) of the arrays."""
    return [torch.tensor(a.copy(), dtype=dtype) for a in arrays]


def reference_norm(arrays: list[np.ndarray], p: float) -> float:
    """The p-norm of all arrays concatenated, in float64 plain NumPy."""
    flat = np.concatenate([np.abs(a.astype(np.float64)).ravel() for a in arrays])
    if math.isinf(p):
        return float(flat.max()) if flat.size else 0.0
    return float(np.sum(flat**p) ** (1.0 / p))
