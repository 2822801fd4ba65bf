"""InfiniteBench's task metric (Zhang et al. 2024, "∞Bench: Extending Long Context Evaluation
Beyond 100K Tokens"; OpenBMB/InfiniteBench ``src/compute_scores.py``).

``infinitebench_score`` applies the task's ``get_score_one_<task>`` (the references are
``get_answer``'s labels: for the multiple-choice tasks ``[option text, letter]``).

Registered in :data:`kvlab.metrics.tasks.TASK_METRICS` when imported (``kvlab.metrics`` imports it).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from kvlab.data.sample import Sample
from kvlab.metrics.rouge import rouge_lsum
from kvlab.metrics.tasks import register_task_metrics
from kvlab.metrics.text import counter_f1, normalize_zh_answer, qa_f1_score

__all__ = [
    "INFINITEBENCH_SCORERS",
    "first_int_match",
    "infinitebench_score",
]


def first_int_match(prediction: str) -> str:
    """InfiniteBench ``first_int_match``: the first run of digits ("" when none)."""
    return next((item for item in re.split("[^0-9]", prediction) if item != ""), "")


def _replace_all(text: str, chars: Sequence[str], by: str = " ") -> str:
    for c in chars:
        text = text.replace(c, by)
    return text


def _collapse_spaces(text: str) -> str:
    while "  " in text:
        text = text.replace("  ", " ")
    return text


_RETRIEVAL_CHARS = ("\n", ":", '"', "'", ".", ",", "?", "!", "{", "}")


def _ib_kv_retrieval(pred: str, label: list[str]) -> bool:
    return label[0] in _replace_all(pred, _RETRIEVAL_CHARS).split()


def _ib_first_int(pred: str, label: list[str]) -> bool:
    return label[0] == first_int_match(pred)


def _ib_code_run(pred: str, label: list[str]) -> bool:
    words = _replace_all(pred.strip(), ("\n", ".", "`", "'", '"', ":")).split()
    if not words:
        return False
    try:
        return int(label[0]) == int(words[-1])
    except ValueError:
        return False


def _ib_code_debug(pred: str, label: list[str]) -> bool:
    pred = pred.strip()
    fn_name, letter = label[0], label[1]
    if pred[:2] in (f"{letter}.", f"{letter}:"):
        return True
    pred = _collapse_spaces(_replace_all(pred.strip(), ("\n", "`", "'", '"', "-", "*", "Option", "option")))
    for prefix in ("answer is:", "is:", "answer:", "correct option is:"):
        idx = pred.find(prefix)
        if idx == -1:
            continue
        if len(pred) < idx + len(prefix) + 1:
            return False
        rest = pred[idx + len(prefix) + 1 :]
        return any(rest.startswith(s) for s in (letter, fn_name))
    return False


def _number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


def _ib_math_find(pred: str, label: list[str]) -> bool:
    target = _number(label[0])
    found = re.search(r"\d+\.\d+|\d+", pred)
    if found is None:
        return False
    value = found.group(0).strip()
    if isinstance(target, int):
        try:
            return int(value) == target
        except ValueError:  # "3.5" against an integer label: the reference's int() raises
            return False
    return float(value) == target


def _ib_longdialogue(pred: str, label: list[str]) -> bool:
    words = [w.upper() for w in _replace_all(pred.strip(), _RETRIEVAL_CHARS).split()]
    return label[0] in words


def _ib_choice(pred: str, label: list[str]) -> bool:
    pred = pred.strip()
    if pred == "":
        return False
    if pred[0] in "ABCD":
        return pred[0] in label
    if pred in label:
        return True
    pred = _collapse_spaces(_replace_all(pred, ("\n", '"', "'", ".", ",", "?", "!", "{", "}")))
    for prefix in ("answer is:", "answer:", "answer is", "option is"):
        idx = pred.find(prefix)
        if idx == -1:
            continue
        if len(pred) < idx + len(prefix) + 1:
            return False
        after = pred[idx + len(prefix) + 1 :]
        return any(after.startswith(s) for s in label)
    for word in pred.split():
        if word in "ABCD":
            return word in label
    return False


def _ib_qa_f1(pred: str, label: list[str]) -> float:
    return max([0.0, *(qa_f1_score(pred, truth) for truth in label)])


def _ib_qa_f1_zh(pred: str, label: list[str]) -> float:
    """``qa_f1_score_zh``: character-level :func:`counter_f1` of the normalised texts."""
    return max(
        [0.0, *(counter_f1(list(normalize_zh_answer(pred)), list(normalize_zh_answer(t))) for t in label)]
    )


def _ib_math_calc(pred: str, label: list[str]) -> float:
    values = [int(v) for v in label]
    numbers = [int(item) for item in re.split("[^0-9]", pred) if item != ""]
    count = 0
    for i, value in enumerate(values):
        if i >= len(numbers) or numbers[i] != value:
            break
        count += 1
    return count / len(values)


def _ib_sum(pred: str, label: list[str]) -> float:
    return max([0.0, *(rouge_lsum(pred, truth) for truth in label)])


#: InfiniteBench ``get_score_one``'s getters (commit 88b3daa of ``src/compute_scores.py``)
INFINITEBENCH_SCORERS: dict[str, Callable[[str, list[str]], float | bool]] = {
    "passkey": _ib_first_int,
    "number_string": _ib_first_int,
    "kv_retrieval": _ib_kv_retrieval,
    "longbook_sum_eng": _ib_sum,
    "longbook_choice_eng": _ib_choice,
    "longbook_qa_eng": _ib_qa_f1,
    "longbook_qa_chn": _ib_qa_f1_zh,
    "longdialogue_qa_eng": _ib_longdialogue,
    "math_find": _ib_math_find,
    "math_calc": _ib_math_calc,
    "code_run": _ib_code_run,
    "code_debug": _ib_code_debug,
}


def infinitebench_score(output: str, sample: Sample) -> float | None:
    """The sample's InfiniteBench task scorer (``meta["task"]``); None for other tasks.

    The labels are ``Sample.answers`` (strings: numbers are parsed back as the reference's
    integers where it compares numbers). Where the reference takes ``label[0]`` of a list label
    (passkey, number_string, code_run, math_find, longdialogue) so does kvlab; for kv_retrieval the
    reference at that commit compares the list itself (always false for a list label), kvlab
    takes ``label[0]`` as later versions do.
    """
    task = sample.meta.get("task")
    if task not in INFINITEBENCH_SCORERS or not sample.answers:
        return None
    if task in ("longbook_choice_eng", "code_debug") and len(sample.answers) < 2:
        return None  # the label is [option text, letter]
    try:
        return float(INFINITEBENCH_SCORERS[task](output, list(sample.answers)))
    except ValueError:  # a label that is not a number where the task compares numbers
        return None


register_task_metrics({"infinitebench_score": infinitebench_score})
