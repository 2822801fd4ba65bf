"""CurDKV's leverage scorer against the naive loop of its formula, and against kvpress."""

from __future__ import annotations

import pytest
import torch
from naive.context import assert_scores, build, make_ctx, sample_ctx, sample_lists
from naive.cur import naive_cur
from support import kvpress_cases

from kvlab.compression.importance import IMPORTANCE

LENGTHS = [37, 26]  # windows of 5 and 16 end partial in both samples


@pytest.mark.parametrize("window", [5, 16, None])
@pytest.mark.parametrize("leverage", ["kv_product", "kv_avg", "key", "value"])
def test_cur_matches_naive(leverage, window):
    ctx = make_ctx(LENGTHS, seed=7)
    scores = build(IMPORTANCE, name="cur", leverage=leverage, local_window=window).score(ctx)
    assert scores.shape == (2, 2, ctx.seq_len) and scores.dtype == torch.float32
    for b in range(2):
        n, off, _, k, v = sample_lists(ctx, b)
        expected = [naive_cur(k[h], v[h], leverage, window) for h in range(2)]
        assert_scores(scores[b, :, off:], expected, atol=1e-6)
        assert not scores[b, :, :off].any()  # padding scores 0


def test_cur_projection_is_a_seeded_gaussian_sketch():
    ctx = make_ctx(LENGTHS, seed=8, layer_idx=2)
    scorer = build(IMPORTANCE, name="cur", projection=3, seed=5)
    sketch = scorer.sketch(ctx.keys.shape[-1], 2)
    assert sketch.shape == (8, 3) and torch.equal(sketch, scorer.sketch(8, 2))
    assert not torch.equal(sketch, scorer.sketch(8, 3))  # one sketch per layer
    scores = scorer.score(ctx)
    for b in range(2):
        n, off, _, k, v = sample_lists(ctx, b)
        expected = [naive_cur(k[h], v[h], "kv_product", 16, sketch.double().tolist()) for h in range(2)]
        assert_scores(scores[b, :, off:], expected, atol=1e-6)


def test_cur_sample_alone_equals_its_batch():
    ctx = make_ctx(LENGTHS, seed=9)
    scorer = build(IMPORTANCE, name="cur", projection=4)
    batched = scorer.score(ctx)
    for b in range(2):
        alone = scorer.score(sample_ctx(ctx, b))
        torch.testing.assert_close(
            batched[b, :, ctx.seq_len - alone.shape[-1] :], alone[0], atol=0, rtol=1e-6
        )


@pytest.mark.parametrize("case", ["cur", "cur_kv_avg"])
def test_cur_keeps_what_kvpress_keeps(case):
    """kvpress 0.5.5's CURPress on tiny-llama's keys and values (tests/fixtures/kvpress/)."""
    want = kvpress_cases.recorded()["cases"][case]["kept"]
    assert kvpress_cases.kvlab_kept(kvpress_cases.CASES[case], kvpress_cases.prompt_states()) == want
