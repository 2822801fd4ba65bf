"""LagKV's scores over Python lists (fp64), written from the paper's formula: partitions of
``lag`` tokens after the sinks, each normalised per channel by the next partition's min and max,
the standard deviation over channels, a softmax over the partition, keys plus values."""

from __future__ import annotations

import math

from naive.attention import INF, softmax


def std(xs: list[float]) -> float:
    """Unbiased standard deviation (``torch.std``'s default)."""
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


def lag_scores(states: list[list[float]], start: int, lag: int) -> list[float]:
    """softmax over the partition ``[start, start + lag)`` of the channel std of its tokens,
    normalised by the channel ranges of the partition ``[start + lag, start + 2 lag)``."""
    dim = len(states[0])
    reference = states[start + lag : start + 2 * lag]
    low = [min(tok[c] for tok in reference) for c in range(dim)]
    high = [max(tok[c] for tok in reference) for c in range(dim)]
    spreads = []
    for t in range(start, start + lag):
        normed = [(states[t][c] - low[c]) / (high[c] - low[c]) for c in range(dim)]
        spreads.append(std(normed))
    return softmax(spreads)


def rank_in(values: list[float]) -> list[float]:
    """Each value's rank among ``values`` (0 for the smallest) over their count."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    for r, i in enumerate(order):
        ranks[i] = r / len(values)
    return ranks


def naive_lagkv(k: list[list[float]], v: list[list[float]], sinks: int, lag: int, cross: bool) -> list[float]:
    """One (sample, KV head)'s LagKV scores, ``k`` and ``v`` ``[n][D]``: sinks +inf, the tail (and a
    prompt too short to score) ``2 + position / n``, each scored partition its rank (or, ``cross``,
    its summed softmax)."""
    n = len(k)
    out = [2.0 + t / n for t in range(n)]
    for t in range(min(sinks, n)):
        out[t] = INF
    if n < sinks + 2 * lag:
        return out
    parts = (n - sinks) // lag
    for p in range(parts - 1):
        start = sinks + p * lag
        summed = [a + b for a, b in zip(lag_scores(k, start, lag), lag_scores(v, start, lag), strict=True)]
        out[start : start + lag] = summed if cross else rank_in(summed)
    return out
