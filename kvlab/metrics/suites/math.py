"""Math answers checked by Hugging Face's Math-Verify (``math-verify``; Kydlíček et al. 2025,
huggingface/Math-Verify, the checker of open-r1 and lighteval's math tasks).

``math_verify_accuracy``: 1 when ``verify(gold, prediction)`` holds, where ``gold =
parse("$" + answer + "$")`` (the reference answer as LaTeX) and ``prediction = parse(output)``
with Math-Verify's default extraction (LaTeX, a ``\\boxed{}`` first, then plain expressions),
else 0: an output with no extractable answer scores 0. Math-Verify is an optional dependency
(the ``math`` extra): a run without it is refused before any model loads, naming the install
command; a reference answer Math-Verify cannot parse is refused too (the official
``math_metric`` raises on it).

Registered in :data:`kvlab.metrics.tasks.TASK_METRICS` when imported (``kvlab.metrics`` imports it).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from kvlab.config.errors import ConfigError
from kvlab.data.sample import Sample
from kvlab.metrics.tasks import register_task_metrics

__all__ = ["MATH_VERIFY_INSTALL", "math_verify_accuracy"]

MATH_VERIFY_INSTALL = "pip install 'kvlab[math]' (or pip install math-verify==0.9.0)"


def _math_verify() -> Any:
    try:
        import math_verify  # optional dependency (the math extra): answer extraction and checking
    except ImportError:
        raise ConfigError(f"math_verify_accuracy needs Math-Verify: {MATH_VERIFY_INSTALL}.") from None
    return math_verify


@lru_cache(maxsize=4096)
def _gold(answer: str) -> Any:
    return _math_verify().parse(f"${answer}$")


def math_verify_accuracy(output: str, sample: Sample) -> float | None:
    """1.0 when Math-Verify finds the output's answer equal to the first reference answer."""
    if not sample.answers:
        return None
    math_verify = _math_verify()
    prediction = math_verify.parse(output)
    return float(bool(prediction) and math_verify.verify(_gold(sample.answers[0]), prediction))


def _check(sample: Sample) -> str | None:
    if not sample.answers:
        return None
    try:
        _math_verify()
    except ConfigError:
        return f"it is checked by Math-Verify, which is not installed: {MATH_VERIFY_INSTALL}"
    if not _gold(sample.answers[0]):
        return f"Math-Verify cannot parse its reference answer {sample.answers[0]!r}"
    return None


register_task_metrics({"math_verify_accuracy": math_verify_accuracy}, {"math_verify_accuracy": _check})
