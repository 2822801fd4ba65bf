"""Device placement by construction: every tensor the engine creates while it prefills, compresses
and decodes takes its device from an input, never from torch's default device.

Every preset (and the H2O decode policy), each on one of its tiny models, runs with the default
device set to ``meta`` while the model and the batch stay on the CPU: a tensor created without an
explicit device lands on ``meta``, which holds no data, so mixing it with the CPU tensors, reading
it or copying it out fails loudly. The run must still produce the recorded tokens and kept counts
(``tests/fixtures/preset_selections.json``). Host-side bookkeeping that is meant to live on the CPU
(RandomScorer's seeded draws, route latches, HybridKV's pool arithmetic, the retrieval host
store) names ``device="cpu"`` explicitly. The GPU tier (``tests/gpu``) runs the presets with the
model on ``cuda:1`` where two GPUs exist.
"""

import json

import pytest
import torch
from support import e2e
from support.preset_runs import (
    NEW_TOKENS,
    RECORD,
    is_vlm_preset,
    preset_compression,
    preset_models,
    preset_samples,
)

from kvlab.config.loader import preset_names
from kvlab.engine.generation import RunOptions
from kvlab.pipeline import Pipeline

RECORDED = json.loads(RECORD.read_text())
H2O_DECODE = "h2o+decode"  # the h2o preset with the h2o decode policy (evict_one at every step)
#: each preset on one of its tiny models, the models taken in turn (what creates a tensor is the
#: method's code, not the model's shape; the regression and batching tests run every pair)
CASES = [
    (name, preset_models(name.split("+")[0])[i % 2]) for i, name in enumerate([*preset_names(), H2O_DECODE])
]


@pytest.mark.parametrize(("preset", "model"), CASES)
def test_a_run_creates_no_tensor_on_the_default_device(preset, model, visual_heads):
    name = preset.split("+")[0]
    loaded = e2e.kvlab_model(model)
    node = preset_compression(name, model, visual_heads)
    if preset == H2O_DECODE:
        node["decode"] = {"name": "h2o"}
    pipeline = Pipeline.from_config(node)
    batch = loaded.processor.collate(preset_samples(is_vlm_preset(name)))
    with torch.device("meta"):
        result = e2e.generate_batch(loaded, pipeline, batch, RunOptions(max_new_tokens=NEW_TOKENS))
    assert result.kept.device.type == "cpu"
    if preset != H2O_DECODE:  # the recorded run: the same tokens and kept counts
        assert result.tokens == RECORDED[f"{name}/{model}"]["tokens"]
        assert result.kept.tolist() == RECORDED[f"{name}/{model}"]["kept"]
