"""Modality allocators (LOOK-M's text prior, DAVID's decoupled budgets) against naive loops, and
the LOOK-M presets end to end on the tiny vision-language models."""

import pytest
import torch
from naive.attention import naive_cumulative
from naive.budgets import naive_rank
from naive.context import make_ctx, sample_lists
from support import e2e
from support.e2e import kvlab_model
from support.modality import WINDOW, mixed_samples, with_modality

from kvlab.config.loader import resolve
from kvlab.pipeline import Pipeline

LOOKM = ["lookm", "lookm_avg", "lookm_pivot", "lookm_weighted", "lookm_h2o"]
DAVID = ["david", "david_h2o", "david_mixkv"]
VLMS = ["tiny-qwen2-vl", "tiny-llava"]


def naive_modality_keep(scores, modality, n, budget, window, allocator):
    """One head's kept positions (sample coordinates) by LOOK-M Eq. 5-8 / DAVID Eq. 4-5, sorting lists."""
    if budget >= n:
        return list(range(n))
    win = list(range(n - window, n))
    free = budget - window
    text = [j for j in range(n - window) if modality[j] == 0]
    vision = [j for j in range(n - window) if modality[j] > 0]

    def top(cands, k):
        return naive_rank([scores[j] if j in cands else float("-inf") for j in range(n)], k) if k else []

    if allocator["name"] == "text_prior":
        strict = allocator.get("overflow") == "strict"
        q_text = min(len(text), free) if strict else len(text)
        q_vision = min(len(vision), max(0, free - q_text))
    else:
        rho = allocator.get("rho", 2.0)
        want_v = int(rho * free / (1 + rho) + 1e-9)
        want_t = free - want_v
        q_vision, q_text = min(want_v, len(vision)), min(want_t, len(text))
        q_vision = min(len(vision), q_vision + want_t - q_text)
        q_text = min(len(text), free - q_vision)
    return sorted(top(text, q_text) + top(vision, q_vision) + win)


@pytest.mark.parametrize(
    "allocator",
    [
        {"name": "text_prior"},
        {"name": "text_prior", "overflow": "strict"},
        {"name": "decoupled", "rho": 2.0},
        {"name": "decoupled", "rho": 0.5},
    ],
    ids=["keep_all_text", "strict", "decoupled_rho2", "decoupled_rho05"],
)
@pytest.mark.parametrize("budget", [10, 16, 30])
def test_modality_allocator_matches_naive_rules(allocator, budget):
    ctx = with_modality([29, 20])
    pipe = Pipeline.from_config(
        {
            "budget": {"tokens": budget, "window": WINDOW},
            "importance": {"attention": {"name": "cumulative_attention", "gqa": "sum"}},
            "allocate": {"modality": allocator},
        }
    )
    selection, _ = pipe.compress(ctx)
    T = ctx.seq_len
    for b in range(ctx.batch_size):
        n, off, q, k, _ = sample_lists(ctx, b)
        scores = naive_cumulative(q, k, ctx.scaling, gqa="sum")
        modality = ctx.modality[b, off:].tolist()
        for h in range(ctx.num_kv_heads):
            want = naive_modality_keep(scores[h], modality, n, budget, WINDOW, allocator)
            got = [p - off for p in selection.kept_positions(b, h)]
            assert got == want, (b, h)
    assert T == 29


@pytest.mark.parametrize("allocator", [{"name": "text_prior", "overflow": "strict"}, {"name": "decoupled"}])
def test_text_only_prompts_degrade_to_unimodal_topk(allocator):
    ctx = make_ctx([29, 20])  # modality 0 everywhere
    base = {
        "budget": {"tokens": 12, "window": WINDOW},
        "importance": {"attention": {"name": "cumulative_attention"}},
    }
    plain, _ = Pipeline.from_config(base).compress(ctx)
    aware, _ = Pipeline.from_config({**base, "allocate": {"modality": allocator}}).compress(ctx)
    assert torch.equal(plain.indices, aware.indices) and torch.equal(plain.counts, aware.counts)


def test_keep_all_text_reports_the_effective_kept_count():
    ctx = with_modality([29, 20])
    node = {
        "budget": {"tokens": 8, "window": WINDOW},
        "importance": {"attention": {"name": "cumulative_attention"}},
    }
    _, loose = Pipeline.from_config({**node, "allocate": {"modality": {"name": "text_prior"}}}).compress(ctx)
    _, hard = Pipeline.from_config(
        {**node, "allocate": {"modality": {"name": "text_prior", "overflow": "strict"}}}
    ).compress(ctx)
    protected = WINDOW
    text = [int(((ctx.modality[b] == 0) & ctx.valid[b]).sum()) for b in range(2)]
    text_outside = [t - int((ctx.modality[b, -WINDOW:] == 0).sum()) for b, t in enumerate(text)]
    for b in range(2):
        assert int(loose.kept[b, 0]) == max(8 - protected, text_outside[b]) + protected
    assert bool((hard.kept == 8).all())


# --- presets end to end ------------------------------------------------------------------------


def preset_pipeline(name, tokens, window=WINDOW):
    node = resolve([name], [])["model"]["compression"]
    sinks = node["budget"].get("sinks", 0)
    node["budget"] = {"tokens": tokens, "window": window, "sinks": sinks}  # the one source of the window
    for scorer in [*(node.get("importance") or {}).values(), *(node.get("diversity") or {}).values()]:
        if scorer and "window" in scorer:  # a restated window must equal budget.window
            scorer["window"] = window
    if "route" in node and "window" in node["route"]["rule"]["metric"]:
        node["route"]["rule"]["metric"]["window"] = window
    return Pipeline.from_config(node)


@pytest.mark.parametrize("model", VLMS)
@pytest.mark.parametrize("preset", LOOKM + DAVID)
def test_budget_at_least_the_prompt_is_identical_to_full(model, preset):
    loaded = kvlab_model(model)
    full = e2e.run(loaded, Pipeline.from_config(None), mixed_samples(), 4)
    big = e2e.run(loaded, preset_pipeline(preset, int(full.prompt_lengths.max())), mixed_samples(), 4)
    assert big.tokens == full.tokens
    assert torch.equal(big.step_logits, full.step_logits)
    assert torch.equal(big.kept, full.kept)


@pytest.mark.parametrize("model", VLMS)
@pytest.mark.parametrize("preset", ["lookm", "lookm_pivot", "david"])
def test_padded_batch_with_different_image_counts_equals_one_by_one(model, preset):
    loaded = kvlab_model(model)
    e2e.assert_batch_equals_alone(loaded, preset_pipeline(preset, 20), mixed_samples(), 4)


@pytest.mark.parametrize("model", VLMS)
@pytest.mark.parametrize("preset", ["lookm", "lookm_h2o"])
def test_text_prior_keeps_every_text_token_and_evicts_images_first(model, preset):
    loaded = kvlab_model(model)
    items = mixed_samples()
    batch = loaded.processor.collate(items)
    modality, valid = batch.modality, batch.attention_mask.bool()
    text = ((modality == 0) & valid).sum(-1)
    for tokens in (int(text.max()) + WINDOW, 12):  # budget >= text + window, and far below
        result = e2e.run(loaded, preset_pipeline(preset, tokens), items, 2)
        T = modality.shape[1]
        for report in result.reports:
            for b in range(len(items)):
                text_positions = set(torch.nonzero((modality[b] == 0) & valid[b]).flatten().tolist())
                outside_window = len(text_positions - set(range(T - WINDOW, T)))
                want = min(max(tokens - WINDOW, outside_window) + WINDOW, int(valid[b].sum()))
                for h in range(report.kept.shape[1]):
                    kept = set(report.selection.kept_positions(b, h))
                    assert text_positions <= kept
                    assert len(kept) == want
