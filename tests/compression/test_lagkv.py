"""LagKV's scorer against the naive loop of its formula, and what its scores make a pipeline keep."""

from __future__ import annotations

import pytest
import torch
from naive.context import assert_scores, build, make_ctx, sample_ctx, sample_lists
from naive.lagkv import naive_lagkv
from support import kvpress_cases

from kvlab.compression.importance import IMPORTANCE
from kvlab.compression.lagkv import partition_ranks
from kvlab.config.errors import ConfigError
from kvlab.pipeline import Pipeline

LENGTHS = [43, 30]  # lag 6, 3 sinks: 6 partitions (5 scored, tail 10); 4 (3 scored, tail 9)


@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize(("sinks", "lag"), [(3, 6), (0, 5), (4, 16)])
def test_lagkv_matches_naive(sinks, lag, cross):
    ctx = make_ctx(LENGTHS, seed=3)
    scores = build(IMPORTANCE, name="lagkv", lag_size=lag, sinks=sinks, cross_scoring=cross).score(ctx)
    assert scores.shape == (2, 2, ctx.seq_len) and scores.dtype == torch.float32
    for b in range(2):
        n, off, _, k, v = sample_lists(ctx, b)
        expected = [naive_lagkv(k[h], v[h], sinks, lag, cross) for h in range(2)]
        assert_scores(scores[b, :, off:], expected)


def test_lagkv_sample_alone_equals_its_batch():
    ctx = make_ctx(LENGTHS, seed=4)
    scorer = build(IMPORTANCE, name="lagkv", lag_size=6, sinks=3)
    batched = scorer.score(ctx)
    for b in range(2):
        alone = scorer.score(sample_ctx(ctx, b))
        assert torch.equal(batched[b, :, ctx.seq_len - alone.shape[-1] :], alone[0])


def test_partition_ranks_spread_a_budget_evenly():
    """A top-k over ranks takes floor(k / P) or one more from each partition, earlier ones first."""
    scores = torch.rand(3, 4, 8, generator=torch.Generator().manual_seed(0))  # [Hkv, P, L]
    ranks = partition_ranks(scores).reshape(3, -1)
    for k in (4, 9, 13):
        kept = torch.sort(ranks, dim=-1, descending=True, stable=True).indices[:, :k]
        per_part = torch.stack([(kept // 8 == p).sum(-1) for p in range(4)], -1)  # [Hkv, P]
        want = torch.tensor([k // 4 + (p < k % 4) for p in range(4)])
        assert torch.equal(per_part, want.expand(3, -1))
        # within a partition the kept tokens are its highest scores
        for h, p in ((0, 0), (2, 3)):
            ours = sorted(int(t) % 8 for t in kept[h] if t // 8 == p)
            best = sorted(torch.topk(scores[h, p], int(want[p])).indices.tolist())
            assert ours == best


def test_lagkv_pipeline_keeps_sinks_tail_then_even_partitions():
    """Sinks and the tail are kept before any partition token; the other 8 tokens split over the 5
    scored partitions, 2 from each of the first three, 1 from the others."""
    ctx = make_ctx([43], seed=5)
    node = {
        "budget": {"tokens": 3 + 10 + 8, "window": 0, "sinks": 3},
        "importance": {"lagkv": {"lag_size": 6}},
    }
    selection, _ = Pipeline.from_config(node).compress(ctx)
    for h in range(2):
        kept = selection.kept_positions(0, h)
        assert set(range(3)) | set(range(33, 43)) <= set(kept)
        per_part = [sum(3 + 6 * p <= t < 9 + 6 * p for t in kept) for p in range(5)]
        assert per_part == [2, 2, 2, 1, 1]


def test_lagkv_short_prompt_keeps_the_newest():
    ctx = make_ctx([20], seed=6)  # < 3 + 2 * 16: nothing to score
    node = {"budget": {"tokens": 9, "window": 0, "sinks": 3}, "importance": {"lagkv": {"lag_size": 16}}}
    selection, _ = Pipeline.from_config(node).compress(ctx)
    assert selection.kept_positions(0, 0) == [0, 1, 2, *range(14, 20)]


def test_lagkv_sinks_restate_the_budget():
    node = {"budget": {"tokens": 32, "window": 0, "sinks": 4}, "importance": {"lagkv": {"sinks": 2}}}
    with pytest.raises(ConfigError, match="sinks"):
        Pipeline.from_config(node)


@pytest.mark.parametrize("case", ["lagkv", "lagkv_cross"])
def test_lagkv_keeps_what_kvpress_keeps(case):
    """kvpress 0.5.5's LagKVPress on tiny-llama's keys and values (tests/fixtures/kvpress/)."""
    want = kvpress_cases.recorded()["cases"][case]["kept"]
    assert kvpress_cases.kvlab_kept(kvpress_cases.CASES[case], kvpress_cases.prompt_states()) == want
