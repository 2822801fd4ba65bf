"""Naive attention maths over Python lists: dot products, softmax, one query's attention, and the
scores of SnapKV (window attention, pooled, GQA-reduced) and H2O (accumulated attention)."""

from __future__ import annotations

import math

INF = float("inf")


def dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def norm(a: list[float]) -> float:
    return math.sqrt(dot(a, a))


def softmax(logits: list[float]) -> list[float]:
    m = max(logits)
    e = [math.exp(x - m) for x in logits]
    s = sum(e)
    return [x / s for x in e]


def naive_pool(s: list[float], pool: str, kernel: int) -> list[float]:
    """Stride-1 pooling, padding kernel // 2: avg pads zeros and divides by kernel, max pads -inf."""
    if pool == "none" or kernel == 1:
        return list(s)
    r = kernel // 2
    out = []
    for t in range(len(s)):
        if pool == "avg":
            total = 0.0
            for d in range(-r, r + 1):
                if 0 <= t + d < len(s):
                    total += s[t + d]
            out.append(total / kernel)
        else:
            best = -INF
            for d in range(-r, r + 1):
                if 0 <= t + d < len(s):
                    best = max(best, s[t + d])
            out.append(best)
    return out


def naive_reduce(rows: list[list[float]], how: str) -> list[float]:
    """GQA reduction of the G query-head rows of one KV head."""
    out = []
    for t in range(len(rows[0])):
        vals = [row[t] for row in rows]
        if how == "mean":
            out.append(sum(vals) / len(vals))
        elif how == "max":
            out.append(max(vals))
        else:
            out.append(sum(vals))
    return out


def naive_window_scores(
    q, k, scaling, window, kernel=5, pool="avg", agg="sum", gqa="mean", order="group_then_pool"
):
    """SnapKV score of one unpadded sample: ``[Hkv][n]`` with +inf on the last ``window`` tokens.

    For each query head h and window query i (position n - W + i), softmax over keys j <= n - W + i;
    column sums (or means) over the W rows, restricted to the past [0, n - W); GQA reduction
    (h -> h // G) and pooling over the past only, in the configured order.
    """
    H, Hkv, n = len(q), len(k), len(k[0])
    G = H // Hkv
    W = min(window, n)
    past = n - W
    per_head = []
    for h in range(H):
        kv = h // G
        col = [0.0] * n
        for i in range(W):
            qpos = past + i
            probs = softmax([dot(q[h][qpos], k[kv][j]) * scaling for j in range(qpos + 1)])
            for j, p in enumerate(probs):
                col[j] += p
        if agg == "mean":
            col = [c / W for c in col]
        per_head.append(col[:past])
    out = []
    for kv in range(Hkv):
        group = per_head[kv * G : (kv + 1) * G]
        if order == "group_then_pool":
            s = naive_pool(naive_reduce(group, gqa), pool, kernel)
        else:
            s = naive_reduce([naive_pool(row, pool, kernel) for row in group], gqa)
        out.append(s + [INF] * W)
    return out


def naive_cumulative(q, k, scaling, gqa="mean", normalize="none"):
    """H2O: column sums of the full causal softmax of one unpadded sample, ``[Hkv][n]``."""
    H, Hkv, n = len(q), len(k), len(k[0])
    G = H // Hkv
    per_head = []
    for h in range(H):
        col = [0.0] * n
        for i in range(n):
            probs = softmax([dot(q[h][i], k[h // G][j]) * scaling for j in range(i + 1)])
            for j, p in enumerate(probs):
                col[j] += p
        if normalize == "by_count":
            col = [c / (n - j) for j, c in enumerate(col)]  # queries i >= j see token j
        per_head.append(col)
    return [naive_reduce(per_head[kv * G : (kv + 1) * G], gqa) for kv in range(Hkv)]


def naive_attention(query: list[float], keys: list[list[float]], values: list[list[float]], scaling: float):
    """``softmax(q K^T scaling) V`` of one query over lists."""
    probs = softmax([dot(query, key) * scaling for key in keys])
    return [sum(p * v[d] for p, v in zip(probs, values, strict=True)) for d in range(len(values[0]))]
