"""A small sweep as a new user makes it (SnapKV and MixKV on SnapKV at two token budgets with
--model.model, one SnapKV run at a ratio), then `kvlab compare`: its event files hold legible
cards that carry information, trial names that say what varies, and one TensorBoard run per run."""

import json

import pytest
from support.cli import write_jsonl
from support.events import read_events
from tensorboard.plugins.hparams import metadata

from kvlab.cli.main import main
from kvlab.runner.compare import comparison_figures
from kvlab.runner.leaderboard import leaderboard
from kvlab.runner.runs import load_runs
from kvlab.runner.views.hparams import METRIC_TAGS
from kvlab.runner.views.names import SHOWN_CHARACTERS

COMMON = ["--model.model", "tiny-llama", "--trainer.enable_progress_bar", "false", "--model.max_new_tokens",
          "2", "--model.compression.budget.window", "4", "--model.inspect_samples", "1"]  # fmt: skip
#: scalars written per batch (the run's curves); the HPARAMS metrics are the only others
PER_BATCH = {"cost/kv_kept_over_full", "time/prefill_s_per_batch", "time/compression_s_per_batch",
             "time/decode_s_per_batch", "time/compression_over_prefill"}  # fmt: skip


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep_views")
    rows = [{"id": f"s{i}", "prompt": "word " * (30 + 10 * i), "answers": ["word"]} for i in range(2)]
    data = write_jsonl(tmp / "d.jsonl", rows)
    where = ["--data.dataset", f"{{name: jsonl, path: {data}}}", "--run.dir", str(tmp / "runs"),
             "--run.experiment", "sweep"]  # fmt: skip
    for preset in ("snapkv", "mixkv_snapkv"):
        main(["predict", "--config", preset, *COMMON, *where, "--model.compression.budget.tokens", "12,24"])
    main(["predict", "--config", "snapkv", *COMMON, *where, "--model.compression.budget.ratio", "0.5"])
    root = tmp / "runs" / "sweep"
    main(["compare", str(root)])
    return root


def trials(root):
    """``{run directory name: (trial name, hparams)}`` read from each run's event files."""
    out = {}
    for run in sorted(p for p in root.iterdir() if (p / "run.json").is_file()):
        content = read_events(run / "tensorboard").PluginTagToContent(metadata.PLUGIN_NAME)
        start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
        out[run.name] = (start.group_name, start.hparams)
    return out


def test_trial_names_say_what_varies_and_differ_in_what_tensorboard_shows(sweep):
    found = trials(sweep)
    # the directories keep kvlab predict's names, every override in them (the model's before the budget)
    snap12 = (
        "snapkv@budget.window=4,name=jsonl,path=d.jsonl,model=tiny-llama,max_new_tokens=2,budget.tokens=12"
    )
    assert snap12 in found
    names = sorted(name.removesuffix(" (sweep)") for name, _ in found.values())
    assert names == ["mixkv_snapkv@12", "mixkv_snapkv@24", "snapkv@12", "snapkv@24", "snapkv@50%"]
    assert len({name[:SHOWN_CHARACTERS] for name in names}) == len(names)
    for _, hparams in found.values():  # what each run kept, whatever its budget was written as
        assert 0 < hparams["kept.ratio"].number_value <= 1 and hparams["kept.tokens"].number_value > 0
    tokens = {run: h["kept.tokens"].number_value for run, (_, h) in found.items()}
    assert tokens[snap12] == pytest.approx(12)


def test_the_experiment_orders_the_columns_method_budget_model(sweep):
    content = read_events(sweep / "compare" / "tensorboard").PluginTagToContent(metadata.PLUGIN_NAME)
    experiment = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG])
    columns = [info.name for info in experiment.hparam_infos]
    assert columns[:3] == ["method", "budget", "model"]
    # TensorBoard sorts by the `differs` flag, then by name: only the leading three are flagged
    assert [info.name for info in experiment.hparam_infos if info.differs] == columns[:3]
    assert next(i for i in experiment.hparam_infos if i.name == "budget").domain_discrete  # every run has one
    assert [info.name.tag for info in experiment.metric_infos][0] == "task/contains_answer"


def test_each_run_is_one_tensorboard_run_with_cards_that_carry_information(sweep):
    for run in sorted(p for p in sweep.iterdir() if (p / "run.json").is_file()):
        board = run / "tensorboard"
        assert not [p for p in board.iterdir() if p.is_dir()]  # no second run (tensorboard/summary)
        acc = read_events(board)
        tags = acc.Tags()
        layers = len(
            json.loads((run / "predictions.jsonl").read_text().splitlines()[0])["kept_per_layer_head"]
        )
        # one number everywhere (uniform budgets) draws no heatmap; text alone draws no modality figure
        assert set(tags["images"]) == {"budget/kept_per_layer"}
        inspected = {int(tag.rsplit("_", 1)[1]) for tag in tags["histograms"]}
        assert inspected == {0, layers - 1}  # model.inspect_layers' default: first and last
        roles = {tag.split("/")[1] for tag in tags["histograms"]}
        assert len(tags["histograms"]) == 2 * len(roles)
        # end-of-run numbers are HPARAMS metrics (scalars TensorBoard needs) and TEXT, nothing more
        end_of_run = set(tags["scalars"]) - PER_BATCH
        assert {tag for tag in end_of_run if not tag.startswith("task/")} <= set(METRIC_TAGS.values())
        table = acc.Tensors("results/metrics/text_summary")[0].tensor_proto.string_val[0].decode()
        assert "| kept | `kept / prompt tokens per layer and KV head` | uniform: " in table
        config = acc.Tensors("run/config/text_summary")[0].tensor_proto.string_val[0].decode()
        assert config.startswith("**method** `") and "**budget**" in config.splitlines()[0]


def test_compare_figures_are_cards_with_a_legend_naming_every_method(sweep):
    """Checked on the figure objects before rendering: the legend is the figure's (drawn inside it,
    never cut from the image), names every method, and coinciding lines are moved apart."""
    runs = load_runs(sweep)
    figures = comparison_figures(sweep, runs, leaderboard(runs))
    assert "score_vs_tokens/jsonl" in figures and "quality_vs_memory/fidelity_kl" in figures
    for tag, (_, fig) in figures.items():
        assert 500 <= fig.get_figwidth() * fig.dpi <= 600, tag  # the per-run figures' width
        assert len(fig.legends) == 1, tag
        legend = fig.legends[0]
        labels = [text.get_text() for text in legend.get_texts()]
        assert {line.get_label() for line in fig.axes[0].get_lines()} <= set(labels), tag  # every line named
        if tag != "score_vs_ratio/jsonl":  # (MixKV ran at token budgets only)
            assert {"snapkv", "mixkv_snapkv"} <= set(labels), tag
        fig.canvas.draw()
        box, frame = legend.get_window_extent(), fig.bbox
        assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1, tag
        lines = [line for line in fig.axes[0].get_lines() if line.get_label() in labels]
        drawn = [tuple(zip(line.get_xdata(), line.get_ydata(), strict=True)) for line in lines]
        assert len(set(drawn)) == len(drawn), tag  # no method hidden under another's line
    markdown = (sweep / "compare.md").read_text()
    header = markdown.splitlines()[0]
    assert "KV kept %" in header and "peak MiB" in header and "peak_memory_bytes" not in header
    snap12 = (
        "snapkv@budget.window=4,name=jsonl,path=d.jsonl,model=tiny-llama,max_new_tokens=2,budget.tokens=12"
    )
    assert f"| snapkv@12 | {snap12} |" in markdown  # the display name beside its directory
