"""The gloo job of ``tests/optimizer/test_savers.py``: a resume of FSDP2 (2 ranks) through torch's
``get_optimizer_state_dict``/``set_optimizer_state_dict``, with the SpikeGuard and Rewind of
``fsdp_jobs`` (each rank's shards of the Rewind copies in its own state dict)."""

from __future__ import annotations

import copy
import os

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from .distributed_jobs import init_world, leave_process_group
from .fsdp_jobs import SPIKED, STOP, WINDOWS, _fsdp_run, _train


def fsdp_saver_job(rank: int, port: int, out_dir: str, world: int) -> None:
    """The run of :data:`fsdp_jobs.WINDOWS` batches without stopping (``"full"``), and the same run
    stopped after :data:`fsdp_jobs.STOP` batches -- between the two spikes -- saved by the helpers and
    loaded into a new FSDP2 model and optimizer that train on the rest (``"resumed"``)."""
    init_world(rank, port, world)
    spiked = rank == SPIKED
    model, opt = _fsdp_run()
    full = _train(model, opt, rank, spiked, 5, range(WINDOWS))
    first, first_opt = _fsdp_run()
    _train(first, first_opt, rank, spiked, 5, range(STOP))
    saved = copy.deepcopy((get_model_state_dict(first), get_optimizer_state_dict(first, first_opt)))
    second, second_opt = _fsdp_run()
    set_model_state_dict(second, saved[0])
    set_optimizer_state_dict(second, second_opt, saved[1])
    rest = _train(second, second_opt, rank, spiked, 5, range(STOP, WINDOWS))
    res = {
        "full": {"used": full["used"][STOP:], "log": full["log"], "last": full["after"][-1]},
        "resumed": {"used": rest["used"], "log": rest["log"], "last": rest["after"][-1]},
        "top_level_kept": "clipopt" in saved[1],
    }
    torch.save(res, os.path.join(out_dir, f"savers{rank}.pt"))
    leave_process_group()
