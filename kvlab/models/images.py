"""Image adapters: how each vision-language family turns a batch's images into forward() inputs.

An :class:`ImageAdapter` gives the pixel inputs of the images of a batch and, per image, how many
image tokens it takes (and, for some families, the text its placeholder becomes); the
:class:`~kvlab.models.processors.ChatProcessor` expands each image's placeholder with it.
:class:`Qwen2VLImages` and :class:`LlavaImages` count tokens themselves; :class:`FamilyImages`
serves the families whose transformers processor writes the image text (LLaVA-NeXT, Idefics3,
SmolVLM, Gemma 3). Nothing here needs torchvision: the adapters use the ``*ImageProcessorPil``
classes. :func:`kvlab.models.vlm.image_adapter` picks a config's adapter.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from PIL import Image

from kvlab.config.errors import ConfigError


def _resize(images: list[Image.Image], size: int | None) -> list[Image.Image]:
    """RGB images, squashed to ``size`` x ``size`` when given (fixed token count per image)."""
    out = [img.convert("RGB") for img in images]
    if size is not None:
        out = [img if img.size == (size, size) else img.resize((size, size), Image.BICUBIC) for img in out]
    return out


class ProcessedImages(NamedTuple):
    """What an :class:`ImageAdapter` makes of the N images of a batch.

    Attributes:
        inputs: forward() keyword inputs (``pixel_values`` and the family's companions).
        counts: ``[N]`` image tokens (tokens carrying image features) per image.
        texts: ``[N]`` the text each image's placeholder becomes, image tokens and the family's
            markers around them; None: the image token repeated ``counts[i]`` times.
    """

    inputs: dict[str, torch.Tensor]
    counts: list[int]
    texts: list[str] | None = None


class ImageAdapter(ABC):
    """Turns the images of a batch into forward() inputs and per-image token counts.

    Attributes:
        placeholder: the text the chat template writes for one image, which the processor replaces
            per image (None: the model's image token, as for Qwen2-VL and LLaVA).
        merge_size: patches merged per side into one token on a grid-based family (Qwen2-VL:
            the image's tokens are its ``image_grid_thw`` grid divided by it); None elsewhere.
    """

    placeholder: str | None = None
    merge_size: int | None = None

    @abstractmethod
    def process(self, images: list[Image.Image]) -> ProcessedImages | tuple[dict[str, Any], list[int]]:
        """``images`` (all images of the batch, in prompt order) -> (model inputs, tokens per image
        [, text per image]): a :class:`ProcessedImages` or its first two fields."""

    def batch_inputs(self, input_ids: torch.Tensor, image_ids: torch.Tensor, video_ids: torch.Tensor) -> dict:
        """Extra per-token inputs for the padded batch (``input_ids`` [B, T]); none by default."""
        return {}


class Qwen2VLImages(ImageAdapter):
    """Qwen2-VL: ``Qwen2VLImageProcessorPil``; an image of grid (t, h, w) takes t*h*w / merge**2 tokens.

    Args:
        image_processor: a ``Qwen2VLImageProcessorPil``.
        image_size: squash images to this square size first (a multiple of 28 inside the
            processor's pixel range, so the token count is fixed: (size/28)**2); None keeps the
            processor's own resizing (Hub models).
    """

    def __init__(self, image_processor: Any, image_size: int | None = None):
        self.image_processor = image_processor
        self.image_size = image_size
        self.merge_size = int(getattr(image_processor, "merge_size", 2))

    def process(self, images: list[Image.Image]) -> tuple[dict[str, torch.Tensor], list[int]]:
        """-> ``pixel_values`` [sum of patches, C*T*P*P], ``image_grid_thw`` [N, 3]; counts per image."""
        out = self.image_processor(images=_resize(images, self.image_size), return_tensors="pt")
        grid = out["image_grid_thw"]
        counts = (grid.prod(-1) // self.merge_size**2).tolist()
        return {"pixel_values": out["pixel_values"], "image_grid_thw": grid}, counts

    def batch_inputs(self, input_ids: torch.Tensor, image_ids: torch.Tensor, video_ids: torch.Tensor) -> dict:
        """``mm_token_type_ids`` [B, T]: 1 image, 2 video, 0 otherwise (Qwen2-VL's M-RoPE needs it)."""
        types = torch.zeros_like(input_ids)
        types[torch.isin(input_ids, image_ids)] = 1
        types[torch.isin(input_ids, video_ids)] = 2
        return {"mm_token_type_ids": types}


class LlavaImages(ImageAdapter):
    """LLaVA: ``LlavaImageProcessorPil`` (resize + centre crop); every image takes the same number of tokens.

    Args:
        image_processor: a ``LlavaImageProcessorPil``.
        tokens_per_image: (crop / patch)**2, plus 1 with ``vision_feature_select_strategy="full"``.
    """

    def __init__(self, image_processor: Any, tokens_per_image: int):
        self.image_processor = image_processor
        self.tokens_per_image = tokens_per_image

    def process(self, images: list[Image.Image]) -> tuple[dict[str, torch.Tensor], list[int]]:
        """-> ``pixel_values`` [N, 3, H, W]; counts per image."""
        out = self.image_processor(images=_resize(images, None), return_tensors="pt")
        return {"pixel_values": out["pixel_values"]}, [self.tokens_per_image] * len(images)


class FamilyImages(ImageAdapter):
    """A family whose transformers processor writes each image's text: LLaVA-NeXT (any-resolution
    tiles, a newline feature per row), Idefics3 and SmolVLM (image splitting, ``<row_i_col_j>``
    tags, a global image), Gemma 3 (begin/end of image around fixed soft tokens).

    The family's image processor makes the pixel inputs of all the batch's images in one call, with
    the processor's own image defaults, and the processor's ``replace_image_token(inputs, i)``
    gives the text the i-th image's placeholder becomes: what the processor's ``__call__`` does,
    with kvlab's chat template, batching and left padding around it.

    Args:
        processor: the family's transformers processor (``LlavaNextProcessor``, ``Idefics3Processor``,
            ``SmolVLMProcessor``, ``Gemma3Processor``), tokenizer and image processor inside.
        image_token_ids: ids of the tokens that carry image features (what each image's count counts).
        type_ids: name of a per-token input marking image tokens with 1 that the model takes
            (Gemma 3's ``token_type_ids``), or None.
    """

    def __init__(self, processor: Any, image_token_ids: Sequence[int], type_ids: str | None = None):
        self.processor = processor
        self.image_processor = processor.image_processor
        self.placeholder = processor.image_token
        self.image_token_ids = frozenset(int(i) for i in image_token_ids)
        self.type_ids = type_ids
        unused = set(getattr(processor, "unused_input_names", None) or ())
        self.input_names = tuple(n for n in self.image_processor.model_input_names if n not in unused)

    def process(self, images: list[Image.Image]) -> ProcessedImages:
        """-> the image processor's model inputs (``pixel_values`` and e.g. ``image_sizes``,
        ``pixel_attention_mask``), image tokens and text per image."""
        processor, tokenizer = self.processor, self.processor.tokenizer
        kwargs = processor._merge_kwargs(tokenizer_init_kwargs=tokenizer.init_kwargs)["images_kwargs"]
        out = self.image_processor(_resize(images, None), **{**kwargs, "return_tensors": "pt"})
        texts = [processor.replace_image_token(out, i) for i in range(len(images))]
        ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        counts = [sum(t in self.image_token_ids for t in row) for row in ids]
        if not all(counts):
            raise ConfigError(
                f"{type(processor).__name__} writes no image token of the model config "
                f"({sorted(self.image_token_ids)}) for an image (it writes "
                f"{texts[counts.index(0)][:80]!r}...): the processor's image token and the config's "
                "image_token_id disagree. Save the model and its processor together (save_pretrained of "
                "both into one directory)."
            )
        return ProcessedImages({k: out[k] for k in self.input_names if k in out}, counts, texts)

    def batch_inputs(self, input_ids: torch.Tensor, image_ids: torch.Tensor, video_ids: torch.Tensor) -> dict:
        """``{type_ids: [B, T]}`` (1 at image tokens) when the family takes one, else nothing."""
        if self.type_ids is None:
            return {}
        return {self.type_ids: torch.isin(input_ids, image_ids).long()}
