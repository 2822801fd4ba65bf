"""InfiniteBench's task metric (Zhang et al. 2024, "∞Bench: Extending Long Context Evaluation
Beyond 100K Tokens"; OpenBMB/InfiniteBench ``src/compute_scores.py``).

``infinitebench_score`` applies the task's ``get_score_one_<task>`` (commit 88b3daa; the
references are ``get_answer``'s labels, unwrapped as the getters do by the ``infinitebench``
dataset: for the multiple-choice tasks ``[option text, letter]``). A label of the wrong shape for
its task is refused before the model loads (:func:`infinitebench_label_problem`), so every
sample gets a score. Kept on purpose (``docs/benchmark_suites.md``): kv_retrieval reads the
first label (the official code compares a list label as a list, never matching it); math_calc
scores every model alike (the official getter drops the first number for ``gpt4``).

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
    "CHOICE_TASKS",
    "INFINITEBENCH_SCORERS",
    "first_int_match",
    "infinitebench_label_problem",
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
    prefixes = ("answer is:", "is:", "answer:", "correct option is:")
    return _after_first_prefix(pred, prefixes, (letter, fn_name)) is True


def _after_first_prefix(pred: str, prefixes: tuple[str, ...], answers: Sequence[str]) -> bool | None:
    """The official scorers' prefix rule: at the first of ``prefixes`` found in ``pred``, whether
    the text one character after it starts with one of ``answers`` (False when nothing follows);
    None when no prefix occurs."""
    for prefix in prefixes:
        idx = pred.find(prefix)
        if idx == -1:
            continue
        if len(pred) < idx + len(prefix) + 1:
            return False
        return any(pred[idx + len(prefix) + 1 :].startswith(a) for a in answers)
    return None


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
    found = _after_first_prefix(pred, ("answer is:", "answer:", "answer is", "option is"), label)
    if found is not None:
        return found
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


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def infinitebench_label_problem(task: str, label: Sequence[str]) -> str | None:
    """Why ``label`` (a sample's answers) cannot be the official label of ``task``, or None.

    The official getters compare numbers for math_find (an int or float label), math_calc (a
    list of ints) and code_run (an int), and read ``[option text, letter]`` for the two
    multiple-choice tasks; a label of another shape would crash or never match there.
    """
    if not label:
        return None
    if task in CHOICE_TASKS and (len(label) != 2 or label[1] not in "ABCD" or len(label[1]) != 1):
        return f"an InfiniteBench {task} label is [option text, letter A-D], got {list(label)!r}"
    if task == "math_find" and not _is_int(label[0]):
        try:
            float(label[0])
        except ValueError:
            return f"an InfiniteBench math_find label is a number, got {label[0]!r}"
    if task == "math_calc" and not all(_is_int(v) for v in label):
        return f"an InfiniteBench math_calc label is a list of integers, got {list(label)!r}"
    if task == "code_run" and not _is_int(label[0]):
        return f"an InfiniteBench code_run label is an integer, got {label[0]!r}"
    return None


CHOICE_TASKS = ("longbook_choice_eng", "code_debug")


def infinitebench_score(output: str, sample: Sample) -> float | None:
    """The sample's InfiniteBench task scorer (``meta["task"]``); None for other tasks or a
    sample without answers.

    The labels are ``Sample.answers`` as the ``infinitebench`` dataset unwraps them the way the
    official code does (``docs/benchmark_suites.md``): strings, numbers parsed back where the
    official getter compares numbers. :func:`infinitebench_label_problem` refuses, when the
    dataset loads, a label that is not of its task's shape, so every output gets a score: an
    output the getter cannot parse scores 0 as there.
    """
    task = sample.meta.get("task")
    if task not in INFINITEBENCH_SCORERS or not sample.answers:
        return None
    return float(INFINITEBENCH_SCORERS[task](output, list(sample.answers)))


def _check(sample: Sample) -> str | None:
    task = sample.meta.get("task")
    if task not in INFINITEBENCH_SCORERS:
        return None
    return infinitebench_label_problem(str(task), sample.answers)


register_task_metrics({"infinitebench_score": infinitebench_score}, {"infinitebench_score": _check})
