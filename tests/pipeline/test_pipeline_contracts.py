"""What you write in YAML is what runs: scorers keyed by role, one source for the recent window,
and a per-sample budget that holds (or whose overshoot is recorded) on short prompts."""

import dataclasses
import json
from dataclasses import dataclass

import pytest
import torch
from naive.context import make_ctx
from support import e2e

from kvlab.cli.main import main
from kvlab.compression.allocators import LAYER_ALLOCATORS
from kvlab.compression.budget import Budget
from kvlab.compression.decode import DECODE_POLICIES
from kvlab.compression.importance import IMPORTANCE, WindowAttentionScorer
from kvlab.config.errors import ConfigError
from kvlab.config.loader import resolve
from kvlab.data.sample import Sample
from kvlab.data.synthetic import SyntheticRetrieval
from kvlab.pipeline import Pipeline
from kvlab.pipeline.validation import allocator_restatements

MIXKV = {
    "budget": {"tokens": 24, "window": 8},
    "importance": {"attention": {"name": "window_attention"}, "value_norm": {}},
    "diversity": {"mean_key_diversity": {}},
    "mixer": {
        "name": "mixkv",
        "extrinsic": "attention",
        "intrinsic": ["value_norm"],
        "diversity": ["mean_key_diversity"],
    },
}


def error_of(node) -> str:
    with pytest.raises(ConfigError) as info:
        Pipeline.from_config(node)
    message = str(info.value)
    assert "\n" not in message  # one paragraph
    return message


# --- the two configs of the issue -----------------------------------------------------------------


def test_a_scorer_window_that_differs_from_the_budget_window_is_refused_with_both_fields():
    message = error_of(
        {
            "budget": {"tokens": 64, "window": 8},
            "importance": {"attention": {"name": "window_attention", "window": 32}},
        }
    )
    assert "model.compression.importance.attention.window = 32" in message
    assert "model.compression.budget.window = 8" in message
    assert "Remove `window`" in message


def test_positional_scorer_lists_are_refused_with_the_mapping_to_write():
    message = error_of(
        {
            "budget": {"tokens": 64, "window": 32},
            "importance": [{"name": "value_norm"}, {"name": "window_attention", "window": 32}],
            "diversity": [{"name": "mean_key_diversity"}],
            "mixer": {"name": "mixkv"},
        }
    )
    assert "model.compression.importance must map each scorer's role" in message
    assert "importance: {value_norm: {}, window_attention: {window: 32}}" in message
    assert "extrinsic: <role>" in message


def test_mixkv_names_its_extrinsic_term():
    node = {**MIXKV, "mixer": {"name": "mixkv", "diversity": ["mean_key_diversity"]}}
    assert "missing the required parameter 'extrinsic'" in error_of(node)


@pytest.mark.parametrize(
    ("mixer", "expected"),
    [
        ({"extrinsic": "atention", "intrinsic": ["value_norm"]}, "Did you mean 'attention'"),
        ({"extrinsic": "attention"}, "no role for: value_norm"),
        ({"extrinsic": "attention", "intrinsic": ["value_norm", "attention"]}, "named twice: attention"),
        ({"extrinsic": "attention", "intrinsic": ["value_norm"], "diversity": []}, "diversity is empty"),
    ],
)
def test_mixkv_roles_must_exist_and_every_scorer_plays_one(mixer, expected):
    node = {**MIXKV, "mixer": {"name": "mixkv", "diversity": ["mean_key_diversity"], **mixer}}
    assert expected in error_of(node)


def test_weighted_sum_weights_name_every_role_and_reference_goes_with_scale_to_reference():
    base = {"budget": {"tokens": 24, "window": 8}, "importance": {"attention": {"name": "window_attention"}}}
    node = {**base, "diversity": {"keydiff": {}}}
    assert "gives no weight to keydiff" in error_of(
        {**node, "mixer": {"name": "weighted_sum", "weights": {"attention": 1.0}}}
    )
    assert "scale_to_reference` and `reference" in error_of(
        {**node, "mixer": {"name": "weighted_sum", "normalize": "scale_to_reference"}}
    )
    Pipeline.from_config(
        {
            **node,
            "mixer": {"name": "weighted_sum", "normalize": "scale_to_reference", "reference": "attention"},
        }
    )


def test_head_allocator_signal_names_a_role():
    node = {**MIXKV, "allocate": {"head": {"name": "adakv", "signal": "attn"}}}
    assert "signal = 'attn' is not a scorer's role" in error_of(node)


def test_a_role_cannot_be_both_importance_and_diversity():
    node = {
        "budget": {"tokens": 24, "window": 8},
        "importance": {"s": {"name": "key_norm"}},
        "diversity": {"s": {"name": "keydiff"}},
    }
    assert "role 's' names both" in error_of(node)


def test_decode_and_route_windows_come_from_the_budget():
    h2o = {
        "budget": {"tokens": 24, "window": 8},
        "importance": {"attention": {"name": "cumulative_attention"}},
    }
    assert "decode.recent = 4 differs from model.compression.budget.window = 8" in error_of(
        {**h2o, "decode": {"name": "h2o", "recent": 4}}
    )
    assert Pipeline.from_config({**h2o, "decode": {"name": "h2o"}}).decode_policy.recent == 8
    ratio = {**h2o, "budget": {"ratio": 0.2, "window": 0.1}, "decode": {"name": "h2o"}}
    assert "write the decode window in tokens" in error_of(ratio)
    david = resolve(["david"], [])["model"]["compression"]
    david["route"]["rule"]["metric"]["window"] = 16
    assert "route.rule.metric.window = 16 differs from model.compression.budget.window = 32" in error_of(
        david
    )


def test_null_removes_an_inherited_role():
    node = resolve(["mixkv_snapkv"], [("model.compression.importance.value_norm", "null")])["model"][
        "compression"
    ]
    assert "no role for" not in str(node)
    assert "names 'value_norm'" in error_of(node)  # the mixer still names it
    node = resolve(
        ["mixkv_snapkv"],
        [("model.compression.importance.value_norm", "null"), ("model.compression.mixer.intrinsic", "[]")],
    )["model"]["compression"]
    assert list(Pipeline.from_config(node).importance) == ["attention"]


# --- roles make YAML order irrelevant ------------------------------------------------------------


def test_scorer_order_in_yaml_does_not_change_what_mixkv_keeps():
    loaded = e2e.kvlab_model("tiny-qwen2")
    items = SyntheticRetrieval(num_samples=2, context_words=40, seed=5).samples()
    swapped = {**MIXKV, "importance": {"value_norm": {}, "attention": {"name": "window_attention"}}}
    a = e2e.run(loaded, Pipeline.from_config(MIXKV), items, 3)
    b = e2e.run(loaded, Pipeline.from_config(swapped), items, 3)
    for ra, rb in zip(a.reports, b.reports, strict=True):
        assert torch.equal(ra.selection.indices, rb.selection.indices)
    assert a.tokens == b.tokens


# --- the recent window per sample ----------------------------------------------------------------


def test_observation_window_per_sample_equals_each_window_alone():
    """Two samples observing different windows in one batch: each row equals the scorer run with
    that window as its own (outside a pipeline, where the scorer's window applies to all rows)."""
    ctx = make_ctx(lengths=[20, 14], seed=3)
    ctx.window = torch.tensor([6, 3])
    both = WindowAttentionScorer(kernel=3).score(ctx)
    for b, window in enumerate([6, 3]):
        alone = WindowAttentionScorer(window=window, kernel=3).score(make_ctx(lengths=[20, 14], seed=3))
        assert torch.equal(both[b], alone[b])
    assert not torch.equal(
        both[1], WindowAttentionScorer(window=6, kernel=3).score(make_ctx([20, 14], seed=3))[1]
    )


@pytest.mark.parametrize("preset", ["snapkv", "mixkv_snapkv", "adakv"])
def test_a_prompt_no_longer_than_the_window_is_kept_whole(preset):
    """A batch whose padded length is at most the observation window has no past token to score:
    nothing is evicted and the output equals the full cache (it used to fail in the pooling)."""
    loaded = e2e.kvlab_model("tiny-llama")
    items = [Sample(id="short", prompt="Name a color."), Sample(id="shorter", prompt="Hi.")]
    node = resolve([preset], [])["model"]["compression"]
    short = e2e.run(loaded, Pipeline.from_config(node), items, 3)
    assert int(short.prompt_lengths.max()) <= 32
    full = e2e.run(loaded, Pipeline.from_config(None), items, 3)
    assert short.tokens == full.tokens and torch.equal(short.kept, full.kept)


def test_a_short_prompt_under_a_ratio_budget_overshoots_and_records_it():
    budget = Budget.from_config({"ratio": 0.2, "window": 32})
    lengths = torch.tensor([136, 400])
    assert budget.per_sample(lengths).tolist() == [32, 80]
    assert budget.overshoot(lengths).tolist() == [5, 0]  # 20% of 136 is 27; the window is 32


def test_max_window_share_keeps_the_asked_budget():
    budget = Budget.from_config({"ratio": 0.2, "window": 32, "max_window_share": 0.5})
    lengths = torch.tensor([136, 400])
    assert budget.window_counts(lengths).tolist() == [13, 32]
    assert budget.per_sample(lengths).tolist() == [27, 80]
    assert budget.overshoot(lengths).tolist() == [0, 0]
    with pytest.raises(ConfigError, match="max_window_share"):
        Budget.from_config({"ratio": 0.2, "max_window_share": 0.0})


@pytest.mark.parametrize("share", [None, 0.5])
def test_short_prompt_keeps_what_the_budget_config_says(share):
    """End to end on a tiny model: with a share the kept count equals the asked 20%; without one
    the whole window is kept and the report carries the overshoot. A batch equals its samples."""
    loaded = e2e.kvlab_model("tiny-llama")
    items = SyntheticRetrieval(num_samples=2, context_words=25, seed=3).samples()
    node = {
        "budget": {"ratio": 0.2, "window": 16, "max_window_share": share},
        "importance": {"attention": {"name": "window_attention"}},
    }
    pipeline = Pipeline.from_config(node)
    result = e2e.run(loaded, pipeline, items, 3)
    lengths = result.prompt_lengths
    asked = torch.floor(lengths.double() * 0.2).long()
    kept = result.kept[0, :, 0]
    if share is None:
        assert torch.equal(kept, torch.maximum(asked, torch.tensor(16)))
        assert torch.equal(result.reports[0].overshoot.cpu(), (16 - asked).clamp(min=0))
    else:
        assert torch.equal(kept, asked)
        assert int(result.reports[0].overshoot.sum()) == 0
    e2e.assert_batch_equals_alone(loaded, pipeline, items, steps=3)


def test_overshoot_reaches_predictions_metrics_and_the_summary(tmp_path, capsys):
    rows = [{"id": f"s{i}", "prompt": "word " * (10 + 200 * i), "answers": ["x"]} for i in range(2)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    main(
        [
            "predict", "--config", "snapkv", "--model.model", "tiny-llama", "--model.max_new_tokens", "2",
            "--trainer.enable_progress_bar", "false", "--model.fidelity", "false",
            "--data.dataset", f"{{name: jsonl, path: {data}}}",
            "--model.compression.budget", "{ratio: 0.2, window: 32}",
            "--run.dir", str(tmp_path / "runs"), "--run.experiment", "e",
        ]
    )  # fmt: skip
    run = next((tmp_path / "runs" / "e").iterdir())
    records = {r["id"]: r for r in map(json.loads, (run / "predictions.jsonl").read_text().splitlines())}
    assert records["s0"]["budget_overshoot"] > 0 and records["s1"]["budget_overshoot"] == 0
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["budget_overshoot_samples"] == 1
    assert "1 samples kept more than their budget" in capsys.readouterr().out


def test_capabilities_are_declared_once_and_read_in_one_walk():
    """Each component declares its capabilities on its class (the base of its kind sets the
    default); ``kvlab list`` shows them and the pipeline reads them in one walk over its parts."""
    rows = {row.name: row.capabilities for row in IMPORTANCE.describe()}
    assert rows["window_attention"] == "chunked_prefill" and rows["cumulative_attention"] == "none"
    policies = {row.name: row.capabilities for row in DECODE_POLICIES.describe()}
    assert policies["h2o"] == "decode_attention" and policies["none"] == "chunked_prefill"
    allocators = {row.name: row.capabilities for row in LAYER_ALLOCATORS.describe()}
    assert allocators["prefix_threshold"] == "chunked_prefill, needs_all_layers, observes_layers"
    snap = Pipeline.from_config(resolve(["snapkv"], [])["model"]["compression"])
    assert [part.field for part in snap.walk()][:2] == [
        "model.compression.importance.attention",
        "model.compression.mixer",
    ]
    caps = snap.capabilities
    assert not (caps.comparing_layers or caps.unchunked or caps.reads_all_queries or caps.decode_attention)
    node = {**resolve(["h2o"], [])["model"]["compression"], "decode": {"name": "h2o"}}
    h2o = Pipeline.from_config(node).capabilities
    assert h2o.reads_all_queries and h2o.decode_attention
    assert [p.field for p in h2o.unchunked] == [
        "model.compression.importance.attention",
        "model.compression.decode",
    ]
    online = Pipeline.from_config(resolve(["prefixkv_online"], [])["model"]["compression"])
    assert [p.name for p in online.capabilities.comparing_layers] == ["prefix_threshold"]
    assert online.needs_all_layers


def test_a_setting_restated_from_the_layer_allocator_is_taken_and_a_different_one_refused():
    """``layer_allocator_settings``: one source for a setting a scorer shares with the layer allocator."""

    @dataclass
    class Reader:  # a scorer restating the allocator's `beta` as its own `steps`
        steps: int | None = None
        layer_allocator_settings = {"steps": "beta"}

    pyramid = LAYER_ALLOCATORS.build({"name": "pyramid", "beta": 7})
    restated = lambda node, allocator: allocator_restatements(
        Reader, node, "importance.r", allocator, "allocate.layer"
    )
    assert restated({}, pyramid) == {"steps": 7}
    assert restated({"steps": 7}, pyramid) == {}  # equal: fine, nothing to fill
    with pytest.raises(ConfigError, match=r"importance.r.steps = 5 differs from allocate.layer.beta = 7"):
        restated({"steps": 5}, pyramid)
    uniform = LAYER_ALLOCATORS.build({"name": "uniform"})
    with pytest.raises(ConfigError, match=r"restates allocate.layer.beta, which the layer allocator 'un"):
        restated({}, uniform)
    assert restated({"steps": 3}, uniform) == {}


@pytest.mark.parametrize("preset", ["snapkv", "h2o", "david", "simlayerkv", "fastv", "quest"])
def test_a_built_pipeline_holds_the_restated_settings_and_no_component_can_change(preset):
    """The settings a component restates are filled into its node before it is built (the budget's
    window, the layer allocator's layer, a route rule's metric), and every component is sealed
    from construction: assigning a parameter raises, naming the class and the field."""
    pipeline = Pipeline.from_config(resolve([preset], [])["model"]["compression"])
    budget = pipeline.budget
    for part in pipeline.walk():
        component = part.component
        assert component.sealed, part.field
        for param, setting in type(component).budget_settings.items():
            value = getattr(budget, setting)
            if isinstance(value, int) and not isinstance(value, bool):
                assert getattr(component, param) == value, (part.field, param)
        for param, setting in type(component).layer_allocator_settings.items():
            assert getattr(component, param) == getattr(pipeline.layer_allocator, setting), (
                part.field,
                param,
            )
    first = next(p.component for p in pipeline.walk() if dataclasses.fields(p.component))
    param = dataclasses.fields(first)[0].name
    with pytest.raises(
        AttributeError, match=rf"{type(first).__name__}\.{param} is a parameter of a built component"
    ):
        setattr(first, param, getattr(first, param))


def test_the_registry_seals_what_it_builds():
    scorer = IMPORTANCE.build({"name": "window_attention", "window": 8})
    with pytest.raises(
        AttributeError, match="WindowAttentionScorer.window is a parameter of a built component"
    ):
        scorer.window = 16
    assert not WindowAttentionScorer(window=8).sealed  # built by hand, from Python: the caller's own object
