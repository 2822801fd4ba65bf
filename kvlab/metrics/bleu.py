"""BLEU as NLTK's ``sentence_bleu`` computes it without smoothing (LooGLE's BLEU-1 and BLEU-4)."""

from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Sequence

__all__ = ["bleu"]


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
