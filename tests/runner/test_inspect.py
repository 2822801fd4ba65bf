"""TensorBoard views: the event files of a VLM run hold every tag with sane values (figures, one histogram
card per layer and role, TEXT summary, an HPARAMS trial); helpers vs naive loops."""

import json
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from support.cli import predict, write_jsonl
from support.events import read_events

from kvlab.cache.selection import Selection
from kvlab.engine.generation import RunOptions
from kvlab.pipeline.report import LayerReport
from kvlab.runner.views.figures import render
from kvlab.runner.views.inspector import modality_record
from kvlab.runner.views.patches import image_grids, patch_figure


@pytest.fixture(scope="module")
def vlm_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inspect")
    for i, color in enumerate(("red", "blue")):
        Image.new("RGB", (40, 40), color).save(tmp / f"img{i}.png")
    rows = [{"id": f"v{i}", "prompt": f"what colour is it? {'word ' * 10 * i}", "images": [f"img{i}.png"],
             "answers": ["red"]} for i in range(2)]  # fmt: skip
    data = write_jsonl(tmp / "d.jsonl", rows)
    predict(
        tmp, "--config", "snapkv", "--model.model", "tiny-qwen2-vl", "--trainer.enable_progress_bar", "false",
        "--model.max_new_tokens", "3", "--data.dataset", f"{{name: jsonl, path: {data}}}",
        "--model.compression.budget", "{tokens: 12, window: 4}",  # snapkv's window attention observes it
        "--model.inspect_layers", "[0, -1]",
    )  # fmt: skip
    return tmp / "runs" / "exp" / "snapkv"


def test_event_files_hold_every_view(vlm_run):
    acc = read_events(vlm_run / "tensorboard")
    tags = acc.Tags()
    layers = len(
        json.loads((vlm_run / "predictions.jsonl").read_text().splitlines()[0])["kept_per_layer_head"]
    )
    figures = {"budget/kept_per_layer", "modality/kept_fraction_per_layer"}
    assert figures <= set(tags["images"])
    # 12 tokens in every layer and head: no heatmap of one number (it is in the TEXT summary)
    assert not {"budget/kept_layer_head", "budget/kept_layer_head_mean"} & set(tags["images"])
    for tag in figures:  # rendered figures a screen shows, not a layers x heads pixel strip
        image = acc.Images(tag)[0]
        assert image.width >= 500 and image.height >= 200
    for layer in (0, layers - 1):
        assert f"patches/layer_{layer}/image_0" in tags["images"]
    # one card per inspected layer (model.inspect_layers) and role; one scorer: no mix
    assert set(tags["histograms"]) == {"scores/attention/layer_0", f"scores/attention/layer_{layers - 1}"}
    first = json.loads((vlm_run / "predictions.jsonl").read_text().splitlines()[0])
    candidates = first["prompt_tokens"] - 4  # the first sample's tokens outside the window of 4
    histogram = acc.Histograms("scores/attention/layer_0")[0].histogram_value
    assert histogram.num == candidates * 2  # x 2 KV heads: no padding, no protected entries
    assert not [t for t in tags["scalars"] if t.startswith(("modality/", "summary/"))]  # no layer-as-step
    assert all(e.value >= 0 for e in acc.Scalars("time/compression_s_per_batch"))
    assert 0 < acc.Scalars("cost/kv_kept_over_full")[0].value < 1
    image = acc.Images("patches/layer_0/image_0")[0]
    assert image.width >= 500 and image.height >= 250


def test_the_run_summary_is_text_and_an_hparams_trial(vlm_run):
    acc = read_events(vlm_run / "tensorboard")  # one TensorBoard run: the views and the summary
    tags = acc.Tags()
    assert not (vlm_run / "tensorboard" / "summary").exists()
    text = {tag.removesuffix("/text_summary") for tag in tags["tensors"]}
    assert {"results/metrics", "run/config", "run/prompt"} <= text
    table = acc.Tensors("results/metrics/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| fidelity to the full cache | `fidelity_top1` |" in table and "| memory | `kv_ratio` |" in table
    assert f"| `fidelity_kl` | {metrics_value(vlm_run, 'fidelity_kl'):.4g} nats/token |" in table
    assert " s per sample |" in table.split("`prefill_seconds` |")[1].splitlines()[0]
    assert "uniform: " in table.split("`kept / prompt tokens per layer and KV head` |")[1].splitlines()[0]
    assert "| kept | `kept.tokens` | 12 tokens per layer and KV head |" in table
    config = acc.Tensors("run/config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert config.startswith(
        "**method** `snapkv` · **budget** 12 tokens, window 4 · **model** `tiny-qwen2-vl`"
    )
    metrics = json.loads((vlm_run / "metrics.json").read_text())
    assert acc.Scalars("fidelity/top1_share")[0].value == pytest.approx(metrics["fidelity_top1"])
    assert acc.Scalars("task/contains_answer")[0].value == pytest.approx(metrics["contains_answer"])
    assert "hp_metric" not in tags["scalars"]
    assert not (vlm_run.parent / "compare").exists()  # a run writes in its own directory alone


def metrics_value(run, key):
    return json.loads((run / "metrics.json").read_text())[key]


def naive_kept(selection, length):
    B, H, _ = selection.indices.shape
    out = torch.zeros(B, H, length, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for p in selection.kept_positions(b, h):
                out[b, h, p] = True
    return out


def test_kept_mask_and_modality_record_match_loops():
    indices = torch.tensor([[[0, 2, 5], [1, 4, 0]], [[3, 0, 0], [2, 3, 5]]])
    counts = torch.tensor([[3, 2], [1, 3]])
    selection = Selection(indices, counts)
    modality = torch.tensor([[0, 1, 1, 1, 0, 0], [-1, 0, 1, 1, 0, 0]])
    mask = selection.kept_mask(6)
    assert torch.equal(mask, naive_kept(selection, 6))
    report = LayerReport(0, counts, torch.tensor([3, 3]), selection)
    for b in range(2):
        row = modality_record([report], modality, b)
        assert row["kv_heads"] == 2
        for m, name in ((0, "text"), (1, "image")):
            kept = sum(int(mask[b, h, t]) for h in range(2) for t in range(6) if modality[b, t] == m)
            assert row["modality_kept"][name] == [kept]
            assert row["modality_tokens"][name] == int((modality[b] == m).sum())


def test_image_grids_and_overlay():
    sample = type("S", (), {"images": [Image.new("RGB", (8, 8))] * 2})()
    modality = torch.tensor([[-1, 0, 1, 1, 1, 1, 0, 1, 1, 0]])
    grid_thw = torch.tensor([[1, 4, 4], [1, 4, 2]])  # merged 2x2: 2x2 and 2x1 tokens
    batch = SimpleNamespace(samples=[sample], modality=modality, model_inputs={"image_grid_thw": grid_thw})
    assert image_grids(batch, 0, 2) == [(2, 2, 2), (7, 2, 1)]
    modality = torch.tensor([[0] + [1] * 10])
    square_plus_cls = SimpleNamespace(samples=[sample], modality=modality, model_inputs={})
    assert image_grids(square_plus_cls, 0, None) == [(2, 2, 2), (7, 2, 2)]  # 5 tokens: CLS + 2x2
    kept = render(patch_figure(Image.new("RGB", (10, 10), "white"), torch.tensor([[1.0, 0.0]]), "t"))
    dropped = render(patch_figure(Image.new("RGB", (10, 10), "white"), torch.tensor([[0.0, 0.0]]), "t"))
    assert kept.shape == dropped.shape and kept.shape[2] == 3
    assert kept.mean() > dropped.mean()  # a kept patch is drawn bright, a dropped one dark


@pytest.mark.parametrize(
    "budget, modality",
    [
        ({"ratio": 0.2, "window": 0.1, "sinks": 0}, {"name": "text_prior", "overflow": "keep_all_text"}),
        ({"ratio": 0.2, "window": 48}, {"name": "none"}),  # 48 does not fit in 20% of ~185 tokens
    ],
)
def test_the_per_layer_plot_and_the_overshoot_counter_agree(budget, modality):
    """LOOK-M's text prior keeps every text token past its budget: the per-layer plot's mean kept
    share stands above its dashed layer budget, and the counter records exactly that excess."""
    from support import e2e

    from kvlab.data.synthetic import SyntheticRetrieval
    from kvlab.pipeline import Pipeline
    from kvlab.pipeline.report import budget_overshoot
    from kvlab.runner.views.inspector import layer_budget_share

    loaded = e2e.kvlab_model("tiny-llama")
    items = SyntheticRetrieval(num_samples=2, context_words=25, seed=3).samples()
    node = {"budget": budget, "importance": {"attention": {"name": "cumulative_attention"}},
            "allocate": {"modality": modality}}  # fmt: skip
    result = e2e.run(loaded, Pipeline.from_config(node), items, 2)
    counter = budget_overshoot(result.reports)
    assert int(counter.max()) > 0
    for b in range(len(items)):
        share, layer_budget = layer_budget_share(result, b)  # what the plot draws
        length = int(result.prompt_lengths[b])
        heads = share.shape[1]
        kept = (share * length).round().sum(1)  # [L] tokens over heads
        drawn = torch.div(kept - (layer_budget * length).round() * heads, heads, rounding_mode="floor")
        window = result.reports[0].overshoot[b]  # the window's part is the same at every layer
        assert int(counter[b]) == max(int(drawn.clamp(min=0).max()), int(window.clamp(min=0)))
        if modality["name"] == "text_prior":
            assert bool((share.mean(1) > layer_budget).all()) == (int(counter[b]) > 0)


def test_routed_samples_on_two_branches_keep_their_scorer_scores():
    """DAVID on MixKV scores (two scorers, mixed) over a batch whose image sample stays decoupled
    and whose text-only sample switches to unified at once: the layer report keeps each scorer's
    scores, each row from its own branch, so the mixed histogram counts the candidates alone
    (never the protected window), as on a pipeline without a route."""
    from support import e2e
    from support.modality import WINDOW, mixed_samples

    from kvlab.config.loader import resolve
    from kvlab.engine.generation import generate
    from kvlab.pipeline import Pipeline
    from kvlab.runner.views.inspector import score_histograms

    loaded = e2e.kvlab_model("tiny-qwen2-vl")
    node = resolve(["david_mixkv"], [])["model"]["compression"]
    node["budget"] = {"tokens": 20, "window": WINDOW}
    node["importance"]["attention"]["window"] = WINDOW
    node["route"]["rule"].update(threshold=-1e9, metric={"name": "ncar", "window": WINDOW})  # never trips
    items = [mixed_samples()[1], mixed_samples()[2]]  # one image; text only (NCAR NaN: switches at once)
    batch = loaded.processor.collate(items)
    result = generate(
        loaded, Pipeline.from_config(node), batch, RunOptions(max_new_tokens=1, record_scores=True)
    )
    report = result.reports[0]
    assert report.route.branches == ["decoupled", "unified"]  # the two samples took different branches
    assert set(report.scorer_scores) == {"attention", "value_norm", "mean_key_diversity"}
    valid = batch.attention_mask[0].bool()
    heads = report.scores.shape[1]
    histograms = score_histograms(report, valid)
    assert histograms["mixed"].numel() == heads * (int(valid.sum()) - WINDOW)  # no protected entry
    assert histograms["attention"].numel() == histograms["mixed"].numel()
