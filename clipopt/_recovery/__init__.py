"""Spike recovery, run inside ``step()``.

* :mod:`.part` — the optimizer's recovery part: its SpikeGuard and Rewind together.
* :mod:`.spike_guard`, :mod:`.spike_stats` — skipping z-score outliers.
* :mod:`.rewind`, :mod:`.host_copy` — going back to a copy of the training state.
"""
