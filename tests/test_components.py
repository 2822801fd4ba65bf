"""Compression components against independent naive implementations of their paper formulas.

Every expected value here comes from a slow, loop-based reference written from the spec
(``shared/specs/david.md`` §2.1-2.3, §4.1, §4.2 E5/E6/E12/E13, §4.4), never from the component
code: explicit Python loops over samples, heads and tokens, float64 arithmetic on the fp32
inputs. Samples are handled in their own coordinates (padding sliced off), so every comparison
with a left-padded batch also checks batch invariance.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kvlab.compression.allocators import PyramidLayerAllocator
from kvlab.compression.budget import Budget
from kvlab.compression.context import LayerContext
from kvlab.compression.diversity import DIVERSITY
from kvlab.compression.importance import IMPORTANCE
from kvlab.compression.mixers import MIXERS
from kvlab.compression.pipeline import Pipeline
from kvlab.compression.selectors import SELECTORS, topk_indices
from kvlab.errors import ConfigError

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
) -> LayerContext:
    """A left-padded batch; padding positions hold random garbage that must be ignored."""
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
# naive references (written from the spec formulas)


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
# 1. window_attention (SnapKV)


@pytest.mark.parametrize("order", ["group_then_pool", "pool_then_group"])
@pytest.mark.parametrize("gqa", ["mean", "max", "sum"])
@pytest.mark.parametrize("agg", ["sum", "mean"])
@pytest.mark.parametrize("kernel", [1, 5, 7])
@pytest.mark.parametrize("pool", ["avg", "max"])
def test_window_attention_matches_naive(pool, kernel, agg, gqa, order):
    ctx = make_ctx(LENGTHS, seed=1)
    W = 6
    scorer = build(
        IMPORTANCE,
        name="window_attention",
        window=W,
        kernel=kernel,
        pool=pool,
        agg=agg,
        gqa=gqa,
        gqa_order=order,
    )
    scores = scorer.score(ctx)
    assert scores.shape == (2, 2, ctx.seq_len) and scores.dtype == torch.float32
    for b in range(2):
        n, off, q, k, _ = sample_lists(ctx, b)
        expected = naive_window_scores(q, k, ctx.scaling, W, kernel, pool, agg, gqa, order)
        assert_scores(scores[b, :, off:], expected)


def test_window_attention_sanity():
    """§4.1.7: rows sum to 1, S >= 0, sum_j S_j <= W, kernel 1 == no pooling, window = +inf."""
    ctx = make_ctx(LENGTHS, seed=2)
    W = 6
    probs = ctx.window_attention(W)
    assert probs.shape == (2, 4, W, ctx.seq_len)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4, W), atol=1e-6, rtol=0)
    assert not probs.masked_select(~ctx.valid[:, None, None, :]).any()  # padding keys get nothing
    raw = build(IMPORTANCE, name="window_attention", window=W, kernel=1, gqa="sum").score(ctx)
    unpooled = build(IMPORTANCE, name="window_attention", window=W, pool="none", gqa="sum").score(ctx)
    assert torch.equal(raw, unpooled)
    past = raw[..., : ctx.seq_len - W]
    assert (past >= 0).all()
    assert (past.sum(-1) <= ctx.group_size * W + 1e-4).all()  # gqa sum over G heads of W rows
    assert torch.isinf(raw[..., -W:]).all() and (raw[..., -W:] > 0).all()


@pytest.mark.parametrize("gqa", ["mean", "sum"])
@pytest.mark.parametrize("kernel", [3, 5, 7])
def test_e12_avg_pool_commutes_with_group_reduction(gqa, kernel):
    ctx = make_ctx(LENGTHS, seed=3)
    a = build(
        IMPORTANCE, name="window_attention", window=5, kernel=kernel, gqa=gqa, gqa_order="group_then_pool"
    ).score(ctx)
    b = build(
        IMPORTANCE, name="window_attention", window=5, kernel=kernel, gqa=gqa, gqa_order="pool_then_group"
    ).score(ctx)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("order", ["group_then_pool", "pool_then_group"])
@pytest.mark.parametrize("pool", ["avg", "max"])
def test_e13_mha_gqa_reductions_identical(pool, order):
    ctx = make_ctx(LENGTHS, heads=3, kv_heads=3, seed=4)
    scores = [
        build(IMPORTANCE, name="window_attention", window=5, pool=pool, gqa=gqa, gqa_order=order).score(ctx)
        for gqa in ("mean", "max", "sum")
    ]
    assert torch.equal(scores[0], scores[1]) and torch.equal(scores[0], scores[2])
    selections = []
    for gqa in ("mean", "max", "sum"):
        pipe = Pipeline.from_config(
            {
                "budget": {"tokens": 12, "window": 5},
                "importance": [
                    {"name": "window_attention", "window": 5, "pool": pool, "gqa": gqa, "gqa_order": order}
                ],
            }
        )
        selections.append(pipe.compress(ctx)[0])
    for sel in selections[1:]:
        assert torch.equal(sel.indices, selections[0].indices) and torch.equal(
            sel.counts, selections[0].counts
        )


# ---------------------------------------------------------------------------------------------
# 2. cumulative_attention (H2O)


@pytest.mark.parametrize("normalize", ["none", "by_count"])
@pytest.mark.parametrize("gqa", ["mean", "max", "sum"])
def test_cumulative_attention_matches_naive(gqa, normalize):
    ctx = make_ctx([19, 12], seed=5)
    scores = build(IMPORTANCE, name="cumulative_attention", gqa=gqa, normalize=normalize).score(ctx)
    for b in range(2):
        n, off, q, k, _ = sample_lists(ctx, b)
        assert_scores(scores[b, :, off:], naive_cumulative(q, k, ctx.scaling, gqa, normalize))


def test_cumulative_attention_ignores_padding_queries_and_chunks():
    ctx = make_ctx([19, 12], seed=6)
    ref = ctx.cumulative_attention()
    garbage = make_ctx([19, 12], seed=7)
    pad = ~ctx.valid
    q = torch.where(pad[:, None, :, None], garbage.queries, ctx.queries)
    k = torch.where(pad[:, None, :, None], garbage.keys, ctx.keys)
    other = LayerContext(0, 4, q, k, ctx.values, ctx.valid, ctx.modality, ctx.scaling)
    torch.testing.assert_close(other.cumulative_attention(chunk=5), ref, atol=1e-6, rtol=0)
    # column sums of a causal softmax over the valid queries add up to the number of valid queries
    torch.testing.assert_close(ref.sum(-1), ctx.lengths[:, None].float().expand(-1, 4), atol=1e-4, rtol=0)
    assert not ref.masked_select(pad[:, None, :]).any()


# ---------------------------------------------------------------------------------------------
# 3. key_norm, value_norm, recency, random


def test_key_value_norm_and_recency():
    ctx = make_ctx(LENGTHS, seed=8)
    knorm = build(IMPORTANCE, name="key_norm").score(ctx)
    knorm_pos = build(IMPORTANCE, name="key_norm", sign=1).score(ctx)
    vnorm = build(IMPORTANCE, name="value_norm").score(ctx)
    recency = build(IMPORTANCE, name="recency").score(ctx)
    for b in range(2):
        n, off, _, k, v = sample_lists(ctx, b)
        assert_scores(knorm[b, :, off:], [[-norm(k[h][t]) for t in range(n)] for h in range(2)])
        assert_scores(knorm_pos[b, :, off:], [[norm(k[h][t]) for t in range(n)] for h in range(2)])
        assert_scores(vnorm[b, :, off:], [[norm(v[h][t]) for t in range(n)] for h in range(2)])
        assert_scores(recency[b, :, off:], [[float(t) for t in range(n)] for _ in range(2)], atol=0)


def test_random_scores_batch_invariant_and_seeded():
    ctx = make_ctx([30, 20], seed=9, layer_idx=2)
    scorer = build(IMPORTANCE, name="random", seed=3)
    batched = scorer.score(ctx)
    for b in range(2):
        alone = scorer.score(sample_ctx(ctx, b))
        n = alone.shape[-1]
        assert torch.equal(batched[b, :, ctx.seq_len - n :], alone[0])
    assert torch.equal(scorer.score(ctx), batched)  # deterministic
    valid = ctx.valid[:, None, :].expand_as(batched)
    assert ((batched[valid] >= 0) & (batched[valid] < 1)).all()
    other = build(IMPORTANCE, name="random", seed=4).score(ctx)
    assert not torch.equal(other[valid], batched[valid])


# ---------------------------------------------------------------------------------------------
# 4. keydiff


def test_keydiff_matches_naive():
    ctx = make_ctx(LENGTHS, seed=10)
    scores = build(DIVERSITY, name="keydiff").score(ctx)
    for b in range(2):
        n, off, _, k, _ = sample_lists(ctx, b)
        expected = []
        for h in range(2):
            anchor = [sum(k[h][t][d] for t in range(n)) / n for d in range(len(k[h][0]))]
            expected.append([-dot(k[h][t], anchor) / (norm(k[h][t]) * norm(anchor)) for t in range(n)])
        assert_scores(scores[b, :, off:], expected)


# ---------------------------------------------------------------------------------------------
# 5. weighted_sum mixer


def naive_minmax(row: list[float], valid: list[bool]) -> list[float]:
    finite = [x for x, ok in zip(row, valid, strict=True) if ok and math.isfinite(x)]
    lo, hi = min(finite), max(finite)
    return [(x - lo) / (hi - lo) if ok and math.isfinite(x) else x for x, ok in zip(row, valid, strict=True)]


@pytest.mark.parametrize("normalize", ["none", "minmax"])
def test_weighted_sum_mixer_matches_naive(normalize):
    ctx = make_ctx(LENGTHS, seed=11)
    gen = torch.Generator().manual_seed(12)
    a = torch.randn(2, 2, ctx.seq_len, generator=gen) * 5 + 3
    a[..., -4:] = INF  # a protected window
    b_ = torch.rand(2, 2, ctx.seq_len, generator=gen) * 0.01
    c = torch.randn(2, 2, ctx.seq_len, generator=gen)
    mixer = build(MIXERS, name="weighted_sum", weights=[0.5, 2.0, -1.0], normalize=normalize)
    mixed = mixer.mix([a, b_], [c], ctx)
    for b in range(2):
        valid = ctx.valid[b].tolist()
        for h in range(2):
            rows = [x[b, h].double().tolist() for x in (a, b_, c)]
            if normalize == "minmax":
                rows = [naive_minmax(r, valid) for r in rows]
            expected = [
                sum(w * r[t] for w, r in zip((0.5, 2.0, -1.0), rows, strict=True)) for t in range(len(valid))
            ]
            got = mixed[b, h].double()
            keep = torch.tensor(valid)
            torch.testing.assert_close(
                got[keep], torch.tensor(expected, dtype=torch.float64)[keep], atol=1e-5, rtol=1e-6
            )
    # a single score with default settings passes through; weights must match the score count
    assert torch.equal(build(MIXERS, name="weighted_sum").mix([a], [], ctx), a)
    with pytest.raises(ValueError, match="weights"):
        build(MIXERS, name="weighted_sum", weights=[1.0]).mix([a, c], [], ctx)


def test_minmax_normalised_scores_span_unit_interval():
    ctx = make_ctx(LENGTHS, seed=13)
    s = torch.randn(2, 2, ctx.seq_len) * 7
    out = build(MIXERS, name="weighted_sum", weights=[1.0], normalize="minmax").mix([s], [], ctx)
    for b in range(2):
        v = out[b][:, ctx.valid[b]]
        torch.testing.assert_close(v.amin(-1), torch.zeros(2), atol=1e-6, rtol=0)
        torch.testing.assert_close(v.amax(-1), torch.ones(2), atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------
# 6. PyramidKV


def pyramid_alloc(allocator, C: int, w: int, Ts: list[int], L: int, layer: int) -> list[int]:
    n = len(Ts)
    out = allocator.allocate(
        torch.full((n,), C, dtype=torch.long),
        torch.tensor(Ts, dtype=torch.long),
        torch.full((n,), w, dtype=torch.long),
        SimpleNamespace(num_layers=L, layer_idx=layer),
    )
    return [int(x) for x in out]


def kvcf_lengths(C: int, w: int) -> list[int]:
    free = C - w
    Ts = {C - 1, C, C + 1, 2 * free - 1, 2 * free, 2 * free + 1, 2 * C, 3 * C + 7, 1000, 4096}
    return sorted(t for t in Ts if t >= 1)


@pytest.mark.parametrize("beta", [1, 2, 7, 20])
def test_pyramid_int_matches_kvcf_schedule(beta):
    allocator = PyramidLayerAllocator(beta=beta, arithmetic="int")
    checked = 0
    for C in (8, 16, 33, 64, 100, 128, 256, 512):
        for w in (0, 1, 4, 8, 32):
            if w > C:
                continue
            Ts = kvcf_lengths(C, w)
            for L in (2, 3, 4, 32, 40):
                per_layer = [pyramid_alloc(allocator, C, w, Ts, L, layer) for layer in range(L)]
                for i, T in enumerate(Ts):
                    caps = [per_layer[layer][i] for layer in range(L)]
                    expected = [naive_kvcf_total(C, w, T, L, layer, beta) for layer in range(L)]
                    if expected[0] is None:  # T < C: no compression
                        assert all(c >= T for c in caps), (C, w, T, L)
                        continue
                    assert caps == expected, (C, w, T, L, beta)
                    checked += 1
                    # invariants (§4.1.4): non-increasing, mean in [B', B' + (L - 1) / 2]
                    assert all(x >= y for x, y in zip(caps, caps[1:], strict=False))
                    free = [c - w for c in caps]
                    mean = sum(free) / L
                    assert C - w <= mean <= C - w + (L - 1) / 2, (C, w, T, L)
                    assert min(free) >= 0 and max(free) <= T - w
                    if 2 * (C - w) > T:  # E6: short prompt -> SnapKV
                        assert caps == [C] * L
    assert checked > 1000


def test_pyramid_schedule_actually_varies():
    allocator = PyramidLayerAllocator()
    caps = [pyramid_alloc(allocator, 128, 32, [4096], 32, layer)[0] for layer in range(32)]
    # B' = 96: min 4, max 188, steps 184 // 31 = 5
    assert caps[0] == 32 + 188 and caps[1] == 32 + 183 and caps[31] == 32 + 188 - 31 * 5


@pytest.mark.parametrize("L", [32, 64])
@pytest.mark.parametrize("C", [1024, 2048, 3072])
def test_pyramid_float_mean_layer_budget(C, L):
    """kvpress ``test_mean_layer_budget``: the mean over layers equals the budget (rel 1e-3)."""
    T, w = 4096, 32
    allocator = PyramidLayerAllocator(arithmetic="float")
    caps = [pyramid_alloc(allocator, C, w, [T], L, layer)[0] for layer in range(L)]
    assert caps[0] > caps[-1]  # the schedule ran (no fallback)
    assert all(x >= y for x, y in zip(caps, caps[1:], strict=False))
    assert abs(sum(caps) / L - C) <= 1e-3 * C


def test_pyramid_float_matches_kvpress_formula():
    allocator = PyramidLayerAllocator(arithmetic="float")
    # spec §2.3 worked example: T = 640, keep 50 % (n_kept = 320), w = 64 -> no fallback, min_num = 64
    for T, C, w, L in ((640, 320, 64, 32), (4096, 2048, 64, 32), (4096, 1024, 32, 64)):
        got = [pyramid_alloc(allocator, C, w, [T], L, layer)[0] for layer in range(L)]
        assert got == [naive_kvpress_total(C, w, T, L, layer) for layer in range(L)], (T, C, w, L)


@pytest.mark.parametrize("arithmetic", ["int", "float"])
def test_e5_pyramid_beta1_is_uniform(arithmetic):
    allocator = PyramidLayerAllocator(beta=1, arithmetic=arithmetic)
    for C, w, T, L in ((128, 32, 4096, 32), (64, 8, 100, 4), (20, 4, 33, 3), (2048, 64, 4096, 64)):
        for layer in range(L):
            assert pyramid_alloc(allocator, C, w, [T], L, layer) == [C]


# ---------------------------------------------------------------------------------------------
# 7. Budget


def test_budget_tokens_and_ratio_per_sample():
    lengths = torch.tensor([100, 37, 10, 3])
    tokens = Budget.from_config({"tokens": 16, "window": 4, "sinks": 2})
    assert tokens.per_sample(lengths).tolist() == [16] * 4
    for ratio in (0.0, 0.1, 0.29, 0.5, 0.7, 1.0):
        budget = Budget.from_config({"ratio": ratio, "window": 4, "sinks": 1})
        # raised to the protected count, itself never more than the prompt
        expected = [max(math.floor(ratio * n), min(5, n)) for n in lengths.tolist()]
        assert budget.per_sample(lengths).tolist() == expected, ratio
        assert budget.protected_counts(lengths).tolist() == [min(5, n) for n in lengths.tolist()]
    assert Budget.from_config(128) == Budget(tokens=128)
    assert Budget.from_config(0.2) == Budget(ratio=0.2)


@pytest.mark.parametrize("window,sinks", [(0, 0), (4, 0), (0, 4), (3, 2), (40, 0)])
def test_budget_protected_mask(window, sinks):
    lengths = [37, 26, 4]
    ctx = make_ctx(lengths, seed=14)
    mask = Budget(tokens=window + sinks, window=window, sinks=sinks).protected_mask(ctx.valid)
    T = ctx.seq_len
    for b, n in enumerate(lengths):
        off = T - n
        expected = [False] * T
        for p in range(n):
            if p >= n - window or p < sinks:
                expected[off + p] = True
        assert mask[b].tolist() == expected


@pytest.mark.parametrize(
    "node,fields",
    [
        ({"ratio": 1.5}, ["ratio"]),
        ({"ratio": -0.1}, ["ratio"]),
        ({"tokens": 10, "window": 8, "sinks": 4}, ["tokens", "window", "sinks"]),
        ({"tokens": 3, "window": 4}, ["tokens", "window"]),
        ({"tokens": 10, "ratio": 0.5}, ["tokens", "ratio"]),
        ({"window": 8}, ["tokens", "ratio"]),
        ({"tokens": 10, "windw": 4}, ["windw", "window"]),
        ({"tokens": 10, "window": -1}, ["window"]),
        (True, ["budget"]),
    ],
)
def test_budget_config_errors_name_the_field(node, fields):
    with pytest.raises(ConfigError) as info:
        Budget.from_config(node)
    for name in fields:
        assert name in str(info.value)
    assert "model.compression.budget" in str(info.value)


def test_pipeline_window_larger_than_budget_is_an_error():
    with pytest.raises(ConfigError, match="window"):
        Pipeline.from_config(
            {"budget": {"tokens": 8, "window": 4}, "importance": [{"name": "window_attention", "window": 16}]}
        )


# ---------------------------------------------------------------------------------------------
# 8. top-k selection


def test_topk_indices_matches_naive_stable_ranking():
    gen = torch.Generator().manual_seed(15)
    scores = torch.randint(0, 4, (3, 2, 23), generator=gen).float()  # many ties
    counts = torch.tensor([[0, 5], [23, 11], [1, 7]])
    idx = topk_indices(scores, counts)
    assert idx.shape == (3, 2, 23)
    for b in range(3):
        for h in range(2):
            c = int(counts[b, h])
            assert idx[b, h, :c].tolist() == naive_rank(scores[b, h].tolist(), c)
            assert idx[b, h, c:].tolist() == [0] * (23 - c)


def test_topk_infinities():
    gen = torch.Generator().manual_seed(16)
    T = 17
    scores = torch.randn(1, 1, T, generator=gen)
    pos_inf, neg_inf = [2, 9, 16], [0, 5, 6, 12]
    scores[0, 0, pos_inf] = INF
    scores[0, 0, neg_inf] = -INF
    for c in range(len(pos_inf), T + 1):
        kept = topk_indices(scores, torch.tensor([[c]]))[0, 0, :c].tolist()
        assert kept == naive_rank(scores[0, 0].tolist(), c)
        assert set(pos_inf) <= set(kept)
        n_neg = len(set(neg_inf) & set(kept))
        assert n_neg == max(0, c - (T - len(neg_inf)))  # -inf only when the count forces it
        if n_neg:
            assert set(kept) & set(neg_inf) == set(sorted(neg_inf)[:n_neg])  # ties -> lower index


def test_topk_selector_selection():
    gen = torch.Generator().manual_seed(17)
    scores = torch.randn(2, 3, 11, generator=gen)
    counts = torch.tensor([[3, 0, 11], [5, 4, 1]])
    sel = build(SELECTORS, name="topk").select(scores, counts, None)
    mask = sel.mask()
    for b in range(2):
        for h in range(3):
            assert sel.kept_positions(b, h) == naive_rank(scores[b, h].tolist(), int(counts[b, h]))
            assert int(mask[b, h].sum()) == int(counts[b, h])


# ---------------------------------------------------------------------------------------------
# 9. full pipeline


def snapkv_config(tokens: int, window: int, **layer) -> dict:
    cfg = {
        "budget": {"tokens": tokens, "window": window},
        "importance": [{"name": "window_attention", "window": window, "kernel": 5}],
    }
    if layer:
        cfg["allocate"] = {"layer": layer}
    return cfg


def naive_pipeline_keep(ctx: LayerContext, b: int, window: int, budget_of) -> list[list[int]]:
    """Naive SnapKV keep set per KV head of sample b, in padded coordinates."""
    n, off, q, k, _ = sample_lists(ctx, b)
    scores = naive_window_scores(q, k, ctx.scaling, window, kernel=5)
    budget = budget_of(n)
    return [[off + p for p in naive_snapkv_keep(scores[h], n, window, budget)] for h in range(len(k))]


@pytest.mark.parametrize("tokens", [4, 12, 30, 40])
def test_snapkv_pipeline_matches_naive(tokens):
    W = 4
    ctx = make_ctx(LENGTHS, seed=18)
    selection, report = Pipeline.from_config(snapkv_config(tokens, W)).compress(ctx)
    T = ctx.seq_len
    for b, n in enumerate(LENGTHS):
        expected = naive_pipeline_keep(ctx, b, W, lambda n: tokens)
        for h in range(2):
            kept = selection.kept_positions(b, h)
            assert kept == expected[h], (b, h)
            assert len(kept) == min(tokens, n)
            assert all(p >= T - n for p in kept)  # padding never kept
            assert set(range(T - W, T)) <= set(kept)  # window kept
            if tokens >= n:
                assert kept == list(range(T - n, T))
    assert report.kept.tolist() == [[min(tokens, n)] * 2 for n in LENGTHS]


def test_snapkv_ratio_pipeline_matches_naive():
    W = 4
    ctx = make_ctx(LENGTHS, seed=19)
    pipe = Pipeline.from_config(
        {
            "budget": {"ratio": 0.3, "window": W},
            "importance": [{"name": "window_attention", "window": W, "kernel": 5}],
        }
    )
    selection, _ = pipe.compress(ctx)
    for b in range(2):
        expected = naive_pipeline_keep(ctx, b, W, lambda n: max(math.floor(0.3 * n), W))
        for h in range(2):
            assert selection.kept_positions(b, h) == expected[h]


@pytest.mark.parametrize(
    "cfg",
    [
        snapkv_config(12, 4),
        snapkv_config(12, 4, name="pyramid", beta=20),
        {"budget": {"tokens": 9, "window": 0, "sinks": 4}, "importance": ["recency"]},
        {"budget": {"ratio": 0.4, "window": 3}, "importance": [{"name": "cumulative_attention"}]},
        {
            "budget": {"tokens": 10, "window": 2},
            "importance": ["value_norm"],
            "diversity": ["keydiff"],
            "mixer": {"name": "weighted_sum", "normalize": "minmax"},
        },
    ],
)
def test_pipeline_batch_equals_each_sample_alone(cfg):
    ctx = make_ctx(LENGTHS, seed=20, layer_idx=1)
    pipe = Pipeline.from_config(cfg)
    batched, _ = pipe.compress(ctx)
    T = ctx.seq_len
    for b, n in enumerate(LENGTHS):
        alone, _ = pipe.compress(sample_ctx(ctx, b))
        for h in range(2):
            shifted = [p + T - n for p in alone.kept_positions(0, h)]
            assert batched.kept_positions(b, h) == shifted, (b, h)


@pytest.mark.parametrize("tokens", [6, 9, 20, 40])
def test_streamingllm_pipeline_keeps_sinks_and_recent(tokens):
    ctx = make_ctx(LENGTHS, seed=21)
    cfg = {"budget": {"tokens": tokens, "window": 0, "sinks": 4}, "importance": ["recency"]}
    pipe = Pipeline.from_config(cfg)
    selection, _ = pipe.compress(ctx)
    T = ctx.seq_len
    for b, n in enumerate(LENGTHS):
        off = T - n
        expected = list(range(n)) if tokens >= n else list(range(4)) + list(range(n - (tokens - 4), n))
        for h in range(2):
            assert selection.kept_positions(b, h) == [off + p for p in expected]


def test_pyramid_pipeline_counts_and_sets_match_naive():
    lengths = [37, 19, 14, 10]  # schedule, clipped schedule, T < 2B' (SnapKV), T < C (no compression)
    C, W, L = 12, 4, 4
    pipe = Pipeline.from_config(snapkv_config(C, W, name="pyramid"))
    distinct = set()
    for layer in range(L):
        ctx = make_ctx(lengths, seed=22 + layer, layer_idx=layer, num_layers=L)
        selection, report = pipe.compress(ctx)
        for b, n in enumerate(lengths):
            total = naive_kvcf_total(C, W, n, L, layer)
            total = n if total is None else total
            distinct.add((b, total))
            expected = naive_pipeline_keep(ctx, b, W, lambda n, total=total: total)
            for h in range(2):
                assert int(selection.counts[b, h]) == total
                assert selection.kept_positions(b, h) == expected[h], (layer, b, h)
        assert report.kept.tolist() == [[int(selection.counts[b, 0])] * 2 for b in range(len(lengths))]
    assert len({t for b, t in distinct if b == 0}) == L  # the schedule really changes per layer


@pytest.mark.parametrize("arithmetic", ["int", "float"])
def test_e5_pyramid_beta1_pipeline_equals_snapkv(arithmetic):
    W = 4
    snap = Pipeline.from_config(snapkv_config(12, W))
    beta1 = Pipeline.from_config(snapkv_config(12, W, name="pyramid", beta=1, arithmetic=arithmetic))
    for layer in range(4):
        ctx = make_ctx([37, 26], seed=30 + layer, layer_idx=layer, num_layers=4)
        a, _ = snap.compress(ctx)
        b, _ = beta1.compress(ctx)
        assert torch.equal(a.counts, b.counts) and torch.equal(a.indices, b.indices)


def test_e6_pyramid_short_prompt_pipeline_equals_snapkv():
    """KVCF: T < 2 (C - w) = 24 -> SnapKV at every layer."""
    W = 4
    short = Pipeline.from_config(snapkv_config(16, W, name="pyramid"))
    snap = Pipeline.from_config(snapkv_config(16, W))
    for layer in range(4):
        ctx = make_ctx([23, 20], seed=40 + layer, layer_idx=layer, num_layers=4)
        a, _ = short.compress(ctx)
        b, _ = snap.compress(ctx)
        assert torch.equal(a.counts, b.counts) and torch.equal(a.indices, b.indices)


def test_e6_pyramid_float_fallback_is_snapkv_budget():
    """kvpress: min_num < w falls back to the uniform budget (spec §2.3: T = 640, keep 20 %, w = 64)."""
    allocator = PyramidLayerAllocator(arithmetic="float")
    for T, C, w, L in ((640, 128, 64, 32), (4096, 512, 64, 32), (1000, 100, 16, 8)):
        assert all(naive_kvpress_total(C, w, T, L, layer) == C for layer in range(L))  # the fallback fires
        assert [pyramid_alloc(allocator, C, w, [T], L, layer)[0] for layer in range(L)] == [C] * L
