"""Importance scorers: LayerContext -> ``[B, Hkv, T]`` float32 scores, higher means keep.

Scores at padding positions are ignored (the pipeline masks them to -inf); scorers do not need
to special-case padding beyond what :class:`LayerContext` helpers already do. Every scorer
casts to fp32 before it reduces (norms, softmax, sums over the window or the GQA group,
pooling): with 16-bit keys and queries the scores equal those of the fp32-upcast inputs, so a
bf16 rounding tie never decides which token is kept.

``capabilities.chunked_prefill`` (declared on the class) says whether a scorer works after a chunked prefill
(``model.prefill_chunk``), where the layer holds every key and value but only the queries of
the recent window: True for scorers of keys, values, positions and the window's attention;
False for H2O's accumulated attention, which needs every query. A scorer that does not
declare it is refused with chunked prefill (``docs/scaling.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from kvlab.compression.context import LayerContext, check_observed_window
from kvlab.compression.ops import GqaReduce, Pool, pool_tokens, reduce_groups
from kvlab.config import papers
from kvlab.config.capabilities import Capabilities, Component
from kvlab.config.registry import Registry


class ImportanceScorer(Component):
    """Base class: override :meth:`score`.

    ``budget_settings`` maps a parameter that restates a budget setting to that setting (e.g.
    ``{"window": "window"}``): the pipeline fills it from ``budget`` when it is unset and
    refuses a config where the two differ. ``capabilities.chunked_prefill``: True when the scores
    need no query older than the recent ``budget.window`` (see the module docstring); a subclass
    must declare it (``capabilities = Capabilities(chunked_prefill=True)``) for
    ``model.prefill_chunk`` to accept it.
    """

    capabilities: ClassVar[Capabilities] = Capabilities(chunked_prefill=False)

    def score(self, ctx: LayerContext) -> torch.Tensor:
        """Return ``[B, Hkv, T]`` float32 scores, higher means keep."""
        raise NotImplementedError


IMPORTANCE: Registry[ImportanceScorer] = Registry("importance scorer", "model.compression.importance.<role>")


@IMPORTANCE.register("window_attention")
@dataclass
class WindowAttentionScorer(ImportanceScorer):
    """SnapKV: attention of the last ``window`` queries to each earlier token, pooled over neighbours.

    ``s_t = pool( gqa( agg_{i in window} softmax(q_i K^T / sqrt(D))_t ) )`` for t < T - window
    (SnapKV, Li et al. 2024, Eq. 1-2). Tokens inside the observation window get +inf: SnapKV
    always keeps its window. Pooling runs over the past tokens only (the window is sliced off
    first, as in every reference implementation).

    The observation window is the budget's recent window (``budget.window``, the tokens SnapKV
    protects): ``window`` may restate it but not differ from it. Per sample, since a ratio window
    or ``budget.max_window_share`` can give samples of one batch different windows: the scores
    are computed once per distinct window and each sample takes its own.

    Defaults follow the original SnapKV (``init_snapkv``: window 32, kernel 5, avg pooling, sum
    over the window). The references disagree on GQA: the original selects per query head and
    stores H heads; kvlab stores KV heads and reduces the group (``gqa: mean``, reduction
    before pooling, as KVCache-Factory's ``kv_head`` mode, AdaKV and SparseMM). ``gqa_order:
    pool_then_group`` reproduces kvpress. Sum vs mean over the window never changes the
    selection (every head has the same window).

    Shapes: column sums of the window attention ``[B, H, T]`` (from
    :meth:`LayerContext.window_attention_scores`: the Triton kernel on CUDA never materialises the
    ``[B, H, W, T]`` probabilities) -> GQA / pooling -> ``[B, Hkv, T]``.
    """

    paper: ClassVar[str | None] = papers.SNAPKV

    window: int | None = None
    kernel: int = 5
    pool: Pool = "avg"
    agg: Literal["sum", "mean"] = "sum"
    gqa: GqaReduce = "mean"
    gqa_order: Literal["group_then_pool", "pool_then_group"] = "group_then_pool"

    budget_settings: ClassVar[dict[str, str]] = {"window": "window"}
    capabilities: ClassVar[Capabilities] = Capabilities(
        chunked_prefill=True
    )  # the window's queries are held after a chunked prefill

    def __post_init__(self) -> None:
        check_observed_window(self.window)
        if self.kernel < 1:
            raise ValueError(f"kernel must be >= 1, got {self.kernel}")

    def score(self, ctx: LayerContext) -> torch.Tensor:
        windows = ctx.observation_windows(self.window, "window_attention")  # [B]
        return per_window(windows, lambda window: self._score(ctx, window))

    def _score(self, ctx: LayerContext, window: int) -> torch.Tensor:
        """``[B, Hkv, T]`` scores of every sample as if its observation window were ``window``."""
        T = ctx.seq_len
        window = min(window, T)
        shape = (ctx.batch_size, ctx.num_kv_heads, T)
        if window == T:  # the whole (padded) prompt is the window: everything is kept
            return torch.full(shape, float("inf"), dtype=torch.float32, device=ctx.keys.device)
        scores = ctx.window_attention_scores(window)  # [B, H, T]: sum over the window (kernel on CUDA)
        if self.agg == "mean":
            scores = scores / window
        past = scores[..., : T - window]
        if self.gqa_order == "group_then_pool":
            past = pool_tokens(reduce_groups(past, ctx.num_kv_heads, self.gqa), self.pool, self.kernel)
        else:
            past = reduce_groups(pool_tokens(past, self.pool, self.kernel), ctx.num_kv_heads, self.gqa)
        out = torch.full(shape, float("inf"), dtype=torch.float32, device=past.device)
        out[..., : T - window] = past
        return out


def per_window(windows: torch.Tensor, compute) -> torch.Tensor:
    """``compute(w)`` for each distinct window ``w`` of ``windows`` ``[B]``; row b from its own window.

    ``compute`` returns a tensor whose first dimension is the batch; one distinct window (the
    usual case) is a single call.
    """
    distinct = sorted(set(windows.tolist()))
    out = compute(distinct[0])
    for window in distinct[1:]:
        rows = (windows == window).to(out.device).view(-1, *([1] * (out.dim() - 1)))
        out = torch.where(rows, compute(window), out)
    return out


@IMPORTANCE.register("cumulative_attention")
@dataclass
class CumulativeAttentionScorer(ImportanceScorer):
    """H2O heavy hitters: attention each token received, summed over every prompt query.

    ``s_t = gqa( sum_i softmax(q_i K^T / sqrt(D))_t )`` over all valid queries i >= t (H2O,
    Zhang et al. 2023, accumulated attention at prefill; LOOK-M uses the same score). Earlier
    tokens are seen by more queries; that bias is part of the method. ``normalize: by_count``
    divides by the number of queries that could see the token (a common variant).

    Needs every prompt query, so a chunked prefill (``model.prefill_chunk``) refuses it.
    """

    paper: ClassVar[str | None] = papers.H2O

    capabilities: ClassVar[Capabilities] = Capabilities(
        chunked_prefill=False
    )  # every query's attention row, gone after its chunk
    gqa: GqaReduce = "mean"
    normalize: Literal["none", "by_count"] = "none"

    def score(self, ctx: LayerContext) -> torch.Tensor:
        scores = ctx.cumulative_attention()  # [B, H, T]
        if self.normalize == "by_count":
            seen_by = (ctx.lengths[:, None] - ctx.positions()).clamp(min=1)  # [B, T]
            scores = scores / seen_by[:, None, :].float()
        return reduce_groups(scores, ctx.num_kv_heads, self.gqa)


@IMPORTANCE.register("key_norm")
@dataclass
class KeyNormScorer(ImportanceScorer):
    """K-norm (Devoto et al. 2024): keep keys with a *low* L2 norm, ``s_t = -||k_t||_2``.

    ``sign: 1`` flips it (keep high-norm keys) for ablations.
    """

    paper: ClassVar[str | None] = papers.KNORM

    capabilities: ClassVar[Capabilities] = Capabilities(chunked_prefill=True)  # keys only
    sign: Literal[-1, 1] = -1

    def score(self, ctx: LayerContext) -> torch.Tensor:
        return self.sign * ctx.keys.float().norm(dim=-1)


@IMPORTANCE.register("value_norm")
@dataclass
class ValueNormScorer(ImportanceScorer):
    """Value norm: ``s_t = ||v_t||_2`` (MixKV's intrinsic importance term, VNorm)."""

    paper: ClassVar[str | None] = papers.VNORM

    capabilities: ClassVar[Capabilities] = Capabilities(chunked_prefill=True)  # values only

    def score(self, ctx: LayerContext) -> torch.Tensor:
        return ctx.values.float().norm(dim=-1)


@IMPORTANCE.register("recency")
@dataclass
class RecencyScorer(ImportanceScorer):
    """StreamingLLM's recent window: ``s_t = position of t in its sample`` (newer is better).

    Combined with ``budget.sinks`` (the attention sinks, 4 in Xiao et al. 2023) this keeps the
    first ``sinks`` tokens plus the most recent ``budget - sinks`` tokens.
    """

    paper: ClassVar[str | None] = papers.STREAMINGLLM

    capabilities: ClassVar[Capabilities] = Capabilities(chunked_prefill=True)  # positions only

    def score(self, ctx: LayerContext) -> torch.Tensor:
        pos = ctx.positions().float()  # [B, T]
        return pos[:, None, :].expand(-1, ctx.num_kv_heads, -1).contiguous()


@IMPORTANCE.register("random")
@dataclass
class RandomScorer(ImportanceScorer):
    """Uniform random scores, seeded by ``(seed, layer, sample length)``.

    The scores of a sample do not depend on the batch it is in (they are drawn in the
    sample's own coordinates and right-aligned into the padded batch).
    """

    capabilities: ClassVar[Capabilities] = Capabilities(chunked_prefill=True)  # nothing from the model
    seed: int = 0

    def score(self, ctx: LayerContext) -> torch.Tensor:
        B, Hkv, T = ctx.batch_size, ctx.num_kv_heads, ctx.seq_len
        out = torch.zeros(B, Hkv, T, device="cpu")  # drawn on the host: the same draws on every device
        for b, length in enumerate(ctx.lengths.tolist()):
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + ctx.layer_idx * 7919 + length)
            out[b, :, T - length :] = torch.rand(Hkv, length, generator=gen, device=gen.device)
        return out.to(ctx.keys.device)
