"""``qk_clip=QKClip(model)``: the attention-logit cap of MuonClip (Kimi K2) and Megatron-LM's ``qk_clip``.

**Measuring.**  For every attention module it watches, the largest pre-softmax logit of each
query head over the window's forward passes: ``logit = (q . k) * scale`` with ``scale =
1/sqrt(head_dim)`` (a module's own ``scaling`` attribute where it has one), the number softmax
sees, over every (query, key) pair of the batch (masked pairs included: an upper bound under a
mask).  Forward hooks find it for ``nn.MultiheadAttention`` (``batch_first`` or not, the packed
``in_proj_weight`` or the separate ``q_proj_weight``/``k_proj_weight``, ``add_bias_kv``) and for
modules with ``q_proj``/``k_proj`` ``nn.Linear`` children (``num_heads``, ``num_key_value_heads``,
``head_dim`` ... read from the module, grouped-query heads included), and, when asked
(``fused="qkv"``), for modules with one fused ``nn.Linear`` child of that name whose output stacks
the queries, the keys and the values in that order (``[q; k; v]``: the layout of timm's ``qkv``,
nanoGPT's ``c_attn``, MPT's ``Wqkv``, Phi-3's ``qkv_proj``).  Fused projections are not found by
name alone: the same names hold per-head interleaved layouts elsewhere (GPTBigCode's ``c_attn``,
GPT-NeoX's ``query_key_value``), which a cap read as ``[q; k; v]`` would scale wrongly.  The hooks
recompute the projections (``nn.MultiheadAttention``) and ``QK^T`` for the watched heads: one more
attention matrix per layer, under ``no_grad``, with no host read.  Only forward passes with gradients
enabled are measured (an evaluation under ``no_grad`` is not training), and with ``every=k`` only
every k-th window.  A custom kernel reports its own maxima with :meth:`QKClip.observe`
(``measure=False`` turns the hooks off).  A module that applies rotary embeddings between its
projections and the product (HF Llama) is measured before the rotation: pass the kernel's maxima
to :meth:`~QKClip.observe` for the rotated logits; likewise one that normalises its queries and keys
(qk-layernorm) is measured before the normalisation.

**Applying.**  After each *applied* update (the skip flag may be a 0/1 device tensor: it is read
with ``torch.where``, never on the host), per key-value group ``g`` (a query head alone without
grouped-query attention), as ``Attention.clip_qk`` of Megatron-LM
(megatron/core/transformer/attention.py): ``m_g`` the largest logit of the group's query heads,
``eta_g = threshold / m_g`` where ``m_g > threshold``; the group's query rows (weight and bias) are
multiplied by ``eta_g ** alpha`` and its key head's rows by ``eta_g ** (1 - alpha)``.  A logit that
is not finite, at most the threshold (so any logit <= 0: ``eta`` is never computed from it, the NaN
of Megatron-LM#7382), or never measured scales nothing (a factor of exactly 1).  The rows are
scaled on the parameters the inner optimizer updates; a DTensor (FSDP2) parameter's rank scales
the rows of its own shard.

**Across ranks.**  Under data parallelism (``replica_group``) the maxima are agreed with one
``all_reduce(MAX)`` per measured window.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from numbers import Real
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from .._checks import check_float_between, check_positive_float, check_positive_int
from .._log_names import MAX_LOGIT
from .._part import Part, Window

__all__ = ["QKClip"]

#: Where a module's head counts are read, in order (the first one present is taken).
HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head")
KV_HEAD_ATTRS = (
    "num_key_value_heads",
    "num_kv_heads",
    "n_kv_heads",
    "n_kv_head",
    "kv_n_heads",
    "kv_heads",
    "num_heads_kv",
)
#: A module's own logit scale, in order (else ``1/sqrt(head_dim)``).
SCALE_ATTRS = ("scaling", "scale", "softmax_scale")


@dataclass(frozen=True)
class _Rows:
    """Rows of one projection parameter: ``getattr(owner, attr)[start:start + count]``."""

    owner: nn.Module
    attr: str
    start: int
    count: int
    key: bool  #: key rows (else query rows)


@dataclass
class _Attention:
    """One watched attention module: its heads and the rows its cap scales."""

    name: str
    module: nn.Module
    heads: int  #: query heads
    kv_heads: int  #: key-value heads (grouped-query attention: fewer than ``heads``)
    head_dim: int
    scale: float
    rows: tuple[_Rows, ...]
    fused: str = ""  #: the fused ``[q; k; v]`` projection child's name (else separate projections)
    params: list[Tensor] = field(default_factory=list)  #: ``rows``' parameters, bound by build()

    @property
    def group(self) -> int:
        """Query heads per key-value head."""
        return self.heads // self.kv_heads


class QKClip(Part):
    """Cap the attention logits by rescaling the query and key weights after each applied update.

    ``ClippedOptimizer(inner, qk_clip=QKClip(model, threshold=100.0, alpha=0.5))``: see
    :mod:`clipopt._recovery.qk_clip` and docs/qk-clip.md.

    Args:
        model: the model whose attention modules are watched (``nn.MultiheadAttention``, modules
            with ``q_proj``/``k_proj`` children, and modules with a fused ``[q; k; v]`` projection
            named in ``fused``); its query and key weights must be parameters of
            the inner optimizer (build the optimizer over the model's parameters, after ``fully_shard``).
        threshold: the largest logit left alone (> 0).
        alpha: the share of the cap taken by the query rows (in [0, 1]; the key rows take ``1 - alpha``).
        every: measure (and cap) every ``every``-th window only (an int >= 1).
        measure: False: no forward hooks; the maxima come from :meth:`observe` (a custom kernel).
        fused: the name (or names) of a fused query-key-value ``nn.Linear`` child whose output is
            ``[q; k; v]`` (e.g. ``"qkv"`` for timm, ``"c_attn"`` for nanoGPT): every module with
            such a child is watched, its heads read as for ``q_proj``/``k_proj`` modules.
    """

    keyword = "qk_clip"
    columns = (MAX_LOGIT,)

    def __init__(
        self,
        model: nn.Module,
        threshold: float = 100.0,
        alpha: float = 0.5,
        every: int = 1,
        measure: bool = True,
        fused: str | Sequence[str] = (),
    ) -> None:
        logit = "the largest attention logit left alone; Kimi K2 and Megatron-LM use 100"
        self.threshold = check_positive_float("threshold", threshold, "100.0", logit)
        split = "the query rows take eta**alpha of the cap, the key rows eta**(1 - alpha): 0.5, an even split"
        self.alpha = check_float_between("alpha", alpha, 0.0, 1.0, "0.5", split)
        self.every = check_positive_int("every", every, 1)
        if not isinstance(measure, bool):
            raise TypeError(f"measure must be a bool, got {measure!r}; pass measure=False for observe() only")
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"model must be a torch.nn.Module, got {type(model).__name__}; pass the model whose "
                "attention logits are capped, e.g. QKClip(model)"
            )
        self._watched = find_attention(model, _check_fused(fused))
        self._index = {id(a.module): i for i, a in enumerate(self._watched)}
        self._maxima: list[Tensor | None] = [None] * len(self._watched)  # this window's, per module
        self._due = True  # the open window is measured (every=k)
        hooks = [_hooks(a, self.measuring, partial(self._seen, i)) for i, a in enumerate(self._watched)]
        self._handles = [h for each in hooks for h in each] if measure else []
        self._cell: Tensor | None = None
        self._closed = False  # this window's commit ran (else logged() clears its measurement)

    # ------------------------------------------------------------------ settings

    @classmethod
    def build(cls, value: Any, inner: Optimizer) -> Part | None:
        part = super().build(value, inner)
        if isinstance(part, QKClip):
            part._bind(inner)
        return part

    def _bind(self, inner: Optimizer) -> None:
        """Resolve the rows' parameters among ``inner``'s: a ``ValueError`` (nothing changed) when one
        is not updated by it."""
        owned = {id(p) for g in inner.param_groups for p in g["params"]}
        bound = []
        for a in self._watched:
            params = [getattr(r.owner, r.attr) for r in a.rows]
            for r, p in zip(a.rows, params, strict=True):
                if id(p) not in owned:
                    raise ValueError(
                        f"qk_clip: {a.name}.{r.attr} is not a parameter of the optimizer; QKClip scales "
                        "the weights the optimizer updates: build the optimizer over model.parameters() "
                        "(after fully_shard), and QKClip(model) on that same model"
                    )
            bound.append(params)
        for a, params in zip(self._watched, bound, strict=True):
            a.params = params

    def settings(self) -> Mapping[str, object]:
        """The cap's settings and the number of heads watched (the size of the ranks' collective)."""
        return {
            "qk_clip.threshold": self.threshold,
            "qk_clip.alpha": self.alpha,
            "qk_clip.every": self.every,
            "qk_clip.heads": sum(a.heads for a in self._watched),
        }

    def __repr__(self) -> str:
        heads = sum(a.heads for a in self._watched)
        return (
            f"QKClip(threshold={self.threshold!r}, alpha={self.alpha!r}, every={self.every}; "
            f"{len(self._watched)} attention module(s), {heads} head(s))"
        )

    @property
    def modules(self) -> list[str]:
        """The names of the watched attention modules, in model order."""
        return [a.name for a in self._watched]

    def remove(self) -> None:
        """Remove the forward hooks (the maxima then come from :meth:`observe` only)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ------------------------------------------------------------------ measuring

    def observe(self, module: nn.Module, max_logits: Tensor) -> None:
        """Record the largest logit of each query head of ``module`` (a tensor of ``heads`` values,
        the scaled logits softmax sees) for the open window: a custom kernel's maxima.  Several calls
        in a window keep each head's largest; in a window ``every=k`` does not measure, nothing."""
        i = self._index.get(id(module))
        if i is None:
            raise ValueError(
                f"qk_clip.observe: {type(module).__name__} is not one of the attention modules QKClip "
                f"watches ({', '.join(self.modules)}); pass one of them"
            )
        a = self._watched[i]
        if not isinstance(max_logits, Tensor) or max_logits.numel() != a.heads:
            shape = tuple(max_logits.shape) if isinstance(max_logits, Tensor) else type(max_logits).__name__
            raise ValueError(
                f"qk_clip.observe: max_logits for {a.name} must be a tensor of its {a.heads} query heads' "
                f"largest logits, got {shape}"
            )
        if self._due:
            self._seen(i, max_logits.detach().reshape(a.heads))

    def _seen(self, i: int, maxima: Tensor) -> None:
        """Fold one forward pass's per-head maxima of module ``i`` into the window's."""
        with torch.no_grad():
            maxima = maxima.float()
            old = self._maxima[i]
            self._maxima[i] = maxima if old is None else torch.maximum(old, maxima.to(old.device))

    def measuring(self) -> bool:
        """Whether a forward pass now is measured: gradients enabled, and the open window due."""
        return self._due and torch.is_grad_enabled()

    # ------------------------------------------------------------------ the window's hooks

    def commit(self, w: Window, d: Any, skipped: bool | Tensor) -> None:
        """The window stands: agree the maxima across the replicas and, unless it was skipped, cap."""
        measured, self._due, self._closed = self._due, w.number % self.every == 0, True
        self._cell = None
        if not measured or not self._watched or not w.params:
            self._maxima = [None] * len(self._watched)
            return
        with torch.no_grad():
            maxima = self._window_maxima(w.params[0].device)
            self._maxima = [None] * len(self._watched)
            if w.replicated:
                torch.distributed.all_reduce(maxima, torch.distributed.ReduceOp.MAX, group=w.replica_group)
            top = maxima.max()
            self._cell = torch.where(top == -math.inf, math.nan, top)
            if skipped is True:
                return
            applied = None if skipped is False else torch.as_tensor(skipped).to(maxima.device) == 0
            per_module = torch.split(maxima, [a.heads for a in self._watched])
            for a, m in zip(self._watched, per_module, strict=True):
                self._cap(a, m, applied)

    def _window_maxima(self, device: torch.device) -> Tensor:
        """Every watched head's largest logit of the window, one vector (-inf: not measured; NaN too)."""
        parts = [
            torch.full((a.heads,), -math.inf, device=device)
            if m is None
            else m.to(device).nan_to_num(nan=-math.inf)
            for a, m in zip(self._watched, self._maxima, strict=True)
        ]
        return torch.cat(parts)

    def _cap(self, a: _Attention, maxima: Tensor, applied: Tensor | None) -> None:
        """Scale module ``a``'s query and key rows by its groups' factors (:func:`cap_factors`)."""
        q, k = cap_factors(maxima, a.kv_heads, self.threshold, self.alpha, applied)
        for r, p in zip(a.rows, a.params, strict=True):
            per_head = k if r.key else q
            scale_rows(p, r.start, per_head.repeat_interleave(a.head_dim * (1 if r.key else a.group)))

    def logged(self, stats: Any) -> None:
        """Every window's end: one that closed without :meth:`commit` (no gradient, or discarded by a
        rewind) drops what was measured for it and counts towards ``every`` all the same."""
        if not self._closed:
            self._maxima = [None] * len(self._watched)
            self._due = stats.step % self.every == 0
        self._closed = False

    def record(self, w: Window) -> None:
        """``StepStats.max_logit``: the window's largest logit (agreed), a 0-d tensor (NaN: none measured)."""
        if self._cell is not None:
            w.cells[MAX_LOGIT] = self._cell

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Whether the open window is measured, and its maxima so far, by module name."""
        pairs = zip(self._watched, self._maxima, strict=True)
        return {"due": self._due, "maxima": {a.name: m.clone() for a, m in pairs if m is not None}}

    def check_state(self, saved: Any, inner: Optimizer) -> Any:
        if not isinstance(saved, Mapping) or not isinstance(saved.get("due"), bool):
            raise ValueError(f"the state dict's qk_clip entry is not QKClip's: {saved!r:.120}")
        maxima = saved.get("maxima", {})
        if not isinstance(maxima, Mapping):
            raise ValueError(
                f"the state dict's qk_clip maxima are not a mapping by module name: {maxima!r:.120}"
            )
        heads = {a.name: a.heads for a in self._watched}
        for name, m in dict(maxima).items():
            if name not in heads or not isinstance(m, Tensor) or m.numel() != heads[name]:
                raise ValueError(
                    f"the state dict's qk_clip entry holds maxima for {name!r}, which is not an attention "
                    f"module of this QKClip with as many heads ({', '.join(heads)}); load it into a QKClip "
                    "over the same model"
                )
        return saved["due"], dict(maxima)

    def load_state(self, checked: Any) -> None:
        due, maxima = checked
        self._due = due
        self._maxima = [maxima.get(a.name) for a in self._watched]


# ---------------------------------------------------------------------- the cap


def cap_factors(
    maxima: Tensor, kv_heads: int, threshold: float, alpha: float, applied: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Per key-value group: the query factor ``eta ** alpha`` and the key factor ``eta ** (1 - alpha)``,
    ``eta = threshold / m`` for a group whose largest logit ``m`` (over its query heads, ``maxima``)
    is finite and above ``threshold``, else exactly 1 (also where ``applied`` is False)."""
    m = maxima.float().view(kv_heads, -1).amax(dim=1)
    over = torch.isfinite(m) & (m > threshold)
    if applied is not None:
        over = over & applied
    eta = torch.where(over, threshold / torch.where(over, m, 1.0), 1.0)
    return eta.pow(alpha), eta.pow(1.0 - alpha)


def scale_rows(p: Tensor, start: int, factors: Tensor) -> None:
    """Multiply rows ``start:start + len(factors)`` of ``p`` in place, row ``start + i`` by ``factors[i]``;
    of a DTensor, the rows its local shard holds."""
    local, first = _local_rows(p)
    lo, hi = max(start, first), min(start + factors.numel(), first + local.shape[0])
    if hi <= lo:
        return
    seg = local[lo - first : hi - first]
    f = factors[lo - start : hi - start].to(device=seg.device, dtype=seg.dtype)
    seg.mul_(f.view(-1, *([1] * (seg.dim() - 1))))


def _local_rows(p: Tensor) -> tuple[Tensor, int]:
    """``p``'s rows this rank holds (the storage itself) and the global index of the first."""
    to_local = getattr(p, "to_local", None)
    if to_local is None:
        return p.detach(), 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)  # type: ignore[attr-defined]
    return to_local().detach(), int(offset[0])


# ---------------------------------------------------------------------- finding the attention


def find_attention(model: nn.Module, fused: tuple[str, ...] = ()) -> list[_Attention]:
    """Every ``nn.MultiheadAttention``, every module with ``q_proj``/``k_proj`` ``nn.Linear``
    children and every module with a fused projection child named in ``fused`` of ``model``, in
    model order; a ``ValueError`` when there is none, or when a name of ``fused`` names none."""
    found = []
    unused = set(fused)
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            found.append(_mha(name or "(model)", module))
        elif isinstance(getattr(module, "q_proj", None), nn.Linear) and isinstance(
            getattr(module, "k_proj", None), nn.Linear
        ):
            found.append(_projections(name or "(model)", module))
        elif (child := _fused_child(module, fused)) is not None:
            found.append(_fused(name or "(model)", module, child))
            unused.discard(child)
    if unused:
        raise ValueError(
            f"qk_clip: fused={tuple(sorted(unused))!r} names no nn.Linear child of any module of "
            f"{type(model).__name__}; pass the attribute name of the fused [q; k; v] projection, "
            "e.g. fused='qkv'"
        )
    if not found:
        raise ValueError(
            f"model has no attention QKClip can watch ({type(model).__name__}: no nn.MultiheadAttention, no "
            "module with q_proj/k_proj nn.Linear children); pass the model that holds the attention layers, "
            "and fused='qkv' (the child's name) for a fused [q; k; v] projection"
        )
    return found


def _fused_child(module: nn.Module, fused: tuple[str, ...]) -> str | None:
    """The name of ``module``'s fused query-key-value ``nn.Linear`` child among ``fused``, or None."""
    return next((n for n in fused if isinstance(getattr(module, n, None), nn.Linear)), None)


def _check_fused(value: Any) -> tuple[str, ...]:
    """``fused`` as a tuple of attribute names (a str is one)."""
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, Sequence) or not all(isinstance(n, str) and n.isidentifier() for n in names):
        raise TypeError(
            f"fused must be an attribute name or a sequence of them, got {value!r}; pass the name of the "
            "fused [q; k; v] nn.Linear child, e.g. fused='qkv'"
        )
    return tuple(dict.fromkeys(names))


def _mha(name: str, m: nn.MultiheadAttention) -> _Attention:
    e, h = m.embed_dim, m.num_heads
    if m.in_proj_weight is not None:  # packed (else q_proj_weight, k_proj_weight)
        rows = [_Rows(m, "in_proj_weight", 0, e, False), _Rows(m, "in_proj_weight", e, e, True)]
    else:
        rows = [_Rows(m, "q_proj_weight", 0, e, False), _Rows(m, "k_proj_weight", 0, e, True)]
    if m.in_proj_bias is not None:
        rows += [_Rows(m, "in_proj_bias", 0, e, False), _Rows(m, "in_proj_bias", e, e, True)]
    return _Attention(name, m, h, h, m.head_dim, m.head_dim**-0.5, tuple(rows))


def _attr_int(module: nn.Module, names: tuple[str, ...]) -> int | None:
    """The first of ``names`` that ``module`` (or its ``config``) has as a positive int."""
    config = getattr(module, "config", None)
    for owner in (module, config):
        for n in names:
            v = getattr(owner, n, None) if owner is not None else None
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def _projections(name: str, m: nn.Module) -> _Attention:
    q, k = cast(nn.Linear, m.q_proj), cast(nn.Linear, m.k_proj)  # (find_attention checked)
    heads, head_dim = _attr_int(m, HEAD_ATTRS), _attr_int(m, ("head_dim",))
    if head_dim is None and heads is not None and q.out_features % heads == 0:
        head_dim = q.out_features // heads
    if head_dim is None:
        raise ValueError(
            f"qk_clip: cannot tell the heads of {name!r} ({type(m).__name__}): it has none of the "
            f"attributes {', '.join(HEAD_ATTRS)} or head_dim; set one on the module (e.g. "
            "module.num_heads = 8), or watch a model whose attention modules have them"
        )
    heads = heads or q.out_features // head_dim
    kv = _attr_int(m, KV_HEAD_ATTRS) or k.out_features // head_dim
    if heads * head_dim != q.out_features or kv * head_dim != k.out_features or heads % kv:
        raise ValueError(
            f"qk_clip: the heads of {name!r} do not fit its projections: {heads} query heads and {kv} "
            f"key-value heads of {head_dim} features, but q_proj has {q.out_features} outputs and "
            f"k_proj {k.out_features}; fix the module's num_heads/num_key_value_heads/head_dim"
        )
    rows = [_Rows(q, "weight", 0, q.out_features, False), _Rows(k, "weight", 0, k.out_features, True)]
    rows += [_Rows(p, "bias", 0, p.out_features, p is k) for p in (q, k) if p.bias is not None]
    return _Attention(name, m, heads, kv, head_dim, _scale(m, head_dim), tuple(rows))


def _scale(m: nn.Module, head_dim: int) -> float:
    """The module's own logit scale (:data:`SCALE_ATTRS`), else ``1/sqrt(head_dim)``."""
    for attr in SCALE_ATTRS:
        v = getattr(m, attr, None)
        if isinstance(v, Real) and not isinstance(v, bool):
            return float(v)
    return float(head_dim**-0.5)


def _fused(name: str, m: nn.Module, child: str) -> _Attention:
    """A module whose fused projection ``child`` outputs ``[q; k; v]``: ``heads * head_dim`` query
    features, then ``kv_heads * head_dim`` key features, then as many value features."""
    qkv = cast(nn.Linear, getattr(m, child))
    out = qkv.out_features
    heads, kv, head_dim = _attr_int(m, HEAD_ATTRS), _attr_int(m, KV_HEAD_ATTRS), _attr_int(m, ("head_dim",))
    if heads is None:
        raise ValueError(
            f"qk_clip: cannot tell the heads of {name!r} ({type(m).__name__}, fused projection {child!r}): "
            f"it has none of the attributes {', '.join(HEAD_ATTRS)}; set one on the module (e.g. "
            "module.num_heads = 8)"
        )
    kv = kv or heads
    if head_dim is None and out % (heads + 2 * kv) == 0:
        head_dim = out // (heads + 2 * kv)
    if head_dim is None or (heads + 2 * kv) * head_dim != out or heads % kv:
        size = (
            f"{head_dim} features make a [q; k; v] of {(heads + 2 * kv) * head_dim}"
            if head_dim
            else "features of any size make no [q; k; v] of"
        )
        raise ValueError(
            f"qk_clip: the heads of {name!r} do not fit its fused projection {child!r}: {heads} query heads "
            f"and {kv} key-value heads of {size} outputs, but it has {out}; fix the module's "
            "num_heads/num_key_value_heads/head_dim (QKClip reads a fused projection as [q; k; v])"
        )
    q_rows, k_rows = heads * head_dim, kv * head_dim
    rows = [_Rows(qkv, "weight", 0, q_rows, False), _Rows(qkv, "weight", q_rows, k_rows, True)]
    if qkv.bias is not None:
        rows += [_Rows(qkv, "bias", 0, q_rows, False), _Rows(qkv, "bias", q_rows, k_rows, True)]
    return _Attention(name, m, heads, kv, head_dim, _scale(m, head_dim), tuple(rows), fused=child)


# ---------------------------------------------------------------------- the forward hooks


def head_maxima(q: Tensor, k: Tensor, kv_heads: int, head_dim: int, scale: float) -> Tensor:
    """The largest scaled logit of each query head: ``q`` (..., L, heads * head_dim) and ``k``
    (..., S, kv_heads * head_dim), query head ``h`` reading key head ``h // (heads // kv_heads)``."""
    qh = q.reshape(*q.shape[:-1], kv_heads, -1, head_dim)
    kh = k.reshape(*k.shape[:-1], kv_heads, head_dim)
    per_head = torch.einsum("...lkgd,...skd->...kgls", qh, kh).amax(dim=(-2, -1)) * scale
    return per_head.reshape(-1, per_head.shape[-2] * per_head.shape[-1]).amax(dim=0)


def _full(t: Tensor) -> Tensor:
    """A DTensor's whole value (a parameter FSDP2 has not gathered); others as they are."""
    full = getattr(t, "full_tensor", None)
    return t if full is None else full()


def _mha_qk(m: nn.MultiheadAttention, query: Tensor, key: Tensor) -> tuple[Tensor, Tensor]:
    """The projected queries and keys of one ``nn.MultiheadAttention`` call, batch first."""
    if query.dim() == 2:  # unbatched (L, E)
        query, key = query.unsqueeze(0), key.unsqueeze(0)
    elif not m.batch_first:
        query, key = query.transpose(0, 1), key.transpose(0, 1)
    e = m.embed_dim
    bias = None if m.in_proj_bias is None else _full(m.in_proj_bias)
    bq, bk = (None, None) if bias is None else (bias[:e], bias[e : 2 * e])
    if m.in_proj_weight is not None:  # packed (else q_proj_weight, k_proj_weight)
        w = _full(m.in_proj_weight)
        wq, wk = w[:e], w[e : 2 * e]
    else:
        wq, wk = _full(m.q_proj_weight), _full(m.k_proj_weight)
    q, k = nn.functional.linear(query, wq, bq), nn.functional.linear(key, wk, bk)
    if m.bias_k is not None:  # add_bias_kv: one more key
        bias_k = _full(m.bias_k)
        k = torch.cat([k, bias_k.reshape(1, 1, e).expand(k.shape[0], 1, e).to(k.dtype)], dim=1)
    return q, k


def _hooks(a: _Attention, measuring: Callable[[], bool], seen: Callable[[Tensor], None]) -> Iterator[Any]:
    """The forward hooks that measure ``a`` while ``measuring()``, handing ``seen`` its heads' maxima."""
    if isinstance(a.module, nn.MultiheadAttention):
        mha = a.module

        def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if measuring():
                query = args[0] if args else kwargs["query"]
                key = args[1] if len(args) > 1 else kwargs["key"]
                with torch.no_grad():
                    q, k = _mha_qk(mha, query, key)
                    seen(head_maxima(q, k, a.kv_heads, a.head_dim, a.scale))

        yield mha.register_forward_pre_hook(pre, with_kwargs=True)
        return
    if a.fused:
        q_end, k_end = a.heads * a.head_dim, (a.heads + a.kv_heads) * a.head_dim

        def stacked(module: nn.Module, args: Any, output: Tensor) -> None:
            if measuring():
                with torch.no_grad():
                    q, k = output[..., :q_end], output[..., q_end:k_end]
                    seen(head_maxima(q, k, a.kv_heads, a.head_dim, a.scale))

        yield getattr(a.module, a.fused).register_forward_hook(stacked)
        return
    slot: dict[str, Tensor] = {}
    for which in ("q_proj", "k_proj"):

        def out(module: nn.Module, args: Any, output: Tensor, which: str = which) -> None:
            if measuring():
                slot[which] = output.detach()

        yield getattr(a.module, which).register_forward_hook(out)

    def after(module: nn.Module, args: Any, output: Any) -> None:
        q, k = slot.pop("q_proj", None), slot.pop("k_proj", None)
        if q is not None and k is not None:
            with torch.no_grad():
                seen(head_maxima(q, k, a.kv_heads, a.head_dim, a.scale))

    yield a.module.register_forward_hook(after)
