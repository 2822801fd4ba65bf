"""The ``kvlab`` attention function registered in transformers' ``AttentionInterface``.

No model forward is patched: kvlab registers one attention function and selects it with
``model.set_attn_implementation`` (language model only; a vision tower keeps sdpa). Per-run
state (the cache, the pipeline, the padding mask) is not passed through ``forward`` kwargs but
through the active :class:`~kvlab.engine.session.CompressionSession` (:mod:`kvlab.engine.session`).

- Prefill (the layer is not compressed yet): exact causal attention over the full prompt with
  kvlab's own padding mask (transformers builds no mask for a custom attention name), then
  the layer's pipeline chooses what to keep and the cache is compacted at once ("layerwise").
  No ``T x T`` tensor is built for any batch (:func:`prefill_attention`). For a model whose
  image tokens attend to each other in both directions (Gemma 3,
  ``RunState.bidirectional_image_blocks``) the rows of each image block see its whole block, as
  in transformers (:func:`~kvlab.cache.masks.image_block_ids`). With
  ``model.prefill_chunk`` the prompt comes in several forwards: a chunk before the last only
  attends (its queries over the dense K/V so far) and the layer is compressed in the last one,
  with the recent window's queries held over from the earlier chunks (:func:`check_prefill_chunk`).
  Under ``model.compression.schedule: global`` a layer is only observed after its prefill
  attention (:meth:`~kvlab.pipeline.execution.LayerExecution.observe`: scores, route decision,
  the allocator's view of the layer; its dense K/V stay in the cache) and every layer is
  compressed, in order, right after the last layer's attention (:func:`finish_global`): peak
  memory is the full cache plus each layer's scores.
- Decode: attention over the layer's ragged kept tokens plus the decoded tokens. While the
  decode policy (or the decode-time protocol) asks for them, the step's attention probabilities
  over the layer's entries are recorded in the run state
  (:meth:`~kvlab.cache.state.RunState.record_decode_attention`).
- Without an active session (or for modules without ``layer_idx``) it is plain sdpa.

Per-layer attention arguments transformers passes (:data:`HANDLED_KWARGS`): ``scaling``,
``sliding_window`` (a query at position ``i`` sees keys in ``(i - window, i]``; at decode the
window is measured on the original positions of the kept entries, so it stays right after
compression), ``softcap`` (``tanh(logits / cap) * cap`` before the mask) and ``s_aux`` (one
extra per-head logit in the softmax denominator, GPT-OSS "sinks"). Keywords in
:data:`IGNORED_KWARGS` carry nothing attention must act on; any other keyword raises a
:class:`~kvlab.config.errors.ConfigError`, and :func:`enable_kvlab_attention` refuses model
configs asking for attention kvlab does not implement.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvlab.compression.context import LayerContext
from kvlab.compression.diversity import DiversityScorer
from kvlab.compression.importance import ImportanceScorer
from kvlab.config.capabilities import Component
from kvlab.config.errors import ConfigError
from kvlab.engine.session import CompressionSession, active_session
from kvlab.pipeline import Pipeline

ATTENTION_NAME = "kvlab"


def register_attention() -> None:
    """Register the ``kvlab`` attention function with transformers (idempotent, no other side effect)."""
    AttentionInterface.register(ATTENTION_NAME, kvlab_attention)


# Keywords transformers 5.x passes to attention functions that kvlab implements.
HANDLED_KWARGS = frozenset({"scaling", "dropout", "is_causal", "sliding_window", "softcap", "s_aux"})

# Keywords that reach attention functions but carry nothing kvlab's attention must act on.
IGNORED_KWARGS = {
    # RoPE is applied before the attention function; kvlab masks with its own padding mask and
    # the cache's positions, never with these.
    "position_ids": "positions are already in the post-RoPE query/key",
    # kvlab's cache always stores (it is the reason kvlab exists); the flag changes nothing here.
    "use_cache": "kvlab always caches",
    # kvlab returns no attention weights (like transformers' sdpa); decode policies get theirs
    # through the session.
    "output_attentions": "no weights are returned, as with sdpa",
    # The cache index of the new tokens; kvlab's cache keeps its own logical length.
    "cache_position": "the cache keeps its own logical length",
    # Mixture-of-experts models (GPT-OSS, Mixtral) pass their router flag down every layer's kwargs.
    "output_router_logits": "a mixture-of-experts output flag, nothing for attention",
}
KNOWN_KWARGS = HANDLED_KWARGS | frozenset(IGNORED_KWARGS)  # checked at every call: precomputed

# Attention layer types (``config.layer_types``) kvlab implements.
SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def _model_name(model: torch.nn.Module) -> str:
    """A readable name for error messages: the config's ``name_or_path`` or the class name."""
    return getattr(getattr(model, "config", None), "name_or_path", "") or type(model).__name__


def check_attention_support(model: torch.nn.Module) -> None:
    """Refuse a model whose language model asks for attention kvlab does not implement.

    Checked on the language model's config: ``layer_types`` other than full/sliding attention
    (e.g. chunked or linear attention), ``attention_chunk_size`` (chunked local attention) and
    ``use_bidirectional_attention``. Sliding windows, logit soft-capping and attention sinks are
    implemented (see the module docstring).

    Raises:
        ConfigError: naming the model and the config argument.
    """
    from kvlab.models.common import text_config

    config = text_config(model.config)
    name = _model_name(model)
    layer_types = getattr(config, "layer_types", None) or []
    unsupported = sorted(set(layer_types) - SUPPORTED_LAYER_TYPES)
    if unsupported:
        raise ConfigError(
            f"model {name!r}: layer_types {unsupported} are not supported by kvlab attention (only "
            f"{sorted(SUPPORTED_LAYER_TYPES)}); this model cannot run under kvlab."
        )
    for argument in ("attention_chunk_size", "use_bidirectional_attention"):
        if getattr(config, argument, None):
            raise ConfigError(
                f"model {name!r}: config argument {argument}={getattr(config, argument)!r} is not supported "
                "by kvlab attention; this model cannot run under kvlab."
            )


def enable_kvlab_attention(model: torch.nn.Module, vision_language: bool) -> None:
    """Route the language model's attention through kvlab; a vision tower keeps sdpa.

    Raises:
        ConfigError: the language model needs an attention feature kvlab does not implement
            (:func:`check_attention_support`); nothing is changed then.
    """
    check_attention_support(model)
    register_attention()
    if vision_language:
        model.set_attn_implementation({"text_config": ATTENTION_NAME, "vision_config": "sdpa"})
    else:
        model.set_attn_implementation(ATTENTION_NAME)


@dataclass(frozen=True)
class AttentionOptions:
    """A layer's per-call attention variant (all None: plain causal softmax attention).

    Attributes:
        sliding_window: a query at position ``i`` sees keys at positions ``(i - window, i]``.
        softcap: logits become ``tanh(logits / softcap) * softcap`` before masking.
        sinks: ``[H]`` one extra logit per query head in the softmax denominator (no value).
    """

    sliding_window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        """True when no variant applies (the exact pre-existing code paths are used)."""
        return self.sliding_window is None and self.softcap is None and self.sinks is None

    def describe(self) -> str:
        """The variants in use, e.g. ``sliding_window=512, softcap=50.0``."""
        parts = [f"sliding_window={self.sliding_window}"] if self.sliding_window is not None else []
        parts += [f"softcap={self.softcap}"] if self.softcap is not None else []
        return ", ".join(parts + (["sinks (s_aux)"] if self.sinks is not None else []))


def attention_options(module: torch.nn.Module, kwargs: dict[str, Any]) -> AttentionOptions:
    """Validate the keywords transformers passed and collect the layer's :class:`AttentionOptions`.

    Raises:
        ConfigError: a keyword kvlab neither implements nor may ignore, a non-zero ``dropout``
            or ``is_causal=False`` (naming the model and the argument).
    """
    unknown = sorted(key for key in kwargs if key not in KNOWN_KWARGS)
    name = getattr(getattr(module, "config", None), "name_or_path", "")
    owner = f"model {name!r} ({type(module).__name__})" if name else type(module).__name__
    if unknown:
        raise ConfigError(
            f"{owner}: attention argument(s) {unknown} are not implemented by kvlab attention (it "
            f"implements {sorted(HANDLED_KWARGS)} and ignores {sorted(IGNORED_KWARGS)}); this model cannot "
            "run under kvlab."
        )
    if kwargs.get("dropout"):
        raise ConfigError(
            f"{owner}: attention argument dropout={kwargs['dropout']} (training) is not supported."
        )
    if kwargs.get("is_causal") is False:
        raise ConfigError(f"{owner}: attention argument is_causal=False (bidirectional) is not supported.")
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    return AttentionOptions(
        sliding_window=int(window) if window is not None else None,
        softcap=float(softcap) if softcap is not None else None,
        sinks=kwargs.get("s_aux"),
    )


#: Elements ``B x H x rows x keys`` of one block of the query-blocked prefill attention (the
#: padded, windowed, soft-capped and sink paths): 2**24 fp32 logits are 64 MiB, whatever the
#: prompt length, so the prefill's attention working set never grows with ``T x T``.
PREFILL_BLOCK_ELEMENTS = 1 << 24


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    options: AttentionOptions | None = None,
    block_elements: int | None = None,
    blocks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the last ``q`` prompt positions over the first ``k``; no ``T x T`` tensor.

    Shapes: query ``[B, H, q, D]`` (positions ``k - q .. k - 1``; ``q == k`` for a whole prompt,
    ``q < k`` for a chunk of a chunked prefill), key ``[B, Hkv, k, D]``, value ``[B, Hkv, k, Dv]``,
    valid ``[B, k]`` (False on padding). Returns ``[B, H, q, Dv]``.

    Keys at padding positions are masked; a padding query also sees itself (and the valid keys
    before it, which left padding never has: then its output is its own value, or a share of it
    with sinks), so no row is empty; that output is never used. ``options`` (sliding window,
    soft-capping, sinks) follow transformers' eager attention; the window counts positions in the
    padded row, which equal each sample's own position differences. Three paths, none of which
    materialises a ``[B, T, T]`` mask or ``[B, H, T, T]`` logits:

    - whole prompt, no padding, no variant: sdpa's own causal path (flash attention);
    - whole left-padded prompt, no variant: sdpa's causal path per sample on its valid suffix;
    - anything else (variants, chunks, other padding): blocks of query rows against the keys
      they can see, ``B x H x rows x keys <= block_elements`` (default
      :data:`PREFILL_BLOCK_ELEMENTS`; :func:`_blocked_attention`).

    ``blocks [B, k]`` (None: causal): image blocks (:func:`image_block_ids`, Gemma 3). A query
    inside a block also sees every key of its block, later ones included, as transformers'
    ``blockwise_overlay``: ``causal | same block`` on full-attention layers, ``(causal | same
    block) & window`` on sliding ones, padding keys masked. The causal rows come from the paths
    above; the rows of each image block are then recomputed (:func:`_image_block_rows`).
    """
    options = options or AttentionOptions()
    block_elements = block_elements or PREFILL_BLOCK_ELEMENTS
    if blocks is not None:
        out = prefill_attention(query, key, value, valid, scaling, options, block_elements)  # causal rows
        _image_block_rows(out, query, key, value, valid, scaling, options, block_elements, blocks)
        return out
    q, k = query.shape[2], key.shape[2]
    if options.plain and q == k:
        if bool(valid.all()):
            return F.scaled_dot_product_attention(
                query, key, value, is_causal=True, scale=scaling, enable_gqa=True
            )
        if _left_padded(valid):
            return _per_sample_attention(query, key, value, valid, scaling)
    return _blocked_attention(query, key, value, valid, scaling, options, block_elements)


def _image_spans(blocks: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(sample, first, end)`` of each image block of ``blocks [B, k]`` (:func:`image_block_ids`)
    with more than one token, positions ``[first, end)``: the rows the blocks change."""
    previous = F.pad(blocks, (1, 0), value=-1)[:, :-1]
    following = F.pad(blocks, (0, 1), value=-1)[:, 1:]
    starts = ((blocks >= 0) & (previous != blocks)).nonzero().tolist()  # row-major: block order
    lasts = ((blocks >= 0) & (following != blocks)).nonzero().tolist()
    return [(b, a, e + 1) for (b, a), (_, e) in zip(starts, lasts, strict=True) if e > a]


def _image_block_rows(
    out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    options: AttentionOptions,
    elements: int,
    blocks: torch.Tensor,
) -> None:
    """Overwrite the rows of ``out [B, H, q, Dv]`` whose queries lie in an image block with their
    attention under the block mask (shapes as :func:`prefill_attention`).

    A query at position ``p`` of the block ``[a, e)`` sees ``causal | same block``: every key
    before ``e`` on a full-attention layer, the keys in ``(p - window, e)`` on a sliding one,
    padding keys masked. Per block, chunks of its rows against those keys, ``H x rows x keys <=
    elements``: at most one block of rows beyond the causal pass, never a ``T x T`` tensor.
    """
    H, q, k = query.shape[1], query.shape[2], key.shape[2]
    offset = k - q  # position of the first query
    window = options.sliding_window
    positions = torch.arange(k, device=query.device)
    for b, a, e in _image_spans(blocks):
        first = max(a, offset)
        lo = max(0, first - window + 1) if window is not None else 0
        step = max(1, elements // (H * (e - lo)))
        for r0 in range(first, e, step):
            r1 = min(e, r0 + step)  # query positions [r0, r1), keys [lo, e)
            lo = max(0, r0 - window + 1) if window is not None else 0
            mask = None  # [rows, keys], None: every key [lo, e) is seen
            if window is not None:
                mask = valid[b, None, lo:e] & (positions[None, lo:e] > positions[r0:r1, None] - window)
            elif not bool(valid[b, lo:e].all()):
                mask = valid[b, None, lo:e].expand(r1 - r0, e - lo)
            rows = slice(r0 - offset, r1 - offset)
            out[b, :, rows] = _masked_rows(
                query[b : b + 1, :, rows], key[b : b + 1, :, lo:e], value[b : b + 1, :, lo:e], mask, scaling,
                options,
            )[0]  # fmt: skip


def _masked_rows(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    options: AttentionOptions,
) -> torch.Tensor:
    """Attention of ``query [1, H, r, D]`` over ``key / value [1, Hkv, n, D]`` with ``mask [r, n]``
    (True: seen; every row sees a key; None: every key), ``[1, H, r, Dv]``: sdpa, or with
    soft-capping or sinks transformers' eager attention, as in :func:`_blocked_attention`."""
    if options.softcap is None and options.sinks is None:
        attn_mask = None if mask is None else mask[None, None]
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, scale=scaling, enable_gqa=True
        )
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    logits = torch.matmul(query, key.transpose(-1, -2)) * scaling  # [1, H, r, n]
    if options.softcap is not None:
        logits = torch.tanh(logits / options.softcap) * options.softcap
    if mask is not None:
        logits = logits.masked_fill(~mask[None, None], float("-inf"))
    if options.sinks is not None:
        sinks = options.sinks.to(logits.dtype).reshape(1, -1, 1, 1).expand(*logits.shape[:3], 1)
        logits = torch.cat([logits, sinks], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., : key.shape[2]]
    return torch.matmul(probs.to(value.dtype), value)


def _left_padded(valid: torch.Tensor) -> bool:
    """True when each row of ``valid [B, k]`` is padding then tokens (its valid tokens are a suffix)."""
    return bool((valid[:, 1:] >= valid[:, :-1]).all())


def _own_values(value: torch.Tensor, groups: int) -> torch.Tensor:
    """``value [Hkv, n, Dv]`` repeated to the query heads, ``[H, n, Dv]``: what a query attending
    only to itself returns (padding queries)."""
    return value.repeat_interleave(groups, dim=0)


def _per_sample_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Causal attention of a left-padded batch, one sdpa call per sample on its valid suffix.

    Shapes as :func:`prefill_attention` with ``q == k == T``. A padding query gets its own value.
    """
    B, H, T, _ = query.shape
    groups = H // key.shape[1]
    out = query.new_empty(B, H, T, value.shape[-1])
    for b, length in enumerate(valid.sum(-1).tolist()):
        pad = T - length
        out[b, :, :pad] = _own_values(value[b, :, :pad], groups)
        if length:
            out[b : b + 1, :, pad:] = F.scaled_dot_product_attention(
                query[b : b + 1, :, pad:],
                key[b : b + 1, :, pad:],
                value[b : b + 1, :, pad:],
                is_causal=True,
                scale=scaling,
                enable_gqa=True,
            )
    return out


def _block_rows(B: int, H: int, q: int, k: int, window: int | None, elements: int) -> int:
    """Query rows per block so that ``B x H x rows x keys seen <= elements`` (at least one row).

    A block of ``r`` rows sees at most ``k`` keys, or ``r + window - 1`` under a sliding window.
    """
    rows = elements // (B * H * k)
    if window is not None and window < k:
        rows = max(rows, min(window, elements // (B * H * 2 * window)))
    return max(1, min(q, rows))


def _blocked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    options: AttentionOptions,
    elements: int,
) -> torch.Tensor:
    """Blocks of query rows, each against the keys it can see, with an ``O(rows x keys)`` mask.

    Shapes as :func:`prefill_attention`. Without soft-capping or sinks a block is one masked
    sdpa call; with them it is transformers' eager attention on the block (logits in the input
    dtype, soft-capped, masked, the sinks appended to the softmax denominator). Each query row
    is computed exactly as in one dense pass: blocking only bounds the working set.
    """
    B, H, q, _ = query.shape
    k = key.shape[2]
    groups = H // key.shape[1]
    offset = k - q  # position of the first query
    window = options.sliding_window
    eager = options.softcap is not None or options.sinks is not None
    if eager:  # eager attention repeats K/V to the query heads, as transformers' eager path
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    out = query.new_empty(B, H, q, value.shape[-1])
    step = _block_rows(B, H, q, k, window, elements)
    positions = torch.arange(k, device=query.device)
    for r0 in range(0, q, step):
        r1 = min(q, r0 + step)
        first, last = offset + r0, offset + r1  # query positions [first, last)
        lo = max(0, first - window + 1) if window is not None else 0
        query_pos = positions[first:last, None]  # [rows, 1]
        key_pos = positions[None, lo:last]  # [1, keys]
        seen = key_pos <= query_pos
        if window is not None:
            seen = seen & (key_pos > query_pos - window)
        mask = seen[None] & valid[:, None, lo:last]  # [B, rows, keys]
        mask = mask | ((key_pos == query_pos)[None] & ~valid[:, first:last, None])
        block = query[:, :, r0:r1]
        if not eager:
            out[:, :, r0:r1] = F.scaled_dot_product_attention(
                block, key[:, :, lo:last], value[:, :, lo:last], attn_mask=mask[:, None], scale=scaling,
                enable_gqa=True,
            )  # fmt: skip
            continue
        logits = torch.matmul(block, key[:, :, lo:last].transpose(-1, -2)) * scaling  # [B, H, rows, keys]
        if options.softcap is not None:
            logits = torch.tanh(logits / options.softcap) * options.softcap
        logits = logits.masked_fill(~mask[:, None], float("-inf"))
        if options.sinks is not None:
            sinks = options.sinks.to(logits.dtype).reshape(1, -1, 1, 1).expand(*logits.shape[:3], 1)
            logits = torch.cat([logits, sinks], dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., : last - lo]
        out[:, :, r0:r1] = torch.matmul(probs.to(value.dtype), value[:, :, lo:last])
    return out


# --- chunked prefill (model.prefill_chunk) ------------------------------------------------------
CHUNK_FIELD = "model.prefill_chunk"


def check_prefill_chunk(pipeline: Pipeline, prefill_chunk: int | None) -> None:
    """Refuse ``model.prefill_chunk`` when a component cannot score a prompt prefilled in chunks.

    A chunked prefill keeps every key and value of the prompt until the layer is compressed,
    but only the queries of the recent window (:attr:`CompressionSession.held_queries`). A
    component says whether that suffices in its declared capabilities (``chunked_prefill``):
    importance and diversity scorers must declare it (their bases say False), any other component
    is refused only when it declares ``chunked_prefill=False``.
    The table of the built-in components is in ``docs/scaling.md``.

    Raises:
        ConfigError: a bad value, or a component that needs every prompt query's attention
            (H2O's accumulated attention, LOOK-M's), naming its field and ``model.prefill_chunk``.
    """
    if prefill_chunk is None:
        return
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
        raise ConfigError(
            f"{CHUNK_FIELD} must be null (the prompt in one forward) or a number of tokens >= 1 per "
            f"prefill chunk, got {prefill_chunk!r}."
        )
    if pipeline.schedule == "global":
        raise ConfigError(
            f"model.compression.schedule = global cannot run with {CHUNK_FIELD} = {prefill_chunk}: a chunked "
            "prefill exists to bound the prefill's memory, while the global schedule keeps every layer's "
            "full K/V until the last layer's prefill ends. Set "
            f"{CHUNK_FIELD} to null (the prompt in one forward), or model.compression.schedule: layerwise "
            "(with a layer allocator that needs only its own layer, e.g. PrefixKV's prefix_calibrated)."
        )
    unchunked = pipeline.capabilities.unchunked
    if not unchunked:
        return
    part = unchunked[0]
    # a scorer whose class (below the scorer base) never declares its capabilities may read any query
    bases = (ImportanceScorer, DiversityScorer, Component, object)
    declared = any("capabilities" in vars(cls) for cls in type(part.component).__mro__ if cls not in bases)
    reason = (
        "needs the attention of every prompt query, which a chunked prefill does not keep"
        if declared
        else "does not declare `chunked_prefill` (set `capabilities = Capabilities(chunked_prefill=True)` "
        "on its class if it reads only keys, values and the queries of the recent budget.window)"
    )
    raise ConfigError(
        f"{part.field} ({part.name}) {reason}, so it cannot run with {CHUNK_FIELD} = {prefill_chunk}. Set "
        f"{CHUNK_FIELD} to null (the prompt in one forward), or use a method whose scorers observe only "
        "the recent window (snapkv, pyramidkv, adakv, mixkv_*, knorm, keydiff, streamingllm); "
        "docs/scaling.md lists which components support chunked prefill."
    )


def chunked_vlm_message(model: str, prefill_chunk: int) -> str:
    """The refusal of ``model.prefill_chunk`` for a vision-language model (one paragraph)."""
    return (
        f"{CHUNK_FIELD} = {prefill_chunk}: model {model!r} is a vision-language model, whose forward merges "
        "the image features into the prompt and computes its positions (M-RoPE) over the whole prompt, "
        "which chunks of input ids cannot carry; it prefills in one forward. Set "
        f"{CHUNK_FIELD} to null for this model."
    )


def observed_window(pipeline: Pipeline, lengths: torch.Tensor) -> int:
    """The most recent queries any component of ``pipeline`` observes for prompts of ``lengths [B]``:
    the largest ``budget.window`` (per sample, branches included), at least 1."""
    budgets = [pipeline.budget, *(branch.budget for branch in pipeline.branches.values())]
    windows = [int(b.window_counts(lengths).max()) for b in budgets if b is not None and lengths.numel()]
    return max([1, *windows])


def global_query_window(pipeline: Pipeline, lengths: torch.Tensor) -> int | None:
    """``schedule: global``: how many of a layer's last queries to keep between its observation and
    its compression (:attr:`CompressionSession.global_queries`).

    The scorers and the route rule have run by then; what compression still reads is the recent
    window the pipeline observes (:func:`observed_window`), unless another component declares
    ``chunked_prefill=False`` (it reads every prompt query, e.g. the ``h2o`` decode policy's
    seed, ``PipelineCapabilities.reads_all_queries``): then all of them (None).
    """
    if pipeline.capabilities.reads_all_queries:
        return None
    return observed_window(pipeline, lengths)


def kvlab_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query ``[B, H, q, D]``, key/value ``[B, Hkv, k, D]``.

    Returns ``([B, q, H, D], None)`` as transformers expects.

    Raises:
        ConfigError: an attention keyword kvlab does not implement (:func:`attention_options`).
    """
    session = active_session()
    layer_idx = getattr(module, "layer_idx", None)
    if session is None or layer_idx is None:
        outside = attention_options(module, {**kwargs, "dropout": dropout})
        if not outside.plain:  # sdpa would drop the window / soft-capping / sinks without a word
            raise ConfigError(
                f"kvlab's attention was called outside a kvlab run on a layer with {outside.describe()}, "
                "which the plain fallback (sdpa) does not apply. Run the model through kvlab "
                "(kvlab.compress_and_generate, kvlab predict), or give it back its own attention first: "
                "model.set_attn_implementation('eager')."
            )
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    options = attention_options(module, {**kwargs, "dropout": dropout})
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer = session.cache.layers[layer_idx]
    if layer.compressed:
        out = layer.decode_attention(query, scaling, options)
        if session.run.records_decode_attention:  # a decode policy (or decode_time) reads it
            session.run.record_decode_attention(layer_idx, layer.attention_probs(query, scaling, options))
        return out.transpose(1, 2).contiguous(), None
    T, q, k = session.valid.shape[1], query.shape[2], key.shape[2]
    whole = q == k == T
    if not whole and (session.prefill_chunk is None or k > T or q > k):
        raise RuntimeError(
            "kvlab compresses at prefill: the first forward must contain the whole prompt, or chunks of "
            f"it when model.prefill_chunk is set (got {q} queries, {k} keys, prompt of {T}, "
            f"prefill_chunk {session.prefill_chunk})"
        )
    blocks = session.run.image_blocks_on(query.device)  # None unless the model has image blocks (Gemma 3)
    valid = session.run.masks_on(query.device)[0][:, :k]
    out = prefill_attention(
        query, key, value, valid, scaling, options, blocks=blocks[:, :k] if blocks is not None else None
    )
    if k < T:  # a chunk before the last: the layer's dense K/V grow in the cache, nothing is compressed
        session.hold_queries(layer_idx, query)
        return out.transpose(1, 2).contiguous(), None
    query = session.observed_queries(layer_idx, query)
    ctx = _layer_context(session, layer_idx, query, key, value, scaling, options.sliding_window)
    if session.pipeline.schedule == "global":
        _observe_layer(session, ctx)
    else:
        _compress_context(session, ctx)
    return out.transpose(1, 2).contiguous(), None


def _layer_context(
    session: CompressionSession,
    layer_idx: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    sliding_window: int | None,
) -> LayerContext:
    """The :class:`LayerContext` of layer ``layer_idx`` after its prefill attention (shapes there)."""
    valid, modality = session.run.masks_on(key.device)  # the layer's device (device_map)
    return LayerContext(
        layer_idx=layer_idx,
        num_layers=len(session.cache.layers),
        queries=query,
        query_start=key.shape[2] - query.shape[2],
        keys=key,
        values=value,
        valid=valid,
        modality=modality,
        scaling=scaling,
        run=session.run,
        sliding_window=sliding_window,
        image_blocks=session.run.image_blocks_on(key.device),
    )


def _compress_context(session: CompressionSession, ctx: LayerContext, seconds: float = 0.0) -> None:
    """Compress layer ``ctx.layer_idx`` (its dense K/V -> the kept entries) and append its report;
    ``seconds`` already spent on it (observing it, under ``schedule: global``) count in the report."""
    start = time.perf_counter()
    with torch.no_grad():
        selection, report = session.pipeline.compress(ctx, record_scores=session.record_scores)
        # a sliding layer keeps its kept entries' positions
        session.cache.layers[ctx.layer_idx].compress(selection, ctx.sliding_window)
    report.seconds = seconds + time.perf_counter() - start
    if ctx.keys.device != session.valid.device:  # reports live on the batch's device, whatever the layer's
        report = _report_to(report, session.valid.device)
    session.reports.append(report)


def _observe_layer(session: CompressionSession, ctx: LayerContext) -> None:
    """``schedule: global``: observe layer ``ctx.layer_idx`` (scores, route decision, allocator hook)
    and keep its context, dense K/V included, until the last layer has been observed; then compress all."""
    start = time.perf_counter()
    with torch.no_grad():
        session.pipeline.observe(ctx)
    ctx.release(session.global_queries)  # free what the context no longer needs while it waits
    session.pending[ctx.layer_idx] = (ctx, time.perf_counter() - start)
    if len(session.pending) == len(session.cache.layers):
        finish_global(session)


def finish_global(session: CompressionSession) -> None:
    """``schedule: global``, after the last layer's attention: compress every observed layer in order."""
    for layer_idx in sorted(session.pending):
        ctx, seconds = session.pending.pop(layer_idx)
        _compress_context(session, ctx, seconds)


def check_prefill_done(session: CompressionSession) -> None:
    """After the prefill forward: every layer is compressed (none left waiting by ``schedule: global``).

    Raises:
        RuntimeError: some layers were observed but the model never ran attention on the others.
    """
    if session.pending:
        raise RuntimeError(
            f"model.compression.schedule: global observed layers {sorted(session.pending)} but the prefill "
            f"ended before all {len(session.cache.layers)} layers ran their attention; the model's decoder "
            "layers must all run kvlab attention."
        )


def _report_to(value: Any, device: torch.device) -> Any:
    """``value`` (report, selection, route decision, tensor, dict or list), its tensors on ``device``."""
    if torch.is_tensor(value):
        return value.to(device)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: _report_to(getattr(value, f.name), device) for f in dataclasses.fields(value)}
        return dataclasses.replace(value, **changes)
    if isinstance(value, dict):
        return {k: _report_to(v, device) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_report_to(v, device) for v in value)
    return value
