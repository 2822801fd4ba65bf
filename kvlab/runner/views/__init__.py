"""TensorBoard views of a run (``docs/evaluation.md``, "TensorBoard views").

Written into ``<run>/tensorboard/`` while the run predicts (:class:`~.inspector.Inspector`):

Every batch (step = batch index; the unit is in the name):

- ``cost/kv_kept_over_full``: kept / full prompt KV bytes, mean over the batch's samples;
- ``time/prefill_s_per_batch``, ``time/compression_s_per_batch``, ``time/decode_s_per_batch``
  (seconds for the whole batch), ``time/compression_over_prefill``;
- ``route/switch_layer_mean``: routed pipelines (DAVID): the batch's mean first layer run by the
  rule's ``after`` branch (a sample that never switched counts as the number of layers).

The first ``model.inspect_samples`` batches, their first sample (step = batch index):

- ``budget/kept_layer_head``: kept / prompt tokens per layer (x) and KV head (y), colour scale
  fitted to the data and stated in the colour bar (:func:`~.figures.heatmap_figure`);
- ``budget/kept_per_layer``: kept share per layer, mean over heads with the heads' min..max band,
  the layer budget dashed and, for prompts with images, each modality's kept share;
- ``scores/<role>/layer_<l>``: histogram of each scorer's score at layer ``l``, over the first
  sample's KV heads and candidate positions (no padding, no protected window or sinks); and
  ``scores/mixed/layer_<l>``, the mixer's output over the same entries, when two scorers or more
  are mixed (:func:`~.inspector.score_histograms`);
- ``patches/layer_<l>/image_<i>``: for the layers of ``model.inspect_layers``, the image beside
  the share of KV heads that kept each patch token (:mod:`~.patches`), each patch's glyph written
  on it for the ``smollm2-reader`` tasks.

At the end of the run (step 0): ``modality/kept_fraction_per_layer`` (kept / present tokens of
each modality per layer, every sample), ``budget/kept_layer_head_mean`` (the heatmap averaged
over every sample) and, for routed pipelines, ``route/metric_per_layer`` (a figure, and the
same numbers as a TEXT table).

Then, from the finished run's files, ``<run>/tensorboard/summary/`` (:mod:`~.summary`): TEXT
``results/metrics`` (the results as a table), ``run/config``, ``run/prompt``, and the run as an
HPARAMS trial (:mod:`~.hparams`).
"""

from kvlab.runner.views.inspector import Inspector
from kvlab.runner.views.labels import run_label
from kvlab.runner.views.summary import write_run_summary

__all__ = ["Inspector", "run_label", "write_run_summary"]
