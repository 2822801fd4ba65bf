"""An offline VLM task on long multi-image prompts, for the OCR VLM ``smollm2-ocr``.

Each image is a 640 x 640 scene (:mod:`kvlab.data.scenes`): 256 patches, most of them background,
textures and repeated icons, a few holding printed words. A ``scene_code`` sample shows
``num_images`` scenes (256 image tokens each: 4 images make a prompt of about 1.1k tokens, 14
about 3.6k); every scene holds one to three caption lines of random words, and one scene holds
the *needle*, the line "The door code is 4 7 2 1 5". The question asks for the code, and the
answer prefix " The door code is" starts the reply (SmolLM2-135M copies a code after the phrase it
followed; asked without it, or with a phrase it does not take for a cue, such as "The code is",
it answers with programming code even from a text prompt, ``docs/vlm_tasks.md``).

The answer is five digit tokens and is scored whole (``contains_answer`` on the five-digit
string), so the first answer token, which under ``query_aware`` comes from the uncompressed
prefill, gives nothing away. The needle never lies in the prompt's tail: at least ``protected``
image tokens follow its last digit (64 by default: twice SnapKV's window), checked when the
sample is built, and ``meta["image_tokens_after_answer"]`` records how many. With
``question_first`` the question goes in the system turn, before the images, so the prompt ends
with the last image and a short instruction: the window then covers image tokens.

Sample ``i`` draws from ``random.Random(f"scene_code:{seed}:{i}")``. ``meta`` carries ``task``,
``task_family``, ``metric``, ``image_cells`` (each image's 256 cell labels, ``""`` for background),
``answer_cells`` (``[image, cell]`` of each digit, in answer order), ``needle_image``,
``image_tokens_after_answer`` and ``question_first``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

import kvlab.data.scenes as scenes
from kvlab.config.errors import ConfigError
from kvlab.data.datasets import DATASETS, check_metrics
from kvlab.data.sample import Sample

MAX_IMAGES = 14
CODE_DIGITS = 5
NEEDLE = ("The", "door", "code", "is")
#: caption words: every word but the needle's "The", "code" and "is" (so the needle is unique)
CAPTION_WORDS = tuple(w for w in scenes.WORDS if w not in ("The", "code", "is"))


def caption(rng: random.Random) -> list[str]:
    """A caption line of two to five random words (no digit, no needle key)."""
    return [rng.choice(CAPTION_WORDS) for _ in range(rng.randint(2, 5))]


def place_lines(
    lines: list[list[str]], rng: random.Random, last_cell: int
) -> tuple[dict[int, str], list[int]]:
    """Put each line of glyphs on its own row of a scene, at a random row and column, the first
    line ending at or before cell ``last_cell``.

    Returns:
        ``{cell: glyph}`` and the first line's cells, in order.
    """
    rows = list(range(scenes.GRID))
    rng.shuffle(rows)
    text: dict[int, str] = {}
    first_cells: list[int] = []
    for k, line in enumerate(lines):
        fits = [r for r in rows if k or r * scenes.GRID + len(line) - 1 <= last_cell]
        row = fits[0]
        rows.remove(row)
        latest = scenes.GRID - len(line)
        if k == 0:
            latest = min(latest, last_cell - row * scenes.GRID - len(line) + 1)
        col = rng.randint(0, latest)
        cells = [row * scenes.GRID + col + j for j in range(len(line))]
        text.update(zip(cells, line, strict=True))
        if k == 0:
            first_cells = cells
    return text, first_cells


@DATASETS.register("scene_code")
@dataclass
class SceneCode:
    """Read the five-digit code of the line "The door code is 4 7 2 1 5" in one of ``num_images``
    scenes (module description)."""

    NAME: ClassVar[str] = "scene_code"
    MAX_NEW_TOKENS: ClassVar[int] = 12
    QUESTION: ClassVar[str] = "What is the door code in the images? Answer with the 5-digit number."

    num_samples: int = 20
    seed: int = 0
    num_images: int = 6
    question_first: bool = False
    protected: int = 64
    metrics: tuple[str, ...] = ("contains_answer", "exact_match")

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ConfigError(f"{self.NAME}: num_samples must be >= 1, got {self.num_samples}.")
        if not 1 <= self.num_images <= MAX_IMAGES:
            raise ConfigError(
                f"{self.NAME}: num_images must be between 1 and {MAX_IMAGES}, got {self.num_images}."
            )
        if not 0 <= self.protected <= scenes.CELLS_PER_IMAGE // 2:
            raise ConfigError(
                f"{self.NAME}: protected must be between 0 and {scenes.CELLS_PER_IMAGE // 2} image tokens, "
                f"got {self.protected}."
            )
        self.metrics = check_metrics(self.metrics)

    def samples(self) -> list[Sample]:
        """``num_samples`` samples, each from its own seeded generator."""
        return [self.sample(i) for i in range(self.num_samples)]

    def sample(self, index: int) -> Sample:
        """Sample ``index``: the scenes rendered, the question after them (or before, in the
        system turn, with ``question_first``)."""
        rng = random.Random(f"{self.NAME}:{self.seed}:{index}")
        digits = [rng.choice(scenes.DIGITS) for _ in range(CODE_DIGITS)]
        target = rng.randrange(self.num_images)
        last = scenes.CELLS_PER_IMAGE - 1 - (self.protected if target == self.num_images - 1 else 0)
        images, cells, answer_cells = [], [], []
        for i in range(self.num_images):
            lines = [caption(rng) for _ in range(rng.randint(1, 3))]
            if i == target:
                lines = [[*NEEDLE, *digits], *lines]
            text, needle_cells = place_lines(lines, rng, last)
            scene = scenes.render_scene(text, rng)
            images.append(scene.image)
            cells.append(scene.labels)
            if i == target:
                answer_cells = [[i, cell] for cell in needle_cells[len(NEEDLE) :]]
        after = (self.num_images - target) * scenes.CELLS_PER_IMAGE - 1 - answer_cells[-1][1]
        if after < self.protected:  # place_lines guarantees it; a change there must not slip by
            raise AssertionError(f"{self.NAME} sample {index}: {after} image tokens after the answer")
        return Sample(
            id=f"{self.NAME}-{index:04d}",
            prompt="Answer with the 5-digit number." if self.question_first else self.QUESTION,
            question=None if self.question_first else self.QUESTION,
            system=self.QUESTION if self.question_first else None,
            images=images,
            answers=["".join(digits)],
            answer_prefix=" " + " ".join(NEEDLE),
            max_new_tokens=self.MAX_NEW_TOKENS,
            meta={
                "task": self.NAME,
                "task_family": self.NAME,
                "metric": self.metrics[0],
                "image_cells": cells,
                "answer_cells": answer_cells,
                "needle_image": target,
                "image_tokens_after_answer": after,
                "question_first": self.question_first,
            },  # fmt: skip
        )
