"""Chunk retrieval (HybridKV's dynamic heads, Appendix A; the ``retrieve`` selector), naive: the
chunks chosen by a brute-force ranking of mean keys, and the check that a retrieving head attended to
exactly the chosen entries."""

from __future__ import annotations

import torch

from naive.attention import dot, naive_attention


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


def assert_attends_to(got, query, ctx, decoded, where: tuple[int, int, int], positions: list[int]) -> None:
    """Each query head of KV head ``h`` of sample ``b`` (``where = (b, h, G)``, G query heads per KV
    head) got, in ``got [B, H, 1, D]``, one softmax over the prompt entries at ``positions`` of
    ``ctx``'s keys and values followed by the ``decoded`` ``(k, v)`` steps (``[B, Hkv, 1, D]`` each)."""
    b, h, G = where
    keys = [ctx.keys[b, h, j].tolist() for j in positions] + [k[b, h, 0].tolist() for k, _ in decoded]
    values = [ctx.values[b, h, j].tolist() for j in positions] + [v[b, h, 0].tolist() for _, v in decoded]
    for g in range(G):
        want = naive_attention(query[b, h * G + g, 0].tolist(), keys, values, ctx.scaling)
        torch.testing.assert_close(
            got[b, h * G + g, 0], torch.tensor(want, dtype=torch.float32), atol=1e-5, rtol=1e-5
        )
