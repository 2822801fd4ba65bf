"""Per-sample task scores: the task-metric registry and the generic metrics.

The benchmark suites' metrics register themselves here with :func:`register_task_metrics`
when their modules are imported; importing the package (``import kvlab.metrics``, which any
``kvlab.metrics.*`` import does first) imports every suite, so this module never imports them.

A dataset names its metrics with a ``metrics`` attribute (YAML: ``data.dataset: {name: jsonl,
path: x.jsonl, metrics: [exact_match, token_f1]}``); datasets without one get
:data:`DEFAULT_TASK_METRICS`. Each metric maps ``(output text, Sample)`` to a score in [0, 1],
or None when the sample cannot be scored (no answers; no choices for ``choice_accuracy``).
Definitions (answers are the sample's reference answers; the best answer counts):

- ``exact_match``: normalised output == a normalised answer;
- ``contains_answer``: a normalised answer occurs in the normalised output;
- ``token_f1``: SQuAD token F1 of output vs answer words;
- ``rouge_l``: ROUGE-L F1 of output vs answer words;
- ``choice_accuracy``: the option the output picks (:func:`picked_choice`) is the answer's option.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Iterable
from typing import Any

from kvlab.config.errors import ConfigError, did_you_mean
from kvlab.data.sample import Sample
from kvlab.metrics.means import SampleMeans
from kvlab.metrics.text import normalize_answer, rouge_l, token_f1, words

__all__ = [
    "DEFAULT_TASK_METRICS",
    "SCORED_SAMPLES",
    "SAMPLE_CHECKS",
    "TASK_METRICS",
    "check_task_samples",
    "normalize_answer",
    "picked_choice",
    "register_task_metrics",
    "score_output",
    "validate_task_metrics",
]

DEFAULT_TASK_METRICS: tuple[str, ...] = ("exact_match", "contains_answer")
LETTERS = string.ascii_lowercase


def _best(output: str, sample: Sample, score: Callable[[str, str], float]) -> float | None:
    if not sample.answers:
        return None
    return max(score(output, answer) for answer in sample.answers)


def choice_index(text: str, choices: list[str]) -> int | None:
    """Option named by ``text``: a letter label ("B", "(b)", "b.") or an option's text."""
    norm = [normalize_answer(c) for c in choices]
    tokens = text.strip().lower().lstrip("(").split()
    if tokens:
        head = tokens[0].rstrip(").:,")
        if len(head) == 1 and head in LETTERS[: len(choices)]:
            return LETTERS.index(head)
    target = normalize_answer(text)
    return norm.index(target) if target in norm else None


def picked_choice(output: str, choices: list[str]) -> int | None:
    """The option an output picks: a leading letter label, else the option text found earliest."""
    index = choice_index(output, choices)
    if index is not None:
        return index
    text = f" {normalize_answer(output)} "
    found = [
        (text.find(f" {normalize_answer(c)} "), i)
        for i, c in enumerate(choices)
        if normalize_answer(c) and f" {normalize_answer(c)} " in text
    ]
    return min(found)[1] if found else None


def _choice_accuracy(output: str, sample: Sample) -> float | None:
    if not sample.choices or not sample.answers:
        return None
    answer = choice_index(sample.answers[0], sample.choices)
    return float(answer is not None and picked_choice(output, sample.choices) == answer)


def _exact(output: str, answer: str) -> float:
    return float(normalize_answer(output) == normalize_answer(answer))


def _contains(output: str, answer: str) -> float:
    target = normalize_answer(answer)
    return float(bool(target) and target in normalize_answer(output))


def _counts_to(output: str, answer: str) -> float:
    """1 when the output counts up to the answer ``N`` and stops there: its integers (runs of
    digits) hold 1, 2, ..., N in order (other numbers may come between) and the last one is N."""
    if not answer.strip().isdigit():
        return 0.0
    target = int(answer)
    found = [int(n) for n in re.findall(r"\d+", output)]
    expected = 1
    for n in found:
        if expected <= target and n == expected:
            expected += 1
    return float(expected > target and bool(found) and found[-1] == target)


def _counts_to_check(sample: Sample) -> str | None:
    if sample.answers and not all(a.strip().isdigit() for a in sample.answers):
        return f"its answers {sample.answers!r} are not all whole numbers (the count to reach)"
    return None


def _per_answer(score: Callable[[str, str], float]) -> Callable[[str, Sample], float | None]:
    """A metric scoring the output against each answer and keeping the best."""
    return lambda output, sample: _best(output, sample, score)


def _choice_check(sample: Sample) -> str | None:
    if not sample.answers:
        return None
    if not sample.choices:
        return "it has reference answers but no choices"
    if choice_index(sample.answers[0], sample.choices) is None:
        return f"its answer {sample.answers[0]!r} is neither a letter label nor one of its choices"
    return None


#: a metric's check of a sample: None when it can score it (or the sample has nothing to score,
#: e.g. no answers), else why not (the run refuses the dataset before any model loads)
SampleCheck = Callable[[Sample], str | None]

TASK_METRICS: dict[str, Callable[[str, Sample], float | None]] = {
    "exact_match": _per_answer(_exact),
    "contains_answer": _per_answer(_contains),
    "counts_to_answer": _per_answer(_counts_to),
    "token_f1": _per_answer(lambda o, a: token_f1(words(o), words(a))),
    "rouge_l": _per_answer(lambda o, a: rouge_l(words(o), words(a))),
    "choice_accuracy": _choice_accuracy,
}
#: the registered metrics' sample checks (a metric without one scores every sample it applies to)
SAMPLE_CHECKS: dict[str, SampleCheck] = {
    "choice_accuracy": _choice_check,
    "counts_to_answer": _counts_to_check,
}


def register_task_metrics(
    metrics: dict[str, Callable[[str, Sample], float | None]], checks: dict[str, SampleCheck] | None = None
) -> None:
    """Add metrics to :data:`TASK_METRICS` (a benchmark suite's module calls it when imported),
    and their sample checks to :data:`SAMPLE_CHECKS` (what a sample must hold to be scored).

    Raises:
        ValueError: a name is registered already (two suites must not share a metric name), or
            a check names no metric being registered.
    """
    taken = sorted(set(metrics) & set(TASK_METRICS))
    if taken:
        raise ValueError(f"task metrics registered twice: {', '.join(taken)}")
    orphans = sorted(set(checks or {}) - set(metrics))
    if orphans:
        raise ValueError(f"sample checks for metrics not being registered: {', '.join(orphans)}")
    TASK_METRICS.update(metrics)
    SAMPLE_CHECKS.update(checks or {})


def check_task_samples(names: Iterable[str], samples: Iterable[Sample], where: str = "data.dataset") -> None:
    """Refuse a dataset whose sample lacks what one of its task metrics needs (naming the sample).

    Called by the run after :func:`validate_task_metrics`, before any model loads. A sample
    without answers passes (it is not scored; ``task_samples`` in ``metrics.json`` counts it out).

    Raises:
        ConfigError: the first sample a metric's :data:`SAMPLE_CHECKS` entry refuses.
    """
    checks = [(name, SAMPLE_CHECKS[name]) for name in dict.fromkeys(names) if name in SAMPLE_CHECKS]
    for sample in samples if checks else ():
        for name, check in checks:
            reason = check(sample)
            if reason is not None:
                raise ConfigError(
                    f"{where}: sample '{sample.id}' cannot be scored by task metric '{name}': {reason}. "
                    "Fix the row, or name a metric that scores it in data.dataset.metrics."
                )


def validate_task_metrics(names: Iterable[str], where: str = "data.dataset.metrics") -> tuple[str, ...]:
    """Check metric names against :data:`TASK_METRICS`; returns them as a tuple."""
    if isinstance(names, str):
        names = [names]
    names = tuple(names)
    for name in names:
        if name not in TASK_METRICS:
            raise ConfigError(
                f"{where}: unknown task metric '{name}'.{did_you_mean(str(name), list(TASK_METRICS))} "
                f"Task metrics: {', '.join(TASK_METRICS)}."
            )
    return names


def score_output(
    output: str, sample: Sample, names: Iterable[str] = DEFAULT_TASK_METRICS
) -> dict[str, float]:
    """``{metric: score}`` for the named metrics that apply to the sample (empty without answers)."""
    scores = {name: TASK_METRICS[name](output, sample) for name in names}
    return {name: value for name, value in scores.items() if value is not None}


#: the ``metrics.json`` key of ``{task metric: number of samples it scored}``
SCORED_SAMPLES = "task_samples"


class TaskScores(SampleMeans):
    """Mean of every registered task metric (:data:`TASK_METRICS`) over the samples scored with it.

    A state per registered name (not per dataset) keeps every DDP rank's states identical;
    names never scored are left out of :meth:`compute`, which also returns
    ``{SCORED_SAMPLES: {name: samples scored}}`` so a mean over fewer samples than the run's
    is visible.
    """

    def __init__(self, **kwargs: Any):
        super().__init__(tuple(TASK_METRICS), **kwargs)

    def compute(self) -> dict[str, Any]:  # type: ignore[override]
        out: dict[str, Any] = super().compute()
        counts = {name: int(getattr(self, f"{name}_count")) for name in self.fields if name in out}
        if counts:
            out[SCORED_SAMPLES] = counts
        return out
