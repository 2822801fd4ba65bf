"""Invariants of every shipped method preset, end to end through the model on tiny random models.

One table of presets; each invariant is parametrised over it, so a new preset is tested by
adding its name. (Random weights: plumbing and invariants only, never quality.)
"""

import functools

import e2e
import pytest
import torch
import torch.nn.functional as F
from e2e import kvlab_model
from transformers import AttentionInterface, DynamicCache

from kvlab.compression.pipeline import Pipeline
from kvlab.config import resolve
from kvlab.data.synthetic import SyntheticRetrieval
from kvlab.models import load_model

PRESETS = ["random", "streamingllm", "snapkv", "knorm", "h2o", "pyramidkv"]
TEXT_MODELS = ["tiny-llama", "tiny-qwen2"]
NEW_TOKENS = 6


def preset_compression(name, **budget):
    node = resolve([name], [])["model"]["compression"]
    if budget:
        node["budget"] = {**node["budget"], **budget}
    return node


def pipeline(name, **budget):
    return Pipeline.from_config(preset_compression(name, **budget))


@functools.cache
def samples(n=2, words=60):
    return SyntheticRetrieval(num_samples=n, context_words=words, seed=1).samples()


def batch_of(loaded, items):
    return loaded.processor.collate(list(items))


def run(loaded, pipe, items):
    return e2e.run(loaded, pipe, items, NEW_TOKENS)


def window_of(name):
    return preset_compression(name)["budget"].get("window", 0)


@pytest.mark.parametrize("model", TEXT_MODELS)
@pytest.mark.parametrize("preset", PRESETS)
def test_budget_at_least_the_prompt_is_identical_to_full(model, preset):
    loaded = kvlab_model(model)
    full = run(loaded, Pipeline.from_config(None), samples())
    longest = int(full.prompt_lengths.max())
    big = run(loaded, pipeline(preset, tokens=longest), samples())
    assert big.tokens == full.tokens
    assert torch.equal(big.step_logits, full.step_logits)
    assert torch.equal(big.kept, full.kept)


@pytest.mark.parametrize("model", TEXT_MODELS)
@pytest.mark.parametrize("preset", PRESETS)
def test_kept_counts_equal_layer_budgets_and_window_is_kept(model, preset):
    loaded = kvlab_model(model)
    budget = 48
    result = run(loaded, pipeline(preset, tokens=budget), samples())
    lengths = result.prompt_lengths
    T = batch_of(loaded, samples())["input_ids"].shape[1]
    window = window_of(preset)
    for report in result.reports:
        expected = torch.minimum(report.budget, lengths)
        assert torch.equal(report.kept, expected[:, None].expand_as(report.kept)), report.layer_idx
        for b in range(len(lengths)):
            pad = T - int(lengths[b])
            for h in range(report.kept.shape[1]):
                kept = report.selection.kept_positions(b, h)
                assert len(set(kept)) == len(kept)
                assert all(pad <= p < T for p in kept)  # padding never kept
                assert set(range(T - window, T)) <= set(kept)  # recent window kept
    if preset != "pyramidkv":
        assert all(int(r.budget.max()) == budget for r in result.reports)


@pytest.mark.parametrize("preset", PRESETS)
def test_kv_bytes_fall_in_proportion_to_the_budget(preset):
    loaded = kvlab_model("tiny-qwen2")
    info = loaded.info
    per_token = info.num_layers * info.num_kv_heads * info.head_dim * 2 * 4
    kept = {}
    for budget in (64, 32):
        result = run(loaded, pipeline(preset, tokens=budget), samples())
        kept[budget] = result.kv_bytes_kept
        assert torch.equal(result.kv_bytes_full, result.prompt_lengths * per_token)
        if preset != "pyramidkv":
            assert torch.equal(
                result.kv_bytes_kept, torch.full_like(result.kv_bytes_kept, budget * per_token)
            )
    assert bool((kept[32] < kept[64]).all())
    # pyramid budgets average to the configured one up to the schedule's floor
    ratio = (kept[32].float() / kept[64].float()).tolist()
    assert all(0.4 < r < 0.6 for r in ratio)


@pytest.mark.parametrize("model", TEXT_MODELS)
@pytest.mark.parametrize("preset", ["full", *PRESETS])
def test_padded_batch_equals_samples_one_by_one(model, preset):
    loaded = kvlab_model(model)
    pipe = pipeline(preset, tokens=40) if preset != "full" else Pipeline.from_config(None)
    items = samples(2, 60)[:1] + SyntheticRetrieval(num_samples=1, context_words=35, seed=5).samples()
    e2e.assert_batch_equals_alone(loaded, pipe, items, NEW_TOKENS)


MASK_REFERENCE = {}


def masked_reference_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
):
    """Full cache, evicted entries hidden by an additive -inf mask at decode (kvpress-style masking)."""
    G = query.shape[1] // key.shape[1]
    if query.shape[2] > 1:
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2), None
    keep = MASK_REFERENCE[module.layer_idx]  # [B, Hkv, T] bool
    mask = torch.ones(*keep.shape[:2], key.shape[2], dtype=torch.bool)
    mask[..., : keep.shape[-1]] = keep
    mask = mask.repeat_interleave(G, 1)[:, :, None, :]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2), None


@pytest.mark.parametrize("preset", ["snapkv", "h2o", "pyramidkv", "streamingllm"])
def test_decode_over_ragged_cache_equals_masked_full_cache(preset):
    """Strongest end-to-end check (david.md §4.1.6): positions continue from the prompt length and
    the ragged cache attends to exactly the kept entries."""
    loaded = kvlab_model("tiny-qwen2")
    item = samples(1, 60)
    result = run(loaded, pipeline(preset, tokens=40), item)
    T = int(result.prompt_lengths[0])
    for report in result.reports:
        keep = torch.zeros(1, report.kept.shape[1], T, dtype=torch.bool)
        for h in range(report.kept.shape[1]):
            keep[0, h, report.selection.kept_positions(0, h)] = True
        MASK_REFERENCE[report.layer_idx] = keep
    AttentionInterface.register("kvlab_masked_reference", masked_reference_attention)
    reference = load_model("tiny-qwen2")
    reference.model.set_attn_implementation("kvlab_masked_reference")
    ids = batch_of(loaded, item)["input_ids"]
    cache = DynamicCache()
    with torch.no_grad():
        out = reference.model(input_ids=ids, past_key_values=cache, use_cache=True)
        logits = [out.logits[:, -1]]
        for step, token in enumerate(result.tokens[0][: NEW_TOKENS - 1]):
            pos = torch.tensor([[T + step]])
            out = reference.model(input_ids=torch.tensor([[token]]), position_ids=pos, past_key_values=cache)
            logits.append(out.logits[:, -1])
    want = torch.stack(logits, 1)[0]
    torch.testing.assert_close(result.step_logits[0, : want.shape[0]], want, atol=1e-4, rtol=1e-4)
