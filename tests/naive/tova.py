"""TOVA (Oren et al. 2024), naive: the prefill score of one unpadded sample and the decode-time policy
on per-(sample, KV head) lists, written from the paper's policy (lists of Python floats, fp64)."""

from __future__ import annotations

from naive.attention import dot, softmax


def naive_tova_scores(q, k, scaling) -> list[float]:
    """``s_t = (1/H) sum_h softmax_t(q_{n-1}^h . k_{h // G}^t * scaling)`` over the ``n`` tokens of one
    unpadded sample; ``q [H][n][D]``, ``k [Hkv][n][D]``."""
    H, Hkv, n = len(q), len(k), len(k[0])
    G = H // Hkv
    total = [0.0] * n
    for h in range(H):
        probs = softmax([dot(q[h][n - 1], k[h // G][t]) * scaling for t in range(n)])
        for t, p in enumerate(probs):
            total[t] += p / H
    return total


def naive_tova_decode(entries, capacity, queries, new_kv, first_position, recent, scaling):
    """TOVA's decode steps on lists.

    Args:
        entries: ``{(b, h): [[position, key, value], ...]}`` the entries each (sample, KV head) holds
            after the prefill.
        capacity: ``{(b, h): int}`` the entries each may hold.
        queries: per step, ``[B][H][D]`` the new token's queries.
        new_kv: per step, ``(keys [B][Hkv][D], values [B][Hkv][D])`` of the new token.
        first_position: the position of the first decoded token (the padded prompt length).
        recent: the newest positions never evicted.

    Each step: every (b, h) stores the new token; every query head attends over its KV head's
    entries (the attention output is recorded); each position's score is the sum of its
    probabilities over the ``H`` query heads divided by ``H`` (a head that does not hold it adds 0);
    then every (b, h) over capacity drops its entry of lowest score outside the ``recent`` newest
    positions (the oldest when all are recent). Returns the outputs ``[step][B][H][D]`` and the
    positions each (b, h) holds at the end, sorted.
    """
    B = 1 + max(b for b, _ in entries)
    Hkv = 1 + max(h for _, h in entries)
    H = len(queries[0][0])
    G = H // Hkv
    outputs = []
    for step, (q, (k, v)) in enumerate(zip(queries, new_kv, strict=True)):
        pos = first_position + step
        out = [[None] * H for _ in range(B)]
        for b in range(B):
            received = {}
            for h in range(Hkv):
                ents = entries[(b, h)]
                ents.append([pos, k[b][h], v[b][h]])
                for g in range(G):
                    probs = softmax([dot(q[b][h * G + g], e[1]) * scaling for e in ents])
                    mixed = zip(*(e[2] for e in ents), strict=True)  # per value dimension
                    out[b][h * G + g] = [sum(p * x for p, x in zip(probs, xs, strict=True)) for xs in mixed]
                    for p, e in zip(probs, ents, strict=True):
                        received[e[0]] = received.get(e[0], 0.0) + p
            for h in range(Hkv):
                ents = entries[(b, h)]
                if len(ents) <= capacity[(b, h)]:
                    continue
                candidates = [e for e in ents if e[0] <= pos - recent]
                if candidates:
                    victim = min(candidates, key=lambda e: received[e[0]] / H)
                else:
                    victim = min(ents, key=lambda e: e[0])
                ents.remove(victim)
        outputs.append(out)
    return outputs, {key: sorted(e[0] for e in ents) for key, ents in entries.items()}
