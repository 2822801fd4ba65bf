"""Finch's scorer: the attention the prompt's question pays to each entry (Corallo and Papotti 2024).

Finch (Sec. 3) feeds the context chunk by chunk with the question appended; after each chunk,
every layer keeps the entries the question attends to most. The chunking and the question are
the progressive prefill mode's (``model.compression.prefill: {name: progressive, question:
true}``, :mod:`kvlab.compression.prefill_modes`); this scorer is the ranking:

    s_t = (1/G) sum_{g in group} sum_{i in question} n_i softmax_t(q_i^g [K_entries; K_q<=i]^T / sqrt(D))

over the layer's entries ``t`` (kept ones and the chunk's), ``n_i`` the keys row ``i`` sees
(``normalize: true``, the authors' implementation in kvpress) or 1, averaged over the ``G`` query
heads of each KV head (kvpress' ``FinchPress`` reduces the group by its mean). Nothing is protected
by the scorer: a Finch budget has no recent window (the question, the part a window would hold,
is prefilled whole after the context).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.compression.context import LayerContext
from kvlab.compression.importance import IMPORTANCE, ImportanceScorer
from kvlab.compression.ops import reduce_groups
from kvlab.config import papers
from kvlab.config.capabilities import Capabilities


@IMPORTANCE.register("question_attention")
@dataclass
class QuestionAttentionScorer(ImportanceScorer):
    """Finch: the attention the question's tokens pay to each entry, summed over the question.

    ``normalize``: each question row weighted by the number of keys it sees (kvpress' Finch).
    Needs a progressive prefill with ``question: true`` (``capabilities.reads_question``).
    """

    paper: ClassVar[str | None] = papers.FINCH
    # the question's queries are held at every step; no prompt query older than the chunk is read
    capabilities: ClassVar[Capabilities] = Capabilities(chunked_prefill=True, reads_question=True)

    normalize: bool = True

    def score(self, ctx: LayerContext) -> torch.Tensor:
        return reduce_groups(ctx.question_attention(self.normalize), ctx.num_kv_heads)  # [B, Hkv, T]
