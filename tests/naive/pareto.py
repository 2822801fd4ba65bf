"""The Pareto front of (bytes, score) points, naive: every pair compared, written from the
definition (a point is dominated when another has at most its bytes and at least its score, one
of the two strictly better; the front is the points nothing dominates)."""

from __future__ import annotations


def naive_pareto_front(points: list[tuple[float, float]]) -> set[int]:
    """Indices of the points no other point dominates."""
    front = set()
    for i, (bytes_i, score_i) in enumerate(points):
        dominated = False
        for j, (bytes_j, score_j) in enumerate(points):
            if (
                j != i
                and bytes_j <= bytes_i
                and score_j >= score_i
                and (bytes_j < bytes_i or score_j > score_i)
            ):
                dominated = True
        if not dominated:
            front.add(i)
    return front
