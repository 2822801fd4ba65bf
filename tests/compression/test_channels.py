"""Channel pruners (``model.compression.channels``) against the naive reference of ThinK's criterion.

ThinK keeps, per (sample, KV head), the ``ceil(keep * D)`` channels of largest
``||Q_w[:, i] K[:, i]^T||_F`` over the window's queries of the head's group and the kept keys
(``naive/think.py``); ``key_magnitude`` drops the query factor. kvpress's ``ThinKPress`` ranks by
the group mean of the window queries' mean squares times the keys' mean square, a monotone
function of the same product, and prunes ``int(D * ratio)``: the same channels. A padded batch
picks each sample's channels alone; the configs the pruned layout cannot serve are refused,
naming the field.
"""

import pytest
import torch
from naive.context import LENGTHS, make_ctx, sample_ctx
from naive.think import naive_channel_scores, naive_kept_channels
from support.kvpress_cases import CASES, kvlab_prefill_channels, kvlab_prefill_kept, recorded

from kvlab.cache.selection import Selection
from kvlab.compression.channels import CHANNEL_PRUNERS
from kvlab.compression.selectors import topk_indices
from kvlab.config.errors import ConfigError
from kvlab.engine.protocols import build_protocol
from kvlab.pipeline import Pipeline

D, HEADS, KV_HEADS, WINDOW = 16, 4, 2, 5
SNAPKV = {"budget": {"tokens": 12, "window": 4}, "importance": {"attention": {"name": "window_attention"}}}


def context_and_selection(seed: int = 0):
    """A random left-padded layer and a ragged selection of its valid positions."""
    ctx = make_ctx(LENGTHS, heads=HEADS, kv_heads=KV_HEADS, dim=D, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    scores = torch.rand(len(LENGTHS), KV_HEADS, ctx.seq_len, generator=g)
    scores = scores.masked_fill(~ctx.valid[:, None, :], float("-inf"))
    counts = torch.tensor([[9, 3], [14, 20]])
    return ctx, Selection(topk_indices(scores, counts), counts)


def naive_channels(ctx, selection, keep: float, window: int | list[int] | None) -> list[list[list[int]]]:
    """Each (sample, KV head)'s kept channels from Python lists (``window``: one for every sample,
    or each sample's own; None: no queries)."""
    G, T = HEADS // KV_HEADS, ctx.seq_len
    out = []
    for b in range(len(LENGTHS)):
        own = window[b] if isinstance(window, list) else window
        first = max(T - own, T - LENGTHS[b]) if own is not None else None
        row = []
        for h in range(KV_HEADS):
            keys = [ctx.keys[b, h, p].double().tolist() for p in selection.kept_positions(b, h)]
            queries = None
            if own is not None:
                queries = [
                    ctx.queries[b, h * G + g, t].double().tolist() for g in range(G) for t in range(first, T)
                ]
            row.append(naive_kept_channels(naive_channel_scores(queries, keys), keep))
        out.append(row)
    return out


@pytest.mark.parametrize("keep", [0.5, 0.25, 0.8])
def test_think_keeps_the_channels_of_the_papers_criterion(keep):
    ctx, selection = context_and_selection()
    think = CHANNEL_PRUNERS.build({"name": "think", "keep": keep, "window": WINDOW})
    channels = think.channels(ctx, selection)
    assert channels.shape == (2, KV_HEADS, think.kept_channels(D)) and channels.dtype == torch.long
    assert channels.tolist() == naive_channels(ctx, selection, keep, WINDOW)


def test_inside_a_pipeline_each_sample_observes_its_own_budget_window():
    """A ratio window gives each sample its own count (``ctx.window``, set by the pipeline)."""
    ctx, selection = context_and_selection(seed=2)
    ctx.window = torch.tensor([3, 7])
    think = CHANNEL_PRUNERS.build({"name": "think", "keep": 0.5})
    assert think.channels(ctx, selection).tolist() == naive_channels(ctx, selection, 0.5, [3, 7])


def test_key_magnitude_keeps_the_largest_key_channels():
    ctx, selection = context_and_selection(seed=3)
    pruner = CHANNEL_PRUNERS.build({"name": "key_magnitude", "keep": 0.5})
    assert pruner.channels(ctx, selection).tolist() == naive_channels(ctx, selection, 0.5, None)


def test_the_query_factor_changes_the_channels():
    """ThinK is not the keys' magnitude: queries concentrated on a few channels pull those in."""
    ctx, selection = context_and_selection(seed=4)
    ctx.queries[..., :4] *= 50.0  # the window's queries live on channels 0..3
    ctx.keys[..., :4] *= 0.05  # where the keys are small
    think = CHANNEL_PRUNERS.build({"name": "think", "keep": 0.5, "window": WINDOW}).channels(ctx, selection)
    magnitude = CHANNEL_PRUNERS.build({"name": "key_magnitude", "keep": 0.5}).channels(ctx, selection)
    assert bool((think[..., :4] == torch.arange(4)).all())  # ThinK keeps them
    assert not bool((magnitude[..., :4] == torch.arange(4)).any())  # the magnitude drops them


def test_kvpress_mean_of_squares_ranks_the_same_channels():
    """kvpress's ThinKPress: mean over the window of q^2, averaged over the group, times the mean of
    k^2 over the keys; the lowest ``int(D * ratio)`` pruned (``ratio = 1 - keep``)."""
    ctx = make_ctx([30, 30], heads=HEADS, kv_heads=KV_HEADS, dim=D, seed=7)
    counts = torch.full((2, KV_HEADS), 30)
    selection = Selection(torch.arange(30).expand(2, KV_HEADS, 30), counts)
    for keep in (0.5, 0.75, 0.3):
        queries = ctx.queries[:, :, -WINDOW:].double()
        query_term = queries.pow(2).mean(2).view(2, KV_HEADS, HEADS // KV_HEADS, D).mean(2)
        scores = query_term * ctx.keys.double().pow(2).mean(2)
        pruned = scores.topk(int(D * (1 - keep)), dim=-1, largest=False).indices
        kept = torch.ones(2, KV_HEADS, D, dtype=torch.bool).scatter_(-1, pruned, False)
        think = CHANNEL_PRUNERS.build({"name": "think", "keep": keep, "window": WINDOW})
        channels = think.channels(ctx, selection)
        assert channels.shape[-1] == D - int(D * (1 - keep))
        assert torch.equal(torch.zeros_like(kept).scatter_(-1, channels, True), kept)


def test_a_padded_batch_picks_each_samples_channels_alone():
    ctx, selection = context_and_selection(seed=5)
    think = CHANNEL_PRUNERS.build({"name": "think", "keep": 0.5, "window": 30})  # longer than sample 1
    batched = think.channels(ctx, selection)
    for b, n in enumerate(LENGTHS):
        offset = ctx.seq_len - n
        count = selection.counts[b : b + 1]
        alone = Selection((selection.indices[b : b + 1] - offset).clamp(min=0), count)
        assert torch.equal(think.channels(sample_ctx(ctx, b), alone), batched[b : b + 1])


@pytest.mark.parametrize(
    ("keep", "dim", "kept"), [(0.5, 64, 32), (0.3, 10, 3), (0.7, 10, 7), (1.0, 8, 8), (0.01, 8, 1)]
)
def test_kept_channels_round_up(keep, dim, kept):
    assert CHANNEL_PRUNERS.build({"name": "key_magnitude", "keep": keep}).kept_channels(dim) == kept


def test_the_window_comes_from_the_budget():
    pipeline = Pipeline.from_config({**SNAPKV, "channels": {"name": "think"}})
    assert pipeline.channel_pruner.window == 4
    with pytest.raises(ConfigError, match="channels.window = 8 differs from model.compression.budget.window"):
        Pipeline.from_config({**SNAPKV, "channels": {"name": "think", "window": 8}})
    with pytest.raises(ConfigError, match=r"channels \(think\) observes .* there is no budget"):
        Pipeline.from_config({"channels": {"name": "think"}})
    full = Pipeline.from_config({"channels": {"name": "think", "window": 8}})  # ThinK alone: every entry kept
    assert full.channel_pruner.window == 8 and not full.compresses


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"quantize": {"name": "kivi"}}, "do not compose yet"),
        ({"decode": {"name": "h2o"}}, "decode = h2o"),
        ({"select": {"name": "retrieve"}}, "outside the cache"),
        ({"prefill": {"name": "progressive", "chunk": 16}}, "progressive"),
        ({"channels": {"name": "think", "keep": 0}}, "keep is the share"),
        ({"channels": {"name": "think", "keep": 1.5}}, "keep is the share"),
    ],
)
def test_what_the_pruned_layout_cannot_serve_is_refused_naming_the_field(extra, match):
    node = {**SNAPKV, "channels": {"name": "think"}, **extra}
    with pytest.raises(ConfigError, match=match):
        Pipeline.from_config(node)


def test_a_route_branch_cannot_set_channels_and_decode_time_refuses_them():
    rule = {"name": "latch", "metric": {"name": "ncar"}, "before": "a", "after": "b"}
    with pytest.raises(ConfigError, match="channels"):
        Pipeline.from_config(
            {**SNAPKV, "route": {"rule": rule, "branches": {"a": {"channels": {"name": "think"}}, "b": {}}}}
        )
    routed = Pipeline.from_config(
        {**SNAPKV, "channels": {"name": "think"}, "route": {"rule": rule, "branches": {"a": {}, "b": {}}}}
    )
    assert routed.channel_pruner is not None
    pipeline = Pipeline.from_config({**SNAPKV, "channels": {"name": "think"}})
    with pytest.raises(ConfigError, match="model.compression.channels"):
        build_protocol({"name": "decode_time", "target_size": 16}).check(pipeline)


@pytest.mark.parametrize("name", ["think", "think_snapkv"])
def test_kvlab_keeps_the_positions_and_channels_kvpress_keeps(name):
    """kvpress's ThinKPress, alone and after SnapKVPress (``tests/fixtures/kvpress/kept.json``): the
    same positions and, per layer and KV head, the same kept key channels on tiny-qwen2 (GQA)."""
    case, record = CASES[name], recorded()["cases"][name]
    assert kvlab_prefill_kept(case) == record["kept"]
    assert kvlab_prefill_channels(case) == record["channels"]
