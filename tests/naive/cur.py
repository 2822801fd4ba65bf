"""CurDKV's scores over Python lists (fp64), from the formula kvpress' CURPress computes: squared
row norms (of a sketch when given), shares of their local window, combined, normalised."""

from __future__ import annotations


def squared_norms(states: list[list[float]], sketch: list[list[float]] | None) -> list[float]:
    """``||x_t G||^2`` (``||x_t||^2`` without a sketch ``G [D][r]``) of each row ``x_t``."""
    if sketch is not None:
        states = [
            [sum(x[c] * sketch[c][j] for c in range(len(x))) for j in range(len(sketch[0]))] for x in states
        ]
    return [sum(c * c for c in x) for x in states]


def local(scores: list[float], window: int | None) -> list[float]:
    """Each score over the sum of its window of ``window`` positions (``[0, w), [w, 2w), ...``)."""
    if window is None:
        return list(scores)
    out = []
    for t, s in enumerate(scores):
        start = (t // window) * window
        out.append(s / sum(scores[start : start + window]))
    return out


def naive_cur(
    k: list[list[float]],
    v: list[list[float]],
    leverage: str,
    window: int | None,
    sketch: list[list[float]] | None = None,
) -> list[float]:
    """One (sample, KV head)'s scores, ``k`` and ``v`` ``[n][D]``."""
    k2 = local(squared_norms(k, sketch), window)
    v2 = local(squared_norms(v, sketch), window)
    combine = {
        "key": lambda a, b: a,
        "value": lambda a, b: b,
        "kv_avg": lambda a, b: (a + b) / 2,
        "kv_product": lambda a, b: a * b,
    }[leverage]
    scores = [combine(a, b) for a, b in zip(k2, v2, strict=True)]
    total = sum(scores)
    return [s / total for s in scores]
