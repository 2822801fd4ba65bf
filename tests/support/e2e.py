"""Helpers shared by the end-to-end generation tests: cached models and batched-vs-alone checks."""

import functools

import torch

from kvlab.engine.generation import GenerationResult, PrefillState, RunOptions, generate, prefill
from kvlab.engine.prompt_split import question_block, split_prompts
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
    """Greedy-generate ``steps`` tokens for ``items`` in one padded batch, keeping the logits
    (:func:`generate_batch`)."""
    batch = loaded.processor.collate(list(items))
    return generate_batch(loaded, pipeline, batch, RunOptions(max_new_tokens=steps, return_logits=True))


def generate_batch(loaded, pipeline: Pipeline, batch, options: RunOptions) -> GenerationResult:
    """``generate``; a pipeline scoring with the question (Finch) runs through ``query_aware``,
    which splits the prompts into context and question."""
    if pipeline.prefill_mode.question:
        return build_protocol("query_aware").run(loaded, pipeline, batch, options).result
    return generate(loaded, pipeline, batch, options)


def prefill_batch(loaded, pipeline: Pipeline, batch, decode_capacity: int) -> PrefillState:
    """``prefill``; a pipeline scoring with the question (Finch) prefills each sample's context with
    its question appended to every chunk for scoring, as ``query_aware`` does before it prefills
    the question itself (the decode steps that follow run the same code either way)."""
    if not pipeline.prefill_mode.question:
        return prefill(loaded, pipeline, batch, decode_capacity=decode_capacity)
    split = split_prompts(loaded.processor, batch, False)
    questions = question_block(split.questions, loaded.processor.pad_token_id)
    return prefill(loaded, pipeline, split.context, decode_capacity, questions=questions)


def assert_batch_equals_alone(loaded, pipeline: Pipeline, items, steps: int) -> None:
    """A padded batch gives each sample the tokens, logits and kept counts it gets alone."""
    batched = run(loaded, pipeline, items, steps)
    for b, item in enumerate(items):
        alone = run(loaded, pipeline, [item], steps)
        assert batched.tokens[b] == alone.tokens[0]
        torch.testing.assert_close(batched.step_logits[b], alone.step_logits[0], atol=1e-4, rtol=1e-4)
        assert torch.equal(batched.kept[:, b], alone.kept[:, 0])
