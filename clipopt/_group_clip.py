"""Per-group clipping as pure tensor functions (re-exported by :mod:`clipopt.functional`).

The gradients come as *groups* (one list per parameter group of the inner
optimizer).  Each group is either **shared** — it has no bound of its own and
is clipped together with the other shared groups by their common norm and the
wrapper's bound — or has its **own** bound: a float (the group is clipped by
the norm of its own gradients) or None (the group is left out of norm
clipping).  Value clipping takes one bound per group (None: off).

Every norm comes from the per-tensor norms of :func:`clipopt.functional.get_norms`
(one read of the gradients): a group's norm, the shared groups' norm and the
total norm are p-norms of those, so no second read is needed.  Nothing here
reads a tensor back to the host, and no host value is copied to the device:
bounds enter as Python floats.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import functional as F  # functional re-exports this module at its end

__all__ = [
    "clip_grad_groups_",
    "clip_groups_value_",
    "group_clip_coefs",
    "group_norms",
    "scale_groups_",
    "shared_norm",
]


def _norm_of(norms: Tensor, p: float) -> Tensor:
    """The p-norm of a vector of norms (0 for an empty one: the inf-norm has no identity)."""
    if norms.numel() == 0:
        return norms.new_zeros(())
    out: Tensor = torch.linalg.vector_norm(norms, p)
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
        common = F.clip_coef(shared_norm(norms_of_groups, shared, norm_type), shared_bound)
    coefs: list[Tensor] = []
    for j, (bound, is_shared) in enumerate(zip(bounds, shared, strict=True)):
        if is_shared:
            coefs.append(common)
        elif bound is None:
            coefs.append(one)
        else:
            coefs.append(F.clip_coef(norms_of_groups[j], bound))
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
        F.check_value_clippable(grads)
    for grads, value in bounded:
        F.clip_grads_value_(grads, value, foreach=foreach)


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
            F.scale_grads_(list(grads), coef, foreach=foreach)


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
    norms = F.get_norms(flat, norm_type, foreach=foreach)
    pre = group_norms(norms, sizes, norm_type)
    total = _norm_of(norms, float(norm_type))
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
    again = group_norms(F.get_norms(flat, norm_type, foreach=foreach), sizes, norm_type)
    out = list(before.unbind())
    for slot, j in enumerate(picked):
        out[j] = again[slot].to(before.dtype)
    return torch.stack(out)
