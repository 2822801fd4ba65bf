"""Model facts through the model: what the engine gives a component is what the model computed, only
what a component declared, and a model that cannot provide a declared fact is refused before it runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest
import torch
from support import e2e
from support.attention_variants import CONFIGS, build, prompts, tokenizer
from support.presets import retrieval_samples

import kvlab
from kvlab.compression.importance import ImportanceScorer
from kvlab.config.capabilities import Capabilities
from kvlab.config.errors import ConfigError
from kvlab.engine.generation import RunOptions, generate
from kvlab.models.builtin import MODELS
from kvlab.models.facts import ModelFacts, fact_refusal, language_model
from kvlab.models.prompts import collate_ids
from kvlab.pipeline import Pipeline

NODE = {"budget": {"tokens": 24, "window": 4}, "importance": {"key_norm": {}}}


@dataclass
class Probe(ImportanceScorer):
    """Key-norm scores; records what each layer's context gives of the model facts (unregistered)."""

    capabilities: ClassVar[Capabilities] = Capabilities(
        chunked_prefill=False,
        model_facts=(
            "hidden_states",
            "keys_before_rotation",
            "projections",
            "queries_before_rotation",
            "rotary",
        ),
    )
    seen: dict[int, Any] = field(default_factory=dict)

    def score(self, ctx):
        cos, sin = ctx.facts.rotary(ctx.model_positions())
        self.seen[ctx.layer_idx] = (
            ctx.queries_before_rotation(),
            cos,
            sin,
            ctx.facts.projections,
            ctx.facts.provided,
            ctx.facts.hidden_states,
            ctx.keys_before_rotation(),
        )
        return -ctx.keys.float().norm(dim=-1)


@dataclass
class Undeclared(ImportanceScorer):
    """Declares no model fact and tries to read one."""

    capabilities: ClassVar[Capabilities] = Capabilities(chunked_prefill=True)
    errors: list[str] = field(default_factory=list)

    def score(self, ctx):
        try:
            ctx.facts.rotary(ctx.model_positions())
        except ConfigError as error:
            self.errors.append(str(error))
        return -ctx.keys.float().norm(dim=-1)


def pipeline_with(scorer: ImportanceScorer) -> Pipeline:
    pipeline = Pipeline.from_config(NODE)
    pipeline.importance["probe"] = scorer  # a second role, not in any registry
    return pipeline


def load(model: str):
    """A built-in tiny model, or a tiny family of ``support.attention_variants`` wrapped for kvlab."""
    if model in CONFIGS:
        return kvlab.wrap_model(build(model), tokenizer(), name=model)
    return e2e.kvlab_model(model)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2", "gemma3-text"])
def test_facts_are_what_the_model_computed(model):
    """Queries and keys before rotation equal the layer's projected queries and keys (Qwen2's bias,
    Gemma 3's query and key norms included), rotary equals the model's rotary module (Gemma 3: one
    per layer type, its sliding layers compressed within their window), projections are the layer's
    own parameters."""
    loaded = load(model)
    lm = language_model(loaded.model)
    projected: dict[int, torch.Tensor] = {}

    def keep_first(idx: int):  # the first call of each layer is the prefill's
        def hook(module, inputs, out) -> None:
            projected.setdefault(idx, out)

        return hook

    def query_module(attention):  # the last step before RoPE: the query norm, else the projection
        return getattr(attention, "q_norm", attention.q_proj)

    def key_module(attention):
        return getattr(attention, "k_norm", attention.k_proj)

    projected_keys: dict[int, torch.Tensor] = {}

    def keep_first_key(idx: int):
        def hook(module, inputs, out) -> None:
            projected_keys.setdefault(idx, out)

        return hook

    normed: dict[int, torch.Tensor] = {}

    def keep_input(idx: int):  # the attention's input: the layer's input norm's output
        def hook(module, inputs, out) -> None:
            normed.setdefault(idx, out)

        return hook

    hooks = [
        query_module(layer.self_attn).register_forward_hook(keep_first(i))
        for i, layer in enumerate(lm.layers)
    ]
    hooks += [
        key_module(layer.self_attn).register_forward_hook(keep_first_key(i))
        for i, layer in enumerate(lm.layers)
    ]
    hooks += [layer.input_layernorm.register_forward_hook(keep_input(i)) for i, layer in enumerate(lm.layers)]
    probe = Probe()
    pipeline = pipeline_with(probe)
    pipeline.sliding_layers = "compress"  # the probe also sees Gemma 3's sliding layers
    rows = [row[:20] for row in prompts()]  # 20, 17 and 9 tokens: left padding
    try:
        result = generate(loaded, pipeline, collate_ids(loaded, rows), RunOptions(max_new_tokens=2))
    finally:
        for hook in hooks:
            hook.remove()
    assert sorted(probe.seen) == list(range(loaded.info.num_layers))
    valid = result.prompt_lengths  # [B]
    B, T, H, D = len(rows), int(valid.max()), loaded.info.num_heads, loaded.info.head_dim
    positions = (torch.arange(T)[None] - (T - valid[:, None])).clamp(min=0)  # left padding at 0
    layer_types = getattr(lm.config, "layer_types", None)
    Hkv = loaded.info.num_kv_heads
    for idx, (queries, cos, sin, weights, provided, hidden, keys) in probe.seen.items():
        out = projected[idx]
        expected = out if out.dim() == 4 else out.view(B, T, H, D).transpose(1, 2)
        torch.testing.assert_close(queries, expected.float(), atol=1e-5, rtol=1e-5)
        out = projected_keys[idx]
        expected = out if out.dim() == 4 else out.view(B, T, Hkv, D).transpose(1, 2)
        torch.testing.assert_close(keys, expected.float(), atol=1e-5, rtol=1e-5)
        per_type = (layer_types[idx],) if layer_types and model == "gemma3-text" else ()
        want_cos, want_sin = lm.rotary_emb(torch.zeros(1), positions, *per_type)
        torch.testing.assert_close(cos, want_cos)
        torch.testing.assert_close(sin, want_sin)
        attention = lm.layers[idx].self_attn
        assert weights.o.data_ptr() == attention.o_proj.weight.data_ptr()  # a view, not a copy
        assert weights.q.shape == (H * D, attention.q_proj.in_features)
        assert (weights.q_bias is not None) == (model == "tiny-qwen2")
        assert provided == (
            "hidden_states",
            "keys_before_rotation",
            "projections",
            "queries_before_rotation",
            "rotary",
        )
        assert torch.equal(hidden, normed[idx])  # [B, T, E], the prefill's
        assert not attention._forward_pre_hooks  # the capture hook is gone after the prefill
    if model == "gemma3-text":  # the two layer types rotate differently: the test tells them apart
        assert not torch.allclose(probe.seen[0][1], probe.seen[1][1])


def test_undeclared_facts_are_neither_computed_nor_readable():
    loaded = e2e.kvlab_model("tiny-llama")
    probe = Undeclared()
    pipeline = pipeline_with(probe)
    assert pipeline.capabilities.model_facts == {}
    e2e.run(loaded, pipeline, retrieval_samples(1, 20), 1)
    assert len(probe.errors) == loaded.info.num_layers
    assert "model fact 'rotary'" in probe.errors[0] and "Capabilities(model_facts=" in probe.errors[0]


def test_a_model_without_the_fact_is_refused_before_it_loads_naming_component_fact_and_fix():
    """tiny-qwen2-vl's rotary embedding is 3-D (M-RoPE): refused at bind time, from its config, and
    again from the loaded model before the prefill forward."""
    pipeline = pipeline_with(Probe())
    with pytest.raises(ConfigError) as error:
        pipeline.bind_model("tiny-qwen2-vl")
    message = str(error.value)
    for fragment in (
        "model.compression.importance.probe (Probe)",
        "'keys_before_rotation'",  # the first, by name, of the facts it cannot provide
        "tiny-qwen2-vl cannot provide",
        "3-D (M-RoPE",
        "--config snapkv",
    ):
        assert fragment in message
    pipeline.bind_model("tiny-qwen2")  # a 1-D rotary embedding is accepted
    loaded = e2e.kvlab_model("tiny-qwen2-vl")
    with pytest.raises(ConfigError, match="3-D"):
        ModelFacts.of(loaded.model, "tiny-qwen2-vl", pipeline.capabilities.model_facts, loaded.info.head_dim)


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2}}, "rope_type dynamic"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
         "partial_rotary_factor 0.5"),
        ({"rope_parameters": None}, "no rotary embedding"),
    ],
)  # fmt: skip
def test_rotary_refusals_read_the_config(change, fragment):
    config = MODELS.get("tiny-llama")().config()
    for key, value in change.items():
        setattr(config, key, value)
    assert fragment in fact_refusal(config, "rotary")
    assert fact_refusal(config, "projections") is None  # checked on the modules, not the config


def test_projections_are_refused_on_a_layer_without_separate_linears():
    loaded = e2e.kvlab_model("tiny-llama")
    attention = language_model(loaded.model).layers[0].self_attn
    saved = attention.o_proj
    try:
        del attention.o_proj
        with pytest.raises(ConfigError, match="layer 0's attention has no separate"):
            ModelFacts.of(loaded.model, "tiny-llama", {"projections": "x (probe)"}, loaded.info.head_dim)
    finally:
        attention.o_proj = saved


def test_hidden_states_need_every_prompt_position():
    with pytest.raises(ValueError, match="declare chunked_prefill=False"):
        Capabilities(chunked_prefill=True, model_facts=("hidden_states",))
