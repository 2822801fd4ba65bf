"""HybridKV (Zeng et al. 2026), naive: text-centric sparsity (Eq. 2-3), the top-down allocation
(Eq. 4-5) and text-prior pruning (Appendix A). Chunk retrieval: :mod:`naive.retrieval`."""

from __future__ import annotations

import math

from naive.attention import dot, softmax


def naive_text_sparsity(q, k, scaling: float, text: list[int], topk: float) -> list[float]:
    """S per KV head of one sample (lists ``q [H][n][D]``, ``k [Hkv][n][D]``, text query positions).

    Per query head: for each text query i, the causal softmax over keys 0..i, its ``ceil(topk n)``
    largest probabilities summed; mean over the text queries; mean over the GQA group.
    """
    H, Hkv, n = len(q), len(k), len(k[0])
    G = H // Hkv
    kk = max(1, math.ceil(topk * n - 1e-9))
    per_head = []
    for h in range(H):
        masses = []
        for i in text:
            probs = softmax([dot(q[h][i], k[h // G][j]) * scaling for j in range(i + 1)])
            masses.append(sum(sorted(probs, reverse=True)[:kk]))
        per_head.append(sum(masses) / len(masses))
    return [sum(per_head[g * G : (g + 1) * G]) / G for g in range(Hkv)]


def naive_hybridkv_floor_budgets(
    S: list[float], static: list[bool], per_head: int, length: int, protected: int, r: float, alpha: float
) -> list[int]:
    """HybridKV Eq. 4-5 with floors, nearest power of two, stepped down to fit; per-head budgets.

    b_dyn = nearest power of two to r * Bbar (ties down), halved while it does not leave every
    static head its protected tokens, at least 8 and the protected tokens, at most the prompt;
    B_stat = Bbar N - b_dyn N_dyn;
    b = floor(alpha B_stat / N_stat) + floor((1 - alpha) B_stat S / sum S_static), clamped to
    [protected, length] (no head above the prompt in these cases).
    """
    N = len(S)
    n_dyn = sum(1 for s in static if not s)
    n_stat = N - n_dyn
    total = per_head * N
    b_dyn = 0
    if n_dyn:
        x = r * per_head
        p = 1
        while p * 2 <= x:
            p *= 2
        b_dyn = p if x - p <= 2 * p - x else 2 * p
        while b_dyn * n_dyn + protected * n_stat > total and b_dyn > 1:
            b_dyn //= 2
        b_dyn = min(max(b_dyn, 8, protected), length)  # a head's budget holds its protected tokens
    stat = total - b_dyn * n_dyn
    norm = sum(s for s, st in zip(S, static, strict=True) if st)
    out = []
    for s, st in zip(S, static, strict=True):
        if not st:
            out.append(b_dyn)
            continue
        b = math.floor(alpha * stat / n_stat) + math.floor((1 - alpha) * stat * s / norm)
        out.append(min(max(b, protected), length))
    return out


def naive_text_prior_keep(
    s_w: list[float], visual: list[bool], n: int, budget: int, window: int
) -> list[int]:
    """Kept positions of a static head: the window, then text by s_w, then visual by s_w (Appendix A)."""
    if budget >= n:
        return list(range(n))
    history = range(n - window)
    text = sorted((j for j in history if not visual[j]), key=lambda j: (-s_w[j], j))
    vision = sorted((j for j in history if visual[j]), key=lambda j: (-s_w[j], j))
    free = budget - window
    chosen = text[:free] + vision[: max(0, free - len(text))]
    return sorted(chosen + list(range(n - window, n)))
