"""Per-parameter ("per-layer") gradient statistics and parameter names."""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .._distributed.collectives import combined_rows, local_shards
from .._tensors import flat as _flat

__all__ = [
    "LAYER_FIELDS",
    "LayerStats",
    "compute_layer_stats",
    "resolve_param_names",
    "sharded_layer_stats",
]

#: The statistics kept per parameter, in column order.
LAYER_FIELDS = ("grad_norm", "grad_max", "grad_min", "nonfinite", "param_norm")


class LayerStats:
    """Per-parameter statistics of one window's combined, pre-clip gradient.

    For each parameter: ``grad_norm`` (L2, float32), ``grad_max`` (max |g|),
    ``grad_min`` (min |g|), ``nonfinite`` (number of nan/inf elements) and
    ``param_norm`` (L2 of the parameter).  Gradient fields are ``nan`` for a
    parameter without a gradient.  The values stay one ``[P, 5]`` tensor on
    the device until first read; reading them is one host read.
    """

    __slots__ = ("_rows", "_values", "names")

    def __init__(self, names: Sequence[str], values: Tensor | list[list[float]]) -> None:
        self.names = tuple(names)
        self._values: Tensor | None = values if isinstance(values, Tensor) else None
        self._rows: list[list[float]] | None = None if isinstance(values, Tensor) else values

    def rows(self) -> list[list[float]]:
        """One list of :data:`LAYER_FIELDS` values per parameter, in :attr:`names` order."""
        if self._rows is None:
            values = self._values
            self._rows = [] if values is None else values.tolist()
            self._values = None
        return self._rows

    def device_values(self) -> Tensor | None:
        """The ``[P, 5]`` tensor still on the device, or None once the rows are Python values."""
        return self._values

    def fill_rows(self, flat: Sequence[float]) -> None:
        """Take the values read elsewhere (:func:`~clipopt.materialize`, row-major) as the rows."""
        k = len(LAYER_FIELDS)
        self._rows = [list(flat[r * k : r * k + k]) for r in range(len(self.names))]
        self._values = None

    def as_dict(self) -> dict[str, dict[str, float]]:
        """``{name: {field: value}}`` as Python floats."""
        pairs = zip(self.names, self.rows(), strict=True)
        return {name: dict(zip(LAYER_FIELDS, row, strict=True)) for name, row in pairs}

    def __getitem__(self, name: str) -> dict[str, float]:
        return dict(zip(LAYER_FIELDS, self.rows()[self.names.index(name)], strict=True))

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"LayerStats({len(self.names)} parameters)"


#: On CPU, gradients of float32, bfloat16 or float16 with at least
#: ``BATCH_MAX_NUMEL`` elements are reduced in chunks of ``CHUNK_NUMEL``: ``|g|``
#: of one chunk is written to a reused float32 buffer (1 MiB) that stays in the
#: core's cache while its sum of squares and extremes are taken, so each gradient
#: crosses the memory bus once and no gradient-sized temporary is allocated.
#: Measured on the 24M-parameter model of benchmarks/diagnostics.py (2 threads,
#: 2 MiB of L2 per core), the gradients' pass: 64K 11.9 ms, 128K 8.8, 256K 7.2,
#: 512K 9.9, 1M 10.2 (1 thread: 17.3, 15.0, 14.4, 17.1, 19.0).
CHUNK_NUMEL = 1 << 18

#: Sums of squares are ``torch.dot`` over pieces of at most this many elements
#: (each chunk is cut separately; best a divisor of ``CHUNK_NUMEL``).  ``dot``
#: accumulates in order, so its relative error grows with the length (N(0,1)
#: float32 data: about 5e-7 at 256K elements, 3e-6 at 1M, 2e-4 at 16M;
#: bfloat16-valued data: 2e-5 at 1M); per-piece sums keep the 256K figure.
DOT_NUMEL = 1 << 18

#: Smaller CPU gradients go through a few ``torch._foreach_*`` calls together.
BATCH_MAX_NUMEL = 1 << 14

#: On CPU, parameters at least this large get their norm from ``torch.dot`` over
#: pieces (one pass; ``_foreach_norm`` is several times slower and loses ~1e-4
#: relative on millions of elements).
PARAM_DOT_MIN_NUMEL = BATCH_MAX_NUMEL

#: The pieces of a float32 parameter's ``torch.dot``: the parameter is read once
#: (no buffer), and on two threads a 256K piece took twice the time of a 1M one
#: (24M parameters: 4.7 ms, 2.4 ms); the relative error of the sum of squares was
#: 1e-7 and 3e-7 against float64.
PARAM_DOT_NUMEL = 1 << 20

#: Gradient dtypes of the chunked and batched CPU paths (reduced in float32).
_FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@torch.no_grad()
def compute_layer_stats(
    params: Sequence[Tensor],
    names: Sequence[str],
    scale: float,
    count_nonfinite: bool,
    grads: Sequence[Tensor | None] | None = None,
) -> LayerStats:
    """Statistics of ``scale * p.grad`` (the combined gradient) and of ``p`` for every parameter.

    ``count_nonfinite=False`` records 0 non-finite elements without counting
    them: callers pass True only when the window's norm was not finite (a finite
    norm means every element is finite).  ``grads`` replaces ``p.grad`` (local
    shards of DTensors).  Nothing is read on the host; the result is one
    ``[P, 5]`` float32 tensor on the first parameter's device.
    """
    if not params:
        return LayerStats([], [])
    return LayerStats(names, _layer_stats(params, scale, count_nonfinite, grads=grads))


def _layer_stats(
    params: Sequence[Tensor],
    scale: float,
    count_nonfinite: bool,
    cpu_kernels: bool = True,
    grads: Sequence[Tensor | None] | None = None,
) -> Tensor:
    """The ``[P, 5]`` statistics.

    Rows are computed by group (chunked and batched CPU gradients, the rest one
    by one, empty gradients, no gradient) into ``grouped``, then put back in
    parameter order by one ``index_select``.  ``cpu_kernels=False`` sends every
    gradient through the generic path used off CPU (for tests).
    """
    device = params[0].device
    kinds = _by_path(params, cpu_kernels, grads)
    chunked, batched, single = kinds.chunked, kinds.batched, kinds.single
    # Zero: the non-finite count unless counted, and every field of an empty gradient.
    grouped = torch.zeros((len(params), 5), dtype=torch.float32, device=device)
    if chunked:
        _chunked_rows([v for _, v in chunked], grouped[: len(chunked)], count_nonfinite)
    row = len(chunked)
    if batched:
        _batched_rows([v for _, v in batched], grouped[row : row + len(batched)], count_nonfinite)
    row += len(batched)
    if single:
        _single_rows([v for _, v in single], grouped[row : row + len(single)], count_nonfinite, cpu_kernels)
    row += len(single) + len(kinds.empty)
    if kinds.missing:
        grouped[row:, :3] = math.nan
    order = [i for i, _ in chunked] + [i for i, _ in batched] + [i for i, _ in single] + kinds.empty
    order += kinds.missing
    _param_norms([params[i] for i in order], grouped[:, 4], cpu_kernels)
    if scale != 1.0:
        grouped[:, :3] *= scale
    return _in_param_order(grouped, order, device)


class _Paths(NamedTuple):
    """The parameters sorted by the path that computes their rows (``(index, values)`` or indices)."""

    chunked: list[tuple[int, Tensor]]  # large CPU gradients, in chunks (last parameters first)
    batched: list[tuple[int, Tensor]]  # small CPU gradients, batched
    single: list[tuple[int, Tensor]]  # the rest (off CPU, other dtypes, no cpu_kernels), one by one
    empty: list[int]  # gradients without elements: rows of zeros
    missing: list[int]  # no gradient: nan gradient fields


def _by_path(params: Sequence[Tensor], cpu_kernels: bool, grads: Sequence[Tensor | None] | None) -> _Paths:
    """Sort the gradients (``p.grad``, or ``grads``) by the path that computes their rows."""
    paths = _Paths([], [], [], [], [])
    for i, p in enumerate(params):
        g = p.grad if grads is None else grads[i]
        if g is None:
            paths.missing.append(i)
            continue
        values = g.coalesce().values() if g.is_sparse else g  # N-d: flattened later, one at a time
        n = values.numel()
        if n == 0:
            paths.empty.append(i)
        elif not (cpu_kernels and values.device.type == "cpu" and values.dtype in _FAST_DTYPES):
            paths.single.append((i, values))
        elif n >= BATCH_MAX_NUMEL:
            paths.chunked.append((i, values))
        else:
            paths.batched.append((i, values))
    # The total norm has just read the gradients in parameter order: start with
    # the last ones, which may still be in the last-level cache.
    paths.chunked.reverse()
    return paths


def _in_param_order(grouped: Tensor, order: list[int], device: torch.device) -> Tensor:
    """``grouped`` (row ``k`` for parameter ``order[k]``) with its rows in parameter order."""
    if order == list(range(len(order))):
        return grouped
    where = [0] * len(order)
    for pos, i in enumerate(order):
        where[i] = pos
    return grouped.index_select(0, _index(tuple(where), device))


@functools.lru_cache(maxsize=64)
def _index(indices: tuple[int, ...], device: torch.device) -> Tensor:
    """An index tensor on ``device``, cached: creating one from a list is a host-to-device copy."""
    return torch.tensor(indices, device=device)


def _chunked_rows(grads: list[Tensor], out: Tensor, count_nonfinite: bool) -> None:
    """Columns 0-3 for large CPU gradients, chunk by chunk through a cache-sized float32 buffer.

    ``|g|`` is taken on the bits (the sign bit cleared by :data:`_MAGNITUDE_BITS`), and its
    extremes by one ``aminmax`` of those bits as int32: non-negative floats, infinity included,
    order as their bits do, and the integer reduction took 10 us on a 256K chunk in cache where
    float ``amin`` + ``amax`` took 24 (``aminmax`` 26).  A nan's bits are above infinity's: it
    is the maximum, as in float ``amax``; the minimum of a gradient with a nan is set to nan
    afterwards, as float ``amin`` gives.
    """
    counts = [-(-g.numel() // CHUNK_NUMEL) for g in grads]
    dot_counts = [_dot_pieces(g.numel()) for g in grads]
    # Per chunk, in column order: max |g|, min |g| (their bits), non-finite count.
    acc = torch.empty((3, sum(counts)), dtype=torch.float32, device="cpu")
    extremes = acc.view(torch.int32)
    highs, lows = extremes[0].unbind(), extremes[1].unbind()
    bad = acc[2].unbind() if count_nonfinite else ()
    squares = torch.empty(sum(dot_counts), dtype=torch.float32, device="cpu")
    square_slots = iter(squares.unbind())
    buf = _scratch_buffer()
    bits = buf.view(torch.int32)
    k = 0
    for g in grads:
        for piece in torch.split(_flat(g), CHUNK_NUMEL):
            n = piece.numel()
            b, b_bits = (buf, bits) if n == CHUNK_NUMEL else (buf[:n], bits[:n])
            if piece.dtype == torch.float32:
                torch.bitwise_and(piece.view(torch.int32), _MAGNITUDE_BITS, out=b_bits)
            else:
                b.copy_(piece)  # bfloat16/float16, reduced in float32
                b_bits.bitwise_and_(_MAGNITUDE_BITS)
            _dots(b, square_slots)
            torch.aminmax(b_bits, out=(lows[k], highs[k]))
            if count_nonfinite:
                # 0 * |g| is 0, or nan for inf and nan; float ops, ~10x faster than bool masks
                b.mul_(0.0).nan_to_num_(nan=1.0)
                torch.sum(b, 0, out=bad[k])
            k += 1
    out[:, 0] = _segment_sum(squares, dot_counts).sqrt_()
    if k == len(grads):  # one chunk each
        out[:, 1:3] = acc[:2].t()
    else:
        lengths = torch.tensor(counts, device="cpu")
        out[:, 1] = torch.segment_reduce(acc[0], "max", lengths=lengths, unsafe=True)
        out[:, 2] = torch.segment_reduce(acc[1], "min", lengths=lengths, unsafe=True)
    # a nan: both extremes are the nan float amin/amax give (the bits' maximum is any nan's payload)
    out[:, 1:3].masked_fill_(out[:, 1:2].isnan(), math.nan)
    if count_nonfinite:
        out[:, 3] = _segment_sum(acc[2].double(), counts)


#: ``0x7fffffff``: and-ed with a float32's bits, clears the sign bit (``|x|``; a nan stays a nan).
_MAGNITUDE_BITS = torch.tensor(0x7FFFFFFF, dtype=torch.int32, device="cpu")  # (whatever the default device)


def _dot_pieces(numel: int) -> int:
    """How many ``DOT_NUMEL`` pieces ``_dots`` makes of ``numel`` elements taken ``CHUNK_NUMEL`` at a time."""
    full, rest = divmod(numel, CHUNK_NUMEL)
    return full * -(-CHUNK_NUMEL // DOT_NUMEL) + -(-rest // DOT_NUMEL)


def _dots(v: Tensor, slots: Iterator[Tensor]) -> None:
    """Write ``piece . piece`` of each ``DOT_NUMEL`` piece of the 1-D ``v`` into the next slots."""
    for piece in torch.split(v, DOT_NUMEL):
        torch.dot(piece, piece, out=next(slots))


def _segment_sum(values: Tensor, counts: list[int]) -> Tensor:
    """Sums of consecutive runs of ``counts`` elements of ``values``."""
    if len(values) == len(counts):
        return values
    lengths = torch.tensor(counts, device=values.device)
    return torch.segment_reduce(values, "sum", lengths=lengths, unsafe=True)


_SCRATCH = threading.local()


def _scratch_buffer() -> Tensor:
    """This thread's float32 CPU buffer of ``CHUNK_NUMEL`` elements, kept between calls.

    Allocating it each call costs page faults; one buffer per thread keeps
    optimizers stepping in different threads apart.
    """
    buf: Tensor | None = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() != CHUNK_NUMEL or buf.is_inference():
        with torch.inference_mode(False):  # an inference tensor could not be written outside it
            buf = torch.empty(CHUNK_NUMEL, dtype=torch.float32, device="cpu")
        _SCRATCH.buf = buf
    return buf


def _batched_rows(grads: list[Tensor], out: Tensor, count_nonfinite: bool) -> None:
    """Columns 0-3 for small non-empty CPU gradients, a few ``_foreach`` calls per batch of them.

    Batches hold at most ``CHUNK_NUMEL`` elements: ``|g|`` is a temporary copy.
    """
    out[:, 0] = torch.stack(_l2_norms(grads))
    start = 0
    while start < len(grads):
        stop, total = start, 0
        while stop < len(grads) and (stop == start or total + grads[stop].numel() <= CHUNK_NUMEL):
            total += grads[stop].numel()
            stop += 1
        magnitudes = torch._foreach_abs(grads[start:stop])
        out[start:stop, 1] = torch.stack(torch._foreach_max(magnitudes))
        torch._foreach_neg_(magnitudes)
        out[start:stop, 2] = torch.stack(torch._foreach_max(magnitudes)).neg_()
        start = stop
    if count_nonfinite:
        out[:, 3] = torch.stack([g.isfinite().logical_not_().sum() for g in grads])


def _single_rows(grads: list[Tensor], out: Tensor, count_nonfinite: bool, cpu_kernels: bool) -> None:
    """Columns 0-3 one gradient at a time: any device, any dtype.

    Single-pass inf/-inf norms give the extremes; on CPU those kernels are slow,
    and ``aminmax(|g|)`` is used (float64/complex gradients come here).
    """
    device = out.device
    out[:, 0] = torch.stack([n.to(device) for n in _l2_norms(grads)])
    highs: list[Tensor] = []
    lows: list[Tensor] = []
    for g in grads:
        if cpu_kernels and g.device.type == "cpu":
            lo, hi = torch.aminmax(g.abs())
        else:
            hi = torch.linalg.vector_norm(g, math.inf)
            lo = torch.linalg.vector_norm(g, -math.inf)
        highs.append(hi.to(device=device, dtype=torch.float32))
        lows.append(lo.to(device=device, dtype=torch.float32))
    out[:, 1] = torch.stack(highs)
    out[:, 2] = torch.stack(lows)
    if count_nonfinite:
        out[:, 3] = torch.stack([g.isfinite().logical_not_().sum().to(device) for g in grads])


def _param_norms(params: list[Tensor], out: Tensor, cpu_kernels: bool) -> None:
    """``out[j] = ||params[j]||`` in float32.

    Large CPU parameters: ``torch.dot`` over pieces of ``DOT_NUMEL`` (copied
    to the float32 scratch buffer first for bfloat16/float16: ``dot``
    accumulates in the input dtype).  The rest together through ``_foreach_norm``.
    """
    direct: list[int] = []
    rest: list[int] = []
    for j, p in enumerate(params):
        fast = cpu_kernels and p.device.type == "cpu" and p.dtype in _FAST_DTYPES
        (direct if fast and p.numel() >= PARAM_DOT_MIN_NUMEL else rest).append(j)
    device = out.device
    if direct:
        sizes = [CHUNK_NUMEL if params[j].dtype != torch.float32 else PARAM_DOT_NUMEL for j in direct]
        counts = [-(-params[j].numel() // size) for j, size in zip(direct, sizes, strict=True)]
        squares = torch.empty(sum(counts), dtype=torch.float32, device="cpu")
        slots = iter(squares.unbind())
        buf = _scratch_buffer()
        for j, size in zip(direct, sizes, strict=True):  # flattened one at a time (a copy while in use)
            for piece in torch.split(_flat(params[j].detach()), size):
                if piece.dtype != torch.float32:  # half precision: dot accumulates in the input dtype
                    piece = buf[: piece.numel()].copy_(piece)
                torch.dot(piece, piece, out=next(slots))
        direct_norms = _segment_sum(squares, counts).sqrt_()
        out.index_copy_(0, _index(tuple(direct), device), direct_norms.to(device))
    if rest:
        norms = _l2_norms([params[j].detach() for j in rest])
        out.index_copy_(0, _index(tuple(rest), device), torch.stack([n.to(device) for n in norms]))


def _l2_norms(tensors: list[Tensor]) -> list[Tensor]:
    """Float32 2-norms through ``_foreach_norm``: half precision accumulated in float32,
    float64 (and complex) in their own precision, then rounded.

    CPU tensors whose memory is not dense (expanded: a zero stride; sliced with a step) are
    reduced from a contiguous copy (:func:`~clipopt._tensors.flat`): torch's CPU reduction of
    such a view adds the elements one after the other in float32 within each thread's share,
    an error that grows with the length and changes with the thread count (2.4e-4 relative for
    40,000 equal values on one thread), where the contiguous sum stays near 1e-6.
    """
    tensors = [_flat(t) if t.device.type == "cpu" and not t.is_contiguous() else t for t in tensors]
    narrow = [t.is_floating_point() and t.element_size() < 4 for t in tensors]
    low = [t for t, n in zip(tensors, narrow, strict=True) if n]
    wide = [t for t, n in zip(tensors, narrow, strict=True) if not n]
    low_norms = iter(torch._foreach_norm(low, 2.0, dtype=torch.float32) if low else [])
    wide_norms = iter(torch._foreach_norm(wide, 2.0) if wide else [])
    return [(next(low_norms) if n else next(wide_norms)).to(torch.float32) for n in narrow]


@torch.no_grad()
def sharded_layer_stats(
    params: Sequence[Tensor], names: Sequence[str], scale: float, count_nonfinite: bool
) -> LayerStats:
    """:func:`compute_layer_stats` of DTensor parameters: of the full tensors, on every rank.

    Each rank computes the statistics of its shards, then they are combined over
    the shard groups: squared norms and non-finite counts summed, max |g| and
    min |g| by MAX (of ``|g|`` and ``-|g|``).  Collective: every rank calls it.
    """
    local_params, local_grads, rows = local_shards(params)
    local = compute_layer_stats(local_params, names, scale, count_nonfinite, grads=local_grads)
    values = local.device_values()
    if values is None or not rows:
        return LayerStats(names, [] if values is None else values)
    for key, indices in rows.items():
        index = torch.tensor(indices, device=values.device)
        sub = values.index_select(0, index).double()
        full = combined_rows(sub, [local_grads[i] for i in indices], key)
        values.index_copy_(0, index, full.to(values.dtype))
    return LayerStats(names, values)


def resolve_param_names(optimizer: torch.optim.Optimizer, param_names: Any) -> dict[Tensor, str]:
    """Names for the optimizer's parameters.

    From ``param_names`` (``model.named_parameters()``, a ``{name: param}``
    mapping, or names in the optimizer's parameter order), else from the inner
    optimizer's own ``param_names`` (set when it was built from
    ``named_parameters()``), else ``group<g>.<i>``.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    names = _own_names(optimizer)
    if param_names is None:
        return _unique(names)
    if isinstance(param_names, Mapping):
        pairs: Iterable[Any] = param_names.items()
    elif isinstance(param_names, (str, bytes)) or not isinstance(param_names, Iterable):
        raise TypeError(_NAMES_HELP.format(got=f"{param_names!r:.60} ({type(param_names).__name__})"))
    else:
        pairs = list(param_names)
    items = list(pairs)
    if items and all(isinstance(x, str) for x in items):
        if len(items) != len(params):
            raise ValueError(
                f"param_names lists {len(items)} names but the optimizer has {len(params)} parameters; "
                "pass param_names=model.named_parameters() instead"
            )
        return _unique(dict(zip(params, items, strict=True)))
    known = {id(p) for p in params}
    matched = 0
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(_NAMES_HELP.format(got=f"an item {item!r:.60}"))
        name, p = item
        if id(p) in known:
            names[p] = name
            matched += 1
    if params and not matched:
        raise ValueError(
            f"param_names names {len(items)} parameters, none of which the optimizer holds "
            "(another model's parameters?); pass the named_parameters() of the model whose "
            "parameters the optimizer was built from"
        )
    return _unique(names)


def _own_names(optimizer: torch.optim.Optimizer) -> dict[Tensor, str]:
    """The inner optimizer's own names, else ``group<g>.<i>``.  Groups built from the
    ``named_parameters()`` of different modules may repeat a name (two ``weight``s): torch accepts
    that, so a repeated name is qualified with its group, ``group<g>.<name>``, not refused."""
    names: dict[Tensor, str] = {}
    groups: dict[Tensor, int] = {}
    for gi, group in enumerate(optimizer.param_groups):
        own = group.get("param_names")
        for i, p in enumerate(group["params"]):
            names[p] = own[i] if own is not None and i < len(own) else f"group{gi}.{i}"
            groups[p] = gi
    counts: dict[str, int] = {}
    for name in names.values():
        counts[name] = counts.get(name, 0) + 1
    return {p: f"group{groups[p]}.{n}" if counts[n] > 1 else n for p, n in names.items()}


def _unique(names: dict[Tensor, str]) -> dict[Tensor, str]:
    """``names``, refused when two parameters share a name (a snapshot would keep one of them)."""
    seen: dict[str, int] = {}
    for name in names.values():
        seen[name] = seen.get(name, 0) + 1
    repeated = sorted(n for n, count in seen.items() if count > 1)
    if repeated:
        shown = ", ".join(map(repr, repeated[:5]))
        raise ValueError(
            f"param_names gives {len(repeated)} name(s) to more than one parameter ({shown}); every "
            "parameter needs its own name (snapshots and CSV columns are keyed by it); "
            "pass param_names=model.named_parameters()"
        )
    return names


_NAMES_HELP = (
    "param_names must be model.named_parameters(), a {{name: parameter}} dict, "
    "or a list of names in the optimizer's parameter order, got {got}; "
    "pass param_names=model.named_parameters()"
)
