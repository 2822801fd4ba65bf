"""LooGLE's task metrics (Li et al. 2024, "LooGLE: Can Long-Context Language Models Understand
Long Contexts?"; bigai-nlco/LooGLE ``Evaluation/automatic_metrics.py``).

``loogle_bleu1``, ``loogle_bleu4`` (NLTK ``sentence_bleu`` without smoothing), ``loogle_rouge1``,
``loogle_rouge2``, ``loogle_rouge_l`` (the ``rouge`` package's *recall*, the reference's default
``metric="r"``) for the QA and summarisation tasks; ``loogle_cloze_exact`` and
``loogle_cloze_partial`` (share of masks filled exactly / with a shared word, per sample and then
averaged over samples; the reference pools the masks of every question) for ``shortdep_cloze``.
METEOR (needs WordNet) and BERTScore (needs RoBERTa-large) are not implemented.

Registered in :data:`kvlab.metrics.tasks.TASK_METRICS` when imported (``kvlab.metrics`` imports it).
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from typing import Any

from kvlab.data.sample import Sample
from kvlab.metrics.bleu import bleu
from kvlab.metrics.rouge import rouge_package_scores
from kvlab.metrics.tasks import register_task_metrics

__all__ = [
    "LOOGLE_CLOZE_TASK",
    "cloze_counts",
    "parse_cloze",
]


def _loogle_words(text: str) -> list[str]:
    return text.replace("\n", " ").split()


LOOGLE_CLOZE_TASK = "shortdep_cloze"


def _loogle_text_metric(score: Callable[[str, str], float]) -> Callable[[str, Sample], float | None]:
    """A LooGLE similarity metric: QA and summarisation samples only; an empty output reads "None"
    (``automatic_eval.py``); the best answer counts."""

    def metric(output: str, sample: Sample) -> float | None:
        if not sample.answers or sample.meta.get("task") == LOOGLE_CLOZE_TASK:
            return None
        hypothesis = output if output != "" else "None"
        return max(score(answer, hypothesis) for answer in sample.answers)

    return metric


def _loogle_rouge(key: str) -> Callable[[str, str], float]:
    def score(reference: str, hypothesis: str) -> float:
        try:
            return rouge_package_scores(hypothesis, reference)[key]["r"]
        except (ValueError, ZeroDivisionError):  # the reference lets it raise; kvlab scores 0
            return 0.0

    return score


def parse_cloze(output: str) -> dict[Any, Any] | None:
    """The output as a Python dict literal (``ast.literal_eval``; LooGLE calls ``eval``), or None."""
    try:
        value = ast.literal_eval(output)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def cloze_counts(output: str, reference: dict[str, str]) -> tuple[int, int, int]:
    """``(exact, partial, masks)``: LooGLE's ``get_exact_match`` / ``get_partial_match`` counts."""
    hypothesis = parse_cloze(output)
    if hypothesis is None:
        return 0, 0, len(reference)
    exact = sum(1 for key in reference if key in hypothesis and hypothesis[key] == reference[key])
    partial = 0
    for key in reference:
        if key in hypothesis:
            shared = set(str(reference[key]).split()) & set(str(hypothesis[key]).split())
            partial += int(len(shared) > 0)
    return exact, partial, len(reference)


def _loogle_cloze(which: int) -> Callable[[str, Sample], float | None]:
    def metric(output: str, sample: Sample) -> float | None:
        reference = sample.meta.get("cloze_answer")
        if not isinstance(reference, dict) or not reference:
            return None
        counts = cloze_counts(output, reference)
        return counts[which] / counts[2]

    return metric


register_task_metrics(
    {
        "loogle_bleu1": _loogle_text_metric(
            lambda ref, hyp: bleu([_loogle_words(ref)], _loogle_words(hyp), (1, 0, 0, 0))
        ),
        "loogle_bleu4": _loogle_text_metric(
            lambda ref, hyp: bleu([_loogle_words(ref)], _loogle_words(hyp), (0, 0, 0, 1))
        ),
        "loogle_rouge1": _loogle_text_metric(_loogle_rouge("rouge-1")),
        "loogle_rouge2": _loogle_text_metric(_loogle_rouge("rouge-2")),
        "loogle_rouge_l": _loogle_text_metric(_loogle_rouge("rouge-l")),
        "loogle_cloze_exact": _loogle_cloze(0),
        "loogle_cloze_partial": _loogle_cloze(1),
    }
)
