"""Guarding an open accumulation window against clearing from outside and stacked accumulation.

While a window is open (``accumulation_steps > 1``), the gradients hold the
sum of its micro-batches.  Two mistakes empty or distort it silently:

* something else clears or replaces the gradients between two ``step()``
  calls (``model.zero_grad()``, a training framework's own clearing,
  ``p.grad = ...``), so the window holds only its latest micro-batches;
* another accumulation is stacked on the wrapper's (a framework calls
  ``step()`` once per *k* backward passes), so one update spans
  ``k * accumulation_steps`` micro-batches.

One *sentinel* parameter is watched through a tensor hook, which runs at
each backward pass before the new gradient is added to ``p.grad``:

* after every ``step()`` that leaves the window open the guard remembers the
  sentinel's gradient tensor and its ``_version``; the
  first backward pass afterwards must find that very tensor, unchanged (an
  in-place ``zero_()`` bumps ``_version``; ``set_to_none`` leaves None; an
  assignment leaves another tensor).  The check runs before autograd adds the
  new gradient, so out-of-place accumulation (``create_graph=True``, sparse
  gradients) and DDP's writes during backward never look like clearing;
* the hook counts backward passes between two ``step()`` calls.

Gradients written by hand between ``step()`` calls, with no backward pass
reaching the sentinel, are not judged: only autograd's accumulation is.

Everything is host-side Python (identities and version counters): no device
work and no host-device synchronisation.  Pickling drops the guard; it re-arms
at the next ``step()``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.utils.hooks import RemovableHandle

from .._distributed.collectives import has_dtensor

__all__ = ["WindowGuard", "cleared_message", "stacked_message"]


def cleared_message(micro_batches: int, accumulation_steps: int) -> str:
    """The error for gradients of an open window cleared or replaced from outside."""
    return (
        f"the gradients of the open accumulation window ({micro_batches} of {accumulation_steps} "
        "micro-batches accumulated) were cleared or replaced from outside the wrapper before this "
        "step() (model.zero_grad(), a training framework clearing gradients after every optimizer "
        "step such as Hugging Face Trainer, or an assignment to p.grad), so the window would "
        "silently hold only its latest micro-batches. Use one accumulation: let the framework "
        "accumulate (Trainer(gradient_accumulation_steps=k), Lightning accumulate_grad_batches=k, "
        "Accelerator(gradient_accumulation_steps=k)) with ClippedOptimizer(..., "
        "accumulation_steps=1), or clear gradients only with opt.zero_grad()"
    )


def stacked_message(passes: int, accumulation_steps: int, allowed: int) -> str:
    """The error for several backward passes per micro-batch while the wrapper accumulates."""
    return (
        f"{passes} backward passes ran since the previous step() while the wrapper accumulates "
        f"accumulation_steps={accumulation_steps} micro-batches (backward_passes_per_step={allowed}): "
        "another gradient accumulation is stacked on the wrapper's (Trainer "
        "gradient_accumulation_steps, Lightning accumulate_grad_batches, Accelerator "
        f"gradient_accumulation_steps), so one update would span {passes * accumulation_steps} "
        "backward passes while the framework's scheduler counts each of its steps. Use one "
        "accumulation: the framework's with ClippedOptimizer(..., accumulation_steps=1), or the "
        f"wrapper's alone. If {passes} backward passes per micro-batch are intended (e.g. two losses "
        f"backwarded separately), pass backward_passes_per_step={passes}"
    )


def _backward_hook(guard: weakref.ref[WindowGuard]) -> Callable[[Tensor], None]:
    """The sentinel's tensor hook; it holds the guard weakly (the parameter outlives the optimizer)."""

    def on_backward(grad: Tensor) -> None:
        me = guard()
        if me is not None:
            me._on_backward()

    return on_backward


class WindowGuard:
    """Watches one sentinel parameter between ``step()`` calls of an accumulating wrapper.

    :meth:`step` runs at every ``step()`` call of the wrapper (after a
    closure's backward) and raises ``RuntimeError`` for a cleared window or
    stacked accumulation; :meth:`reset` runs when a window closes or the
    gradients are loaded.
    """

    __slots__ = (
        "__weakref__",
        "_armed_window",
        "_grad",
        "_handle",
        "_param",
        "_version",
        "backward_passes",
        "cleared",
    )

    def __init__(self) -> None:
        self._param: Tensor | None = None  # the optimizer holds it anyway
        self._handle: RemovableHandle | None = None
        self._grad: Tensor | None = None  # the sentinel's gradient at the latest step(); reset() drops it
        self._version = 0
        self._armed_window = False  # remember() ran since the latest reset()
        self.backward_passes = 0  # passes reaching the sentinel since the latest step()
        self.cleared = False  # the first pass after remember() found the gradient changed

    def __del__(self) -> None:
        if self._handle is not None:  # the parameter outlives the optimizer: do not leave the hook
            self._handle.remove()

    def __getstate__(self) -> dict[str, Any]:
        return {}  # hooks and weak references do not travel: a copy re-arms at its next step()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def __deepcopy__(self, memo: dict[int, Any]) -> WindowGuard:
        return WindowGuard()

    # ---------------------------------------------------------------- arming

    def _arm(self, params: list[Tensor]) -> None:
        """Hook the first parameter that has a gradient (none yet: try again next time).

        DTensor (FSDP2) parameters are left alone: FSDP2 writes their ``.grad``
        outside autograd's accumulation.
        """
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if has_dtensor(params):
            return
        for p in params:
            if p.grad is not None and p.requires_grad and not p.grad.is_sparse:
                self._handle = p.register_hook(_backward_hook(weakref.ref(self)))  # type: ignore[no-untyped-call]
                self._param = p
                return

    def _on_backward(self) -> None:
        self.backward_passes += 1
        if self.backward_passes == 1 and self._armed_window and not self._unchanged():
            self.cleared = True

    def _unchanged(self) -> bool:
        """The sentinel's gradient is what the latest ``step()`` saw: same tensor, same version.

        A gradient that is a view of a larger buffer (DDP's ``gradient_as_bucket_view``,
        flat gradient buffers) shares that buffer's version counter, which other
        parameters' accumulation bumps, and DDP may swap a gradient for a view
        holding the same values: for views only ``None`` counts as cleared.
        """
        p = self._param
        if p is None:
            return True
        grad = p.grad
        if self._grad is None:  # no gradient at the latest step()
            return grad is None
        if grad is None:
            return False
        if grad._base is not None:
            return True
        return grad is self._grad and grad._version == self._version

    # ---------------------------------------------------------------- wrapper calls

    def step(
        self, micro_batches: int, accumulation_steps: int, allowed: int, params: Callable[[], list[Tensor]]
    ) -> None:
        """At a ``step()`` call (after a closure's backward), before anything changes.

        Raises ``RuntimeError`` if the open window was cleared from outside or
        another accumulation is stacked on the wrapper's; otherwise, when this
        call leaves the window open, notes the sentinel's gradient.
        ``params`` returns the wrapper's parameters; it is only called to pick a sentinel.
        """
        if self.backward_passes > allowed or self.cleared:  # (one test for both: every call runs it)
            self._check(micro_batches, accumulation_steps, allowed)
        self.backward_passes = 0
        if micro_batches + 1 >= accumulation_steps:
            return  # this call closes the window: reset() follows
        p = self._param
        if p is None:
            self._arm(params())
            p = self._param
            if p is None:
                return
        grad = self._grad = p.grad
        if grad is not None:
            self._version = grad._version
        self._armed_window = True  # (cleared is False here: it was checked above)

    def _check(self, micro_batches: int, accumulation_steps: int, allowed: int) -> None:
        """Raise for stacked accumulation (the root cause when both happen: HF Trainer) or a cleared
        window."""
        passes = self.backward_passes
        if passes > allowed and self._handle is not None:
            raise RuntimeError(stacked_message(passes, accumulation_steps, allowed))
        if self.cleared and self._armed_window:
            raise RuntimeError(cleared_message(micro_batches, accumulation_steps))

    def reset(self) -> None:
        """The window closed (or its gradients were loaded): nothing to compare with until the next step()."""
        self._armed_window = False
        self._grad = None
        self.cleared = False
        self.backward_passes = 0
