"""Task metrics of the vision-language benchmarks, as their reference implementations score them.

Each function maps ``(output, Sample)`` to a score in [0, 1] (None when the sample has no
answers) and is registered in :data:`kvlab.metrics.tasks.TASK_METRICS` when this module is
imported (the package ``kvlab.metrics`` imports it). The output is stripped of surrounding whitespace
first; every other step follows lmms-eval's task code (``lmms_eval/tasks/<task>/utils.py``),
which copies each benchmark's official scorer, quirks included (``docs/vlm_tasks.md``):

- ``anls`` (DocVQA; Biten et al. 2019, "Scene Text Visual Question Answering", Sec. 4):
  ``1 - min_a NL(a, o)`` over the answers, 0 below 0.5. ``NL`` is the Levenshtein distance of
  the lower-cased, whitespace-collapsed strings over ``max(len(a), len(o))`` of the strings
  *before* collapsing (the reference's denominator).
- ``relaxed_accuracy`` (ChartQA; Masry et al. 2022, Sec. 5.1): a number within 5% of a
  numeric answer (``"45%"`` reads 0.45), otherwise a case-insensitive exact match. An answer
  of 0 falls back to the string match (the reference's ``if target_float`` test).
- ``vqa_accuracy`` (TextVQA, VQAv2; Antol et al. 2015, "VQA: Visual Question Answering", Sec. 4):
  the output and the (10) answers normalised by the official EvalAI answer processor, then
  ``mean_i min(1, #{j != i : a_j = o} / 3)``.
- ``ocrbench`` (Liu et al. 2024, "OCRBench"): 1 when an answer occurs in the lower-cased
  output (HME100k formulas: with spaces and newlines removed, the answer's case kept);
  the benchmark's score is the sum over its 1000 questions, i.e. 1000 x this mean.
- ``mmmu_accuracy`` (Yue et al. 2024, "MMMU", the official ``eval_utils.py``): multiple
  choice: the letter :func:`parse_multi_choice` reads equals the answer's; open questions:
  :func:`parse_open` 's numbers or strings match the normalised answer.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Sequence

from kvlab.data.sample import Sample
from kvlab.metrics.tasks import register_task_metrics

__all__ = [
    "anls",
    "mmmu_accuracy",
    "ocrbench_score",
    "parse_multi_choice",
    "parse_open",
    "relaxed_accuracy",
    "vqa_accuracy",
    "vqa_normalize",
]


# ---------------------------------------------------------------------------------------------
# ANLS (DocVQA)


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions of one character each)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def _collapse(text: str) -> str:
    return " ".join(text.strip().lower().split())


def anls_value(output: str, answers: Sequence[str], threshold: float = 0.5) -> float:
    """ANLS of one output against its answers (see the module docstring)."""
    distances = []
    for answer in answers:
        length = max(len(answer.upper()), len(output.upper()))  # the reference's raw lengths
        distances.append(0.0 if length == 0 else levenshtein(_collapse(answer), _collapse(output)) / length)
    score = 1.0 - min(distances)
    return score if score >= threshold else 0.0


def anls(output: str, sample: Sample) -> float | None:
    """DocVQA's Average Normalized Levenshtein Similarity of one sample."""
    return anls_value(output.strip(), sample.answers) if sample.answers else None


# ---------------------------------------------------------------------------------------------
# Relaxed accuracy (ChartQA)


def _to_float(text: str) -> float | None:
    try:
        return float(text.rstrip("%")) / 100.0 if text.endswith("%") else float(text)
    except ValueError:
        return None


def relaxed_correct(output: str, target: str, max_relative_change: float = 0.05) -> bool:
    """ChartQA's relaxed correctness of one output against one answer."""
    predicted, expected = _to_float(output), _to_float(target)
    if predicted is not None and expected:
        return abs(predicted - expected) / abs(expected) <= max_relative_change
    return output.lower() == target.lower()


def relaxed_accuracy(output: str, sample: Sample) -> float | None:
    """1 if the output is relaxed-correct against an answer (ChartQA's ``relaxed_overall``)."""
    if not sample.answers:
        return None
    return float(any(relaxed_correct(output.strip(), answer) for answer in sample.answers))


# ---------------------------------------------------------------------------------------------
# VQA accuracy (TextVQA): the EvalAI answer processor


_CONTRACTIONS = {
    "aint": "ain't", "arent": "aren't", "cant": "can't", "couldve": "could've", "couldnt": "couldn't",
    "couldn'tve": "couldn't've", "couldnt've": "couldn't've", "didnt": "didn't", "doesnt": "doesn't",
    "dont": "don't", "hadnt": "hadn't", "hadnt've": "hadn't've", "hadn'tve": "hadn't've", "hasnt": "hasn't",
    "havent": "haven't", "hed": "he'd", "hed've": "he'd've", "he'dve": "he'd've", "hes": "he's",
    "howd": "how'd", "howll": "how'll", "hows": "how's", "Id've": "I'd've", "I'dve": "I'd've", "Im": "I'm",
    "Ive": "I've", "isnt": "isn't", "itd": "it'd", "itd've": "it'd've", "it'dve": "it'd've", "itll": "it'll",
    "let's": "let's", "maam": "ma'am", "mightnt": "mightn't", "mightnt've": "mightn't've",
    "mightn'tve": "mightn't've", "mightve": "might've", "mustnt": "mustn't", "mustve": "must've",
    "neednt": "needn't", "notve": "not've", "oclock": "o'clock", "oughtnt": "oughtn't",
    "ow's'at": "'ow's'at", "'ows'at": "'ow's'at", "'ow'sat": "'ow's'at", "shant": "shan't",
    "shed've": "she'd've", "she'dve": "she'd've", "she's": "she's", "shouldve": "should've",
    "shouldnt": "shouldn't", "shouldnt've": "shouldn't've", "shouldn'tve": "shouldn't've",
    "somebody'd": "somebodyd", "somebodyd've": "somebody'd've", "somebody'dve": "somebody'd've",
    "somebodyll": "somebody'll", "somebodys": "somebody's", "someoned": "someone'd",
    "someoned've": "someone'd've", "someone'dve": "someone'd've", "someonell": "someone'll",
    "someones": "someone's", "somethingd": "something'd", "somethingd've": "something'd've",
    "something'dve": "something'd've", "somethingll": "something'll", "thats": "that's",
    "thered": "there'd", "thered've": "there'd've", "there'dve": "there'd've", "therere": "there're",
    "theres": "there's", "theyd": "they'd", "theyd've": "they'd've", "they'dve": "they'd've",
    "theyll": "they'll", "theyre": "they're", "theyve": "they've", "twas": "'twas", "wasnt": "wasn't",
    "wed've": "we'd've", "we'dve": "we'd've", "weve": "we've", "werent": "weren't", "whatll": "what'll",
    "whatre": "what're", "whats": "what's", "whatve": "what've", "whens": "when's", "whered": "where'd",
    "wheres": "where's", "whereve": "where've", "whod": "who'd", "whod've": "who'd've",
    "who'dve": "who'd've", "wholl": "who'll", "whos": "who's", "whove": "who've", "whyll": "why'll",
    "whyre": "why're", "whys": "why's", "wont": "won't", "wouldve": "would've", "wouldnt": "wouldn't",
    "wouldnt've": "wouldn't've", "wouldn'tve": "wouldn't've", "yall": "y'all", "yall'll": "y'all'll",
    "y'allll": "y'all'll", "yall'd've": "y'all'd've", "y'alld've": "y'all'd've", "y'all'dve": "y'all'd've",
    "youd": "you'd", "youd've": "you'd've", "you'dve": "you'd've", "youll": "you'll", "youre": "you're",
    "youve": "you've",
}  # fmt: skip
_NUMBERS = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5",
            "six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10"}  # fmt: skip
_ARTICLES = ("a", "an", "the")
# the official pattern: "(?!<=\d)" is a (no-op) lookahead, as written in the VQA evaluation code
_PERIOD_STRIP = re.compile(r"(?!<=\d)(\.)(?!\d)")
_COMMA_STRIP = re.compile(r"(?<=\d)(\,)+(?=\d)")
_PUNCTUATION = (";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`",
                ",", "?", "!")  # fmt: skip
# the reference passes re.UNICODE (= 32) as sub()'s `count`: at most 32 periods are removed
_PERIOD_COUNT = int(re.UNICODE)


def _punctuation(text: str) -> str:
    out = text
    for p in _PUNCTUATION:
        if p + " " in text or " " + p in text or _COMMA_STRIP.search(text) is not None:
            out = out.replace(p, "")
        else:
            out = out.replace(p, " ")
    return _PERIOD_STRIP.sub("", out, count=_PERIOD_COUNT)


def _digits_articles(text: str) -> str:
    kept = [_NUMBERS.get(w, w) for w in text.lower().split()]
    kept = [w for w in kept if w not in _ARTICLES]
    return " ".join(_CONTRACTIONS.get(w, w) for w in kept)


def vqa_normalize(answer: str) -> str:
    """The EvalAI / VQA answer processor: lower case, commas and ``?`` dropped, punctuation,
    periods, articles removed, number words as digits, contractions restored."""
    text = answer.lower().replace(",", "").replace("?", "").replace("'s", " 's").strip()
    text = text.replace("\n", " ").replace("\t", " ").strip()
    return _digits_articles(_punctuation(text))


def vqa_accuracy_value(output: str, answers: Sequence[str]) -> float:
    """``mean_i min(1, #{j != i : a_j = o} / 3)`` over the normalised answers ``a``."""
    predicted = vqa_normalize(output)
    normalized = [vqa_normalize(a) for a in answers]
    scores = []
    for i in range(len(normalized)):
        matches = sum(1 for j, a in enumerate(normalized) if j != i and a == predicted)
        scores.append(min(1.0, matches / 3))
    return sum(scores) / len(scores)


def vqa_accuracy(output: str, sample: Sample) -> float | None:
    """VQA accuracy of one sample (TextVQA's ``exact_match`` in lmms-eval)."""
    return vqa_accuracy_value(output.strip(), sample.answers) if sample.answers else None


# ---------------------------------------------------------------------------------------------
# OCRBench

#: OCRBench's source dataset whose answers are LaTeX formulas (compared without spaces)
HME_DATASET = "HME100k"


def ocrbench_value(output: str, answers: Sequence[str], dataset: str) -> float:
    """1.0 when an answer occurs in the output (OCRBench's rule; see the module docstring)."""
    predicted = output.lower().strip().replace("\n", " ")
    for answer in answers:
        if dataset == HME_DATASET:
            found = answer.strip().replace("\n", " ").replace(" ", "") in predicted.replace(" ", "")
        else:
            found = answer.lower().strip().replace("\n", " ") in predicted
        if found:
            return 1.0
    return 0.0


def ocrbench_score(output: str, sample: Sample) -> float | None:
    """OCRBench's 0/1 score; the source dataset is ``sample.meta["dataset"]``."""
    if not sample.answers:
        return None
    return ocrbench_value(output.strip(), sample.answers, str(sample.meta.get("dataset", "")))


# ---------------------------------------------------------------------------------------------
# MMMU


def parse_multi_choice(
    response: str, letters: Sequence[str], options: dict[str, str], rng: random.Random
) -> str:
    """The letter a response picks (MMMU's ``parse_multi_choice_response``).

    In order: a bracketed letter ``(B)``; a letter followed by a space; a letter followed by a
    period; for responses of more than 5 words, an option's text. Several candidates: the one
    found last. None: a random letter drawn from ``rng`` (the reference draws at random too).
    """
    for char in (",", ".", "!", "?", ";", ":", "'"):
        response = response.strip(char)
    response = f" {response} "
    candidates = [c for c in letters if f"({c})" in response]
    bracketed, by_letter = bool(candidates), True
    if not candidates:
        candidates = [c for c in letters if f"{c} " in response]
    if not candidates:
        candidates = [c for c in letters if f"{c}." in response]
    if not candidates and len(response.split()) > 5:
        candidates = [c for c in letters if options[c].lower() in response.lower()]
        by_letter = not candidates
    if not candidates:
        return rng.choice(list(letters))
    if len(candidates) == 1:
        return candidates[0]
    if not by_letter:
        starts = [response.lower().rfind(options[c].lower()) for c in candidates]
    elif bracketed:
        starts = [response.rfind(f"({c})") for c in candidates]
    else:
        starts = [response.rfind(f" {c} ") for c in candidates]
    return candidates[max(range(len(starts)), key=starts.__getitem__)]  # first of the latest


def _is_number(text: str) -> bool:
    try:
        float(text.replace(",", ""))
        return True
    except ValueError:
        return False


def mmmu_normalize(text: str) -> list[str | float]:
    """MMMU's ``normalize_str``: a number rounded to 2 decimals, else the lower-cased string (a
    single character padded with a space on either side, so it matches only as a word)."""
    text = text.strip()
    if _is_number(text):
        return [round(float(text.replace(",", "")), 2)]
    text = text.lower()
    return [" " + text, text + " "] if len(text) == 1 else [text]


_NUMBER_PATTERNS = (
    re.compile(r"-?\b\d{1,3}(?:,\d{3})+\b"),  # with thousands separators
    re.compile(r"-?\d+(?:\.\d+)?[eE][+-]?\d+"),  # scientific notation
    re.compile(r"-?(?:\d+\.\d+|\.\d+|\d+\b)(?![eE][+-]?\d+)(?![,\d])"),  # plain
)
_KEY_INDICATORS = ("could be ", "so ", "is ", "thus ", "therefore ", "final ", "answer ", "result ")
_TRIVIAL = {":", ",", ".", "!", "?", ";", "'"}


def _key_responses(response: str) -> list[str]:
    """The tail after the last answer indicator ("is ", "so ", ...) of each sentence, shortest wins."""
    response = response.strip().strip(".").lower()
    parts = re.split(r"\.\s(?=[A-Z])|\n", response)
    keys = []
    for index, part in enumerate(parts):
        indicators = _KEY_INDICATORS + (("=",) if index == len(parts) - 1 else ())
        shortest = None
        for indicator in indicators:
            if indicator in part:
                tail = part.split(indicator)[-1].strip()
                # as the reference: an empty tail found first is replaced by the next one found
                if not shortest or len(tail) < len(shortest):
                    shortest = tail
        if shortest and shortest.strip() not in _TRIVIAL:
            keys.append(shortest)
    return keys or [response]


def parse_open(response: str) -> list[str | float]:
    """MMMU's ``parse_open_response``: candidate answers (strings and numbers) of a free response."""
    keys = _key_responses(response)
    found = list(keys)
    for key in keys:
        for pattern in _NUMBER_PATTERNS:
            found.extend(pattern.findall(key))
    return list({value for item in found for value in mmmu_normalize(item)})


def open_correct(answers: str | Sequence[str], predictions: Sequence[str | float]) -> bool:
    """MMMU's ``eval_open``: a predicted string contains a normalised answer, or a predicted
    number equals one."""
    gold = [answers] if isinstance(answers, str) else list(answers)
    normalized = [value for answer in gold for value in mmmu_normalize(answer)]
    for predicted in predictions:
        if isinstance(predicted, str):
            if any(isinstance(a, str) and a in predicted for a in normalized):
                return True
        elif predicted in normalized:
            return True
    return False


def _options(sample: Sample) -> list[str]:
    if sample.choices:
        return list(sample.choices)
    raw = sample.meta.get("options")
    return list(ast.literal_eval(raw)) if isinstance(raw, str) and raw.strip() else []


def mmmu_accuracy(output: str, sample: Sample) -> float | None:
    """MMMU's per-question accuracy (multiple choice when the sample has options, else open).

    An unparseable multiple-choice response gets a letter drawn from ``random.Random`` seeded
    with the sample id: random as the reference, but the same on every run.
    """
    if not sample.answers:
        return None
    options = _options(sample)
    if options and sample.meta.get("question_type", "multiple-choice") == "multiple-choice":
        letters = [chr(65 + i) for i in range(len(options))]
        rng = random.Random(f"mmmu:{sample.id}")
        picked = parse_multi_choice(output.strip(), letters, dict(zip(letters, options, strict=True)), rng)
        return float(picked in sample.answers)
    answers = sample.answers[0] if len(sample.answers) == 1 else sample.answers
    return float(open_correct(answers, parse_open(output.strip())))


register_task_metrics(
    {
        "anls": anls,
        "relaxed_accuracy": relaxed_accuracy,
        "vqa_accuracy": vqa_accuracy,
        "ocrbench": ocrbench_score,
        "mmmu_accuracy": mmmu_accuracy,
    }
)
