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
  fitted to the data and stated in the colour bar (:func:`~.figures.heatmap_figure`); not drawn
  for a uniform allocation (one number: in the TEXT summary);
- ``budget/kept_per_layer``: kept share per layer, mean over heads with the heads' min..max band,
  the layer budget dashed and, for prompts with images, each modality's kept share;
- ``scores/<role>/layer_<l>``: for the layers of ``model.inspect_layers`` (first and last by
  default, ``all`` on request), a histogram of each scorer's score over the first sample's KV
  heads and candidate positions (no padding, no protected window or sinks); and
  ``scores/mixed/layer_<l>``, the mixer's output over the same entries, when two scorers or more
  are mixed (:func:`~.inspector.score_histograms`);
- ``patches/layer_<l>/image_<i>``: for the same layers, the image beside the share of KV heads
  that kept each patch token (:mod:`~.patches`), each patch's glyph written on it for the
  ``smollm2-reader`` tasks.

From the finished run's files (:mod:`~.summary`), in the same ``tensorboard/`` directory: the
end-of-run figures over every record (``budget/kept_layer_head_mean``,
``modality/kept_fraction_per_layer`` where prompts hold images or video, ``route/metric_per_layer``
for routed pipelines), TEXT ``results/metrics``, ``run/config``, ``run/prompt``, and the run as an
HPARAMS trial (:mod:`~.hparams`) named by what varies within its experiment (:mod:`~.names`).
"""

from kvlab.runner.views.inspector import Inspector, modality_record
from kvlab.runner.views.labels import run_label
from kvlab.runner.views.summary import write_experiment_summaries, write_run_summary

__all__ = ["Inspector", "modality_record", "run_label", "write_experiment_summaries", "write_run_summary"]
