"""Quest's page index: each page's keys bounded per channel, pages ranked by the bound of q . k.

Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference" (ICML
2024), Sec. 3 and Algorithm 1. The KV cache is cut into pages of a fixed number of tokens (16 in
the paper); a page's metadata is the per-channel minimum ``m_c`` and maximum ``M_c`` of its keys
(Sec. 3, Algorithm 1); at each decode step the query ``q`` bounds the logit of every key of page
``c`` by::

    U_c(q) = sum_d max(q_d m_{c,d}, q_d M_{c,d})   >=   q . k_j   for every k_j in page c

and the top ``K = budget / page`` pages by ``U_c`` are loaded and attended exactly. In kvlab the
page index is a retrieval index (:mod:`kvlab.compression.retrieval_index`) of the ``retrieve``
selector, whose chunks are the pages: the selector's ``chunk`` is the page size, its host store
the paged cache and its fetch the loaded pages (``configs/quest.yaml``). The choices where kvlab
differs from the paper are in ``docs/methods/quest.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.compression.retrieval_index import RETRIEVAL_INDEXES, RetrievalIndex
from kvlab.config import papers
from kvlab.kernels.retrieval import page_topk


@RETRIEVAL_INDEXES.register("key_bounds")
@dataclass
class KeyBoundsIndex(RetrievalIndex):
    """Quest: each page's per-channel key minimum and maximum, ranked by the upper bound of q . k.

    The index is ``[R, NC, 2, D]`` in the keys' dtype: ``[..., 0, :]`` the minimum ``m_c`` and
    ``[..., 1, :]`` the maximum ``M_c`` over the page's real tokens (each is one of the page's own
    key values, so the keys' dtype holds it exactly; an empty page stores zeros and is never
    chosen). At decode a page's score is ``U_c(qbar) = sum_d max(qbar_d m_{c,d}, qbar_d M_{c,d})``
    (Tang et al. 2024, Algorithm 1) with ``qbar`` the mean of the KV head's ``G`` queries: with
    ``G = 1`` (the paper's multi-head models) the paper's bound; under GQA the tightest bound of the
    group's mean logit ``qbar . k_j``, the quantity the ``mean_key`` index estimates, so the two
    indexes rank one selection per KV head by the same target. Twice the mean key's device bytes.
    Kernel: :func:`kvlab.kernels.retrieval.page_topk`.
    """

    paper: ClassVar[str | None] = papers.QUEST

    def summarise(self, keys: torch.Tensor, token_valid: torch.Tensor) -> torch.Tensor:
        real = token_valid[..., None]  # [R, NC, chunk, 1]
        low = keys.masked_fill(~real, float("inf")).amin(2)  # [R, NC, D]
        high = keys.masked_fill(~real, float("-inf")).amax(2)
        empty = ~token_valid.any(-1)[..., None]  # [R, NC, 1]
        bounds = torch.stack([low.masked_fill(empty, 0), high.masked_fill(empty, 0)], 2)
        return bounds  # [R, NC, 2, D]

    def topk(self, query, index, rows, chunk_valid, n_sel, num_kv_heads, width=None):
        return page_topk(query, index, rows, chunk_valid, n_sel, num_kv_heads, width)
