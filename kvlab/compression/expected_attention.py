"""Expected Attention (Devoto et al. 2025): the attention future queries are expected to pay each key.

The method, and where kvlab's reading of it stands against the paper and the reference code
(kvpress' ``ExpectedAttentionPress``), is written out in ``docs/methods/expected_attention.md``.
Shapes: B batch, H query heads, Hkv KV heads, G = H / Hkv, T padded prompt length, D head dim,
n = ``n_future_positions``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.compression.context import LayerContext
from kvlab.compression.importance import IMPORTANCE, ImportanceScorer
from kvlab.config import papers
from kvlab.config.capabilities import Capabilities
from kvlab.models.facts import LayerFacts, rotate_half

#: the reference's ``n_sink`` (kvpress ``ExpectedAttentionPress``), used outside a pipeline; inside
#: one the scorer reads ``budget.sinks``
REFERENCE_SINKS = 4


@IMPORTANCE.register("expected_attention")
@dataclass
class ExpectedAttentionScorer(ImportanceScorer):
    """Expected Attention: each key's attention under a Gaussian model of the next queries, times ||v||.

    Per sample and query head (Devoto et al. 2025, Sec. 3; kvpress ``ExpectedAttentionPress``):

    1. Statistics of the prompt's queries *before* RoPE, the first ``n_sink`` positions left out
       (outliers), padding left out: ``mu = mean_i q_i`` ``[D]`` and, with ``use_covariance``,
       ``Sigma = mean_i (q_i - mu)(q_i - mu)^T`` ``[D, D]`` (divided by the count, as the reference).
    2. The next ``n`` queries sit at positions ``L .. L + n - 1`` (L: the sample's prompt length,
       :attr:`~kvlab.compression.context.LayerContext.prompt_lengths`);
       RoPE rotates position ``p`` by ``R_p``, so their average rotation ``R = mean_j R_{L+j}``
       (``R x = mean(cos) * x + mean(sin) * rotate_half(x)``) gives the future query distribution
       ``N(R mu, R Sigma R^T)`` (the paper's position-averaged query).
    3. For ``q ~ N(mu', Sigma')`` and scale ``s``, ``E[exp(s q.k)] = exp(s mu'.k + s^2/2 k^T Sigma' k)``
       (the Gaussian moment generating function; with ``s = 1/sqrt(d)`` the paper's
       ``exp(mu'.k / sqrt(d) + k^T Sigma' k / (2d))``), normalised over the sample's keys after its
       first ``n_sink`` (a softmax of the exponents), then averaged over the G query heads of a KV
       head: ``a_t`` ``[B, Hkv, T]``.
    4. With ``use_vnorm``: ``s_t = (a_t + epsilon) * ||v_t||_2`` (the reference's stand-in for the
       contribution ``a_t ||W_o v_t||`` to the residual stream); else ``s_t = a_t``.

    The first ``n_sink`` keys of each sample score ``+inf`` (kept, as the reference's ``max + 1``);
    ``n_sink`` restates ``budget.sinks`` (one source per setting), which also protects them.
    Where kvlab departs from the reference (both documented in ``docs/methods/expected_attention.md``):
    the logits use the layer's softmax scale ``s`` (the reference hard-codes ``1/sqrt(d)``, which
    is the same for Llama, Qwen2 and Mistral), and statistics, rotation and scores run in fp32
    (the reference in the model's dtype). Neither shows on the tiny models in fp32: a prefill keeps
    the positions kvpress 0.5.5's press keeps in every layer and head, on tiny-qwen2 (GQA) with the
    reference's settings and on tiny-llama without covariance or value norm
    (``tests/fixtures/kvpress/``).

    Reads the model facts ``queries_before_rotation`` and ``rotary`` (refused on a model without a
    1-D rotary embedding, e.g. Qwen2-VL's M-RoPE) and every prompt query (refused with
    ``model.prefill_chunk``).
    """

    paper: ClassVar[str | None] = papers.EXPECTED_ATTENTION

    n_future_positions: int = 512
    n_sink: int | None = None
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.02

    budget_settings: ClassVar[dict[str, str]] = {"n_sink": "sinks"}
    capabilities: ClassVar[Capabilities] = Capabilities(
        chunked_prefill=False,  # statistics of every prompt query
        model_facts=("queries_before_rotation", "rotary"),
    )

    def __post_init__(self) -> None:
        if self.n_future_positions < 1:
            raise ValueError(f"n_future_positions must be >= 1, got {self.n_future_positions}")
        if self.n_sink is not None and self.n_sink < 0:
            raise ValueError(f"n_sink must be >= 0, got {self.n_sink}")
        if self.epsilon < 0:
            raise ValueError(f"epsilon must be >= 0, got {self.epsilon}")

    @property
    def sinks(self) -> int:
        """The leading positions left out of the statistics and kept (``budget.sinks`` in a pipeline)."""
        return REFERENCE_SINKS if self.n_sink is None else self.n_sink

    def score(self, ctx: LayerContext) -> torch.Tensor:
        ctx.last_queries(ctx.seq_len, "expected_attention (the statistics of every prompt query)")
        B, Hkv, G, D = ctx.batch_size, ctx.num_kv_heads, ctx.group_size, ctx.keys.shape[-1]
        counted = ctx.valid & (ctx.positions() >= self.sinks)  # [B, T]: queries and keys past the sinks
        mean, cov = query_statistics(ctx.queries_before_rotation(), counted, self.use_covariance)
        rotation = future_rotation(ctx.facts, ctx.prompt_lengths, self.n_future_positions)  # [B, D, D]
        mean = torch.einsum("bij,bhj->bhi", rotation, mean).view(B, Hkv, G, 1, D)
        keys = ctx.keys_fp32()[:, :, None]  # [B, Hkv, 1, T, D]
        s = ctx.scaling
        logits = s * (keys * mean).sum(-1)  # [B, Hkv, G, T]
        if cov is not None:
            cov = (rotation[:, None] @ cov @ rotation.transpose(-1, -2)[:, None]).view(B, Hkv, G, D, D)
            logits = logits + (s * s / 2) * ((keys @ cov) * keys).sum(-1)
        logits = logits.masked_fill(~counted[:, None, None, :], float("-inf"))
        expected = torch.softmax(logits, dim=-1).nan_to_num(0.0).mean(dim=2)  # [B, Hkv, T]
        if self.use_vnorm:
            expected = (expected + self.epsilon) * ctx.values.float().norm(dim=-1)
        sink = ctx.valid & ~counted
        return expected.masked_fill(sink[:, None, :], float("inf"))


def query_statistics(
    queries: torch.Tensor, counted: torch.Tensor, covariance: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mean ``[B, H, D]`` and (``covariance``) covariance ``[B, H, D, D]`` of ``queries [B, H, T, D]``
    over the positions of ``counted [B, T]``, divided by their count (1 when there is none)."""
    weight = counted.to(queries.dtype)[:, None, :, None]  # [B, 1, T, 1]
    count = counted.sum(-1).clamp(min=1).to(queries.dtype)[:, None, None]  # [B, 1, 1]
    mean = (queries * weight).sum(2) / count
    if not covariance:
        return mean, None
    centred = (queries - mean[:, :, None]) * weight
    return mean, centred.transpose(-1, -2) @ centred / count[..., None]


def future_rotation(facts: LayerFacts, lengths: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, D, D]`` fp32: the mean of the RoPE rotations of positions ``L_b .. L_b + n - 1``
    (``lengths [B]``), ``R x = mean(cos) * x + mean(sin) * rotate_half(x)``."""
    positions = lengths[:, None] + torch.arange(n, device=lengths.device)  # [B, n]
    cos, sin = facts.rotary(positions)  # [B, n, D]
    cos, sin = cos.mean(1), sin.mean(1)  # [B, D]
    eye = torch.eye(cos.shape[-1], dtype=cos.dtype, device=cos.device)
    columns = eye * cos[:, None] + rotate_half(eye) * sin[:, None]  # row k: R e_k
    return columns.transpose(-1, -2)
