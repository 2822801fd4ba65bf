"""VL-Cache over Python lists (fp64), from the paper (Tu et al. 2024): the post-vision queries'
accumulated attention per token, a layer's post-vision density (entries at or above a share of
their row's maximum) and the layer budgets proportional to the densities."""

from __future__ import annotations

from naive.attention import dot, softmax


def post_vision_rows(q, k, scale: float, first: int) -> list[list[list[float]]]:
    """``[H][rows][n]``: the causal attention of queries ``first .. n - 1`` of one unpadded sample
    (``q [H][n][D]``, ``k [Hkv][n][D]``), zero beyond each row's position."""
    heads, n = len(q), len(q[0])
    group = heads // len(k)
    out = []
    for h in range(heads):
        rows = []
        for i in range(first, n):
            probs = softmax([scale * dot(q[h][i], k[h // group][t]) for t in range(i + 1)])
            rows.append(probs + [0.0] * (n - i - 1))
        out.append(rows)
    return out


def post_vision_scores(rows: list[list[list[float]]], kv_heads: int) -> list[list[float]]:
    """``[Hkv][n]``: the rows summed per query head, averaged over each KV head's group."""
    heads = len(rows)
    group = heads // kv_heads
    sums = [[sum(row[t] for row in rows[h]) for t in range(len(rows[h][0]))] for h in range(heads)]
    return [
        [sum(sums[j * group + g][t] for g in range(group)) / group for t in range(len(sums[0]))]
        for j in range(kv_heads)
    ]


def density(rows: list[list[list[float]]], first: int, threshold: float) -> float:
    """The share of allowed entries (row ``i`` sees keys ``0 .. first + i``) at or above
    ``threshold`` times the row's maximum, over every head and row."""
    dense = allowed = 0
    for head in rows:
        for r, row in enumerate(head):
            seen = row[: first + r + 1]
            top = max(seen)
            dense += sum(1 for x in seen if x >= threshold * top)
            allowed += len(seen)
    return dense / allowed


def layer_budgets(densities: list[float], budget: int, length: int, protected: int) -> list[float]:
    """Real-valued layer budgets: ``w + F_l``, the model's ``L (c - w)`` free tokens shared by
    density, a layer above its ``n - w`` candidates capped and its excess shared again."""
    L = len(densities)
    room = length - protected
    free = [0.0] * L
    open_layers = set(range(L))
    left = min(L * (budget - protected), L * room)
    while left > 1e-9 and open_layers:
        weight = sum(densities[i] for i in open_layers)
        grants = {i: densities[i] / weight * left for i in open_layers}
        over = [i for i in open_layers if free[i] + grants[i] >= room]
        if not over:
            for i in open_layers:
                free[i] += grants[i]
            break
        for i in over:
            left -= room - free[i]
            free[i] = room
            open_layers.discard(i)
    return [protected + f for f in free]
