"""ROUGE as the two packages that benchmarks call compute it (re-implemented, not imported).

- pltrdy's ``rouge`` package 1.0.1 (:func:`rouge_package_scores`; LongBench's ``rouge_score``,
  LooGLE's ROUGE-1/2/L): sentences split on periods, n-grams and LCS words counted as sets
  (``exclusive=True``), case kept; summary-level ROUGE-L.
- Google's ``rouge_score`` (:func:`rouge_n_score`, :func:`rouge_lsum`; InfiniteBench's
  ``evaluate.load("rouge")``, kvpress's needle scorer): lower-cased alphanumeric tokens
  (:func:`rouge_score_tokens`, no stemmer), clipped n-gram counts, ``rougeLsum`` over sentences
  split on newlines.

Differences from the packages kept on purpose are listed in ``docs/benchmark_suites.md``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

__all__ = [
    "rouge_lsum",
    "rouge_n_score",
    "rouge_package_scores",
    "rouge_score_tokens",
]


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
