"""Tests for kvlab.metrics.intervals: each statistic against an independent computation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvlab.metrics import intervals as iv


@pytest.mark.parametrize(
    ("k", "n", "low", "high"),
    # Newcombe (1998), "Two-sided confidence intervals for the single proportion", Table I, method 3
    [(81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718)],
)
def test_wilson_matches_newcombe(k: int, n: int, low: float, high: float) -> None:
    got = iv.wilson(k, n)
    assert got == pytest.approx((low, high), abs=5e-5)


@pytest.mark.parametrize(("k", "n"), [(0, 6), (5, 6), (9, 20), (11, 20), (192, 385), (3, 8)])
def test_wilson_inverts_the_score_test(k: int, n: int) -> None:
    """Each finite bound is the p where the score statistic |p̂ - p| / sqrt(p (1 - p) / n) equals z
    (found by bisection here, not by the closed form)."""

    def score(p: float) -> float:
        return abs(k / n - p) / math.sqrt(p * (1 - p) / n) - iv.Z95

    def root(lo: float, hi: float) -> float:  # score changes sign between lo and hi
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if (score(mid) > 0) == (score(lo) > 0) else (lo, mid)
        return (lo + hi) / 2

    low, high = iv.wilson(k, n)
    p_hat = k / n
    assert low == pytest.approx(0.0 if k == 0 else root(1e-12, p_hat), abs=1e-9)
    assert high == pytest.approx(1.0 if k == n else root(max(p_hat, 1e-12), 1 - 1e-12), abs=1e-9)


def test_wilson_rejects_bad_counts() -> None:
    for k, n in ((3, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError):
            iv.wilson(k, n)


def test_samples_for_five_points() -> None:
    assert iv.samples_for_half_width(0.05) == 385  # z² / (4 * 0.05²) = 384.1
    n = iv.samples_for_half_width(0.05)
    low, high = iv.wilson(n // 2, n)
    assert (high - low) / 2 < 0.0501


def test_weighted_mean_and_proportion() -> None:
    groups = [[1.0, 0.0, 1.0, 1.0], [0.0, 1.0]]
    assert iv.weighted_mean(groups) == pytest.approx(4 / 6)  # pooled
    assert iv.weighted_mean(groups, [0.5, 0.5]) == pytest.approx((0.75 + 0.5) / 2)  # macro
    assert iv.is_proportion(groups) and iv.is_proportion(groups, [4, 2])
    assert not iv.is_proportion(groups, [0.5, 0.5])  # a macro mean of unequal strata is no share
    assert not iv.is_proportion([[1.0, 0.5]])
    assert iv.cell_interval(groups).kind == "wilson"
    assert iv.cell_interval(groups).low == pytest.approx(iv.wilson(4, 6)[0])
    assert iv.cell_interval([[1.0, 0.5]]).kind == "bootstrap"


def test_bootstrap_is_seeded_and_brackets_the_mean() -> None:
    values = [[0.1, 0.4, 0.35, 0.8, 0.65, 0.2, 0.5]]
    first, again = iv.bootstrap_interval(values), iv.bootstrap_interval(values)
    assert first == again  # the fixed seed
    assert first[0] < iv.weighted_mean(values) < first[1]
    assert iv.bootstrap_interval([[0.3, 0.3, 0.3]]) == pytest.approx((0.3, 0.3))


def test_bootstrap_covers_the_true_mean_95_percent_of_the_time() -> None:
    """Seeded simulation: 400 data sets of 60 fractional scores (Beta(2, 3), mean 0.4), and 400
    stratified ones (Beta(2, 3) and Beta(5, 1), macro mean (0.4 + 5/6) / 2); the intervals cover
    the true mean about 95% of the time (the percentile bootstrap runs a little short at n = 60)."""
    rng = np.random.default_rng(1234)
    hits = sum(
        lo <= 0.4 <= hi
        for lo, hi in (
            iv.bootstrap_interval([rng.beta(2, 3, 60)], resamples=1000, seed=s) for s in range(400)
        )
    )
    assert 0.91 <= hits / 400 <= 0.98
    truth = (0.4 + 5 / 6) / 2
    hits = 0
    for s in range(400):
        groups = [rng.beta(2, 3, 40), rng.beta(5, 1, 20)]
        lo, hi = iv.bootstrap_interval(groups, [0.5, 0.5], resamples=1000, seed=s)
        hits += lo <= truth <= hi
    assert 0.91 <= hits / 400 <= 0.98


def test_mcnemar_known_answers() -> None:
    assert iv.mcnemar_p(6, 0) == pytest.approx(2 / 64)  # the fewest discordant pairs that resolve
    assert iv.mcnemar_p(0, 5) == pytest.approx(2 / 32)  # five all one way do not
    assert iv.mcnemar_p(2, 8) == pytest.approx(2 * (1 + 10 + 45) / 1024)
    assert iv.mcnemar_p(4, 4) == 1.0 and iv.mcnemar_p(0, 0) == 1.0
    scipy_stats = pytest.importorskip("scipy.stats")
    for b, c in ((3, 11), (10, 2), (7, 7), (0, 9), (25, 12)):
        assert iv.mcnemar_p(b, c) == pytest.approx(scipy_stats.binomtest(b, b + c).pvalue)


def test_mcnemar_bounds_over_pairings() -> None:
    # one method at 20/20: every pairing is the same (c = 0)
    assert iv.mcnemar_bounds(20, 11, 20) == (iv.mcnemar_p(9, 0), iv.mcnemar_p(9, 0))
    # 11 against 4 of 20: c from 0 (p = 2 / 2^7) to 4 (b = 11, p = 2 P(X <= 4 | 15))
    low, high = iv.mcnemar_bounds(11, 4, 20)
    assert low == pytest.approx(2 / 2**7) and high == pytest.approx(2 * 1941 / 2**15)
    # 5 against 0 of 6: never resolved
    assert iv.mcnemar_bounds(5, 0, 6)[0] > iv.ALPHA
    # brute force over every pairing of 4 and 2 successes among 6 samples
    import itertools

    ps = set()
    for a in itertools.combinations(range(6), 4):
        for b in itertools.combinations(range(6), 2):
            only_a, only_b = len(set(a) - set(b)), len(set(b) - set(a))
            ps.add(iv.mcnemar_p(only_a, only_b))
    assert iv.mcnemar_bounds(4, 2, 6) == (min(ps), max(ps))


def test_resolved_on_constructed_pairs() -> None:
    # 0/1 scores: McNemar. 6 samples where only a is right, none the other way: p = 1/32
    a = [[1.0] * 6 + [1.0, 0.0] * 5]
    b = [[0.0] * 6 + [1.0, 0.0] * 5]
    assert iv.resolved(a, b) and iv.resolved(b, a)
    b5 = [[0.0] * 5 + [1.0] + [1.0, 0.0] * 5]  # five discordant: p = 1/16
    assert not iv.resolved(a, b5)
    # the same marginals, paired differently: 6 right only in a and 3 only in b (p = 0.51)
    assert not iv.resolved([[1.0] * 6 + [0.0] * 3 + [1.0] * 3], [[0.0] * 6 + [1.0] * 3 + [1.0] * 3])
    # fractional scores: the sign-flip test. A constant shift of 0.05 on 40 noisy scores is resolved
    rng = np.random.default_rng(0)
    base = rng.uniform(0, 0.9, 40)
    assert iv.resolved([base + 0.05], [base])
    # ... two samples both 0.5 lower are not (p = 2/4), whatever a bootstrap would say
    assert not iv.resolved([[0.5, 0.0]], [[1.0, 0.5]])
    # differences of +0.1 and -0.1 in equal numbers: mean 0, not resolved
    noisy = base.copy()
    noisy[::2] += 0.1
    noisy[1::2] -= 0.1
    assert not iv.resolved([noisy], [base])
    with pytest.raises(ValueError, match="pair up"):
        iv.resolved([[0.5, 0.2]], [[0.5]])


def test_sign_flip_against_enumeration_and_mcnemar() -> None:
    import itertools

    # brute force over the 2^7 sign assignments of 7 weighted differences in two strata
    diffs, weights = [[0.3, -0.1, 0.25, 0.4], [0.5, 0.2, -0.05]], [0.5, 0.5]
    per_sample = [0.5 / 4 * d for d in diffs[0]] + [0.5 / 3 * d for d in diffs[1]]
    observed = abs(sum(per_sample))
    hits = sum(
        abs(sum(s * d for s, d in zip(signs, per_sample, strict=True))) >= observed - 1e-12
        for signs in itertools.product((1, -1), repeat=7)
    )
    assert iv.sign_flip_p(diffs, weights) == pytest.approx(hits / 128)
    # on 0/1 scores with equal weights: McNemar's exact test (zero differences drop out)
    for b, c in ((6, 0), (5, 1), (3, 3), (9, 2)):
        d = [[1.0] * b + [-1.0] * c + [0.0] * 7]
        assert iv.sign_flip_p(d) == pytest.approx(iv.mcnemar_p(b, c))
    # past EXACT_FLIPS non-zero differences: seeded Monte Carlo, close to the exact binomial answer
    d = [[1.0] * 14 + [-1.0] * 6]
    p = iv.sign_flip_p(d)
    assert p == iv.sign_flip_p(d) and p == pytest.approx(iv.mcnemar_p(14, 6), abs=0.01)
    assert iv.sign_flip_p([[0.0, 0.0]]) == 1.0
