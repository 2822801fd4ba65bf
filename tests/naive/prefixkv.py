"""PrefixKV (Wang et al. 2024), naive: layer importance (Sec. 3.2), the global prefix configuration
(Eq. 1) by a threshold scan, and the fixed-index decode rule on one (sample, head) as a list."""

from __future__ import annotations

import math

from naive.attention import dot, softmax


def naive_layer_importance(q, k, scaling) -> list[float]:
    """``I[n] = mean_h sum_m softmax_n(q^{h,m} . k^{h,n})`` of one unpadded sample (Sec. 3.2)."""
    H, Hkv, n = len(q), len(k), len(k[0])
    G = H // Hkv
    total = [0.0] * n
    for h in range(H):
        for m in range(n):
            probs = softmax([dot(q[h][m], k[h // G][j]) * scaling for j in range(m + 1)])
            for j, p in enumerate(probs):
                total[j] += p / H
    return total


def naive_prefix_sizes(importance: list[list[float]], protected: list[bool], total: int) -> list[int]:
    """Layer sizes of Eq. 1 found by scanning thresholds: ``k_l(p) = min{k : C_l[k] >= p}``.

    ``C_l`` is the cumulative normalised importance along layer l's priority sequence, protected
    tokens first (their mass counted first), then the rest by descending importance (ties to the
    lower position); a layer keeps at least its protected tokens. Thresholds are tried from the
    smallest upward (every value of every ``C_l``) until the sizes add up to ``total``.
    """
    curves = []
    for row in importance:
        mass = sum(row)
        w = [x / mass for x in row]
        held = [w[j] for j in range(len(w)) if protected[j]]
        rest = sorted((j for j in range(len(w)) if not protected[j]), key=lambda j: (-w[j], j))
        curve, acc = [], 0.0
        for x in held + [w[j] for j in rest]:
            acc += x
            curve.append(acc)
        curves.append(curve)
    floor = sum(protected)

    def sizes(p: float) -> list[int]:
        return [
            max(floor, next(k + 1 for k, c in enumerate(curve) if c >= p or k == len(curve) - 1))
            for curve in curves
        ]

    for p in sorted({c for curve in curves for c in curve[max(floor - 1, 0) :]} | {0.0}):
        found = sizes(p)
        if sum(found) == total:
            return found
    raise AssertionError("no threshold gives that total (ties); use continuous scores")


def naive_fixed_index_decode(arrivals, kept: int, prompt: int, distance: int, steps: int):
    """PrefixKV's decode rule on one (sample, head) as a list, returning the list after each step.

    ``arrivals``: the ``kept`` entries after prefill in position order; step ``t`` appends
    ``("new", t)``; then, with ``n`` tokens processed, the entry at index ``e = kept - distance``
    (``kept // 2`` if below 1) is deleted (later ones shift left) when
    ``trunc(len - n * kept / prompt) > 0``, computed exactly with fractions.
    """
    from fractions import Fraction

    entries = list(arrivals)
    e = kept - distance if kept - distance >= 1 else kept // 2
    history = []
    for t in range(steps):
        entries.append(("new", t))
        processed = prompt + t + 1
        if math.trunc(len(entries) - Fraction(processed * kept, prompt)) > 0:
            del entries[e]
        history.append(list(entries))
    return history
