"""Sliding-window layers keep at most their window (``model.compression.sliding_layers``).

A sliding layer's next query sees the prompt's last ``W - 1`` tokens only, so no method keeps
anything older there: ``window`` (default) keeps exactly those tokens, ``compress`` runs the
method within them. Full-attention layers are untouched, and the full cache stays exact
(tests/engine/test_attention_variants.py runs these models against transformers).
"""

import pytest
from support.attention_variants import WINDOW, build, prompts, tokenizer

import kvlab
from kvlab.config.errors import ConfigError
from kvlab.engine.generation import RunOptions, generate
from kvlab.models.prompts import collate_ids
from kvlab.pipeline import Pipeline

SNAPKV = {"budget": {"tokens": 8, "window": 2}, "importance": {"attention": {"name": "window_attention"}}}


def run(name: str, node):
    loaded = kvlab.wrap_model(build(name), tokenizer(), name=name)
    rows = prompts()
    result = generate(
        loaded, Pipeline.from_config(node), collate_ids(loaded, rows), RunOptions(max_new_tokens=3)
    )
    config = loaded.model.config
    layer_types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    return result, [len(r) for r in rows], layer_types


def kept_positions(result, layer: int, b: int, h: int, pad: int) -> list[int]:
    """Kept positions of one (sample, head), in the sample's own coordinates."""
    return [p - pad for p in result.reports[layer].selection.kept_positions(b, h)]


@pytest.mark.parametrize("node", [None, SNAPKV], ids=["full", "snapkv"])
def test_sliding_layers_keep_exactly_the_visible_window(node):
    result, lengths, layer_types = run("gemma3-text", node)
    width = max(lengths)
    for layer, kind in enumerate(layer_types):
        for b, n in enumerate(lengths):
            if kind == "sliding_attention":
                visible = list(range(max(0, n - (WINDOW - 1)), n))
                for h in range(result.kept.shape[2]):
                    assert kept_positions(result, layer, b, h, width - n) == visible
            else:
                assert result.kept[layer, b].tolist() == [min(n, 8) if node else n] * result.kept.shape[2]


def test_compress_within_the_window():
    node = {**SNAPKV, "budget": {"tokens": 3, "window": 1}, "sliding_layers": "compress"}
    result, lengths, layer_types = run("gemma3-text", node)
    width = max(lengths)
    for layer, kind in enumerate(layer_types):
        for b, n in enumerate(lengths):
            for h in range(result.kept.shape[2]):
                kept = kept_positions(result, layer, b, h, width - n)
                assert len(kept) == min(n, 3)
                if kind == "sliding_attention":
                    assert min(kept) >= n - (WINDOW - 1) and n - 1 in kept  # the window's newest is protected


def test_sliding_layers_hold_less_memory_than_full_layers():
    result, lengths, layer_types = run("mistral-sliding", None)
    assert set(layer_types) == {"sliding_attention"}
    assert result.kept.max() == WINDOW - 1 and result.kept.sum() < sum(lengths) * result.kept.shape[0] * 2


def test_bad_sliding_layers_value_is_refused():
    with pytest.raises(ConfigError, match="model.compression.sliding_layers must be 'window'.*'compress'"):
        Pipeline.from_config({**SNAPKV, "sliding_layers": "drop"})
    node = {**SNAPKV, "route": {"rule": {"name": "latch"}, "branches": {"a": {"sliding_layers": "compress"}}}}
    with pytest.raises(ConfigError, match="branches.a.sliding_layers"):
        Pipeline.from_config(node)


@pytest.mark.parametrize(
    "method",
    [
        {"select": {"name": "retrieve", "chunk": 4}},
        {"allocate": {"layer": {"name": "prefix_threshold"}}, "schedule": "global"},
    ],
    ids=["retrieve", "prefix_threshold"],
)
def test_a_component_that_cannot_compress_sliding_layers_is_refused_before_the_model_loads(method, tmp_path):
    """Read from the model's config alone (a directory holding only config.json: no weights), the
    sliding-window layers meet ``sliding_layers: compress`` when the pipeline binds the model; with
    the default (``window``) or a model without such layers, the same pipeline binds."""
    from support.attention_variants import CONFIGS

    gemma, llama = tmp_path / "gemma3-text", tmp_path / "llama"
    CONFIGS["gemma3-text"]().save_pretrained(gemma)
    CONFIGS["llama"]().save_pretrained(llama)
    node = {**SNAPKV, "budget": {"ratio": 0.5, "window": 1}, **method}
    with pytest.raises(ConfigError, match=r"cannot compress a sliding-window layer.*2 sliding-window layers"):
        Pipeline.from_config({**node, "sliding_layers": "compress"}).bind_model(str(gemma))
    Pipeline.from_config(node).bind_model(str(gemma))
    Pipeline.from_config({**node, "sliding_layers": "compress"}).bind_model(str(llama))
