"""Offline VLM tasks whose answers are written in the images, for the reading VLM ``smollm2-reader``.

Every image is a 4 x 4 grid of glyph cells (:mod:`kvlab.data.glyphs`), so each task is text the
model can only read through its image tokens; the question follows the images. Four tasks, each
its own dataset and all of them together as ``reader`` (the VLM reference suite):

- ``reader_code``: ``num_images`` images, each labelled "Image k :"; one holds "The secret code
  is 4 7 2 9 1 ." and the others a short caption ("A small dog ."). Question: the code in image k.
- ``reader_table``: a form of ``rows`` rows "Field : 4 1 7" (six cells each, so four rows fill
  two images; Name, City, Pet, Fruit, Day, Sport, Drink, Colour, in a random order), caption
  images before or after. Question: one field's number; the answer prefix " Field:" starts the
  reply.
- ``reader_doc``: a page of prose cut over ``num_images`` images, one sentence of which is "The
  secret code is 4 7 2 9 1 ." at a random place. Question: the code in the document.
- ``reader_mark``: like ``reader_code``, but the one image says "The marks are" and shows
  ``marks`` (3) squares of distinct colours (red, green, blue, yellow). Question: the marks'
  colours in order; the answer prefix " The marks are" starts the reply.

SmolLM2-135M binds a key to its value poorly when several look alike (docs/evaluation.md:
with two facts of the same form it often answers the other's value), so each prompt holds exactly
one code, one set of marks and one value of each field type: the question's referent is unique,
and the answer is only in the images. ``docs/vlm_tasks.md`` gives the measured scores and the designs
that failed (which image holds a word; counting marks).

Sample ``i`` of a task draws from ``random.Random(f"{task}:{seed}:{i}")``. ``meta`` carries
``task``, ``task_family`` (the task), ``metric``, ``image_cells`` (each image's cells, for the
kept-patch view and the tests) and ``answer_cells`` (``[image, cell]`` of each cell that shows
the answer, in answer order: the targets of ``kvlab calibrate``'s reader statistics).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, ClassVar

import kvlab.data.glyphs as glyphs
from kvlab.config.errors import ConfigError
from kvlab.data.datasets import DATASETS, check_metrics
from kvlab.data.sample import Sample

CODE_DIGITS = 5
MAX_LABEL = 9  # image labels are one digit


def label(index: int) -> list[str]:
    """The cells "Image k :" heading image ``index`` (0-based)."""
    return ["Image", "", str(index + 1), ":"]


def caption(rng: random.Random) -> list[str]:
    """A short caption such as "A small dog ." (no digit, colour or field word)."""
    return [rng.choice(("A", "The")), rng.choice(glyphs.ADJECTIVES), rng.choice(glyphs.NOUNS), "."]


def code(rng: random.Random) -> str:
    """A 5-digit code (a leading zero allowed)."""
    return "".join(rng.choice(glyphs.DIGITS) for _ in range(CODE_DIGITS))


def filler_sentence(rng: random.Random) -> list[str]:
    """A filler sentence of the document task ("My aunt sat near the house .")."""
    parts = (glyphs.FILLER_SUBJECTS, glyphs.FILLER_VERBS, glyphs.FILLER_PLACES)
    return [word for part in parts for word in rng.choice(part).split()] + ["."]


@dataclass
class ReaderTask:
    """Base of the reader tasks: ``num_samples`` samples from ``seed``; subclasses set :attr:`NAME`
    and :meth:`build` (one sample's image cells, question, answer, answer prefix, meta)."""

    NAME: ClassVar[str] = ""
    MAX_NEW_TOKENS: ClassVar[int] = 16

    num_samples: int = 20
    seed: int = 0
    metrics: tuple[str, ...] = ("contains_answer", "exact_match")

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ConfigError(f"{self.NAME}: num_samples must be >= 1, got {self.num_samples}.")
        self.metrics = check_metrics(self.metrics)

    def samples(self) -> list[Sample]:
        """``num_samples`` samples, each from its own seeded generator."""
        return [self.sample(i) for i in range(self.num_samples)]

    def sample(self, index: int) -> Sample:
        """Sample ``index``: its images rendered, the question after them."""
        rng = random.Random(f"{self.NAME}:{self.seed}:{index}")
        images, question, answer, prefix, meta = self.build(rng)
        return Sample(
            id=f"{self.NAME}-{index:04d}",
            prompt=question,
            question=question,
            images=[glyphs.render(cells) for cells in images],
            answers=[answer],
            answer_prefix=prefix,
            max_new_tokens=self.MAX_NEW_TOKENS,
            meta={
                "task": self.NAME,
                "task_family": self.NAME,
                "metric": self.metrics[0],
                "image_cells": images,
                **meta,
            },  # fmt: skip
        )

    def build(self, rng: random.Random) -> tuple[list[list[str]], str, str, str, dict[str, Any]]:
        """``(cells of each image, question, answer, answer prefix, meta)`` of one sample."""
        raise NotImplementedError


def _check_images(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise ConfigError(f"{name}: num_images must be between {low} and {high}, got {value}.")


@DATASETS.register("reader_code")
@dataclass
class ReaderCode(ReaderTask):
    """Read the 5-digit code in image k of ``num_images`` (the others hold captions)."""

    NAME: ClassVar[str] = "reader_code"
    num_images: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_images(self.NAME, self.num_images, 2, MAX_LABEL)

    def build(self, rng: random.Random) -> tuple[list[list[str]], str, str, str, dict[str, Any]]:
        target, value = rng.randrange(self.num_images), code(rng)
        images = [
            label(i) + (["The", "secret", "code", "is", "", *value, "."] if i == target else caption(rng))
            for i in range(self.num_images)
        ]
        question = f"What is the secret code in image {target + 1}? Answer with the 5-digit number only."
        meta = {"image_index": target, "answer_cells": [[target, 9 + i] for i in range(CODE_DIGITS)]}
        return images, question, value, "", meta


@DATASETS.register("reader_mark")
@dataclass
class ReaderMark(ReaderTask):
    """The colours of the ``marks`` coloured squares (distinct colours) in image k of ``num_images``
    (the others hold captions); the answer prefix "The marks are" starts the reply."""

    NAME: ClassVar[str] = "reader_mark"
    num_images: int = 8
    marks: int = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_images(self.NAME, self.num_images, 2, MAX_LABEL)
        if not 2 <= self.marks <= len(glyphs.COLOURS):
            raise ConfigError(
                f"{self.NAME}: marks must be between 2 and {len(glyphs.COLOURS)}, got {self.marks}."
            )

    def build(self, rng: random.Random) -> tuple[list[list[str]], str, str, str, dict[str, Any]]:
        target = rng.randrange(self.num_images)
        colours = rng.sample(glyphs.COLOURS, self.marks)  # SmolLM2 copies a repeated colour badly
        marks = [f"{glyphs.MARK_PREFIX}{c}" for c in colours]
        images = [
            label(i) + (["The", "marks", "are", *marks, "."] if i == target else caption(rng))
            for i in range(self.num_images)
        ]
        question = f"What colours are the marks in image {target + 1}?"
        meta = {"image_index": target, "answer_cells": [[target, 7 + i] for i in range(self.marks)]}
        return images, question, " ".join(colours), " The marks are", meta


@DATASETS.register("reader_table")
@dataclass
class ReaderTable(ReaderTask):
    """The 3-digit number of one row of a table "Field : 4 1 7" of ``rows`` rows, its cells filling
    as many images as they need; caption images make up ``num_images`` (placed before or after
    the table). The answer prefix "Field:" starts the reply."""

    NAME: ClassVar[str] = "reader_table"
    ROW: ClassVar[int] = 6  # cells per row: field, ":", blank, three digits
    rows: int = 4
    num_images: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 2 <= self.rows <= len(glyphs.FIELDS):
            raise ConfigError(
                f"{self.NAME}: rows must be between 2 and {len(glyphs.FIELDS)}, got {self.rows}."
            )
        least = -(-self.rows * self.ROW // glyphs.CELLS_PER_IMAGE)
        _check_images(self.NAME, self.num_images, least, 16)

    def build(self, rng: random.Random) -> tuple[list[list[str]], str, str, str, dict[str, Any]]:
        names = rng.sample(glyphs.FIELDS, self.rows)
        values = {name: "".join(rng.choice(glyphs.DIGITS) for _ in range(3)) for name in names}
        cells = [c for name in names for c in (name, ":", "", *values[name])]
        per = glyphs.CELLS_PER_IMAGE
        table = [cells[i : i + per] for i in range(0, len(cells), per)]
        captions = [caption(rng) for _ in range(self.num_images - len(table))]
        first = rng.randrange(len(captions) + 1)
        asked = rng.choice(names)
        question = f"What is the number for {asked.lower()} in the table?"
        row = names.index(asked)
        at = [row * self.ROW + 3 + i for i in range(3)]  # the row's digits in the table's cells
        meta = {"field": asked, "row": row, "table_image": first,
                "answer_cells": [[first + a // per, a % per] for a in at]}  # fmt: skip
        return captions[:first] + table + captions[first:], question, values[asked], f" {asked}:", meta


@DATASETS.register("reader_doc")
@dataclass
class ReaderDoc(ReaderTask):
    """The secret code in a page of prose cut over ``num_images`` images (the code sentence placed
    at a random sentence boundary; the page ends at the last whole sentence that fits). The
    answer prefix "The secret code is" starts the reply."""

    NAME: ClassVar[str] = "reader_doc"
    num_images: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_images(self.NAME, self.num_images, 2, 16)

    def build(self, rng: random.Random) -> tuple[list[list[str]], str, str, str, dict[str, Any]]:
        value = code(rng)
        needle = ["The", "secret", "code", "is", "", *value, "."]
        room = self.num_images * glyphs.CELLS_PER_IMAGE - len(needle)
        sentences: list[list[str]] = []
        while sum(map(len, sentences)) + len(nxt := filler_sentence(rng)) <= room:
            sentences.append(nxt)
        slot = rng.randrange(len(sentences) + 1)
        cells = [c for s in sentences[:slot] + [needle] + sentences[slot:] for c in s]
        per = glyphs.CELLS_PER_IMAGE
        images = [cells[i : i + per] for i in range(0, self.num_images * per, per)]
        start = sum(map(len, sentences[:slot]))
        question = "What is the secret code in the document?"
        digits = range(start + 5, start + 5 + CODE_DIGITS)  # after "The secret code is" and a blank
        meta = {"needle_cell": start, "needle_image": start // per, "needle_sentence": slot,
                "answer_cells": [[d // per, d % per] for d in digits]}  # fmt: skip
        return images, question, value, " The secret code is", meta


READER_TASKS: dict[str, type[ReaderTask]] = {
    cls.NAME: cls for cls in (ReaderCode, ReaderTable, ReaderDoc, ReaderMark)
}


@DATASETS.register("reader")
@dataclass
class ReaderSuite:
    """The reader tasks together: ``samples_per_task`` samples of each of ``tasks`` (at their
    default sizes), task by task; the VLM reference suite (``kvlab reference-table --suite vlm``)."""

    tasks: tuple[str, ...] = tuple(READER_TASKS)
    samples_per_task: int = 5
    seed: int = 0
    metrics: tuple[str, ...] = ("contains_answer", "exact_match")

    def __post_init__(self) -> None:
        unknown = [t for t in self.tasks if t not in READER_TASKS]
        if unknown or not self.tasks:
            raise ConfigError(f"reader: unknown tasks {unknown} (tasks: {', '.join(READER_TASKS)}).")
        self.tasks = tuple(self.tasks)
        self.parts()  # validates samples_per_task and metrics before any model loads

    def parts(self) -> list[ReaderTask]:
        """One dataset per task, ``samples_per_task`` samples each."""
        return [READER_TASKS[t](num_samples=self.samples_per_task, seed=self.seed, metrics=self.metrics)
                for t in self.tasks]  # fmt: skip

    def samples(self) -> list[Sample]:
        """Every task's samples, in the order of ``tasks``."""
        return [s for task in self.parts() for s in task.samples()]
