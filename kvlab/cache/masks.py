"""Attention masks as small composable predicates (in the spirit of transformers' ``masking_utils``).

A predicate takes broadcastable index tensors ``(batch, query, key)`` (the batch rows, the query
positions, the key positions) and returns where a query sees a key (bool, their broadcast
shape). :func:`and_masks` and :func:`or_masks` combine predicates; :func:`build_mask` evaluates one
over positions. Every mask kvlab builds is one of these:

- prefill attention (:mod:`kvlab.engine.prefill_attention`): ``causal & window & key padding``,
  or a padding query's own key (``diagonal & query padding``), per block of query rows; the rows
  of an image block (Gemma 3) ``window & key padding`` over the keys of its block;
- the attention helpers of :class:`~kvlab.compression.context.LayerContext`:
  ``(causal | same image block) & key padding``;
- the cache's slot layout (:meth:`~kvlab.cache.slots.SlotLayout.attention_probs`): the sliding
  window over the stored positions of each entry.

Positions are positions in the padded row (left padding: a sample's own position differences).
No predicate materialises more than its broadcast shape; a caller bounds that by evaluating a
block of query rows at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvlab.models.base import IMAGE

#: ``(batch [B, 1, 1], query [.., q, 1], key [.., 1, k]) -> bool`` (broadcast shape)
MaskPredicate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def causal(batch: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """A query sees the keys at or before its position."""
    return key <= query


def diagonal(batch: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """A query sees its own key."""
    return key == query


def sliding_window(window: int) -> MaskPredicate:
    """A query at position ``i`` sees keys at positions ``> i - window`` (with :func:`causal`: the
    window ``(i - window, i]`` of transformers' ``sliding_window``)."""

    def inside(batch: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return key > query - window

    return inside


def key_padding(valid: torch.Tensor) -> MaskPredicate:
    """Keys on padding are never seen; ``valid [B, T]`` (False on padding), indexed by key position."""

    def real(batch: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return valid[batch, key]

    return real


def query_padding(valid: torch.Tensor) -> MaskPredicate:
    """True for queries on padding (``valid [B, T]`` False there), indexed by query position."""

    def padding(batch: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return ~valid[batch, query]

    return padding


def same_image_block(blocks: torch.Tensor) -> MaskPredicate:
    """A query inside an image block sees every key of its block (``blocks [B, T]``,
    :func:`image_block_ids`; -1 outside images), later ones included (Gemma 3)."""

    def same(batch: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        own = blocks[batch, query]
        return (own == blocks[batch, key]) & (own >= 0)

    return same


def and_masks(*predicates: MaskPredicate) -> MaskPredicate:
    """Seen where every predicate sees."""

    def both(batch: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        seen = predicates[0](batch, query, key)
        for predicate in predicates[1:]:
            seen = seen & predicate(batch, query, key)
        return seen

    return both


def or_masks(*predicates: MaskPredicate) -> MaskPredicate:
    """Seen where any predicate sees."""

    def either(batch: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        seen = predicates[0](batch, query, key)
        for predicate in predicates[1:]:
            seen = seen | predicate(batch, query, key)
        return seen

    return either


def build_mask(
    predicate: MaskPredicate,
    queries: torch.Tensor,
    keys: torch.Tensor,
    batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """``predicate`` over query positions ``queries [q]`` and key positions ``keys [k]``: ``[B, q, k]``
    for the samples ``batch`` (``[B]`` indices, or one index: ``[1, q, k]``; None: predicates that read
    no sample's tensor, ``[1, q, k]``)."""
    if batch is None:
        rows = torch.zeros(1, 1, 1, dtype=torch.long, device=queries.device)
    else:
        rows = torch.as_tensor(batch, device=queries.device).reshape(-1, 1, 1)
    return predicate(rows, queries[None, :, None], keys[None, None, :])


def image_block_ids(modality: torch.Tensor) -> torch.Tensor:
    """The image block of each prompt token, ``[B, T]`` long: -1 outside images, else the index of
    its run of consecutive image tokens in the row (0, 1, ...).

    ``modality [B, T]``: 1 at image tokens (``kvlab.models.base.IMAGE``). As transformers'
    ``get_block_sequence_ids_for_mask`` for Gemma 3 (``token_type_ids == 1``): a block starts at an
    image token whose predecessor is not one, so each image's soft tokens form one block (Gemma 3
    writes ``<start_of_image>`` / ``<end_of_image>``, text, around them); padding is -1.
    """
    is_image = modality == IMAGE
    previous = F.pad(is_image, (1, 0), value=False)[:, :-1]
    starts = (is_image & ~previous).long().cumsum(-1) - 1
    return torch.where(is_image, starts, torch.full_like(starts, -1))
