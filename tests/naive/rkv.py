"""R-KV (Cai et al. 2025), naive: the redundancy of one (sample, KV head)'s keys and the decode-time
policy on per-(sample, KV head) lists, written from the paper's formulas with kvlab's documented
choices (``docs/methods/rkv.md``; lists of Python floats, fp64)."""

from __future__ import annotations

from naive.attention import dot, norm, softmax


def naive_redundancy(keys: list[list[float]], positions: list[int], threshold: float | None) -> list[float]:
    """``R_j = softmax_j((1/n) sum_i c_ij)``: ``c_ij`` the cosine similarity of keys ``i != j`` (0 for
    ``i == j``); for each ``i``, the newest ``j`` (by position) with ``c_ij > threshold`` gets 0."""
    n = len(keys)
    unit = [[x / (norm(k) + 1e-8) for x in k] for k in keys]
    c = [[dot(unit[i], unit[j]) if i != j else 0.0 for j in range(n)] for i in range(n)]
    if threshold is not None:
        for i in range(n):
            similar = [j for j in range(n) if j != i and c[i][j] > threshold]
            if similar:
                c[i][max(similar, key=lambda j: positions[j])] = 0.0
    return softmax([sum(c[i][j] for i in range(n)) / n for j in range(n)])


def naive_rkv_decode(
    entries, capacity, queries, new_kv, first_position, scaling, recent, every, mix_lambda, kernel
):
    """R-KV's decode steps on lists (threshold 0.5).

    Args:
        entries: ``{(b, h): [[position, key, value], ...]}`` each (sample, KV head)'s entries after
            the prefill.
        capacity: ``{(b, h): int}`` the entries each may hold after a step.
        queries: per step, ``[B][H][D]`` the new token's queries.
        new_kv: per step, ``(keys [B][Hkv][D], values [B][Hkv][D])`` of the new token.
        first_position: the position of the first decoded token.

    Each step every (b, h) stores the new token and each query head attends over its entries (the
    output is recorded, with each entry's probability averaged over the KV head's ``G`` query
    heads). A (b, h) holding more than its capacity keeps ``capacity - min(every, capacity) + 1``
    entries: the ``recent`` newest, then those of highest ``λ I - (1 - λ) R``; ``I`` the
    probabilities of the last ``recent`` steps' queries renormalised over the entries older than
    the window, summed and divided by ``recent``, then max-pooled over ``kernel`` neighbours in
    position order; ``R`` :func:`naive_redundancy`. Returns the outputs ``[step][B][H][D]``, the
    entries each (b, h) held after every step (``[step]{(b, h): count}``) and the positions each
    holds at the end, sorted.
    """
    B = 1 + max(b for b, _ in entries)
    Hkv = 1 + max(h for _, h in entries)
    H = len(queries[0][0])
    G = H // Hkv
    history = {key: [] for key in entries}  # per step: {position: probability averaged over G}
    outputs, held = [], []
    for step, (q, (k, v)) in enumerate(zip(queries, new_kv, strict=True)):
        pos = first_position + step
        out = [[None] * H for _ in range(B)]
        for (b, h), ents in entries.items():
            ents.append([pos, k[b][h], v[b][h]])
            received = {}
            for g in range(G):
                probs = softmax([dot(q[b][h * G + g], e[1]) * scaling for e in ents])
                mixed = zip(*(e[2] for e in ents), strict=True)
                out[b][h * G + g] = [sum(p * x for p, x in zip(probs, xs, strict=True)) for xs in mixed]
                for p, e in zip(probs, ents, strict=True):
                    received[e[0]] = received.get(e[0], 0.0) + p / G
            history[(b, h)].append(received)
            if len(ents) <= capacity[(b, h)]:
                continue
            window = {e[0] for e in ents if e[0] > pos - recent}
            importance = {e[0]: 0.0 for e in ents}
            for received in history[(b, h)][-recent:]:
                older = {p: x for p, x in received.items() if p not in window}
                total = sum(older.values())
                for p, x in older.items():
                    importance[p] += x / total / recent
            ents.sort(key=lambda e: e[0])
            scores = [importance[e[0]] for e in ents]
            half = kernel // 2
            pooled = [max(scores[max(0, j - half) : j + half + 1]) for j in range(len(ents))]
            redundancy = naive_redundancy([e[1] for e in ents], [e[0] for e in ents], 0.5)
            mixed = {
                e[0]: mix_lambda * i - (1 - mix_lambda) * r
                for e, i, r in zip(ents, pooled, redundancy, strict=True)
            }
            target = capacity[(b, h)] - min(every, capacity[(b, h)]) + 1
            others = sorted((e for e in ents if e[0] not in window), key=lambda e: -mixed[e[0]])
            keep = {e[0] for e in ents if e[0] in window} | {e[0] for e in others[: target - len(window)]}
            ents[:] = [e for e in ents if e[0] in keep]
        outputs.append(out)
        held.append({key: len(ents) for key, ents in entries.items()})
    return outputs, held, {key: sorted(e[0] for e in ents) for key, ents in entries.items()}
