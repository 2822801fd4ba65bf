"""CAPKV: a value's leverage in a capacity matrix weighted by its key's alignment with the queries.

Tang et al. 2026 ("Rethinking KV Cache Eviction via a Unified Information-Theoretic Objective",
arXiv 2604.25975), as kvpress 0.5.5's ``CapPress`` computes it, with its defaults.
``docs/methods/capkv.md`` gives the equations and every choice where kvlab, the reference code and
the paper differ. Shapes: B batch, H query heads, Hkv KV heads, G = H / Hkv, T padded prompt
length, D head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.compression.context import LayerContext
from kvlab.compression.expected_attention import REFERENCE_SINKS, future_rotation, query_statistics
from kvlab.compression.importance import IMPORTANCE, ImportanceScorer
from kvlab.config import papers
from kvlab.config.capabilities import Capabilities


@IMPORTANCE.register("capkv")
@dataclass
class CapKVScorer(ImportanceScorer):
    """CAPKV: each value's leverage ``v_t^T A^{-1} v_t`` times its key's weight ``w_t`` under the anchor.

    Per sample and query head, over the sample's tokens after its first ``n_sink`` (``t``; the
    formula of kvpress' ``CapPress`` docstring, its notes 1-4 and its code)::

        mu  = R mean_i q_i                      [D]    the anchor: the mean of the prompt's queries
                                                        before RoPE (past the sinks), rotated by the
                                                        average R = mean_j R_{L+j}, j < n_future_positions
        c_t = <k_t / ||k_t||, mu / ||mu||>       in [-1, 1]   (k_t the cached, post-RoPE key)
        w_t = exp(tau c_t - max_u tau c_u)       in (0, 1]
        A   = I + sum_t (w_t + epsilon) v_t v_t^T    [D, D]
        s_t = w_t v_t^T A^{-1} v_t

    then the mean over the G query heads of a KV head: ``[B, Hkv, T]`` fp32. The paper's
    ``A = I + sum_i w_i u_i u_i^T`` with the output direction ``u_i`` and ``w_i = exp(tau
    <k_i, mu_q>)``; what the reference code (and so kvlab) changes, each in
    ``docs/methods/capkv.md``:

    - keys and anchor L2-normalised (the paper's raw dot product), a per-head max shift of the
      exponent (which also fixes the scale of ``w`` against ``I``: it is not a no-op), ``epsilon``
      added to ``w`` inside ``A`` only, ``u_t = v_t``;
    - the anchor rotated to the next ``n_future_positions`` positions (not in the paper), with the
      helpers of Expected Attention (:func:`~kvlab.compression.expected_attention.query_statistics`,
      :func:`~kvlab.compression.expected_attention.future_rotation`);
    - GQA: scored per query head (the KV head's keys and values repeated), averaged per KV head.

    The first ``n_sink`` positions of each sample score ``+inf`` (kvpress pads them with the batch
    tensor's ``max + 1``); ``n_sink`` restates ``budget.sinks``, which protects them. Padding scores
    0 and is left out of the anchor, the max shift and ``A``: each sample alone. kvlab solves ``A``
    (symmetric, eigenvalues >= 1) by a Cholesky factor in fp32 (kvpress: ``A`` in the model's dtype,
    a general solve in fp32).

    Reads the model facts ``queries_before_rotation`` and ``rotary`` (refused on a model without a
    1-D rotary embedding, e.g. Qwen2-VL's M-RoPE) and every prompt query (refused with
    ``model.prefill_chunk``).
    """

    paper: ClassVar[str | None] = papers.CAPKV

    tau: float = 5.0
    n_future_positions: int = 512
    n_sink: int | None = None
    epsilon: float = 1e-6

    budget_settings: ClassVar[dict[str, str]] = {"n_sink": "sinks"}
    capabilities: ClassVar[Capabilities] = Capabilities(
        chunked_prefill=False,  # the anchor is the mean of every prompt query
        model_facts=("queries_before_rotation", "rotary"),
    )

    def __post_init__(self) -> None:
        if not (math.isfinite(self.tau) and self.tau >= 0):
            raise ValueError(
                f"tau must be a finite number >= 0 (the temperature of the alignment weights; 0: every "
                f"token weighs 1), got {self.tau}"
            )
        if self.n_future_positions < 1:
            raise ValueError(f"n_future_positions must be >= 1, got {self.n_future_positions}")
        if self.n_sink is not None and self.n_sink < 0:
            raise ValueError(f"n_sink must be >= 0, got {self.n_sink}")
        if not (math.isfinite(self.epsilon) and self.epsilon >= 0):
            raise ValueError(f"epsilon must be a finite number >= 0, got {self.epsilon}")

    @property
    def sinks(self) -> int:
        """The leading positions left out of the anchor and ``A`` and kept (``budget.sinks`` in a
        pipeline; kvpress' ``n_sink = 4`` outside one, the default CapPress takes from Expected Attention)."""
        return REFERENCE_SINKS if self.n_sink is None else self.n_sink

    def score(self, ctx: LayerContext) -> torch.Tensor:
        ctx.last_queries(ctx.seq_len, "capkv (its anchor is the mean of every prompt query)")
        B, Hkv, G, D = ctx.batch_size, ctx.num_kv_heads, ctx.group_size, ctx.keys.shape[-1]
        counted = ctx.valid & (ctx.positions() >= self.sinks)  # [B, T]: queries and tokens past the sinks
        mean, _ = query_statistics(ctx.queries_before_rotation(), counted, covariance=False)  # [B, H, D]
        rotation = future_rotation(ctx.facts, ctx.prompt_lengths, self.n_future_positions)  # [B, D, D]
        anchor = torch.einsum("bij,bhj->bhi", rotation, mean)
        anchor = torch.nn.functional.normalize(anchor, dim=-1).view(B, Hkv, G, 1, D)
        keys = torch.nn.functional.normalize(ctx.keys_fp32(), dim=-1)[:, :, None]  # [B, Hkv, 1, T, D]
        logits = self.tau * (keys * anchor).sum(-1).clamp(-1.0, 1.0)  # [B, Hkv, G, T]
        mask = counted[:, None, None, :]
        # the max over the counted tokens (logits >= -tau: the clamp only replaces the -inf of a
        # sample with none, whose weights are all 0)
        top = logits.masked_fill(~mask, -math.inf).amax(-1, keepdim=True).clamp_min(-self.tau)
        weights = torch.exp(logits - top) * mask  # [B, Hkv, G, T], 0 off the counted tokens
        values = ctx.values.float()[:, :, None]  # [B, Hkv, 1, T, D]
        scaled = values * ((weights + self.epsilon) * mask).sqrt()[..., None]  # [B, Hkv, G, T, D]
        eye = torch.eye(D, dtype=scaled.dtype, device=scaled.device)
        capacity = eye + scaled.transpose(-1, -2) @ scaled  # A, [B, Hkv, G, D, D]
        # A = L L^T: A's eigenvalues are >= 1, so the factorisation holds for any finite input (the
        # _ex form reads no error flag back to the host)
        factor = torch.linalg.cholesky_ex(capacity).L
        solved = torch.linalg.solve_triangular(factor, values.transpose(-1, -2), upper=False)  # L^{-1} v_t
        leverage = solved.square().sum(-2)  # v_t^T A^{-1} v_t, [B, Hkv, G, T]
        scores = (weights * leverage).mean(2)  # [B, Hkv, T]
        sink = ctx.valid & ~counted
        return scores.masked_fill(sink[:, None, :], math.inf)
