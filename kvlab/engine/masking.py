"""The masking baseline: full-size K/V with the evicted entries hidden by an attention mask.

This is how kvpress holds a per-head selection such as AdaKV's: every prompt entry stays in a
transformers ``DynamicCache`` and decode masks the evicted ones, so memory does not fall.
``kvlab bench memory`` measures kvlab's ragged cache against it, and a test checks that
decoding over the ragged cache equals decoding over this masked full cache.
"""

from __future__ import annotations

import uuid
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kvlab.models import load_model

MASKED_ATTENTION = "kvlab_masked"


def masked_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, *, masks: dict[int, torch.Tensor],
    **kwargs,
):  # fmt: skip
    """Full K/V; at decode the evicted prompt entries (``masks[layer]``, ``[B, Hkv, T]`` kept
    masks of the prompt entries) are masked out.

    Shapes: query ``[B, H, q, D]``, key/value ``[B, Hkv, S, D]``; returns ``[B, q, H, D]``.
    """
    if query.shape[2] > 1:
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2), None
    keep = masks[module.layer_idx]
    mask = torch.ones(*keep.shape[:2], key.shape[2], dtype=torch.bool, device=key.device)
    mask[..., : keep.shape[-1]] = keep
    group = query.shape[1] // key.shape[1]
    mask = mask.repeat_interleave(group, 1)[:, :, None, :]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2), None


def load_masked_model(
    model_name: str, reports: list[Any], length: int
) -> tuple[Any, dict[int, torch.Tensor]]:
    """``model_name`` with kvpress-style masking: full K/V kept, at decode the prompt entries the
    layer ``reports`` evicted (their selections, prompts of ``length`` tokens) are masked out.

    Returns ``(loaded model, masks)``: the ``[B, Hkv, length]`` kept mask per layer index, bound to
    this model's attention function (no state outside it)."""
    loaded = load_model(model_name)
    masks = {report.layer_idx: report.selection.kept_mask(length) for report in reports}
    name = f"{MASKED_ATTENTION}_{uuid.uuid4().hex[:12]}"  # one function per model: its own masks
    AttentionInterface.register(name, partial(masked_attention, masks=masks))
    loaded.model.set_attn_implementation(name)
    return loaded, masks
