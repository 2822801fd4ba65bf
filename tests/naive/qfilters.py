"""Q-Filters over Python lists (fp64), from the paper (Godey et al. 2025, Sec. 3-4): the first
right singular vector of the stacked queries by power iteration on ``Q^T Q``, signed so that the
queries' mean projection is positive, and each key's projection on it."""

from __future__ import annotations

import math

from naive.attention import dot


def first_right_singular_vector(rows: list[list[float]], iterations: int = 500) -> list[float]:
    """``v_1`` of the matrix with ``rows`` (power iteration on ``Q^T Q``, unit length, sign by the
    mean projection: ``mean_i <q_i, v_1> > 0``)."""
    dim = len(rows[0])
    v = [1.0 / math.sqrt(dim)] * dim
    for _ in range(iterations):
        projections = [dot(row, v) for row in rows]  # Q v
        w = [sum(p * row[c] for p, row in zip(projections, rows, strict=True)) for c in range(dim)]  # Q^T Q v
        length = math.sqrt(dot(w, w))
        v = [x / length for x in w]
    if sum(dot(row, v) for row in rows) < 0:
        v = [-x for x in v]
    return v


def qfilter_scores(keys: list[list[float]], direction: list[float]) -> list[float]:
    """``<k_t, u>`` for every key (the paper's Theorem 1 estimate of the expected logit, up to kappa)."""
    return [dot(k, direction) for k in keys]
