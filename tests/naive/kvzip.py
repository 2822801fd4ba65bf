"""KVzip (Kim et al. 2025, Sec. 3.2) written out: the most attention each prompt entry receives while
the model repeats the prompt, one chunk per step, in fp64 loops over one sample.

Step ``i`` reconstructs the chunk ``[a, b)`` of an ``n``-token prompt; its block's queries ``q_r``
(rows ``r``, each query head ``h``) attend to a set of prompt entries and, causally, to the block's
own keys ``j <= r``. The set is every entry (``scope: cache``, the paper's full cache) or the first
``min(sinks, a)`` entries and the chunk (``scope: chunk``, the authors' code and kvpress'
``_compute_cross_attention``). Each entry ``t`` of the chunk scores ``max_{r, h in group} softmax``;
KVzip+ multiplies each probability by ``||W_O^h v_t|| / ||x_r||`` first.
"""

from __future__ import annotations

import torch


def reconstruction_scores(
    steps,
    n: int,
    heads: int,
    kv_heads: int,
    scope: str,
    sinks: int,
    plus=None,
) -> torch.Tensor:
    """``[Hkv, n]`` fp64 scores of one sample's prompt entries.

    ``steps``: per chunk ``(a, b, keys [Hkv, n, D], values [Hkv, n, D], queries [H, q, D],
    block_keys [Hkv, q, D], scaling, inputs [q, E] or None)``, the block unpadded. ``plus``:
    the output projection ``[E, H D]`` for KVzip+ (None: KVzip).
    """
    group = heads // kv_heads
    scores = torch.zeros(kv_heads, n, dtype=torch.float64)
    for a, b, keys, values, queries, block_keys, scaling, inputs in steps:
        entries = list(range(n)) if scope == "cache" else list(range(min(sinks, a))) + list(range(a, b))
        for j in range(kv_heads):
            for g in range(group):
                h = j * group + g
                for r in range(queries.shape[1]):
                    seen = torch.cat([keys[j, entries].double(), block_keys[j, : r + 1].double()])
                    probs = torch.softmax(seen @ queries[h, r].double() * scaling, dim=0)
                    for slot, t in enumerate(entries):
                        if not a <= t < b:
                            continue
                        value = float(probs[slot])
                        if plus is not None:
                            dim = values.shape[-1]
                            w_o = plus[:, h * dim : (h + 1) * dim].double()
                            value *= float((w_o @ values[j, t].double()).norm()) / float(
                                inputs[r].double().norm()
                            )
                        scores[j, t] = max(float(scores[j, t]), value)
    return scores


def model_topk_kept(scores, free: int, protected: list[int]) -> list[list[list[int]]]:
    """KVzip's model-wide budgets as kvlab sizes them, for one sample: ``scores[ly][h][t]`` (None off the
    candidates), ``free`` candidates per head on average, ``protected`` the positions always kept.

    The model's best ``L Hkv free`` candidates (ties to the lower layer, head, position) give each
    layer its winners ``n_l``; the per-head shares ``n_l / Hkv`` are rounded by largest remainder
    (ties to the lower layer) to sum to ``L free``; each layer keeps its best ``Hkv`` times its share
    over all its heads (ties as above) and the protected positions. Returns ``[ly][h]`` sorted positions.
    """
    L, Hkv = len(scores), len(scores[0])
    flat = [
        (-s, ly, h, t)
        for ly in range(L)
        for h in range(Hkv)
        for t, s in enumerate(scores[ly][h])
        if s is not None
    ]
    flat.sort()
    winners = [0] * L
    for _, ly, _, _ in flat[: L * Hkv * free]:
        winners[ly] += 1
    shares = [w / Hkv for w in winners]
    base = [int(x) for x in shares]
    short = L * free - sum(base)
    for ly in sorted(range(L), key=lambda ly: (-(shares[ly] - base[ly]), ly))[:short]:
        base[ly] += 1
    kept = []
    for ly in range(L):
        ranked = sorted((-s, h, t) for h in range(Hkv) for t, s in enumerate(scores[ly][h]) if s is not None)
        heads = [sorted(protected) for _ in range(Hkv)]
        for _, h, t in ranked[: Hkv * base[ly]]:
            heads[h].append(t)
        kept.append([sorted(x) for x in heads])
    return kept
