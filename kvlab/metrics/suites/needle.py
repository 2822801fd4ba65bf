"""The needle-in-a-haystack metric (Kamradt 2023, gkamradt/LLMTest_NeedleInAHaystack, scored
there by an LLM judge).

``needle_rouge1`` is NVIDIA/kvpress's replacement (``evaluation/benchmarks/needle_in_haystack/
calculate_metrics.py``, commits ab418ac to 8bb29b9): ``Rouge().get_scores(needle.strip(),
output.strip())`` of the ``rouge`` package (pltrdy/rouge 1.0.1: sentences split at periods,
words as sets, case kept), its ROUGE-1 F-measure, in [0, 1]. Where the package raises (an
output with no sentence: empty, or only periods) kvpress's run fails; kvlab scores 0.

Registered in :data:`kvlab.metrics.tasks.TASK_METRICS` when imported (``kvlab.metrics`` imports it).
"""

from __future__ import annotations

from kvlab.data.sample import Sample
from kvlab.metrics.rouge import rouge_package_scores
from kvlab.metrics.tasks import register_task_metrics

__all__ = ["needle_rouge1"]


def needle_rouge1(output: str, sample: Sample) -> float | None:
    """ROUGE-1 F of the output against the needle (the sample's first answer), in [0, 1]."""
    if not sample.answers:
        return None
    try:
        return rouge_package_scores(sample.answers[0].strip(), output.strip())["rouge-1"]["f"]
    except ValueError:  # no sentence in the output: kvpress' scorer raises
        return 0.0


register_task_metrics({"needle_rouge1": needle_rouge1})
