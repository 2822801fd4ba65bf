"""FastV (Chen et al. 2024) over Python lists: the attention each token receives at layer K - 1,
averaged over the heads (from the last query, as the released code, or from every query, as the
paper's text), and the tokens a layer from K on keeps: every text token and the
``round((1 - R) N_img)`` image tokens of highest rank."""

from __future__ import annotations

from naive.attention import dot, softmax


def attention_row(q: list[float], k: list[list[float]], position: int, scaling: float) -> list[float]:
    """Causal softmax of the query at ``position`` over the keys ``k [n][D]`` (0 after ``position``)."""
    probs = softmax([dot(q, k[j]) * scaling for j in range(position + 1)])
    return probs + [0.0] * (len(k) - position - 1)


def received_attention(q, k, scaling: float, queries: str = "last") -> list[float]:
    """``[n]``: the mean over query heads h (KV head h // G) of the attention the last query pays
    each token (``last``), or of the mean over all n queries of it (``all``)."""
    heads, kv_heads, n = len(q), len(k), len(k[0])
    group = heads // kv_heads
    total = [0.0] * n
    for h in range(heads):
        rows = [n - 1] if queries == "last" else list(range(n))
        for i in rows:
            row = attention_row(q[h][i], k[h // group], i, scaling)
            for t in range(n):
                total[t] += row[t] / len(rows)
    return [x / heads for x in total]


def fastv_keep(ranking: list[float], image: list[bool], drop: float) -> list[int]:
    """Kept positions: every text token, and of the image tokens the ``round((1 - drop) N_img)``
    highest in ``ranking`` (ties to the lower position)."""
    images = [t for t in range(len(ranking)) if image[t]]
    keep = round(len(images) * (1 - drop))
    top = sorted(images, key=lambda t: (-ranking[t], t))[:keep]
    return sorted([t for t in range(len(ranking)) if not image[t]] + top)
