"""A layer compressed by the ``retrieve`` selector, shared by the retrieval and Quest tests."""

import torch

from kvlab.cache.layer import CompressedLayer
from kvlab.compression.context import LayerContext
from kvlab.compression.retrieval import RetrieveSelector


def retrieval_layer(lengths, counts, local="none", chunk=4, steps=2, seed=0, G=2, index=None):
    """A layer compressed by the retrieve selector with ``index`` (default: the mean key) on a random
    padded prompt whose last 3 tokens are protected, after ``steps`` decode tokens; returns
    ``(layer, the next query, the context, the scores, the decoded (k, v))``."""
    gen = torch.Generator().manual_seed(seed)
    B, T, Hkv, D = len(lengths), max(lengths), 2, 8
    valid = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        valid[b, T - n :] = True
    keys, values = torch.randn(B, Hkv, T, D, generator=gen), torch.randn(B, Hkv, T, D, generator=gen)
    ctx = LayerContext(0, 1, torch.randn(B, Hkv * G, T, D, generator=gen), keys, values, valid,
                       torch.where(valid, 0, -1), D**-0.5)  # fmt: skip
    scores = torch.where(valid, 0.0, float("-inf"))[:, None].expand(B, Hkv, T).clone()
    scores[..., -3:] = float("inf")  # 3 protected tokens
    selection = RetrieveSelector(chunk=chunk, local=local, index=index or {"name": "mean_key"}).select(
        scores, torch.tensor(counts), ctx
    )
    layer = CompressedLayer(decode_capacity=4)
    layer.update(keys, values)
    layer.compress(selection)
    decoded = [(torch.randn(B, Hkv, 1, D, generator=gen), torch.randn(B, Hkv, 1, D, generator=gen))
               for _ in range(steps)]  # fmt: skip
    for k, v in decoded:
        layer.update(k, v)
    query = torch.randn(B, Hkv * G, 1, D, generator=gen)
    return layer, query, ctx, scores, decoded
