"""Prompt lengths measured in tokens of the run's model, and fitting a generated prompt to a length.

A dataset whose lengths are in tokens (``synthetic_retrieval``'s ``context_tokens``, RULER's
``lengths``, the needle grid's lengths, LongBench's ``max_length`` truncation) declares a
``tokenizer: str | None`` field: the name of the model (built-in, local directory or Hub id)
whose tokenizer and chat template measure it. ``null`` means the run's ``model.model``: kvlab
passes it when it builds the dataset (``build_dataset(node, tokenizer=model)``), and a dataset
built without one refuses a length in tokens (:func:`require_tokenizer`).

The data layer does not load models: such a dataset also declares ``processors`` (a
:func:`~kvlab.config.registry.context_field`), a :class:`ProcessorSource` that gives the processor
of a model name. Whoever builds the dataset passes it: ``kvlab predict`` and ``kvlab calibrate``
give :data:`kvlab.models.PROCESSORS` (``build_dataset(node, tokenizer=model,
processors=PROCESSORS)``); a script building a dataset itself does the same.

What is counted (one rule for every suite, docs/benchmark_suites.md): the prompt as the model
sees it with ``data.chat_template: auto`` (the model's own chat template, system turn, assistant
header and answer prefix included: exactly the ids of ``ChatProcessor.prompt_ids``). A run
with ``data.chat_template: none`` or another template sees a prompt shorter or longer by the
template's markup (a few tens of tokens).

:func:`fit_units` finds the largest number of filler units (words, sentences, list items) whose
prompt fits a token budget, counting each candidate exactly (a bracketing search with
interpolation steps: about five tokenizations per prompt).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from kvlab.config.errors import ConfigError
from kvlab.data.sample import Sample

__all__ = [
    "ProcessorSource",
    "TokenCounter",
    "check_tokenizer_name",
    "fit_units",
    "require_tokenizer",
    "token_counter",
    "truncate_middle",
    "truncate_before_question",
]


@runtime_checkable
class PromptTokens(Protocol):
    """A processor that gives a sample's prompt ids without building tensors (kvlab's
    ``ChatProcessor``); any other processor is measured through its ``collate``."""

    def prompt_ids(self, sample: Sample) -> list[int]:
        """The ids the model sees for ``sample``'s prompt (chat template, answer prefix)."""
        ...


class ProcessorSource(Protocol):
    """Where a dataset gets the processor of the model its ``tokenizer`` field names
    (:data:`kvlab.models.PROCESSORS`)."""

    def check(self, name: str) -> None:
        """Raise :class:`ConfigError` unless ``name`` names a model; loads nothing."""
        ...

    def load(self, name: str) -> Any:
        """The processor of model ``name`` (its tokenizer and chat template; no weights)."""
        ...


class TokenCounter:
    """Counts tokens with the tokenizer (and chat template) of a model's processor.

    Args:
        name: the model's name (for messages).
        processor: its processor (a ``ChatProcessor``, or any processor with a ``tokenizer`` and
            ``collate``).
    """

    def __init__(self, name: str, processor: Any):
        self.name = name
        self.processor: Any = processor
        self.tokenizer: Any = processor.tokenizer

    def ids(self, text: str) -> list[int]:
        """Token ids of ``text`` alone (no special tokens)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def count_text(self, text: str) -> int:
        """Tokens of ``text`` alone (no special tokens, no chat template)."""
        return len(self.ids(text))

    def decode(self, ids: list[int]) -> str:
        """Text of token ids, special tokens skipped, spaces as encoded (no clean-up)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def count_prompt(self, sample: Sample) -> int:
        """Tokens of ``sample``'s prompt as the model sees it under ``data.chat_template: auto``:
        ``ChatProcessor.prompt_ids`` (the chat template with the assistant turn opened, the
        answer prefix after it), the ids ``collate`` feeds the model."""
        if isinstance(self.processor, PromptTokens):
            return len(self.processor.prompt_ids(sample))
        return int(self.processor.collate([sample]).input_ids.shape[-1])  # a custom processor


@functools.cache
def token_counter(name: str, processors: ProcessorSource) -> TokenCounter:
    """The (cached) :class:`TokenCounter` of model ``name``, its processor from ``processors``."""
    return TokenCounter(name, processors.load(name))


def check_tokenizer_name(
    name: str | None, processors: ProcessorSource | None, where: str = "data.dataset.tokenizer"
) -> None:
    """Validate a ``tokenizer`` field without loading anything (None is allowed; without a
    processor source the name is checked when the tokenizer is needed)."""
    if name is None or processors is None:
        return
    try:
        processors.check(name)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def require_tokenizer(
    name: str | None, processors: ProcessorSource | None, dataset: str, what: str
) -> TokenCounter:
    """The counter of ``name``; a :class:`ConfigError` when no tokenizer is known or no processor
    source was given.

    Args:
        name: the dataset's ``tokenizer`` field.
        processors: the dataset's ``processors`` (what loads the model's processor).
        dataset: the dataset's registered name (for the message).
        what: the field measured in tokens (for the message), e.g. ``context_tokens``.
    """
    if name is None:
        raise ConfigError(
            f"data.dataset.tokenizer is not set, but {dataset}'s `{what}` is measured in tokens. "
            "`kvlab predict` sets it to the run's model.model; when you build the dataset yourself "
            "(Python API, a custom script), pass `tokenizer: <model name>` (e.g. smollm2-135m)."
        )
    if processors is None:
        raise ConfigError(
            f"{dataset}'s `{what}` is measured in tokens of model {name!r}, but the dataset was built "
            "without a processor source to load that model's tokenizer. `kvlab predict` passes one; when "
            "you build the dataset yourself, pass `processors=kvlab.models.PROCESSORS` (with "
            "`tokenizer=<model name>`)."
        )
    return token_counter(name, processors)


def fit_units(
    length_of: Callable[[int], int], limit: int, start: int, lowest: int = 1
) -> tuple[int, int] | None:
    """The largest ``n >= lowest`` with ``length_of(n) <= limit``, and that length.

    ``length_of`` should grow with ``n`` (a prompt with ``n`` filler units); the answer always
    fits, and is the largest fitting ``n`` wherever ``length_of`` is non-decreasing. Returns
    None when even ``lowest`` units do not fit. The search brackets the answer from ``start``
    with steps sized by the measured tokens per unit, then alternates interpolation and
    bisection steps; each ``n`` is measured once.
    """
    cache: dict[int, int] = {}

    def f(n: int) -> int:
        if n not in cache:
            cache[n] = length_of(n)
        return cache[n]

    if f(lowest) > limit:
        return None
    n = max(start, lowest)
    rate = max(f(n) / max(n, 1), 1e-9)  # tokens per unit, roughly
    if f(n) <= limit:
        lo, step = n, max(1, int((limit - f(n)) / rate))
        while True:
            if f(lo + step) > limit:
                hi = lo + step
                break
            lo, step = lo + step, step * 2
    else:
        hi, step = n, max(1, int((f(n) - limit) / rate))
        while True:
            cand = max(lowest, hi - step)
            if f(cand) <= limit:
                lo = cand
                break
            hi, step = cand, step * 2
    bisect = False
    while hi - lo > 1:
        if bisect:
            mid = (lo + hi) // 2
        else:
            mid = lo + (limit - f(lo)) * (hi - lo) // max(f(hi) - f(lo), 1)
            mid = min(max(mid, lo + 1), hi - 1)
        bisect = not bisect
        if f(mid) <= limit:
            lo = mid
        else:
            hi = mid
    return lo, f(lo)


def truncate_middle(counter: TokenCounter, text: str, max_tokens: int) -> tuple[str, int]:
    """``text`` cut to its first and last ``max_tokens // 2`` tokens when longer than
    ``max_tokens`` (LongBench ``pred.py``, InfiniteBench ``truncate_input``, LooGLE); returns
    ``(text, tokens dropped)``."""
    ids = counter.ids(text)
    if len(ids) <= max_tokens:
        return text, 0
    half = max_tokens // 2
    return counter.decode(ids[:half]) + counter.decode(ids[-half:]), len(ids) - 2 * half


def truncate_before_question(
    counter: TokenCounter, prompt: str, question: str, max_tokens: int, row: str
) -> tuple[str, int]:
    """:func:`truncate_middle` of a prompt ending with ``question``, which the cut must leave whole.

    Raises:
        ConfigError: the cut reaches into the question (``row`` names the task and row).
    """
    prompt, dropped = truncate_middle(counter, prompt, max_tokens)
    if not prompt.endswith(question):
        raise ConfigError(
            f"data.dataset.max_length: cutting {row} to {max_tokens} tokens cuts into its question (the "
            "text after the context); raise max_length."
        )
    return prompt, dropped
