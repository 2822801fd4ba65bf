"""Config and image-processing factories shared by the tiny VLMs and the grafted SmolLM2 VLMs.

Both Qwen2-VL models (``tiny-qwen2-vl``, ``smollm2-qwen2-vl``) and both LLaVA models
(``tiny-llava``, ``smollm2-llava``) are built by the same two functions here from a *text* config
dict (the language model's dimensions) plus an image size; only the dimensions differ.
Vision towers are always tiny and random (2 layers, width 32).
"""

from __future__ import annotations

from typing import Any

from kvlab.models.processors import ImageAdapter, LlavaImages, Qwen2VLImages

QWEN2VL_PATCH = 14
QWEN2VL_MERGE = 2
LLAVA_PATCH = 14
#: the tiny random vision towers (both families)
VISION_WIDTH, VISION_LAYERS, VISION_HEADS = 32, 2, 2


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
    from transformers import Qwen2VLConfig

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
    from transformers import LlavaConfig

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
        from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

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
        from transformers.models.llava import LlavaImageProcessorPil

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
    """The adapter for a config's family (None for text-only configs); Hub models pass their processor."""
    if getattr(config, "vision_config", None) is None:
        return None
    model_type = getattr(config, "model_type", "")
    if model_type in ("qwen2_vl", "qwen2_5_vl"):
        if image_processor is None and image_size is None:
            from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

            image_processor = Qwen2VLImageProcessorPil()
        return qwen2_vl_images(image_size, image_processor)
    if model_type == "llava":
        return llava_images(config, image_processor)
    from kvlab.config.errors import ConfigError

    raise ConfigError(
        f"kvlab has no image processing for vision-language models of type '{model_type}'. "
        "Supported families: qwen2_vl, qwen2_5_vl, llava (or use a text-only model)."
    )
