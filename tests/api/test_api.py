"""The public Python API, used the way a user script would: ``import kvlab`` and its public names only.

Tiny built-in models (random weights, no download); budgets are set through preset overrides.
"""

import copy
import functools

import pytest
import torch
from PIL import Image

import kvlab

LONG = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. " * 3
SHORT = "Name a color that you like, and tell me why."  # 35 tokens: above the 32-token window, below BUDGET
BUDGET = 40  # tokens per head, the preset's 32-token window included


@functools.cache
def model(name):
    return kvlab.load_model(name)


def snapkv(tokens=BUDGET):
    return kvlab.load_pipeline("snapkv", {"budget": {"tokens": tokens}})


def same(a, b):
    """Two outputs of the same prompt agree on everything but the timings."""
    assert a.token_ids == b.token_ids and a.text == b.text
    assert a.prompt_ids == b.prompt_ids and a.modality == b.modality
    assert torch.equal(a.kept, b.kept) and a.kept_positions == b.kept_positions
    assert (a.kv_bytes_kept, a.kv_bytes_full, a.layer_budgets) == (
        b.kv_bytes_kept,
        b.kv_bytes_full,
        b.layer_budgets,
    )


# ---- pipelines -------------------------------------------------------------------------------
def test_every_public_name_resolves_and_unknown_names_raise():
    for name in kvlab.__all__:
        assert getattr(kvlab, name) is not None
    assert "snapkv" in kvlab.presets() and "full" in kvlab.presets()
    with pytest.raises(AttributeError):
        kvlab.not_a_name  # noqa: B018


def test_preset_with_overrides_builds_in_every_form(tmp_path):
    expected = kvlab.compression_config("snapkv", {"budget.tokens": 48})
    assert expected["budget"] == {"tokens": 48, "window": 32}  # siblings kept
    run_config = tmp_path / "run.yaml"
    run_config.write_text("preset: snapkv\nmodel:\n  compression:\n    budget: {tokens: 48}\n")
    bare = tmp_path / "bare.yaml"
    bare.write_text("preset: snapkv\nbudget: {tokens: 48}\n")
    forms = [
        kvlab.compression_config("snapkv", {"budget": {"tokens": 48}}),
        kvlab.compression_config("snapkv", {"model.compression.budget.tokens": 48}),
        kvlab.compression_config("snapkv.yaml", budget={"tokens": 48}),
        kvlab.compression_config({"preset": "snapkv", "budget": {"tokens": 48}}),
        kvlab.compression_config({"preset": "snapkv", "model": {"compression": {"budget": {"tokens": 48}}}}),
        kvlab.compression_config(str(run_config)),
        kvlab.compression_config(bare),
        kvlab.compression_config(kvlab.compression_config("snapkv"), {"budget.tokens": 48}),
    ]
    for form in forms:
        assert form == expected
    assert kvlab.compression_config("snapkv", {"budget.ratio": 0.2})["budget"] == {"ratio": 0.2, "window": 32}
    assert kvlab.compression_config(None) == {} and kvlab.compression_config("full") == {}
    assert isinstance(kvlab.load_pipeline("snapkv", {"budget.tokens": 48}), kvlab.Pipeline)


@pytest.mark.parametrize(
    ("source", "overrides", "named"),
    [
        ("snapkv", {"budget.tokenz": 64}, "tokenz"),
        ("snapkv", {"budgett": {"tokens": 64}}, "budgett"),
        ("snapkv", {"budget.tokens": 8}, "window"),  # below the protected window
        ("snapkvv", {}, "snapkvv"),
        (42, {}, "preset name"),
        ("snapkv", {3: 1}, "dotted"),
    ],
)
def test_bad_input_is_a_config_error_naming_the_field(source, overrides, named):
    with pytest.raises(kvlab.ConfigError, match=named):
        kvlab.load_pipeline(source, overrides)


# ---- running ---------------------------------------------------------------------------------
def test_budget_at_least_the_prompt_equals_the_full_cache():
    loaded = model("tiny-qwen2")
    full = kvlab.compress_and_generate(loaded, kvlab.load_pipeline("full"), [LONG, SHORT], max_new_tokens=6)
    big = kvlab.compress_and_generate(loaded, snapkv(4096), [LONG, SHORT], max_new_tokens=6)
    for a, b in zip(full, big, strict=True):
        assert a.token_ids == b.token_ids and a.text == b.text
        assert a.kept_positions == b.kept_positions
        assert a.kept_positions[0][0] == list(range(a.prompt_tokens))
        assert bool((b.kept == b.prompt_tokens).all()) and b.kv_ratio == 1.0


def test_kept_counts_equal_the_budget_and_batch_equals_alone():
    loaded = model("tiny-qwen2")
    outputs = kvlab.compress_and_generate(loaded, snapkv(), [LONG, SHORT], max_new_tokens=6)
    long, short = outputs
    L, H = long.kept.shape
    assert (L, H) == (3, 2)  # tiny-qwen2: 3 layers, 2 KV heads
    assert long.prompt_tokens > BUDGET and bool((long.kept == BUDGET).all())
    assert long.layer_budgets == [BUDGET] * L
    window = list(range(long.prompt_tokens - 32, long.prompt_tokens))
    for heads in long.kept_positions:
        for positions in heads:
            assert len(positions) == BUDGET and positions == sorted(set(positions))
            assert positions[-32:] == window and positions[0] >= 0
    assert torch.equal(long.kept_mask().sum(-1), long.kept)
    assert long.kv_bytes_kept * long.prompt_tokens == long.kv_bytes_full * BUDGET
    assert long.kv_ratio == pytest.approx(BUDGET / long.prompt_tokens)
    assert short.prompt_tokens < BUDGET and bool((short.kept == short.prompt_tokens).all())
    assert set(long.costs) >= {"prompt_tokens", "kv_ratio", "prefill_seconds", "decode_seconds"}
    assert long.decode_seconds > 0 and long.compression_seconds > 0
    for prompt, batched in zip([LONG, SHORT], outputs, strict=True):
        [alone] = kvlab.compress_and_generate(loaded, snapkv(), prompt, max_new_tokens=6)
        same(batched, alone)
    small_batches = kvlab.compress_and_generate(
        loaded, snapkv(), [LONG, SHORT], max_new_tokens=6, batch_size=1
    )
    for a, b in zip(outputs, small_batches, strict=True):
        same(a, b)


def test_chat_messages_and_token_ids():
    loaded = model("tiny-qwen2")
    pipeline = snapkv()
    [text] = kvlab.compress_and_generate(loaded, pipeline, [LONG], max_new_tokens=5)
    chat = [{"role": "user", "content": LONG}]
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": LONG},
        {"role": "assistant", "content": "A fox."},
        {"role": "user", "content": SHORT},
    ]
    outputs = kvlab.compress_and_generate(
        loaded,
        pipeline,
        [chat, text.prompt_ids, torch.tensor(text.prompt_ids), conversation],
        max_new_tokens=5,
    )
    for out in outputs[:3]:
        same(out, text)
    assert outputs[1].prompt == text.prompt_ids  # in order, prompt kept as given
    multi = outputs[3]
    assert multi.prompt_tokens > text.prompt_tokens and bool((multi.kept == BUDGET).all())
    [again] = kvlab.compress_and_generate(loaded, pipeline, multi.prompt_ids, max_new_tokens=5)
    same(again, multi)
    [system] = kvlab.compress_and_generate(
        loaded, pipeline, [[{"role": "system", "content": "Be brief."}, *chat]], max_new_tokens=5
    )
    assert system.prompt_tokens > text.prompt_tokens
    assert system.prompt_ids[-text.prompt_tokens :] == text.prompt_ids  # the system turn comes first
    for bad in ([{"content": "no role"}], [[]], [3.5]):
        with pytest.raises(kvlab.ConfigError, match="prompts"):
            kvlab.compress_and_generate(loaded, pipeline, bad)
    with pytest.raises(kvlab.ConfigError, match="text-only"):
        kvlab.compress_and_generate(loaded, pipeline, [SHORT], images=[Image.new("RGB", (56, 56))])


def test_wrap_your_own_transformers_model():
    """A model built from a config (random init, then the built-in's weights) gives load_model's outputs."""
    from transformers import AutoModelForCausalLM

    reference = model("tiny-llama")
    mine = AutoModelForCausalLM.from_config(copy.deepcopy(reference.model.config), attn_implementation="sdpa")
    mine.load_state_dict(reference.model.state_dict())
    wrapped = kvlab.wrap_model(mine, reference.processor.tokenizer)
    assert (wrapped.info.num_layers, wrapped.info.num_kv_heads) == (2, 4)
    prompts = [LONG, [{"role": "user", "content": SHORT}]]
    ours = kvlab.compress_and_generate(wrapped, snapkv(), prompts, max_new_tokens=6)
    theirs = kvlab.compress_and_generate(reference, snapkv(), prompts, max_new_tokens=6)
    for a, b in zip(ours, theirs, strict=True):
        same(a, b)
    assert bool((ours[0].kept == BUDGET).all())
    with pytest.raises(kvlab.ConfigError, match="load_model"):
        kvlab.compress_and_generate(mine, snapkv(), [SHORT])


def test_a_chat_needs_a_template_and_a_string_without_one_goes_in_raw():
    """A tokenizer without a chat template: a string prompt is passed raw (tokenizer(prompt), no
    invented ChatML); a multi-turn chat cannot be passed raw and is refused."""
    reference = model("tiny-llama")
    tokenizer = copy.deepcopy(reference.processor.tokenizer)
    tokenizer.chat_template = None
    wrapped = kvlab.wrap_model(reference.model, tokenizer)
    [out] = kvlab.compress_and_generate(wrapped, None, [SHORT], max_new_tokens=2)
    assert out.prompt_ids == list(tokenizer(SHORT)["input_ids"])
    chat = [
        {"role": "user", "content": SHORT},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "y"},
    ]
    with pytest.raises(kvlab.ConfigError, match="needs a chat template"):
        kvlab.compress_and_generate(wrapped, None, [chat])


def image(seed):
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (56, 56, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def test_vlm_prompt_with_an_image():
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    loaded = model("tiny-qwen2-vl")
    pipeline = snapkv()
    prompts = [LONG, SHORT, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": SHORT}]]
    images = [image(0), None, [image(1), image(2)]]
    outputs = kvlab.compress_and_generate(loaded, pipeline, prompts, images=images, max_new_tokens=5)
    assert [out.modality.count(1) for out in outputs] == [4, 0, 8]  # 56x56 -> 4 image tokens each
    assert bool((outputs[0].kept == BUDGET).all())
    for prompt, imgs, batched in zip(prompts, images, outputs, strict=True):
        [alone] = kvlab.compress_and_generate(loaded, pipeline, [prompt], images=[imgs], max_new_tokens=5)
        same(batched, alone)

    mine = AutoModelForImageTextToText.from_config(
        copy.deepcopy(loaded.model.config), attn_implementation="sdpa"
    )
    mine.load_state_dict(loaded.model.state_dict())
    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56)
    wrapped = kvlab.wrap_model(mine, loaded.processor.tokenizer, processor)
    [ours] = kvlab.compress_and_generate(wrapped, pipeline, LONG, images=image(0), max_new_tokens=5)
    same(ours, outputs[0])
    with pytest.raises(kvlab.ConfigError, match="token ids"):
        kvlab.compress_and_generate(loaded, pipeline, [outputs[1].prompt_ids], images=[image(0)])
