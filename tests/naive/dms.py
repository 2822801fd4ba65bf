"""DMS's eviction rule over Python lists: the entries scoring at least a threshold, at most a count."""

from __future__ import annotations


def threshold_keep(scores: list[float], count: int, threshold: float) -> list[int]:
    """The positions one (sample, head) keeps: of those with ``scores[t] >= threshold`` (``inf``:
    protected, ``-inf``: padding), the ``count`` highest-scored (ties to the lower position), ascending."""
    above = [t for t, s in enumerate(scores) if s >= threshold]
    ranked = sorted(above, key=lambda t: (-scores[t], t))
    return sorted(ranked[:count])
