"""Small tensor helpers shared by the norm kernels (:mod:`clipopt.functional`) and the
per-layer statistics (:mod:`clipopt._diagnostics.layers`)."""

from __future__ import annotations

from torch import Tensor

__all__ = ["flat"]


def flat(t: Tensor) -> Tensor:
    """``t`` as a 1-d tensor without a copy where its memory is dense (contiguous, channels_last,
    transposed: the dimensions permuted into memory order), else a contiguous copy.

    Norms and statistics do not depend on the order of the elements; a strided
    view would make ``torch.dot`` accumulate sequentially (less accurate).
    """
    if t.is_contiguous():
        return t.view(-1)
    strides = t.stride()
    permuted = t.permute(sorted(range(t.dim()), key=lambda d: -strides[d]))
    return permuted.view(-1) if permuted.is_contiguous() else t.contiguous().view(-1)
