"""FastV against the formula (``naive.fastv``: loops in fp64) layer by layer, its schedule and its one
source for K, and end to end on the tiny VLMs (layer K = 1: they have two layers)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from naive.context import make_ctx, sample_lists
from naive.fastv import fastv_keep, received_attention
from support import e2e
from support.preset_runs import preset_samples

from kvlab.cache.state import RunState
from kvlab.compression.fastv import FastVAttention, FastVLayerAllocator
from kvlab.config.errors import ConfigError
from kvlab.config.loader import resolve
from kvlab.models.base import TEXT
from kvlab.pipeline import Pipeline

LENGTHS = [26, 19]
LAYERS = 4
#: image tokens of each sample (sample coordinates): two images, then one
IMAGES = [list(range(3, 11)) + list(range(13, 19)), list(range(2, 9))]


def fastv_node(**changes) -> dict:
    """The preset's compression node with ``changes`` merged into its ``allocate.layer`` / scorer."""
    node = resolve(["fastv"], [])["model"]["compression"]
    node["allocate"]["layer"].update(changes.pop("layer_allocator", {}))
    node["importance"]["attention"].update(changes)
    return node


def layer_contexts(run: RunState) -> list:
    """One prefill's contexts of ``LAYERS`` layers (each its own queries and keys), images marked."""
    contexts = []
    for layer in range(LAYERS):
        ctx = make_ctx(LENGTHS, seed=20 + layer, layer_idx=layer, num_layers=LAYERS, scale=2.0, run=run)
        modality = ctx.modality.clone()
        for b, images in enumerate(IMAGES):
            off = ctx.seq_len - LENGTHS[b]
            modality[b, [off + t for t in images]] = 1
        contexts.append(dataclasses.replace(ctx, modality=modality))
    return contexts


@pytest.mark.parametrize("queries", ["last", "all"])
@pytest.mark.parametrize("K, drop", [(2, 0.5), (1, 0.25), (3, 0.75)])
def test_fastv_keeps_the_text_and_the_top_images_of_layer_k_minus_1_from_layer_k_on(queries, K, drop):
    pipeline = Pipeline.from_config(fastv_node(queries=queries, layer_allocator={"layer": K, "drop": drop}))
    contexts = layer_contexts(RunState())
    selections = [pipeline.compress(ctx)[0] for ctx in contexts]
    for b in range(len(LENGTHS)):
        n, off, q, k, _ = sample_lists(contexts[K - 1], b)
        ranking = received_attention(q, k, contexts[K - 1].scaling, queries)
        image = [t in IMAGES[b] for t in range(n)]
        want = fastv_keep(ranking, image, drop)
        for layer, selection in enumerate(selections):
            for h in range(2):
                kept = [p - off for p in selection.kept_positions(b, h)]
                assert kept == (list(range(n)) if layer < K else want), (layer, b, h)
    # the ranking is layer K - 1's: layer K's own attention would keep other image tokens
    n, off, q, k, _ = sample_lists(contexts[K], 0)
    own = fastv_keep(
        received_attention(q, k, contexts[K].scaling, queries), [t in IMAGES[0] for t in range(n)], drop
    )
    assert drop in (0.0, 1.0) or own != [p - off for p in selections[K].kept_positions(0, 0)]


def test_the_schedule_budget_floor_and_text_only_prompts():
    allocator = FastVLayerAllocator(layer=2, drop=0.5)
    ctx = layer_contexts(RunState())[2]
    lengths = ctx.lengths
    zero = torch.zeros(2, dtype=torch.long)
    got = allocator.allocate(zero, lengths, zero, ctx)
    images = torch.tensor([len(i) for i in IMAGES])
    assert torch.equal(got, lengths - images + torch.round(images * 0.5).long())
    floor = torch.full((2,), 18)  # above FastV's 16 for sample 1, below its 19 for sample 0
    assert torch.equal(allocator.allocate(floor, lengths, zero, ctx), torch.tensor([19, 18]))
    assert torch.equal(allocator.allocate(zero, lengths, zero, layer_contexts(RunState())[1]), lengths)
    text_only = make_ctx(LENGTHS, layer_idx=3)
    assert torch.equal(allocator.allocate(zero, lengths, zero, text_only), lengths)
    with pytest.raises(ValueError, match="layer"):
        FastVLayerAllocator(layer=0)
    with pytest.raises(ValueError, match="drop"):
        FastVLayerAllocator(drop=1.5)


def test_k_is_set_once_on_the_layer_allocator():
    assert Pipeline.from_config(fastv_node()).importance["attention"].layer == 2
    with pytest.raises(
        ConfigError, match=r"attention.layer = 3 differs from model.compression.allocate.layer.layer = 2"
    ):
        Pipeline.from_config(fastv_node(layer=3))
    node = fastv_node()
    node["allocate"]["layer"] = {"name": "uniform"}
    with pytest.raises(ConfigError, match="restates model.compression.allocate.layer.layer"):
        Pipeline.from_config(node)
    assert FastVAttention(layer=2).capabilities.chunked_prefill is False


@pytest.mark.parametrize("model", ["tiny-qwen2-vl", "tiny-llava"])
def test_fastv_on_the_tiny_vlms_evicts_only_image_tokens_from_layer_k(model):
    loaded = e2e.kvlab_model(model)
    items = preset_samples(vlm=True)  # two images, one image, text only
    pipeline = Pipeline.from_config(fastv_node(layer_allocator={"layer": 1}))
    result = e2e.run(loaded, pipeline, items, 4)
    batch = loaded.processor.collate(list(items))
    T = batch.input_ids.shape[1]
    first, second = result.reports
    assert torch.equal(first.kept, result.prompt_lengths[:, None].expand_as(first.kept))
    for b in range(len(items)):
        pad = T - int(result.prompt_lengths[b])
        text = {p for p in range(pad, T) if int(batch.modality[b, p]) == TEXT}
        images = int(result.prompt_lengths[b]) - len(text)
        rows = [second.selection.kept_positions(b, h) for h in range(loaded.info.num_kv_heads)]
        assert all(row == rows[0] for row in rows)  # every KV head evicts the same tokens
        assert text <= set(rows[0])
        assert len(rows[0]) == len(text) + round(images * 0.5)
    assert int(result.prompt_lengths[0]) > len(second.selection.kept_positions(0, 0))  # something went
    e2e.assert_batch_equals_alone(loaded, pipeline, items, 4)
