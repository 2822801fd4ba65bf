"""``smollm2-ocr``: a LLaVA whose vision tower reads printed words wherever they sit in a patch.

A synthetic testbed for KV-cache compression, not a general VLM. SmolLM2-135M-Instruct (trained)
is the language model; images are 640 x 640 scenes of 16 x 16 cells of 40 px
(:mod:`kvlab.data.scenes`), one cell per patch, so an image is 256 tokens in reading order. A
patch that shows one glyph of :data:`kvlab.data.scenes.GLYPHS` (a word, a digit, a punctuation
mark) becomes, after the projector, SmolLM2's input embedding of the glyph's token; a patch
without text (background, a texture, an icon) the embedding of four spaces
(:data:`kvlab.data.scenes.BACKGROUND_TEXT`).

Unlike ``smollm2-reader`` (a read-out fitted to one rendering per glyph, which fails when a glyph
moves by a pixel), the tower's features do not depend on where the ink sits in the patch, and
the reading is trained on many renderings (both fonts, every size, ink and shift the scenes
draw, over textured and noisy backgrounds). CLIP's own layers and LLaVA's projector, in order:

1. **Fourier coefficients** (the bias-free patch convolution, :func:`fourier_basis`): for each
   frequency of :func:`frequencies` (``|f_y|, |f_x| <= MAX_FREQUENCY``, one of each conjugate
   pair, no constant term) the real and imaginary parts of the 2-D DFT of the patch's grey level,
   each twice with opposite signs (so the channels' mean is exactly 0 for the layernorm). A glyph
   shifted inside its patch, its ink staying inside, is a circular shift of the patch, which only
   moves the coefficients' phases; without the constant term the background's level drops out.
2. **CLIP's pre-layernorm**: the coefficients over their root mean square (the ink's contrast
   drops out).
3. **Encoder layer 1** (attention projections zero): its MLP writes the power spectrum
   ``|X(f)|^2 = re^2 + im^2`` into channels of its own, through ``gelu(a u) + gelu(-a u) =
   a u erf(a u / sqrt 2) ~ sqrt(2 / pi) a^2 u^2`` at the small gain :data:`SQUARE_GAIN`. A circular
   shift leaves the power spectrum unchanged: the features are shift-invariant by construction.
4. **Encoder layer 2** (attention zero): its MLP is a trained classifier (:func:`train_reader`,
   one GELU layer of :data:`CLASSIFIER_WIDTH` units) from the layernormed spectrum to one score per
   glyph, written into channels of its own.
5. **LLaVA's projector** ``linear_2(gelu(linear_1(x)))`` in closed form: per glyph a detector
   ``d = (gelu(b z) - gelu(b z - b)) / b`` (``b`` = :data:`DETECTOR_GAIN`), 0 for a score
   ``z <= 0`` and 1 for ``z >= 1`` (a ramp between), and ``linear_2`` sums the glyphs' token
   embeddings weighted by their detectors. A patch whose score is at least 1 for its glyph and at most 0
   for every other glyph becomes exactly that token's embedding.

The classifier is trained (:mod:`kvlab.models.scaffolding.ocr_training`: Adam, seeded, one
thread, on every patch of :attr:`BuildSize.scenes` random scenes). It is the only trained part
(0.9 MB) and ships with kvlab as :data:`TRAINED_FILE`, with its held-out report; loading the model
assembles the rest in closed form around it (a few seconds, nothing to cache), and refuses a file
whose digest (of the glyph set and every constant here) is not this module's. ``docs/models.md``
gives the figures.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import LlavaForConditionalGeneration

from kvlab.data import scenes
from kvlab.models.common import seeded
from kvlab.models.scaffolding import graft
from kvlab.models.vlm import llava_images

#: bump when the construction changes (part of the classifier's digest)
BUILD_VERSION = 1
SEED = 0
HELD_OUT_SEED = 1
MAX_FREQUENCY = 10
SQUARE_GAIN = 0.01
LAYER_NORM_EPS = 1e-5
CLASSIFIER_WIDTH = 576
DETECTOR_GAIN = 8.0  # gelu(-8) = -5e-15: a detector below its ramp is 0 to float32's precision
#: the trained classifier (step 4), shipped with kvlab (:mod:`kvlab.models.scaffolding.ocr_training`)
TRAINED_FILE = Path(__file__).with_name("ocr_classifier.safetensors")


@dataclass(frozen=True)
class BuildSize:
    """How much the classifier's training sees (:mod:`~kvlab.models.scaffolding.ocr_training`; part of
    the digest, so the shipped file names the recipe it came from): ``scenes`` random training
    scenes (256 patches each);
    ``steps`` Adam steps of ``batch`` patches, the last ``detector_steps`` of them with the
    detectors' loss; ``held_out`` scenes for the report."""

    scenes: int = 140
    steps: int = 2400
    detector_steps: int = 1600
    batch: int = 256
    learning_rate: float = 2e-3
    held_out: int = 16


BUILD = BuildSize()


def frequencies() -> list[tuple[int, int]]:
    """The DFT frequencies ``(f_y, f_x)`` the tower keeps: ``|f| <= MAX_FREQUENCY`` on each axis,
    one of each conjugate pair (``f_y > 0``, or ``f_y = 0`` and ``f_x > 0``)."""
    K = MAX_FREQUENCY
    return [(fy, fx) for fy in range(K + 1) for fx in range(-K, K + 1) if fy > 0 or fx > 0]


@dataclass(frozen=True)
class Layout:
    """Where things sit in the tower's residual stream (channels): the ``4 F`` signed Fourier
    coefficients first, then the ``F`` power-spectrum channels, then one score per glyph."""

    coefficients: int
    spectrum: int
    classes: int

    @property
    def hidden(self) -> int:
        return self.coefficients + self.spectrum + self.classes

    @property
    def spectrum_slots(self) -> slice:
        return slice(self.coefficients, self.coefficients + self.spectrum)

    @property
    def score_slots(self) -> slice:
        return slice(self.coefficients + self.spectrum, self.hidden)


def layout() -> Layout:
    n = len(frequencies())
    return Layout(4 * n, n, len(scenes.GLYPHS))


def digest(size: BuildSize = BUILD) -> str:
    """Eight hex digits over the glyph set, the scene constants and the construction's constants."""
    facts = [BUILD_VERSION, SEED, HELD_OUT_SEED, scenes.GLYPHS, scenes.CELL, scenes.GRID, scenes.MAX_SHIFT,
             scenes.FONTS, scenes.SANS_SIZES, scenes.BACKGROUND_TEXT, scenes.ICONS, scenes.TEXTURES,
             MAX_FREQUENCY, SQUARE_GAIN, LAYER_NORM_EPS, CLASSIFIER_WIDTH, DETECTOR_GAIN,
             asdict(size)]  # fmt: skip
    return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:8]


def ocr_config(tokenizer: Any) -> Any:
    """The ``LlavaConfig``: SmolLM2's dimensions; a two-layer CLIP tower over 40 px patches of
    640 px images (256 tokens), width :func:`layout`; LLaVA's two-layer GELU projector."""
    slots = layout()
    return graft.cell_llava_config(
        tokenizer, scenes.IMAGE_SIZE, scenes.CELL, hidden_size=slots.hidden,
        intermediate_size=slots.coefficients, num_hidden_layers=2, projection_dim=slots.hidden,
        layer_norm_eps=LAYER_NORM_EPS, hidden_act="gelu",
    )  # fmt: skip


def fourier_basis() -> torch.Tensor:
    """``[4 F, CELL, CELL]`` float64: for each frequency of :func:`frequencies`, the cosine and the
    negated sine (``X(f) = sum_yx g(y, x) exp(-2 pi i (f_y y + f_x x) / CELL)``), then all negated."""
    size = scenes.CELL
    axis = torch.arange(size, dtype=torch.float64)
    y, x = torch.meshgrid(axis, axis, indexing="ij")
    rows = []
    for fy, fx in frequencies():
        phase = 2 * math.pi * (fy * y + fx * x) / size
        rows += [torch.cos(phase), -torch.sin(phase)]
    basis = torch.stack(rows)
    return torch.cat([basis, -basis])


def set_spectrum(vlm: torch.nn.Module, image_mean: list[float], image_std: list[float]) -> None:
    """Write steps 1 to 3 (coefficients, layernorm, power spectrum) into ``vlm.model.vision_tower``
    and zero encoder layer 2 and the projector, in place. ``image_mean``/``image_std``: the image
    processor's normalisation, undone by the weights so a channel reads the DFT of the grey level
    ``mean_c(pixel_c) / 255`` (the processor's means drop out with the constant term)."""
    tower = vlm.model.vision_tower
    slots = layout()
    std = torch.tensor(image_std, dtype=torch.float64)
    weight = torch.zeros(slots.hidden, 3, scenes.CELL, scenes.CELL, dtype=torch.float64)
    weight[: slots.coefficients] = fourier_basis()[:, None] * (std / 3)[None, :, None, None]
    # layer 1's MLP: unit i = a * channel i; spectrum channel j sums the four units of frequency j
    n = slots.coefficients
    fc1 = torch.zeros(n, slots.hidden, dtype=torch.float64)
    fc1[:, :n] = SQUARE_GAIN * torch.eye(n, dtype=torch.float64)
    frequency_of = torch.arange(n) % (n // 2) // 2  # cos, sin of each frequency; then the negations
    fc2 = torch.zeros(slots.hidden, n, dtype=torch.float64)
    fc2[slots.coefficients + frequency_of, torch.arange(n)] = 1 / (math.sqrt(2 / math.pi) * SQUARE_GAIN**2)
    with torch.no_grad():
        tower.embeddings.patch_embedding.weight.copy_(weight.float())
        tower.embeddings.class_embedding.zero_()
        tower.embeddings.position_embedding.weight.zero_()
        for norm in (tower.pre_layrnorm, tower.post_layernorm):
            norm.weight.fill_(1.0)
            norm.bias.zero_()
        for name, param in tower.encoder.named_parameters():
            param.fill_(1.0 if "layer_norm" in name and name.endswith("weight") else 0.0)
        first = tower.encoder.layers[0].mlp
        first.fc1.weight.copy_(fc1.float())
        first.fc2.weight.copy_(fc2.float())
        for param in vlm.model.multi_modal_projector.parameters():
            param.zero_()


def glyph_token_ids(tokenizer: Any) -> list[int]:
    """The token id each glyph of :data:`~kvlab.data.scenes.GLYPHS` shows (each is one token)."""
    return graft.single_token_ids(tokenizer, [scenes.cell_text(glyph) for glyph in scenes.GLYPHS])


def detectors(scores: torch.Tensor) -> torch.Tensor:
    """``(gelu(b z) - gelu(b z - b)) / b`` of each score, as the projector computes it: 0 for
    ``z <= 0``, 1 for ``z >= 1``."""
    gelu = torch.nn.functional.gelu
    return (gelu(DETECTOR_GAIN * scores) - gelu(DETECTOR_GAIN * scores - DETECTOR_GAIN)) / DETECTOR_GAIN


def set_reader(vlm: torch.nn.Module, trained: dict[str, torch.Tensor], tokenizer: Any) -> None:
    """Write the classifier ``trained`` (``W1``, ``b1``, ``W2``, ``b2``) into encoder layer 2 and the
    detectors into the projector (steps 4 and 5), in place; the detectors weight each glyph's token
    embedding (:func:`glyph_token_ids` of ``tokenizer``)."""
    embeddings = vlm.get_input_embeddings().weight.detach()[glyph_token_ids(tokenizer)].float()
    slots = layout()
    glyph_count, width = len(scenes.GLYPHS), CLASSIFIER_WIDTH
    mlp = vlm.model.vision_tower.encoder.layers[1].mlp
    projector = vlm.model.multi_modal_projector
    b = DETECTOR_GAIN
    with torch.no_grad():
        mlp.fc1.weight.zero_()
        mlp.fc1.weight[:width, slots.spectrum_slots] = trained["W1"]
        mlp.fc1.bias.zero_()
        mlp.fc1.bias[:width] = trained["b1"]
        mlp.fc2.weight.zero_()
        mlp.fc2.weight[slots.score_slots, :width] = trained["W2"]
        mlp.fc2.bias.zero_()
        mlp.fc2.bias[slots.score_slots] = trained["b2"]
        scores = torch.arange(glyph_count) + slots.score_slots.start
        projector.linear_1.weight.zero_()
        projector.linear_1.weight[torch.arange(glyph_count), scores] = b
        projector.linear_1.weight[glyph_count + torch.arange(glyph_count), scores] = b
        projector.linear_1.bias.zero_()
        projector.linear_1.bias[glyph_count : 2 * glyph_count] = -b
        projector.linear_2.weight.zero_()
        projector.linear_2.weight[:, :glyph_count] = embeddings.T / b
        projector.linear_2.weight[:, glyph_count : 2 * glyph_count] = -embeddings.T / b
        projector.linear_2.bias.zero_()


def trained_report() -> dict[str, Any]:
    """The held-out report stored with the shipped classifier."""
    return json.loads(_trained_metadata()["report"])


def _trained_metadata() -> dict[str, str]:
    with safe_open(str(TRAINED_FILE), "pt") as handle:
        return handle.metadata()


def spectrum_model() -> tuple[Any, Any, torch.nn.Module]:
    """``(tokenizer, config, vlm)``: the grafted LLaVA with steps 1 to 3 written in (encoder layer 2
    and the projector zero), float32."""
    tokenizer = graft.vlm_tokenizer("llava")
    config = ocr_config(tokenizer)
    with seeded(SEED):  # the vision part's throwaway initialisation draws the same numbers every time
        vlm = graft.build_grafted(LlavaForConditionalGeneration, config, SEED, torch.float32)
    processor = llava_images(config).image_processor
    set_spectrum(vlm, list(processor.image_mean), list(processor.image_std))
    return tokenizer, config, vlm


def load_ocr(dtype: torch.dtype) -> torch.nn.Module:
    """``smollm2-ocr``: the grafted LLaVA, its tower and projector assembled in closed form around
    the shipped classifier (:data:`TRAINED_FILE`), in ``dtype``, eval mode.

    Raises:
        RuntimeError: the shipped classifier was trained for other constants (its digest differs):
            train it again with ``python -m kvlab.models.scaffolding.ocr_training --train``.
    """
    shipped = _trained_metadata().get("digest")
    if shipped != digest():
        raise RuntimeError(
            f"smollm2-ocr's classifier ({TRAINED_FILE.name}, digest {shipped}) was trained for other "
            f"constants than these (digest {digest()}): run "
            "`python -m kvlab.models.scaffolding.ocr_training --train`."
        )
    tokenizer, _, vlm = spectrum_model()
    set_reader(vlm, load_file(str(TRAINED_FILE)), tokenizer)
    return vlm.to(dtype).eval()
