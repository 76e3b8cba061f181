"""Copies of the training state in host memory, for :class:`~clipopt.Rewind`.

A :class:`HostCopy` holds the parameters, the inner optimizer's per-parameter
state, the buffers of a module and a small dict of wrapper state (policy and
guard), all as CPU tensors.  Taking one from an accelerator enqueues
``non_blocking`` copies into pinned memory and records an event: the host does
not wait and the device is not stalled (later kernels on the same stream run
after the copies, so the values are those of the moment of the capture).  A
new copy reuses the host buffers of the one it replaces when the shapes match.
:func:`host_tensors` copies some tensors the same way ahead of a copy (a
module's buffers at a window's close, before the next forward pass changes
them); :func:`capture` then holds those instead of the live ones.
Restoring is exact, bit for bit: parameters and buffers are written in place
(their identity is kept), and so is every optimizer state tensor whose shape
and dtype still match, on its live device (no new device memory at a rewind;
a copy loaded from a checkpoint of another device goes where the state is
now); the others get new tensors of the captured dtypes on the captured
devices (those of the parameters, for a loaded copy).
DTensors (FSDP2, tensor parallel) are copied as their local shards, spec
kind ``"s"``, and written back into them (:mod:`clipopt._recovery.shard_copy`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.optim import Optimizer

from .shard_copy import (
    coordinates,
    coordinates_problem,
    is_shard,
    local,
    locals_of,
    shard_like,
    shard_problem,
)

__all__ = [
    "HostCopy",
    "HostTensors",
    "TrainingState",
    "capture",
    "copy_extra",
    "copy_problem",
    "host_tensors",
    "plain",
    "restore",
]


@dataclasses.dataclass
class TrainingState:
    """What a copy is taken of (live objects, not copied)."""

    params: list[Tensor]  #: the optimizer's parameters, in group order
    buffers: list[Tensor]  #: the module's buffers (empty without a module)
    optimizer: Optimizer  #: the inner optimizer, whose ``state`` is copied per parameter


class _Landing:
    """Host tensors filled by non-blocking copies; ``event`` is recorded after them (None: landed)."""

    leaves: list[Tensor]
    event: Any

    @property
    def nbytes(self) -> int:
        """Host memory held by the tensors."""
        return sum(t.numel() * t.element_size() for t in self.leaves)

    def wait(self) -> None:
        """Block until the copies have landed in host memory (a no-op on CPU)."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None

    def order_before_later_work(self) -> None:
        """Work enqueued later on the current stream runs after the copies (the host does not wait)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


@dataclasses.dataclass
class HostCopy(_Landing):
    """One copy of the training state in host memory."""

    step: int  #: windows closed when the copy was taken
    applied: int  #: updates applied when the copy was taken
    spec: Any  #: the nested structure of the state, tensors replaced by ``("t", index)``
    leaves: list[Tensor]  #: the host tensors (pinned when copied from an accelerator)
    devices: list[torch.device]  #: where each leaf came from
    event: Any = None  #: a CUDA event recorded after the copies, or None (CPU: already done)


@dataclasses.dataclass
class HostTensors(_Landing):
    """Tensors copied to host memory at one moment: a module's buffers at a window's close, which
    the copy taken at the next check (after the next forward pass) holds instead of the live ones."""

    step: int  #: windows closed when they were copied
    leaves: list[Tensor]  #: the host tensors (pinned when copied from an accelerator)
    event: Any = None  #: a CUDA event recorded after the copies, or None (CPU: already done)

    def fits(self, live: Sequence[Tensor]) -> bool:
        """Whether they can stand in for ``live`` (same count, shapes and dtypes)."""
        shards = locals_of(live)
        return len(shards) == len(self.leaves) and all(
            (t.shape, t.dtype) == (h.shape, h.dtype) for t, h in zip(shards, self.leaves, strict=True)
        )


class _Leaf(NamedTuple):
    """Where a restored structure holds the copy's tensor number ``number`` (before it is placed)."""

    number: int


class _Shard(NamedTuple):
    """Where a restored structure holds the copy's local shard number ``number`` of a DTensor."""

    number: int


def _place(obj: Any, put: Callable[[Any, Any], Any], live: Any = None) -> Any:
    """``obj`` with each :class:`_Leaf` or :class:`_Shard` replaced by ``put(leaf, live value there)``."""
    if isinstance(obj, (_Leaf, _Shard)):
        return put(obj, live)
    if isinstance(obj, dict):
        return {k: _place(v, put, live.get(k) if isinstance(live, dict) else None) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_place(v, put) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_place(v, put) for v in obj)
    return obj


def _flatten(obj: Any, out: list[Tensor]) -> Any:
    """``obj`` with every tensor replaced by ``("t", i)`` (a DTensor: ``("s", i)``, its local shard
    appended), the tensors appended to ``out``."""
    if is_shard(obj):
        out.append(local(obj))
        return ("s", len(out) - 1)
    if isinstance(obj, Tensor):
        out.append(obj)
        return ("t", len(out) - 1)
    if isinstance(obj, dict):
        return ("d", [(k, _flatten(v, out)) for k, v in obj.items()])
    if isinstance(obj, list):
        return ("l", [_flatten(v, out) for v in obj])
    if isinstance(obj, tuple):
        return ("u", [_flatten(v, out) for v in obj])
    return ("v", copy.deepcopy(obj))


def _unflatten(spec: Any, leaf: Any, shard: Any = None) -> Any:
    """The structure of ``spec``: ``leaf(i)`` at its tensors, ``shard(i)`` (or ``leaf``) at its shards."""
    kind, body = spec
    if kind == "t":
        return leaf(body)
    if kind == "s":
        return (shard or leaf)(body)
    if kind == "d":
        return {k: _unflatten(v, leaf, shard) for k, v in body}
    if kind == "l":
        return [_unflatten(v, leaf, shard) for v in body]
    if kind == "u":
        return tuple(_unflatten(v, leaf, shard) for v in body)
    return copy.deepcopy(body)


_KINDS = ("t", "s", "d", "l", "u", "v")
_PARTS = {"params", "buffers", "state", "extra"}  #: what a copy's structure holds (and "shards" for DTensors)


def _spec_problem(spec: Any, n: int) -> str | None:
    """Why ``spec`` is not a structure :func:`_flatten` makes over ``n`` leaves, or None."""
    if not (isinstance(spec, tuple) and len(spec) == 2 and spec[0] in _KINDS):
        return "a node of its 'spec' is not a (kind, body) pair"
    kind, body = spec
    if kind in ("t", "s"):
        ok = isinstance(body, int) and not isinstance(body, bool) and 0 <= body < n
        return None if ok else f"its 'spec' refers to leaf {body!r}, not one of its {n} leaves"
    if kind == "v":
        return None
    if not isinstance(body, list):
        return f"a {kind!r} node of its 'spec' does not hold a list"
    if kind == "d" and not all(isinstance(e, (tuple, list)) and len(e) == 2 for e in body):
        return "a dict node of its 'spec' does not hold (key, value) pairs"
    for child in [e[1] for e in body] if kind == "d" else body:
        why = _spec_problem(child, n)
        if why is not None:
            return why
    return None


def _leaf_list(node: Any) -> list[int] | None:
    """The leaf numbers of a ``("l", [("t" or "s", i), ...])`` node, or None for any other node."""
    if node[0] != "l" or not all(child[0] in ("t", "s") for child in node[1]):
        return None
    return [child[1] for child in node[1]]


def copy_problem(spec: Any, leaves: Sequence[Tensor], target: TrainingState | None) -> str | None:
    """Why a loaded copy (``spec`` and ``leaves``) cannot be restored into ``target``, or None.

    Checks the whole structure (every leaf reference in range) and, with a
    ``target``, that its parameters and buffers have the target's count, shapes
    and dtypes and that its state belongs to parameters the target has.
    """
    try:
        why = _spec_problem(spec, len(leaves))
    except RecursionError:
        why = "its 'spec' is nested too deeply"
    if why is not None:
        return why
    body = dict(spec[1]) if spec[0] == "d" else {}
    if not _PARTS <= set(body) <= {*_PARTS, "shards"}:
        return "its 'spec' must hold params, buffers, state and extra"
    params, buffers, state = _leaf_list(body["params"]), _leaf_list(body["buffers"]), body["state"]
    entries = state[1] if state[0] == "l" else None
    if params is None or buffers is None or entries is None:
        return "its 'spec' holds params, buffers or state of another structure than Rewind's"
    numbers = [e[1][0][1] if e[0] == "u" and len(e[1]) == 2 and e[1][0][0] == "v" else None for e in entries]
    if target is None:
        return None
    why = _sharding_problem(body, target)
    if why is not None:
        return why
    for name, live, saved in (("parameters", target.params, params), ("buffers", target.buffers, buffers)):
        if len(live) != len(saved) or any(
            t.shape != leaves[i].shape or t.dtype != leaves[i].dtype
            for t, i in zip(locals_of(live), saved, strict=True)
        ):
            return f"its copies hold {name} of other shapes or dtypes than this optimizer's"
    if any(type(i) is not int or not 0 <= i < len(params) for i in numbers) or len(set(numbers)) != len(
        numbers
    ):
        return "its copies hold optimizer state of parameters this optimizer does not have"
    return None


def _sharding_problem(body: dict[str, Any], target: TrainingState) -> str | None:
    """Why a copy (its structure's parts ``body``) holds other shards than ``target``'s parameters, or
    None: the mesh coordinates it recorded, and which parameters it holds as shards."""
    shards = _unflatten(body["shards"], lambda _: None) if "shards" in body else None
    why = coordinates_problem(shards, coordinates(target.params))
    kinds = [c[0] for c in body["params"][1]]
    whole_or_shard = ["s" if is_shard(p) else "t" for p in target.params]
    if why is None and len(kinds) == len(whole_or_shard) and kinds != whole_or_shard:  # (count: shapes check)
        why = "its copies hold whole tensors and DTensor shards at other places than these parameters"
    return why


def copy_extra(spec: Any, leaves: Sequence[Tensor]) -> Any:
    """The ``extra`` (wrapper state) of a copy whose structure :func:`copy_problem` accepted,
    over its own ``leaves`` (not cloned: for checking it)."""
    return _unflatten(dict(spec[1])["extra"], lambda number: leaves[number])


def _host_buffer(src: Tensor, old: Tensor | None) -> Tensor:
    """A host tensor for ``src``: ``old`` when it fits, else a new one (pinned for accelerator sources)."""
    if old is not None and old.shape == src.shape and old.dtype == src.dtype:
        return old
    pin = src.device.type == "cuda"
    return torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)


def plain(t: Tensor) -> bool:
    """Whether a copy can hold ``t``: a dense tensor (not sparse, not another subclass), or a DTensor
    whose local shard is one."""
    t = local(t)
    return not t.is_sparse and t.layout == torch.strided and type(t) in (Tensor, torch.nn.Parameter)


def _check_plain(tensors: Sequence[Tensor]) -> None:
    for t in tensors:
        if not plain(t):
            raise TypeError(
                f"Rewind copies dense tensors only, got a {type(t).__name__} with layout {t.layout}; "
                "a Rewind cannot hold sparse or other tensor-subclass state: leave it out for them"
            )


def _to_host(
    tensors: Sequence[Tensor], old: Sequence[Tensor], held: dict[int, Tensor] | None = None
) -> tuple[list[Tensor], Any]:
    """Host copies of ``tensors`` (into ``old``'s tensors where they fit), enqueued without waiting,
    and the CUDA event recorded after them (None on CPU).  ``held``: positions already copied."""
    held = held or {}
    leaves = []
    with torch.no_grad():
        for i, src in enumerate(tensors):
            if i in held:
                leaves.append(held[i])
                continue
            dst = _host_buffer(src, old[i] if i < len(old) else None)
            dst.copy_(src.detach(), non_blocking=src.device.type == "cuda")
            leaves.append(dst)
    event = None
    if any(t.device.type == "cuda" for t in tensors):
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
    return leaves, event


def host_tensors(tensors: Sequence[Tensor], step: int, reuse: HostTensors | None = None) -> HostTensors:
    """Host copies of ``tensors`` (:func:`plain` ones) as they are now (window ``step``), without
    waiting for them.

    ``reuse``: earlier ones whose host tensors may be overwritten (copies on the same stream land in order).
    """
    shards = locals_of(tensors)
    _check_plain(shards)
    return HostTensors(step, *_to_host(shards, [] if reuse is None else reuse.leaves))


def capture(
    source: TrainingState,
    extra: Any,
    step: int,
    applied: int,
    reuse: HostCopy | None = None,
    buffers: HostTensors | None = None,
) -> HostCopy:
    """A copy of ``source`` and of ``extra`` (nested dicts/lists of tensors and numbers).

    ``reuse``: a copy whose host buffers may be overwritten (it is waited for first).
    ``buffers``: host copies of ``source.buffers`` taken earlier (:func:`host_tensors`), which the
    copy holds instead of the live buffers when they fit (no wait: later copies are ordered after them).
    """
    state = source.optimizer.state
    per_param = [(i, state[p]) for i, p in enumerate(source.params) if p in state]
    tensors: list[Tensor] = []
    tree = {"params": source.params, "buffers": source.buffers, "state": per_param, "extra": extra}
    shards = coordinates(source.params)
    if shards is not None:  # DTensor parameters: where this rank's shards lie
        tree["shards"] = shards
    spec = _flatten(tree, tensors)
    _check_plain(tensors)
    held: dict[int, Tensor] = {}
    if buffers is not None and buffers.fits(source.buffers):
        buffers.order_before_later_work()
        held = dict(enumerate(buffers.leaves, start=len(source.params)))
    old: list[Tensor] = []
    if reuse is not None:
        reuse.wait()
        old = reuse.leaves
    leaves, event = _to_host(tensors, old, held)
    return HostCopy(step, applied, spec, leaves, [t.device for t in tensors], event)


def restore(copy_: HostCopy, target: TrainingState) -> Any:
    """Put ``copy_`` back into ``target`` bit for bit; returns the copy's ``extra`` (CPU tensors, cloned).

    The parameters' gradients are cleared.  Raises ``ValueError`` (touching
    nothing) when the parameters or buffers no longer match the copy.
    DTensors get their local shards back, in place.
    """
    copy_.wait()
    leaves = copy_.leaves
    tree = _unflatten(copy_.spec, _Leaf, _Shard)
    params, buffers = tree["params"], tree["buffers"]
    _check_restorable(tree, target, leaves)
    with torch.no_grad():
        for t, s in zip(target.params, params, strict=True):
            local(t).copy_(leaves[s.number])
            t.grad = None
        for t, s in zip(target.buffers, buffers, strict=True):
            local(t).copy_(leaves[s.number])
        state = target.optimizer.state
        # a state tensor of the same shape, dtype and device is written in place (tensors inside
        # lists, LBFGS's history, always get new ones: such lists may share them with other copies)
        per_param = [
            (i, _place(entry, _putter(copy_, target.params[i]), state.get(target.params[i])))
            for i, entry in tree["state"]
        ]
        state.clear()
        for i, entry in per_param:
            state[target.params[i]] = entry
    return _place(tree["extra"], lambda leaf, _: leaves[leaf.number].clone())


def _putter(copy_: HostCopy, like: Tensor) -> Callable[[Any, Any], Any]:
    """How the state of parameter ``like`` gets a copied leaf back: into the live tensor when shape
    and dtype fit (no new device memory), else into a new one (a DTensor's shard: as ``like``'s)."""

    def put(leaf: Any, live: Any) -> Any:
        src, device = copy_.leaves[leaf.number], copy_.devices[leaf.number]
        if isinstance(leaf, _Shard):
            return shard_like(src, live, like)
        if type(live) is Tensor and (live.shape, live.dtype) == (src.shape, src.dtype):
            return live.copy_(src)  # where the live state is (a copy loaded from another device)
        return src.to(device, copy=True)

    return put


def _state_leaf_problem(leaf: Any, src: Tensor, live: Any, like: Tensor) -> str | None:
    """Why the copied state tensor ``src`` (at ``leaf``) of parameter ``like`` cannot replace ``live``."""
    if isinstance(leaf, _Shard):
        return shard_problem(src, live, like)
    if is_shard(live):
        return "a copied optimizer-state tensor is whole where the live state is a DTensor"
    return None


def _check_restorable(tree: Any, target: TrainingState, leaves: list[Tensor]) -> None:
    """``ValueError`` unless the copy's structure ``tree`` (over ``leaves``) can go back into ``target``."""
    params, buffers = tree["params"], tree["buffers"]
    for name, live, saved in (("parameters", target.params, params), ("buffers", target.buffers, buffers)):
        if len(live) != len(saved) or any(
            t.shape != leaves[s.number].shape or t.dtype != leaves[s.number].dtype
            for t, s in zip(locals_of(live), saved, strict=True)
        ):
            raise ValueError(
                f"a Rewind cannot restore its copy: the {name} changed since the copy was taken (count, "
                "shape or dtype); a Rewind needs the same model and parameter groups throughout training"
            )
    problems: list[str] = []
    state = target.optimizer.state
    for i, entry in tree["state"]:
        like = target.params[i]

        def check(leaf: Any, live: Any, like: Tensor = like) -> None:
            why = _state_leaf_problem(leaf, leaves[leaf.number], live, like)
            if why is not None:
                problems.append(why)

        _place(entry, check, state.get(like))
    if problems:
        raise ValueError(
            f"a Rewind cannot restore its copy: {problems[0]}; a Rewind needs the same model, sharding "
            "and optimizer throughout training"
        )
