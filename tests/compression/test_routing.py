"""Routing: the NCAR metric, the latch rule, DAVID's limits (all unified / all decoupled), the
switch layer in predictions and TensorBoard, and the hybrid preset through `kvlab predict`."""

import json

import pytest
import torch
from naive.context import make_ctx
from support import e2e
from support.e2e import kvlab_model
from support.modality import WINDOW, mixed_samples, with_modality

from kvlab.cache.state import RunState
from kvlab.cli.main import main
from kvlab.compression.routing import LAYER_METRICS, ROUTE_RULES
from kvlab.config.errors import ConfigError
from kvlab.config.loader import resolve
from kvlab.pipeline import Pipeline

VLMS = ["tiny-qwen2-vl", "tiny-llava"]


def test_ncar_closed_form_under_uniform_attention():
    """NCAR (DAVID Eq. 6) by hand: zero queries give uniform causal rows,
    theta = T/(n_V r) sum_i |V ∩ [0, T-r+i]| / (T-r+i+1)."""
    ctx = with_modality([29, 20], seed=4)
    ctx.queries.zero_()
    r = 6
    theta = LAYER_METRICS.build({"name": "ncar", "window": r}).measure(ctx)
    for b in range(2):
        n = int(ctx.valid[b].sum())
        mod = ctx.modality[b, ctx.seq_len - n :].tolist()
        vision = [j for j in range(n) if mod[j] > 0]
        total = sum(len([j for j in vision if j <= n - r + i]) / (n - r + i + 1) for i in range(r))
        assert float(theta[b]) == pytest.approx(n / (len(vision) * r) * total, rel=1e-5)


def test_ncar_is_nan_without_vision_tokens():
    ctx = make_ctx([20, 12])  # text only
    assert bool(torch.isnan(LAYER_METRICS.build({"name": "ncar", "window": 4}).measure(ctx)).all())


class Sequence:
    """A stand-in metric that returns the given value per layer."""

    def __init__(self, values):
        self.values = values

    def measure(self, ctx):
        return torch.tensor([self.values[ctx.layer_idx]])


@pytest.mark.parametrize("test, switch", [("delta_lt", 2), ("theta_lt", 1), ("delta_gt", 0)])
def test_latch_switches_once_and_stays(test, switch):
    """DAVID's latch (Alg. 1) by hand: theta = [0.6, 0.25, 0.2, 0.9] with threshold 0.3."""
    rule = ROUTE_RULES.build({"name": "latch", "test": test, "threshold": 0.3})
    rule._metric = Sequence([0.6, 0.25, 0.2, 0.9])
    run = RunState()  # one prefill's shared state: the latch keeps its own there
    got = []
    for layer in range(4):
        ctx = make_ctx([6], layer_idx=layer, run=run)
        got.append(rule.decide(ctx).branches[0])
    assert got == ["decoupled"] * switch + ["unified"] * (4 - switch)


def david_node(threshold, window=WINDOW, tokens=20):
    node = preset_pipeline_node("david", tokens, window)
    node["route"]["rule"]["threshold"] = threshold
    return node


def preset_pipeline_node(name, tokens, window):
    node = resolve([name], [])["model"]["compression"]
    node["budget"] = {"tokens": tokens, "window": window}  # window attention and NCAR observe it
    node["importance"]["attention"]["window"] = window  # restating it is allowed when equal
    node["route"]["rule"]["metric"]["window"] = window
    return node


@pytest.mark.parametrize("model", VLMS)
def test_david_limits_equal_the_unified_host_and_the_decoupled_pipeline(model):
    loaded = kvlab_model(model)
    items = mixed_samples()[:2]  # with images
    never = david_node(1e9)  # delta < 1e9 at layer 0: unified everywhere
    always = david_node(-1e9)  # never switches: decoupled everywhere
    host = {k: v for k, v in never.items() if k != "route"}
    decoupled = {**host, "allocate": {"modality": {"name": "decoupled", "rho": 2.0}}}
    for routed, plain in ((never, host), (always, decoupled)):
        a = e2e.run(loaded, Pipeline.from_config(routed), items, 3)
        b = e2e.run(loaded, Pipeline.from_config(plain), items, 3)
        assert a.tokens == b.tokens and torch.equal(a.step_logits, b.step_logits)
        for ra, rb in zip(a.reports, b.reports, strict=True):
            assert torch.equal(ra.selection.indices, rb.selection.indices)
    switched = [
        r.route.switched.tolist() for r in e2e.run(loaded, Pipeline.from_config(always), items, 1).reports
    ]
    assert switched == [[False, False]] * loaded.info.num_layers


def test_decoupled_layers_split_the_budget_by_rho():
    loaded = kvlab_model("tiny-qwen2-vl")
    items = mixed_samples()[:1]
    batch = loaded.processor.collate(items)
    result = e2e.run(loaded, Pipeline.from_config(david_node(-1e9, tokens=12)), items, 1)
    vision = batch.modality[0] > 0
    for report in result.reports:
        for h in range(report.kept.shape[1]):
            kept = report.selection.kept_positions(0, h)
            outside = [p for p in kept if p < vision.shape[0] - WINDOW]
            assert (
                sum(bool(vision[p]) for p in outside) == (12 - WINDOW) * 2 // 3
            )  # floor(rho B_s / (1 + rho))


def test_route_errors_name_the_field():
    node = resolve(["david"], [])["model"]["compression"]
    node["route"]["rule"]["after"] = "unifed"
    with pytest.raises(ConfigError, match="unifed"):
        Pipeline.from_config(node)
    node = resolve(["david"], [])["model"]["compression"]
    node["route"]["branches"]["unified"] = {"decode": {"name": "h2o"}}
    with pytest.raises(ConfigError, match="whole pipeline"):
        Pipeline.from_config(node)


def predict(tmp_path, preset, *args):
    main(
        [
            "predict",
            "--config",
            preset,
            "--model.model",
            "tiny-qwen2-vl",
            "--model.max_new_tokens",
            "3",
            "--trainer.enable_progress_bar",
            "false",
            "--data.dataset",
            "{name: synthetic_image_qa, num_samples: 3, images_per_sample: 2}",
            "--data.batch_size",
            "2",
            "--model.compression.budget",
            f"{{tokens: 20, window: {WINDOW}}}",
            "--run.dir",
            str(tmp_path),
            "--run.experiment",
            "exp",
            "--run.method",
            preset,
            *args,
        ]
    )
    run = tmp_path / "exp" / preset
    return run, [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]


def windows(window=WINDOW):
    return [
        "--model.compression.importance",  # merged into the preset's attention role; equals budget.window
        f"{{attention: {{name: window_attention, window: {window}, kernel: 5, pool: max}}}}",
        "--model.compression.route.rule.metric.window",
        str(window),
    ]


def tensorboard_events(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_switch_layer_is_recorded_in_predictions_and_tensorboard(tmp_path):
    run, records = predict(tmp_path, "david", *windows())
    assert len(records) == 3
    for r in records:
        assert r["route_switch_layer"] in (0, 1, None)  # 2 layers; None: never switched
        assert len(r["route_metric"]) == 2 and r["route_metric"][0] is not None
    acc = tensorboard_events(run)
    assert len(acc.Scalars("route/switch_layer_mean")) == 2  # one per batch
    assert "route/metric_per_layer" in acc.Tags()["images"]  # the curve over layers is a figure
    # the numbers behind it: the mean over the samples that evaluated each layer, and its drop
    table = acc.Tensors("route/metric_per_layer/text_summary")[0].tensor_proto.string_val[0].decode()
    rows = [line.strip("|").split("|") for line in table.splitlines()[2:]]
    curve = {int(layer): float(value) for layer, value, _ in rows}
    assert 0 in curve  # layer 0 always evaluates the metric
    for layer, value in curve.items():
        seen = [r["route_metric"][layer] for r in records if r["route_metric"][layer] is not None]
        assert value == pytest.approx(sum(seen) / len(seen), rel=1e-5)
    for layer, _, drop in rows[1:]:
        layer = int(layer)
        assert float(drop) == pytest.approx(curve[layer - 1] - curve[layer], rel=1e-4, abs=1e-6)


def test_hybrid_preset_runs_end_to_end(tmp_path):
    run, records = predict(
        tmp_path,
        "david_mixkv",
        "--model.compression.importance",
        f"{{attention: {{name: window_attention, window: {WINDOW}, agg: mean}}, value_norm: {{}}}}",
        "--model.compression.route.rule.metric.window",
        str(WINDOW),
    )
    assert len(records) == 3
    assert all(r["kv_ratio"] < 1 and "route_switch_layer" in r for r in records)
    assert all(c == 20 for r in records for row in r["kept_per_layer_head"] for c in row)
