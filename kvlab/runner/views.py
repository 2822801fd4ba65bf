"""TensorBoard views of what compression kept (written by :class:`Inspector`).

Every batch (``step`` = batch index):

- ``cost/kv_ratio``: kept / full prompt KV bytes (batch mean);
- ``time/prefill_s``, ``time/compression_s``, ``time/decode_s``, ``time/compression_over_prefill``.
- ``route/switch_layer``: routed pipelines (DAVID): the batch's mean first layer run by the
  rule's ``after`` branch (a sample that never switched counts as the number of layers).

The first ``samples`` batches (detailed views of the batch's first sample, cheap by default):

- ``budget/kept_layer_head``: image of kept tokens per layer (rows) x KV head (columns) over the
  prompt length (white = everything kept);
- ``scores/layer_<l>``: histogram of the layer's mixed scores (finite entries, whole batch),
  and ``scores/<scorer>/layer_<l>`` per scorer when the layer report carries ``scorer_scores``;
- ``patches/layer_<l>/image_<i>``: for each chosen layer, the sample's image with each patch
  dimmed by the share of KV heads that dropped its token (bright = kept by every head).

At the end of the run (``step`` = layer index, so TensorBoard draws a curve over layers):

- ``modality/kept_fraction_<text|image|video>``: kept tokens of that modality / present
  tokens of it (times heads), over every sample of the run;
- ``budget/kept_layer_head_mean``: the heatmap averaged over every sample of the run;
- ``route/metric`` and ``route/metric_drop``: routed pipelines (DAVID): the route metric of
  each layer (NCAR theta_m) and its drop from the previous layer (Delta_m), averaged over the
  samples where the layer evaluated it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from kvlab.compression.routing import route_metric, switch_layers
from kvlab.engine.generation import GenerationResult
from kvlab.models.base import IMAGE, TEXT, VIDEO

MODALITY_NAMES = {TEXT: "text", IMAGE: "image", VIDEO: "video"}


def budget_heatmap(kept: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """``[L, Hkv]`` kept counts -> ``[1, L, Hkv]`` image in [0, 1] (fraction of the prompt kept)."""
    return (kept.float() / max(prompt_length, 1)).clamp(0, 1)[None]


def modality_counts(selection: Any, modality: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept and present token counts per modality id (0 text, 1 image, 2 video), each ``[3]``.

    Present counts are multiplied by the number of KV heads, so kept / present is the fraction.
    """
    modality = modality.cpu()
    kept = selection.kept_mask(modality.shape[1]).cpu()  # [B, Hkv, T]
    Hkv = kept.shape[1]
    kept_counts = torch.stack([(kept & (modality == m)[:, None]).sum() for m in MODALITY_NAMES])
    present = torch.stack([(modality == m).sum() * Hkv for m in MODALITY_NAMES])
    return kept_counts, present


def image_grids(batch: dict[str, Any], b: int, processor: Any) -> list[tuple[int, int, int]]:
    """``(first token, rows, cols)`` of each image of sample ``b`` in the prompt (empty if unknown).

    Qwen2-VL: the grid is ``image_grid_thw`` merged by the processor's ``merge_size``. Others:
    the image's tokens split evenly per image and laid out as a square (a leading CLS token
    skipped when the count is a square plus one).
    """
    samples = batch["samples"]
    positions = (batch["modality"][b] == IMAGE).nonzero().flatten().tolist()
    n_images = len(samples[b].images)
    if not positions or n_images == 0:
        return []
    grid_thw = batch.get("model_inputs", {}).get("image_grid_thw")
    merge = getattr(getattr(processor, "images", None), "merge_size", None)
    if grid_thw is not None and merge:
        first = sum(len(s.images) for s in samples[:b])
        thw = grid_thw[first : first + n_images].tolist()
        layout = [(int(h) // merge, int(w) // merge, 0) for _, h, w in thw]  # (rows, cols, skipped)
    else:
        per_image = len(positions) // n_images
        side = math.isqrt(per_image)
        if side * side not in (per_image, per_image - 1):
            return []
        layout = [(side, side, per_image - side * side)] * n_images
    grids, offset = [], 0
    for rows, cols, skip in layout:
        grids.append((positions[offset + skip], rows, cols))
        offset += skip + rows * cols
    return grids


def patch_overlay(image: Image.Image, kept_share: torch.Tensor, cell: int = 16) -> torch.Tensor:
    """``[3, rows*cell, cols*cell]`` image in [0, 1]: ``image`` with each patch scaled by
    ``0.2 + 0.8 * kept_share[row, col]`` (``kept_share`` ``[rows, cols]`` in [0, 1])."""
    rows, cols = kept_share.shape
    cell = max(cell, 128 // max(rows, cols))
    pixels = torch.from_numpy(np.asarray(image.convert("RGB").resize((cols * cell, rows * cell))).copy())
    pixels = pixels.float().permute(2, 0, 1) / 255
    scale = kept_share.float().repeat_interleave(cell, 0).repeat_interleave(cell, 1)
    return (pixels * (0.2 + 0.8 * scale)).clamp(0, 1)


class Inspector:
    """Writes the views in the module docstring to a TensorBoard ``SummaryWriter``.

    Args:
        writer: the ``SummaryWriter`` (``TensorBoardLogger.experiment``).
        samples: number of batches (from the first) that get the detailed views.
        layers: layers whose kept image patches are drawn (negative counts from the end).
    """

    def __init__(self, writer: Any, samples: int = 4, layers: Sequence[int] = (0, -1)):
        self.writer = writer
        self.samples = samples
        self.layers = tuple(layers)
        self.kept = torch.zeros(0, len(MODALITY_NAMES))
        self.present = torch.zeros(0, len(MODALITY_NAMES))
        self.heatmap_sum: torch.Tensor | None = None
        self.heatmap_count = 0
        self.route_sums: dict[int, list[float]] = {}  # layer -> [sum of the metric, samples]

    def detailed(self, step: int) -> bool:
        """Whether batch ``step`` gets the detailed views (and its scores should be recorded)."""
        return step < self.samples

    def log_batch(
        self, result: GenerationResult, batch: dict[str, Any], step: int, processor: Any = None
    ) -> None:
        """Per-batch scalars, run-level accumulators and (for the first batches) detailed views."""
        w = self.writer
        ratio = (result.kv_bytes_kept.float() / result.kv_bytes_full.clamp(min=1).float()).mean()
        w.add_scalar("cost/kv_ratio", float(ratio), step)
        w.add_scalar("time/prefill_s", result.prefill_seconds, step)
        w.add_scalar("time/compression_s", result.compression_seconds, step)
        w.add_scalar("time/decode_s", result.decode_seconds, step)
        w.add_scalar(
            "time/compression_over_prefill",
            result.compression_seconds / max(result.prefill_seconds, 1e-9),
            step,
        )
        switch = switch_layers(result.reports)
        if switch is not None:  # routed pipelines: mean switch layer (never switched = number of layers)
            layers = [len(result.reports) if s is None else s for s in switch]
            w.add_scalar("route/switch_layer", sum(layers) / len(layers), step)
        self._accumulate(result, batch)
        if not self.detailed(step):
            return
        if result.kept.numel():
            w.add_image(
                "budget/kept_layer_head",
                budget_heatmap(result.kept[:, 0], int(result.prompt_lengths[0])),
                step,
            )
        for report in result.reports:
            self._histogram(f"scores/layer_{report.layer_idx}", report.scores, step)
            for name, scores in (getattr(report, "scorer_scores", None) or {}).items():
                self._histogram(f"scores/{name}/layer_{report.layer_idx}", scores, step)
        self._patches(result, batch, step, processor)

    def _histogram(self, tag: str, scores: torch.Tensor | None, step: int) -> None:
        if scores is None:
            return
        finite = scores[torch.isfinite(scores)]
        if finite.numel():
            self.writer.add_histogram(tag, finite.float().cpu(), step)

    def _accumulate(self, result: GenerationResult, batch: dict[str, Any]) -> None:
        rows = [
            modality_counts(r.selection, batch["modality"]) for r in result.reports if r.selection is not None
        ]
        if rows:
            kept, present = (torch.stack(x).float() for x in zip(*rows, strict=True))
            if self.kept.shape[0] != kept.shape[0]:
                self.kept, self.present = torch.zeros_like(kept), torch.zeros_like(present)
            self.kept += kept
            self.present += present
        if result.kept.numel():
            share = (result.kept.float() / result.prompt_lengths.clamp(min=1)[None, :, None]).sum(
                1
            )  # [L, Hkv]
            self.heatmap_sum = share if self.heatmap_sum is None else self.heatmap_sum + share
            self.heatmap_count += result.kept.shape[1]
        for report in result.reports:
            for b in range(len(batch["samples"])):
                value = route_metric(report, b)
                if value is not None:
                    total = self.route_sums.setdefault(report.layer_idx, [0.0, 0])
                    total[0] += value
                    total[1] += 1

    def _patches(self, result: GenerationResult, batch: dict[str, Any], step: int, processor: Any) -> None:
        grids = image_grids(batch, 0, processor)
        reports = [r for r in result.reports if r.selection is not None]
        if not grids or not reports:
            return
        T = batch["modality"].shape[1]
        for layer in dict.fromkeys(self.layers):
            if not -len(reports) <= layer < len(reports):
                continue
            report = reports[layer]
            share = report.selection.kept_mask(T)[0].float().cpu().mean(0)  # [T] share of heads keeping it
            for i, (first, rows, cols) in enumerate(grids):
                patch = share[first : first + rows * cols].view(rows, cols)
                image = patch_overlay(batch["samples"][0].images[i], patch)
                self.writer.add_image(f"patches/layer_{report.layer_idx}/image_{i}", image, step)

    def finish(self) -> None:
        """Write the run-level views (modality fractions per layer, mean heatmap) and flush."""
        for m, name in MODALITY_NAMES.items():
            if self.present.numel() and bool((self.present[:, m] > 0).all()):
                for layer, value in enumerate((self.kept[:, m] / self.present[:, m]).tolist()):
                    self.writer.add_scalar(f"modality/kept_fraction_{name}", value, layer)
        if self.heatmap_sum is not None and self.heatmap_count:
            mean = (self.heatmap_sum / self.heatmap_count).clamp(0, 1)[None]
            self.writer.add_image("budget/kept_layer_head_mean", mean, 0)
        means = {layer: total / count for layer, (total, count) in sorted(self.route_sums.items())}
        for layer, value in means.items():
            self.writer.add_scalar("route/metric", value, layer)
            if layer - 1 in means:
                self.writer.add_scalar("route/metric_drop", means[layer - 1] - value, layer)
        self.writer.flush()
