"""Chunk retrieval at decode (HybridKV's dynamic heads, the ``retrieve`` selector): scoring, top-k, gather.

A retrieving (sample, KV head) row ``r`` keeps its prompt K/V off the accelerator in
``chunk``-token chunks and, on the accelerator, an index of each chunk's mean key
``index [R, NC, D]``. At every decode step:

1. :func:`chunk_topk` scores every chunk against the step's queries and picks the top
   ``n_sel[r]`` chunks per row and query: ``score[r, i, c] = qbar[r, i] . index[r, c]`` with
   ``qbar`` the mean of the row's ``G`` query vectors (GQA: one selection per KV head; the mean
   over the group of ``q_g . k`` equals ``qbar . k``). Since ``index[r, c]`` is the chunk's mean
   key, the score is the chunk's mean attention logit before the softmax scale, which ranks
   chunks as the scaled logit does (HybridKV, Zeng et al. 2026, Appendix A: "the inner product
   between the query vector and chunk metadata"). Ties go to the lower chunk (a stable sort);
   the chosen chunk ids come back ascending, ``-1`` past a row's count.
2. :func:`gather_chunks` copies the chosen chunks' keys and values from the host store
   ``[R, M, D]`` into a device buffer ``[R, q, S * chunk, D]``.

With Quest's index (``key_bounds``: the per-channel minimum and maximum of each page's keys,
``index [R, NC, 2, D]``), :func:`page_topk` replaces step 1: a page's score is the upper bound of
the logit over its keys, ``sum_d max(qbar_d m_{c,d}, qbar_d M_{c,d})`` (Tang et al. 2024, Sec. 3,
Algorithm 1), and the same exact top-k picks the pages.

All three dispatch (:mod:`kvlab.kernels.dispatch`) to Triton kernels in
:mod:`kvlab.kernels.tl.retrieval` on CUDA and to the torch references here elsewhere. The
Triton gather reads the pinned host store directly (CUDA unified addressing: pinned host memory
is addressable from the device), so the chunk ids never travel to the host; the reference moves
the ids to the host, gathers there (into pinned memory on a CUDA machine) and copies the result
to the device.
"""

from __future__ import annotations

import torch

from kvlab.kernels.dispatch import CALLS, launch_device, use_triton


def chunk_scores_reference(
    query: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, chunk_valid: torch.Tensor, num_kv_heads: int
) -> torch.Tensor:
    """Mean-key chunk scores of every retrieving row, ``[R, q, NC]`` fp32 (-inf on invalid chunks).

    Args:
        query: ``[B, H, q, D]`` the step's queries (query head ``h`` reads KV head ``h // G``).
        index: ``[R, NC, D]`` mean key of each chunk of each retrieving row.
        rows: ``[R, 2]`` long, the (sample, KV head) of each row.
        chunk_valid: ``[R, NC]`` bool, False on chunks that hold no token.
        num_kv_heads: ``Hkv``; ``G = H / Hkv``.

    ``score[r, i, c] = (mean_g q[b_r, h_r G + g, i]) . index[r, c]`` in fp32.
    """
    B, H, q, D = query.shape
    G = H // num_kv_heads
    grouped = query.float().view(B, num_kv_heads, G, q, D)[rows[:, 0], rows[:, 1]]  # [R, G, q, D]
    scores = torch.einsum("rqd,rcd->rqc", grouped.mean(1), index.float())
    return scores.masked_fill(~chunk_valid[:, None, :], float("-inf"))


def topk_chunks_reference(
    scores: torch.Tensor, n_sel: torch.Tensor, width: int | None = None
) -> torch.Tensor:
    """The top ``n_sel[r]`` valid chunks of every row and query, ascending, ``[R, q, max n_sel]`` long.

    ``scores [R, q, NC]`` (-inf: invalid chunk, never chosen), ``n_sel [R]`` long. A row with fewer
    valid chunks than ``n_sel`` takes them all; ties go to the lower chunk. Entries past a row's
    count are -1. ``width`` is ``max(n_sel)`` when the caller knows it (saves a host sync).
    """
    R, q, NC = scores.shape
    if width is None:
        width = int(n_sel.max()) if R else 0
    width = min(width, NC)
    if R == 0 or width == 0:
        return torch.full((R, q, width), -1, dtype=torch.long, device=scores.device)
    valid = scores > float("-inf")
    k = torch.minimum(n_sel.to(scores.device)[:, None], valid.sum(-1))  # [R, q]
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :width]
    keep = torch.arange(width, device=scores.device) < k[..., None]
    big = NC
    chosen = torch.sort(torch.where(keep, order, big), dim=-1).values
    return chosen.masked_fill(chosen == big, -1)


def chunk_topk_reference(
    query: torch.Tensor,
    index: torch.Tensor,
    rows: torch.Tensor,
    chunk_valid: torch.Tensor,
    n_sel: torch.Tensor,
    num_kv_heads: int,
    width: int | None = None,
) -> torch.Tensor:
    """Score the chunks of every retrieving row and pick its top ``n_sel`` per query.

    Args:
        query: ``[B, H, q, D]`` the step's queries.
        index: ``[R, NC, D]`` chunk mean keys.
        rows: ``[R, 2]`` long, (sample, KV head) of each row.
        chunk_valid: ``[R, NC]`` bool.
        n_sel: ``[R]`` long, chunks to retrieve per row.
        num_kv_heads: ``Hkv`` (query head ``h`` belongs to KV head ``h // (H / Hkv)``).
        width: ``max(n_sel)`` if the caller knows it (no host sync), else None.

    Returns:
        ``[R, q, max n_sel]`` long chunk ids, ascending, -1 past each row's count.
    """
    scores = chunk_scores_reference(query, index, rows, chunk_valid, num_kv_heads)
    return topk_chunks_reference(scores, n_sel, width)


def chunk_topk(
    query: torch.Tensor,
    index: torch.Tensor,
    rows: torch.Tensor,
    chunk_valid: torch.Tensor,
    n_sel: torch.Tensor,
    num_kv_heads: int,
    width: int | None = None,
) -> torch.Tensor:
    """Dispatcher of :func:`chunk_topk_reference` (same arguments and result)."""
    if use_triton("chunk_topk", query, index):
        # triton is optional: the launcher (which imports it) loads on this path only
        from kvlab.kernels.tl.retrieval import chunk_topk_triton as impl
    else:
        impl = chunk_topk_reference
    with launch_device(query):
        return impl(query, index, rows, chunk_valid, n_sel, num_kv_heads, width)


def page_bounds_reference(
    query: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, chunk_valid: torch.Tensor, num_kv_heads: int
) -> torch.Tensor:
    """Quest's page upper bounds of every retrieving row, ``[R, q, NC]`` fp32 (-inf on empty pages).

    Args:
        query: ``[B, H, q, D]`` the step's queries (query head ``h`` reads KV head ``h // G``).
        index: ``[R, NC, 2, D]`` per page, the per-channel minimum (``[..., 0, :]``) and maximum
            (``[..., 1, :]``) of its keys.
        rows: ``[R, 2]`` long, the (sample, KV head) of each row.
        chunk_valid: ``[R, NC]`` bool, False on pages that hold no token.
        num_kv_heads: ``Hkv``; ``G = H / Hkv``.

    ``U[r, i, c] = sum_d max(qbar_d m_{c,d}, qbar_d M_{c,d})`` in fp32 with ``qbar`` the mean of the
    row's ``G`` queries: since ``m <= M``, the larger product is ``qbar_d M_d`` where ``qbar_d >= 0``
    and ``qbar_d m_d`` elsewhere (Quest, Tang et al. 2024, Algorithm 1). ``U >= qbar . k_j`` for
    every key ``k_j`` of the page.
    """
    B, H, q, D = query.shape
    G = H // num_kv_heads
    grouped = query.float().view(B, num_kv_heads, G, q, D)[rows[:, 0], rows[:, 1]]  # [R, G, q, D]
    qbar = grouped.mean(1)  # [R, q, D]
    low, high = index[:, :, 0].float(), index[:, :, 1].float()  # [R, NC, D] each
    bounds = torch.einsum("rqd,rcd->rqc", qbar.clamp(min=0), high) + torch.einsum(
        "rqd,rcd->rqc", qbar.clamp(max=0), low
    )
    return bounds.masked_fill(~chunk_valid[:, None, :], float("-inf"))


def page_topk_reference(
    query: torch.Tensor,
    index: torch.Tensor,
    rows: torch.Tensor,
    chunk_valid: torch.Tensor,
    n_sel: torch.Tensor,
    num_kv_heads: int,
    width: int | None = None,
) -> torch.Tensor:
    """Bound the pages of every retrieving row and pick its top ``n_sel`` per query (Quest).

    Arguments and result as :func:`chunk_topk_reference`, with ``index [R, NC, 2, D]`` the pages'
    per-channel key minimum and maximum (:func:`page_bounds_reference`).
    """
    bounds = page_bounds_reference(query, index, rows, chunk_valid, num_kv_heads)
    return topk_chunks_reference(bounds, n_sel, width)


def page_topk(
    query: torch.Tensor,
    index: torch.Tensor,
    rows: torch.Tensor,
    chunk_valid: torch.Tensor,
    n_sel: torch.Tensor,
    num_kv_heads: int,
    width: int | None = None,
) -> torch.Tensor:
    """Dispatcher of :func:`page_topk_reference` (same arguments and result)."""
    if use_triton("page_topk", query, index):
        # triton is optional: the launcher (which imports it) loads on this path only
        from kvlab.kernels.tl.retrieval import page_topk_triton as impl
    else:
        impl = page_topk_reference
    with launch_device(query):
        return impl(query, index, rows, chunk_valid, n_sel, num_kv_heads, width)


def gather_chunks_reference(
    host_keys: torch.Tensor, host_values: torch.Tensor, ids: torch.Tensor, chunk: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of the chosen chunks on ``device``, ``[R, q, S * chunk, D]`` each.

    Args:
        host_keys / host_values: ``[R, M, D]`` the rows' prompt K/V (``M`` a multiple of ``chunk``),
            in host memory (pinned on a CUDA machine) or anywhere.
        ids: ``[R, q, S]`` long chunk ids, -1 for none (its slots are zero).
        chunk: tokens per chunk.
        device: where the result goes (the ids' device).

    Chunk ``c`` of row ``r`` is ``host[r, c * chunk : (c + 1) * chunk]``.
    """
    R, q, S = ids.shape
    M, D = host_keys.shape[1], host_keys.shape[2]
    ids_host = ids.to(host_keys.device)
    tokens = ids_host.clamp(min=0)[..., None] * chunk + torch.arange(chunk, device=host_keys.device)
    flat = (torch.arange(R, device=host_keys.device)[:, None, None, None] * M + tokens).reshape(-1)
    pinned = host_keys.is_pinned()
    out = []
    for host in (host_keys, host_values):
        staging = torch.empty(flat.numel(), D, dtype=host.dtype, device=host.device, pin_memory=pinned)
        torch.index_select(host.reshape(R * M, D), 0, flat, out=staging)
        staging = staging.view(R, q, S * chunk, D)
        staging.masked_fill_((ids_host < 0).repeat_interleave(chunk, -1)[..., None], 0)
        out.append(staging.to(device, non_blocking=pinned))
    return out[0], out[1]


def gather_chunks(
    host_keys: torch.Tensor, host_values: torch.Tensor, ids: torch.Tensor, chunk: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher of :func:`gather_chunks_reference` (same arguments and result).

    Triton runs when the ids are on CUDA and the host store is addressable from the device
    (pinned, or already on the device); the interpreter runs it on CPU tensors.
    """
    if ids.is_cuda and not (host_keys.is_cuda or host_keys.is_pinned()):  # not addressable from the device
        CALLS[("gather_chunks", "reference")] += 1
        impl = gather_chunks_reference
    elif use_triton("gather_chunks", ids):
        # triton is optional: the launcher (which imports it) loads on this path only
        from kvlab.kernels.tl.retrieval import gather_chunks_triton as impl
    else:
        impl = gather_chunks_reference
    with launch_device(ids):
        return impl(host_keys, host_values, ids, chunk, device)
