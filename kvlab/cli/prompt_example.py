"""The prompt example a command prints: what the model sees for a sample, its middle elided.

``kvlab predict`` prints (and writes to ``prompt_example.txt``) the first sample's prompt as the
model sees it (:func:`describe_prompt`); ``kvlab check-model`` prints its prompt's ends (:func:`elide`).
"""

from __future__ import annotations

from typing import Any

from kvlab.data.sample import Sample
from kvlab.models.base import PromptProcessor

#: characters of a prompt example kept at each end before the middle is elided
EXAMPLE_KEEP = 200
#: the line a prompt example shows between the context and the question part
QUESTION_LINE = "\n[--- question part: prefilled after compression by query_agnostic / multi_question ---]\n"


def elide(text: str, keep: int = EXAMPLE_KEEP) -> str:
    """``text`` with its middle replaced by a marker when longer than ``2 * keep`` characters
    (the first and last ``keep`` characters are kept)."""
    if len(text) <= 2 * keep:
        return text
    return f"{text[:keep]}\n[... {len(text) - 2 * keep} characters elided ...]\n{text[-keep:]}"


def describe_prompt(processor: Any, sample: Sample) -> tuple[str, int]:
    """What the model sees for ``sample``: ``(text, token count)``.

    The text is the batch's token ids decoded with special tokens visible (BOS, chat markers, image
    tokens), its middle elided past ``2 * EXAMPLE_KEEP`` characters; the count is the prompt's tokens.
    A sample with a ``question`` shows its context and its question part (question, assistant
    opening, answer prefix) on either side of :data:`QUESTION_LINE`, each elided on its own.
    """
    ids = processor.collate([sample]).input_ids[0]
    tokens = [int(t) for t in ids.tolist()]
    if not isinstance(processor, PromptProcessor):  # a custom processor: the ids themselves
        return elide(" ".join(map(str, tokens))), len(tokens)
    tokenizer = processor.tokenizer
    if sample.question is not None:
        split = processor.context_token_count(sample, tokens)
        parts = (tokens[:split], tokens[split:])
        context, question = (tokenizer.decode(p, skip_special_tokens=False) for p in parts)
        return elide(context) + QUESTION_LINE + elide(question), len(tokens)
    return elide(tokenizer.decode(tokens, skip_special_tokens=False)), len(tokens)
