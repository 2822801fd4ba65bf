"""Vision-language models: only the language model is compressed, positions stay right, batches
with different image counts equal their samples one by one."""

import pytest
import torch
from support import e2e
from support.e2e import kvlab_model
from support.preset_runs import VLM_MODELS

from kvlab.config.loader import merge, resolve
from kvlab.data.synthetic import SyntheticImageQA, SyntheticRetrieval
from kvlab.models import load_model
from kvlab.models.base import IMAGE
from kvlab.pipeline import Pipeline

VLMS = list(VLM_MODELS)
BUDGET = 40  # below every mixed sample's prompt length


def snapkv(tokens: int = BUDGET) -> dict:
    """The shipped SnapKV preset's compression with a token budget of ``tokens``."""
    node = resolve(["snapkv"], [])["model"]["compression"]
    return {**node, "budget": merge(node["budget"], {"tokens": tokens})}


SNAP = snapkv()


def mixed_samples():
    """One sample with two images, one with one image, one text-only; all different lengths."""
    two = SyntheticImageQA(num_samples=1, images_per_sample=2, seed=3).samples()
    one = SyntheticImageQA(num_samples=1, images_per_sample=1, seed=4).samples()
    text = SyntheticRetrieval(num_samples=1, context_words=30, seed=2).samples()
    return two + one + text


def run(loaded, config, items, steps=5):
    return e2e.run(loaded, Pipeline.from_config(config), items, steps)


@pytest.mark.parametrize("name", VLMS)
def test_full_cache_matches_transformers_generate(name):
    loaded = kvlab_model(name)
    item = mixed_samples()[:1]
    batch = loaded.processor.collate(item)
    ours = run(loaded, None, item)
    reference = load_model(name)  # sdpa everywhere, transformers' own cache and positions
    out = reference.model.generate(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        **batch.model_inputs,
        max_new_tokens=5,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    want = torch.stack(out.logits, 1)[0].float()
    torch.testing.assert_close(ours.step_logits[0, : want.shape[0]], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", VLMS)
@pytest.mark.parametrize("config", [None, SNAP], ids=["full", "snapkv"])
def test_batch_with_different_image_counts_equals_one_by_one(name, config):
    loaded = kvlab_model(name)
    e2e.assert_batch_equals_alone(loaded, Pipeline.from_config(config), mixed_samples(), steps=5)


@pytest.mark.parametrize("name", VLMS)
def test_only_language_model_layers_are_compressed_and_image_tokens_found(name):
    loaded = kvlab_model(name)
    items = mixed_samples()
    batch = loaded.processor.collate(items)
    image_id = loaded.info.image_token_ids[0]
    assert torch.equal(batch.modality == IMAGE, batch.input_ids == image_id)
    per_image = loaded.tokens_per_image
    assert (batch.modality == IMAGE).sum(-1).tolist() == [2 * per_image, per_image, 0]
    result = run(loaded, SNAP, items)
    assert result.kept.shape == (loaded.info.num_layers, 3, loaded.info.num_kv_heads)
    assert bool(
        (result.kept == torch.minimum(result.prompt_lengths, torch.tensor(BUDGET))[None, :, None]).all()
    )


@pytest.mark.parametrize("name", VLMS)
def test_budget_at_least_the_prompt_is_identical_to_full(name):
    loaded = kvlab_model(name)
    items = mixed_samples()
    full = run(loaded, None, items)
    big = run(loaded, snapkv(int(full.prompt_lengths.max())), items)
    assert big.tokens == full.tokens
    assert torch.equal(big.step_logits, full.step_logits)
