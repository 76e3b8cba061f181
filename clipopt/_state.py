"""Wrapper state: the counters a checkpoint must hold, and state-dict validation."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from numbers import Real
from typing import Any, Literal, cast

import torch
from torch import Tensor
from torch.compiler import is_compiling
from torch.optim import Optimizer

from ._errors import NonFiniteGradientError

__all__ = [
    "FORMAT_VERSION",
    "STATE_DICT_MESSAGE",
    "StateDictError",
    "bad",
    "check_scaler_entry",
    "check_scaler_matches",
    "WrapperState",
    "check_loaded_state",
    "held_state",
    "has_own_layout",
    "int_field",
    "keep_group_keys",
    "own_group_keys",
    "read_wrapper_state",
    "restore_on_failure",
    "validate_inner_state",
]

#: Version of the ``"clipopt"`` entry of a state dict.
FORMAT_VERSION = 1

#: Whose state layout an optimizer keeps (:func:`_layout`).
Layout = Literal["torch", "derived", "own"]

#: Inner-state entries that torch.optim keeps with the parameter's shape (other optimizers may use
#: these names for state of another shape: the rule is torch's own optimizers').
_PARAM_SHAPED = frozenset(
    {
        "exp_avg",
        "exp_avg_sq",
        "max_exp_avg_sq",
        "momentum_buffer",
        "sum",
        "square_avg",
        "acc_delta",
        "grad_avg",
        "prev",
        "step_size",
        "ax",
        "mu_product_buffer",
    }
)


class WrapperState:
    """Counters of a :class:`~clipopt.ClippedOptimizer`, all part of its state dict.

    ``skipped`` and ``consecutive`` become 0-d int64 device tensors once a skip
    is decided on the device (fused path); they are updated in place there and
    become ints in :meth:`to_dict`.  A window whose only skip signal is its
    non-finite flag (the plain window) leaves that flag here, uncounted, and
    up to :data:`PENDING_LIMIT` of them are counted at once when a counter is
    read: no kernel per window for the counters.
    """

    __slots__ = ("_consecutive", "_pending", "_skipped", "micro_batches", "windows")

    def __init__(
        self,
        micro_batches: int = 0,
        windows: int = 0,
        skipped: int | Tensor = 0,
        consecutive: int | Tensor = 0,
    ) -> None:
        #: Micro-batches accumulated in the open window (0 when none is open).
        self.micro_batches = micro_batches
        #: Windows closed so far, applied or skipped: the ``step`` of the latest ``StepStats``.
        self.windows = windows
        self._skipped = skipped
        self._consecutive = consecutive
        #: The 0/1 device skip flags of the latest windows, not yet in ``skipped``/``consecutive``.
        self._pending: list[Tensor] = []

    @property
    def skipped(self) -> int | Tensor:
        """Windows skipped, whatever the reason (docs/design.md, 'Reasons')."""
        if self._pending:
            self._count_pending()
        return self._skipped

    @property
    def consecutive(self) -> int | Tensor:
        """Skipped windows in a row, ending at the latest one."""
        if self._pending:
            self._count_pending()
        return self._consecutive

    @property
    def applied(self) -> int | Tensor:
        """Updates that reached the inner optimizer: ``windows - skipped``."""
        return self.windows - self.skipped

    def copy(self) -> WrapperState:
        """A copy to put back when a window's close fails (before it counts: the device counters are
        the same tensors, which counting updates in place)."""
        new = WrapperState(self.micro_batches, self.windows, self._skipped, self._consecutive)
        new._pending = list(self._pending)
        return new

    def __getstate__(self) -> dict[str, Any]:
        return {
            "micro_batches": self.micro_batches,
            "windows": self.windows,
            "skipped": self.skipped,
            "consecutive": self.consecutive,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def record(self, skipped: bool | Tensor, nonfinite: bool | Tensor) -> None:
        """Count the outcome of the latest window (``windows`` already counts it).

        ``skipped`` is True/1.0 when it was skipped; ``nonfinite`` when it was skipped
        for non-finite gradients (a spike skip does not extend ``consecutive``).  One device flag
        for both (the plain window's non-finite flag, exactly 0.0 or 1.0) waits in the pending list.
        """
        if isinstance(skipped, Tensor) and nonfinite is skipped and not is_compiling():  # (kept eager)
            pending = self._pending
            if pending and pending[0].device != skipped.device:
                self._count_pending()
            pending.append(skipped)
            if len(pending) >= PENDING_LIMIT:
                self._count_pending()
            return
        if self._pending:
            self._count_pending()
        if isinstance(skipped, Tensor) or isinstance(nonfinite, Tensor):  # in place, on the device
            like = cast(Tensor, skipped if isinstance(skipped, Tensor) else nonfinite)
            one = torch.as_tensor(skipped, device=like.device).to(torch.int64)
            bad = torch.as_tensor(nonfinite, device=like.device).to(torch.int64)
            self._add(one, bad, like)
        else:
            self._skipped = self._skipped + int(skipped)
            self._consecutive = self._consecutive + 1 if nonfinite else 0

    def _add(self, one: Tensor, bad: Tensor, like: Tensor) -> None:
        """Count one window on the device: ``one`` skipped, ``bad`` non-finite (int64, 0 or 1)."""
        self._skipped = _on_device(self._skipped, like).add_(one)
        run = _on_device(self._consecutive, like)  # (run + bad) * bad, in one kernel: bad is 0 or 1
        self._consecutive = torch.addcmul(bad, run, bad, out=run)

    def _count_pending(self) -> None:
        """Count the pending flags (each both the skip and the non-finite flag of its window), on the
        device: ``skipped`` grows by their sum; ``consecutive`` is the run of ones they end with,
        plus the run before them when they are all ones."""
        flags, self._pending = self._pending, []
        like = flags[0]
        if len(flags) == 1:  # one window: as record() counts it at once
            one = like.to(torch.int64)
            self._add(one, one, like)
            return
        f = torch.stack(flags).to(torch.int64)
        self._skipped = _on_device(self._skipped, like) + f.sum()
        tail = f.flip(0).cumprod(0).sum()  # the ones at the end, up to the latest 0
        whole = tail == len(flags)  # all ones: the run before them goes on
        self._consecutive = torch.addcmul(tail, _on_device(self._consecutive, like), whole)

    def check_consecutive(self, limit: int, snapshot: str | None) -> None:
        """Raise :class:`NonFiniteGradientError` once ``limit`` windows in a row were skipped as
        non-finite (one host read of ``consecutive``); ``snapshot``: the latest anomaly snapshot."""
        count = int(self.consecutive)
        if count >= limit:
            raise NonFiniteGradientError(count, self.windows, snapshot)

    def to_dict(self, *, pending_grads: list[Tensor | None] | None, scaler: Any) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "micro_batches": self.micro_batches,
            "windows": self.windows,
            "applied": int(self.applied),
            "skipped": int(self.skipped),
            "consecutive": int(self.consecutive),
            "pending_grads": pending_grads,
            "scaler": scaler,
        }


#: At most this many windows' skip flags wait uncounted in a :class:`WrapperState` (their kernels
#: then run once for all of them).
PENDING_LIMIT = 64


def _on_device(count: int | Tensor, like: Tensor) -> Tensor:
    """``count`` as a 0-d int64 tensor on ``like``'s device."""
    if isinstance(count, Tensor):
        return count
    return torch.full((), count, dtype=torch.int64, device=like.device)


class StateDictError(ValueError):
    """A state dict that clipopt refuses to load (a ``ValueError``)."""


#: The message of a :class:`StateDictError` about the wrapper's state dict (``{}``: what is wrong).
STATE_DICT_MESSAGE = "invalid state_dict: {}; pass the dict returned by opt.state_dict()"


def bad(msg: str, message: str = STATE_DICT_MESSAGE) -> StateDictError:
    """The error for a state dict (or a component's entry) that cannot be loaded: ``msg`` in
    ``message`` (a component's own form, such as the Rewind's, for its entry)."""
    return StateDictError(message.format(msg))


def int_field(
    entry: dict[str, Any],
    key: str,
    low: int = 0,
    high: int | None = None,
    *,
    where: str = "clipopt.",
    message: str = STATE_DICT_MESSAGE,
) -> int:
    """``entry[key]``, an int from ``low`` to ``high`` (None: no bound), else :func:`bad` naming it
    as ``'{where}{key}'``."""
    value = entry.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise bad(f"'{where}{key}' must be an int >= {low}, got {value!r}", message)
    if high is not None and value > high:
        raise bad(f"'{where}{key}' must be <= {high}, got {value!r}", message)
    return int(value)


#: What ``GradScaler.state_dict()`` holds when the scaler is enabled.
_SCALER_FIELDS: dict[str, tuple[type, ...]] = {
    "scale": (float, int),
    "growth_factor": (float, int),
    "backoff_factor": (float, int),
    "growth_interval": (int,),
    "_growth_tracker": (int,),
}


def check_scaler_entry(value: Any) -> None:
    """The saved ``'clipopt.scaler'`` has the shape of a ``GradScaler`` state dict (None or ``{}``:
    none saved, or a disabled scaler's); whether the scaler present now takes it is
    :func:`check_scaler_matches`'s concern."""
    if value is None or value == {}:
        return
    if not isinstance(value, dict):
        raise bad(f"'clipopt.scaler' must be a GradScaler state dict, got {type(value).__name__}")
    for key, kinds in _SCALER_FIELDS.items():
        field = value.get(key)
        if not isinstance(field, kinds) or isinstance(field, bool):
            raise bad(f"'clipopt.scaler.{key}' must be a number, got {field!r}")


def check_scaler_matches(saved: Any, scaler: torch.amp.GradScaler | None) -> None:
    """The scaler present now takes the saved scaler state (loaded into a copy of it first: it may
    refuse it); nothing to check without either."""
    if saved is None or scaler is None:
        return
    try:
        copy.deepcopy(scaler).load_state_dict(saved)
    except (RuntimeError, KeyError, TypeError, ValueError) as exc:
        raise bad(
            f"the GradScaler rejected 'clipopt.scaler' ({exc})",
            "invalid state_dict: {}; pass a state dict saved with a scaler configured like this one",
        ) from exc


def has_own_layout(state_dict: dict[str, Any], inner: Optimizer) -> bool:
    """Whether ``state_dict`` holds the inner optimizer's state in a layout of its own, not torch's.

    pytorch_optimizer's ``Lookahead`` saves ``lookahead_state``/``base_optimizer``: it has neither
    of torch's keys (``state``, ``param_groups``), and its class loads state dicts its own way.
    Such an entry is checked by the inner optimizer itself (see ``Checkpoint.take_over``).  torch's
    own classes (``ZeroRedundancyOptimizer`` overrides ``load_state_dict``) always use torch's layout:
    a dict without its keys is the wrong dict (a model's state dict), refused as such.
    """
    torch_keys = "state" in state_dict or "param_groups" in state_dict
    kind = type(inner)
    torch_class = kind.__module__ == "torch" or kind.__module__.startswith("torch.")
    return not torch_keys and not torch_class and kind.load_state_dict is not Optimizer.load_state_dict


def _check_layout(parts: list[Any]) -> None:
    """Each inner optimizer's state dict has a ``"state"`` dict and a ``"param_groups"`` list (None:
    one in its optimizer's own layout, :func:`has_own_layout`, checked by the optimizer)."""
    for k, part in enumerate(parts):
        if part is None:
            continue
        several = part.get("optimizers") if isinstance(part, dict) and "state" not in part else None
        if len(parts) == 1 and isinstance(several, list):
            raise bad(
                f"it is the state dict of a ClippedOptimizer over {len(several)} optimizers "
                "({'optimizers': [...]}); load it into a ClippedOptimizer over the same list of optimizers"
            )
        where = "" if len(parts) == 1 else f"optimizers[{k}]."
        for key, kind in (("state", dict), ("param_groups", list)):
            value = part.get(key) if isinstance(part, dict) else None
            if not isinstance(value, kind):
                raise bad(f"'{where}{key}' must be a {kind.__name__}, got {type(value).__name__}")


def read_wrapper_state(
    state_dict: Any, params: list[Tensor], accumulation_steps: int, parts: list[Any] | None = None
) -> tuple[WrapperState, list[Tensor | None] | None, Any] | None:
    """Validate ``state_dict["clipopt"]``; None for a plain optimizer's state dict.

    ``parts``: the inner optimizers' state dicts (default: ``state_dict`` itself), each checked
    for its ``"state"`` and ``"param_groups"`` (None for one in its own layout)."""
    if not isinstance(state_dict, dict):
        raise TypeError(
            f"state_dict must be a dict, got {type(state_dict).__name__}; "
            "pass the dict returned by opt.state_dict() (or torch.load of it)"
        )
    _check_layout([state_dict] if parts is None else parts)
    ext = state_dict.get("clipopt")
    if ext is None:
        return None
    if not isinstance(ext, dict):
        raise bad(f"'clipopt' must be a dict, got {type(ext).__name__}")
    if ext.get("format") != FORMAT_VERSION:
        raise bad(f"'clipopt.format' is {ext.get('format')!r}, this clipopt reads {FORMAT_VERSION}")
    micro = int_field(ext, "micro_batches", 0, accumulation_steps - 1)
    windows = int_field(ext, "windows", 0)
    skipped = int_field(ext, "skipped", 0, windows)
    applied = int_field(ext, "applied", 0)
    if applied + skipped != windows:
        raise bad(f"'clipopt.applied' ({applied}) + 'skipped' ({skipped}) != 'windows' ({windows})")
    counters = WrapperState(
        micro_batches=micro,
        windows=windows,
        skipped=skipped,
        consecutive=int_field(ext, "consecutive", 0, skipped),
    )
    pending = ext.get("pending_grads")
    if pending is not None:
        if not isinstance(pending, list) or len(pending) != len(params):
            got = len(pending) if isinstance(pending, list) else type(pending).__name__
            raise bad(f"'clipopt.pending_grads' must list {len(params)} gradients, got {got}")
        for i, (p, g) in enumerate(zip(params, pending, strict=True)):
            if g is not None and (not isinstance(g, Tensor) or g.shape != p.shape):
                shape = tuple(g.shape) if isinstance(g, Tensor) else type(g).__name__
                raise bad(f"pending gradient {i} has shape {shape}, parameter has {tuple(p.shape)}")
            if g is not None and not (g.is_floating_point() or g.is_complex()):
                raise bad(f"pending gradient {i} has dtype {g.dtype}, gradients are floating point")
    elif micro > 0:
        raise bad("'clipopt.micro_batches' > 0 but no 'pending_grads' were saved")
    check_scaler_entry(ext.get("scaler"))
    return counters, pending, ext.get("scaler")


def validate_inner_state(state_dict: dict[str, Any], inner: Optimizer) -> None:
    """Check group sizes and param-shaped state tensors before the inner optimizer loads them."""
    saved_groups = state_dict["param_groups"]
    groups = inner.param_groups
    if len(saved_groups) != len(groups):
        raise bad(f"it has {len(saved_groups)} parameter groups, the optimizer has {len(groups)}")
    id_to_param: dict[Any, Tensor] = {}
    for i, (saved, group) in enumerate(zip(saved_groups, groups, strict=True)):
        if not isinstance(saved, dict) or not isinstance(saved.get("params"), list):
            raise bad(f"parameter group {i} has no 'params' list")
        if len(saved["params"]) != len(group["params"]):
            raise bad(
                f"parameter group {i} has {len(saved['params'])} parameters, "
                f"the optimizer's has {len(group['params'])}"
            )
        id_to_param.update(zip(saved["params"], group["params"], strict=True))
        for name, value in saved.items():
            if name not in ("params", "param_names") and name in group:
                _check_hyperparameter(i, name, value, group[name])
    flat = sum(q.numel() for group in groups for q in group["params"])
    builtin = _layout(type(inner))  # whose state layouts are known
    for key, entry in state_dict["state"].items():
        if key not in id_to_param:
            raise bad(f"state for parameter id {key!r} that no parameter group lists")
        if not isinstance(entry, dict):
            raise bad(f"state of parameter {key!r} must be a dict, got {type(entry).__name__}")
        p = id_to_param[key]
        current = inner.state.get(p) or {}
        for name, value in entry.items():
            if isinstance(value, Tensor):
                _check_state_tensor(key, name, value, p, current.get(name), flat, builtin)


def optimizer_chain(inner: Optimizer) -> list[Optimizer]:
    """``inner`` and the optimizers it wraps (``Lookahead``'s and ``ScheduleFreeWrapper``'s base
    optimizer is their ``optimizer``): each holds state and groups of its own."""
    chain = [inner]
    base = getattr(inner, "optimizer", None)
    while isinstance(base, Optimizer) and all(base is not o for o in chain):
        chain.append(base)
        base = getattr(base, "optimizer", None)
    return chain


def held_state(inner: Optimizer) -> list[tuple[list[dict[str, Any]], dict[Tensor, dict[str, Any]]]]:
    """Each optimizer's groups and per-parameter state in :func:`optimizer_chain` (shallow copies),
    what :func:`check_loaded_state` compares the loaded state with."""
    return [
        ([dict(g) for g in o.param_groups], {p: dict(s) for p, s in o.state.items()})
        for o in optimizer_chain(inner)
    ]


def check_loaded_state(
    inner: Optimizer, before: list[tuple[list[dict[str, Any]], dict[Tensor, dict[str, Any]]]]
) -> None:
    """After the inner optimizer loaded a state dict in a layout of its own (:func:`has_own_layout`):
    the per-parameter state each optimizer of :func:`optimizer_chain` now holds must fit the
    parameters and its groups' hyper-parameters be of the kinds held ``before`` (:func:`held_state`),
    as a torch-layout entry's must before loading."""
    for o, (groups, state) in zip(optimizer_chain(inner), before, strict=False):
        for i, (group, old) in enumerate(zip(o.param_groups, groups, strict=False)):
            for name, value in group.items():
                if name not in ("params", "param_names") and name in old:
                    _check_hyperparameter(i, name, value, old[name])
        params = [p for group in o.param_groups for p in group["params"]]
        flat = sum(p.numel() for p in params)
        builtin = _layout(type(o))
        for i, p in enumerate(params):
            for name, value in (o.state.get(p) or {}).items():
                if isinstance(value, Tensor):
                    _check_state_tensor(i, name, value, p, (state.get(p) or {}).get(name), flat, builtin)


def _kind(value: Any) -> str | None:
    """The kind of a hyper-parameter value: what a saved value must match; None: anything goes."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (Real, Tensor)):
        return "number"
    if isinstance(value, str):
        return "str"
    if isinstance(value, (tuple, list)):
        return "sequence"
    return None


_KIND_NAMES = {
    "bool": "True or False",
    "number": "a number (or a tensor)",
    "str": "a string",
    "sequence": "a tuple",
}


def _check_hyperparameter(group: int, name: str, saved: Any, current: Any) -> None:
    """A saved hyper-parameter must be of the kind the optimizer holds now (``lr`` a number, ``betas``
    a tuple of numbers, flags bools); None is accepted where the optimizer holds None, a bool or a
    string (an option turned off, such as LBFGS's ``line_search_fn``)."""
    want, got = _kind(current), _kind(saved)
    if want is None or (saved is None and want in ("bool", "str")):
        return
    ok = got == want
    if ok and want == "number" and isinstance(current, Tensor) and current.numel() != 1:
        ok = isinstance(saved, Tensor) and saved.shape == current.shape
    elif ok and want == "number":
        ok = not isinstance(saved, Tensor) or saved.numel() == 1
    if ok and want == "sequence":
        ok = len(saved) == len(current) and all(
            _kind(c) is None or _kind(s) == _kind(c) for s, c in zip(saved, current, strict=True)
        )
    if not ok:
        shown = f"{saved!r:.60}"
        raise bad(
            f"parameter group {group} has {name}={shown} ({type(saved).__name__}), but the optimizer's "
            f"{name} is {_KIND_NAMES[want]} (now {current!r:.60})"
        )


def _fits(shape: tuple[int, ...], param: tuple[int, ...]) -> bool:
    """Whether a state tensor of ``shape`` can belong to a parameter of shape ``param``: a scalar,
    the parameter's shape, or a reduction of it (dimensions kept as 1 or dropped, as factored
    second moments such as Adafactor's row and column statistics are)."""
    if len(shape) == 0 or shape == param:
        return True
    if len(shape) == len(param):
        return all(s in (d, 1) for s, d in zip(shape, param, strict=True))
    it = iter(param)  # a subsequence of the parameter's dimensions
    return len(shape) < len(param) and all(any(s == d for d in it) for s in shape)


def _layout(kind: type) -> Layout:
    """Whose state layout an optimizer class keeps: ``"torch"`` (one of torch's optimizers),
    ``"derived"`` (a class derived from one of them, ``class MyAdamW(torch.optim.AdamW)``: the step it
    inherits needs torch's moments, it may add entries of its own), else ``"own"``."""
    if kind.__module__.startswith("torch.optim"):
        return "torch"
    derived = any(k.__module__.startswith("torch.optim") and k is not Optimizer for k in kind.__mro__)
    return "derived" if derived else "own"


def _check_state_tensor(
    key: Any, name: str, value: Tensor, p: Tensor, current: Any, flat: int, builtin: Layout
) -> None:
    """A state tensor must fit its parameter: the shape the optimizer holds now, else for torch's own
    optimizers (``builtin`` ``"torch"``) the parameter's (moments), a scalar (counters), a reduction
    of it, or a flat vector (LBFGS keeps flat vectors of all its parameters, ``flat`` elements, under
    the first one); a class derived from one of them (``"derived"``) the parameter's for the moments,
    any shape for other entries.  A third-party optimizer's entries (``"own"``) may have any shape,
    whatever their names: its layout is its own (timm's ``NvNovoGrad`` keeps ``exp_avg_sq`` as one
    number per tensor, Shampoo ``(d, d)`` factors, 8-bit optimizers blocks)."""
    shape, pshape = tuple(value.shape), tuple(p.shape)
    if isinstance(current, Tensor):  # the optimizer already holds this entry: the same shape
        ok = tuple(current.shape) == shape
    elif builtin == "own":
        ok = True
    elif name in _PARAM_SHAPED:
        ok = shape == pshape
    elif builtin == "derived":
        ok = True
    else:
        ok = _fits(shape, pshape) or value.numel() == 1 or shape in ((p.numel(),), (flat,))
    if not ok:
        raise bad(f"state[{key!r}][{name!r}] has shape {shape}, parameter has {pshape}")


def own_group_keys(inner: Optimizer) -> list[set[str]] | None:
    """The keys of each group that the inner optimizer's own ``state_dict()`` keeps, where it may leave
    some out (a third-party class with its own ``state_dict`` or state-dict hooks: heavyball drops the
    keys that start with ``_``, ``__class__`` among them); None where it keeps every key (torch's own
    optimizers, and classes with torch's ``state_dict`` and no hook), or does not say (its state dict
    raises, or is not in torch's layout)."""
    kind = type(inner)
    if kind.__module__ == "torch" or kind.__module__.startswith("torch."):
        return None
    hooks = getattr(inner, "_optimizer_state_dict_pre_hooks", None) or getattr(
        inner, "_optimizer_state_dict_post_hooks", None
    )
    if kind.state_dict is Optimizer.state_dict and not hooks:
        return None
    try:
        groups = inner.state_dict().get("param_groups")
    except Exception:  # it cannot say now (e.g. a sharded optimizer before consolidating): all kept
        return None
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        return None
    return [set(g) for g in groups]


@contextmanager
def keep_group_keys(inner: Optimizer) -> Iterator[None]:
    """After loading, every group must still hold every hyper-parameter it held before, except those
    the inner optimizer's own ``state_dict()`` leaves out (:func:`own_group_keys`): it cannot need
    them from a state dict (heavyball sets its private keys again at every step).

    Checked after loading, because optimizers fill in options added in later
    torch releases in their ``__setstate__``; a key still missing then would
    only fail at the next ``step()``.
    """
    before = [set(group) for group in inner.param_groups]
    saved = own_group_keys(inner)
    yield
    for i, (keys, group) in enumerate(zip(before, inner.param_groups, strict=True)):
        missing = sorted(keys - set(group))
        if saved is not None and i < len(saved):
            missing = [k for k in missing if k in saved[i]]
        if missing:
            raise bad(f"parameter group {i} lacks {', '.join(map(repr, missing))}")


@contextmanager
def restore_on_failure(inner: Optimizer, *, reload: bool = False) -> Iterator[None]:
    """Put the inner optimizer's state and groups back if loading fails half-way.

    ``Optimizer.load_state_dict`` builds new ``state`` and ``param_groups``
    objects and swaps them in at the end, so keeping the old objects suffices.
    With ``reload`` (an inner optimizer with a layout of its own, whose state may
    live in objects it wraps) its own state dict is taken first and loaded back.
    """
    saved = inner.state_dict() if reload else None
    state, groups = inner.state, inner.param_groups
    try:
        yield
    except StateDictError:
        _put_back(inner, state, groups, saved)
        raise
    except Exception as exc:
        _put_back(inner, state, groups, saved)
        raise bad(f"the inner {type(inner).__name__} rejected it ({exc})") from exc


def _put_back(inner: Optimizer, state: Any, groups: list[dict[str, Any]], saved: Any) -> None:
    """The objects held before loading (only those replaced: a third-party ``param_groups`` may be a
    read-only view), or ``saved`` loaded back."""
    if saved is not None:
        inner.load_state_dict(saved)
        return
    if inner.state is not state:
        inner.state = state
    if inner.param_groups is not groups:
        inner.param_groups = groups
