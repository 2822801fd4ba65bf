"""CriticalKV (Feng et al. 2025) over Python lists, from the paper's bound: the value term
``||W_o^h v_t||_p`` of the output perturbation ``A_t ||W_o^h v_t||_1``, and the second stage's score
``(A_t + epsilon) ||W_o^h v_t||_1`` (the reference code's epsilon)."""

from __future__ import annotations


def projected_value_norm(v: list[list[list[float]]], w_o: list[list[float]], heads: int, p: int = 1):
    """``[Hkv][n]``: per KV head j and token t, the mean over the query heads h of j's group of
    ``||W_o^h v_{j,t}||_p``, with ``W_o^h[e][d] = w_o[e][h D + d]`` (``w_o`` is ``[E][H D]``)."""
    kv_heads, dim = len(v), len(v[0][0])
    group = heads // kv_heads
    out = []
    for j in range(kv_heads):
        row = []
        for value in v[j]:
            total = 0.0
            for h in range(j * group, (j + 1) * group):
                projected = [sum(w_o[e][h * dim + d] * value[d] for d in range(dim)) for e in range(len(w_o))]
                total += sum(abs(x) ** p for x in projected) ** (1.0 / p)
            row.append(total / group)
        out.append(row)
    return out


def second_stage_scores(attention: list[float], projected: list[float], epsilon: float) -> list[float]:
    """``(A_t + epsilon) * ||W_o v_t||`` per token (an infinite attention stays infinite)."""
    return [(a + epsilon) * p for a, p in zip(attention, projected, strict=True)]
