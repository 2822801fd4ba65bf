"""VL-Cache: the post-vision token scores, the layers' densities and budgets against the paper's
formulas (``naive.vl_cache``: loops in fp64), and its schedule."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from naive.context import assert_scores, make_ctx, sample_lists
from naive.vl_cache import density, layer_budgets, post_vision_rows, post_vision_scores

from kvlab.compression.importance import IMPORTANCE
from kvlab.compression.vl_cache import layer_budgets as kvlab_layer_budgets
from kvlab.compression.vl_cache import post_vision_density
from kvlab.config.errors import ConfigError
from kvlab.pipeline import Pipeline

LENGTHS = [29, 21]
IMAGE = (3, 12)  # each sample's tokens 3 .. 11 are image tokens; the text after them is post-vision


def vlm_ctx(seed: int):
    ctx = make_ctx(LENGTHS, seed=seed)
    modality = ctx.modality.clone()
    for b, n in enumerate(LENGTHS):
        off = ctx.seq_len - n
        modality[b, off + IMAGE[0] : off + IMAGE[1]] = 1
    return dataclasses.replace(ctx, modality=modality)


def test_scores_and_density_match_the_formula():
    ctx = vlm_ctx(seed=2)
    scores = IMPORTANCE.build({"name": "post_vision_attention"}).score(ctx)
    dense = post_vision_density(ctx, 0.01)
    for b in range(2):
        _, off, q, k, _ = sample_lists(ctx, b)
        rows = post_vision_rows(q, k, ctx.scaling, IMAGE[1])
        assert_scores(scores[b, :, off:], post_vision_scores(rows, 2))
        assert float(dense[b]) == pytest.approx(density(rows, IMAGE[1], 0.01), abs=1e-9)
    for threshold in (0.05, 0.3):
        _, _, q, k, _ = sample_lists(ctx, 1)
        want = density(post_vision_rows(q, k, ctx.scaling, IMAGE[1]), IMAGE[1], threshold)
        assert float(post_vision_density(ctx, threshold)[1]) == pytest.approx(want, abs=1e-9)


@pytest.mark.parametrize(
    ("densities", "budget", "length", "protected"),
    [([0.2, 0.5, 0.3, 0.1], 20, 60, 4), ([0.9, 0.05, 0.05], 30, 40, 2), ([0.5, 0.5], 10, 50, 0)],
)
def test_layer_budgets_share_the_total_by_density(densities, budget, length, protected):
    want = layer_budgets(densities, budget, length, protected)
    got = kvlab_layer_budgets(
        torch.tensor(densities)[:, None],
        torch.tensor([budget]),
        torch.tensor([length]),
        torch.tensor([protected]),
    )[:, 0]
    assert int(got.sum()) == round(sum(want)) == len(densities) * budget  # the uniform total
    assert all(abs(int(g) - w) < 1 for g, w in zip(got, want, strict=True))  # floor or ceiling
    assert int(got.max()) <= length


def test_a_budget_covering_the_prompt_keeps_all():
    got = kvlab_layer_budgets(
        torch.tensor([[0.1], [0.9]]), torch.tensor([50]), torch.tensor([40]), torch.tensor([0])
    )
    assert got[:, 0].tolist() == [50, 50]


def test_vl_cache_needs_the_global_schedule():
    node = {
        "budget": {"tokens": 16, "window": 0},
        "importance": {"attention": {"name": "post_vision_attention"}},
        "allocate": {"layer": {"name": "vl_cache"}},
    }
    with pytest.raises(ConfigError, match="schedule"):
        Pipeline.from_config(node)
    Pipeline.from_config({**node, "schedule": "global"})


def test_the_global_schedule_keeps_the_uniform_total():
    node = {
        "schedule": "global",
        "budget": {"tokens": 12, "window": 0},
        "importance": {"attention": {"name": "post_vision_attention"}},
        "allocate": {"layer": {"name": "vl_cache"}},
    }
    pipeline = Pipeline.from_config(node)
    contexts = []
    run = None
    for layer in range(3):
        ctx = dataclasses.replace(vlm_ctx(seed=10 + layer), layer_idx=layer, num_layers=3)
        if run is not None:
            ctx = dataclasses.replace(ctx, run=run)
        run = ctx.run
        pipeline.observe(ctx)
        contexts.append(ctx)
    kept = torch.stack([pipeline.compress(ctx)[1].kept for ctx in contexts])  # [L, B, Hkv]
    assert kept.sum(0).tolist() == [[36, 36], [36, 36]]
    assert len(set(kept[:, 0, 0].tolist())) > 1  # the layers differ
