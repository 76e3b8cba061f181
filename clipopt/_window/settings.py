"""The settings one window closes with (:class:`WindowSettings`), read when the window closes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch.optim import Optimizer

from .._inner import inner_optimizers, is_fused
from .._policies.builtin import ClipPolicy
from .groups import GroupPlan

__all__ = ["WindowSettings"]


@dataclass(frozen=True)
class WindowSettings:
    """What one window closes with: the wrapper's settings when the window closes.

    They may change between windows (``opt.norm_type = 1.0``, a group's
    ``max_norm``): the window plan (:mod:`clipopt._window.plan`) reads them again after
    each change, and every stage of the close (:mod:`clipopt._window.stages`, :mod:`clipopt._window.diagnose`)
    gets them from this record, never from the optimizer.
    """

    norm_type: float  #: ``p`` of every norm
    clip_value: float | None  #: the element-wise bound of the groups without their own
    divisor: float  #: the summed gradients are divided by it: the micro-batches (``"mean"``) or 1 (``"sum"``)
    foreach: bool | None  #: passed to the foreach kernels
    policy: ClipPolicy | None  #: ``max_norm`` when it is a policy
    max_norm: float | None  #: ``max_norm`` when it is a float (None: off, or a policy)
    skip_enabled: bool  #: a non-finite window is skipped (``skip_nonfinite`` or a GradScaler)
    scaled: bool  #: a GradScaler unscaled the gradients: a non-finite window is an ``"overflow"``
    norm_group: Any  #: the pipeline stages' process group, or None
    plan: GroupPlan | None  #: the groups' own ``max_norm``/``clip_value`` (None: no group has one)
    fused: bool = (
        False  #: the inner step takes ``grad_scale``/``found_inf`` (fused Adam, AdamW, SGD, Adagrad)
    )
    #: Every setting of the wrapper by name (``scaler``, ``reduction``, ``max_consecutive_nonfinite``
    #: ...), as it was when this record was made.
    config: Mapping[str, Any] = field(default_factory=dict, compare=False)
    #: Nothing but a norm bound (at most) clips: no per-group options, policy, value clipping, pipeline
    #: norm group or GradScaler (a plain window, :mod:`clipopt._window.plain`, when no part acts at it
    #: either: ``Part.plain``).
    plain: bool = field(init=False)

    def __post_init__(self) -> None:
        plain = self.plan is None and self.policy is None and self.clip_value is None
        plain = plain and self.norm_group is None and not self.scaled
        object.__setattr__(self, "plain", plain)  # (frozen: set once, here)

    @classmethod
    def read(cls, c: Mapping[str, Any], n: int, plan: GroupPlan | None, inner: Optimizer) -> WindowSettings:
        """The settings of a window of ``n`` micro-batches (per-group options: ``plan``) over the
        ``inner`` optimizer(s), from the wrapper's settings by name ``c``."""
        bound = c["max_norm"]
        policy = bound if isinstance(bound, ClipPolicy) else None
        return cls(
            norm_type=c["norm_type"],
            clip_value=c["clip_value"],
            divisor=float(n) if c["reduction"] == "mean" else 1.0,
            foreach=c["foreach"],
            policy=policy,
            max_norm=None if policy is not None else bound,
            skip_enabled=c["skip_nonfinite"] or c["scaler"] is not None,
            scaled=c["scaler"] is not None,
            norm_group=c["norm_group"],
            plan=plan,
            fused=all(is_fused(o) for o in inner_optimizers(inner)),
            config=c,
        )

    @property
    def unitwise(self) -> bool:
        """The policy clips the gradients in place: unit by unit (AGC) or tensor by tensor (AdaGC)."""
        return self.policy is not None and self.policy.unitwise

    @property
    def clips_in_place(self) -> bool:
        """Clipping changes the gradients before the inner step (value clipping, or a policy that
        clips in place)."""
        value = self.clip_value is not None or (self.plan is not None and self.plan.any_value_clipping)
        return value or self.unitwise
