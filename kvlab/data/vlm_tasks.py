"""Vision-language benchmarks as datasets: ``docvqa``, ``chartqa``, ``textvqa``, ``ocrbench``, ``mmmu``.

Each reads its benchmark's split through the ``hf`` adapter (:class:`~kvlab.data.hf.HFDataset`:
a Hub name, a ``save_to_disk`` directory or one data file, in the Hub dataset's own schema) and
builds the prompts, answers and generation limits lmms-eval uses for it
(``lmms_eval/tasks/<task>/``, its ``default`` prompt): the same questions, the same instruction
after them, the official answer-length limit as :attr:`Sample.max_new_tokens`, and the task's
metric (:mod:`kvlab.metrics.suites.vlm`). ``docs/vlm_tasks.md`` lists the schemas and choices.

Every sample's text is its question (``Sample.question == Sample.prompt``): the image is the
context a query-agnostic protocol compresses before the question is read. Samples that share
an image (DocVQA's ``docId``, TextVQA's ``image_id``) share a ``context_id``. ``meta`` carries
``task``, ``task_family`` and ``metric`` (the task's official metric, the first of ``metrics``),
read by ``kvlab compare``'s leaderboard, and the row's scalar columns (OCRBench's ``dataset``
decides how it is scored).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvlab.config.errors import ConfigError
from kvlab.data.datasets import DATASETS, check_metrics
from kvlab.data.hf import HFDataset, _image
from kvlab.data.sample import Sample

SHORT_ANSWER = "Answer the question using a single word or phrase."
MULTI_CHOICE = "Answer with the option's letter from the given choices directly."


@dataclass
class VLMTask:
    """Base of the benchmarks: load the split, check its schema, one :class:`Sample` per row.

    Subclasses set the defaults of ``path``/``split``/``subset``/``metrics``/``max_new_tokens``,
    :attr:`COLUMNS` (the schema's columns this loader reads), :attr:`QUESTION` (the question
    column) and :meth:`build`.
    """

    path: str = ""
    split: str = "test"
    subset: str | None = None
    limit: int | None = None
    metrics: tuple[str, ...] = ()
    max_new_tokens: int = 32
    _rows: list[dict[str, Any]] = field(default_factory=list, init=False, repr=False)

    registry_name: ClassVar[str] = ""  # set by DATASETS.register
    COLUMNS: ClassVar[tuple[str, ...]] = ()
    QUESTION: ClassVar[str] = "question"
    FAMILY: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.metrics = check_metrics(self.metrics)
        if self.max_new_tokens < 1:
            raise ConfigError(
                f"data.dataset.max_new_tokens must be >= 1 (the {self.registry_name} answer limit), got "
                f"{self.max_new_tokens}."
            )
        table = HFDataset(
            path=self.path,
            split=self.split,
            subset=self.subset,
            fields={"prompt": self.QUESTION},
            limit=self.limit,
            metrics=self.metrics,
        )
        self._rows = table._rows
        missing = [c for c in self.COLUMNS if c not in self._rows[0]]
        if missing:
            raise ConfigError(
                f"data.dataset ({self.registry_name}): {self.path} (split '{self.split}') lacks the columns "
                f"{missing} of the {self.registry_name} schema (it has {', '.join(self._rows[0])}). Point "
                f"`path` at the benchmark's own data (default {type(self).path!r}) or use name: hf with "
                "your own field mapping."
            )

    def samples(self) -> list[Sample]:
        """One sample per row (the first ``limit`` rows); ids must be unique."""
        out, seen = [], set()
        for index, row in enumerate(self._rows):
            sample = self.build(index, row)
            if sample.id in seen:
                raise ConfigError(
                    f"data.dataset ({self.registry_name}): duplicate id '{sample.id}' (row {index})."
                )
            seen.add(sample.id)
            out.append(sample)
        return out

    def build(self, index: int, row: dict[str, Any]) -> Sample:
        """The sample of one row."""
        raise NotImplementedError

    def _sample(
        self, raw_id: Any, row: dict[str, Any], prompt: str, images: list[Any], **kwargs: Any
    ) -> Sample:
        """A sample with the shared conventions (id prefixed by the task, question = prompt, meta)."""
        sample_id = f"{self.registry_name}-{raw_id}"
        where = f"{self.path} ({self.registry_name}) sample '{sample_id}'"
        shown = {self.QUESTION, "answer", "answers"}  # already in the prompt and the answers
        meta = {k: v for k, v in row.items() if isinstance(v, str | int | float | bool) and k not in shown}
        meta.update(task=self.registry_name, task_family=self.FAMILY, metric=self.metrics[0])
        return Sample(
            id=sample_id,
            prompt=prompt,
            images=[_image(image, where) for image in images],
            question=prompt,
            max_new_tokens=self.max_new_tokens,
            meta={**meta, **kwargs.pop("meta", {})},
            **kwargs,
        )


def _answers(value: Any) -> list[str]:
    items = value if isinstance(value, list | tuple) else [] if value is None else [value]
    return [str(v) for v in items]


@DATASETS.register("docvqa")
@dataclass
class DocVQA(VLMTask):
    """DocVQA (Mathew et al. 2021): questions on scanned document pages; ANLS, 128 new tokens."""

    path: str = "lmms-lab/DocVQA"
    split: str = "validation"
    subset: str | None = "DocVQA"
    metrics: tuple[str, ...] = ("anls",)
    max_new_tokens: int = 128

    COLUMNS: ClassVar[tuple[str, ...]] = ("questionId", "question", "image", "answers", "docId")
    FAMILY: ClassVar[str] = "docvqa"

    def build(self, index: int, row: dict[str, Any]) -> Sample:
        prompt = f"{row['question']}\n{SHORT_ANSWER}"
        return self._sample(
            row["questionId"], row, prompt, [row["image"]], answers=_answers(row["answers"]),
            context_id=f"docvqa-doc{row['docId']}",
        )  # fmt: skip


@DATASETS.register("chartqa")
@dataclass
class ChartQA(VLMTask):
    """ChartQA (Masry et al. 2022): questions on charts; relaxed accuracy, 16 new tokens."""

    path: str = "lmms-lab/ChartQA"
    split: str = "test"
    metrics: tuple[str, ...] = ("relaxed_accuracy",)
    max_new_tokens: int = 16

    COLUMNS: ClassVar[tuple[str, ...]] = ("type", "question", "answer", "image")
    FAMILY: ClassVar[str] = "chartqa"

    def build(self, index: int, row: dict[str, Any]) -> Sample:
        prompt = f"{row['question']}\n{SHORT_ANSWER}"
        return self._sample(
            f"{self.split}-{index}", row, prompt, [row["image"]], answers=_answers(row["answer"])
        )


@DATASETS.register("textvqa")
@dataclass
class TextVQA(VLMTask):
    """TextVQA (Singh et al. 2019): questions on text in photos; VQA accuracy over 10 answers."""

    path: str = "lmms-lab/textvqa"
    split: str = "validation"
    metrics: tuple[str, ...] = ("vqa_accuracy",)
    max_new_tokens: int = 32

    COLUMNS: ClassVar[tuple[str, ...]] = ("question_id", "question", "image", "answers", "image_id")
    FAMILY: ClassVar[str] = "textvqa"

    def build(self, index: int, row: dict[str, Any]) -> Sample:
        prompt = f"{str(row['question']).capitalize()}\n{SHORT_ANSWER}"  # lmms-eval capitalises
        return self._sample(
            row["question_id"], row, prompt, [row["image"]], answers=_answers(row["answers"]),
            context_id=f"textvqa-image{row['image_id']}",
        )  # fmt: skip


@DATASETS.register("ocrbench")
@dataclass
class OCRBench(VLMTask):
    """OCRBench (Liu et al. 2024): 1000 OCR questions in 10 categories; answer found in output."""

    path: str = "echo840/OCRBench"
    split: str = "test"
    metrics: tuple[str, ...] = ("ocrbench",)
    max_new_tokens: int = 128

    COLUMNS: ClassVar[tuple[str, ...]] = ("dataset", "question", "question_type", "answer", "image")
    FAMILY: ClassVar[str] = "ocrbench"

    def build(self, index: int, row: dict[str, Any]) -> Sample:
        prompt = str(row["question"]).strip()
        return self._sample(
            f"{self.split}-{index}", row, prompt, [row["image"]], answers=_answers(row["answer"])
        )


_IMAGE_TAG = re.compile(r"<image \d+>")


@DATASETS.register("mmmu")
@dataclass
class MMMU(VLMTask):
    """MMMU (Yue et al. 2024): college-level multi-discipline questions with 1-7 images; choice accuracy."""

    path: str = "lmms-lab/MMMU"
    split: str = "validation"
    metrics: tuple[str, ...] = ("mmmu_accuracy",)
    max_new_tokens: int = 16

    COLUMNS: ClassVar[tuple[str, ...]] = ("id", "question", "options", "answer", "question_type", "image_1")
    FAMILY: ClassVar[str] = "mmmu"

    def build(self, index: int, row: dict[str, Any]) -> Sample:
        where = f"{self.path} (mmmu) row {index} (id '{row['id']}')"
        try:
            options = [str(o) for o in ast.literal_eval(row["options"])] if row["options"] else []
        except (ValueError, SyntaxError):
            raise ConfigError(
                f"{where}: `options` is not a Python list literal: {row['options']!r}."
            ) from None
        question = str(row["question"])
        if row["question_type"] == "multiple-choice":
            lettered = "\n".join(f"{chr(65 + i)}. {option}" for i, option in enumerate(options))
            prompt = f"{question}\n{lettered}\n\n{MULTI_CHOICE}"
        else:
            prompt = f"{question}\n\n{SHORT_ANSWER}"
            options = []
        # the images the prompt names (question and options), in name order, as lmms-eval
        names = sorted({tag.strip("<>").replace(" ", "_") for tag in _IMAGE_TAG.findall(prompt)})
        absent = [n for n in names if row.get(n) is None]
        if absent:
            raise ConfigError(f"{where}: the prompt names {absent} but the row has no such image.")
        return self._sample(
            row["id"], row, prompt, [row[n] for n in names], answers=_answers(row["answer"]), choices=options
        )
