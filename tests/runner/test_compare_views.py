"""`kvlab compare`'s leaderboard (methods x budget per task family, CSV, plots, TensorBoard) on a
hand-built experiment, and the rendered TensorBoard figures (sizes, no pixel-strip images)."""

import csv
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from kvlab.cli.main import main
from kvlab.runner import marked_cells
from kvlab.runner.leaderboard import budget_point, cell_samples, leaderboard
from kvlab.runner.runs import load_runs
from kvlab.runner.views import run_label
from kvlab.runner.views.figures import heatmap_figure, layer_curves_figure, render
from kvlab.runner.views.patches import patch_figure

ATTENTION = {"attention": {"name": "window_attention"}}


def write_run(root, name, budget, samples, dataset="bench"):
    """A run directory: run.json with the model and data fields, and one record per sample
    ``(task, family, metric, score)``."""
    path = root / name
    path.mkdir(parents=True)
    scorer = {"random": {}} if name.startswith("random") else ATTENTION
    compression = {} if budget is None else {"budget": budget, "importance": scorer}
    fields = {"model": {"model": "tiny-llama", "compression": compression, "max_new_tokens": 4},
              "data": {"dataset": {"name": "jsonl", "path": f"{dataset}.jsonl"}}}  # fmt: skip
    (path / "run.json").write_text(json.dumps({"fingerprint": "x", "fields": fields}))
    kv_ratio = 1.0 if budget is None else 0.3
    records = [
        {
            "id": f"{dataset}-{i}",
            "kv_ratio": kv_ratio,
            "meta": {"task": t, "task_family": f, "metric": m},
            m: score,
        }
        for i, (t, f, m, score) in enumerate(samples)
    ]
    (path / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def samples(doc, chart_a, chart_b):
    """Two docvqa samples (anls), one sample of each of two chart tasks in the family `chart`."""
    return [
        ("docvqa", "document", "anls", doc[0]),
        ("docvqa", "document", "anls", doc[1]),
        ("chartqa", "chart", "relaxed_accuracy", chart_a),
        ("plotqa", "chart", "relaxed_accuracy", chart_b),
    ]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench") / "exp"
    write_run(root, "full", None, samples((1.0, 0.5), 1.0, 1.0))
    write_run(root, "snapkv@budget.ratio=0.1", {"ratio": 0.1, "window": 8}, samples((0.5, 0.0), 1.0, 0.0))
    write_run(root, "snapkv@budget.ratio=0.5", {"ratio": 0.5, "window": 8}, samples((1.0, 0.5), 1.0, 0.0))
    write_run(root, "random@budget.ratio=0.1", {"ratio": 0.1, "window": 8}, samples((0.0, 0.0), 0.0, 0.0))
    # a method run task by task (two runs of one budget, other datasets): pooled into one cell
    write_run(
        root,
        "random@budget.ratio=0.5,name=a",
        {"ratio": 0.5, "window": 8},
        samples((1.0, 1.0), 1.0, 1.0)[:2],
        "a",
    )
    write_run(
        root,
        "random@budget.ratio=0.5,name=b",
        {"ratio": 0.5, "window": 8},
        samples((1.0, 1.0), 0.0, 1.0)[2:],
        "b",
    )
    main(["compare", str(root)])
    return root


def test_budget_point_reads_ratio_tokens_or_full_from_run_fields():
    assert (
        budget_point({"model": {"compression": {"budget": 0.2, "importance": ATTENTION}}}).label
        == "ratio=0.2"
    )
    assert (
        budget_point(
            {"model": {"compression": {"budget": {"tokens": 64}, "diversity": {"keydiff": {}}}}}
        ).label
        == "tokens=64"
    )
    assert budget_point({"model": {"compression": {}}}).label == "full"
    assert (
        budget_point({"model": {"compression": {"budget": 0.2}}}).label == "full"
    )  # no scorer: nothing evicted


def test_leaderboard_table_by_hand(bench):
    board = leaderboard(load_runs(bench))
    assert [b.label for b in board.budgets] == ["ratio=0.1", "ratio=0.5"]
    assert board.metrics == {"document": ["anls"], "chart": ["relaxed_accuracy"]}
    # document = docvqa's mean; chart = mean of chartqa's and plotqa's means; overall = mean of both
    expected = {  # method: {budget: (document, chart)}
        "full": {"ratio=0.1": (75.0, 100.0), "ratio=0.5": (75.0, 100.0)},  # fills every column
        "snapkv": {"ratio=0.1": (25.0, 50.0), "ratio=0.5": (75.0, 50.0)},
        "random": {"ratio=0.1": (0.0, 0.0), "ratio=0.5": (100.0, 50.0)},  # pooled from runs a and b
    }
    for method, cells in expected.items():
        for budget, (document, chart) in cells.items():
            assert board.scores["document"][method][budget] == pytest.approx(document)
            assert board.scores["chart"][method][budget] == pytest.approx(chart)
            assert board.scores["overall"][method][budget] == pytest.approx((document + chart) / 2)
    assert board.full == {"full"}
    # every cell's per-sample scores give back its score (the macro mean), the full cache's in every column
    for family, rows in board.scores.items():
        for method, by_label in rows.items():
            for label, score in by_label.items():
                samples = cell_samples(board, family, method, label)
                assert 100 * marked_cells.value(samples) == pytest.approx(score)
    assert cell_samples(board, "chart", "snapkv", "ratio=0.1") == {
        ("chart", "chartqa"): {"bench-2": 1.0},
        ("chart", "plotqa"): {"bench-3": 0.0},
    }


def test_compare_writes_leaderboard_csv_markdown_plot_and_tensorboard(bench):
    text = (bench / "compare.md").read_text()
    assert text.startswith("| method |")  # today's table first
    assert "### overall (mean of the task families) (anls, relaxed_accuracy)" in text
    # each cell with its 95% interval (Wilson for docvqa's 0/1 anls; bold: the column's top method)
    assert "| snapkv | **25.0** [0, 50] | 75.0 [50, 100] |" in text.split("### document")[1]
    assert "| full | 100.0 [34, 100] | 100.0 [34, 100] |" in text.split("### chart")[1]
    assert "95% interval [low, high]" in text and "McNemar's exact test" in text
    rows = list(csv.DictReader((bench / "leaderboard.csv").open()))
    overall = {r["method"]: r for r in rows if r["family"] == "overall"}
    assert list(overall) == ["full", "random", "snapkv"]  # the full cache first
    assert float(overall["snapkv"]["ratio=0.1"]) == pytest.approx(37.5)
    board = EventAccumulator(
        str(bench / "compare" / "tensorboard"), size_guidance={"images": 0, "tensors": 0}
    )
    board.Reload()
    tags = board.Tags()
    # one card per family and per quality metric (curves as figures: nothing smooths them)
    cards = {"score_vs_ratio/overall", "score_vs_ratio/document", "score_vs_ratio/chart",
             "quality_vs_memory/anls", "quality_vs_memory/relaxed_accuracy"}  # fmt: skip
    assert set(tags["images"]) == cards
    for tag in cards:  # the PNG file is the very image of the card, at the size of a run's figures
        kind, name = tag.split("/")
        with Image.open(bench / f"{kind}.{name}.png") as image:
            png = np.asarray(image.convert("RGB"))
        card = board.Images(tag)[0]
        assert np.array_equal(
            np.asarray(Image.open(io.BytesIO(card.encoded_image_string)).convert("RGB")), png
        )
        assert 500 <= card.width <= 600 and card.height >= 300
    assert not tags["scalars"]
    assert [p.name for p in (bench / "compare" / "tensorboard").iterdir() if p.is_dir()] == []  # one run
    text = board.Tensors("compare/text_summary")[0].tensor_proto.string_val[0].decode()
    assert text == (bench / "compare.md").read_text()  # the leaderboard table as TEXT


def test_figures_are_readable_sizes():
    share = torch.rand(30, 3)
    heat = render(heatmap_figure(share, "snapkv · 128 tokens/head, window 32\nsample s0"))
    assert heat.shape[1] >= 500 and heat.shape[0] >= 200 and heat.dtype == np.uint8
    assert heat.std() > 10  # drawn, not blank
    curves = render(
        layer_curves_figure(share, "t", budget=torch.full((30,), 0.4), modalities={"image": torch.rand(30)})
    )
    assert curves.shape[1] >= 500
    patches = render(
        patch_figure(Image.new("RGB", (64, 48), "white"), torch.tensor([[1.0, 0.0], [0.5, 0.25]]), "t")
    )
    assert patches.shape[1] >= 500 and patches.shape[0] >= 250


def test_run_label_names_the_budget_window_and_sinks():
    from kvlab.pipeline import Pipeline

    snap = Pipeline.from_config({"budget": {"tokens": 128, "window": 32}, "importance": ATTENTION})
    assert run_label("snapkv", snap) == "snapkv · 128 tok/head, window 32"
    assert run_label("snapkv@budget.tokens=128,model=tiny-llama", snap) == "snapkv · 128 tok/head, window 32"
    assert run_label("full", Pipeline.from_config({})) == "full · full cache"
    ratio = Pipeline.from_config({"budget": {"ratio": 0.2, "window": 8, "sinks": 4}, "importance": ATTENTION})
    assert run_label(None, ratio) == "ratio 0.2, window 8, 4 sinks"


def test_runs_differing_in_window_or_protocol_are_never_pooled():
    """Only the budget's size is a column: another window or protocol is another method (row)."""
    from kvlab.runner.runs import Run

    def run(name, point, budget, protocol="query_aware", score=1.0, metric="contains_answer"):
        fields = {"model": {"compression": {"budget": budget, "importance": ATTENTION}, "protocol": protocol},
                  "data": {"dataset": {"name": "bench", "metrics": [metric]}}}  # fmt: skip
        records = [{"id": "s0", metric: score}]
        return Run(name, "snapkv", point, {}, records=records, fields=fields)

    runs = [
        run("snapkv@budget.ratio=0.1,budget.window=8", {"budget.ratio": "0.1", "budget.window": "8"},
            {"ratio": 0.1, "window": 8}, score=1.0),
        run("snapkv@budget.ratio=0.1,budget.window=32", {"budget.ratio": "0.1", "budget.window": "32"},
            {"ratio": 0.1, "window": 32}, score=0.0),
        run("snapkv@budget.ratio=0.2", {"budget.ratio": "0.2"}, {"ratio": 0.2}, protocol="query_agnostic"),
        run("snapkv@budget.ratio=0.3", {"budget.ratio": "0.3"}, {"ratio": 0.3}, protocol="query_aware"),
    ]  # fmt: skip
    board = leaderboard(runs)
    rows = board.scores["bench"]
    assert rows["snapkv@budget.window=8"]["ratio=0.1"] == 100.0
    assert rows["snapkv@budget.window=32"]["ratio=0.1"] == 0.0
    plain = [name for name in rows if not name.startswith("snapkv@budget.window")]
    assert len(plain) == 2 and all(name.startswith("snapkv#") for name in plain)  # two protocols, two rows


def test_a_run_without_its_datasets_metric_has_no_score():
    from kvlab.runner.leaderboard import primary_metric
    from kvlab.runner.runs import Run

    fields = {"data": {"dataset": {"name": "bench", "metrics": ["rouge_l"]}}}
    run = Run("snapkv", "snapkv", {}, {}, records=[{"id": "s0", "contains_answer": 1.0}], fields=fields)
    assert primary_metric(run) is None  # never scored by another metric


def test_heatmaps_fit_their_scale_and_name_a_uniform_budget():
    ada = torch.tensor([[0.13, 0.40], [0.25, 0.31]])
    fig = heatmap_figure(ada, "adakv")
    bar = fig.axes[1]
    assert "scale: 0.13 to 0.40" in bar.get_ylabel()  # fitted to the data, and stated
    assert fig.axes[0].images[0].get_clim() == pytest.approx((0.13, 0.40))
    assert {t.get_text() for t in fig.axes[0].texts} == {"0.13", "0.40", "0.25", "0.31"}  # values printed
    uniform = heatmap_figure(torch.full((30, 3), 0.24), "snapkv")  # too many cells to print each
    assert [t.get_text() for t in uniform.axes[0].texts] == ["uniform: 0.24"]
    assert "0.24 everywhere" in uniform.axes[1].get_ylabel()


def test_kept_patches_are_drawn_in_the_colour_bars_colours_with_the_count():
    share = torch.tensor([[1.0, 0.0, 0.5, 1.0]])  # 2 KV heads: shares 0, 1/2, 1
    fig = patch_figure(Image.new("RGB", (40, 10), "white"), share, "lookm", heads=2)
    panel = fig.axes[1]
    assert panel.get_title() == "kept 3/4 patches"
    image = render(fig)
    shown = panel.images[0]
    top = np.round(np.asarray(shown.cmap(shown.norm(1.0))[:3]) * 255)
    bottom = np.round(np.asarray(shown.cmap(shown.norm(0.0))[:3]) * 255)
    box = panel.get_window_extent()  # the panel in pixels (origin bottom left)
    y = int(image.shape[0] - (box.y0 + box.y1) / 2)
    first = image[y, int(box.x0 + box.width / 8)]  # the first patch: kept by both heads
    second = image[y, int(box.x0 + 3 * box.width / 8)]  # dropped by both
    assert np.abs(first.astype(int) - top).max() <= 2  # the bar's top colour, not a muted blend
    assert np.abs(second.astype(int) - bottom).max() <= 2


def fields(budget, model="smollm2-135m", window=32):
    """A run's run.json fields with a SnapKV-like pipeline (``budget`` None: the full cache)."""
    compression = {} if budget is None else {"budget": {**budget, "window": window}, "importance": ATTENTION}
    return {"model": {"model": model, "compression": compression}}


def test_display_names_lead_with_what_varies():
    """The issue's experiment: SnapKV and MixKV at two ratios with --model.model, a default run;
    names keep the method and the values that differ, the budget alone, the shared model dropped."""
    from kvlab.runner.views.names import SHOWN_CHARACTERS, display_names

    over = "model=smollm2-135m,budget.ratio"
    runs = [(f"snapkv@{over}=0.1", fields({"ratio": 0.1})), (f"snapkv@{over}=0.2", fields({"ratio": 0.2})),
            (f"mixkv_snapkv@{over}=0.1", fields({"ratio": 0.1})),
            (f"mixkv_snapkv@{over}=0.2", fields({"ratio": 0.2})),
            ("snapkv", fields({"tokens": 128}))]  # fmt: skip
    names = display_names(runs)
    assert list(names.values()) == [
        "snapkv@10%",
        "snapkv@20%",
        "mixkv_snapkv@10%",
        "mixkv_snapkv@20%",
        "snapkv@128",
    ]
    assert len({n[:SHOWN_CHARACTERS] for n in names.values()}) == len(runs)
    # a value that differs is named by its field; the full cache has no budget
    other = display_names([("full", fields(None)),
                           ("snapkv@budget.window=8", fields({"ratio": 0.1}, window=8)),
                           ("snapkv@budget.window=16", fields({"ratio": 0.1}, window=16))])  # fmt: skip
    assert list(other.values()) == ["full", "snapkv@window=8", "snapkv@window=16"]
    # long methods alike in TensorBoard's first 15 characters: the values lead
    long = display_names([("mixkv_pyramidkv@budget.ratio=0.1", fields({"ratio": 0.1})),
                          ("mixkv_pyramidkv@budget.ratio=0.2", fields({"ratio": 0.2}))])  # fmt: skip
    assert list(long.values()) == ["10% mixkv_pyramidkv", "20% mixkv_pyramidkv"]
    # nothing but the directory tells two runs apart: the directory names
    same = display_names(
        [("snapkv@budget=0.1", fields({"ratio": 0.1})), ("snapkv@budget.ratio=0.1", fields({"ratio": 0.1}))]
    )
    assert list(same.values()) == ["snapkv@budget=0.1", "snapkv@budget.ratio=0.1"]


def test_the_legend_names_a_method_drawn_only_in_a_later_panel():
    from kvlab.runner.leaderboard import legend_entries, pyplot

    fig, axes = pyplot().subplots(1, 2)
    axes[0].plot([0, 1], [0, 1], label="snapkv")
    axes[1].plot([0, 1], [1, 0], label="snapkv")
    axes[1].plot([0, 1], [1, 1], label="lookm")  # no overall score: absent from the first panel
    handles, labels = legend_entries(axes.flat)
    assert labels == ["snapkv", "lookm"] and len(handles) == 2
    pyplot().close(fig)


def test_a_quantize_only_run_fills_every_column_but_is_not_the_reference():
    """A run that only quantizes has no budget (its score fills every column) but changes every
    entry: the marks compare it with the full cache, whatever the names' order."""
    from kvlab.runner.leaderboard import family_methods, leaderboard_text
    from kvlab.runner.runs import Run

    data = {"dataset": {"name": "bench", "metrics": ["contains_answer"]}}
    quantize = {"quantize": {"name": "per_token", "bits": 2}}

    def run(name, compression, score):
        records = [{"id": f"s{i}", "contains_answer": score} for i in range(20)]
        fields = {"model": {"compression": compression}, "data": data}
        return Run(name, name, {}, {}, records=records, fields=fields)

    snap = {"budget": {"ratio": 0.1}, "importance": ATTENTION}
    runs = [run("aaa_int2", quantize, 0.0), run("full", {}, 1.0), run("snapkv", snap, 1.0)]
    board = leaderboard(runs)
    assert board.full == {"aaa_int2", "full"} and board.reference == {"full"}
    assert family_methods(board, "bench") == ["full", "aaa_int2", "snapkv"]
    assert board.scores["bench"]["aaa_int2"] == {"ratio=0.1": 0.0}
    table, _ = leaderboard_text(board)
    row = next(line for line in table.splitlines() if line.startswith("| aaa_int2"))
    assert "*" in row  # 0 of 20 against the full cache's 20 of 20: resolved below it
