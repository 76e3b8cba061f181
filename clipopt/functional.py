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
* :func:`nonfinite_grads` — per gradient, ``1.0`` where an element is ``nan``/``inf``
  (a float32 norm can overflow on finite elements: it cannot tell).
* :func:`finite_total` — the norm that cannot overflow: torch's norm as it is, or, where it
  overflowed on finite elements, the same norm taken max-scaled in float64 (every total norm
  here goes through it; see "A norm that cannot overflow" below).

Per-group clipping (a bound per parameter group, see the section at the end):
:func:`group_norms`, :func:`shared_norm`, :func:`group_clip_coefs`,
:func:`clip_groups_value_`, :func:`scale_groups_` and their composition
:func:`clip_grad_groups_`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.compiler import is_compiling

from ._tensors import cpu_value as _cpu_value
from ._tensors import flat as _flat

__all__ = [
    "EPS",
    "FLOAT32_MAX",
    "clip_coef",
    "check_value_clippable",
    "clip_grad_groups_",
    "clip_grads_value_",
    "clip_groups_value_",
    "finite_group_norms",
    "finite_norm_of",
    "finite_norms",
    "finite_total",
    "get_norms",
    "get_total_norm",
    "nonfinite_grads",
    "norm_range",
    "range_dtype",
    "group_clip_coefs",
    "group_norms",
    "narrowed",
    "beyond",
    "beyond_range",
    "nonfinite_flag",
    "overflowed",
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
    whose norm exceeds 65504 give a finite norm, and it cannot overflow: where
    torch's float32 norm of finite gradients is ``inf`` it is taken again,
    max-scaled in float64 (:func:`finite_total`; bit for bit torch's otherwise).
    Sparse COO gradients are supported.  The result is a 0-d tensor on the device
    of the first gradient; nothing is read back to the host (but on the CPU, where
    a read waits for nothing, whether it is ``inf``: :func:`overflowed`).

    Args:
        grads: the gradients (``p.grad``), not the parameters.
        norm_type: ``p > 0`` or ``float("inf")``.
        foreach: use ``torch._foreach_norm`` (``None``: where supported).
    """
    if torch.is_grad_enabled():  # a window's close runs without: no context to enter there
        with torch.no_grad():
            return _total_norm(grads, float(norm_type), foreach)
    return _total_norm(grads, float(norm_type), foreach)


def _total_norm(grads: Sequence[Tensor], p: float, foreach: bool | None) -> Tensor:
    """:func:`get_total_norm` (``p``: the norm type), with autograd off."""
    if len(grads) == 0:
        return torch.zeros((), dtype=torch.float32)
    plain_total = foreach_total_norm(grads, p, foreach, check=False)
    if plain_total is not None:  # the common case, without host checks per gradient
        return finite_total(plain_total, grads, p)  # (overflowed(): not read under torch.compile)
    first_device = grads[0].device
    out_dtype = torch.float32
    norms: list[Tensor] = []
    if any(g.is_complex() for g in grads):
        grads = [_real_magnitude(g, p) if g.is_complex() else g for g in grads]
    for (device, dtype), group in _group(grads).items():
        acc = _norm_dtype(dtype)
        if acc == torch.float64:
            out_dtype = torch.float64
        norms.extend(_same_kind_norms(group, device, p, acc, foreach))
    if not norms:
        return torch.zeros((), dtype=out_dtype, device=first_device)
    if any(n.device != first_device or n.dtype != out_dtype for n in norms):
        norms = [n.to(device=first_device, dtype=out_dtype) for n in norms]
    stacked = torch.stack(norms)
    return finite_total(torch.linalg.vector_norm(stacked, p), grads, p)


def foreach_total_norm(
    grads: Sequence[Tensor], p: float, foreach: bool | None, check: bool = True
) -> Tensor | None:
    """The ``p``-norm of ``grads`` from one ``torch._foreach_norm`` (and the norm of those norms) when
    they are all dense, real, of one device and dtype that the foreach kernels support, and none is
    large enough for :func:`_direct_cpu_norms`; else None (the general path of
    :func:`get_total_norm` decides).  Checked before the kernel runs: a kernel that refused a
    gradient part-way would have read the ones before it for nothing, every window.  Used by
    clipopt's plain window (``check``: an overflowed norm is taken again, :func:`finite_total`, read
    on the CPU; the plain window never runs under ``torch.compile``); not part of the public API."""
    first = grads[0]
    dtype, device = first.dtype, first.device
    if foreach is False or dtype.is_complex or device.type not in _FOREACH_DEVICES:
        return None
    acc = _norm_dtype(dtype)
    limit: float = math.inf
    if foreach is None and device.type == "cpu":  # the sizes _direct_cpu_norms takes
        limit = DOT_MIN_NUMEL if p == 2.0 and acc == dtype else AMINMAX_MIN_NUMEL if p == math.inf else limit
    cpu = device.type == "cpu"  # is_cpu is a cheaper test than building each tensor's device
    for g in grads:
        if (
            g.dtype is not dtype
            or g.is_sparse
            or g.numel() >= limit
            or not (g.is_cpu if cpu else g.device == device)
        ):
            return None
    total: Tensor = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(list(grads), p, dtype=acc)), p)
    # finite_total's check, inlined (every plain window); not read while torch.compile traces (a frame
    # it compiles inside the plain close, after an eager fallback, would break there)
    if check and cpu and host_reads(total) and _cpu_value(total) == math.inf:
        return finite_total(total, grads, p, overflow=True)
    return total


def _same_kind_norms(
    group: list[Tensor], device: torch.device, p: float, acc: torch.dtype, foreach: bool | None
) -> list[Tensor]:
    """``p``-norms in ``acc`` of parts of ``group`` (gradients of one device and dtype) that together
    make up all of it: the norm of these norms is the group's norm.  Large CPU tensors are measured
    directly, the rest with ``torch._foreach_norm`` where supported, else one by one."""
    norms: list[Tensor] = []
    sparse = any(g.is_sparse for g in group)
    if sparse and foreach:
        raise ValueError("foreach=True does not support sparse gradients; pass foreach=None (the default)")
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
        return norms
    if use_foreach:
        norms.extend(torch._foreach_norm(tensors, p, dtype=acc))
    else:
        norms.extend(torch.linalg.vector_norm(t, p, dtype=acc) for t in tensors)
    return norms


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
    A norm of finite elements that overflowed is taken again without overflow
    (:func:`finite_norms`; looked at on the CPU only, :func:`overflowed`).
    """
    p = float(norm_type)
    norms = _norms(grads, p, foreach, None)
    if p != math.inf and overflowed(norms):  # a finite tensor's own norm overflowed
        norms = narrowed(finite_norms(grads, p).to(norms.device), norms)
    return norms


@torch.no_grad()
def norms_and_sums(
    grads: Sequence[Tensor], norm_type: float, foreach: bool | None
) -> tuple[Tensor, list[Tensor]]:
    """:func:`get_norms`, bit for bit, and each gradient's sum of elements (of its values when sparse;
    of its real and imaginary parts, as one real sum, for a large complex CPU gradient; on its
    device).  A large CPU gradient measured by ``torch.dot`` pieces has each piece summed right
    after its ``dot``, while the piece is still in the core's cache (its sum is the sum of the
    pieces' sums: 24M parameters, 2 threads: 4.2 ms for both where they took 5.3 apart).  Used by
    the candidate per-layer row (``_diagnostics/badrow.py``), which only needs to know whether each
    sum is finite; not part of the public API (not in ``__all__``)."""
    sums: dict[int, Tensor] = {}
    norms = _norms(grads, float(norm_type), foreach, sums)
    found = [sums.get(i) for i in range(len(grads))]
    return norms, [s if s is not None else _dense(g).sum() for s, g in zip(found, grads, strict=True)]


def _norms(grads: Sequence[Tensor], p: float, foreach: bool | None, sums: dict[int, Tensor] | None) -> Tensor:
    """:func:`get_norms`; with ``sums``, also the sums of the gradients measured by ``dot`` pieces
    (by index), taken piece by piece."""
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
            cpu = foreach is None and device.type == "cpu"
            piece_sums: list[Tensor] | None = None if sums is None else []
            direct = _direct_cpu_norm(t, p, acc, piece_sums) if cpu else None
            if sums is not None and piece_sums:  # measured by dot pieces: their sums make the sum
                sums[i] = torch.stack(piece_sums).sum()
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


def _direct_cpu_norm(
    t: Tensor, p: float, acc: torch.dtype, piece_sums: list[Tensor] | None = None
) -> Tensor | None:
    """One large CPU tensor's norm by the kernels of :func:`_direct_cpu_norms`, else None
    (``piece_sums``: gets the sums of the ``dot`` pieces, when the norm is taken by them)."""
    if p == 2.0 and acc == t.dtype and t.numel() >= DOT_MIN_NUMEL:
        return torch.stack(_piece_squares(t, piece_sums)).sum().sqrt()
    if p == math.inf and t.numel() >= AMINMAX_MIN_NUMEL:
        return _abs_max(t).to(acc)
    return None


def _piece_squares(t: Tensor, piece_sums: list[Tensor] | None = None) -> list[Tensor]:
    """``sum(t**2)`` as ``torch.dot`` over pieces of ``DOT_PIECE_NUMEL`` elements (see there);
    ``piece_sums`` gets each piece's sum, taken right after its ``dot``, while it is in cache."""
    squares = []
    for x in torch.split(_flat(t), DOT_PIECE_NUMEL):
        squares.append(torch.dot(x, x))
        if piece_sums is not None:
            piece_sums.append(x.sum())
    return squares


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
def clip_grads_value_(grads: Sequence[Tensor], clip_value: float, *, foreach: bool | None = None) -> None:
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


@torch.no_grad()
def nonfinite_grads(
    grads: Sequence[Tensor], norms: Tensor, norm_type: float = 2.0, *, foreach: bool | None = None
) -> Tensor:
    """``1.0`` (float32) for each gradient holding a ``nan`` or ``inf`` element, else ``0.0``.

    ``norms`` are the gradients' ``norm_type``-norms (:func:`get_norms`).  A norm is ``nan``
    only when an element is; an ``inf`` norm may come from finite elements whose squares
    overflow float32 (elements of 1e25), so those are told apart by ``max |g|``, which never
    overflows (one more read of the gradients, skipped for ``norm_type=inf``: ``norms`` are
    those maxima).  On the device, no host read.
    """
    if len(grads) == 0:
        return torch.zeros(0, dtype=torch.float32)
    p = float(norm_type)
    maxima = norms if p == math.inf else get_norms(grads, math.inf, foreach=foreach)
    return (torch.isnan(norms) | ~torch.isfinite(maxima)).to(torch.float32)


def nonfinite_flag(total_norm: Tensor) -> Tensor:
    """``1.0`` (float32) where ``total_norm`` is ``nan`` or ``±inf``, else ``0.0``.

    Exactly the values a fused optimizer's ``found_inf`` accepts.  Two kernels: ``x - x`` is
    ``0`` for a finite ``x`` and ``nan`` for ``nan`` and ``±inf``, and ``ne_(0)`` writes the
    flag into that float tensor (``isfinite`` is five, and a sixth to convert it).
    """
    diff = total_norm - total_norm
    if diff.dtype != torch.float32:
        diff = diff.to(torch.float32)  # nan stays nan
    return diff.ne_(0.0)


# ----------------------------------------------------------------------------- a norm that cannot overflow
#
# torch's float32 norm kernels (vector_norm, _foreach_norm, dot: on the CPU as on CUDA) sum the
# p-th powers in float32, so a tensor whose norm exceeds about 1.8e19 (p = 2) has an inf norm
# however finite its elements, and so has the norm of norms that combines them.  Every total norm
# here is taken as torch takes it (bit for bit its value where it is finite) and then passes
# through finite_total: where it is +inf, it is taken again, max-scaled in float64, and narrowed back
# to the norm's dtype.  Whether it is +inf is known on the host for free on the CPU only (no device
# to wait for: a read through _tensors.cpu_value); on an accelerator it is not read (that would be a
# sync): the caller that reads the norm anyway passes what it read (``overflow=``).  The true norm
# above float32's largest value stays inf: not representable (reason "norm_overflow").

#: float32's largest finite value (3.4e38): a float32 norm above it is ``inf``.
FLOAT32_MAX = torch.finfo(torch.float32).max

#: Whether the host reads a CPU norm's value to look for an overflow (it waits for no device).
#: False makes the CPU take an accelerator's path, which reads nothing (the tests set it to run
#: the accelerators' closes here).
READ_CPU_NORMS = True


def host_reads(norm: Tensor) -> bool:
    """Whether the host may read ``norm``'s value without a sync: a CPU tensor
    (:data:`READ_CPU_NORMS`), outside ``torch.compile`` (a read would break the graph)."""
    return norm.is_cpu and READ_CPU_NORMS and not is_compiling()


def overflowed(norm: Tensor) -> bool:
    """Whether ``norm`` (a 0-d norm, or a vector of norms: any of them) is ``+inf``, where the host
    knows it without a sync: read on the CPU (one ``item()``, after an ``amax`` for a vector; no
    device to wait for; ``tests/hostreads.py`` counts it apart), False on an accelerator (not read,
    and no kernel launched: the norm stays as it is there) and under ``torch.compile`` (a read would
    break the graph: as on an accelerator)."""
    if norm.numel() == 0 or not host_reads(norm):
        return False
    return _cpu_value(norm if norm.numel() == 1 else norm.amax()) == math.inf


def norm_range(norm_type: float, dtype: torch.dtype = torch.float32) -> float:
    """The largest ``norm_type``-norm torch's kernels can take in ``dtype`` without overflow:
    ``finfo(dtype).max ** (1 / p)`` (1.8e19 for p = 2 in float32, 1.3e154 in float64; ``inf`` for
    the inf-norm, a largest element).  A window's range is that of :func:`range_dtype`.  A gradient
    whose norm is below it has every element below it too: for p = 2 every element's square is
    finite in that dtype, so no optimizer's squared-gradient state overflows from one window (a
    conservative rule: AdamW's ``exp_avg_sq``, ``(1 - beta2) * g**2``, is finite up to ~5.8e20 per
    float32 element)."""
    p = float(norm_type)
    if p == math.inf:
        return math.inf
    try:
        return float(torch.finfo(dtype).max ** (1.0 / p))
    except OverflowError:  # p < 1 in float64: beyond any float
        return math.inf


#: The gradient dtypes whose range of norms is float64's (every other one's is float32's).
_WIDE = (torch.float64, torch.complex128)


def range_dtype(grads: Sequence[Tensor]) -> torch.dtype:
    """The dtype whose range of norms (:func:`norm_range`) bounds a window of ``grads``: that of the
    narrowest gradient, float64 only where every gradient is float64 (or complex128), else float32:
    a float32 gradient, and what an optimizer keeps for it, live in float32's range whatever the
    norm's dtype (float64 beside a float64 gradient)."""
    return torch.float64 if grads and all(g.dtype in _WIDE for g in grads) else torch.float32


def beyond(value: float, norm_type: float, grads: Sequence[Tensor]) -> bool:
    """Whether a norm of ``grads`` whose value is ``value`` is finite and at least
    :func:`norm_range` in :func:`range_dtype` (``grads`` looked at only for a value beyond
    float32's range, the narrowest): the one rule of every close, read or passed as it was read."""
    if not math.isfinite(value) or value < norm_range(norm_type):
        return False
    return value >= norm_range(norm_type, range_dtype(grads))


def beyond_range(norm: Tensor, norm_type: float, divisor: float = 1.0, *, grads: Sequence[Tensor]) -> bool:
    """Whether the 0-d norm ``norm`` of ``grads`` times ``divisor`` (a window's norm of summed
    gradients, taken divided by its micro-batches) is :func:`beyond` their range of norms: a norm
    torch's kernels overflow on, which :func:`finite_total` took again, or one as large.  Known
    where the host knows it without a sync: read on the CPU (:func:`overflowed`'s read), False on
    an accelerator and under ``torch.compile``."""
    if not host_reads(norm):
        return False
    return beyond(_cpu_value(norm) * divisor, norm_type, grads)


def finite_norms(grads: Sequence[Tensor], norm_type: float = 2.0) -> Tensor:
    r"""Each gradient's ``norm_type``-norm in float64, taken so that it cannot overflow.

    .. math:: n_i = m_i \, \big\| g_i / m_i \big\|_p, \qquad m_i = \max_j |g_{ij}|

    The quotient's elements lie in ``[-1, 1]``, so the sum of their p-th powers is at most the
    number of elements, and the largest element ``m_i`` is exact (a maximum does not round).  ``nan``
    where an element is ``nan`` or ``±inf``.  One more read of each gradient for its maximum and one
    for its norm, through a float64 copy of one gradient at a time: for a window whose float32 norm
    overflowed only (:func:`finite_total`).  A 1-d float64 tensor on the first gradient's device;
    ``grads`` are left as they are (float64 ones too).
    """
    p = float(norm_type)
    if len(grads) == 0:
        return torch.zeros(0, dtype=torch.float64)
    device = grads[0].device
    out: list[Tensor] = []
    for g in grads:
        t = _real_magnitude(g, p) if g.is_complex() else _dense(g)
        if t.numel() == 0:
            out.append(torch.zeros((), dtype=torch.float64, device=t.device))
            continue
        m = _abs_max(t).double()
        if p == math.inf:
            out.append(m)
            continue
        unit = _unit(m)
        # a float64 copy to divide in place: ``t.double()`` is ``t`` itself for float64 gradients
        # (and a sparse gradient's values, or a complex one's ``view_as_real``, alias the gradient)
        out.append(torch.linalg.vector_norm(t.to(torch.float64, copy=True).div_(unit), p).mul_(unit))
    return torch.stack([n.to(device) for n in out])


def _unit(m: Tensor) -> Tensor:
    """``m``, or 1 where it is 0 (every element 0: nothing to divide by)."""
    return torch.where(m > 0, m, torch.ones_like(m))


def finite_norm_of(norms: Tensor, norm_type: float) -> Tensor:
    """The ``norm_type``-norm of a vector of float64 norms (:func:`finite_norms`), max-scaled: it cannot
    overflow when they are finite (0 for an empty vector)."""
    p = float(norm_type)
    if norms.numel() == 0:
        return norms.new_zeros(())
    m = norms.amax()
    if p == math.inf:
        return m
    unit = _unit(m)
    out: Tensor = torch.linalg.vector_norm(norms / unit, p).mul_(unit)
    return out


def narrowed(wide: Tensor, plain: Tensor) -> Tensor:
    """``plain`` (torch's norms, any shape), with ``wide`` (the same norms in float64, from
    :func:`finite_norms`) in ``plain``'s dtype where ``plain`` overflowed (``+inf``) and ``wide``
    fits: a finite norm stays torch's bit for bit, a norm above float32's largest value or of
    non-finite elements stays ``inf``/``nan``."""
    narrow = wide.to(plain.dtype)
    return torch.where((plain == math.inf) & torch.isfinite(narrow), narrow, plain)


def finite_total(
    total: Tensor, grads: Sequence[Tensor], norm_type: float = 2.0, *, overflow: bool | None = None
) -> Tensor:
    """``total``, torch's ``norm_type``-norm of ``grads`` (whatever kernels took it), unless it
    overflowed: then the same norm without overflow (:func:`finite_norms`, :func:`finite_norm_of`) in
    ``total``'s dtype, ``inf`` only where it exceeds that dtype's range or an element is not finite.

    ``overflow``: whether the caller read ``total`` as ``+inf`` (None: :func:`overflowed` looks, on
    the CPU only).  Every total norm of clipopt goes through here: one rule for every path.
    """
    if norm_type == math.inf or not (overflowed(total) if overflow is None else overflow):
        return total  # (a largest element does not overflow: inf is an element's)
    return narrowed(finite_norm_of(finite_norms(grads, norm_type).to(total.device), norm_type), total)


def finite_group_norms(
    norms: Tensor, sizes: Sequence[int], grads: Sequence[Tensor] | None, norm_type: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The per-tensor ``norms`` of ``grads``, their total norm and each group's norm
    (:func:`group_norms`; ``sizes``: how many norms belong to each group), none overflowing: where
    the total is ``+inf`` (:func:`overflowed`) the per-tensor norms are taken again by
    :func:`finite_norms` and narrowed as :func:`finite_total` narrows (``grads`` None: they are
    not); every norm of norms is max-scaled where its float32 sum overflowed (:func:`_norm_of`, which
    :func:`shared_norm` takes too)."""
    p = float(norm_type)
    total: Tensor = torch.linalg.vector_norm(norms, p) if norms.numel() else norms.new_zeros(())
    if p != math.inf and overflowed(total):  # a tensor's own norm, or their combination, overflowed
        if grads is not None:
            norms = narrowed(finite_norms(grads, p).to(norms.device), norms)
        total = _norm_of(norms, p)
    return norms, total, group_norms(norms, sizes, p)


# ----------------------------------------------------------------------------- per-group clipping
#
# The gradients come as *groups* (one list per parameter group of the inner optimizer).  Each group
# is either *shared* -- no bound of its own: clipped together with the other shared groups by their
# common norm and the wrapper's bound -- or has its *own* bound: a float (clipped by the norm of its
# own gradients) or None (left out of norm clipping).  Value clipping takes one bound per group.
# Every norm comes from the per-tensor norms of get_norms (one read of the gradients): a group's
# norm, the shared groups' norm and the total norm are p-norms of those.  Bounds enter as Python
# floats, so no host value is copied to the device.


def _norm_of(norms: Tensor, p: float) -> Tensor:
    """The p-norm of a vector of norms (0 for an empty one: the inf-norm has no identity), as torch
    combines them (``vector_norm``), max-scaled in float64 where that overflowed (:func:`overflowed`)
    on finite entries (:func:`finite_norm_of`, :func:`narrowed`)."""
    if norms.numel() == 0:
        return norms.new_zeros(())
    out: Tensor = torch.linalg.vector_norm(norms, p)
    if p != math.inf and overflowed(out):
        out = narrowed(finite_norm_of(norms.double(), p), out)
    return out


def group_norms(norms: Tensor, sizes: Sequence[int], norm_type: float) -> Tensor:
    r"""Each group's ``norm_type``-norm from the per-tensor norms, laid out group after group.

    .. math:: N_j = \big\|(n_i)_{i \in \text{group } j}\big\|_p

    ``norms`` is what :func:`get_norms` returns for the groups' gradients
    concatenated in order; ``sizes[j]`` is how many of them belong to group
    ``j``.  A group without gradients has norm 0.  A 1-d tensor of
    ``len(sizes)`` values, on ``norms``' device and in its dtype.
    """
    if sum(sizes) != norms.numel():
        raise ValueError(
            f"sizes must add up to the number of norms ({norms.numel()}), got {list(sizes)}; "
            "pass one count per group, in the order the gradients were given to get_norms"
        )
    p = float(norm_type)
    out: list[Tensor] = []
    start = 0
    for size in sizes:
        out.append(_norm_of(norms[start : start + size], p))
        start += size
    if not out:
        return norms.new_zeros(0)
    return torch.stack(out)


def shared_norm(norms_of_groups: Tensor, shared: Sequence[bool], norm_type: float) -> Tensor:
    r"""The common norm of the groups marked ``shared``: :math:`\|(N_j)_{j \in S}\|_p` (0 if none)."""
    picked = [norms_of_groups[j] for j, s in enumerate(shared) if s]
    if not picked:
        return norms_of_groups.new_zeros(())
    return _norm_of(torch.stack(picked), float(norm_type))


def group_clip_coefs(
    norms_of_groups: Tensor,
    bounds: Sequence[float | None],
    shared: Sequence[bool],
    shared_bound: float | Tensor | None,
    norm_type: float,
) -> Tensor:
    r"""The norm-clipping coefficient of every group, as a 1-d tensor (``len(bounds)`` values).

    * a shared group (``shared[j]``): :math:`\min(1, b / (N_S + 10^{-6}))` with the
      shared groups' common norm :math:`N_S` and ``shared_bound`` :math:`b`
      (1 when ``shared_bound`` is None); ``bounds[j]`` is ignored;
    * a group with its own float bound ``bounds[j]``: :math:`\min(1, b_j / (N_j + 10^{-6}))`;
    * a group whose own bound is None: 1 (left out of norm clipping).

    ``norms_of_groups`` are the groups' norms *after* value clipping, as the norm
    bound is applied after it.  A non-finite norm gives 0 or ``nan`` where it
    is bounded: check finiteness on the total norm before trusting it.
    """
    if not (len(bounds) == len(shared) == norms_of_groups.numel()):
        raise ValueError(
            f"bounds ({len(bounds)}), shared ({len(shared)}) and norms_of_groups "
            f"({norms_of_groups.numel()}) must have one entry per group"
        )
    one = torch.ones((), dtype=norms_of_groups.dtype, device=norms_of_groups.device)
    common = one
    if shared_bound is not None and any(shared):
        common = clip_coef(shared_norm(norms_of_groups, shared, norm_type), shared_bound)
    coefs: list[Tensor] = []
    for j, (bound, is_shared) in enumerate(zip(bounds, shared, strict=True)):
        if is_shared:
            coefs.append(common)
        elif bound is None:
            coefs.append(one)
        else:
            coefs.append(clip_coef(norms_of_groups[j], bound))
    if not coefs:
        return norms_of_groups.new_zeros(0)
    return torch.stack(coefs)


@torch.no_grad()
def clip_groups_value_(
    grad_groups: Sequence[Sequence[Tensor]],
    clip_values: Sequence[float | None],
    *,
    foreach: bool | None = None,
) -> None:
    r"""Clamp group ``j``'s gradients into ``[-clip_values[j], clip_values[j]]`` in place (None: untouched).

    Same result as ``torch.nn.utils.clip_grad_value_`` applied group by group;
    every group with a bound is checked (sparse and complex gradients refused,
    ``TypeError``) before any gradient is clamped.
    """
    if len(grad_groups) != len(clip_values):
        raise ValueError(
            f"clip_values must have one entry per group ({len(grad_groups)}), got {len(clip_values)}"
        )
    bounded = [(list(g), c) for g, c in zip(grad_groups, clip_values, strict=True) if c is not None and g]
    for grads, _ in bounded:
        check_value_clippable(grads)
    for grads, value in bounded:
        clip_grads_value_(grads, value, foreach=foreach)


@torch.no_grad()
def scale_groups_(
    grad_groups: Sequence[Sequence[Tensor]],
    coefs: Tensor | Sequence[Tensor | float],
    *,
    foreach: bool | None = None,
) -> None:
    r"""Multiply the gradients of group ``j`` by ``coefs[j]`` in place: :math:`g \leftarrow c_j\,g`.

    ``coefs`` is a 1-d tensor (as :func:`group_clip_coefs` returns; its entries
    are taken as views, no host read) or a sequence of 0-d tensors or floats.
    """
    if len(grad_groups) != len(coefs):
        raise ValueError(f"coefs must have one entry per group ({len(grad_groups)}), got {len(coefs)}")
    for grads, coef in zip(grad_groups, coefs, strict=True):
        if grads:
            scale_grads_(list(grads), coef, foreach=foreach)


@torch.no_grad()
def clip_grad_groups_(
    grad_groups: Sequence[Sequence[Tensor]],
    max_norm: float | None,
    norm_type: float = 2.0,
    *,
    bounds: Sequence[float | None] | None = None,
    shared: Sequence[bool] | None = None,
    clip_values: Sequence[float | None] | None = None,
    foreach: bool | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Clip gradient groups in place; return ``(total_norm, group_norms, coefs)``, all pre-clip norms.

    The per-group form of ``clip_grad_value_`` followed by ``clip_grad_norm_``:
    group ``j`` is value-clipped by ``clip_values[j]`` (None: not), then
    norm-clipped — with the other shared groups by their common norm and
    ``max_norm`` when ``shared[j]``, else alone by ``bounds[j]`` (None: not at
    all).  ``shared`` defaults to "every group", ``bounds`` to None each.

    The gradients are read once for the norms (twice with value clipping: the
    norm bound sees the clamped gradients).  ``total_norm`` is the pre-clip norm
    of every gradient, ``group_norms`` the pre-clip norm of each group and
    ``coefs`` the coefficient each group was multiplied by.
    """
    k = len(grad_groups)
    shared = [True] * k if shared is None else list(shared)
    bounds = [None] * k if bounds is None else list(bounds)
    values = [None] * k if clip_values is None else list(clip_values)
    sizes = [len(g) for g in grad_groups]
    flat = [g for group in grad_groups for g in group]
    norms = get_norms(flat, norm_type, foreach=foreach)
    _, total, pre = finite_group_norms(norms, sizes, flat, norm_type)
    post = pre
    if any(v is not None for v in values):
        clip_groups_value_(grad_groups, values, foreach=foreach)
        post = _renorm_clamped(grad_groups, values, pre, norm_type, foreach)
    coefs = group_clip_coefs(post, bounds, shared, max_norm, norm_type)
    scale_groups_(grad_groups, coefs, foreach=foreach)
    return total, pre, coefs


def _renorm_clamped(
    grad_groups: Sequence[Sequence[Tensor]],
    clip_values: Sequence[float | None],
    before: Tensor,
    norm_type: float,
    foreach: bool | None,
) -> Tensor:
    """The groups' norms after value clipping: only the clamped groups are read again."""
    picked = [j for j, v in enumerate(clip_values) if v is not None and grad_groups[j]]
    if not picked:
        return before
    flat = [g for j in picked for g in grad_groups[j]]
    sizes = [len(grad_groups[j]) for j in picked]
    again = group_norms(get_norms(flat, norm_type, foreach=foreach), sizes, norm_type)
    out = list(before.unbind())
    for slot, j in enumerate(picked):
        out[j] = again[slot].to(before.dtype)
    return torch.stack(out)
