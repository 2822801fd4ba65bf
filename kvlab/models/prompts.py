"""The prompts :func:`kvlab.compress_and_generate` takes, normalised, batched and collated.

A prompt is a string, chat messages, token ids (a list or a 1-D tensor; a 2-D tensor is a batch of
them) or a :class:`~kvlab.data.sample.Sample`, with optional images. :func:`prompt_items` turns
each into a :class:`PromptItem`: a Sample when the processor can render it (a string, a chat of one
user turn after an optional system turn, a Sample), else token ids (a longer chat is rendered
through the chat template). :func:`prompt_batches` groups them into batches of one kind (whole
contexts under ``multi_question``), and :func:`collate_items` makes a batch the model's input:
the processor's ``collate`` for Samples, :func:`collate_ids` (the same left-padded layout, no
images) for token ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from kvlab.config.errors import ConfigError
from kvlab.data.contexts import context_batches
from kvlab.data.sample import Sample
from kvlab.models.base import PAD, TEXT, Batch, LoadedModel, PromptProcessor

#: the ``images`` argument: one entry per prompt, each None, an image or a list of images
ImagesArg = Sequence[Image.Image | Sequence[Image.Image] | None] | None


@dataclass
class PromptItem:
    """One normalised prompt: a :class:`Sample` (goes through the processor's ``collate``) or ready
    token ids; ``index`` is its place among the prompts given, ``prompt`` the prompt as given."""

    index: int
    prompt: Any
    sample: Sample | None = None
    ids: list[int] | None = None


def prompt_items(loaded: LoadedModel, prompts: Any, images: ImagesArg = None) -> list[PromptItem]:
    """``prompts`` (one prompt or a list; see :func:`kvlab.compress_and_generate`) as one
    :class:`PromptItem` per prompt, in order: strings, one-turn chats and Samples become a Sample
    (collated by the processor), token ids and longer chats (rendered through the chat template)
    token ids.

    Raises:
        ConfigError: a malformed prompt or message, images for a text-only model, a token-id prompt
            or a longer chat, or an ``images`` list of the wrong length.
    """
    prompts = _prompt_list(prompts)
    per_prompt = _images_per_prompt(images, len(prompts))
    if any(per_prompt) and not loaded.info.vision_language:
        raise ConfigError(
            f"images were given but model '{loaded.info.name}' is text-only; use a vision-language model "
            "(e.g. tiny-qwen2-vl, smollm2-qwen2-vl) or drop the images."
        )
    items = []
    for i, (prompt, imgs) in enumerate(zip(prompts, per_prompt, strict=True)):
        item = PromptItem(index=i, prompt=prompt)
        if isinstance(prompt, Sample):
            if imgs:
                raise ConfigError(
                    f"prompts[{i}] is a Sample, which carries its own images; leave its images entry None."
                )
            item.sample = prompt
        elif isinstance(prompt, str):
            item.sample = Sample(id=str(i), prompt=prompt, images=imgs)
        elif _is_token_ids(prompt):
            ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else [int(t) for t in prompt]
            if imgs:
                raise ConfigError(
                    f"prompts[{i}] is token ids, which cannot carry images; pass the text or chat messages "
                    "with images=..., and kvlab inserts and expands the image tokens."
                )
            if not ids:
                raise ConfigError(f"prompts[{i}] is an empty list of token ids.")
            item.ids = ids
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
            _check_messages(prompt, i)
            sample = _chat_sample(prompt, i, imgs)
            if sample is not None:
                item.sample = sample
            elif imgs:
                raise ConfigError(
                    f"prompts[{i}]: images go with a string prompt or a chat of one user turn (after an "
                    "optional system turn) with string contents; this conversation has more turns."
                )
            else:
                item.ids = _render_chat(loaded, prompt)
        else:
            raise ConfigError(
                f"prompts[{i}] must be a string, a list of {{'role': ..., 'content': ...}} messages or token "
                f"ids (list of ints or a 1-D tensor), got {prompt!r}."
            )
        items.append(item)
    return items


def _prompt_list(prompts: Any) -> list[Any]:
    """One prompt or a list of prompts -> a list of prompts."""
    if isinstance(prompts, str | Sample):
        return [prompts]
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() == 1:
            return [prompts]
        if prompts.dim() == 2:
            return list(prompts)
        raise ConfigError(f"token-id prompts must be a 1-D or 2-D tensor, got shape {tuple(prompts.shape)}.")
    if not isinstance(prompts, Sequence) or not prompts:
        raise ConfigError(
            "prompts must be a non-empty list of prompts (strings, chat message lists or token-id lists), "
            f"or one prompt; got {prompts!r}."
        )
    if isinstance(prompts[0], int | Mapping):  # one token-id list or one conversation
        return [prompts]
    return list(prompts)


def _images_per_prompt(images: ImagesArg, count: int) -> list[list[Image.Image]]:
    if images is None:
        return [[] for _ in range(count)]
    if isinstance(images, Image.Image) and count == 1:
        images = [images]
    if isinstance(images, Image.Image) or not isinstance(images, Sequence) or len(images) != count:
        raise ConfigError(
            f"images must hold one entry per prompt ({count}): None, a PIL image or a list of PIL images; "
            f"got {images!r}."
        )
    out = []
    for i, entry in enumerate(images):
        entry = [] if entry is None else [entry] if isinstance(entry, Image.Image) else list(entry)
        if not all(isinstance(img, Image.Image) for img in entry):
            raise ConfigError(
                f"images[{i}] must be None, a PIL image or a list of PIL images, got {entry!r}."
            )
        out.append([img.convert("RGB") for img in entry])
    return out


def _is_token_ids(prompt: Any) -> bool:
    if isinstance(prompt, torch.Tensor):
        return prompt.dim() == 1 and not prompt.is_floating_point()
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        and len(prompt) > 0
    )


def _check_messages(messages: Sequence[Mapping[str, Any]], i: int) -> None:
    for j, message in enumerate(messages):
        if "role" not in message or "content" not in message:
            raise ConfigError(
                f"prompts[{i}][{j}] must be a chat message {{'role': 'user', 'content': '...'}}, "
                f"got {message!r}."
            )


def _chat_sample(messages: Sequence[Mapping[str, Any]], i: int, images: list[Image.Image]) -> Sample | None:
    """A Sample for ``[system?, user]`` with string contents (collate renders it identically), else None."""
    system = None
    rest = list(messages)
    if rest and rest[0]["role"] == "system" and isinstance(rest[0]["content"], str):
        system = rest.pop(0)["content"]
    if len(rest) != 1 or rest[0]["role"] != "user" or not isinstance(rest[0]["content"], str):
        return None
    return Sample(id=str(i), prompt=rest[0]["content"], images=images, system=system)


def _render_chat(loaded: LoadedModel, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """Token ids of a conversation through the processor's chat template (its ``chat_template``
    setting: the tokenizer's own or a file), assistant turn opened; a conversation cannot be
    passed raw, so a model without a template is refused."""
    processor = loaded.processor
    template = processor.template if isinstance(processor, PromptProcessor) else None
    if template is None:
        setting = processor.chat_template if isinstance(processor, PromptProcessor) else None
        raise ConfigError(
            f"prompts: a multi-turn chat needs a chat template, and model {loaded.info.name!r} has none in "
            f"use (chat_template={setting!r}). Pass a template file "
            "(wrap_model(..., chat_template='path/to/template.jinja')) or give the prompt as one string."
        )
    tokenizer = processor.tokenizer
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=True, tokenize=False, chat_template=template
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_batches(
    items: list[PromptItem], batch_size: int | None, by_context: bool
) -> list[list[PromptItem]]:
    """The batches ``items`` run in: those with a Sample first, then those with token ids (one kind
    per batch), each kind in batches of ``batch_size`` prompts (all when None), or of ``batch_size``
    whole contexts (every prompt of a ``context_id`` together) when ``by_context``."""
    samples = [item for item in items if item.sample is not None]
    ids = [item for item in items if item.sample is None]
    return _batches(samples, batch_size, by_context) + _batches(ids, batch_size, by_context)


def _batches(group: list[PromptItem], batch_size: int | None, by_context: bool) -> list[list[PromptItem]]:
    if not group:
        return []
    if by_context and group[0].sample is not None:
        indices = context_batches([item.sample.context_id for item in group], batch_size or len(group))
        return [[group[i] for i in batch] for batch in indices]
    step = batch_size or len(group)
    return [group[start : start + step] for start in range(0, len(group), step)]


def collate_items(loaded: LoadedModel, batch: list[PromptItem]) -> Batch:
    """One batch of :func:`prompt_batches` as the model's input batch: the processor's ``collate``
    of its Samples, or :func:`collate_ids` of its token ids."""
    if batch[0].sample is not None:
        return loaded.processor.collate([item.sample for item in batch])
    return collate_ids(loaded, [item.ids for item in batch])


def collate_ids(loaded: LoadedModel, rows: list[list[int]]) -> Batch:
    """Token-id prompts -> a left-padded batch in the processor's ``collate`` layout (no images).

    Returns ``input_ids`` / ``attention_mask`` / ``modality`` ``[B, T]`` and ``model_inputs`` (the
    image adapter's per-token inputs, e.g. Qwen2-VL's ``mm_token_type_ids`` ``[B, T]``).
    """
    processor = loaded.processor
    if not isinstance(processor, PromptProcessor):
        raise ConfigError(
            f"token-id and multi-turn prompts need kvlab's ChatProcessor; {type(processor).__name__} only "
            "takes string prompts."
        )
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), processor.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, width - len(row) :] = 1
    image_ids = torch.tensor(processor.image_token_ids, dtype=torch.long)
    video_ids = torch.tensor(processor.video_token_ids, dtype=torch.long)
    special = (torch.isin(input_ids, image_ids) | torch.isin(input_ids, video_ids)) & attention_mask.bool()
    if bool(special.any()):
        raise ConfigError(
            "a token-id or multi-turn prompt contains image/video tokens but carries no images; pass the "
            "prompt as a string or one-turn chat with images=..."
        )
    modality = torch.full_like(input_ids, TEXT)
    modality[attention_mask == 0] = PAD
    model_inputs: dict[str, Any] = {}
    if processor.images is not None:
        model_inputs = processor.images.batch_inputs(input_ids, image_ids, video_ids)
        for value in model_inputs.values():
            value[attention_mask == 0] = 0
    return Batch(input_ids, attention_mask, modality, model_inputs, [str(i) for i in range(len(rows))])
