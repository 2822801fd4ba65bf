"""A model spread over devices with ``device_map`` (accelerate): the cache follows the layers.

On a CPU-only machine every entry of the map is ``cpu``, but built-ins are dispatched with
accelerate's hooks all the same, so the hook path (inputs moved per module, ``cache``
skipped) runs; the cache of each layer must sit on that layer's parameters' device and the
outputs must equal the plain single-device model's. With two GPUs the layers alternate between
them and the same checks hold across real devices.
"""

from types import SimpleNamespace

import pytest
import torch
from support import e2e

from kvlab.api import load_model
from kvlab.config.errors import ConfigError
from kvlab.data.synthetic import SyntheticRetrieval
from kvlab.engine.generation import decode, prefill
from kvlab.pipeline import Pipeline

MODEL = "tiny-qwen2"  # GQA, 3 layers
STEPS = 4
SNAPKV = {"budget": {"tokens": 24, "window": 8}, "importance": {"attention": {"name": "window_attention"}}}


def layer_map(devices: list[str], num_layers: int = 3) -> dict[str, str]:
    """Embeddings on the first device, layer ``l`` on ``devices[l % len(devices)]``, head on the last."""
    placed = {f"model.layers.{i}": devices[i % len(devices)] for i in range(num_layers)}
    return {
        "model.embed_tokens": devices[0],
        "model.rotary_emb": devices[0],
        **placed,
        "model.norm": devices[-1],
        "lm_head": devices[-1],
    }


def items():
    """Two prompts of different lengths (a padded batch)."""
    return (
        SyntheticRetrieval(num_samples=1, context_words=40, seed=1).samples()
        + SyntheticRetrieval(num_samples=1, context_words=25, seed=2).samples()
    )


def run_on(loaded):
    """Prefill + decode a padded batch; returns the prefill state (its cache) and the decode result."""
    batch = loaded.processor.collate(items())
    state = prefill(loaded, Pipeline.from_config(SNAPKV), batch, decode_capacity=STEPS)
    return state, decode(state, STEPS, return_logits=True)


def check_against_single_device(device_map: dict[str, str], atol: float) -> None:
    dispatched = load_model(MODEL, device_map=device_map)
    assert dispatched.device_map == device_map
    layers = dispatched.model.model.layers
    assert all(hasattr(layer, "_hf_hook") for layer in layers)  # accelerate's hooks, even on one device
    state, out = run_on(dispatched)
    for i, (layer, cache_layer) in enumerate(zip(layers, state.cache.layers, strict=True)):
        device = next(layer.parameters()).device
        assert device == torch.device(device_map[f"model.layers.{i}"])
        assert state.cache.devices()[i] == device
        buffers = (
            cache_layer.prompt_keys,
            cache_layer.decode_values,
            cache_layer.starts,
            cache_layer.lengths,
        )
        assert {buffer.device for buffer in buffers} == {device}
    single_state, single = run_on(e2e.kvlab_model(MODEL))
    assert torch.equal(out.tokens.cpu(), single.tokens)
    torch.testing.assert_close(out.step_logits.cpu(), single.step_logits, atol=atol, rtol=atol)
    assert torch.equal(state.cache.kept_tokens().cpu(), single_state.cache.kept_tokens())
    for mine, theirs in zip(state.session.reports, single_state.session.reports, strict=True):
        assert torch.equal(mine.selection.indices.cpu(), theirs.selection.indices)


def test_device_map_dict_dispatches_with_hooks_and_the_cache_follows_each_layer():
    check_against_single_device(layer_map(["cpu"]), atol=0.0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_layers_on_two_gpus_keep_their_cache_on_their_own_gpu():
    check_against_single_device(layer_map(["cuda:0", "cuda:1"]), atol=1e-4)


def test_device_map_auto_and_a_saved_directory_through_from_pretrained(tmp_path):
    auto = load_model("tiny-llama", device_map="auto")
    expected = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert set(auto.device_map.values()) <= {expected, "0"}
    source = e2e.kvlab_model(MODEL)
    source.model.save_pretrained(tmp_path)
    source.processor.tokenizer.save_pretrained(tmp_path)
    saved = load_model(str(tmp_path), device_map=layer_map(["cpu"]))
    # from_pretrained dispatches only over several devices; one device is recorded as the whole model's
    assert saved.source == "pretrained" and saved.device_map == {"": "cpu"}
    state, out = run_on(saved)
    single_state, single = run_on(load_model(str(tmp_path)))  # the same directory, no device_map
    assert torch.equal(out.tokens.cpu(), single.tokens)
    torch.testing.assert_close(out.step_logits, single.step_logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(state.cache.kept_tokens(), single_state.cache.kept_tokens())


@pytest.mark.parametrize(
    "device_map, match",
    [
        ("everywhere", "must be one of auto"),
        ({}, "must be one of auto"),
        ({"model.layers.0": [0, 1]}, "not `name: device`"),
        ({"model.layers.0": "cpu"}, "does not place every weight"),
    ],
)
def test_bad_device_maps_are_config_errors(device_map, match):
    with pytest.raises(ConfigError, match=match):
        load_model(MODEL, device_map=device_map)


def test_device_and_device_map_together_are_refused():
    with pytest.raises(ConfigError, match="give one"):
        load_model(MODEL, device="cpu", device_map="auto")


def test_lightning_move_leaves_a_dispatched_model_in_place_and_data_parallel_is_refused():
    """Lightning moves the LightningModule to its root device (``strategy.model_to_device``: ``.to``).
    A dispatched model is not a submodule, so that move leaves accelerate's placement alone; a
    model without a device map is one and moves."""
    from kvlab.runner.module import KVLabModule

    moved = {}
    for device_map in (None, layer_map(["cpu"])):
        module = KVLabModule(model=MODEL, device_map=device_map, fidelity=False)
        module.configure_model()
        module.to("meta")  # what the strategy does, towards a device the weights are not on
        moved[device_map is None] = {p.device.type for p in module.loaded.model.parameters()}
    assert moved == {True: {"meta"}, False: {"cpu"}}
    module = KVLabModule(model=MODEL, device_map="auto", fidelity=False)
    module._trainer = SimpleNamespace(world_size=2)
    with pytest.raises(ConfigError, match="single process"):
        module.configure_model()
    with pytest.raises(ConfigError, match="model.device_map"):
        KVLabModule(model=MODEL, device_map="everywhere")
