"""LongBench v1's task metrics (Bai et al. 2024, "LongBench: A Bilingual, Multitask Benchmark
for Long Context Understanding"; THUDM/LongBench ``metrics.py`` and ``eval.py``).

``longbench_score`` applies the task's metric of ``eval.py``'s ``dataset2metric`` (the task is
``Sample.meta["task"]``), after keeping only the first line of the output for trec, triviaqa,
samsum and lsht, and keeps the best answer. The per-metric names (``longbench_qa_f1``,
``longbench_rouge_l``, ``longbench_classification``, ``longbench_retrieval``,
``longbench_retrieval_zh``, ``longbench_count``, ``longbench_code_sim``) apply one metric to any
sample (the same post-processing when the sample's task is a LongBench task); see each
function. The Chinese tasks multifieldqa_zh, dureader and vcsum are scored on jieba's words
(``qa_f1_zh_score``, ``rouge_zh_score``; ``longbench_qa_f1_zh``, ``longbench_rouge_zh``), which
needs the ``zh`` extra: without jieba the run is refused before any model loads, naming the
install command. ``longbench_qa_f1`` and ``longbench_rouge_l`` split words on whitespace, so they
refuse a Chinese sample (a Chinese task, ``language: zh``, or an answer in Chinese).

Registered in :data:`kvlab.metrics.tasks.TASK_METRICS` when imported (``kvlab.metrics`` imports it).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Sequence

from kvlab.data.sample import Sample
from kvlab.metrics.rouge import rouge_package_scores
from kvlab.metrics.tasks import register_task_metrics
from kvlab.metrics.text import (
    JIEBA_INSTALL,
    chinese_words,
    counter_f1,
    has_chinese,
    jieba_available,
    normalize_zh_answer,
    qa_f1_score,
)

__all__ = [
    "LONGBENCH_FIRST_LINE_TASKS",
    "LONGBENCH_METRIC",
    "classification_score",
    "code_sim_score",
    "count_score",
    "fuzz_ratio",
    "longbench_postprocess",
    "longbench_rouge_score",
    "longbench_score",
    "longbench_task",
    "qa_f1_zh_score",
    "retrieval_score",
    "rouge_zh_score",
]


def longbench_rouge_score(prediction: str, ground_truth: str) -> float:
    """LongBench ``rouge_score``: the ``rouge`` package's ROUGE-L F, 0 when it raises."""
    try:
        return rouge_package_scores(prediction, ground_truth)["rouge-l"]["f"]
    except (ValueError, ZeroDivisionError):
        return 0.0


def rouge_zh_score(prediction: str, ground_truth: str) -> float:
    """LongBench ``rouge_zh_score``: :func:`longbench_rouge_score` of the jieba words joined by spaces."""
    return longbench_rouge_score(" ".join(chinese_words(prediction)), " ".join(chinese_words(ground_truth)))


def qa_f1_zh_score(prediction: str, ground_truth: str) -> float:
    """LongBench ``qa_f1_zh_score``: :func:`counter_f1` of the jieba words, each normalised by
    :func:`normalize_zh_answer` (no punctuation, no whitespace), empty ones dropped."""

    def tokens(text: str) -> list[str]:
        return [t for t in (normalize_zh_answer(w) for w in chinese_words(text)) if t]

    return counter_f1(tokens(prediction), tokens(ground_truth))


def classification_score(prediction: str, ground_truth: str, all_classes: Sequence[str]) -> float:
    """LongBench ``classification_score``: the class names found in the output, less those
    contained in (and different from) the answer; ``1 / #found`` when the answer is among them.

    Quirks kept: names are removed from the list while it is iterated (a name right after a
    removed one is not checked), and the reference's fuzzy fallback never runs (its test
    ``em_match_list != 0`` is always true), so an output naming no class scores 0.
    """
    matches = [name for name in all_classes if name in prediction]
    for term in matches:  # the reference's remove-while-iterating loop, kept on purpose
        if term in ground_truth and term != ground_truth:
            matches.remove(term)
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _numbers_score(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    right = sum(1 for number in numbers if number == target)
    return 0.0 if not numbers else right / len(numbers)


def count_score(prediction: str, ground_truth: str) -> float:
    """LongBench ``count_score``: the share of numbers in the output equal to the answer."""
    return _numbers_score(prediction, str(ground_truth))


def retrieval_score(prediction: str, ground_truth: str, zh: bool = False) -> float | None:
    """LongBench ``retrieval_score`` (``retrieval_zh_score`` with ``zh``): the share of numbers in
    the output equal to the paragraph number of the answer ("Paragraph 12" / "段落12"); None
    for an answer naming no paragraph (the reference fails on it)."""
    found = re.findall(r"段落(\d+)" if zh else r"Paragraph (\d+)", ground_truth)
    return _numbers_score(prediction, found[0]) if found else None


def fuzz_ratio(a: str, b: str) -> int:
    """``fuzzywuzzy.fuzz.ratio`` without python-Levenshtein (its pure-Python path): 100 for equal
    strings, 0 when one is empty, else ``round(100 * difflib.SequenceMatcher(None, a, b).ratio())``.

    With python-Levenshtein installed fuzzywuzzy uses ``Levenshtein.ratio`` (the indel
    similarity) instead, which can differ by a few points; LongBench v1's requirements do not
    install it.
    """
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


def code_sim_score(prediction: str, ground_truth: str) -> float:
    """LongBench ``code_sim_score``: the first output line (after leading newlines) without a
    backtick, ``#`` or ``//``, compared to the answer by :func:`fuzz_ratio` / 100."""
    line = ""
    for candidate in prediction.lstrip("\n").split("\n"):
        if "`" not in candidate and "#" not in candidate and "//" not in candidate:
            line = candidate
            break
    return fuzz_ratio(line, ground_truth) / 100


def _classification(prediction: str, ground_truth: str, sample: Sample) -> float:
    return classification_score(prediction, ground_truth, sample.meta.get("all_classes") or [])


#: LongBench ``eval.py``'s ``dataset2metric``: task -> (metric name, scorer)
LONGBENCH_METRIC: dict[str, tuple[str, Callable[[str, str, Sample], float | None]]] = {
    "narrativeqa": ("qa_f1", lambda p, g, s: qa_f1_score(p, g)),
    "qasper": ("qa_f1", lambda p, g, s: qa_f1_score(p, g)),
    "multifieldqa_en": ("qa_f1", lambda p, g, s: qa_f1_score(p, g)),
    "multifieldqa_zh": ("qa_f1_zh", lambda p, g, s: qa_f1_zh_score(p, g)),
    "hotpotqa": ("qa_f1", lambda p, g, s: qa_f1_score(p, g)),
    "2wikimqa": ("qa_f1", lambda p, g, s: qa_f1_score(p, g)),
    "musique": ("qa_f1", lambda p, g, s: qa_f1_score(p, g)),
    "dureader": ("rouge_zh", lambda p, g, s: rouge_zh_score(p, g)),
    "gov_report": ("rouge_l", lambda p, g, s: longbench_rouge_score(p, g)),
    "qmsum": ("rouge_l", lambda p, g, s: longbench_rouge_score(p, g)),
    "multi_news": ("rouge_l", lambda p, g, s: longbench_rouge_score(p, g)),
    "vcsum": ("rouge_zh", lambda p, g, s: rouge_zh_score(p, g)),
    "trec": ("classification", _classification),
    "triviaqa": ("qa_f1", lambda p, g, s: qa_f1_score(p, g)),
    "samsum": ("rouge_l", lambda p, g, s: longbench_rouge_score(p, g)),
    "lsht": ("classification", _classification),
    "passage_retrieval_en": ("retrieval", lambda p, g, s: retrieval_score(p, g)),
    "passage_count": ("count", lambda p, g, s: count_score(p, g)),
    "passage_retrieval_zh": ("retrieval_zh", lambda p, g, s: retrieval_score(p, g, zh=True)),
    "lcc": ("code_sim", lambda p, g, s: code_sim_score(p, g)),
    "repobench-p": ("code_sim", lambda p, g, s: code_sim_score(p, g)),
}
#: tasks whose output is cut to its first line before scoring (``eval.py``'s ``scorer``)
LONGBENCH_FIRST_LINE_TASKS = ("trec", "triviaqa", "samsum", "lsht")


def longbench_task(sample: Sample) -> str | None:
    """The LongBench task of a sample (``meta["task"]``, a LongBench-E ``_e`` suffix dropped)."""
    task = sample.meta.get("task")
    if not isinstance(task, str):
        return None
    task = task[:-2] if task.endswith("_e") else task
    return task if task in LONGBENCH_METRIC else None


def longbench_postprocess(output: str, task: str | None) -> str:
    """The output as ``eval.py`` scores it: only its first line for trec, triviaqa, samsum, lsht."""
    if task in LONGBENCH_FIRST_LINE_TASKS:
        return output.lstrip("\n").split("\n")[0]
    return output


def longbench_score(output: str, sample: Sample) -> float | None:
    """The sample's task metric (``dataset2metric``), best answer; None for a non-LongBench task."""
    task = longbench_task(sample)
    if task is None or not sample.answers:
        return None
    return _best(longbench_postprocess(output, task), sample, LONGBENCH_METRIC[task][1])


def _best(
    prediction: str, sample: Sample, scorer: Callable[[str, str, Sample], float | None]
) -> float | None:
    """``eval.py``'s ``score = max(score, metric(...))`` from 0 over the answers; None when no
    answer can be scored."""
    scores = [v for v in (scorer(prediction, answer, sample) for answer in sample.answers) if v is not None]
    return max([0.0, *scores]) if scores else None


def _longbench_family(
    name: str, scorer: Callable[[str, str, Sample], float | None]
) -> Callable[..., float | None]:
    """A LongBench metric applied to any sample (None for LongBench tasks scored by another)."""

    def metric(output: str, sample: Sample) -> float | None:
        task = longbench_task(sample)
        if not sample.answers or (task is not None and LONGBENCH_METRIC[task][0] != name):
            return None
        return _best(longbench_postprocess(output, task), sample, scorer)

    return metric


#: the metrics that segment Chinese words with jieba, and those that split on whitespace
JIEBA_METRICS = ("qa_f1_zh", "rouge_zh")
WHITESPACE_METRICS = ("qa_f1", "rouge_l")
_PARAGRAPH = {"retrieval": r"Paragraph (\d+)", "retrieval_zh": r"段落(\d+)"}


def is_chinese_sample(sample: Sample) -> bool:
    """A Chinese LongBench task, a row with ``language: zh``, or an answer in Chinese."""
    task = longbench_task(sample)
    return (
        (task is not None and LONGBENCH_METRIC[task][0] in (*JIEBA_METRICS, "retrieval_zh"))
        or task in ("lsht",)
        or sample.meta.get("language") == "zh"
        or any(has_chinese(a) for a in sample.answers)
    )


def _metric_problem(metric: str, sample: Sample) -> str | None:
    """Why LongBench's ``metric`` cannot score ``sample`` as the official code does, or None."""
    if metric in JIEBA_METRICS and not jieba_available():
        return f"its LongBench metric {metric}_score segments Chinese words with jieba: {JIEBA_INSTALL}"
    if metric in WHITESPACE_METRICS and is_chinese_sample(sample):
        return (
            f"it is Chinese, and {metric} splits words on whitespace, which disagrees with LongBench's "
            f"official score; use longbench_score or longbench_{metric}_zh (jieba)"
        )
    if metric in _PARAGRAPH and not all(re.findall(_PARAGRAPH[metric], a) for a in sample.answers):
        return f"its answers {sample.answers!r} do not all name a paragraph as {metric}_score needs"
    return None


def _score_check(sample: Sample) -> str | None:
    task = longbench_task(sample)
    if task is None or not sample.answers:
        return None
    return _metric_problem(LONGBENCH_METRIC[task][0], sample)


def _family_check(name: str) -> Callable[[Sample], str | None]:
    def check(sample: Sample) -> str | None:
        task = longbench_task(sample)
        if not sample.answers:
            return None
        if task is not None and LONGBENCH_METRIC[task][0] != name:
            if name in WHITESPACE_METRICS and is_chinese_sample(sample):
                return _metric_problem(name, sample)
            return None  # a task scored by another metric: not this one's sample
        return _metric_problem(name, sample)

    return check


FAMILIES = ("qa_f1", "qa_f1_zh", "rouge_l", "rouge_zh", "classification", "retrieval", "retrieval_zh",
            "count", "code_sim")  # fmt: skip
_FAMILY_SCORERS: dict[str, Callable[[str, str, Sample], float | None]] = {
    "qa_f1": lambda p, g, s: qa_f1_score(p, g),
    "qa_f1_zh": lambda p, g, s: qa_f1_zh_score(p, g),
    "rouge_l": lambda p, g, s: longbench_rouge_score(p, g),
    "rouge_zh": lambda p, g, s: rouge_zh_score(p, g),
    "classification": _classification,
    "retrieval": lambda p, g, s: retrieval_score(p, g),
    "retrieval_zh": lambda p, g, s: retrieval_score(p, g, zh=True),
    "count": lambda p, g, s: count_score(p, g),
    "code_sim": lambda p, g, s: code_sim_score(p, g),
}

register_task_metrics(
    {"longbench_score": longbench_score}
    | {f"longbench_{name}": _longbench_family(name, _FAMILY_SCORERS[name]) for name in FAMILIES},
    {"longbench_score": _score_check} | {f"longbench_{name}": _family_check(name) for name in FAMILIES},
)
