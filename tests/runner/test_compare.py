"""Sweeps and `kvlab compare`: one run per value, the reference reused, table = metrics.json, plots."""

import csv
import json

import pytest
import yaml
from support.cli import TINY, predict, write_jsonl
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from kvlab.cli.main import main
from kvlab.cli.sweep import expand
from kvlab.config.errors import ConfigError
from kvlab.runner.fidelity_run import FidelityEvaluator
from kvlab.runner.run_names import parse_method, split_values

SNAP = ["--model.compression.budget.window", "4"]  # snapkv's window attention observes budget.window


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """A full run, then a CLI budget sweep, counting the full-cache runs made for references."""
    tmp = tmp_path_factory.mktemp("sweep")
    rows = [{"id": f"s{i}", "prompt": "word " * (25 + 10 * i), "answers": ["word"]} for i in range(3)]
    data = write_jsonl(tmp / "d.jsonl", rows)
    calls = []
    real = FidelityEvaluator.run

    def counting(self, pipeline, *args, **kwargs):
        calls.append(pipeline.compresses)
        return real(self, pipeline, *args, **kwargs)

    FidelityEvaluator.run = counting
    try:
        dataset = ["--data.dataset", f"{{name: jsonl, path: {data}}}"]
        predict(tmp, "--config", "full", *TINY, *dataset)
        full_runs = calls.count(False)
        predict(
            tmp, "--config", "snapkv", *TINY, *dataset, *SNAP, "--model.compression.budget.tokens", "12,24"
        )
    finally:
        FidelityEvaluator.run = real
    return tmp / "runs" / "exp", full_runs, calls.count(False) - full_runs


def test_sweep_writes_one_run_per_value_and_reuses_the_reference(swept):
    exp, full_runs, later_full_runs = swept
    methods = sorted(p.name for p in exp.iterdir() if (p / "predictions.jsonl").exists())
    assert methods == ["full", "snapkv@budget.tokens=12", "snapkv@budget.tokens=24"]
    config = yaml.safe_load((exp / "snapkv@budget.tokens=12" / "config.yaml").read_text())
    assert config["model"]["compression"]["budget"]["tokens"] == 12
    assert len(list((exp / "reference").glob("*.pt"))) == 3
    assert full_runs == 0  # `full` is its own reference
    assert later_full_runs == 0  # the sweep loaded the references `full` stored
    ratios = [json.loads((exp / m / "metrics.json").read_text())["kv_ratio"] for m in methods]
    assert ratios[0] == 1.0 and ratios[1] < ratios[2] < 1.0


def test_compare_table_equals_each_runs_metrics_json(swept, capsys):
    exp = swept[0]
    main(["compare", str(exp)])
    out = capsys.readouterr().out
    assert "| snapkv@budget.tokens=12 |" in out and "fidelity_top1" in out
    rows = list(csv.DictReader((exp / "compare.csv").open()))
    assert [r["method"] for r in rows] == ["full", "snapkv@budget.tokens=12", "snapkv@budget.tokens=24"]
    for row in rows:
        metrics = json.loads((exp / row["method"] / "metrics.json").read_text())
        for key in ("samples", "kv_ratio", "fidelity_kl", "fidelity_token_match", "contains_answer"):
            assert float(row[key]) == pytest.approx(metrics[key], rel=1e-3)
    assert float(rows[0]["fidelity_kl"]) == pytest.approx(0.0, abs=1e-6)
    assert (exp / "compare.md").read_text().startswith("| method |")


def test_sweep_plot_png_and_tensorboard_curves(swept):
    exp = swept[0]
    assert (exp / "quality_vs_memory.png").read_bytes()[:4] == b"\x89PNG"
    acc = EventAccumulator(str(exp / "compare" / "tensorboard" / "snapkv"))
    acc.Reload()
    steps = [e.step for e in acc.Scalars("sweep/fidelity_top1")]
    assert len(steps) == 2 and steps == sorted(steps) and all(0 < s < 1000 for s in steps)
    figure = EventAccumulator(str(exp / "compare" / "tensorboard" / "_figure"))
    figure.Reload()
    assert "sweep/quality_vs_memory" in figure.Tags()["images"]


def test_yaml_sweep_block_and_names(tmp_path):
    cfg = {
        "preset": "snapkv",
        "sweep": {"model.compression.budget.tokens": [16, 32], "model.max_new_tokens": [2, 3]},
    }
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(cfg))
    from kvlab.config.loader import resolve

    points = expand(resolve([str(tmp_path / "s.yaml")], []), [])
    assert [name for name, _ in points] == [
        "budget.tokens=16,max_new_tokens=2", "budget.tokens=16,max_new_tokens=3",
        "budget.tokens=32,max_new_tokens=2", "budget.tokens=32,max_new_tokens=3",
    ]  # fmt: skip
    assert points[3][1]["model"]["compression"]["budget"]["tokens"] == 32 and "sweep" not in points[3][1]
    assert points[3][1]["model"]["compression"]["budget"]["window"] == 32  # siblings kept
    assert parse_method("snapkv@budget.tokens=16,max_new_tokens=2") == (
        "snapkv", {"budget.tokens": "16", "max_new_tokens": "2"})  # fmt: skip
    assert split_values("[{name: a, w: 1}, {name: b}]") == ["[{name: a, w: 1}, {name: b}]"]
    with pytest.raises(ConfigError, match="non-empty list"):
        expand({"sweep": {"model.max_new_tokens": 3}}, [])


def test_compare_without_runs_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["compare", str(tmp_path)])
    assert info.value.code == 2 and "no runs" in capsys.readouterr().err
