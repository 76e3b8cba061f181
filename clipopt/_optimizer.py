"""``ClippedOptimizer``: clipping, accumulation and skipping around any ``torch.optim`` optimizer."""

from __future__ import annotations

import collections
import copy
import os
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from numbers import Real
from typing import Any

import torch
from torch import Tensor
from torch._compile import _disable_dynamo
from torch.compiler import is_compiling
from torch.optim import Optimizer
from torch.optim import optimizer as _optim_module

from . import functional as F
from ._badrow import candidate_row
from ._checks import (
    check_choice,
    check_flag,
    check_norm_type,
    check_optional_positive_float,
    check_optional_positive_int,
    check_positive_int,
)
from ._distributed import (
    ShardedGrads,
    Unsynced,
    allreduce_mean_,
    has_dtensor,
    reduce_norm_over,
    sharded_layer_stats,
    suppress_sync,
)
from ._distributed_decision import ReplicaDecision, check_norm_group, check_replica_group, settings_of
from ._errors import NonFiniteGradientError
from ._layers import LayerStats, compute_layer_stats, resolve_param_names
from ._logging import Logger, log_window
from ._loss import LossSum, check_loss, loss_of_closure
from ._policies import ClipPolicy
from ._rollback import InnerBackup, UndoPoint, nonfinite_loss, reevaluates
from ._snapshot import SnapshotWriter, check_saveable, now, process_rank, to_saveable, versions
from ._state import (
    WrapperState,
    keep_group_keys,
    read_wrapper_state,
    restore_on_failure,
    validate_inner_state,
)
from ._stats import StepStats
from ._window_guard import WindowGuard

__all__ = ["ClippedOptimizer"]

_HOOK_DICTS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


#: torch optimizers whose fused implementation takes ``grad_scale`` and ``found_inf``.
_FUSED_CAPABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def _is_fused(inner: Optimizer) -> bool:
    """True when ``inner.step()`` takes ``grad_scale``/``found_inf`` (fused Adam, AdamW, SGD, Adagrad).

    ``_step_supports_amp_scaling`` marks them (and third-party fused optimizers),
    but pickling drops that instance attribute, so the type counts as well.
    """
    if not (getattr(inner, "_step_supports_amp_scaling", False) or isinstance(inner, _FUSED_CAPABLE)):
        return False
    return all(bool(g.get("fused")) for g in inner.param_groups)


def _fused_inner_step(
    inner: Optimizer, closure: Callable[[], Any] | None, grad_scale: Tensor | None, found_inf: Tensor | None
) -> Any:
    """The fused inner ``step()`` with ``grad_scale``/``found_inf`` set on it, as GradScaler does.

    Under ``torch.compile(opt.step)`` it runs eagerly (:data:`_fused_inner_step_eager`):
    torch never compiles its fused kernels either (``_fused_adamw`` is
    ``torch.compiler.disable``-d), and attributes set on the optimizer inside a
    traced frame do not reach them.
    """
    inner.grad_scale = grad_scale  # type: ignore[attr-defined]
    inner.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        return inner.step(closure)
    finally:
        del inner.grad_scale  # type: ignore[attr-defined]
        del inner.found_inf  # type: ignore[attr-defined]


#: ``_fused_inner_step`` hidden from torch.compile; torch's lazy wrapper imports
#: ``torch._dynamo`` at the first call (while compiling), not when clipopt is imported.
_fused_inner_step_eager = _disable_dynamo(_fused_inner_step)


def _lr_value(lr: Any) -> float | Tensor:
    """A group's lr for the record: tensor learning rates are copied, not read (no host sync)."""
    return lr.detach().clone() if isinstance(lr, Tensor) else float(lr)


def _check_layer_stats(value: Any) -> int:
    """``layer_stats``: False -> 0 (off), True -> 1, k -> every k windows."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int) and value >= 1:
        return value
    raise (TypeError if not isinstance(value, int) else ValueError)(
        f"layer_stats must be True, False or an int >= 1, got {value!r}; "
        "pass e.g. layer_stats=10 for statistics every 10 updates"
    )


def _check_loggers(loggers: Any) -> list[Logger]:
    if isinstance(loggers, (str, bytes)) or not hasattr(loggers, "__iter__"):
        raise TypeError(
            f"loggers must be a list of loggers, got {type(loggers).__name__}; "
            "pass e.g. loggers=[CSVLogger('grads.csv')]"
        )
    out = list(loggers)
    for logger in out:
        if not isinstance(logger, Logger):
            raise TypeError(
                f"loggers must hold objects with log(stats, optimizer) and close() methods, "
                f"got {type(logger).__name__}; pass e.g. loggers=[CSVLogger('grads.csv')]"
            )
    return out


class ClippedOptimizer(Optimizer):
    r"""Wrap ``optimizer`` to clip, accumulate and skip non-finite updates.

    Call :meth:`step` after every ``backward()``; every ``accumulation_steps``-th
    call closes a *window* and, in this order:

    1. combines the micro-batch gradients (``reduction="mean"`` divides their
       sum by the number of micro-batches actually accumulated);
    2. computes the total ``norm_type``-norm of the combined gradient in
       float32 — the recorded ``total_norm``, which decides finiteness;
    3. clamps every element into ``[-clip_value, clip_value]`` (if set);
    4. multiplies by ``min(1, max_norm / (norm + 1e-6))`` (if ``max_norm`` is set),
       with ``norm`` taken after step 3;
    5. calls the inner ``step()`` — or skips: a skipped update is as if it never
       happened (parameters and inner state untouched, gradients discarded).

    ``param_groups``, ``state`` and ``defaults`` are the inner optimizer's own
    objects, so LR schedulers, ``add_param_group`` and checkpoints work as usual.
    Reading :attr:`update_applied`, :attr:`step_was_skipped` or a field of
    :attr:`last_stats` may wait for the device; recording them does not.

    An error raised inside :meth:`step` or :meth:`flush` before the inner step
    has run (bad gradients, a failing policy) leaves the wrapper's counters,
    window and policy state exactly as before the call; when the gradients
    were already changed in place (unscaled, clipped, or by the inner step
    raising), they are discarded with the window's micro-batches.
    Loggers and snapshots never interrupt training for I/O errors: they warn
    once per cause.  A window in which no parameter has a gradient is not
    applied (``update_applied`` False); it is recorded as skipped with reason
    ``"nograd"``.  Complex parameters are measured and clipped by norm like
    ``clip_grad_norm_`` does (the norm of ``|g|``); ``clip_value`` refuses them.

    Like torch's optimizers, a ``ClippedOptimizer`` is not thread-safe: call
    :meth:`step` from one thread at a time (concurrent calls miscount windows).

    Args:
        optimizer: any ``torch.optim.Optimizer`` (also third-party subclasses).
        max_norm: global norm bound, a :class:`ClipPolicy` (:class:`AutoClip`,
            :class:`ZClip`, :class:`AGC`) that sets it per window on the device, or
            None to turn norm clipping off.
        norm_type: ``p > 0`` or ``float("inf")``, as in ``clip_grad_norm_``.
        clip_value: element-wise bound applied before the norm bound, or None.
        accumulation_steps: micro-batches per optimizer update.
        reduction: ``"mean"`` or ``"sum"`` of the micro-batch gradients.
        skip_nonfinite: skip (and zero) an update whose gradients are not finite.
        max_consecutive_nonfinite: raise :class:`NonFiniteGradientError` after
            this many skipped updates in a row (None: never).  Checking it reads
            one flag from the device per update.
        scaler: a ``torch.amp.GradScaler`` whose ``scale(loss)`` you backward;
            the wrapper unscales, steps and updates it at each window's end.
        stats_history: how many :class:`StepStats` :attr:`stats` keeps.
        foreach: passed to the foreach kernels (None: where supported).
        param_names: names for per-parameter output: ``model.named_parameters()``,
            a ``{name: param}`` dict or names in parameter order (default: the
            inner optimizer's ``param_names``, else ``group<g>.<i>``).
        layer_stats: per-parameter statistics (:class:`LayerStats`) every
            ``k`` windows (True: every window; False: never).  A window with
            statistics reads one flag from the device.
        loggers: objects with ``log(stats, optimizer)`` and ``close()`` called at
            every window's end (:class:`CSVLogger`, :class:`TensorBoardLogger`).
        snapshot_dir: folder for anomaly snapshots: on a non-finite window the
            parameters, pre-clip gradients, optimizer state, statistics and
            :meth:`attach`-ed tensors are saved (see :func:`load_snapshot`);
            with a ``scaler`` such a window has reason ``"overflow"`` and the
            snapshot holds the loss scale (:func:`clipopt.replay` tells an
            overflow of the scale from a genuine fault).
            Deciding reads one flag from the device per update.
        max_snapshots: at most this many snapshots are written per run and reason
            (non-finite, overflow, spike), so spikes never crowd out a later non-finite one.
        norm_group: a process group whose ranks hold *different* parameters
            (pipeline stages): the partial norms are combined over it (one scalar
            collective per norm), so every stage clips and skips alike.
        replica_group: the ranks holding replicas of these parameters (DDP):
            ``"auto"`` (the default group when ``torch.distributed`` is
            initialised with more than one rank), a process group, or None
            (decisions stay rank-local: ranks training independent models).
            Costs one scalar collective per window with plain-tensor parameters
            (none added for DTensor ones) and one settings check at the first
            ``step()``; see ``clipopt/_distributed_decision.py``.
        backward_passes_per_step: backward passes expected per :meth:`step` call
            while accumulating (``accumulation_steps > 1``).  More is reported as
            an accumulation stacked on the wrapper's (``RuntimeError``); raise it
            when a micro-batch legitimately runs several (two losses backwarded
            separately).  Gradients of an open window cleared or replaced from
            outside (``model.zero_grad()``) raise ``RuntimeError`` as well.
    """

    _policy: ClipPolicy | None
    _bound: float | None

    def __init__(
        self,
        optimizer: Optimizer,
        max_norm: float | ClipPolicy | None = 1.0,
        norm_type: float = 2.0,
        clip_value: float | None = None,
        accumulation_steps: int = 1,
        reduction: str = "mean",
        skip_nonfinite: bool = True,
        max_consecutive_nonfinite: int | None = None,
        *,
        scaler: torch.amp.GradScaler | None = None,
        stats_history: int = 1024,
        foreach: bool | None = None,
        param_names: Any = None,
        layer_stats: bool | int = False,
        loggers: Sequence[Logger] = (),
        snapshot_dir: str | os.PathLike[str] | None = None,
        max_snapshots: int = 10,
        norm_group: Any = None,
        replica_group: Any = "auto",
        backward_passes_per_step: int = 1,
    ) -> None:
        if isinstance(optimizer, ClippedOptimizer):
            raise TypeError(
                "optimizer is already a ClippedOptimizer; wrap its inner optimizer "
                "(opt.optimizer) once, with all the options you need"
            )
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}; "
                "pass e.g. torch.optim.AdamW(model.parameters())"
            )
        self.max_norm = max_norm
        self.norm_type = check_norm_type(norm_type)
        self.clip_value = check_optional_positive_float("clip_value", clip_value, "0.5")
        self.accumulation_steps = check_positive_int("accumulation_steps", accumulation_steps)
        self.reduction = check_choice("reduction", reduction, ("mean", "sum"))
        self.skip_nonfinite = check_flag("skip_nonfinite", skip_nonfinite)
        self.max_consecutive_nonfinite = check_optional_positive_int(
            "max_consecutive_nonfinite", max_consecutive_nonfinite
        )
        if self.max_consecutive_nonfinite is not None and not skip_nonfinite:
            raise ValueError(
                f"max_consecutive_nonfinite={max_consecutive_nonfinite!r} counts skipped updates "
                "but skip_nonfinite=False skips none; set skip_nonfinite=True or "
                "max_consecutive_nonfinite=None"
            )
        if scaler is not None and not (hasattr(scaler, "unscale_") and hasattr(scaler, "update")):
            raise TypeError(
                f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}; "
                "pass scaler=torch.amp.GradScaler()"
            )
        if foreach is not None:
            check_flag("foreach", foreach)
        self.stats_history = check_positive_int("stats_history", stats_history)
        self.layer_stats = _check_layer_stats(layer_stats)
        self.loggers = _check_loggers(loggers)
        if snapshot_dir is not None and not isinstance(snapshot_dir, (str, os.PathLike)):
            raise TypeError(
                f"snapshot_dir must be a path or None, got {type(snapshot_dir).__name__}; "
                "pass e.g. snapshot_dir='anomalies/'"
            )
        self.max_snapshots = check_positive_int("max_snapshots", max_snapshots)
        self.norm_group = check_norm_group(norm_group)
        self._replicas = ReplicaDecision(check_replica_group(replica_group))
        self.backward_passes_per_step = check_positive_int(
            "backward_passes_per_step", backward_passes_per_step
        )
        names = resolve_param_names(optimizer, param_names)
        if self.clip_value is not None and any(p.is_complex() for p in names):
            raise ValueError(
                f"clip_value={clip_value!r} cannot clip complex parameters (a complex number has no order "
                "to clamp by); pass clip_value=None and bound complex gradients with max_norm"
            )
        if snapshot_dir is not None and has_dtensor(list(names)):
            raise ValueError(_DTENSOR_DIAGNOSTICS)
        if snapshot_dir is not None and param_names is None and not any(
            g.get("param_names") for g in optimizer.param_groups
        ):
            warnings.warn(
                "snapshot_dir is set but the parameters have no names, so snapshots name them "
                "group0.0, group0.1, ... and model.load_state_dict(snap['params'], strict=False) "
                "matches nothing; pass param_names=model.named_parameters()",
                UserWarning,
                stacklevel=2,
            )

        self.optimizer = optimizer
        self.scaler = scaler
        self.foreach = foreach
        self._init_hooks()
        self.stats: collections.deque[StepStats] = collections.deque(maxlen=self.stats_history)
        self.last_stats: StepStats | None = None
        self._counters = WrapperState()
        self._loss = LossSum()  # the open window's micro-batch losses
        self._update_applied: bool | None = False  # None: read _last_skipped
        self._last_skipped: bool | Tensor = False
        self._ready_state: Any = None  # the state object known to hold state for every parameter
        self._ready_size: tuple[int, int] = (0, 0)
        self._params_key: tuple[int, ...] = ()
        self._params_cache: list[Tensor] = []
        self._has_dtensor = False  # some parameter is a DTensor (FSDP2): norms are reduced across ranks
        self._shards: ShardedGrads | None = None  # the open window's sharded gradients
        self._unsynced: Unsynced | None = None  # the latest micro-batch that skipped its sync, see no_sync()
        self._names = names
        self._snapshots = None if snapshot_dir is None else SnapshotWriter(snapshot_dir, self.max_snapshots)
        self._attached: dict[str, list[Any]] = {}
        self._bad_row: LayerStats | None = None  # the window's candidate per-layer row, see _measure
        #: Path of the latest anomaly snapshot written, or None.
        self.last_snapshot: str | None = None
        self._last_nonfinite_snapshot: str | None = None  # what NonFiniteGradientError names
        self._window_guard = WindowGuard()  # outside clearing and stacked accumulation, see _window_guard

    # ------------------------------------------------------------------ delegation

    def _init_hooks(self) -> None:
        for name in _HOOK_DICTS:
            if name not in self.__dict__:
                setattr(self, name, OrderedDict())
        self._patch_step_function()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> collections.defaultdict[Tensor, Any]:
        return self.optimizer.state

    @state.setter
    def state(self, value: collections.defaultdict[Tensor, Any]) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the inner optimizer."""
        self.optimizer.add_param_group(param_group)

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the hooks (as torch does); mid-window also the gradients.

        Pickling a parameter does not carry its ``.grad``, so the gradients of a
        half-accumulated window travel with the wrapper.
        """
        state = self.__dict__.copy()
        for name in _HOOK_DICTS:
            state.pop(name, None)
        self._check_checkpointable()
        if self._unsynced is not None:  # the model and its process group do not travel; the fact does
            state["_unsynced"] = self._unsynced.detached()
        state["_shards"] = None
        if self._counters.micro_batches > 0:
            state["_pending_grads"] = [p.grad for p in self._params()]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        pending = state.pop("_pending_grads", None)
        state.setdefault("norm_group", None)  # pickled before these existed
        state.setdefault("_replicas", ReplicaDecision("auto"))
        state.setdefault("backward_passes_per_step", 1)  # pickled before these existed
        state.setdefault("_window_guard", WindowGuard())
        self.__dict__.update(state)
        self.__dict__.setdefault("_loss", LossSum())  # pickled by a clipopt without the loss
        self._init_hooks()
        if pending is not None:
            for p, g in zip(self._params(), pending, strict=True):
                p.grad = g

    def __repr__(self) -> str:
        opts = (
            f"max_norm={self.max_norm}, norm_type={self.norm_type}, clip_value={self.clip_value}, "
            f"accumulation_steps={self.accumulation_steps}, reduction={self.reduction!r}, "
            f"skip_nonfinite={self.skip_nonfinite}"
        )
        inner = "\n".join("  " + line for line in repr(self.optimizer).splitlines())
        return f"ClippedOptimizer({opts},\n{inner}\n)"

    @property
    def max_norm(self) -> float | ClipPolicy | None:
        """The norm bound: a float, a :class:`ClipPolicy`, or None (off); may be changed between windows."""
        return self._policy if self._policy is not None else self._bound

    @max_norm.setter
    def max_norm(self, value: float | ClipPolicy | None) -> None:
        if isinstance(value, ClipPolicy):
            self._policy, self._bound = value, None
            return
        if value is not None and (isinstance(value, bool) or not isinstance(value, Real)):
            raise TypeError(
                f"max_norm must be a float, a ClipPolicy (AutoClip, ZClip, AGC) or None, got {value!r} "
                f"({type(value).__name__}); pass e.g. max_norm=1.0 or max_norm=AutoClip()"
            )
        self._bound = check_optional_positive_float("max_norm", value, "1.0")
        self._policy = None

    # ------------------------------------------------------------------ signals

    @property
    def micro_batches(self) -> int:
        """Micro-batches gathered in the current, still open window."""
        return self._counters.micro_batches

    @property
    def num_updates(self) -> int:
        """Updates applied so far (may wait for the device)."""
        return int(self._counters.applied)

    @property
    def num_skipped(self) -> int:
        """Windows skipped so far (may wait for the device)."""
        return int(self._counters.skipped)

    @property
    def num_windows(self) -> int:
        """Windows closed so far, applied or skipped."""
        return self._counters.windows

    @property
    def update_applied(self) -> bool:
        """True when the latest :meth:`step` call changed the parameters (may wait for the device)."""
        if self._update_applied is None:  # a window decided on the device: applied unless skipped
            return not bool(self._last_skipped)
        return self._update_applied

    @property
    def step_was_skipped(self) -> bool:
        """True when the latest closed window ended in a skip (may wait for the device)."""
        return bool(self._last_skipped)

    # ------------------------------------------------------------------ step

    def step(self, closure: Callable[[], Any] | None = None, *, loss: Tensor | float | None = None) -> Any:
        """Record one micro-batch; at the window's end combine, clip, and step or skip.

        ``loss`` (a one-element tensor or a float), or else the closure's return
        value, is the micro-batch's loss: the window's losses are combined like
        the gradients (``reduction``) into ``StepStats.loss`` without a host read.

        With a ``closure`` the wrapper evaluates it (forward + backward) once per
        call; optimizers that re-evaluate it (LBFGS) get the re-evaluated
        gradients clipped the same way.  Step hooks registered on the wrapper
        (and global optimizer hooks) run around every call.
        """
        if (
            self._optimizer_step_pre_hooks
            or self._optimizer_step_post_hooks
            or _optim_module._global_optimizer_pre_hooks
            or _optim_module._global_optimizer_post_hooks
            # a host-only query torch.compile cannot trace (a graph break); compiled code has no profiler hook
            or (not is_compiling() and torch.autograd._profiler_enabled())  # type: ignore[attr-defined]
        ):
            return self._profiled_step(closure, loss=loss)
        return self._step(closure, loss=loss)

    # torch's profile_hook_step costs ~12 us per call (record_function) even with
    # no hook and no profiler; take it only when a hook or the profiler is active.
    step.hooked = True  # type: ignore[attr-defined]

    def _step(self, closure: Callable[[], Any] | None = None, *, loss: Tensor | float | None = None) -> Any:
        if not self._replicas.checked:
            self._check_replicas()
        given = check_loss(loss)
        if closure is not None and not callable(closure):
            raise TypeError(
                f"closure must be a callable or None, got {type(closure).__name__}; pass a function that "
                "computes the loss and calls backward(), e.g. opt.step(closure), or call opt.step()"
            )
        if closure is not None and self.scaler is not None:
            raise TypeError(
                "step(closure) cannot be used with scaler=...: GradScaler does not support "
                "closures; call loss.backward() yourself and then opt.step()"
            )
        out = None
        if closure is not None:
            with torch.enable_grad():
                out = closure()
        if self.accumulation_steps > 1 and not self._has_dtensor and not is_compiling():
            # host bookkeeping only (see _window_guard); FSDP2 writes .grad outside autograd
            guard, allowed = self._window_guard, self.backward_passes_per_step
            guard.step(self._counters.micro_batches, self.accumulation_steps, allowed, self._params)
        loss_before = self._loss.total, self._loss.count  # add() replaces, never writes into, the sum
        self._loss.add(given if given is not None else loss_of_closure(out))
        self._counters.micro_batches += 1
        if self._counters.micro_batches < self.accumulation_steps:
            self._update_applied = False
            return out
        try:
            return self._close_window(out, closure)
        except BaseException:
            if self._counters.micro_batches > 0:  # rolled back: this call's micro-batch is not counted
                self._counters.micro_batches -= 1
                self._loss.total, self._loss.count = loss_before
            raise

    _profiled_step = Optimizer.profile_hook_step(_step)

    def flush(self) -> None:
        """Apply the micro-batches gathered so far (a partial window), dividing by their count.

        A no-op when no micro-batch is pending.  Under data parallelism it is
        collective: call it on every rank (ranks with different partial windows raise).
        """
        if not self._replicas.checked:
            self._check_replicas()
        params = self._params()
        if self._replicas.active and params:
            counters = self._counters
            self._replicas.check_flush(counters.micro_batches, counters.windows + 1, params[0].device)
        if self._counters.micro_batches > 0:
            self._close_window(None, None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients, but only when no window is open.

        Calls made while micro-batches are being accumulated do nothing, so
        ``zero_grad()`` may be called after every micro-batch.
        """
        if self._counters.micro_batches == 0:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    @contextmanager
    def no_sync(self, model: torch.nn.Module, *, sync: bool | None = None) -> Iterator[None]:
        """Skip ``model``'s gradient synchronisation unless this micro-batch closes the window.

        ::

            with opt.no_sync(model):
                loss = loss_fn(model(x), y)  # DDP decides in the forward pass: run it inside
                loss.backward()
            opt.step()

        For every micro-batch of a window but the last, the backward inside runs
        without DDP's all-reduce (``model.no_sync()``) or FSDP2's reduce-scatter
        (``set_requires_gradient_sync(False)``); gradients accumulate locally and
        the last micro-batch's backward synchronises their sum.  A plain module
        (no data parallelism) is left alone, so the same loop runs in one process.

        Args:
            model: the DDP- or FSDP2-wrapped model (or a plain module).
            sync: None decides by the window; True synchronises this backward
                (the last micro-batch of the data, before :meth:`flush`); False
                never does.

        :meth:`flush` after an unsynchronised micro-batch all-reduces the DDP
        gradients itself (a plain average over the process group, without
        DDP's communication hooks); FSDP2 cannot reduce them afterwards, so there
        it raises: pass ``sync=True`` for the last micro-batch instead.  A
        checkpoint taken mid-window holds the rank's own unsynchronised gradients
        (save one per rank); under FSDP2 it is refused while they are pending.
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"model must be a torch.nn.Module (a DDP- or FSDP2-wrapped model), got "
                f"{type(model).__name__}; pass e.g. opt.no_sync(ddp_model)"
            )
        if sync is not None:
            check_flag("sync", sync)
        if not self._replicas.checked:
            self._check_replicas()
        index = self._counters.micro_batches + 1  # this micro-batch's place in the window
        if sync is None:
            sync = index >= self.accumulation_steps
        if sync:
            yield
            return
        context, kind = suppress_sync(model)
        if kind is None:
            self._warn_plain_no_sync(model)
            with context:
                yield
            return
        before = self._unsynced
        # set before the body runs: an opt.step() inside the block may close the window
        self._unsynced = Unsynced(kind, index, type(model).__name__, getattr(model, "process_group", None))
        try:
            with context:
                yield
        except BaseException:
            self._unsynced = before
            raise

    def _check_replicas(self) -> None:
        """Once, at the first step() or no_sync(): the ranks' window settings must agree (collective)."""
        params = self._params()
        if params:
            self._replicas.check_settings(settings_of(self), params[0].device)

    def _warn_plain_no_sync(self, model: torch.nn.Module) -> None:
        """no_sync(model) under data parallelism with a module that has no sync to skip: warn once."""
        if self._replicas.active and not self._replicas.warned_no_sync:
            self._replicas.warned_no_sync = True
            warnings.warn(
                f"opt.no_sync(model) got a {type(model).__name__}, which has no gradient sync to "
                "skip, so every micro-batch still synchronises (or none does); pass the "
                "DistributedDataParallel (or fully_shard) wrapper itself, e.g. opt.no_sync(ddp_model), "
                "not ddp_model.module",
                UserWarning,
                stacklevel=4,
            )

    def _pending_unsynced(self) -> Unsynced | None:
        """The marker when the open window's latest micro-batch skipped its sync, else None."""
        marker = self._unsynced
        n = self._counters.micro_batches
        if marker is None or n == 0 or marker.micro_batch != n:  # a later micro-batch synchronised
            return None
        return marker

    def _sync_unsynced(self) -> None:
        """Before closing a window whose latest micro-batch skipped its sync: do that sync now."""
        marker = self._pending_unsynced()
        if marker is None:
            self._unsynced = None
            return
        if marker.kind != "ddp":  # nothing changed: the window stays open and pending
            raise RuntimeError(
                f"the latest micro-batch ran inside opt.no_sync(model) without gradient sync, and "
                f"{marker.model_type} cannot reduce accumulated gradients afterwards; pass "
                "opt.no_sync(model, sync=True) for the last micro-batch before flush()"
            )
        allreduce_mean_([p for p in self._params() if p.requires_grad], marker.group)
        self._unsynced = None

    def _check_checkpointable(self) -> None:
        """Refuse to save a window whose gradients are held inside FSDP2 (``p.grad`` is None there)."""
        marker = self._pending_unsynced()
        if marker is not None and marker.kind != "ddp":
            raise RuntimeError(
                f"the open window's latest micro-batch ran inside opt.no_sync(model) and "
                f"{marker.model_type} keeps its unsynchronised gradients internally, so they cannot "
                "be saved; checkpoint at a window boundary (opt.micro_batches == 0)"
            )

    def _params(self) -> list[Tensor]:
        """All parameters, in group order; cached until the groups change."""
        groups = self.param_groups
        key = (id(groups), *[id(g["params"]) for g in groups], *[len(g["params"]) for g in groups])
        if key != self._params_key:
            self._params_cache = [p for group in groups for p in group["params"]]
            self._params_key = key
            self._has_dtensor = has_dtensor(self._params_cache)
        return self._params_cache

    def _close_window(self, loss: Any, closure: Callable[[], Any] | None) -> Any:
        """Close the window; an error before the inner step returned leaves the wrapper as it was.

        An error raised once the gradients were changed in place (unscaled,
        value-clipped, scaled, or by the inner step itself) cannot give them back:
        the wrapper is still restored, but the window's gradients are discarded
        and its micro-batches not counted (never applied twice, or divided
        twice).  Once the inner step has run, the window stands: an error while
        recording or logging it, or :class:`NonFiniteGradientError`, comes after
        an update that cannot be taken back, and the window is counted.
        """
        undo = UndoPoint(self)
        try:
            return self._finish_window(loss, closure, undo)
        except BaseException as exc:
            if not undo.committed:
                undo.restore(self)
                if undo.touched:
                    self._discard_window(exc)
            raise

    def _discard_window(self, exc: BaseException) -> None:
        """Drop the open window whose gradients a failed close already changed; say so on ``exc``."""
        for p in self._params():
            p.grad = None
        self._counters.micro_batches = 0
        self._loss = LossSum()
        self._attached.clear()
        if hasattr(exc, "add_note"):
            exc.add_note(
                "clipopt: the window's gradients were already changed in place (unscaled or clipped) "
                "when this error was raised; they were discarded and the window's micro-batches are "
                "not counted"
            )

    def _finish_window(self, loss: Any, closure: Callable[[], Any] | None, undo: UndoPoint) -> Any:
        n = self._counters.micro_batches
        params = self._params()
        if self._has_dtensor and self._snapshots is not None:
            raise ValueError(_DTENSOR_DIAGNOSTICS)
        self._sync_unsynced()
        grads = self._window_grads(params)  # may raise: before the scaler is unscaled
        if self.clip_value is not None:
            F.check_value_clippable(grads)  # before anything is measured, saved or clamped
        if not grads:
            undo.committed = True
            return self._close_empty(n, loss)
        if self.scaler is not None:
            undo.touched = True
            self.scaler.unscale_(self.optimizer)
        try:
            with torch.no_grad():
                total_norm, flag = self._measure(grads, n, params)
                if self._replicas.active and not self._has_dtensor:  # DDP: one decision on every rank
                    total_norm, flag = self._replicas.agree(total_norm, flag, n, self._counters.windows + 1)
                layers = self._diagnose(params, total_norm, flag, n)
                unitwise = self._policy is not None and self._policy.unitwise  # AGC clips in place
                undo.touched |= self.clip_value is not None or unitwise
                w = self._clip(params, grads, total_norm, flag, n)
            undo.touched = True  # scaling and the inner step change the gradients
            self._counters.micro_batches = 0
            self._counters.windows += 1
            window_loss = self._loss.take(self.reduction)
            fused = _is_fused(self.optimizer) and self._inner_state_ready()
            loss = self._step_fused(w, loss, closure) if fused else self._step_host(w, loss, closure, params)
            undo.committed = True
        finally:  # also after an error: an unscaled scaler without update() would refuse every later window
            self._shards = None  # views of the gradients: do not keep them past the window
            self._window_guard.reset()
            if self.scaler is not None:
                self.scaler.update()
        stats = self._record(w, n, layers, window_loss)
        log_window(self.loggers, stats, self)  # I/O failures warn; the window is complete either way
        self._attached.clear()
        self._replicas.end_window(host_read=not fused)  # may warn (divergence) or raise (out of step)
        self._check_consecutive_nonfinite()
        return loss

    def _close_empty(self, n: int, loss: Any) -> Any:
        """A window in which no parameter has a gradient: nothing to apply, so the inner step is not
        called; it is recorded as skipped with reason ``"nograd"`` (not a non-finite skip)."""
        params = self._params()
        zero = torch.zeros((), dtype=torch.float32, device=params[0].device if params else None)
        w = _Window([], zero, zero, None, 1.0, 1.0, False, self._bound)
        self._counters.micro_batches = 0
        self._counters.windows += 1
        self._last_skipped, self._update_applied = True, False
        self._counters.record(True, False)
        stats = self._record(w, n, None, self._loss.take(self.reduction), reason="nograd")
        log_window(self.loggers, stats, self)
        self._attached.clear()
        return loss

    def _window_grads(self, params: list[Tensor]) -> list[Tensor]:
        """The gradients to measure and clip: ``p.grad``, or their local shards for DTensors."""
        grads = [p.grad for p in params if p.grad is not None]
        self._shards = ShardedGrads(grads) if self._has_dtensor else None
        return grads if self._shards is None else self._shards.locals

    def _total_norm(self, grads: list[Tensor]) -> Tensor:
        """The norm of ``grads`` over all ranks holding shards of them (collective for DTensors)."""
        if self._shards is not None:
            norm = self._shards.total_norm(grads, self.norm_type, self.foreach)
        else:
            norm = F.get_total_norm(grads, self.norm_type, foreach=self.foreach)
        if self.norm_group is not None:  # pipeline stages: every stage gets the norm of all of them
            norm = reduce_norm_over(norm, self.norm_type, self.norm_group)
        return norm

    def _check_consecutive_nonfinite(self) -> None:
        """Raise once ``max_consecutive_nonfinite`` windows in a row were skipped (reads one counter)."""
        limit = self.max_consecutive_nonfinite
        if limit is not None:
            count = int(self._counters.consecutive)
            if count >= limit:
                raise NonFiniteGradientError(count, self._counters.windows, self._last_nonfinite_snapshot)

    def _divisor(self, n: int) -> float:
        return float(n) if self.reduction == "mean" else 1.0

    def _measure(
        self, grads: list[Tensor], n: int, params: list[Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Steps 1-2: the pre-clip norm of the combined gradient and its non-finite flag.

        Given ``params`` while per-layer statistics are on and a logger writes them,
        the same pass keeps each gradient's norm for the window's candidate bad row
        (see :mod:`clipopt._badrow`).
        """
        divisor = self._divisor(n)
        if params is not None:
            self._bad_row = None
        if params is not None and self.layer_stats and self.loggers and self._shards is None:
            norms = F.get_norms(grads, self.norm_type, foreach=self.foreach)
            raw_norm = torch.linalg.vector_norm(norms, self.norm_type)
            with_grad = [i for i, p in enumerate(params) if p.grad is not None]
            self._bad_row = candidate_row(
                self.layer_names(), with_grad, norms, 1.0 / divisor, self.norm_type == 2.0
            )
        else:
            raw_norm = self._total_norm(grads)
        total_norm = raw_norm / divisor if divisor != 1.0 else raw_norm
        return total_norm, F.nonfinite_flag(total_norm)

    def _diagnose(self, params: list[Tensor], total_norm: Tensor, flag: Tensor, n: int) -> LayerStats | None:
        """Per-layer statistics when due, and an anomaly snapshot of a non-finite or spiking window.

        Both see the pre-clip gradients.  Either one reads the flag (and the
        policy's spike rule, see :meth:`ClipPolicy.is_spike`) from the device, once.
        """
        due = bool(self.layer_stats) and (self._counters.windows + 1) % self.layer_stats == 0
        if due:
            self._bad_row = None  # the full statistics are this window's row
        if not due and self._snapshots is None:
            return None
        spike = None
        if self._snapshots is not None and self._policy is not None:
            spike = self._policy.is_spike(total_norm)
        if spike is None:
            bad, spiking = bool(flag.item()), False
        else:
            bad, spiking = (v > 0 for v in torch.stack([flag, spike.to(flag.dtype)]).tolist())
        inv = 1.0 / self._divisor(n)
        stats_of = sharded_layer_stats if self._has_dtensor else compute_layer_stats  # the former: collective
        layers = stats_of(params, self.layer_names(), inv, bad) if due else None
        # with a scaler, a non-finite window is an "overflow" (GradScaler's normal operation, or a fault:
        # clipopt.replay tells them apart); each reason has its own max_snapshots
        reason = ("nonfinite" if self.scaler is None else "overflow") if bad else "spike" if spiking else None
        if not bad and self._snapshots is not None and self._replicas.diverged_now():
            reason = "divergence"
        if reason is not None and self._snapshots is not None:
            if layers is None:
                snap_layers = compute_layer_stats(params, self.layer_names(), inv, bad)
                self._bad_row = snap_layers if self.layer_stats else None  # the full row, computed anyway
            else:
                snap_layers = layers
            path = self._snapshots.save(self._snapshot_payload(params, total_norm, n, snap_layers, reason))
            self.last_snapshot = path or self.last_snapshot
            if path is not None and reason in ("nonfinite", "overflow"):
                self._last_nonfinite_snapshot = path
        return layers

    def _snapshot_payload(
        self, params: list[Tensor], total_norm: Tensor, n: int, layers: LayerStats, reason: str
    ) -> dict[str, Any]:
        inv = 1.0 / self._divisor(n)
        names = self.layer_names()
        return {
            "format": 1,
            "step": self._counters.windows + 1,
            "reason": reason,
            "micro_batches": n,
            "total_norm": float(total_norm.item()),
            "params": {name: p.detach().to("cpu", copy=True) for name, p in zip(names, params, strict=True)},
            "grads": {
                name: (p.grad.detach() * inv).to("cpu")
                for name, p in zip(names, params, strict=True)
                if p.grad is not None
            },
            "optimizer": {
                **self.optimizer.state_dict(),
                "clipopt": self._counters.to_dict(pending_grads=None, scaler=None),
            },
            "layer_stats": layers.as_dict(),
            "attached": {
                name: to_saveable(values[0] if len(values) == 1 else values, name)
                for name, values in self._attached.items()
            },
            "versions": versions(),
            "time": now(),
            "rank": process_rank(),
            "scale": None if self.scaler is None else float(self.scaler.get_scale()),
        }

    def _clip(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        total_norm: Tensor,
        flag: Tensor,
        n: int,
        fixed: tuple[float | Tensor | None] | None = None,
    ) -> _Window:
        """Steps 3-4: value clipping, then the norm bound (or a policy's); all on the device.

        ``fixed=(bound,)`` uses that bound instead of ``max_norm`` (closure re-evaluations).
        """
        divisor = self._divisor(n)
        inv = 1.0 / divisor
        norm = total_norm
        clipped: bool | Tensor = False
        if self.clip_value is not None:
            # clamp(g / n, ±c) == clamp(g, ±c·n) / n: the division folds into the final scale.
            F.clip_grads_value_(grads, self.clip_value * divisor, foreach=self.foreach)
            norm = self._total_norm(grads) * inv
            clipped = norm < total_norm
        # a unit-wise policy is stateless: re-evaluations get it again
        unitwise = self._policy is not None and self._policy.unitwise
        policy = self._policy if fixed is None or unitwise else None
        skip = flag if self._skip_enabled() else None
        if fixed is None:
            skip = self._replicas.skip_with_divergence(skip)
        coef: float | Tensor = 1.0
        bound = self._bound if fixed is None else fixed[0]
        if policy is not None and policy.unitwise:
            unit_clipped = policy.clip_(params, inv)  # applies the 1/n as well
            clipped = unit_clipped | clipped if isinstance(clipped, Tensor) else unit_clipped
            return _Window(grads, total_norm, flag, skip, 1.0, 1.0, clipped, None)
        if policy is not None:
            bound = policy.threshold(total_norm)
            spike = policy.spike()
            if spike is not None:
                skip = spike if skip is None else torch.maximum(skip, spike)
        if bound is not None:
            coef = F.clip_coef(norm, bound)
            clipped = (coef < 1.0) | clipped if isinstance(clipped, Tensor) else coef < 1.0
        scale = coef * inv if divisor != 1.0 else coef
        return _Window(grads, total_norm, flag, skip, coef, scale, clipped, bound)

    def _skip_enabled(self) -> bool:
        return self.skip_nonfinite or self.scaler is not None

    def _inner_state_ready(self) -> bool:
        """Whether every parameter with a gradient already has inner state.

        Before a parameter's first update a fused kernel that is told to skip can
        leave freshly allocated state uninitialised (fused SGD's momentum buffers),
        and a skipped first update must leave no state behind, so such windows
        take the host path.  SGD without momentum keeps no state at all.  Once
        every parameter has state, that is remembered for this state object.
        """
        state = self.state
        params = self._params()
        if self._ready_state is state and self._ready_size == (len(state), len(params)):
            return True
        sgd = isinstance(self.optimizer, torch.optim.SGD)
        all_ready = True
        for group in self.param_groups:
            if sgd and group.get("momentum", 0) == 0:
                continue
            for p in group["params"]:
                s = state.get(p)
                if not s or any(v is None for v in s.values()):
                    if p.grad is not None:
                        return False
                    all_ready = False
        if all_ready:
            self._ready_state, self._ready_size = state, (len(state), len(params))
        return True

    def _step_fused(self, w: _Window, loss: Any, closure: Callable[[], Any] | None) -> Any:
        """Fold the scale into the fused kernel as ``grad_scale``; skip through ``found_inf``."""
        grad_scale: Tensor | None = None  # the kernel divides the gradients by grad_scale
        if isinstance(w.scale, Tensor):
            grad_scale = w.scale.to(torch.float32).reciprocal()
        elif w.scale != 1.0:
            grad_scale = torch.tensor(1.0 / w.scale, dtype=torch.float32, device=w.total_norm.device)
        found_inf = w.skip
        inner_closure = self._inner_closure(loss, closure, w.limit)
        fused_step = _fused_inner_step_eager if is_compiling() else _fused_inner_step
        out = fused_step(self.optimizer, inner_closure, grad_scale, found_inf)
        self._set_outcome(found_inf if found_inf is not None else False, w)
        return out if closure is not None else loss

    def _step_host(
        self, w: _Window, loss: Any, closure: Callable[[], Any] | None, params: list[Tensor]
    ) -> Any:
        """Scale the gradients, read the skip flag once, then step or discard."""
        if isinstance(w.scale, Tensor) or w.scale != 1.0:
            F.scale_grads_(w.grads, w.scale, foreach=self.foreach)
        skipped = w.skip is not None and bool(w.skip.item())
        if skipped:
            for p in params:
                p.grad = None
            out = loss
        else:
            # an optimizer that re-evaluates the closure (LBFGS) moves the parameters first: keep a copy
            guard = closure is not None and self._skip_enabled() and reevaluates(self.optimizer)
            backup, bad = (InnerBackup(self.optimizer, params), [False]) if guard else (None, None)
            out = self.optimizer.step(self._inner_closure(loss, closure, w.limit, bad))
            if closure is None:
                out = loss
            if backup is not None and bad is not None and bad[0]:  # a non-finite re-evaluation: skip
                backup.restore()
                skipped, w.flag = True, torch.ones_like(w.flag)
        self._set_outcome(skipped, w)
        return out

    def _inner_closure(
        self,
        loss: Any,
        closure: Callable[[], Any] | None,
        limit: float | Tensor | None,
        bad: list[bool] | None = None,
    ) -> Callable[[], Any] | None:
        """First call returns the loss already computed; later calls re-evaluate and clip.

        Re-evaluated gradients are clipped with the window's own bound ``limit``
        (a policy sees each window once, not each evaluation).  With ``bad``
        (a one-element list) each re-evaluation is checked on the host: a
        non-finite loss or gradient sets ``bad[0]`` and zeroes the gradients,
        which ends LBFGS's iterations; the caller then restores the window.
        """
        if closure is None:
            return None
        calls = [0]

        def reevaluate() -> Any:
            calls[0] += 1
            if calls[0] == 1:
                return loss
            with torch.enable_grad():
                out = closure()
            with torch.no_grad():
                params = self._params()
                grads = self._window_grads(params)
                total_norm, flag = self._measure(grads, 1)
                w = self._clip(params, grads, total_norm, flag, 1, fixed=(limit,))
                if isinstance(w.scale, Tensor) or w.scale != 1.0:
                    F.scale_grads_(grads, w.scale, foreach=self.foreach)
                self._shards = None
                if bad is not None and (bad[0] or bool(flag.item()) or nonfinite_loss(out)):
                    bad[0] = True
                    for g in grads:
                        g.zero_()
                    out = torch.zeros(()) if isinstance(out, Tensor) else 0.0
            return out

        return reevaluate

    def _set_outcome(self, skipped: bool | Tensor, w: _Window) -> None:
        """Count the window; ``skipped`` is a bool, or a 0/1 float tensor decided on the device."""
        self._last_skipped = skipped
        self._update_applied = not skipped if isinstance(skipped, bool) else None
        nonfinite: bool | Tensor = skipped
        spikes = self._policy is not None and self._policy.spike() is not None
        if spikes or self._replicas.divergence is not None:  # a skip may be a spike or a divergence
            enabled = self._skip_enabled()
            if isinstance(skipped, bool):
                nonfinite = skipped and enabled and bool(w.flag.item())  # only read after a skip
            else:
                nonfinite = w.flag if enabled else torch.zeros_like(w.flag)
        self._counters.record(skipped, nonfinite)

    def _record(
        self,
        w: _Window,
        n: int,
        layers: LayerStats | None,
        loss: Tensor | float | None,
        reason: str | None = None,
    ) -> StepStats:
        stats = StepStats(
            step=self._counters.windows,
            micro_batches=n,
            total_norm=w.total_norm,
            clip_coef=w.coef,
            clipped=w.clipped,
            skipped=self._last_skipped,
            reason_if_skipped=reason or ("overflow" if self.scaler is not None else "nonfinite"),
            max_norm=w.limit,
            nonfinite=w.flag if self._policy is not None and self._policy.spike() is not None else None,
            divergence=self._replicas.divergence,
            lr=[_lr_value(g["lr"]) for g in self.param_groups],
            layers=layers,
            loss=loss,
            bad_row=self._bad_row,
        )
        self.last_stats = stats
        self.stats.append(stats)
        return stats

    # ------------------------------------------------------------------ diagnostics

    def layer_names(self) -> list[str]:
        """The name of every parameter, in parameter-group order (see ``param_names``)."""
        names = self._names
        out: list[str] = []
        seen: set[str] = set()
        for gi, group in enumerate(self.param_groups):
            own = group.get("param_names")
            for i, p in enumerate(group["params"]):
                name = names.get(p) or (own[i] if own is not None and i < len(own) else None)
                name = name or f"group{gi}.{i}"
                if name in seen:  # a group added later repeats a name: qualified, so no tensor is lost
                    name = f"group{gi}.{name}" if f"group{gi}.{name}" not in seen else f"group{gi}.{i}"
                seen.add(name)
                out.append(name)
        return out

    def attach(self, **tensors: Any) -> None:
        """Register tensors (the current batch) to save if this window goes bad.

        ``opt.attach(inputs=x, targets=y)`` before ``opt.step()``; attachments are
        dropped when the window closes.  Called several times in one window, a
        name keeps a list of what it received, in order.  Only read when a
        snapshot is written (``snapshot_dir``); copies are made then.
        """
        for name, value in tensors.items():  # check every value before keeping any
            check_saveable(value, name)
        for name, value in tensors.items():
            self._attached.setdefault(name, []).append(value)

    def close(self) -> None:
        """Close every logger (flushes buffered rows)."""
        for logger in self.loggers:
            logger.close()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus a ``"clipopt"`` entry with the wrapper state.

        The result has the usual ``"state"`` and ``"param_groups"`` keys (a plain
        optimizer can load it) and only tensors, numbers, strings, lists and
        dicts, so ``torch.load(..., weights_only=True)`` reads it.  Taken
        mid-window it holds a copy of the gradients accumulated so far.
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        self._check_checkpointable()
        sd = dict(self.optimizer.state_dict())
        pending = None
        if self._counters.micro_batches > 0:
            pending = [None if p.grad is None else p.grad.detach().clone() for p in self._params()]
        sd["clipopt"] = self._counters.to_dict(
            pending_grads=pending,
            scaler=self.scaler.state_dict() if self.scaler is not None else None,
        )
        sd["clipopt"].update(self._loss.to_dict())  # the open window's loss sum
        sd["clipopt"]["policy"] = self._policy.state_dict() if self._policy is not None else None
        marker = self._pending_unsynced()  # DDP: the saved gradients are this rank's, not yet averaged
        sd["clipopt"]["unsynced"] = None if marker is None else marker.to_dict()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` or from a plain optimizer.

        Everything is validated before anything changes: a mismatched or corrupt
        state dict raises ``ValueError`` and leaves this optimizer as it was.
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        params = self._params()
        wrapper = read_wrapper_state(state_dict, params, self.accumulation_steps)
        validate_inner_state(state_dict, self.optimizer)
        policy_state = self._check_policy_state(state_dict)
        self._check_scaler_state(wrapper)
        ext = state_dict.get("clipopt")
        unsynced = Unsynced.from_dict(
            ext.get("unsynced") if isinstance(ext, dict) else None, wrapper[0].micro_batches if wrapper else 0
        )
        loss_sum = LossSum()
        if wrapper is not None and isinstance(ext, dict):  # older state dicts have no loss: an empty sum
            loss_sum = LossSum.from_dict(ext, wrapper[0].micro_batches)
        inner_sd = {k: v for k, v in state_dict.items() if k != "clipopt"}
        with restore_on_failure(self.optimizer), keep_group_keys(self.optimizer):
            self.optimizer.load_state_dict(inner_sd)
        self._ready_state = None
        self._window_guard.reset()  # loaded gradients are new tensors
        if wrapper is None:
            self._counters = WrapperState()
        else:
            counters, pending, scaler_state = wrapper
            self._counters = counters
            if pending is not None:
                for p, g in zip(params, pending, strict=True):
                    p.grad = None if g is None else g.detach().to(p.device, p.dtype, copy=True)
            if scaler_state is not None and self.scaler is not None:
                self.scaler.load_state_dict(scaler_state)
            if policy_state is not None and self._policy is not None:
                self._policy.load_state_dict(policy_state)
        self._loss = loss_sum
        self._update_applied = False
        self._last_skipped = False
        self._unsynced = unsynced
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _check_scaler_state(self, wrapper: Any) -> None:
        """Load the saved scaler state into a copy of the scaler first: it may refuse it."""
        if wrapper is None or wrapper[2] is None or self.scaler is None:
            return
        try:
            copy.deepcopy(self.scaler).load_state_dict(wrapper[2])
        except (RuntimeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"invalid state_dict: the GradScaler rejected 'clipopt.scaler' ({exc}); "
                "pass a state dict saved with a scaler configured like this one"
            ) from exc

    def _check_policy_state(self, state_dict: dict[str, Any]) -> dict[str, Any] | None:
        """The policy's saved state, checked by loading it into a copy of the policy first."""
        ext = state_dict.get("clipopt")
        state = ext.get("policy") if isinstance(ext, dict) else None
        if state is None or self._policy is None:
            return None
        if not isinstance(state, dict):
            raise ValueError(
                f"invalid state_dict: 'clipopt.policy' must be a dict, got {type(state).__name__}; "
                "pass the dict returned by opt.state_dict()"
            )
        copy.deepcopy(self._policy).load_state_dict(state)  # raises ValueError, touching nothing
        return state

    def __deepcopy__(self, memo: dict[int, Any]) -> ClippedOptimizer:
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for logger in self.loggers:  # a copy logs to the same files: share the loggers, do not copy rows
            memo[id(logger)] = logger
        if self.norm_group is not None:  # process groups are shared, never copied
            memo[id(self.norm_group)] = self.norm_group
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return new


_DTENSOR_DIAGNOSTICS = (
    "snapshot_dir does not support DTensor (FSDP2) parameters yet: each rank holds only "
    "shards; pass snapshot_dir=None (norms, clipping, skipping, layer_stats and loggers work)"
)


class _Window:
    """The device-side results of steps 1-4 for one window."""

    __slots__ = ("clipped", "coef", "flag", "grads", "limit", "scale", "skip", "total_norm")

    def __init__(
        self,
        grads: list[Tensor],
        total_norm: Tensor,
        flag: Tensor,
        skip: Tensor | None,
        coef: float | Tensor,
        scale: float | Tensor,
        clipped: bool | Tensor,
        limit: float | Tensor | None,
    ) -> None:
        self.grads = grads  #: the gradients, clipped in place by now except for ``scale``
        self.total_norm = total_norm  #: pre-clip norm of the combined gradient
        self.flag = flag  #: 1.0 when total_norm is not finite, else 0.0
        self.skip = skip  #: 1.0 when the window is skipped (non-finite or spike); None: never skip
        self.coef = coef  #: norm-clipping coefficient (1.0 when off)
        self.scale = scale  #: coef / micro-batches (mean) — what still multiplies the gradients
        self.clipped = clipped  #: whether clipping changed the gradient
        self.limit = limit  #: the norm bound of this window (a policy's threshold), or None
