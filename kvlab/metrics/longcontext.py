"""Task metrics of the long-context benchmarks, as their reference implementations score them.

Each registered metric maps ``(output, Sample)`` to a score in [0, 1] (None when it does not
apply: no answers, or a sample of a task scored otherwise) and is added to
:data:`kvlab.metrics.tasks.TASK_METRICS` when this module is imported (``kvlab.metrics``
imports it). The scorers reproduce the reference code step by step, quirks included; where kvlab
cannot (a dependency it does not ship), the difference is stated here and in
``docs/benchmark_suites.md``.

RULER (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?"; NVIDIA/RULER ``scripts/eval/synthetic/constants.py`` and ``scripts/eval/evaluate.py``):

- ``string_match_all``: mean over the references of "reference in output" (case-insensitive);
- ``string_match_part``: max over the references of the same test.
  The output is first stripped and its control characters (``\\x00``-``\\x1f``) replaced by
  newlines (``postprocess_pred``).

LongBench v1 (Bai et al. 2024, "LongBench: A Bilingual, Multitask Benchmark for Long Context
Understanding"; THUDM/LongBench ``metrics.py`` and ``eval.py``): ``longbench_score`` applies the
task's metric of ``eval.py``'s ``dataset2metric`` (the task is ``Sample.meta["task"]``), after
keeping only the first line of the output for trec, triviaqa, samsum and lsht, and keeps the best
answer. The per-metric names (``longbench_qa_f1``, ``longbench_rouge_l``,
``longbench_classification``, ``longbench_retrieval``, ``longbench_retrieval_zh``,
``longbench_count``, ``longbench_code_sim``) apply one metric to any sample (the same
post-processing when the sample's task is a LongBench task); see each function. The Chinese
metrics that need jieba word segmentation (``qa_f1_zh``, ``rouge_zh``) are not implemented: the
``longbench`` dataset refuses the tasks that use them.

InfiniteBench (Zhang et al. 2024, "∞Bench: Extending Long Context Evaluation Beyond 100K
Tokens"; OpenBMB/InfiniteBench ``src/compute_scores.py``): ``infinitebench_score`` applies the
task's ``get_score_one_<task>`` (the references are ``get_answer``'s labels: for the
multiple-choice tasks ``[option text, letter]``).

LooGLE (Li et al. 2024, "LooGLE: Can Long-Context Language Models Understand Long Contexts?";
bigai-nlco/LooGLE ``Evaluation/automatic_metrics.py``): ``loogle_bleu1``, ``loogle_bleu4``
(NLTK ``sentence_bleu`` without smoothing), ``loogle_rouge1``, ``loogle_rouge2``,
``loogle_rouge_l`` (the ``rouge`` package's *recall*, the reference's default ``metric="r"``)
for the QA and summarisation tasks; ``loogle_cloze_exact`` and ``loogle_cloze_partial`` (share
of masks filled exactly / with a shared word, per sample and then averaged over samples; the
reference pools the masks of every question) for ``shortdep_cloze``. METEOR (needs WordNet) and
BERTScore (needs RoBERTa-large) are not implemented.

Needle in a haystack (Kamradt 2023, gkamradt/LLMTest_NeedleInAHaystack, scored there by an LLM
judge): ``needle_rouge1`` is NVIDIA/kvpress's replacement (``evaluation/benchmarks/
needle_in_haystack/calculate_metrics.py``): the ROUGE-1 F-measure of the output against the
needle, tokenised as Google's ``rouge_score`` does, without its Porter stemmer (kvpress's
``use_stemmer=True``), in [0, 1] (kvpress multiplies by 10).
"""

from __future__ import annotations

import ast
import difflib
import math
import re
import string
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from kvlab.data.sample import Sample
from kvlab.metrics.tasks import register_task_metrics
from kvlab.metrics.text import normalize_answer

__all__ = [
    "INFINITEBENCH_SCORERS",
    "LONGBENCH_FIRST_LINE_TASKS",
    "LONGBENCH_METRIC",
    "bleu",
    "classification_score",
    "code_sim_score",
    "count_score",
    "infinitebench_score",
    "longbench_postprocess",
    "longbench_score",
    "qa_f1_score",
    "retrieval_score",
    "rouge_lsum",
    "rouge_n_score",
    "rouge_package_scores",
    "ruler_postprocess",
    "string_match_all",
    "string_match_part",
]

# =============================================================================================
# RULER
# =============================================================================================
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


# =============================================================================================
# LongBench v1
# =============================================================================================
def counter_f1(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
    """LongBench's ``f1_score``: F1 of the shared multiset of tokens, 0 when nothing is shared
    (two empty sequences also score 0, unlike SQuAD's convention)."""
    num_same = sum((Counter(prediction) & Counter(ground_truth)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction)
    recall = num_same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str) -> float:
    """LongBench/InfiniteBench ``qa_f1_score``: :func:`counter_f1` of the SQuAD-normalised words."""
    return counter_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


# --- the ``rouge`` package (pltrdy/rouge 1.0.1, ``exclusive=True``) ---------------------------
def _lcs_table(x: Sequence[str], y: Sequence[str]) -> list[list[int]]:
    table = [[0] * (len(y) + 1) for _ in range(len(x) + 1)]
    for i in range(1, len(x) + 1):
        for j in range(1, len(y) + 1):
            if x[i - 1] == y[j - 1]:
                table[i][j] = table[i - 1][j - 1] + 1
            else:
                table[i][j] = max(table[i - 1][j], table[i][j - 1])
    return table


def _recon_lcs(x: Sequence[str], y: Sequence[str]) -> set[str]:
    """The words of the LCS of ``x`` and ``y`` that ``rouge``'s ``_recon_lcs`` reconstructs
    (its tie-break: step in ``x`` only when ``table[i-1][j] > table[i][j-1]``), as a set."""
    table = _lcs_table(x, y)
    i, j, words = len(x), len(y), set()
    while i > 0 and j > 0:
        if x[i - 1] == y[j - 1]:
            words.add(x[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def _rouge_sentences(text: str) -> list[str]:
    """``rouge``'s sentence split: pieces between periods, non-empty before whitespace collapse."""
    return [" ".join(piece.split()) for piece in text.split(".") if len(piece) > 0]


def _rouge_words(sentences: Sequence[str]) -> list[str]:
    return [word for sentence in sentences for word in sentence.split(" ")]


def _ngrams(words: Sequence[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def rouge_package_scores(hypothesis: str, reference: str) -> dict[str, dict[str, float]]:
    """``Rouge().get_scores(hypothesis, reference)[0]`` of the ``rouge`` package (pltrdy/rouge
    1.0.1, default ``exclusive=True``: n-grams and words counted as sets; case kept).

    Returns ``{"rouge-1" | "rouge-2" | "rouge-l": {"f", "p", "r"}}``. ROUGE-N: ``p = |H ∩ R| /
    |H|`` over the sets of n-grams, ``r = |H ∩ R| / |R|``; ROUGE-L is summary-level: the union
    over reference sentences and hypothesis sentences of the LCS words, over the distinct words
    of each side; ``f = 2 p r / (p + r + 1e-8)``.

    Raises:
        ValueError: the hypothesis or the reference has no sentence (as the package does).
    """
    hyp, ref = _rouge_sentences(hypothesis), _rouge_sentences(reference)
    if not hyp:
        raise ValueError("Hypothesis is empty.")
    if not ref:
        raise ValueError("Reference is empty.")
    hyp_words, ref_words = _rouge_words(hyp), _rouge_words(ref)
    out: dict[str, dict[str, float]] = {}
    for n in (1, 2):
        h, r = _ngrams(hyp_words, n), _ngrams(ref_words, n)
        overlap = len(h & r)
        p = overlap / len(h) if h else 0.0
        rec = overlap / len(r) if r else 0.0
        out[f"rouge-{n}"] = {"f": 2.0 * (p * rec / (p + rec + 1e-8)), "p": p, "r": rec}
    m, n_hyp = len(set(ref_words)), len(set(hyp_words))
    union: set[str] = set()
    for ref_sentence in ref:
        for hyp_sentence in hyp:
            union |= _recon_lcs(ref_sentence.split(" "), hyp_sentence.split(" "))
    r_lcs, p_lcs = len(union) / m, len(union) / n_hyp
    out["rouge-l"] = {"f": 2.0 * (p_lcs * r_lcs / (p_lcs + r_lcs + 1e-8)), "p": p_lcs, "r": r_lcs}
    return out


def longbench_rouge_score(prediction: str, ground_truth: str) -> float:
    """LongBench ``rouge_score``: the ``rouge`` package's ROUGE-L F, 0 when it raises."""
    try:
        return rouge_package_scores(prediction, ground_truth)["rouge-l"]["f"]
    except (ValueError, ZeroDivisionError):
        return 0.0


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


#: LongBench ``eval.py``'s ``dataset2metric``: task -> (metric name, scorer). None: not implemented
#: (needs jieba).
LONGBENCH_METRIC: dict[str, tuple[str, Callable[[str, str, Sample], float | None] | None]] = {
    "narrativeqa": ("qa_f1", lambda p, g, s: qa_f1_score(p, g)),
    "qasper": ("qa_f1", lambda p, g, s: qa_f1_score(p, g)),
    "multifieldqa_en": ("qa_f1", lambda p, g, s: qa_f1_score(p, g)),
    "multifieldqa_zh": ("qa_f1_zh", None),
    "hotpotqa": ("qa_f1", lambda p, g, s: qa_f1_score(p, g)),
    "2wikimqa": ("qa_f1", lambda p, g, s: qa_f1_score(p, g)),
    "musique": ("qa_f1", lambda p, g, s: qa_f1_score(p, g)),
    "dureader": ("rouge_zh", None),
    "gov_report": ("rouge_l", lambda p, g, s: longbench_rouge_score(p, g)),
    "qmsum": ("rouge_l", lambda p, g, s: longbench_rouge_score(p, g)),
    "multi_news": ("rouge_l", lambda p, g, s: longbench_rouge_score(p, g)),
    "vcsum": ("rouge_zh", None),
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
    scorer = LONGBENCH_METRIC[task][1]
    if scorer is None:
        return None
    return _best(longbench_postprocess(output, task), sample, scorer)


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


# =============================================================================================
# InfiniteBench
# =============================================================================================
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


_ZH_PUNCTUATION = (  # the reference's list, full-width characters included
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠"
    "｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_ALL_PUNCTUATION = set(string.punctuation + _ZH_PUNCTUATION)


def normalize_zh_answer(text: str) -> str:
    """InfiniteBench ``normalize_zh_answer``: lower case, no (Chinese or ASCII) punctuation, no spaces."""
    return "".join("".join(ch for ch in text.lower() if ch not in _ALL_PUNCTUATION).split())


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


# =============================================================================================
# Google's rouge_score (InfiniteBench's ``evaluate.load("rouge")``, kvpress's needle scorer)
# =============================================================================================
def rouge_score_tokens(text: str) -> list[str]:
    """``rouge_score``'s default tokenizer (no stemmer): lower case, non-alphanumerics to spaces."""
    tokens = re.split(r"\s+", re.sub(r"[^a-z0-9]+", " ", text.lower()))
    return [t for t in tokens if re.match(r"^[a-z0-9]+$", t)]


def _fmeasure(precision: float, recall: float) -> float:
    return 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0


def rouge_n_score(prediction: str, target: str, n: int = 1) -> float:
    """``rouge_score``'s ROUGE-N F-measure: clipped n-gram counts (multisets)."""
    pred, ref = rouge_score_tokens(prediction), rouge_score_tokens(target)
    pred_ngrams = Counter(tuple(pred[i : i + n]) for i in range(len(pred) - n + 1))
    ref_ngrams = Counter(tuple(ref[i : i + n]) for i in range(len(ref) - n + 1))
    overlap = sum((pred_ngrams & ref_ngrams).values())
    precision = overlap / max(sum(pred_ngrams.values()), 1)
    recall = overlap / max(sum(ref_ngrams.values()), 1)
    return _fmeasure(precision, recall)


def _lcs_indices(ref: Sequence[str], can: Sequence[str]) -> list[int]:
    """``rouge_score``'s ``lcs_ind``: indices into ``ref`` of one LCS (``_backtrack_norec``)."""
    table = _lcs_table(ref, can)
    i, j, out = len(ref), len(can), []
    while i > 0 and j > 0:
        if ref[i - 1] == can[j - 1]:
            out.insert(0, i - 1)
            i, j = i - 1, j - 1
        elif table[i][j - 1] > table[i - 1][j]:
            j -= 1
        else:
            i -= 1
    return out


def rouge_lsum(prediction: str, target: str) -> float:
    """``rouge_score``'s ``rougeLsum`` F-measure (summary-level LCS, sentences split on newlines).

    For each reference sentence, the union of its LCS positions with every prediction sentence;
    a token counts as a hit while both sides still have unmatched occurrences of it.
    """
    ref = [rouge_score_tokens(s) for s in target.split("\n") if len(s)]
    can = [rouge_score_tokens(s) for s in prediction.split("\n") if len(s)]
    m, n = sum(map(len, ref)), sum(map(len, can))
    if not ref or not can or not m or not n:
        return 0.0
    ref_counts, can_counts = Counter(), Counter()
    for sentence in ref:
        ref_counts.update(sentence)
    for sentence in can:
        can_counts.update(sentence)
    hits = 0
    for r in ref:
        union = sorted(set().union(*(_lcs_indices(r, c) for c in can)))
        for token in (r[i] for i in union):
            if can_counts[token] > 0 and ref_counts[token] > 0:
                hits += 1
                can_counts[token] -= 1
                ref_counts[token] -= 1
    return _fmeasure(hits / n, hits / m)


def needle_rouge1(output: str, sample: Sample) -> float | None:
    """ROUGE-1 F of the output against the needle (the sample's first answer), in [0, 1]."""
    if not sample.answers:
        return None
    return rouge_n_score(output, sample.answers[0], 1)


# =============================================================================================
# LooGLE
# =============================================================================================
def _modified_precision(references: list[list[str]], hypothesis: list[str], n: int) -> tuple[int, int]:
    counts = Counter(tuple(hypothesis[i : i + n]) for i in range(len(hypothesis) - n + 1))
    max_ref: Counter[tuple[str, ...]] = Counter()
    for ref in references:
        ref_counts = Counter(tuple(ref[i : i + n]) for i in range(len(ref) - n + 1))
        for ngram in counts:
            max_ref[ngram] = max(max_ref[ngram], ref_counts[ngram])
    clipped = sum(min(count, max_ref[ngram]) for ngram, count in counts.items())
    return clipped, max(1, sum(counts.values()))


def bleu(references: list[list[str]], hypothesis: list[str], weights: Sequence[float]) -> float:
    """NLTK's ``sentence_bleu`` without smoothing (``SmoothingFunction().method0``).

    ``BP * exp(sum_n w_n log p_n)`` with clipped n-gram precisions ``p_n`` (denominator at least
    1), ``BP = exp(1 - r / c)`` for a hypothesis of ``c`` words not longer than the closest
    reference length ``r`` (ties to the shorter); 0 when no unigram matches; a zero ``p_n`` is
    replaced by the smallest positive float, as method0 does.
    """
    precisions = [_modified_precision(references, hypothesis, n) for n in range(1, len(weights) + 1)]
    if precisions[0][0] == 0:
        return 0.0
    c = len(hypothesis)
    r = min((len(ref) for ref in references), key=lambda length: (abs(length - c), length))
    bp = 1.0 if c > r else (0.0 if c == 0 else math.exp(1 - r / c))
    logs = [
        w * math.log(num / den if num else sys.float_info.min)
        for w, (num, den) in zip(weights, precisions, strict=True)
    ]
    return bp * math.exp(math.fsum(logs))


def _loogle_words(text: str) -> list[str]:
    return text.replace("\n", " ").split()


LOOGLE_CLOZE_TASK = "shortdep_cloze"


def _loogle_text_metric(score: Callable[[str, str], float]) -> Callable[[str, Sample], float | None]:
    """A LooGLE similarity metric: QA and summarisation samples only; an empty output reads "None"
    (``automatic_eval.py``); the best answer counts."""

    def metric(output: str, sample: Sample) -> float | None:
        if not sample.answers or sample.meta.get("task") == LOOGLE_CLOZE_TASK:
            return None
        hypothesis = output if output != "" else "None"
        return max(score(answer, hypothesis) for answer in sample.answers)

    return metric


def _loogle_rouge(key: str) -> Callable[[str, str], float]:
    def score(reference: str, hypothesis: str) -> float:
        try:
            return rouge_package_scores(hypothesis, reference)[key]["r"]
        except (ValueError, ZeroDivisionError):  # the reference lets it raise; kvlab scores 0
            return 0.0

    return score


def parse_cloze(output: str) -> dict[Any, Any] | None:
    """The output as a Python dict literal (``ast.literal_eval``; LooGLE calls ``eval``), or None."""
    try:
        value = ast.literal_eval(output)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def cloze_counts(output: str, reference: dict[str, str]) -> tuple[int, int, int]:
    """``(exact, partial, masks)``: LooGLE's ``get_exact_match`` / ``get_partial_match`` counts."""
    hypothesis = parse_cloze(output)
    if hypothesis is None:
        return 0, 0, len(reference)
    exact = sum(1 for key in reference if key in hypothesis and hypothesis[key] == reference[key])
    partial = 0
    for key in reference:
        if key in hypothesis:
            shared = set(str(reference[key]).split()) & set(str(hypothesis[key]).split())
            partial += int(len(shared) > 0)
    return exact, partial, len(reference)


def _loogle_cloze(which: int) -> Callable[[str, Sample], float | None]:
    def metric(output: str, sample: Sample) -> float | None:
        reference = sample.meta.get("cloze_answer")
        if not isinstance(reference, dict) or not reference:
            return None
        counts = cloze_counts(output, reference)
        return counts[which] / counts[2]

    return metric


register_task_metrics(
    {
        "string_match_all": _ruler_metric(string_match_all),
        "string_match_part": _ruler_metric(string_match_part),
        "longbench_score": longbench_score,
        "longbench_qa_f1": _longbench_family("qa_f1", lambda p, g, s: qa_f1_score(p, g)),
        "longbench_rouge_l": _longbench_family("rouge_l", lambda p, g, s: longbench_rouge_score(p, g)),
        "longbench_classification": _longbench_family("classification", _classification),
        "longbench_retrieval": _longbench_family("retrieval", lambda p, g, s: retrieval_score(p, g)),
        "longbench_retrieval_zh": _longbench_family(
            "retrieval_zh", lambda p, g, s: retrieval_score(p, g, zh=True)
        ),
        "longbench_count": _longbench_family("count", lambda p, g, s: count_score(p, g)),
        "longbench_code_sim": _longbench_family("code_sim", lambda p, g, s: code_sim_score(p, g)),
        "infinitebench_score": infinitebench_score,
        "loogle_bleu1": _loogle_text_metric(
            lambda ref, hyp: bleu([_loogle_words(ref)], _loogle_words(hyp), (1, 0, 0, 0))
        ),
        "loogle_bleu4": _loogle_text_metric(
            lambda ref, hyp: bleu([_loogle_words(ref)], _loogle_words(hyp), (0, 0, 0, 1))
        ),
        "loogle_rouge1": _loogle_text_metric(_loogle_rouge("rouge-1")),
        "loogle_rouge2": _loogle_text_metric(_loogle_rouge("rouge-2")),
        "loogle_rouge_l": _loogle_text_metric(_loogle_rouge("rouge-l")),
        "loogle_cloze_exact": _loogle_cloze(0),
        "loogle_cloze_partial": _loogle_cloze(1),
        "needle_rouge1": needle_rouge1,
    }
)
