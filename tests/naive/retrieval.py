"""Chunk retrieval (HybridKV's dynamic heads, Appendix A; the ``retrieve`` selector), naive: the
chunks chosen by a brute-force ranking of mean keys."""

from __future__ import annotations

from naive.attention import dot


def naive_chunk_choice(
    q_group: list[list[float]], keys: list[list[float]], chunk: int, n_sel: int
) -> list[int]:
    """Brute force: rank the ``chunk``-token chunks of ``keys [m][D]`` by the mean over the chunk's
    tokens and the group's queries of ``q . k_j``; the top ``n_sel`` chunk ids (ties: lower id), ascending."""
    m = len(keys)
    chunks = [list(range(c, min(c + chunk, m))) for c in range(0, m, chunk)]
    score = [
        sum(dot(qv, keys[j]) for qv in q_group for j in tokens) / (len(q_group) * len(tokens))
        for tokens in chunks
    ]
    order = sorted(range(len(chunks)), key=lambda c: (-score[c], c))
    return sorted(order[:n_sel])
