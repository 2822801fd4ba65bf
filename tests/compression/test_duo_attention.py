"""DuoAttention: the head split against its formula (``naive.duo_attention``), what a pipeline keeps
(streaming heads: sinks and window; retrieval heads: everything), the needle statistic against
loops, batched equals unbatched, and the refusal without an artefact."""

from __future__ import annotations

import pytest
import torch
from naive.context import make_ctx, sample_ctx
from naive.duo_attention import duo_capacities, needle_mass
from support import e2e
from support.needle_statistics import check_needle_statistic
from support.presets import budgeted_pipeline, retrieval_samples

from kvlab.calibration.statistics import needle_sentence, needle_targets
from kvlab.compression.allocators import HEAD_ALLOCATORS
from kvlab.config.artefacts import Artefact
from kvlab.pipeline import Pipeline

SCORES = torch.rand(4, 4, generator=torch.Generator().manual_seed(0))  # [L, H]: 4 layers, 4 query heads


@pytest.mark.parametrize("share", [None, 0.25, 0.5, 1.0])
@pytest.mark.parametrize(("free", "available"), [(5, 20), (11, 13), (0, 9), (3, 3), (7, 40)])
@pytest.mark.parametrize("gqa", ["mean", "max"])
def test_capacities_match_the_formula(share, free, available, gqa):
    allocator = HEAD_ALLOCATORS.build({"name": "duo_attention", "retrieval_share": share, "gqa": gqa})
    caps = allocator.capacities(SCORES, 2, free, available)
    want = duo_capacities(SCORES.double().tolist(), 2, free, available, share, gqa)
    assert caps.flatten().tolist() == want
    assert int(caps.sum()) == min(8 * free, 8 * available)  # the budget, unless the prompt is shorter
    if share is None:  # whole heads, at most one partial, the rest streaming
        assert int(((caps > 0) & (caps < available)).sum()) <= 1


def artefact_file(tmp_path, layers: int = 2) -> str:
    scores = torch.tensor([[0.1, 0.2, 0.9, 0.8], [0.05, 0.0, 0.3, 0.4]])[:layers]
    path = tmp_path / "duo.safetensors"
    return str(Artefact("duo_attention_heads", "toy", layers, 4, 2, {"scores": scores}).save(path))


def test_streaming_heads_keep_sinks_and_window_retrieval_heads_keep_all(tmp_path):
    """4 KV heads over 2 layers, 30 candidates each (36 tokens, 2 sinks, 4 window), 15 free per head:
    60 free tokens: the best head (layer 0, KV 1) keeps all 30, the next (layer 1, KV 1) 30, the
    other two their 6 protected tokens."""
    node = {
        "budget": {"tokens": 21, "window": 4, "sinks": 2},
        "importance": {"recency": {}},
        "allocate": {"head": {"name": "duo_attention", "artefact": artefact_file(tmp_path)}},
    }
    pipeline = Pipeline.from_config(node)
    kept = []
    for layer in range(2):
        ctx = make_ctx([36, 36], seed=layer, layer_idx=layer, num_layers=2)
        selection, report = pipeline.compress(ctx)
        kept.append(report.kept[0].tolist())
        for h in range(2):
            positions = selection.kept_positions(0, h)
            if h == 0:
                assert positions == [0, 1, 32, 33, 34, 35]  # streaming: sinks + window
            else:
                assert positions == list(range(36))  # retrieval: the whole prompt
    assert kept == [[6, 36], [6, 36]]


def test_a_batch_allocates_each_sample_as_alone(tmp_path):
    node = {
        "budget": {"ratio": 0.4, "window": 3, "sinks": 1},
        "importance": {"recency": {}},
        "allocate": {"head": {"name": "duo_attention", "artefact": artefact_file(tmp_path)}},
    }
    pipeline = Pipeline.from_config(node)
    for layer in range(2):
        ctx = make_ctx([37, 26], seed=7 + layer, layer_idx=layer, num_layers=2)
        batched, _ = pipeline.compress(ctx)
        for b in range(2):
            alone, _ = pipeline.compress(sample_ctx(ctx, b))
            pad = ctx.seq_len - int(ctx.valid[b].sum())
            for h in range(2):
                assert [p - pad for p in batched.kept_positions(b, h)] == alone.kept_positions(0, h)


def test_needle_statistic_is_the_attention_mass_on_the_needle():
    check_needle_statistic("duo_attention_heads", needle_mass, seed=3, spans=[(12, 9), (10, 8)])


def test_needle_sentence_and_its_tokens():
    prompt = "Filler one. Filler two! The secret code for Orion is 12345. More filler?\nQuestion"
    assert needle_sentence(prompt, "12345") == "The secret code for Orion is 12345."
    with pytest.raises(ValueError, match="does not occur in the prompt"):
        needle_sentence(prompt, "99999")
    ids = torch.tensor([1, 2, 3, 7, 8, 9, 10, 4, 5])
    assert needle_targets(ids, [7, 8, 9, 10]).nonzero().flatten().tolist() == [3, 4, 5, 6]
    # a first token tokenised differently in the prompt: 3 of 4 ids from two windows, the last wins
    assert needle_targets(ids, [17, 8, 9, 10]).nonzero().flatten().tolist() == [4, 5, 6, 7]


def test_the_duo_mixkv_hybrid_streams_three_quarters_of_the_heads():
    """``configs/duo_mixkv.yaml`` on tiny-llama (2 layers x 4 KV heads): the 2 best heads share the
    free budget of all 8 by MixKV's scores, the other 6 keep their 4 sinks and 32 recent tokens."""
    model = "tiny-llama"
    pipeline = budgeted_pipeline("duo_mixkv", model, tokens=44)  # 8 free tokens per head
    result = e2e.run(e2e.kvlab_model(model), pipeline, retrieval_samples(), 2)
    kept = torch.stack([report.kept for report in result.reports]) - 36  # [L, B, Hkv] beyond protected
    for b in range(kept.shape[1]):
        free = kept[:, b].flatten()
        assert int((free > 0).sum()) == 2 and int(free.sum()) == 8 * 8
        assert sorted(free.tolist())[-2:] == [32, 32]
