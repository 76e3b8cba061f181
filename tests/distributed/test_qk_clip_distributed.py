"""QKClip on 2 gloo ranks (#35 item 2): the ranks agree on the largest logits (``all_reduce(MAX)``)
and apply the same cap; under FSDP2 each rank scales the rows of its own shard of ``in_proj_weight``.

The reference: each head's largest logit over both ranks' batches, computed by hand from the weights
before the window (:func:`~tests.recovery.test_qk_clip.mha_logit_maxima`), and Megatron-LM's cap
(:func:`~tests.recovery.test_qk_clip.megatron_factors`), both written in the tests.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from .. import qk_clip_jobs as jobs
from ..helpers import spawn_job
from ..markers import needs_gloo
from ..recovery.test_qk_clip import megatron_factors, mha_logit_maxima, scaled_rows

pytestmark = needs_gloo


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_job(jobs.qk_clip_job, "qk", tmp_path_factory.mktemp("qk"), 2)


def _reference(run: list[dict[str, Any]]) -> tuple[list[float], list[float], list[float]]:
    """Both ranks' largest logit per head (the agreed maxima) and Megatron's query and key factors."""
    attn = nn.MultiheadAttention(jobs.E, jobs.H, batch_first=True)
    with torch.no_grad():
        attn.in_proj_weight.copy_(run[0]["before"][0])
        attn.in_proj_bias.copy_(run[0]["before"][1])
    per_rank = [mha_logit_maxima(attn, r["x"], r["x"]) for r in run]
    agreed = [max(heads) for heads in zip(*per_rank, strict=True)]
    q_f, k_f = megatron_factors(agreed, jobs.H, jobs.THRESHOLD, 0.5)
    # the ranks disagree: a head rank 0 alone would leave alone is capped on both
    local = megatron_factors(per_rank[0], jobs.H, jobs.THRESHOLD, 0.5)[0]
    assert any(a == 1.0 and b != 1.0 for a, b in zip(local, q_f, strict=True))
    return agreed, q_f, k_f


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_the_ranks_agree_on_the_logits_and_cap_as_one(ranks: list[dict[str, Any]], kind: str) -> None:
    run = [r[kind] for r in ranks]
    agreed, q_f, k_f = _reference(run)
    e, d = jobs.E, jobs.E // jobs.H
    for r in run:
        assert r["max_logit"] == pytest.approx(max(agreed), rel=1e-5)
        for got, before in zip(r["after"], r["before"], strict=True):
            for rows, factors in ((slice(0, e), q_f), (slice(e, 2 * e), k_f)):
                want = scaled_rows(before[rows], factors, d)
                torch.testing.assert_close(got[rows].double(), want, rtol=4e-7, atol=0.0)
            assert torch.equal(got[2 * e :], before[2 * e :])
    assert all(torch.equal(a, b) for a, b in zip(run[0]["after"], run[1]["after"], strict=True))
