"""LayerContext: everything a compression component may read about one layer's prefill.

Shapes: B batch, H query heads, Hkv KV heads, G = H / Hkv, T padded prompt length, D head dim.
Batches are left padded; ``valid[b, t]`` is False on padding. Attention helpers are memoised so
two components never compute the same attention twice, and work in blocks of query rows so that
no helper needs more than a bounded ``[B, H, rows, T]`` block besides its ``O(T)`` result.

Queries: after a one-forward prefill the context holds every prompt query (``query_start`` 0);
after a chunked prefill (``model.prefill_chunk``) only those of the prompt's last positions (the
largest recent window a component observes, and the last chunk). The helpers say which they
need: the window helpers the last ``W`` queries, :meth:`LayerContext.cumulative_attention` all of
them (refused otherwise, see ``docs/scaling.md``).

Model facts (:attr:`LayerContext.facts`, :mod:`kvlab.models.facts`): the rotary embedding at any
position, the queries and keys before rotation (:meth:`LayerContext.queries_before_rotation`,
:meth:`LayerContext.keys_before_rotation`), the layer's
projection weights; a frozen view holding only what the pipeline's components declared in
``Capabilities(model_facts=...)`` (empty otherwise: reading an undeclared fact raises).

The question (:attr:`LayerContext.question`): during a progressive prefill with ``question: true``
(``model.compression.prefill``, Finch) the question part of the prompt runs after each chunk; its
queries and keys are a :class:`QuestionView`, and :meth:`LayerContext.question_attention` is the
attention the question pays to each entry (its own keys in the softmax, never among the entries).

Image blocks (Gemma 3, :attr:`LayerContext.image_blocks`): the model lets the tokens of one image
attend to each other in both directions, and every attention helper here applies the same mask as
the model's prefill attention (``causal | same image block``), so scorers read the attention the
model computed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlab.cache.masks import and_masks, build_mask, causal, key_padding, or_masks, same_image_block
from kvlab.cache.state import RunState
from kvlab.compression.decision import RouteDecision
from kvlab.config.errors import ConfigError
from kvlab.kernels.window_scores import REFERENCE_BLOCK_ELEMENTS, window_attention_scores
from kvlab.models.facts import LayerFacts


def check_observed_window(window: int | None) -> None:
    """Refuse a window observer's own ``window`` below 0 (None: the budget's; 0: the last query
    alone, as :meth:`LayerContext.observation_windows` reads it)."""
    if window is not None and window < 0:
        raise ValueError(f"window must be >= 0 (0: the last query alone), got {window}")


@dataclass(frozen=True)
class QuestionView:
    """The question of a progressive prefill's step, after one layer's attention (Finch, Sec. 3).

    Attributes:
        queries: post-RoPE queries ``[B, H, Q, D]`` of the question tokens, left padded.
        keys: their post-RoPE keys ``[B, Hkv, Q, D]`` (in the softmax, never entries to keep).
        valid: ``[B, Q]`` bool, False on padding (and for a sample with no chunk at this step).
    """

    queries: torch.Tensor
    keys: torch.Tensor
    valid: torch.Tensor


@dataclass
class LayerContext:
    """Inputs of one layer's compression.

    Attributes:
        layer_idx: index of the decoder layer (0-based).
        num_layers: number of decoder layers of the language model.
        queries: post-RoPE queries ``[B, H, Tq, D]`` of the prompt's last ``Tq`` positions
            (``query_start = T - Tq``): every query (``Tq = T``) after a one-forward prefill, the
            observed window and the last chunk after a chunked prefill.
        keys: post-RoPE keys ``[B, Hkv, T, D]`` (GQA heads not repeated).
        values: values ``[B, Hkv, T, D]``.
        valid: ``[B, T]`` bool, False on padding.
        modality: ``[B, T]`` long, 0 text, 1 image, 2 video, -1 padding.
        scaling: softmax scale of the layer (usually ``D ** -0.5``).
        run: the run's shared state (:class:`~kvlab.cache.state.RunState`: the cache, each
            component's own bookkeeping via ``run.owned(self, factory)``, the layers kept whole),
            the same object for every layer of a prefill; a standalone context has an empty one.
        protected: ``[B, T]`` bool, tokens the budget always keeps (window, sinks); set by the
            pipeline before any scorer runs (None outside a pipeline: nothing protected).
        window: ``[B]`` long, the recent window of each sample (``budget.window``, per sample):
            protected by the budget and observed by window scorers; set by the pipeline (None
            outside a pipeline: scorers use their own ``window``).
        query_start: prompt position of ``queries[:, :, 0]`` (0: every query is held).
        sliding_window: the layer's sliding window ``W`` (its queries see the ``W`` newest
            positions), None for a full-attention layer; the pipeline then keeps only tokens the
            next query can see (``model.compression.sliding_layers``).
        image_blocks: ``[B, T]`` long image block of each token (-1 outside images;
            :func:`kvlab.cache.masks.image_block_ids`) when the model lets the tokens of one
            image attend to each other in both directions (Gemma 3), else None (causal). The
            attention helpers then OR "same image block" into their causal mask.
        block_elements: the most fp32 attention probabilities an attention helper holds at once
            (``B x H x rows x T``; default :data:`~kvlab.kernels.window_scores.REFERENCE_BLOCK_ELEMENTS`,
            64 MiB): the helpers work in blocks of query rows of that size.
        route: inside a route's branch, the route's decision for this layer (a per-head rule's
            classes ride on it, e.g. HybridKV's); None outside a route. Set by the pipeline
            (:meth:`in_branch`).
        routed_heads: inside a per-head route's branch, ``[B, Hkv]`` bool, the heads routed to
            this branch (the rows of its selection that will be kept; a selector may skip the
            others); None otherwise.
        routes: inside a route's branch, the route's decision for every layer decided so far in
            this run, by layer index (all of them under ``schedule: global``).
        prompt_valid: the padding mask the model's positions were counted from, ``[B, T]`` bool;
            None: :attr:`valid`. :meth:`restricted` sets it (the tokens a sliding layer's next
            query can see are fewer than the prompt, whose positions are unchanged).
        facts: the model facts the pipeline's components declared, for this layer
            (:class:`~kvlab.models.facts.LayerFacts`: rotary embedding, projection weights; set by
            the engine, empty when no component declares one).
        role_scores: every scorer's score by role (``[B, Hkv, T]`` each, as the scorer returned it),
            set by the pipeline once the layer is scored, before allocation and selection (a
            selector ranking part of the budget by one scorer reads it: ``two_stage``); empty
            before scoring and outside a pipeline.
        question: the question's queries and keys during a progressive prefill with
            ``question: true`` (:class:`QuestionView`); None otherwise.
    """

    layer_idx: int
    num_layers: int
    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor
    modality: torch.Tensor
    scaling: float
    run: RunState = field(default_factory=RunState)
    protected: torch.Tensor | None = None
    window: torch.Tensor | None = None
    query_start: int = 0
    sliding_window: int | None = None
    image_blocks: torch.Tensor | None = None
    block_elements: int = REFERENCE_BLOCK_ELEMENTS
    route: RouteDecision | None = None
    routed_heads: torch.Tensor | None = None
    routes: Mapping[int, RouteDecision] = field(default_factory=dict)
    prompt_valid: torch.Tensor | None = None
    facts: LayerFacts = field(default_factory=LayerFacts)
    role_scores: Mapping[str, torch.Tensor] = field(default_factory=dict)
    question: QuestionView | None = None
    _memo: dict[Any, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def batch_size(self) -> int:
        return self.keys.shape[0]

    @property
    def num_heads(self) -> int:
        return self.queries.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def seq_len(self) -> int:
        return self.keys.shape[2]

    @property
    def lengths(self) -> torch.Tensor:
        """Valid (non-padding) tokens per sample, ``[B]`` long."""
        return self.valid.sum(-1)

    def restricted(self, valid: torch.Tensor) -> LayerContext:
        """This context with only the tokens of ``valid [B, T]`` left valid (a copy: the same tensors
        and run state, its own memoised helpers, which depend on ``valid``)."""
        prompt_valid = self.valid if self.prompt_valid is None else self.prompt_valid
        return dataclasses.replace(self, valid=valid, prompt_valid=prompt_valid, _memo={})

    @contextlib.contextmanager
    def in_branch(
        self,
        route: RouteDecision,
        routes: Mapping[int, RouteDecision],
        routed_heads: torch.Tensor | None = None,
    ) -> Iterator[LayerContext]:
        """Within the block this context is a route branch's: :attr:`route`, :attr:`routes` and
        :attr:`routed_heads` are set (the pipeline's routed execution), then restored."""
        saved = (self.route, self.routes, self.routed_heads)
        self.route, self.routes, self.routed_heads = route, routes, routed_heads
        try:
            yield self
        finally:
            self.route, self.routes, self.routed_heads = saved

    def release(self, keep_queries: int | None) -> None:
        """Free what this context no longer needs while it waits to be compressed (``schedule: global``).

        Keeps the last ``keep_queries`` queries (a copy, so the prefill's query tensor can be freed;
        None: all) and, of the memoised attention helpers, only per-token statistics (at most one
        value per sample, query head and token, e.g. ``cumulative_attention``); larger
        intermediates (the fp32 copy of the keys, window attention probabilities) are recomputed if
        asked for again.
        """
        if keep_queries is not None and keep_queries < self.queries.shape[2]:
            self.queries = self.queries[:, :, self.queries.shape[2] - keep_queries :].clone()
            self.query_start = self.seq_len - keep_queries
        per_token = self.batch_size * self.num_heads * self.seq_len
        large = [k for k, v in self._memo.items() if torch.is_tensor(v) and v.numel() > per_token]
        for name in large:
            del self._memo[name]

    def positions(self) -> torch.Tensor:
        """Position of each token within its own sample, ``[B, T]`` (see :func:`sample_positions`)."""
        return sample_positions(self.valid)

    def model_positions(self) -> torch.Tensor:
        """The position the model gave each token, ``[B, T]`` long: its position in its own prompt
        (:attr:`prompt_valid`), padding at 0, as the engine's ``position_ids``."""
        valid = self.valid if self.prompt_valid is None else self.prompt_valid
        return sample_positions(valid).clamp(min=0)

    @property
    def prompt_lengths(self) -> torch.Tensor:
        """Prompt tokens per sample, ``[B]`` long (:attr:`prompt_valid`; the next token's position)."""
        return (self.valid if self.prompt_valid is None else self.prompt_valid).sum(-1)

    @property
    def candidates(self) -> torch.Tensor:
        """``[B, T]`` bool: the tokens that compete for the budget (valid and not protected).

        Per-head statistics of the MixKV family (min, max and mean of a score) are taken over
        these tokens: the prompt before the window, ``P = T - W`` tokens, padding excluded.
        """
        if self.protected is None:
            return self.valid
        return self.valid & ~self.protected

    def observation_windows(self, own: int | None, who: str) -> torch.Tensor:
        """The recent window each sample's last queries span, ``[B]`` long, for a window observer.

        Inside a pipeline this is :attr:`window` (the budget's); outside one, the observer's
        ``own`` window. A window of 0 (a budget with no recent window, or an observer's own 0) is
        raised to 1: an observer needs at least the last query.
        """
        if self.window is not None:
            return self.window.clamp(min=1)
        if own is None:
            raise ValueError(
                f"{who} needs a window: set budget.window (or its own window outside a pipeline)"
            )
        return torch.full((self.batch_size,), max(own, 1), dtype=torch.long, device=self.valid.device)

    def unit_key_mean(self) -> torch.Tensor:
        """Mean of the unit-normalised keys over each sample's valid tokens, ``[B, Hkv, D]`` fp32.

        ``mean_t k_t / ||k_t||`` (window included, padding excluded), shared by MixKV's key
        diversity and its head redundancy; memoised.
        """
        if "unit_key_mean" not in self._memo:
            weight = self.valid.float()[:, None, None, :] / self.key_norms()[:, :, None, :]  # [B, Hkv, 1, T]
            count = self.lengths.clamp(min=1)[:, None, None].float()
            # sum_t k_t / ||k_t|| as one matrix-vector product: the unit keys are never materialised
            self._memo["unit_key_mean"] = (weight @ self.keys_fp32()).squeeze(2) / count
        return self._memo["unit_key_mean"]

    def key_norms(self) -> torch.Tensor:
        """``||k_t||_2`` per (sample, KV head, token), ``[B, Hkv, T]`` fp32, floored at 1e-12 (memoised)."""
        if "key_norms" not in self._memo:
            self._memo["key_norms"] = self.keys_fp32().norm(dim=-1).clamp_min(1e-12)
        return self._memo["key_norms"]

    def keys_fp32(self) -> torch.Tensor:
        """The keys in fp32, ``[B, Hkv, T, D]`` (cast once, shared by the attention helpers)."""
        if "keys_fp32" not in self._memo:
            self._memo["keys_fp32"] = self.keys.float()
        return self._memo["keys_fp32"]

    def last_queries(self, count: int, who: str = "a component") -> torch.Tensor:
        """The queries of the prompt's last ``count`` positions, ``[B, H, count, D]``.

        Raises:
            ConfigError: the context holds fewer (a chunked prefill keeps only the largest
                ``budget.window`` and the last chunk), naming ``who`` and ``model.prefill_chunk``.
        """
        held = self.queries.shape[2]
        if count > held:
            raise ConfigError(
                f"{who} observes the last {count} queries, but this layer holds only the last {held} "
                f"(the prompt was prefilled in chunks, model.prefill_chunk): observe at most budget.window "
                "queries, or set model.prefill_chunk to null."
            )
        return self.queries[:, :, held - count :]

    def queries_before_rotation(self) -> torch.Tensor:
        """The held queries before the rotary embedding, ``[B, H, Tq, D]`` fp32 (positions as
        :attr:`queries`), memoised.

        Each query is rotated back at the position the model gave it (:meth:`model_positions`)
        by :meth:`~kvlab.models.facts.LayerFacts.queries_before_rotation`;
        needs the model fact ``queries_before_rotation`` declared (``Capabilities(model_facts=...)``).
        """
        if "queries_before_rotation" not in self._memo:
            positions = self.model_positions()[:, self.query_start :]
            self._memo["queries_before_rotation"] = self.facts.queries_before_rotation(
                self.queries, positions
            )
        return self._memo["queries_before_rotation"]

    def keys_before_rotation(self) -> torch.Tensor:
        """The prompt's keys before the rotary embedding, ``[B, Hkv, T, D]`` fp32, memoised.

        Each key is rotated back at the position the model gave it (:meth:`model_positions`) by
        :meth:`~kvlab.models.facts.LayerFacts.keys_before_rotation`; needs the model fact
        ``keys_before_rotation`` declared (``Capabilities(model_facts=...)``).
        """
        if "keys_before_rotation" not in self._memo:
            self._memo["keys_before_rotation"] = self.facts.keys_before_rotation(
                self.keys, self.model_positions()
            )
        return self._memo["keys_before_rotation"]

    def window_attention(self, window: int) -> torch.Tensor:
        """Attention probabilities of the last ``window`` queries over all keys, ``[B, H, W, T]`` fp32.

        Causal inside the window, padding keys masked; rows of padding queries (samples shorter
        than the window) are zero. Softmax runs in fp32 on logits computed in fp32 (see the
        16-bit logits would reorder near-ties); the result is memoised per window size. Its
        size is ``W x T x H`` per sample: a scorer that needs only sums over the window should
        use :meth:`window_attention_scores`, which never holds it.
        """
        key = ("window_attention", window)
        if key not in self._memo:
            queries = self.last_queries(window, "window_attention")
            self._memo[key] = attention_probs(queries, self, first_query=self.seq_len - window)
        return self._memo[key]

    def window_attention_scores(self, window: int) -> torch.Tensor:
        """Attention each key receives from the last ``window`` queries, per query head, ``[B, H, T]`` fp32.

        Equals ``window_attention(window).sum(-2)`` but goes through
        :func:`kvlab.kernels.window_scores.window_attention_scores`, which never materialises the
        ``[B, H, W, T]`` probabilities (the Triton kernel on CUDA; blocks of heads and window rows
        in the torch reference); memoised per window size. When a window query sits inside an image
        block that continues after it (:attr:`image_blocks`), it sees later keys too, which the
        kernel's causal mask does not: the sums then come from :func:`attention_probs` with the
        block mask, a bounded block of window rows at a time.
        """
        key = ("window_attention_scores", window)
        if key not in self._memo:
            queries = self.last_queries(window, "window_attention_scores")
            if self._blocks_look_ahead(self.seq_len - window):
                self._memo[key] = self._summed_attention(queries, self.seq_len - window)
            else:
                self._memo[key] = window_attention_scores(
                    queries, self.keys, self.valid, self.scaling, self.block_elements
                )
        return self._memo[key]

    def _blocks_look_ahead(self, first_query: int) -> bool:
        """Whether a query at position ``>= first_query`` sees a later key of its image block."""
        if self.image_blocks is None:
            return False
        blocks = self.image_blocks[:, first_query:]
        return bool(((blocks[:, :-1] >= 0) & (blocks[:, :-1] == blocks[:, 1:])).any())

    def _summed_attention(
        self, queries: torch.Tensor, first_query: int, chunk: int | None = None
    ) -> torch.Tensor:
        """``sum_i`` of :func:`attention_probs` rows of ``queries [B, H, q, D]`` (positions
        ``first_query + i``), ``[B, H, T]`` fp32, ``chunk`` rows at a time (default: 256, fewer when
        ``B x H x chunk x T`` would pass :attr:`block_elements`)."""
        T = self.seq_len
        if chunk is None:
            block = self.block_elements
            chunk = max(1, min(256, block // (self.batch_size * self.num_heads * T)))
        total = torch.zeros(self.batch_size, self.num_heads, T, dtype=torch.float32, device=self.keys.device)
        for start in range(0, queries.shape[2], chunk):
            probs = attention_probs(
                queries[:, :, start : start + chunk], self, first_query=first_query + start
            )
            total += probs.sum(-2)
        return total

    def question_attention(self, normalize: bool = False) -> torch.Tensor:
        """Attention the question's queries pay to each entry, summed over the question, ``[B, H, T]`` fp32.

        Question row ``i`` attends to every valid entry and, causally, to the question's own valid
        keys ``j <= i``; the softmax runs over both (fp32 logits), and only the entries' columns are
        returned (Finch, Sec. 3: the question is appended to the chunk, its own K/V dropped after).
        ``normalize``: each row's probabilities are multiplied by the number of keys it sees
        (the valid entries and the question's own keys up to it), so a row's uniform attention
        weighs 1 per key whatever its length
        (the normalisation of the authors' implementation, kvpress' ``FinchPress``). Padding rows
        give 0. Memoised per ``normalize``.

        Raises:
            ConfigError: no question is held (the prefill is not progressive with ``question: true``).
        """
        key = ("question_attention", normalize)
        if key in self._memo:
            return self._memo[key]
        view = self.question
        if view is None:
            raise ConfigError(
                "question_attention needs the question's queries, which only a progressive prefill with "
                "`model.compression.prefill: {name: progressive, question: true}` provides (under "
                "model.protocol: query_aware)."
            )
        probs = appended_attention(
            view.queries, 0, self.keys_fp32(), self.valid, view.keys, view.valid, self.scaling
        )  # [B, H, Q, T]
        if normalize:
            seen_keys = self.lengths[:, None] + view.valid.long().cumsum(-1)  # [B, Q]
            probs = probs * seen_keys[:, None, :, None]
        self._memo[key] = probs.sum(2)
        return self._memo[key]

    def cumulative_attention(self, chunk: int | None = None) -> torch.Tensor:
        """Column sums of the full causal prompt attention (H2O's accumulated attention), ``[B, H, T]`` fp32.

        Sums over every valid query, ``chunk`` queries at a time (default: 256, fewer when
        ``B x H x chunk x T`` would pass :attr:`block_elements`),
        so neither the ``T x T`` matrix nor an unbounded block of it is materialised. With
        :attr:`image_blocks` the rows are the model's (``causal | same image block``): an image
        token's column also receives the attention of the earlier tokens of its image.

        Raises:
            ConfigError: the context does not hold every prompt query (a chunked prefill);
                components using this declare ``chunked_prefill = False`` and are refused at
                config time.
        """
        key = ("cumulative_attention",)
        if key not in self._memo:
            queries = self.last_queries(
                self.seq_len, "cumulative_attention (accumulated attention over every query)"
            )
            self._memo[key] = self._summed_attention(queries, 0, chunk)
        return self._memo[key]


def appended_attention(
    queries: torch.Tensor,
    first_row: int,
    keys: torch.Tensor,
    valid: torch.Tensor,
    own_keys: torch.Tensor,
    own_valid: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Softmax attention of rows of a block appended after the entries, over the entries only.

    ``queries [B, H, r, D]`` are the block's rows ``first_row .. first_row + r - 1``; the block's
    keys are ``own_keys [B, Hkv, Q, D]`` (``own_valid [B, Q]``), the entries' ``keys [B, Hkv, S, D]``
    (``valid [B, S]``). Row ``i`` attends to every valid entry and, causally, to the block's valid
    keys ``j <= i``; the softmax (fp32 logits) runs over both and only the entries' columns are
    returned, ``[B, H, r, S]`` fp32, padding rows zero. Finch's question appended to a chunk
    (:meth:`LayerContext.question_attention`) and KVzip's reconstruction block
    (:class:`kvlab.compression.reconstruction.ReconstructionStep`) are such blocks.
    """
    B, H, r, D = queries.shape
    Hkv, S, Q = keys.shape[1], keys.shape[2], own_keys.shape[2]
    grouped = queries.float().reshape(B, Hkv, (H // Hkv) * r, D)
    entry_logits = (grouped @ keys.float().transpose(-1, -2) * scaling).view(B, H, r, S)
    own_logits = (grouped @ own_keys.float().transpose(-1, -2) * scaling).view(B, H, r, Q)
    entry_logits = entry_logits.masked_fill(~valid[:, None, None, :], float("-inf"))
    rows = torch.arange(first_row, first_row + r, device=keys.device)
    seen = (torch.arange(Q, device=keys.device)[None, :] <= rows[:, None])[None] & own_valid[:, None, :]
    own_logits = own_logits.masked_fill(~seen[:, None], float("-inf"))  # [B, H, r, Q]
    probs = torch.softmax(torch.cat([entry_logits, own_logits], dim=-1), dim=-1)[..., :S]
    return torch.nan_to_num(probs) * own_valid[:, None, first_row : first_row + r, None]


def attention_probs(queries: torch.Tensor, ctx: LayerContext, first_query: int) -> torch.Tensor:
    """Softmax attention of ``queries`` ``[B, H, q, D]`` (prompt positions ``first_query + i``) over all keys.

    Returns ``[B, H, q, T]`` fp32 with the causal mask (OR-ed with "same image block" when
    ``ctx.image_blocks`` is set, as the model's prefill attention), padding keys masked, and zero
    rows for padding queries.
    """
    B, H, q, D = queries.shape
    keys = ctx.keys_fp32()  # [B, Hkv, T, D]
    T = keys.shape[2]
    # query head h reads KV head h // G: group the queries instead of repeating the keys
    grouped = queries.float().reshape(B, ctx.num_kv_heads, ctx.group_size * q, D)
    logits = (torch.matmul(grouped, keys.transpose(-1, -2)) * ctx.scaling).view(B, H, q, T)
    query_pos = torch.arange(first_query, first_query + q, device=keys.device)
    seen = causal
    if ctx.image_blocks is not None:  # a query inside an image block sees all of its block
        seen = or_masks(causal, same_image_block(ctx.image_blocks))
    samples = torch.arange(B, device=keys.device)
    allowed = build_mask(
        and_masks(seen, key_padding(ctx.valid)), query_pos, torch.arange(T, device=keys.device), samples
    )
    logits = logits.masked_fill(~allowed[:, None], float("-inf"))  # [B, 1, q, T]
    query_valid = ctx.valid[:, first_query : first_query + q]  # [B, q]
    logits = logits.masked_fill(~query_valid[:, None, :, None], 0.0)
    probs = torch.softmax(logits, dim=-1)
    return probs * query_valid[:, None, :, None]


def sample_positions(valid: torch.Tensor) -> torch.Tensor:
    """Position of each token within its own sample, ``[B, T]`` long, from ``valid`` ``[B, T]``.

    0 at a sample's first valid token; padding gets -1. With left padding this is
    ``t - (T - length)``, so a padded sample sees the positions it has alone.
    """
    pos = valid.long().cumsum(-1) - 1
    return pos.masked_fill(~valid, -1)
