"""ChunkKV's selector against the naive loop of its rule, layer-wise reuse, batching, and kvpress."""

from __future__ import annotations

import pytest
import torch
from naive.chunkkv import naive_chunkkv
from naive.context import assert_batch_equals_alone, kept, make_ctx, random_scores
from support import e2e, kvpress_cases
from support.presets import budgeted_compression, retrieval_samples

from kvlab.cache.state import RunState
from kvlab.compression.selectors import SELECTORS
from kvlab.pipeline import Pipeline

LENGTHS = [37, 26]


@pytest.mark.parametrize("heads", ["each", "shared"])
@pytest.mark.parametrize(("chunk", "budget"), [(4, 17), (5, 20), (7, 12), (1, 9), (10, 26)])
def test_chunkkv_matches_naive(chunk, budget, heads):
    ctx = make_ctx(LENGTHS, seed=10)
    scores = random_scores(ctx, seed=chunk)
    counts = torch.tensor([[budget, budget], [budget - 3, budget]])
    selection = SELECTORS.build({"name": "chunkkv", "chunk": chunk, "heads": heads}).select(
        scores, counts, ctx
    )
    assert torch.equal(selection.counts, counts)
    for b, n in enumerate(LENGTHS):
        off = ctx.seq_len - n
        want = naive_chunkkv(
            scores[b, :, off:].double().tolist(), counts[b].tolist(), chunk, heads == "shared"
        )
        for h in range(2):
            assert kept(selection, b, h, off) == want[h]


def test_chunkkv_keeps_whole_chunks_of_a_sample_s_own_positions():
    """With a budget of whole chunks, only whole chunks (of the sample's positions) are kept."""
    ctx = make_ctx(LENGTHS, seed=11)
    scores = random_scores(ctx, seed=1, protected=(0, 0))
    counts = torch.full((2, 2), 15)
    selection = SELECTORS.build({"name": "chunkkv", "chunk": 5}).select(scores, counts, ctx)
    for b, n in enumerate(LENGTHS):
        for h in range(2):
            positions = kept(selection, b, h, ctx.seq_len - n)
            chunks = {p // 5 for p in positions}
            assert len(chunks) == 3 and all({5 * c + i for i in range(5)} <= set(positions) for c in chunks)


def test_chunkkv_sample_alone_equals_its_batch():
    ctx = make_ctx(LENGTHS, seed=12)
    node = {"budget": {"tokens": 19, "window": 3, "sinks": 2}, "importance": {"key_norm": {}}}
    pipeline = Pipeline.from_config({**node, "select": {"name": "chunkkv", "chunk": 4}})
    assert_batch_equals_alone(pipeline, ctx)


def test_chunkkv_reuses_the_first_layer_of_each_group():
    """reuse_layers 2: layers 1 and 2 keep layer 0's positions, layer 3 selects anew, 4 reuses 3."""
    run = RunState()
    selector = SELECTORS.build({"name": "chunkkv", "chunk": 4, "reuse_layers": 2})
    alone = SELECTORS.build({"name": "chunkkv", "chunk": 4})
    counts = torch.full((2, 2), 14)
    picked = []
    for layer in range(5):
        ctx = make_ctx(LENGTHS, seed=13, layer_idx=layer, num_layers=5, run=run)
        scores = random_scores(ctx, seed=100 + layer)
        selection = selector.select(scores, counts, ctx)
        picked.append(selection.indices)
        if layer in (0, 3):  # the group's first layer selects from its own scores
            assert torch.equal(selection.indices, alone.select(scores, counts, ctx).indices)
    assert torch.equal(picked[1], picked[0]) and torch.equal(picked[2], picked[0])
    assert not torch.equal(picked[3], picked[0]) and torch.equal(picked[4], picked[3])


@pytest.mark.parametrize("case", ["chunkkv", "chunkkv_11"])
def test_chunkkv_keeps_what_kvpress_keeps(case):
    """kvpress 0.5.5's ChunkKVPress around KnormPress on tiny-llama (tests/fixtures/kvpress/)."""
    want = kvpress_cases.recorded()["cases"][case]["kept"]
    assert kvpress_cases.kvlab_kept(kvpress_cases.CASES[case], kvpress_cases.prompt_states()) == want


def test_chunkkv_reuse_through_the_model():
    """The chunkkv preset with reuse_layers 1 on tiny-qwen2 (3 layers): layer 1 keeps layer 0's
    positions, layer 2 selects anew."""
    node = budgeted_compression("chunkkv", tokens=40)
    node["select"]["reuse_layers"] = 1
    result = e2e.run(e2e.kvlab_model("tiny-qwen2"), Pipeline.from_config(node), retrieval_samples(), 2)
    first, second, third = (report.selection.indices for report in result.reports)
    assert torch.equal(second, first)
    assert not torch.equal(third, first)
