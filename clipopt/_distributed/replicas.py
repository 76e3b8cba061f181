"""One skip decision on every data-parallel replica; replica divergence; settings agreement.

Under DDP (or any data parallelism that leaves every rank a full, synchronised
copy of the gradients) each rank measures the norm of its own copy.  Should
one rank's copy change after the all-reduce (a buggy hook, silent data
corruption), the ranks would take different decisions and their replicas
drift apart.  :class:`ReplicaDecision` makes the decision common:

* **per window, one collective**: an ``all_reduce(MAX)`` of sixteen float64
  values — the non-finite indicator, ``norm`` and ``-norm`` (the largest and
  the smallest norm over the replicas), the packet kind and its negation, the
  loss (a SpikeGuard's), and the ranks' check (:mod:`clipopt._distributed.rank_check`:
  window index, micro-batch count, settings key, loaded-state checksum, a
  failed close).  Every rank then skips when any rank is
  non-finite, and skips with reason ``"divergence"`` when the replicas' norms
  differ by more than :data:`DIVERGENCE_RTOL` (relative) or when the ranks'
  checks differ (``flush()`` on some ranks only, window counters out of step,
  settings changed on some ranks, another checkpoint loaded).  Every rank
  continues with the same norm (the largest), so adaptive policies keep the
  same state everywhere.  Nothing is read to the host for this: the agreed
  flag feeds the fused optimizers' ``found_inf``.  The warning (divergence)
  and the error (ranks out of step) need the host value: it is read where the
  window reads the device anyway (the non-fused path, snapshots), otherwise at
  the next window's close (from an accelerator: :data:`LAG` windows later, the
  same window on every rank, so no rank is left waiting in a collective).
* **once, at the first** ``step()`` **or** ``no_sync()``: an ``all_reduce(MAX)``
  of the key of the settings record (:func:`settings_of`: the window settings,
  accumulation_steps, reduction, norm_type, ..., and every part's own
  ``settings()``: the policy, SpikeGuard, Rewind with its skip list, UpdateClip;
  :mod:`clipopt._distributed.agreement`), read to the host once; when the keys
  differ, every rank's record is gathered and every rank raises, naming each
  setting that differs, instead of drifting or hanging in a later collective.
  The key also rides in every window's check (below): a setting changed later
  on some ranks (a skip list given to ``rewind.batches()``) is named there.
* **per** ``flush()`` **call, one collective** (also when nothing is pending):
  the same packet with kind "flush", read to the host; ranks with different
  partial windows (uneven data at the end of an epoch) raise on every rank.
  A ``flush()`` on some ranks only is detected when the others' next
  collective is clipopt's; when it is the model's own gradient all-reduce
  the backend reports a collective mismatch (gloo aborts) or waits for its
  timeout (NCCL) — call ``flush()`` on every rank.

Under FSDP2 / tensor parallelism (DTensor parameters) the norm is already
reduced across the shard groups, so every rank holds the same norm and flag
and no per-window collective is added: the ranks' check rides in the norm's
reduction (``ShardedGrads.carry``), and its flag is the window's divergence.
The settings check runs once, and again after ``accumulation_steps`` changed
(the ranks' own collectives would no longer pair up before the next window).
After ``load_state_dict`` (:meth:`ReplicaDecision.loaded`) the next window's
check carries a checksum of the loaded state and of the parameters.
"""

from __future__ import annotations

import collections
import math
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from .._caller import user_stacklevel
from .agreement import Setting, compare, settings_record
from .rank_check import (
    MAX_SLOTS,
    MODULUS,
    CheckValues,
    Differ,
    decode,
    encode,
    mismatch,
    settings_key,
    state_checksum,
    tensor_checksum,
)

__all__ = ["DIVERGENCE_RTOL", "ReplicaDecision", "check_norm_group", "check_replica_group"]

#: Replicas whose synchronised gradient norms differ by more than this (relative to the
#: largest) have diverged.  Identical gradients give bit-identical norms on identical
#: hardware; the margin leaves room for different kernels on mixed hardware.
DIVERGENCE_RTOL = 1e-5

#: A check copied from an accelerator is read once this many more checks went out (see settle()).
LAG = 2

#: flag, norm, -norm, kind, -kind (0: window, 1: flush check), loss; then the check (rank_check.py)
_HEAD = 6
_PACKET = _HEAD + MAX_SLOTS


def check_replica_group(value: Any) -> Any:
    """``replica_group``: ``"auto"``, None, or a ``torch.distributed`` process group."""
    if value is None or value == "auto":
        return value
    dist = torch.distributed
    if dist.is_available() and isinstance(value, dist.ProcessGroup):
        return value
    raise TypeError(
        f"replica_group must be 'auto', None or a torch.distributed ProcessGroup, got "
        f"{value!r:.80} ({type(value).__name__}); pass replica_group='auto' (every rank of the default "
        "group holds a replica), a group from dist.new_group(...), or None (rank-local decisions)"
    )


def check_norm_group(value: Any) -> Any:
    """``norm_group``: None or a ``torch.distributed`` process group (pipeline stages)."""
    dist = torch.distributed
    if value is None or (dist.is_available() and isinstance(value, dist.ProcessGroup)):
        return value
    raise TypeError(
        f"norm_group must be a torch.distributed ProcessGroup or None, got {value!r:.80} "
        f"({type(value).__name__}); pass the group of the ranks holding the other parameters "
        "(pipeline stages), e.g. norm_group=dist.new_group(stage_ranks)"
    )


def _group_world(group: Any) -> int:
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return int(dist.get_world_size(group))


class ReplicaDecision:
    """The agreement of the skip decision across the replicas of ``replica_group`` (see module doc)."""

    def __init__(self, option: Any) -> None:
        self.option = option
        self._resolved = False
        self._group: Any = None
        self.active = False  # a group of more than one rank: settings check, and (plain tensors) agreement
        #: ``accumulation_steps`` when the settings check ran (None: not yet; it also runs, as a
        #: no-op, without replicas); under FSDP2 (``_sharded``) a change is checked again (see due()).
        self.checked_k: int | None = None
        self._sharded = False
        # reduced checks not read on the host yet, oldest first: (host copy, event or None, sequence
        # number, encoding ("ddp", "sum" or "max"), this rank's values)
        self._pending: collections.deque[tuple[Tensor, Any, int, str, CheckValues]] = collections.deque()
        self._sent = 0  # checks sent so far (the sequence number of the next)
        self._values: CheckValues | None = None  # this window's check values (prepare)
        self._settings: list[Setting] = []  # this window's settings, to name one that differs
        self._device: torch.device | None = None
        self._loaded: int | None = None  # checksum of the state dict loaded last, until a window carried it
        self._open = 0  # the window whose check went out and whose close has not ended (0: none)
        self.divergence: Tensor | None = None  # this window's divergence indicator (1.0/0.0)
        #: The largest window loss over the ranks (``nan``: none given), set by agree(loss=...).
        self.agreed_loss: Tensor | None = None
        self.warned_no_sync = False

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles resolve their group again (groups do not travel)."""
        option = self.option if self.option is None or isinstance(self.option, str) else "auto"
        return {"option": option}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state.get("option", "auto"))  # type: ignore[misc]

    def __deepcopy__(self, memo: dict[int, Any]) -> ReplicaDecision:
        return ReplicaDecision(self.option)  # same group object; resolved again on first use

    # ------------------------------------------------------------------ group

    def resolve(self) -> bool:
        """Decide once (at the first step() or no_sync()) whether this optimizer has replicas."""
        if not self._resolved:
            self._resolved = True
            dist = torch.distributed
            if self.option is None or not (dist.is_available() and dist.is_initialized()):
                self.active = False
            else:
                self._group = None if self.option == "auto" else self.option
                self.active = _group_world(self._group) > 1
        return self.active

    @property
    def group(self) -> Any:
        """The replicas' process group once resolved (None: the default group)."""
        return self._group

    @property
    def process_group(self) -> Any:
        """The replicas' process group object once resolved and active (the default group's own
        object where :attr:`group` is None), else None: what a part sees (``Window.replica_group``)."""
        if not self.active:
            return None
        return torch.distributed.group.WORLD if self._group is None else self._group

    # ------------------------------------------------------------------ settings: once, and per change

    def due(self, accumulation_steps: int) -> bool:
        """Whether step()/no_sync() must run the settings check first: before the first window, and
        under FSDP2 after ``accumulation_steps`` changed (the ranks' own collectives would no longer
        pair up before the next window's check; DDP's agreement packet finds it)."""
        return self.checked_k is None or (self._sharded and accumulation_steps != self.checked_k)

    def check_settings(self, settings: list[Setting], params: list[Tensor], sharded: bool) -> None:
        """Raise on every rank when the ranks' settings records differ (:func:`settings_of`),
        naming each setting that differs: one small collective, two more only then (on the
        device of ``params``; none: nothing to compare yet)."""
        if not params:
            return
        self.checked_k = int(dict(settings)["accumulation_steps"])  # type: ignore[call-overload]
        self._sharded = sharded
        if self.resolve():
            self._compare_settings(settings, params[0].device)

    def _compare_settings(self, settings: list[Setting], device: torch.device) -> None:
        bad = compare(settings, settings_key(settings), device, self._group)
        if bad:
            raise RuntimeError(
                "ClippedOptimizer settings differ across the ranks of the replica group: "
                + ", ".join(bad)
                + "; build the optimizer with the same settings on every rank, change them on every "
                "rank alike (and resume every rank from the same checkpoint step), or pass "
                "replica_group=None if the ranks train independent models"
            )

    # ------------------------------------------------------------------ the state, after a load

    def loaded(self, state_dict: dict[str, Any], own: frozenset[str] = frozenset()) -> None:
        """After ``load_state_dict``: the checksum of what every rank must hold alike, carried by the
        next window's check (no collective here).  Left out: what is each rank's own (an open
        window's gradients and loss, the unsynced marker, DTensor shards, the parts' entries named
        in ``own``: a Rewind's copies)."""
        dist = torch.distributed  # not resolve(): a load may come before init_process_group
        if self.option is not None and dist.is_available() and dist.is_initialized():
            entry = {k: v for k, v in (state_dict.get("clipopt") or {}).items() if k not in _RANK_OWN | own}
            inner = {k: v for k, v in state_dict.items() if k != "clipopt"}
            self._loaded = state_checksum([inner, entry])

    # ------------------------------------------------------------------ per window

    def prepare(
        self, params: list[Tensor], norm_group: Any, settings: list[Setting], shards: Any, n: int, window: int
    ) -> None:
        """Before a window's norm: read the checks due, then this rank's values for this window's
        check (``settings``: :func:`settings_of`, compared as one key); under FSDP2 (``shards``)
        they ride in the norm's own reduction (``shards.carry``).  Called only when :attr:`active`."""
        self.settle(self._sent)
        self._device = params[0].device
        # pipeline stages (norm_group) hold different parameters and state: counters and settings only
        state: int | Tensor | None = self._loaded if norm_group is None else None
        if state is not None:  # the parameters as they are now (a model loaded after us included)
            found = tensor_checksum(params, self._device)
            state = state if found is None else (found + state).remainder(MODULUS)
        self._settings = settings
        self._values = CheckValues(window, n, settings_key(settings), state, failed=self._open)
        self._open = window
        if shards is not None:
            shards.carry = self

    def encode(self, summed: bool, device: torch.device) -> Tensor:
        """This window's check, as entries of the norm's reduction (SUM when ``summed``, else MAX)."""
        return encode(self._values or CheckValues(0, 0, 0), summed, device)

    def receive(self, reduced: Tensor, summed: bool) -> None:
        """The check's entries after the norm's reduction: the skip flag now, the message later."""
        self.divergence = mismatch(reduced, summed)
        self._send(reduced, "sum" if summed else "max", self._values or CheckValues(0, 0, 0))

    def _send(self, reduced: Tensor, kind: str, values: CheckValues) -> None:
        self._pending.append((*self._to_host(reduced), self._sent, kind, values))
        self._sent += 1

    def agree(
        self, total_norm: Tensor, flag: Tensor, n: int, window: int, loss: Tensor | float | None = None
    ) -> tuple[Tensor, Tensor]:
        """One collective: the common ``(norm, flag)`` of this window; sets :attr:`divergence`.

        With ``loss`` (a SpikeGuard watching the loss) the same collective also
        finds the largest window loss over the ranks: :attr:`agreed_loss`
        (``nan`` when no rank gave one).
        """
        dist = torch.distributed
        values = self._values if self._values is not None else CheckValues(window, n, 0)
        norm64 = total_norm.detach().to(torch.float64)
        finite = torch.nan_to_num(norm64, nan=0.0, posinf=0.0, neginf=0.0)
        head = torch.stack([flag.to(torch.float64), finite, -finite, finite * 0.0, finite * 0.0])
        packet = torch.cat([head, _loss_slot(loss, norm64).reshape(1), encode(values, False, norm64.device)])
        dist.all_reduce(packet, op=dist.ReduceOp.MAX, group=self._group)
        self.agreed_loss = torch.where(packet[5] == -math.inf, math.nan, packet[5])
        any_bad = packet[0] > 0
        high, low = packet[1], -packet[2]
        out_of_step = (packet[3] != -packet[4]) | (mismatch(packet[_HEAD:], False) > 0)
        spread = (high - low) > DIVERGENCE_RTOL * high
        self.divergence = ((spread & ~any_bad) | out_of_step).to(torch.float32)
        nan = torch.full_like(total_norm, math.nan)
        common = torch.where(any_bad, nan, high.to(total_norm.dtype))
        norm = torch.where(flag > 0, total_norm, common)  # a non-finite rank keeps its own nan/inf
        self._send(packet, "ddp", values)
        return norm, any_bad.to(torch.float32)

    def agree_loss(self, loss: Tensor | float | None, device: torch.device) -> Tensor:
        """The largest window loss over the ranks (``nan``: none given), in one scalar collective.

        For DTensor (FSDP2) parameters, where the norm is already common and no
        per-window packet runs, but a SpikeGuard scores the (rank-local) loss.
        """
        dist = torch.distributed
        value = _loss_slot(loss, torch.empty((), device=device))
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self._group)
        return torch.where(value == -math.inf, math.nan, value)

    def end_window(self, host_read: bool) -> None:
        """Forget this window's device values; check its outcome now when the window read the host."""
        self.divergence = None
        self.agreed_loss = None
        if self._values is not None and self._values.state is not None:
            self._loaded = None  # carried: the next windows compare the counters and settings only
        self._values = None
        self._open = 0
        if host_read:
            self.settle(None)

    def settle(self, now: int | None) -> None:
        """Warn about divergence / raise on ranks out of step, for the checks not read yet.

        ``now=None`` reads every one.  Otherwise (``now``: the checks sent so far) a check whose
        values are on the host already (CPU) is read, and one copied from an accelerator once
        :data:`LAG` more checks went out (its copy has long arrived: the wait is no stall).  The
        rule depends on the sequence only, so every rank raises at the same window and none is
        left waiting in a collective.
        """
        while self._pending:
            host, event, sent, kind, values = self._pending[0]
            if now is not None and event is not None and now - sent < LAG:
                return
            if event is not None:
                event.synchronize()
            self._pending.popleft()
            self._check(host.tolist(), kind, values)

    def _check(self, host: list[float], kind: str, values: CheckValues) -> None:
        check = host[_HEAD:] if kind == "ddp" else host
        if kind == "ddp" and host[3] != -host[4]:
            raise RuntimeError(_FLUSH_ON_SOME)
        differ, failed = decode(check, values, kind == "sum")
        names = {d.name: d for d in differ}
        if "window" in names or "micro-batches" in names:
            raise RuntimeError(_out_of_step(values, names, failed, kind == "sum"))
        if "settings" in names:
            if self._device is not None:
                self._compare_settings(self._settings, self._device)  # names the settings: raises
            raise RuntimeError(_SETTINGS_CHANGED.format(window=values.window))  # none named
        if "state" in names:
            state = names["state"]
            raise RuntimeError(
                _STATE_DIFFERS.format(window=values.window, ranks=state.ranks, mine=state.mine)
            )
        low, high = -host[2], host[1]
        if kind == "ddp" and host[0] == 0 and high - low > DIVERGENCE_RTOL * high:
            warnings.warn(
                f"clipopt: the data-parallel replicas' synchronised gradient norms differ at window "
                f"{values.window} (from {low:.9g} to {high:.9g}): a rank's gradients changed after the "
                "gradient all-reduce (a buggy hook or silent data corruption); the update was skipped on "
                "every rank (reason 'divergence'). If the ranks train independent models, pass "
                "replica_group=None",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )

    def check_flush(self, n: int, window: int, device: torch.device) -> None:
        """At every ``flush()``: raise on every rank when the ranks' partial windows differ.

        One collective and one host read per ``flush()`` call (not per window).
        """
        if not self.resolve():
            return
        self.settle(None)
        dist = torch.distributed
        values = [0.0, 0.0, 0.0, 1.0, -1.0, -math.inf, window, -window, n, -n]
        values += [-math.inf] * (_PACKET - len(values) - 2) + [0.0, 0.0]  # settings, state; failed
        packet = torch.tensor(values, dtype=torch.float64).to(device)
        dist.all_reduce(packet, op=dist.ReduceOp.MAX, group=self._group)
        _, _, _, k_hi, k_lo, _, w_hi, w_lo, n_hi, n_lo = packet[:10].tolist()
        if k_hi != -k_lo:
            raise RuntimeError(_FLUSH_ON_SOME)
        if n_hi != -n_lo or w_hi != -w_lo:
            raise RuntimeError(
                f"flush() found different partial windows on the ranks of the replica group: this rank "
                f"has {n} micro-batches pending in window {window}, the ranks from {_fmt(-n_lo)} to "
                f"{_fmt(n_hi)} (windows {_fmt(-w_lo)} to {_fmt(w_hi)}); give every rank the same number "
                "of micro-batches (e.g. DistributedSampler(drop_last=True)) and call flush() on every rank"
            )

    @staticmethod
    def _to_host(packet: Tensor) -> tuple[Tensor, Any]:
        if packet.device.type == "cpu":
            return packet, None
        if packet.device.type == "cuda":
            host = torch.empty(packet.shape, dtype=packet.dtype, pin_memory=True)
            host.copy_(packet, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
            return host, event
        return packet, None  # other devices: read (and so waited for) when settled


#: "clipopt" entries that are each rank's own under data parallelism (not compared after a load)
_RANK_OWN = frozenset({"pending_grads", "loss_sum", "loss_count", "unsynced"})

_FLUSH_ON_SOME = (
    "flush() was called on some ranks of the replica group only: one rank's flush() met another "
    "rank's window; call flush() on every rank (it is collective under data parallelism)"
)

_SETTINGS_CHANGED = (
    "ClippedOptimizer settings differ across the ranks of the replica group at window {window}: the "
    "keys of the ranks' settings differ but no setting could be named; build the optimizer and change "
    "its settings alike on every rank; the window was skipped on every rank"
)

_STATE_DIFFERS = (
    "the ranks of the replica group hold different training states at window {window}, the first after "
    "load_state_dict: the checksums of the parameters and of the loaded optimizer state differ ({ranks}; "
    "this rank: {mine}); "
    "a rank loaded another run's checkpoint or another step's; load the same checkpoint on every rank "
    "(under FSDP2 each rank's file of the same save); the window was skipped on every rank"
)


def _out_of_step(values: CheckValues, names: dict[str, Differ], failed: int, summed: bool) -> str:
    """The message for ranks at different windows, naming the cause the values point at."""
    n, window = values.micro_batches, values.window
    where = f"this rank closed window {window} after {n} micro-batches"
    if "window" not in names:
        ranks = names["micro-batches"].ranks
        ranks = (
            f"ranks' micro-batches: {ranks}"
            if summed
            else f"ranks windows {window} to {window} after {ranks}"
        )
        return (
            f"the ranks of the replica group closed different accumulation windows: {where}, the {ranks}"
            f"{'' if summed else ' micro-batches'}; call flush() on every rank (it is collective under "
            "data parallelism) and give every rank the same accumulation_steps; the window was skipped on "
            "every rank"
        )
    ranks = names["window"].ranks
    cause = "a rank loaded a checkpoint of another step, or skipped a window the others closed"
    if failed:
        if summed:
            who = ", this one among them" if values.failed else ""
            cause = f"a window's close raised on {failed} rank(s){who} after the ranks had agreed on it"
        else:
            who = "this rank" if values.failed else "another rank"
            cause = f"the close of window {failed} raised on {who} after the ranks had agreed on it"
        cause += (
            " (e.g. an error in the inner optimizer's step, caught by the training loop): that rank rolled "
            "the window back while the others applied it, so the replicas differ now"
        )
    return (
        f"the window counters of the ranks of the replica group differ: {where}, the ranks' windows: "
        f"{ranks}; {cause}; the window was skipped on every rank; resume every rank from the same "
        "checkpoint"
    )


def _loss_slot(loss: Tensor | float | None, packet: Tensor) -> Tensor:
    """The packet's loss entry: the loss as float64, ``-inf`` when absent or ``nan`` (MAX ignores it)."""
    if not isinstance(loss, Tensor):  # None or a float: a fill on the device, no host-to-device copy
        v = -math.inf if loss is None or math.isnan(float(loss)) else float(loss)
        return torch.full((), v, dtype=torch.float64, device=packet.device)
    value = loss.detach().to(packet.device, torch.float64).reshape(())
    return torch.where(torch.isnan(value), -math.inf, value)


def _fmt(v: float) -> str:
    return f"{v + 0.0:g}"  # no "-0"


def settings_of(
    c: Mapping[str, Any],
    counters: tuple[int, int],
    groups: list[dict[str, Any]],
    parts: Iterable[tuple[str, object]],
) -> list[Setting]:
    """What every replica must share: the wrapper's own settings by name ``c`` (numbers, ``-1``:
    off/None; ``max_norm`` ``-2``: a policy), its ``counters`` (windows closed, micro-batches
    pending) and its ``groups``' clipping options, then each of ``parts`` (``(keyword, part)``) with
    its own ``settings()`` record (:mod:`clipopt._distributed.agreement`)."""
    bound = c["max_norm"]  # a float, a ClipPolicy or None
    max_norm = -1.0 if bound is None else float(bound) if isinstance(bound, (int, float)) else -2.0
    core: list[Setting] = [
        ("accumulation_steps", float(c["accumulation_steps"])),
        ("reduction", 0.0 if c["reduction"] == "mean" else 1.0),
        ("norm_type", float(c["norm_type"])),
        ("max_norm", max_norm),
        ("clip_value", -1.0 if c["clip_value"] is None else float(c["clip_value"])),
        ("skip_nonfinite", float(c["skip_nonfinite"])),
        ("scaler", float(c["scaler"] is not None)),
        ("windows closed", float(counters[0])),
        ("micro_batches pending", float(counters[1])),
        *_group_settings(groups),
    ]
    return settings_record(core, parts)


def _group_settings(groups: list[dict[str, Any]]) -> list[Setting]:
    """The per-group ``max_norm``/``clip_value`` of every group as two checksums (a fixed count of
    settings, whatever the number of groups): absent -3, None -1, else the value, weighted by index."""

    def code(group: dict[str, Any], key: str) -> float:
        if key not in group:
            return -3.0
        value = group[key]
        return -1.0 if value is None else float(value) if isinstance(value, (int, float)) else -4.0

    return [
        (f"per-group {key}", sum((g + 1) * code(group, key) for g, group in enumerate(groups)))
        for key in ("max_norm", "clip_value")
    ]
