"""The ``hf`` dataset (Hugging Face ``datasets``) on a dataset built and saved here (no network)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from support.cli import write_jsonl

from kvlab.config.errors import ConfigError
from kvlab.data import DATASETS


@pytest.fixture(scope="module")
def saved_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import datasets

    rows = {
        "qid": ["a", "b", "c"],
        "question": ["What?", "Which?", "Who?"],
        "passage": ["ctx one", "ctx two", "ctx three"],
        "answer": [{"text": ["x", "y"]}, {"text": ["z"]}, {"text": ["w"]}],
        "options": [["p", "q"], ["r", "s"], ["t", "u"]],
        "label": [1, 0, 1],
        "img": [Image.new("RGB", (4, 4), (255, 0, 0)), Image.new("L", (4, 4), 9), Image.new("RGB", (5, 5))],
        "extra": [1, 2, 3],
    }
    table = datasets.Dataset.from_dict(rows).cast_column("img", datasets.Image())
    path = tmp_path_factory.mktemp("hf") / "saved"
    datasets.DatasetDict({"test": table, "train": table}).save_to_disk(str(path))
    return path


def test_hf_field_mapping(saved_hf: Path) -> None:
    fields = {"prompt": "question", "context": "passage", "answers": "answer.text", "image": "img",
              "id": "qid", "choices": "options"}  # fmt: skip
    ds = DATASETS.build({"name": "hf", "path": str(saved_hf), "fields": fields, "limit": 2})
    first, second = ds.samples()
    assert (first.id, first.prompt) == ("a", "ctx one\n\nWhat?")
    assert (first.answers, first.choices) == (["x", "y"], ["p", "q"])
    assert first.meta == {"label": 1, "extra": 1}  # unmapped scalar columns
    assert first.images[0].getpixel((0, 0)) == (255, 0, 0)
    assert second.images[0].mode == "RGB" and second.images[0].getpixel((0, 0)) == (9, 9, 9)
    assert ds.metrics == ("contains_answer",)


def test_hf_template_answer_index_and_alias(saved_hf: Path) -> None:
    fields = {"prompt": "question", "answers": "label", "choices": "options"}
    node = {"name": "huggingface", "path": str(saved_hf), "split": "train", "template": "{prompt}\n{choices}",
            "answer_is_index": True, "fields": fields,
            "metrics": ["choice_accuracy", "exact_match"]}  # fmt: skip
    ds = DATASETS.build(node)
    samples = ds.samples()
    assert [s.id for s in samples] == ["train-0", "train-1", "train-2"]  # no id column: split-row
    assert samples[0].prompt == "What?\nA. p\nB. q" and samples[0].answers == ["q"]
    assert [s.answers for s in samples] == [["q"], ["r"], ["u"]]
    assert ds.metrics == ("choice_accuracy", "exact_match")


def test_hf_dataset_reads_a_jsonl_data_file_with_field_mapping(tmp_path: Path) -> None:
    file = write_jsonl(tmp_path / "rows.jsonl", [{"q": "one", "a": 1}, {"q": "two", "a": 2}])
    node = {"name": "hf", "path": str(file), "fields": {"prompt": "q", "answers": "a"}}
    samples = DATASETS.build(node).samples()
    assert [(s.prompt, s.answers) for s in samples] == [("one", ["1"]), ("two", ["2"])]


@pytest.mark.parametrize(
    ("change", "match"),
    [({"fields": {"prompt": "quest"}}, r"fields\.prompt: column 'quest'.*Available columns: qid, question"),
     ({"split": "validation"}, r"'validation' is not a split.*Available splits: test, train"),
     ({"fields": {"answers": "answer"}}, r"no 'prompt' key"),
     ({"fields": {"prompt": "question", "question": "x"}}, r"unknown keys \['question'\]"),
     ({"fields": {"prompt": 3}}, r"\['prompt'\] must name columns"),
     ({"fields": {"prompt": "question", "answers": "options"}, "answer_is_index": True}, "not indices"),
     ({"template": "{prompt} {passage}"}, r"unknown keys \['passage'\]"),
     ({"metrics": []}, "data.dataset.metrics is empty"),
     ({"path": "./no/such/dir"}, "neither a data file nor a directory")],
)  # fmt: skip
def test_hf_dataset_errors_name_the_field_to_fix(saved_hf: Path, change: dict[str, Any], match: str) -> None:
    node = {"name": "hf", "path": str(saved_hf), "fields": {"prompt": "question"}, **change}
    with pytest.raises(ConfigError, match=match):
        DATASETS.build(node).samples()


def test_hf_through_kvlab_predict(saved_hf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvlab.cli.main import main

    fields = "{prompt: question, context: passage, answers: answer.text, id: qid}"
    common = ["predict", "--config", "full", "--model.model", "tiny-llama", "--model.max_new_tokens", "3",
              "--run.dir", str(tmp_path), "--run.experiment", "hf", "--run.method", "full"]  # fmt: skip
    with pytest.raises(SystemExit) as info:  # a bad column: exit 2 naming the columns
        main([*common, "--data.dataset", f"{{name: hf, path: {saved_hf}, fields: {{prompt: q}}}}"])
    assert info.value.code == 2 and "Available columns: qid, question" in capsys.readouterr().err
    node = f"{{name: hf, path: {saved_hf}, split: train, fields: {fields}, metrics: [token_f1]}}"
    main([*common, "--data.dataset", node])
    lines = (tmp_path / "hf" / "full" / "predictions.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["id"] for r in records] == ["a", "b", "c"]
    assert [r["answers"] for r in records] == [["x", "y"], ["z"], ["w"]]
    assert all("token_f1" in r and "contains_answer" not in r for r in records)
