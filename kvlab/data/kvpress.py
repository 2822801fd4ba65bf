"""The ``kvpress`` dataset: data in NVIDIA kvpress' evaluation schema, accepted as is.

kvpress' benchmarks (RULER, LongBench, InfiniteBench, Loogle, ... as published for its
``evaluation/``) are tables with one row per question::

    context         str   the long document, shared by the rows of one context
    question        str   asked after the context (may be empty)
    answer_prefix   str   optional; starts the assistant's turn (e.g. "Answer:")
    answer          str or list of str (``answers`` is accepted too); optional
    max_new_tokens  int   optional; this question's generation limit
    <other columns>       scalar values kept in each sample's ``meta`` (e.g. ``task``)

Each row becomes one :class:`~kvlab.data.sample.Sample`: ``prompt = context + question`` (as
kvpress concatenates them), ``question``, ``answer_prefix``, ``answers``, ``max_new_tokens`` and
``context_id`` (a hash of the context text, so the rows of one context are grouped: the
``multi_question`` protocol compresses it once). The chat template and the answer prefix are
applied by the model's processor exactly as kvpress' pipeline does: the context and question in
the user turn, the answer prefix after the assistant's opening (docs/protocols.md)::

    data:
      dataset: {name: kvpress, path: data/ruler_4k.parquet}        # or .jsonl, a save_to_disk
                                                                    # directory, or a Hub name
      # path: simonjegou/ruler, subset: "4096", split: test         (Hub, with a cached copy offline)

Sources: a ``.jsonl`` / ``.json`` lines file (read directly), a ``.parquet`` file (pyarrow), a
directory written by ``datasets``' ``save_to_disk`` or a Hub name (through the ``hf`` dataset's
loader, :class:`~kvlab.data.hf.HFDataset`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlab.config.errors import ConfigError
from kvlab.data.datasets import DATASETS, check_metrics
from kvlab.data.hf import HFDataset
from kvlab.data.jsonl import read_json_lines
from kvlab.data.sample import Sample

#: the columns of kvpress' schema (``answer`` or ``answers`` holds the references)
COLUMNS = ("context", "question", "answer_prefix", "answer", "answers", "max_new_tokens")
WHERE = "data.dataset"


def context_key(context: str) -> str:
    """The ``context_id`` of a context text: the first 16 hex digits of its sha256."""
    return hashlib.sha256(context.encode()).hexdigest()[:16]


@DATASETS.register("kvpress")
@dataclass
class KVPressDataset:
    """Rows in kvpress' schema (context, question, answer_prefix, answer, max_new_tokens), as samples.

    ``path``: a ``.jsonl``/``.json`` lines file, a ``.parquet`` file, a ``save_to_disk`` directory or
    a Hub name (``split``, ``subset`` for the last two). ``id_field``: the column holding sample ids
    (default ``id``; without it a sample's id is its row number). ``limit``: the first rows only.
    """

    path: str
    split: str = "test"
    subset: str | None = None
    id_field: str = "id"
    limit: int | None = None
    metrics: tuple[str, ...] = ("contains_answer",)
    _rows: list[dict[str, Any]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.metrics = check_metrics(self.metrics)
        if self.limit is not None and (isinstance(self.limit, bool) or self.limit < 1):
            raise ConfigError(f"{WHERE}.limit must be >= 1 or null (all rows), got {self.limit!r}.")
        rows = self._load()
        if self.limit is not None:
            rows = rows[: self.limit]
        if not rows:
            raise ConfigError(f"{WHERE}.path: {self.path} has no rows. Point it at data in kvpress' schema.")
        self._rows = rows
        self.samples()  # every row checked now, before any model loads

    def _load(self) -> list[dict[str, Any]]:
        """The rows as dicts: JSON lines and parquet read here, datasets through the ``hf`` loader."""
        local = Path(self.path).expanduser()
        suffix = local.suffix.lower()
        if local.is_file() and suffix in (".jsonl", ".json"):
            return _json_lines(local)
        if local.is_file() and suffix == ".parquet":
            return _parquet(local)
        if local.is_file():
            raise ConfigError(
                f"{WHERE}.path: {local} has suffix '{local.suffix}'; the kvpress dataset reads .jsonl/.json "
                "lines files, .parquet files, save_to_disk directories and Hub names."
            )
        loader = HFDataset(
            path=self.path,
            split=self.split,
            subset=self.subset,
            fields={"prompt": "question", "context": "context"},
        )  # the hf loader: Hub names and save_to_disk directories, its column checks and messages
        return loader._rows

    def samples(self) -> list[Sample]:
        """One sample per row, in order (``context_id`` groups the rows of one context)."""
        out, seen = [], {}
        for index, row in enumerate(self._rows):
            sample = self._sample(index, row)
            if sample.id in seen:
                raise ConfigError(
                    f"{self.path} row {index}: duplicate id '{sample.id}' (first on row {seen[sample.id]}). "
                    f"Ids must be unique (predictions are keyed by them); fix column '{self.id_field}'."
                )
            seen[sample.id] = index
            out.append(sample)
        return out

    def _sample(self, index: int, row: dict[str, Any]) -> Sample:
        raw_id = row.get(self.id_field)
        sample_id = str(raw_id) if raw_id is not None else str(index)
        where = f"{self.path} row {index} (id '{sample_id}')"
        context = _text(row, "context", where, required=True)
        question = _text(row, "question", where, required=True)
        answer_prefix = _text(row, "answer_prefix", where, required=False)
        if not (context + question).strip():
            raise ConfigError(f"{where}: both 'context' and 'question' are empty; there is nothing to ask.")
        answers = _answers(row, where)
        limit = row.get("max_new_tokens")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            if isinstance(limit, float) and limit.is_integer() and limit >= 1:  # pandas' float columns
                limit = int(limit)
            else:
                raise ConfigError(
                    f"{where}: 'max_new_tokens' must be an integer >= 1 or absent, got {limit!r}. Fix the "
                    "value."
                )
        used = {*COLUMNS, self.id_field}
        meta = {k: v for k, v in row.items() if k not in used and isinstance(v, str | int | float | bool)}
        return Sample(
            id=sample_id,
            prompt=context + question,
            answers=answers,
            meta=meta,
            question=question,
            answer_prefix=answer_prefix,
            max_new_tokens=limit,
            context_id=context_key(context),
        )


def _text(row: dict[str, Any], column: str, where: str, required: bool) -> str:
    """A string column (absent or null: an error when ``required``, else ``""``)."""
    value = row.get(column)
    if value is None:
        if required:
            present = ", ".join(sorted(row)) or "none"
            raise ConfigError(
                f"{where} has no '{column}' (columns present: {present}). The kvpress dataset reads kvpress' "
                "schema: context, question, answer_prefix, answer, max_new_tokens."
            )
        return ""
    if not isinstance(value, str):
        raise ConfigError(f"{where}: '{column}' must be a string, got {type(value).__name__}. Fix the data.")
    return value


def _answers(row: dict[str, Any], where: str) -> list[str]:
    """``answer`` (or ``answers``): a string or a list of strings/numbers -> a list of strings."""
    value = row.get("answer", row.get("answers"))
    if value is None:
        return []
    if hasattr(value, "tolist"):  # a numpy array from a parquet list column
        value = value.tolist()
    items = value if isinstance(value, list | tuple) else [value]
    if not all(isinstance(v, str | int | float) and not isinstance(v, bool) for v in items):
        raise ConfigError(
            f"{where}: 'answer' must be a string or a list of strings, got {value!r}. Fix the data."
        )
    return [str(v) for v in items]


def _json_lines(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file (blank lines skipped); a line that is not a JSON object is an error."""
    fix = "Each line must be one JSON object with kvpress' columns (context, question, ...)."
    return [row for _, row in read_json_lines(path, fix)]


def _parquet(path: Path) -> list[dict[str, Any]]:
    """Rows of a parquet file, read with pyarrow."""
    try:
        import pyarrow.parquet as pq  # pyarrow (comes with datasets): slow to import, parquet files only
    except ImportError:
        raise ConfigError(f"{WHERE}.path: reading {path} needs pyarrow: `pip install pyarrow`.") from None
    try:
        return pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise ConfigError(
            f"{WHERE}.path: {path} cannot be read as parquet ({type(exc).__name__}: {exc})."
        ) from None
