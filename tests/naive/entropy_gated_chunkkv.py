"""EntropyGatedChunkKV's selection over Python lists, from kvpress 0.5.5's description of
``EntropyGatedChunkKVPress`` (a greedy pass over the chunks by mean score, important but spiky
chunks cut to their best tokens, the rest of the budget to the best remaining tokens), on kvlab's
candidates: the protected tokens kept anyway, each sample's own chunks."""

from __future__ import annotations

import math

EPSILON = 1e-8


def normalised_entropy(xs: list[float]) -> float:
    """The entropy of ``xs`` taken as weights (shifted by their minimum if one is negative), over
    ``log(len(xs))``, clamped to [0, 1]; 0 for a single value."""
    if len(xs) <= 1:
        return 0.0
    lowest = min(xs)
    if lowest < 0:
        xs = [x - lowest for x in xs]
    total = sum(xs)
    h = 0.0
    for x in xs:
        p = x / (total + EPSILON)
        h -= p * math.log(p + EPSILON)
    return min(1.0, max(0.0, h / math.log(len(xs))))


def lower_median(xs: list[float]) -> float:
    return sorted(xs)[(len(xs) - 1) // 2]


def naive_entropy_gated_chunkkv(
    scores: list[list[float]], counts: list[int], chunk: int, low: int, shared: bool
) -> list[list[int]]:
    """Kept positions of each head of one sample, ``scores [Hkv][n]`` in the sample's own positions
    (+inf kept, -inf never, finite candidates), ``counts [Hkv]``; ``shared``: every head ranks by
    the candidates' scores summed over the heads."""
    heads, n = len(scores), len(scores[0])
    if shared:
        summed = [sum(scores[g][t] for g in range(heads) if math.isfinite(scores[g][t])) for t in range(n)]
        scores = [
            [summed[t] if math.isfinite(scores[h][t]) else scores[h][t] for t in range(n)]
            for h in range(heads)
        ]
    out = []
    for h in range(heads):
        s = scores[h]
        chunks = {}
        for t in range(n):
            if math.isfinite(s[t]):
                chunks.setdefault(t // chunk, []).append(t)
        mean = {j: sum(s[t] for t in members) / len(members) for j, members in chunks.items()}
        entropy = {j: normalised_entropy([s[t] for t in members]) for j, members in chunks.items()}
        mean_median = lower_median(list(mean.values())) if chunks else 0.0
        entropy_median = lower_median(list(entropy.values())) if chunks else 0.0
        keep = {t for t in range(n) if s[t] == math.inf}
        left = counts[h] - len(keep)
        for j in sorted(chunks, key=lambda j: (-mean[j], j)):
            if left <= 0:
                break
            best = sorted(chunks[j], key=lambda t: (-s[t], t))
            take = min(len(best), left)
            if mean[j] >= mean_median and entropy[j] < entropy_median:
                take = min(take, low)
            keep |= set(best[:take])
            left -= take
        rest = sorted(
            (t for t in range(n) if math.isfinite(s[t]) and t not in keep), key=lambda t: (-s[t], t)
        )
        keep |= set(rest[: max(left, 0)])
        out.append(sorted(keep))
    return out
