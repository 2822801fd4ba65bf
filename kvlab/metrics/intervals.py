"""95% intervals of a table cell's mean score, and whether two methods' difference is resolved.

A cell of the reference tables and the leaderboard is a mean of per-sample task scores in [0, 1],
possibly a macro mean: the samples fall into strata (a family's tasks), each stratum's mean
weighted (:func:`weighted_mean`). The cell's interval (:func:`cell_interval`) is

- the **Wilson score interval** (:func:`wilson`) where the cell is a proportion: every score is 0
  or 1 and every sample weighs the same (the macro mean equals the pooled share);
- else a **percentile bootstrap** (:func:`bootstrap_interval`): :data:`RESAMPLES` resamples drawn
  with a fixed seed (:data:`SEED`), each stratum's samples resampled within it, the weighted mean
  recomputed, the 2.5% and 97.5% quantiles of the resampled means.

Two methods scored on the same samples (pairs aligned) differ resolvably at 95%
(:func:`resolved`) by a paired test:

- **McNemar's exact test** (:func:`mcnemar_p`) where both are proportions: the two-sided binomial
  test of the discordant pairs (one right, the other wrong), resolved when p < 0.05;
- else the **paired sign-flip test** (:func:`sign_flip_p`, a permutation test of the weighted mean
  difference; McNemar's test is its 0/1 case), resolved when p < 0.05. A paired bootstrap was not
  chosen: with few samples whose differences agree (two samples, both 0.5 lower) its interval
  shrinks to a point and would "resolve" anything.

:func:`mcnemar_bounds` gives the range of McNemar's p over every pairing two proportions of the
same n allow, for tables whose per-sample records are gone (only the counts are known).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: the two-sided 95% normal quantile
Z95 = 1.959963984540054
#: the bootstrap's resamples and seed (fixed: a table's intervals are reproducible)
RESAMPLES = 2000
SEED = 0
#: the level a difference is resolved at (two-sided)
ALPHA = 0.05
#: the sign-flip test enumerates every assignment up to this many non-zero differences
EXACT_FLIPS = 16


@dataclass(frozen=True)
class Interval:
    """A 95% interval ``[low, high]`` on the scores' scale (0 to 1) and how it was computed
    (``wilson`` or ``bootstrap``)."""

    low: float
    high: float
    kind: str


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of the proportion ``successes / n`` (Wilson 1927; Newcombe 1998's
    method 3): the proportions ``p`` whose score test ``|p̂ - p| / sqrt(p (1 - p) / n)`` stays
    within ``z``::

        centre = (p̂ + z²/2n) / (1 + z²/n),  half = z / (1 + z²/n) * sqrt(p̂ (1 - p̂) / n + z²/4n²)
    """
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"wilson: need 0 <= successes <= n and n >= 1, got {successes} of {n}.")
    p, z2 = successes / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def _weights(groups: Sequence[Sequence[float]], weights: Sequence[float] | None) -> np.ndarray:
    """Each stratum's weight (default: its share of the samples: the pooled mean)."""
    sizes = np.array([len(g) for g in groups], dtype=np.float64)
    if not len(groups) or (sizes == 0).any():
        raise ValueError("intervals: every stratum needs at least one sample.")
    w = sizes / sizes.sum() if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != sizes.shape:
        raise ValueError(f"intervals: {len(groups)} strata but {w.shape[0]} weights.")
    return w / w.sum()


def weighted_mean(groups: Sequence[Sequence[float]], weights: Sequence[float] | None = None) -> float:
    """``Σ w_s mean(stratum s)``: the cell's value (``weights`` None: the pooled mean)."""
    w = _weights(groups, weights)
    return float(sum(wi * float(np.mean(g)) for wi, g in zip(w, groups, strict=True)))


def is_proportion(groups: Sequence[Sequence[float]], weights: Sequence[float] | None = None) -> bool:
    """Whether the weighted mean is a plain share of 0/1 scores: every score 0 or 1 and every
    sample weighing the same (each stratum's weight proportional to its size)."""
    if not all(v in (0.0, 1.0) for g in groups for v in g):
        return False
    w, sizes = _weights(groups, weights), np.array([len(g) for g in groups], dtype=np.float64)
    return bool(np.allclose(w, sizes / sizes.sum(), rtol=1e-9, atol=1e-12))


def _resampled_means(
    groups: Sequence[Sequence[float]], w: np.ndarray, resamples: int, seed: int
) -> np.ndarray:
    """``[resamples]`` weighted means, each stratum resampled with replacement within itself."""
    rng = np.random.default_rng(seed)
    total = np.zeros(resamples)
    for wi, group in zip(w, groups, strict=True):
        values = np.asarray(group, dtype=np.float64)
        picks = rng.integers(0, len(values), size=(resamples, len(values)))
        total += wi * values[picks].mean(axis=1)
    return total


def bootstrap_interval(
    groups: Sequence[Sequence[float]],
    weights: Sequence[float] | None = None,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> tuple[float, float]:
    """The percentile bootstrap 95% interval of :func:`weighted_mean` (stratified: each stratum's
    samples resampled within it, ``resamples`` times from ``seed``)."""
    means = _resampled_means(groups, _weights(groups, weights), resamples, seed)
    low, high = np.quantile(means, [ALPHA / 2, 1 - ALPHA / 2])
    return float(low), float(high)


def cell_interval(groups: Sequence[Sequence[float]], weights: Sequence[float] | None = None) -> Interval:
    """The cell's 95% interval: Wilson where it is a proportion (:func:`is_proportion`), else the
    stratified percentile bootstrap."""
    if is_proportion(groups, weights):
        n = sum(len(g) for g in groups)
        low, high = wilson(round(sum(sum(g) for g in groups)), n)
        return Interval(low, high, "wilson")
    return Interval(*bootstrap_interval(groups, weights), "bootstrap")


def mcnemar_p(b: int, c: int) -> float:
    """McNemar's exact test: the two-sided binomial p-value of ``b`` pairs where only the first
    method is right against ``c`` where only the second is, under ``Binomial(b + c, 1/2)``:
    ``min(1, 2 P(X <= min(b, c)))``; 1 without discordant pairs."""
    m = b + c
    if m == 0:
        return 1.0
    tail = sum(math.comb(m, i) for i in range(min(b, c) + 1)) / 2**m
    return min(1.0, 2 * tail)


def mcnemar_bounds(k_a: int, k_b: int, n: int) -> tuple[float, float]:
    """``(lowest, highest)`` McNemar p over every pairing of ``k_a`` and ``k_b`` successes among the
    same ``n`` samples: with ``c`` pairs where only the method with fewer is right, the other
    has ``c + |k_a - k_b|``, and ``c`` runs from 0 to ``min(fewer, n - more)``. The counts decide
    the test when both bounds fall on the same side of :data:`ALPHA`."""
    more, fewer = max(k_a, k_b), min(k_a, k_b)
    if not 0 <= fewer <= more <= n:
        raise ValueError(f"mcnemar_bounds: need 0 <= k <= n, got {k_a}, {k_b} of {n}.")
    ps = [mcnemar_p(c + more - fewer, c) for c in range(min(fewer, n - more) + 1)]
    return min(ps), max(ps)


def sign_flip_p(
    diffs: Sequence[Sequence[float]],
    weights: Sequence[float] | None = None,
    flips: int = 10_000,
    seed: int = SEED,
) -> float:
    """The paired sign-flip (permutation) test of a weighted mean difference: under "no
    difference" each sample's difference ``a - b`` is as likely negated, so the p-value is the
    share of sign assignments whose ``|Σ w_s mean(±d_s)|`` reaches the observed one. Exact over
    every assignment of the non-zero differences up to :data:`EXACT_FLIPS` of them, else
    ``(1 + hits) / (1 + flips)`` over ``flips`` random assignments from ``seed``. On 0/1 scores with
    equal weights it is McNemar's exact test (the non-zero differences are the discordant pairs)."""
    w = _weights(diffs, weights)
    per_sample = np.concatenate(
        [wi / len(d) * np.asarray(d, dtype=np.float64) for wi, d in zip(w, diffs, strict=True)]
    )
    terms = per_sample[per_sample != 0]
    if terms.size == 0:
        return 1.0
    observed = abs(terms.sum()) * (1 - 1e-9)  # ties count as extreme despite rounding
    if terms.size <= EXACT_FLIPS:
        signs = 1 - 2 * ((np.arange(2**terms.size)[:, None] >> np.arange(terms.size)) & 1)
        return float(np.mean(np.abs(signs @ terms) >= observed))
    signs = np.random.default_rng(seed).choice((-1.0, 1.0), size=(flips, terms.size))
    return float((1 + np.sum(np.abs(signs @ terms) >= observed)) / (1 + flips))


def resolved(
    groups_a: Sequence[Sequence[float]],
    groups_b: Sequence[Sequence[float]],
    weights: Sequence[float] | None = None,
) -> bool:
    """Whether two methods' weighted means on the same, paired samples differ at 95%: McNemar's
    exact test where both are proportions, else the paired sign-flip test (:func:`sign_flip_p`),
    each at p < 0.05."""
    if any(len(a) != len(b) for a, b in zip(groups_a, groups_b, strict=True)):
        raise ValueError("resolved: the two methods' strata must pair up sample by sample.")
    if is_proportion(groups_a, weights) and is_proportion(groups_b, weights):
        pairs = [(x, y) for a, b in zip(groups_a, groups_b, strict=True) for x, y in zip(a, b, strict=True)]
        only_a = sum(1 for x, y in pairs if x > y)
        only_b = sum(1 for x, y in pairs if y > x)
        return mcnemar_p(only_a, only_b) < ALPHA
    diffs = [np.subtract(a, b, dtype=np.float64) for a, b in zip(groups_a, groups_b, strict=True)]
    return sign_flip_p(diffs, weights) < ALPHA


def samples_for_half_width(half_width: float, p: float = 0.5, z: float = Z95) -> int:
    """The samples a proportion near ``p`` needs for a 95% interval of ``± half_width`` (the normal
    approximation, which Wilson's approaches as n grows): ``n = z² p (1 - p) / half_width²``,
    rounded up; 385 for ±5 points at 50%."""
    return math.ceil(z * z * p * (1 - p) / (half_width * half_width))
