"""Naive budgets and selection: the stable top-k rank, SnapKV's kept positions, a two-stage
selection, PyramidKV's layer totals as KVCache-Factory and kvpress compute them, and a layer's kept
count under per-layer ratios."""

from __future__ import annotations

import math


def naive_rank(scores: list[float], count: int) -> list[int]:
    """Stable top-``count``: highest first, ties to the lower index; returned ascending."""
    order = sorted(range(len(scores)), key=lambda j: (-scores[j], j))
    return sorted(order[:count])


def naive_two_stage_keep(
    first: list[float], final: list[float], fixed: list[int], count: int, share: float
) -> list[int]:
    """One head's kept positions: every ``fixed`` one, then of the other positions ``c`` (``final``
    finite), ``floor(share * f)`` by ``first`` and the rest of ``f = count - len(fixed)`` by ``final``."""
    free = count - len(fixed)
    others = [t for t in range(len(final)) if t not in fixed and abs(final[t]) != float("inf")]
    stage1 = [others[j] for j in naive_rank([first[t] for t in others], int(share * free))]
    rest = [t for t in others if t not in stage1]
    stage2 = [rest[j] for j in naive_rank([final[t] for t in rest], free - len(stage1))]
    return sorted(fixed + stage1 + stage2)


def naive_snapkv_keep(scores: list[float], n: int, window: int, budget: int) -> list[int]:
    """Kept positions (sample coordinates) of one head: last ``window`` + top-(budget - window) others."""
    if budget >= n:
        return list(range(n))
    win = list(range(n - window, n))
    cand = scores[: n - window]
    return sorted(naive_rank(cand, budget - window) + win)


def naive_kvcf_total(C: int, w: int, T: int, L: int, layer: int, beta: int = 20) -> int | None:
    """KVCache-Factory PyramidKV: tokens kept at ``layer`` (window included); None = no compression."""
    free = C - w
    if T < C:
        return None
    if 2 * free > T:
        return C
    min_num = free // beta
    max_num = 2 * free - min_num
    if max_num >= T - w:
        max_num = T - w
        min_num = 2 * free - max_num
    steps = (max_num - min_num) // (L - 1)
    return w + max_num - layer * steps


def naive_kvpress_total(n_kept: int, w: int, T: int, L: int, layer: int, beta: int = 20) -> int:
    """kvpress PyramidKVPress.get_layer_budget with T * (1 - cr) = n_kept (window included)."""
    cap = w + n_kept
    min_num = (cap - w) / beta
    max_num = (cap - w) * 2 - min_num
    if max_num >= T - w:
        max_num = T - w
        min_num = (cap - w) * 2 - max_num
    if not (T >= max_num >= min_num >= w):
        return round(n_kept)
    steps = (max_num - min_num) / (L - 1)
    return round(max_num - layer * steps)


def naive_per_layer_kept(ratio: float, budget: int, length: int, protected: int) -> int:
    """Entries a head keeps at a layer of kept share ``ratio`` (``per_layer``): ``floor(ratio * budget)``,
    at least the ``protected`` tokens, at most the prompt."""
    return min(length, max(protected, math.floor(ratio * budget)))
