"""Budgets, layer allocators, top-k selection and whole pipelines against naive references."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from naive.attention import INF, naive_window_scores
from naive.budgets import naive_kvcf_total, naive_kvpress_total, naive_rank, naive_snapkv_keep
from naive.context import LENGTHS, build, make_ctx, sample_ctx, sample_lists

from kvlab.compression.allocators import PyramidLayerAllocator
from kvlab.compression.budget import Budget
from kvlab.compression.context import LayerContext
from kvlab.compression.selectors import SELECTORS, topk_indices
from kvlab.config.errors import ConfigError
from kvlab.pipeline import Pipeline

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
                    # invariants: non-increasing, mean in [B', B' + (L - 1) / 2]
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
    # worked example: T = 640, keep 50 % (n_kept = 320), w = 64 -> no fallback, min_num = 64
    for T, C, w, L in ((640, 320, 64, 32), (4096, 2048, 64, 32), (4096, 1024, 32, 64)):
        got = [pyramid_alloc(allocator, C, w, [T], L, layer)[0] for layer in range(L)]
        assert got == [naive_kvpress_total(C, w, T, L, layer) for layer in range(L)], (T, C, w, L)


@pytest.mark.parametrize("arithmetic", ["int", "float"])
def test_pyramid_with_beta_1_gives_every_layer_the_same_budget(arithmetic):
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
    # the observation window is budget.window: a window larger than the budget is refused there
    with pytest.raises(ConfigError, match=r"budget.tokens = 8 is below the protected tokens \(window 16"):
        Pipeline.from_config(
            {"budget": {"tokens": 8, "window": 16}, "importance": {"attention": {"name": "window_attention"}}}
        )
    # and a scorer cannot observe a larger window than the budget protects
    with pytest.raises(
        ConfigError, match=r"importance.attention.window = 16 differs from .*budget.window = 4"
    ):
        Pipeline.from_config(
            {
                "budget": {"tokens": 8, "window": 4},
                "importance": {"attention": {"name": "window_attention", "window": 16}},
            }
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
        "importance": {"attention": {"name": "window_attention", "window": window, "kernel": 5}},
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
            "importance": {"attention": {"name": "window_attention", "window": W, "kernel": 5}},
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
        {"budget": {"tokens": 9, "window": 0, "sinks": 4}, "importance": {"recency": {}}},
        {
            "budget": {"ratio": 0.4, "window": 3},
            "importance": {"attention": {"name": "cumulative_attention"}},
        },
        {
            "budget": {"tokens": 10, "window": 2},
            "importance": {"value_norm": {}},
            "diversity": {"keydiff": {}},
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
    cfg = {"budget": {"tokens": tokens, "window": 0, "sinks": 4}, "importance": {"recency": {}}}
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


def assert_same_selections(first, second, lengths, seed, num_layers=4):
    """Both pipelines keep the same counts and positions on every layer of random contexts."""
    for layer in range(num_layers):
        ctx = make_ctx(lengths, seed=seed + layer, layer_idx=layer, num_layers=num_layers)
        a, _ = first.compress(ctx)
        b, _ = second.compress(ctx)
        assert torch.equal(a.counts, b.counts) and torch.equal(a.indices, b.indices), layer


@pytest.mark.parametrize("arithmetic", ["int", "float"])
def test_pyramid_with_beta_1_keeps_what_snapkv_keeps(arithmetic):
    W = 4
    snap = Pipeline.from_config(snapkv_config(12, W))
    beta1 = Pipeline.from_config(snapkv_config(12, W, name="pyramid", beta=1, arithmetic=arithmetic))
    assert_same_selections(snap, beta1, [37, 26], seed=30)


def test_pyramid_on_a_short_prompt_keeps_what_snapkv_keeps():
    """KVCF: T < 2 (C - w) = 24 -> SnapKV at every layer."""
    W = 4
    short = Pipeline.from_config(snapkv_config(16, W, name="pyramid"))
    snap = Pipeline.from_config(snapkv_config(16, W))
    assert_same_selections(short, snap, [23, 20], seed=40)


def test_pyramid_float_arithmetic_falls_back_to_the_uniform_budget():
    """kvpress: min_num < w falls back to the uniform budget (T = 640, keep 20 %, w = 64)."""
    allocator = PyramidLayerAllocator(arithmetic="float")
    for T, C, w, L in ((640, 128, 64, 32), (4096, 512, 64, 32), (1000, 100, 16, 8)):
        assert all(naive_kvpress_total(C, w, T, L, layer) == C for layer in range(L))  # the fallback fires
        assert [pyramid_alloc(allocator, C, w, [T], L, layer)[0] for layer in range(L)] == [C] * L


def test_ratio_window_protects_a_fraction_of_each_prompt():
    """``window: 0.1`` (LOOK-M's alpha1): the last floor(0.1 n) tokens of each sample, inside the budget."""
    ctx = make_ctx(LENGTHS, seed=22)
    pipe = Pipeline.from_config({"budget": {"ratio": 0.3, "window": 0.1}, "importance": {"key_norm": {}}})
    selection, _ = pipe.compress(ctx)
    T = ctx.seq_len
    for b, n in enumerate(LENGTHS):
        _, off, _, k, _ = sample_lists(ctx, b)
        window, budget = math.floor(0.1 * n), math.floor(0.3 * n)
        for h in range(2):
            scores = [-math.sqrt(sum(x * x for x in k[h][t])) for t in range(n - window)]
            want = sorted(naive_rank(scores, budget - window) + list(range(n - window, n)))
            assert selection.kept_positions(b, h) == [off + p for p in want]
            assert set(range(T - window, T)) <= set(selection.kept_positions(b, h))
    with pytest.raises(ConfigError, match="fraction of the prompt"):
        Pipeline.from_config({"budget": {"ratio": 0.3, "window": 1.5}, "importance": {"key_norm": {}}})
