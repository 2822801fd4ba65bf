"""docs/write_a_component.md is true: its scorer passes its naive test and its preset runs
through `kvlab predict` on a tiny model, loaded with `imports:` and no edit to kvlab."""

import itertools
import json
import re

import torch
from naive.context import make_ctx
from support.paths import REPO

from kvlab.cli.main import main
from kvlab.compression.importance import IMPORTANCE

PAGE = REPO / "docs" / "write_a_component.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", PAGE.read_text(), flags=re.S)


def test_the_page_is_under_40_lines_of_code():
    code = [line for block in blocks("python") + blocks("yaml") for line in block.splitlines()]
    assert len(code) < 40


def test_the_scorer_passes_its_naive_test_and_its_preset_runs(tmp_path, monkeypatch):
    scorer, test = blocks("python")
    preset = blocks("yaml")[0]
    (tmp_path / "vatp.py").write_text(scorer)
    (tmp_path / "vatp.yaml").write_text(preset)
    rows = [{"id": f"s{i}", "prompt": "word " * (60 + 20 * i), "answers": ["x"]} for i in range(2)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)
    main(
        [
            "predict", "--config", str(tmp_path / "vatp.yaml"), "--model.model", "tiny-llama",
            "--model.max_new_tokens", "2", "--model.fidelity", "false",
            "--model.compression.budget", "{tokens: 40, window: 8}",
            "--trainer.enable_progress_bar", "false", "--data.dataset", f"{{name: jsonl, path: {data}}}",
            "--run.dir", str(tmp_path / "runs"), "--run.experiment", "doc",
        ]
    )  # fmt: skip
    run = next((tmp_path / "runs" / "doc").iterdir())
    records = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == ["s0", "s1"]
    assert all(count == 40 for r in records for row in r["kept_per_layer_head"] for count in row)

    # the naive test of the page, on the class the preset's `imports:` registered
    scorer_class = IMPORTANCE.get("value_weighted_attention")
    namespace = {"ValueWeightedAttention": scorer_class, "make_ctx": make_ctx, "itertools": itertools}
    namespace["torch"] = torch
    exec(test, namespace)  # noqa: S102  (the page's own test)
    namespace["test_value_weighted_attention_matches_a_loop"]()
