"""Helpers shared by the end-to-end generation tests: cached models and batched-vs-alone checks."""

import functools

import torch

from kvlab.engine.generation import GenerationResult, RunOptions, generate
from kvlab.engine.protocols import build_protocol
from kvlab.engine.registration import enable_kvlab_attention
from kvlab.models import load_model
from kvlab.pipeline import Pipeline


@functools.cache
def kvlab_model(name):
    """A built-in model with its language model routed through kvlab attention (loaded once)."""
    loaded = load_model(name)
    enable_kvlab_attention(loaded.model, loaded.info.vision_language)
    return loaded


def run(loaded, pipeline: Pipeline, items, steps: int) -> GenerationResult:
    """Greedy-generate ``steps`` tokens for ``items`` in one padded batch, keeping the logits; a
    pipeline scoring with the question (Finch) runs through ``query_aware``, which splits the prompts."""
    batch = loaded.processor.collate(list(items))
    options = RunOptions(max_new_tokens=steps, return_logits=True)
    if pipeline.prefill_mode.question:
        return build_protocol("query_aware").run(loaded, pipeline, batch, options).result
    return generate(loaded, pipeline, batch, options)


def assert_batch_equals_alone(loaded, pipeline: Pipeline, items, steps: int) -> None:
    """A padded batch gives each sample the tokens, logits and kept counts it gets alone."""
    batched = run(loaded, pipeline, items, steps)
    for b, item in enumerate(items):
        alone = run(loaded, pipeline, [item], steps)
        assert batched.tokens[b] == alone.tokens[0]
        torch.testing.assert_close(batched.step_logits[b], alone.step_logits[0], atol=1e-4, rtol=1e-4)
        assert torch.equal(batched.kept[:, b], alone.kept[:, 0])
