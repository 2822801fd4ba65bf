"""RULER's task metrics (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?"; NVIDIA/RULER ``scripts/eval/synthetic/constants.py`` and
``scripts/eval/evaluate.py``).

- ``string_match_all``: mean over the references of "reference in output" (case-insensitive);
- ``string_match_part``: max over the references of the same test.
  The output is first stripped and its control characters (``\\x00``-``\\x1f``) replaced by
  newlines (``postprocess_pred``).

Registered in :data:`kvlab.metrics.tasks.TASK_METRICS` when imported (``kvlab.metrics`` imports it).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from kvlab.data.sample import Sample
from kvlab.metrics.tasks import register_task_metrics

__all__ = [
    "ruler_postprocess",
    "string_match_all",
    "string_match_part",
]


_CONTROL = re.compile(r"[\x00-\x1f]")


def ruler_postprocess(output: str) -> str:
    """RULER's ``postprocess_pred``: strip, control characters to newlines, strip again."""
    return _CONTROL.sub("\n", output.strip()).strip()


def string_match_all(output: str, references: Sequence[str]) -> float:
    """Mean over ``references`` of ``ref.lower() in output.lower()`` (RULER ``string_match_all``)."""
    text = output.lower()
    return sum(1.0 if r.lower() in text else 0.0 for r in references) / len(references)


def string_match_part(output: str, references: Sequence[str]) -> float:
    """Max over ``references`` of ``ref.lower() in output.lower()`` (RULER ``string_match_part``)."""
    text = output.lower()
    return max(1.0 if r.lower() in text else 0.0 for r in references)


def _ruler_metric(match: Callable[[str, Sequence[str]], float]) -> Callable[[str, Sample], float | None]:
    def metric(output: str, sample: Sample) -> float | None:
        if not sample.answers:
            return None
        return match(ruler_postprocess(output), sample.answers)

    return metric


register_task_metrics(
    {
        "string_match_all": _ruler_metric(string_match_all),
        "string_match_part": _ruler_metric(string_match_part),
    }
)
