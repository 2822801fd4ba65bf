"""TOVA (Oren et al. 2024, "Transformers are Multi-State RNNs", arXiv 2401.06104): Token Omission Via
Attention.

The paper reads a decoder as a multi-state RNN whose state is the KV cache, and TOVA bounds that
state to a fixed size (Sec. 3, the TOVA policy, Fig. 2): at each decoding step it takes the
softmax-normalised attention of the current query to every token in the state, the current
token included, and drops the token with the lowest score, one per step. The score is taken per
layer, averaged over its heads, so the heads of a layer keep the same tokens. The paper's release
(``schwartz-lab-NLP/TOVA``, ``src/tova_cache.py``, ``TOVACache.reduce``) applies it after every
forward, the prompt's included: a layer holding more than ``cache_size`` keys keeps the
``cache_size`` with the highest last-query attention averaged over all query heads, the same
indices for every KV head; a shorter prompt is kept and the cache grows to ``cache_size``. kvlab
splits it in its two places:

- the prompt, compressed at prefill: the ``tova`` importance scorer scores each prompt token by
  the last prompt query's attention, averaged over every query head of the layer,
  ``s_t = (1/H) sum_h softmax(q_{T-1}^h K_{h // G}^T / sqrt(D))_t`` (the multi-state after the
  prompt is the ``budget`` tokens the last query attends to most);
- the decode steps: the ``tova`` decode policy, on the shared eviction step
  (:class:`~kvlab.compression.decode.ScoredEviction`), replaces every stored entry's score by the
  new query's attention averaged over all ``H`` heads of the layer and, once a (sample, KV head)
  holds more than its budget, evicts its lowest-scored entry (one per step: the multi-state keeps
  its size).

Choices where kvpress' ``TOVAPress`` (0.5.x) and the paper differ, resolved for the paper
(``docs/methods/tova.md``): kvpress gives the last prompt token more than the highest score so it
is never pruned; the paper lets it compete, so the preset protects nothing (``budget.window: 0``) and the
last token keeps or loses its place by its own attention weight; ``budget.window: 1`` reproduces
kvpress: the same kept positions as ``TOVAPress`` 0.5.5 in every layer and head of tiny-qwen2 and
tiny-llama (``tests/fixtures/kvpress/``), where the preset (window 0) drops the last token on
tiny-qwen2 for the next best one in every layer. kvpress compresses once, at
prefill, to a ratio of the prompt (``compression_ratio``) and appends every decoded token; the
paper drops one token per step at a fixed size, as the decode policy does. A prompt shorter than
the budget is kept whole and the state grows until it holds ``budget`` tokens, then evicts (the
paper's "multi-state size"); with a ``ratio`` budget the size is each prompt's kept count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.cache.layer import CompressedLayer
from kvlab.compression.context import LayerContext
from kvlab.compression.decode import DECODE_POLICIES, ScoredEntries, ScoredEviction, grow_to_budget
from kvlab.compression.importance import IMPORTANCE, ImportanceScorer
from kvlab.compression.ops import layer_mean
from kvlab.config import papers
from kvlab.config.capabilities import Capabilities


@IMPORTANCE.register("tova")
@dataclass
class TovaScorer(ImportanceScorer):
    """TOVA at prefill: the last query's attention to each prompt token, averaged over all heads.

    ``s_t = (1/H) sum_h softmax(q_{T-1}^h K_{g(h)}^T / sqrt(D))_t`` over the sample's valid tokens
    (the last token's own weight included), ``g(h) = h // G`` the query head's KV head; one row
    per layer, broadcast to ``[B, Hkv, T]``, so every KV head keeps the same positions (TOVA,
    Sec. 3.3). The mean is over all ``H`` query heads (:func:`~kvlab.compression.ops.layer_mean`),
    not within a GQA group (``reduce_groups``). Reads only the last query, so a chunked prefill
    (``model.prefill_chunk``) gives the same scores.
    """

    paper: ClassVar[str | None] = papers.TOVA

    capabilities: ClassVar[Capabilities] = Capabilities(chunked_prefill=True)  # the last query only

    def score(self, ctx: LayerContext) -> torch.Tensor:
        return layer_mean(ctx.window_attention_scores(1), ctx.num_kv_heads)  # [B, Hkv, T]


@DECODE_POLICIES.register("tova")
@dataclass
class TovaDecodePolicy(ScoredEviction):
    """TOVA at decode: a fixed-size cache, the entry of lowest current attention evicted at each step.

    After each step (the new token stored), every entry's score is the new query's attention to
    it averaged over all ``H`` query heads of the layer, by position:
    ``s_p = (1/H) sum_h p_h(p)``, ``p_h`` the softmax of query head ``h`` over its KV head's stored
    entries (0 for a head that does not hold ``p``; with the ``tova`` scorer every head holds the
    same positions). The scores are replaced each step, never accumulated. A (sample, KV head)
    holding more than its capacity then evicts its lowest-scored entry outside the ``recent``
    newest positions (``recent`` is ``budget.window``; 0 in the preset: the new token competes
    too, as in the paper). Capacity: the layer's budget; a prompt the prefill kept whole (budget
    at least its length) grows until it holds the budget, a compressed one holds its kept count.
    The step itself is the shared :class:`~kvlab.compression.decode.ScoredEviction`.
    """

    paper: ClassVar[str | None] = papers.TOVA

    recent: int = 0

    def capacity(self, kept: torch.Tensor, budget: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The layer budget where the prefill kept the whole prompt, else the kept count."""
        return grow_to_budget(kept, budget, lengths)

    def update(self, entries: ScoredEntries, probs: torch.Tensor, layer: CompressedLayer) -> None:
        """Replace every score by the step's attention averaged over the layer's ``H`` heads, by
        position (``probs [B, Hkv, G, q, S]``; the ``q`` queries of the step averaged)."""
        B, Hkv, G, q, S = probs.shape
        received = probs.sum((2, 3))  # [B, Hkv, S]: summed over the group's heads and the step's queries
        valid = layer.slot_valid()
        spare = layer.cumulative_length  # positions are below it; empty slots add into this one
        index = torch.where(valid, entries.positions[:, :, :S], spare).reshape(B, Hkv * S)
        total = received.new_zeros(B, spare + 1)
        total.scatter_add_(1, index, received.masked_fill(~valid, 0).reshape(B, Hkv * S))  # per position
        entries.scores[:, :, :S] = total.gather(1, index).view(B, Hkv, S) / (Hkv * G * q)
