"""``smollm2-reader``: a LLaVA whose image tokens carry what the image shows, built in closed form.

A synthetic testbed for KV-cache compression, not a general VLM. SmolLM2-135M-Instruct (trained)
is the language model, as in ``smollm2-llava``; the vision path is constructed so that a patch
showing one glyph of :data:`kvlab.data.glyphs.GLYPHS` (a word, a digit, a punctuation mark, a
coloured mark or a blank) becomes, after the projector, an embedding close to SmolLM2's input
embedding of the token the glyph shows. Images are 160 x 160 grids of 4 x 4 cells of 40 px
(:mod:`kvlab.data.glyphs`), one cell per patch, so an image is 16 tokens in reading order and
the trained LM reads it as it reads text, at image positions and as the image modality.

The vision path (no training):

1. **Patch embedding** (CLIP's bias-free convolution, width :data:`VISION_WIDTH` = 643): 640
   channels copy the grey level of each pixel of the cell's text band (rows 12..27 of 40, where
   glyphs are drawn), two the cell's mean chroma (R - G, G - B: zero for any grey pixel) and one
   its mean grey level (x :data:`COLOUR_GAIN`). The position embedding subtracts white, so a blank
   cell is exactly 0.
2. **CLIP's pre-layernorm** (eps 1e-5, CLIP's own: a glyph's features do not depend on how dark
   its ink is), then one encoder layer whose projections are zero: an exact identity. LLaVA takes
   its output (``vision_feature_layer`` -1) without the CLS token.
3. **Projector**, LLaVA's ``linear_2(gelu(linear_1(x)))`` (:func:`projector_weights`): a ridge
   least-squares read-out from the tower's features of every glyph, rendered in four inks plus
   noisy copies (the black rendering, which the tasks draw, weighted x :data:`CLEAN_WEIGHT`), to
   the SmolLM2 embedding of :func:`kvlab.data.glyphs.cell_text`, carried by pass-through units
   kept far above 0 (where GELU is the identity), and four colour detectors
   (:func:`colour_detectors`), the nonlinearity that tells the mark colours apart.

The fit runs once (about 4 s) in float64 on one thread with a seeded noise generator, and its
vision weights are cached in ``$KVLAB_CACHE/models/smollm2-reader-<digest>/`` (``digest``: of the
glyph set and the construction constants, so a change rebuilds), like the SmolLM2 conversion;
later loads read them. ``python -m kvlab.models.scaffolding.reader --rebuild`` builds it again and
prints the fit report (also in ``fit.json`` there). ``docs/models.md`` gives the fit's accuracy.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import LlavaForConditionalGeneration

from kvlab.data import glyphs
from kvlab.models.common import one_thread, seeded
from kvlab.models.scaffolding import graft, smollm2
from kvlab.models.vlm import llava_images

#: bump when the construction changes (part of the cache digest)
BUILD_VERSION = 1
SEED = 0
BAND = (12, 28)  # pixel rows of a cell copied at full resolution (glyphs are drawn at rows 14..24)
BAND_FEATURES = (BAND[1] - BAND[0]) * glyphs.CELL
VISION_WIDTH = BAND_FEATURES + 3
COLOUR_GAIN = 4.0
LAYER_NORM_EPS = 1e-5  # CLIP's own: the layernorm makes a glyph's features independent of its ink
INKS = ((0, 0, 0), (70, 70, 70), (20, 20, 120), (110, 20, 20))
NOISY_COPIES = 3
NOISE = 8.0  # pixel noise std, in 0..255 units
CLEAN_WEIGHT = 10.0
RIDGE = 1e-6  # times the mean diagonal of the normal equations
DETECTOR_MARGIN = 8.0  # GELU(-8) = -5e-15, GELU(8) = 8
FIT_FILES = ("vision.safetensors", "fit.json")


def digest() -> str:
    """Eight hex digits over the glyph set and every constant of the construction."""
    facts = [BUILD_VERSION, SEED, glyphs.GLYPHS, glyphs.CELL, glyphs.GRID, glyphs.MARK, BAND, COLOUR_GAIN,
             LAYER_NORM_EPS, INKS, NOISY_COPIES, NOISE, CLEAN_WEIGHT, RIDGE, DETECTOR_MARGIN]  # fmt: skip
    return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:8]


def cache_dir() -> Path:
    """Where the fitted vision weights live (they may not exist yet)."""
    return smollm2.kvlab_cache_root() / "models" / f"smollm2-reader-{digest()}"


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in FIT_FILES)


def reader_config(tokenizer: Any) -> Any:
    """The ``LlavaConfig``: SmolLM2's dimensions, a one-layer CLIP tower of width
    :data:`VISION_WIDTH` over 40 px patches of 160 px images (16 tokens), a linear projector."""
    return graft.cell_llava_config(
        tokenizer, glyphs.IMAGE_SIZE, glyphs.CELL, hidden_size=VISION_WIDTH, intermediate_size=1,
        num_hidden_layers=1, projection_dim=VISION_WIDTH, layer_norm_eps=LAYER_NORM_EPS,
    )  # fmt: skip


# ---- the closed-form tower ----------------------------------------------------------------------
def set_tower(vlm: torch.nn.Module, image_mean: list[float], image_std: list[float]) -> None:
    """Write the analytic vision tower into ``vlm.model.vision_tower`` (in place, float32).

    ``image_mean``/``image_std``: the image processor's per-channel normalisation, undone by the
    weights so that a band channel reads ``mean_c(pixel_c) / 255 - 1`` (0 on white), the two
    chroma channels ``COLOUR_GAIN`` x the cell's mean ``(R - G) / 255`` and ``(G - B) / 255`` and
    the last ``COLOUR_GAIN`` x the cell's mean ``mean_c(pixel_c) / 255 - 1``.
    """
    tower = vlm.model.vision_tower
    mean = torch.tensor(image_mean, dtype=torch.float64)
    std = torch.tensor(image_std, dtype=torch.float64)
    P = glyphs.CELL
    weight = torch.zeros(VISION_WIDTH, 3, P, P, dtype=torch.float64)  # [out, C, y, x]
    rows = torch.arange(BAND[0], BAND[1]).repeat_interleave(P)
    cols = torch.arange(P).repeat(BAND[1] - BAND[0])
    for c in range(3):
        weight[torch.arange(BAND_FEATURES), c, rows, cols] = std[c] / 3
    # chroma (zero for any grey pixel, so text never moves them) and the cell's mean grey level
    area = P * P
    for k, (plus, minus) in enumerate(((0, 1), (1, 2))):
        weight[BAND_FEATURES + k, plus] = COLOUR_GAIN * std[plus] / area
        weight[BAND_FEATURES + k, minus] = -COLOUR_GAIN * std[minus] / area
    weight[BAND_FEATURES + 2] = COLOUR_GAIN * std[:, None, None].expand(3, P, P) / (3 * area)
    position = torch.empty(VISION_WIDTH, dtype=torch.float64)
    position[:BAND_FEATURES] = mean.mean() - 1  # pixel p_c/255 = std_c x_c + mean_c; white -> 0
    position[BAND_FEATURES] = COLOUR_GAIN * (mean[0] - mean[1])
    position[BAND_FEATURES + 1] = COLOUR_GAIN * (mean[1] - mean[2])
    position[BAND_FEATURES + 2] = COLOUR_GAIN * (mean.mean() - 1)
    with torch.no_grad():
        tower.embeddings.patch_embedding.weight.copy_(weight.float())
        tower.embeddings.class_embedding.zero_()
        positions = tower.embeddings.position_embedding.weight  # [1 + patches, width]
        positions.copy_(position.float().expand_as(positions))
        positions[0].zero_()  # the CLS token, dropped by LLaVA
        for norm in (tower.pre_layrnorm, tower.post_layernorm):
            norm.weight.fill_(1.0)
            norm.bias.zero_()
        for name, param in tower.encoder.named_parameters():
            if "layer_norm" in name:
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                param.zero_()  # q/k/v/out and fc1/fc2: the layer adds 0 to its input


def training_images(generator: torch.Generator) -> tuple[list[Any], list[str], torch.Tensor]:
    """Every glyph in every ink of :data:`INKS`, plus :data:`NOISY_COPIES` noisy copies of each
    non-blank glyph's black rendering (pixel noise of std :data:`NOISE` inside its cell).

    Returns ``(images, cells, weights)``: the 160-px images (16 cells each, blank-padded),
    ``cells[i]`` the glyph of the i-th patch in image order, ``weights [len(cells)]`` its weight
    in the fit (:data:`CLEAN_WEIGHT` for the black rendering the tasks use). The noise is drawn
    from ``generator`` cell by cell in a fixed order.
    """
    entries = [(glyph, ink, False, CLEAN_WEIGHT if ink == glyphs.INK else 1.0)
               for glyph in glyphs.GLYPHS for ink in INKS]  # fmt: skip
    entries += [
        (glyph, glyphs.INK, True, 1.0) for glyph in glyphs.GLYPHS if glyph for _ in range(NOISY_COPIES)
    ]
    per, size = glyphs.CELLS_PER_IMAGE, glyphs.CELL
    images, cells, weights = [], [], []
    for start in range(0, len(entries), per):
        chunk = entries[start : start + per]
        image = Image.new("RGB", (glyphs.IMAGE_SIZE, glyphs.IMAGE_SIZE), glyphs.BACKGROUND)
        for i, (glyph, ink, _, _) in enumerate(chunk):
            glyphs.draw_cell(image, glyph, i // glyphs.GRID, i % glyphs.GRID, ink)
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float64).copy())
        for i, (_, _, noisy, _) in enumerate(chunk):
            if noisy:
                y, x = (i // glyphs.GRID) * size, (i % glyphs.GRID) * size
                noise = torch.randn(size, size, 3, generator=generator, dtype=torch.float64) * NOISE
                pixels[y : y + size, x : x + size] += noise
        image = Image.fromarray(pixels.round().clamp(0, 255).to(torch.uint8).numpy(), "RGB")
        images.append(image)
        cells += [entry[0] for entry in chunk] + [""] * (per - len(chunk))
        weights += [entry[3] for entry in chunk] + [1.0] * (per - len(chunk))
    return images, cells, torch.tensor(weights, dtype=torch.float64)


def tower_features(vlm: torch.nn.Module, config: Any, images: list[Any], chunk: int = 64) -> torch.Tensor:
    """``[len(images) * 16, VISION_WIDTH]`` float64: what the projector receives for each patch."""
    adapter = llava_images(config)
    out = []
    for start in range(0, len(images), chunk):
        pixels = adapter.process(images[start : start + chunk])[0]["pixel_values"]
        with torch.no_grad():
            hidden = vlm.model.vision_tower(pixels, output_hidden_states=True).hidden_states[-1]
        out.append(hidden[:, 1:].reshape(-1, VISION_WIDTH).double())
    return torch.cat(out)


def colour_detectors(
    features: torch.Tensor, cells: list[str]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One detector per mark colour: ``gelu(scale * (u . x - threshold))``, about 0 on every
    patch but that colour's marks.

    A uniform square's features are affine in its RGB, so a linear read-out cannot tell four
    colours and white (a blank) apart; these detectors give the projector the missing
    nonlinearity. ``u`` is the ridge least-squares direction that reads the colour's indicator
    off the features; the threshold is midway between the lowest projection of that colour's
    patches and the highest of all others, and the scale puts both at least
    :data:`DETECTOR_MARGIN` from 0.

    Args:
        features: ``[N, F]`` the tower's features; cells: ``[N]`` each patch's glyph.

    Returns:
        ``directions [K, F]``, ``thresholds [K]``, ``scales [K]`` (K = mark colours).
    """
    indicators = torch.tensor(
        [[float(cell == mark) for mark in glyphs.MARKS] for cell in cells], dtype=torch.float64
    )
    directions, offsets = ridge_fit(features, indicators, torch.ones(len(cells), dtype=torch.float64))
    thresholds, scales = [], []
    for k, mark in enumerate(glyphs.MARKS):
        mine = indicators[:, k] > 0
        projection = features @ directions[k]
        low, high = float(projection[mine].min()), float(projection[~mine].max())
        if low <= high:
            raise RuntimeError(f"{mark} cannot be told apart from the other glyphs ({low:.3g} <= {high:.3g})")
        thresholds.append((low + high) / 2)
        scales.append(2 * DETECTOR_MARGIN / (low - high))
    del offsets  # the threshold replaces the fitted offset
    return (
        directions,
        torch.tensor(thresholds, dtype=torch.float64),
        torch.tensor(scales, dtype=torch.float64),
    )


def detector_outputs(
    features: torch.Tensor, directions: torch.Tensor, thresholds: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """``[N, K]`` the detectors' GELU outputs, as the projector computes them."""
    return torch.nn.functional.gelu(scales * (features @ directions.T - thresholds))


def ridge_fit(
    inputs: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted ridge least squares ``targets ~ inputs @ W.T + b`` (float64; the bias unpenalised).

    Args:
        inputs: ``[N, F]``; targets: ``[N, D]``; weights: ``[N]``.

    Returns:
        ``W [D, F]``, ``b [D]``.
    """
    X = torch.cat([inputs, torch.ones(len(inputs), 1, dtype=torch.float64)], dim=1)  # [N, F + 1]
    Xw = X * weights[:, None]
    gram = X.T @ Xw
    penalty = RIDGE * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=torch.float64)
    penalty[-1, -1] = 0
    solution = torch.linalg.solve(gram + penalty, Xw.T @ targets)  # [F + 1, D]
    return solution[:-1].T.contiguous(), solution[-1].contiguous()


def projector_weights(
    features: torch.Tensor, cells: list[str], targets: torch.Tensor, weights: torch.Tensor
) -> dict[str, torch.Tensor]:
    """LLaVA's projector ``linear_2(gelu(linear_1(x)))`` computing ``A x + Q h(x) + b``.

    ``h`` are the :func:`colour_detectors` and ``A``, ``Q``, ``b`` the :func:`ridge_fit` of the
    targets on ``[x, h(x)]``. ``linear_1`` holds ``D - K`` pass-through units ``B x + C`` (``A =
    P B`` by SVD, the K weakest directions of ``A`` dropped; ``C`` keeps them at least 8 above 0,
    where GELU is the identity in float32) and the K detectors; ``linear_2 = [P | Q]`` with bias
    ``b - P C``.

    Returns:
        the projector's state (``linear_1.weight [D, F]``, ``linear_1.bias``, ``linear_2.weight
        [D, D]``, ``linear_2.bias``) in float64 and ``report`` facts.
    """
    directions, thresholds, scales = colour_detectors(features, cells)
    detected = detector_outputs(features, directions, thresholds, scales)
    W, b = ridge_fit(torch.cat([features, detected], dim=1), targets, weights)
    K = len(glyphs.MARKS)
    A, Q = W[:, :-K], W[:, -K:]
    U, S, Vh = torch.linalg.svd(A, full_matrices=False)
    keep = A.shape[0] - K
    P, B = U[:, :keep], S[:keep, None] * Vh[:keep]
    shift = 8.0 + 2 * float((features @ B.T).abs().max())
    return {
        "linear_1.weight": torch.cat([B, scales[:, None] * directions]),
        "linear_1.bias": torch.cat([torch.full((keep,), shift, dtype=torch.float64), -scales * thresholds]),
        "linear_2.weight": torch.cat([P, Q], dim=1),
        "linear_2.bias": b - P.sum(1) * shift,
        "dropped_singular_value": S[keep:].max(),
    }


def cell_token_ids(tokenizer: Any) -> list[int]:
    """The token id each glyph of :data:`GLYPHS` shows (each text of :func:`cell_text` is one token)."""
    return graft.single_token_ids(tokenizer, [glyphs.cell_text(glyph) for glyph in glyphs.GLYPHS])


def _glyph_sheets(
    ink: tuple[int, int, int], offset: tuple[int, int], noise: float, generator: torch.Generator
) -> list[Any]:
    """Every glyph once, 16 to an image, in ``ink``, shifted by ``offset``, with pixel noise."""
    sheets = []
    for start in range(0, len(glyphs.GLYPHS), glyphs.CELLS_PER_IMAGE):
        image = Image.new("RGB", (glyphs.IMAGE_SIZE, glyphs.IMAGE_SIZE), glyphs.BACKGROUND)
        for i, glyph in enumerate(glyphs.GLYPHS[start : start + glyphs.CELLS_PER_IMAGE]):
            glyphs.draw_cell(image, glyph, i // glyphs.GRID, i % glyphs.GRID, ink, offset)
        if noise:
            pixels = torch.from_numpy(np.asarray(image, dtype=np.float64).copy())
            pixels += torch.randn(pixels.shape, generator=generator, dtype=torch.float64) * noise
            image = Image.fromarray(pixels.round().clamp(0, 255).to(torch.uint8).numpy(), "RGB")
        sheets.append(image)
    return sheets


def evaluate_fit(vlm: torch.nn.Module, config: Any, ids: list[int]) -> dict[str, Any]:
    """How well each glyph lands on its token, per rendering: top-1 nearest SmolLM2 embedding
    (L2, over the 49152 text tokens), relative error ``|e - E| / |E|``, the glyphs misread.

    Renderings: ``clean`` (black, what the tasks draw: the fit's target), each other ink of
    :data:`INKS`, ``noise`` (black, pixel noise of std :data:`NOISE` everywhere, blanks included,
    a generator seed the fit never saw) and ``offset_1px`` (shifted right and down by 1 px: the
    read-out is position-specific, the renderer never shifts).
    """
    adapter = llava_images(config)
    table = vlm.get_input_embeddings().weight[: smollm2.load_config().vocab_size].detach()
    target = table[ids]
    generator = torch.Generator().manual_seed(SEED + 1)
    conditions = {"clean": (glyphs.INK, (0, 0), 0.0)}
    conditions.update({f"ink_{r}_{g}_{b}": ((r, g, b), (0, 0), 0.0) for r, g, b in INKS[1:]})
    conditions.update({"noise": (glyphs.INK, (0, 0), NOISE), "offset_1px": (glyphs.INK, (1, 1), 0.0)})
    report: dict[str, Any] = {"glyphs": len(ids)}
    for name, (ink, offset, noise) in conditions.items():
        pixels = adapter.process(_glyph_sheets(ink, offset, noise, generator))[0]["pixel_values"]
        with torch.no_grad():
            embedded = vlm.model.get_image_features(pixel_values=pixels).pooler_output
        embedded = torch.cat(list(embedded)).reshape(-1, table.shape[1])[: len(ids)]
        nearest = torch.cdist(embedded, table).argmin(-1)
        rel = (embedded - target).norm(dim=-1) / target.norm(dim=-1)
        wrong = [glyphs.GLYPHS[i] for i in range(len(ids)) if int(nearest[i]) != ids[i]]
        report[name] = {
            "nearest_token_accuracy": round(1 - len(wrong) / len(ids), 4),
            "relative_error_mean": round(float(rel.mean()), 4),
            "relative_error_max": round(float(rel.max()), 4),
            "misread": wrong[:20],
        }
    return report


def construct(dst: Path) -> dict[str, Any]:
    """Build the reader's vision weights into ``dst`` (``vision.safetensors``, ``fit.json``)."""
    started = time.perf_counter()
    with one_thread():  # the same float64 reductions in every process
        tokenizer = graft.vlm_tokenizer("llava")
        config = reader_config(tokenizer)
        vlm = graft.build_grafted(LlavaForConditionalGeneration, config, SEED, torch.float32)
        processor = llava_images(config).image_processor
        set_tower(vlm, list(processor.image_mean), list(processor.image_std))
        generator = torch.Generator().manual_seed(SEED)
        images, cells, weights = training_images(generator)
        features = tower_features(vlm, config, images)
        ids = cell_token_ids(tokenizer)
        index = {glyph: i for i, glyph in enumerate(glyphs.GLYPHS)}
        table = vlm.get_input_embeddings().weight.detach().double()
        targets = table[[ids[index[cell]] for cell in cells]]
        fitted = projector_weights(features, cells, targets, weights)
        dropped = float(fitted.pop("dropped_singular_value"))
        projector = vlm.model.multi_modal_projector
        with torch.no_grad():
            for name, value in fitted.items():
                projector.get_parameter(name).copy_(value.float())
        report = evaluate_fit(vlm, config, ids)
        report["dropped_singular_value"] = dropped
    state = {
        name: tensor.detach().contiguous()
        for name, tensor in vlm.state_dict().items()
        if name.startswith(("model.vision_tower.", "model.multi_modal_projector."))
    }
    save_file(state, dst / "vision.safetensors", metadata={"digest": digest()})
    report.update(digest=digest(), patches=len(cells), seconds=round(time.perf_counter() - started, 1))
    (dst / "fit.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def ensure_built() -> Path:
    """The cache directory with the fitted vision weights, constructing them first if needed."""
    target = cache_dir()
    if _is_complete(target):
        return target
    return smollm2.convert_once(target, construct, _is_complete)


def load_reader(dtype: torch.dtype) -> torch.nn.Module:
    """``smollm2-reader``: the grafted LLaVA with the cached vision weights, in ``dtype``, eval mode."""
    state = load_file(ensure_built() / "vision.safetensors")
    config = reader_config(graft.vlm_tokenizer("llava"))
    with seeded(SEED):  # the vision part's throwaway initialisation draws the same numbers every time
        vlm = graft.build_grafted(LlavaForConditionalGeneration, config, SEED, torch.float32)
    missing, unexpected = vlm.load_state_dict(state, strict=False)
    vision = [k for k in missing if not k.startswith("model.language_model.") and k != "lm_head.weight"]
    if unexpected or vision:
        raise RuntimeError(
            f"smollm2-reader's vision weights do not fit: missing {vision}, unexpected {unexpected}"
        )
    return vlm.to(dtype).eval()


def main(args: list[str] | None = None) -> None:
    """``python -m kvlab.models.scaffolding.reader [--rebuild]``: build (or rebuild) and report."""
    parser = argparse.ArgumentParser(description="Build the smollm2-reader vision weights (cached).")
    parser.add_argument("--rebuild", action="store_true", help="delete the cached weights and fit again")
    ns = parser.parse_args(args)
    if ns.rebuild:
        shutil.rmtree(cache_dir(), ignore_errors=True)
    path = ensure_built()
    print(f"{path}\n{(path / 'fit.json').read_text()}", end="")


if __name__ == "__main__":
    main()
