"""kvlab's own decode loop: prefill (with compression inside), then greedy decode over the cache.

Short on purpose (no forked ``generate``): one forward over the padded prompt, then one token
per step through the Cache API. Positions: text models get explicit ``position_ids`` from the
attention mask (each sample counts from its own first token, padding or not), and decode
positions continue from the *original* prompt length. Multimodal-RoPE models (Qwen2-VL) compute
their own positions at prefill from the attention mask (``get_rope_index``), which also stores
per-sample ``rope_deltas``. At decode kvlab passes the new token's position itself, exactly as
the model derives it from a full attention mask (valid tokens so far + ``rope_deltas``, the same
on all three M-RoPE axes): Qwen2-VL 5.23 would otherwise build positions for the whole
sequence (given a mask) or ignore left padding (without one).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlab.compression.context import sample_positions
from kvlab.compression.pipeline import LayerReport, Pipeline
from kvlab.engine.attention import CompressionSession, compression_session
from kvlab.engine.cache import CompressedCache
from kvlab.models.base import LoadedModel


@dataclass
class GenerationResult:
    """Outputs of :func:`generate` for a batch of B samples.

    Attributes:
        tokens: generated token ids per sample (eos excluded, stops at eos or the limit).
        kept: ``[L, B, Hkv]`` kept prompt tokens per layer and head.
        prompt_lengths: ``[B]`` valid prompt tokens.
        kv_bytes_full: bytes an uncompressed cache of each prompt would hold, ``[B]``.
        kv_bytes_kept: bytes of each sample's kept prompt K/V, ``[B]``.
        kv_bytes_allocated: everything the cache allocated for the batch (decode region and
            offsets included).
        prefill_seconds / compression_seconds / decode_seconds: batch timings (prefill excludes
            the compression time spent inside it).
        step_logits: ``[B, steps, V]`` logits of every generated position (when requested).
        reports: per-layer :class:`LayerReport` s.
    """

    tokens: list[list[int]]
    kept: torch.Tensor
    prompt_lengths: torch.Tensor
    kv_bytes_full: torch.Tensor
    kv_bytes_kept: torch.Tensor
    kv_bytes_allocated: int
    prefill_seconds: float
    compression_seconds: float
    decode_seconds: float
    step_logits: torch.Tensor | None = None
    reports: list[LayerReport] = field(default_factory=list)


def _uses_mrope(model: torch.nn.Module) -> bool:
    return hasattr(getattr(model, "model", model), "get_rope_index")


def _prefill_positions(
    model: torch.nn.Module, positions: torch.Tensor, extra: dict[str, Any]
) -> dict[str, Any]:
    """Prefill ``position_ids`` kwargs: explicit for text models and for text-only M-RoPE batches.

    M-RoPE models keep ``rope_deltas`` on the model between calls; it is reset here so a batch
    never sees the previous batch's deltas. With images they compute their own 3-D positions.
    """
    if not _uses_mrope(model):
        return {"position_ids": positions}
    model.model.rope_deltas = None
    if extra.get("image_grid_thw") is None and extra.get("video_grid_thw") is None:
        return {"position_ids": positions[None].expand(3, -1, -1)}
    return {}


def _decode_positions(model: torch.nn.Module, next_pos: torch.Tensor) -> torch.Tensor:
    """Position ids of the next token: ``[B, 1]``, or ``[3, B, 1]`` for multimodal RoPE."""
    if not _uses_mrope(model):
        return next_pos
    deltas = model.model.rope_deltas  # [B, 1] from the prefill's get_rope_index (None: text only)
    if deltas is not None:
        next_pos = next_pos + deltas.to(next_pos.device)
    return next_pos[None].expand(3, -1, -1)


@torch.no_grad()
def generate(
    loaded: LoadedModel,
    pipeline: Pipeline,
    batch: dict[str, Any],
    max_new_tokens: int = 32,
    return_logits: bool = False,
    record_scores: bool = False,
    calibration: Any = None,
    teacher_tokens: torch.Tensor | None = None,
) -> GenerationResult:
    """Prefill ``batch`` (a processor's collate output), compress every layer, decode greedily.

    ``teacher_tokens`` ``[B, S]``: feed these tokens instead of the greedy choices (teacher
    forcing, for fidelity metrics); decoding then runs exactly S steps.
    """
    model, info = loaded.model, loaded.info
    pipeline.bind_model(info.name)
    device = next(model.parameters()).device
    input_ids = batch["input_ids"].to(device)
    attention_mask = batch["attention_mask"].to(device)
    valid = attention_mask.bool()
    extra = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.get("model_inputs", {}).items()}
    B = input_ids.shape[0]
    cache = CompressedCache(info.num_layers, decode_capacity=max_new_tokens)
    session = CompressionSession(
        cache=cache,
        pipeline=pipeline,
        valid=valid,
        modality=batch["modality"].to(device),
        calibration=calibration,
        record_scores=record_scores,
    )
    positions = sample_positions(valid).clamp(min=0)  # padding gets 0, as in transformers
    eos = torch.tensor(sorted(set(loaded.processor.eos_token_ids)), device=device)

    with compression_session(session):
        start = time.perf_counter()
        kwargs = _prefill_positions(model, positions, extra)
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **kwargs,
            **extra,
        )
        prefill_total = time.perf_counter() - start
        pipeline.decode_policy.start(cache, session.state)
        logits = out.logits[:, -1].float()
        step_logits = [logits] if return_logits else []
        tokens = torch.empty(B, 0, dtype=torch.long, device=device)
        finished = torch.zeros(B, dtype=torch.bool, device=device)
        next_pos = positions[:, -1:] + 1
        decode_start = time.perf_counter()
        steps = max_new_tokens if teacher_tokens is None else teacher_tokens.shape[1]
        for step in range(steps):
            next_token = logits.argmax(-1) if teacher_tokens is None else teacher_tokens[:, step].to(device)
            tokens = torch.cat([tokens, next_token[:, None]], dim=1)
            finished |= torch.isin(next_token, eos)
            if (teacher_tokens is None and bool(finished.all())) or step == steps - 1:
                break
            out = model(
                input_ids=next_token[:, None],
                position_ids=_decode_positions(model, next_pos),
                past_key_values=cache,
                use_cache=True,
            )
            next_pos = next_pos + 1
            logits = out.logits[:, -1].float()
            if return_logits:
                step_logits.append(logits)
            pipeline.decode_policy.after_step(cache, step)
        decode_seconds = time.perf_counter() - decode_start

    kept = cache.kept_tokens()  # [L, B, Hkv]
    lengths = valid.sum(-1)
    bytes_per_token = info.head_dim * 2 * cache.layers[0].prompt_keys.element_size()
    full = lengths * info.num_kv_heads * info.num_layers * bytes_per_token
    return GenerationResult(
        tokens=[_trim(row, set(eos.tolist())) for row in tokens.tolist()],
        kept=kept.cpu(),
        prompt_lengths=lengths.cpu(),
        kv_bytes_full=full.cpu(),
        kv_bytes_kept=(kept.sum(dim=(0, 2)) * bytes_per_token).cpu(),
        kv_bytes_allocated=cache.kv_bytes(),
        prefill_seconds=prefill_total - session.compression_seconds,
        compression_seconds=session.compression_seconds,
        decode_seconds=decode_seconds,
        step_logits=torch.stack(step_logits, dim=1).cpu() if return_logits else None,
        reports=session.reports,
    )


def _trim(row: list[int], stops: set[int]) -> list[int]:
    """``row`` up to (excluding) its first stop token."""
    for i, token in enumerate(row):
        if token in stops:
            return row[:i]
    return row
