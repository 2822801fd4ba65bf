"""Every shipped eviction preset composed with each channel pruner (``model.compression.channels``).

For each preset (on its first tiny model) and each pruner: the run keeps exactly the entries the
preset keeps without pruning (the pruner only changes how the kept keys are stored), the prefill's
own output (the first generated position's logits) is the same, and every sample's
``kv_bytes_kept`` and the cache's allocated bytes fall by the pruned channels. Presets whose decode
policy rewrites entries, whose selector keeps K/V outside the cache or whose prefill is progressive
are refused before anything runs, naming the field. The ``think`` preset: a padded batch equals its
samples alone; ThinK over the context protocols and over sliding-window layers.
"""

import functools

import pytest
import torch
from support.attention_variants import build, prompts, tokenizer
from support.e2e import assert_batch_equals_alone, kvlab_model, run
from support.preset_runs import preset_models, preset_pipeline, preset_samples, stored_form_refusal
from support.presets import budgeted_compression, preset_config
from support.questions import QUESTIONS

import kvlab
from kvlab.config.errors import ConfigError
from kvlab.config.loader import preset_names
from kvlab.engine.generation import RunOptions, generate
from kvlab.engine.protocols import build_protocol
from kvlab.models.prompts import collate_ids
from kvlab.pipeline import Pipeline

PRESETS = [
    name
    for name in preset_names()
    if preset_config(name)["model"].get("compression")
    and "channels" not in preset_config(name)["model"]["compression"]
]
PRUNERS = {"think": {"name": "think", "keep": 0.5}, "key_magnitude": {"name": "key_magnitude", "keep": 0.25}}
NEW_TOKENS = 3


@functools.cache
def plain_run(preset: str):
    model = preset_models(preset)[0]
    loaded = kvlab_model(model)
    samples = preset_samples(loaded.info.vision_language)
    options = RunOptions(max_new_tokens=NEW_TOKENS, return_logits=True)
    node = budgeted_compression(preset, model)
    return generate(loaded, Pipeline.from_config(node), loaded.processor.collate(samples), options)


def pruned_node(preset: str, pruner: str) -> dict:
    node = budgeted_compression(preset, preset_models(preset)[0])
    node["channels"] = dict(PRUNERS[pruner])
    return node


def refused_reason(preset: str) -> str | None:
    """Why ``preset`` cannot take a channel pruner, read from its own pipeline (None: it can)."""
    pipeline = preset_pipeline(preset)
    reason = stored_form_refusal(pipeline)
    if reason is None and pipeline.prefill_mode.progressive:
        return "progressive"
    return reason


@pytest.mark.parametrize("pruner", list(PRUNERS))
@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_runs_with_each_pruner_keeping_the_same_entries_in_fewer_bytes(preset, pruner):
    reason = refused_reason(preset)
    if reason is not None:
        with pytest.raises(ConfigError, match=f"model.compression.channels.*{reason}"):
            Pipeline.from_config(pruned_node(preset, pruner))
        return
    model = preset_models(preset)[0]
    loaded = kvlab_model(model)
    plain = plain_run(preset)
    options = RunOptions(max_new_tokens=NEW_TOKENS, return_logits=True)
    batch = loaded.processor.collate(preset_samples(loaded.info.vision_language))
    result = generate(loaded, Pipeline.from_config(pruned_node(preset, pruner)), batch, options)
    assert torch.equal(result.kept, plain.kept)
    assert torch.equal(result.step_logits[:, 0], plain.step_logits[:, 0])  # the prefill is not pruned
    assert torch.equal(result.kv_bytes_full, plain.kv_bytes_full)
    assert bool((result.kv_bytes_kept < plain.kv_bytes_kept).all())
    assert result.kv_bytes_allocated < plain.kv_bytes_allocated
    # every kept entry saves the pruned key channels; each (layer, sample, head) stores its channel index
    info = loaded.info
    channels = max(1, -(-int(PRUNERS[pruner]["keep"] * info.head_dim * 1e6) // 10**6))
    index = info.num_layers * info.num_kv_heads * channels * 8
    saved = result.kept.sum((0, 2)) * (info.head_dim - channels) * 4 - index
    assert torch.equal(plain.kv_bytes_kept - result.kv_bytes_kept, saved)
    assert bool(torch.isfinite(result.step_logits).all())


def test_the_refused_presets_are_the_evicting_decode_policies_retrieval_and_finch():
    refused = {preset: refused_reason(preset) for preset in PRESETS if refused_reason(preset)}
    assert refused.get("tova") == "decode" and refused.get("retrieval") == "outside the cache"
    assert refused.get("finch") == "progressive" and refused.get("quest") == "outside the cache"
    assert "snapkv" not in refused and "lookm" not in refused  # merged keys are pruned


def test_think_preset_batched_equals_alone():
    loaded = kvlab_model("tiny-qwen2")
    node = budgeted_compression("think", "tiny-qwen2", tokens=24, window=4)
    assert_batch_equals_alone(loaded, Pipeline.from_config(node), preset_samples(False), NEW_TOKENS)


def test_keeping_every_channel_gives_the_unpruned_run():
    loaded = kvlab_model("tiny-qwen2")
    node = budgeted_compression("snapkv", "tiny-qwen2", tokens=24, window=4)
    plain = run(loaded, Pipeline.from_config(node), preset_samples(False), NEW_TOKENS)
    node["channels"] = {"name": "think", "keep": 1.0}
    whole = run(loaded, Pipeline.from_config(node), preset_samples(False), NEW_TOKENS)
    assert whole.tokens == plain.tokens
    torch.testing.assert_close(whole.step_logits, plain.step_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("protocol", ["query_agnostic", "multi_question"])
def test_context_protocols_prune_the_context_and_append_questions_whole(protocol):
    loaded = kvlab_model("tiny-qwen2")
    batch = loaded.processor.collate(list(QUESTIONS))
    node = budgeted_compression("snapkv", "tiny-qwen2", tokens=24, window=4)
    plain = build_protocol(protocol).run(
        loaded, Pipeline.from_config(node), batch, RunOptions(max_new_tokens=3)
    )
    node["channels"] = {"name": "think", "keep": 0.5}
    pruned = build_protocol(protocol).run(
        loaded, Pipeline.from_config(node), batch, RunOptions(max_new_tokens=3)
    )
    assert torch.equal(pruned.result.kept, plain.result.kept)
    assert bool((pruned.result.kv_bytes_kept < plain.result.kv_bytes_kept).all())


@pytest.mark.parametrize("family", ["gemma2", "gemma3-text"])
def test_sliding_window_layers_attend_their_window_over_the_pruned_keys(family):
    """Sliding-window layers (and Gemma 2's soft-capping) read the pruned keys through the masked
    path with their window; keeping every channel gives the unpruned logits."""
    node = {"budget": {"tokens": 8, "window": 2}, "importance": {"attention": {"name": "window_attention"}}}
    loaded = kvlab.wrap_model(build(family), tokenizer(), name=family)
    batch = collate_ids(loaded, prompts())
    options = RunOptions(max_new_tokens=3, return_logits=True)
    plain = generate(loaded, Pipeline.from_config(node), batch, options)
    results = {}
    for keep in (1.0, 0.5):
        node["channels"] = {"name": "think", "keep": keep}
        results[keep] = generate(loaded, Pipeline.from_config(node), batch, options)
        assert torch.equal(results[keep].kept, plain.kept)
    torch.testing.assert_close(results[1.0].step_logits, plain.step_logits, atol=1e-5, rtol=1e-5)
    assert bool((results[0.5].kv_bytes_kept < plain.kv_bytes_kept).all())
    assert float((results[0.5].step_logits[:, 1:] - plain.step_logits[:, 1:]).abs().max()) > 0


@pytest.mark.parametrize("prefill", ["chunked", "global"])
def test_a_chunked_prefill_and_the_global_schedule_keep_the_same_channels(prefill):
    """ThinK reads only the budget window's queries, which a chunked prefill and ``schedule:
    global`` hold: the same kept entries and channels, the same outputs."""
    loaded = kvlab_model("tiny-qwen2")
    node = budgeted_compression("think", "tiny-qwen2", tokens=24, window=4)
    batch = loaded.processor.collate(preset_samples(False))
    options = RunOptions(max_new_tokens=NEW_TOKENS, return_logits=True)
    plain = generate(loaded, Pipeline.from_config(node), batch, options)
    if prefill == "chunked":
        options = RunOptions(max_new_tokens=NEW_TOKENS, return_logits=True, prefill_chunk=16)
    else:
        node["schedule"] = "global"
    other = generate(loaded, Pipeline.from_config(node), batch, options)
    assert torch.equal(other.kept, plain.kept) and other.tokens == plain.tokens
    torch.testing.assert_close(other.step_logits, plain.step_logits, atol=1e-4, rtol=1e-4)
