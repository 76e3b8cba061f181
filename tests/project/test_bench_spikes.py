"""The figures of benchmarks/spikes.py that are computed, not measured: loss spikes and recovery.

Hand-made loss curves whose answer is counted by eye; the benchmark's table reports these.
"""

from __future__ import annotations

import math

from benchmarks.spikes import Run, Workload, loss_spikes, shard_recovery

W = Workload(windows=100, bad_shard=(60, 65), poisoned=(45,))


def _run(losses: list[float]) -> Run:
    return Run("clip", 0, losses=losses, batch_index=list(range(len(losses))))


def test_a_spike_that_comes_back_is_one_recovered_spike() -> None:
    """Four windows 1 nat above a flat 2.0 are one spike, back within 50 windows."""
    losses = [2.0] * 100
    losses[30:34] = [3.0] * 4
    assert loss_spikes(_run(losses), W) == (1, 1)


def test_a_spike_that_never_comes_back_is_not_recovered() -> None:
    """A loss that stays 1 nat up to the end is one spike and not recovered; a non-finite loss too."""
    assert loss_spikes(_run([2.0] * 40 + [3.0] * 60), W) == (1, 0)
    assert loss_spikes(_run([2.0] * 40 + [math.nan] * 60), W) == (1, 0)
    assert loss_spikes(_run([2.0] * 80 + [3.0] * 20), W) == (1, 0)  # up for the last 20: not back


def test_corrupted_batches_and_small_rises_are_not_spikes() -> None:
    """The loss on the poisoned batch and the bad shard is left out; 0.2 nats up is under the 0.25 level."""
    losses = [2.0] * 100
    losses[45] = 9.0
    losses[60:65] = [9.0] * 5
    losses[70] = 2.2
    assert loss_spikes(_run(losses), W) == (0, 0)


def test_shard_recovery_counts_real_text_windows_until_the_level_before() -> None:
    """After the shard, 7 windows at 3.0 then 2.05 (within 0.1 of the 2.0 before): 7 windows to recover."""
    losses = [2.0] * 60 + [9.0] * 5 + [3.0] * 7 + [2.05] * 28
    assert shard_recovery(_run(losses), W) == 7
    assert shard_recovery(_run([2.0] * 60 + [9.0] * 5 + [3.0] * 35), W) == 35  # never back: all left
