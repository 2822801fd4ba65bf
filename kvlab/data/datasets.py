"""Dataset components: the ``DATASETS`` registry and the ``jsonl`` dataset.

A dataset is a dataclass registered in :data:`DATASETS` whose fields are its parameters and
whose :meth:`samples` method returns the list of :class:`~kvlab.data.sample.Sample` to run.
Everything that can be checked cheaply (files exist, JSON parses, ids are unique, images open)
is checked in ``__post_init__``, so a bad data config fails before any model is loaded.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from PIL import Image

from kvlab.config.errors import ConfigError
from kvlab.config.registry import Registry
from kvlab.data.jsonl import read_json_lines
from kvlab.data.sample import Sample


class SampleSource(Protocol):
    """What every registered dataset provides. A dataset may also declare ``metrics``: the names
    of the task metrics its samples are scored with (:func:`check_metrics`; default
    ``exact_match`` and ``contains_answer``)."""

    def samples(self) -> list[Sample]:
        """All samples of the dataset, in a fixed order."""
        ...


DATASETS: Registry[SampleSource] = Registry("dataset", "data.dataset")


def build_dataset(node: Any, where: str = "data.dataset", **context: Any) -> SampleSource:
    """Build a dataset from its config node ``{name: ..., <params>}`` (validated).

    ``context`` (e.g. ``tokenizer=<the run's model>``) fills fields a dataset declares and the
    node leaves unset; datasets without such a field never see it.
    """
    return DATASETS.build(node, where, **context)


def check_metrics(names: str | Sequence[str]) -> tuple[str, ...]:
    """A dataset's ``metrics`` as a non-empty tuple of names (one name alone is a list of one).

    Data sits below the metrics, so the names stay strings here: the run's data module checks
    them against the task-metric registry (``kvlab.metrics.tasks.validate_task_metrics``) when
    it is built, before any model loads.
    """
    names = (names,) if isinstance(names, str) else tuple(names)
    for name in names:
        if not isinstance(name, str):
            raise ConfigError(
                f"data.dataset.metrics: {name!r} is not a task metric name; give names such as "
                "[exact_match, token_f1] (`kvlab list` shows them all)."
            )
    if not names:
        raise ConfigError("data.dataset.metrics is empty; name at least one task metric, e.g. [exact_match].")
    return names


@dataclass
class _Record:
    """One parsed JSONL line, images resolved (not yet loaded)."""

    id: str
    line: int
    prompt: str
    image_paths: list[Path]
    answers: list[str]
    choices: list[str]
    system: str | None
    meta: dict[str, Any]


def _scalar_text(value: Any) -> bool:
    return isinstance(value, str | int | float) and not isinstance(value, bool)


@DATASETS.register("jsonl")
@dataclass
class JsonlDataset:
    """Samples from a JSON-lines file, one JSON object per line (text, images, answers, choices).

    Each line holds the prompt text (``text_field``) and optionally an id (default: the line
    number), images (a path or a list of paths), reference answers (a string or a list),
    multiple-choice options and a system message. Other fields are kept in ``Sample.meta``.
    Relative image paths resolve against ``image_root`` if given, else against the directory
    of the JSONL file. Every image is opened and verified when the dataset is built.
    """

    path: str
    text_field: str = "prompt"
    id_field: str = "id"
    images_field: str = "images"
    answers_field: str = "answers"
    choices_field: str = "choices"
    system_field: str = "system"
    image_root: str | None = None
    metrics: tuple[str, ...] = ("exact_match", "contains_answer")
    _records: list[_Record] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.metrics = check_metrics(self.metrics)
        file = Path(self.path).expanduser().resolve()
        if not file.is_file():
            what = "is a directory, not a file" if file.is_dir() else "does not exist"
            raise ConfigError(
                f"data.dataset.path: the JSONL file {file} {what} (given as {self.path!r}; relative "
                f"paths resolve against the working directory {Path.cwd()}). Fix `path` in the "
                f"dataset config or pass an absolute path."
            )
        if self.image_root is not None:
            root = Path(self.image_root).expanduser().resolve()
            if not root.is_dir():
                raise ConfigError(
                    f"data.dataset.image_root: the directory {root} does not exist (given as "
                    f"{self.image_root!r}). Fix `image_root` or remove it to resolve image paths "
                    f"against the JSONL file's directory ({file.parent})."
                )
        else:
            root = file.parent
        self._records = self._parse(file, root)

    def _parse(self, file: Path, root: Path) -> list[_Record]:
        records: list[_Record] = []
        first_line: dict[str, int] = {}
        fix = (
            "Each line of a JSONL file must be one complete JSON object such as "
            f'{{"{self.id_field}": "q1", "{self.text_field}": "..."}}; fix or remove this line.'
        )
        for lineno, obj in read_json_lines(file, fix):
            where = f"{file}:{lineno}"
            record = self._record(obj, lineno, where, root)
            if record.id in first_line:
                raise ConfigError(
                    f"{where}: duplicate id '{record.id}' (first used on line "
                    f"{first_line[record.id]}). Ids must be unique because predictions are keyed "
                    f"and resumed by them; rename one of the samples."
                )
            first_line[record.id] = lineno
            records.append(record)
        if not records:
            raise ConfigError(
                f"data.dataset.path: {file} contains no samples. Add one JSON object per line, "
                f'e.g. {{"{self.id_field}": "q1", "{self.text_field}": "..."}}.'
            )
        return records

    def _record(self, obj: dict[str, Any], lineno: int, where: str, root: Path) -> _Record:
        raw_id = obj.get(self.id_field)
        if raw_id is None:
            sample_id = str(lineno)
        elif _scalar_text(raw_id):
            sample_id = str(raw_id)
        else:
            raise ConfigError(
                f"{where}: field '{self.id_field}' must be a string or a number, got {raw_id!r}. "
                f"Fix the id, or set data.dataset.id_field to the field that holds the ids."
            )
        prompt = obj.get(self.text_field)
        if prompt is None and {"context", "question"} <= set(obj):
            raise ConfigError(
                f"{where}: sample '{sample_id}' has no '{self.text_field}' field but 'context' and "
                f"'question': the file is in kvpress' schema (context, question, answer_prefix, answer). "
                f"Read it with `data.dataset: {{name: kvpress, path: {self.path}}}`, which joins the "
                f"context and question and groups the questions of one context."
            )
        options = {self.id_field: "id_field", self.text_field: "text_field",
                   self.images_field: "images_field", self.answers_field: "answers_field",
                   self.choices_field: "choices_field",
                   self.system_field: "system_field"}  # fmt: skip
        self._check_near_misses(obj, options, where, sample_id)
        if not isinstance(prompt, str):
            problem = "has no" if prompt is None else f"has a non-string ({type(prompt).__name__})"
            raise ConfigError(
                f"{where}: sample '{sample_id}' {problem} '{self.text_field}' field (the prompt text; "
                f"fields present: {', '.join(sorted(obj)) or 'none'}). Add it, or set "
                f"data.dataset.text_field to the field that holds the prompt."
            )
        images = self._strings(obj, self.images_field, where, sample_id, allow_scalar=True)
        if not prompt.strip() and not images:
            raise ConfigError(
                f"{where}: sample '{sample_id}' has an empty '{self.text_field}' field and no images, so "
                f"there is nothing to prompt the model with. Write the prompt text, or remove the line."
            )
        paths = [self._check_image(p, root, where, sample_id) for p in images]
        system = obj.get(self.system_field)
        if system is not None and not isinstance(system, str):
            raise ConfigError(
                f"{where}: sample '{sample_id}': field '{self.system_field}' must be a string, "
                f"got {type(system).__name__}. Fix the value or remove the field."
            )
        used = set(options)
        return _Record(
            id=sample_id,
            line=lineno,
            prompt=prompt,
            image_paths=paths,
            answers=self._strings(obj, self.answers_field, where, sample_id, allow_scalar=True),
            choices=self._strings(obj, self.choices_field, where, sample_id, allow_scalar=False),
            system=system,
            meta={k: v for k, v in obj.items() if k not in used},
        )

    @staticmethod
    def _check_near_misses(obj: dict[str, Any], fields: dict[str, str], where: str, sample_id: str) -> None:
        """Refuse a key that is one typo away from a field the row lacks (``answer`` for ``answers``):
        kept as metadata, it would leave the sample unscored without a word. ``fields`` maps each
        field name read to the dataset option that names it."""
        missing = [f for f in fields if f not in obj]
        for key in obj:
            if key in fields:
                continue
            match = difflib.get_close_matches(str(key), missing, n=1, cutoff=0.8)
            if match:
                raise ConfigError(
                    f"{where}: sample '{sample_id}' has a field '{key}' but no '{match[0]}': kvlab reads "
                    f"'{match[0]}' (the fields it reads are {', '.join(sorted(fields))}), so '{key}' would "
                    f"be kept as metadata and ignored. Rename it to '{match[0]}', or set "
                    f"data.dataset.{fields[match[0]]} to '{key}'."
                )

    @staticmethod
    def _strings(obj: dict[str, Any], key: str, where: str, sample_id: str, allow_scalar: bool) -> list[str]:
        """A field that holds a list of strings/numbers (or one of them, if ``allow_scalar``)."""
        value = obj.get(key)
        if value is None:
            return []
        if allow_scalar and _scalar_text(value):
            return [str(value)]
        if isinstance(value, list) and all(_scalar_text(v) for v in value):
            return [str(v) for v in value]
        expected = "a string or a list of strings" if allow_scalar else "a list of strings"
        raise ConfigError(
            f"{where}: sample '{sample_id}': field '{key}' must be {expected}, got {value!r}. "
            f"Fix the value or remove the field."
        )

    def _check_image(self, raw: str, root: Path, where: str, sample_id: str) -> Path:
        path = Path(raw).expanduser()
        if not path.is_absolute():
            path = root / path
        path = path.resolve()
        if not path.is_file():
            raise ConfigError(
                f"{where}: image '{raw}' of sample '{sample_id}' not found at {path}. Relative image "
                f"paths resolve against {root} (set data.dataset.image_root to change this); fix the "
                f"path or add the file."
            )
        try:
            with Image.open(path) as image:
                image.verify()
        except Exception as exc:  # PIL raises many types for unreadable files
            raise ConfigError(
                f"{where}: image {path} of sample '{sample_id}' cannot be opened as an image "
                f"({type(exc).__name__}: {exc}). Replace the file with a valid image or remove it "
                f"from the sample."
            ) from None
        return path

    def samples(self) -> list[Sample]:
        """The samples in file order, images loaded and converted to RGB."""
        out = []
        for rec in self._records:
            images = []
            for path in rec.image_paths:
                try:
                    with Image.open(path) as image:
                        images.append(image.convert("RGB"))
                except Exception as exc:  # verify() does not decode pixel data
                    raise ConfigError(
                        f"{self.path}:{rec.line}: image {path} of sample '{rec.id}' cannot be decoded "
                        f"({type(exc).__name__}: {exc}). Replace the file with a valid image."
                    ) from None
            out.append(
                Sample(
                    id=rec.id,
                    prompt=rec.prompt,
                    images=images,
                    answers=list(rec.answers),
                    choices=list(rec.choices),
                    system=rec.system,
                    meta=dict(rec.meta),
                )
            )
        return out
