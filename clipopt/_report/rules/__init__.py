"""The verdict rules of ``clipopt report``, founded on real runs (tests/report/test_report_corpus.py).

Every rule reads a :class:`~clipopt._report.read.GradLog`: the pre-clip total
norm of each update, the loss when the log has one, the clipping record
(clipopt logs), the per-layer rows, and the update norm when the log has it
(``update_clip=`` or ``update_stats=True``).  Statistics are computed with torch on
float64 columns, so a million updates take a fraction of a second; the norms
are judged on their logarithms (or divided by their maximum), so norms up to
``1e308`` give a verdict rather than an overflow.

Terms
-----
*Finite norms*: rows whose norm is finite, in file order.  *Overflow rows*:
non-finite norm with reason ``overflow`` -- a ``GradScaler`` calibrating its
scale, normal operation, never evidence.  *Start*: the median of the first
:data:`START_ROWS` finite values (norms or losses) -- the scale of the run
before anything happened.  A percentile interpolates linearly between ranks
(numpy's default).

Rules, most severe verdict first
--------------------------------
``exploding`` -- the run left its scale for good:

- *blow-up of the loss* (logs with a loss): some loss is above
  :data:`LOSS_BLOWUP` times the start loss (or is not finite, with no
  non-finite gradient before it), and from a row on the median loss of the
  next :func:`block` rows stays above :data:`LOSS_STAY` times the start, with
  no whole block after that row whose median came back to the start or under.
  Step: that row -- where the loss went up to stay, not an earlier excursion
  that came back (a tiny GPT without LayerNorm, turbulent at step 12, settled
  below its start for 200 steps and blew up at step 332: its onset is 332); a
  loss that hovers between its start and 3x it after a blow-up never came
  back.  The start loss is the median of the first
  :data:`START_ROWS` losses, or of those before the first of them that is
  already LOSS_BLOWUP x the median of the ones before it (AdamW at lr 1.0
  goes from 0.7 to 458 in its first two updates).  Why: a person decides that a run blew up from its loss; a
  loss that stays an order of magnitude above where it started is a run that
  is lost, even when its gradient norm comes down again (the plain run of
  ``clipopt demo`` blows up at update 5 and then sits at 10x its start loss).
  Likewise from the level the loss had reached: a loss above
  :data:`LOSS_BLOWUP` times the median of the previous whole :func:`block`
  (blocks aligned at the first row), after which the median of the next block
  (at least :data:`BLOCK_MIN` rows) and that of the last block stay above
  :data:`LOSS_STAY` times that median, with no whole block after that row
  back at that median or under.
  Why: a classifier that learned to a tenth of its start loss and then
  diverges back to chance never goes above its start loss, yet it is lost; a
  bad batch's loss spike that the run recovers from by its end is not.
- *fast growth of the norm*: the median of the last :func:`block` finite norms
  is at least :data:`GROWTH_RATIO` times the start's, or some norm reaches
  :data:`GROWTH_RATIO` times the start and the median of the next block stays
  above :data:`GROWTH_ONSET_RATIO` times it, with no whole block back at the
  start or under after it (a blow-up in the first updates, which block
  medians over the whole run miss).  Step (onset): the first norm
  above ``GROWTH_ONSET_RATIO`` x start from which the next block's median
  stays above it.  When the log has a loss that is finite to the end and
  lower at the end than at the start, growth of the norm alone is not an
  explosion (a note says so): the loss is the better witness.  Slow geometric
  growth that ends in an overflow is an explosion from its onset, and the
  non-finite updates that follow are part of it.

``nonfinite`` -- some update (not an overflow row) had a non-finite gradient,
not inside an explosion.  Its own verdict because one bad batch is not an
explosion: clipopt skips it (``skip_nonfinite``) and the run goes on.  Step:
the first such row.  Layer: in that row's own per-layer statistics (clipopt
writes them for every non-finite window, whatever the ``layer_stats``
period) the first parameter, in parameter order, with non-finite elements or a
non-finite gradient norm (a ``nan`` norm with no non-finite element counted is a
parameter without a gradient, e.g. a frozen one; in logs that count none,
Lightning's, a ``nan`` norm is non-finite); in logs without that row, the first per-layer row
after it, and the evidence says it was taken from a later row.

``spikes`` -- isolated large updates, or a blow-up that came back:

- *a blow-up that came back* (``recovered_blowup``, logs with a loss): before
  an explosion's onset, the loss went above LOSS_BLOWUP x its start and the
  median of the next block stayed above LOSS_STAY x it, then a whole block's
  median came back to the start or under (the losses of spike skips left out:
  those updates never happened).  Why: the run goes on, so it is no explosion, but the
  steps were too large for that stretch -- the learning rate or its warm-up;
  the advice says so.  A stretch that begins with a loss spike over a calm
  history (the loss spike rule below, with at least :data:`SPIKE_MIN_HISTORY`
  losses before it) and with no rise of the logged learning rate in the block
  before it is not one: that is a bad stretch of data, whose loss comes back
  as soon as the data does, and the spike rules report it.

- *norm spikes*: a finite norm ``x`` with ``z = (ln x - m) / s >``
  :data:`SPIKE_Z`, ``m``/``s`` the mean and standard deviation of the
  logarithms of the previous up to :data:`SPIKE_WINDOW` norms (at least
  :data:`SPIKE_MIN_HISTORY`), and ``x`` at least :data:`SPIKE_MIN_RATIO`
  times their mean.  On logarithms because gradient norms are close to
  log-normal: on raw norms healthy heavy-tailed runs had 8-17 false spikes per
  12,000 updates, on log-norms none.  *A spike that clipping handled is not a
  spike*: a clipped update (clipopt's ``clipped`` column) whose loss over the
  next :data:`HANDLED_ROWS` rows stays below :data:`LOSS_SPIKE_RATIO` times
  the median loss before it is counted as handled (without a loss in the log,
  nothing shows that it was handled, and it is a spike) in the summary, not as evidence -- clipping doing its
  job (``clipopt demo``'s clipped run clips 9 % of its updates, some at 2x the
  rolling mean, and learns).
- *handled by a skip*: a norm or loss spike at an update skipped as a spike
  (reason ``spike``: a SpikeGuard, or a policy's ``skip_spikes``) after which
  the median loss of the next :data:`HANDLED_ROWS` applied updates (the other
  skips left out: a bad shard is skipped window after window) stays below
  :data:`LOSS_SPIKE_RATIO` times the median of the applied losses before it
  is handled -- the skip did its job; the summary lists them
  (``skipped_spikes_handled``) and the verdict line says so.  Without a loss
  in the log every such skip is handled: a skipped update never reached the
  parameters.
- *loss spikes* (logs with a loss): a loss more than :data:`LOSS_SPIKE_Z`
  standard deviations above the mean of the previous up to
  :data:`LOSS_WINDOW` losses and above :data:`LOSS_SPIKE_RATIO` times that
  mean (a corrupted batch, a bad data shard: the loss shows it even when
  clipping hides the norm).
- *update spikes* (logs with the update norm, ``kind`` ``update_spikes``): the
  norm spike rule above on the update norm divided by the learning rate (group
  0's, where the log records one: a warm restart that multiplies the learning
  rate is not a spike), over the applied updates, with no gradient-norm spike
  (the same rule, clipped or not) at that row or in the
  :data:`UPDATE_ECHO_ROWS` before it.  Why: an update that jumps while the
  gradient does not is the optimizer's own doing -- Adam's second moment,
  still near zero after a quiet stretch of a parameter (a rare token's
  embedding), divides an ordinary gradient into a step many times the usual
  one; gradient clipping cannot see it, update clipping bounds it.  A
  gradient spike's update is the gradient's (and momentum carries it into the
  next updates, whence the echo rows): the gradient rules report it.  As with
  the norm, an update spike that ``update_clip`` bounded (``update_coef`` < 1)
  and after which the loss stays calm is handled, a note and not evidence.

``vanishing`` (needs per-layer rows): a layer whose median gradient norm is
below :data:`VANISH_RELATIVE` times the median over layers, or whose median
``grad_norm / param_norm`` is below :data:`VANISH_TO_PARAM`.  Step: its first
per-layer row below.  Why: in a deep saturating net the first layers' gradients
are orders of magnitude below the last ones' while the total norm looks calm.
*A gradient zero by construction is not vanishing*: a bias whose median
gradient norm is also below :data:`VANISH_RELATIVE` times that of its own
weight (``0.bias`` and ``0.weight``, ``bias_ih_l0`` and ``weight_ih_l0``) gets
a note instead -- the gradient reaches that module, so nothing vanished on the
way; gradients that vanish shrink a module's weight and bias together.  A
convolution's bias followed by a BatchNorm is one: the normalisation subtracts
the batch mean, so the bias gets no gradient while the run learns (the
Conv+BatchNorm run of the corpus).  Only a bias against its weight: two
weights of one module (a ``ParameterList``, a stacked RNN) are different
layers, which vanish one after the other.

``healthy`` -- none of the above.

Threshold
---------
``suggested_max_norm``, one number: the :data:`SUGGEST_PERCENTILE`-th
percentile of the *healthy stretch*'s finite norms -- the rows before an
explosion's onset (or before the first non-finite row), spikes left out --
so that clipping bounds the outliers and leaves the typical update alone;
when the run exploded, the median of that stretch instead, since its last
norms already rise towards the blow-up.  The report also says which fraction
of updates was clipped, and whether the ``max_norm`` used looks too tight (more
than :data:`TIGHT_FRACTION` of the updates clipped: the bound then acts as a
smaller learning rate) or too loose (the run exploded or spiked and the bound
did not clip those updates, or it is above :data:`LOOSE_RATIO` times the
suggestion) -- or that the bound is not the fix: ``learning rate`` when the
worst finding is a blow-up that came back, or a loss blow-up for good without
a growth of the norm at or before it (an Adam-type optimizer's step does not
shrink with the gradient, so lower the learning rate or add a warm-up);
``bad data`` when the spikes are loss spikes with norm spikes only at clipped
updates (a bad shard, which clipping lets the model learn from: skip it with
a SpikeGuard).  Further values for reference: AutoClip's
:data:`AUTOCLIP_PERCENTILE`-th percentile (Seetharaman et al. 2020), Pascanu et
al.'s range of :data:`PASCANU_LOW`-:data:`PASCANU_HIGH` times the mean norm
(2013), and a static ZClip bound, mean + :data:`ZCLIP_Z` standard deviations
(Kumar et al. 2025), of all the finite norms -- or, when the run exploded, of
the healthy stretch the suggestion came from: the blow-up's norms (1e16 and
more in the corpus's exploding runs) would only measure how far it went.

Update norm
-----------
When the log has the update norm, the report's ``update`` key (None without)
sums it up (applied updates: median, maximum, how many ``update_clip``
bounded) and suggests two ``UpdateClip`` bounds from the *healthy stretch of
the updates*: the applied updates before the same end as ``max_norm``'s
stretch, every update and gradient spike left out together with the
:data:`UPDATE_ECHO_ROWS` after it.

- ``UpdateClip(max_norm=...)``: the largest update norm of that stretch, not a
  percentile as for ``max_norm``.  Why: a gradient bound that clips 10 % of the
  updates leaves Adam's normalisation to absorb it, but an update bound scales
  the step itself, so every healthy update it touched would be a step taken
  with a smaller learning rate; the bound is there for the outliers only.
- ``UpdateClip(z=...)``: UpdateClip's own rule replayed on the log (the mean and
  population standard deviation of the previous up to :data:`UPDATE_Z_WINDOW`
  applied update norms, a bound once it holds half of them): the smallest z, in
  half steps and at least :data:`UPDATE_Z_MIN`, under which no update of the
  healthy stretch would have been bounded (None when none came after half a
  window).  Why: the adaptive bound follows a learning-rate schedule and the
  slow drift of Adam's update norm, which a fixed bound taken from one part of
  the run does not; below 3 standard deviations it would act on ordinary
  updates of a longer run.

The report says how many of the update spikes found each would have bounded.

Attention logits
----------------
When the log has ``max_logit`` (``qk_clip=QKClip(model)``), the report's ``attention`` key (None
without) gives the largest logit's start, end and maximum, and a note says when it grows
(:mod:`clipopt._report.rules.attention`: the end's median at least
:data:`~clipopt._report.rules.attention.LOGIT_GROWTH_RATIO` times the start's and at least
:data:`~clipopt._report.rules.attention.LOGIT_LARGE`).
"""

from __future__ import annotations

from .analysis import analyze
from .common import VERDICTS, percentile

__all__ = ["VERDICTS", "analyze", "percentile"]
