"""Vision-language families: which image adapter feeds each one, and the built-in VLMs' configs.

:func:`image_adapter` picks the adapter of a config's family (``model_type``): Qwen2-VL and
Qwen2.5-VL (:class:`~kvlab.models.images.Qwen2VLImages`), LLaVA
(:class:`~kvlab.models.images.LlavaImages`), and the families in :data:`FAMILY_PROCESSORS`
(LLaVA-NeXT, Idefics3, SmolVLM, Gemma 3), fed through their own transformers processor
(:class:`~kvlab.models.images.FamilyImages`). Families in
:data:`BIDIRECTIONAL_IMAGE_FAMILIES` (Gemma 3) let the tokens of one image attend to each other
in both directions; kvlab's prefill attention and its attention-reading scorers apply those
image blocks for them (``ModelInfo.bidirectional_image_blocks``). Families in
:data:`NON_CAUSAL_FAMILIES` are refused: their language model attends non-causally over an image
prompt in a way kvlab does not implement. ``docs/models.md`` lists the families and how to add one.

Both Qwen2-VL built-ins (``tiny-qwen2-vl``, ``smollm2-qwen2-vl``) and both LLaVA built-ins
(``tiny-llava``, ``smollm2-llava``) are built by the same two functions here from a *text* config
dict (the language model's dimensions) plus an image size; only the dimensions differ.
Vision towers are always tiny and random (2 layers, width 32).
"""

from __future__ import annotations

from typing import Any

from transformers import LlavaConfig, Qwen2VLConfig
from transformers.models.llava import LlavaImageProcessorPil
from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

from kvlab.config.errors import ConfigError
from kvlab.models.common import IMAGE_TOKEN_FIELDS, config_token_ids
from kvlab.models.images import FamilyImages, ImageAdapter, LlavaImages, Qwen2VLImages

QWEN2VL_PATCH = 14
QWEN2VL_MERGE = 2
LLAVA_PATCH = 14
#: the tiny random vision towers (both families)
VISION_WIDTH, VISION_LAYERS, VISION_HEADS = 32, 2, 2

#: families fed through their transformers processor: model_type -> (processor class in
#: ``transformers``, the per-token image-type input the model takes or None)
FAMILY_PROCESSORS: dict[str, tuple[str, str | None]] = {
    "llava_next": ("LlavaNextProcessor", None),
    "idefics3": ("Idefics3Processor", None),
    "smolvlm": ("SmolVLMProcessor", None),
    "gemma3": ("Gemma3Processor", "token_type_ids"),
}
#: families whose language model lets the tokens of one image attend to each other in both
#: directions (transformers: ``token_type_ids`` -> ``block_sequence_ids``, OR-ed into the causal mask of
#: sliding and global layers): model_type -> description. kvlab applies the same image blocks in
#: prefill attention and in the scorers that read prompt attention
#: (:func:`kvlab.cache.masks.image_block_ids`); decode stays causal (new tokens are text).
BIDIRECTIONAL_IMAGE_FAMILIES: dict[str, str] = {
    "gemma3": "bidirectional attention within each image (a run of consecutive image tokens)",
}
#: families whose language model attends non-causally over an image prompt in a way kvlab does not
#: implement: model_type -> why
NON_CAUSAL_FAMILIES: dict[str, str] = {
    "paligemma": (
        "PaliGemma's language model attends bidirectionally over the image and the text prefix (a prefix-LM "
        "mask from token_type_ids), while kvlab's prefill attention is causal apart from image blocks"
    ),
}
#: the vision-language families image_adapter feeds (model_type), for messages
SUPPORTED_FAMILIES = (
    "qwen2_vl",
    "qwen2_5_vl",
    "llava",
    *sorted(FAMILY_PROCESSORS.keys() - NON_CAUSAL_FAMILIES.keys()),
)


def qwen2_vl_tokens_per_image(image_size: int) -> int:
    """``<|image_pad|>`` tokens for a square image: (size / 14)**2 patches, merged 2x2."""
    return (image_size // QWEN2VL_PATCH) ** 2 // QWEN2VL_MERGE**2


def llava_tokens_per_image(image_size: int) -> int:
    """``<image>`` tokens for a square image (CLS dropped: ``vision_feature_select_strategy="default"``)."""
    return (image_size // LLAVA_PATCH) ** 2


def qwen2_vl_config(text: dict[str, Any], token_ids: dict[str, int], mrope_section: list[int]) -> Any:
    """A ``Qwen2VLConfig`` around the language-model dims ``text`` (Llama-style keys) and a tiny vision tower.

    Args:
        text: Llama-style language-model kwargs (see :func:`kvlab.models.scaffolding.tiny.text_dims`), with
            ``rope_parameters`` ``{"rope_type": "default", "rope_theta": ...}``.
        token_ids: ids of ``<|image_pad|> <|video_pad|> <|vision_start|> <|vision_end|>``.
        mrope_section: (t, h, w) split of the rotary half-dim; sums to head_dim / 2.
    """
    text = {k: v for k, v in text.items() if k != "head_dim"}  # Qwen2-VL derives it: hidden / heads
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": list(mrope_section)}
    vision = dict(
        depth=VISION_LAYERS,
        embed_dim=VISION_WIDTH,
        hidden_size=text["hidden_size"],  # the merger projects straight into the LM width
        num_heads=VISION_HEADS,
        mlp_ratio=2,
        patch_size=QWEN2VL_PATCH,
        spatial_merge_size=QWEN2VL_MERGE,
        temporal_patch_size=2,
    )
    return Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"],
        tie_word_embeddings=text.get("tie_word_embeddings", False),
    )


def llava_config(text: dict[str, Any], token_ids: dict[str, int], image_size: int) -> Any:
    """A ``LlavaConfig``: Llama language model with dims ``text`` and a tiny CLIP tower for ``image_size``."""
    text = {**text, "model_type": "llama"}
    vision = dict(
        model_type="clip_vision_model",
        hidden_size=VISION_WIDTH,
        intermediate_size=2 * VISION_WIDTH,
        num_hidden_layers=VISION_LAYERS,
        num_attention_heads=VISION_HEADS,
        image_size=image_size,
        patch_size=LLAVA_PATCH,
        projection_dim=VISION_WIDTH,
    )
    return LlavaConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=token_ids["<image>"],
        image_seq_length=llava_tokens_per_image(image_size),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=text.get("tie_word_embeddings", False),
    )


def qwen2_vl_images(image_size: int | None, image_processor: Any = None) -> ImageAdapter:
    """Qwen2-VL image adapter; built-ins squash images to ``image_size`` (a multiple of 28)."""
    if image_processor is None:
        assert image_size is not None and image_size % (QWEN2VL_PATCH * QWEN2VL_MERGE) == 0
        pixels = image_size * image_size
        image_processor = Qwen2VLImageProcessorPil(
            min_pixels=pixels, max_pixels=pixels, patch_size=QWEN2VL_PATCH, merge_size=QWEN2VL_MERGE
        )
    return Qwen2VLImages(image_processor, image_size)


def llava_images(config: Any, image_processor: Any = None) -> ImageAdapter:
    """LLaVA image adapter for ``config`` (a ``LlavaConfig``); tokens per image from its vision tower."""
    vision = config.vision_config
    size = int(vision.image_size)
    if image_processor is None:
        image_processor = LlavaImageProcessorPil(
            size={"shortest_edge": size}, crop_size={"height": size, "width": size}
        )
    tokens = (size // int(vision.patch_size)) ** 2
    if getattr(config, "vision_feature_select_strategy", "default") == "full":
        tokens += 1
    return LlavaImages(image_processor, tokens)


def image_adapter(
    config: Any, image_processor: Any = None, image_size: int | None = None
) -> ImageAdapter | None:
    """The image adapter of a config's family (None for text-only configs).

    Args:
        config: the model's HF config (its ``model_type`` names the family).
        image_processor: Qwen2-VL, Qwen2.5-VL, LLaVA: the family's ``*ImageProcessorPil`` (None: the
            family's defaults). The :data:`FAMILY_PROCESSORS` families: the family's transformers
            processor (``LlavaNextProcessor``, ``Idefics3Processor``, ...), tokenizer and image
            processor inside (required: it writes each image's text).
        image_size: built-in Qwen2-VL models: the square size images are squashed to.

    Raises:
        ConfigError: a family kvlab cannot run exactly (:data:`NON_CAUSAL_FAMILIES`), a family it
            has no image processing for, or a :data:`FAMILY_PROCESSORS` family without its processor.
    """
    if getattr(config, "vision_config", None) is None:
        return None
    model_type = getattr(config, "model_type", "")
    supported = ", ".join(SUPPORTED_FAMILIES)
    if model_type in NON_CAUSAL_FAMILIES:
        raise ConfigError(
            f"vision-language models of type '{model_type}' are refused: {NON_CAUSAL_FAMILIES[model_type]}. "
            "Use a text-only model or a supported vision-language family "
            f"({supported}); docs/models.md lists them."
        )
    if model_type in ("qwen2_vl", "qwen2_5_vl"):
        if image_processor is None and image_size is None:
            image_processor = Qwen2VLImageProcessorPil()
        return qwen2_vl_images(image_size, image_processor)
    if model_type == "llava":
        return llava_images(config, image_processor)
    if model_type in FAMILY_PROCESSORS:
        class_name, type_ids = FAMILY_PROCESSORS[model_type]
        if not hasattr(image_processor, "replace_image_token"):
            raise ConfigError(
                f"vision-language models of type '{model_type}' take their images through their transformers "
                f"processor, which writes each image's tokens: pass a {class_name} (tokenizer and image "
                f"processor inside) as the image processor, e.g. processor = {class_name}.from_pretrained("
                "path); kvlab.wrap_model(model, processor.tokenizer, processor)."
            )
        return FamilyImages(image_processor, config_token_ids(config, *IMAGE_TOKEN_FIELDS), type_ids)
    raise ConfigError(
        f"kvlab has no image processing for vision-language models of type '{model_type}'. "
        f"Supported families: {supported} (or use a text-only model); docs/models.md says how to add one."
    )
