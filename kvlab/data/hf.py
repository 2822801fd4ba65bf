"""The ``hf`` dataset: any Hugging Face ``datasets`` dataset, mapped onto :class:`Sample` fields.

``path`` is a Hub name (``org/name``; cached copies work offline with ``HF_HUB_OFFLINE=1``), a
directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``, or one data file
(``.json``/``.jsonl``/``.csv``/``.parquet``/``.arrow``). ``fields`` maps kvlab's sample fields to
the dataset's columns::

    data:
      dataset:
        name: hf
        path: rajpurkar/squad          # or ./my_saved_dataset, or data/test.parquet
        split: validation
        fields: {prompt: question, context: context, answers: answers.text, id: id}
        metrics: [exact_match, token_f1]
        limit: 100

A dotted column (``answers.text``) reads a key of a struct column. The ``datasets`` package is
imported only when such a dataset is built, so ``kvlab list`` stays fast.
"""

from __future__ import annotations

import io
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from kvlab.config.errors import ConfigError
from kvlab.data.datasets import DATASETS, check_metrics
from kvlab.data.sample import Sample

#: sample fields a mapping may name (``images`` is an alias of ``image``)
FIELDS = ("prompt", "context", "answers", "choices", "image", "images", "id", "system")
_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
DEFAULT_TEMPLATE = "{context}\n\n{prompt}"
_TEMPLATE_KEYS = ("prompt", "context", "choices")


def _lookup(row: dict[str, Any], column: str) -> Any:
    """``row[column]``; a dotted column reads nested keys (``answers.text``)."""
    value: Any = row
    for part in column.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _texts(value: Any) -> list[str]:
    """A scalar or a list of scalars as strings (None -> [])."""
    if value is None:
        return []
    items = value if isinstance(value, list | tuple) else [value]
    return [str(v) for v in items if v is not None]


def _image(value: Any, where: str) -> Image.Image:
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict) and (value.get("bytes") or value.get("path")):  # undecoded Image feature
        source = io.BytesIO(value["bytes"]) if value.get("bytes") else value["path"]
        with Image.open(source) as image:
            return image.convert("RGB")
    if isinstance(value, str):
        try:
            with Image.open(Path(value).expanduser()) as image:
                return image.convert("RGB")
        except Exception as exc:  # PIL raises many types for unreadable files
            raise ConfigError(
                f"{where}: image '{value}' cannot be opened ({type(exc).__name__}: {exc}). Fix the path "
                f"in the dataset or map `image` to a column of images."
            ) from None
    raise ConfigError(
        f"{where}: the image column holds a {type(value).__name__}, not an image, path or list of them. "
        f"Map data.dataset.fields.image to a column of images."
    )


@DATASETS.register("hf")
@dataclass
class HFDataset:
    """A Hugging Face ``datasets`` dataset (Hub name, ``save_to_disk`` directory or data file).

    ``fields`` maps sample fields (``prompt`` required; ``context``, ``answers``, ``choices``,
    ``image``, ``id``, ``system`` optional) to columns; ``template`` joins them into the prompt
    (keys ``{prompt}``, ``{context}``, ``{choices}`` = lettered options, one per line; default:
    context, blank line, prompt). ``answer_is_index``: the answers column holds the index of the
    right choice (as in MMLU). Unmapped columns with scalar values go to ``Sample.meta``.
    """

    path: str
    split: str = "test"
    subset: str | None = None
    fields: dict[str, str] = field(default_factory=lambda: {"prompt": "question", "answers": "answer"})
    template: str | None = None
    answer_is_index: bool = False
    limit: int | None = None
    metrics: tuple[str, ...] = ("contains_answer",)
    _rows: list[dict[str, Any]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.metrics = check_metrics(self.metrics)
        unknown = [k for k in self.fields if k not in FIELDS]
        not_names = [k for k, v in self.fields.items() if not isinstance(v, str) or not v]
        if unknown or not_names or "prompt" not in self.fields:
            problem = (
                f"unknown keys {unknown}" if unknown
                else f"{not_names} must name columns (strings)" if not_names
                else "no 'prompt' key"
            )  # fmt: skip
            raise ConfigError(
                f"data.dataset.fields: {problem}. Map kvlab's sample fields ({', '.join(FIELDS)}; "
                f"'prompt' is required) to column names, e.g. {{prompt: question, answers: answer}}."
            )
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"data.dataset.limit must be >= 1 or null (all rows), got {self.limit}.")
        if self.template is not None:
            self._check_template()
        table = self._load()
        columns = list(table.column_names)
        for key, column in self.fields.items():
            if column.split(".")[0] not in columns:
                raise ConfigError(
                    f"data.dataset.fields.{key}: column '{column}' is not in {self.path} (split "
                    f"'{self.split}'). Available columns: {', '.join(columns)}. Fix the mapping."
                )
        if self.limit is not None:
            table = table.select(range(min(self.limit, len(table))))
        self._rows = list(table)
        if not self._rows:
            raise ConfigError(f"data.dataset: split '{self.split}' of {self.path} has no rows.")

    def _check_template(self) -> None:
        try:
            names = {f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None}
        except ValueError as exc:
            raise ConfigError(f"data.dataset.template: malformed format string ({exc}).") from None
        bad = sorted(names - set(_TEMPLATE_KEYS))
        if bad:
            raise ConfigError(
                f"data.dataset.template uses unknown keys {bad}; it may use {{prompt}}, {{context}} and "
                f"{{choices}} (the mapped fields). Escape literal braces as '{{{{' and '}}}}'."
            )

    def _load(self) -> Any:
        """The split as a ``datasets.Dataset`` (ConfigError for a missing path, split or subset)."""
        try:
            import datasets  # datasets: 1.7 s to import, only when such a dataset is built (kvlab list)
        except ImportError:
            raise ConfigError(
                "data.dataset: the 'hf' dataset needs the 'datasets' package: `pip install datasets`."
            ) from None
        local = Path(self.path).expanduser()
        try:
            if local.is_dir() and any((local / f).is_file() for f in ("state.json", "dataset_dict.json")):
                loaded = datasets.load_from_disk(str(local))
                if isinstance(loaded, datasets.DatasetDict):
                    return self._split(loaded)
                return loaded
            if local.is_file():
                builder = _FILE_BUILDERS.get(local.suffix.lower())
                if builder is None:
                    raise ConfigError(
                        f"data.dataset.path: {local} has suffix '{local.suffix}'; data files must be one of "
                        f"{', '.join(_FILE_BUILDERS)} (for JSONL with kvlab's own fields use name: jsonl)."
                    )
                return datasets.load_dataset(builder, data_files=str(local), split="train")
            if self.path.startswith(("/", ".", "~")) or local.exists():
                raise ConfigError(
                    f"data.dataset.path: {local.resolve()} is neither a data file nor a directory written by "
                    f"save_to_disk (no state.json or dataset_dict.json). Fix the path."
                )
            return self._split(datasets.load_dataset(self.path, self.subset))
        except ConfigError:
            raise
        except Exception as exc:  # datasets raises many types (not found, offline, bad config)
            raise ConfigError(
                f"data.dataset: cannot load '{self.path}' (subset {self.subset!r}, split '{self.split}'): "
                f"{type(exc).__name__}: {exc}. Check the Hub name or local path (offline runs need a "
                f"cached copy), `subset` and `split`."
            ) from None

    def _split(self, splits: Any) -> Any:
        if self.split not in splits:
            raise ConfigError(
                f"data.dataset.split: '{self.split}' is not a split of {self.path}. Available splits: "
                f"{', '.join(splits)}. Set `split` to one of them."
            )
        return splits[self.split]

    def samples(self) -> list[Sample]:
        """One sample per row (the first ``limit`` rows), images converted to RGB."""
        out, seen = [], set()
        for index, row in enumerate(self._rows):
            sample = self._sample(index, row)
            if sample.id in seen:
                raise ConfigError(
                    f"data.dataset: duplicate id '{sample.id}' (row {index}, column "
                    f"'{self.fields['id']}'). Ids must be unique; map `id` to a unique column or remove it."
                )
            seen.add(sample.id)
            out.append(sample)
        return out

    def _sample(self, index: int, row: dict[str, Any]) -> Sample:
        get = {key: _lookup(row, column) for key, column in self.fields.items()}
        sample_id = str(get["id"]) if get.get("id") is not None else f"{self.split}-{index}"
        where = f"{self.path} row {index} (id '{sample_id}')"
        choices = _texts(get.get("choices"))
        answers = _texts(get.get("answers"))
        if self.answer_is_index and answers:
            if not all(a.lstrip("-").isdigit() and 0 <= int(a) < len(choices) for a in answers):
                raise ConfigError(
                    f"{where}: answer_is_index is set but the answers {answers} are not indices into the "
                    f"{len(choices)} choices. Map `choices`, or unset answer_is_index."
                )
            answers = [choices[int(a)] for a in answers]
        raw_images = get.get("image", get.get("images"))
        items = raw_images if isinstance(raw_images, list) else [] if raw_images is None else [raw_images]
        values = {
            "prompt": str(get["prompt"] or ""),
            "context": str(get.get("context") or ""),
            "choices": "\n".join(f"{chr(65 + i)}. {c}" for i, c in enumerate(choices)),
        }
        if self.template is not None:
            prompt = self.template.format(**values)
        else:
            prompt = DEFAULT_TEMPLATE.format(**values) if values["context"] else values["prompt"]
        if not prompt.strip() and not items:
            raise ConfigError(
                f"{where}: the prompt is empty (column '{self.fields['prompt']}'"
                f"{' and the template' if self.template is not None else ''}) and the row has no images. "
                "Map data.dataset.fields.prompt to the column holding the question, or drop such rows."
            )
        used = {column.split(".")[0] for column in self.fields.values()}
        meta = {k: v for k, v in row.items() if k not in used and isinstance(v, str | int | float | bool)}
        return Sample(
            id=sample_id,
            prompt=prompt,
            images=[_image(item, where) for item in items],
            answers=answers,
            choices=choices,
            system=str(get["system"]) if get.get("system") else None,
            meta=meta,
        )


@DATASETS.register("huggingface")
@dataclass
class HuggingFaceDataset(HFDataset):
    """Alias of ``hf``: a Hugging Face ``datasets`` dataset mapped onto sample fields."""
