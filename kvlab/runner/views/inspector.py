"""The views written while a run predicts (:class:`Inspector`); the tags are listed in
:mod:`kvlab.runner.views`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

import kvlab.data.glyphs as glyphs
from kvlab.engine.generation import GenerationResult
from kvlab.models.base import IMAGE, TEXT, VIDEO, Batch
from kvlab.pipeline.report import budget_overshoot
from kvlab.runner.views.figures import fitted_range, heatmap_figure, layer_curves_figure, render
from kvlab.runner.views.labels import titled
from kvlab.runner.views.patches import cell_labels, image_grids, merge_size, patch_figure, patch_share

MODALITY_NAMES = {TEXT: "text", IMAGE: "image", VIDEO: "video"}


def budget_heatmap(kept: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """``[L, Hkv]`` kept counts -> ``[L, Hkv]`` share of the prompt kept, in [0, 1]."""
    return (kept.float() / max(prompt_length, 1)).clamp(0, 1)


def layer_budget_share(result: GenerationResult, b: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the per-layer plot of sample ``b`` draws: ``[L, Hkv]`` kept / prompt tokens and the
    ``[L]`` layer budget / prompt tokens (None when some layer reported no budget)."""
    length = int(result.prompt_lengths[b])
    share = budget_heatmap(result.kept[:, b], length)
    reports = sorted(result.reports, key=lambda r: r.layer_idx)
    if len(reports) != share.shape[0] or any(r.budget is None for r in reports):
        return share, None
    budget = torch.stack([r.budget[b].float().cpu() for r in reports]).clamp(max=length)
    return share, budget / max(length, 1)


def modality_record(reports: Sequence[Any], modality: torch.Tensor, b: int) -> dict[str, Any]:
    """What sample ``b`` kept of each modality, for its prediction record (read back by the
    end-of-run figure, :func:`kvlab.runner.views.summary.modality_fractions`, so a resumed run's
    figure covers every sample): ``modality_tokens`` (``{name: tokens in the prompt}``) and
    ``modality_kept`` (``{name: [L] kept entries summed over KV heads]}``), with ``kv_heads``.
    Empty for a prompt of text alone or a pipeline that selected nothing."""
    row = modality[b].cpu()
    present = {name: int((row == m).sum()) for m, name in MODALITY_NAMES.items()}
    ordered = sorted((r for r in reports if r.selection is not None), key=lambda r: r.layer_idx)
    if not (present["image"] or present["video"]) or not ordered:
        return {}
    kept = [r.selection.kept_mask(row.shape[0])[b].cpu() for r in ordered]  # each [Hkv, T]
    counts = {name: [int((k & (row == m)).sum()) for k in kept]
              for m, name in MODALITY_NAMES.items() if present[name]}  # fmt: skip
    tokens = {name: n for name, n in present.items() if n}
    return {"modality_tokens": tokens, "modality_kept": counts, "kv_heads": int(kept[0].shape[0])}


def score_histograms(report: Any, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{role: scores}`` of sample 0 at one layer, each a flat tensor over its KV heads and candidate
    positions (padding and the protected window and sinks left out).

    Each scorer's own score by role; ``mixed`` (the mixer's output over the same candidates: the
    entries some role scored, so under a route each row's own branch's) only when there are two
    roles or more (with one, it repeats that scorer). A report without per-scorer scores gives
    ``mixed`` over the sample's valid positions (``valid`` ``[T]``).
    """
    by_role = {role: s[0].float().cpu() for role, s in (getattr(report, "scorer_scores", None) or {}).items()}
    out = {role: s[torch.isfinite(s)] for role, s in by_role.items()}
    mixed = report.scores[0].float().cpu() if report.scores is not None else None
    if mixed is not None and len(by_role) != 1:
        if by_role:
            candidates = torch.stack([torch.isfinite(s) for s in by_role.values()]).any(0)
        elif valid.shape[-1] == mixed.shape[-1]:
            candidates = valid.cpu()[None].expand_as(mixed)
        else:  # a protocol that compressed only part of the prompt (its context)
            candidates = torch.ones_like(mixed, dtype=torch.bool)
        out["mixed"] = mixed[candidates & torch.isfinite(mixed)]
    return {role: values for role, values in out.items() if values.numel()}


def route_table(means: dict[int, float]) -> str:
    """The route metric per layer and its drop from the layer before, as a Markdown table (the
    numbers behind ``route/metric_per_layer``'s figure)."""
    lines = ["| layer | route metric | drop from the layer before |", "|---|---|---|"]
    for layer, value in means.items():
        drop = f"{means[layer - 1] - value:.6g}" if layer - 1 in means else ""
        lines.append(f"| {layer} | {value:.6g} | {drop} |")
    return "\n".join(lines) + "\n"


class Inspector:
    """Writes the per-batch views of :mod:`kvlab.runner.views` to a TensorBoard ``SummaryWriter``
    (the end-of-run figures are drawn from the run's records, :mod:`~kvlab.runner.views.summary`).

    Args:
        writer: the ``SummaryWriter`` (``TensorBoardLogger.experiment``).
        samples: number of batches (from the first) that get the detailed views.
        layers: layers whose score histograms and kept image patches are drawn (negative counts
            from the end); None: every layer.
        label: the method and budget, for figure titles (:func:`kvlab.runner.views.labels.run_label`).
    """

    def __init__(
        self, writer: Any, samples: int = 4, layers: Sequence[int] | None = (0, -1), label: str = ""
    ) -> None:
        self.writer = writer
        self.samples = samples
        self.layers = None if layers is None else tuple(layers)
        self.label = label

    def detailed(self, step: int) -> bool:
        """Whether batch ``step`` gets the detailed views (and its scores should be recorded)."""
        return step < self.samples

    def inspected(self, reports: Sequence[Any]) -> list[Any]:
        """The reports of the inspected layers (:attr:`layers`, in layer order, each once)."""
        ordered = sorted(reports, key=lambda r: r.layer_idx)
        if self.layers is None:
            return ordered
        picked = dict.fromkeys(i % len(ordered) for i in self.layers if -len(ordered) <= i < len(ordered))
        return [ordered[i] for i in sorted(picked)]

    def _figure(self, tag: str, fig: Any, step: int) -> None:
        self.writer.add_image(tag, render(fig), step, dataformats="HWC")

    def log_batch(
        self,
        result: GenerationResult,
        batch: Batch,
        step: int,
        processor: Any = None,
        scalars: Mapping[str, float] | None = None,
    ) -> None:
        """Per-batch scalars, the components' own among them (``scalars`` by tag, from
        :meth:`kvlab.pipeline.Pipeline.report`), and (for the first batches) detailed views."""
        w = self.writer
        ratio = (result.kv_bytes_kept.float() / result.kv_bytes_full.clamp(min=1).float()).mean()
        w.add_scalar("cost/kv_kept_over_full", float(ratio), step)
        w.add_scalar("time/prefill_s_per_batch", result.prefill_seconds, step)
        w.add_scalar("time/compression_s_per_batch", result.compression_seconds, step)
        w.add_scalar("time/decode_s_per_batch", result.decode_seconds, step)
        w.add_scalar(
            "time/compression_over_prefill",
            result.compression_seconds / max(result.prefill_seconds, 1e-9),
            step,
        )
        for tag, value in (scalars or {}).items():
            w.add_scalar(tag, value, step)
        if not self.detailed(step):
            return
        if result.kept.numel():
            self._budget_views(result, batch, step)
        valid = batch.attention_mask[0].bool()
        for report in self.inspected(result.reports):
            if valid is None or (report.scores is None and not getattr(report, "scorer_scores", None)):
                continue
            for role, values in score_histograms(report, valid).items():
                self.writer.add_histogram(f"scores/{role}/layer_{report.layer_idx}", values, step)
        self._patches(result, batch, step, processor)

    def _budget_views(self, result: GenerationResult, batch: Batch, step: int) -> None:
        """The first sample's heatmap (not for a uniform allocation: one number, in the per-layer
        plot and the TEXT summary) and per-layer curves."""
        length = int(result.prompt_lengths[0])
        share, budget = layer_budget_share(result, 0)  # [L, Hkv], [L]
        about = f"sample {batch.samples[0].id} ({length} tok)"
        if not fitted_range(share)[2]:
            self._figure("budget/kept_layer_head", heatmap_figure(share, titled(self.label, about)), step)
        reports = sorted(result.reports, key=lambda r: r.layer_idx)
        modalities = self._modality_share(reports, batch) if len(reports) == share.shape[0] else {}
        overshoot = budget_overshoot(result.reports)
        excess = int(overshoot[0]) if overshoot is not None else 0
        note = f"budget_overshoot: {excess} tok/head over budget" if excess else None
        curves = layer_curves_figure(share, titled(self.label, about), budget, modalities, note)
        self._figure("budget/kept_per_layer", curves, step)

    @staticmethod
    def _modality_share(reports: list[Any], batch: Batch) -> dict[str, torch.Tensor]:
        """``{name: [L]}`` kept share of each modality of the first sample (only with image or video):
        :func:`modality_record`'s counts over the modality's tokens times the KV heads."""
        row = {} if any(r.selection is None for r in reports) else modality_record(reports, batch.modality, 0)
        heads, tokens = row.get("kv_heads"), row.get("modality_tokens", {})
        return {name: torch.tensor([c / (tokens[name] * heads) for c in counts])
                for name, counts in row.get("modality_kept", {}).items()}  # fmt: skip

    def _patches(self, result: GenerationResult, batch: Batch, step: int, processor: Any) -> None:
        grids = image_grids(batch, 0, merge_size(processor))
        reports = [r for r in result.reports if r.selection is not None]
        if not grids or not reports:
            return
        T = batch.modality.shape[1]
        sample = batch.samples[0]
        cells = sample.meta.get("image_cells") or []  # smollm2-reader tasks: each image's glyphs
        for report in self.inspected(reports):
            heads = int(report.selection.counts.shape[1])
            for i, (first, rows, cols) in enumerate(grids):
                share = patch_share(report.selection, T, first, rows, cols)
                title = titled(self.label, f"sample {sample.id}", f"layer {report.layer_idx}, image {i}")
                # glyphs label patches only where one patch is one cell (smollm2-reader's 4 x 4)
                reader_grid = i < len(cells) and (rows, cols) == (glyphs.GRID, glyphs.GRID)
                labels = cell_labels(cells[i], rows * cols) if reader_grid else None
                figure = patch_figure(sample.images[i], share, title, heads=heads, labels=labels)
                self._figure(f"patches/layer_{report.layer_idx}/image_{i}", figure, step)

    def finish(self) -> None:
        """Flush the events (the run-level figures come from the records:
        :func:`kvlab.runner.views.summary.write_run_summary`)."""
        self.writer.flush()
