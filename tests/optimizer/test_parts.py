"""The parts' face on the wrapper (clipopt/_part.py, ``_config.REGISTRY``): keywords, reads, assignments."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import clipopt
from clipopt import ClippedOptimizer
from clipopt._config import REGISTRY


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _attention() -> torch.nn.MultiheadAttention:
    torch.manual_seed(0)
    return torch.nn.MultiheadAttention(8, 2, batch_first=True)


def test_an_unknown_keyword_names_itself_and_the_parts_there_are() -> None:
    model = _model()
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'rerunn'.*qk_clip, rerun"):
        ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), rerunn=clipopt.Rerun())


def test_a_part_off_reads_none_and_on_reads_what_was_given() -> None:
    model = _model()
    rerun = clipopt.Rerun()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), rerun=rerun)
    assert opt.rerun is rerun and opt.qk_clip is None


def test_a_bad_part_assigned_mid_run_is_refused_and_nothing_changes() -> None:
    """Assigning a part's keyword runs the part's own check, as the constructor does; a refused
    value leaves the part that was there, and the open window's gradients."""
    model = _model()
    rerun = clipopt.Rerun()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2, rerun=rerun)
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(TypeError, match="rerun must be a Rerun"):
        opt.rerun = "yes"
    assert opt.rerun is rerun
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert "rerun" not in vars(opt)  # held by the parts, not stored on the wrapper
    opt.rerun = None
    assert opt.rerun is None
    again = clipopt.Rerun()
    opt.rerun = again
    assert opt.rerun is again


def test_the_parts_run_in_the_registrys_order_whatever_order_the_keywords_come_in() -> None:
    attention = _attention()
    params = list(attention.parameters())
    orders = []
    for first_qk in (True, False):
        qk, rerun = clipopt.QKClip(attention), clipopt.Rerun()
        kwargs = {"qk_clip": qk, "rerun": rerun} if first_qk else {"rerun": rerun, "qk_clip": qk}
        opt = ClippedOptimizer(torch.optim.SGD(params, lr=0.1), **kwargs)
        orders.append([type(p) for p in opt._run.parts.active])
        qk.remove()
    registry = [c for c in REGISTRY if c in (clipopt.QKClip, clipopt.Rerun)]
    assert orders == [registry, registry]


def test_a_logger_appended_while_logging_is_off_is_refused_not_lost(tmp_path: Any) -> None:
    """``opt.loggers`` of a wrapper built without loggers reads ``[]``; a logger appended to it would
    never be called (logging is a part, turned on by assigning a list), so appending says so."""
    model = _model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert opt.loggers == []
    with pytest.raises(TypeError, match=r"assign a list instead: opt.loggers = \["):
        opt.loggers.append(clipopt.CSVLogger(tmp_path / "grads.csv"))
    opt.loggers = [clipopt.CSVLogger(tmp_path / "grads.csv")]
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    opt.close()
    assert (tmp_path / "grads.csv").read_text().count("\n") == 2  # the header and one window
