"""CriticalKV against the formula (``naive.criticalkv``, ``naive.attention``: loops in fp64): the
projected value norm, the product mix, and the preset's two stages on AdaKV's head budgets; against
what kvpress 0.5.5's ``CriticalKVPress`` and ``CriticalAdaKVPress`` keep."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from naive.attention import naive_window_scores
from naive.budgets import naive_two_stage_keep
from naive.context import assert_scores, make_ctx, sample_lists
from naive.criticalkv import projected_value_norm, second_stage_scores
from support import kvpress_cases

from kvlab.compression.criticalkv import ProjectedValueNorm
from kvlab.compression.mixers import ProductMixer
from kvlab.config.errors import ConfigError
from kvlab.config.loader import merge, resolve
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


def test_criticalkv_keeps_what_kvpress_keeps():
    """kvpress 0.5.5's CriticalKVPress around SnapKVPress (window 8, kernel 5) hooked on tiny-qwen2,
    27 of 55 per head (tests/fixtures/kvpress/), keeps what kvlab's criticalkv preset on uniform
    head budgets keeps, every layer and head, when both stage ones take as many by attention:
    kvpress's ``int(0.5 * 27.5) = 13`` hold SnapKV's window of 8 (scored ``max + 1``), so 5 by
    attention; kvlab's ``floor(share * 19)`` beyond the window is 5 at ``share: 0.3``."""
    want = kvpress_cases.recorded()["cases"]["criticalkv"]["kept"]
    assert kvpress_cases.kvlab_prefill_kept(kvpress_cases.CASES["criticalkv"]) == want


@pytest.mark.parametrize("case", ["criticalkv_ada", "criticalkv_ada_llama"])
def test_criticalkv_ada_keeps_what_kvpress_keeps_at_its_stage_one_count(case):
    """kvpress 0.5.5's CriticalAdaKVPress around SnapKVPress (window 8) hooked on tiny-qwen2 and
    tiny-llama (tests/fixtures/kvpress/) against the criticalkv preset with that window.

    - Head budgets: the same count in every layer and head. kvpress's safeguard
      (``int(0.2 n_kept)`` = 5 or 6) falls on the window, scored ``max + 1``; kvlab's guarantee
      beyond the window (``floor(0.2 (n_kept - 8))`` = 3 or 4) is below every head's share of the
      global top here, so both are AdaKV's global top of the attention.
    - Stage one: kvpress keeps ``int(0.5 b_j)`` of a head's budget ``b_j`` with the window inside,
      ``int(0.5 b_j) - 8`` by attention; kvlab ``floor(share f_j)`` of the ``f_j = b_j - 8`` beyond
      the window (``docs/methods/criticalkv.md``). Given, head by head, the share at which the two
      counts agree, kvlab keeps kvpress's positions in every layer and head.
    - At the preset's share 0.5 kvlab's stage one keeps 4 more by attention, and the kept sets
      overlap with Jaccard >= 0.70 (measured 0.704 on tiny-qwen2, 0.758 on tiny-llama)."""
    spec = kvpress_cases.CASES[case]
    want = kvpress_cases.recorded()["cases"][case]["kept"]
    window = spec.kvlab["budget"]["window"]
    preset = kvpress_cases.kvlab_prefill_kept(spec)
    assert [[len(h) for h in layer] for layer in preset] == [[len(h) for h in layer] for layer in want]
    heads = zip(itertools.chain(*preset), itertools.chain(*want), strict=True)
    overlap = [kvpress_cases.jaccard(mine, theirs) for mine, theirs in heads]
    assert min(overlap) >= 0.70 and min(overlap) < 1
    shares = {}  # (layer, head) -> the share whose stage one keeps kvpress's count by attention
    for layer, heads in enumerate(want):
        for head, kept in enumerate(heads):
            first = int(0.5 * len(kept)) - window
            assert first >= 0  # kvpress's stage one holds the whole window
            shares[layer, head] = (first + 0.5) / (len(kept) - window)
    node = kvpress_cases.compression_node(spec)
    for share in set(shares.values()):
        got = kvpress_cases.kvlab_prefill_kept(spec, merge(node, {"select": {"share": share}}))
        for layer, head in (key for key, value in shares.items() if value == share):
            assert got[layer][head] == want[layer][head], (layer, head, share)
