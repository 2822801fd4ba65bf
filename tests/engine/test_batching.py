"""A padded batch gives every sample exactly what it gets alone, for every shipped preset.

Parametrised over ``preset_names()`` (a new preset is covered without being listed): text presets
on both tiny text models with two prompts of different lengths, VLM presets on both tiny VLMs with
one batch holding a two-image, a one-image and a text-only sample. Per sample: the same generated
tokens, logits within 1e-4, and in every layer the same kept positions per KV head (the batch's
positions shifted by the sample's left padding), not only the same counts.
"""

import functools
import tempfile

import pytest
import torch
from support import e2e
from support.preset_runs import TOKEN_BUDGET, preset_compression, preset_models, preset_samples
from support.presets import preset_config

from kvlab.calibration.synthetic import synthetic_visual_heads
from kvlab.config.loader import preset_names
from kvlab.data.synthetic import SyntheticRetrieval
from kvlab.pipeline import Pipeline

NEW_TOKENS = 4
CASES = [(preset, model) for preset in preset_names() for model in preset_models(preset)]


@functools.cache
def visual_heads(info) -> str:
    """A seeded visual-head artefact for a tiny model (SparseMM presets), written once per model."""
    return synthetic_visual_heads(info, tempfile.mkdtemp(prefix="kvlab-vh-"))


@functools.cache
def batch_items(vlm: bool) -> tuple:
    """VLM: two images, one image, no image. Text: a 60-word and a 35-word prompt (padding differs)."""
    if vlm:
        return tuple(preset_samples(vlm=True))
    longer = SyntheticRetrieval(num_samples=1, context_words=60, seed=1).samples()
    return tuple(longer + SyntheticRetrieval(num_samples=1, context_words=35, seed=5).samples())


def kept_positions(result, b: int, pad: int) -> list[list[list[int]]]:
    """``[layer][head]`` kept prompt positions of sample ``b``, counted from its first valid token."""
    return [
        [[p - pad for p in report.selection.kept_positions(b, h)] for h in range(report.kept.shape[1])]
        for report in result.reports
        if report.selection is not None
    ]


@pytest.mark.parametrize("preset, model", CASES)
def test_padded_batch_equals_each_sample_alone(preset, model):
    loaded = e2e.kvlab_model(model)
    compresses = bool(preset_config(preset)["model"].get("compression"))
    node = preset_compression(preset, model, visual_heads) if compresses else None
    pipeline = Pipeline.from_config(node)
    items = batch_items(loaded.info.vision_language)
    if loaded.info.vision_language:
        assert sorted(len(item.images) for item in items) == [0, 1, 2]
    batched = e2e.run(loaded, pipeline, items, NEW_TOKENS)
    T = int(loaded.processor.collate(list(items)).input_ids.shape[1])
    evicted = False
    for b, item in enumerate(items):
        alone = e2e.run(loaded, pipeline, [item], NEW_TOKENS)
        length = int(alone.prompt_lengths[0])
        assert int(batched.prompt_lengths[b]) == length
        assert batched.tokens[b] == alone.tokens[0]
        torch.testing.assert_close(batched.step_logits[b], alone.step_logits[0], atol=1e-4, rtol=1e-4)
        assert torch.equal(batched.kept[:, b], alone.kept[:, 0])
        assert kept_positions(batched, b, T - length) == kept_positions(alone, 0, 0)
        evicted |= bool((alone.kept < length).any())
    # a compressing preset evicts on these prompts, so the positions compared are a real choice
    assert evicted == compresses or TOKEN_BUDGET >= T
