"""The two_stage selector against a loop (``naive.budgets.naive_two_stage_keep``), its limits, its role
check, and a pipeline handing it the scores by role."""

from __future__ import annotations

import itertools

import pytest
import torch
from naive.budgets import naive_rank, naive_two_stage_keep
from naive.context import make_ctx

from kvlab.compression.importance import KeyNormScorer, WindowAttentionScorer
from kvlab.compression.two_stage import TwoStageSelector
from kvlab.config.errors import ConfigError
from kvlab.pipeline import Pipeline

LENGTHS = [21, 14]


def random_case(seed: int):
    """Final scores with padding (-inf) and protected (+inf) entries, a first-stage score, counts."""
    ctx = make_ctx(LENGTHS, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    B, Hkv, T = 2, 2, max(LENGTHS)
    final = torch.randn(B, Hkv, T, generator=gen)
    final = final.masked_fill(~ctx.valid[:, None, :], float("-inf"))
    final[:, :, -2:] = float("inf")  # a recent window of 2
    first = torch.randn(B, Hkv, T, generator=gen).masked_fill(~ctx.valid[:, None, :], float("-inf"))
    counts = torch.tensor([[9, 5], [13, 3]])
    ctx.role_scores = {"attention": first}
    return ctx, final, first, counts


@pytest.mark.parametrize("share", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_two_stage_keeps_what_the_loop_keeps(share, seed):
    ctx, final, first, counts = random_case(seed)
    got = TwoStageSelector(first="attention", share=share).select(final, counts, ctx)
    assert torch.equal(got.counts, counts)
    for b, h in itertools.product(range(2), range(2)):
        f, s = final[b, h].tolist(), first[b, h].tolist()
        fixed = [t for t in range(len(f)) if f[t] == float("inf")]
        want = naive_two_stage_keep(s, f, fixed, int(counts[b, h]), share)
        assert got.kept_positions(b, h) == want, (b, h)


def test_the_two_stages_differ_from_either_score_alone():
    """On these scores the first stage changes the choice (the selector is not topk in disguise)."""
    ctx, final, first, counts = random_case(0)
    staged = TwoStageSelector(share=0.5).select(final, counts, ctx)
    by_final = TwoStageSelector(share=0.0).select(final, counts, ctx)
    by_first = TwoStageSelector(share=1.0).select(final, counts, ctx)
    rows = [(b, h) for b in range(2) for h in range(2)]
    assert any(staged.kept_positions(b, h) != by_final.kept_positions(b, h) for b, h in rows)
    assert any(staged.kept_positions(b, h) != by_first.kept_positions(b, h) for b, h in rows)


def test_a_share_outside_zero_one_and_an_unknown_role_are_refused():
    with pytest.raises(ValueError, match="share"):
        TwoStageSelector(share=1.5)
    node = {
        "budget": {"tokens": 12, "window": 2},
        "importance": {"attention": {"name": "window_attention"}},
        "select": {"name": "two_stage", "first": "atention"},
    }
    with pytest.raises(ConfigError, match="'atention'.*Did you mean 'attention'"):
        Pipeline.from_config(node)


def test_a_pipeline_hands_the_selector_each_scorer_by_role():
    """Stage one by the window attention, stage two by the mix of attention and key norm."""
    ctx = make_ctx(LENGTHS, seed=5)
    node = {
        "budget": {"tokens": 12, "window": 2},
        "importance": {
            "attention": {"name": "window_attention", "kernel": 1, "pool": "none"},
            "key_norm": {},
        },
        "mixer": {"name": "weighted_sum", "weights": {"attention": 1.0, "key_norm": 0.05}},
        "select": {"name": "two_stage", "first": "attention", "share": 0.5},
    }
    selection, _ = Pipeline.from_config(node).compress(ctx)
    attention = WindowAttentionScorer(window=2, kernel=1, pool="none").score(make_ctx(LENGTHS, seed=5))
    key_norm = KeyNormScorer().score(make_ctx(LENGTHS, seed=5))
    mattered = []
    for b, h in itertools.product(range(2), range(2)):
        n = LENGTHS[b]
        off = max(LENGTHS) - n
        first = attention[b, h, off:].tolist()
        final = (attention[b, h, off:] + 0.05 * key_norm[b, h, off:]).tolist()
        final[n - 2 :] = [float("inf")] * 2
        want = naive_two_stage_keep(first, final, [n - 2, n - 1], 12, 0.5)
        assert [p - off for p in selection.kept_positions(b, h)] == want
        mattered.append(want != sorted(naive_rank(final[: n - 2], 10) + [n - 2, n - 1]))
    assert any(mattered)  # the first stage changed some head's choice
