"""``model.prefill_chunk``: the prompt prefilled in chunks gives what one forward gives.

Chunks of a padded batch on tiny-qwen2 keep the same positions and generate the same tokens as
one forward for SnapKV, AdaKV and MixKV-SnapKV (chunks shorter than the observed window
included: the window's queries are held across chunks); sliding-window, soft-capped and sink
layers give transformers' logits chunk by chunk. What cannot run chunked (H2O's and LOOK-M's
accumulated attention, an undeclared plugin scorer, a vision-language model) is refused with a
ConfigError naming ``model.prefill_chunk``, before the model loads where the config tells.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from support import e2e

import kvlab
from kvlab.compression.importance import IMPORTANCE, ImportanceScorer
from kvlab.config.capabilities import Capabilities
from kvlab.config.errors import ConfigError
from kvlab.data.synthetic import SyntheticRetrieval
from kvlab.engine.generation import RunOptions, generate, prefill
from kvlab.engine.prefill_plan import check_prefill_chunk
from kvlab.models.base import Batch
from kvlab.pipeline import Pipeline
from kvlab.runner.module import KVLabModule

STEPS = 4


@functools.cache
def padded_batch() -> Batch:
    """A 60-word and a 35-word retrieval prompt: 283 and 215 tokens, left padded."""
    items = SyntheticRetrieval(num_samples=1, context_words=60, seed=1).samples()
    items += SyntheticRetrieval(num_samples=1, context_words=35, seed=5).samples()
    return e2e.kvlab_model("tiny-qwen2").processor.collate(items)


def kept_positions(result) -> list:
    return [(r.selection.indices.tolist(), r.selection.counts.tolist()) for r in result.reports]


CASES = [("snapkv", 20), ("snapkv", 100), ("adakv", 20), ("mixkv_snapkv", 20)]


@pytest.mark.parametrize("preset, chunk", CASES)
def test_chunked_prefill_keeps_and_generates_what_one_forward_does(preset, chunk):
    """Chunk 20 < window 32: the window's queries come from two chunks; the shorter prompt's first
    chunks are padding only."""
    loaded = e2e.kvlab_model("tiny-qwen2")
    pipeline = kvlab.load_pipeline(preset, {"budget.tokens": 48})  # window 32: observed and protected
    check_prefill_chunk(pipeline, chunk)
    batch = padded_batch()
    whole = generate(loaded, pipeline, batch, RunOptions(max_new_tokens=STEPS, return_logits=True))
    assert int(whole.kept.max()) < int(whole.prompt_lengths.min())  # a real eviction
    chunked = generate(
        loaded, pipeline, batch, RunOptions(max_new_tokens=STEPS, return_logits=True, prefill_chunk=chunk)
    )
    assert kept_positions(chunked) == kept_positions(whole)
    assert chunked.tokens == whole.tokens
    torch.testing.assert_close(chunked.step_logits, whole.step_logits, atol=1e-4, rtol=1e-4)


def test_chunks_reach_every_layer_and_only_the_last_one_compresses(monkeypatch):
    """The forwards are the chunks (input ids of N tokens, positions continuing), and the context
    that compresses holds the window's queries and the last chunk's."""
    loaded = e2e.kvlab_model("tiny-qwen2")
    batch = padded_batch()
    seen, contexts = [], []
    forward = loaded.model.forward
    monkeypatch.setattr(
        loaded.model, "forward", lambda **kw: seen.append(kw["input_ids"].shape[1]) or forward(**kw)
    )
    pipeline = kvlab.load_pipeline("snapkv")
    compress = pipeline.compress  # the engine hands each layer's context to the pipeline

    def compressing(ctx, **kwargs):
        contexts.append(ctx.queries.shape[2])
        return compress(ctx, **kwargs)

    monkeypatch.setattr(pipeline, "compress", compressing)
    state = prefill(loaded, pipeline, batch, options=RunOptions(prefill_chunk=100))
    assert seen == [100, 100, 83] and contexts == [32 + 83] * loaded.info.num_layers
    assert state.next_positions.flatten().tolist() == batch.attention_mask.sum(-1).tolist()


@pytest.mark.parametrize("name", ["mistral-sliding", "gemma2", "gpt-oss-sinks"])
def test_chunked_prefill_of_windowed_softcapped_and_sink_layers_matches_transformers(name):
    from support.attention_variants import STEPS as VARIANT_STEPS
    from support.attention_variants import build, prompts, tokenizer

    from kvlab.models.prompts import collate_ids

    model = build(name)
    rows = prompts()  # 23, 17 and 9 tokens: chunks of 4 leave the shortest padding-only chunks
    wanted = {}
    with torch.no_grad():
        for b in (0, 2):
            out = model.generate(
                input_ids=torch.tensor([rows[b]]), max_new_tokens=VARIANT_STEPS, do_sample=False,
                output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
            wanted[b] = torch.stack(out.logits, 1)[0].float()
    loaded = kvlab.wrap_model(model, tokenizer(), name=name)  # from here on, kvlab's attention
    full = Pipeline.from_config(None)
    ours = generate(
        loaded,
        full,
        collate_ids(loaded, rows),
        RunOptions(max_new_tokens=VARIANT_STEPS, return_logits=True, prefill_chunk=4),
    )
    for b, logits in wanted.items():
        torch.testing.assert_close(ours.step_logits[b], logits, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# refusals


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if a model starts loading."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the config error")

    monkeypatch.setattr("kvlab.runner.module.load_model", refuse)


@pytest.mark.parametrize("preset, field", [("h2o", "importance.attention"), ("lookm", "importance.attention"),
                                           ("david_h2o", "importance.attention")])  # fmt: skip
def test_methods_needing_every_query_are_refused_before_the_model_loads(preset, field, no_model_load):
    with pytest.raises(ConfigError) as error:
        KVLabModule(model="tiny-qwen2", compression=kvlab.compression_config(preset), prefill_chunk=64)
    message = str(error.value)
    assert "model.prefill_chunk = 64" in message and f"model.compression.{field}" in message
    assert "every prompt query" in message and "docs/scaling.md" in message


def test_h2o_decode_policy_after_a_window_scorer_is_refused(no_model_load):
    """The h2o decode policy is seeded with every prompt query's attention, whatever scored the prompt."""
    node = kvlab.compression_config("snapkv", decode={"name": "h2o"})
    with pytest.raises(ConfigError) as error:
        KVLabModule(model="tiny-qwen2", compression=node, prefill_chunk=64)
    assert "model.compression.decode (h2o)" in str(error.value) and "every prompt query" in str(error.value)


@pytest.mark.parametrize("value", [0, -3, True, 2.5, "64"])
def test_bad_prefill_chunk_values_are_refused(value, no_model_load):
    with pytest.raises(ConfigError, match="model.prefill_chunk must be null"):
        KVLabModule(model="tiny-qwen2", compression=kvlab.compression_config("snapkv"), prefill_chunk=value)


def test_a_scorer_that_does_not_declare_chunked_prefill_is_refused():
    @dataclass
    class Undeclared(ImportanceScorer):
        def score(self, ctx):
            return ctx.keys.float().norm(dim=-1)

    @dataclass
    class Declared(Undeclared):
        capabilities: ClassVar[Capabilities] = Capabilities(chunked_prefill=True)

    IMPORTANCE.register("test_undeclared")(Undeclared)
    IMPORTANCE.register("test_declared")(Declared)
    try:
        budget = {"tokens": 16, "window": 4}
        node = {"budget": budget, "importance": {"mine": {"name": "test_undeclared"}}}
        with pytest.raises(ConfigError, match="model.compression.importance.mine .*does not declare"):
            check_prefill_chunk(Pipeline.from_config(node), 8)
        declared = {"budget": budget, "importance": {"mine": "test_declared"}}
        check_prefill_chunk(Pipeline.from_config(declared), 8)
        check_prefill_chunk(Pipeline.from_config(node), None)  # one forward: anything goes
    finally:
        for name in ("test_undeclared", "test_declared"):
            IMPORTANCE.unregister(name)


def test_vision_language_models_are_refused():
    loaded = e2e.kvlab_model("tiny-qwen2-vl")
    batch = loaded.processor.collate(SyntheticRetrieval(num_samples=1, context_words=10, seed=2).samples())
    with pytest.raises(ConfigError, match="model.prefill_chunk = 8: model .* is a vision-language model"):
        prefill(loaded, kvlab.load_pipeline("snapkv"), batch, options=RunOptions(prefill_chunk=8))
    module = KVLabModule(
        model="tiny-qwen2-vl", compression=kvlab.compression_config("snapkv"), prefill_chunk=8
    )
    with pytest.raises(ConfigError, match="is a vision-language model"):
        module.configure_model()  # when the model loads, before any batch


def test_the_python_api_passes_prefill_chunk_through():
    loaded = e2e.kvlab_model("tiny-qwen2")
    prompt = padded_batch().input_ids[0].tolist()
    [whole] = kvlab.compress_and_generate(loaded, "snapkv", [prompt], max_new_tokens=STEPS)
    [chunked] = kvlab.compress_and_generate(
        loaded, "snapkv", [prompt], max_new_tokens=STEPS, prefill_chunk=64
    )
    assert chunked.token_ids == whole.token_ids and chunked.kept_positions == whole.kept_positions
    with pytest.raises(ConfigError, match="prefill_chunk"):
        kvlab.compress_and_generate(loaded, "h2o", [prompt], prefill_chunk=50)
