"""The unit of data kvlab works on: one prompt (text plus optional images) and its references."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from kvlab.config.errors import ConfigError


@dataclass
class Sample:
    """One prompt to run.

    Attributes:
        id: unique identifier within the dataset (predictions are keyed and resumed by it).
        prompt: the user's text. Images, if any, are placed before the text in the user turn.
        images: PIL images (already opened and converted to RGB).
        answers: reference answers (empty when the dataset has none).
        choices: options for multiple-choice questions (empty otherwise).
        system: optional system message.
        meta: free-form fields carried into the predictions file (e.g. needle position).
        question: the trailing part of ``prompt`` that asks the question (``prompt`` ends with it
            exactly), or None when the dataset does not separate it. Protocols other than
            ``query_aware`` compress ``prompt`` minus ``question`` (the context) alone and
            prefill the question afterwards, uncompressed (docs/protocols.md).
        answer_prefix: text that starts the assistant's turn (e.g. ``"Answer:"``); it is part of
            the prompt the model continues, never compressed by ``query_agnostic``.
        max_new_tokens: this sample's generation limit (benchmarks fix it per task); None uses
            ``model.max_new_tokens``.
        context_id: samples with the same ``context_id`` share one context (the same ``prompt``
            minus ``question``, the same images): ``multi_question`` compresses it once for all
            of them. None: the sample's context is its own.
    """

    id: str
    prompt: str
    images: list[Image.Image] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    choices: list[str] = field(default_factory=list)
    system: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    question: str | None = None
    answer_prefix: str = ""
    max_new_tokens: int | None = None
    context_id: str | None = None

    def __post_init__(self) -> None:
        if self.question is not None and not self.prompt.endswith(self.question):
            raise ValueError(
                f"sample {self.id!r}: its prompt must end with its question (the question is the part a "
                "query-agnostic run prefills after compressing the context)"
            )

    @property
    def context(self) -> str:
        """``prompt`` without its trailing ``question`` (the whole prompt when there is none)."""
        return self.prompt[: len(self.prompt) - len(self.question)] if self.question else self.prompt


def own_limits(samples: Sequence[Sample], limit: int) -> list[Sample]:
    """The samples that decode under their own ``max_new_tokens`` (a benchmark's answer length for
    its task), not under ``limit``: those whose own limit is set and differs from it."""
    return [s for s in samples if s.max_new_tokens is not None and s.max_new_tokens != limit]


def describe_own_limits(samples: Sequence[Sample], limit: int, total: int) -> str:
    """``"3 of the 8 samples carry their own answer limit (32 to 128 tokens)"``: what
    :func:`own_limits` found, for a note or a refusal (empty when every sample decodes under ``limit``)."""
    own = own_limits(samples, limit)
    if not own:
        return ""
    low, high = min(s.max_new_tokens or 0 for s in own), max(s.max_new_tokens or 0 for s in own)
    span = f"{low} tokens" if low == high else f"{low} to {high} tokens"
    carry = "carries its" if len(own) == 1 else "carry their"
    return f"{len(own)} of the {total} samples {carry} own answer limit ({span})"


def refuse_unused_limit(samples: Sequence[Sample], limit: int, field: str, fix: str) -> None:
    """Refuse a ``max_new_tokens`` the user gave explicitly (``field``: where) that some samples
    would not decode under: a sample's own limit (a benchmark's protocol length, a row's
    ``max_new_tokens``) always wins, so the run would answer another question than the one asked.

    Raises:
        ConfigError: how many samples, their limits, and ``fix``.
    """
    found = describe_own_limits(samples, limit, len(samples))
    if found:
        raise ConfigError(
            f"{field} = {limit} would not apply: {found}, which kvlab decodes under instead (a sample's own "
            f"limit is its benchmark's protocol and always wins). {fix}"
        )


def require_questions(samples: Sequence[Sample], why: str) -> None:
    """Refuse samples that do not mark their question (``Sample.question``) in a run that compresses
    each context apart from its question (``why`` names it): the split would put the question in the
    context, and the run would measure a query-aware compression under another name.

    Raises:
        ConfigError: the first samples without a question, and the fix.
    """
    missing = [s.id for s in samples if not s.question]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        listed = ", ".join(repr(i) for i in missing[:3]) + more
        raise ConfigError(
            f"{why} compresses each context apart from its question, but samples {listed} do not mark "
            "their question (Sample.question, the trailing part of the prompt): the question would be "
            "compressed with the context, which is a query-aware run. Use a dataset that marks it (the "
            "`kvpress` schema's context and question fields, the built-in tasks), or "
            "`model.protocol: query_aware` with a method that compresses the whole prompt."
        )
