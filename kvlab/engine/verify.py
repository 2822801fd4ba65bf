"""Check kvlab's engine against transformers' own forward on one prompt (``model.verify``, ``check-model``).

kvlab runs a model through its own attention function and ragged cache, and kvlab's fidelity
metrics compare compressed runs with that same engine: an engine that is wrong for a model family
would go unnoticed. :func:`verify_engine` runs one prompt twice, nothing evicted:

- natively: the language model's attention switched back to transformers' own (``sdpa``, or
  ``eager`` for logit soft-capping and attention sinks, which sdpa does not implement) with a
  transformers ``DynamicCache`` and ``generate`` (greedy);
- through kvlab: :func:`kvlab.engine.generation.generate` with the full cache
  (``Pipeline.from_config(None)``);

and compares the prompt's last-position logits (max absolute difference) and the first greedy
tokens. When the prompt is not longer than a local-attention span of the model (``sliding_window``
on sliding layers, ``attention_chunk_size``), a second probe longer than the span, built by
repeating the prompt's text tokens, is checked too: the span must matter in the check.

Tolerance on the max |logit difference| (:data:`TOLERANCES`): ``atol + rtol * max |native logit|``,
fp32 ``1e-3 + 1e-4 * scale`` (the two paths differ by summation order only, ~1e-5 on real models),
fp16 ``5e-2 + 1e-2 * scale``, bf16 ``1e-1 + 5e-2 * scale`` (rounding of 7-bit mantissas through
every layer). A wrong engine (a missed window, scaling or soft-cap) is off by whole units. Greedy
tokens must match; a divergence where the native logits of the two chosen tokens are within the
tolerance (a near tie that rounding may flip) is not a mismatch.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from kvlab.engine.generation import RunOptions, generate
from kvlab.engine.registration import enable_kvlab_attention
from kvlab.models.base import TEXT, Batch, LoadedModel
from kvlab.models.common import text_config
from kvlab.models.placement import input_device
from kvlab.models.prompts import collate_ids
from kvlab.pipeline import Pipeline

#: dtype -> (atol, rtol) on the prompt's last-position logits (see the module docstring)
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-3, 1e-4),
    torch.float16: (5e-2, 1e-2),
    torch.bfloat16: (1e-1, 5e-2),
}
#: greedy tokens compared per check
STEPS = 8
#: tokens a local-attention probe extends past the span
PROBE_EXTRA = 16
#: text-config fields reported as the attention features in play (when set)
FEATURE_FIELDS = (
    "sliding_window",
    "attention_chunk_size",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "query_pre_attn_scalar",
    "use_bidirectional_attention",
)


@dataclass
class VerifyResult:
    """One model's kvlab-vs-native comparison (the prompt, plus a local-attention probe when needed).

    Attributes:
        max_logit_diff: max |kvlab - native| over the prompt's last-position logits ``[V]`` (the
            largest over the checks).
        tolerance: the largest difference accepted (dtype's ``atol + rtol * scale``, the smallest
            over the checks).
        tokens_match: the first greedy tokens agree in every check (near ties excepted).
        first_divergence: ``"<check>: step i (native t1, kvlab t2)"`` of the first failing check,
            None when everything matches.
        features: the model's attention features (sliding window, soft-capping, scaling, layer types).
        seconds_native / seconds_kvlab: wall time of each path over all checks.
        checks: ``(name, prompt tokens, max |logit diff|, tokens match)`` per check.
        prompt_tokens: tokens of the prompt (the first check).
        native_tokens / kvlab_tokens: the first check's greedy tokens (at most :data:`STEPS`).
    """

    max_logit_diff: float
    tolerance: float
    tokens_match: bool
    first_divergence: str | None
    features: dict[str, Any]
    seconds_native: float
    seconds_kvlab: float
    checks: list[tuple[str, int, float, bool]] = field(default_factory=list)
    prompt_tokens: int = 0
    native_tokens: list[int] = field(default_factory=list)
    kvlab_tokens: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """The logits are within the tolerance and the greedy tokens match."""
        return self.max_logit_diff <= self.tolerance and self.tokens_match

    @property
    def total_tokens(self) -> int:
        """Prompt tokens over all checks (for tokens/s)."""
        return sum(check[1] for check in self.checks)

    def describe(self) -> str:
        """One line: the difference, the tolerance, the divergence and the features."""
        features = ", ".join(f"{k}={v}" for k, v in self.features.items()) or "plain causal attention"
        divergence = self.first_divergence or "none"
        return (
            f"max |logit difference| {self.max_logit_diff:.3g} (tolerance {self.tolerance:.3g}), first "
            f"diverging greedy step: {divergence}; attention features in play: {features}"
        )


def attention_features(model: torch.nn.Module) -> dict[str, Any]:
    """The language model's attention features: set :data:`FEATURE_FIELDS`, ``layer_types`` counts,
    the attention ``scaling`` of the first layer that has one and attention sinks."""
    config = text_config(model.config)
    features: dict[str, Any] = {}
    layer_types = getattr(config, "layer_types", None) or []
    for name in FEATURE_FIELDS:
        value = getattr(config, name, None)
        if name == "sliding_window" and layer_types and "sliding_attention" not in layer_types:
            value = None  # set but unused (every layer full attention)
        if value is not None and value is not False:
            features[name] = value
    if layer_types:
        features["layer_types"] = dict(Counter(layer_types))
    for module in model.modules():
        if hasattr(module, "layer_idx") and isinstance(getattr(module, "scaling", None), float):
            features["scaling"] = round(module.scaling, 6)
            break
    if any(hasattr(module, "sinks") for module in model.modules()):
        features["sinks"] = True
    return features


def local_span(model: torch.nn.Module) -> int | None:
    """The largest local-attention span of the language model (sliding window on sliding layers,
    ``attention_chunk_size``), None without one."""
    config = text_config(model.config)
    layer_types = getattr(config, "layer_types", None) or []
    spans = []
    window = getattr(config, "sliding_window", None)
    if window and (not layer_types or "sliding_attention" in layer_types):
        spans.append(int(window))
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk:
        spans.append(int(chunk))
    return max(spans) if spans else None


def _native_implementation(model: torch.nn.Module) -> str:
    """``eager`` when the attention uses soft-capping or sinks (sdpa ignores them) or the model
    class does not support sdpa at all (``_supports_sdpa`` False), else ``sdpa``."""
    features = attention_features(model)
    if "attn_logit_softcapping" in features or "sinks" in features:
        return "eager"
    return "sdpa" if getattr(model, "_supports_sdpa", True) else "eager"


def _set_attention(loaded: LoadedModel, implementation: str) -> None:
    if loaded.info.vision_language:
        loaded.model.set_attn_implementation({"text_config": implementation, "vision_config": "sdpa"})
    else:
        loaded.model.set_attn_implementation(implementation)


@torch.no_grad()
def _native(loaded: LoadedModel, batch: Batch, steps: int) -> tuple[torch.Tensor, list[int], float]:
    """transformers' own greedy run: ``(logits [S, V] fp32, tokens [S], seconds)``."""
    model = loaded.model
    device = input_device(model)
    extra = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.model_inputs.items()}
    _set_attention(loaded, _native_implementation(model))
    try:
        start = time.perf_counter()
        out = model.generate(
            input_ids=batch.input_ids.to(device),
            attention_mask=batch.attention_mask.to(device),
            cache=DynamicCache(config=model.config),
            max_new_tokens=steps,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            output_logits=True,
            return_dict_in_generate=True,
            **extra,
        )
        seconds = time.perf_counter() - start
    finally:
        enable_kvlab_attention(model, loaded.info.vision_language)
    logits = torch.stack(out.logits, 1)[0].float()
    tokens = out.sequences[0, batch.input_ids.shape[1] :].tolist()
    return logits, tokens, seconds


def _compare(name: str, loaded: LoadedModel, batch: Batch, steps: int, result: VerifyResult) -> None:
    """Run one check on a one-sample ``batch`` (``input_ids [1, T]``) and fold it into ``result``."""
    native_logits, native_tokens, native_seconds = _native(loaded, batch, steps)
    start = time.perf_counter()
    ours = generate(loaded, Pipeline.from_config(None), batch, RunOptions(steps, return_logits=True))
    result.seconds_kvlab += time.perf_counter() - start
    result.seconds_native += native_seconds
    kvlab_logits = ours.step_logits[0].float()  # [S', V]; stops early only at eos
    kvlab_tokens = kvlab_logits.argmax(-1).tolist()
    atol, rtol = TOLERANCES.get(loaded.model.dtype, TOLERANCES[torch.bfloat16])
    native_first = native_logits[0].cpu()
    tolerance = atol + rtol * float(native_first.abs().max())
    diff = float((kvlab_logits[0] - native_first).abs().max())
    match, divergence = True, None
    for i, (a, b) in enumerate(zip(native_tokens, kvlab_tokens, strict=False)):
        if a != b:
            gap = float(native_logits[i, a] - native_logits[i, b])
            if gap > tolerance:  # not a near tie
                match, divergence = False, f"{name}: step {i} (native token {a}, kvlab token {b})"
            break
    prompt_tokens = int(batch.attention_mask.sum())
    result.checks.append((name, prompt_tokens, diff, match))
    if not result.checks[:-1]:
        result.prompt_tokens, result.native_tokens, result.kvlab_tokens = (
            prompt_tokens,
            native_tokens,
            kvlab_tokens,
        )
    result.max_logit_diff = max(result.max_logit_diff, diff)
    result.tolerance = min(result.tolerance, tolerance)
    result.tokens_match = result.tokens_match and match
    if result.first_divergence is None and (divergence is not None or diff > tolerance):
        result.first_divergence = divergence or f"{name}: step 0 (logits beyond the tolerance)"


def _one_sample(loaded: LoadedModel, batch_or_ids: Batch | list[int]) -> Batch:
    """A one-sample batch: token ids collated, or a batch's first sample re-collated alone."""
    if isinstance(batch_or_ids, Batch):
        if batch_or_ids.samples:
            return loaded.processor.collate(batch_or_ids.samples[:1])
        mask = batch_or_ids.attention_mask[0].bool()
        batch_or_ids = batch_or_ids.input_ids[0][mask].tolist()
    return collate_ids(loaded, [list(batch_or_ids)])


def verify_engine(
    loaded: LoadedModel, batch_or_ids: Batch | list[int], steps: int = STEPS, probe: bool = True
) -> VerifyResult:
    """Compare kvlab's engine (nothing evicted) with transformers' own forward on one prompt.

    Args:
        loaded: the model, its attention routed through kvlab (it is routed back afterwards).
        batch_or_ids: a processor's collate output (its first sample is used, collated alone) or
            one prompt's token ids ``[T]``.
        steps: greedy tokens compared.
        probe: when the prompt is not longer than the model's local-attention span, also check a
            prompt of ``span + PROBE_EXTRA`` tokens repeating the prompt's text tokens (skipped past
            ``max_position_embeddings``).

    Returns:
        the :class:`VerifyResult` (``.ok`` tells whether kvlab reproduces the model).
    """
    result = VerifyResult(
        max_logit_diff=0.0,
        tolerance=float("inf"),
        tokens_match=True,
        first_divergence=None,
        features=attention_features(loaded.model),
        seconds_native=0.0,
        seconds_kvlab=0.0,
    )
    batch = _one_sample(loaded, batch_or_ids)
    _compare("prompt", loaded, batch, steps, result)
    span = local_span(loaded.model)
    length = int(batch.attention_mask.sum())
    if probe and span is not None and length <= span:
        target = span + PROBE_EXTRA
        valid = batch.attention_mask[0].bool() & (batch.modality[0] == TEXT)
        text = batch.input_ids[0][valid].tolist()
        if text and target + steps <= loaded.info.max_position_embeddings:
            ids = (text * (target // len(text) + 1))[:target]
            _compare(f"probe of {target} tokens", loaded, _one_sample(loaded, ids), steps, result)
    return result
