"""Expected Attention (Devoto et al. 2025) over Python lists, from the paper's formulas.

One sample's post-RoPE queries are rotated back pair by pair (RoPE rotates the dims ``i`` and
``i + D/2`` by the angle ``p * theta_i``), their mean and covariance taken without the first
``sinks`` positions, the average rotation of the next ``n`` positions applied (as a ``D x D``
matrix built entry by entry), and each key scored by ``exp(s mu.k + s^2/2 k^T Sigma k)``,
normalised over the keys after the sinks, averaged over the query group, then ``(a + eps) ||v||``.
"""

from __future__ import annotations

import math

from naive.attention import INF, dot, norm


def unrotate(q: list[float], position: int, inv_freq: list[float], scaling: float) -> list[float]:
    """The query before RoPE of ``q`` rotated at ``position`` (cos and sin scaled by ``scaling``)."""
    half = len(q) // 2
    out = [0.0] * len(q)
    for i in range(half):
        angle = position * inv_freq[i]
        x, y = q[i] / scaling, q[i + half] / scaling
        out[i] = x * math.cos(angle) + y * math.sin(angle)  # rotate (x, y) back by -angle
        out[i + half] = y * math.cos(angle) - x * math.sin(angle)
    return out


def mean_rotation(start: int, n: int, inv_freq: list[float], scaling: float) -> list[list[float]]:
    """``mean_{j < n} R_{start + j}``: ``R_p`` rotates each pair ``(i, i + D/2)`` by ``p * theta_i``."""
    half = len(inv_freq)
    dim = 2 * half
    rot = [[0.0] * dim for _ in range(dim)]
    for j in range(n):
        for i in range(half):
            c = math.cos((start + j) * inv_freq[i]) * scaling / n
            s = math.sin((start + j) * inv_freq[i]) * scaling / n
            rot[i][i] += c  # x' = x cos - y sin
            rot[i][i + half] -= s
            rot[i + half][i + half] += c  # y' = y cos + x sin
            rot[i + half][i] += s
    return rot


def expected_attention(
    q: list[list[list[float]]],
    k: list[list[list[float]]],
    v: list[list[list[float]]],
    inv_freq: list[float],
    *,
    rope_scaling: float = 1.0,
    softmax_scale: float,
    sinks: int,
    n_future: int,
    covariance: bool = True,
    vnorm: bool = True,
    epsilon: float = 0.0,
) -> list[list[float]]:
    """Scores ``[Hkv][n]`` of one unpadded sample: ``q [H][n][D]`` post-RoPE at positions ``0..n-1``,
    ``k``/``v`` ``[Hkv][n][D]``; the first ``sinks`` keys score +inf."""
    H, Hkv, n, dim = len(q), len(k), len(k[0]), len(k[0][0])
    group = H // Hkv
    rot = mean_rotation(n, n_future, inv_freq, rope_scaling)
    out = [[0.0] * n for _ in range(Hkv)]
    for h in range(H):
        pre = [unrotate(q[h][t], t, inv_freq, rope_scaling) for t in range(sinks, n)]
        count = max(1, len(pre))
        mu = [sum(x[d] for x in pre) / count for d in range(dim)]
        sigma = [
            [sum((x[i] - mu[i]) * (x[j] - mu[j]) for x in pre) / count for j in range(dim)]
            for i in range(dim)
        ]
        mu_f = [dot(rot[i], mu) for i in range(dim)]
        sigma_f = [
            [
                sum(rot[i][a] * sigma[a][b] * rot[j][b] for a in range(dim) for b in range(dim))
                for j in range(dim)
            ]
            for i in range(dim)
        ]
        kh = k[h // group]
        exponents = []
        for t in range(sinks, n):
            e = softmax_scale * dot(mu_f, kh[t])
            if covariance:
                quad = sum(kh[t][i] * sigma_f[i][j] * kh[t][j] for i in range(dim) for j in range(dim))
                e += softmax_scale**2 / 2 * quad
            exponents.append(e)
        top = max(exponents)
        weights = [math.exp(e - top) for e in exponents]
        total = sum(weights)
        for t, w in zip(range(sinks, n), weights, strict=True):
            out[h // group][t] += w / total / group
    for kv in range(Hkv):
        for t in range(n):
            if t < sinks:
                out[kv][t] = INF
            elif vnorm:
                out[kv][t] = (out[kv][t] + epsilon) * norm(v[kv][t])
    return out
