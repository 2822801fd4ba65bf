"""The ``kvlab`` attention function registered in transformers' ``AttentionInterface``.

No model forward is patched: kvlab registers one attention function and selects it with
``model.set_attn_implementation`` (language model only; a vision tower keeps sdpa). Per-run
state (the cache, the pipeline, the padding mask) is not passed through ``forward`` kwargs but
through a :class:`CompressionSession` held in a context variable while kvlab runs the model.

- Prefill (the layer is not compressed yet): exact causal attention over the full prompt with
  kvlab's own padding mask (transformers builds no mask for a custom attention name), then
  the layer's pipeline chooses what to keep and the cache is compacted at once ("layerwise").
- Decode: attention over the layer's ragged kept tokens plus the decoded tokens. When the
  decode policy asked for them (``session.decode_attention`` is a dict), the step's attention
  probabilities over the layer's entries are stored there for the policy.
- Without an active session (or for modules without ``layer_idx``) it is plain sdpa.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvlab.compression.context import LayerContext
from kvlab.compression.pipeline import LayerReport, Pipeline
from kvlab.engine.cache import CompressedCache

ATTENTION_NAME = "kvlab"
_SESSION: contextvars.ContextVar[CompressionSession | None] = contextvars.ContextVar(
    "kvlab_session", default=None
)


@dataclass
class CompressionSession:
    """State of one batch's prefill + decode.

    Attributes:
        cache: the batch's :class:`CompressedCache`.
        pipeline: the compression method.
        valid: ``[B, T]`` bool prompt padding mask (False on padding).
        modality: ``[B, T]`` modality ids of the prompt.
        record_scores: keep each layer's mixed scores in its report (for TensorBoard).
        reports: one :class:`LayerReport` per compressed layer, in layer order.
        state: cross-layer scratch space for components and the decode policy (reset per session).
        decode_attention: None unless the decode policy asks for the decode attention (in its
            ``start``, by setting a dict): then every decode step stores layer ``l``'s
            :meth:`~kvlab.engine.cache.CompressedLayer.attention_probs`, ``[B, Hkv, G, q, S]``
            fp32 over the layer's ``S`` slots, at key ``l`` (the policy takes them in ``after_step``).
    """

    cache: CompressedCache
    pipeline: Pipeline
    valid: torch.Tensor
    modality: torch.Tensor
    record_scores: bool = False
    reports: list[LayerReport] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)
    decode_attention: dict[int, torch.Tensor] | None = None
    _placed: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    def masks_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(valid, modality)``, both ``[B, T]``, on ``device`` (a layer's device under a
        ``device_map``); copied once per device and batch, the tensors themselves on their own."""
        if device == self.valid.device:
            return self.valid, self.modality
        if device not in self._placed:
            self._placed[device] = (self.valid.to(device), self.modality.to(device))
        return self._placed[device]

    @property
    def compression_seconds(self) -> float:
        """Seconds spent compressing, summed over the layer reports."""
        return sum(report.seconds for report in self.reports)


@contextlib.contextmanager
def compression_session(session: CompressionSession) -> Iterator[CompressionSession]:
    """Make ``session`` the active one for kvlab attention calls inside the block."""
    token = _SESSION.set(session)
    try:
        yield session
    finally:
        _SESSION.reset(token)


def register_attention() -> None:
    """Register the ``kvlab`` attention function with transformers (idempotent, no other side effect)."""
    AttentionInterface.register(ATTENTION_NAME, kvlab_attention)


def enable_kvlab_attention(model: torch.nn.Module, vision_language: bool) -> None:
    """Route the language model's attention through kvlab; a vision tower keeps sdpa."""
    register_attention()
    if vision_language:
        model.set_attn_implementation({"text_config": ATTENTION_NAME, "vision_config": "sdpa"})
    else:
        model.set_attn_implementation(ATTENTION_NAME)


def prefill_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Causal attention over the whole prompt, ``[B, H, T, D]`` -> ``[B, H, T, D]``.

    Keys at padding positions are masked; a padding query attends to itself only (its output
    is never used) so no row is empty. Without padding it is sdpa's own causal path.
    """
    if bool(valid.all()):
        return F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=True
        )
    T = query.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool, device=query.device).tril()
    mask = causal[None] & valid[:, None, :]
    mask = mask | (torch.eye(T, dtype=torch.bool, device=query.device)[None] & ~valid[:, :, None])
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask[:, None], scale=scaling, enable_gqa=True
    )


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
    """
    session = _SESSION.get()
    layer_idx = getattr(module, "layer_idx", None)
    if session is None or layer_idx is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer = session.cache.layers[layer_idx]
    if layer.compressed:
        out = layer.decode_attention(query, scaling)
        if session.decode_attention is not None:
            session.decode_attention[layer_idx] = layer.attention_probs(query, scaling)
        return out.transpose(1, 2).contiguous(), None
    if query.shape[2] != session.valid.shape[1] or key.shape[2] != query.shape[2]:
        raise RuntimeError(
            "kvlab compresses at prefill: the first forward must contain the whole prompt "
            f"(got {query.shape[2]} queries, {key.shape[2]} keys, prompt of {session.valid.shape[1]})"
        )
    out = prefill_attention(query, key, value, session.masks_on(query.device)[0], scaling)
    _compress_layer(session, layer_idx, query, key, value, scaling)
    return out.transpose(1, 2).contiguous(), None


def _compress_layer(
    session: CompressionSession,
    layer_idx: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
) -> None:
    start = time.perf_counter()
    valid, modality = session.masks_on(key.device)  # the layer's device (device_map)
    ctx = LayerContext(
        layer_idx=layer_idx,
        num_layers=len(session.cache.layers),
        queries=query,
        keys=key,
        values=value,
        valid=valid,
        modality=modality,
        scaling=scaling,
        state=session.state,
    )
    with torch.no_grad():
        selection, report = session.pipeline.compress(ctx, record_scores=session.record_scores)
        session.cache.layers[layer_idx].compress(selection)
    report.seconds = time.perf_counter() - start
    if key.device != session.valid.device:  # reports live on the batch's device, whatever the layer's
        report = _report_to(report, session.valid.device)
    session.reports.append(report)


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
