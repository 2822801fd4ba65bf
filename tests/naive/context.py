"""Random left-padded contexts for the component tests, a sample of one as Python lists, random
selector scores (protected +inf, padding -inf), and two small comparisons (build a component from
its registry, scores against lists)."""

from __future__ import annotations

import math

import torch

from kvlab.cache.state import RunState
from kvlab.compression.context import LayerContext

LENGTHS = [37, 26]  # B = 2, different left padding


def make_ctx(
    lengths: list[int],
    heads: int = 4,
    kv_heads: int = 2,
    dim: int = 8,
    seed: int = 0,
    layer_idx: int = 0,
    num_layers: int = 4,
    scale: float = 1.5,
    run: RunState | None = None,
) -> LayerContext:
    """A left-padded batch; padding positions hold random garbage that must be ignored. Contexts of
    one prefill share one ``run`` (the engine's :class:`RunState`); None: a fresh one."""
    gen = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        valid[b, T - n :] = True
    return LayerContext(
        layer_idx=layer_idx,
        num_layers=num_layers,
        queries=torch.randn(B, heads, T, dim, generator=gen) * scale,
        keys=torch.randn(B, kv_heads, T, dim, generator=gen) * scale,
        values=torch.randn(B, kv_heads, T, dim, generator=gen),
        valid=valid,
        modality=torch.where(valid, 0, -1),
        scaling=dim**-0.5,
        run=run if run is not None else RunState(),
    )


def sample_ctx(ctx: LayerContext, b: int) -> LayerContext:
    """Sample ``b`` alone (B = 1), padding sliced off."""
    n = int(ctx.valid[b].sum())
    T = ctx.seq_len
    return LayerContext(
        layer_idx=ctx.layer_idx,
        num_layers=ctx.num_layers,
        queries=ctx.queries[b : b + 1, :, T - n :].clone(),
        keys=ctx.keys[b : b + 1, :, T - n :].clone(),
        values=ctx.values[b : b + 1, :, T - n :].clone(),
        valid=torch.ones(1, n, dtype=torch.bool),
        modality=torch.zeros(1, n, dtype=torch.long),
        scaling=ctx.scaling,
    )


def random_scores(ctx, seed: int, protected: tuple[int, int] = (2, 3)) -> torch.Tensor:
    """``[B, Hkv, T]`` random scores with each sample's first and last tokens protected (+inf) and
    padding -inf, as the pipeline hands them to a selector."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(ctx.batch_size, ctx.num_kv_heads, ctx.seq_len, generator=gen)
    pos, n = ctx.positions(), ctx.lengths[:, None]
    sinks, window = protected
    scores = scores.masked_fill(((pos >= 0) & (pos < sinks) | (pos >= n - window))[:, None], math.inf)
    return scores.masked_fill(~ctx.valid[:, None], -math.inf)


def sample_lists(ctx: LayerContext, b: int):
    """(n, offset, q [H][n][D], k [Hkv][n][D], v [Hkv][n][D]) of sample b as Python floats."""
    n = int(ctx.valid[b].sum())
    off = ctx.seq_len - n
    q = ctx.queries[b, :, off:].double().tolist()
    k = ctx.keys[b, :, off:].double().tolist()
    v = ctx.values[b, :, off:].double().tolist()
    return n, off, q, k, v


def build(registry, **node):
    return registry.build(node)


def assert_scores(actual: torch.Tensor, expected: list[list[float]], atol: float = 1e-5) -> None:
    torch.testing.assert_close(
        actual.double(), torch.tensor(expected, dtype=torch.float64), atol=atol, rtol=0
    )


def kept(selection, b: int, h: int, offset: int) -> list[int]:
    """Sample ``b``'s kept positions at head ``h``, counted from its first real token (``offset``:
    its left padding)."""
    return [p - offset for p in selection.kept_positions(b, h)]


def assert_batch_equals_alone(pipeline, ctx: LayerContext, heads: int = 2) -> None:
    """``pipeline.compress`` of the padded batch ``ctx`` keeps, for each sample and head, what it
    keeps for that sample alone (:func:`sample_ctx`)."""
    batched, _ = pipeline.compress(ctx)
    for b in range(ctx.valid.shape[0]):
        n = int(ctx.valid[b].sum())
        alone, _ = pipeline.compress(sample_ctx(ctx, b))
        for h in range(heads):
            assert kept(batched, b, h, ctx.seq_len - n) == alone.kept_positions(0, h)
