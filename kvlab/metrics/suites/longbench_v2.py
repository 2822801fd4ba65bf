"""LongBench v2's task metric (Bai et al. 2025, "LongBench v2: Towards Deeper Understanding and
Reasoning on Realistic Long-context Multitasks"; THUDM/LongBench ``pred.py``, ``result.py`` at
commit 2e00731).

``longbench_v2_accuracy``: 1 when the letter :func:`extract_answer` reads from the output is the
answer's, else 0 (``pred.py``'s ``judge``; an output it cannot read scores 0, as ``result.py``
counts it without ``compensated``). ``pred.py`` leaves an empty output out of its results file;
kvlab scores it 0 instead, so no sample leaves the mean (``docs/benchmark_suites.md``).

Registered in :data:`kvlab.metrics.tasks.TASK_METRICS` when imported (``kvlab.metrics`` imports it).
"""

from __future__ import annotations

import re

from kvlab.data.sample import Sample
from kvlab.metrics.tasks import register_task_metrics

__all__ = ["extract_answer", "longbench_v2_accuracy"]

_PARENTHESISED = re.compile(r"The correct answer is \(([A-D])\)")
_BARE = re.compile(r"The correct answer is ([A-D])")


def extract_answer(response: str) -> str | None:
    """``pred.py``'s ``extract_answer``: drop ``*``, then the letter of "The correct answer is (X)",
    else of "The correct answer is X" (first match, case kept); None when neither occurs."""
    response = response.replace("*", "")
    for pattern in (_PARENTHESISED, _BARE):
        match = pattern.search(response)
        if match:
            return match.group(1)
    return None


def longbench_v2_accuracy(output: str, sample: Sample) -> float | None:
    """1.0 when :func:`extract_answer` of the stripped output is the sample's answer letter."""
    if not sample.answers:
        return None
    return float(extract_answer(output.strip()) == sample.answers[0])


def _check(sample: Sample) -> str | None:
    if sample.answers and sample.answers[0] not in ("A", "B", "C", "D"):
        return f"a LongBench v2 answer is a letter A-D, got {sample.answers[0]!r}"
    return None


register_task_metrics({"longbench_v2_accuracy": longbench_v2_accuracy}, {"longbench_v2_accuracy": _check})
