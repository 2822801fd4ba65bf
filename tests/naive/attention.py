"""Fixtures and independent naive references (loops written from the papers' formulas) for component tests."""

from __future__ import annotations

import math

import torch

from kvlab.cache.state import RunState
from kvlab.compression.context import LayerContext

INF = float("inf")

# ---------------------------------------------------------------------------------------------
# fixtures: random LayerContexts with left padding


def make_ctx(
    lengths: list[int],
    heads: int = 4,
    kv_heads: int = 2,
    dim: int = 8,
    seed: int = 0,
    layer_idx: int = 0,
    num_layers: int = 4,
    scale: float = 1.5,
    run: RunState | None = None,
) -> LayerContext:
    """A left-padded batch; padding positions hold random garbage that must be ignored. Contexts of
    one prefill share one ``run`` (the engine's :class:`RunState`); None: a fresh one."""
    gen = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        valid[b, T - n :] = True
    return LayerContext(
        layer_idx=layer_idx,
        num_layers=num_layers,
        queries=torch.randn(B, heads, T, dim, generator=gen) * scale,
        keys=torch.randn(B, kv_heads, T, dim, generator=gen) * scale,
        values=torch.randn(B, kv_heads, T, dim, generator=gen),
        valid=valid,
        modality=torch.where(valid, 0, -1),
        scaling=dim**-0.5,
        run=run if run is not None else RunState(),
    )


def sample_ctx(ctx: LayerContext, b: int) -> LayerContext:
    """Sample ``b`` alone (B = 1), padding sliced off."""
    n = int(ctx.valid[b].sum())
    T = ctx.seq_len
    return LayerContext(
        layer_idx=ctx.layer_idx,
        num_layers=ctx.num_layers,
        queries=ctx.queries[b : b + 1, :, T - n :].clone(),
        keys=ctx.keys[b : b + 1, :, T - n :].clone(),
        values=ctx.values[b : b + 1, :, T - n :].clone(),
        valid=torch.ones(1, n, dtype=torch.bool),
        modality=torch.zeros(1, n, dtype=torch.long),
        scaling=ctx.scaling,
    )


def sample_lists(ctx: LayerContext, b: int):
    """(n, offset, q [H][n][D], k [Hkv][n][D], v [Hkv][n][D]) of sample b as Python floats."""
    n = int(ctx.valid[b].sum())
    off = ctx.seq_len - n
    q = ctx.queries[b, :, off:].double().tolist()
    k = ctx.keys[b, :, off:].double().tolist()
    v = ctx.values[b, :, off:].double().tolist()
    return n, off, q, k, v


# ---------------------------------------------------------------------------------------------
# naive references (written from the papers' formulas)


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


def naive_rank(scores: list[float], count: int) -> list[int]:
    """Stable top-``count``: highest first, ties to the lower index; returned ascending."""
    order = sorted(range(len(scores)), key=lambda j: (-scores[j], j))
    return sorted(order[:count])


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


def build(registry, **node):
    return registry.build(node)


def assert_scores(actual: torch.Tensor, expected: list[list[float]], atol: float = 1e-5) -> None:
    torch.testing.assert_close(
        actual.double(), torch.tensor(expected, dtype=torch.float64), atol=atol, rtol=0
    )


LENGTHS = [37, 26]  # B = 2, different left padding


# ---------------------------------------------------------------------------------------------
# PrefixKV (Wang et al. 2024): importance, global prefix configuration, decode rule


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


# ---------------------------------------------------------------------------------------------
# HybridKV (Zeng et al. 2026): text-centric sparsity (Eq. 2-3), top-down allocation (Eq. 4-5),
# text-prior pruning (Appendix A), chunk retrieval by mean keys (Appendix A)


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


def naive_chunk_choice(
    q_group: list[list[float]], keys: list[list[float]], chunk: int, n_sel: int
) -> list[int]:
    """Brute force: rank the ``chunk``-token chunks of ``keys [m][D]`` by the mean over the chunk's
    tokens and the group's queries of ``q . k_j``; the top ``n_sel`` chunk ids (ties: lower id), ascending."""
    m = len(keys)
    chunks = [list(range(c, min(c + chunk, m))) for c in range(0, m, chunk)]
    score = [
        sum(dot(qv, keys[j]) for qv in q_group for j in tokens) / (len(q_group) * len(tokens))
        for tokens in chunks
    ]
    order = sorted(range(len(chunks)), key=lambda c: (-score[c], c))
    return sorted(order[:n_sel])


def naive_attention(query: list[float], keys: list[list[float]], values: list[list[float]], scaling: float):
    """``softmax(q K^T scaling) V`` of one query over lists."""
    probs = softmax([dot(query, key) * scaling for key in keys])
    return [sum(p * v[d] for p, v in zip(probs, values, strict=True)) for d in range(len(values[0]))]
