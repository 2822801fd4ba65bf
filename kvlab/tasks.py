"""Per-sample task scores recorded in the predictions (the full metric suite comes with evaluation)."""

from __future__ import annotations

import re
import string

from kvlab.data.sample import Sample


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and articles, collapse whitespace (SQuAD normalisation)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def score_output(output: str, sample: Sample) -> dict[str, float]:
    """``exact_match`` and ``contains_answer`` (1.0 or 0.0) against the sample's answers.

    Returns an empty dict for samples without answers.
    """
    if not sample.answers:
        return {}
    pred = normalize_answer(output)
    refs = [normalize_answer(a) for a in sample.answers]
    return {
        "exact_match": float(any(pred == ref for ref in refs)),
        "contains_answer": float(any(ref and ref in pred for ref in refs)),
    }
