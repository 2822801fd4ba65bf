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
from kvlab.config.errors import ConfigError
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
    unknown = sorted(set(kwargs) - HANDLED_KWARGS - set(IGNORED_KWARGS))
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


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    options: AttentionOptions | None = None,
) -> torch.Tensor:
    """Causal attention over the whole prompt: query ``[B, H, T, D]``, key/value ``[B, Hkv, T, D]``.

    Returns ``[B, H, T, D]``.

    Keys at padding positions are masked; a padding query attends to itself only (its output
    is never used) so no row is empty. Without padding or variants it is sdpa's own causal path.
    ``options`` (sliding window, soft-capping, sinks) follow transformers' eager attention; the
    window counts positions in the padded row, which equal each sample's own position differences.
    """
    options = options or AttentionOptions()
    if options.plain and bool(valid.all()):
        return F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=True
        )
    T = query.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool, device=query.device).tril()
    if options.sliding_window is not None:
        causal = causal & ~torch.ones_like(causal).tril(-options.sliding_window)
    mask = causal[None] & valid[:, None, :]
    mask = mask | (torch.eye(T, dtype=torch.bool, device=query.device)[None] & ~valid[:, :, None])
    if options.softcap is None and options.sinks is None:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask[:, None], scale=scaling, enable_gqa=True
        )
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    logits = torch.matmul(query, key.transpose(-1, -2)) * scaling  # [B, H, T, T]
    if options.softcap is not None:
        logits = torch.tanh(logits / options.softcap) * options.softcap
    logits = logits.masked_fill(~mask[:, None], float("-inf"))
    if options.sinks is not None:
        sinks = options.sinks.to(logits.dtype).reshape(1, -1, 1, 1).expand(*logits.shape[:3], 1)
        logits = torch.cat([logits, sinks], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :T]
    return torch.matmul(probs.to(value.dtype), value)


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
    session = _SESSION.get()
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
        if session.decode_attention is not None:
            session.decode_attention[layer_idx] = layer.attention_probs(query, scaling, options)
        return out.transpose(1, 2).contiguous(), None
    if query.shape[2] != session.valid.shape[1] or key.shape[2] != query.shape[2]:
        raise RuntimeError(
            "kvlab compresses at prefill: the first forward must contain the whole prompt "
            f"(got {query.shape[2]} queries, {key.shape[2]} keys, prompt of {session.valid.shape[1]})"
        )
    out = prefill_attention(query, key, value, session.masks_on(query.device)[0], scaling, options)
    layer.sliding_window = options.sliding_window  # the cache then keeps kept entries' positions
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
        sliding_window=session.cache.layers[layer_idx].sliding_window,
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
