"""Every registered component runs: built from the registry, in a pipeline whose other slots keep
their defaults, through a short prefill and decode on a tiny model.

The cases are read from the registries themselves (every registry whose entries are pipeline
components), so a component is covered the day it is registered. A component that cannot run
with the other slots at their defaults says what it needs in :data:`NEEDS` (one line), e.g.
MixKV's mixer names its roles, PrefixKV's online allocator needs ``schedule: global``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from support import e2e

from kvlab.config.capabilities import Component
from kvlab.config.loader import merge
from kvlab.config.registry import REGISTRIES, Registry
from kvlab.data.synthetic import SyntheticImageQA, SyntheticRetrieval
from kvlab.pipeline import Pipeline

VLM, TEXT_MODEL = "tiny-qwen2-vl", "tiny-qwen2"
STEPS = 4
#: every other slot at its default: SnapKV's scorer under a small token budget
BASE: dict[str, Any] = {
    "budget": {"tokens": 24, "window": 4},
    "importance": {"attention": {"name": "window_attention"}},
}


def _slot(field: str, name: str) -> dict[str, Any]:
    """The node putting component ``name`` of the registry written at YAML ``field`` into its slot."""
    component = {"name": name}
    if field.endswith("importance.<role>"):
        return {"importance": {"attention": component}}
    if field.endswith("diversity.<role>"):
        return {"diversity": {"diverse": component}}
    if field.endswith("route.rule.metric"):
        rule = {"name": "latch", "metric": component, "before": "first", "after": "second"}
        return {"route": {"rule": rule, "branches": {"first": {}, "second": {}}}}
    if field.endswith("select.index"):
        return {"select": {"name": "retrieve", "index": component}}
    if field.endswith("route.rule"):
        return {"route": {"rule": component, "branches": {}}}  # the rule's own branch names, below
    path = field.removeprefix("model.compression.").split(".")
    node: dict[str, Any] = component
    for key in reversed(path):
        node = {key: node}
    return node


#: what a component needs beyond the other slots' defaults (registry kind, name) -> node merged over
#: its slot's, or a function of the test's ``visual_heads`` fixture and the model's info
NEEDS: dict[tuple[str, str], Any] = {
    ("mixer", "mixkv"): {
        "importance": {"attention": {"name": "window_attention"}, "value_norm": {}},
        "diversity": {"mean_key_diversity": {}},
        "mixer": {"extrinsic": "attention", "intrinsic": ["value_norm"], "diversity": ["mean_key_diversity"]},
    },
    ("layer allocator", "prefix_threshold"): {"schedule": "global"},
    ("layer allocator", "model_topk"): {"schedule": "global"},
    ("layer allocator", "vl_cache"): {"schedule": "global"},
    ("importance scorer", "expected_attention"): {"model": TEXT_MODEL},  # Qwen2-VL's 3-D rotary: refused
    ("importance scorer", "leverage"): {"model": TEXT_MODEL},  # Qwen2-VL's 3-D rotary: refused
    ("importance scorer", "capkv"): {"model": TEXT_MODEL},  # Qwen2-VL's 3-D rotary: refused
    ("importance scorer", "qfilters"): {"model": TEXT_MODEL},  # filters shipped for the text models
    # FastV's K is its layer allocator's; K = 1 so that the two-layer tiny VLM evicts at all
    ("importance scorer", "fastv_attention"): {"allocate": {"layer": {"name": "fastv", "layer": 1}}},
    ("layer allocator", "fastv"): {"allocate": {"layer": {"layer": 1}}},
    ("layer allocator", "per_layer"): lambda visual_heads, info: {  # one kept share per layer
        "allocate": {"layer": {"ratios": [0.5] * info.num_layers}}
    },
    ("layer allocator", "prefix_calibrated"): {
        "budget": {"ratio": 0.5, "window": 1, "sinks": 1},  # as calibrated (its shipped artefact)
        "allocate": {"layer": {"interpolate": "linear"}},
        "model": TEXT_MODEL,
    },
    ("head allocator", "sparsemm"): lambda visual_heads, info: {
        "allocate": {"head": {"artefact": visual_heads(info)}}
    },
    ("head allocator", "duo_attention"): {"model": TEXT_MODEL},  # head scores shipped for the text models
    ("head allocator", "headkv"): {"model": TEXT_MODEL},  # head scores shipped for the text models
    # Finch's scorer reads the question, which a progressive prefill with the question appends
    ("importance scorer", "question_attention"): {
        "prefill": {"name": "progressive", "chunk": 16, "question": True},
        "model": TEXT_MODEL,
    },
    ("prefill mode", "progressive"): {"prefill": {"chunk": 16}, "model": TEXT_MODEL},  # text models only
    # KVzip's scorers read the model's reconstruction of the prompt, which the reconstruct prefill runs
    ("importance scorer", "reconstruction_attention"): {
        "prefill": {"name": "reconstruct", "chunk": 16},
        "model": TEXT_MODEL,
    },
    ("importance scorer", "reconstruction_attention_plus"): {
        "prefill": {"name": "reconstruct", "chunk": 16},
        "model": TEXT_MODEL,
    },
    ("prefill mode", "reconstruct"): {
        "prefill": {"chunk": 16},
        "importance": {"attention": {"name": "reconstruction_attention"}},
        "model": TEXT_MODEL,  # text models only
    },
    ("head allocator", "hybridkv"): {
        "route": {"rule": {"name": "text_sparsity"}, "branches": {"static": {}, "dynamic": {}}}
    },
}


def component_registries() -> list[Registry[Any]]:
    """The registries of pipeline components (their entries derive from ``Component``)."""
    found = []
    for registry in REGISTRIES:
        classes = [registry.get(name) for name in registry.names()]
        if classes and all(isinstance(cls, type) and issubclass(cls, Component) for cls in classes):
            found.append(registry)
    return found


def cases() -> list[Any]:
    import kvlab.compression  # noqa: F401  (registers every built-in component)

    return [
        pytest.param(registry, name, id=f"{registry.kind.replace(' ', '_')}-{name}")
        for registry in component_registries()
        for name in registry.names()
    ]


def node_for(registry: Registry[Any], name: str, visual_heads, info) -> tuple[dict[str, Any], str]:
    """The ``model.compression`` node running component ``name``, and the model to run it on."""
    node = merge(copy.deepcopy(BASE), _slot(registry.field, name))
    if "route" in node and not node["route"]["branches"]:  # a rule routes to its own branch names
        rule = registry.build({"name": name})
        node["route"]["branches"] = {branch: {} for branch in rule.branch_names}
    need = NEEDS.get((registry.kind, name), {})
    need = need(visual_heads, info) if callable(need) else copy.deepcopy(need)
    model = need.pop("model", VLM)
    return merge(node, need), model


def samples(model: str) -> list[Any]:
    """Two prompts of different lengths (padding); on the VLM one with an image, one text-only."""
    text = SyntheticRetrieval(num_samples=1, context_words=40, seed=2).samples()
    if model == TEXT_MODEL:
        return text + SyntheticRetrieval(num_samples=1, context_words=25, seed=3).samples()
    return SyntheticImageQA(num_samples=1, images_per_sample=1, seed=4).samples() + text


@pytest.mark.parametrize("registry, name", cases())
def test_every_registered_component_prefills_and_decodes(registry, name, visual_heads):
    loaded_vlm = e2e.kvlab_model(VLM)
    node, model = node_for(registry, name, visual_heads, loaded_vlm.info)
    loaded = e2e.kvlab_model(model)
    pipeline = Pipeline.from_config(node)
    assert any(part.component.registry_name == name for part in pipeline.walk()), "not in the pipeline"
    result = e2e.run(loaded, pipeline, samples(model), STEPS)
    assert len(result.reports) == loaded.info.num_layers
    assert all(len(tokens) <= STEPS for tokens in result.tokens) and result.step_logits is not None
    assert bool(torch.isfinite(result.step_logits).all())
    assert bool((result.kept <= result.prompt_lengths[None, :, None]).all())


def test_every_component_registry_is_covered():
    """A new kind of component (a registry of ``Component`` s) gets a slot here or fails this test."""
    import kvlab.compression  # noqa: F401

    kinds = {registry.kind for registry in component_registries()}
    assert kinds == {
        "importance scorer", "diversity scorer", "mixer", "layer allocator", "head allocator",
        "modality allocator", "selector", "route rule", "layer metric", "decode policy", "quantizer",
        "retrieval index", "prefill mode", "channel pruner",
    }  # fmt: skip
