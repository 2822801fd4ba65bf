"""Prefill attention: exact causal attention over the prompt with kvlab's padding mask, no ``T x T`` tensor.

transformers builds no mask for a custom attention name, so the ``kvlab`` attention function
masks itself, with the predicates of :mod:`kvlab.cache.masks`. :func:`prefill_attention` takes the
fastest exact path for the case (sdpa's causal kernel for a whole unpadded prompt, one sdpa call
per sample for a left-padded one, blocks of query rows otherwise) and applies a layer's variants
(sliding window, soft-capping, sinks) and Gemma 3's bidirectional image blocks as transformers'
eager attention does. The working set of a block is bounded by ``block_elements``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvlab.cache.masks import (
    and_masks,
    build_mask,
    causal,
    diagonal,
    key_padding,
    or_masks,
    query_padding,
    sliding_window,
)
from kvlab.cache.options import AttentionOptions

#: Elements ``B x H x rows x keys`` of one block of the query-blocked prefill attention (the
#: padded, windowed, soft-capped and sink paths): 2**24 fp32 logits are 64 MiB, whatever the
#: prompt length, so the prefill's attention working set never grows with ``T x T``.
PREFILL_BLOCK_ELEMENTS = 1 << 24


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    options: AttentionOptions | None = None,
    block_elements: int | None = None,
    blocks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the last ``q`` prompt positions over the first ``k``; no ``T x T`` tensor.

    Shapes: query ``[B, H, q, D]`` (positions ``k - q .. k - 1``; ``q == k`` for a whole prompt,
    ``q < k`` for a chunk of a chunked prefill), key ``[B, Hkv, k, D]``, value ``[B, Hkv, k, Dv]``,
    valid ``[B, k]`` (False on padding). Returns ``[B, H, q, Dv]``.

    Keys at padding positions are masked; a padding query also sees itself (and the valid keys
    before it, which left padding never has: then its output is its own value, or a share of it
    with sinks), so no row is empty; that output is never used. ``options`` (sliding window,
    soft-capping, sinks) follow transformers' eager attention; the window counts positions in the
    padded row, which equal each sample's own position differences. Three paths, none of which
    materialises a ``[B, T, T]`` mask or ``[B, H, T, T]`` logits:

    - whole prompt, no padding, no variant: sdpa's own causal path (flash attention);
    - whole left-padded prompt, no variant: sdpa's causal path per sample on its valid suffix;
    - anything else (variants, chunks, other padding): blocks of query rows against the keys
      they can see, ``B x H x rows x keys <= block_elements`` (default
      :data:`PREFILL_BLOCK_ELEMENTS`; :func:`_blocked_attention`).

    ``blocks [B, k]`` (None: causal): image blocks (:func:`~kvlab.cache.masks.image_block_ids`, Gemma 3). A
    query inside a block also sees every key of its block, later ones included, as transformers'
    ``blockwise_overlay``: ``causal | same block`` on full-attention layers, ``(causal | same
    block) & window`` on sliding ones, padding keys masked. The causal rows come from the paths
    above; the rows of each image block are then recomputed (:func:`_image_block_rows`).
    """
    options = options or AttentionOptions()
    block_elements = block_elements or PREFILL_BLOCK_ELEMENTS
    if blocks is not None:
        out = prefill_attention(query, key, value, valid, scaling, options, block_elements)  # causal rows
        _image_block_rows(out, query, key, value, valid, scaling, options, block_elements, blocks)
        return out
    q, k = query.shape[2], key.shape[2]
    if options.plain and q == k:
        if bool(valid.all()):
            return F.scaled_dot_product_attention(
                query, key, value, is_causal=True, scale=scaling, enable_gqa=True
            )
        if _left_padded(valid):
            return _per_sample_attention(query, key, value, valid, scaling)
    return _blocked_attention(query, key, value, valid, scaling, options, block_elements)


def _image_spans(blocks: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(sample, first, end)`` of each image block of ``blocks [B, k]``
    (:func:`~kvlab.cache.masks.image_block_ids`) with more than one token, positions ``[first, end)``: the
    rows the blocks change."""
    previous = F.pad(blocks, (1, 0), value=-1)[:, :-1]
    following = F.pad(blocks, (0, 1), value=-1)[:, 1:]
    starts = ((blocks >= 0) & (previous != blocks)).nonzero().tolist()  # row-major: block order
    lasts = ((blocks >= 0) & (following != blocks)).nonzero().tolist()
    return [(b, a, e + 1) for (b, a), (_, e) in zip(starts, lasts, strict=True) if e > a]


def _image_block_rows(
    out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    options: AttentionOptions,
    elements: int,
    blocks: torch.Tensor,
) -> None:
    """Overwrite the rows of ``out [B, H, q, Dv]`` whose queries lie in an image block with their
    attention under the block mask (shapes as :func:`prefill_attention`).

    A query at position ``p`` of the block ``[a, e)`` sees ``causal | same block``: every key
    before ``e`` on a full-attention layer, the keys in ``(p - window, e)`` on a sliding one,
    padding keys masked. Per block, chunks of its rows against those keys, ``H x rows x keys <=
    elements``: at most one block of rows beyond the causal pass, never a ``T x T`` tensor.
    """
    H, q, k = query.shape[1], query.shape[2], key.shape[2]
    offset = k - q  # position of the first query
    window = options.sliding_window
    positions = torch.arange(k, device=query.device)
    windowed = and_masks(sliding_window(window), key_padding(valid)) if window is not None else None
    for b, a, e in _image_spans(blocks):
        first = max(a, offset)
        lo = max(0, first - window + 1) if window is not None else 0
        step = max(1, elements // (H * (e - lo)))
        for r0 in range(first, e, step):
            r1 = min(e, r0 + step)  # query positions [r0, r1), keys [lo, e)
            lo = max(0, r0 - window + 1) if window is not None else 0
            mask = None  # [rows, keys], None: every key [lo, e) is seen (the block: causal | same block)
            if windowed is not None:
                mask = build_mask(windowed, positions[r0:r1], positions[lo:e], b)[0]
            elif not bool(valid[b, lo:e].all()):
                mask = build_mask(key_padding(valid), positions[r0:r1], positions[lo:e], b)[0].expand(
                    r1 - r0, -1
                )
            rows = slice(r0 - offset, r1 - offset)
            out[b, :, rows] = _masked_rows(
                query[b : b + 1, :, rows], key[b : b + 1, :, lo:e], value[b : b + 1, :, lo:e], mask, scaling,
                options,
            )[0]  # fmt: skip


def _masked_rows(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    options: AttentionOptions,
) -> torch.Tensor:
    """Attention of ``query [1, H, r, D]`` over ``key / value [1, Hkv, n, D]`` with ``mask [r, n]``
    (True: seen; every row sees a key; None: every key), ``[1, H, r, Dv]``: sdpa, or with
    soft-capping or sinks transformers' eager attention, as in :func:`_blocked_attention`."""
    if options.softcap is None and options.sinks is None:
        attn_mask = None if mask is None else mask[None, None]
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, scale=scaling, enable_gqa=True
        )
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    logits = torch.matmul(query, key.transpose(-1, -2)) * scaling  # [1, H, r, n]
    if options.softcap is not None:
        logits = torch.tanh(logits / options.softcap) * options.softcap
    if mask is not None:
        logits = logits.masked_fill(~mask[None, None], float("-inf"))
    if options.sinks is not None:
        sinks = options.sinks.to(logits.dtype).reshape(1, -1, 1, 1).expand(*logits.shape[:3], 1)
        logits = torch.cat([logits, sinks], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., : key.shape[2]]
    return torch.matmul(probs.to(value.dtype), value)


def _left_padded(valid: torch.Tensor) -> bool:
    """True when each row of ``valid [B, k]`` is padding then tokens (its valid tokens are a suffix)."""
    return bool((valid[:, 1:] >= valid[:, :-1]).all())


def _own_values(value: torch.Tensor, groups: int) -> torch.Tensor:
    """``value [Hkv, n, Dv]`` repeated to the query heads, ``[H, n, Dv]``: what a query attending
    only to itself returns (padding queries)."""
    return value.repeat_interleave(groups, dim=0)


def _per_sample_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Causal attention of a left-padded batch, one sdpa call per sample on its valid suffix.

    Shapes as :func:`prefill_attention` with ``q == k == T``. A padding query gets its own value.
    """
    B, H, T, _ = query.shape
    groups = H // key.shape[1]
    out = query.new_empty(B, H, T, value.shape[-1])
    for b, length in enumerate(valid.sum(-1).tolist()):
        pad = T - length
        out[b, :, :pad] = _own_values(value[b, :, :pad], groups)
        if length:
            out[b : b + 1, :, pad:] = F.scaled_dot_product_attention(
                query[b : b + 1, :, pad:],
                key[b : b + 1, :, pad:],
                value[b : b + 1, :, pad:],
                is_causal=True,
                scale=scaling,
                enable_gqa=True,
            )
    return out


def _block_rows(B: int, H: int, q: int, k: int, window: int | None, elements: int) -> int:
    """Query rows per block so that ``B x H x rows x keys seen <= elements`` (at least one row).

    A block of ``r`` rows sees at most ``k`` keys, or ``r + window - 1`` under a sliding window.
    """
    rows = elements // (B * H * k)
    if window is not None and window < k:
        rows = max(rows, min(window, elements // (B * H * 2 * window)))
    return max(1, min(q, rows))


def _blocked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    options: AttentionOptions,
    elements: int,
) -> torch.Tensor:
    """Blocks of query rows, each against the keys it can see, with an ``O(rows x keys)`` mask.

    Shapes as :func:`prefill_attention`. Without soft-capping or sinks a block is one masked
    sdpa call; with them it is transformers' eager attention on the block (logits in the input
    dtype, soft-capped, masked, the sinks appended to the softmax denominator). Each query row
    is computed exactly as in one dense pass: blocking only bounds the working set.
    """
    B, H, q, _ = query.shape
    k = key.shape[2]
    groups = H // key.shape[1]
    offset = k - q  # position of the first query
    window = options.sliding_window
    eager = options.softcap is not None or options.sinks is not None
    if eager:  # eager attention repeats K/V to the query heads, as transformers' eager path
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    out = query.new_empty(B, H, q, value.shape[-1])
    step = _block_rows(B, H, q, k, window, elements)
    positions = torch.arange(k, device=query.device)
    samples = torch.arange(B, device=query.device)
    seen = [causal, key_padding(valid)] + ([sliding_window(window)] if window is not None else [])
    # causal, in the window, not padding; a padding query sees its own key (no row is empty)
    visible = or_masks(and_masks(*seen), and_masks(diagonal, query_padding(valid)))
    for r0 in range(0, q, step):
        r1 = min(q, r0 + step)
        first, last = offset + r0, offset + r1  # query positions [first, last)
        lo = max(0, first - window + 1) if window is not None else 0
        mask = build_mask(visible, positions[first:last], positions[lo:last], samples)  # [B, rows, keys]
        block = query[:, :, r0:r1]
        if not eager:
            out[:, :, r0:r1] = F.scaled_dot_product_attention(
                block, key[:, :, lo:last], value[:, :, lo:last], attn_mask=mask[:, None], scale=scaling,
                enable_gqa=True,
            )  # fmt: skip
            continue
        logits = torch.matmul(block, key[:, :, lo:last].transpose(-1, -2)) * scaling  # [B, H, rows, keys]
        if options.softcap is not None:
            logits = torch.tanh(logits / options.softcap) * options.softcap
        logits = logits.masked_fill(~mask[:, None], float("-inf"))
        if options.sinks is not None:
            sinks = options.sinks.to(logits.dtype).reshape(1, -1, 1, 1).expand(*logits.shape[:3], 1)
            logits = torch.cat([logits, sinks], dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., : last - lo]
        out[:, :, r0:r1] = torch.matmul(probs.to(value.dtype), value[:, :, lo:last])
    return out
