"""Calibration: per-model statistics measured once (``kvlab calibrate``) and loaded by components.

See docs/calibration.md. ``CALIBRATIONS`` (:mod:`kvlab.calibration.statistics`) is the registry of
statistics (``visual_heads`` for SparseMM, ``redundancy`` for MixKV's offline r̄,
``prefixkv_layer_ratios`` for PrefixKV's offline allocator, and the reading VLM's
``hybridkv_head_classes`` and ``image_attention`` in :mod:`kvlab.calibration.reading`, the
Q-Filters directions ``qfilters`` in :mod:`kvlab.calibration.qfilters`, the needle-reading head
scores in :mod:`kvlab.calibration.retrieval_heads`);
importing the package registers every one. The artefact file format the components read is
ground: :mod:`kvlab.config.artefacts`.
"""

from kvlab.calibration import prefixkv, qfilters, reading, retrieval_heads, statistics  # noqa: F401  (imported for their registrations)
