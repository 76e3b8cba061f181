"""``clipopt.replay``: rerun an anomaly snapshot and name the operation that went non-finite.

:func:`replay` loads the snapshot's parameters into the model, runs
``loss_fn(model, attached)`` and its backward ``repeats`` times under a
:class:`~clipopt._replay.watch.NonFiniteWatch` (operator interception) and a
:class:`~clipopt._replay.watch.ModuleTracker` (module attribution), both active only
during the replay, and puts the model back as it was.  What each snapshot
reason is compared with:

- ``"nonfinite"`` (and ``"overflow"``, a :class:`torch.amp.GradScaler` run): a
  run reproduces it when its loss or a parameter's gradient is non-finite.  An
  ``"overflow"`` snapshot holds the loss scale; the replay backpropagates the
  loss times that scale, as ``scaler.scale(loss).backward()`` did, and when the
  first non-finite value is in the backward it runs once more without the scale:
  finite then means the scale alone overflowed float16 (GradScaler's normal
  operation, ``cause="loss-scale"``), non-finite a genuine fault.
- ``"spike"`` and ``"divergence"``: a run reproduces it when its total gradient
  norm is within :data:`NORM_RTOL` of the snapshot's; for spikes the parameter
  whose gradient grew most against the optimizer's history is named
  (:mod:`clipopt._replay.growth`).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .._diagnostics.snapshot import load_snapshot
from .._reasons import NONFINITE_NAMES, OVERFLOW, by_code
from .growth import LayerGrowth, layer_growth
from .watch import ModuleTracker, NonFiniteWatch, OpEvent, TensorStats, all_finite

__all__ = ["NORM_RTOL", "ReplayInputError", "ReplayResult", "replay"]

#: A spike or divergence replay reproduces when its norm is within this relative distance of the snapshot's.
NORM_RTOL = 1e-3

#: Snapshot reasons whose replay looks for non-finite values.
NONFINITE_REASONS = NONFINITE_NAMES

#: Prefixes that wrappers add to parameter names (DDP / DataParallel, torch.compile).
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")

#: Keys :func:`replay` needs in a snapshot given as a dict.
_NEEDED = ("step", "reason", "total_norm", "params", "grads", "optimizer", "attached")


class ReplayInputError(Exception):
    """The mark of the errors :func:`replay` raises about its inputs (the snapshot, the model, the
    arguments, what ``loss_fn`` returns), as against errors raised by the user's code it runs:
    ``clipopt replay`` shows the former as one line and lets the latter show their traceback."""


class ReplayValueError(ReplayInputError, ValueError):
    """A :class:`ReplayInputError` that is a ``ValueError``."""


class ReplayTypeError(ReplayInputError, TypeError):
    """A :class:`ReplayInputError` that is a ``TypeError``."""


@dataclass(frozen=True)
class ReplayResult:
    """What :func:`replay` found.  ``module`` "" is the model itself; None is outside its modules.

    ``cause`` is one of: ``"operation"`` (an operator of the model made a
    non-finite value from finite inputs: fix the model), ``"fp16-overflow"`` (the
    same, a float16/bfloat16 result too large for its dtype), ``"loss-scale"``
    (only the GradScaler's scale overflowed: its normal operation), ``"data"``
    (an attached tensor is non-finite), ``"parameters"`` (the snapshot's
    parameters already were), ``"spike"`` (a spike that replays exactly: the
    model and this batch produce it), ``"transient"`` (no replay showed the
    anomaly: data loading, hardware, or another rank -- not the model and this
    batch), ``"intermittent"`` (some replays did), ``"divergence"`` (a
    divergence snapshot that replays with the same norm), ``"averaged"`` (a
    spike or divergence snapshot of one rank under data parallelism: its norm is
    that of the gradient averaged over the ranks, which one rank's replay does
    not reproduce; ``reproduced`` is then whatever the comparison gave, and
    ``layer`` is still named from the snapshot).
    """

    #: The snapshot's file (None when a loaded snapshot was given).
    file: str | None
    #: The snapshot's step (update number).
    step: int
    #: The snapshot's reason: "nonfinite", "overflow", "spike", "divergence".
    reason: str
    #: The rank that wrote it under torch.distributed, else None.
    rank: int | None
    #: Whether every replay showed the anomaly again (see the module docstring).
    reproduced: bool
    #: Number of replays.
    repeats: int
    #: How many of them showed it.
    reproduced_runs: int
    #: Whether every replay that showed it found the same phase, module and operator.
    consistent: bool
    #: See the class docstring.
    cause: str
    #: "forward" or "backward": where the first non-finite value was made (None: none was), in the
    #: first replay that showed the anomaly (this and the fields down to ``output``).
    phase: str | None
    #: Qualified name of the module it was made in (for spikes: of the layer that grew most).
    module: str | None
    #: Class name of that module.
    module_type: str | None
    #: The first ATen operator that produced a non-finite value, e.g. "aten.log.default".
    op: str | None
    #: In the backward, the autograd node running that operator, e.g. "SqrtBackward0".
    node: str | None
    #: Whether the operator's tensor inputs were all finite (False: a non-finite leaf came in).
    inputs_finite: bool | None
    #: Statistics of the operator's first floating tensor inputs.
    inputs: tuple[TensorStats, ...]
    #: Statistics of its first non-finite output.
    output: TensorStats | None
    #: Whether the (first) replay's loss was finite.
    loss_finite: bool
    #: Attached entries holding non-finite values, e.g. ("inputs",) or ("batch[0]",).
    attached_nonfinite: tuple[str, ...]
    #: Snapshot parameters holding non-finite values.
    params_nonfinite: tuple[str, ...]
    #: The snapshot's pre-clip total gradient norm.
    snapshot_norm: float
    #: The (first) replay's total gradient norm (unscaled).
    replay_norm: float
    #: Parameters whose gradient in the snapshot is non-finite.
    snapshot_nonfinite_grads: tuple[str, ...]
    #: Parameters whose gradient in the (first) replay is non-finite.
    replay_nonfinite_grads: tuple[str, ...]
    #: The GradScaler's scale the replay backpropagated with (None: no scaler).
    scale: float | None
    #: With a scale: whether a replay without it had finite gradients (None: not run).
    unscaled_finite: bool | None
    #: Spikes: the parameter whose gradient grew most against the optimizer's history.
    layer: str | None
    #: Spikes: every parameter's growth, largest first.
    growth: tuple[LayerGrowth, ...] = field(default=())
    #: Spikes: why there is no growth (the optimizer keeps no history), else None.
    growth_missing: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain data (floats may be nan/inf; see :func:`clipopt._report.text.json_safe`)."""
        out: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, (TensorStats, LayerGrowth)):
                value = value.as_dict()
            elif isinstance(value, tuple):
                value = [v.as_dict() if isinstance(v, (TensorStats, LayerGrowth)) else v for v in value]
            out[name] = value
        return out


@dataclass(frozen=True)
class _Run:
    """One forward and backward of the replay."""

    loss_finite: bool
    nonfinite_grads: tuple[str, ...]
    norm: float
    origin: OpEvent | None  # the origin (or, without one, the first non-finite operator)
    first_in_model: OpEvent | None

    @property
    def event(self) -> OpEvent | None:
        """Where the first non-finite value was made; for one that came in from outside the model
        (the data, converted in ``loss_fn``), the first operator of the model that saw it."""
        origin = self.origin
        if origin is not None and origin.module is None and not origin.inputs_finite:
            return self.first_in_model or origin
        return origin


def replay(
    snapshot: str | os.PathLike[str] | Mapping[str, Any],
    model: nn.Module,
    loss_fn: Callable[[nn.Module, dict[str, Any]], Tensor],
    repeats: int = 3,
) -> ReplayResult:
    """Rerun a snapshot's forward and backward and say where it went non-finite (docs/replay.md).

    Args:
        snapshot: a snapshot file written by ``ClippedOptimizer(snapshot_dir=...)``
            (one rank's ``-rank<r>.pt`` file works without a process group), or
            what :func:`clipopt.load_snapshot` returned.
        model: the model that was trained (not wrapped in DDP), built the same
            way; the snapshot's parameters are loaded into it by name (a
            ``module.`` or ``_orig_mod.`` prefix of DDP or ``torch.compile`` is
            dropped).  Its parameters, buffers and ``.grad`` are put back
            afterwards.  Buffers (e.g. BatchNorm statistics) are the model's own:
            a snapshot does not hold them.
        loss_fn: ``loss_fn(model, attached)`` returns the loss (one element) of
            the snapshot's attached tensors (a fresh copy each time, on the CPU).
        repeats: how many times to replay (``reproduced`` means every time).

    Returns:
        a :class:`ReplayResult`.
    """
    _check_arguments(model, loss_fn, repeats)
    snap, file = _load(snapshot)
    targets = match_parameters(snap["params"], model)
    scale = _scale(snap)
    try:
        with _restored(model):
            _load_parameters(snap["params"], targets)
            runs = [_run(snap, model, loss_fn, targets, scale) for _ in range(repeats)]
            unscaled = None
            first = runs[0].event
            if scale is not None and first is not None and first.phase == "backward":
                unscaled = _run(snap, model, loss_fn, targets, None)
    except Exception as exc:  # loss_fn's own error: say where it happened
        if hasattr(exc, "add_note"):
            where = file or "a snapshot"
            exc.add_note(f"clipopt.replay: raised while replaying {where}; the model was restored")
        raise
    return _result(snap, file, runs, unscaled, scale, targets)


# ---------------------------------------------------------------------------- arguments and loading


def _check_arguments(model: Any, loss_fn: Any, repeats: Any) -> None:
    if not isinstance(model, nn.Module):
        raise ReplayTypeError(
            f"replay() got model={type(model).__name__}; pass the torch.nn.Module that was trained"
        )
    if not callable(loss_fn):
        raise ReplayTypeError(
            f"replay() got loss_fn={type(loss_fn).__name__}, which is not callable; "
            "pass a function loss_fn(model, attached) returning the loss"
        )
    if isinstance(repeats, bool) or not isinstance(repeats, int):
        raise ReplayTypeError(f"replay() got repeats={repeats!r}; pass a positive int, e.g. repeats=3")
    if repeats < 1:
        raise ReplayValueError(f"replay() got repeats={repeats}; pass a positive int, e.g. repeats=3")


def _load(snapshot: Any) -> tuple[dict[str, Any], str | None]:
    if isinstance(snapshot, (str, os.PathLike)):
        return load_snapshot(snapshot), os.fspath(snapshot)
    if isinstance(snapshot, Mapping):
        missing = [k for k in _NEEDED if k not in snapshot]
        if missing:
            raise ReplayValueError(
                f"replay() got a snapshot dict without {', '.join(missing)}; "
                "pass a path or what clipopt.load_snapshot() returned"
            )
        return dict(snapshot), None
    raise ReplayTypeError(
        f"replay() got snapshot={type(snapshot).__name__}; "
        "pass a snapshot path or what clipopt.load_snapshot() returned"
    )


def match_parameters(params: Mapping[str, Tensor], model: nn.Module) -> dict[str, tuple[str, nn.Parameter]]:
    """Snapshot name -> (model name, parameter); ``ValueError`` naming what does not match."""
    own = dict(model.named_parameters())
    if params and all(re.fullmatch(r"group\d+\.\d+", n) for n in params):
        raise ReplayValueError(
            "the snapshot's parameter names are positional (group<g>.<i>), so they cannot be matched "
            "to the model; train with ClippedOptimizer(..., param_names=model.named_parameters())"
        )
    out = {}
    for name, value in params.items():
        target = _strip(name, own)
        if target is None:
            shown = ", ".join(list(own)[:4]) + (", ..." if len(own) > 4 else "")
            raise ReplayValueError(
                f"the snapshot's parameter {name!r} is not in the model ({type(model).__name__}, whose "
                f"parameters are {shown or 'none'}); pass the model that was trained, built the same way"
            )
        if tuple(own[target].shape) != tuple(value.shape):
            raise ReplayValueError(
                f"the snapshot's parameter {name!r} has shape {tuple(value.shape)} but the model's "
                f"{target!r} has {tuple(own[target].shape)}; pass the model that was trained"
            )
        out[name] = (target, own[target])
    return out


def _strip(name: str, own: Mapping[str, Any]) -> str | None:
    while name not in own:
        prefix = next((p for p in _WRAPPER_PREFIXES if name.startswith(p)), None)
        if prefix is None:
            return None
        name = name[len(prefix) :]
    return name


def _scale(snap: Mapping[str, Any]) -> float | None:
    scale = snap.get("scale")
    if snap["reason"] != by_code(OVERFLOW).name or not isinstance(scale, (int, float)) or scale == 1.0:
        return None
    return float(scale)


@contextmanager
def _restored(model: nn.Module) -> Iterator[None]:
    """Put the model's parameters, buffers, gradients and training modes back on exit."""
    params = {n: (p, p.detach().clone(), p.grad) for n, p in model.named_parameters()}
    buffers = {n: (b, b.detach().clone()) for n, b in model.named_buffers()}
    modes = [(m, m.training) for m in model.modules()]
    try:
        yield
    finally:
        for m, training in modes:  # loss_fn may call model.eval() or model.train()
            m.training = training
        with torch.no_grad():
            for p, value, grad in params.values():
                p.copy_(value)
                p.grad = grad
            for b, value in buffers.values():
                b.copy_(value)


def _load_parameters(params: Mapping[str, Tensor], targets: Mapping[str, tuple[str, nn.Parameter]]) -> None:
    with torch.no_grad():
        for name, (_, p) in targets.items():
            p.copy_(params[name].to(device=p.device, dtype=p.dtype))


# ---------------------------------------------------------------------------- one replay


def _run(
    snap: Mapping[str, Any],
    model: nn.Module,
    loss_fn: Callable[..., Any],
    targets: Mapping[str, tuple[str, nn.Parameter]],
    scale: float | None,
) -> _Run:
    for p in model.parameters():
        p.grad = None
    tracker = ModuleTracker(model)
    watch = NonFiniteWatch(tracker)
    for buffer in model.buffers():
        if (buffer.is_floating_point() or buffer.is_complex()) and not all_finite(buffer):
            watch.follow(buffer)  # a -inf mask registered as a buffer
    attached = _copy(snap["attached"])
    with torch.random.fork_rng(), tracker.hooks(), watch:
        torch.manual_seed(0)  # every replay draws the same dropout masks
        try:
            out = loss_fn(model, attached)
        except (TypeError, AttributeError) as exc:
            message = micro_batch_message(snap, exc)
            if message is None:
                raise
            raise ReplayTypeError(message) from exc
        loss = _check_loss(out, targets)
        watch.phase = "backward"
        if loss.requires_grad:
            (loss if scale is None else loss * scale).reshape(()).backward()  # type: ignore[no-untyped-call]
    grads = {name: p.grad for name, (_, p) in targets.items() if p.grad is not None}
    bad = tuple(name for name, g in grads.items() if not all_finite(g))
    norm = math.sqrt(sum(float(g.detach().double().norm()) ** 2 for g in grads.values()))
    return _Run(
        loss_finite=all_finite(loss.detach()),
        nonfinite_grads=bad,
        norm=norm if scale is None else norm / scale,
        origin=watch.origin or watch.first_any,
        first_in_model=watch.first_in_model,
    )


def micro_batch_message(snap: Mapping[str, Any], exc: BaseException) -> str | None:
    """What to say when ``loss_fn`` fails on an accumulated window's attachments (lists of the
    window's micro-batches, where a loss function written for one micro-batch expects a tensor),
    else None (the error is ``loss_fn``'s own)."""
    count = snap.get("micro_batches")
    attached = snap["attached"] if isinstance(snap["attached"], dict) else {}
    lists = {name: v for name, v in attached.items() if isinstance(v, list)}
    if not (isinstance(count, int) and count > 1 and lists):
        return None
    name, first = next(iter(lists.items()))
    kinds = ", ".join(
        f"tensor {tuple(v.shape)}" if isinstance(v, Tensor) else type(v).__name__ for v in first[:3]
    )
    more = ", ..." if len(first) > 3 else ""
    names = ", ".join(repr(n) for n in lists)
    return (
        f"replay(): loss_fn raised {type(exc).__name__} ({exc}) on the attachments of a window that "
        f"accumulated {count} micro-batches: each attached name ({names}) is a list of the window's "
        f"micro-batches, e.g. attached[{name!r}] = [{kinds}{more}], not one batch; make loss_fn take "
        "the lists and return the mean of the micro-batch losses (as reduction='mean' averages the "
        f"gradients), e.g. torch.stack([one_batch_loss(model, {{k: v[i] for k, v in attached.items()}}) "
        f"for i in range({count})]).mean()"
    )


def _check_loss(loss: Any, targets: Mapping[str, tuple[str, nn.Parameter]]) -> Tensor:
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
        raise ReplayTypeError(
            f"replay(): loss_fn returned {what}; return the loss as a tensor with one element"
        )
    if not loss.requires_grad and any(p.requires_grad for _, p in targets.values()):
        raise ReplayValueError(  # its backward would give no gradient: every replay would read as transient
            "replay(): loss_fn returned a loss that does not require grad (detached, or computed under "
            "torch.no_grad()); return the loss whose backward gives the parameters' gradients"
        )
    return loss


def _copy(value: Any) -> Any:
    """A fresh copy of what ``attach`` received (loss_fn may change it in place)."""
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


# ---------------------------------------------------------------------------- the result


def _result(
    snap: Mapping[str, Any],
    file: str | None,
    runs: list[_Run],
    unscaled: _Run | None,
    scale: float | None,
    targets: Mapping[str, tuple[str, nn.Parameter]],
) -> ReplayResult:
    reason = str(snap["reason"])
    showed = [_showed(run, snap, reason) for run in runs]
    first = runs[0]
    where = {_where(r) for r, s in zip(runs, showed, strict=True) if s}
    # a replay that stays finite names no operator (an infinity made and absorbed on the way is harmless);
    # when only some did, the first of those says where
    shown = next((r for r, s in zip(runs, showed, strict=True) if s), None)
    event = shown.event if reason in NONFINITE_REASONS and shown is not None else None
    read = _snapshot_fields(snap)
    unscaled_finite = None if unscaled is None else not _showed(unscaled, snap, reason)
    growth, missing = layer_growth(snap) if reason == "spike" else ([], None)
    layer = growth[0].name if growth else None
    return ReplayResult(
        file=file,
        **read,
        reproduced=all(showed),
        repeats=len(runs),
        reproduced_runs=sum(showed),
        consistent=len(where) <= 1,
        cause=_overall_cause(snap, showed, event, read, unscaled_finite),
        **_where_fields(event, layer, targets),
        loss_finite=first.loss_finite,
        replay_norm=first.norm,
        replay_nonfinite_grads=first.nonfinite_grads,
        scale=scale,
        unscaled_finite=unscaled_finite,
        layer=layer,
        growth=tuple(growth),
        growth_missing=missing,
    )


def _snapshot_fields(snap: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`ReplayResult` fields read from the snapshot alone."""
    return {
        "step": int(snap["step"]),
        "reason": str(snap["reason"]),
        "rank": snap.get("rank"),
        "attached_nonfinite": tuple(nonfinite_entries(snap["attached"])),
        "params_nonfinite": tuple(n for n, t in snap["params"].items() if _has_nonfinite(t)),
        "snapshot_norm": float(snap["total_norm"]),
        "snapshot_nonfinite_grads": tuple(n for n, g in snap["grads"].items() if _has_nonfinite(g)),
    }


def _overall_cause(
    snap: Mapping[str, Any],
    showed: list[bool],
    event: OpEvent | None,
    read: Mapping[str, Any],
    unscaled_finite: bool | None,
) -> str:
    """:attr:`ReplayResult.cause` (``read``: :func:`_snapshot_fields`)."""
    reason = read["reason"]
    if snap.get("rank") is not None and reason not in NONFINITE_REASONS:
        return "averaged"  # the snapshot's norm is of the gradient averaged over the ranks
    attached_bad, params_bad = read["attached_nonfinite"], read["params_nonfinite"]
    return _cause(reason, all(showed), any(showed), event, attached_bad, params_bad, unscaled_finite)


def _where_fields(
    event: OpEvent | None, layer: str | None, targets: Mapping[str, tuple[str, nn.Parameter]]
) -> dict[str, Any]:
    """The fields that say where: the operator that made the first non-finite value, or for a spike
    the module of the layer that grew most."""
    fields = _event_fields(event)
    if layer is not None:
        fields.update(module=targets[layer][0].rpartition(".")[0], module_type=None)
    return fields


def _event_fields(event: OpEvent | None) -> dict[str, Any]:
    """The :class:`ReplayResult` fields that describe where the first non-finite value was made."""
    if event is None:
        return dict(
            phase=None,
            module=None,
            module_type=None,
            op=None,
            node=None,
            inputs_finite=None,
            inputs=(),
            output=None,
        )
    return dict(
        phase=event.phase,
        module=event.module,
        module_type=event.module_type,
        op=event.op,
        node=event.node,
        inputs_finite=event.inputs_finite,
        inputs=event.inputs,
        output=event.output,
    )


def _showed(run: _Run, snap: Mapping[str, Any], reason: str) -> bool:
    if reason in NONFINITE_REASONS:
        return not run.loss_finite or bool(run.nonfinite_grads)
    expected = float(snap["total_norm"])
    return math.isfinite(run.norm) and abs(run.norm - expected) <= NORM_RTOL * abs(expected)


def _where(run: _Run) -> tuple[str | None, str | None, str | None]:
    event = run.event
    return (None, None, None) if event is None else (event.phase, event.module, event.op)


def _cause(
    reason: str,
    reproduced: bool,
    any_showed: bool,
    event: OpEvent | None,
    attached_bad: tuple[str, ...],
    params_bad: tuple[str, ...],
    unscaled_finite: bool | None,
) -> str:
    if not reproduced:
        return "intermittent" if any_showed else "transient"
    if reason not in NONFINITE_REASONS:
        return "spike" if reason == "spike" else reason
    if params_bad:
        return "parameters"
    if attached_bad and (event is None or not event.inputs_finite):
        return "data"
    if unscaled_finite:
        return "loss-scale"
    if event is not None and event.inputs_finite and event.finite_in_float32:
        return "fp16-overflow"
    return "operation"


def nonfinite_entries(value: Any, name: str = "") -> list[str]:
    """Names of the attached entries (``inputs``, ``batch[0]``, ``batch['x']``) holding non-finite values."""
    if isinstance(value, Tensor):
        return [name] if _has_nonfinite(value) else []
    if isinstance(value, (list, tuple)):
        return [n for i, v in enumerate(value) for n in nonfinite_entries(v, f"{name}[{i}]")]
    if isinstance(value, Mapping):
        if not name:
            return [n for k, v in value.items() for n in nonfinite_entries(v, str(k))]
        return [n for k, v in value.items() for n in nonfinite_entries(v, f"{name}[{k!r}]")]
    return []


def _has_nonfinite(t: Any) -> bool:
    if not isinstance(t, Tensor) or not (t.is_floating_point() or t.is_complex()):
        return False
    return not all_finite(t)
