"""kvlab's :class:`~kvlab.models.base.Processor`: ChatML prompts, image expansion, left-padded batches.

One :class:`ChatProcessor` serves every model. What differs between vision-language families is
how images become pixels and how many placeholder tokens one image takes; that lives in an
:class:`ImageAdapter` (:class:`Qwen2VLImages`, :class:`LlavaImages`). Nothing here needs
torchvision: the adapters use the ``*ImageProcessorPil`` classes.

Prompt layout per sample (via the tokenizer's chat template, ``add_generation_prompt=True``)::

    [system turn] <|im_start|>user\\n<image 1>...<image n>{prompt}<|im_end|>\\n<|im_start|>assistant\\n

The template renders each image as one image token (plus wrappers such as ``<|vision_start|>``);
the processor then repeats that token as many times as the image's vision features need.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from PIL import Image

from kvlab.config.errors import ConfigError
from kvlab.data.sample import Sample
from kvlab.models.base import IMAGE, PAD, TEXT, VIDEO

CHATML_END = "<|im_end|>"


def _resize(images: list[Image.Image], size: int | None) -> list[Image.Image]:
    """RGB images, squashed to ``size`` x ``size`` when given (fixed token count per image)."""
    out = [img.convert("RGB") for img in images]
    if size is not None:
        out = [img if img.size == (size, size) else img.resize((size, size), Image.BICUBIC) for img in out]
    return out


class ImageAdapter(ABC):
    """Turns the images of a batch into forward() inputs and per-image token counts."""

    @abstractmethod
    def process(self, images: list[Image.Image]) -> tuple[dict[str, torch.Tensor], list[int]]:
        """``images`` (all images of the batch, in prompt order) -> (model inputs, tokens per image)."""

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


class ChatProcessor:
    """The kvlab processor for every model (implements :class:`kvlab.models.base.Processor`).

    Args:
        tokenizer: an HF tokenizer with a ChatML chat template that accepts string content and,
            for VLMs, list content with ``{"type": "image"}`` entries.
        image_token_ids / video_token_ids: from the model config (modality 1 / 2).
        images: how to turn images into inputs; None for text-only models.
        extra_eos_token_ids: more ids that end generation (e.g. from the generation config).
    """

    def __init__(
        self,
        tokenizer: Any,
        image_token_ids: tuple[int, ...] = (),
        video_token_ids: tuple[int, ...] = (),
        images: ImageAdapter | None = None,
        extra_eos_token_ids: tuple[int, ...] = (),
    ):
        self.tokenizer = tokenizer
        self.image_token_ids = tuple(image_token_ids)
        self.video_token_ids = tuple(video_token_ids)
        self.images = images
        self.pad_token_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        if self.pad_token_id is None:
            raise ConfigError(
                "the tokenizer has neither a pad nor an eos token; kvlab cannot left-pad batches"
            )
        eos = [tokenizer.get_vocab().get(CHATML_END), tokenizer.eos_token_id, *extra_eos_token_ids]
        self._eos_token_ids = list(dict.fromkeys(int(t) for t in eos if t is not None))
        self.image_token = (
            tokenizer.convert_ids_to_tokens(self.image_token_ids[0]) if image_token_ids else None
        )

    # ---- prompt building --------------------------------------------------------------------
    def messages(self, sample: Sample) -> list[dict[str, Any]]:
        """ChatML messages: optional system turn, then the user turn (images first, then the text)."""
        msgs: list[dict[str, Any]] = []
        if sample.system is not None:
            msgs.append({"role": "system", "content": sample.system})
        if sample.images:
            content: Any = [{"type": "image"} for _ in sample.images] + [
                {"type": "text", "text": sample.prompt}
            ]
        else:
            content = sample.prompt  # plain string: works with text-only templates too
        msgs.append({"role": "user", "content": content})
        return msgs

    def prompt_text(self, sample: Sample) -> str:
        """The chat-templated prompt, with one image token per image (before expansion)."""
        return self.tokenizer.apply_chat_template(
            self.messages(sample), add_generation_prompt=True, tokenize=False
        )

    def _expand(self, text: str, counts: list[int], sample: Sample) -> str:
        """Repeat the i-th image token of ``text`` ``counts[i]`` times."""
        pieces = text.split(self.image_token) if self.image_token else [text]
        if len(pieces) - 1 != len(counts):
            raise ConfigError(
                f"sample '{sample.id}': the chat template rendered {len(pieces) - 1} image tokens "
                f"({self.image_token!r}) for {len(counts)} images; the prompt text must not contain the "
                "image token itself, and the tokenizer's chat template must render {'type': 'image'} entries."
            )
        out = [pieces[0]]
        for count, piece in zip(counts, pieces[1:], strict=True):
            out.append(self.image_token * count + piece)
        return "".join(out)

    # ---- Processor protocol -----------------------------------------------------------------
    def collate(self, samples: list[Sample]) -> dict[str, Any]:
        """Samples -> left-padded batch (B = len(samples), T = longest prompt).

        Returns ``input_ids`` [B, T], ``attention_mask`` [B, T] (0 on padding), ``modality`` [B, T]
        (0 text, 1 image, 2 video, -1 padding), ``model_inputs`` (Qwen2-VL: ``pixel_values``
        [patches, 1176], ``image_grid_thw`` [N, 3], ``mm_token_type_ids`` [B, T]; LLaVA:
        ``pixel_values`` [N, 3, H, W]; N = images in the batch, in sample order; empty for
        text-only batches except ``mm_token_type_ids``), ``ids`` and ``samples``.
        """
        if not samples:
            raise ValueError("collate() needs at least one sample")
        all_images = [img for s in samples for img in s.images]
        if all_images and self.images is None:
            bad = next(s.id for s in samples if s.images)
            raise ConfigError(
                f"sample '{bad}' has images but the model is text-only; use a vision-language model "
                "(e.g. tiny-qwen2-vl, smollm2-qwen2-vl) or a text-only dataset."
            )
        model_inputs: dict[str, Any] = {}
        counts: list[int] = []
        if all_images:
            model_inputs, counts = self.images.process(all_images)  # type: ignore[union-attr]
        rows: list[list[int]] = []
        start = 0
        for sample in samples:
            n = len(sample.images)
            text = self._expand(self.prompt_text(sample), counts[start : start + n], sample)
            start += n
            rows.append(list(self.tokenizer(text, add_special_tokens=False)["input_ids"]))

        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            if row:
                input_ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
                attention_mask[i, width - len(row) :] = 1

        image_ids = torch.tensor(self.image_token_ids, dtype=torch.long)
        video_ids = torch.tensor(self.video_token_ids, dtype=torch.long)
        modality = torch.full_like(input_ids, TEXT)
        modality[torch.isin(input_ids, image_ids)] = IMAGE
        modality[torch.isin(input_ids, video_ids)] = VIDEO
        modality[attention_mask == 0] = PAD
        if sum(counts) != int((modality == IMAGE).sum()):
            raise RuntimeError(f"expected {sum(counts)} image tokens, found {int((modality == IMAGE).sum())}")
        if self.images is not None:
            extra = self.images.batch_inputs(input_ids, image_ids, video_ids)
            for value in extra.values():
                value[attention_mask == 0] = 0
            model_inputs.update(extra)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "modality": modality,
            "model_inputs": model_inputs,
            "ids": [s.id for s in samples],
            "samples": list(samples),
        }

    def decode(self, token_ids: list[int] | torch.Tensor) -> str:
        """Token ids -> text, special tokens (chat markers, image tokens, padding) skipped."""
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.tolist()
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    @property
    def eos_token_ids(self) -> list[int]:
        """``<|im_end|>`` (the ChatML turn end), the tokenizer's eos and any extra ids, deduplicated."""
        return list(self._eos_token_ids)

    def __repr__(self) -> str:
        kind = type(self.images).__name__ if self.images else "text"
        return f"ChatProcessor({type(self.tokenizer).__name__}, vocab={len(self.tokenizer)}, images={kind})"
