"""The model zoo: every supported family, as a tiny random-weight model saved to a directory and
loaded by path (``model.model: /path/to/dir``), runs exactly under kvlab.

Per family (one module-scoped fixture each): kvlab's full cache gives transformers' own logits
(``verify_engine``, the check every run does, and every teacher-forced step within 1e-4 in fp32),
a padded batch gives each sample what it gets alone, and ``snapkv``, ``adakv``, ``mixkv_snapkv``
(and for VLMs ``lookm`` and ``david``) run and keep exactly their budgets. Families kvlab cannot run
exactly are refused at load time with a ConfigError. ``docs/models.md`` lists the families.
"""

from __future__ import annotations

import importlib
import importlib.util
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from support import e2e

import kvlab
from kvlab.cache.masks import image_block_ids
from kvlab.cache.options import AttentionOptions
from kvlab.cache.state import RunState
from kvlab.compression.context import LayerContext
from kvlab.config.errors import ConfigError
from kvlab.data.sample import Sample
from kvlab.engine.generation import RunOptions, generate
from kvlab.engine.prefill_attention import prefill_attention
from kvlab.engine.verify import _native, verify_engine
from kvlab.models.base import IMAGE, TEXT, LoadedModel
from kvlab.models.common import seeded, text_config
from kvlab.models.info import model_info
from kvlab.models.scaffolding.tiny import TINY_TOKEN_IDS, text_dims
from kvlab.models.scaffolding.tokenizer import IMAGE_PLACEHOLDERS, tiny_tokenizer
from kvlab.pipeline import Pipeline

#: the sliding window of the windowed families: every zoo prompt is several windows long
WINDOW = 12
#: greedy steps compared with transformers, and generated in the batch checks
STEPS = 5
#: token budget of the preset runs (above the presets' 32-token windows, below every prompt)
BUDGET = 48
TEXT_PRESETS = ("snapkv", "adakv", "mixkv_snapkv")
VLM_PRESETS = (*TEXT_PRESETS, "lookm", "david")
SENTENCE = (
    "the quick brown fox jumps over a lazy dog while seven wizards judge boxing matches near an old "
    "stone bridge before the rain began and a quiet poet wrote about the river bank"
)
#: prompt words (the tiny BPE tokenizes most in one or two tokens)
WORDS = tuple(SENTENCE.split(" "))


# ---- the families --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Family:
    """A tiny random model of one family: ``save(path)`` writes model + tokenizer/processor there."""

    save: Callable[[Path], None]
    vision: bool = False


def _dims(drop: tuple[str, ...] = (), **changes: Any) -> dict[str, Any]:
    """Llama-style kwargs over the tiny BPE: 2 layers, hidden 64, 4 heads / 2 KV heads, head_dim 16,
    512 positions; ``changes`` set more, ``drop`` removes keys the family derives itself."""
    dims = {**text_dims(num_layers=2, num_heads=4, num_kv_heads=2), "max_position_embeddings": 512, **changes}
    return {k: v for k, v in dims.items() if k not in drop}


def _save_text(config_cls: str, drop: tuple[str, ...] = (), **changes: Any) -> Callable[[Path], None]:
    def save(path: Path) -> None:
        import transformers

        config = getattr(transformers, config_cls)(**_dims(drop, **changes))
        _save_model(config, "AutoModelForCausalLM", path)
        tiny_tokenizer().save_pretrained(path)

    return save


def _save_model(config: Any, auto_class: str, path: Path) -> None:
    """Seeded random weights (fp32) of ``config``'s model class under ``auto_class``, saved to ``path``."""
    import transformers

    with seeded(0), torch.no_grad():
        model = getattr(transformers, auto_class).from_config(config, dtype=torch.float32)
        # a matrix initialised to zeros (Gemma 3's image projection) would make every image token
        # the same, and the image checks would see nothing
        for parameter in model.parameters():
            if parameter.dim() >= 2 and not parameter.any():
                parameter.normal_(std=0.02)
    model.save_pretrained(path)


def _vlm_tokenizer(placeholder: str, extra_tokens: Sequence[str] = (), **named: str) -> Any:
    """The tiny BPE with a ChatML template writing ``placeholder`` per image, the family's named
    special tokens (``image_token="<image>"``, Gemma 3's ``boi_token``...) and its other tokens."""
    tokenizer = tiny_tokenizer(placeholder, named or None)
    if extra_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": list(extra_tokens)})
    return tokenizer


def _token_id(tokenizer: Any, token: str) -> int:
    return int(tokenizer.convert_tokens_to_ids(token))


def save_qwen2_vl(path: Path) -> None:
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    from kvlab.models.vlm import qwen2_vl_config

    config = qwen2_vl_config(_dims(), TINY_TOKEN_IDS, mrope_section=[2, 3, 3])
    _save_model(config, "AutoModelForImageTextToText", path)
    tiny_tokenizer(IMAGE_PLACEHOLDERS["qwen2_vl"]).save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=84 * 84).save_pretrained(path)


def save_qwen2_5_vl(path: Path) -> None:
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    text = _dims(drop=("head_dim",))
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [2, 3, 3]}
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[1],
        ),
        image_token_id=TINY_TOKEN_IDS["<|image_pad|>"],
        video_token_id=TINY_TOKEN_IDS["<|video_pad|>"],
        vision_start_token_id=TINY_TOKEN_IDS["<|vision_start|>"],
        vision_end_token_id=TINY_TOKEN_IDS["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    _save_model(config, "AutoModelForImageTextToText", path)
    tiny_tokenizer(IMAGE_PLACEHOLDERS["qwen2_vl"]).save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=84 * 84).save_pretrained(path)


def save_llava(path: Path) -> None:
    from transformers.models.llava import LlavaImageProcessorPil

    from kvlab.models.vlm import llava_config

    config = llava_config(_dims(), TINY_TOKEN_IDS, image_size=28)
    _save_model(config, "AutoModelForImageTextToText", path)
    tiny_tokenizer(IMAGE_PLACEHOLDERS["llava"]).save_pretrained(path)
    LlavaImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}).save_pretrained(
        path
    )


_CLIP = dict(
    model_type="clip_vision_model",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
    projection_dim=32,
)


def save_llava_next(path: Path) -> None:
    """LLaVA-NeXT: 28x28 base tiles, any-resolution grids up to 56x56 (a newline feature per row)."""
    from transformers import LlavaNextConfig, LlavaNextProcessor
    from transformers.models.llava_next import LlavaNextImageProcessorPil

    pinpoints = [[28, 56], [56, 28], [56, 56]]
    config = LlavaNextConfig(
        text_config={**_dims(), "model_type": "llama"},
        vision_config=_CLIP,
        image_token_index=TINY_TOKEN_IDS["<image>"],
        image_grid_pinpoints=pinpoints,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=True,
    )
    _save_model(config, "AutoModelForImageTextToText", path)
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}, image_grid_pinpoints=pinpoints
    )
    tokenizer = _vlm_tokenizer("<image>", image_token="<image>")
    LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS, which "default" drops
        chat_template=tokenizer.chat_template,
    ).save_pretrained(path)


_IDEFICS_TOKENS = [
    "<fake_token_around_image>",
    "<global-img>",
    "<end_of_utterance>",
    *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
]


#: Idefics3 / SmolVLM image processing: resized to 64 at most, split into 32x32 tiles
_IDEFICS_IMAGES = {"size": {"longest_edge": 64}, "max_image_size": {"longest_edge": 32}}


def _idefics_config(config_cls: Any, tokenizer: Any) -> Any:
    """A tiny Idefics3 / SmolVLM: SigLIP-style tower on 32x32 tiles of 8x8 patches, pixel shuffle by
    2 (4 tokens per tile), Llama language model."""
    return config_cls(
        text_config={**_dims(vocab_size=len(tokenizer)), "model_type": "llama"},
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        scale_factor=2,
        image_token_id=_token_id(tokenizer, "<image>"),
        pad_token_id=TINY_TOKEN_IDS["<|endoftext|>"],
        tie_word_embeddings=True,
    )


def _save_idefics(path: Path, family: str) -> None:
    """Idefics3 / SmolVLM: images split into tiles plus a global view, 4 tokens per tile."""
    import transformers

    tokenizer = _vlm_tokenizer("<image>", _IDEFICS_TOKENS, image_token="<image>")
    prefix = {"idefics3": "Idefics3", "smolvlm": "SmolVLM"}[family]
    config = _idefics_config(getattr(transformers, f"{prefix}Config"), tokenizer)
    _save_model(config, "AutoModelForImageTextToText", path)
    module = importlib.import_module(f"transformers.models.{family}")
    image_processor = getattr(module, f"{prefix}ImageProcessorPil")(**_IDEFICS_IMAGES)
    kwargs = {} if family == "idefics3" else {"video_processor": None}
    getattr(transformers, f"{prefix}Processor")(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=4,
        chat_template=tokenizer.chat_template,
        **kwargs,
    ).save_pretrained(path)


_GEMMA3_SPECIAL = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}


def save_gemma3_vision(path: Path) -> None:
    """Gemma 3 with images: SigLIP on 56x56 (4x4 patches) pooled to 4 soft tokens per image."""
    from transformers import Gemma3Config, Gemma3Processor
    from transformers.models.gemma3 import Gemma3ImageProcessorPil

    tokenizer = _vlm_tokenizer("<start_of_image>", **_GEMMA3_SPECIAL)
    text = _dims(
        drop=("rope_parameters",),
        vocab_size=len(tokenizer),
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
        model_type="gemma3_text",
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=56,
            patch_size=14,
        ),
        mm_tokens_per_image=4,
        boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.eoi_token_id,
        image_token_index=tokenizer.image_token_id,
    )
    _save_model(config, "AutoModelForImageTextToText", path)
    Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": 56, "width": 56}),
        tokenizer=tokenizer,
        image_seq_length=4,
        chat_template=tokenizer.chat_template,
    ).save_pretrained(path)


FAMILIES: dict[str, Family] = {
    "llama": Family(_save_text("LlamaConfig")),
    "mistral": Family(_save_text("MistralConfig", sliding_window=None)),
    "mistral-sliding": Family(_save_text("MistralConfig", sliding_window=WINDOW)),
    "qwen2": Family(_save_text("Qwen2Config", drop=("head_dim",))),
    "qwen3": Family(_save_text("Qwen3Config")),  # QK-norm
    "gemma2": Family(
        _save_text(
            "Gemma2Config",
            sliding_window=WINDOW,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=16,
            drop=("rope_parameters",),
        )
    ),
    "gemma3-text": Family(
        _save_text(
            "Gemma3TextConfig",
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
            drop=("rope_parameters",),
        )
    ),
    "phi3": Family(_save_text("Phi3Config", drop=("head_dim",))),
    "olmo2": Family(_save_text("Olmo2Config")),  # post-norm, QK-norm over the full projections
    "qwen2-vl": Family(save_qwen2_vl, vision=True),
    "qwen2.5-vl": Family(save_qwen2_5_vl, vision=True),
    "llava": Family(save_llava, vision=True),
    "llava-next": Family(save_llava_next, vision=True),
    "idefics3": Family(lambda path: _save_idefics(path, "idefics3"), vision=True),
    "smolvlm": Family(lambda path: _save_idefics(path, "smolvlm"), vision=True),
    "gemma3-vision": Family(save_gemma3_vision, vision=True),  # bidirectional image blocks
}
VLM_FAMILIES = [name for name, family in FAMILIES.items() if family.vision]
#: families whose transformers processor needs packages kvlab does not install: family -> modules
NEEDS = {"smolvlm": ("num2words", "torchvision")}  # SmolVLMProcessor, its video processor


def missing(family: str) -> list[str]:
    return [module for module in NEEDS.get(family, ()) if importlib.util.find_spec(module) is None]


# ---- samples -----------------------------------------------------------------------------------
def _image(width: int, height: int, seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def _text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def text_samples() -> list[Sample]:
    """Three prompts of different lengths, each several sliding windows long."""
    return [Sample(f"t{i}", _text(words, seed=i)) for i, words in enumerate((70, 45, 55))]


def vlm_samples() -> list[Sample]:
    """Two images of different shapes, one image, text only: different image-token counts."""
    return [
        Sample("two", _text(40, seed=10), images=[_image(56, 56, 1), _image(84, 40, 2)]),
        Sample("one", _text(30, seed=11), images=[_image(40, 70, 3)]),
        Sample("text", _text(50, seed=12)),
    ]


#: the preset runs: each family with the methods that apply to it
PRESET_CASES = [
    (name, preset)
    for name, family in FAMILIES.items()
    for preset in (VLM_PRESETS if family.vision else TEXT_PRESETS)
]


@pytest.fixture(scope="module")
def zoo(request, tmp_path_factory) -> tuple[str, LoadedModel]:
    """``(family, model)``: the family's tiny model saved to a directory and loaded by path (one per
    family and module; tests name the family with ``indirect`` parametrisation)."""
    name = request.param
    if missing(name):
        pytest.skip(f"{name}: its transformers processor needs {missing(name)} (refusal: test below)")
    path = tmp_path_factory.mktemp(name)
    FAMILIES[name].save(path)
    return name, kvlab.load_model(str(path))


def samples_of(loaded: LoadedModel) -> list[Sample]:
    return vlm_samples() if loaded.info.vision_language else text_samples()


# ---- exactness -----------------------------------------------------------------------------------
def assert_full_cache_matches_transformers(loaded: LoadedModel, sample: Sample) -> None:
    """kvlab's full cache against transformers' own generate on one sample: the engine check of
    every run (``verify_engine``: first logits, greedy tokens, a probe past a sliding window) and
    every step's logits within 1e-4 (kvlab teacher-forced with transformers' greedy tokens)."""
    batch = loaded.processor.collate([sample])
    result = verify_engine(loaded, batch, steps=STEPS)
    assert result.ok, result.describe()
    native_logits, native_tokens, _ = _native(loaded, batch, STEPS)
    ours = generate(
        loaded,
        Pipeline.from_config(None),
        batch,
        RunOptions(
            max_new_tokens=len(native_tokens),
            return_logits=True,
            teacher_tokens=torch.tensor([native_tokens]),
        ),
    )
    torch.testing.assert_close(ours.step_logits[0], native_logits.cpu(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("zoo", list(FAMILIES), indirect=True)
def test_full_cache_matches_transformers(zoo):
    name, loaded = zoo
    assert_full_cache_matches_transformers(loaded, samples_of(loaded)[0])


@pytest.mark.parametrize("zoo", list(FAMILIES), indirect=True)
def test_padded_batch_equals_each_sample_alone(zoo):
    name, loaded = zoo
    for preset in (None, "snapkv"):
        pipeline = (
            kvlab.load_pipeline(preset, budget={"tokens": BUDGET}) if preset else Pipeline.from_config(None)
        )
        e2e.assert_batch_equals_alone(loaded, pipeline, samples_of(loaded), STEPS)


@pytest.mark.parametrize("zoo", VLM_FAMILIES, indirect=True)
def test_image_tokens_are_found(zoo):
    """Modality 1 exactly at the config's image token ids, as many as the family's processor writes."""
    name, loaded = zoo
    items = vlm_samples()
    batch = loaded.processor.collate(items)
    image_ids = torch.tensor(loaded.info.image_token_ids)
    assert torch.equal(batch.modality == IMAGE, torch.isin(batch.input_ids, image_ids))
    per_sample = (batch.modality == IMAGE).sum(-1).tolist()
    assert per_sample[0] > 0 and per_sample[1] > 0 and per_sample[2] == 0


@pytest.mark.parametrize("zoo", ["llava-next", "idefics3", "gemma3-vision"], indirect=True)
def test_prompt_equals_the_family_processors_own(zoo):
    """For a family fed through its transformers processor, kvlab's prompt ids and pixel inputs are
    what that processor's own ``__call__`` makes of the same templated text and images."""
    name, loaded = zoo
    processor = loaded.processor
    sample = vlm_samples()[0]
    ours = processor.collate([sample])
    theirs = processor.images.processor(
        text=[processor.prompt_text(sample)], images=sample.images, return_tensors="pt"
    )
    assert ours.input_ids[0].tolist() == theirs["input_ids"][0].tolist()
    assert ours.model_inputs.keys() <= theirs.keys()
    for key, value in ours.model_inputs.items():
        assert torch.equal(value, theirs[key]), key


# ---- budgets -------------------------------------------------------------------------------------
def sliding_layers(loaded: LoadedModel) -> list[bool]:
    """Per layer: whether it is a sliding-window layer (``layer_types``, else ``sliding_window``)."""
    config = text_config(loaded.model.config)
    types = getattr(config, "layer_types", None)
    if types:
        return [kind == "sliding_attention" for kind in types]
    return [bool(getattr(config, "sliding_window", None))] * loaded.info.num_layers


def assert_keeps_its_budget(preset: str, loaded: LoadedModel, items: list[Sample]) -> None:
    """Each full-attention layer keeps ``min(budget, prompt)`` per KV head (AdaKV: per layer, summed
    over heads; LOOK-M: the budget raised to every text token, which its text prior keeps); a
    sliding-window layer keeps the ``WINDOW - 1`` last tokens its next query sees (``sliding_layers:
    window``, docs/architecture.md)."""
    pipeline = kvlab.load_pipeline(preset, budget={"tokens": BUDGET})
    result = e2e.run(loaded, pipeline, items, STEPS)
    batch = loaded.processor.collate(items)
    lengths = result.prompt_lengths
    T = batch.input_ids.shape[1]
    heads = loaded.info.num_kv_heads
    assert len(result.reports) == loaded.info.num_layers
    for report, sliding in zip(result.reports, sliding_layers(loaded), strict=True):
        layer = report.layer_idx
        if sliding:
            visible = torch.clamp(lengths, max=WINDOW - 1)
            assert torch.equal(report.kept, visible[:, None].expand_as(report.kept)), layer
            for b in range(len(items)):
                assert report.selection.kept_positions(b, 0) == list(range(T - int(visible[b]), T))
            continue
        assert torch.equal(report.budget, torch.full_like(report.budget, BUDGET)), layer
        expected = torch.minimum(report.budget, lengths)  # [B]
        assert bool((expected < lengths).all())  # the budget evicts
        if preset == "adakv":
            assert torch.equal(report.kept.sum(-1), heads * expected), layer
            assert bool((report.kept <= lengths[:, None]).all()), layer
        elif preset == "lookm":
            text = ((batch.modality == TEXT) & batch.attention_mask.bool()).sum(-1)
            want = torch.maximum(expected, text)
            assert torch.equal(report.kept, want[:, None].expand_as(report.kept)), layer
            for b in range(len(items)):
                text_positions = {p for p in range(T) if int(batch.modality[b, p]) == TEXT}
                for h in range(heads):
                    assert text_positions <= set(report.selection.kept_positions(b, h)), layer
        else:
            assert torch.equal(report.kept, expected[:, None].expand_as(report.kept)), layer


@pytest.mark.parametrize("zoo, preset", PRESET_CASES, indirect=["zoo"])
def test_presets_keep_their_budgets(zoo, preset):
    name, loaded = zoo
    assert_keeps_its_budget(preset, loaded, samples_of(loaded))


@pytest.mark.parametrize("zoo", ["llava-next"], indirect=True)
def test_kvlab_predict_takes_the_directory_as_model_model(zoo, tmp_path):
    """The YAML route: ``--model.model /path/to/dir`` on a multi-resolution VLM, engine check on the
    first batch included, keeps the budget in every full-attention layer."""
    import json

    from support.cli import predict

    name, loaded = zoo
    dataset = "{name: synthetic_image_qa, num_samples: 2, images_per_sample: 2, seed: 1}"
    args = ("--model.model", loaded.path, "--model.compression.budget", str(BUDGET))
    quiet = ("--trainer.enable_progress_bar", "false", "--model.max_new_tokens", "3")
    predict(tmp_path, "--config", "snapkv", *args, "--data.dataset", dataset, *quiet)
    lines = (tmp_path / "runs" / "exp" / "snapkv" / "predictions.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == 2 and any("verify_seconds" in r for r in records)
    for record in records:
        assert record["prompt_tokens"] > BUDGET
        assert {count for layer in record["kept_per_layer_head"] for count in layer} == {BUDGET}


def test_gemma2_without_soft_capping_is_verified(tmp_path):
    """Gemma 2 with soft-capping off: kvlab runs it (eager load), and the engine check runs
    transformers' side in eager too, since Gemma 2 has no sdpa path."""
    save = _save_text(
        "Gemma2Config",
        sliding_window=WINDOW,
        attn_logit_softcapping=None,
        query_pre_attn_scalar=16,
        drop=("rope_parameters",),
    )
    save(tmp_path)
    assert_full_cache_matches_transformers(kvlab.load_model(str(tmp_path)), text_samples()[0])


# ---- Gemma 3's bidirectional image blocks -------------------------------------------------------
def naive_block_attention(query, key, value, valid, blocks, scaling, window=None, softcap=None, sinks=None):
    """Dense reference of Gemma 3's prefill attention: one ``[B, H, k, k]`` softmax with the mask
    transformers builds (``create_masks_for_vision_model``): ``causal | same image block`` on full
    layers, ``(causal | same image block) & (key > query - window)`` on sliding ones, padding keys
    masked. Rows of padding queries are left out of the comparison (their output is never used)."""
    B, H, k, _ = query.shape
    groups = H // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    pos = torch.arange(k)
    mask = (pos[None, :] <= pos[:, None])[None] | (
        (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0)
    )
    if window is not None:
        mask = mask & (pos[None, :] > pos[:, None] - window)[None]
    mask = mask & valid[:, None, :]
    logits = query @ key.transpose(-1, -2) * scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~mask[:, None], float("-inf"))
    logits = logits.masked_fill(~valid[:, None, :, None], 0.0)  # padding rows: anything finite
    if sinks is not None:  # one extra logit per head in the denominator, no value
        logits = torch.cat([logits, sinks.reshape(1, -1, 1, 1).expand(*logits.shape[:3], 1)], -1)
    return torch.softmax(logits, -1)[..., :k] @ value


def _block_batch(seed: int = 0):
    """A left-padded batch of 3 (lengths 40, 33, 28) with image runs of 6 to 9 tokens, two of them
    adjacent to the prompt's end (so the last queries sit inside an image block), ``modality [B, T]``."""
    g = torch.Generator().manual_seed(seed)
    T = 40
    modality = torch.zeros(3, T, dtype=torch.long)
    modality[1, :7] = -1
    modality[2, :12] = -1
    for b, runs in enumerate([[(3, 9), (20, 26), (31, 38)], [(9, 15), (16, 22), (34, 40)], [(14, 20)]]):
        for a, e in runs:
            modality[b, a:e] = IMAGE
    q = torch.randn(3, 4, T, 8, generator=g)
    k = torch.randn(3, 2, T, 8, generator=g)
    v = torch.randn(3, 2, T, 8, generator=g)
    return q, k, v, modality


def test_image_block_ids_are_transformers_own():
    """Block ids from kvlab's modality ids equal Gemma 3's ``get_block_sequence_ids_for_mask`` on the
    ``token_type_ids`` its processor writes (1 at image tokens): each run of image tokens one block."""
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    g = torch.Generator().manual_seed(3)
    modality = torch.randint(-1, 2, (6, 50), generator=g)  # padding, text and image everywhere
    expected = get_block_sequence_ids_for_mask((modality == IMAGE).long())
    assert torch.equal(image_block_ids(modality), expected)
    assert image_block_ids(torch.tensor([[0, 1, 1, 0, 1, 0, 0, 1, 1, 1]])).tolist() == [
        [-1, 0, 0, -1, 1, -1, -1, 2, 2, 2]
    ]


@pytest.mark.parametrize(
    "options",
    [
        AttentionOptions(),
        AttentionOptions(sliding_window=5),
        AttentionOptions(sliding_window=5, softcap=3.0),
        AttentionOptions(sinks=torch.linspace(-1.0, 1.0, 4)),
    ],
    ids=["full", "sliding", "sliding-softcap", "sinks"],
)
@pytest.mark.parametrize("block_elements", [None, 4 * 2 * 3 * 12], ids=["one-block", "row-blocks"])
def test_prefill_attention_with_image_blocks_equals_the_dense_mask(options, block_elements):
    """kvlab's prefill with image blocks equals the dense masked softmax (transformers' mask), on
    full and sliding layers, with soft-capping and sinks, whether an image's rows are recomputed in
    one chunk or a few rows at a time; without the blocks the image rows differ."""
    q, k, v, modality = _block_batch()
    valid, blocks = modality >= 0, image_block_ids(modality)
    ours = prefill_attention(q, k, v, valid, 0.3, options, block_elements=block_elements, blocks=blocks)
    want = naive_block_attention(
        q, k, v, valid, blocks, 0.3, options.sliding_window, options.softcap, options.sinks
    )
    rows = valid[:, None, :, None].expand_as(want)
    torch.testing.assert_close(ours[rows], want[rows], atol=1e-5, rtol=1e-5)
    causal = prefill_attention(q, k, v, valid, 0.3, options, block_elements=block_elements)
    assert not torch.allclose(causal[rows], ours[rows], atol=1e-3)  # the blocks change the attention


def _block_context(blocks: bool) -> LayerContext:
    q, k, v, modality = _block_batch(seed=1)
    valid = modality >= 0
    return LayerContext(
        layer_idx=0,
        num_layers=1,
        queries=q,
        keys=k,
        values=v,
        valid=valid,
        modality=modality,
        scaling=0.3,
        image_blocks=image_block_ids(modality) if blocks else None,
    )


def test_scorers_read_the_attention_with_image_blocks():
    """The attention every scorer reads (``attention_probs``: H2O's and LOOK-M's accumulated
    attention, SnapKV's window sums, HybridKV's text rows) is the model's own, image blocks
    included: each equals the dense masked softmax's rows / column sums."""
    ctx = _block_context(blocks=True)
    valid, blocks = ctx.valid, ctx.image_blocks
    probs = naive_block_attention(
        ctx.queries, ctx.keys, torch.eye(ctx.seq_len).expand(3, 2, -1, -1), valid, blocks, 0.3
    )  # values = identity: the output rows are the probabilities
    probs = probs * valid[:, None, :, None]
    torch.testing.assert_close(ctx.cumulative_attention(chunk=7), probs.sum(-2), atol=1e-5, rtol=1e-5)
    for window in (4, 10):
        torch.testing.assert_close(
            ctx.window_attention_scores(window), probs[:, :, -window:].sum(-2), atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(ctx.window_attention(window), probs[:, :, -window:], atol=1e-5, rtol=1e-5)
    causal = _block_context(blocks=False)
    assert not torch.allclose(causal.window_attention_scores(4), ctx.window_attention_scores(4), atol=1e-3)


def test_window_scores_take_the_kernel_when_no_block_looks_ahead():
    """A window whose queries see no later key of their image block (text after the last image)
    gives the kernel's causal sums: the block mask changes nothing there."""
    ctx = _block_context(blocks=True)
    ctx.image_blocks[:, -6:] = -1  # the window's queries: no image
    assert not ctx._blocks_look_ahead(ctx.seq_len - 6)
    plain = _block_context(blocks=False)
    assert torch.equal(ctx.window_attention_scores(6), plain.window_attention_scores(6))


def test_causal_models_keep_the_plain_paths():
    """Only a family with image blocks takes the image-row path: the flag comes from the family
    (Gemma 3 with images; not its text-only model, not a causal VLM), and a session without it, or a
    Gemma 3 batch without images, has no blocks, so prefill attention stays on its sdpa paths."""
    from transformers import Gemma3Config, Gemma3TextConfig, LlavaConfig, Qwen2VLConfig

    assert model_info(Gemma3Config(), "g").bidirectional_image_blocks
    for config in (Gemma3TextConfig(), LlavaConfig(), Qwen2VLConfig()):
        assert not model_info(config, "c").bidirectional_image_blocks
    _, _, _, modality = _block_batch()
    valid = modality >= 0
    plain = RunState(valid=valid, modality=modality)
    assert plain.image_blocks_on(valid.device) is None
    text_only = RunState(valid=valid, modality=modality.clamp(max=0), bidirectional_image_blocks=True)
    assert text_only.image_blocks_on(valid.device) is None
    gemma = RunState(valid=valid, modality=modality, bidirectional_image_blocks=True)
    assert torch.equal(gemma.image_blocks_on(valid.device), image_block_ids(modality))


@pytest.mark.parametrize("zoo", ["gemma3-vision"], indirect=True)
def test_gemma3_with_images_has_image_blocks(zoo):
    """Gemma 3 with images, loaded from its directory, has ``bidirectional_image_blocks``, and the
    zoo's prompts put one block per image in the batch (the model's own ``token_type_ids`` mark the
    same tokens), so the zoo's exactness checks run the image blocks."""
    name, loaded = zoo
    assert loaded.info.bidirectional_image_blocks
    batch = loaded.processor.collate(vlm_samples())
    blocks = image_block_ids(batch.modality)
    assert blocks.amax(-1).tolist() == [1, 0, -1]  # two images, one image, text only
    assert torch.equal(batch.model_inputs["token_type_ids"].bool(), blocks >= 0)


# ---- refused families ----------------------------------------------------------------------------
def test_paligemma_is_refused_at_load(tmp_path):
    """PaliGemma attends bidirectionally over the image and the text prefix (a prefix-LM mask), which
    kvlab does not implement: refused when it loads, before any weight, never run wrongly."""
    from transformers import PaliGemmaConfig

    tokenizer = _vlm_tokenizer("<image>", image_token="<image>")
    config = PaliGemmaConfig(
        text_config=_dims(
            drop=("rope_parameters",), vocab_size=len(tokenizer), model_type="gemma", query_pre_attn_scalar=16
        ),
        vision_config={**_CLIP, "model_type": "siglip_vision_model", "projection_dim": 64},
        image_token_index=_token_id(tokenizer, "<image>"),
    )
    _save_model(config, "AutoModelForImageTextToText", tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="type 'paligemma' are refused: PaliGemma.*prefix-LM"):
        kvlab.load_model(str(tmp_path))


@pytest.mark.skipif(
    not missing("smolvlm"), reason="SmolVLM's processor can be built here: it runs in the zoo"
)
def test_smolvlm_without_its_processor_packages_is_refused_at_load(tmp_path):
    """SmolVLMProcessor needs num2words (and torchvision for its video processor): without them the
    model is refused when it loads, naming the package, instead of failing inside transformers."""
    from transformers import SmolVLMConfig
    from transformers.models.smolvlm import SmolVLMImageProcessorPil

    tokenizer = _vlm_tokenizer("<image>", _IDEFICS_TOKENS, image_token="<image>")
    _save_model(_idefics_config(SmolVLMConfig, tokenizer), "AutoModelForImageTextToText", tmp_path)
    tokenizer.save_pretrained(tmp_path)
    SmolVLMImageProcessorPil(**_IDEFICS_IMAGES).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="SmolVLMProcessor needs a package that is not installed"):
        kvlab.load_model(str(tmp_path))
