"""TensorBoard views of what a batch's compression did.

Tags written per batch (``step`` = batch index):

- ``cost/kv_ratio``: kept / full prompt KV bytes (batch mean);
- ``time/prefill_s``, ``time/compression_s``, ``time/decode_s``;
- ``budget/kept_layer_head``: image of the kept tokens per layer (rows) x KV head (columns)
  of the batch's first sample, normalised by its prompt length (white = everything kept);
- ``scores/layer_<l>``: histogram of the mixed scores of layer l (when the module records scores).
"""

from __future__ import annotations

from typing import Any

import torch

from kvlab.generation import GenerationResult


def budget_heatmap(kept: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """``[L, Hkv]`` kept counts -> ``[1, L, Hkv]`` image in [0, 1] (fraction of the prompt kept)."""
    return (kept.float() / max(prompt_length, 1)).clamp(0, 1)[None]


def log_batch(writer: Any, result: GenerationResult, batch: dict[str, Any], step: int) -> None:
    """Write one batch's figures to a TensorBoard ``SummaryWriter``."""
    ratio = (result.kv_bytes_kept.float() / result.kv_bytes_full.clamp(min=1).float()).mean()
    writer.add_scalar("cost/kv_ratio", float(ratio), step)
    writer.add_scalar("time/prefill_s", result.prefill_seconds, step)
    writer.add_scalar("time/compression_s", result.compression_seconds, step)
    writer.add_scalar("time/decode_s", result.decode_seconds, step)
    if result.kept.numel():
        image = budget_heatmap(result.kept[:, 0], int(result.prompt_lengths[0]))
        writer.add_image("budget/kept_layer_head", image, step, dataformats="CHW")
    for report in result.reports:
        if report.scores is not None:
            finite = report.scores[torch.isfinite(report.scores)]
            if finite.numel():
                writer.add_histogram(f"scores/layer_{report.layer_idx}", finite.cpu(), step)
