"""Sweeps and `kvlab compare`: one run per value, the reference reused, table = metrics.json, plots."""

import contextlib
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


def hparams_table(logdir):
    """What TensorBoard's HPARAMS tab shows for ``logdir``, computed by its own plugin code from the
    event files: ``({column: HParamInfo}, {metric tag}, {trial name: session run})``."""
    from tensorboard.plugins.hparams import metadata
    from tensorboard.plugins.hparams.backend_context import Context

    plugin_data, scalars = {}, {}
    for events in logdir.rglob("events.out.tfevents.*"):
        run = str(events.parent.relative_to(logdir))
        acc = EventAccumulator(str(events.parent))
        acc.Reload()
        with contextlib.suppress(KeyError):  # a directory without hparams data
            plugin_data.setdefault(run, {}).update(acc.PluginTagToContent(metadata.PLUGIN_NAME))
        scalars.setdefault(run, set()).update(acc.Tags()["scalars"])
    assert not any(metadata.EXPERIMENT_TAG in tags for tags in plugin_data.values())  # no run's columns win
    columns = {info.name: info for info in Context(None)._compute_hparam_infos(plugin_data)}
    sessions = {
        metadata.parse_session_start_info_plugin_data(tags[metadata.SESSION_START_INFO_TAG]).group_name: run
        for run, tags in plugin_data.items()
        if metadata.SESSION_START_INFO_TAG in tags
    }
    metrics = set().union(*(scalars[run] for run in sessions.values()))
    return columns, metrics, sessions


def test_runs_compare_in_tensorboards_hparams_tab(swept):
    """Opened on the experiment, HPARAMS has one readable trial per run, the union of the runs'
    fields as columns (the full run has no budget, the sweep's budget.tokens differs) and the real
    metrics, with no placeholder hp_metric."""
    exp = swept[0]
    columns, metrics, sessions = hparams_table(exp)
    # short trial names: TensorBoard cuts them at about 15 characters
    assert set(sessions) == {"full (exp)", "snapkv@12 (exp)", "snapkv@24 (exp)"}
    assert {"run", "preset", "model", "protocol", "dataset", "budget.tokens", "budget.window"} <= set(columns)
    assert "importance.attention" in columns and "importance.attention.kernel" in columns  # defaults too
    assert columns["budget.tokens"].differs and columns["run"].differs and not columns["model"].differs
    assert (
        columns["budget.tokens"].domain_interval.min_value,
        columns["budget.tokens"].domain_interval.max_value,
    ) == (
        12,
        24,
    )
    assert not [c for c in columns if c.startswith(("_", "batch_size", "chat_template"))]
    assert {"task/contains_answer", "cost/kv_kept_over_full", "fidelity/top1_share",
            "time/prefill_s_per_sample"} <= metrics  # fmt: skip
    # TensorBoard shows the first five metrics by name: the KV kept, fidelity and the task
    first = ["cost/kv_kept_over_full", "fidelity/kl_nats_per_token", "fidelity/token_match_share",
             "fidelity/top1_share", "task/contains_answer"]  # fmt: skip
    assert sorted(metrics)[:5] == first
    assert "hp_metric" not in metrics
    snap = EventAccumulator(str(exp / sessions["snapkv@12 (exp)"]))
    snap.Reload()
    kv_ratio = json.loads((exp / "snapkv@budget.tokens=12" / "metrics.json").read_text())["kv_ratio"]
    assert snap.Scalars("cost/kv_kept_over_full")[0].value == pytest.approx(kv_ratio)


def test_sweep_plot_png_and_tensorboard_figure(swept):
    exp = swept[0]
    assert (exp / "quality_vs_memory.png").read_bytes()[:4] == b"\x89PNG"
    board = EventAccumulator(str(exp / "compare" / "tensorboard"))
    board.Reload()
    assert "sweep/quality_vs_memory" in board.Tags()["images"]
    assert not board.Tags()["scalars"]  # curves as figures: TensorBoard's smoothing cannot bend them


def test_compare_without_plots_leaves_no_figure_of_an_earlier_compare(swept, tmp_path):
    """After ``--no-plots`` every figure and TensorBoard TEXT is of the runs now, or absent."""
    import shutil

    from kvlab.runner.compare import write_comparison

    exp = shutil.copytree(swept[0], tmp_path / "exp")
    assert (exp / "quality_vs_memory.png").is_file() and (exp / "compare" / "tensorboard").is_dir()
    write_comparison(exp, plots=False)
    assert not (exp / "quality_vs_memory.png").exists() and not (exp / "compare" / "tensorboard").exists()
    assert not list(exp.glob("score_vs_*.png")) and (exp / "compare.md").is_file()


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
