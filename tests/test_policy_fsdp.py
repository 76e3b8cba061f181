"""AdaGC and StableSPAM under FSDP2 (2 gloo processes): each tensor's norm and largest |g| are
those of the full tensor, so the sharded run gives the parameters of one process.

The job (``tests/policy_jobs.py``) runs once for the module; the reference is
``pytorch_optimizer``'s optimizer in one process, on the mean gradient of both ranks.
"""

from __future__ import annotations

from typing import Any

import pytest

from . import policy_jobs as jobs
from .distributed_jobs import WORLD
from .helpers import assert_tensors_close, spawn_job
from .markers import needs_gloo

pytestmark = needs_gloo


@pytest.fixture(scope="module")
def fsdp_policy(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_job(jobs.fsdp_policy_job, "fsdp_policy", tmp_path_factory.mktemp("fsdp_policy"), WORLD)


@pytest.mark.parametrize("name", ["adagc", "stable_spam"])
def test_fsdp2_per_tensor_policy_equals_one_process(fsdp_policy: list[dict[str, Any]], name: str) -> None:
    """8 updates (a x1e3 spike on the sixth) on FSDP2 shards equal pytorch_optimizer's optimizer in
    one process (rtol 1e-5, atol 1e-6: float32 across ranks), on every rank, and the spike is clipped."""
    for rank in fsdp_policy:
        res = rank[name]
        assert res["clipped"][5]
        assert_tensors_close(res["params"], res["ref_params"])
