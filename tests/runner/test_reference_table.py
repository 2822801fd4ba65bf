"""Tests for ``kvlab reference-table`` (kvlab.runner.reference_table): configs, the table, the CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvlab.cli import reference_table as reference_command
from kvlab.cli.main import main
from kvlab.config.errors import ConfigError
from kvlab.metrics import intervals
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


def _predictions(path: Path, scores: list[float], metric: str = "contains_answer") -> None:
    """A fabricated run: one record per sample, ids s0, s1, ... (the same samples in every run)."""
    path.mkdir(parents=True)
    lines = [json.dumps({"id": f"s{i}", metric: score}) for i, score in enumerate(scores)]
    (path / "predictions.jsonl").write_text("\n".join(lines) + "\n")


def test_table_with_intervals_marks_and_docs_section(tmp_path: Path) -> None:
    _predictions(tmp_path / "t" / "full", [1.0] * 8)
    _predictions(tmp_path / "t" / "random@budget=0.1", [0.0] * 8)
    _predictions(tmp_path / "t" / "random@budget=0.5", [1.0] * 4 + [0.0] * 4)
    _predictions(tmp_path / "t" / "knorm@budget=0.1", [1.0] * 7 + [0.0])
    text = reference.table(
        tmp_path, ["t"], ("full", "random", "knorm", "snapkv"), (0.1, 0.5), "contains_answer"
    )
    # Wilson 95% intervals of k/8 (closed form: 8/8 [67.6, 100], 0/8 [0, 32.4], 4/8 [21.5, 78.5],
    # 7/8 [52.9, 97.8]); McNemar against full (8/8): 0/8 has 8 discordant pairs, p = 2/2^8 (*),
    # 4/8 has 4, p = 1/8, 7/8 has 1; against the bold 7/8, 0/8 has 7 all one way, p = 2/2^7 (†)
    assert text.splitlines()[:6] == [
        "| method | t @ 10% | t @ 50% |",
        "|---|---|---|",
        "| full | 100.0 [68, 100] | 100.0 [68, 100] |",  # the full cache has no budget: every column
        "| random | 0.0 [0, 32]*† | 50.0 [22, 78] |",  # alone at 50%: no bold
        "| knorm | **87.5** [53, 98] | - |",
        "| snapkv | - | - |",  # not run
    ]
    assert "Wilson score interval" in text and "bootstrap" not in text  # only 0/1 scores here
    doc = tmp_path / "doc.md"
    doc.write_text(f"# T\n\nbefore\n{reference.MARK_START}\nold\n{reference.MARK_END}\nafter\n")
    reference.replace_section(doc, text)
    assert doc.read_text() == f"# T\n\nbefore\n{reference.MARK_START}\n{text}{reference.MARK_END}\nafter\n"
    doc.write_text("no markers")
    with pytest.raises(ConfigError, match="markers"):
        reference.replace_section(doc, text)


def test_table_bootstraps_fractional_scores(tmp_path: Path) -> None:
    """token_f1-like scores: the seeded percentile bootstrap, and the paired sign-flip test."""
    full = [0.9, 0.8, 1.0, 0.7, 0.95, 0.85, 0.9, 1.0, 0.75, 0.8]
    _predictions(tmp_path / "t" / "full", full, "token_f1")
    _predictions(tmp_path / "t" / "snapkv@budget=0.5", [v - 0.3 for v in full], "token_f1")
    _predictions(
        tmp_path / "t" / "knorm@budget=0.5", [v - 0.02 * (-1) ** i for i, v in enumerate(full)], "token_f1"
    )
    text = reference.table(tmp_path, ["t"], ("full", "snapkv", "knorm"), (0.5,), "token_f1")
    rows = text.splitlines()[2:5]
    low, high = intervals.bootstrap_interval([full])
    assert rows[0] == f"| full | 86.5 [{100 * low:.0f}, {100 * high:.0f}] |"
    assert rows[1].startswith("| snapkv | 56.5 [") and rows[1].endswith("]*† |")  # 10 of 10 lower: p = 2/2^10
    assert rows[2].startswith("| knorm | **86.5** [") and rows[2].endswith("] |")  # +-0.02 alternating: p = 1
    assert "percentile bootstrap (2000 resamples, seed 0" in text


def test_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "evaluation.md"
    doc.write_text(f"x\n{reference.MARK_START}\n{reference.MARK_END}\n")
    args = ["reference-table", "--model", "tiny-llama", "--methods", "full,random,simlayerkv",
            "--budgets", "0.5", "--tasks", "retrieval-512", "--samples", "2", "--dir", str(tmp_path / "runs"),
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
        tmp_path / "runs", ["retrieval-512"], ("full", "random", "simlayerkv"), (0.5,), "contains_answer"
    )
    assert expected in doc.read_text() and expected in capsys.readouterr().out
    assert "| random | " in expected and "| random | - |" not in expected  # scored, with its interval
    assert re.search(r"\| random \| \d+\.\d \[\d+, \d+\]", expected)
    # SimLayerKV asks for a token budget: its cell is refused before any run, left empty and named
    assert "| simlayerkv | - |" in expected and not (root / "simlayerkv@budget=0.5").exists()
    assert re.search(r"Refused, no run: `simlayerkv` at 50% on retrieval-512: .*budget", doc.read_text())


def test_bad_reference_table_options_exit_2_before_any_run(tmp_path: Path) -> None:
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


# ---- --suite ruler ----------------------------------------------------------------------------
SNAP = {"budget": {"ratio": 0.1, "window": 32}, "importance": {"attention": {"name": "window_attention"}}}


def _suite_run(root: Path, protocol: str, method: str, ratio: float | None, scores: dict) -> None:
    """A fabricated run of the suite: ``scores[(task, length)]`` -> per-sample string_match_all."""
    path = root / reference.suite_experiment(protocol) / reference.run_name(method, ratio)
    path.mkdir(parents=True)
    compression = {} if ratio is None else {**SNAP, "budget": {"ratio": ratio, "window": 32}}
    fields = {
        "model": {"model": "m", "compression": compression, "protocol": {"name": protocol}},
        "data": {"dataset": {"name": "ruler", "metrics": ["string_match_all"]}},
    }
    (path / "run.json").write_text(json.dumps({"fingerprint": "f", "fields": fields}))
    lines = [
        json.dumps({"id": f"{task}-{length}-{i}", "string_match_all": value, "kv_ratio": ratio or 1.0,
                    "meta": {"suite": "ruler", "task": task, "length": length}})
        for (task, length), values in scores.items() for i, value in enumerate(values)
    ]  # fmt: skip
    (path / "predictions.jsonl").write_text("\n".join(lines) + "\n")


def test_suite_config_sets_protocol_and_checks_the_engine_once() -> None:
    snap = reference.suite_config("snapkv", 0.25, "query_agnostic", TASK, RUN, "tiny-llama")
    assert snap["model"]["protocol"] == "query_agnostic" and snap["model"]["verify"] == "off"
    assert snap["model"]["compression"]["budget"] == {"window": 32, "ratio": 0.25}
    full = reference.suite_config("full", None, "query_aware", TASK, RUN)
    assert full["model"]["protocol"] == "query_aware" and full["model"]["verify"] == "first_batch"
    assert reference.suite_experiment("query_aware") == "ruler-query_aware"


def test_suite_table_against_hand_computed_means(tmp_path: Path) -> None:
    # two tasks x two lengths; snapkv at 0.1 and 0.5 under two protocols, full once per protocol
    full = {("a", 1024): [1.0], ("a", 2048): [1.0], ("b", 1024): [1.0], ("b", 2048): [0.0]}
    low = {("a", 1024): [1.0], ("a", 2048): [0.0], ("b", 1024): [0.5], ("b", 2048): [0.0]}
    high = {("a", 1024): [1.0], ("a", 2048): [1.0], ("b", 1024): [1.0], ("b", 2048): [0.25]}
    for protocol in ("query_aware", "query_agnostic"):
        _suite_run(tmp_path, protocol, "full", None, full)
        _suite_run(tmp_path, protocol, "snapkv", 0.1, low if protocol == "query_aware" else high)
        _suite_run(tmp_path, protocol, "snapkv", 0.5, high)
    text = reference.suite_table(
        tmp_path, ("query_aware", "query_agnostic"), ("full", "snapkv", "keydiff"), (0.1, 0.5)
    )
    # every cell with its 95% interval: full's 3 of 4 by Wilson, snapkv's fractional scores by the
    # bootstrap; one compressed method per column: no bold, and 4 samples resolve nothing
    assert "| full | 75.0 [30, 95] | 75.0 [30, 95] | 75.0 [30, 95] | 75.0 [30, 95] |" in text
    assert "| snapkv | 37.5 [0, 75] | 81.2 [62, 100] |" in text and not re.search(r"\] ?[*†]", text)
    lines = [re.sub(r" \[\d+, \d+\]", "", line) for line in text.splitlines()]  # the scores alone
    # overall = mean over tasks of the task means: full (1 + 0.5) / 2; snapkv@0.1 aware (0.5 + 0.25) / 2;
    # snapkv@0.5 (1 + 0.625) / 2
    start = lines.index(
        "| method | query_aware @ 10% | query_aware @ 50% | query_agnostic @ 10% | query_agnostic @ 50% |"
    )
    assert lines[start + 2 : start + 5] == [
        "| full | 75.0 | 75.0 | 75.0 | 75.0 |",
        "| snapkv | 37.5 | 81.2 | 81.2 | 81.2 |",
        "| keydiff | - | - | - | - |",  # not run
    ]
    # by task, mean over the budgets: snapkv aware a = (1 + 0 + 1 + 1) / 4, b = (0.5 + 0 + 1 + 0.25) / 4
    start = lines.index(
        "| method | query_aware: a | query_aware: b | query_agnostic: a | query_agnostic: b |"
    )
    assert lines[start + 2 : start + 4] == [
        "| full | 100.0 | 50.0 | 100.0 | 50.0 |",
        "| snapkv | 75.0 | 43.8 | 100.0 | 62.5 |",
    ]
    # by length (numeric order): snapkv aware 1024 = (1 + 0.5 + 1 + 1) / 4, 2048 = (0 + 0 + 1 + 0.25) / 4
    start = lines.index(
        "| method | query_aware: 1024 | query_aware: 2048 | query_agnostic: 1024 | query_agnostic: 2048 |"
    )
    assert lines[start + 2 : start + 4] == [
        "| full | 100.0 | 50.0 | 100.0 | 50.0 |",
        "| snapkv | 87.5 | 31.2 | 100.0 | 62.5 |",
    ]
    boards = reference.suite_boards(tmp_path, ("query_aware", "query_agnostic"), plots=False)
    figure = reference.plot_suite(boards, ("full", "snapkv"), tmp_path / "suite.png", "t")
    assert figure is not None and figure.stat().st_size > 10_000


def test_suite_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "evaluation.md"
    marks = f"{reference.MARK_START}\nkept\n{reference.MARK_END}"
    doc.write_text(f"x\n{marks}\n{reference.SUITE_START}\n{reference.SUITE_END}\n")
    main(["reference-table", "--suite", "ruler", "--model", "tiny-llama", "--methods", "full,snapkv",
          "--budgets", "0.5", "--tasks", "niah_single_1", "--lengths", "512", "--dir", str(tmp_path / "runs"),
          "--docs", str(doc), "--figure", str(tmp_path / "fig" / "suite.png")])  # fmt: skip
    for protocol in ("query_aware", "query_agnostic"):
        root = tmp_path / "runs" / f"ruler-{protocol}"
        assert sorted(p.name for p in root.iterdir() if (p / "predictions.jsonl").is_file()) == [
            "full",
            "snapkv@budget=0.5",
        ]
        for run in ("full", "snapkv@budget=0.5"):
            [record] = [json.loads(line) for line in (root / run / "predictions.jsonl").open()]
            assert record["protocol"] == protocol and record["meta"]["task"] == "niah_single_1"
            assert record["prompt_tokens"] + 128 <= 512 and "string_match_all" in record
            if run == "full":
                assert record["kv_ratio"] == 1.0
            else:  # the budget counts the context under query_agnostic; the question part is added
                assert 0.4 < record["kv_ratio"] < 0.75
        assert list(root.glob("score_vs_ratio.*.png")) and (root / "leaderboard.csv").is_file()  # per family
    text = (tmp_path / "runs" / "reference_suite.md").read_text()
    assert "niah_single_1 at 512 tokens, 1 sample(s) per task and length: **1 samples per cell**" in text
    assert text in doc.read_text() and text in capsys.readouterr().out
    assert marks in doc.read_text()  # the other table is kept
    assert (tmp_path / "fig" / "suite.png").is_file()
    assert "| full | " in text and "| snapkv | " in text


def test_suite_cli_errors(tmp_path: Path) -> None:
    for bad in (
        ["--protocols", "query_aware,bogus"],
        ["--tasks", "qa_1"],
        ["--tasks", "retrieval-1k"],
        ["--lengths", "128"],
        ["--lengths", "1k"],
        ["--methods", "snapkvv"],
        ["--batch-size", "0"],
    ):
        with pytest.raises(SystemExit) as info:
            main(["reference-table", "--suite", "ruler", "--dir", str(tmp_path), *bad])
        assert info.value.code == 2
    for suite_only in (["--protocols", "query_aware"], ["--lengths", "1024"], ["--no-plots"]):
        with pytest.raises(ConfigError, match="apply to --suite ruler or vlm only"):
            reference_command.main(["--dir", str(tmp_path), *suite_only])
    assert not any(tmp_path.iterdir())


def test_vlm_suite_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--suite vlm`` on the tiny LLaVA (plumbing only: it cannot read the reader's images); a
    preset that refuses the model is left empty and named."""
    from kvlab.runner import reference_vlm

    doc = tmp_path / "evaluation.md"
    doc.write_text(f"x\n{reference.VLM_MARKS[0]}\n{reference.VLM_MARKS[1]}\n")
    main(["reference-table", "--suite", "vlm", "--model", "tiny-llava", "--methods", "full,snapkv,sparsemm",
          "--budgets", "0.5", "--tasks", "reader_table,reader_doc", "--samples", "1", "--batch-size", "2",
          "--dir", str(tmp_path / "runs"), "--docs", str(doc), "--no-plots"])  # fmt: skip
    for protocol in ("query_aware", "query_agnostic"):
        root = tmp_path / "runs" / f"vlm-{protocol}"
        records = [json.loads(line) for line in (root / "snapkv@budget=0.5" / "predictions.jsonl").open()]
        assert [r["meta"]["task"] for r in records] == ["reader_table", "reader_doc"]
        assert all(r["protocol"] == protocol for r in records)
        assert not (root / "sparsemm@budget=0.5" / "predictions.jsonl").is_file()
    text = (tmp_path / "runs" / "reference_vlm.md").read_text()
    assert "reader tasks reader_table, reader_doc, 1 sample(s) per task: **2 samples per cell**" in text
    assert "| method | query_aware: reader_doc | query_aware: reader_table |" in text.replace(
        " | query_agnostic: reader_doc | query_agnostic: reader_table |", " |"
    )
    assert "Refused, no run: `sparsemm` at 50% under query_aware: " in text
    assert text in doc.read_text() and "By length" not in text
    assert reference_vlm.MODEL == "smollm2-reader" and reference_vlm.METHODS[0] == "full"


def test_vlm_suite_refuses_a_bad_model_and_a_suite_with_no_run(tmp_path: Path) -> None:
    """A typo in --model is an error before any cell, not a table of refused cells; a suite whose
    every cell is refused fails instead of writing an empty table over the docs block."""
    doc = tmp_path / "evaluation.md"
    doc.write_text(f"x\n{reference.VLM_MARKS[0]}\nkept\n{reference.VLM_MARKS[1]}\n")
    args = ["--suite", "vlm", "--budgets", "0.5", "--tasks", "reader_table",
            "--samples", "1", "--dir", str(tmp_path / "runs"), "--docs", str(doc), "--no-plots"]  # fmt: skip
    with pytest.raises(ConfigError, match="model.model"):
        reference_command.main([*args, "--model", "tiny-lava", "--methods", "snapkv"])
    with pytest.raises(ConfigError, match="every cell was refused.*`sparsemm` at 50% under query_aware"):
        reference_command.main([*args, "--model", "tiny-llama", "--methods", "sparsemm",
                                "--protocols", "query_aware"])  # fmt: skip
    assert "kept" in doc.read_text()
