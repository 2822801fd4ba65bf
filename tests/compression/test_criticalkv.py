"""CriticalKV against the formula (``naive.criticalkv``, ``naive.attention``: loops in fp64): the
projected value norm, the product mix, and the preset's two stages on AdaKV's head budgets."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from naive.attention import naive_window_scores
from naive.budgets import naive_two_stage_keep
from naive.context import assert_scores, make_ctx, sample_lists
from naive.criticalkv import projected_value_norm, second_stage_scores

from kvlab.compression.criticalkv import ProjectedValueNorm
from kvlab.compression.mixers import ProductMixer
from kvlab.config.errors import ConfigError
from kvlab.config.loader import resolve
from kvlab.models.facts import LayerFacts, Projections
from kvlab.pipeline import Pipeline

LENGTHS = [23, 15]
HEADS, KV_HEADS, DIM, HIDDEN = 4, 2, 8, 6


def with_projections(ctx, seed: int = 0):
    """``ctx`` with random q/k/v/o projection weights among its facts; returns it and ``W_o`` as lists."""
    gen = torch.Generator().manual_seed(seed)
    o = torch.randn(HIDDEN, HEADS * DIM, generator=gen)
    q = torch.randn(HEADS * DIM, HIDDEN, generator=gen)
    kv = torch.randn(KV_HEADS * DIM, HIDDEN, generator=gen)
    facts = LayerFacts(provided=("projections",), weights=Projections(q=q, k=kv, v=kv, o=o))
    return dataclasses.replace(ctx, facts=facts), o.double().tolist()


@pytest.mark.parametrize("p", [1, 2])
def test_projected_value_norm_matches_the_formula(p):
    ctx, w_o = with_projections(make_ctx(LENGTHS, HEADS, KV_HEADS, DIM, seed=3))
    got = ProjectedValueNorm(norm=p).score(ctx)
    assert got.shape == (2, KV_HEADS, max(LENGTHS)) and got.dtype == torch.float32
    for b in range(2):
        _, off, _, _, v = sample_lists(ctx, b)
        assert_scores(got[b, :, off:], projected_value_norm(v, w_o, HEADS, p), atol=1e-4)


def test_the_projection_is_not_the_value_norm():
    """W_o reorders entries: the projected norm ranks differently from ||v|| (the fact is read)."""
    ctx, _ = with_projections(make_ctx(LENGTHS, HEADS, KV_HEADS, DIM, seed=4))
    projected = ProjectedValueNorm().score(ctx)[0, 0]
    plain = ctx.values[0, 0].float().norm(dim=-1)
    assert not torch.equal(projected.argsort(), plain.argsort())
    with pytest.raises(ConfigError, match="projections"):  # undeclared in a context without the fact
        ProjectedValueNorm().score(make_ctx(LENGTHS, HEADS, KV_HEADS, DIM, seed=4))
    with pytest.raises(ValueError, match="norm"):
        ProjectedValueNorm(norm=3)


def test_product_mixer_adds_each_offset_then_multiplies():
    ctx = make_ctx(LENGTHS, seed=5)
    a, p = torch.rand(2, 2, 23), torch.rand(2, 2, 23)
    mixed = ProductMixer(offsets={"attention": 0.25}).mix({"attention": a, "projected": p}, ctx)
    torch.testing.assert_close(mixed, (a + 0.25) * p)
    assert torch.equal(ProductMixer().mix({"attention": a}, ctx), a)
    with pytest.raises(ConfigError, match="offsets names 'atention'"):
        ProductMixer(offsets={"atention": 1.0}).check_roles(["attention"], [], "model.compression.mixer")


@pytest.mark.parametrize("budget", [9, 14])
def test_the_preset_keeps_the_two_stages_of_the_paper(budget):
    """Each head: the window, then floor(f / 2) by SnapKV's attention A_t, then the rest by
    (A_t + 1e-4) ||W_o^h v_t||_1, f the head's AdaKV count beyond the window."""
    window = 4
    node = resolve(["criticalkv"], [])["model"]["compression"]
    node["budget"] = {"tokens": budget, "window": window}
    ctx, w_o = with_projections(make_ctx(LENGTHS, HEADS, KV_HEADS, DIM, seed=6, scale=2.0), seed=1)
    selection, report = Pipeline.from_config(node).compress(ctx)
    assert torch.equal((report.kept - window).sum(-1), torch.full((2,), KV_HEADS * (budget - window)))
    stages_mattered = []
    for b, h in itertools.product(range(2), range(KV_HEADS)):
        n, off, q, k, v = sample_lists(ctx, b)
        attention = naive_window_scores(
            q, k, ctx.scaling, window, 5, "avg", "mean", "mean", "group_then_pool"
        )[h]
        final = second_stage_scores(attention, projected_value_norm(v, w_o, HEADS)[h], 1e-4)
        count = int(report.kept[b, h])
        fixed = list(range(n - window, n))
        want = naive_two_stage_keep(attention, final, fixed, count, 0.5)
        assert [p - off for p in selection.kept_positions(b, h)] == want, (b, h)
        stages_mattered.append(want != naive_two_stage_keep(attention, final, fixed, count, 0.0))
    assert any(stages_mattered)
