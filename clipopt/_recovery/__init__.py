"""Spike recovery, run inside ``step()``.

* :mod:`.spike_guard`, :mod:`.spike_stats` — skipping z-score outliers (the part ``spike_guard=``).
* :mod:`.rewind`, :mod:`.host_copy` — going back to a copy of the training state
  (the part ``rewind=``).
"""
