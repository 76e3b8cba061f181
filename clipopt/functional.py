"""Pure tensor functions behind :class:`clipopt.ClippedOptimizer`.

Every function here works on a list of *gradients* (not parameters), never
reads a tensor back to the host, and returns norms and coefficients as 0-d
tensors on the gradients' device.  They are the same operations as
``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` split into their
parts, so that the wrapper can combine, fold and skip them:

* :func:`get_total_norm` — the p-norm of all gradients seen as one vector,
  accumulated in (at least) float32.
* :func:`clip_grads_value_` — clamp every element into ``[-clip_value, clip_value]``.
* :func:`clip_coef` — ``min(1, max_norm / (total_norm + 1e-6))``.
* :func:`scale_grads_` — multiply every gradient by a 0-d tensor.
* :func:`nonfinite_flag` — ``1.0`` where the norm is ``nan``/``inf``, else ``0.0``.

Per-group clipping (a bound per parameter group, see :mod:`clipopt._group_clip`):
:func:`group_norms`, :func:`shared_norm`, :func:`group_clip_coefs`,
:func:`clip_groups_value_`, :func:`scale_groups_` and their composition
:func:`clip_grad_groups_`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "EPS",
    "clip_coef",
    "check_value_clippable",
    "clip_grad_groups_",
    "clip_grads_value_",
    "clip_groups_value_",
    "get_norms",
    "get_total_norm",
    "group_clip_coefs",
    "group_norms",
    "nonfinite_flag",
    "scale_grads_",
    "scale_groups_",
    "shared_norm",
]

#: The constant torch adds to the norm before dividing (``clip_grad_norm_``).
EPS = 1e-6


def _norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 gradients: never less precise than float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _dense(grad: Tensor) -> Tensor:
    """The values whose norm is the gradient's norm (sparse COO gradients coalesced)."""
    if grad.is_sparse:
        return grad.coalesce().values()
    return grad


def _real_magnitude(grad: Tensor, p: float) -> Tensor:
    """A real tensor with the same p-norm as the complex ``grad``: the norm of the moduli ``|g|``.

    For p = 2 the real and imaginary parts (``view_as_real``, no copy) have the
    same 2-norm; other p need ``|g|`` itself (a copy).  This is what
    ``clip_grad_norm_`` measures for complex gradients.
    """
    g = _dense(grad)
    if g.dtype == torch.complex32:
        g = g.to(torch.complex64)
    return torch.view_as_real(g) if p == 2.0 else g.abs()


def _group(grads: Sequence[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    """The gradients by (device, dtype), in order; one group in the common case, found fast."""
    device, dtype = grads[0].device, grads[0].dtype
    if all(g.dtype == dtype and g.device == device for g in grads):
        return {(device, dtype): list(grads)}
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    return groups


@torch.no_grad()
def get_total_norm(
    grads: Sequence[Tensor],
    norm_type: float = 2.0,
    *,
    foreach: bool | None = None,
) -> Tensor:
    r"""Return the ``norm_type``-norm of ``grads`` viewed as one concatenated vector.

    .. math::
        \|g\|_p = \Big(\sum_i \sum_j |g_{ij}|^p\Big)^{1/p}, \qquad
        \|g\|_\infty = \max_{i,j} |g_{ij}|

    Unlike ``torch.nn.utils.get_total_norm`` the norm is accumulated in float32
    whatever the gradient dtype (float64 stays float64), so float16 gradients
    whose norm exceeds 65504 give a finite norm.  Sparse COO gradients are
    supported.  The result is a 0-d tensor on the device of the first gradient;
    nothing is read back to the host.

    Args:
        grads: the gradients (``p.grad``), not the parameters.
        norm_type: ``p > 0`` or ``float("inf")``.
        foreach: use ``torch._foreach_norm`` (``None``: where supported).
    """
    p = float(norm_type)
    if len(grads) == 0:
        return torch.zeros((), dtype=torch.float32)
    first_device = grads[0].device
    out_dtype = torch.float32
    norms: list[Tensor] = []
    if any(g.is_complex() for g in grads):
        grads = [_real_magnitude(g, p) if g.is_complex() else g for g in grads]
    for (device, dtype), group in _group(grads).items():
        acc = _norm_dtype(dtype)
        if acc == torch.float64:
            out_dtype = torch.float64
        sparse = any(g.is_sparse for g in group)
        if sparse and foreach:
            raise ValueError(
                "foreach=True does not support sparse gradients; pass foreach=None (the default)"
            )
        tensors = [_dense(g) for g in group] if sparse else group
        if foreach is None and device.type == "cpu":
            tensors = _direct_cpu_norms(tensors, p, acc, norms)
        use_foreach = (foreach is None or foreach) and device.type in _FOREACH_DEVICES
        use_foreach = use_foreach and not sparse
        if foreach and not use_foreach:
            raise RuntimeError(
                f"foreach=True was passed, but the foreach API does not support {device.type} tensors"
            )
        if not tensors:
            continue
        if use_foreach:
            norms.extend(torch._foreach_norm(tensors, p, dtype=acc))
        else:
            norms.extend(torch.linalg.vector_norm(t, p, dtype=acc) for t in tensors)
    if not norms:
        return torch.zeros((), dtype=out_dtype, device=first_device)
    if any(n.device != first_device or n.dtype != out_dtype for n in norms):
        norms = [n.to(device=first_device, dtype=out_dtype) for n in norms]
    stacked = torch.stack(norms)
    total: Tensor = torch.linalg.vector_norm(stacked, p)
    return total


@torch.no_grad()
def get_norms(
    grads: Sequence[Tensor],
    norm_type: float = 2.0,
    *,
    foreach: bool | None = None,
) -> Tensor:
    r"""Return the ``norm_type``-norm of each gradient, stacked in the order given.

    .. math:: n_i = \|g_i\|_p, \qquad \|g\|_p = \|(n_1, \dots, n_k)\|_p

    One read of the gradients, as :func:`get_total_norm` (whose value is the
    ``norm_type``-norm of this vector, equal to rounding), with the same kernels
    and accumulation dtype; for callers that need each gradient's norm too.
    A 1-d tensor of ``len(grads)`` values on the device of the first gradient.
    """
    p = float(norm_type)
    if len(grads) == 0:
        return torch.zeros(0, dtype=torch.float32)
    if any(g.is_complex() for g in grads):
        grads = [_real_magnitude(g, p) if g.is_complex() else g for g in grads]
    first_device = grads[0].device
    out_dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    norms: list[Tensor | None] = [None] * len(grads)
    places: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, g in enumerate(grads):
        places.setdefault((g.device, g.dtype), []).append(i)
    for (device, dtype), index in places.items():
        acc = _norm_dtype(dtype)
        sparse = any(grads[i].is_sparse for i in index)
        rest = []
        for i in index:
            t = _dense(grads[i])
            direct = _direct_cpu_norm(t, p, acc) if foreach is None and device.type == "cpu" else None
            if direct is None:
                rest.append(i)
            else:
                norms[i] = direct
        tensors = [_dense(grads[i]) for i in rest]
        if not tensors:
            continue
        if (foreach is None or foreach) and device.type in _FOREACH_DEVICES and not sparse:
            found = list(torch._foreach_norm(tensors, p, dtype=acc))
        else:
            found = [torch.linalg.vector_norm(t, p, dtype=acc) for t in tensors]
        for i, n in zip(rest, found, strict=True):
            norms[i] = n
    return torch.stack([n.to(device=first_device, dtype=out_dtype) for n in norms if n is not None])


def _direct_cpu_norm(t: Tensor, p: float, acc: torch.dtype) -> Tensor | None:
    """One large CPU tensor's norm by the kernels of :func:`_direct_cpu_norms`, else None."""
    if p == 2.0 and acc == t.dtype and t.numel() >= DOT_MIN_NUMEL:
        return torch.stack(_piece_squares(t)).sum().sqrt()
    if p == math.inf and t.numel() >= AMINMAX_MIN_NUMEL:
        return _abs_max(t).to(acc)
    return None


def _piece_squares(t: Tensor) -> list[Tensor]:
    """``sum(t**2)`` as ``torch.dot`` over pieces of ``DOT_PIECE_NUMEL`` elements (see there)."""
    return [torch.dot(x, x) for x in torch.split(_flat(t), DOT_PIECE_NUMEL)]


def _abs_max(t: Tensor) -> Tensor:
    """``max |t|`` in one pass (``torch.aminmax``), in ``t``'s dtype."""
    return torch.stack(torch.aminmax(t)).abs().max()


#: Devices with ``torch._foreach_*`` kernels.
_FOREACH_DEVICES = ("cpu", "cuda", "xpu", "mps")

#: On CPU, tensors at least this large get their 2-norm from ``torch.dot(g, g)``
#: (one pass, no buffer; faster and more accurate than ``_foreach_norm``, which
#: wins on small tensors through lower per-tensor overhead).  See benchmarks/.
DOT_MIN_NUMEL = 1 << 17

#: ``torch.dot`` accumulates in order, so its relative error grows with the length
#: (N(0,1) float32: 2e-4 at 30M elements; ``_foreach_norm`` 1.7e-3); summing it over
#: pieces of this many elements keeps about 1e-6 at any length, for ~1 % more time.
DOT_PIECE_NUMEL = 1 << 20

#: On CPU, tensors at least this large get their inf-norm from ``torch.aminmax``
#: (one pass, no buffer), several times faster than ``_foreach_norm(inf)``.
AMINMAX_MIN_NUMEL = 1 << 10


def _flat(t: Tensor) -> Tensor:
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


def _direct_cpu_norms(tensors: list[Tensor], p: float, acc: torch.dtype, norms: list[Tensor]) -> list[Tensor]:
    """Append the norms of the large CPU tensors computed directly; return the rest.

    ``p = 2`` (float32/float64 only: ``dot`` accumulates in the input dtype) and
    ``p = inf`` (any dtype: a max is exact) have single-pass kernels that beat
    ``_foreach_norm`` on large tensors; other cases are returned untouched.
    """
    if p == 2.0 and acc == tensors[0].dtype:
        big = [t for t in tensors if t.numel() >= DOT_MIN_NUMEL]
        if big:  # flattened one at a time: a non-dense gradient is copied only while in use
            squares = [square for t in big for square in _piece_squares(t)]
            norms.append(torch.stack(squares).sum().sqrt())
            return [t for t in tensors if t.numel() < DOT_MIN_NUMEL]
    elif p == math.inf:
        big = [t for t in tensors if t.numel() >= AMINMAX_MIN_NUMEL]
        if big:
            norms.append(torch.stack([_abs_max(t) for t in big]).max().to(acc))
            return [t for t in tensors if t.numel() < AMINMAX_MIN_NUMEL]
    return tensors


@torch.no_grad()
def clip_grads_value_(
    grads: Sequence[Tensor], clip_value: float, *, foreach: bool | None = None
) -> None:
    r"""Clamp every gradient element into ``[-clip_value, clip_value]`` in place.

    .. math:: g \leftarrow \operatorname{clamp}(g, -c, c)

    Same result as ``torch.nn.utils.clip_grad_value_``; an empty list is a no-op.
    Sparse gradients are rejected with a ``TypeError``.
    """
    if not grads:
        return
    check_value_clippable(grads)
    for (device, _), dense in _group(grads).items():
        if (foreach is None or foreach) and device.type in _FOREACH_DEVICES:
            torch._foreach_clamp_min_(dense, -clip_value)
            torch._foreach_clamp_max_(dense, clip_value)
        else:
            for g in dense:
                g.clamp_(-clip_value, clip_value)


def check_value_clippable(grads: Sequence[Tensor]) -> None:
    """Raise ``TypeError`` (before anything is clamped) for gradients value clipping cannot take.

    Sparse gradients are refused, as by ``clip_grad_value_``; so are complex ones:
    a complex number has no order, ``clamp`` is not defined for it (nor is
    ``clip_grad_value_``), and clamping the real and imaginary parts apart would
    turn the gradient's direction.  Clip complex gradients by norm instead.
    """
    if any(g.is_sparse for g in grads):
        raise TypeError(
            "clip_value does not support sparse gradients; "
            "pass clip_value=None for optimizers such as SparseAdam"
        )
    if any(g.is_complex() for g in grads):
        raise TypeError(
            "clip_value does not support complex gradients (a complex number has no order to clamp "
            "by); pass clip_value=None and bound complex gradients with max_norm"
        )


def clip_coef(total_norm: Tensor, max_norm: float | Tensor) -> Tensor:
    r"""Return ``min(1, max_norm / (total_norm + 1e-6))`` as a 0-d tensor.

    The same expression as ``torch.nn.utils.clip_grads_with_norm_``: the
    coefficient is always applied (a Python ``if coef < 1`` would read the
    tensor back to the host).  A non-finite ``total_norm`` gives ``0`` or
    ``nan``: check :func:`nonfinite_flag` before trusting it.
    """
    return torch.clamp(max_norm / (total_norm + EPS), max=1.0)


@torch.no_grad()
def scale_grads_(grads: Sequence[Tensor], coef: Tensor | float, *, foreach: bool | None = None) -> None:
    r"""Multiply every gradient by ``coef`` in place: :math:`g \leftarrow c\,g`.

    ``coef`` may be a 0-d tensor on any device; it is moved (asynchronously)
    to each gradient's device.
    """
    if not grads:
        return
    for (device, _), group in _group(grads).items():
        c = coef.to(device, non_blocking=True) if isinstance(coef, Tensor) else coef
        dense = [g for g in group if not g.is_sparse]
        for g in group:
            if g.is_sparse:
                g.mul_(c)
        if not dense:
            continue
        if (foreach is None or foreach) and device.type in _FOREACH_DEVICES:
            torch._foreach_mul_(dense, c)
        else:
            for g in dense:
                g.mul_(c)


def nonfinite_flag(total_norm: Tensor) -> Tensor:
    """``1.0`` (float32) where ``total_norm`` is ``nan`` or ``±inf``, else ``0.0``.

    Exactly the values a fused optimizer's ``found_inf`` accepts.
    """
    return (~torch.isfinite(total_norm)).to(torch.float32)


def _check_norm_type(norm_type: float) -> float:
    p = float(norm_type)
    if not (p > 0 or p == math.inf):
        raise ValueError(f"norm_type must be > 0 or float('inf'), got {norm_type!r}")
    return p


# Per-group clipping lives in its own module; it uses the functions above.
from ._group_clip import (  # noqa: E402
    clip_grad_groups_,
    clip_groups_value_,
    group_clip_coefs,
    group_norms,
    scale_groups_,
    shared_norm,
)
