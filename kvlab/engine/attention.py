"""The ``kvlab`` attention function: what transformers calls for every attention layer.

:func:`kvlab_attention` dispatches; the rest lives in its own modules. Per-run state (the cache,
the pipeline, the padding mask) does not come through ``forward`` kwargs but from the active
:class:`~kvlab.engine.session.CompressionSession` (:mod:`kvlab.engine.session`); the function is
registered in transformers' ``AttentionInterface`` by :mod:`kvlab.engine.registration`.

- Prefill (the layer is not compressed yet): exact causal attention over the full prompt with
  kvlab's own padding mask (:func:`~kvlab.engine.prefill_attention.prefill_attention`, no
  ``T x T`` tensor; Gemma 3's image blocks see their whole block), then the layer is handed to the
  schedule (:mod:`kvlab.engine.schedule`): compressed at once (``layerwise``) or observed until the
  last layer (``global``). With ``model.prefill_chunk`` the prompt comes in several forwards: a
  chunk before the last only attends (its queries over the dense K/V so far) and the layer is
  compressed in the last one, with the recent window's queries held over from the earlier chunks
  (:mod:`kvlab.engine.prefill_plan`). A progressive prefill (``model.compression.prefill:
  progressive``) compresses every layer after every chunk instead (:mod:`kvlab.engine.progressive`).
  A reconstruct prefill (``reconstruct``, KVzip) keeps every layer waiting after the prompt's
  forward, then runs the model's reconstruction forwards, scored layer by layer, before
  compressing them all (:mod:`kvlab.engine.reconstruction`).
- Decode: attention over the layer's ragged kept tokens plus the decoded tokens
  (:meth:`~kvlab.cache.layer.CompressedLayer.decode_attention`). While the decode policy (or the
  decode-time protocol) asks for them, the step's attention probabilities over the layer's
  entries are recorded in the run state (:meth:`~kvlab.cache.state.RunState.record_decode_attention`).
- Without an active session (or for modules without ``layer_idx``) it is plain sdpa.

Per-layer attention arguments transformers passes (:data:`~kvlab.engine.keywords.HANDLED_KWARGS`):
``scaling``, ``sliding_window`` (a query at position ``i`` sees keys in ``(i - window, i]``; at
decode the window is measured on the original positions of the kept entries, so it stays right
after compression), ``softcap`` (``tanh(logits / cap) * cap`` before the mask) and ``s_aux`` (one
extra per-head logit in the softmax denominator, GPT-OSS "sinks"). Keywords in
:data:`~kvlab.engine.keywords.IGNORED_KWARGS` carry nothing attention must act on; any other
keyword raises a :class:`~kvlab.config.errors.ConfigError`, and
:func:`~kvlab.engine.registration.enable_kvlab_attention` refuses model configs asking for
attention kvlab does not implement.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvlab.config.errors import ConfigError
from kvlab.engine.keywords import attention_options
from kvlab.engine.prefill_attention import prefill_attention
from kvlab.engine.progressive import progressive_attention
from kvlab.engine.reconstruction import hold_layer, reconstruction_attention
from kvlab.engine.schedule import compress_context, layer_context, observe_layer
from kvlab.engine.session import active_session


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
        ConfigError: an attention keyword kvlab does not implement
            (:func:`~kvlab.engine.keywords.attention_options`).
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
    reconstruction = session.reconstruction
    if reconstruction is not None and reconstruction.active:  # the model repeats the prompt (KVzip)
        out = reconstruction_attention(session, layer_idx, query, key, value, scaling, options)
        return out.transpose(1, 2).contiguous(), None
    if session.progressive is not None:  # compressed after every chunk (model.compression.prefill)
        out = progressive_attention(session, layer_idx, query, key, value, scaling, options)
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
        query,
        key,
        value,
        valid,
        scaling,
        options,
        block_elements=session.block_elements,
        blocks=blocks[:, :k] if blocks is not None else None,
    )
    if k < T:  # a chunk before the last: the layer's dense K/V grow in the cache, nothing is compressed
        session.hold_queries(layer_idx, query)
        return out.transpose(1, 2).contiguous(), None
    query = session.observed_queries(layer_idx, query)
    ctx = layer_context(session, layer_idx, query, key, value, scaling, options.sliding_window)
    if reconstruction is not None:  # scored by the reconstruction that follows the prompt's forward
        hold_layer(session, ctx)
    elif session.pipeline.schedule == "global":
        observe_layer(session, ctx)
    else:
        compress_context(session, ctx)
    return out.transpose(1, 2).contiguous(), None
