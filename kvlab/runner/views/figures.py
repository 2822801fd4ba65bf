"""The figures of the TensorBoard views, drawn to be read at TensorBoard's default card size.

matplotlib's object API on an Agg canvas (no pyplot state, no global backend change), rendered
to RGB arrays 560 px wide with 13-14 pt text, so TensorBoard's default card, which shrinks the
image to about 360 px, still shows legible titles and ticks. Titles are two short lines (method
and budget, then sample:
:func:`kvlab.runner.views.labels.run_label`); scales are fitted to the data and stated in the
colour bar's label or the axis, never a fixed 0..1 that leaves the data in one end. A heatmap
whose cells all hold one value says so in words (``uniform: 0.24``) instead of a solid block.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import wraps
from typing import Any

import numpy as np
import torch
from PIL import Image

DPI = 100
WIDTH = 5.6  # inches: 560 px at DPI
#: matplotlib settings of every view (fonts sized for a card that shrinks the image ~1.6x)
STYLE = {
    "font.size": 13,
    "axes.titlesize": 13,
    "axes.labelsize": 13,
    "xtick.labelsize": 12,
    "ytick.labelsize": 12,
    "legend.fontsize": 11,
    "figure.titlesize": 13,
}
MODALITY_COLORS = {"text": "tab:green", "image": "tab:red", "video": "tab:purple"}  # the same in every figure
#: cells at most this many wide and high get their value printed (wider ones would be unreadable)
PRINTED_CELLS = (16, 8)


def cells_printed(layers: int, heads: int) -> bool:
    """Whether a heatmap of ``layers x heads`` cells prints each value (:data:`PRINTED_CELLS`)."""
    return layers <= PRINTED_CELLS[0] and heads <= PRINTED_CELLS[1]


def styled(draw: Callable[..., Any]) -> Callable[..., Any]:
    """Build the figure under :data:`STYLE` (fonts are fixed when the text is created)."""

    @wraps(draw)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from matplotlib import rc_context  # matplotlib: imported when a figure is drawn (slow to import)

        with rc_context(STYLE):
            return draw(*args, **kwargs)

    return wrapper


def new_figure(height: float, width: float = WIDTH) -> Any:
    """An empty figure (constrained layout) on its own Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # matplotlib: optional (dev extra)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def card_figure(entries: int = 1, columns: int = 2) -> tuple[Any, Any]:
    """``(figure, axes)`` of one comparison card: the width of every view, the height grown by one
    legend row per ``columns`` of the ``entries`` the legend below the axes will name."""
    fig = new_figure(height=3.9 + 0.28 * math.ceil(max(entries, 1) / columns))
    return fig, fig.add_subplot()


def legend_below(fig: Any, ax: Any, note: str | None = None, columns: int = 2) -> Any:
    """The legend of ``ax``'s lines inside the figure, below the axes (constrained layout makes
    room): a legend outside the figure is cut from the image TensorBoard shows. ``note`` is the
    legend's title (e.g. that equal points were drawn side by side)."""
    handles, labels = ax.get_legend_handles_labels()
    return fig.legend(handles, labels, loc="outside lower center", ncols=min(columns, max(len(labels), 1)),
                      frameon=False, title=note, title_fontsize=10)  # fmt: skip


def save_png(image: np.ndarray, path: Any) -> None:
    """A rendered figure (:func:`render`) as a PNG file: the very pixels TensorBoard shows."""
    Image.fromarray(image).save(path)


def render(fig: Any) -> np.ndarray:
    """The figure as an ``[H, W, 3]`` uint8 RGB array."""
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def ticks(count: int, most: int = 12) -> list[int]:
    """At most ``most`` evenly spaced tick positions over ``range(count)``."""
    step = max(1, math.ceil(count / most))
    return list(range(0, count, step))


def fitted_range(values: torch.Tensor, floor: float = 0.0) -> tuple[float, float, bool]:
    """``(low, high, uniform)``: the data's range for a colour scale; a range of one value is
    widened by 0.05 each way (never below ``floor``) and reported as uniform."""
    low, high = float(values.min()), float(values.max())
    if high - low < 1e-6:
        return max(low - 0.05, floor), low + 0.05, True
    return low, high, False


@styled
def heatmap_figure(share: torch.Tensor, title: str, label: str = "kept / prompt tokens") -> Any:
    """``[L, Hkv]`` values as a heatmap: layer on x, KV head on y.

    The colour scale spans the data's own range and the colour bar says so; the cells' values are
    printed when there are at most 16 layers and 8 heads, and a uniform map says ``uniform: v``.
    """
    L, H = share.shape
    low, high, uniform = fitted_range(share)
    fig = new_figure(height=min(2.9 + 0.22 * H, 5.0))
    ax = fig.add_subplot()
    im = ax.imshow(share.T.float().numpy(), aspect="auto", cmap="viridis", vmin=low, vmax=high,
                   interpolation="nearest", origin="lower")  # fmt: skip
    ax.set_xlabel("layer")
    ax.set_ylabel("KV head")
    ax.set_xticks(ticks(L, 10))
    ax.set_yticks(ticks(H, 8))
    if uniform:
        ax.text(0.5, 0.5, f"uniform: {float(share.flatten()[0]):.2f}", transform=ax.transAxes, ha="center",
                va="center", fontsize=15, color="white", weight="bold",
                bbox={"facecolor": "black", "alpha": 0.45, "edgecolor": "none"})  # fmt: skip
    elif cells_printed(L, H):
        middle = (low + high) / 2
        for layer in range(L):
            for head in range(H):
                value = float(share[layer, head])
                ax.text(layer, head, f"{value:.2f}", ha="center", va="center", fontsize=9,
                        color="white" if value < middle else "black")  # fmt: skip
    scale = f"{float(share.flatten()[0]):.2f} everywhere" if uniform else f"{low:.2f} to {high:.2f}"
    fig.colorbar(im, ax=ax, label=f"{label}\n(scale: {scale})", fraction=0.05, pad=0.02)
    ax.set_title(title)
    return fig


def upper_limit(*arrays: np.ndarray) -> float:
    """A y-axis top fitted to the data: 15% above its largest value (at least 0.05, at most 1.05
    for shares that reach 1)."""
    top = max((float(np.nanmax(a)) for a in arrays if a.size), default=1.0)
    return min(max(top * 1.15, 0.05), 1.05) if top <= 1.0 else top * 1.1


@styled
def layer_curves_figure(
    share: torch.Tensor,
    title: str,
    budget: torch.Tensor | None = None,
    modalities: dict[str, torch.Tensor] | None = None,
    note: str | None = None,
) -> Any:
    """Kept share per layer: mean over KV heads (line) and min..max over heads (band).

    Args:
        share: ``[L, Hkv]`` kept / prompt tokens.
        budget: ``[L]`` layer budget / prompt tokens (dashed), or None.
        modalities: ``{name: [L]}`` kept share of each modality's tokens (dotted lines).
        note: a warning printed in the plot (the sample's budget overshoot).
    """
    L = share.shape[0]
    layers = np.arange(L)
    fig = new_figure(height=4.0)
    ax = fig.add_subplot()
    low, high, mean = share.min(1).values.numpy(), share.max(1).values.numpy(), share.mean(1).numpy()
    ax.fill_between(layers, low, high, alpha=0.25, label="min..max over heads")
    ax.plot(layers, mean, marker="o", markersize=3, label="mean over heads")
    drawn = [high]
    if budget is not None:
        # on top of the mean: a uniform budget lies exactly on it
        dashed = {"linestyle": "--", "color": "black", "linewidth": 1.6, "zorder": 3}
        ax.plot(layers, budget.float().numpy(), label="layer budget", **dashed)
        drawn.append(budget.float().numpy())
    for name, values in (modalities or {}).items():
        ax.plot(layers, values.float().numpy(), linestyle=":", marker=".", color=MODALITY_COLORS.get(name),
                label=f"{name} tokens")  # fmt: skip
        drawn.append(values.float().numpy())
    ax.set_xlabel("layer")
    ax.set_ylabel("kept / prompt tokens")
    ax.set_xticks(ticks(L, 10))
    ax.set_ylim(0, upper_limit(*drawn))
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    if note:
        box = {"facecolor": "white", "alpha": 0.85, "edgecolor": "darkred"}
        ax.text(0.02, 0.04, note, transform=ax.transAxes, ha="left", va="bottom", color="darkred",
                fontsize=11, bbox=box)  # fmt: skip
    ax.set_title(title)
    return fig


@styled
def modality_figure(fractions: dict[str, list[float]], title: str) -> Any:
    """Kept fraction of each modality's tokens per layer (one line per modality)."""
    fig = new_figure(height=3.8)
    ax = fig.add_subplot()
    for name, values in fractions.items():
        ax.plot(range(len(values)), values, marker="o", markersize=3, color=MODALITY_COLORS.get(name),
                label=f"{name} tokens")  # fmt: skip
    count = max((len(v) for v in fractions.values()), default=1)
    ax.set_xticks(ticks(count, 10))
    ax.set_xlabel("layer")
    ax.set_ylabel("kept / present tokens")
    ax.set_ylim(0, upper_limit(*(np.asarray(v, dtype=float) for v in fractions.values())))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title)
    return fig


@styled
def route_figure(metric: dict[int, float], title: str) -> Any:
    """A routed pipeline's route metric per layer (mean over the samples where the layer evaluated
    it) and its drop from the layer before (DAVID's NCAR theta_m and Delta_m)."""
    fig = new_figure(height=3.8)
    ax = fig.add_subplot()
    layers = sorted(metric)
    ax.plot(layers, [metric[layer] for layer in layers], marker="o", markersize=3, label="route metric")
    drops = [(layer, metric[layer - 1] - metric[layer]) for layer in layers if layer - 1 in metric]
    if drops:
        ax.plot(*zip(*drops, strict=True), marker=".", linestyle="--", label="drop from the layer before")
    ax.set_xlabel("layer")
    ax.set_ylabel("metric (mean over samples)")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title)
    return fig
