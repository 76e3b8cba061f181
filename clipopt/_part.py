"""The part protocol: one optional feature of the wrapper, with its whole contract in one class.

:class:`Part` is the protocol, :class:`Window` what a part sees of a window, :class:`Parts` the
active parts of one wrapper, built from the constructor's keywords by ``_config.REGISTRY`` (one
line per part: adding a feature is one new module plus that line, ARCHITECTURE.md).

A *part* is what one keyword argument of :class:`~clipopt.ClippedOptimizer` builds (``spike_guard=``,
``rewind=``, ``update_clip=``, ``qk_clip=`` ...).  Its class states, in one place:

* **its settings**: :meth:`Part.build` checks the keyword's value -- in the constructor and when the
  keyword is assigned mid-run, before anything changes -- and returns the part, or None (off);
* **its stage**: the hooks it overrides (:class:`Part`'s methods, listed in the order a window
  runs them); the parts run each hook in the registry's order, never in
  the order a user listed them (``_config.REGISTRY``);
* **what it decides**: a skip flag (:meth:`Part.flag`, with its reason :attr:`Part.code`), a
  discarded window (:meth:`Part.begin`), a rejected or bounded update (:meth:`Part.after_step`);
* **its commit and undo**: :meth:`Part.commit` runs once the window's outcome stands; a part
  whose state a failed close must put back lists it in :meth:`Part.undo_state`;
* **its state-dict entry**: under its :attr:`Part.keyword` in the ``"clipopt"`` entry, checked
  completely by :meth:`Part.check_state` before :meth:`Part.load_state` changes anything; keyed
  by the inner optimizer's own indices or by parameter identity, never by a position in a flat
  list of parameters;
* **what the ranks compare**: :meth:`Part.settings`, put into the ranks' agreement for every
  part (:mod:`clipopt._distributed.agreement`).

A part reads the window through :class:`Window` (values, never the wrapper) and records host
numbers or 0-d device tensors into the window's cells (``StepStats.recovery``, read as
``stats.<column>``).  An *observer* (:attr:`Part.observer`) only records: the parameters are
bit-identical with and without it (tests/window/test_observing.py checks each one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = ["Part", "Parts", "Window", "outcome_flag"]

_T = TypeVar("_T")


@dataclass
class Window:
    """What a part sees of the window being closed: values, never the wrapper."""

    number: int  #: this window's number, counted from 1
    micro_batches: int  #: the micro-batches it combines
    params: list[Tensor]  #: every parameter, in group order
    inner: Optimizer  #: the inner optimizer (several: one ``InnerOptimizers``)
    settings: Any  #: the window's :class:`~clipopt._window.settings.WindowSettings`
    closure: Callable[[], Any] | None = None  #: ``step()``'s closure, or None
    #: The ranks' process group under data parallelism (DDP/FSDP2 replicas), or None.
    replica_group: Any = None
    #: The window's cells for its ``StepStats`` (``StepStats.recovery``), by column name.
    cells: dict[str, Any] = field(default_factory=dict)
    #: Whether the ranks are data-parallel replicas (``replica_group`` None is then the default group).
    replicated: bool = False
    #: What the active parts share (:attr:`Part.shares`), by class: kept from window to window.
    shared: Mapping[type, Any] = field(default_factory=dict)
    #: Stage 2: the window's loss as the data-parallel ranks agreed it (the largest over them, the
    #: same on each) when a part reads it (:meth:`Part.agrees_loss`); None: the decision's ``d.loss``.
    agreed_loss: Tensor | None = None
    #: What a Rewind copy holds beside the parameters (``_window.held.Held``); None unless a part
    #: takes copies (:attr:`Part.takes_copies`).
    held: Any = None


def outcome_flag(skipped: bool | Tensor, device: torch.device) -> Tensor:
    """A window's outcome (``skipped``: a bool, or a 0/1 device flag) as a float32 0/1 tensor on
    ``device``; a bool becomes a fill on the device (no host-to-device copy), a flag is not read."""
    if isinstance(skipped, Tensor):
        return skipped.to(device, torch.float32)
    return torch.full((), float(skipped), dtype=torch.float32, device=device)


class Part:
    """The base of every part: each hook does nothing until a part overrides it.

    The hooks, in the order a window's close runs them (docs/design.md, 'Order of operations'):

    ========================  =======================================================
    :meth:`before_closure`    ``step(closure)``: before each micro-batch's closure runs
    :meth:`begin`             before the window is combined (may discard it)
    :meth:`diagnose`          stage 3, the pre-clip gradients (observers)
    :meth:`flag`              stage 5, a skip signal after the built-in ones
    :meth:`rerun`             after stage 5: execute the window again, decide again
    :meth:`step_context`      stage 6, around the inner step
    :meth:`before_step`       stage 6, just before the inner step
    :meth:`after_step`        stage 6, just after it (may reject or bound the update)
    :meth:`commit`            the outcome stands (applied or skipped)
    :meth:`record`            stage 7, the window's cells
    :meth:`report`            stage 7, the window's ``StepStats`` to the loggers
    :meth:`logged`            stage 7, the window's ``StepStats`` once built
    ========================  =======================================================
    """

    #: The constructor's keyword that builds it; also its state-dict entry's key and the prefix of
    #: its settings' names in the ranks' agreement.
    keyword: ClassVar[str] = ""
    #: The reason code recorded when :meth:`flag` is the first signal that skips a window.
    code: ClassVar[int] = 0
    #: It only records: the run is bit-identical without it.
    observer: ClassVar[bool] = False
    #: The columns its cells may hold (``_log_names``), for the loggers' headers.
    columns: ClassVar[tuple[str, ...]] = ()
    #: What ``opt.<keyword>`` reads while the part is off (``update_stats``: False).
    off: ClassVar[Any] = None
    #: The class of what it shares with the other active parts naming the same class (the update's
    #: copy of ``UpdateClip`` and ``update_stats``): one instance (``shares()``) for all of them, made
    #: when the first of them is on, kept from window to window and across assignments while one is,
    #: dropped when none is; a hook finds it in ``w.shared[shares]``.  None: nothing.
    shares: ClassVar[type | None] = None
    #: Its :meth:`record` runs for an empty or discarded window too (else for measured ones only).
    records_unmeasured: ClassVar[bool] = False
    #: Its state-dict entry is each data-parallel rank's own (a Rewind's copies of its shards): left
    #: out of the ranks' comparison of a loaded state.
    rank_own: ClassVar[bool] = False

    # ------------------------------------------------------------------ settings

    @classmethod
    def build(cls, value: Any, inner: Optimizer) -> Part | None:
        """The part the keyword's ``value`` builds for ``inner``, or None when it is off; raises the
        ``TypeError``/``ValueError`` that names the keyword, the value and the fix.  Called by the
        constructor and by an assignment mid-run, before anything changes."""
        return cls.checked(value, cls)

    #: For the keyword's ``TypeError``: what it takes (default ``"a <class>"``) and a value to pass
    #: (default ``"<class>()"``).
    takes: ClassVar[str] = ""
    example: ClassVar[str] = ""

    @classmethod
    def checked(cls, value: Any, kind: type[_T]) -> _T | None:
        """``value`` when it is None or a ``kind`` (the class a user passes); else the ``TypeError``
        that names the keyword, the value's type and what to pass."""
        if value is None or isinstance(value, kind):
            return value
        takes, example = cls.takes or f"a {kind.__name__}", cls.example or f"{kind.__name__}()"
        raise TypeError(
            f"{cls.keyword} must be {takes} or None, got {type(value).__name__}; "
            f"pass e.g. {cls.keyword}={example}"
        )

    def value(self) -> Any:
        """What ``opt.<keyword>`` returns: the object the user passed (by default the part itself)."""
        return self

    @classmethod
    def unset(cls) -> Any:
        """What ``opt.<keyword>`` returns while the part is off: :attr:`off` by default
        (``update_stats``: False; ``layer_stats``: 0)."""
        return cls.off

    def settings(self) -> Mapping[str, object]:
        """What every data-parallel rank must share, by name (each name starts with the keyword)."""
        return {}

    def plain(self, window: int) -> bool:
        """Whether window number ``window`` may close as a plain window with this part on (a part
        that does nothing at that window); False by default."""
        return False

    def check_with(self, active: Mapping[str, Part], max_norm: Any) -> None:
        """``ValueError`` unless it can run beside the ``active`` parts (by keyword, itself included)
        and the wrapper's ``max_norm`` (a bound or a clip policy); called by the constructor and
        when a part or ``max_norm`` is assigned mid-run, before anything changes."""

    def describe(self) -> str | None:
        """Its text in the wrapper's ``repr``: ``keyword=value`` (None: not shown, an observer's)."""
        return None if self.observer else f"{self.keyword}={self.value()!r}"

    def agrees_loss(self) -> bool:
        """Whether it reads the window's loss as the ranks agree it (:attr:`Window.agreed_loss`):
        under data parallelism the ranks then agree on the loss in stage 2."""
        return False

    # ------------------------------------------------------------------ the window's hooks

    def before_closure(self, closure: Callable[[], Any], index: int, window: int) -> None:
        """``step(closure)``: just before the wrapper runs ``closure``, the closure of micro-batch
        ``index`` of the open window, number ``window`` (``index`` 0: its first; with
        ``accumulation_steps > 1`` the earlier ones were given to earlier ``step()`` calls).  Not
        called for a micro-batch without a closure."""

    def begin(self, w: Window) -> int | None:
        """Before the window is combined: a reason code to discard the window (its gradients are
        dropped and it is recorded as skipped with that reason), or None."""
        return None

    def diagnose(self, w: Window, d: Any) -> None:
        """Stage 3: the pre-clip gradients and the decision's norms (``d``: ``WindowDecision``)."""

    def is_spike(self, w: Window, d: Any) -> Tensor | None:
        """Stage 3: its spike rule for the window as a 0/1 device flag, remembering nothing (the
        anomaly snapshots' spike), or None: it has no spike rule."""
        return None

    def flag(self, w: Window, d: Any) -> Tensor | None:
        """Stage 5: a 0/1 float tensor on the device (never read on the host) that skips the
        window with reason :attr:`code`, or None (no opinion)."""
        return None

    def rerun(self, w: Window, d: Any) -> list[Any] | None:
        """After stage 5 (decide), before anything is applied: None to go on, or the return values of
        the window's closures executed again by the part (the gradients recomputed).  The wrapper
        then puts back what deciding changed (the clip policy's state) and decides again from
        stage 1 (combine), with the window's loss taken from those values; :meth:`begin` is not
        called again, and this hook is called again with the new decision.  A part that reruns
        must return None on that second call."""
        return None

    def step_context(self, w: Window) -> AbstractContextManager[Any]:
        """Stage 6: a context the inner step runs in (e.g. a learning-rate cut)."""
        return nullcontext()

    def host_step(self, w: Window) -> bool:
        """Whether this window's inner step must take the host path (its outcome read on the host)."""
        return False

    def before_step(self, w: Window, d: Any) -> None:
        """Stage 6: just before the inner step runs, or the window is skipped."""

    def after_step(self, w: Window, d: Any, skipped: bool | Tensor) -> bool | Tensor:
        """Stage 6: just after the inner step: the window's outcome, possibly changed (an update put
        back is skipped)."""
        return skipped

    def commit(self, w: Window, d: Any, skipped: bool | Tensor) -> None:
        """The window's outcome stands (``skipped``: a bool, or a 0/1 device flag)."""

    def closed(self, windows: int) -> None:
        """Window number ``windows`` has closed, applied, skipped, empty or discarded (after
        :meth:`commit` when the window was measured)."""

    def record(self, w: Window) -> None:
        """Stage 7: put this window's cells into ``w.cells`` (host numbers or 0-d device tensors)."""

    def report(self, stats: Any, optimizer: Any) -> None:
        """Stage 7: hand the window's ``StepStats`` to objects of the user's that take the wrapper
        (``optimizer``; None once it is gone), before anything else reads the record: the loggers'
        ``log(stats, optimizer)``.  Called for every window, plain ones included."""

    def logged(self, stats: Any) -> None:
        """Stage 7: the window's ``StepStats`` is built."""

    def close(self) -> None:
        """``opt.close()``: flush and release what the part holds open."""

    def configure(self, diagnostics: Any) -> None:
        """Say what stage 3 (diagnose) does for this part: an observer sets its fields of the
        runtime's :class:`~clipopt._window.diagnose.Diagnostics` (called whenever the parts change,
        after they were all reset)."""

    # ------------------------------------------------------------------ undo and checkpoints

    def undo_state(self) -> Any:
        """What a failed close must put back (taken before the close); None: nothing."""
        return None

    def restore_undo(self, saved: Any) -> None:
        """Put back what :meth:`undo_state` returned."""

    def state_dict(self) -> Any:
        """Its entry in the ``"clipopt"`` entry of the state dict; None: it has none."""
        return None

    def check_state(self, saved: Any, inner: Optimizer) -> Any:
        """``ValueError`` (changing nothing) unless ``saved`` (its entry of a state dict, never None)
        can be loaded; returns what :meth:`load_state` takes."""
        return saved

    def load_state(self, checked: Any) -> None:
        """Load what :meth:`check_state` returned."""

    def check_held(self, checked: Any, check: Callable[[Any], None]) -> None:
        """A part whose state holds copies of the held training state (a Rewind's copies): run
        ``check`` (``ValueError``) on each copy's held state in ``checked`` (what
        :meth:`check_state` returned)."""

    #: Whether a Rewind copy holds its state (training state, not a record): its
    #: :meth:`state_dict` is copied along and loaded back (:meth:`load_state`) at a rewind.
    held: ClassVar[bool] = False
    #: Whether it takes copies of the training state (a Rewind): only then does a window build what
    #: a copy holds beside the parameters (:attr:`Window.held`).
    takes_copies: ClassVar[bool] = False


class _Flag:
    """A part's skip signal as the decision's ``SkipSource`` (``_window.decision``)."""

    __slots__ = ("_part", "_window", "code")

    def __init__(self, part: Part, window: Window) -> None:
        self.code, self._part, self._window = part.code, part, window

    def flag(self, d: Any) -> Tensor | None:
        return self._part.flag(self._window, d)


class Parts:
    """The active parts of one wrapper, in registry order; built from the constructor's keywords."""

    def __init__(
        self,
        registry: Sequence[type[Part]],
        parts: Mapping[str, Part],
        shared: Mapping[type, Any] | None = None,
        unset: Mapping[str, Any] | None = None,
    ) -> None:
        #: Every part class, in the order their hooks run (``_config.REGISTRY``).
        self.registry = tuple(registry)
        self._by_keyword = {c.keyword: parts[c.keyword] for c in self.registry if c.keyword in parts}
        #: The active parts, in the order their hooks run.
        self.active: tuple[Part, ...] = tuple(self._by_keyword.values())
        #: What they share (:attr:`Part.shares`), by class: ``shared``'s (the parts before an
        #: assignment) kept, a new one made for a class no part shared before.
        self.shared: dict[type, Any] = {}
        for p in self.active:
            kind = p.shares
            if kind is not None and kind not in self.shared:
                self.shared[kind] = shared[kind] if shared and kind in shared else kind()
        #: Whether an active part takes copies (:attr:`Part.takes_copies`): a window then builds
        #: what a copy holds (:attr:`Window.held`).
        self.take_copies = any(p.takes_copies for p in self.active)
        #: The active parts that override :meth:`Part.report` (read at every window: no call).
        self.reporting = tuple(p for p in self.active if type(p).report is not Part.report)
        #: What ``opt.<keyword>`` read for the parts that are off (:meth:`Part.unset`), kept: the
        #: same object at every read (a list stays the same list).
        self._unset: dict[str, Any] = {k: v for k, v in (unset or {}).items() if k not in self._by_keyword}

    @classmethod
    def build(cls, registry: Sequence[type[Part]], options: Mapping[str, Any], inner: Optimizer) -> Parts:
        """Each part of ``registry`` from its keyword in ``options`` (absent: off); an unknown keyword
        is a ``TypeError`` naming it and the keywords there are."""
        known = {c.keyword for c in registry}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"ClippedOptimizer() got an unexpected keyword argument {unknown[0]!r}; "
                f"the parts it takes are {', '.join(sorted(known)) or '(none)'}"
            )
        built: dict[str, Part] = {}
        for part_cls in registry:
            part = part_cls.build(options.get(part_cls.keyword), inner)
            if part is not None:
                built[part_cls.keyword] = part
        return cls(registry, built)

    def __iter__(self) -> Iterator[Part]:
        return iter(self.active)

    def __bool__(self) -> bool:
        return bool(self.active)

    def value(self, keyword: str) -> Any:
        """What ``opt.<keyword>`` returns: the part's value, or its class's :attr:`Part.off` (None)."""
        part = self._by_keyword.get(keyword)
        if part is not None:
            return part.value()
        if keyword not in self._unset:
            self._unset[keyword] = next(c for c in self.registry if c.keyword == keyword).unset()
        return self._unset[keyword]

    def assigned(self, keyword: str, value: Any, inner: Optimizer) -> Parts:
        """The parts with ``keyword`` set to ``value`` mid-run: checked as the constructor checks it
        (raises before anything changes); the others kept."""
        part_cls = next(c for c in self.registry if c.keyword == keyword)
        part = part_cls.build(value, inner)
        parts = {k: p for k, p in self._by_keyword.items() if k != keyword}
        if part is not None:
            parts[keyword] = part
        return Parts(self.registry, parts, self.shared, self._unset)

    def plain(self, window: int) -> bool:
        """Whether window number ``window`` may close as a plain one: no part acts at it."""
        for p in self.active:  # noqa: SIM110 (a loop: no generator calls on the plain path)
            if not p.plain(window):
                return False
        return True

    def check_with(self, max_norm: Any) -> None:
        """Each active part's :meth:`Part.check_with` against the others and ``max_norm``."""
        for p in self.active:
            p.check_with(self._by_keyword, max_norm)

    def describe(self) -> list[str]:
        """The active parts' texts in the wrapper's ``repr`` (:meth:`Part.describe`)."""
        texts = (p.describe() for p in self.active)
        return [text for text in texts if text is not None]

    def agrees_loss(self) -> bool:
        """Whether a part reads the ranks' agreed loss (:meth:`Part.agrees_loss`)."""
        return any(p.agrees_loss() for p in self.active)

    def rank_own(self) -> frozenset[str]:
        """The keywords whose state-dict entries are each rank's own (:attr:`Part.rank_own`), on or off."""
        return frozenset(c.keyword for c in self.registry if c.rank_own)

    def held(self) -> tuple[Part, ...]:
        """The active parts whose state a Rewind copy holds (:attr:`Part.held`)."""
        return tuple(p for p in self.active if p.held)

    # ------------------------------------------------------------------ the window's hooks

    def begin(self, w: Window) -> int | None:
        for p in self.active:
            code = p.begin(w)
            if code is not None:
                return code
        return None

    def is_spike(self, w: Window, d: Any) -> Tensor | None:
        """The first part's spike rule for the window (:meth:`Part.is_spike`), or None."""
        for p in self.active:
            spike = p.is_spike(w, d)
            if spike is not None:
                return spike
        return None

    def closed(self, windows: int) -> None:
        for p in self.active:
            p.closed(windows)

    def record(self, w: Window, measured: bool) -> None:
        """Stage 7: the parts' cells (:meth:`Part.record`); a window that was not ``measured`` (empty,
        or discarded) only by the parts that record such windows (:attr:`Part.records_unmeasured`)."""
        for p in self.active:
            if measured or p.records_unmeasured:
                p.record(w)

    def host_step(self, w: Window) -> bool:
        """Whether a part needs this window's inner step on the host path (:meth:`Part.host_step`)."""
        return any(p.host_step(w) for p in self.active)

    def before_closure(self, closure: Callable[[], Any], index: int, window: int) -> None:
        for p in self.active:
            p.before_closure(closure, index, window)

    def rerun(self, w: Window, d: Any, restore: Callable[[], None]) -> list[Any] | None:
        """The first part's re-execution of the window (:meth:`Part.rerun`), or None; after a
        re-execution ``restore()`` puts back what deciding the window changed (the wrapper's undo
        point: the clip policy's state, the history)."""
        for p in self.active:
            again = p.rerun(w, d)
            if again is not None:
                restore()
                return again
        return None

    def report(self, stats: Any, optimizer: Any) -> None:
        for p in self.reporting:
            p.report(stats, optimizer)

    def configure(self, diagnostics: Any) -> None:
        for p in self.active:
            p.configure(diagnostics)

    def flags(self, w: Window) -> list[_Flag]:
        return [_Flag(p, w) for p in self.active if type(p).flag is not Part.flag]

    def step_context(self, w: Window) -> ExitStack:
        stack = ExitStack()
        for p in self.active:
            stack.enter_context(p.step_context(w))
        return stack

    def settings_pairs(self) -> list[tuple[str, object]]:
        """``(keyword, value)`` for every registered part but the observers (None when off): the ranks'
        agreement, which records the class of the object the user passed (:meth:`Part.value`) and that
        object's ``settings()`` (a part whose value has none, ``update_stats=True``: the part's own).
        Observers are left out: they may differ by rank (a logger on rank 0 only)."""
        out: list[tuple[str, object]] = []
        for c in self.registry:
            if c.observer:
                continue
            part = self._by_keyword.get(c.keyword)
            value = None if part is None else part.value()
            out.append((c.keyword, value if callable(getattr(value, "settings", None)) else part))
        return out

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Each active part's entry under its keyword (a part without state writes none)."""
        out: dict[str, Any] = {}
        for keyword, part in self._by_keyword.items():
            state = part.state_dict()
            if state is not None:
                out[keyword] = state
        return out

    def check_state(
        self, entry: Mapping[str, Any], inner: Optimizer, wrapper_check: Callable[[Any], None] | None = None
    ) -> dict[str, Any]:
        """Each active part's saved entry checked (``ValueError``, nothing changed); an entry of a
        part that is off here, or missing from the state dict, is ignored.  The held state inside
        a part's copies (:meth:`Part.check_held`) is checked too: each held part's own entry of it,
        then the rest by ``wrapper_check`` (the policy and the scaler)."""
        checked = {
            keyword: part.check_state(entry[keyword], inner)
            for keyword, part in self._by_keyword.items()
            if entry.get(keyword) is not None
        }

        def check_copy(extra: Any) -> None:
            if not isinstance(extra, dict):
                return
            for p in self.held():
                if extra.get(p.keyword) is not None:
                    p.check_state(extra[p.keyword], inner)
            if wrapper_check is not None:
                wrapper_check(extra)

        for keyword, state in checked.items():
            self._by_keyword[keyword].check_held(state, check_copy)
        return checked

    def load_state(self, checked: Mapping[str, Any]) -> None:
        for keyword, state in checked.items():
            self._by_keyword[keyword].load_state(state)

    def undo_state(self) -> list[tuple[Part, Any]]:
        saved = []
        for p in self.active:  # (a loop: a walrus in a comprehension breaks torch.compile's graph)
            state = p.undo_state()
            if state is not None:
                saved.append((p, state))
        return saved

    @staticmethod
    def restore_undo(saved: list[tuple[Part, Any]]) -> None:
        for part, state in saved:
            part.restore_undo(state)
