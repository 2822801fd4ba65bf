"""The needle-in-a-haystack metric (Kamradt 2023, gkamradt/LLMTest_NeedleInAHaystack, scored
there by an LLM judge).

``needle_rouge1`` is NVIDIA/kvpress's replacement (``evaluation/benchmarks/
needle_in_haystack/calculate_metrics.py``): the ROUGE-1 F-measure of the output against the
needle, tokenised as Google's ``rouge_score`` does, without its Porter stemmer (kvpress's
``use_stemmer=True``), in [0, 1] (kvpress multiplies by 10).

Registered in :data:`kvlab.metrics.tasks.TASK_METRICS` when imported (``kvlab.metrics`` imports it).
"""

from __future__ import annotations

from kvlab.data.sample import Sample
from kvlab.metrics.rouge import rouge_n_score
from kvlab.metrics.tasks import register_task_metrics

__all__ = [
    "needle_rouge1",
]


def needle_rouge1(output: str, sample: Sample) -> float | None:
    """ROUGE-1 F of the output against the needle (the sample's first answer), in [0, 1]."""
    if not sample.answers:
        return None
    return rouge_n_score(output, sample.answers[0], 1)


register_task_metrics({"needle_rouge1": needle_rouge1})
