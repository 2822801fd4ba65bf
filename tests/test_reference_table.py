"""Tests for ``kvlab reference-table`` (kvlab.runner.reference_table): configs, the table, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlab.config.cli import main
from kvlab.config.errors import ConfigError
from kvlab.runner import reference_table as reference

TASK = {"name": "synthetic_retrieval", "context_tokens": 512, "num_samples": 2}
RUN = {"dir": "d", "experiment": "e", "method": "m"}


def test_run_config_replaces_token_budget_by_ratio() -> None:
    snap = reference.run_config("snapkv", 0.1, TASK, RUN)
    assert snap["model"]["compression"]["budget"] == {"window": 32, "ratio": 0.1}
    assert snap["model"]["model"] == "smollm2-135m" and snap["model"]["fidelity"] is False
    assert snap["data"]["dataset"] == TASK and snap["run"] == RUN
    assert snap["model"]["compression"]["importance"]["attention"]["name"] == "window_attention"
    stream = reference.run_config("streamingllm", 0.25, TASK, RUN, "tiny-llama")
    assert stream["model"]["compression"]["budget"] == {"window": 0, "sinks": 4, "ratio": 0.25}
    assert stream["model"]["model"] == "tiny-llama"
    assert not reference.run_config("full", None, TASK, RUN)["model"].get("compression")


def test_cells_run_full_once() -> None:
    assert reference.cells(("full", "random", "snapkv"), (0.1, 0.25)) == [
        ("full", None), ("random", 0.1), ("random", 0.25), ("snapkv", 0.1), ("snapkv", 0.25),
    ]  # fmt: skip
    assert (
        reference.run_name("snapkv", 0.1) == "snapkv@budget=0.1"
        and reference.run_name("full", None) == "full"
    )


def _metrics(path: Path, value: float) -> None:
    path.mkdir(parents=True)
    (path / "metrics.json").write_text(json.dumps({"samples": 2, "contains_answer": value}))


def test_table_and_docs_section(tmp_path: Path) -> None:
    _metrics(tmp_path / "t" / "full", 1.0)
    _metrics(tmp_path / "t" / "random@budget=0.1", 0.0)
    _metrics(tmp_path / "t" / "random@budget=0.5", 0.5)
    text = reference.table(tmp_path, ["t"], ("full", "random", "snapkv"), (0.1, 0.5), "contains_answer")
    assert text.splitlines() == [
        "| method | t @ 10% | t @ 50% |",
        "|---|---|---|",
        "| full | 1.00 | 1.00 |",  # the full cache has no budget: the same run in every column
        "| random | 0.00 | 0.50 |",
        "| snapkv | - | - |",  # not run
    ]
    doc = tmp_path / "doc.md"
    doc.write_text(f"# T\n\nbefore\n{reference.MARK_START}\nold\n{reference.MARK_END}\nafter\n")
    reference.replace_section(doc, text)
    assert doc.read_text() == f"# T\n\nbefore\n{reference.MARK_START}\n{text}{reference.MARK_END}\nafter\n"
    doc.write_text("no markers")
    with pytest.raises(ConfigError, match="markers"):
        reference.replace_section(doc, text)


def test_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "evaluation.md"
    doc.write_text(f"x\n{reference.MARK_START}\n{reference.MARK_END}\n")
    args = ["reference-table", "--model", "tiny-llama", "--methods", "full,random", "--budgets", "0.5",
            "--tasks", "retrieval-512", "--samples", "2", "--dir", str(tmp_path / "runs"),
            "--docs", str(doc)]  # fmt: skip
    main(args)
    root = tmp_path / "runs" / "retrieval-512"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["full", "random@budget=0.5"]
    for run in ("full", "random@budget=0.5"):
        records = [json.loads(line) for line in (root / run / "predictions.jsonl").read_text().splitlines()]
        assert len(records) == 2 and all(r["prompt_tokens"] > 400 for r in records)
    ratios = [
        json.loads(line)["kv_ratio"] for line in (root / "random@budget=0.5" / "predictions.jsonl").open()
    ]
    assert all(0.4 < r < 0.6 for r in ratios)
    expected = reference.table(
        tmp_path / "runs", ["retrieval-512"], ("full", "random"), (0.5,), "contains_answer"
    )
    assert expected in doc.read_text() and expected in capsys.readouterr().out
    assert "| random | " in expected and "-" not in expected.splitlines()[-1]


def test_cli_errors(tmp_path: Path) -> None:
    for bad in (
        ["--methods", "snapkvv"],
        ["--tasks", "retrieval-9k"],
        ["--budgets", "0.1,x"],
        ["--budgets", "2"],
    ):
        with pytest.raises(SystemExit) as info:
            main(["reference-table", "--dir", str(tmp_path), *bad])
        assert info.value.code == 2
    assert not any(tmp_path.iterdir())
