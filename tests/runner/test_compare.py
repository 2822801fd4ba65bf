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
    """What TensorBoard's HPARAMS tab shows for ``logdir``, read by its own plugin code from the event
    files: ``([HParamInfo] in the experiment's order, [metric tag], {trial name: session run})``."""
    from tensorboard.plugins.hparams import metadata

    plugin_data, experiments = {}, []
    for events in logdir.rglob("events.out.tfevents.*"):
        run = str(events.parent.relative_to(logdir))
        acc = EventAccumulator(str(events.parent))
        acc.Reload()
        with contextlib.suppress(KeyError):  # a directory without hparams data
            plugin_data.setdefault(run, {}).update(acc.PluginTagToContent(metadata.PLUGIN_NAME))
    for tags in plugin_data.values():
        if metadata.EXPERIMENT_TAG in tags:
            experiments.append(metadata.parse_experiment_plugin_data(tags[metadata.EXPERIMENT_TAG]))
    assert len(experiments) == 1  # one experiment: its configuration orders the columns
    sessions = {
        metadata.parse_session_start_info_plugin_data(tags[metadata.SESSION_START_INFO_TAG]).group_name: run
        for run, tags in plugin_data.items()
        if metadata.SESSION_START_INFO_TAG in tags
    }
    metrics = [info.name.tag for info in experiments[0].metric_infos]
    return list(experiments[0].hparam_infos), metrics, sessions


def test_runs_compare_in_tensorboards_hparams_tab(swept):
    """Opened on the experiment, HPARAMS has one readable trial per run, the method, the budget and
    the model as its first columns, what each run kept whatever its budget was written as, and the
    real metrics, with no placeholder hp_metric."""
    exp = swept[0]
    columns, metrics, sessions = hparams_table(exp)
    assert set(sessions) == {"full (exp)", "snapkv@12 (exp)", "snapkv@24 (exp)"}  # what varies
    from tensorboard.plugins.hparams import api_pb2
    from tensorboard.plugins.hparams.backend_context import _sort_and_reduce_to_hparams_limit

    names = [c.name for c in columns]
    assert names[:3] == ["method", "budget", "model"]
    served = api_pb2.Experiment(hparam_infos=columns)
    _sort_and_reduce_to_hparams_limit(served)  # what TensorBoard's backend serves, in its order
    shown = [c.name for c in served.hparam_infos][:5]  # the first five are displayed
    assert shown[:3] == ["budget", "method", "model"]
    assert {"run", "protocol", "dataset", "budget.window", "kept.ratio", "kept.tokens"} <= set(names)
    assert "importance.attention" in names and "importance.attention.kernel" in names  # defaults too
    assert not {"budget.ratio", "budget.tokens", "preset"} & set(names)  # the budget is one column
    budget = next(c for c in columns if c.name == "budget")
    assert sorted(budget.domain_discrete) == ["12 tokens", "24 tokens", "full"]
    assert not [c for c in names if c.startswith(("_", "batch_size", "chat_template"))]
    assert metrics[0] == "task/contains_answer" and "fidelity/top1_share" in metrics
    assert "hp_metric" not in metrics
    snap = EventAccumulator(str(exp / sessions["snapkv@12 (exp)"]))
    snap.Reload()
    fidelity = json.loads((exp / "snapkv@budget.tokens=12" / "metrics.json").read_text())["fidelity_top1"]
    assert snap.Scalars("fidelity/top1_share")[0].value == pytest.approx(fidelity)


def test_sweep_plot_png_and_tensorboard_figure(swept):
    exp = swept[0]
    assert (exp / "quality_vs_memory.fidelity_kl.png").read_bytes()[:4] == b"\x89PNG"
    board = EventAccumulator(str(exp / "compare" / "tensorboard"))
    board.Reload()
    assert "quality_vs_memory/fidelity_kl" in board.Tags()["images"]
    assert not board.Tags()["scalars"]  # curves as figures: TensorBoard's smoothing cannot bend them


def test_compare_without_plots_leaves_no_figure_of_an_earlier_compare(swept, tmp_path):
    """After ``--no-plots`` every figure and TensorBoard TEXT is of the runs now, or absent."""
    import shutil

    from kvlab.runner.compare import write_comparison

    exp = shutil.copytree(swept[0], tmp_path / "exp")
    assert list(exp.glob("quality_vs_memory.*.png")) and (exp / "compare" / "tensorboard").is_dir()
    write_comparison(exp, plots=False)
    assert not list(exp.glob("quality_vs_memory*.png")) and not list(exp.glob("score_vs_*.png"))
    assert (exp / "compare.md").is_file()
    board = EventAccumulator(str(exp / "compare" / "tensorboard"))  # the HPARAMS configuration alone
    board.Reload()
    assert not board.Tags()["images"] and not board.Tags()["tensors"]


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
