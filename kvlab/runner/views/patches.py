"""The kept-patch view: an image beside the share of KV heads that kept each of its patch tokens.

Kept in a module of its own (the image side of the views changes with the datasets that carry
images): :func:`image_grids` finds each image's token grid in a prompt, :func:`patch_share`
reads a layer's selection over it, :func:`patch_figure` draws it; for the ``smollm2-reader``
tasks (``meta["image_cells"]``) each patch's glyph is written on it (:func:`cell_labels`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from PIL import Image

from kvlab.models.base import IMAGE, Batch, PromptProcessor
from kvlab.runner.views.figures import WIDTH, new_figure, styled


def merge_size(processor: Any) -> int | None:
    """The patches merged per side into one image token by ``processor``'s image adapter
    (:attr:`~kvlab.models.images.ImageAdapter.merge_size`; None without one)."""
    images = processor.images if isinstance(processor, PromptProcessor) else None
    return images.merge_size if images is not None else None


def image_grids(batch: Batch, b: int, merge: int | None) -> list[tuple[int, int, int]]:
    """``(first token, rows, cols)`` of each image of sample ``b`` in the prompt (empty if unknown).

    Qwen2-VL: the grid is ``image_grid_thw`` merged by ``merge`` (:func:`merge_size`). Others:
    the image's tokens split evenly per image and laid out as a square (a leading CLS token
    skipped when the count is a square plus one).
    """
    samples = batch.samples
    positions = (batch.modality[b] == IMAGE).nonzero().flatten().tolist()
    n_images = len(samples[b].images)
    if not positions or n_images == 0:
        return []
    grid_thw = batch.model_inputs.get("image_grid_thw")
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


def patch_share(selection: Any, length: int, first: int, rows: int, cols: int) -> torch.Tensor:
    """``[rows, cols]``: the share of sample 0's KV heads that kept each patch token of one image
    (multiples of ``1 / Hkv``)."""
    share = selection.kept_mask(length)[0].float().cpu().mean(0)  # [T]
    return share[first : first + rows * cols].view(rows, cols)


def cell_labels(cells: list[str], count: int) -> list[str]:
    """The ``count`` texts written over an image's patches from its reader glyph cells (reading
    order; a mark ``mark:red`` as ``[red]``; patches past the cells left blank). More cells than
    patches means the image is not cut into one patch per cell (another model's grid): refused."""
    if len(cells) > count:
        raise ValueError(
            f"{len(cells)} glyph cells cannot label {count} patches: not a one-cell-per-patch grid"
        )
    labels = [f"[{c.split(':', 1)[1]}]" if c.startswith("mark:") else c for c in cells]
    return labels + [""] * (count - len(labels))


def _share_colours(heads: int | None) -> tuple[Any, Any, list[float] | None]:
    """``(cmap, norm, ticks)``: with ``heads`` KV heads, one flat colour per possible share
    ``k / heads`` (so a patch shows exactly a colour of the bar); else a continuous 0..1 scale."""
    from matplotlib import colormaps  # matplotlib: imported when a figure is drawn (slow to import)
    from matplotlib.colors import BoundaryNorm, ListedColormap, Normalize

    base = colormaps["magma"]
    if heads is None or heads > 16:
        return base, Normalize(0.0, 1.0), None
    levels = [k / heads for k in range(heads + 1)]
    cmap = ListedColormap([base(0.08 + 0.9 * level) for level in levels])
    bounds = [-0.5 / heads, *[(k + 0.5) / heads for k in range(heads + 1)]]
    return cmap, BoundaryNorm(bounds, cmap.N), levels


@styled
def patch_figure(
    image: Image.Image,
    kept_share: torch.Tensor,
    title: str,
    heads: int | None = None,
    labels: list[str] | None = None,
) -> Any:
    """The image beside each patch's kept share ``[rows, cols]`` in [0, 1] (the share of KV heads
    that kept the patch's token), drawn opaque in the colour bar's own colours.

    The panel's title counts the patches some head kept; with ``heads`` given, each possible share
    ``k / heads`` is one flat colour of the bar. ``labels`` (``rows * cols`` texts in reading
    order, e.g. :func:`cell_labels` of a reader image) are written on the patches, black on the
    bar's light half and white on its dark half, so which glyphs survived reads at a glance.
    """
    rows, cols = kept_share.shape
    pixels = np.asarray(image.convert("RGB"))
    height, width = pixels.shape[:2]
    aspect = height / max(width, 1)
    fig = new_figure(height=min(2.2 * aspect + 1.3, 6.0), width=WIDTH)
    left, right = fig.subplots(1, 2)
    left.imshow(pixels)
    left.set_title("image")
    cmap, norm, levels = _share_colours(heads)
    shown = right.imshow(kept_share.float().numpy(), cmap=cmap, norm=norm, extent=(0, width, height, 0),
                         interpolation="nearest")  # fmt: skip
    kept = int((kept_share > 0).sum())
    right.set_title(f"kept {kept}/{rows * cols} patches")
    if rows * cols <= 400:  # patch boundaries
        right.vlines(np.linspace(0, width, cols + 1), 0, height, colors="white", linewidth=0.4, alpha=0.6)
        right.hlines(np.linspace(0, height, rows + 1), 0, width, colors="white", linewidth=0.4, alpha=0.6)
    if labels is not None:
        if len(labels) != rows * cols:
            raise ValueError(f"{len(labels)} labels for {rows} x {cols} patches")
        patch_points = right.get_position().width * fig.get_figwidth() * 72 / cols  # a patch's width
        for i, text in enumerate(labels):
            value = float(kept_share[i // cols, i % cols])
            x, y = (i % cols + 0.5) * width / cols, (i // cols + 0.5) * height / rows
            size = min(11.0, 0.8 * patch_points / (0.65 * max(len(text), 2)))  # the text fits its patch
            right.text(x, y, text, ha="center", va="center", weight="bold", fontsize=size,
                       color="black" if value > 0.5 else "white")  # fmt: skip
    for ax in (left, right):
        ax.set_xticks([])
        ax.set_yticks([])
    label = "share of KV heads\nkeeping the patch"
    bar = fig.colorbar(shown, ax=right, label=label, fraction=0.046, pad=0.03)
    if levels is not None:
        shown_ticks = levels if len(levels) <= 9 else levels[:: math.ceil(len(levels) / 8)]
        bar.set_ticks(shown_ticks, labels=[f"{v:.2g}" for v in shown_ticks])
    fig.suptitle(title)
    return fig
