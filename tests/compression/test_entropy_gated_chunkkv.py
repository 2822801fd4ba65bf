"""EntropyGatedChunkKV's selector against the naive loop of its rule, a worked example, the
budget's invariants, batching, layer-wise reuse, its refusal, and kvpress."""

from __future__ import annotations

import pytest
import torch
from naive.context import assert_batch_equals_alone, kept, make_ctx, random_scores
from naive.entropy_gated_chunkkv import naive_entropy_gated_chunkkv
from support import kvpress_cases

from kvlab.cache.state import RunState
from kvlab.compression.selectors import SELECTORS
from kvlab.config.errors import ConfigError
from kvlab.pipeline import Pipeline

LENGTHS = [37, 26]


def selector(**fields):
    return SELECTORS.build({"name": "entropy_gated_chunkkv", **fields})


@pytest.mark.parametrize("heads", ["each", "shared"])
@pytest.mark.parametrize(
    ("chunk", "low", "budget"),
    [(4, 1, 17), (5, 2, 20), (7, 3, 12), (10, 4, 26), (5, 4, 30), (3, 1, 9), (2, 1, 15), (6, 2, 31)],
)
def test_entropy_gated_chunkkv_matches_naive(chunk, low, budget, heads):
    ctx = make_ctx(LENGTHS, seed=20)
    scores = random_scores(ctx, seed=chunk + 10 * low)
    counts = torch.tensor([[budget, budget - 2], [budget - 3, budget]]).minimum(ctx.lengths[:, None])
    selection = selector(chunk=chunk, low_entropy_chunk=low, heads=heads).select(scores, counts, ctx)
    assert torch.equal(selection.counts, counts)
    for b, n in enumerate(LENGTHS):
        off = ctx.seq_len - n
        want = naive_entropy_gated_chunkkv(
            scores[b, :, off:].double().tolist(), counts[b].tolist(), chunk, low, heads == "shared"
        )
        for h in range(2):
            got = kept(selection, b, h, off)
            assert got == want[h]
            assert len(got) == counts[b, h]  # exactly the count


def worked_example() -> torch.Tensor:
    """``[1, 1, 30]``: chunk 0 one spike (10) over small distinct scores, important but spiky;
    chunk 1 flat 0.8 (entropy 1); chunk 2 about 0.5, nearly flat, the lowest mean."""
    spiky = [10.0] + [0.1 + 0.01 * i for i in range(1, 10)]
    flat = [0.8] * 10
    low = [0.5 + 0.001 * i for i in range(10)]
    return torch.tensor([spiky + flat + low])[None]


@pytest.mark.parametrize(
    ("budget", "want"),
    [
        # the spike's chunk keeps its 4 best (0, 9, 8, 7); its freed 6 tokens take chunk 1 whole
        (14, [0, 7, 8, 9, *range(10, 20)]),
        # chunk 2 (not spiky) is cut to the 4 best of its own tokens by the budget left
        (18, [0, 7, 8, 9, *range(10, 20), 26, 27, 28, 29]),
        # every chunk taken (24 tokens): the 4 left go to the best remaining, chunk 0's 6, 5, 4, 3
        (28, [0, *range(3, 30)]),
    ],
)
def test_a_spiky_chunk_keeps_its_best_tokens_and_frees_the_rest(budget, want):
    ctx = make_ctx([30], seed=21, kv_heads=1)
    selection = selector(chunk=10, low_entropy_chunk=4).select(
        worked_example(), torch.tensor([[budget]]), ctx
    )
    assert selection.kept_positions(0, 0) == want
    # plain ChunkKV spends 10 tokens on the spike's chunk instead
    plain = SELECTORS.build({"name": "chunkkv", "chunk": 10}).select(
        worked_example(), torch.tensor([[14]]), ctx
    )
    assert plain.kept_positions(0, 0)[:10] == list(range(10))


@pytest.mark.parametrize("heads", ["each", "shared"])
def test_a_budget_of_the_whole_prompt_keeps_everything(heads):
    ctx = make_ctx(LENGTHS, seed=22)
    node = {"budget": {"tokens": 40, "window": 3, "sinks": 2}, "importance": {"key_norm": {}}}
    select = {"name": "entropy_gated_chunkkv", "chunk": 5, "low_entropy_chunk": 2, "heads": heads}
    selection, _ = Pipeline.from_config({**node, "select": select}).compress(ctx)
    for b, n in enumerate(LENGTHS):
        for h in range(2):
            assert kept(selection, b, h, ctx.seq_len - n) == list(range(n))


@pytest.mark.parametrize("heads", ["each", "shared"])
def test_entropy_gated_chunkkv_sample_alone_equals_its_batch(heads):
    ctx = make_ctx(LENGTHS, seed=23)
    node = {"budget": {"tokens": 19, "window": 3, "sinks": 2}, "importance": {"key_norm": {}}}
    select = {"name": "entropy_gated_chunkkv", "chunk": 4, "low_entropy_chunk": 2, "heads": heads}
    pipeline = Pipeline.from_config({**node, "select": select})
    assert_batch_equals_alone(pipeline, ctx)


def test_entropy_gated_chunkkv_reuses_the_first_layer_of_each_group():
    """reuse_layers 1: layer 1 keeps layer 0's positions, layer 2 selects anew from its own."""
    run = RunState()
    reusing, alone = (
        selector(chunk=4, low_entropy_chunk=2, reuse_layers=1),
        selector(chunk=4, low_entropy_chunk=2),
    )
    counts = torch.full((2, 2), 14)
    picked = []
    for layer in range(3):
        ctx = make_ctx(LENGTHS, seed=24, layer_idx=layer, num_layers=3, run=run)
        scores = random_scores(ctx, seed=200 + layer)
        picked.append(reusing.select(scores, counts, ctx).indices)
        if layer != 1:
            assert torch.equal(picked[-1], alone.select(scores, counts, ctx).indices)
    assert torch.equal(picked[1], picked[0]) and not torch.equal(picked[2], picked[0])


@pytest.mark.parametrize(("chunk", "low"), [(4, 4), (4, 6), (10, 0)])
def test_a_spiky_chunk_must_keep_fewer_tokens_than_a_chunk(chunk, low):
    with pytest.raises(
        ConfigError, match=rf"low_entropy_chunk must be >= 1 and below chunk \({chunk}\), got {low}"
    ):
        selector(chunk=chunk, low_entropy_chunk=low)


@pytest.mark.parametrize("case", ["entropy_gated_chunkkv", "entropy_gated_chunkkv_topup"])
def test_entropy_gated_chunkkv_keeps_what_kvpress_keeps(case):
    """kvpress 0.5.5's EntropyGatedChunkKVPress around KnormPress on tiny-llama (tests/fixtures/kvpress/)."""
    want = kvpress_cases.recorded()["cases"][case]["kept"]
    got = kvpress_cases.kvlab_kept(kvpress_cases.CASES[case], kvpress_cases.prompt_states())
    assert got == want
    assert all(len(head) == kvpress_cases.CASES[case].kept for layer in got for head in layer)
