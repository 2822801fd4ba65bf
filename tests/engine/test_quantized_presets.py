"""Every shipped eviction preset composed with each quantizer (``model.compression.quantize``).

For each preset (on its first tiny model) and each quantizer: the run keeps exactly the entries
the preset keeps without quantization (the quantizer only changes how they are stored), and every
sample's ``kv_bytes_kept`` (packed codes + scales / zero points or norms + the full-precision
residual) and the cache's allocated bytes fall (by how much on long prompts:
tests/cache/test_quantized_cache.py). Presets whose decode policy rewrites entries or
whose selector keeps K/V outside the cache, and the channel-pruned ``think``, are refused before
anything runs, naming the field.
"""

import functools

import pytest
import torch
from support.attention_variants import build, prompts, tokenizer
from support.e2e import kvlab_model, run
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

PRESETS = [name for name in preset_names() if preset_config(name)["model"].get("compression")]
QUANTIZERS = {
    "kivi2": {"name": "kivi", "bits": 2, "group": 8, "residual": 8},
    "int4": {"name": "per_token", "bits": 4, "group": 16},
    "turbo3": {"name": "turboquant", "bits": 3, "residual": 4},
}
NEW_TOKENS = 3


@functools.cache
def plain_run(preset: str):
    model = preset_models(preset)[0]
    loaded = kvlab_model(model)
    samples = preset_samples(loaded.info.vision_language)
    return run(loaded, Pipeline.from_config(budgeted_compression(preset, model)), samples, NEW_TOKENS)


def quantized(preset: str, quantizer: str) -> Pipeline:
    node = budgeted_compression(preset, preset_models(preset)[0])
    node["quantize"] = QUANTIZERS[quantizer]
    return Pipeline.from_config(node)


def refused_reason(preset: str) -> str | None:
    """Why ``preset`` cannot take a quantizer, read from its own pipeline (None: it can)."""
    pipeline = preset_pipeline(preset)
    reason = stored_form_refusal(pipeline)
    if reason is None and pipeline.channel_pruner is not None:
        return "do not compose"
    return reason


@pytest.mark.parametrize("quantizer", list(QUANTIZERS))
@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_runs_with_each_quantizer_keeping_the_same_entries_in_fewer_bytes(preset, quantizer):
    reason = refused_reason(preset)
    if reason is not None:
        with pytest.raises(ConfigError, match=f"model.compression.quantize.*{reason}"):
            quantized(preset, quantizer)
        return
    model = preset_models(preset)[0]
    loaded = kvlab_model(model)
    plain = plain_run(preset)
    result = run(
        loaded, quantized(preset, quantizer), preset_samples(loaded.info.vision_language), NEW_TOKENS
    )
    assert torch.equal(result.kept, plain.kept)
    assert torch.equal(result.kv_bytes_full, plain.kv_bytes_full)
    assert bool((result.kv_bytes_kept <= plain.kv_bytes_kept).all())
    assert int(result.kv_bytes_kept.sum()) < int(plain.kv_bytes_kept.sum())
    if not (preset_pipeline(preset).prefill_mode.question and quantizer == "kivi2"):
        # Finch prefills its question (28 tokens here) on top of ~20 kept entries per head, and
        # KIVI folds them into codes, growing its code buffers by capacity: on these tiny prompts
        # the allocation exceeds the unquantized run's (155 against 144 KB; kept bytes still fall)
        assert result.kv_bytes_allocated < plain.kv_bytes_allocated
    assert all(len(tokens) <= NEW_TOKENS for tokens in result.tokens)


def test_the_refused_presets_are_the_evicting_decode_policies_and_retrieval():
    refused = {preset: refused_reason(preset) for preset in PRESETS if refused_reason(preset)}
    assert refused.get("prefixkv") == "decode" and refused.get("retrieval") == "outside the cache"
    assert refused.get("hybridkv") == "outside the cache"  # a route branch retrieves
    assert "snapkv" not in refused and "lookm" not in refused  # merged entries are quantized


def test_int8_codes_stay_close_to_the_unquantized_run():
    """8-bit per-token codes change the logits of a compressed run by far less than their scale."""
    plain = plain_run("snapkv")
    loaded = kvlab_model(preset_models("snapkv")[0])
    node = budgeted_compression("snapkv", preset_models("snapkv")[0])
    node["quantize"] = {"name": "per_token", "bits": 8}
    result = run(loaded, Pipeline.from_config(node), preset_samples(False), NEW_TOKENS)
    assert result.tokens == plain.tokens
    scale = float(plain.step_logits.abs().max())
    assert float((result.step_logits - plain.step_logits).abs().max()) < 0.02 * scale


@pytest.mark.parametrize("protocol", ["query_agnostic", "multi_question"])
def test_context_protocols_keep_the_same_entries_and_charge_the_codes(protocol):
    """A compressed, quantized context answers questions appended in full precision; each sample is
    charged its context's codes and residual plus its question's entries."""
    loaded = kvlab_model("tiny-qwen2")
    batch = loaded.processor.collate(list(QUESTIONS))
    node = budgeted_compression("snapkv", "tiny-qwen2", tokens=24, window=4)
    plain = (
        build_protocol(protocol)
        .run(loaded, Pipeline.from_config(node), batch, RunOptions(max_new_tokens=3))
        .result
    )
    node["quantize"] = {"name": "kivi", "bits": 2, "group": 4, "residual": 4}
    packed = (
        build_protocol(protocol)
        .run(loaded, Pipeline.from_config(node), batch, RunOptions(max_new_tokens=3))
        .result
    )
    assert torch.equal(packed.kept, plain.kept)
    assert bool((packed.kv_bytes_kept < plain.kv_bytes_kept).all())


def test_decode_time_compression_refuses_a_quantizer():
    node = budgeted_compression("snapkv", "tiny-qwen2", tokens=24, window=4)
    node["quantize"] = {"name": "kivi"}
    with pytest.raises(ConfigError, match="model.compression.quantize"):
        build_protocol({"name": "decode_time", "target_size": 16}).check(Pipeline.from_config(node))


@pytest.mark.parametrize("family", ["gemma2", "gemma3-text"])
def test_sliding_window_layers_attend_their_window_over_the_codes(family):
    """Sliding-window layers (and Gemma 2's soft-capping) read the dequantized entries with their
    window mask: 8-bit codes keep the unquantized run's entries and, nearly, its logits."""
    node = {"budget": {"tokens": 8, "window": 2}, "importance": {"attention": {"name": "window_attention"}}}
    loaded = kvlab.wrap_model(build(family), tokenizer(), name=family)
    batch = collate_ids(loaded, prompts())
    plain = generate(
        loaded, Pipeline.from_config(node), batch, RunOptions(max_new_tokens=3, return_logits=True)
    )
    node["quantize"] = {"name": "per_token", "bits": 8, "group": 8}
    packed = generate(
        loaded, Pipeline.from_config(node), batch, RunOptions(max_new_tokens=3, return_logits=True)
    )
    assert torch.equal(packed.kept, plain.kept)
    assert bool((packed.kv_bytes_kept < plain.kv_bytes_kept).all())
    difference = float((packed.step_logits - plain.step_logits).abs().max())
    assert 0 < difference < 0.02 * float(plain.step_logits.abs().max())
