"""StepStats pickled by a clipopt from before the reason code (issue 12) still unpickle."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

from clipopt import StepStats

#: What a StepStats pickled before issue 12 held: the reason as three fields.
_COMMON = {
    "step": 3,
    "micro_batches": 1,
    "_total_norm": torch.tensor(2.0),
    "_clip_coef": 1.0,
    "_clipped": False,
    "_max_norm": None,
    "_lr": (0.1,),
    "layers": None,
    "_loss": None,
    "_bad_row": None,
}


def _old(**fields: Any) -> StepStats:
    """A StepStats rebuilt the way pickle rebuilds an old one (its slot state)."""
    stats = StepStats.__new__(StepStats)
    stats.__setstate__((None, {**_COMMON, **fields}))
    return stats


def _f(skipped: Any, stored: str, nonfinite: Any = None, divergence: Any = None) -> dict[str, Any]:
    """The old reason fields: skipped, the stored reason, the non-finite and divergence indicators."""
    return {
        "_skipped": skipped,
        "_reason_if_skipped": stored,
        "_nonfinite": nonfinite,
        "_divergence": divergence,
    }


T1, T0 = torch.tensor(1.0), torch.tensor(0.0)


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        (_f(False, "nonfinite"), None),
        (_f(True, "nonfinite"), "nonfinite"),
        (_f(True, "overflow"), "overflow"),
        (_f(True, "nograd"), "nograd"),
        (_f(T1, "nonfinite", nonfinite=T0), "spike"),
        (_f(T1, "nonfinite", nonfinite=T1, divergence=T0), "nonfinite"),
        (_f(T1, "nonfinite", nonfinite=T0, divergence=T1), "divergence"),
        (_f(T0, "nonfinite", nonfinite=T0, divergence=T0), None),
    ],
)
def test_old_step_stats_keep_their_reason(fields: dict[str, Any], reason: str | None) -> None:
    """Each combination of the old three fields gives the reason the old StepStats.reason gave
    (divergence first, then 'spike' for a skip that was not non-finite, else the stored reason),
    also after a new pickle round trip."""
    old = _old(**fields)
    assert old.reason == reason
    assert pickle.loads(pickle.dumps(_old(**fields))).reason == reason
    assert old.total_norm == 2.0 and old.step == 3


def test_new_step_stats_round_trip_through_pickle() -> None:
    """A StepStats recorded now (device values not read yet) pickles and keeps every field."""
    w = torch.nn.Parameter(torch.ones(2))
    from clipopt import ClippedOptimizer

    opt = ClippedOptimizer(torch.optim.SGD([w], lr=0.1), max_norm=1.0)
    w.grad = torch.tensor([float("nan"), 1.0])
    opt.step()
    assert opt.last_stats is not None
    copy = pickle.loads(pickle.dumps(opt.last_stats))
    assert copy.as_dict()["reason"] == "nonfinite" and copy.skipped and copy.step == 1
