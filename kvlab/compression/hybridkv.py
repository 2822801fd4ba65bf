"""HybridKV's head classifier and top-down budget allocator.

HybridKV (Zeng et al. 2026, "HybridKV: Hybrid KV Cache Compression for Efficient Multimodal Large
Language Model Inference", ACL 2026) gives each KV head of each input one of two strategies:

1. **Classification** (Sec. 3.1, Eq. 2-3): the text-centric sparsity score ``S`` of a head is
   the attention mass its text queries put on their top ``k = ceil(topk * C)`` keys, averaged over
   the text queries; ``S >= theta`` is *static* (concentrated, stable focus), otherwise *dynamic*.
   The ``text_sparsity`` route rule computes it at every layer and routes each KV head to the
   ``static`` or the ``dynamic`` branch of a ``route`` (a per-head route, see
   :mod:`kvlab.compression.routing`).
2. **Top-down allocation** (Sec. 3.2, Eq. 4-5): the ``hybridkv`` head allocator splits the pool's
   budget between the two types (share coefficient ``r``; dynamic budgets uniform and rounded to
   a power of two) and then among static heads (a uniform base ``alpha`` plus a part proportional
   to the L1-normalised ``S``).
3. **Compression** (Sec. 3.3, Appendix A): not here. Static heads are pruned once by the text
   prior (window, then historical text, then the top visual tokens by the window attention
   ``s_w`` of Eq. 6-7): in YAML the ``window_attention`` scorer (no pooling, mean over the
   window) with the ``text_prior`` modality allocator (``overflow: strict``) and ``topk``.
   Dynamic heads retrieve: the ``retrieve`` selector (:mod:`kvlab.compression.retrieval`).

The rule hands the classes to the allocator in its decision (:class:`HeadClassDecision`, which
the pipeline gives the branches' components as ``ctx.route``, and every layer's as
``ctx.routes``). Paper ambiguities and the choices made: ``docs/methods/hybridkv.md``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from kvlab.compression.allocators import HEAD_ALLOCATORS, HeadAllocator, round_to_total
from kvlab.compression.context import LayerContext, attention_probs
from kvlab.compression.decision import RouteDecision
from kvlab.compression.prefixkv import fit_to_total
from kvlab.compression.routing import ROUTE_RULES, RouteRule
from kvlab.config import papers
from kvlab.config.capabilities import Capabilities
from kvlab.config.errors import ConfigError

TextSet = Literal["trailing", "all_text"]
GroupReduce = Literal["mean", "max", "min"]


@dataclass
class HeadClassDecision(RouteDecision):
    """The ``text_sparsity`` rule's decision at one layer, with its classification: ``score [B, Hkv]``
    fp32 (S of Eq. 3) and ``static [B, Hkv]`` bool (the heads routed to the static branch)."""

    score: torch.Tensor | None = None
    static: torch.Tensor | None = None


@dataclass
class GlobalPools:
    """``scope: global``: the layers of the pool and each sample's budgets ``[B, L', Hkv]`` (one prompt)."""

    layers: list[int]
    budgets: torch.Tensor


def text_queries(ctx: LayerContext, text: TextSet = "trailing", min_text: int = 8) -> torch.Tensor:
    """``[B, T]`` bool: the prompt positions whose queries form HybridKV's text set ``T`` (Eq. 2).

    ``trailing``: the text after each sample's last visual token (the question and the chat
    template's tail; the whole prompt when it has no visual token); fewer than ``min_text`` such
    tokens fall back to the sample's recent window (``ctx.window``, the budget's). ``all_text``:
    every text token. Visual tokens are modality ids > 0 (image, video).
    """
    valid = ctx.valid
    visual = (ctx.modality > 0) & valid
    T = valid.shape[1]
    pos = torch.arange(T, device=valid.device)
    if text == "all_text":
        return valid & ~visual
    last_visual = torch.where(visual, pos, -1).amax(-1)  # [B], -1: no visual token
    trailing = valid & (pos[None, :] > last_visual[:, None])
    short = trailing.sum(-1) < min_text
    if bool(short.any()):
        if ctx.window is None:
            raise ValueError(
                "the text_sparsity rule needs the budget's window (a pipeline budget) to fall back on"
            )
        recent = valid & (pos[None, :] >= T - ctx.window.clamp(min=1)[:, None])
        trailing = torch.where(short[:, None], recent, trailing)
    return trailing


def text_centric_sparsity(
    ctx: LayerContext,
    topk: float = 0.05,
    text: TextSet = "trailing",
    min_text: int = 8,
    gqa: GroupReduce = "mean",
) -> torch.Tensor:
    """HybridKV's text-centric sparsity score (Eq. 2-3) of every KV head, ``[B, Hkv]`` fp32 in (0, 1].

    For query head h and text queries ``i in T`` (:func:`text_queries`), with the layer's causal,
    padding-masked attention ``P = softmax(q_i K^T * scaling)`` in fp32 over the sample's ``C``
    tokens and ``k = ceil(topk * C)``::

        S_h = 1/|T| sum_{i in T} sum_{j=1..k} TopK(P[i], k)_j

    then reduced over each GQA group by ``gqa``. Query rows are computed in blocks of at most
    ``ctx.block_elements`` probabilities.

    Raises:
        ValueError: the context does not hold a text query (a chunked prefill keeps only the
            recent window's queries).
    """
    rows = text_queries(ctx, text, min_text)  # [B, T]
    B, H, T = ctx.batch_size, ctx.num_heads, ctx.seq_len
    k = torch.tensor([max(1, math.ceil(topk * n - 1e-9)) for n in ctx.lengths.tolist()], device=rows.device)
    first = int(rows.any(0).nonzero()[0]) if bool(rows.any()) else T
    if first < ctx.query_start:
        raise ValueError(
            "the text_sparsity rule needs the queries of the text tokens, which a chunked prefill does not "
            "keep: set model.prefill_chunk to null"
        )
    kmax = int(k.max())
    block = max(1, ctx.block_elements // (B * H * T))
    mass = torch.zeros(B, H, dtype=torch.float32, device=ctx.keys.device)
    rank = torch.arange(kmax, device=rows.device)
    for r0 in range(first, T, block):
        r1 = min(T, r0 + block)
        queries = ctx.queries[:, :, r0 - ctx.query_start : r1 - ctx.query_start]
        probs = attention_probs(queries, ctx, first_query=r0)  # [B, H, rows, T]
        top = probs.topk(min(kmax, T), dim=-1).values  # [B, H, rows, kmax]
        kept = (top * (rank[: top.shape[-1]] < k[:, None, None, None])).sum(-1)  # [B, H, rows]
        mass += (kept * rows[:, None, r0:r1]).sum(-1)
    per_query = mass / rows.sum(-1).clamp(min=1)[:, None]  # [B, H]
    grouped = per_query.view(B, ctx.num_kv_heads, ctx.group_size)
    if gqa == "mean":
        return grouped.mean(-1)
    return grouped.amax(-1) if gqa == "max" else grouped.amin(-1)


@ROUTE_RULES.register("text_sparsity")
@dataclass
class TextSparsityRule(RouteRule):
    """HybridKV's head classifier (Sec. 3.1): route each KV head by its text-centric sparsity.

    ``S >= theta`` (:func:`text_centric_sparsity`, an absolute cutoff on the top-``topk`` mass)
    sends the head to branch ``static``, otherwise to ``dynamic``; per input and per layer. The
    classes and scores are in its decision (:class:`HeadClassDecision`) for the ``hybridkv``
    allocator; the decision's ``metric`` is the mean S over the sample's heads. ``text``, ``min_text`` and
    ``gqa``: see :func:`text_queries` and :func:`text_centric_sparsity`.
    """

    paper: ClassVar[str | None] = papers.HYBRIDKV

    theta: float = 0.9
    topk: float = 0.05
    text: TextSet = "trailing"
    min_text: int = 8
    gqa: GroupReduce = "mean"
    static: str = "static"
    dynamic: str = "dynamic"

    per_head: ClassVar[bool] = True
    # the text queries' attention rows, gone after their chunk
    capabilities: ClassVar[Capabilities] = Capabilities(chunked_prefill=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.topk <= 1.0:
            raise ValueError(f"topk must be a fraction of the prompt in (0, 1], got {self.topk}")
        if self.min_text < 1:
            raise ValueError(f"min_text must be >= 1, got {self.min_text}")
        if self.static == self.dynamic:
            raise ValueError(f"static and dynamic must name different branches, both are '{self.static}'")

    @property
    def branch_names(self) -> tuple[str, ...]:
        return (self.static, self.dynamic)

    def decide(self, ctx: LayerContext) -> RouteDecision:
        score = text_centric_sparsity(ctx, self.topk, self.text, self.min_text, self.gqa)
        static = score >= self.theta
        dynamic = (~static).any(-1).tolist()
        return HeadClassDecision(
            branches=[self.dynamic if d else self.static for d in dynamic],
            switched=torch.zeros(ctx.batch_size, dtype=torch.bool, device="cpu"),  # as the metric
            metric=score.float().mean(-1).cpu(),
            heads=(~static).long(),
            head_names=(self.static, self.dynamic),
            score=score,
            static=static,
        )


def round_pow2(x: float, mode: Literal["nearest", "ceil", "floor", "none"]) -> int:
    """``x > 0`` to a power of two: nearest in linear distance (ties down), up, down; ``none``: floor."""
    if mode == "none":
        return max(1, math.floor(x))
    lo = 2 ** math.floor(math.log2(max(x, 1.0)))
    hi = 2 * lo
    if mode == "floor" or x <= lo:
        return lo
    if mode == "ceil":
        return hi
    return lo if x - lo <= hi - x else hi


def allocate_pool(
    score: torch.Tensor,
    static: torch.Tensor,
    per_head: int,
    length: int,
    protected: int,
    r: float = 0.75,
    alpha: float = 0.1,
    pow2: Literal["nearest", "ceil", "floor", "none"] = "nearest",
    min_dynamic: int = 8,
    rounding: Literal["exact_total", "floor"] = "exact_total",
) -> torch.Tensor:
    """HybridKV's top-down allocation (Eq. 4-5) of one sample's pool of ``N`` heads, ``[N]`` long.

    Args:
        score: ``[N]`` text-centric sparsity ``S`` of each head.
        static: ``[N]`` bool head classes.
        per_head: ``Bbar``, the average budget per head (protected tokens included);
            ``B_total = Bbar N``.
        length: the sample's prompt length ``C`` (no head keeps more).
        protected: tokens every static head keeps whatever its budget (the window and sinks).

    Head-type level: ``b_dyn = pow2(r Bbar)``, stepped down one power at a time while
    ``b_dyn N_dyn + protected N_stat > B_total`` (the paper's constraint
    ``r <= B_total / (Bbar N_dyn)``, with room for every static head's window), then raised to
    ``min_dynamic`` where that still leaves the static heads their window, to ``protected`` in
    any case (a budget below the protected tokens is the pipeline's recorded overshoot), and
    capped at ``C``; ``B_stat = B_total - b_dyn N_dyn`` (the
    total preserved after rounding and raising). Head level::

        b_h = alpha B_stat / N_stat + (1 - alpha) B_stat S_h / sum_{static} S

    fitted to integers within ``[protected, C]`` summing to ``B_stat`` (``exact_total``: the
    real values shifted by one common amount where a bound binds, then rounded by largest
    remainder), or with each term floored (``floor``, Eq. 5 as printed) and then clamped to
    ``[protected, C]`` with the excess above ``C`` handed to the other static heads in proportion
    to their ``S`` (the release's rule; its total may differ from ``B_stat``). Dynamic heads get
    ``b_dyn``.

    """
    N = score.numel()
    dynamic = ~static
    n_dyn, n_stat = int(dynamic.sum()), N - int(dynamic.sum())
    total = per_head * N
    out = torch.zeros(N, dtype=torch.long, device="cpu")  # host arithmetic on the classes (prefill)
    b_dyn = 0
    if n_dyn:
        b_dyn = round_pow2(r * per_head, pow2)
        limit = (total - protected * n_stat) // n_dyn
        while b_dyn > max(limit, 1):
            b_dyn = max(limit, 1) if pow2 == "none" else b_dyn // 2
        # kvlab's pipeline counts the protected tokens in every head's budget (a retrieving head with
        # nothing resident retrieves that many at least), so b_dyn is raised to them here, where
        # B_stat still accounts for it
        b_dyn = max(b_dyn, min(min_dynamic, max(limit, 1)))  # min_dynamic where it fits
        b_dyn = min(max(b_dyn, protected), length)
        out[dynamic.cpu()] = b_dyn
    if not n_stat:
        return out
    stat = max(total - b_dyn * n_dyn, 0)
    s = score.detach().double().cpu()[static.cpu()]
    share = s / s.sum() if float(s.sum()) > 0 else torch.full_like(s, 1.0 / n_stat)
    real = alpha * stat / n_stat + (1 - alpha) * stat * share
    if rounding == "floor":
        budgets = math.floor(alpha * stat / n_stat) + torch.floor((1 - alpha) * stat * share).long()
        out[static.cpu()] = _clamp_spread(budgets.clamp(min=protected), length, share)
    else:  # within [protected, C], summing to B_stat (bounded by what the bounds allow)
        low = min(protected, length)
        out[static.cpu()] = fit_to_total(real, low, length, min(max(stat, low * n_stat), length * n_stat))
    return out


def _clamp_spread(budgets: torch.Tensor, high: int, share: torch.Tensor) -> torch.Tensor:
    """``budgets`` capped at ``high``; what a cap removes goes to the others in proportion to ``share``."""
    budgets = budgets.clone()
    for _ in range(budgets.numel()):
        over = budgets > high
        if not bool(over.any()):
            break
        surplus = int((budgets[over] - high).sum())
        budgets[over] = high
        room = budgets < high
        if not bool(room.any()):
            break
        budgets[room] += round_to_total(share[room] / share[room].sum() * surplus, surplus)
    return budgets


@HEAD_ALLOCATORS.register("hybridkv")
@dataclass
class HybridKVHeadAllocator(HeadAllocator):
    """HybridKV's top-down allocation (Eq. 4-5, :func:`allocate_pool`) over the classified heads.

    Needs the ``text_sparsity`` route rule (it classifies the heads). The pool is each layer's
    KV heads (``scope: layer``: ``Bbar`` is the layer budget, N = Hkv) or every layer's
    (``scope: global``, the paper's reading: one pool of L x Hkv heads, which needs every layer's
    classes before the first layer is compressed, i.e. ``model.compression.schedule: global``).
    Returns ``[B, Hkv]`` free-token counts (budgets minus the protected tokens): ragged.
    """

    paper: ClassVar[str | None] = papers.HYBRIDKV
    needs_route_rule: ClassVar[frozenset[str]] = frozenset({"text_sparsity"})

    r: float = 0.75
    alpha: float = 0.1
    pow2: Literal["nearest", "ceil", "floor", "none"] = "nearest"
    min_dynamic: int = 8
    rounding: Literal["exact_total", "floor"] = "exact_total"
    scope: Literal["layer", "global"] = "layer"

    def __post_init__(self) -> None:
        if not self.r > 0:
            raise ValueError(f"r must be > 0 (the dynamic heads' share of the average budget), got {self.r}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.min_dynamic < 1:
            raise ValueError(f"min_dynamic must be >= 1 token, got {self.min_dynamic}")
        if self.scope == "global":  # every layer's classes are compared
            self.capabilities = dataclasses.replace(type(self).capabilities, needs_all_layers=True)

    def allocate(self, scores: torch.Tensor, free: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        seen = {layer: d for layer, d in ctx.routes.items() if isinstance(d, HeadClassDecision)}
        if not isinstance(ctx.route, HeadClassDecision):
            raise ConfigError(
                "model.compression.allocate.head 'hybridkv' splits budgets by head class: it needs a "
                "per-head route whose rule classifies the heads, `route: {rule: {name: text_sparsity}, "
                "branches: {static: ..., dynamic: ...}}` (see configs/hybridkv.yaml)."
            )
        protected = (
            (ctx.protected & ctx.valid).sum(-1) if ctx.protected is not None else torch.zeros_like(free)
        )
        per_head = free + protected  # the layer budget Bbar of each sample (protected included)
        if self.scope == "global":
            budgets = self._global(seen, per_head, protected, ctx)
        else:
            classes = ctx.route
            budgets = torch.stack([
                self._pool(classes.score[b], classes.static[b], per_head[b], ctx.lengths[b], protected[b])
                for b in range(ctx.batch_size)
            ])  # fmt: skip
        return budgets.to(free.device) - protected[:, None]

    def _pool(self, score, static, per_head, length, protected) -> torch.Tensor:
        return allocate_pool(
            score, static, int(per_head), int(length), int(protected),
            self.r, self.alpha, self.pow2, self.min_dynamic, self.rounding,
        )  # fmt: skip

    def _global(
        self, seen: dict[int, HeadClassDecision], per_head, protected, ctx: LayerContext
    ) -> torch.Tensor:
        """This layer's rows of one pool over every layer (computed once per prompt)."""
        pools = ctx.run.owned(self, lambda: GlobalPools([], torch.empty(0)))
        if not pools.layers:
            whole = ctx.run.whole_layers  # sliding-window layers kept whole, never classified
            if len(seen) + len(whole) != ctx.num_layers:
                raise ConfigError(
                    "model.compression.allocate.head.scope 'global' pools every layer's heads, whose "
                    "classes exist only after the last layer's prefill: set model.compression.schedule: "
                    "global, or use scope: layer (one pool per layer)."
                )
            layers = sorted(seen)
            B, Hkv = seen[layers[0]].score.shape
            budgets = torch.empty(B, len(layers), Hkv, dtype=torch.long, device="cpu")  # host arithmetic
            for b in range(B):
                score = torch.stack([seen[layer].score[b] for layer in layers]).flatten()
                static = torch.stack([seen[layer].static[b] for layer in layers]).flatten()
                pool = self._pool(score, static, per_head[b], ctx.lengths[b], protected[b])
                budgets[b] = pool.view(len(layers), Hkv)
            pools.layers, pools.budgets = layers, budgets
        return pools.budgets[:, pools.layers.index(ctx.layer_idx)]
