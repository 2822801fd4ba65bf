"""Scorers and mixers against independent naive implementations of their formulas."""

from __future__ import annotations

import math

import pytest
import torch
from naive.attention import INF, dot, naive_cumulative, naive_window_scores, norm
from naive.context import LENGTHS, assert_scores, build, make_ctx, sample_ctx, sample_lists

from kvlab.compression.context import LayerContext
from kvlab.compression.diversity import DIVERSITY
from kvlab.compression.importance import IMPORTANCE
from kvlab.compression.mixers import MIXERS
from kvlab.config.errors import ConfigError
from kvlab.pipeline import Pipeline

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
    """SnapKV invariants: rows sum to 1, S >= 0, sum_j S_j <= W, kernel 1 == no pooling, window = +inf."""
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
def test_average_pooling_commutes_with_the_query_group_reduction(gqa, kernel):
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
def test_without_query_groups_every_gqa_reduction_gives_the_same_scores(pool, order):
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
                "importance": {
                    "attention": {"name": "window_attention", "pool": pool, "gqa": gqa, "gqa_order": order}
                },
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


@pytest.mark.parametrize("anchor", ["unit_mean", "raw_mean"])
def test_keydiff_matches_naive(anchor):
    """KeyDiff's anchor is the mean of unit keys (the paper, the default) or of raw keys."""
    ctx = make_ctx(LENGTHS, seed=10)
    scores = build(DIVERSITY, name="keydiff", anchor=anchor).score(ctx)
    for b in range(2):
        n, off, _, k, _ = sample_lists(ctx, b)
        expected = []
        for h in range(2):
            keys = [[x / norm(row) for x in row] for row in k[h][:n]] if anchor == "unit_mean" else k[h][:n]
            mean = [sum(keys[t][d] for t in range(n)) / n for d in range(len(k[h][0]))]
            expected.append([-dot(k[h][t], mean) / (norm(k[h][t]) * norm(mean)) for t in range(n)])
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
    mixer = build(MIXERS, name="weighted_sum", weights={"a": 0.5, "b": 2.0, "c": -1.0}, normalize=normalize)
    mixer.check_roles(["a", "b"], ["c"], "model.compression.mixer")
    mixed = mixer.mix({"a": a, "b": b_, "c": c}, ctx)
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
    # a single score with default settings passes through; weights must name every role
    assert torch.equal(build(MIXERS, name="weighted_sum").mix({"a": a}, ctx), a)
    with pytest.raises(ConfigError, match="model.compression.mixer.weights gives no weight to c"):
        build(MIXERS, name="weighted_sum", weights={"a": 1.0}).check_roles(
            ["a", "c"], [], "model.compression.mixer"
        )


def test_minmax_normalised_scores_span_unit_interval():
    ctx = make_ctx(LENGTHS, seed=13)
    s = torch.randn(2, 2, ctx.seq_len) * 7
    out = build(MIXERS, name="weighted_sum", weights={"s": 1.0}, normalize="minmax").mix({"s": s}, ctx)
    for b in range(2):
        v = out[b][:, ctx.valid[b]]
        torch.testing.assert_close(v.amin(-1), torch.zeros(2), atol=1e-6, rtol=0)
        torch.testing.assert_close(v.amax(-1), torch.ones(2), atol=1e-6, rtol=0)
