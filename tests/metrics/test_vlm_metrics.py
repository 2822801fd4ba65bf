"""VLM task metrics against worked examples of their reference implementations (lmms-eval's task
code, which copies the official scorers; each expected value is computed by hand in the comment)."""

import random

import pytest

from kvlab.data.sample import Sample
from kvlab.metrics.suites.vlm import (
    anls_value,
    levenshtein,
    ocrbench_value,
    open_correct,
    parse_multi_choice,
    parse_open,
    relaxed_correct,
    vqa_accuracy_value,
    vqa_normalize,
)
from kvlab.metrics.tasks import TASK_METRICS, score_output


def sample(answers, **kwargs):
    return Sample(id=kwargs.pop("id", "q"), prompt="?", answers=list(answers), **kwargs)


def naive_levenshtein(a, b):
    """Textbook full-table dynamic programme."""
    table = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            table[i][j] = min(
                table[i - 1][j] + 1, table[i][j - 1] + 1, table[i - 1][j - 1] + (a[i - 1] != b[j - 1])
            )
    return table[-1][-1]


def test_vlm_metrics_are_registered_and_skip_samples_without_answers():
    assert {"anls", "relaxed_accuracy", "vqa_accuracy", "ocrbench", "mmmu_accuracy"} <= set(TASK_METRICS)
    assert score_output("x", sample([]), ["anls", "vqa_accuracy", "mmmu_accuracy"]) == {}  # no answers


@pytest.mark.parametrize(
    "a,b", [("kitten", "sitting"), ("", "abc"), ("university", "univ"), ("flaw", "lawn")]
)
def test_levenshtein_equals_brute_force_and_is_symmetric(a, b):
    assert levenshtein(a, b) == naive_levenshtein(a, b) == levenshtein(b, a)


def test_anls_worked_examples():
    assert anls_value("lorem", ["Lorem"]) == 1.0  # case folded
    # "univ of california" vs "university of california": 6 deletions over max(18, 24) -> 1 - 6/24
    assert anls_value("Univ of California", ["University of California"]) == pytest.approx(0.75)
    assert anls_value("6", ["5"]) == 0.0  # 1 - 1/1 = 0 < 0.5
    assert anls_value("abcd", ["abcx"]) == pytest.approx(0.75)  # 1 - 1/4
    assert anls_value("abx", ["abcdef"]) == 0.0  # 1 - 4/6 = 0.33 < 0.5: thresholded
    assert anls_value("12 May", ["May 12", "12 may"]) == 1.0  # best answer
    # the reference's denominator is the raw lengths: "a  b" (4 chars) vs "ab": collapsed
    # "a b" is 1 edit from "ab" -> 1 - 1/4 = 0.75 (1 - 1/3 with collapsed lengths)
    assert anls_value("a  b", ["ab"]) == pytest.approx(0.75)
    assert TASK_METRICS["anls"]("  lorem \n", sample(["Lorem"])) == 1.0  # output stripped


def test_relaxed_accuracy_worked_examples():
    assert relaxed_correct("13", "12.5")  # |13 - 12.5| / 12.5 = 0.04 <= 0.05
    assert not relaxed_correct("13.2", "12.5")  # 0.056
    assert relaxed_correct("0.46", "45%") and relaxed_correct("46%", "45%")  # 0.46 vs 0.45: 0.022
    assert relaxed_correct("Yes", "yes") and not relaxed_correct("yes.", "yes")
    assert not relaxed_correct("0.0", "0")  # a zero answer falls back to the string match
    assert relaxed_correct("0", "0")
    assert TASK_METRICS["relaxed_accuracy"](" 13\n", sample(["12.5"])) == 1.0


def test_vqa_normalisation_and_accuracy():
    assert vqa_normalize("Coca-Cola.") == "coca cola"
    assert vqa_normalize("Two dogs") == "2 dogs" and vqa_normalize("the cat") == "cat"
    assert vqa_normalize("dont") == "don't" and vqa_normalize("1,000") == "1000"
    assert vqa_normalize("3.5") == "3.5"  # a period between digits stays
    # 2 x "coca cola", 8 x "coke"; the output matches the 2: leaving one of them out leaves 1
    # match (1/3), leaving a "coke" out leaves 2 (2/3): (2 * 1/3 + 8 * 2/3) / 10 = 0.6
    assert vqa_accuracy_value("Coca-Cola.", ["coca cola"] * 2 + ["coke"] * 8) == pytest.approx(0.6)
    # "two" -> "2" against 3 x "2", 7 x "3": leaving a "2" out leaves 2 matches (2/3), leaving a
    # "3" out leaves 3 (1): (3 * 2/3 + 7 * 1) / 10 = 0.9; "three" matches at least 6 others: 1
    assert vqa_accuracy_value("two", ["2"] * 3 + ["3"] * 7) == pytest.approx(0.9)
    assert vqa_accuracy_value("three", ["2"] * 3 + ["3"] * 7) == pytest.approx(1.0)
    assert vqa_accuracy_value("nothing", ["2"] * 10) == 0.0


def test_ocrbench_worked_examples():
    assert ocrbench_value("The word is HELLO.", ["Hello"], "IIIT5K") == 1.0
    assert ocrbench_value("hel lo", ["Hello"], "IIIT5K") == 0.0
    assert ocrbench_value("x ^ { 2 } + 1", ["x^{2}+1"], "HME100k") == 1.0  # spaces removed
    assert ocrbench_value("X", ["X"], "HME100k") == 0.0  # output lower-cased, formula case kept
    assert ocrbench_value("line one\nline two", ["one line"], "FUNSD") == 1.0  # newlines as spaces
    s = sample(["Hello"], meta={"dataset": "IIIT5K"})
    assert TASK_METRICS["ocrbench"]("hello world", s) == 1.0


def test_mmmu_multiple_choice_parsing():
    options = {"A": "cat", "B": "dog", "C": "bird", "D": "fish"}
    letters = list(options)
    rng = random.Random(0)
    assert parse_multi_choice("(B) dog", letters, options, rng) == "B"
    assert parse_multi_choice("B", letters, options, rng) == "B"
    assert parse_multi_choice("C.", letters, options, rng) == "C"  # "." stripped, then "C "
    assert parse_multi_choice("The answer is dog because it barks", letters, options, rng) == "B"  # > 5 words
    assert parse_multi_choice("A or B", letters, options, rng) == "B"  # several: the last one
    assert parse_multi_choice("(A) no, (D)", letters, options, rng) == "D"
    drawn = [parse_multi_choice("unsure", letters, options, random.Random(7)) for _ in range(2)]
    assert drawn[0] == drawn[1] == random.Random(7).choice(letters)  # unparseable: a seeded draw
    mc = sample(["B"], choices=list(options.values()), meta={"question_type": "multiple-choice"})
    assert TASK_METRICS["mmmu_accuracy"]("(B)", mc) == 1.0 and TASK_METRICS["mmmu_accuracy"]("A", mc) == 0.0
    assert TASK_METRICS["mmmu_accuracy"]("hmm", mc) == TASK_METRICS["mmmu_accuracy"](
        "hmm", mc
    )  # deterministic


def test_mmmu_open_parsing():
    # "is " -> "3.50", "result " -> "is 3.50": the shortest tail; as a number 3.5 = the answer
    assert parse_open("The result is 3.50") == [3.5]
    assert open_correct("3.5", parse_open("The result is 3.50"))
    assert open_correct("Paris", parse_open("Paris."))
    assert not open_correct("Paris", parse_open("London"))
    assert open_correct("1,200", parse_open("so the total = 1200"))  # "1,200" -> 1200.0
    assert not open_correct("a", parse_open("banana"))  # one letter matches only as a word (" a"/"a ")
    opened = sample(["Paris"], meta={"question_type": "open"})
    assert TASK_METRICS["mmmu_accuracy"]("It is Paris.", opened) == 1.0
