"""docs/write_a_component.md is true: its scorer is TOVA's shipped class, its naive test passes, its
preset is configs/tova.yaml and runs through `kvlab predict` on a tiny model, and the scorer,
written to a file of its own under a new name, is loaded with `imports:` and no edit to kvlab."""

import json
import re

import torch
import yaml
from naive.context import make_ctx
from support.paths import REPO

from kvlab.cli.main import main
from kvlab.compression.importance import IMPORTANCE

PAGE = REPO / "docs" / "write_a_component.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", PAGE.read_text(), flags=re.S)


def code_lines(block: str) -> list[str]:
    return [line for line in block.splitlines() if line.strip()]


def test_the_page_is_under_40_lines_of_code():
    assert len([line for block in blocks("python") + blocks("yaml") for line in code_lines(block)]) < 40


def test_the_scorer_and_the_preset_are_the_shipped_ones():
    scorer = blocks("python")[0]
    shipped = (REPO / "kvlab" / "compression" / "tova.py").read_text().splitlines()
    # the docstring is its summary line, closed
    assert [line for line in code_lines(scorer) if line.removesuffix('"""') not in shipped] == []
    preset = yaml.safe_load(blocks("yaml")[0])
    assert preset == yaml.safe_load((REPO / "configs" / "tova.yaml").read_text())


def test_the_naive_test_passes():
    scorer_test = blocks("python")[1]
    namespace = {"make_ctx": make_ctx, "IMPORTANCE": IMPORTANCE, "torch": torch}
    exec(scorer_test, namespace)  # noqa: S102  (the page's own test)
    namespace["test_tova_scores_match_the_formula"]()


def predict(tmp_path, config: str, experiment: str) -> list[dict]:
    rows = [{"id": f"s{i}", "prompt": "word " * (60 + 20 * i), "answers": ["x"]} for i in range(2)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    main(
        [
            "predict", "--config", config, "--model.model", "tiny-llama",
            "--model.max_new_tokens", "2", "--model.fidelity", "false",
            "--model.compression.budget", "{tokens: 40, window: 0}",
            "--trainer.enable_progress_bar", "false", "--data.dataset", f"{{name: jsonl, path: {data}}}",
            "--run.dir", str(tmp_path / "runs"), "--run.experiment", experiment,
        ]
    )  # fmt: skip
    run = next((tmp_path / "runs" / experiment).iterdir())
    return [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]


def test_the_preset_runs_and_the_scorer_loads_as_a_plugin(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tova.yaml").write_text(blocks("yaml")[0])
    shipped = predict(tmp_path, str(tmp_path / "tova.yaml"), "shipped")
    assert [r["id"] for r in shipped] == ["s0", "s1"]
    assert all(count == 40 for r in shipped for row in r["kept_per_layer_head"] for count in row)

    # the page's class, in a file outside kvlab under a new name, loaded by `imports:`
    # (a name no other test registers: the registry is process-wide, and the plugin tests' own
    # scorer is `my_scorer`)
    (tmp_path / "docs_tova.py").write_text(blocks("python")[0].replace('"tova"', '"docs_tova"'))
    (tmp_path / "mine.yaml").write_text(
        "preset: tova\nimports: [docs_tova.py]\n"
        "model: {compression: {importance: {attention: {name: docs_tova}}}}\n"
    )
    try:
        mine = predict(tmp_path, str(tmp_path / "mine.yaml"), "mine")
    finally:
        IMPORTANCE.unregister("docs_tova")
    assert [r["kept_per_layer_head"] for r in mine] == [r["kept_per_layer_head"] for r in shipped]
    assert [r["output"] for r in mine] == [r["output"] for r in shipped]
