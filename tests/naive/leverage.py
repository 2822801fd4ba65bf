"""Compactor's leverage scores over Python lists (fp64), from the formula kvpress'
``LeverageScorePress`` computes: centred keys, a right sketch, ridge leverage, a z-score."""

from __future__ import annotations

import math


def solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """``matrix^{-1} rhs`` by Gaussian elimination with partial pivoting."""
    n = len(matrix)
    a = [row[:] + [rhs[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for c in range(col, n + 1):
                a[r][c] -= f * a[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (a[r][n] - sum(a[r][c] * x[c] for c in range(r + 1, n))) / a[r][r]
    return x


def leverage(keys: list[list[float]], sketch: list[list[float]] | None, ridge: float) -> list[float]:
    """One head's ridge leverage ``l_t = x_t (X^T X + ridge I)^{-1} x_t^T`` of its pre-RoPE keys
    ``[n][D]``, centred over the tokens and multiplied by ``sketch [D][r]`` (none: the keys)."""
    n, dim = len(keys), len(keys[0])
    mean = [sum(k[c] for k in keys) / n for c in range(dim)]
    rows = [[k[c] - mean[c] for c in range(dim)] for k in keys]
    if sketch is not None:
        rows = [[sum(x[c] * sketch[c][j] for c in range(dim)) for j in range(len(sketch[0]))] for x in rows]
    r = len(rows[0])
    gram = [[sum(x[i] * x[j] for x in rows) + (ridge if i == j else 0.0) for j in range(r)] for i in range(r)]
    return [max(0.0, sum(a * b for a, b in zip(x, solve(gram, x), strict=True))) for x in rows]


def zscore(heads: list[list[float]]) -> list[list[float]]:
    """``(s - mean) / max(std, 1e-6)`` over every head and token of one sample (std: n - 1)."""
    flat = [s for head in heads for s in head]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((s - mean) ** 2 for s in flat) / (len(flat) - 1))
    return [[(s - mean) / max(std, 1e-6) for s in head] for head in heads]
