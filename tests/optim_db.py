"""The one table of inner optimizers the tests run against, with capability tags.

In the manner of torch's ``testing/_internal/common_optimizers.py`` ``optim_db``: one
:class:`OptimInfo` per optimizer class and implementation variant, and tags that say
what it supports or needs, so that a test asks for "every fused optimizer" or "every
optimizer that steps without a closure" instead of keeping its own list.

Tags:

- ``foreach`` / ``forloop`` / ``fused``: the implementation the variant selects
  (``foreach=True``, ``foreach=False``, ``fused=True``); ``single`` for classes with
  one implementation only (LBFGS, SparseAdam, Muon).
- ``closure``: ``step()`` needs a closure (LBFGS).
- ``sparse``: takes sparse gradients only (SparseAdam; its model is an ``Embedding``).
- ``matrix``: takes 2-D parameters only (Muon; its model has no biases).
- ``stateful``: keeps per-parameter state after a step (everything but plain SGD).
- ``capturable``: the class accepts ``capturable=`` (CUDA-graph capture).
- ``momentum``: the variant uses momentum (SGD, RMSprop).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import optim

TAGS = frozenset(
    {
        "foreach",
        "forloop",
        "fused",
        "single",
        "closure",
        "sparse",
        "matrix",
        "stateful",
        "capturable",
        "momentum",
    }
)


@dataclass(frozen=True)
class OptimInfo:
    """One optimizer class in one implementation variant."""

    id: str  # e.g. "Adam-fused": the class (and configuration) and the implementation
    cls: type[torch.optim.Optimizer]  # the torch.optim class
    kwargs: dict[str, Any] = field(default_factory=dict)  # constructor arguments, implementation included
    tags: frozenset[str] = frozenset()  # capabilities and needs, from TAGS

    def make(self, params: Iterable[Any], **overrides: Any) -> torch.optim.Optimizer:
        """The optimizer over ``params``; ``overrides`` replace constructor arguments."""
        return self.cls(params, **{**self.kwargs, **overrides})

    @property
    def model(self) -> str:
        """The model kind it can train: "dense", "matrix" (2-D parameters only) or "sparse"."""
        return "sparse" if "sparse" in self.tags else "matrix" if "matrix" in self.tags else "dense"


def _variants(name: str, cls: type[torch.optim.Optimizer], tags: set[str], **kw: Any) -> list[OptimInfo]:
    """The foreach and for-loop variants, and the fused one where ``tags`` has "fused"."""
    impls: list[tuple[str, dict[str, Any]]] = [
        ("foreach", {"foreach": True}),
        ("forloop", {"foreach": False}),
    ]
    if "fused" in tags:
        impls.append(("fused", {"fused": True}))
    shared = tags - {"fused"}
    return [
        OptimInfo(f"{name}-{impl}", cls, {**kw, **extra}, frozenset(shared | {impl})) for impl, extra in impls
    ]


_ADAM = {"fused", "stateful", "capturable"}
_STATEFUL = {"stateful", "capturable"}

OPTIM_DB: list[OptimInfo] = [
    *_variants("Adam", optim.Adam, _ADAM, lr=0.05),
    *_variants("Adam-amsgrad", optim.Adam, _ADAM, lr=0.05, amsgrad=True),
    *_variants("AdamW", optim.AdamW, _ADAM, lr=0.05, weight_decay=0.1),
    *_variants("SGD", optim.SGD, {"fused"}, lr=0.1),
    *_variants("SGD-momentum", optim.SGD, {"fused", "stateful", "momentum"}, lr=0.1, momentum=0.9),
    *_variants(
        "SGD-nesterov", optim.SGD, {"fused", "stateful", "momentum"}, lr=0.1, momentum=0.9, nesterov=True
    ),
    *_variants("Adagrad", optim.Adagrad, {"fused", "stateful"}, lr=0.1),
    *_variants("Adadelta", optim.Adadelta, _STATEFUL, lr=1.0),
    *_variants("Adamax", optim.Adamax, _STATEFUL, lr=0.05),
    *_variants("ASGD", optim.ASGD, _STATEFUL, lr=0.05, t0=1.0),
    *_variants("NAdam", optim.NAdam, _STATEFUL, lr=0.05),
    *_variants("RAdam", optim.RAdam, _STATEFUL, lr=0.05),
    *_variants("RMSprop", optim.RMSprop, _STATEFUL, lr=0.01),
    *_variants(
        "RMSprop-centered-momentum",
        optim.RMSprop,
        _STATEFUL | {"momentum"},
        lr=0.01,
        centered=True,
        momentum=0.9,
    ),
    *_variants("Rprop", optim.Rprop, _STATEFUL, lr=0.01),
    *_variants("Adafactor", optim.Adafactor, {"stateful"}, lr=0.05),
    OptimInfo(
        "LBFGS-closure",
        optim.LBFGS,
        {"lr": 0.5, "max_iter": 4, "history_size": 3},
        frozenset({"single", "closure", "stateful"}),
    ),
    OptimInfo(
        "SparseAdam-sparse", optim.SparseAdam, {"lr": 0.05}, frozenset({"single", "sparse", "stateful"})
    ),
    # Muon only takes 2-D parameters.
    OptimInfo("Muon", optim.Muon, {"lr": 0.02}, frozenset({"single", "matrix", "stateful"})),
]
assert len({o.id for o in OPTIM_DB}) == len(OPTIM_DB), "duplicate ids in OPTIM_DB"
assert all(o.tags <= TAGS for o in OPTIM_DB), "unknown tag in OPTIM_DB"

# What a plain ``loss.backward(); step()`` loop on a dense model with biases can drive.
PLAIN = frozenset({"closure", "sparse", "matrix"})


def select(*tags: str, exclude: Iterable[str] = ()) -> list[OptimInfo]:
    """The entries having every one of ``tags`` and none of ``exclude``, in table order."""
    want, avoid = set(tags), set(exclude)
    assert want | avoid <= TAGS, f"unknown tags {sorted((want | avoid) - TAGS)}"
    return [o for o in OPTIM_DB if want <= o.tags and not avoid & o.tags]


def pick(*ids: str) -> list[OptimInfo]:
    """The entries with these ids, in this order."""
    by_id = {o.id: o for o in OPTIM_DB}
    return [by_id[i] for i in ids]


def get(id_: str) -> OptimInfo:
    """The entry with this id."""
    (info,) = pick(id_)
    return info


def params(infos: Iterable[OptimInfo]) -> list[Any]:
    """``infos`` as ``pytest.param`` values named by their ids, for ``parametrize``."""
    return [pytest.param(o, id=o.id) for o in infos]
