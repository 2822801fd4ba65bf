"""TensorBoard views of what compression kept (written by :class:`Inspector`).

Pictures are matplotlib figures rendered off-screen (Agg canvas, no pyplot state) to RGB images
at least 800 px wide, with axes, a colour bar or legend, and the run's method and budget in
the title (:func:`run_label`); they are drawn only for the few detailed batches and at the end.

Every batch (``step`` = batch index):

- ``cost/kv_ratio``: kept / full prompt KV bytes (batch mean);
- ``time/prefill_s``, ``time/compression_s``, ``time/decode_s``, ``time/compression_over_prefill``.
- ``route/switch_layer``: routed pipelines (DAVID): the batch's mean first layer run by the
  rule's ``after`` branch (a sample that never switched counts as the number of layers).

The first ``samples`` batches (detailed views of the batch's first sample, cheap by default):

- ``budget/kept_layer_head``: heatmap of the kept share of the prompt per layer (x) and KV head
  (y), colour bar 0..1;
- ``budget/kept_per_layer``: kept share per layer, mean over heads with the heads' min..max
  band, the layer budget dashed and, for prompts with images, each modality's kept share;
- ``scores/layer_<l>``: histogram of the layer's mixed scores (finite entries, whole batch),
  and ``scores/<scorer>/layer_<l>`` per scorer when the layer report carries ``scorer_scores``;
- ``patches/layer_<l>/image_<i>``: for each chosen layer, the sample's image beside the same
  image overlaid with each patch's share of KV heads that kept its token (colour bar 0..1);
  for the ``smollm2-reader`` tasks (``meta["image_cells"]``) each patch's glyph is written over
  it, black on kept patches and white on dropped ones.

At the end of the run (``step`` = layer index, so TensorBoard draws a curve over layers):

- ``modality/kept_fraction_<text|image|video>``: kept tokens of that modality / present
  tokens of it (times heads), over every sample of the run; ``modality/kept_fraction_per_layer``
  draws them as one figure;
- ``budget/kept_layer_head_mean``: the heatmap averaged over every sample of the run;
- ``route/metric`` and ``route/metric_drop``: routed pipelines (DAVID): the route metric of
  each layer (NCAR theta_m) and its drop from the previous layer (Delta_m), averaged over the
  samples where the layer evaluated it.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from kvlab.compression.routing import route_metric, switch_layers
from kvlab.engine.generation import GenerationResult
from kvlab.models.base import IMAGE, TEXT, VIDEO

MODALITY_NAMES = {TEXT: "text", IMAGE: "image", VIDEO: "video"}
MODALITY_COLORS = {"text": "tab:green", "image": "tab:red", "video": "tab:purple"}  # the same in every figure
DPI = 100
WIDTH = 8.4  # inches: 840 px at DPI


def run_label(method: str | None, pipeline: Any) -> str:
    """``"<method> · <budget>"`` for figure titles, e.g. ``snapkv · 128 tokens/head, window 32``."""
    budget = getattr(pipeline, "budget", None)
    if budget is None or not getattr(pipeline, "compresses", True):
        text = "full cache"
    else:
        size = f"{budget.tokens} tokens/head" if budget.tokens is not None else f"ratio {budget.ratio:g}"
        text = f"{size}, window {budget.window:g}" + (f", {budget.sinks} sinks" if budget.sinks else "")
    return f"{method} · {text}" if method else text


def cell_label(cell: str) -> str:
    """How a glyph cell of a reader image is written over its patch (a mark as ``[red]``)."""
    return f"[{cell.split(':', 1)[1]}]" if cell.startswith("mark:") else cell


def budget_heatmap(kept: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """``[L, Hkv]`` kept counts -> ``[L, Hkv]`` share of the prompt kept, in [0, 1]."""
    return (kept.float() / max(prompt_length, 1)).clamp(0, 1)


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


# ---------------------------------------------------------------------------------------------
# figures (matplotlib's object API on an Agg canvas: no pyplot, no global backend change)


def _figure(height: float, width: float = WIDTH) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # matplotlib: optional (dev extra)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def render(fig: Any) -> np.ndarray:
    """The figure as an ``[H, W, 3]`` uint8 RGB array."""
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def _wrap(title: str, width: int = 100) -> str:
    """A title wrapped to lines that fit the figure (long run names are common)."""
    return "\n".join(textwrap.fill(line, width, break_long_words=True) for line in title.splitlines())


def _colorbar(fig: Any, ax: Any, cmap: str, label: str) -> None:
    """A 0..1 colour bar of ``cmap`` at full opacity (the overlays themselves are translucent)."""
    from matplotlib.cm import ScalarMappable  # matplotlib: optional (dev extra)
    from matplotlib.colors import Normalize

    fig.colorbar(ScalarMappable(Normalize(0.0, 1.0), cmap), ax=ax, label=label, fraction=0.046, pad=0.03)


def _ticks(count: int, most: int = 16) -> list[int]:
    step = max(1, math.ceil(count / most))
    return list(range(0, count, step))


def heatmap_figure(share: torch.Tensor, title: str) -> Any:
    """Kept share ``[L, Hkv]`` in [0, 1] as a heatmap: layer on x, KV head on y, colour bar."""
    L, H = share.shape
    fig = _figure(height=min(1.9 + 0.28 * H, 6.0))
    ax = fig.add_subplot()
    im = ax.imshow(share.T.float().numpy(), aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0,
                   interpolation="nearest", origin="lower")  # fmt: skip
    ax.set_xlabel("layer")
    ax.set_ylabel("KV head")
    ax.set_xticks(_ticks(L, 24))
    ax.set_yticks(_ticks(H, 12))
    if L <= 16 and H <= 12:  # cells wide enough to print each value
        for layer in range(L):
            for head in range(H):
                value = float(share[layer, head])
                ax.text(layer, head, f"{value:.2f}", ha="center", va="center", fontsize=8,
                        color="white" if value < 0.6 else "black")  # fmt: skip
    fig.colorbar(im, ax=ax, label="kept / prompt tokens", fraction=0.05, pad=0.02)
    ax.set_title(_wrap(title), fontsize=10)
    return fig


def layer_curves_figure(
    share: torch.Tensor,
    title: str,
    budget: torch.Tensor | None = None,
    modalities: dict[str, torch.Tensor] | None = None,
) -> Any:
    """Kept share per layer: mean over KV heads (line) and min..max over heads (band).

    Args:
        share: ``[L, Hkv]`` kept / prompt tokens.
        budget: ``[L]`` layer budget / prompt tokens (dashed), or None.
        modalities: ``{name: [L]}`` kept share of each modality's tokens (dotted lines).
    """
    L = share.shape[0]
    layers = np.arange(L)
    fig = _figure(height=3.6)
    ax = fig.add_subplot()
    ax.fill_between(layers, share.min(1).values.numpy(), share.max(1).values.numpy(), alpha=0.25,
                    label="min..max over KV heads")  # fmt: skip
    ax.plot(layers, share.mean(1).numpy(), marker="o", markersize=3, label="mean over KV heads")
    if budget is not None:
        ax.plot(layers, budget.float().numpy(), linestyle="--", color="black", label="layer budget")
    for name, values in (modalities or {}).items():
        ax.plot(layers, values.float().numpy(), linestyle=":", marker=".", color=MODALITY_COLORS.get(name),
                label=f"{name} tokens")  # fmt: skip
    ax.set_xlabel("layer")
    ax.set_ylabel("kept / prompt tokens")
    ax.set_xticks(_ticks(L, 24))
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    ax.set_title(_wrap(title), fontsize=10)
    return fig


def patch_figure(
    image: Image.Image, kept_share: torch.Tensor, title: str, labels: Sequence[str] | None = None
) -> Any:
    """The image beside itself overlaid with each patch's kept share ``[rows, cols]`` in [0, 1]
    (share of KV heads that kept the patch's token), with a colour bar. ``labels`` (``rows *
    cols`` strings in reading order, e.g. the glyphs of a ``smollm2-reader`` image) are written
    on the overlay instead of the grey image, in a colour that reads on the patch's shade."""
    rows, cols = kept_share.shape
    pixels = np.asarray(image.convert("RGB"))
    height, width = pixels.shape[:2]
    aspect = height / max(width, 1)
    fig = _figure(height=min(max(2.6, 4.2 * aspect) + 0.6, 8.0), width=max(WIDTH, 8.0))
    left, right = fig.subplots(1, 2)
    left.imshow(pixels)
    left.set_title("image", fontsize=9)
    labelled = labels is not None and len(labels) == rows * cols
    if not labelled:  # grey underneath: the colours are the share (labels replace the glyphs)
        right.imshow(pixels.mean(-1), cmap="gray", vmin=0, vmax=255)
    right.imshow(kept_share.float().numpy(), cmap="magma", vmin=0.0, vmax=1.0, alpha=1.0 if labelled else 0.7,
                 extent=(0, width, height, 0), interpolation="nearest")  # fmt: skip
    right.set_title(f"kept share of each patch ({rows} x {cols} tokens)", fontsize=9)
    if rows * cols <= 400:  # patch boundaries
        right.vlines(np.linspace(0, width, cols + 1), 0, height, colors="white", linewidth=0.3, alpha=0.5)
        right.hlines(np.linspace(0, height, rows + 1), 0, width, colors="white", linewidth=0.3, alpha=0.5)
    if labelled:
        for i, text in enumerate(labels):  # type: ignore[arg-type]
            value = float(kept_share[i // cols, i % cols])
            x, y = (i % cols + 0.5) * width / cols, (i // cols + 0.5) * height / rows
            right.text(x, y, text, ha="center", va="center", fontsize=9, weight="bold",
                       color="black" if value > 0.5 else "white")  # fmt: skip
    for ax in (left, right):
        ax.set_xticks([])
        ax.set_yticks([])
    _colorbar(fig, right, "magma", "share of KV heads keeping the patch")
    fig.suptitle(_wrap(title), fontsize=10)
    return fig


def modality_figure(fractions: dict[str, list[float]], title: str) -> Any:
    """Kept fraction of each modality's tokens per layer (one line per modality)."""
    fig = _figure(height=3.4)
    ax = fig.add_subplot()
    for name, values in fractions.items():
        ax.plot(range(len(values)), values, marker="o", markersize=3, color=MODALITY_COLORS.get(name),
                label=f"{name} tokens")  # fmt: skip
    count = max((len(v) for v in fractions.values()), default=1)
    ax.set_xticks(_ticks(count, 24))
    ax.set_xlabel("layer")
    ax.set_ylabel("kept share of the modality's tokens")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(_wrap(title), fontsize=10)
    return fig


class Inspector:
    """Writes the views in the module docstring to a TensorBoard ``SummaryWriter``.

    Args:
        writer: the ``SummaryWriter`` (``TensorBoardLogger.experiment``).
        samples: number of batches (from the first) that get the detailed views.
        layers: layers whose kept image patches are drawn (negative counts from the end).
        label: the method and budget, for figure titles (:func:`run_label`).
    """

    def __init__(self, writer: Any, samples: int = 4, layers: Sequence[int] = (0, -1), label: str = ""):
        self.writer = writer
        self.samples = samples
        self.layers = tuple(layers)
        self.label = label
        self.kept = torch.zeros(0, len(MODALITY_NAMES))
        self.present = torch.zeros(0, len(MODALITY_NAMES))
        self.heatmap_sum: torch.Tensor | None = None
        self.heatmap_count = 0
        self.route_sums: dict[int, list[float]] = {}  # layer -> [sum of the metric, samples]

    def detailed(self, step: int) -> bool:
        """Whether batch ``step`` gets the detailed views (and its scores should be recorded)."""
        return step < self.samples

    def _figure(self, tag: str, fig: Any, step: int) -> None:
        self.writer.add_image(tag, render(fig), step, dataformats="HWC")

    def _title(self, text: str) -> str:
        return f"{self.label}\n{text}" if self.label else text

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
            self._budget_views(result, batch, step)
        for report in result.reports:
            self._histogram(f"scores/layer_{report.layer_idx}", report.scores, step)
            for name, scores in (getattr(report, "scorer_scores", None) or {}).items():
                self._histogram(f"scores/{name}/layer_{report.layer_idx}", scores, step)
        self._patches(result, batch, step, processor)

    def _budget_views(self, result: GenerationResult, batch: dict[str, Any], step: int) -> None:
        """The first sample's heatmap and per-layer curves."""
        length = int(result.prompt_lengths[0])
        share = budget_heatmap(result.kept[:, 0], length)  # [L, Hkv]
        sample_id = batch["samples"][0].id
        about = f"sample {sample_id}, {length} prompt tokens"
        heatmap = heatmap_figure(share, self._title(f"kept share per layer and KV head: {about}"))
        self._figure("budget/kept_layer_head", heatmap, step)
        reports = sorted(result.reports, key=lambda r: r.layer_idx)
        budget = None
        if len(reports) == share.shape[0] and all(r.budget is not None for r in reports):
            budget = torch.stack([r.budget[0].float().cpu() for r in reports]).clamp(max=length) / max(
                length, 1
            )
        modalities = self._modality_share(reports, batch) if len(reports) == share.shape[0] else {}
        curves = layer_curves_figure(share, self._title(f"kept share per layer: {about}"), budget, modalities)
        self._figure("budget/kept_per_layer", curves, step)

    @staticmethod
    def _modality_share(reports: list[Any], batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """``{name: [L]}`` kept share of each modality of the first sample (only with image or video)."""
        modality = batch["modality"][0].cpu()
        present = {m: int((modality == m).sum()) for m in MODALITY_NAMES}
        if not (present[IMAGE] or present[VIDEO]) or any(r.selection is None for r in reports):
            return {}
        out = {}
        for m, name in MODALITY_NAMES.items():
            if present[m]:
                values = []
                for report in reports:
                    kept = report.selection.kept_mask(modality.shape[0])[0].cpu()  # [Hkv, T]
                    values.append(float((kept & (modality == m)).sum()) / (present[m] * kept.shape[0]))
                out[name] = torch.tensor(values)
        return out

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
        sample = batch["samples"][0]
        for layer in dict.fromkeys(self.layers):
            if not -len(reports) <= layer < len(reports):
                continue
            report = reports[layer]
            share = report.selection.kept_mask(T)[0].float().cpu().mean(0)  # [T] share of heads keeping it
            cells = sample.meta.get("image_cells") or []  # smollm2-reader tasks: each image's glyphs
            for i, (first, rows, cols) in enumerate(grids):
                patch = share[first : first + rows * cols].view(rows, cols)
                title = self._title(f"layer {report.layer_idx}: sample {sample.id}, image {i}")
                labels = None
                if i < len(cells):
                    labels = [cell_label(c) for c in cells[i]] + [""] * (rows * cols - len(cells[i]))
                figure = patch_figure(sample.images[i], patch, title, labels)
                self._figure(f"patches/layer_{report.layer_idx}/image_{i}", figure, step)

    def finish(self) -> None:
        """Write the run-level views (modality fractions per layer, mean heatmap) and flush."""
        fractions = {}
        for m, name in MODALITY_NAMES.items():
            if self.present.numel() and bool((self.present[:, m] > 0).all()):
                fractions[name] = (self.kept[:, m] / self.present[:, m]).tolist()
                for layer, value in enumerate(fractions[name]):
                    self.writer.add_scalar(f"modality/kept_fraction_{name}", value, layer)
        if fractions:
            title = self._title("kept fraction of each modality's tokens per layer, all samples")
            self._figure("modality/kept_fraction_per_layer", modality_figure(fractions, title), 0)
        if self.heatmap_sum is not None and self.heatmap_count:
            mean = (self.heatmap_sum / self.heatmap_count).clamp(0, 1)
            title = self._title(f"mean kept share per layer and KV head over {self.heatmap_count} samples")
            self._figure("budget/kept_layer_head_mean", heatmap_figure(mean, title), 0)
        means = {layer: total / count for layer, (total, count) in sorted(self.route_sums.items())}
        for layer, value in means.items():
            self.writer.add_scalar("route/metric", value, layer)
            if layer - 1 in means:
                self.writer.add_scalar("route/metric_drop", means[layer - 1] - value, layer)
        self.writer.flush()
