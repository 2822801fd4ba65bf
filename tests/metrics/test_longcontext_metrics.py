"""The long-context benchmarks' metrics against worked examples computed by hand from each
reference implementation's definition (kvlab.metrics.suites, docs/benchmark_suites.md)."""

from __future__ import annotations

import itertools
import math

import pytest

from kvlab.data.sample import Sample
from kvlab.metrics.bleu import bleu
from kvlab.metrics.rouge import rouge_lsum, rouge_n_score, rouge_package_scores
from kvlab.metrics.suites.infinitebench import infinitebench_score
from kvlab.metrics.suites.longbench import (
    classification_score,
    code_sim_score,
    count_score,
    fuzz_ratio,
    longbench_rouge_score,
    longbench_score,
    retrieval_score,
)
from kvlab.metrics.suites.ruler import ruler_postprocess, string_match_all, string_match_part
from kvlab.metrics.tasks import (
    SAMPLE_CHECKS,
    TASK_METRICS,
    check_task_samples,
    score_output,
    validate_task_metrics,
)
from kvlab.metrics.text import qa_f1_score


def _sample(answers: list[str], **meta: object) -> Sample:
    return Sample("s", "prompt", answers=answers, meta=dict(meta))


# ---- RULER (scripts/eval/synthetic/constants.py, evaluate.py) ----------------------------------
def test_ruler_string_match_all_averages_and_part_takes_the_best() -> None:
    refs = ["123", "456", "ABC-def"]
    out = "The numbers are 123 and abc-DEF."  # 2 of 3 references, case-insensitive
    assert string_match_all(out, refs) == pytest.approx(2 / 3)
    assert string_match_part(out, refs) == 1.0
    assert string_match_part("nothing", refs) == 0.0
    sample = _sample(refs)
    assert TASK_METRICS["string_match_all"](out, sample) == pytest.approx(2 / 3)
    # postprocess_pred: control characters become newlines, so "12\x003" no longer holds "123"
    assert ruler_postprocess("  12\x003 \x07 ") == "12\n3"
    assert TASK_METRICS["string_match_part"]("12\x003", _sample(["123"])) == 0.0
    assert TASK_METRICS["string_match_all"]("x", Sample("n", "p")) is None


# ---- LongBench (metrics.py, eval.py) ------------------------------------------------------------
def test_longbench_qa_f1_scores_normalised_words_and_keeps_the_best_answer() -> None:
    # normalised "eiffel tower in paris" vs "eiffel tower": 2 shared, P = 1/2, R = 1 -> F1 = 2/3
    assert qa_f1_score("The Eiffel Tower, in Paris!", "Eiffel Tower") == pytest.approx(2 / 3)
    assert qa_f1_score("", "") == 0.0  # LongBench's f1_score: nothing shared -> 0 (SQuAD says 1)
    sample = _sample(["Paris", "Paris, France"], task="hotpotqa")
    assert longbench_score("Paris", sample) == 1.0  # the best answer counts
    # "it is in paris france": vs "paris" P = 1/5 -> F1 1/3; vs "paris france" P = 2/5, R = 1 -> 4/7
    assert longbench_score("It is in Paris France", sample) == pytest.approx(4 / 7)


def test_rouge_package_counts_word_sets_and_summary_level_lcs() -> None:
    scores = rouge_package_scores("the cat sat on the mat", "the cat was on the mat")
    # unique words: 5 each side, 4 shared -> P = R = 0.8; bigram sets: 5 each, 3 shared -> 0.6
    assert scores["rouge-1"]["p"] == pytest.approx(0.8) and scores["rouge-1"]["r"] == pytest.approx(0.8)
    assert scores["rouge-2"]["f"] == pytest.approx(0.6, abs=1e-7)
    assert scores["rouge-l"]["f"] == pytest.approx(0.8, abs=1e-7)  # LCS words {the, cat, on, mat}
    # summary level: ref "a c" / "b d", hyp "a b" / "c d": union of sentence LCS words = all 4
    assert rouge_package_scores("a b. c d", "a c. b d")["rouge-l"]["r"] == pytest.approx(1.0)
    # words are sets (exclusive=True): hyp {the}, ref {the, cat} -> R = 1/2, P = 1, F = 2/3
    assert rouge_package_scores("the the the", "the cat")["rouge-l"]["f"] == pytest.approx(2 / 3, abs=1e-7)
    with pytest.raises(ValueError):
        rouge_package_scores("", "the cat")
    assert longbench_rouge_score("", "the cat") == 0.0  # the reference's bare except
    gov = _sample(["the cat was on the mat"], task="gov_report")
    assert longbench_score("the cat sat on the mat", gov) == pytest.approx(0.8, abs=1e-7)


def test_longbench_classification_keeps_the_official_quirks() -> None:
    classes = ["Individual", "City", "Location", "Country"]
    assert classification_score("City or Location", "City", classes) == 0.5  # 1 / #found
    assert classification_score("nothing named", "City", classes) == 0.0  # no fuzzy fallback
    # "Num" is part of (and differs from) the answer "Number": removed -> 1 / 1
    assert classification_score("Number", "Number", ["Num", "Number"]) == 1.0
    # remove-while-iterating skips the item after a removed one: "abc" survives -> 1 / 2
    assert classification_score("abcd", "abcd", ["ab", "abc", "abcd"]) == 0.5
    # trec keeps the first line only (eval.py): "City" found, the second line is not read
    trec = _sample(["City"], task="trec", all_classes=classes)
    assert longbench_score("\nCity\nLocation Country", trec) == 1.0
    assert longbench_score("City Location", trec) == 0.5


def test_longbench_retrieval_count_and_code_sim_match_worked_examples() -> None:
    assert retrieval_score("Paragraph 12, maybe Paragraph 3", "Paragraph 12") == 0.5
    assert retrieval_score("答案是段落5", "段落5", zh=True) == 1.0
    assert count_score("There are 7 unique paragraphs; 7 in total", "7") == 1.0
    assert count_score("5 or 7", "7") == 0.5 and count_score("none", "7") == 0.0
    # first line without ` / # / // ; difflib ratio 2M/T: "abcd" vs "abce" -> 6/8
    assert code_sim_score("```python\n# comment\nabcd\n", "abce") == 0.75
    assert fuzz_ratio("abc", "abd") == 67  # round(100 * 4 / 6)
    assert fuzz_ratio("", "") == 100 and fuzz_ratio("a", "") == 0
    lcc = _sample(["    return total"], task="lcc")
    assert longbench_score("    return total\nprint(1)", lcc) == 1.0


def test_longbench_families_apply_only_to_their_tasks() -> None:
    hotpot = _sample(["Paris"], task="hotpotqa")
    assert TASK_METRICS["longbench_qa_f1"]("Paris", hotpot) == 1.0
    assert TASK_METRICS["longbench_rouge_l"]("Paris", hotpot) is None
    plain = _sample(["Paris"])  # not a LongBench sample: the metric applies as is
    assert TASK_METRICS["longbench_qa_f1"]("Paris", plain) == 1.0
    assert longbench_score("Paris", plain) is None
    assert validate_task_metrics(["longbench_score", "string_match_all"]) == (
        "longbench_score",
        "string_match_all",
    )


# ---- InfiniteBench (src/compute_scores.py) -------------------------------------------------------
@pytest.mark.parametrize(
    ("task", "output", "answers", "score"),
    [
        ("passkey", "The pass key is 71432.", ["71432"], 1.0),
        ("passkey", "7143 2", ["71432"], 0.0),  # first run of digits only
        ("number_string", "2200012222", ["2200012222"], 1.0),
        ("kv_retrieval", 'The value is "beef-2".', ["beef-2"], 1.0),
        ("code_run", "So the return value is: -6", ["-6"], 1.0),
        ("code_run", "-6 is the value.", ["-6"], 0.0),  # the last word is read
        ("code_debug", "B. broken", ["broken", "B"], 1.0),
        ("code_debug", "The correct option is: C", ["broken", "B"], 0.0),
        ("code_debug", "I think the answer is: broken", ["broken", "B"], 1.0),
        ("math_find", "The largest number is 88.", ["88"], 1.0),
        ("math_find", "3.5", ["3"], 0.0),
        ("longdialogue_qa_eng", "ace", ["ACE", "ACE ROTHSTEIN"], 1.0),
        ("longbook_choice_eng", "C", ["Light housework", "C"], 1.0),
        ("longbook_choice_eng", "The answer is: C", ["Light housework", "C"], 1.0),
        ("longbook_choice_eng", "I think B is right", ["Light housework", "C"], 0.0),
        ("longbook_qa_chn", "北京市", ["北京"], 0.8),  # characters: P = 2/3, R = 1
        ("longbook_qa_chn", "北京。", ["北京"], 1.0),
        ("math_calc", "[1, 4, 9, 2]", ["1", "4", "8"], 2 / 3),  # correct prefix length / 3
    ],
)
def test_infinitebench_scores_match_worked_examples(
    task: str, output: str, answers: list[str], score: float
) -> None:
    assert infinitebench_score(output, _sample(answers, task=task)) == pytest.approx(score)


def test_rouge_score_lsum_and_rouge1_match_worked_examples() -> None:
    # ref "the cat was on the mat" (6 tokens); prediction lines "the cat sat" / "on the mat":
    # union of LCS positions {the, cat} + {on, the, mat} -> 5 hits; P = R = 5/6
    assert rouge_lsum("the cat sat\non the mat", "The cat was on the mat.") == pytest.approx(5 / 6)
    assert rouge_lsum("", "the cat") == 0.0
    sample = _sample(["The cat was on the mat."], task="longbook_sum_eng")
    assert infinitebench_score("the cat sat\non the mat", sample) == pytest.approx(5 / 6)
    # rouge_score's ROUGE-1: 6 lower-cased output tokens all in the 21-token needle -> F = 12/27
    needle = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
    assert rouge_n_score("Eat a sandwich in Dolores Park.", needle) == pytest.approx(12 / 27)
    # the needle metric is the rouge package's (kvpress): word sets, case kept ("Eat" is not "eat"):
    # 5 of the output's 6 words among the needle's 19 distinct ones -> P = 5/19, R = 5/6, F = 0.4
    score = TASK_METRICS["needle_rouge1"]("Eat a sandwich in Dolores Park.", _sample([needle]))
    assert score == pytest.approx(0.4, abs=1e-7)


# ---- LooGLE (Evaluation/automatic_metrics.py) ----------------------------------------------------
def test_loogle_bleu_is_nltk_bleu_without_smoothing() -> None:
    ref = ["the", "cat", "is", "on", "the", "mat"]
    # clipped unigrams 4/4; c = 4 < r = 6 -> BP = exp(1 - 6/4)
    assert bleu([ref], ["the", "cat", "the", "mat"], (1, 0, 0, 0)) == pytest.approx(math.exp(-0.5))
    # one 4-gram, matched: p4 = 1; BP = exp(1 - 5/4)
    assert bleu([list("abcde")], list("abcd"), (0, 0, 0, 1)) == pytest.approx(math.exp(-0.25))
    assert bleu([list("abcde")], list("abc"), (0, 0, 0, 1)) < 1e-300  # p4 = 0: method0's tiny float
    assert bleu([ref], ["dog"], (1, 0, 0, 0)) == 0.0
    sample = _sample(["the cat is on the mat"], task="shortdep_qa")
    assert TASK_METRICS["loogle_bleu1"]("the cat the mat", sample) == pytest.approx(math.exp(-0.5))
    assert TASK_METRICS["loogle_bleu1"]("", sample) == 0.0  # an empty output reads "None"


def test_loogle_rouge_is_recall_and_cloze_scores_share_of_masks() -> None:
    sample = _sample(["the cat was on the mat"], task="longdep_qa")
    # rouge-1 recall over word sets: {the, cat} of {the, cat, was, on, mat}
    assert TASK_METRICS["loogle_rouge1"]("the cat", sample) == pytest.approx(0.4)
    assert TASK_METRICS["loogle_rouge_l"]("the cat", sample) == pytest.approx(0.4)
    cloze = _sample(
        ["{}"], task="shortdep_cloze", cloze_answer={"<mask-0>": "Britney Spears", "<mask-1>": "Paris"}
    )
    out = "{'<mask-0>': 'Britney', '<mask-1>': 'Paris'}"
    assert TASK_METRICS["loogle_cloze_exact"](out, cloze) == 0.5  # mask-1 exact
    assert TASK_METRICS["loogle_cloze_partial"](out, cloze) == 1.0  # both share a word
    assert TASK_METRICS["loogle_cloze_exact"]("not a dict", cloze) == 0.0
    assert TASK_METRICS["loogle_bleu1"](out, cloze) is None  # similarity metrics skip the cloze task
    assert TASK_METRICS["loogle_cloze_exact"](out, sample) is None
    assert score_output(out, cloze, ["loogle_cloze_exact", "loogle_rouge1"]) == {"loogle_cloze_exact": 0.5}


#: outputs no scorer can read: empty, control characters, a broken literal, prose, Chinese, long
UNPARSEABLE = ["", "\x00\x07", "{'<mask-0>': [", "I do not know.", "我不知道。", "lorem ipsum " * 400]

#: per metric, samples it must score (well-formed, as their datasets load them)
SUITE_SAMPLES: dict[str, list[Sample]] = {
    "string_match_all": [_sample(["123", "456"], task="niah_multivalue")],
    "string_match_part": [_sample(["123", "456"], task="qa_1")],
    "longbench_score": [
        _sample(["Paris"], task="hotpotqa"),
        _sample(["the cat was on the mat"], task="gov_report"),
        _sample(["City"], task="trec", all_classes=["City", "Location"]),
        _sample(["Paragraph 3"], task="passage_retrieval_en"),
        _sample(["段落3"], task="passage_retrieval_zh"),
        _sample(["7"], task="passage_count"),
        _sample(["    return total"], task="lcc"),
    ],
    "longbench_qa_f1": [_sample(["Paris"], task="hotpotqa"), _sample(["Paris"])],
    "longbench_rouge_l": [_sample(["the cat"], task="qmsum")],
    "longbench_classification": [_sample(["City"], task="lsht", all_classes=["City", "Location"])],
    "longbench_retrieval": [_sample(["Paragraph 3"])],
    "longbench_retrieval_zh": [_sample(["段落3"])],
    "longbench_count": [_sample(["7"])],
    "longbench_code_sim": [_sample(["    return total"], task="repobench-p")],
    "infinitebench_score": [
        _sample(["71432"], task="passkey"),
        _sample(["2200012222"], task="number_string"),
        _sample(["beef-2"], task="kv_retrieval"),
        _sample(["The cat was on the mat."], task="longbook_sum_eng"),
        _sample(["Light housework", "C"], task="longbook_choice_eng"),
        _sample(["fighting"], task="longbook_qa_eng"),
        _sample(["北京"], task="longbook_qa_chn"),
        _sample(["ACE", "ACE ROTHSTEIN"], task="longdialogue_qa_eng"),
        _sample(["88"], task="math_find"),
        _sample(["1", "3", "6"], task="math_calc"),
        _sample(["-6"], task="code_run"),
        _sample(["broken", "B"], task="code_debug"),
    ],
    "loogle_bleu1": [_sample(["the cat is on the mat"], task="shortdep_qa")],
    "loogle_bleu4": [_sample(["the cat is on the mat"], task="longdep_qa")],
    "loogle_rouge1": [_sample(["the cat is on the mat"], task="longdep_summarization")],
    "loogle_rouge2": [_sample(["the cat is on the mat"], task="shortdep_qa")],
    "loogle_rouge_l": [_sample(["the cat is on the mat"], task="shortdep_qa")],
    "loogle_cloze_exact": [_sample(["{}"], task="shortdep_cloze", cloze_answer={"<mask-0>": "Paris"})],
    "loogle_cloze_partial": [_sample(["{}"], task="shortdep_cloze", cloze_answer={"<mask-0>": "Paris"})],
    "needle_rouge1": [_sample(["The best thing to do in San Francisco is eat a sandwich."])],
    "longbench_qa_f1_zh": [_sample(["北京"], task="multifieldqa_zh")],
    "longbench_rouge_zh": [_sample(["会议讨论项目进度。"], task="vcsum")],
    "longbench_v2_accuracy": [_sample(["B"])],
    "math_verify_accuracy": [_sample(["\\frac{1}{2}"]), _sample(["70"])],
    "scbench_score": [
        Sample("s", "p", meta={"task": task, "label": label})
        for task, label in [
            ("scbench_kv", "beef-2"),
            ("scbench_passkey", "71432"),
            ("scbench_choice_eng", ["Georgie", "B"]),
            ("scbench_qa_eng", ["ACE"]),
            ("scbench_many_shot", ["positive"]),
            ("scbench_qa_chn", ["北京"]),
            ("scbench_mf", 88),
            ("scbench_vt", ["ABC", "DEF"]),
            ("scbench_summary", "The cat was on the mat."),
        ]
    ],
}


@pytest.mark.parametrize("name", sorted(SUITE_SAMPLES))
def test_an_unparseable_output_scores_a_number_and_never_leaves_the_mean(name: str) -> None:
    """Every suite metric passes its own sample check on well-formed samples and gives every
    unparseable output a score in [0, 1] (the official code's, normally 0), never None."""
    check_task_samples([name], SUITE_SAMPLES[name])
    for sample, output in itertools.product(SUITE_SAMPLES[name], UNPARSEABLE):
        value = TASK_METRICS[name](output, sample)
        assert value is not None and 0.0 <= value <= 1.0, (name, sample.meta, output[:20], value)
        assert score_output(output, sample, [name]) == {name: value}


def test_every_suite_metric_refuses_or_scores_any_sample() -> None:
    """On arbitrary samples, a metric either refuses the sample at load (its check), or returns
    a score in [0, 1], or None (no answers; a task it does not score): it never raises."""
    names = sorted(SUITE_SAMPLES)  # every benchmark suite's metric but the VLM ones
    tasks = [
        None,
        "hotpotqa",
        "trec",
        "passage_retrieval_en",
        "lcc",
        "code_debug",
        "math_find",
        "shortdep_cloze",
    ]
    answers = [[], ["The Eiffel Tower"], ["x", "A"], ["Paragraph 3"], ["7"]]
    for task, refs, output in itertools.product(
        tasks, answers, ["", "Paragraph 3", "A. x", "{'a': 1}", "\x00"]
    ):
        sample = Sample("s", "p", answers=refs, meta={} if task is None else {"task": task})
        for name in names:
            check = SAMPLE_CHECKS.get(name)
            if check is not None and check(sample) is not None:
                continue  # refused when the dataset loads
            value = TASK_METRICS[name](output, sample)
            assert value is None or 0.0 <= value <= 1.0, (name, task, refs, output, value)
