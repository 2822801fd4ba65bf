"""The per_layer layer allocator (kvpress' PerLayerCompressionPress): each layer keeps its share of
the budget (``naive.budgets.naive_per_layer_kept``), the list must have one ratio per layer
(refused when the model is bound, before it loads, and at the first layer otherwise), and with a
budget of the whole prompt it keeps what kvpress 0.5.5 keeps."""

from __future__ import annotations

import pytest
import torch
from naive.budgets import naive_per_layer_kept
from naive.context import make_ctx
from support import kvpress_cases
from support.e2e import kvlab_model
from support.presets import retrieval_samples

from kvlab.config.errors import ConfigError
from kvlab.engine.generation import RunOptions, generate
from kvlab.pipeline import Pipeline

LENGTHS = [37, 26]


def node(ratios, **budget) -> dict:
    return {
        "budget": {"window": 4, "sinks": 1, **budget},
        "importance": {"key_norm": {}},
        "allocate": {"layer": {"name": "per_layer", "ratios": ratios}},
    }


@pytest.mark.parametrize("budget", [{"ratio": 1.0}, {"tokens": 20}, {"ratio": 0.5}])
def test_each_layer_keeps_its_share_of_the_budget(budget):
    ratios = [1.0, 0.5, 0.33, 0.0]  # the last below the protected tokens: they are kept
    pipeline = Pipeline.from_config(node(ratios, **budget))
    for layer, ratio in enumerate(ratios):
        selection, report = pipeline.compress(make_ctx(LENGTHS, seed=41, layer_idx=layer, num_layers=4))
        for b, n in enumerate(LENGTHS):
            per_sample = budget.get("tokens") or int(budget["ratio"] * n)
            want = naive_per_layer_kept(ratio, per_sample, n, protected=5)
            assert selection.counts[b].tolist() == [want, want], (layer, b)
            assert int(report.budget[b]) == max(5, int(ratio * per_sample))  # the overshoot is recorded


def test_ratios_of_another_length_are_refused_when_the_model_is_bound_and_at_the_first_layer():
    pipeline = Pipeline.from_config(node([0.5, 0.4, 0.3], ratio=1.0))
    with pytest.raises(ConfigError) as error:
        pipeline.bind_model("tiny-llama")  # read from its config: no weights loaded
    message = str(error.value)
    for fragment in ("model.compression.allocate.layer.ratios", "holds 3 ratios", "tiny-llama has 2 decoder",
                     "one kept fraction per layer (2 values)"):  # fmt: skip
        assert fragment in message
    pipeline.bind_model("tiny-qwen2")  # 3 layers
    unbound = Pipeline.from_config(node([0.5, 0.4], ratio=1.0))
    with pytest.raises(ConfigError, match="holds 2 ratios, but the model has 4 decoder layers"):
        unbound.compress(make_ctx(LENGTHS, num_layers=4))


def test_a_run_on_the_model_keeps_each_layers_share():
    loaded = kvlab_model("tiny-qwen2")
    batch = loaded.processor.collate(retrieval_samples(2, 60))
    ratios = [0.9, 0.25, 0.6]
    result = generate(
        loaded, Pipeline.from_config(node(ratios, tokens=40)), batch, RunOptions(max_new_tokens=2)
    )
    for ratio, report in zip(ratios, result.reports, strict=True):
        assert torch.equal(report.kept, torch.full_like(report.kept, max(5, int(ratio * 40))))


@pytest.mark.parametrize("ratios, fragment", [([], "(empty)"), ([0.5, 1.2], "1.2 is out of range")])
def test_ratios_must_be_kept_fractions(ratios, fragment):
    with pytest.raises(ConfigError, match=fragment):
        Pipeline.from_config(node(ratios, ratio=1.0))


@pytest.mark.parametrize("case", ["per_layer", "per_layer_qwen2"])
def test_per_layer_keeps_what_kvpress_keeps(case):
    """kvpress 0.5.5's PerLayerCompressionPress around KnormPress through its forward hook, its
    compression_ratios cr_l against kvlab's kept shares 1 - cr_l of the prompt (tests/fixtures/kvpress/)."""
    want = kvpress_cases.recorded()["cases"][case]["kept"]
    assert kvpress_cases.kvlab_prefill_kept(kvpress_cases.CASES[case]) == want
