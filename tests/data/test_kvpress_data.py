"""The ``kvpress`` dataset: kvpress' evaluation schema read unchanged from JSONL, parquet and a
``datasets`` directory (local fixtures only)."""

from __future__ import annotations

import pytest
from support.cli import write_jsonl

from kvlab.config.errors import ConfigError
from kvlab.data import DATASETS
from kvlab.data.kvpress import context_key
from kvlab.data.sample import Sample

FIRST = "Alice keeps 3 red apples in a basket by the door. "
SECOND = "The train leaves at 7 from platform 2. "
ROWS = [
    {"context": FIRST, "question": "How many apples?", "answer_prefix": "Answer:", "answer": ["3", "three"],
     "max_new_tokens": 4, "task": "count"},
    {"context": FIRST, "question": "Where is the basket?", "answer_prefix": "Answer:",
     "answer": ["by the door"], "max_new_tokens": 8, "task": "where"},
    {"context": SECOND, "question": "When does the train leave?", "answer_prefix": "", "answer": ["7"],
     "max_new_tokens": 2, "task": "when"},
]  # fmt: skip


def expected() -> list[Sample]:
    return [
        Sample(
            id=str(i),
            prompt=row["context"] + row["question"],
            answers=row["answer"],
            meta={"task": row["task"]},
            question=row["question"],
            answer_prefix=row["answer_prefix"],
            max_new_tokens=row["max_new_tokens"],
            context_id=context_key(row["context"]),
        )
        for i, row in enumerate(ROWS)
    ]


def load(path, **params) -> list[Sample]:
    return DATASETS.build({"name": "kvpress", "path": str(path), **params}).samples()


def test_jsonl_rows_become_samples_grouped_by_context(tmp_path):
    samples = load(write_jsonl(tmp_path / "d.jsonl", ROWS))
    assert samples == expected()
    assert (
        samples[0].context == FIRST
        and samples[0].context_id == samples[1].context_id != samples[2].context_id
    )
    assert load(write_jsonl(tmp_path / "l.jsonl", ROWS), limit=2) == expected()[:2]


def test_parquet_rows_equal_the_jsonl_ones(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert load(path) == expected()


def test_a_saved_hf_dataset_equals_the_jsonl_rows(tmp_path):
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "saved"
    datasets.DatasetDict({"test": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(path))
    assert load(path) == expected()


def test_scalar_answers_ids_and_optional_columns(tmp_path):
    rows = [{"id": "q7", "context": FIRST, "question": "", "answers": "3"}]  # no prefix, no limit
    [s] = load(write_jsonl(tmp_path / "d.jsonl", rows))
    assert (s.id, s.answers, s.answer_prefix, s.max_new_tokens, s.question) == ("q7", ["3"], "", None, "")
    assert s.context == FIRST and s.prompt == FIRST


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"question": "Q?"}], "has no 'context'"),
        ([{"context": FIRST, "question": "Q?", "max_new_tokens": 0}], "'max_new_tokens' must be an integer"),
        ([{"context": FIRST, "question": 3}], "'question' must be a string"),
        ([{"context": FIRST, "question": "Q?", "answer": {"a": 1}}], "'answer' must be a string"),
        (
            [{"id": 1, "context": FIRST, "question": "Q?"}, {"id": 1, "context": FIRST, "question": "R?"}],
            "duplicate id",
        ),
        (["not json"], "malformed JSON"),
    ],
)
def test_bad_rows_are_refused_naming_the_row(tmp_path, rows, message):
    with pytest.raises(ConfigError, match=message):
        load(write_jsonl(tmp_path / "d.jsonl", rows))


def test_unknown_file_types_are_refused(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("context,question\n")
    with pytest.raises(ConfigError, match="has suffix '.csv'"):
        load(path)


def test_a_kvpress_file_given_as_jsonl_is_refused_naming_the_kvpress_dataset(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(ConfigError, match=r"d.jsonl:1: .*kvpress' schema.*name: kvpress, path: "):
        DATASETS.build({"name": "jsonl", "path": str(path)})
