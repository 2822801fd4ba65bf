"""CAPKV (Tang et al. 2026) over Python lists (fp64), from the formula of kvpress' ``CapPress``.

One sample's post-RoPE queries are rotated back pair by pair, averaged past the sinks, rotated by
the mean RoPE rotation of the next ``n`` positions (a ``D x D`` matrix built entry by entry); each
key past the sinks is weighted by ``exp(tau cos(k, mu) - max)``, the capacity matrix
``A = I + sum (w + eps) v v^T`` is written entry by entry and solved by Gaussian elimination, and
``w v^T A^{-1} v`` is averaged over the query group.
"""

from __future__ import annotations

import math

from naive.attention import INF, dot, norm
from naive.expected_attention import mean_rotation, unrotate
from naive.leverage import solve


def capkv(
    q: list[list[list[float]]],
    k: list[list[list[float]]],
    v: list[list[list[float]]],
    inv_freq: list[float],
    *,
    rope_scaling: float = 1.0,
    tau: float,
    sinks: int,
    n_future: int,
    epsilon: float,
) -> list[list[float]]:
    """Scores ``[Hkv][n]`` of one unpadded sample: ``q [H][n][D]`` post-RoPE at positions ``0..n-1``,
    ``k``/``v`` ``[Hkv][n][D]``; the first ``sinks`` positions score +inf."""
    H, Hkv, n, dim = len(q), len(k), len(k[0]), len(k[0][0])
    group = H // Hkv
    rot = mean_rotation(n, n_future, inv_freq, rope_scaling)
    counted = range(sinks, n)
    out = [[INF if t < sinks else 0.0 for t in range(n)] for _ in range(Hkv)]
    for h in range(H):
        pre = [unrotate(q[h][t], t, inv_freq, rope_scaling) for t in counted]
        mu = [sum(x[d] for x in pre) / len(pre) for d in range(dim)]
        anchor = [dot(rot[i], mu) for i in range(dim)]
        kh, vh = k[h // group], v[h // group]
        cosines = [max(-1.0, min(1.0, dot(kh[t], anchor) / (norm(kh[t]) * norm(anchor)))) for t in counted]
        top = max(tau * c for c in cosines)
        weights = [math.exp(tau * c - top) for c in cosines]
        capacity = [
            [
                (1.0 if i == j else 0.0)
                + sum((w + epsilon) * vh[t][i] * vh[t][j] for w, t in zip(weights, counted, strict=True))
                for j in range(dim)
            ]
            for i in range(dim)
        ]
        for w, t in zip(weights, counted, strict=True):
            out[h // group][t] += w * dot(vh[t], solve(capacity, vh[t])) / group
    return out
