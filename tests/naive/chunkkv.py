"""ChunkKV's selection over Python lists, from the paper's Algorithm 1 plus kvlab's exact budget:
chunk sums of the candidates' scores, whole chunks in rank order while they fit, then the best
remaining candidates."""

from __future__ import annotations

import math


def naive_chunkkv(scores: list[list[float]], counts: list[int], chunk: int, shared: bool) -> list[list[int]]:
    """Kept positions of each head of one sample, ``scores [Hkv][n]`` in the sample's own positions
    (+inf kept, -inf never, finite candidates), ``counts [Hkv]``."""
    heads, n = len(scores), len(scores[0])
    chunks = math.ceil(n / chunk)

    def members(h: int, j: int) -> list[int]:
        return [t for t in range(j * chunk, min(n, (j + 1) * chunk)) if math.isfinite(scores[h][t])]

    sums = [[sum(scores[h][t] for t in members(h, j)) for j in range(chunks)] for h in range(heads)]
    if shared:
        sums = [[sum(sums[g][j] for g in range(heads)) for j in range(chunks)] for _ in range(heads)]
    out = []
    for h in range(heads):
        keep = {t for t in range(n) if scores[h][t] == math.inf}
        free = counts[h] - len(keep)
        ranked = sorted((j for j in range(chunks) if members(h, j)), key=lambda j: (-sums[h][j], j))
        for j in ranked:
            if len(members(h, j)) > free:
                break
            keep |= set(members(h, j))
            free -= len(members(h, j))
        rest = sorted(
            (t for t in range(n) if math.isfinite(scores[h][t]) and t not in keep),
            key=lambda t: (-scores[h][t], t),
        )
        keep |= set(rest[:free])
        out.append(sorted(keep))
    return out
