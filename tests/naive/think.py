"""ThinK's key channel pruning, naive: loops over Python lists, written from the paper (Xu et al.
2024, Sec. 3: the query-driven criterion ``||Q_w[:, i] K[:, i]^T||_F``) and from attention's
definition for the decode over pruned keys.

``naive_channel_scores`` rates channel ``i`` of one KV head as the Frobenius norm of the outer
product of the window queries' column ``i`` (every query head of the group, every window query)
with the kept keys' column ``i``, computed as the square root of the sum of its squared cells;
``naive_pruned_attention`` attends dense keys whose pruned channels are zero.
"""

from __future__ import annotations

import math


def naive_channel_scores(queries: list[list[float]] | None, keys: list[list[float]]) -> list[float]:
    """``[D]``: ``sqrt(sum_{t, s} (q_t[i] * k_s[i])^2)`` over the rows ``q_t`` of ``queries [Q][D]``
    and ``k_s`` of ``keys [n][D]``; without queries (``None``, the query-agnostic magnitude),
    ``sqrt(sum_s k_s[i]^2)``."""
    D = len(keys[0])
    scores = []
    for i in range(D):
        total = 0.0
        for k in keys:
            if queries is None:
                total += k[i] * k[i]
            else:
                for q in queries:
                    total += (q[i] * k[i]) ** 2
        scores.append(math.sqrt(total))
    return scores


def naive_kept_channels(scores: list[float], keep: float) -> list[int]:
    """The ``ceil(keep * D)`` best channels (ties to the lower channel), ascending."""
    count = max(1, math.ceil(round(keep * len(scores), 6)))
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return sorted(order[:count])


def naive_pruned_attention(
    query: list[float],
    prompt_keys: list[list[float]],
    prompt_values: list[list[float]],
    channels: list[int],
    decode_keys: list[list[float]],
    decode_values: list[list[float]],
    scaling: float,
) -> list[float]:
    """One query ``[D]`` over a head's prompt entries, whose keys keep only ``channels`` (the others
    zero), and its decoded entries (every channel): ``softmax(q . k * scaling) v``."""
    kept = set(channels)
    logits = [
        scaling * sum(q * k for i, (q, k) in enumerate(zip(query, key, strict=True)) if i in kept)
        for key in prompt_keys
    ]
    logits += [scaling * sum(q * k for q, k in zip(query, key, strict=True)) for key in decode_keys]
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    total = sum(weights)
    values = prompt_values + decode_values
    return [sum(w * v[d] for w, v in zip(weights, values, strict=True)) / total for d in range(len(query))]
