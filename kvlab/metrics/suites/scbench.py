"""SCBench's task metric (Li et al. 2025, "SCBench: A KV Cache-Centric Analysis of Long-Context
Methods"; microsoft/MInference ``scbench/compute_scores.py`` at commit 459df6b).

``scbench_score`` applies the getter ``compute_scores`` maps the sample's task to
(``Multiturnbench_to_Infinitebench``, then ``get_score_one``) on the turn's official label,
``meta["label"]`` as the ``scbench`` dataset keeps it (``get_ground_truth``'s):

- scbench_kv, scbench_kv_hard, scbench_hashhop, scbench_prefix_suffix: the label occurs in the
  output (``get_score_one_kv_retrieval`` there is a plain substring test);
- scbench_passkey: the first run of digits equals the label (``label[0]`` of a list);
- scbench_choice_eng: InfiniteBench's ``longbook_choice_eng`` getter on ``[answer, letter]``;
- scbench_qa_eng, scbench_many_shot: SCBench's ``longdialogue_qa_eng`` getter, an item of the label
  occurs in the upper-cased output;
- scbench_qa_chn: InfiniteBench's character F1 (``qa_f1_score_zh``), best label item;
- scbench_mf: the first number of the output, as an integer (``int(float(...))``) for an integer
  label, as a float for a float label;
- scbench_vt: ``string_match_all``, the share of label items in the output, rounded to 2 decimals;
- scbench_summary: ``rougeLsum`` F (Google's ``rouge_score``, as ``evaluate.load("rouge")``).

A label is iterated as the official code iterates it (a string label of scbench_vt, qa_eng,
qa_chn or many_shot is iterated by character there, and here). A label the getter cannot read
(scbench_mf's not a number, a list where the substring test wants a string) is refused before
any model loads (the official code raises).

Registered in :data:`kvlab.metrics.tasks.TASK_METRICS` when imported (``kvlab.metrics`` imports it).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from kvlab.data.sample import Sample
from kvlab.metrics.rouge import rouge_lsum
from kvlab.metrics.suites.infinitebench import INFINITEBENCH_SCORERS, first_int_match
from kvlab.metrics.tasks import register_task_metrics
from kvlab.metrics.text import counter_f1, normalize_zh_answer

__all__ = ["SCBENCH_SCORERS", "scbench_score"]


def _kv(pred: str, label: Any) -> float:
    return float(label in pred)


def _passkey(pred: str, label: Any) -> float:
    label = label[0] if isinstance(label, list) else label
    return float(label == first_int_match(pred))


def _any_upper(pred: str, label: Any) -> float:
    pred = pred.strip().upper()
    return float(any(item.upper() in pred for item in label))


def _qa_chn(pred: str, label: Any) -> float:
    norm = list(normalize_zh_answer(pred))
    return max([0.0, *(counter_f1(norm, list(normalize_zh_answer(truth))) for truth in label)])


def _first_number(pred: str) -> str | None:
    found = re.search(r"\d+\.\d+|\d+", pred)
    return None if found is None else found.group(0).strip()


def _math_find(pred: str, label: Any) -> float:
    label = label[0] if isinstance(label, list) else label
    number = _first_number(pred)
    if number is None:
        return 0.0
    return float(int(float(number)) == label if isinstance(label, int) else float(number) == label)


def _string_match_all(pred: str, label: Any) -> float:
    return round(sum(1.0 if r.lower() in pred.lower() else 0.0 for r in label) / len(label), 2)


def _summary(pred: str, label: Any) -> float:
    return (
        max(rouge_lsum(pred, truth) for truth in label)
        if isinstance(label, list)
        else rouge_lsum(pred, label)
    )


#: task -> the getter ``compute_scores.py`` applies (through ``Multiturnbench_to_Infinitebench``)
SCBENCH_SCORERS: dict[str, Callable[[str, Any], float]] = {
    "scbench_kv": _kv,
    "scbench_kv_hard": _kv,
    "scbench_hashhop": _kv,
    "scbench_prefix_suffix": _kv,
    "scbench_passkey": _passkey,
    "scbench_choice_eng": lambda pred, label: float(
        INFINITEBENCH_SCORERS["longbook_choice_eng"](pred, label)
    ),
    "scbench_qa_eng": _any_upper,
    "scbench_many_shot": _any_upper,
    "scbench_qa_chn": _qa_chn,
    "scbench_mf": _math_find,
    "scbench_vt": _string_match_all,
    "scbench_summary": _summary,
}


def scbench_score(output: str, sample: Sample) -> float | None:
    """The sample's SCBench getter on its official label; None for a sample of another suite."""
    task = sample.meta.get("task")
    if task not in SCBENCH_SCORERS or "label" not in sample.meta:
        return None
    return SCBENCH_SCORERS[task](output, sample.meta["label"])


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check(sample: Sample) -> str | None:
    task = sample.meta.get("task")
    if task not in SCBENCH_SCORERS:
        return None
    if "label" not in sample.meta:
        return "an SCBench sample carries its official label in meta['label'] (the scbench dataset sets it)"
    label = sample.meta["label"]
    first = label[0] if isinstance(label, list) and label else label
    if task in ("scbench_kv", "scbench_kv_hard", "scbench_hashhop", "scbench_prefix_suffix"):
        ok = isinstance(label, str)
    elif task == "scbench_mf":
        ok = _is_number(first)
    elif task == "scbench_choice_eng":
        ok = isinstance(label, list) and len(label) == 2 and label[1] in ("A", "B", "C", "D")
    elif task == "scbench_summary":
        ok = isinstance(label, str) or (
            isinstance(label, list) and all(isinstance(v, str) for v in label) and label
        )
    else:
        ok = isinstance(label, str | list) and len(label) > 0 and all(isinstance(v, str) for v in label)
    return None if ok else f"its {task} label {label!r} is not of the shape SCBench's scorer reads"


register_task_metrics({"scbench_score": scbench_score}, {"scbench_score": _check})
