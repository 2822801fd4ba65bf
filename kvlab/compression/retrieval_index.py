"""Retrieval indexes: what a retrieving head keeps on the device to rank its chunks at decode.

The ``retrieve`` selector (:mod:`kvlab.compression.retrieval`) moves a head's prompt K/V to host
memory in ``chunk``-token chunks and keeps, on the layer's device, an index with one summary per
chunk; at every decode step the index ranks the chunks against the step's queries and the top
ones are fetched. An index is a component of its own kind (YAML:
``select: {name: retrieve, index: {name: ...}}``), so two summaries compare at the same budgets
with everything else equal:

- ``mean_key`` (the default): the mean key of each chunk, ranked by ``qbar . kbar_c``
  (HybridKV, Zeng et al. 2026, Appendix A);
- ``key_bounds``: Quest's per-channel minimum and maximum of each page's keys, ranked by the upper
  bound of ``q . k`` over the page (Tang et al. 2024; :mod:`kvlab.compression.quest`).

Shapes: R retrieving (sample, KV head) rows, NC chunks per row, ``chunk`` tokens per chunk, D
the head dim, B / H / q the step's samples, query heads and queries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.config import papers
from kvlab.config.capabilities import Component
from kvlab.config.registry import Registry
from kvlab.kernels.retrieval import chunk_topk


class RetrievalIndex(Component):
    """Base class: override :meth:`summarise` (prefill) and :meth:`topk` (every decode step).

    The index tensor :meth:`summarise` returns has the rows and chunks as its first two dimensions
    (``[R, NC, ...]``), so the store can take a subset of rows (a route's heads) and count its bytes
    per row without knowing its layout.
    """

    def summarise(self, keys: torch.Tensor, token_valid: torch.Tensor) -> torch.Tensor:
        """The chunk summaries of every row, ``[R, NC, ...]`` in the keys' dtype.

        Args:
            keys: ``[R, NC, chunk, D]`` the rows' prompt keys in chunk order (zeros on empty slots).
            token_valid: ``[R, NC, chunk]`` bool, real token slots (a row's last chunk may be partial;
                chunks past a row's tokens are empty).
        """
        raise NotImplementedError

    def topk(
        self,
        query: torch.Tensor,
        index: torch.Tensor,
        rows: torch.Tensor,
        chunk_valid: torch.Tensor,
        n_sel: torch.Tensor,
        num_kv_heads: int,
        width: int | None = None,
    ) -> torch.Tensor:
        """The top ``n_sel[r]`` chunks of every row and query, ascending, ``[R, q, width]`` long (-1
        past a row's count; ties to the lower chunk).

        Args:
            query: ``[B, H, q, D]`` the step's queries (query head ``h`` reads KV head ``h // G``).
            index: what :meth:`summarise` returned, ``[R, NC, ...]``.
            rows: ``[R, 2]`` long, the (sample, KV head) of each row.
            chunk_valid: ``[R, NC]`` bool, chunks holding at least one token.
            n_sel: ``[R]`` long, chunks fetched per step.
            num_kv_heads: ``Hkv``.
            width: ``max(n_sel)`` capped at NC when the caller knows it (no host sync), else None.
        """
        raise NotImplementedError


RETRIEVAL_INDEXES: Registry[RetrievalIndex] = Registry("retrieval index", "model.compression.select.index")


@RETRIEVAL_INDEXES.register("mean_key")
@dataclass
class MeanKeyIndex(RetrievalIndex):
    """The mean key of each chunk, ranked by the group's mean query: ``qbar . kbar_c``.

    ``kbar_c = (1 / n_c) sum_{j in c} k_j`` over the chunk's ``n_c`` real tokens (post-RoPE keys),
    stored ``[R, NC, D]`` in the keys' dtype (computed in fp32). ``qbar . kbar_c`` is the mean over
    the chunk's tokens and the GQA group's queries of ``q_g . k_j``: the chunk's mean logit before
    the softmax scale (HybridKV, Zeng et al. 2026, Appendix A: "the inner product between the query
    vector and chunk metadata"). Kernel: :func:`kvlab.kernels.retrieval.chunk_topk`.
    """

    paper: ClassVar[str | None] = papers.HYBRIDKV

    def summarise(self, keys: torch.Tensor, token_valid: torch.Tensor) -> torch.Tensor:
        filled = token_valid.sum(-1)  # [R, NC]
        index = keys.float().sum(2) / filled.clamp(min=1)[..., None]
        return index.to(keys.dtype)

    def topk(self, query, index, rows, chunk_valid, n_sel, num_kv_heads, width=None):
        return chunk_topk(query, index, rows, chunk_valid, n_sel, num_kv_heads, width)
