"""The per-layer row of a window that went bad, whatever the ``layer_stats`` period.

See docs/diagnostics.md, 'Loggers'.

With ``layer_stats=k`` the full per-layer statistics are computed every k-th
window.  So that the report can name the first parameter whose gradient went
non-finite in *any* window, every other window also gets a candidate row built
from the per-parameter norms that the total-norm pass computes anyway
(:func:`clipopt.functional.get_norms`, no host read), which the loggers write
only when the window's total norm turned out non-finite (they read the norm
anyway).  In that row ``nonfinite`` is 1 when the parameter's gradient holds a
``nan`` or ``inf`` element (an indicator, not a count), from :func:`element_flags`:
not from the norm alone, which overflows float32 for finite elements of 1e25 and
would name such a parameter before the one holding the ``inf``.  ``grad_norm`` is its 2-norm (``nan`` when
``norm_type`` is not 2), and ``grad_max``, ``grad_min`` and ``param_norm`` are
``nan`` (not computed).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.compiler import is_compiling

from .. import functional as F
from .layers import LAYER_FIELDS, LayerStats

__all__ = ["any_nonfinite", "candidate_row", "element_flags", "norm_with_row", "row_of_norms"]

_NORM = LAYER_FIELDS.index("grad_norm")
_NONFINITE = LAYER_FIELDS.index("nonfinite")


def candidate_row(
    names: Sequence[str],
    with_grad: Sequence[int],
    norms: Tensor,
    scale: float,
    two_norm: bool,
    nonfinite: Tensor,
) -> LayerStats:
    """A ``[P, 5]`` row: ``norms[j] * scale`` is the norm of parameter ``with_grad[j]``'s gradient,
    ``nonfinite[j]`` 1.0 when that gradient holds a ``nan``/``inf`` element."""
    shape = (len(names), len(LAYER_FIELDS))
    values = torch.full(shape, float("nan"), dtype=torch.float32, device=norms.device)
    # every parameter has a gradient (the usual case): whole columns; else the rows' index, made once
    index: slice | Tensor = (
        slice(None) if len(with_grad) == len(names) else _rows_index(tuple(with_grad), norms.device)
    )
    column = norms.to(torch.float32) * scale
    if two_norm:
        values[index, _NORM] = column
    values[index, _NONFINITE] = nonfinite.to(torch.float32)
    return LayerStats(names, values)


def _rows_index(rows: tuple[int, ...], device: torch.device) -> Tensor:
    """``rows`` as an index tensor: from the cache in eager windows; while ``torch.compile`` traces
    the step, a constant of the graph (dynamo would trace through the cache, and warn about it)."""
    if is_compiling():
        return torch.tensor(rows, device=device, dtype=torch.long)
    return _index(rows, device)


@functools.lru_cache(maxsize=32)
def _index(rows: tuple[int, ...], device: torch.device) -> Tensor:
    """``rows`` as an index tensor on ``device``, made once per set of rows: a tensor made from a
    Python list is a blocking host-to-device copy on an accelerator, so not one per window."""
    return torch.tensor(rows, device=device, dtype=torch.long)


def any_nonfinite(row: LayerStats) -> Tensor:
    """1.0 (float32, on the device) when a parameter of the candidate ``row`` holds a nan/inf
    element, else 0.0: the window's gradients looked at element by element, no host read."""
    values = row.device_values()
    if values is None or values.numel() == 0:
        raise ValueError("any_nonfinite needs a candidate row still on the device (just made)")
    return values[:, _NONFINITE].nan_to_num(0.0).amax()


def norm_with_row(
    grads: list[Tensor],
    params: list[Tensor],
    names: list[str],
    *,
    norm_type: float,
    foreach: bool | None,
    inv: float,
) -> tuple[Tensor, LayerStats | None]:
    """The summed gradients' total norm, and from the same pass each gradient's norm as the
    window's candidate bad row (see :mod:`clipopt._diagnostics.badrow`)."""
    if float(norm_type) == math.inf:  # the norms say it all (element_flags): no sums
        norms, sums = F.get_norms(grads, norm_type, foreach=foreach), None
    else:
        norms, sums = F.norms_and_sums(grads, norm_type, foreach)
    raw_norm = F.finite_total(torch.linalg.vector_norm(norms, norm_type), grads, norm_type)
    return raw_norm, row_of_norms(norms, grads, params, names, norm_type=norm_type, inv=inv, sums=sums)


def row_of_norms(
    norms: Tensor,
    grads: list[Tensor],
    params: list[Tensor],
    names: list[str],
    *,
    norm_type: float,
    inv: float,
    sums: list[Tensor] | None = None,
) -> LayerStats:
    """The window's candidate bad row from the per-gradient norms already computed (``norms[j]``:
    the ``j``-th parameter with a gradient, ``grads[j]``), with each gradient's non-finite flag
    (:func:`element_flags`: its elements, not its norm alone; ``sums``: the gradients' sums when
    taken already)."""
    with_grad = [i for i, p in enumerate(params) if p.grad is not None]
    flags = element_flags(grads, norms, norm_type, sums)
    return candidate_row(names, with_grad, norms, inv, norm_type == 2.0, flags)


def element_flags(
    grads: list[Tensor], norms: Tensor, norm_type: float, sums: list[Tensor] | None = None
) -> Tensor:
    """1.0 (float32) for each gradient holding a ``nan``/``inf`` element, else 0.0, from its
    ``norm_type``-norm (``norms``) and, every window, one cheap pass: each gradient's sum.

    A finite norm means finite elements, and a ``nan`` norm a ``nan`` element (for the inf-norm,
    the largest ``|g|``, the norm says it all).  An infinite norm is an ``inf`` element, or finite
    elements whose float32 norm overflowed (about 1e19 and more for p = 2); their sum tells them apart:
    an ``inf`` or ``nan`` element makes it ``inf`` or ``nan``, finite elements keep it finite until
    it passes 3.4e38 itself (a gradient of n elements near 3.4e38 / n, which then counts as
    non-finite).
    The exact test, :func:`clipopt.functional.nonfinite_grads`, reads the largest ``|g|`` instead:
    on CPU about three times the time of a sum (24M parameters: 6.5 ms against 2.2), every window.
    ``sums``: the gradients' sums, taken already (:func:`clipopt.functional.norms_and_sums`, with
    the norms); otherwise they are taken here.
    """
    if float(norm_type) == math.inf or not grads:
        return (~torch.isfinite(norms)).to(torch.float32)
    device = norms.device
    if sums is None:
        sums = [(g.coalesce().values() if g.is_sparse else g).sum() for g in grads]
    total = torch.stack([s.to(device) for s in sums])
    return (torch.isnan(norms) | (torch.isinf(norms) & ~torch.isfinite(total))).to(torch.float32)
