"""Invariants of every shipped method preset, end to end through the model on tiny random models.

One table of presets; each invariant is parametrised over it, so a new preset is tested by
adding its name. (Random weights: plumbing and invariants only, never quality.)
"""

import functools
import tempfile

import e2e
import pytest
import torch
from e2e import kvlab_model
from transformers import DynamicCache

from kvlab.calibration import Artefact
from kvlab.calibration.synthetic import synthetic_visual_heads
from kvlab.compression.pipeline import Pipeline
from kvlab.config.loader import resolve
from kvlab.data.synthetic import SyntheticRetrieval
from kvlab.engine.masking import load_masked_model

PRESETS = [
    "random",
    "streamingllm",
    "snapkv",
    "knorm",
    "h2o",
    "pyramidkv",
    "adakv",
    "sparsemm",
    "keydiff",
    "mixkv_snapkv",
    "mixkv_adakv",
    "mixkv_pyramidkv",
    "mixkv_sparsemm",
]
RAGGED = {"adakv", "sparsemm", "mixkv_adakv", "mixkv_sparsemm"}  # per-head budgets differ
LAYERWISE = {"pyramidkv", "mixkv_pyramidkv"}  # per-layer budgets differ
TEXT_MODELS = ["tiny-llama", "tiny-qwen2"]
NEW_TOKENS = 6


@functools.cache
def visual_heads_artefact(model: str) -> str:
    """A seeded, skewed visual-head artefact for a tiny model (SparseMM presets need one)."""
    return synthetic_visual_heads(kvlab_model(model).info, tempfile.mkdtemp(prefix="kvlab-vh-"))


def preset_compression(name, model="tiny-qwen2", **budget):
    node = resolve([name], [])["model"]["compression"]
    if budget:
        node["budget"] = {**node["budget"], **budget}
    head = node.get("allocate", {}).get("head", {})
    if head.get("name") == "sparsemm":
        head["artefact"] = visual_heads_artefact(model)
    return node


def pipeline(name, model="tiny-qwen2", **budget):
    return Pipeline.from_config(preset_compression(name, model, **budget))


@functools.cache
def samples(n=2, words=60):
    return SyntheticRetrieval(num_samples=n, context_words=words, seed=1).samples()


def batch_of(loaded, items):
    return loaded.processor.collate(list(items))


def run(loaded, pipe, items):
    return e2e.run(loaded, pipe, items, NEW_TOKENS)


def window_of(name):
    return preset_compression(name)["budget"].get("window", 0)


@pytest.mark.parametrize("model", TEXT_MODELS)
@pytest.mark.parametrize("preset", PRESETS)
def test_budget_at_least_the_prompt_is_identical_to_full(model, preset):
    loaded = kvlab_model(model)
    full = run(loaded, Pipeline.from_config(None), samples())
    longest = int(full.prompt_lengths.max())
    big = run(loaded, pipeline(preset, model, tokens=longest), samples())
    assert big.tokens == full.tokens
    assert torch.equal(big.step_logits, full.step_logits)
    assert torch.equal(big.kept, full.kept)


@pytest.mark.parametrize("model", TEXT_MODELS)
@pytest.mark.parametrize("preset", PRESETS)
def test_kept_counts_equal_layer_budgets_and_window_is_kept(model, preset):
    loaded = kvlab_model(model)
    budget = 48
    pipe = pipeline(preset, model, tokens=budget)
    result = run(loaded, pipe, samples())
    lengths = result.prompt_lengths
    T = batch_of(loaded, samples())["input_ids"].shape[1]
    window = window_of(preset)
    Hkv = loaded.info.num_kv_heads
    for report in result.reports:
        expected = torch.minimum(report.budget, lengths)
        if preset in RAGGED:  # heads differ; the layer (AdaKV) or the model (SparseMM) sums to the budget
            assert len(set(report.kept.flatten().tolist())) > 1, report.layer_idx
        else:
            assert torch.equal(report.kept, expected[:, None].expand_as(report.kept)), report.layer_idx
        if "adakv" in preset:
            assert torch.equal((report.kept - window).sum(-1), Hkv * (expected - window))
        for b in range(len(lengths)):
            pad = T - int(lengths[b])
            for h in range(report.kept.shape[1]):
                kept = report.selection.kept_positions(b, h)
                assert len(set(kept)) == len(kept)
                assert all(pad <= p < T for p in kept)  # padding never kept
                assert set(range(T - window, T)) <= set(kept)  # recent window kept
    if preset not in LAYERWISE:
        assert all(int(r.budget.max()) == budget for r in result.reports)
    if (
        "sparsemm" in preset
    ):  # global over layers and heads: sum of caps, less what short heads could not hold
        free = budget - window
        allocator = pipe.head_allocator
        head_scores = Artefact.load(allocator.artefact).tensors["scores"]
        caps = allocator.capacities(head_scores, Hkv, free)  # [L, Hkv]
        assert int(caps.sum()) == loaded.info.num_layers * Hkv * free
        kept = torch.stack([r.kept for r in result.reports]) - window  # [L, B, Hkv]
        for b in range(len(lengths)):
            available = int(lengths[b]) - window
            assert torch.equal(kept[:, b], caps.clamp(max=available))


@pytest.mark.parametrize("preset", PRESETS)
def test_kv_bytes_fall_in_proportion_to_the_budget(preset):
    loaded = kvlab_model("tiny-qwen2")
    info = loaded.info
    per_token = info.num_layers * info.num_kv_heads * info.head_dim * 2 * 4
    kept = {}
    for budget in (64, 32):
        result = run(loaded, pipeline(preset, tokens=budget), samples())
        kept[budget] = result.kv_bytes_kept
        assert torch.equal(result.kv_bytes_full, result.prompt_lengths * per_token)
        if "sparsemm" in preset:  # caps above a short head's candidates are clamped
            assert bool((result.kv_bytes_kept <= budget * per_token).all())
        elif preset not in LAYERWISE:
            assert torch.equal(
                result.kv_bytes_kept, torch.full_like(result.kv_bytes_kept, budget * per_token)
            )
    assert bool((kept[32] < kept[64]).all())
    # pyramid budgets average to the configured one up to the schedule's floor
    ratio = (kept[32].float() / kept[64].float()).tolist()
    assert all(0.4 < r < 0.6 for r in ratio)


@pytest.mark.parametrize("model", TEXT_MODELS)
@pytest.mark.parametrize("preset", ["full", *PRESETS])
def test_padded_batch_equals_samples_one_by_one(model, preset):
    loaded = kvlab_model(model)
    pipe = pipeline(preset, model, tokens=40) if preset != "full" else Pipeline.from_config(None)
    items = samples(2, 60)[:1] + SyntheticRetrieval(num_samples=1, context_words=35, seed=5).samples()
    e2e.assert_batch_equals_alone(loaded, pipe, items, NEW_TOKENS)


@pytest.mark.parametrize("preset", ["snapkv", "h2o", "pyramidkv", "streamingllm", "adakv", "mixkv_sparsemm"])
def test_decode_over_ragged_cache_equals_masked_full_cache(preset):
    """Strongest end-to-end check (david.md §4.1.6): positions continue from the prompt length and
    the ragged cache attends to exactly the kept entries (against kvpress-style masking of a
    full cache, the baseline of `kvlab bench memory`)."""
    loaded = kvlab_model("tiny-qwen2")
    item = samples(1, 60)
    result = run(loaded, pipeline(preset, tokens=40), item)
    T = int(result.prompt_lengths[0])
    reference = load_masked_model("tiny-qwen2", result.reports, T)  # full K/V, evicted entries masked
    ids = batch_of(loaded, item)["input_ids"]
    cache = DynamicCache()
    with torch.no_grad():
        out = reference.model(input_ids=ids, past_key_values=cache, use_cache=True)
        logits = [out.logits[:, -1]]
        for step, token in enumerate(result.tokens[0][: NEW_TOKENS - 1]):
            pos = torch.tensor([[T + step]])
            out = reference.model(input_ids=torch.tensor([[token]]), position_ids=pos, past_key_values=cache)
            logits.append(out.logits[:, -1])
    want = torch.stack(logits, 1)[0]
    torch.testing.assert_close(result.step_logits[0, : want.shape[0]], want, atol=1e-4, rtol=1e-4)


HOSTS = {"mixkv_snapkv": "snapkv", "mixkv_adakv": "adakv", "mixkv_pyramidkv": "pyramidkv",
         "mixkv_sparsemm": "sparsemm"}  # fmt: skip


@pytest.mark.parametrize("mixkv, host", HOSTS.items())
def test_mixkv_without_diversity_and_intrinsic_term_keeps_the_hosts_tokens(mixkv, host):
    """MixKV spec Sec. 8: r = 0 and no VNorm term reduce MixKV to its host exactly (any allocator)."""
    loaded = kvlab_model("tiny-qwen2")
    node = preset_compression(mixkv)
    node["importance"] = node["importance"][:1]
    node["mixer"] = {**node["mixer"], "redundancy": "fixed", "fixed_redundancy": 0.0}
    got = run(loaded, Pipeline.from_config(node), samples())
    want = run(loaded, pipeline(host), samples())
    assert got.tokens == want.tokens and torch.equal(got.kept, want.kept)
    for mine, theirs in zip(got.reports, want.reports, strict=True):
        assert torch.equal(mine.selection.indices, theirs.selection.indices)
    full_mixkv = run(loaded, pipeline(mixkv), samples())  # and the real MixKV does change the choice
    assert any(
        not torch.equal(a.selection.indices, b.selection.indices)
        for a, b in zip(full_mixkv.reports, want.reports, strict=True)
    )


def test_scores_are_aggregated_to_kv_heads_as_configured():
    """GQA (tiny-qwen2: 4 query heads on 2 KV heads): one budget per KV head; mean vs max groups differ."""
    loaded = kvlab_model("tiny-qwen2")
    chosen = {}
    for gqa in ("mean", "max"):
        node = preset_compression("mixkv_adakv")
        node["importance"][0]["gqa"] = gqa
        result = run(loaded, Pipeline.from_config(node), samples())
        assert result.kept.shape[-1] == loaded.info.num_kv_heads
        chosen[gqa] = torch.cat([r.selection.indices.flatten() for r in result.reports])
    assert not torch.equal(chosen["mean"], chosen["max"])
