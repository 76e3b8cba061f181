"""Watching a forward and backward pass for the first operator that produces a non-finite value.

Used by :func:`clipopt.replay` only, and only while it runs:

- :class:`ModuleTracker` keeps the stack of the model's modules that are
  running (forward pre-hooks and forward hooks, removed afterwards) and a
  timeline of autograd sequence numbers, so that a backward node can be traced
  to the module whose forward created it.
- :class:`NonFiniteWatch` is a ``TorchDispatchMode``: it sees every ATen
  operator of the forward and of the backward (the autograd engine runs under
  the same mode) and records the first *origin*: an operator whose output holds
  a NaN or an infinity while none of its tensor inputs came out of an earlier
  non-finite operator.  Its non-finite inputs, if any, are then leaves (the
  attached data, a parameter).  An operator whose only non-finite input is a
  Python number (``masked_fill(mask, -inf)``, ``full(..., -inf)``) or a
  non-finite buffer of the model (a registered ``-inf`` mask, see
  :meth:`NonFiniteWatch.follow`) creates the value on purpose and is not an
  origin; its output is still followed.  An in-place or ``out=`` operator is
  judged by its inputs as they were before it ran; the uninitialized output of
  ``empty``/``empty_like`` (NaN under ``torch.use_deterministic_algorithms``) is
  not checked.

The backward attribution uses torch's autograd sequence numbers
(``torch._C._autograd._get_sequence_nr``, ``Node._sequence_nr``) and
``torch._C._current_autograd_node`` (torch 2.13); where they are missing the
backward's module is None, the operator is still named.

Every check reads one flag per floating output from the device (this is a
debugging tool, not a training path): the finiteness of the output's sum (finite
only when every element is), so one reduction per operator; views are not checked
(their input was).  After the origin is found the checks stop.
"""

from __future__ import annotations

import bisect
import math
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["ModuleTracker", "NonFiniteWatch", "OpEvent", "TensorStats", "all_finite", "tensor_stats"]

#: At most this many tensor inputs of an operator are described.
MAX_INPUTS = 4


@dataclass(frozen=True)
class TensorStats:
    """What a tensor held: shape, dtype, non-finite counts and the range of its finite values."""

    #: Shape of the tensor.
    shape: tuple[int, ...]
    #: Its dtype without the ``torch.`` prefix, e.g. ``"float16"``.
    dtype: str
    #: Number of NaN elements.
    nan: int
    #: Number of ``+inf`` elements.
    posinf: int
    #: Number of ``-inf`` elements.
    neginf: int
    #: Smallest finite element (nan when there is none).
    min: float
    #: Largest finite element (nan when there is none).
    max: float

    @property
    def nonfinite(self) -> int:
        """NaN and infinite elements together."""
        return self.nan + self.posinf + self.neginf

    def as_dict(self) -> dict[str, Any]:
        """Plain data (JSON after :func:`clipopt._report.text.json_safe`)."""
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "nan": self.nan,
            "posinf": self.posinf,
            "neginf": self.neginf,
            "min": self.min,
            "max": self.max,
        }


def tensor_stats(t: Tensor) -> TensorStats:
    """The :class:`TensorStats` of a floating (or complex: of its real view) tensor."""
    v = stored_values(t.detach())  # a sparse tensor: its stored values (the shape is the full one)
    if v.is_complex():
        v = torch.view_as_real(v)
    v = v.reshape(-1).to(torch.float64 if v.dtype == torch.float64 else torch.float32)
    finite = v[torch.isfinite(v)]
    counts = torch.stack([v.isnan().sum(), (v == math.inf).sum(), (v == -math.inf).sum()])
    nan, posinf, neginf = counts.tolist()
    lo, hi = (finite.min().item(), finite.max().item()) if finite.numel() else (math.nan, math.nan)
    dtype = str(t.dtype).removeprefix("torch.")
    return TensorStats(tuple(t.shape), dtype, int(nan), int(posinf), int(neginf), float(lo), float(hi))


@dataclass(frozen=True)
class OpEvent:
    """The operator that first produced a non-finite value."""

    #: The ATen operator, e.g. ``"aten.log.default"``.
    op: str
    #: ``"forward"`` or ``"backward"``.
    phase: str
    #: Qualified name of the model's module it ran in ("" is the model itself;
    #: None: outside the model's modules, e.g. in ``loss_fn``).
    module: str | None
    #: Class name of that module (None with ``module``).
    module_type: str | None
    #: In the backward, the autograd node that ran it (e.g. ``"SqrtBackward0"``).
    node: str | None
    #: Whether every tensor input was finite (False: a non-finite leaf came in).
    inputs_finite: bool
    #: The first :data:`MAX_INPUTS` floating tensor inputs.
    inputs: tuple[TensorStats, ...]
    #: The first non-finite output.
    output: TensorStats
    #: For a float16/bfloat16 output: whether the same operator on float32 copies of
    #: its inputs is finite (True: the value overflowed the dtype's range); else None.
    finite_in_float32: bool | None = None


class ModuleTracker:
    """The stack of running modules of one model, and which module each autograd node came from."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._types = {name: type(m).__name__ for name, m in model.named_modules()}
        self._stack: list[str] = []
        self._starts: list[int] = []  # autograd sequence numbers where the innermost module changed
        self._owners: list[str | None] = []  # ... and the module from there on

    def current(self) -> str | None:
        """Qualified name of the innermost running module, or None outside the model."""
        return self._stack[-1] if self._stack else None

    def type_of(self, name: str | None) -> str | None:
        """Class name of the module ``name``."""
        return None if name is None else self._types.get(name)

    def module_of(self, node: Any) -> str | None:
        """The module whose forward created the autograd ``node`` (None if unknown)."""
        seq = _node_sequence_nr(node)
        if seq is None or not self._starts:
            return None
        i = bisect.bisect_right(self._starts, seq) - 1
        return self._owners[i] if i >= 0 else None

    @contextmanager
    def hooks(self) -> Iterator[ModuleTracker]:
        """Install the forward hooks on every module of the model; remove them on exit."""
        handles = []
        try:
            for name, module in self._model.named_modules():
                handles.append(module.register_forward_pre_hook(self._enter(name)))
                handles.append(module.register_forward_hook(self._leave, always_call=True))
            yield self
        finally:
            for handle in handles:
                handle.remove()
            self._stack.clear()

    def _enter(self, name: str) -> Any:
        def pre_hook(module: nn.Module, args: Any) -> None:
            self._stack.append(name)
            self._mark()

        return pre_hook

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack.pop()
        self._mark()

    def _mark(self) -> None:
        seq = _next_sequence_nr()
        if seq is None:
            return
        if self._starts and self._starts[-1] == seq:  # no node was created in between
            self._owners[-1] = self.current()
        else:
            self._starts.append(seq)
            self._owners.append(self.current())


class NonFiniteWatch(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the first origin of a non-finite value (see the module docstring).

    Set :attr:`phase` to ``"forward"`` or ``"backward"`` around each pass.
    """

    def __init__(self, tracker: ModuleTracker) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.tracker = tracker
        self.phase = "forward"
        #: The first origin, once found.
        self.origin: OpEvent | None = None
        #: The first operator inside the model with a non-finite output (where data NaNs are first seen).
        self.first_in_model: OpEvent | None = None
        #: The first operator with a non-finite output of any kind (the fallback when no origin is
        #: found: a value made non-finite on purpose, e.g. a ``-inf`` mask, that later went NaN).
        self.first_any: OpEvent | None = None
        self._tainted: dict[int, weakref.ref[Tensor]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.origin is not None and (self.first_in_model is not None or self.phase == "backward"):
            return func(*args, **kwargs)  # found (first_in_model is a forward operator)
        before = _inputs_before(func, args, kwargs)  # in-place and out= operators overwrite their inputs
        out = func(*args, **kwargs)
        if getattr(func, "_opname", None) in _UNINITIALIZED:  # garbage (NaN under deterministic mode)
            return out
        tainted = any(self._is_tainted(t) for t in _floats((args, kwargs)))
        if getattr(func, "is_view", False):  # shares its input's memory: checked there; taint follows
            if tainted:
                for t in _floats(out):
                    self._taint(t)
            return out
        bad = [t for t in _floats(out) if not all_finite(t)]
        if not bad:
            return out
        args, kwargs = before
        inputs = _floats((args, kwargs))
        for t in bad:
            self._taint(t)
        inputs_finite = all(all_finite(t) for t in inputs)
        constant = inputs_finite and any(_nonfinite_number(v) for v in tree_leaves((args, kwargs)))
        if self.first_any is None:
            self.first_any = self._event(func, args, kwargs, inputs, bad[0], inputs_finite)
        if self.origin is None and not tainted and not constant:
            self.origin = self._event(func, args, kwargs, inputs, bad[0], inputs_finite)
        if self.first_in_model is None and self.phase == "forward" and self.tracker.current() is not None:
            self.first_in_model = self._event(func, args, kwargs, inputs, bad[0], inputs_finite)
        return out

    def _event(
        self, func: Any, args: Any, kwargs: Any, inputs: list[Tensor], output: Tensor, inputs_finite: bool
    ) -> OpEvent:
        node = _current_node() if self.phase == "backward" else None
        module = self.tracker.current() if node is None else self.tracker.module_of(node)
        return OpEvent(
            op=str(func),
            phase=self.phase,
            module=module,
            module_type=self.tracker.type_of(module),
            node=None if node is None else str(node.name()),
            inputs_finite=inputs_finite,
            inputs=tuple(tensor_stats(t) for t in inputs[:MAX_INPUTS]),
            output=tensor_stats(output),
            finite_in_float32=_finite_in_float32(func, args, kwargs) if output.dtype in _HALF else None,
        )

    def follow(self, t: Tensor) -> None:
        """Treat ``t``'s non-finite values as made on purpose (a ``-inf`` mask buffer): operators that
        consume it are followed, not origins."""
        self._taint(t)

    def _is_tainted(self, t: Tensor) -> bool:
        ref = self._tainted.get(id(t))
        return ref is not None and ref() is t

    def _taint(self, t: Tensor) -> None:
        self._tainted[id(t)] = weakref.ref(t)


#: Dtypes whose overflow :func:`_finite_in_float32` checks.
_HALF = (torch.float16, torch.bfloat16)

#: Operators whose output is uninitialized memory (filled with NaN under
#: ``torch.use_deterministic_algorithms(True)``): not checked, an in-place operator fills it.
_UNINITIALIZED = frozenset(
    ("empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "empty_permuted")
)


def _inputs_before(func: Any, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """``func``'s inputs as they are before it runs: copies of the tensors it writes in place
    (``self`` of ``log_``), and without its ``out=`` tensors (their old contents are no input)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return args, kwargs
    args, kwargs = list(args), dict(kwargs)
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        if arg.kwarg_only:
            kwargs.pop(arg.name, None)
        elif i < len(args):
            args[i] = tree_map(lambda v: v.clone() if isinstance(v, Tensor) else v, args[i])
    return tuple(args), kwargs


def _finite_in_float32(func: Any, args: Any, kwargs: Any) -> bool | None:
    """Whether ``func`` on float32 copies of its half-precision inputs (and float32 for a
    half-precision ``dtype`` argument) is finite; None when the operator refuses them."""

    def widen(v: Any) -> Any:
        if isinstance(v, Tensor) and v.dtype in _HALF:
            return v.float()
        return torch.float32 if v in _HALF else v

    try:
        out = func(*tree_map(widen, args), **tree_map(widen, kwargs))
    except (RuntimeError, TypeError, ValueError):
        return None
    return all(all_finite(t) for t in _floats(out))


def _floats(tree: Any) -> list[Tensor]:
    return [
        t
        for t in tree_leaves(tree)
        if isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex()) and t.numel()
    ]


def all_finite(t: Tensor) -> bool:
    """Whether every element is finite: a sum is finite only then (one reduction, no mask); a
    non-finite sum of finite elements (an overflow of the sum itself) is told apart by the full check."""
    t = stored_values(t)
    return bool(t.sum().isfinite()) or bool(torch.isfinite(t).all())


def stored_values(t: Tensor) -> Tensor:
    """The values a sparse tensor stores (``nn.Embedding(sparse=True)``'s gradient), else ``t``."""
    if t.layout == torch.sparse_coo:
        return t.coalesce().values()
    if t.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        return t.values()
    return t


def _nonfinite_number(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _current_node() -> Any:
    """The autograd node running now (in the backward), or None."""
    get = getattr(torch._C, "_current_autograd_node", None)
    return None if get is None else get()


def _next_sequence_nr() -> int | None:
    """The sequence number the next autograd node of this thread will get (None if torch lacks it)."""
    get = getattr(torch._C._autograd, "_get_sequence_nr", None)
    return None if get is None else int(get())


def _node_sequence_nr(node: Any) -> int | None:
    get = getattr(node, "_sequence_nr", None)
    if get is None:
        return None
    seq = int(get())
    return None if seq >= 2**63 else seq  # AccumulateGrad has no sequence number (UINT64_MAX)
