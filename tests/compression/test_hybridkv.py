"""HybridKV: the text-centric sparsity classifier (Eq. 2-3), the top-down allocator (Eq. 4-5), the
text-prior static selection, the per-head route, and the method end to end on the tiny models
(the sanity checks of docs/methods/hybridkv.md: unlimited budget = full, theta = 0 = SnapKV without
pooling, theta > 1 with r = 1 = uniform chunk retrieval, text kept when the budget allows)."""

import pytest
import torch
from naive.attention import naive_window_scores
from naive.context import make_ctx, sample_lists
from naive.hybridkv import naive_hybridkv_floor_budgets, naive_text_prior_keep, naive_text_sparsity
from support import e2e
from support.e2e import kvlab_model

from kvlab.cache.state import RunState
from kvlab.compression.hybridkv import (
    allocate_pool,
    round_pow2,
    text_centric_sparsity,
    text_queries,
)
from kvlab.config.errors import ConfigError
from kvlab.config.loader import resolve
from kvlab.data.synthetic import SyntheticImageQA, SyntheticRetrieval
from kvlab.engine.generation import RunOptions
from kvlab.pipeline import Pipeline

WINDOW = 4


def vlm_ctx(lengths, text_tail=6, seed=0, **kw):
    """A padded batch whose samples are two text tokens, images, then ``text_tail`` text tokens."""
    ctx = make_ctx(lengths, seed=seed, **kw)
    T = ctx.seq_len
    modality = torch.full_like(ctx.modality, -1)
    for b, n in enumerate(lengths):
        modality[b, T - n :] = 0
        modality[b, T - n + 2 : T - text_tail] = 1
    ctx.modality = modality
    return ctx


def hybrid_node(tokens=14, theta=0.9, **head):
    """The preset's pipeline with a token budget; one pool per layer (``scope: layer``, compressed
    layer by layer) unless ``scope`` says otherwise (``global`` keeps ``schedule: global``)."""
    node = resolve(["hybridkv"], [])["model"]["compression"]
    node["budget"] = {"tokens": tokens, "window": WINDOW}
    node["route"]["rule"]["theta"] = theta
    node["allocate"]["head"].update({"scope": "layer", **head})
    if node["allocate"]["head"]["scope"] == "layer":
        node.pop("schedule")
    return node


@pytest.mark.parametrize("text, tail", [("trailing", 6), ("all_text", 6), ("trailing", 2)])
def test_text_centric_sparsity_matches_a_loop(text, tail):
    ctx = vlm_ctx([23, 17], text_tail=tail)
    ctx.window = torch.tensor([WINDOW, WINDOW])
    got = text_centric_sparsity(ctx, topk=0.1, text=text, min_text=4)
    rows = text_queries(ctx, text, min_text=4)
    for b in range(2):
        n, off, q, k, _ = sample_lists(ctx, b)
        mine = [i - off for i in rows[b].nonzero().flatten().tolist()]
        visual = (ctx.modality[b, off:] > 0).tolist()
        if text == "all_text":
            want_rows = [i for i in range(n) if not visual[i]]
        elif tail >= 4:
            want_rows = list(range(n - tail, n))
        else:  # fewer than min_text trailing tokens: the recent window
            want_rows = list(range(n - WINDOW, n))
        assert mine == want_rows
        want = naive_text_sparsity(q, k, ctx.scaling, want_rows, topk=0.1)
        torch.testing.assert_close(got[b], torch.tensor(want, dtype=torch.float32), atol=1e-5, rtol=1e-5)
    assert bool(((got > 0) & (got <= 1 + 1e-6)).all())


def test_round_pow2_examples():
    assert [round_pow2(x, "nearest") for x in (1842.75, 1843, 2250, 3071, 3073, 6)] == [
        2048, 2048, 2048, 2048, 4096, 4,
    ]  # fmt: skip
    assert round_pow2(1843, "ceil") == 2048 and round_pow2(2250, "ceil") == 4096
    assert round_pow2(2250, "floor") == 2048 and round_pow2(2250.7, "none") == 2250


@pytest.mark.parametrize("seed", range(6))
def test_allocation_matches_eq4_eq5_and_conserves_the_budget(seed):
    gen = torch.Generator().manual_seed(seed)
    N = int(torch.randint(2, 12, (1,), generator=gen))
    score = 0.5 + 0.5 * torch.rand(N, generator=gen)
    static = score >= 0.75
    static[0] = True
    per_head, protected = int(torch.randint(40, 400, (1,), generator=gen)), 8
    length = 10 * per_head
    got = allocate_pool(score, static, per_head, length, protected, r=0.75, alpha=0.3, rounding="floor")
    want = naive_hybridkv_floor_budgets(
        score.tolist(), static.tolist(), per_head, length, protected, 0.75, 0.3
    )
    assert got.tolist() == want
    exact = allocate_pool(score, static, per_head, length, protected, r=0.75, alpha=0.3)
    assert int(exact.sum()) == per_head * N  # exact_total: Sum b_static + b_dyn N_dyn = B_total
    assert bool(((exact - got).abs() <= 2).all())  # each a floor or a ceiling of the same real budget
    b_dyn = set(exact[~static].tolist())
    assert len(b_dyn) <= 1 and all(b % 8 == 0 and b & (b - 1) == 0 for b in b_dyn)  # a power of two, x 8


def test_allocation_edge_cases():
    score = torch.tensor([0.95, 0.97, 0.5, 0.6])
    # every head dynamic with r = 1: pow2(Bbar) = 128 > Bbar = 100 would break the total, stepped down
    assert allocate_pool(score, torch.zeros(4, dtype=torch.bool), 100, 1000, 4, r=1.0).tolist() == [64] * 4
    # every head static: the whole budget, alpha = 1 is uniform
    assert (
        allocate_pool(score, torch.ones(4, dtype=torch.bool), 100, 1000, 4, alpha=1.0).tolist() == [100] * 4
    )
    # pow2(r Bbar) = 16 below the 32 protected tokens every head's count holds: b_dyn is raised
    # to them before B_stat is taken, so the pool still sums to B_total
    mixed = torch.tensor([True, False])
    assert allocate_pool(score[:2], mixed, 32, 1000, 32, r=0.75).tolist() == [32, 32]
    # no head keeps more than the prompt: the excess goes to the other static heads
    got = allocate_pool(torch.tensor([1.0, 0.1, 0.1]), torch.ones(3, dtype=torch.bool), 50, 60, 4, alpha=0.0)
    assert got.tolist()[0] == 60 and int(got.sum()) == 150


def test_static_heads_keep_every_text_token_when_the_budget_allows():
    """theta = 0 (all static): with b >= window + historical text, every text token is kept."""
    ctx = vlm_ctx([40, 33], text_tail=6)
    text_hist = 2 + 6 - WINDOW
    selection, report = Pipeline.from_config(hybrid_node(tokens=16, theta=0.0)).compress(ctx)
    assert bool((report.kept >= WINDOW + text_hist).all())
    T = ctx.seq_len
    for b, n in enumerate([40, 33]):
        text = [p for p in range(T - n, T) if int(ctx.modality[b, p]) == 0]
        for h in range(2):
            assert set(text) <= set(selection.kept_positions(b, h))


def test_text_prior_selection_matches_a_loop():
    """theta = 0, alpha = 1: every head static with the layer budget, text prior by s_w (Eq. 6-7)."""
    ctx = vlm_ctx([40, 33], text_tail=6, seed=3)
    budget = 12
    selection, _ = Pipeline.from_config(hybrid_node(tokens=budget, theta=0.0, alpha=1.0)).compress(ctx)
    for b in range(2):
        n, off, q, k, _ = sample_lists(ctx, b)
        s_w = naive_window_scores(q, k, ctx.scaling, WINDOW, kernel=1, pool="none", agg="mean")
        visual = (ctx.modality[b, off:] > 0).tolist()
        for h in range(2):
            want = naive_text_prior_keep(s_w[h], visual, n, budget, WINDOW)
            assert [p - off for p in selection.kept_positions(b, h)] == want


def test_theta_zero_without_text_prior_is_snapkv_without_pooling():
    ctx = vlm_ctx([40, 33], seed=5)
    node = hybrid_node(tokens=12, theta=0.0, alpha=1.0)
    node["route"]["branches"]["static"] = {}
    got, _ = Pipeline.from_config(node).compress(ctx)
    snap = resolve(["snapkv"], [])["model"]["compression"]
    snap["budget"] = {"tokens": 12, "window": WINDOW}
    snap["importance"]["attention"].update(kernel=1, pool="none")
    want, _ = Pipeline.from_config(snap).compress(vlm_ctx([40, 33], seed=5))
    assert torch.equal(got.counts, want.counts) and torch.equal(got.indices, want.indices)


def test_per_head_route_takes_each_head_from_its_branch():
    ctx = vlm_ctx([40, 33], seed=2)
    ctx.window = torch.tensor(
        [WINDOW, WINDOW]
    )  # what the pipeline sets: the fallback text set (6 < 8 tokens)
    score = text_centric_sparsity(ctx)
    theta = float(score.flatten().sort().values[1:3].mean())  # some heads of each class
    selection, report = Pipeline.from_config(hybrid_node(tokens=16, theta=theta)).compress(ctx)
    classes = report.route  # the rule's decision carries its classes (HeadClassDecision)
    assert torch.equal(report.route.heads, (~classes.static).long())
    store = selection.offloaded
    assert sorted(map(tuple, store.rows.tolist())) == sorted(map(tuple, (~classes.static).nonzero().tolist()))
    assert bool((selection.counts[~classes.static] == 0).all())  # dynamic heads hold nothing local
    assert bool((selection.counts[classes.static] >= WINDOW).all())


def test_config_errors():
    node = hybrid_node()
    node["route"]["branches"]["dynamic"]["budget"] = {"tokens": 8}
    with pytest.raises(ConfigError, match="share one layer budget"):
        Pipeline.from_config(node)
    node = resolve(["snapkv"], [])["model"]["compression"]
    node["allocate"]["head"] = {"name": "hybridkv"}
    with pytest.raises(ConfigError, match="text_sparsity"):
        Pipeline.from_config(node).compress(make_ctx([30]))
    node = hybrid_node(scope="global")
    node["schedule"] = "layerwise"
    with pytest.raises(ConfigError, match="schedule: global"):
        Pipeline.from_config(node).compress(vlm_ctx([30]))


# --- end to end on the tiny models -------------------------------------------------------------
def vlm_items():
    two = SyntheticImageQA(num_samples=1, images_per_sample=2, seed=3).samples()
    return two + SyntheticRetrieval(num_samples=1, context_words=30, seed=2).samples()


def test_unlimited_budget_reproduces_full_exactly():
    loaded = kvlab_model("tiny-qwen2-vl")
    full = e2e.run(loaded, Pipeline.from_config(None), vlm_items(), 5)
    node = resolve(["hybridkv"], [])["model"]["compression"]
    node["budget"]["ratio"] = 1.0
    got = e2e.run(loaded, Pipeline.from_config(node), vlm_items(), 5)
    assert got.tokens == full.tokens and torch.equal(got.step_logits, full.step_logits)
    assert all(r.selection.offloaded is None for r in got.reports)


def test_all_dynamic_with_r_one_is_uniform_retrieval():
    """theta > 1 sends every head to retrieval; r = 1 and a power-of-two budget: the retrieval preset."""
    loaded = kvlab_model("tiny-qwen2")
    items = SyntheticRetrieval(num_samples=2, context_words=60, seed=1).samples()
    node = hybrid_node(tokens=64, theta=1.5, r=1.0)
    node["budget"]["window"] = 0
    got = e2e.run(loaded, Pipeline.from_config(node), items, 5)
    retrieval = resolve(["retrieval"], [])["model"]["compression"]
    retrieval["budget"] = {"tokens": 64, "window": 0}  # nothing resident, as dynamic heads
    want = e2e.run(loaded, Pipeline.from_config(retrieval), items, 5)
    assert got.tokens == want.tokens and torch.equal(got.step_logits, want.step_logits)


def test_a_padded_batch_equals_its_samples_alone():
    loaded = kvlab_model("tiny-qwen2-vl")
    theta = 0.2  # on tiny-qwen2-vl the image sample's heads score ~0.13 (dynamic), the text one's ~0.22
    e2e.assert_batch_equals_alone(loaded, Pipeline.from_config(hybrid_node(24, theta)), vlm_items(), 4)


def test_device_budget_is_the_pool_and_falls_with_the_budget():
    """Per layer and sample the heads' on-device entries (static: resident; dynamic: the slots
    fetched per step) sum to Hkv x budget when a static head takes the rest (exact_total), dynamic
    heads fetch pow2(r Bbar) each, and halving the budget halves both."""
    loaded = kvlab_model("tiny-qwen2-vl")
    items = vlm_items() + SyntheticImageQA(num_samples=1, images_per_sample=1, seed=4).samples()
    Hkv, device, classes = loaded.info.num_kv_heads, {}, set()
    for tokens in (64, 32):
        result = e2e.run(loaded, Pipeline.from_config(hybrid_node(tokens, theta=0.2)), items, 3)
        total = 0
        for report in result.reports:
            store = report.selection.offloaded
            fetched = store.retrieval_counts()[0] if store is not None else torch.zeros_like(report.kept)
            dynamic = report.route.heads.bool()
            classes |= set(dynamic.flatten().tolist())
            assert torch.equal(fetched > 0, dynamic)
            assert bool((fetched[dynamic] == round_pow2(0.75 * tokens, "nearest")).all())
            assert bool((report.kept[dynamic] == 0).all())  # nothing resident (local: none)
            entries = (report.kept + fetched).sum(-1)  # [B]
            has_static = (~dynamic).any(-1)
            assert torch.equal(entries[has_static], torch.full_like(entries[has_static], Hkv * tokens))
            assert bool((entries <= Hkv * tokens).all())
            total += entries
        device[tokens] = total
    assert classes == {False, True}  # both head types occur in these runs
    assert torch.equal(device[32] * 2, device[64])


def test_global_scope_pools_the_heads_of_every_layer():
    """scope: global (schedule: global): one pool of L x Hkv heads per sample (Eq. 4-5 over all
    layers), against the loop; per-layer pools would give other budgets."""
    L, lengths = 3, [40, 33]
    run = RunState()  # one prefill's shared state, as the engine gives every layer's context
    ctxs = [vlm_ctx(lengths, seed=10 + layer, layer_idx=layer, num_layers=L, run=run) for layer in range(L)]
    scores = []
    for ctx in ctxs:
        ctx.window = torch.tensor([WINDOW, WINDOW])
        scores.append(text_centric_sparsity(ctx))  # [B, Hkv]
        ctx.window = None
    score = torch.stack(scores, 1)  # [B, L, Hkv]
    theta = float(score.flatten().median())
    node = hybrid_node(tokens=16, theta=theta, scope="global", rounding="floor")
    pipe = Pipeline.from_config(node)
    for ctx in ctxs:
        pipe.observe(ctx)
    got = torch.zeros(2, L, 2, dtype=torch.long)
    for ctx in ctxs:
        selection, report = pipe.compress(ctx)
        store = selection.offloaded
        fetched = store.retrieval_counts()[0] if store is not None else torch.zeros_like(report.kept)
        got[:, ctx.layer_idx] = report.kept + fetched
    for b in range(2):
        static = (score[b] >= theta).flatten()
        assert 0 < int(static.sum()) < L * 2  # both types in the pool
        want = naive_hybridkv_floor_budgets(score[b].flatten().tolist(), static.tolist(), 16, lengths[b],
                                            WINDOW, 0.75, 0.1)  # fmt: skip
        assert got[b].flatten().tolist() == want


def test_pool_keeps_its_total_when_a_static_head_is_raised_to_its_protected_tokens():
    """A low-S static head is raised to the window: the other static heads give the difference back."""
    from kvlab.compression.hybridkv import allocate_pool

    static = torch.tensor([True, True, True, False])
    out = allocate_pool(torch.tensor([1.0, 0.05, 0.05, 0.3]), static, 40, 1000, 32)
    assert int(out.sum()) == 4 * 40 and bool((out >= 32).all())
    out = allocate_pool(torch.tensor([1.0, 0.05, 0.05, 0.3]), static, 40, 1000, 32, min_dynamic=100)
    assert int(out.sum()) == 4 * 40 and out.tolist() == [32, 32, 32, 64]  # min_dynamic only where it fits


def test_global_pool_on_a_model_with_sliding_window_layers():
    """Sliding layers keep their window and are not pooled; the full-attention layers share the pool."""
    from support.attention_variants import build, prompts, tokenizer

    import kvlab
    from kvlab.engine.generation import generate
    from kvlab.models.prompts import collate_ids

    loaded = kvlab.wrap_model(build("gemma3-text"), tokenizer(), name="gemma3-text")
    batch = collate_ids(loaded, prompts())
    node = kvlab.compression_config("hybridkv", budget={"ratio": 0.5, "window": 1, "sinks": 0})
    result = generate(loaded, Pipeline.from_config(node), batch, RunOptions(max_new_tokens=2))
    kinds = loaded.model.config.layer_types
    full = [layer for layer, kind in enumerate(kinds) if kind == "full_attention"]
    assert full and len(full) < len(kinds)
    pooled = torch.stack([result.reports[layer].budget for layer in full])  # [L_full, B]
    assert bool((pooled < result.prompt_lengths).all())
