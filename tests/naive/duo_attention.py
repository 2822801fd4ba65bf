"""DuoAttention over Python lists (fp64), from the paper's head split (Xiao et al. 2024, Sec. 3)
on kvlab's budget (docs/methods/duo_attention.md): KV heads ranked by their calibrated score,
retrieval heads first, streaming heads keep nothing beyond their protected tokens; and the
calibration's attention mass on the needle."""

from __future__ import annotations

import math

from naive.attention import dot, softmax


def kv_head_scores(scores: list[list[float]], kv_heads: int, gqa: str) -> list[float]:
    """The flattened ``[L * Hkv]`` KV-head scores: the group's mean or max of ``scores [L][H]``."""
    out = []
    for row in scores:
        group = len(row) // kv_heads
        for j in range(kv_heads):
            members = row[j * group : (j + 1) * group]
            out.append(sum(members) / group if gqa == "mean" else max(members))
    return out


def duo_capacities(
    scores: list[list[float]],
    kv_heads: int,
    free: int,
    available: int,
    share: float | None,
    gqa: str = "mean",
) -> list[int]:
    """Free tokens per KV head (flattened ``[L * Hkv]``): the best ``round(share N)`` heads share the
    ``N free`` tokens equally (at most ``available`` each, floor/ceil by largest remainder); what
    is left fills whole heads in rank order (all of it, ``share: None``)."""
    kv = kv_head_scores(scores, kv_heads, gqa)
    n = len(kv)
    order = sorted(range(n), key=lambda i: (-kv[i], i))
    caps = [0] * n
    total = n * max(free, 0)
    if share is not None and total > 0:
        count = max(1, round(share * n))
        each = min(total / count, available)
        want = round(each * count)
        floors = [math.floor(each)] * count
        for i in range(want - sum(floors)):
            floors[i] += 1
        for i, head in enumerate(order[:count]):
            caps[head] = floors[i]
        total -= sum(floors)
    for head in order:
        room = min(available - caps[head], total)
        if room > 0:
            caps[head] += room
            total -= room
    return caps


def needle_mass(q: list[list[list[float]]], k: list[list[list[float]]], scale: float, answer: int,
                needle: list[int]) -> list[float]:  # fmt: skip
    """Per query head: the mean over the last ``answer`` queries of their attention (causal) on the
    ``needle`` positions; ``q [H][n][D]``, ``k [Hkv][n][D]`` of one unpadded sample."""
    heads, n = len(q), len(q[0])
    group = heads // len(k)
    out = []
    for h in range(heads):
        total = 0.0
        for i in range(n - answer, n):
            probs = softmax([scale * dot(q[h][i], k[h // group][t]) for t in range(i + 1)])
            total += sum(probs[t] for t in needle if t <= i)
        out.append(total / answer)
    return out
