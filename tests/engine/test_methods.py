"""Invariants of every shipped method preset, end to end through the model on tiny random models.

The cases are every shipped preset (``preset_names()``), text presets on the tiny text models and
VLM presets on the tiny VLMs with image samples, so a new preset is tested without being added
here; what an invariant expects (ragged heads, layer-wise budgets, a text prior that may keep more
than the budget) is read from the preset's own config. (Random weights: plumbing and invariants
only, never quality.)
"""

import functools
import math
from dataclasses import dataclass

import pytest
import torch
from support import e2e
from support.e2e import kvlab_model
from support.preset_runs import is_vlm_preset, preset_models, preset_samples
from support.presets import budgeted_compression, budgeted_pipeline, preset_config, retrieval_samples
from transformers import DynamicCache

from kvlab.compression.decode import DECODE_POLICIES, ScoredEviction
from kvlab.compression.selectors import SELECTORS
from kvlab.config.artefacts import Artefact, resolve_path
from kvlab.config.loader import preset_names
from kvlab.engine.masking import load_masked_model
from kvlab.models.base import TEXT
from kvlab.pipeline import Pipeline

PRESETS = [name for name in preset_names() if preset_config(name)["model"].get("compression")]  # not `full`
# every preset on each of its tiny models
CASES = [(preset, model) for preset in PRESETS for model in preset_models(preset)]
# a padded batch equals its samples one by one (kept positions included): tests/engine/test_batching.py
NEW_TOKENS = 6


@dataclass(frozen=True)
class Traits:
    """What a preset's config says about the kept counts (derived, never listed by name)."""

    ragged: bool  # a head allocator other than uniform: heads of a layer keep different counts
    layerwise: bool  # a layer allocator other than uniform: layers get different budgets
    adakv: bool  # heads of a layer share its budget: their kept counts sum to it
    sparsemm: bool  # static per-head capacities from a visual-head artefact
    keeps_all_text: bool  # a text prior keeping every text token, even beyond the budget
    model_wide: bool = False  # heads ranked over the model (DuoAttention): the model's total is the budget
    retrieves: bool = False  # some heads retrieve (a `retrieve` selector, maybe in a per-head route branch)
    local: str = "none"  # what a retrieving head holds resident: `none`, or its `protected` tokens
    chunk: int = 8  # a retrieving head's tokens per chunk
    bounded: bool = False  # a fixed-size cache while decoding (ScoredEviction): new tokens count
    periodic: bool = False  # evicts many entries every N decode steps (ScoredEviction.every > 1)
    routed_budget: bool = (
        False  # a route branch sets its own budget (SimLayerKV's full layers): no fixed budget
    )
    question: bool = (
        False  # scores with the question (Finch): the context is compressed, the question kept whole
    )
    pruned: bool = False  # a channel pruner: the kept keys are stored with fewer channels (ThinK)
    capped: bool = False  # the selector's counts are caps (DMS's threshold): heads keep what scores above it


def traits(name: str) -> Traits:
    node = preset_config(name)["model"]["compression"]
    allocate = node.get("allocate") or {}
    head = (allocate.get("head") or {}).get("name", "uniform")
    layer = (allocate.get("layer") or {}).get("name", "uniform")
    modality = allocate.get("modality") or {}
    branches = ((node.get("route") or {}).get("branches") or {}).values()
    selects = [node.get("select") or {}, *((branch or {}).get("select") or {} for branch in branches)]
    retrieve = [select for select in selects if select.get("name") == "retrieve"]
    decode = (node.get("decode") or {}).get("name", "none")
    return Traits(
        ragged=head != "uniform",
        layerwise=layer != "uniform",
        adakv=head == "adakv",
        sparsemm=head in ("sparsemm", "headkv"),  # static capacities from calibrated head scores
        model_wide=head == "duo_attention",
        keeps_all_text=modality.get("name") == "text_prior" and modality.get("overflow") == "keep_all_text",
        retrieves=bool(retrieve),
        local=retrieve[0].get("local", "none") if retrieve else "none",
        chunk=retrieve[0].get("chunk", 8) if retrieve else 8,
        bounded=issubclass(DECODE_POLICIES.get(decode), ScoredEviction),
        periodic=getattr(DECODE_POLICIES.build(node.get("decode") or {"name": "none"}), "every", 1) > 1,
        routed_budget=any("budget" in (branch or {}) for branch in branches),
        question=bool((node.get("prefill") or {}).get("question")),
        pruned=node.get("channels") is not None,
        capped=not SELECTORS.get((node.get("select") or {}).get("name", "topk")).keeps_counts,
    )


@functools.cache
def samples_for(model):
    """Two text samples for a text model; two image samples and a text one for a VLM."""
    return preset_samples(vlm=True) if kvlab_model(model).info.vision_language else retrieval_samples()


@functools.cache
def full_run(model):
    return run(kvlab_model(model), Pipeline.from_config(None), samples_for(model))


def batch_of(loaded, items):
    return loaded.processor.collate(list(items))


def run(loaded, pipe, items):
    return e2e.run(loaded, pipe, items, NEW_TOKENS)


def protected(name, length):
    """``(window, sinks)`` of a preset for a prompt of ``length`` tokens (a float window is a fraction)."""
    budget = budgeted_compression(name)["budget"]
    window = budget.get("window", 0)
    return (math.floor(window * length) if isinstance(window, float) else window), budget.get("sinks", 0)


@pytest.mark.parametrize("preset, model", CASES)
def test_budget_at_least_the_prompt_is_identical_to_full(preset, model):
    loaded = kvlab_model(model)
    full = full_run(model)
    longest = int(full.prompt_lengths.max())
    room = longest + (NEW_TOKENS if traits(preset).bounded else 0)  # a fixed-size cache holds them too
    if traits(preset).pruned:  # pruned key channels change every decode step: every channel kept here
        node = budgeted_compression(preset, model, tokens=room)
        node["channels"]["keep"] = 1.0
        big = run(loaded, Pipeline.from_config(node), samples_for(model))
        assert big.tokens == full.tokens and torch.equal(big.kept, full.kept)
        torch.testing.assert_close(big.step_logits, full.step_logits, atol=1e-5, rtol=1e-5)
        return
    node = budgeted_compression(preset, model, tokens=room)
    if traits(preset).capped:  # a threshold evicts below it whatever the budget: one below every score
        node["select"]["threshold"] = -1e30
    big = run(loaded, Pipeline.from_config(node), samples_for(model))
    assert big.tokens == full.tokens
    if traits(preset).question:  # the context prefilled, then the question on top: the same cache, other sums
        torch.testing.assert_close(big.step_logits, full.step_logits, atol=1e-4, rtol=1e-4)
        assert torch.equal(big.kv_bytes_kept, full.kv_bytes_kept)  # every context entry, then the question
        return
    assert torch.equal(big.step_logits, full.step_logits)
    assert torch.equal(big.kept, full.kept)


@pytest.mark.parametrize("preset, model", CASES)
def test_kept_counts_equal_layer_budgets_and_window_is_kept(preset, model):
    loaded = kvlab_model(model)
    items = samples_for(model)
    if traits(preset).capped:  # its own budget (DMS: the whole prompt): the threshold decides the counts
        result = run(loaded, budgeted_pipeline(preset, model), items)
        check_capped_counts(preset, model, items, batch_of(loaded, items), result)
        return
    budget = 48
    pipe = budgeted_pipeline(preset, model, tokens=budget)
    result = run(loaded, pipe, items)
    lengths = result.prompt_lengths
    batch = batch_of(loaded, items)
    T = batch.input_ids.shape[1]
    trait = traits(preset)
    window = protected(preset, T)[0]  # an int window in the ragged checks below (AdaKV, SparseMM)
    Hkv = loaded.info.num_kv_heads
    if trait.retrieves:
        check_retrieval_budgets(preset, trait, result, batch, budget, Hkv)
        return
    for report in result.reports:
        expected = torch.minimum(report.budget, lengths)
        if trait.model_wide:  # whole and streaming heads; a layer may hold streaming heads only
            pass
        elif trait.ragged:  # heads differ; the layer (AdaKV) or the model (SparseMM) sums to the budget
            assert len(set(report.kept.flatten().tolist())) > 1, report.layer_idx
        elif trait.keeps_all_text:  # the budget, raised to the text tokens it must keep
            assert bool((report.kept >= expected[:, None]).all()), report.layer_idx
        else:
            assert torch.equal(report.kept, expected[:, None].expand_as(report.kept)), report.layer_idx
        if trait.adakv:
            assert torch.equal((report.kept - window).sum(-1), Hkv * (expected - window))
        for b in range(len(lengths)):
            pad = T - int(lengths[b])
            recent, sinks = protected(preset, int(lengths[b]))
            text = {p for p in range(pad, T) if int(batch.modality[b, p]) == TEXT}
            for h in range(report.kept.shape[1]):
                kept = report.selection.kept_positions(b, h)
                assert len(set(kept)) == len(kept)
                assert all(pad <= p < T for p in kept)  # padding never kept
                assert set(range(T - recent, T)) <= set(kept)  # recent window kept
                assert set(range(pad, pad + sinks)) <= set(kept)  # sinks kept
                if trait.keeps_all_text and int(report.budget[b]) < int(lengths[b]):
                    assert text <= set(kept)
    if not trait.layerwise and not trait.routed_budget:  # routed: each row has its branch's budget
        assert all(int(r.budget.max()) == budget for r in result.reports)
    if trait.model_wide:  # over the model: the budget's free tokens, heads kept whole or at their protected
        guarded = window + protected(preset, T)[1]  # window and sinks
        kept = torch.stack([r.kept for r in result.reports]) - guarded  # [L, B, Hkv]
        assert len(set(kept.flatten().tolist())) > 1
        for b in range(len(lengths)):
            available, free = int(lengths[b]) - guarded, min(budget, int(lengths[b])) - guarded
            assert int(kept[:, b].sum()) == loaded.info.num_layers * Hkv * free
            if pipe.head_allocator.retrieval_share is None:  # whole heads, one at the boundary
                assert int(((kept[:, b] > 0) & (kept[:, b] < available)).sum()) <= 1
    if trait.sparsemm:  # global over layers and heads: sum of caps, less what short heads could not hold
        free = budget - window
        allocator = pipe.head_allocator
        path = resolve_path(allocator.artefact, model, allocator.artefact_kind, "test")
        head_scores = Artefact.load(path).tensors["scores"]
        caps = allocator.capacities(head_scores, Hkv, free)  # [L, Hkv]
        assert int(caps.sum()) == loaded.info.num_layers * Hkv * free
        kept = torch.stack([r.kept for r in result.reports]) - window  # [L, B, Hkv]
        for b in range(len(lengths)):
            available = int(lengths[b]) - window
            assert torch.equal(kept[:, b], caps.clamp(max=available))


@pytest.mark.parametrize("preset", PRESETS)
def test_kv_bytes_fall_in_proportion_to_the_budget(preset):
    model = "tiny-qwen2-vl" if is_vlm_preset(preset) else "tiny-qwen2"
    loaded = kvlab_model(model)
    info = loaded.info
    per_token = info.num_layers * info.num_kv_heads * info.head_dim * 2 * 4
    trait = traits(preset)
    if trait.retrieves:
        check_device_bytes_fall(preset, trait, loaded, model, per_token)
        return
    kept = {}
    window, sinks = protected(preset, 0)  # a float window is a share of each prompt: 0 here
    low = max(32, window + sinks)  # the smaller budget still holds the protected tokens
    for budget in (2 * low, low):
        result = run(loaded, budgeted_pipeline(preset, model, tokens=budget), samples_for(model))
        kept[budget] = result.kv_bytes_kept
        assert torch.equal(result.kv_bytes_full, result.prompt_lengths * per_token)
        if trait.question:  # the context's kept entries; the question part is prefilled whole after
            kept[budget] = result.kept.sum((0, 2)) * (per_token // (info.num_layers * info.num_kv_heads))
            assert torch.equal(kept[budget], torch.full_like(kept[budget], budget * per_token))
            continue
        if trait.sparsemm:  # caps above a short head's candidates are clamped
            assert bool((result.kv_bytes_kept <= budget * per_token).all())
        elif trait.keeps_all_text:  # every text token is kept: the text-only sample is not compressed
            assert bool((result.kv_bytes_kept >= budget * per_token).all())
        elif (
            trait.periodic or trait.capped
        ):  # the entries the last periodic eviction kept (decoded ones too) / above the threshold: within it
            assert bool((result.kv_bytes_kept <= budget * per_token).all())
        elif (
            trait.routed_budget
        ):  # layers keep their branch's budget (all of the prompt, for SimLayerKV's full ones)
            assert bool(
                (result.kv_bytes_kept >= torch.clamp(result.prompt_lengths, max=budget) * per_token).all()
            )
        elif trait.pruned:  # keys at Dk channels, values at head_dim; each (layer, head) its channel index
            pruner = budgeted_pipeline(preset, model, tokens=budget).channel_pruner
            dk = pruner.kept_channels(info.head_dim)
            heads = info.num_layers * info.num_kv_heads
            expected = budget * heads * (dk + info.head_dim) * 4 + heads * dk * 8
            assert torch.equal(result.kv_bytes_kept, torch.full_like(result.kv_bytes_kept, expected))
        elif not trait.layerwise:
            assert torch.equal(
                result.kv_bytes_kept, torch.full_like(result.kv_bytes_kept, budget * per_token)
            )
    if (
        trait.keeps_all_text or trait.periodic or trait.routed_budget or trait.capped
    ):  # the text alone outgrows both budgets / evicted to budget - every + 1 / some layers keep everything
        assert bool((kept[low] <= kept[2 * low]).all())
        return
    assert bool((kept[low] < kept[2 * low]).all())
    # pyramid budgets average to the configured one up to the schedule's floor
    ratio = (kept[low].float() / kept[2 * low].float()).tolist()
    assert all(0.4 < r < 0.6 for r in ratio)


def check_capped_counts(preset, model, items, batch, result):
    """A selector whose counts are caps (the ``threshold`` selector), run with the preset's own budget
    (``result``): each head keeps its protected tokens and what scores at least the threshold, so
    heads differ and none keeps padding; with a budget between the protected tokens and what they
    keep, the budget caps them (a head that kept more keeps exactly the budget)."""
    T = batch.input_ids.shape[1]
    lengths = result.prompt_lengths
    for report in result.reports:
        assert bool((report.kept <= lengths[:, None]).all()), report.layer_idx
        for b in range(len(lengths)):
            pad = T - int(lengths[b])
            recent, sinks = protected(preset, int(lengths[b]))
            for h in range(report.kept.shape[1]):
                kept = report.selection.kept_positions(b, h)
                assert all(pad <= p < T for p in kept) and set(range(T - recent, T)) <= set(kept)
                assert set(range(pad, pad + sinks)) <= set(kept)
    counts = torch.stack([r.kept for r in result.reports])  # [L, B, Hkv]
    assert len(set(counts.flatten().tolist())) > 1  # the threshold, not a budget, sets the counts
    assert bool((counts < lengths[None, :, None]).any())  # it evicts
    window, sinks = protected(preset, T)
    cap = (window + sinks + int(counts.max())) // 2
    capped = run(kvlab_model(model), budgeted_pipeline(preset, model, tokens=cap), items)
    for free, report in zip(result.reports, capped.reports, strict=True):
        torch.testing.assert_close(report.kept, torch.clamp(free.kept, max=cap), rtol=0, atol=0)


def device_counts(report):
    """``(resident, fetched, stored)`` ``[B, Hkv]`` of one layer: prompt entries the compressed cache
    holds, token slots fetched per decode step, prompt tokens in the host store (0 where a head does
    not retrieve)."""
    store = report.selection.offloaded
    if store is None:
        zero = torch.zeros_like(report.kept)
        return report.kept, zero, zero
    fetched, stored = store.retrieval_counts()
    return report.kept, fetched.to(report.kept.device), stored.to(report.kept.device)


def check_retrieval_budgets(preset, trait, result, batch, budget, Hkv):
    """The budget invariants of a retrieving preset (``kept`` counts resident entries only).

    A retrieving head's on-device budget is its resident entries plus the token slots it fetches
    per decode step (whole chunks: up to ``chunk - 1`` tokens of a budget are left unused); its
    resident entries plus its host store are the whole prompt (retrieval sees everything). With
    one head budget (no head allocator) each head's resident + fetched is the layer budget, less
    that remainder; with a head allocator (HybridKV) the heads of a layer share ``Hkv x budget``
    and every retrieving head of a sample fetches the same amount (b_dyn). Heads that do not
    retrieve keep the window and sinks like any evicting head, and the whole prompt when the
    budget covers it.
    """
    chunk = trait.chunk
    lengths = result.prompt_lengths
    T = batch.input_ids.shape[1]
    for report in result.reports:
        expected = torch.minimum(report.budget, lengths)  # [B]
        resident, fetched, stored = device_counts(report)
        retrieving = stored > 0
        device = resident + fetched
        assert bool(retrieving.any()), report.layer_idx  # the budget is below every prompt here
        # retrieval sees the whole prompt: resident + stored = the prompt
        assert torch.equal(torch.where(retrieving, resident + stored, lengths[:, None]),
                           lengths[:, None].expand_as(resident)), report.layer_idx  # fmt: skip
        assert bool((fetched % chunk == 0).all())
        if trait.ragged:  # a head allocator: the layer's heads share its budget
            assert bool((device.sum(-1) <= Hkv * expected).all()), report.layer_idx
            for b in range(len(lengths)):
                assert len(set(fetched[b][retrieving[b]].tolist())) == 1  # one b_dyn per sample
        else:
            unused = torch.where(retrieving, expected[:, None] - device, 0)
            assert bool(((unused >= 0) & (unused < chunk)).all()), report.layer_idx
            kept_whole = torch.where(retrieving, expected[:, None], resident)  # a head that does not retrieve
            assert torch.equal(kept_whole, expected[:, None].expand_as(resident))  # keeps its budget
        for b in range(len(lengths)):
            pad = T - int(lengths[b])
            recent, sinks = protected(preset, int(lengths[b]))
            must = set(range(T - recent, T)) | set(range(pad, pad + sinks))
            for h in range(report.kept.shape[1]):
                kept = report.selection.kept_positions(b, h)
                assert len(set(kept)) == len(kept)
                assert all(pad <= p < T for p in kept)  # padding never kept
                if not bool(retrieving[b, h]):
                    assert must <= set(kept)  # recent window and sinks kept
                elif trait.local == "protected":
                    assert set(kept) == must  # resident: exactly the protected tokens
                else:
                    assert kept == []  # nothing resident: the window is reached through the store
    assert all(int(r.budget.max()) == budget for r in result.reports)


def check_device_bytes_fall(preset, trait, loaded, model, per_token):
    """A retrieving preset's device bytes (``kv_bytes_device``: resident entries + chunk index + one
    step's fetch buffer) fall with the budget, its budgeted part (resident + fetched entries) stays
    within the budget, and the host store does not depend on the budget. With one head budget the
    budgeted part falls in proportion (whole chunks aside)."""
    info = loaded.info
    per_entry = per_token // (info.num_layers * info.num_kv_heads)
    device, budgeted, host = {}, {}, {}
    for budget in (64, 32):
        pipeline = budgeted_pipeline(preset, model, tokens=budget)
        result = run(loaded, pipeline, samples_for(model))
        assert torch.equal(result.kv_bytes_full, result.prompt_lengths * per_token)
        records = pipeline.report(result.reports, result.kv_bytes_kept).samples  # the retrieve selector's
        device[budget] = torch.tensor([r["kv_bytes_device"] for r in records])
        host[budget] = torch.tensor([r["kv_bytes_offloaded"] for r in records])
        entries = sum(resident + fetched for resident, fetched, _ in map(device_counts, result.reports))
        budgeted[budget] = entries.sum(-1) * per_entry  # [B]
        assert bool((budgeted[budget] <= budget * per_token).all())
        assert bool((device[budget] > budgeted[budget]).all())  # + the chunk index
    assert torch.equal(host[32], host[64])
    assert bool((budgeted[32] <= budgeted[64]).all()) and bool((device[32] <= device[64]).all())
    if not trait.ragged:
        assert bool((device[32] < device[64]).all())
        ratio = (budgeted[32].float() / budgeted[64].float()).tolist()
        assert all(0.4 < r < 0.6 for r in ratio)


@pytest.mark.parametrize("preset", ["snapkv", "h2o", "pyramidkv", "streamingllm", "adakv", "mixkv_sparsemm"])
def test_decode_over_ragged_cache_equals_masked_full_cache(preset):
    """Strongest end-to-end check (docs/methods/david.md): positions continue from the prompt length and
    the ragged cache attends to exactly the kept entries (against kvpress-style masking of a
    full cache, the baseline of `kvlab bench memory`)."""
    loaded = kvlab_model("tiny-qwen2")
    item = retrieval_samples(1, 60)
    result = run(loaded, budgeted_pipeline(preset, tokens=40), item)
    T = int(result.prompt_lengths[0])
    reference, _ = load_masked_model("tiny-qwen2", result.reports, T)  # full K/V, evicted entries masked
    ids = batch_of(loaded, item).input_ids
    cache = DynamicCache()
    with torch.no_grad():
        out = reference.model(input_ids=ids, cache=cache, use_cache=True)
        logits = [out.logits[:, -1]]
        for step, token in enumerate(result.tokens[0][: NEW_TOKENS - 1]):
            pos = torch.tensor([[T + step]])
            out = reference.model(input_ids=torch.tensor([[token]]), position_ids=pos, cache=cache)
            logits.append(out.logits[:, -1])
    want = torch.stack(logits, 1)[0]
    torch.testing.assert_close(result.step_logits[0, : want.shape[0]], want, atol=1e-4, rtol=1e-4)


# each MixKV preset `mixkv_<host>` and its host preset
HOSTS = {name: name[len("mixkv_") :] for name in PRESETS if name.startswith("mixkv_") and name[6:] in PRESETS}


@pytest.mark.parametrize("mixkv, host", HOSTS.items())
def test_mixkv_without_diversity_and_intrinsic_term_keeps_the_hosts_tokens(mixkv, host):
    """MixKV with r = 0 and no VNorm term reduce MixKV to its host exactly (any allocator)."""
    loaded = kvlab_model("tiny-qwen2")
    node = budgeted_compression(mixkv)
    extrinsic = node["mixer"]["extrinsic"]
    node["importance"] = {extrinsic: node["importance"][extrinsic]}
    node["mixer"] = {**node["mixer"], "intrinsic": [], "redundancy": "fixed", "fixed_redundancy": 0.0}
    got = run(loaded, Pipeline.from_config(node), retrieval_samples())
    want = run(loaded, budgeted_pipeline(host), retrieval_samples())
    assert got.tokens == want.tokens and torch.equal(got.kept, want.kept)
    for mine, theirs in zip(got.reports, want.reports, strict=True):
        assert torch.equal(mine.selection.indices, theirs.selection.indices)
    # and the real MixKV does change the choice
    full_mixkv = run(loaded, budgeted_pipeline(mixkv), retrieval_samples())
    assert any(
        not torch.equal(a.selection.indices, b.selection.indices)
        for a, b in zip(full_mixkv.reports, want.reports, strict=True)
    )


def test_scores_are_aggregated_to_kv_heads_as_configured():
    """GQA (tiny-qwen2: 4 query heads on 2 KV heads): one budget per KV head; mean vs max groups differ."""
    loaded = kvlab_model("tiny-qwen2")
    chosen = {}
    for gqa in ("mean", "max"):
        node = budgeted_compression("mixkv_adakv")
        node["importance"][node["mixer"]["extrinsic"]]["gqa"] = gqa
        result = run(loaded, Pipeline.from_config(node), retrieval_samples())
        assert result.kept.shape[-1] == loaded.info.num_kv_heads
        chosen[gqa] = torch.cat([r.selection.indices.flatten() for r in result.reports])
    assert not torch.equal(chosen["mean"], chosen["max"])
