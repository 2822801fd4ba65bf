"""Calibration: per-model statistics measured once (``kvlab calibrate``) and loaded by components.

See docs/calibration.md. ``Artefact`` is the file format; ``CALIBRATIONS`` the registry of
statistics (``visual_heads`` for SparseMM, ``redundancy`` for MixKV's offline r̄, and more in
:mod:`kvlab.calibration.prefixkv` and :mod:`kvlab.calibration.reading`).
"""

from kvlab.calibration.artefact import Artefact, UsesArtefact, cache_path

__all__ = ["Artefact", "UsesArtefact", "cache_path"]
