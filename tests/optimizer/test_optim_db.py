"""The shared optimizer table (tests/optim_db.py): its capability tags agree with torch."""

from __future__ import annotations

import inspect

import pytest
import torch

from ..helpers import mlp, model_for
from ..optim_db import OPTIM_DB, OptimInfo, params, select


def _one_step(info: OptimInfo) -> torch.optim.Optimizer:
    """One plain torch step of ``info``'s optimizer on its kind of model."""
    model = model_for(info.model)
    opt = info.make(model.parameters())
    x = torch.randint(0, 10, (6,)) if info.model == "sparse" else torch.randn(8, 5)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    opt.step(closure)
    return opt


@pytest.mark.parametrize("info", params(OPTIM_DB))
def test_implementation_and_capturable_tags_match_the_constructor(info: OptimInfo) -> None:
    """foreach/forloop/fused tags are the implementation the kwargs select; "capturable" is set
    exactly for the classes whose constructor takes capturable=."""
    accepted = inspect.signature(info.cls.__init__).parameters
    assert ("foreach" in info.tags) == (info.kwargs.get("foreach") is True)
    assert ("forloop" in info.tags) == (info.kwargs.get("foreach") is False)
    assert ("fused" in info.tags) == (info.kwargs.get("fused") is True)
    assert ("single" in info.tags) == ("foreach" not in accepted)
    assert ("capturable" in info.tags) == ("capturable" in accepted)
    assert len(info.tags & {"foreach", "forloop", "fused", "single"}) == 1


@pytest.mark.parametrize("info", params(OPTIM_DB))
def test_stateful_tag_matches_the_state_after_one_step(info: OptimInfo) -> None:
    """An entry is tagged "stateful" exactly when torch's optimizer holds per-parameter state
    after one step."""
    state = _one_step(info).state
    has_state = any(len(s) > 0 for s in state.values())
    assert ("stateful" in info.tags) == has_state, dict(state)


def test_closure_sparse_and_matrix_entries_refuse_what_they_cannot_take() -> None:
    """The "closure" entry refuses step() without a closure, the "sparse" one dense gradients and
    the "matrix" one a 1-D parameter: the tags name real needs."""
    (lbfgs,) = select("closure")
    model = mlp((5, 4, 3))
    with pytest.raises(TypeError):
        lbfgs.make(model.parameters()).step()  # type: ignore[call-arg]
    (sparse,) = select("sparse")
    opt = sparse.make(model.parameters())
    model(torch.randn(8, 5)).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match="SparseAdam does not support dense gradients"):
        opt.step()
    (matrix,) = select("matrix")
    with pytest.raises(ValueError, match="Muon only supports 2D parameters"):
        matrix.make(mlp((5, 4, 3)).parameters())
