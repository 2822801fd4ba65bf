"""HeadKV over Python lists (fp64), from the paper and the authors' release (Fu et al. 2024):
the retrieval-reasoning score (top-k attention on the needle while the answer is copied) and the
head budgets (a base budget plus a pool shared by the normalised, tempered scores)."""

from __future__ import annotations

from naive.attention import dot, softmax


def retrieval_reasoning_score(q: list[list[list[float]]], k: list[list[list[float]]], scale: float,
                              answer: int, needle: list[int]) -> list[float]:  # fmt: skip
    """Per query head: sum over the last ``answer`` queries of ``10 a[i] / (|R| answer)`` for the
    keys ``i`` among the query's ``|R|`` strongest (causal attention) that are in ``needle`` (R)."""
    heads, n = len(q), len(q[0])
    group = heads // len(k)
    top = len(needle)
    out = []
    for h in range(heads):
        total = 0.0
        for i in range(n - answer, n):
            probs = softmax([scale * dot(q[h][i], k[h // group][t]) for t in range(i + 1)])
            probs += [0.0] * (n - i - 1)  # keys after the query: masked
            strongest = sorted(range(n), key=lambda t: -probs[t])[:top]
            total += sum(10 * probs[t] / (top * answer) for t in strongest if t in needle)
        out.append(total)
    return out


def headkv_capacities(
    scores: list[list[float]], kv_heads: int, free: int, beta: float, temp: float
) -> list[float]:
    """Real-valued free tokens per KV head (flattened ``[L * Hkv]``) before rounding: the authors'
    ``head_capacity = total_attention * pool + min_num`` with shares summed over each KV group."""
    flat = [x for row in scores for x in row]
    total = sum(flat)
    shares = [(x / total) ** temp for x in flat]
    norm = sum(shares)
    shares = [x / norm for x in shares]
    heads = len(scores[0])
    group = heads // kv_heads
    layers = len(scores)
    base = free - int(free // beta)
    pool = int(free // beta) * layers * kv_heads
    out = []
    for layer in range(layers):
        for j in range(kv_heads):
            s = sum(shares[layer * heads + j * group + g] for g in range(group))
            out.append(s * pool + base)
    return out
