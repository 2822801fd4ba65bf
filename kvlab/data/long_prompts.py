"""Prompts longer than the model's context (``data.long_prompts``): measured with the model's
processor, refused or cut at the left.

The processor is passed in by the caller (the data module holds the run model's), so this module
measures a prompt exactly as the model sees it without knowing where processors come from.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvlab.config.errors import ConfigError
from kvlab.data.sample import Sample
from kvlab.data.tokens import PromptTokens

#: the values of ``data.long_prompts``
LONG_PROMPTS = ("refuse", "truncate_left")


def prompt_length(processor: Any, sample: Sample) -> int:
    """Tokens of ``sample``'s full prompt (chat template, images expanded), as the model sees it.
    A text-only sample is tokenized without building tensors."""
    if not sample.images and isinstance(processor, PromptTokens):
        return len(processor.prompt_ids(sample))
    return int(processor.collate([sample]).input_ids.shape[-1])


def truncate_left(processor: Any, sample: Sample, limit: int) -> tuple[Sample, int]:
    """``sample`` with the fewest leading words of its prompt dropped so that it fits ``limit``
    tokens; returns ``(sample, words dropped)``. Only context words are dropped: a sample's
    ``question`` stays whole. Raises :class:`ConfigError` when even the empty context (chat
    template, system message, images, question, answer prefix) does not fit."""
    words = sample.context.split(" ")
    question = sample.question or ""

    def cut(k: int) -> Sample:
        return replace(sample, prompt=" ".join(words[k:]) + question)

    if prompt_length(processor, cut(len(words))) > limit:
        raise ConfigError(
            f"sample '{sample.id}': even with its whole prompt text before the question removed, the chat "
            f"template, system message, images, question and answer prefix take more than the model's "
            f"context of {limit} tokens, so data.long_prompts = truncate_left cannot make it fit. Remove "
            "images or the system message from this sample, or use a model with a longer context."
        )
    low, high = 0, len(words)  # invariant: cut(high) fits
    while low < high:
        mid = (low + high) // 2
        if prompt_length(processor, cut(mid)) <= limit:
            high = mid
        else:
            low = mid + 1
    return cut(high), high
